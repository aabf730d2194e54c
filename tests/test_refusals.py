"""No refused call is reported as a success (SPEC 14's reporting contract, issue 31), and
the SWA class's review regressions: every case raises ValueError on every backend
(device: at the latest at the next call that returns a host value, and within 8 calls;
host and debug mode: at once), and leaves the pool as it was, its host mirror equal to
its state's lengths."""
import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc.sglang as kvs
from jax_kvalloc import state as st
from jax_kvalloc import swa_table
from jax_kvalloc import swa as core
from jax_kvalloc.sglang import pool as pool_module

PS = 4
BACKENDS = ["device", "host", "debug"]


def _make(cls, backend, *args, **kw):
  return cls(*args, backend="device" if backend == "debug" else backend, kernel="jnp",
             debug=backend == "debug", **kw)


def _paged(backend, **kw):
  return _make(kvs.PagedTokenToKVPoolAllocator, backend, 4 * PS, PS, **kw)


def _swa(backend, ps=PS, need_sort=False, device="cpu", **kw):
  return _make(kvs.SWATokenToKVPoolAllocator, backend, 16 * ps, 8 * ps, ps, None, device,
               None, need_sort, **kw)


def _contents(a, r=0):
  """Every list and the mapping of rank r's state, and whether its mirror is its
  state's lengths (read from the pool itself: the class refuses every call now)."""
  pool = a._pools[r]  # pylint: disable=protected-access
  state = jax.tree.map(np.asarray, pool.state)
  parts = (state.full, state.swa) if isinstance(state, core.SWAState) else (state,)
  lists = [x.tolist() for p in parts for x in (st.live_free_pages(p),
                                               st.live_release_pages(p))]
  if isinstance(state, core.SWAState):
    lists.append(state.mapping.tolist())
  assert pool.lengths() == pool.backend.lengths(pool.state), "mirror != state"
  return lists


def _extend(a, seq, pre=0, last=-1):
  return np.asarray(a.alloc_extend(np.array([pre]), None, np.array([seq]), None,
                                   np.array([last]), seq - pre))


# Each case: (allocator, setup(a) -> context, misuse(a, context), message, whether only
# the state shows it: then the device refuses it inside and a later call raises, and
# every call after raises until clear() / restore_state()).
def _bug1_paged(a, _):
  a.free_page_ids(jnp.array([0, 3]))  # device: taken as it is; page 0 is refused
  out = a.alloc(2 * PS)               # the mirror counted 2 pages: the device refuses
  assert out is None or not np.asarray(out).any(), "a refused allocation's slots are 0"


def _bug1_swa(a, out):
  a.free_segment(out, start_pos=0)     # page 1's SWA KV is gone: breaks the contract
  got = a.alloc_extend(np.array([0]), None, np.array([28]), None, np.array([-1]), 28)
  assert got is None or not np.asarray(got).any()


