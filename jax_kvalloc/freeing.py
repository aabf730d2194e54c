"""Giving slots back: `free` (SPEC 3 and 4.4) and `merge_and_sort_free` (SPEC 6)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kvalloc import debug
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

Array = jax.Array


def merge_and_sort_free(config: AllocatorConfig, state: AllocatorState) -> AllocatorState:
  """free_pages = sort(free_pages ++ release_pages); release_pages = [] (SPEC 6).

  A no-op when release_pages is empty (the result is then the same state). O(num_pages
  log num_pages): only a shortfall or an explicit call runs it.
  """
  del config
  n = state.free_ring.shape[0]
  both = jnp.concatenate([
      st.ring_window(state.free_ring, state.free_head, state.free_len, n, st.SENTINEL),
      st.ring_window(state.release_ring, state.release_head, state.release_len, n,
                     st.SENTINEL),
  ])
  merged = jnp.sort(both)[:n]
  total = state.free_len + state.release_len
  merged = jnp.where(jnp.arange(n) < total, merged, 0)
  has_released = state.release_len > 0
  return state._replace(
      free_ring=jnp.where(has_released, merged, state.free_ring),
      free_head=jnp.where(has_released, 0, state.free_head),
      free_len=total,
      release_head=jnp.zeros((), jnp.int32),  # separate buffers, so that they can be
      release_len=jnp.zeros((), jnp.int32),   # donated when this runs eagerly
  )


def maybe_merge(config: AllocatorConfig, state: AllocatorState,
                shortfall: Array) -> AllocatorState:
  """Merges when need_sort is on and `shortfall` (bool[]) holds; else returns `state`."""
  if not config.need_sort:
    return state
  return jax.lax.cond(shortfall & (state.release_len > 0),
                      lambda s: merge_and_sort_free(config, s), lambda s: s, state)


def free(config: AllocatorConfig, state: AllocatorState, free_index: Array) -> AllocatorState:
  """Returns slots to the pool (SPEC 3 token allocator, SPEC 4.4 paged allocator).

  Paged (kind="paged"): the sorted unique pages `unique(free_index // page_size)` are
  prepended to release_pages (need_sort) or free_pages: LIFO, and freeing any slot of a
  page frees the whole page. Token (kind="token"): the slots are appended, in the order
  given, without de-duplication: FIFO.

  Args:
    config: static configuration.
    state: the pool.
    free_index: i32[M] slot indices (an integer dtype; TypeError otherwise). Entries that
      name page 0 (the padding sink, so 0 is the padding value) or lie outside the pool
      are ignored; in debug mode any such entry other than 0, or a double free, is an
      error (recorded in state.debug) and the call frees nothing.

  Returns:
    The new state. An all-padding `free_index` returns an equal state. Frees that would
    overflow the pool (only possible through double frees, which debug mode reports) are
    cut to fit, so the lists never overwrite one another's entries.
  """
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  ps = config.page_size
  n = config.num_pages
  if config.kind == "paged":
    pages = jnp.where(free_index >= 0, free_index // ps, 0)
    valid = (pages >= 1) & (pages <= n)
    pages = jnp.sort(jnp.where(valid, pages, st.SENTINEL))
    is_first = jnp.concatenate([jnp.ones((1,), bool), pages[1:] != pages[:-1]])
    values, count = st.compact(pages, is_first & (pages != st.SENTINEL))
  else:
    valid = (free_index >= 1) & (free_index <= n)
    values, count = st.compact(free_index, valid)
  if config.debug:
    state, count = debug.finish_free(config, state, free_index, values, count)
  room = n - state.free_len - state.release_len
  count = jnp.minimum(count, room)

  if config.need_sort:
    ring, head, length = state.release_ring, state.release_head, state.release_len
  else:
    ring, head, length = state.free_ring, state.free_head, state.free_len
  if config.kind == "paged":
    ring, head = st.ring_push_front(ring, head, values, count)
  else:
    ring = st.ring_push_back(ring, head, length, values, count)
  length = length + count
  if config.need_sort:
    return state._replace(release_ring=ring, release_head=head, release_len=length)
  return state._replace(free_ring=ring, free_head=head, free_len=length)
