"""The allocator state pytree and the fixed-capacity ring buffers it is made of.

Layout. `free_pages` and `release_pages` are each a ring buffer (a fixed-capacity deque)
of capacity `num_pages` with a head and a length, because SGLang's lists are used as
deques: allocation takes from the front, the paged `free` prepends (LIFO), the token
`free` appends (FIFO). On a ring every one of those is O(work):

  take k from the front    head += k, len -= k            no array write at all
  prepend m                head -= m, write m entries      O(m) scatter
  append m                 write m entries, len += m       O(m) scatter
  merge_and_sort_free      sort both lists into one        O(num_pages log num_pages)

Nothing scans the pool, and an allocation never writes the lists. Under `jax.jit` with the
state donated, XLA performs the scatters in place. A flat array with a moving head would
need room on both sides of it; the ring needs none and is never longer than the pool.
Indices into a ring are always taken modulo its capacity, so no read or write of the
state can leave its arrays, whatever the lengths say.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import debug as _debug
from jax_kvalloc import guard as _guard
from jax_kvalloc.config import AllocatorConfig

Array = jax.Array

# Sorts after every page id; fills the unused tail of sorted scratch arrays.
SENTINEL = np.int32(2**31 - 1)


class AllocatorState(NamedTuple):
  """State of one pool. Capacities come from the array shapes; nothing static lives here.

  The free list is `free_ring[(free_head + i) % num_pages]` for i < free_len; likewise the
  release list. `debug` is None unless the config has debug=True (jax_kvalloc.debug);
  `guard`, the ownership record, is None when the config has guard=False
  (jax_kvalloc.guard).
  """
  free_ring: Array      # i32[num_pages] ring buffer of free page ids
  free_head: Array      # i32[] index of the first free page in free_ring
  free_len: Array       # i32[] number of free pages
  release_ring: Array   # i32[num_pages] ring buffer of released pages (need_sort)
  release_head: Array   # i32[]
  release_len: Array    # i32[]
  debug: Optional[_debug.DebugState] = None  # debug-mode bookkeeping; None when off
  guard: Optional[_guard.GuardState] = None  # held pages + first refusal; None when off


def init(config: AllocatorConfig) -> AllocatorState:
  """The initial state (SPEC 2): free_pages = [1, ..., num_pages], release_pages = []."""
  n = config.num_pages
  # Every field gets its own buffer: aliased leaves could not be donated.
  return AllocatorState(
      free_ring=jnp.arange(1, n + 1, dtype=jnp.int32),
      free_head=jnp.zeros((), jnp.int32),
      free_len=jnp.full((), n, jnp.int32),
      release_ring=jnp.zeros((n,), jnp.int32),
      release_head=jnp.zeros((), jnp.int32),
      release_len=jnp.zeros((), jnp.int32),
      debug=_debug.init(config) if config.debug else None,
      guard=_guard.init(n) if config.guard else None,
  )


def record(config: AllocatorConfig, state: AllocatorState) -> Optional[_guard.GuardState]:
  """The state's ownership record (None when config.guard is off); ValueError when the
  state does not match the config (a state built without its record)."""
  if config.guard != (state.guard is not None):
    raise ValueError(
        f"config.guard={config.guard}, but the state {'has no' if config.guard else 'has an'}"
        " ownership record: build states with init(config) (or with_record for a state "
        "assembled by hand)")
  return state.guard


def with_record(config: AllocatorConfig, state: AllocatorState) -> AllocatorState:
  """`state` with its ownership record rebuilt from its lists (every page in neither
  list held, no refusal), or dropped when config.guard is off; for states assembled by
  hand (tests, benchmarks); a single pool."""
  if not config.guard:
    return state._replace(guard=None)
  return state._replace(guard=_guard.GuardState(held=held_from_lists(state),
                                                status=jnp.zeros((3,), jnp.int32)))


def held_from_lists(state: AllocatorState) -> Array:
  """The ownership record's held (i32[num_pages + 1]) of a state's lists, traced: 1 for
  every page in neither list, 0 for page 0 and the listed pages. O(num_pages); the
  jitted twin of `with_record` (a single pool)."""
  n = state.free_ring.shape[0]
  i = jnp.arange(n, dtype=jnp.int32)
  free = jnp.where(i < state.free_len, state.free_ring[(state.free_head + i) % max(n, 1)],
                   n + 1)
  released = jnp.where(i < state.release_len,
                       state.release_ring[(state.release_head + i) % max(n, 1)], n + 1)
  held = jnp.ones((n + 1,), jnp.int32).at[0].set(0)
  return held.at[free].set(0, mode="drop").at[released].set(0, mode="drop")


def available_size(config: AllocatorConfig, state: AllocatorState) -> Array:
  """Free slots, released ones included: (len(free) + len(release)) * page_size. i32[]."""
  return (state.free_len + state.release_len) * config.page_size


def freed_list(need_sort: bool, state: AllocatorState) -> Tuple[Any, Any, Any, Any]:
  """(ring, head, length, other list's length) of the list that frees write: release_pages
  when need_sort, else free_pages (SPEC 4.4). The other length bounds the room left."""
  if need_sort:
    return state.release_ring, state.release_head, state.release_len, state.free_len
  return state.free_ring, state.free_head, state.free_len, state.release_len


def with_freed_list(need_sort: bool, state: AllocatorState, ring: Any, head: Any,
                    length: Any) -> AllocatorState:
  """`state` with the list that frees write (see `freed_list`) replaced."""
  if need_sort:
    return state._replace(release_ring=ring, release_head=head, release_len=length)
  return state._replace(free_ring=ring, free_head=head, free_len=length)


# ---------------------------------------------------------------------------------------
# Ring buffer primitives. `ring` is i32[C]; head and length are i32[] scalars.
#
# Each takes an array namespace `xp`: jax.numpy (default; traced, padded, masked) or numpy
# (the classes' host backend, jax_kvalloc.sglang.backends.host: exact lengths, Python-int heads, and
# the ring is WRITTEN IN PLACE, so the caller copies it first when a snapshot shares it).
# ---------------------------------------------------------------------------------------

def ring_window(ring: Array, head: Array, length: Array, n: int,
                fill: int | np.integer = 0, xp: Any = jnp) -> Array:
  """The first `n` (static) entries of a ring, in order; entries at i >= length are `fill`.

  Returns i32[n]. O(n) gather; every read index is inside the ring. With numpy, a window
  that does not wrap is a view of the ring (read it before the ring is written again).
  """
  cap = ring.shape[0]
  if cap == 0:
    return xp.full((n,), fill, xp.int32)
  if xp is np and n <= length:  # host: exact window, usually one contiguous slice
    head = int(head)
    if head + n <= cap:
      return ring[head:head + n]
    return np.concatenate([ring[head:], ring[:head + n - cap]])
  i = xp.arange(n, dtype=xp.int32)
  vals = ring[(head + i) % cap]
  return xp.where(i < length, vals, xp.asarray(fill, xp.int32))


def _ring_write(ring: Array, start: Array, values: Array, count: Array, xp: Any) -> Array:
  """ring[(start + j) % cap] = values[j] for j < count. O(M)."""
  cap = ring.shape[0]
  if xp is np:  # host: count == len(values), at most two contiguous slices, in place
    start, count = int(start) % max(cap, 1), int(count)
    first = min(count, cap - start)
    ring[start:start + first] = values[:first]
    ring[:count - first] = values[first:count]
    return ring
  j = jnp.arange(values.shape[0], dtype=jnp.int32)
  pos = jnp.where(j < count, (start + j) % cap, cap)  # cap is out of range: dropped
  return ring.at[pos].set(values, mode="drop")


def ring_push_front(ring: Array, head: Array, values: Array, count: Array, xp: Any = jnp):
  """Prepends values[:count] (in order) to the ring. Returns (ring, new_head).

  values is i32[M]; entries at j >= count are not written. O(M) scatter.
  """
  cap = ring.shape[0]
  new_head = (head - count) % max(cap, 1)
  return _ring_write(ring, new_head, values, count, xp), new_head


def ring_push_back(ring: Array, head: Array, length: Array, values: Array, count: Array,
                   xp: Any = jnp):
  """Appends values[:count] (in order) after the ring's last entry. Returns the ring."""
  return _ring_write(ring, head + length, values, count, xp)


def compact(values: Array, keep: Array):
  """Moves values[keep] to the front, in order. Returns (i32[M] compacted, i32[] count).

  Entries past the count are 0. O(M): an exclusive prefix sum gives each kept entry its
  place.
  """
  keep = keep.astype(jnp.int32)
  pos = jnp.cumsum(keep) - keep
  pos = jnp.where(keep > 0, pos, values.shape[0])
  out = jnp.zeros_like(values).at[pos].set(values, mode="drop")
  return out, jnp.sum(keep)


# ---------------------------------------------------------------------------------------
# Host-side views, for the SGLang-compatible classes and for tests.
# ---------------------------------------------------------------------------------------

def live_free_pages(state: AllocatorState) -> np.ndarray:
  """The free list in order, as a host numpy int32 array (syncs)."""
  return _live(state.free_ring, state.free_head, state.free_len)


def live_release_pages(state: AllocatorState) -> np.ndarray:
  """The release list in order, as a host numpy int32 array (syncs)."""
  return _live(state.release_ring, state.release_head, state.release_len)


def _live(ring, head, length) -> np.ndarray:
  ring = np.asarray(ring)
  cap = ring.shape[-1]
  if ring.ndim != 1:
    raise ValueError(f"expected the state of a single pool, got a ring of shape {ring.shape}")
  h, n = int(head), int(length)
  if cap == 0:
    return np.zeros((0,), np.int32)
  return np.array(ring[(h + np.arange(n)) % cap], dtype=np.int32)
