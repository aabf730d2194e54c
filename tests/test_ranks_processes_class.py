"""`dp_ranks=` on the SGLang-compatible classes: an allocator holding ranks 1 and 3 of
dp_size 4 (what one process of several holds) gives, on those ranks, exactly the full
allocator's results and state (random serving traces, each also checked against the
model), refuses ranks 0 and 2 without changing anything, and its free groups, clear()
and snapshots touch the held ranks only.
"""
import jax
import numpy as np
import pytest

import jax_kvalloc.sglang as kvs
from jax_kvalloc import ranks
from jax_kvalloc.sglang import RankedSnapshot
from serving_driver import run_workload

DP, HELD, OTHERS = 4, (1, 3), (0, 2)
PS, PAGES = 4, 12          # per rank
KINDS = ["paged", "token"]
BACKENDS = ["host", "device"]


def _make(kind, backend="host", need_sort=False, dp_ranks=None, **kw):
  if kind == "paged":
    return kvs.PagedTokenToKVPoolAllocator(DP * PAGES * PS, PS, need_sort=need_sort,
                                          dp_size=DP, backend=backend, dp_ranks=dp_ranks,
                                          **kw)
  return kvs.TokenToKVPoolAllocator(DP * PAGES, need_sort=need_sort, dp_size=DP,
                                    backend=backend, dp_ranks=dp_ranks, **kw)


def _ps(kind):
  return PS if kind == "paged" else 1


def _rank(a, r):
  """Rank r as host data: (free list, release list, available_size)."""
  return (np.asarray(a.free_pages[r]).tolist(), np.asarray(a.release_pages[r]).tolist(),
          a.available_size(dp_rank=r))


def _held(a):
  return [_rank(a, r) for r in HELD]


def _same(got, want, what):
  if got is None or want is None:
    assert got is None and want is None, (what, got, want)
  else:
    assert np.asarray(got).tolist() == np.asarray(want).tolist(), what


