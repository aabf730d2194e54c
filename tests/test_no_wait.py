"""The device backend's class calls never wait on the device, and its host mirror of the
list lengths is exact.

Transfer guards do not fire for CPU arrays (the host copy is zero-copy), so on the CPU
`no_device_reads` makes every device-to-host path raise instead: a jax.Array's
__int__/__bool__/__index__/__float__/__array__/item/tolist/block_until_ready,
numpy.asarray/numpy.array of a jax.Array, jax.device_get and jax.block_until_ready. A
serving sequence of class calls (free groups, free_segment, free_page_ids, snapshots,
merges included) runs inside it, fed host data only (the slots to free
come from the model running in lock step); a negative control shows the guard trips. On a
GPU the same sequence runs under jax.transfer_guard_device_to_host("disallow") (marker
gpu; skipped without one).
"""
import contextlib

import jax
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import status as status_module
import jax.numpy as jnp
from jax_kvalloc.sglang import pool as pool_module
from jax_kvalloc.sglang import swa_peers
from landed import settle
from model import ModelAllocator
from model_step import ModelStep
from serving_driver import run_workload
from gpu import needs_gpu


ARRAY_TYPES = (type(jnp.zeros((1,))),)  # jax's ArrayImpl (its methods are patchable)
_READ_STATUS = lambda status, _asarray=np.asarray: _asarray(status)  # noqa: E731


class DeviceRead(AssertionError):
  """A device-to-host read inside `no_device_reads`."""


def _read_landed(x, _asarray=np.asarray):
  if not x.is_ready():
    raise DeviceRead("device read: an SWA record's array that has not landed (a wait)")
  return _asarray(x)


@contextlib.contextmanager
def no_device_reads():
  """Every device->host path of jax raises DeviceRead while this is open."""
  def refuse(what):
    def raiser(*args, **kwargs):
      raise DeviceRead(f"device read: {what}")
    return raiser

  mp = pytest.MonkeyPatch()
  try:
    for cls in ARRAY_TYPES:
      for name in ("__int__", "__bool__", "__index__", "__float__", "__array__", "item",
                   "tolist", "block_until_ready", "__dlpack__"):
        if hasattr(cls, name):
          mp.setattr(cls, name, refuse(f"jax.Array.{name}"), raising=False)
    for mod_name, fn_name in (("asarray", np.asarray), ("array", np.array)):
      def wrapped(x, *args, _fn=fn_name, _name=mod_name, **kwargs):
        if isinstance(x, jax.Array):
          raise DeviceRead(f"device read: numpy.{_name} of a jax.Array")
        return _fn(x, *args, **kwargs)
      mp.setattr(np, mod_name, wrapped)
    mp.setattr(jax, "device_get", refuse("jax.device_get"))
    mp.setattr(jax, "block_until_ready", refuse("jax.block_until_ready"))
    # The statuses of earlier calls (SPEC 14): read once landed, without a wait in a
    # steady loop (the classes count any wait in `status_waits`).
    mp.setattr(status_module, "read", _READ_STATUS)
    # The SWA record's queue (swa_peers) reads arrays that have landed: not a wait.
    mp.setattr(swa_peers, "read", _read_landed)
    yield
  finally:
    mp.undo()


def decode_all(a, m, slot_lists, put, outputs, speculative=False):
  """One decode token for every request, the class `a` and the model `m` in lock step;
  `put` turns last_loc into the class's input. Appends (class output, model output) to
  `outputs` and each new slot to its list; `speculative` rolls both back instead
  (backup_state / restore_state)."""
  seq = np.array([len(r) + 1 for r in slot_lists])
  last = np.array([r[-1] for r in slot_lists])
  snap = a.backup_state() if speculative else None
  msnap = m.backup_state() if speculative else None
  out = a.alloc_decode(seq, seq, put(last))
  want = m.alloc_decode(seq.tolist(), last.tolist())
  assert (out is None) == (want is None)
  if speculative:
    a.restore_state(snap)
    m.restore_state(msnap)
  elif want is not None:
    outputs.append((out, want))
    for r, s in zip(slot_lists, want):
      r.append(s)


