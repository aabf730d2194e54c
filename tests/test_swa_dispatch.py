"""The SWA class's device backend launches one program per steady serving call.

Every program the class can start is counted: every program of the device backends'
program caches (device.Programs.fn: the SWA programs of backends.device_swa, its
translate and segment-pages helpers, and the pad / slice programs they share). At bucket sizes,
alloc_extend, alloc_extend_swa_tail, alloc_decode (host or device last_loc), free_swa
(the window free), free, free_swa_segment and free_segment (device free_index) are one
launch each, and sizes within a bucket compile nothing new. Outputs are checked against
the host backend in lock step.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.sglang import swa as swa_cls
from jax_kvalloc.sglang.backends import device as dev_backend

PS = 4


@pytest.fixture
def count(monkeypatch):
  """A callable giving the launches so far (see the module docstring)."""
  n = [0]

  def counted(fn):
    def wrapper(*args, **kwargs):
      n[0] += 1
      return fn(*args, **kwargs)
    return wrapper

  orig_fn = dev_backend.Programs.fn
  monkeypatch.setattr(dev_backend.Programs, "fn",
                      lambda self, key: counted(orig_fn(self, key)))
  return lambda: n[0]


def _pair(need_sort=False):
  make = lambda backend: swa_cls.SWATokenToKVPoolAllocator(
      256 * PS, 128 * PS, PS, None, "cpu", None, need_sort, backend=backend, kernel="jnp",
      debug=False)
  return make("device"), make("host")


def _same(out, want):
  assert (out is None) == (want is None)
  if out is not None:
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("need_sort", [False, True])
def test_one_launch_per_steady_call(count, need_sort):
  a, h = _pair(need_sort)
  rng = np.random.default_rng(1)

  def both(name, *args, **kw):
    before = count()
    out = getattr(a, name)(*args, **kw)
    launched = count() - before
    _same(out, getattr(h, name)(*[np.asarray(x) if isinstance(x, jax.Array) else x
                                  for x in args], **kw))
    return out, launched

  for _ in range(2):  # the first round compiles; the second must be steady too
    # Prefill: 8 rows (a row bucket) of 8 tokens each (64: a token bucket).
    z, seq = np.zeros(8, np.int64), np.full(8, 2 * PS, np.int64)
    full, n = both("alloc_extend", z, z, seq, seq, jnp.full((8,), -1, jnp.int32), 64)
    assert n == 1, ("alloc_extend", n)
    rows = np.asarray(full).reshape(8, -1)
    # Decode: 8 rows, last_loc on the device, then from the host.
    seq = seq + 1
    out, n = both("alloc_decode", seq, seq, jnp.asarray(rows[:, -1]))
    assert n == 1, ("alloc_decode", n)
    seq = seq + 1
    out2, n = both("alloc_decode", seq, seq, np.asarray(out, np.int64))
    assert n == 1, ("alloc_decode host last_loc", n)
    # One request's tail extend: 64 tokens, SWA KV for the last 2 pages.
    one, tok = np.zeros(1, np.int64), np.array([64], np.int64)
    tail, n = both("alloc_extend_swa_tail", one, one, tok, tok, np.array([-1]), 64, 2 * PS)
    assert n == 1, ("alloc_extend_swa_tail", n)
    # One request of 64 tokens, all with SWA KV (last_loc from the host: a device one
    # of 1 row would be padded to its 8-row bucket by one more, tiny, launch).
    lone, n = both("alloc_extend", one, one, tok, tok, np.array([-1]), 64)
    assert n == 1, ("alloc_extend one row", n)
    # Window frees: the first page of rows 0-3 (free_swa: reads once), of rows 4-7
    # (free_swa_segment of host slots).
    out, n = both("free_swa", rows[:4, :PS].reshape(-1))
    assert n == 1, ("free_swa", n)
    out, n = both("free_swa_segment", rows[4:, :PS].reshape(-1), start_pos=0)
    assert n == 1, ("free_swa_segment", n)
    # Finishes: the lone request as a device segment, the tail request's head (full
    # only) and tail, then free of the 8 rows and their decode slots.
    out, n = both("free_segment", lone, start_pos=0)
    assert n == 1, ("free_segment device", n)
    t = np.asarray(tail, np.int64)
    out, n = both("free_full_segment", t[:64 - 2 * PS], start_pos=0)
    assert n == 1, ("free_full_segment", n)
    out, n = both("free_segment", t[64 - 2 * PS:], start_pos=64 - 2 * PS)
    assert n == 1, ("free_segment", n)
    rest = np.concatenate([rows.reshape(-1), np.asarray(out2), np.asarray(out2)])
    out, n = both("free", np.unique(rest))
    assert n == 1, ("free", n)
    assert (a.full_available_size(), a.swa_available_size()) == (
        h.full_available_size(), h.swa_available_size())
    assert (a.full_available_size(), a.swa_available_size()) == (a.size_full, a.size_swa)


def test_sizes_within_a_bucket_compile_nothing_new(count):
  # alloc_extend's rows and tokens pad to buckets; alloc_decode runs at its exact size
  # (a program per size up to 64 rows: one launch, no slice), so only extend is shared.
  del count
  a, h = _pair()
  ops = a._pools[0].backend.ops  # pylint: disable=protected-access

  def core_programs():
    return {k: f._cache_size() for k, f in ops._fns.items() if k[0] in ("extend",)}

  for bs in (8, 3):  # 8 first: the bucket's programs compile
    seq = np.full(bs, 2 * PS - 1, np.int64)
    z = np.zeros(bs, np.int64)
    full = a.alloc_extend(z, z, seq - 1, seq - 1, np.full(bs, -1), int((seq - 1).sum()))
    h.alloc_extend(z, z, seq - 1, seq - 1, np.full(bs, -1), int((seq - 1).sum()))
    last = np.asarray(full).reshape(bs, -1)[:, -1]
    _same(a.alloc_decode(seq, seq, last), h.alloc_decode(seq, seq, last))
    if bs == 8:
      warm = core_programs()
  assert core_programs() == warm


def test_warmup_compiles_every_serving_program():
  """The SWA class's warm-up (from the base class) compiles what a serving loop within
  its maxima runs: afterwards prefills, decodes, tail extends, window frees and finishes
  compile nothing."""
  a, h = _pair(need_sort=True)
  # exact_sizes: the output lengths below shorter than their token bucket (7, 14, 8).
  report = a.warmup(max_batch=2, max_tokens=64, max_free=64, exact_sizes=[7, 8, 14])
  assert report.programs > 0
  ops = a._pools[0].backend.ops  # pylint: disable=protected-access
  before = {k: f._cache_size() for k, f in ops._fns.items()}
  for bs in (2, 1):
    z, seq = np.zeros(bs, np.int64), np.full(bs, 2 * PS - 1, np.int64)
    full = a.alloc_extend(z, z, seq, seq, np.full(bs, -1), int(seq.sum()))
    h.alloc_extend(z, z, seq, seq, np.full(bs, -1), int(seq.sum()))
    last = np.asarray(full).reshape(bs, -1)[:, -1]
    _same(a.alloc_decode(seq + 1, seq + 1, last), h.alloc_decode(seq + 1, seq + 1, last))
    one = np.zeros(1, np.int64)
    tail = a.alloc_extend_swa_tail(one, one, np.array([8]), np.array([8]), np.array([-1]),
                                   8, PS)
    h.alloc_extend_swa_tail(one, one, np.array([8]), np.array([8]), np.array([-1]), 8, PS)
    rows = np.asarray(full).reshape(bs, -1)
    for x in (a, h):
      x.free_swa_segment(rows[:, :PS].reshape(-1), start_pos=0)
      x.free_full_segment(np.asarray(tail)[:PS], start_pos=0)
      x.free_segment(np.asarray(tail)[PS:], start_pos=PS)
      x.free(np.asarray(full))
  assert {k: f._cache_size() for k, f in ops._fns.items()} == before
  assert (a.full_available_size(), a.swa_available_size()) == (
      h.full_available_size(), h.swa_available_size())
