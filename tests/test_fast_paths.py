"""The classes' fast paths for a host pool (jax_kvalloc.sglang.base: `_solo`, `quiet`,
the free-group queue reused from group to group) keep every check of the full paths:
a sticky refusal still raises on every call, and a queue that ended, raised or was
dropped by clear() never leaks into the next group."""
import numpy as np
import pytest

import jax_kvalloc.sgl_jax as sj
from jax_kvalloc.sglang import PagedTokenToKVPoolAllocator
from jax_kvalloc.sglang import TokenToKVPoolAllocator


def _token(**kw):
  return sj.TokenToKVPoolAllocator(32, backend="host", **kw)


def _paged(**kw):
  return sj.PagedTokenToKVPoolAllocator(64, 4, backend="host", **kw)


MAKERS = [_token, _paged,
          lambda: TokenToKVPoolAllocator(32, backend="host"),
          lambda: PagedTokenToKVPoolAllocator(64, 4, backend="host", need_sort=True)]


def _fast_calls(a):
  empty = np.zeros((0,), np.int32)
  return [lambda: a.available_size(), lambda: a.available_size(0),
          lambda: a.free(empty), a.free_group_begin, lambda: a.alloc(a.page_size)]


@pytest.mark.parametrize("make", MAKERS)
def test_a_sticky_refusal_raises_on_every_fast_call_until_clear(make):
  a = make()
  x = a.alloc(4 * a.page_size)
  a.free(x)
  with pytest.raises(ValueError, match="not held"):
    a.free(x)  # freed twice: refused, sticky
  for call in _fast_calls(a):
    with pytest.raises(ValueError, match="not held"):
      call()
  with pytest.raises(ValueError, match="not held"):
    a.free_group_end()  # (no group is open: the sticky refusal comes first)
  a.clear()
  assert a.available_size() == a.size
  a.free_group_begin()
  a.free_group_end()


@pytest.mark.parametrize("make", MAKERS)
def test_fast_paths_check_dp_rank(make):
  a = make()
  for bad, err in ((1, ValueError), (True, TypeError), (0.0, TypeError), ("0", TypeError)):
    with pytest.raises(err, match="dp_rank"):
      a.available_size(bad)
    with pytest.raises(err, match="dp_rank"):
      a.free(np.zeros((0,), np.int32), bad)
  assert a.available_size(np.int64(0)) == a.size  # an integral dp_rank is taken


@pytest.mark.parametrize("make", MAKERS)
def test_a_refused_group_leaves_nothing_queued_for_the_next(make):
  a = make()
  ps = a.page_size
  x = a.alloc(4 * ps)
  y = a.alloc(2 * ps)
  snap = a.backup_state()
  a.free_group_begin()
  a.free(x)
  a.free(y)
  a.free(np.array([a.size - 1], np.int32))  # never handed out: the end refuses
  with pytest.raises(ValueError, match="free_group_end"):
    a.free_group_end()
  a.restore_state(snap)
  a.free_group_begin()
  a.free_group_end()  # empty: must not free x or y again
  assert a.available_size() == a.size - 6 * ps
  a.free(y)
  a.free(x)  # both still held
  assert a.available_size() == a.size


@pytest.mark.parametrize("make", MAKERS)
def test_clear_drops_the_open_group(make):
  a = make()
  x = a.alloc(2 * a.page_size)
  a.free_group_begin()
  a.free(x)
  a.clear()
  assert a.is_not_in_free_group
  a.free_group_begin()
  a.free_group_end()  # x is free after clear: a stale queue would be refused here
  assert a.available_size() == a.size
  x = a.alloc(2 * a.page_size)
  a.free(x)  # and the record agrees
  assert a.available_size() == a.size


@pytest.mark.parametrize("make", [_token, _paged])
def test_the_flavour_free_group_view_is_a_copy(make):
  a = make()
  x = a.alloc(2 * a.page_size)
  a.free_group_begin()
  a.free(x)
  view = a.free_group
  assert [len(q) for q in view] == [1]
  view[0].append(np.array([a.size - 1], np.int32))  # not the queue: changes nothing
  view[0][0][:] = 0
  a.free_group_end()
  assert a.available_size() == a.size
  assert a.free_group == [[]]


@pytest.mark.parametrize("make", MAKERS)
def test_groups_nest_and_end_checks_still_raise(make):
  a = make()
  with pytest.raises(RuntimeError, match="without free_group_begin"):
    a.free_group_end()
  a.free_group_begin()
  with pytest.raises(RuntimeError, match="do not nest"):
    a.free_group_begin()
  a.free_group_end()
  with pytest.raises(RuntimeError, match="without free_group_begin"):
    a.free_group_end()


@pytest.mark.parametrize("kind,need_sort", [("token", False), ("token", True),
                                            ("paged", False), ("paged", True)])
def test_available_size_follows_the_state_on_random_calls(kind, need_sort):
  """available_size (kept by the mirror as it changes) equals the lists the state holds,
  after every call of a random sequence: allocations, frees (some refused), groups,
  merges, snapshots restored, clears."""
  rng = np.random.default_rng(7 + 2 * need_sort + (kind == "paged"))
  ps = 1 if kind == "token" else 4
  a = (TokenToKVPoolAllocator(64, backend="host", need_sort=need_sort) if ps == 1 else
       PagedTokenToKVPoolAllocator(128, ps, backend="host", need_sort=need_sort))
  held, snap = [], None
  for _ in range(400):
    op = rng.choice(["alloc", "alloc", "free", "free", "group", "merge", "snap",
                     "restore", "refused", "clear"], p=[.2, .1, .2, .1, .1, .05, .08, .07,
                                                        .05, .05])
    if op == "alloc":
      got = a.alloc(int(rng.integers(0, 6)) * ps)
      if got is not None and got.size:
        held.append(got)
    elif op in ("free", "group") and held:
      x = held.pop(int(rng.integers(len(held))))
      if op == "group":
        a.free_group_begin()
        a.free(np.zeros((0,), np.int32))
        a.free(x)
        a.free_group_end()
      else:
        a.free(x)
    elif op == "merge":
      a.merge_and_sort_free()
    elif op == "snap":
      snap = (a.backup_state(), list(held))
    elif op == "restore" and snap is not None:
      a.restore_state(snap[0])
      held = list(snap[1])
    elif op == "refused" and held:  # a double free: refused, sticky until clear()
      x = held.pop(int(rng.integers(len(held))))
      a.free(x)
      with pytest.raises(ValueError, match="not held"):
        a.free(x)
      with pytest.raises(ValueError, match="not held"):
        a.available_size()
      a.clear()
      held, snap = [], None
    elif op == "clear":
      a.clear()
      held, snap = [], None
    lists = len(a.free_pages) + len(a.release_pages)
    assert a.available_size() == lists * ps == a.size - sum(x.size for x in held)