def _serving_sequence(a, m, need_sort, outputs, device_last=False):
  """A serving loop's class calls on `a` (device backend) with host inputs only (or,
  with device_last, last_loc and the free_segment / free_page_ids arguments as device
  arrays, as SGLang passes them); `m` (the model)
  runs alongside to know which slots each request holds. Appends every device output
  to `outputs` (checked afterwards, outside the guard)."""
  put = (lambda x: jnp.asarray(np.asarray(x, np.int32))) if device_last else (
      lambda x: x)
  ps = a.page_size
  reqs = []
  rng = np.random.default_rng(0)
  for step in range(40):
    if step % 7 == 3 and reqs:  # finish two requests inside a free group
      a.free_group_begin()
      m.free_group_begin()
      for _ in range(min(2, len(reqs))):
        slots = reqs.pop(0)
        a.free(np.asarray(slots, np.int64))
        m.free(slots)
      if device_last and reqs:  # a page-id free of a device array, queued in the group
        slots = reqs.pop(0)
        a.free_segment(put(slots), start_pos=0)
        m.free_segment(slots, 0)
      a.free_group_end()
      m.free_group_end()
    elif step % 7 == 5 and reqs:  # finish one through SGLang 0.5.23's unsorted frees
      slots = reqs.pop(0)
      a.free_segment(put(np.asarray(slots, np.int64)), start_pos=0)
      m.free_segment(slots, 0)
      if reqs:
        pages = sorted({s // ps for s in reqs.pop(0)}, reverse=True)
        a.free_page_ids(put(np.asarray(pages, np.int64)))
        m.free_page_ids(pages)
    if step % 5 == 0:  # prefill new requests
      seq = rng.integers(1, 3 * ps + 2, 3)
      zeros = np.zeros(3, np.int64)
      last = np.full(3, -1, np.int64)
      out = a.alloc_extend(zeros, zeros, seq, seq, put(last), int(seq.sum()))
      want = m.alloc_extend([0] * 3, seq.tolist(), [-1] * 3)
      assert (out is None) == (want is None)
      if want is not None:
        outputs.append((out, want))
        starts = np.concatenate([[0], np.cumsum(seq)])
        reqs += [list(want[starts[i]:starts[i + 1]]) for i in range(3)]
    elif reqs:  # decode every live request
      decode_all(a, m, reqs, put, outputs, speculative=step % 4 == 1)
    raw = a.alloc(2 * ps)
    want = m.alloc(2 * ps)
    if want is not None:
      outputs.append((raw, want))
      a.free(np.asarray(want, np.int64))
      m.free(want)
    assert a.available_size() == m.available_size()
  if need_sort:
    a.merge_and_sort_free()
    m.merge_and_sort_free()


@pytest.mark.parametrize("need_sort,device_last", [(False, False), (True, False),
                                                   (False, True), (True, True)])
def test_device_class_calls_do_not_wait(need_sort, device_last):
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(48 * ps, ps, need_sort=need_sort, kernel="jnp",
                                     debug=False)
  m = ModelAllocator(48 * ps, ps, need_sort)
  warm = []
  _serving_sequence(a, m, need_sort, warm, device_last)  # compiles every program needed
  a.clear()
  m = ModelAllocator(48 * ps, ps, need_sort)
  outputs = []
  with no_device_reads():
    _serving_sequence(a, m, need_sort, outputs, device_last)
  assert outputs
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(a.free_pages, m.free_pages)
  np.testing.assert_array_equal(a.release_pages, m.release_pages)


def test_negative_control_trips_the_guard():
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="jnp", debug=False)
  out = a.alloc(8)
  checks = [lambda: np.asarray(out), lambda: np.array(out), lambda: int(out[0]),
            lambda: bool(out[0]), lambda: out.tolist(), lambda: out.item(),
            lambda: out.block_until_ready(), lambda: jax.device_get(out),
            lambda: jax.block_until_ready(out), lambda: a.free_pages,
            lambda: range(10)[out[0]]]
  with no_device_reads():
    for check in checks:
      with pytest.raises(DeviceRead):
        check()
  assert np.asarray(out).tolist() == list(range(4, 12))  # restored afterwards


def test_debug_mode_waits_and_says_so():
  # Debug mode reads the error record after every call: the guard must see it.
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="jnp", debug=True)
  a.alloc(8)
  with no_device_reads(), pytest.raises(DeviceRead):
    a.alloc(8)



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("need_sort,device_last", [(False, False), (True, False),
                                                   (False, True), (True, True)])