CASES = {
    # 1. a device array naming page 0: the mirror must not count it, nor hand out zeros.
    "free_page_ids_page_0": (
        _paged, lambda a: a.alloc(4 * PS), _bug1_paged, r"page_ids\[0\]=0", True),
    # 1. a segment free after a window free (SWA): no peer for its first page.
    "free_segment_after_window_free": (
        _swa, lambda a: (lambda o: (a.free_swa_segment(o[:PS], start_pos=0), o)[1])(
            _extend(a, 3 * PS)), _bug1_swa, r"free_index\[0\]=4 has no SWA peer", True),
    # 2. free_segment of a bad segment: the full pool's check before the SWA side frees.
    "free_segment_not_one_request": (
        _swa, lambda a: _extend(a, 2 * PS),
        lambda a, out: a.free_segment(np.array([4, 5, 6, 8]), start_pos=0),
        r"free_index\[3\]=8 lies in page 2", False),
    "free_segment_not_one_request_in_a_group": (
        _swa, lambda a: (_extend(a, 2 * PS), a.free_group_begin()),
        lambda a, _: a.free_segment(np.array([4, 5, 6, 8]), start_pos=0),
        r"free_index\[3\]=8 lies in page 2", False),
    # 3. page size 1: free of a slot whose SWA KV was freed (free_swa first).
    "token_free_without_peer": (
        lambda b: _swa(b, ps=1), lambda a: (a.alloc(3), a.free_swa(np.array([2]))),
        lambda a, _: a.free(np.array([2])), r"free_index\[0\]=2 has no SWA peer", True),
    # 4. alloc_extend / alloc_decode continuing a page whose SWA KV is gone.
    "extend_continues_a_page_without_peer": (
        _swa, lambda a: a.free_swa(_extend(a, 6)),
        lambda a, _: _extend(a, 8, pre=6, last=9), r"last_loc\[0\]=9 has no SWA peer",
        True),
    "decode_continues_a_page_without_peer": (
        _swa, lambda a: a.free_swa(_extend(a, 6)),
        lambda a, _: a.alloc_decode(np.array([7]), None, np.array([9])),
        r"last_loc\[0\]=9 has no SWA peer", True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_refusals_raise_and_change_nothing_on_every_backend(case, backend):
  make, setup, misuse, match, deferred = CASES[case]
  a = make(backend)
  context = setup(a)
  before = _contents(a)
  with pytest.raises(ValueError, match=match):
    misuse(a, context)
    a.available_size()  # the device's refusal raises here at the latest
  assert _contents(a) == before  # nothing changed, the mirror rolled back
  if backend == "device" and deferred:  # read later: every call raises until a clear
    with pytest.raises(ValueError, match=match):
      a.available_size()
  a.clear()
  assert a.available_size() == a.size


class _NeverReady:
  """A device status that never lands by itself (a slow device), for the 8-call rule."""

  def __init__(self, status):
    self.status = status

  def copy_to_host_async(self):
    pass

  def is_ready(self):
    return False

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.asarray(self.status, dtype)


@pytest.fixture
def slow_device(monkeypatch):
  record = pool_module.Pool.record
  monkeypatch.setattr(pool_module.Pool, "record", lambda self, op, status, call: record(
      self, op, None if status is None else _NeverReady(status), call))


def test_device_refusal_raises_within_8_calls(slow_device):
  del slow_device
  a = _paged("device")
  a.alloc(4 * PS)
  a.available_size()                             # reads the alloc's status: one wait
  assert a.status_waits == 1
  a.free_page_ids(jnp.array([0, 3]))             # call m: refused by the device
  for _ in range(7):                             # calls m+1 .. m+7 return no host value
    a.merge_and_sort_free()
  assert a.status_waits == 1
  with pytest.raises(ValueError, match=r"page_ids\[0\]=0"):
    a.merge_and_sort_free()                      # call m+8 waits for it, and raises
  assert a.status_waits == 2


def test_device_refusal_raises_at_the_next_host_value(slow_device):
  del slow_device
  a = _paged("device")
  a.alloc(4 * PS)
  a.free_page_ids(jnp.array([3, 0]))
  with pytest.raises(ValueError, match=r"page_ids\[1\]=0"):
    a.debug_print()                              # waits for both statuses
  assert a.status_waits == 2


def test_valid_calls_never_wait_for_a_status():
  a = _paged("device")
  out = a.alloc(2 * PS)
  for _ in range(20):
    a.free(np.asarray(out))
    out = a.alloc(2 * PS)
    jax.block_until_ready(out)  # the status of a finished call has landed
    a.available_size()
  assert a.status_waits == 0


def test_restore_state_takes_no_bad_snapshot_of_any_rank():
  # 5. Every rank's snapshot is checked before any is restored.
  a = _swa("host", dp_size=2)
  snap = a.backup_state()
  for r in (0, 1):
    _extend_rank(a, r)
  other = _swa("host", dp_size=2, need_sort=True).backup_state().ranks[1]
  with pytest.raises((TypeError, ValueError)):
    a.restore_state(snap._replace(ranks=(snap.ranks[0], other)))
  assert [a.available_size(dp_rank=r) for r in (0, 1)] == [4 * PS - 2 * PS] * 2
  with pytest.raises(TypeError):
    a.restore_state(_swa("host").backup_state())  # not a RankedSnapshot
  a.restore_state(snap)
  assert [a.available_size(dp_rank=r) for r in (0, 1)] == [4 * PS] * 2


def _extend_rank(a, r):
  return a.alloc_extend(np.array([0]), None, np.array([2 * PS]), None, np.array([-1]),
                        2 * PS, dp_rank=r)


def test_no_assert_in_the_classes():
  # 6. Under `python -O` asserts vanish with their side effects: the classes hold none.
  root = pathlib.Path(kvs.__file__).parent
  found = [f"{p.relative_to(root)}:{n.lineno}" for p in sorted(root.rglob("*.py"))
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Assert)]
  assert not found, found


@pytest.mark.parametrize("backend", ["host", "device"])
def test_swa_ranks_as_the_pool_classes(backend):
  # 7. Free groups over ranks, one device per rank, dp_rank checked as an int.
  a = _swa(backend, dp_size=2, device=jax.devices("cpu")[:2])  # conftest: 4 devices
  assert a.is_not_in_free_group
  out = _extend_rank(a, 1)
  a.free_group_begin()
  assert not a.is_not_in_free_group
  a.free(np.asarray(out), dp_rank=1)
  assert a.available_size(dp_rank=1) == 4 * PS - 2 * PS  # queued
  a.free_group_end()
  assert a.available_size(dp_rank=1) == 4 * PS
  with pytest.raises(TypeError, match="dp_rank must be an int"):
    a.available_size(dp_rank=True)
  with pytest.raises(ValueError, match="dp_rank=2 is out of range"):
    a.alloc_extend(np.array([0]), None, np.array([4]), None, np.array([-1]), 4,
                   dp_rank=2)


def test_swa_table_attention_inputs_count_only_rows_of_the_table():
  # 8. Rows outside the table are padding, as request_table's attention_inputs has them.
  cfg = core.SWAConfig(64, 32, 4, False, kernel="jnp", debug=False)
  table = swa_table.init_table(cfg, 2, 4)
  state = core.init(cfg)
  att = jax.jit(lambda s, t, rows: swa_table.attention_inputs(
      cfg, s, t, rows, jnp.ones((4,), jnp.int32), 8, num_rows=4))(
          state, table, jnp.array([0, 5, 1, -1]))
  np.testing.assert_array_equal(att.kv_lens, [0, 0, 0, 0])
  np.testing.assert_array_equal(att.num_seqs, [2])


def test_step_rows_extend_needs_max_tokens():
  # 9. Named at trace time, not a gather TypeError inside XLA.
  import jax_kvalloc as kv  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import request_table as rt  # pylint: disable=g-import-not-at-top
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel="jnp", debug=False)
  with pytest.raises(ValueError, match="max_tokens must be given with extend"):
    rt.step_rows(cfg, kv.init(cfg), rt.init_table(cfg, 2, 4), extend=jnp.array([0]),
                 n=jnp.array([3]))
