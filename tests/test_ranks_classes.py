"""`dp_size` / `dp_rank` on the SGLang-compatible classes (SPEC 12, sglang-jax's names).

The scenarios of sglang-jax's multi-dp allocator tests, in our own words: each rank
allocates and frees its own pages; a free group queues frees per rank and flushes every
rank at its end, none leaking into another rank; a rank that runs dry leaves the others
serving; snapshots and clear cover every rank (or the one named). Then random traces:
each rank in turn against its own model while the others must not move.
"""
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import ranks
from jax_kvalloc.sglang import RankedSnapshot
from serving_driver import run_workload

PS = 16
SIZE = 1024   # 64 pages


def _paged(dp_size, **kw):
  return kvs.PagedTokenToKVPoolAllocator(size=SIZE, page_size=PS, kvcache=None,
                                        dp_size=dp_size, **kw)


def _lens(alloc, attr="free_pages"):
  return [len(x) for x in getattr(alloc, attr)]


@pytest.mark.parametrize("backend", ["device", "host"])
def test_each_rank_allocates_and_frees_its_own_pages(backend):
  a = _paged(3, backend=backend, need_sort=True)
  per_rank = SIZE // PS // 3   # 21 pages, ids 1..21 on every rank
  assert _lens(a) == [per_rank] * 3 and a.dp_size == 3
  for r in range(3):
    got = np.asarray(a.alloc(2 * PS, dp_rank=r))
    assert got.tolist() == list(range(PS, 3 * PS))  # pages 1 and 2: ids are rank-local
    assert a.available_size(dp_rank=r) == (per_rank - 2) * PS
    assert _lens(a)[r] == per_rank - 2 and sum(_lens(a)) == 3 * per_rank - 2  # others whole
    a.free(got, dp_rank=r)
    assert _lens(a, "release_pages")[r] == 2   # need_sort: parked until a merge
    a.merge_and_sort_free(dp_rank=r)
    assert a.free_pages[r].tolist() == list(range(1, per_rank + 1))


@pytest.mark.parametrize("dp_size", [1, 3])
def test_free_group_queues_per_rank_and_flushes_every_rank(dp_size):
  a = _paged(dp_size)
  held = {r: [a.alloc(2 * PS, dp_rank=r) for _ in range(2)] for r in range(dp_size)}
  before = _lens(a) if dp_size > 1 else [len(a.free_pages)]
  a.free_group_begin()
  assert not a.is_not_in_free_group
  for k in (0, 1):              # interleaved: rank 1's, rank 0's, rank 2's, ...
    for r in ([1, 0, 2] if dp_size == 3 else [0]):
      a.free(held[r][k], dp_rank=r)
  after_queue = _lens(a) if dp_size > 1 else [len(a.free_pages)]
  assert after_queue == before  # nothing freed yet
  a.free_group_end()
  assert a.is_not_in_free_group
  now = _lens(a) if dp_size > 1 else [len(a.free_pages)]
  assert now == [b + 4 for b in before]  # each rank got back exactly its own 4 pages
  with pytest.raises(RuntimeError):
    a.free_group_end()  # no group open: an error, as without ranks


def test_a_rank_running_dry_leaves_the_others_serving():
  a = _paged(2)
  per_rank = SIZE // PS // 2
  taken = [a.alloc(PS, dp_rank=0) for _ in range(per_rank)]
  assert all(t is not None for t in taken) and len(a.free_pages[0]) == 0
  assert a.alloc(PS, dp_rank=0) is None
  assert a.alloc_decode([1], None, [-1], dp_rank=0) is None
  assert len(a.free_pages[1]) == per_rank
  assert np.asarray(a.alloc(PS, dp_rank=1)).tolist() == list(range(PS, 2 * PS))
  a.free(taken[0], dp_rank=0)
  a.free(taken[1], dp_rank=0)
  assert _lens(a) == [2, per_rank - 1]
  # alloc_extend / alloc_decode by rank, SGLang's signature plus dp_rank.
  out = a.alloc_extend([0], None, [PS + 3], None, [-1], PS + 3, dp_rank=1)
  assert np.asarray(out).tolist() == list(range(2 * PS, 3 * PS + 3))
  out = a.alloc_decode([PS + 4], None, [3 * PS + 2], dp_rank=1)
  assert np.asarray(out).tolist() == [3 * PS + 3]


def test_snapshots_and_clear_cover_every_rank():
  a = _paged(3)
  a.alloc(PS, dp_rank=0)
  snap = a.backup_state()
  assert isinstance(snap, RankedSnapshot) and len(snap.ranks) == 3
  for r in range(3):
    a.alloc(3 * PS, dp_rank=r)
  a.restore_state(snap)
  assert _lens(a) == [20, 21, 21]
  for r in range(3):
    a.alloc(2 * PS, dp_rank=r)
  a.clear(dp_rank=1)
  assert _lens(a) == [18, 21, 19]
  a.clear()
  assert _lens(a) == [21, 21, 21]
  with pytest.raises(TypeError, match="RankedSnapshot"):
    a.restore_state(_paged(1).backup_state())
  with pytest.raises(ValueError, match="another allocator"):
    a.restore_state(_paged(2).backup_state())


