"""No refused call is reported as a success (SPEC 14's reporting contract, issue 31),
the SWA class's review regressions, and the ownership record's misuse cases (SPEC 14,
issue 32) on the paged, token and SWA classes: every case raises ValueError on every
backend (device: at the first call after its status has landed, and within 8 calls;
host and debug mode: at once), naming the operation and the page; leaves the
pool as it was (lists, mapping, its ownership record equal to its lists, its host mirror
equal to its state's lengths); and a refusal is sticky: every call raises until
`restore_state` or `clear()`."""
import ast
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc.sglang as kvs
from jax_kvalloc import debug
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import swa_table
from jax_kvalloc import swa as core
from jax_kvalloc.sglang import pool as pool_module
from jax_kvalloc.sglang.backends import device as device_module
from jax_kvalloc.sglang.backends import status as status_module
from jax_kvalloc.sglang.swa import SWADebugError
from jax_kvalloc.sglang.swa_peers import PeerRecord
from gpu import needs_gpu
from landed import settle

PS = 4
BACKENDS = ["device", "host", "debug"]
ALL = tuple(BACKENDS)
KERNEL, DEVICE = "jnp", "cpu"  # the GPU test runs the cases on its device and kernels


def _make(cls, backend, *args, **kw):
  return cls(*args, backend="device" if backend == "debug" else backend, kernel=KERNEL,
             debug=backend == "debug", **kw)


def _paged(backend, **kw):
  return _make(kvs.PagedTokenToKVPoolAllocator, backend, 4 * PS, PS, **kw)


def _token(backend, **kw):
  return _make(kvs.TokenToKVPoolAllocator, backend, 16, **kw)


def _swa(backend, ps=PS, need_sort=False, device=None, **kw):
  return _make(kvs.SWATokenToKVPoolAllocator, backend, 16 * ps, 8 * ps, ps, None,
               device or DEVICE, None, need_sort, **kw)


def _contents(a, r=0):
  """Every list and the mapping of rank r's state, and whether its mirror is its
  state's lengths and each ownership record its lists' (read from the pool itself: the
  class refuses every call after a refusal)."""
  pool = a._pools[r]  # pylint: disable=protected-access
  state = jax.tree.map(np.asarray, pool.state)
  parts = (state.full, state.swa) if isinstance(state, core.SWAState) else (state,)
  lists = [x.tolist() for p in parts for x in (st.live_free_pages(p),
                                               st.live_release_pages(p))]
  for p in parts:
    held = guard.from_free(p.free_ring.shape[0], np.concatenate(
        [st.live_free_pages(p), st.live_release_pages(p)]))
    assert p.guard is not None and (p.guard.held == held).all(), "record != lists"
  if isinstance(state, core.SWAState):
    lists.append(state.mapping.tolist())
  assert pool.lengths() == pool.backend.lengths(pool.state), "mirror != state"
  if pool.peers is not None:  # the SWA record of live mappings (swa_peers): the state's
    pool.peers.resolve(block=True)
    lists.append((pool.peers.live.tolist(), pool.peers.irregular))
    fresh = PeerRecord(pool.peers.num_pages, pool.peers.page_size)
    fresh.rebuild(state)
    assert pool.peers.irregular or (fresh.live == pool.peers.live).all(), "peers != state"
  return lists


def _extend(a, seq, pre=0, last=-1):
  return np.asarray(a.alloc_extend(np.array([pre]), None, np.array([seq]), None,
                                   np.array([last]), seq - pre))


def _freed(a, n):
  """n pages (paged), slots (token) or a request of n pages (SWA), then freed: (held
  slots of another n, the freed slots)."""
  if isinstance(a, kvs.SWATokenToKVPoolAllocator):
    kept, gone = _extend(a, n * PS), _extend(a, n * PS)
  else:
    kept, gone = np.asarray(a.alloc(n * a.page_size)), np.asarray(a.alloc(n * a.page_size))
  a.free(gone)
  return kept, gone


# Each case: (allocator, setup(a) -> context, misuse(a, context), message, the backends
# on which it is a refusal of the state (then sticky: every call raises until
# restore_state() or clear()); elsewhere it is bad input the host checks refuse at once).
def _bug1_paged(a, _):
  a.free_page_ids(jnp.array([0, 3]))  # device: taken as it is; page 0 is refused
  out = a.alloc(2 * PS)               # the mirror counted 2 pages: the device refuses
  assert out is None or not np.asarray(out).any(), "a refused allocation's slots are 0"


