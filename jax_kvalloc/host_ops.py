"""The host backend: SGLang's operations on an `AllocatorState` held in NumPy.

For schedulers that live on the host (sglang-jax's setting) the classes accept
`backend="host"`: the state is an `AllocatorState` whose rings are numpy int32 arrays and
whose heads and lengths are Python ints, and every operation runs here, vectorized and
O(work) (no Python loop over requests or pages; nothing pool-sized except a merge).

The arithmetic is not a second copy: the slot indices come from
`jax_kvalloc.index_jnp` and the ring reads and writes from `jax_kvalloc.state`, called
with `xp=numpy`, the same functions the jitted device path calls with jax.numpy.

Contract of every function here: its arguments were validated by the class (the host
checks of jax_kvalloc.validate), the class has already decided that the call fits (it
keeps the lengths) and run any need_sort merge the shortfall triggers, and arrays are
exact-length int64 host arrays. Outputs are fresh numpy int32 arrays. Rings are written in
place; a ring that a snapshot still holds (`shared`) is copied first (copy-on-write), so
`backup_state` and an allocation never copy anything.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from jax_kvalloc import index_jnp
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

_EMPTY_WINDOW = np.zeros((1,), np.int32)  # read by index_jnp only where it is masked off


def init(config: AllocatorConfig) -> AllocatorState:
  """The initial state (SPEC 2) in numpy: free_pages = [1..num_pages], nothing released."""
  n = config.num_pages
  return AllocatorState(free_ring=np.arange(1, n + 1, dtype=np.int32), free_head=0,
                        free_len=n, release_ring=np.zeros((n,), np.int32), release_head=0,
                        release_len=0, debug=None)


def _take(config: AllocatorConfig, state: AllocatorState,
          k: int) -> Tuple[AllocatorState, np.ndarray]:
  """(state without the first k free pages, those pages: a view or copy, i32[k])."""
  pages = st.ring_window(state.free_ring, state.free_head, state.free_len, k, xp=np)
  state = state._replace(free_head=(state.free_head + k) % config.num_pages,
                         free_len=state.free_len - k)
  return state, pages


def alloc(config: AllocatorConfig, state: AllocatorState,
          need_size: int) -> Tuple[AllocatorState, np.ndarray]:
  """`need_size` slots (a multiple of page_size) off the front of the free list (SPEC 3,
  4.1). Returns (state, i32[need_size])."""
  ps = config.page_size
  state, pages = _take(config, state, need_size // ps)
  if ps == 1:
    return state, np.array(pages, np.int32)
  out = pages[:, None] * ps + np.arange(ps, dtype=np.int32)
  return state, out.reshape(-1)


def alloc_extend(config: AllocatorConfig, state: AllocatorState, pre: np.ndarray,
                 seq: np.ndarray, last: np.ndarray, total: int,
                 new_pages: int) -> Tuple[AllocatorState, np.ndarray]:
  """A prefill batch's slots (SPEC 4.2). pre/seq/last: i64[bs]; total = sum(seq - pre),
  new_pages its page count (both from validate.extend_args). Returns (state,
  i32[total]).

  index_jnp.extend_indices' rule (each request: Part 1 from last_loc + 1, then its new
  pages in order) in a host form that does per-token work only three times: the output
  is runs of consecutive slots (a request's Part 1; each new page), so it is
  arange(total) plus each run's offset repeated over the run. Everything else is per
  request or per page. tests/test_host_backend.py checks it against extend_indices.
  """
  ps = config.page_size
  bs = pre.shape[0]
  ext = seq - pre
  first_new = -(-pre // ps)                      # ceil(pre / ps)
  part1 = np.minimum(ext, first_new * ps - pre)  # the rest of the current page
  per_row = -(-seq // ps) - first_new            # new pages per request
  tok_start = np.cumsum(ext) - ext
  page_start = np.cumsum(per_row) - per_row
  state, window = _take(config, state, new_pages)
  owner = np.repeat(np.arange(bs), per_row)      # request of each new page
  k = np.arange(new_pages) - page_start[owner]   # the page's rank within its request
  # Runs in output order: request r's Part 1 run, then its page runs.
  starts = np.empty((bs + new_pages,), np.int64)
  lens = np.empty((bs + new_pages,), np.int64)
  pos = np.empty((bs + new_pages,), np.int64)
  r1 = page_start + np.arange(bs)
  starts[r1], lens[r1], pos[r1] = last + 1, part1, tok_start
  r2 = np.arange(new_pages) + owner + 1
  run_pos = tok_start[owner] + part1[owner] + k * ps
  starts[r2] = window * ps
  lens[r2] = np.minimum(ps, tok_start[owner] + ext[owner] - run_pos)
  pos[r2] = run_pos
  out = np.repeat(starts - pos, lens) + np.arange(total)
  return state, out.astype(np.int32)


def decode_pages(config: AllocatorConfig, seq: np.ndarray) -> Tuple[np.ndarray, int]:
  """(bool[bs] rows whose new token starts a page, their count) for alloc_decode."""
  # ceil(seq/ps) > ceil((seq-1)/ps) (SPEC 4.3) is, for seq >= 1, (seq - 1) % ps == 0.
  needs = (seq - 1) % config.page_size == 0
  return needs, int(np.count_nonzero(needs))


def alloc_decode(config: AllocatorConfig, state: AllocatorState, seq: np.ndarray,
                 last: np.ndarray, needs: np.ndarray,
                 k: int) -> Tuple[AllocatorState, np.ndarray]:
  """One slot per request (SPEC 4.3). seq/last: i64[bs]; needs, k from `decode_pages`.
  Returns (state, i32[bs]).

  index_jnp.decode_indices' rule in its host form: the rows that need a page take the
  first k free pages in batch order, which on the host is one boolean-mask assignment
  (no prefix sum or gather needed).
  """
  del seq
  out = (last + 1).astype(np.int32)
  if k:
    state, window = _take(config, state, k)
    out[needs] = window * config.page_size
  return state, out


def _push(config: AllocatorConfig, state: AllocatorState, values: np.ndarray,
          shared: bool, front: bool) -> AllocatorState:
  """Prepends (front) or appends values to release_pages (need_sort) or free_pages,
  cut to the room left (as the device path does; only double frees can overflow)."""
  room = config.num_pages - state.free_len - state.release_len
  count = min(values.shape[0], room)
  if count == 0:
    return state
  values = values[:count]
  name = "release" if config.need_sort else "free"
  ring = getattr(state, f"{name}_ring")
  head = getattr(state, f"{name}_head")
  length = getattr(state, f"{name}_len")
  if shared:
    ring = ring.copy()
  if front:
    ring, head = st.ring_push_front(ring, head, values, count, xp=np)
    head = int(head)
  else:
    ring = st.ring_push_back(ring, head, length, values, count, xp=np)
  return state._replace(**{f"{name}_ring": ring, f"{name}_head": head,
                           f"{name}_len": length + count})


def free_count(config: AllocatorConfig, idx: np.ndarray) -> Tuple[np.ndarray, int]:
  """(values to free, their count) of a validated `free` argument: the sorted unique
  pages (paged, SPEC 4.4) or the slots as given (token, SPEC 3)."""
  if config.kind == "paged":
    pages = np.unique(idx // config.page_size) if config.page_size > 1 else np.unique(idx)
    return pages, pages.shape[0]
  return idx, idx.shape[0]


def free(config: AllocatorConfig, state: AllocatorState, values: np.ndarray,
         shared: bool) -> AllocatorState:
  """`free` of the values `free_count` gave (LIFO prepend for paged, FIFO append for
  token). `shared`: the ring written is held by a snapshot (copy it first)."""
  return _push(config, state, values.astype(np.int32), shared,
               front=config.kind == "paged")


def free_page_ids(config: AllocatorConfig, state: AllocatorState, page_ids: np.ndarray,
                  shared: bool) -> AllocatorState:
  """SPEC 10: these pages, order kept, prepended as one block (token: appended)."""
  return _push(config, state, page_ids.astype(np.int32), shared,
               front=config.kind == "paged")


def merge_and_sort_free(config: AllocatorConfig, state: AllocatorState,
                        shared: bool) -> AllocatorState:
  """free_pages = sort(free_pages ++ release_pages), release_pages = [] (SPEC 6); the
  caller runs it only when release_pages is non-empty. `shared`: the free ring is held
  by a snapshot (a new one is built either way, so nothing is copied twice)."""
  del shared  # the merged list goes into a fresh array
  n = config.num_pages
  both = np.concatenate([
      st.ring_window(state.free_ring, state.free_head, state.free_len, state.free_len,
                     xp=np),
      st.ring_window(state.release_ring, state.release_head, state.release_len,
                     state.release_len, xp=np)])
  both.sort()
  ring = np.zeros((n,), np.int32)
  ring[:both.shape[0]] = both
  return state._replace(free_ring=ring, free_head=0, free_len=both.shape[0],
                        release_head=0, release_len=0)


def from_jax(state: AllocatorState) -> AllocatorState:
  """A host-backend state (writable numpy rings, int heads and lengths) from a jax one
  (reads the device). Debug bookkeeping is dropped: the host backend keeps none."""
  return AllocatorState(
      free_ring=np.array(state.free_ring, np.int32), free_head=int(state.free_head),
      free_len=int(state.free_len), release_ring=np.array(state.release_ring, np.int32),
      release_head=int(state.release_head), release_len=int(state.release_len), debug=None)


# ---------------------------------------------------------------------------------------
# Small batches as Python ints. numpy costs about a microsecond per call whatever the
# array size, so a batch of a few requests spends most of its time in call overhead; up
# to SMALL_BATCH requests the same rules run on Python ints instead (slots are written
# as runs of numpy slices, never token by token). Any argument these do not accept
# (wrong type, a value the checks refuse) returns None and the caller takes the general
# path, which validates and raises with the usual message (and takes batches of more
# than SMALL_PAGES new pages, whose pages the small path would walk one by one). tests/test_host_backend.py
# checks both paths against each other.
# ---------------------------------------------------------------------------------------

SMALL_BATCH = 8
SMALL_PAGES = 64  # alloc_extend_small walks the new pages in Python: keep them few
_INT32_MAX = 2**31 - 1


def small_ints(x) -> "list | None":
  """x as a list of Python ints when it is a 1-D integer numpy array or list of ints of
  1..SMALL_BATCH entries; None otherwise."""
  if type(x) is np.ndarray:
    if x.ndim == 1 and x.dtype.kind in "iu" and 0 < x.shape[0] <= SMALL_BATCH:
      return x.tolist()
    return None
  if type(x) is list and 0 < len(x) <= SMALL_BATCH and all(type(v) is int for v in x):
    return x
  return None


def decode_plan_small(config: AllocatorConfig, seq: list, last: list) -> "int | None":
  """Pages a small alloc_decode batch needs, or None if an argument fails a check."""
  ps, slots = config.page_size, config.num_slots
  if len(seq) != len(last):
    return None
  k = 0
  for s, l in zip(seq, last):
    if not (0 < s <= _INT32_MAX and -1 <= l < slots and (l + 2 - s) % ps == 0):
      return None
    k += (s - 1) % ps == 0  # the request's new token starts a page (SPEC 4.3)
  return k


def alloc_decode_small(config: AllocatorConfig, state: AllocatorState, seq: list,
                       last: list, k: int) -> Tuple[AllocatorState, np.ndarray]:
  """alloc_decode of a batch `decode_plan_small` accepted (k pages, known to fit)."""
  ps = config.page_size
  pages = []
  if k:
    state, pages = _take_list(config, state, k)
  out, j = [], 0
  for s, l in zip(seq, last):
    if (s - 1) % ps == 0:
      out.append(pages[j] * ps)
      j += 1
    else:
      out.append(l + 1)
  return state, np.array(out, np.int32)


def extend_plan_small(config: AllocatorConfig, pre: list, seq: list, last: list,
                      extend_num_tokens) -> "Tuple[int, int] | None":
  """(total tokens, new pages) of a small alloc_extend batch, or None if an argument
  fails a check (extend_num_tokens included)."""
  ps, slots = config.page_size, config.num_slots
  if not len(pre) == len(seq) == len(last) or type(extend_num_tokens) is not int:
    return None
  total = pages = 0
  for p, s, l in zip(pre, seq, last):
    if not (0 <= p <= s <= _INT32_MAX and -1 <= l < slots and (l + 1 - p) % ps == 0):
      return None
    total += s - p
    pages += -(-s // ps) + (-p // ps)
  if total != extend_num_tokens or pages > SMALL_PAGES:
    return None
  return total, pages


def _take_list(config: AllocatorConfig, state: AllocatorState,
               k: int) -> Tuple[AllocatorState, list]:
  """_take for the small paths: the pages as a list, the state rebuilt without the
  namedtuple's (slow) _replace."""
  ring, head, length = state.free_ring, state.free_head, state.free_len
  cap = ring.shape[0]
  if head + k <= cap:
    pages = ring[head:head + k].tolist()
  else:
    pages = ring[head:].tolist() + ring[:head + k - cap].tolist()
  return AllocatorState(ring, (head + k) % cap, length - k, *state[3:]), pages


def alloc_extend_small(config: AllocatorConfig, state: AllocatorState, pre: list,
                       seq: list, last: list, total: int,
                       new_pages: int) -> Tuple[AllocatorState, np.ndarray]:
  """alloc_extend (SPEC 4.2) of a batch `extend_plan_small` accepted, known to fit.

  The output is runs of consecutive slots: each request's Part 1 (from last_loc + 1),
  then its new pages (one run when they are consecutive page ids, as a fresh or
  LIFO-recycled free list mostly gives; else a run per page). It is built as
  arange(total) plus one constant per run: a numpy call per run, never per token.
  """
  ps = config.page_size
  state, pages = _take_list(config, state, new_pages)
  runs = []  # (output position, first slot, length)
  pos = page = 0
  for p, s, l in zip(pre, seq, last):
    ext = s - p
    if ext == 0:
      continue
    part1 = min(ext, -(-p // ps) * ps - p)
    if part1:
      runs.append((pos, l + 1, part1))
    rest = ext - part1
    if rest:
      n = -(-rest // ps)  # the request's new pages (Parts 2 and 3)
      mine = pages[page:page + n]
      at = pos + part1
      if mine[-1] - mine[0] == n - 1 and mine == list(range(mine[0], mine[0] + n)):
        runs.append((at, mine[0] * ps, rest))
      else:
        for q, pg in enumerate(mine):
          runs.append((at + q * ps, pg * ps, min(ps, rest - q * ps)))
      page += n
    pos += ext
  if len(runs) == 1:
    at, start, n = runs[0]
    return state, np.arange(start, start + n, dtype=np.int32)
  out = np.arange(total, dtype=np.int32)
  for at, start, n in runs:
    if start != at:
      out[at:at + n] += start - at
  return state, out
