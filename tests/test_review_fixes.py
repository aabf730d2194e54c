"""Regressions of issue 42's review, each first reproduced: (1) the host SWA backend's
merge after a snapshot wrote inside the snapshot; (2) a refusal raised at
`free_group_end` left the group open; (3) a functional SWA free whose full side is
refused left its SWA side freed; (4) borrowing a page that is not held was accepted;
(5) a device-backend free of host data naming a page never handed out raises at the
first call after its status has landed, not at once (the README says so)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import ranks
from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc import swa as core
from jax_kvalloc import swa_table
from landed import settle

PS = 4
NOT_HELD = r"is not held \(free, released, or never handed out\)"


def _swa_class(backend, ps, need_sort=True, **kw):
  return kvs.SWATokenToKVPoolAllocator(16 * ps, 16 * ps, ps, need_sort=need_sort,
                                       kernel="jnp", debug=False, backend=backend, **kw)


def _take(a, n, dp_rank=0):
  """n slots of one new request (alloc at page size 1, else one alloc_extend row)."""
  if a.page_size == 1:
    return np.asarray(a.alloc(n, dp_rank=dp_rank))
  z, s = np.zeros(1, np.int64), np.array([n], np.int64)
  return np.asarray(a.alloc_extend(z, z, s, s, np.array([-1], np.int64), n,
                                   dp_rank=dp_rank))


def _swa_contents(a, r=0):
  """Both pools' lists and the mapping of rank r's state, host lists."""
  state = jax.tree.map(np.asarray, a._pools[r].state)  # pylint: disable=protected-access
  return tuple(st.live_free_pages(p).tolist() + [-1] + st.live_release_pages(p).tolist()
               for p in (state.full, state.swa)) + (np.asarray(state.mapping).tolist(),)


# -- 1. the host SWA backend's merge after backup_state ------------------------------------
@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("ps", [1, PS])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_swa_merge_after_a_snapshot_leaves_the_snapshot_as_it_was(backend, ps, dp_size):
  a = _swa_class(backend, ps, dp_size=dp_size)
  r = dp_size - 1
  x, y = _take(a, 2 * ps, r), _take(a, 2 * ps, r)
  a.free(x, dp_rank=r)                 # on the release list (need_sort)
  snap = a.backup_state()
  at_snap = _swa_contents(a, r)
  a.merge_and_sort_free(dp_rank=r)     # builds fresh rings; the rest of the state must
  a.free(y, dp_rank=r)                 # not be written inside the snapshot either
  a.restore_state(snap)
  assert _swa_contents(a, r) == at_snap
  a.free(y, dp_rank=r)                 # held at the snapshot: a legal free
  a.restore_state(snap)
  with pytest.raises(ValueError, match="free"):
    a.free(x, dp_rank=r)               # freed before the snapshot: refused
    settle(a, r)
  a.restore_state(snap)
  assert _swa_contents(a, r) == at_snap


# -- 2. a refusal raised at free_group_end closes the group --------------------------------
def _paged(backend, **kw):
  return kvs.PagedTokenToKVPoolAllocator(16 * PS, PS, kernel="jnp", debug=False,
                                         backend=backend, **kw)


def _wait_for_statuses(a):
  for pool in a._pools:  # pylint: disable=protected-access
    if pool.backend.defers_status:
      jax.block_until_ready(pool.backend.running)


def _make(cls, backend):
  return _paged(backend) if cls == "paged" else _swa_class(backend, PS, need_sort=False)


@pytest.mark.parametrize("backend", ["host", "device"])
def test_a_refusal_inside_a_group_raised_again_at_free_group_end_closes_it(backend):
  # SWA class: a segment free in a group takes its SWA half at call time; one without an
  # SWA peer is refused there (host: at once; device: at the first call after its status
  # landed, here free_group_end), and free_group_end raises it and closes the group.
  a = _make("swa", backend)
  held, other = _take(a, 2 * PS), _take(a, 2 * PS)
  a.free_swa(other)                    # its SWA side freed: a segment free is refused
  snap = a.backup_state()
  full = a.available_size()
  a.free_group_begin()
  a.free(held)
  try:
    a.free_segment(other, start_pos=0)  # no SWA peer
  except ValueError:
    pass
  _wait_for_statuses(a)
  with pytest.raises(ValueError, match="no SWA peer"):
    a.free_group_end()
  assert a.is_not_in_free_group
  a.restore_state(snap)
  a.free_group_begin()
  a.free_group_end()
  assert settle(a) == full
  a.free(held)
  assert settle(a) == full + 2 * PS


# -- 3. functional SWA: a refused full side frees nothing -----------------------------------
CFG = core.SWAConfig(16 * PS, 16 * PS, PS, False, kernel="jnp", debug=False)


def _functional_state():
  """A state with one request of 3 pages in both pools, then its full side freed alone
  (free_full): its full pages are not held, its SWA peers are. Returns (state, slots)."""
  state = core.init(CFG)
  z = jnp.zeros((1,), jnp.int32)
  state, slots, ok = core.alloc_extend(CFG, state, z, jnp.array([3 * PS]),
                                       jnp.array([-1]), max_tokens=3 * PS)
  assert bool(ok)
  return core.free_full(CFG, state, slots), slots


def _arrays(state):
  return [np.asarray(x).tolist() for x in jax.tree.leaves(state)]


def _full_status(state):
  return np.asarray(state.full.guard.status).tolist()


@pytest.mark.parametrize("op", ["free", "free_segment"])
def test_functional_swa_free_refused_by_the_full_pool_changes_nothing(op):
  before, slots = _functional_state()
  if op == "free":
    after = jax.jit(lambda s, i: core.free(CFG, s, i))(before, slots)
  else:
    after = jax.jit(lambda s, i: core.free_segment(CFG, s, i, jnp.int32(0)))(before, slots)
  assert _full_status(after)[0] != 0   # the full pool refused (its status says so)
  assert _arrays(after.swa) == _arrays(before.swa)
  assert np.asarray(after.mapping).tolist() == np.asarray(before.mapping).tolist()
  assert _arrays(after.full._replace(guard=None)) == _arrays(before.full._replace(guard=None))


def test_functional_swa_free_accepted_by_both_pools_frees_both():
  state = core.init(CFG)
  z = jnp.zeros((1,), jnp.int32)
  state, slots, _ = core.alloc_extend(CFG, state, z, jnp.array([3 * PS]),
                                      jnp.array([-1]), max_tokens=3 * PS)
  after = core.free(CFG, state, slots)
  assert int(after.full.free_len) == int(after.swa.free_len) == 16
  assert not np.asarray(after.mapping)[np.asarray(slots)].any()


def test_functional_release_rows_refused_by_the_full_pool_changes_nothing():
  table = swa_table.init_table(CFG, 4, 8)
  state = core.init(CFG)
  rows = jnp.array([1], jnp.int32)
  state, table, slots, ok = swa_table.extend_rows(CFG, state, table, rows,
                                                  jnp.array([3 * PS]), max_tokens=3 * PS)
  assert bool(ok)
  before = core.free_full(CFG, state, slots)  # the full side freed behind the table
  after, table_after, ok = swa_table.release_rows(CFG, before, table, rows)
  assert not bool(ok) and _full_status(after)[0] != 0
  assert _arrays(after.swa) == _arrays(before.swa)
  assert np.asarray(after.mapping).tolist() == np.asarray(before.mapping).tolist()
  assert _arrays(table_after) == _arrays(table)


@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("op", ["free", "free_segment"])
def test_swa_class_free_refused_by_the_full_pool_changes_nothing(backend, op):
  a = _swa_class(backend, PS, need_sort=False)
  held = _take(a, 3 * PS)
  a.free_full(held)                    # the full side alone: the SWA peers stay
  before = _swa_contents(a)
  with pytest.raises(ValueError, match=NOT_HELD + " in the full pool"):
    if op == "free":
      a.free(held)
    else:
      a.free_segment(held, start_pos=0)
    settle(a)
  assert _swa_contents(a) == before


# -- 4. borrows consult the ownership record ------------------------------------------------
def _table_case():
  """A pool of 16 pages with row 0 holding pages 1, 2 (8 tokens), and a table of 4 rows."""
  cfg = kv.AllocatorConfig(size=16 * PS, page_size=PS, kernel="jnp", debug=False)
  state, table = kv.init(cfg), rt.init_table(cfg, 4, 4)
  state, table, _, ok = rt.extend_rows(cfg, state, table, jnp.array([0]),
                                       jnp.array([2 * PS]), max_tokens=2 * PS)
  assert bool(ok)
  return cfg, state, table


@pytest.mark.parametrize("ranked", [False, True])
def test_borrow_pages_refuses_a_page_that_is_not_held(ranked):
  cfg, state, table = _table_case()
  borrow = jax.jit(rt.borrow_pages, static_argnums=0)
  if ranked:
    borrow = jax.jit(ranks.borrow_pages, static_argnums=0)
    state, table = ranks.stack_ranks([state, state]), jax.tree.map(
        lambda x: jnp.stack([x, x]), table)
    cfg = dataclasses.replace(cfg, size=2 * cfg.size)
  lead = (lambda x: jnp.stack([x, x])) if ranked else (lambda x: x)
  for ids, good in (([1, 2], True),        # held by row 0
                    ([1, 5], False),       # page 5 is free
                    ([3, 0], False)):      # page 3 is free
    t2, ok = borrow(cfg, state, table, lead(jnp.array([1])), lead(jnp.array([ids])),
                    lead(jnp.array([2])))
    assert np.asarray(ok).all() == good, ids
    if not good:
      chex_equal(t2, table)
  # Only the pages borrowed count: page 5 beyond num_pages is not looked at.
  _, ok = borrow(cfg, state, table, lead(jnp.array([1])), lead(jnp.array([[1, 5]])),
                 lead(jnp.array([1])))
  assert np.asarray(ok).all()


def test_borrow_from_rows_refuses_a_page_that_is_not_held():
  cfg, state, table = _table_case()
  borrow = jax.jit(rt.borrow_from_rows, static_argnums=0, static_argnames="hand_over")
  _, ok = borrow(cfg, state, table, jnp.array([1]), jnp.array([0]), jnp.array([2]))
  assert bool(ok)
  freed, table_freed, ok = rt.release_rows(cfg, state, table, jnp.array([0]))
  assert bool(ok)
  # Row 0's pages freed behind a stale table (its row still listing them): refused.
  t2, ok = borrow(cfg, freed, table, jnp.array([1]), jnp.array([0]), jnp.array([2]))
  assert not bool(ok)
  chex_equal(t2, table)
  t2, ok = borrow(cfg, freed, table, jnp.array([1]), jnp.array([0]), jnp.array([2]),
                  hand_over=True)
  assert not bool(ok)
  del table_freed


def chex_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- 5. what the README says of a free of host data never handed out -------------------------
@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("form", ["numpy", "list"])
@pytest.mark.parametrize("cls", ["paged", "token"])
def test_free_of_host_data_never_handed_out(backend, form, cls):
  # Host backend: raises at once. Device backend (the record is on the device): not at
  # the call, but at the first call after its status has landed (README, SPEC 14).
  if cls == "paged":
    a, page = _paged(backend), 12
    a.alloc(2 * PS)
  else:
    a = kvs.TokenToKVPoolAllocator(16, kernel="jnp", debug=False, backend=backend)
    a.alloc(2)
    page = 12
  slots = [page * a.page_size]
  arg = np.array(slots, np.int64) if form == "numpy" else slots
  before = a.available_size()
  if backend == "host":
    with pytest.raises(ValueError, match=rf"^free: page {page} {NOT_HELD}"):
      a.free(arg)
  else:
    a.free(arg)                        # returns: the record is on the device
    _wait_for_statuses(a)
    with pytest.raises(ValueError, match=rf"^free: page {page} {NOT_HELD}"):
      a.available_size()               # the first call after it landed
  with pytest.raises(ValueError, match=rf"^free: page {page}"):
    a.available_size()                 # sticky
  a.clear()
  assert a.available_size() == before + 2 * a.page_size