def test_device_class_calls_do_not_wait_on_gpu(need_sort, device_last):
  ps = 16
  a = kvs.PagedTokenToKVPoolAllocator(48 * ps, ps, need_sort=need_sort, device="cuda",
                                     debug=False)
  _serving_sequence(a, ModelAllocator(48 * ps, ps, need_sort), need_sort, [], device_last)
  a.clear()
  m = ModelAllocator(48 * ps, ps, need_sort)
  outputs = []
  with jax.transfer_guard_device_to_host("disallow"):
    _serving_sequence(a, m, need_sort, outputs, device_last)
    # Negative control, before anything is read: the guard is live (once an array has
    # been read, jax keeps its host copy and a second read transfers nothing).
    with pytest.raises(Exception):
      np.asarray(outputs[0][0])
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)


# -- the host mirror equals the device state after every operation ------------------------

class MirrorChecked:
  """Forwards to a class instance; after every method call asserts that the host mirror
  (available_size's source) equals the lengths in the device state."""

  def __init__(self, impl):
    self._impl = impl
    self.checks = 0

  def __getattr__(self, name):
    attr = getattr(self._impl, name)
    if not callable(attr):
      return attr

    def call(*args, **kwargs):
      result = attr(*args, **kwargs)
      a = self._impl
      st = a._pools[0].state  # pylint: disable=protected-access
      assert a._pools[0].lengths() == (int(st.free_len), int(st.release_len)), (
          f"after {name}: mirror {a._pools[0].lengths()} != state "
          f"{(int(st.free_len), int(st.release_len))}")
      self.checks += 1
      return result
    return call


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("kind,ps,num_pages", [("token", 1, 40), ("paged", 4, 24),
                                               ("paged", 16, 12)])
def test_host_mirror_is_exact_on_random_traces(kind, ps, num_pages, need_sort, backend):
  if kind == "token":
    impl = kvs.TokenToKVPoolAllocator(num_pages, need_sort=need_sort, debug=False,
                                     backend=backend)
  else:
    impl = kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                          debug=False, backend=backend)
  checked = MirrorChecked(impl)
  run_workload(checked, size=num_pages * ps, page_size=ps, need_sort=need_sort, kind=kind,
               steps=150, seed=3)
  assert checked.checks > 100


# -- with a model step queued before them, no class call waits (SPEC 14) ---------------------

class _Replay:
  """Host copies of a sequence's outputs: read in a first pass (`recording`), given back
  in a second pass of the same sequence from the same state, which reads nothing."""

  def __init__(self):
    self.recording = True
    self.host = {}

  def out(self, name, value):
    if self.recording:
      self.host[name] = np.asarray(value)
    return value