class Tee:
  """Rank r of a held-ranks allocator and of the full one, driven together with
  run_workload's method set: every result of `held` must equal `full`'s."""

  def __init__(self, held, full, r):
    self.held, self.full, self.r = held, full, r

  def _both(self, name, *args, **kw):
    got = getattr(self.held, name)(*args, **kw)
    _same(got, getattr(self.full, name)(*args, **kw), name)
    return got

  free_pages = property(lambda self: self.held.free_pages[self.r])
  release_pages = property(lambda self: self.held.release_pages[self.r])

  def available_size(self):
    return self._both("available_size", dp_rank=self.r)

  def alloc(self, n):
    return self._both("alloc", n, dp_rank=self.r)

  def alloc_extend(self, *args):
    return self._both("alloc_extend", *args, dp_rank=self.r)

  def alloc_decode(self, *args):
    return self._both("alloc_decode", *args, dp_rank=self.r)

  def free(self, idx):
    self._both("free", idx, dp_rank=self.r)

  def merge_and_sort_free(self):
    self._both("merge_and_sort_free", dp_rank=self.r)

  def free_group_begin(self):
    self._both("free_group_begin")

  def free_group_end(self):
    self._both("free_group_end")

  def backup_state(self):
    return self.held.backup_state(), self.full.backup_state()

  def restore_state(self, snap):
    self.held.restore_state(snap[0])
    self.full.restore_state(snap[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_held_ranks_match_the_full_allocator(kind, backend):
  need_sort = kind == "paged"   # both lists in play on one, FIFO frees on the other
  held = _make(kind, backend, need_sort, dp_ranks=[3, 1])   # any order: held ascending
  full = _make(kind, backend, need_sort)
  assert held.dp_ranks == HELD and full.dp_ranks == (0, 1, 2, 3) and held.dp_size == DP
  for seed, r in enumerate(HELD):
    run_workload(Tee(held, full, r), size=PAGES * _ps(kind), page_size=_ps(kind),
                 need_sort=need_sort, kind=kind, steps=30, seed=seed)
  assert _held(held) == _held(full)
  assert [held.free_pages[r] for r in OTHERS] == [None, None]
  # The functional state: the held ranks, stacked in dp_ranks order, are the full one's.
  got, want = held.state, full.state
  assert ranks.num_ranks(got) == 2
  for i, r in enumerate(HELD):
    for x, y in zip(jax.tree.leaves(ranks.rank_state(got, i)),
                    jax.tree.leaves(ranks.rank_state(want, r))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  held.set_state(got)
  assert _held(held) == _held(full)
  with pytest.raises(ValueError, match=r"holds 2 \(dp_ranks=\(1, 3\)\)"):
    held.set_state(want)
  assert _held(held) == _held(full)


def _calls(kind, r, slot):
  """Every call a scheduler makes for rank r (each valid for a held rank)."""
  calls = [lambda a: a.alloc(_ps(kind), dp_rank=r),
           lambda a: a.free([slot], dp_rank=r),
           lambda a: a.free_full([slot], dp_rank=r),
           lambda a: a.free_page_ids([1], dp_rank=r),
           lambda a: a.free_segment([slot], start_pos=0, dp_rank=r),
           lambda a: a.free_segments([([slot], 0)], dp_rank=r),
           lambda a: a.merge_and_sort_free(dp_rank=r),
           lambda a: a.available_size(dp_rank=r),
           lambda a: a.get_all_free_pages(dp_rank=r),
           lambda a: a.debug_print(dp_rank=r),
           lambda a: a.clear(dp_rank=r)]
  if kind == "paged":
    calls += [lambda a: a.alloc_extend([0], None, [3], None, [-1], 3, dp_rank=r),
              lambda a: a.alloc_decode([1], None, [-1], dp_rank=r)]
  return calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_other_ranks_are_refused_and_nothing_changes(kind, backend):
  a = _make(kind, backend, dp_ranks=HELD)
  held = {r: np.asarray(a.alloc(2 * _ps(kind), dp_rank=r)) for r in HELD}
  a.free_group_begin()
  a.free(held[1][:_ps(kind)], dp_rank=1)   # queued
  before, queued = _held(a), a.debug_print()
  slot = _ps(kind)                          # page 1's first slot
  for r in OTHERS:
    for call in _calls(kind, r, slot):
      with pytest.raises(ValueError, match=rf"dp_rank={r} is held by another process "
                                           r"\(this allocator holds dp_ranks=\(1, 3\) "
                                           r"of dp_size=4\)"):
        call(a)
      assert _held(a) == before and a.debug_print() == queued
      assert not a.is_not_in_free_group
  a.free_group_end()
  assert [len(a.free_pages[r]) for r in HELD] == [PAGES - 1, PAGES - 2]
  with pytest.raises(ValueError, match="dp_rank=4 is out of range"):
    a.alloc(1, dp_rank=4)
  with pytest.raises(TypeError, match="dp_rank must be an int"):
    a.alloc(1, dp_rank="1")


@pytest.mark.parametrize("kind", KINDS)
def test_free_groups_clear_and_snapshots_touch_held_ranks_only(kind):
  ps = _ps(kind)
  a, full = _make(kind, dp_ranks=HELD), _make(kind)
  for x in (a, full):
    got = {r: x.alloc(3 * ps, dp_rank=r) for r in range(DP) if r in x.dp_ranks}
    x.free_group_begin()
    for r in reversed(HELD):
      x.free(got[r][:ps], dp_rank=r)
      x.free(got[r][2 * ps:], dp_rank=r)
    if x is full:
      assert [len(full.free_pages[r]) for r in OTHERS] == [PAGES - 3] * 2
    x.free_group_end()
  assert _held(a) == _held(full)
  assert "rank 0" not in a.debug_print() and "rank 3" in a.debug_print()

  snap = a.backup_state()
  assert isinstance(snap, RankedSnapshot) and snap.dp_ranks == HELD
  assert len(snap.ranks) == 2
  saved = _held(a)
  a.alloc(ps, dp_rank=3)
  a.free_group_begin()
  a.clear(dp_rank=1)                       # rank 1 only; the group stays open
  assert not a.is_not_in_free_group and _held(a)[0] == _rank(_make(kind), 1)
  a.clear()                                # every held rank, and the group closes
  assert a.is_not_in_free_group and _held(a) == _held(_make(kind, dp_ranks=HELD))
  a.restore_state(snap)
  assert _held(a) == saved
  for other in (full, _make(kind, dp_ranks=[1, 2]), _make(kind, dp_ranks=[1])):
    with pytest.raises(ValueError, match="another allocator"):
      a.restore_state(other.backup_state())
    with pytest.raises(ValueError, match="another allocator"):
      other.restore_state(snap)
  assert _held(a) == saved


@pytest.mark.parametrize("dp_ranks, error, match", [
    ([1, 1], ValueError, r"dp_ranks=\[1, 1\] names a rank twice"),
    ([1, 4], ValueError, r"dp_ranks=\[1, 4\] names rank 4, out of range"),
    ([-1], ValueError, r"dp_ranks=\[-1\] names rank -1"),
    ([], ValueError, "dp_ranks is empty"),
    ("13", TypeError, "dp_ranks must be a sequence"),
    (3, TypeError, "dp_ranks must be a sequence"),
    ([1.0], TypeError, "dp_ranks must hold ints"),
    ([True], TypeError, "dp_ranks must hold ints"),
])
@pytest.mark.parametrize("kind", KINDS)
def test_bad_dp_ranks(kind, dp_ranks, error, match):
  with pytest.raises(error, match=match):
    _make(kind, dp_ranks=dp_ranks)


def test_default_and_all_ranks_are_todays_class():
  every = _make("paged", dp_ranks=np.arange(DP))
  assert repr(every) == repr(_make("paged")) and "dp_ranks" not in repr(every)
  assert "dp_ranks=(1, 3)" in repr(_make("paged", dp_ranks=HELD))
  one = kvs.PagedTokenToKVPoolAllocator(64, PS, dp_ranks=[0])
  assert isinstance(one.backup_state(), kvs.AllocatorSnapshot) and one.dp_ranks == (0,)
  with pytest.raises(ValueError, match=r"dp_ranks=\[1\] names rank 1"):
    kvs.TokenToKVPoolAllocator(64, dp_ranks=[1])


def test_swa_allocator_holds_its_ranks_only():
  def swa(dp_ranks=None):
    return kvs.SWATokenToKVPoolAllocator(2 * 32, 2 * 16, 4, backend="host", dp_size=2,
                                         dp_ranks=dp_ranks)
  a, full = swa([1]), swa()
  z = np.zeros(1, np.int64)
  args = (z, z, np.array([8]), np.array([8]), np.array([-1]), 8)
  _same(a.alloc_extend(*args, dp_rank=1), full.alloc_extend(*args, dp_rank=1), "extend")
  assert a.available_size(dp_rank=1) == full.available_size(dp_rank=1) == 8
  with pytest.raises(ValueError, match=r"dp_rank=0 is held by another process"):
    a.alloc_extend(*args, dp_rank=0)
  with pytest.raises(ValueError, match=r"dp_rank=0 is held by another process"):
    a.clear(dp_rank=0)
  snap = a.backup_state()
  assert snap.dp_ranks == (1,) and len(snap.ranks) == 1
  with pytest.raises(ValueError, match=r"holding dp_ranks=\(1,\)"):
    a.restore_state(full.backup_state())
  a.free_group_begin()
  a.clear()
  assert a.available_size(dp_rank=1) == 16
  a.restore_state(snap)
  assert a.available_size(dp_rank=1) == 8
  with pytest.raises(ValueError, match="dp_ranks"):
    swa([2])