def _bug1_swa(a, out):
  a.free_segment(out, start_pos=0)     # page 1's SWA KV is gone: breaks the contract
  got = a.alloc_extend(np.array([0]), None, np.array([28]), None, np.array([-1]), 28)
  assert got is None or not np.asarray(got).any()


def _in_group(calls):
  def misuse(a, ctx):
    a.free_group_begin()
    for call in calls:
      call(a, ctx)
    a.free_group_end()
  return misuse


NOT_HELD = re.escape("is not held (free, released, or never handed out)")
TWICE = "is named twice by one call that does not de-duplicate"
CASES = {
    # -- issue 31 ---------------------------------------------------------------------
    # 1. a device array naming page 0: the mirror must not count it, nor hand out zeros.
    "free_page_ids_page_0": (
        _paged, lambda a: a.alloc(4 * PS), _bug1_paged, r"page_ids\[0\]=0", ("device",)),
    # 1. a segment free after a window free (SWA): no peer for its first page.
    "free_segment_after_window_free": (
        _swa, lambda a: (lambda o: (a.free_swa_segment(o[:PS], start_pos=0), o)[1])(
            _extend(a, 3 * PS)), _bug1_swa, r"free_index\[0\]=4 has no SWA peer",
        ("device", "host")),
    # 2. free_segment of a bad segment: the full pool's check before the SWA side frees.
    "free_segment_not_one_request": (
        _swa, lambda a: _extend(a, 2 * PS),
        lambda a, out: a.free_segment(np.array([4, 5, 6, 8]), start_pos=0),
        r"free_index\[3\]=8 lies in page 2", ()),
    "free_segment_not_one_request_in_a_group": (
        _swa, lambda a: (_extend(a, 2 * PS), a.free_group_begin()),
        lambda a, _: a.free_segment(np.array([4, 5, 6, 8]), start_pos=0),
        r"free_index\[3\]=8 lies in page 2", ()),
    # 3. page size 1: free of a slot whose SWA KV was freed (free_swa first).
    "token_free_without_peer": (
        lambda b: _swa(b, ps=1), lambda a: (a.alloc(3), a.free_swa(np.array([2]))),
        lambda a, _: a.free(np.array([2])), r"free_index\[0\]=2 has no SWA peer",
        ("device", "host")),
    # 4. alloc_extend / alloc_decode continuing a page whose SWA KV is gone.
    "extend_continues_a_page_without_peer": (
        _swa, lambda a: a.free_swa(_extend(a, 6)),
        lambda a, _: _extend(a, 8, pre=6, last=9), r"last_loc\[0\]=9 has no SWA peer",
        ("device", "host")),
    "decode_continues_a_page_without_peer": (
        _swa, lambda a: a.free_swa(_extend(a, 6)),
        lambda a, _: a.alloc_decode(np.array([7]), None, np.array([9])),
        r"last_loc\[0\]=9 has no SWA peer", ("device", "host")),
    # -- SPEC 14: the ownership record, paged class -----------------------------------
    "paged_double_free": (
        _paged, lambda a: _freed(a, 1), lambda a, c: a.free(np.concatenate(c)),
        rf"^free: page 2 {NOT_HELD}", ALL),
    "paged_double_free_released": (  # need_sort: the page is parked in release_pages
        lambda b: _paged(b, need_sort=True), lambda a: _freed(a, 1),
        lambda a, c: a.free(c[1]), rf"^free: page 2 {NOT_HELD}", ALL),
    "paged_free_never_held": (
        _paged, lambda a: a.alloc(PS), lambda a, _: a.free(np.array([3 * PS + 1])),
        rf"^free: page 3 {NOT_HELD}", ALL),
    "paged_free_page_ids_never_held": (
        _paged, lambda a: a.alloc(PS), lambda a, _: a.free_page_ids(jnp.array([1, 4])),
        rf"^free_page_ids: page 4 {NOT_HELD}", ALL),
    "paged_page_0": (
        _paged, lambda a: a.alloc(PS), lambda a, _: a.free(np.array([PS, 1])),
        r"free_index\[1\]=1 is not an allocatable slot.*page 0 is reserved", ()),
    "paged_out_of_range": (
        _paged, lambda a: a.alloc(PS), lambda a, _: a.free_page_ids(jnp.array([1, 7])),
        r"page_ids\[1\]=7 is not a page of the pool", ("device",)),
    "paged_free_page_ids_twice_in_one_call": (
        _paged, lambda a: a.alloc(2 * PS), lambda a, _: a.free_page_ids(jnp.array([2, 1, 2])),
        rf"(^free_page_ids: page 2 {TWICE}|page_ids\[2\]=2 is given twice)", ("device",)),
    "paged_free_segment_page_twice": (
        _paged, lambda a: a.alloc(2 * PS),
        lambda a, _: a.free_segment(jnp.array([4, 5, 6, 7, 4, 5]), start_pos=0),
        rf"(^free_segment: page 1 {TWICE}|// page_size\[1\]=1 names a page twice)",
        ("device",)),
    "paged_free_segments_share_a_page": (
        _paged, lambda a: a.alloc(2 * PS),
        lambda a, _: a.free_segments([(jnp.array([4, 5]), 0), (jnp.array([4, 5]), 4)]),
        rf"(^free_segments: page 1 {TWICE}|segments.* page)", ("device",)),
    "paged_segment_of_a_freed_request": (
        _paged, lambda a: _freed(a, 2),
        lambda a, c: a.free_segment(c[1], start_pos=0), rf"^free_segment: page 3 {NOT_HELD}",
        ALL),
    "paged_double_free_in_a_group": (  # the group's slot frees, then its page ids
        _paged, lambda a: _freed(a, 1),
        _in_group([lambda a, c: a.free_page_ids(c[0][:1] // PS), lambda a, c: a.free(c[1])]),
        rf"^free_group_end: page 2 {NOT_HELD}", ALL),
    # -- token class ------------------------------------------------------------------
    "token_double_free": (
        _token, lambda a: _freed(a, 2), lambda a, c: a.free(c[1]),
        rf"^free: page 3 {NOT_HELD}", ALL),
    "token_free_slot_twice_in_one_call": (
        _token, lambda a: a.alloc(3), lambda a, _: a.free(np.array([1, 3, 1])),
        rf"^free: page 1 {TWICE}", ALL),
    "token_free_never_held": (
        _token, lambda a: a.alloc(3), lambda a, _: a.free_page_ids([2, 9]),
        rf"^free_page_ids: page 9 {NOT_HELD}", ALL),
    "token_segment_twice": (
        _token, lambda a: a.alloc(4), lambda a, _: a.free_segment([1, 2, 2], start_pos=0),
        rf"^free_segment: page 2 {TWICE}", ALL),
    "token_slot_twice_across_a_group": (
        _token, lambda a: a.alloc(4),
        _in_group([lambda a, _: a.free([1, 2]), lambda a, _: a.free([2])]),
        rf"^free_group_end: page 2 {TWICE}", ALL),
    # -- SWA class: each pool's record --------------------------------------------------
    "swa_double_free": (  # debug mode's peer check finds it first (its own error)
        _swa, lambda a: _freed(a, 2), lambda a, c: a.free(np.concatenate(c)),
        rf"(^free: page 3 {NOT_HELD} in the full pool|free_index\[8\]=12 has no SWA "
        r"peer \(call free_full\))", ALL),
    "swa_free_full_twice": (
        _swa, lambda a: _freed(a, 2), lambda a, c: a.free_full(c[1]),
        rf"^free_full: page 3 {NOT_HELD} in the full pool", ALL),
    "swa_segment_of_a_freed_request": (
        _swa, lambda a: _freed(a, 2), lambda a, c: a.free_full_segment(c[1], start_pos=0),
        rf"(^free_full_segment: page 3 {NOT_HELD} in the full pool)", ALL),
    "swa_token_free_slot_twice": (
        lambda b: _swa(b, ps=1), lambda a: a.alloc(3),
        lambda a, _: a.free(np.array([2, 1, 2])),
        rf"^free: page 2 {TWICE} in the full pool", ALL),
    "swa_free_full_segment_page_twice": (
        _swa, lambda a: _extend(a, 2 * PS),
        lambda a, _: a.free_full_segment(jnp.array([4, 5, 6, 7, 4]), start_pos=0),
        rf"(^free_full_segment: page 1 {TWICE} in the full pool|// page_size\[1\]=1 "
        r"names a page twice)", ("device",)),
    "swa_free_full_twice_in_a_group": (
        lambda b: _swa(b, ps=1), lambda a: (a.alloc(3), a.free_swa(np.array([2]))),
        _in_group([lambda a, _: a.free_full(np.array([2])),
                   lambda a, _: a.free_full(np.array([2]))]),
        rf"^free_group_end: page 2 {TWICE} in the full pool", ALL),
    "swa_free_swa_of_a_freed_request": (  # page size > 1: the full page is not held
        _swa, lambda a: _freed(a, 2),
        lambda a, c: a.free_swa(np.append(c[0][:1], c[1][5:6])),
        rf"(^free_swa: page 4 {NOT_HELD} in the full pool|free_index\[1\]=17 has no "
        r"SWA peer \(call free_full\))", ALL),
    "swa_free_swa_of_a_freed_request_in_a_group": (
        _swa, lambda a: _freed(a, 2),
        _in_group([lambda a, c: a.free_swa(c[1][:2])]),
        rf"(^free_swa: page 3 {NOT_HELD} in the full pool|free_index\[0\]=12 has no "
        r"SWA peer \(call free_full\))", ALL),
    "swa_free_of_part_of_a_freed_page": (
        _swa, lambda a: _freed(a, 2), lambda a, c: a.free(np.append(c[0][:2], c[1][6:7])),
        rf"(^free: page 4 {NOT_HELD} in the full pool|^free_swa: free_index\[2\]=18 has "
        r"no SWA peer \(call free_full\))", ALL),
    "swa_mapping_to_a_free_swa_slot": (  # the SWA pool's record
        lambda b: _swa(b, ps=1),
        lambda a: (a.alloc(3), a.set_full_to_swa_mapping(np.array([2]), np.array([7]))),
        lambda a, _: a.free_swa(np.array([2])), rf"^free_swa: page 7 {NOT_HELD} in the SWA "
        "pool", ALL),
}


def _own_error(e):
  """Whether `e` is one of debug mode's own checks (beyond the record: not sticky)."""
  return isinstance(e, (debug.AllocatorDebugError, SWADebugError))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_refusals_raise_and_change_nothing_on_every_backend(case, backend):
  _check_case(case, backend)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_refusals_on_the_gpu(case, monkeypatch):
  """The same cases on the device backend on a GPU, with its kernels (Triton frees and
  allocations, the record kept in their launches)."""
  monkeypatch.setattr(sys.modules[__name__], "KERNEL", "auto")
  monkeypatch.setattr(sys.modules[__name__], "DEVICE", jax.devices("gpu")[0])
  _check_case(case, "device")


def _check_case(case, backend):
  make, setup, misuse, match, sticky = CASES[case]
  a = make(backend)
  context = setup(a)
  before = _contents(a)
  snap = a.backup_state() if a.is_not_in_free_group else None
  with pytest.raises(ValueError, match=match) as raised:
    misuse(a, context)
    settle(a)  # the device's refusal raises at the first call after it landed
  assert _contents(a) == before  # nothing changed, the mirror rolled back
  if backend in sticky and not _own_error(raised.value):
    for call in (a.available_size, lambda: a.alloc(a.page_size), a.backup_state,
                 lambda: a.free([a.page_size])):
      with pytest.raises(ValueError, match=match):
        call()
    if snap is not None:  # a restore clears it
      a.restore_state(snap)
      assert _contents(a) == before and a.available_size() >= 0
  a.clear()
  assert a.available_size() == a.size


@pytest.mark.parametrize("backend", ["device", "host"])
def test_snapshots_put_the_record_back(backend):
  """A single pool's snapshot does not keep the ownership record: restore_state patches
  the live one (only allocations since) or rebuilds it (frees or merges since, a later
  snapshot, another allocator's snapshot), and `state` hands out a record that later
  calls do not write. After each step the record equals the lists, and a double free
  is still refused."""
  a = _paged(backend, need_sort=True)
  a.alloc(PS)
  snap = a.backup_state()
  out = np.asarray(a.alloc(2 * PS))
  a.restore_state(snap)                      # patched: pages 2, 3 free again
  before = _contents(a)
  out = np.asarray(a.alloc(2 * PS))
  a.free(out[:PS])
  later = a.backup_state()
  a.restore_state(snap)                      # rebuilt: a free since
  assert _contents(a) == before
  a.restore_state(later)                     # rebuilt: more pages free than the live state
  after_free = _contents(a)
  a.merge_and_sort_free()
  a.restore_state(later)                     # rebuilt: a merge since
  assert _contents(a) == after_free
  other = _paged(backend, need_sort=True)
  other.restore_state(later)                 # another allocator's snapshot
  assert _contents(other) == after_free
  held_out = a.state                         # handed out: later calls copy the record
  record = np.asarray(held_out.guard.held).copy()
  a.alloc(PS)
  np.testing.assert_array_equal(np.asarray(held_out.guard.held), record)
  a.set_state(held_out)
  assert _contents(a) == after_free
  with pytest.raises(ValueError, match=rf"^free: page 2 {NOT_HELD}"):
    a.free(out[:1])                          # freed before `later`: not held
    settle(a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refusal_names_its_rank_and_clear_of_that_rank_ends_it(backend):
  a = _paged(backend, dp_size=2)
  kept = [np.asarray(a.alloc(PS, dp_rank=r)) for r in (0, 1)]
  a.free(kept[1], dp_rank=1)
  with pytest.raises(ValueError, match=rf"^dp_rank=1: free: page 1 {NOT_HELD}"):
    a.free(kept[1], dp_rank=1)
    settle(a, dp_rank=1)
  with pytest.raises(ValueError, match="dp_rank=1: free"):
    a.available_size(dp_rank=0)                  # every call, on any rank
  a.clear(dp_rank=1)
  a.free(kept[0], dp_rank=0)
  assert [a.available_size(dp_rank=r) for r in (0, 1)] == [2 * PS, 2 * PS]


class _NeverReady:
  """A device status that never lands by itself (a slow device), for the 8-call rule."""

  def __init__(self, status):
    self.status = status

  def is_ready(self):
    return False

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.asarray(self.status, dtype)


@pytest.fixture
def slow_device(monkeypatch):
  """The running statuses the pools keep never land before a read waits for them."""
  record = pool_module.Pool.record

  def never_ready(self, op, status, call):
    record(self, op, status, call)
    if self.pending and not isinstance(self.pending[-1][3], _NeverReady):
      *rest, running = self.pending[-1]
      self.pending[-1] = (*rest, _NeverReady(running))
  monkeypatch.setattr(pool_module.Pool, "record", never_ready)


HOST_VALUE_CALLS = ("available_size", "debug_print", "backup_state", "merge_and_sort_free")


@pytest.mark.parametrize("before", [0, 1, 5])
def test_device_refusal_raises_at_the_8th_call(slow_device, before):
  # A status that has not landed is not waited for, by any call (those returning host
  # values included), until the 8th class call after the refused one: that call waits
  # and raises, naming the refused call.
  del slow_device
  a = _make(kvs.PagedTokenToKVPoolAllocator, "device", 16 * PS, PS)
  a.alloc(4 * PS)
  for _ in range(before):                        # valid calls, unread
    a.alloc(PS)
  a.free_page_ids(jnp.array([15]))               # refused by the device: not held
  waits = a.status_waits
  later = 0
  with pytest.raises(ValueError, match=rf"^free_page_ids: page 15 {NOT_HELD}"):
    for later in range(1, pool_module.WITHIN_CALLS + 1):
      getattr(a, HOST_VALUE_CALLS[later % len(HOST_VALUE_CALLS)])()
  assert later == pool_module.WITHIN_CALLS == 8
  assert a.status_waits > waits                  # the 8th call waited


def test_device_refusal_raises_at_the_first_call_after_it_landed():
  a = _paged("device")
  a.alloc(4 * PS)
  a.free_page_ids(jnp.array([3, 0]))
  jax.block_until_ready(a._pools[0].backend.running)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"^free_page_ids: page_ids\[1\]=0"):
    a.available_size()                           # landed: read, no wait
  assert a.status_waits == 0


def _steady_reads(monkeypatch, **kw):
  """(statuses read, class calls) over 40 valid device class calls (frees and
  allocations)."""
  reads = []
  read = status_module.read
  monkeypatch.setattr(status_module, "read", lambda x: reads.append(x) or read(x))
  a = kvs.PagedTokenToKVPoolAllocator(16 * PS, PS, debug=False, **kw)
  out = a.alloc(2 * PS)
  for _ in range(20):
    a.free(np.asarray(out))
    out = a.alloc(2 * PS)
  return len(reads), 41


def test_steady_device_calls_read_at_most_one_status_per_call(monkeypatch):
  reads, calls = _steady_reads(monkeypatch, kernel=KERNEL)
  assert 0 < reads <= calls


@pytest.mark.gpu
@needs_gpu
def test_steady_device_calls_read_at_most_one_status_per_call_on_gpu(monkeypatch):
  reads, calls = _steady_reads(monkeypatch, device="cuda")
  assert 0 < reads <= calls


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