def _pool_calls(a, k, r, token):
  """A scheduler's per-step calls on a token or paged class (rank r), host inputs only."""
  ps, kw, h = a.page_size, dict(dp_rank=r), k.host
  keep = {}
  if token:
    calls = [
        ("alloc", lambda: k.out("x", a.alloc(5, **kw))),
        ("alloc", lambda: k.out("y", a.alloc(3, **kw))),
    ]
  else:
    z, seq, last = np.zeros(2, np.int64), np.array([5, 3]), np.full(2, -1)
    calls = [
        ("alloc_extend", lambda: k.out("x", a.alloc_extend(z, z, seq, seq, last, 8, **kw))),
        ("alloc_decode", lambda: k.out("d", a.alloc_decode(
            seq + 1, seq + 1, np.array([h["x"][4], h["x"][7]]), **kw))),
    ]
  first = (lambda: h["x"]) if token else (lambda: np.append(h["x"][:5], h["d"][0]))
  second = (lambda: h["y"]) if token else (lambda: np.append(h["x"][5:], h["d"][1]))
  calls += [
      ("available_size", lambda: a.available_size(**kw)),
      ("backup_state", lambda: keep.update(snap=a.backup_state())),
      ("alloc", lambda: a.alloc(2 * ps, **kw)),
      ("restore_state", lambda: a.restore_state(keep["snap"])),
      ("free_group_begin", a.free_group_begin),
      ("free", lambda: a.free(first(), **kw)),
      ("free_group_end", a.free_group_end),
      ("is_not_in_free_group", lambda: a.is_not_in_free_group),
      ("free_segment", lambda: a.free_segment(second(), start_pos=0, **kw)),
      ("alloc", lambda: k.out("b", a.alloc(2 * ps, **kw))),
      ("free_page_ids", lambda: a.free_page_ids(np.unique(h["b"] // ps)[::-1].copy(),
                                                **kw)),
      ("merge_and_sort_free", lambda: a.merge_and_sort_free(**kw)),
      ("debug_print", lambda: a.debug_print(**kw)),
      ("available_size", lambda: a.available_size(**kw)),
  ]
  return calls


def _swa_calls(a, k, r):
  """A scheduler's per-step calls on the SWA class (rank r, page size 4), host inputs
  only: `free` and `free_swa` of part of a page too, inside a free group and outside
  (their SWA counts from the host record, jax_kvalloc.sglang.swa_peers), and the
  segment frees."""
  kw, h = dict(dp_rank=r), k.host
  z, seq, last = np.zeros(2, np.int64), np.array([5, 3]), np.full(2, -1)
  keep = {}
  return [
      ("alloc_extend", lambda: k.out("f", a.alloc_extend(z, z, seq, seq, last, 8, **kw))),
      ("free_group_begin", a.free_group_begin),
      ("free_swa", lambda: a.free_swa(h["f"][1:2], **kw)),
      ("free", lambda: a.free(h["f"][:5], **kw)),
      ("free_group_end", a.free_group_end),
      ("free_swa", lambda: a.free_swa(h["f"][6:7], **kw)),
      ("swa_available_size", lambda: a.swa_available_size(**kw)),
      ("free", lambda: a.free(h["f"][5:], **kw)),
      ("alloc_extend", lambda: k.out("x", a.alloc_extend(z, z, seq, seq, last, 8, **kw))),
      ("alloc_decode", lambda: k.out("d", a.alloc_decode(
          seq + 1, seq + 1, np.array([h["x"][4], h["x"][7]]), **kw))),
      ("full_available_size", lambda: a.full_available_size(**kw)),
      ("swa_available_size", lambda: a.swa_available_size(**kw)),
      ("new_pages_available", lambda: a.new_pages_available(1, 1, **kw)),
      ("backup_state", lambda: keep.update(snap=a.backup_state())),
      ("alloc_extend", lambda: a.alloc_extend(z, z, seq, seq, last, 8, **kw)),
      ("restore_state", lambda: a.restore_state(keep["snap"])),
      ("free_group_begin", a.free_group_begin),
      ("free_segment", lambda: a.free_segment(np.append(h["x"][:5], h["d"][0]),
                                              start_pos=0, **kw)),
      ("free_group_end", a.free_group_end),
      ("free_swa_segment", lambda: a.free_swa_segment(np.append(h["x"][5:], h["d"][1]),
                                                      start_pos=0, **kw)),
      ("free_full_segment", lambda: a.free_full_segment(
          np.append(h["x"][5:], h["d"][1]), start_pos=0, **kw)),
      ("merge_and_sort_free", lambda: a.merge_and_sort_free(**kw)),
      ("debug_print", lambda: a.debug_print(**kw)),
      ("available_size", lambda: a.available_size(**kw)),
  ]


def _make_class(kind, backend, dp_size):
  common = dict(kernel="jnp", debug=False, backend=backend, dp_size=dp_size)
  if kind == "token":
    return kvs.TokenToKVPoolAllocator(64 * dp_size, need_sort=True, **common)
  if kind == "paged":
    return kvs.PagedTokenToKVPoolAllocator(64 * dp_size, 4, need_sort=True, **common)
  return kvs.SWATokenToKVPoolAllocator(64 * dp_size, 64 * dp_size, 4, need_sort=True,
                                       **common)


@pytest.mark.parametrize("kind,dp_size,backend", [
    ("paged", 1, "device"), ("token", 1, "device"), ("swa", 1, "device"),
    ("paged", 2, "device"), ("swa", 2, "device"), ("paged", 1, "host"),
    ("swa", 2, "host")])
def test_no_call_waits_with_a_model_step_queued(kind, dp_size, backend):
  # Every per-step call returns while a model step queued before it still runs (a call
  # that waited for the device could not). Statuses that have not landed are not waited
  # for until the 8th call (SPEC 14): so a step is queued for every 7 calls, and let
  # finish after them, with the programs queued behind it (on a busy CPU they may still
  # run when the next window's 8th call comes). Outputs are checked against a first,
  # unblocked pass.
  a = _make_class(kind, backend, dp_size)
  r = dp_size - 1
  k = _Replay()
  calls = (_swa_calls(a, k, r) if kind == "swa"
           else _pool_calls(a, k, r, token=kind == "token"))
  for _, call in calls:                 # the first pass: compiles, records the outputs
    call()
  first = (k.host, a.available_size(dp_rank=r))
  a.clear()
  k.recording = False
  window = pool_module.WITHIN_CALLS - 1
  for start in range(0, len(calls), window):
    step = ModelStep()
    try:
      assert step.running()
      for name, call in calls[start:start + window]:
        call()
        assert step.running(), f"{name} waited for the model step"
    finally:
      step.finish()
      for pool in a._pools:  # pylint: disable=protected-access
        if pool.backend.defers_status:
          jax.block_until_ready(pool.backend.running)
  assert settle(a, r) == first[1]
  assert a.status_waits == 0


def test_a_read_of_an_output_waits_for_the_model_step():
  # The negative control: the step is ahead of the allocator's programs on the device.
  a = _make_class("paged", "device", 1)
  np.asarray(a.alloc(8))                # compiled
  step = ModelStep()
  try:
    out = a.alloc(8)
    assert step.running()
    np.asarray(out)                     # waits for the step
    assert not step.running()
  finally:
    step.finish()


def test_an_swa_count_only_the_device_knows_waits_for_the_model_step():
  # The negative control of the SWA class's free_swa at page size 4: after a mapping set
  # by hand the host record cannot count the SWA pages it frees (swa_peers), so the
  # count is read, after the step. That read rebuilds the record: the next one reads
  # nothing.
  a = _make_class("swa", "device", 1)
  z, seq = np.zeros(1, np.int64), np.array([16])
  out = np.asarray(a.alloc_extend(z, z, seq, seq, np.array([-1]), 16))
  a.free_swa(out[:1])                   # compiled
  a.set_full_to_swa_mapping(out[4:5], a.translate_loc_from_full_to_swa(out[4:5]))
  step = ModelStep()
  try:
    assert step.running()
    a.free_swa(out[8:9])
    assert not step.running(), "free_swa after a mapping set by hand did not wait"
  finally:
    step.finish()
  with no_device_reads():
    a.free_swa(out[12:13])
  assert a.swa_available_size() == a.size_swa - 4
