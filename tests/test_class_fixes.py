"""Regressions of the class layer's review (issue 21): free groups over data-parallel
ranks, set_state's value checks, restore_state of ranks all or nothing, and
attention_inputs' num_seqs with rows outside the table."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import ranks
from jax_kvalloc import request_table as rt

PS = 4
SIZE = 64 * PS   # 32 pages per rank at dp_size 2


def _paged(**kw):
  return kvs.PagedTokenToKVPoolAllocator(SIZE, PS, kernel="jnp", debug=False, **kw)


@pytest.mark.parametrize("backend", ["device", "host"])
def test_clear_of_one_rank_keeps_the_group_open_for_the_others(backend):
  a = _paged(dp_size=2, backend=backend)
  full = a.available_size(dp_rank=1)
  held = [np.asarray(a.alloc(2 * PS, dp_rank=r)) for r in (0, 1)]
  a.free_group_begin()
  a.free(held[0], dp_rank=0)
  a.free(held[1], dp_rank=1)
  a.clear(dp_rank=0)                 # rank 0 back to its start, its queued free dropped
  assert not a.is_not_in_free_group  # the group still spans rank 1
  with pytest.raises(RuntimeError):  # and cannot be opened twice, on no rank
    a.free_group_begin()
  a.free_group_end()                 # rank 1's queued free comes back
  assert a.is_not_in_free_group
  assert a.available_size(dp_rank=0) == a.available_size(dp_rank=1) == full
  a.free_group_begin()               # a fresh group opens on every rank
  a.free_group_end()


def test_clear_of_every_rank_closes_the_group():
  a = _paged(dp_size=2)
  a.free_group_begin()
  a.clear()
  assert a.is_not_in_free_group
  a = _paged()                       # dp_size 1: clearing rank 0 clears every rank
  a.free_group_begin()
  a.clear(dp_rank=0)
  assert a.is_not_in_free_group


@pytest.mark.parametrize("backend", ["device", "host"])
def test_set_state_refuses_lengths_beyond_the_pool(backend):
  a = _paged(backend=backend)
  a.alloc(4 * PS)
  before = (a.available_size(), np.asarray(a.free_pages).tolist())
  state = kv.init(a.config)          # a state of the right shapes and dtypes
  for field, value in (("release_len", 5), ("free_len", -1), ("free_head", 64),
                       ("release_head", -2)):
    bad = state._replace(**{field: jnp.asarray(value, jnp.int32)})
    with pytest.raises(ValueError, match=f"state.{field}"):
      a.set_state(bad)
    assert (a.available_size(), np.asarray(a.free_pages).tolist()) == before
  a.set_state(state)                 # the same state with valid lengths is taken
  assert a.available_size() == SIZE


def test_set_state_of_ranks_is_all_or_nothing():
  a = _paged(dp_size=2)
  a.alloc(2 * PS, dp_rank=0)
  good = kv.init(ranks.rank_config(a.config, 2))
  bad = good._replace(release_len=jnp.asarray(3, jnp.int32))  # 32 + 3 > 32 pages
  with pytest.raises(ValueError, match="state.free_len \\+ state.release_len"):
    a.set_state(ranks.stack_ranks([good, bad]))
  assert a.available_size(dp_rank=0) == SIZE // 2 - 2 * PS  # rank 0 not taken either


@pytest.mark.parametrize("backend", ["device", "host"])
def test_restore_state_of_ranks_is_all_or_nothing(backend):
  a = _paged(dp_size=2, backend=backend)
  snap = a.backup_state()
  a.alloc(2 * PS, dp_rank=0)
  a.alloc(2 * PS, dp_rank=1)
  other = _paged(backend=backend).backup_state()  # a snapshot of another config
  bad = snap._replace(ranks=(snap.ranks[0], other))
  with pytest.raises((TypeError, ValueError)):
    a.restore_state(bad)
  assert [a.available_size(dp_rank=r) for r in (0, 1)] == [SIZE // 2 - 2 * PS] * 2
  a.restore_state(snap)
  assert [a.available_size(dp_rank=r) for r in (0, 1)] == [SIZE // 2] * 2


def test_attention_inputs_counts_only_rows_of_the_table():
  cfg = kv.AllocatorConfig(size=64, page_size=4)
  table = rt.init_table(cfg, 2, 4)
  att_fn = jax.jit(functools.partial(rt.attention_inputs, cfg))  # one compile
  # Rows 0 and 1 are in the table, row 5 and row -1 are not; all four are "real".
  att = att_fn(table, jnp.array([0, 5, 1, -1]), jnp.array([1, 1, 1, 1]), num_rows=4)
  np.testing.assert_array_equal(att.kv_lens, [0, 0, 0, 0])
  np.testing.assert_array_equal(att.num_seqs, [2])
  att = att_fn(table, jnp.array([0, 1, 9, 9]), jnp.array([1, 2, 3, 3]), num_rows=2)
  np.testing.assert_array_equal(att.num_seqs, [2])
  np.testing.assert_array_equal(att.cu_q_lens, [0, 1, 3, 3, 3])