def test_ranked_state_round_trip_through_jitted_ranks_code():
  a = _paged(2)
  a.alloc(PS, dp_rank=1)
  cfg = a.config
  state = a.state
  assert state.free_ring.shape == (2, 32)
  state, out, ok = ranks.alloc(cfg, state, np.asarray([2 * PS, 0], np.int32), max_size=2 * PS)
  assert np.asarray(ok).tolist() == [True, True]
  a.set_state(state)
  assert _lens(a) == [30, 31]
  assert a.available_size(dp_rank=0) == 30 * PS


def test_dp_size_one_is_todays_class():
  a = _paged(1)
  b = kvs.PagedTokenToKVPoolAllocator(SIZE, PS)
  for x in (a, b):
    x.alloc(2 * PS)
  assert a.free_pages.tolist() == b.free_pages.tolist()  # a flat array, not a list
  assert a.alloc(PS, dp_rank=0) is not None and a.dp_size == 1
  assert "dp_size" not in repr(a)
  assert isinstance(a.backup_state(), kvs.AllocatorSnapshot)
  with pytest.raises(ValueError, match="dp_rank=1 is out of range"):
    a.alloc(PS, dp_rank=1)


def test_token_allocator_ranks():
  a = kvs.TokenToKVPoolAllocator(size=30, dp_size=3)
  assert np.asarray(a.alloc(4, dp_rank=2)).tolist() == [1, 2, 3, 4]
  a.free([3, 1], dp_rank=2)
  assert a.free_pages[2].tolist() == [5, 6, 7, 8, 9, 10, 3, 1]  # FIFO, rank-local ids
  assert a.free_pages[0].tolist() == list(range(1, 11))
  assert "dp_size=3" in repr(a)


def test_bad_dp_arguments():
  with pytest.raises(ValueError, match="dp_size must be >= 1"):
    _paged(0)
  with pytest.raises(ValueError, match="less than one page"):
    _paged(SIZE // PS + 1)
  a = _paged(2)
  with pytest.raises(ValueError, match="dp_rank=2 is out of range"):
    a.alloc(PS, dp_rank=2)
  with pytest.raises(TypeError, match="dp_rank must be an int"):
    a.free([PS], dp_rank="0")
  with pytest.raises(ValueError, match="one device per rank"):
    _paged(2, device=["cpu"])
  assert _lens(a) == [32, 32]


class RankView:
  """One rank of a ranked class with the plain SGLang method set (for run_workload)."""

  def __init__(self, alloc, rank):
    self.a, self.r = alloc, rank

  free_pages = property(lambda self: self.a.free_pages[self.r])
  release_pages = property(lambda self: self.a.release_pages[self.r])

  def available_size(self):
    return self.a.available_size(dp_rank=self.r)

  def alloc(self, n):
    return self.a.alloc(n, dp_rank=self.r)

  def alloc_extend(self, *args):
    return self.a.alloc_extend(*args, dp_rank=self.r)

  def alloc_decode(self, *args):
    return self.a.alloc_decode(*args, dp_rank=self.r)

  def free(self, idx):
    self.a.free(idx, dp_rank=self.r)

  def merge_and_sort_free(self):
    self.a.merge_and_sort_free(dp_rank=self.r)

  def free_group_begin(self):
    self.a.free_group_begin()

  def free_group_end(self):
    self.a.free_group_end()

  def backup_state(self):
    return self.a.backup_state()

  def restore_state(self, snap):
    self.a.restore_state(snap)


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("need_sort", [False, True])
def test_every_rank_matches_the_model_while_the_others_stay(need_sort, backend):
  dp, pages = 3, 20
  a = kvs.PagedTokenToKVPoolAllocator(dp * pages * 4, 4, need_sort=need_sort, dp_size=dp,
                                     backend=backend)
  ends = []
  for r in range(dp):
    run_workload(RankView(a, r), size=pages * 4, page_size=4, need_sort=need_sort,
                 kind="paged", steps=80, seed=r)
    ends.append((a.free_pages[r].tolist(), a.release_pages[r].tolist()))
    for q in range(r):  # earlier ranks untouched by this one's trace
      assert (a.free_pages[q].tolist(), a.release_pages[q].tolist()) == ends[q]


def test_debug_mode_and_warmup_per_rank():
  a = _paged(2, debug=True, guard=False)  # debug's own check (the record: test_refusals)
  held = a.alloc(PS, dp_rank=1)
  a.free(held, dp_rank=1)
  with pytest.raises(kv.AllocatorDebugError, match="double free"):
    a.free(held, dp_rank=1)  # rank 1's page is already free
  assert _lens(a) == [32, 32]
  b = _paged(2)
  report = b.warmup(max_batch=1, max_tokens=PS)
  assert report.programs > 0 and _lens(b) == [32, 32]
