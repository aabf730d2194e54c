"""Giving slots back: `free` (SPEC 3 and 4.4), `merge_and_sort_free` (SPEC 6), and
SGLang 0.5.23's newer frees (SPEC 10): `free_page_ids`, `free_segment` (no sort, O(pages
freed)), the `free_full*` aliases, and the `get_all_free_pages` census.

The paged `free` has several implementations with the same result (PAGED_FREE: XLA's
sort and bitmap, the Triton kernels); config.kernel picks one (jax_kvalloc.kernels).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import debug
from jax_kvalloc import gated
from jax_kvalloc import guard
from jax_kvalloc import kernels
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

Array = jax.Array

# XLA's two ways of finding `free`'s sorted unique pages (free_pages_sorted_unique). The
# bitmap costs O(num_pages + M) in a few fused kernels, the sort O(M log M) (on a GPU a
# chain of many small kernels); free_method takes the bitmap while num_pages <=
# BITMAP_RATIO * M, the ratio up to which the bitmap won on the 2-core CPU and at every
# H200 size measured.
XLA_METHODS = ("sort", "bitmap")
BITMAP_RATIO = 32


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
  """Merges when need_sort is on and `shortfall` (bool[]) holds; else returns `state`.

  A branch (lax.cond), also under vmap: over stacked pools (data-parallel ranks) the
  sort runs only in calls where some pool merges (jax_kvalloc.gated says how).
  """
  if not config.need_sort:
    return state

  def merge_where(s: AllocatorState, merge: Array) -> AllocatorState:
    merged = merge_and_sort_free(config, s)
    return jax.tree.map(lambda new, old: jnp.where(merge, new, old), merged, s)

  return gated.gated(merge_where)(state, shortfall & (state.release_len > 0))


def free(config: AllocatorConfig, state: AllocatorState,
         free_index: Array) -> AllocatorState:
  """Returns slots to the pool (SPEC 3 token allocator, SPEC 4.4 paged allocator).

  Paged (kind="paged"): the sorted unique pages `unique(free_index // page_size)` are
  prepended to release_pages (need_sort) or free_pages: LIFO, and freeing any slot of a
  page frees the whole page. Token (kind="token"): the slots are appended, in the order
  given, without de-duplication: FIFO.

  The implementation follows config.kernel (jax_kvalloc.kernels): the paged free runs
  the Triton kernels (one memset and three launches that also write the ring,
  `pallas_kernels.free_push_front_triton`) for the Triton family outside debug mode and
  for sizes `pallas_kernels.free_preferred` takes, else XLA's sort or bitmap
  (`free_method`). Every implementation gives the same state.

  Args:
    config: static configuration.
    state: the pool.
    free_index: i32[M] slot indices (an integer dtype; TypeError otherwise); 0 is
      padding. With the ownership record (config.guard, the default) an entry naming a
      page that is not held (another slot of page 0, a slot outside the pool, a free or
      released page; token allocator: also a slot given twice) refuses the whole call:
      nothing is freed and state.guard.status records it (jax_kvalloc.guard). Without
      it such entries are ignored (page 0, outside the pool) or freed as given; debug
      mode refuses them too and records them in state.debug.

  Returns:
    The new state. An all-padding `free_index` returns an equal state. Without the record,
    frees that would overflow the pool (only possible through double frees) are cut to
    fit, so the lists never overwrite one another's entries.
  """
  return _free(config, state, free_index, guard.OP_FREE)[0]


def free_refused(config: AllocatorConfig, state: AllocatorState, free_index: Array, *,
                 also_refuse: Optional[Array] = None) -> Tuple[AllocatorState, Array]:
  """`free`, also returning whether it was refused (bool[]: by the ownership record, or
  `also_refuse`, which refuses it without a status, e.g. a composite operation whose
  other part was refused)."""
  if also_refuse is not None:  # a refusal decided beforehand: nothing is given
    free_index = jnp.where(also_refuse, 0, validate.as_i32(free_index, "free_index"))
  state, refused = _free(config, state, free_index, guard.OP_FREE)
  return state, refused if also_refuse is None else refused | also_refuse


def free_method(num_pages: int, m: int) -> str:
  """XLA's way ("sort" or "bitmap") of finding the sorted unique pages for these static
  sizes: the bitmap when num_pages <= BITMAP_RATIO * m (its O(num_pages) share is then at
  most BITMAP_RATIO times the input) and num_pages <= 2**30 (the map's indices stay far
  inside int32), else the sort."""
  return "bitmap" if num_pages <= min(BITMAP_RATIO * m, 2**30) else "sort"


def free_pages_sorted_unique(pages: Array, num_pages: int,
                             method: Optional[str] = None) -> Tuple[Array, Array]:
  """The distinct pages of `pages` that lie in [1, num_pages], ascending (SPEC 4.4), in XLA.

  Args:
    pages: i32[M] page ids; entries outside [1, num_pages] (page 0, negatives, past the
      pool) are ignored.
    num_pages: the pool's pages (static).
    method: "sort" sorts the M ids, marks each first of a run, compacts: O(M log M).
      "bitmap" sets one bit per given page in a bitmap of num_pages + 1 bits (a scatter
      into bool[] and a reduction into u32 words), takes a prefix sum of the words'
      popcounts, and scatters each page to its place (the marked pages below it):
      O(num_pages + M), no sort. None: `free_method`'s rule. ValueError otherwise.

  Returns:
    (values, count): i32[M] with the pages in values[:count] and 0 after them, and
    i32[] count. Both methods return the same bits.
  """
  return _sorted_unique(pages, num_pages, method)[:2]


def _sorted_unique(pages: Array, num_pages: int, method: Optional[str],
                   named: Optional[Array] = None
                   ) -> Tuple[Array, Array, Array, Array, Optional[Array]]:
  """`free_pages_sorted_unique`, with what the ownership record reads
  (guard.free_by_page): (values, count, ids, stray, marks).

  ids: i32[M] each entry's id in the method's own pass: its page where in
  [1, num_pages], 0 where `named` (bool[M]) holds and the page is outside, above
  num_pages elsewhere (ignored). stray: bool[] whether any entry has id 0, read off the
  method's result (the sort's first key, the bitmap's bit 0, neither of them a page), so
  that the record costs no pass over the M entries. marks: the bitmap method's
  bool[>= num_pages + 1], True at the ids (None for the sort). Without `named`, exactly
  the unguarded program (no id 0, stray False)."""
  pages = validate.as_i32(pages, "pages").reshape(-1)
  m = pages.shape[0]
  n = num_pages
  valid = (pages >= 1) & (pages <= n)
  if method is None:
    method = free_method(n, m)
  if method not in XLA_METHODS:
    raise ValueError(f"method must be one of {XLA_METHODS} or None, got {method!r}")
  stray = jnp.zeros((), bool)
  if method == "sort":
    ids = jnp.where(valid, pages, st.SENTINEL if named is None else
                    jnp.where(named, 0, st.SENTINEL))
    pages = jnp.sort(ids)
    is_first = jnp.concatenate([jnp.ones((1,), bool), pages[1:] != pages[:-1]])
    keep = is_first & (pages != st.SENTINEL)
    if named is not None and m:
      stray, keep = pages[0] == 0, keep & (pages != 0)
    return (*st.compact(pages, keep), ids, stray, None)
  # One bit per page id 0..n, in u32 words; ignored entries go past the map (dropped).
  words_n = (n + 1 + 31) // 32
  drop = words_n * 32
  ids = jnp.where(valid, pages, drop if named is None else jnp.where(named, 0, drop))
  marks = _marks(words_n * 32, ids)
  bits = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  if named is not None:  # bit 0 (page 0) says a named entry was outside; not a page
    stray = marks[0]
    bits = jnp.where(jnp.arange(words_n)[:, None] * 32 + jnp.arange(32) == 0, 0, bits)
  words = jnp.sum(jnp.where(marks.reshape(words_n, 32), bits, jnp.uint32(0)), axis=1,
                  dtype=jnp.uint32)  # distinct bits: the sum is their OR
  per_word = jax.lax.population_count(words).astype(jnp.int32)
  before = _exclusive_prefix(per_word)  # marked pages in the words before each word
  # Page p's place: the marked pages below it, i.e. those of the earlier words and the
  # lower bits of its own word. Repeats of a page write the same value to the same
  # place (< M: at most M pages are marked), so any write that lands is exact; M drops.
  q = jnp.where(valid, pages, 0)
  word, bit = q >> 5, (q & 31).astype(jnp.uint32)
  below = jax.lax.population_count(words[word] & (jnp.left_shift(jnp.uint32(1), bit) - 1))
  slot = jnp.where(valid, before[word] + below.astype(jnp.int32), m)
  values = jnp.zeros((m,), jnp.int32).at[slot].set(pages, mode="drop")
  # The count from elements, not from one more reduction (kernel).
  return values, before[-1] + per_word[-1], ids, stray, marks


def _marks(size: int, ids: Array) -> Array:
  """bool[size]: True at ids (i32[M], >= 0; those >= size dropped). lax.scatter, not
  .at[]: jnp's wrap of negative indices would be a pass of its own over a materialized
  `ids` (the record's branch reads it too)."""
  dnums = jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                          scatter_dims_to_operand_dims=(0,))
  return jax.lax.scatter(jnp.zeros((size,), bool), ids[:, None],
                         jnp.ones(ids.shape, bool), dnums,
                         mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _exclusive_prefix(x: Array) -> Array:
  """i32[W] -> i32[W]: out[i] = sum(x[:i])."""
  return jnp.cumsum(x) - x


def _free(config: AllocatorConfig, state: AllocatorState, free_index: Array,
          op: int) -> Tuple[AllocatorState, Array]:
  """`free` and whether the ownership record refused it (bool[]; False without one),
  with the operation its records name (free_page_ids and free_segment of the token
  allocator are `free`)."""
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  n, m = config.num_pages, free_index.shape[0]
  if config.kind == "token":
    values, count = st.compact(free_index, (free_index >= 1) & (free_index <= n))
    err = None
    if config.debug:
      state, count, err = debug.finish_free(config, state, free_index, values, count,
                                            _debug_op(op))
    state, refused = _guard_free(config, state, op, free_index, free_index != 0,
                                 also_refuse=err)
    return _give_back(config, state, values, _unless(state, refused, count)), _flag(refused)
  if config.debug:  # the checks need XLA's (values, count)
    return _PAGED_FREE[free_method(n, m)](config, state, free_index, op=op)
  return kernels.by_device(
      config.kernel, state.free_ring,
      lambda name: _PAGED_FREE[paged_free_implementation(config, name, m)](
          config, state, free_index, op=op), "free")


def _debug_op(op: int) -> int:
  """The debug record's operation for a guard op (debug names the plain frees only)."""
  return {guard.OP_FREE_SEGMENT: debug.OP_FREE_SEGMENT,
          guard.OP_FREE: debug.OP_FREE}.get(op, debug.OP_FREE_PAGE_IDS)


def _guard_free(config: AllocatorConfig, state: AllocatorState, op: int, pages: Array,
                given: Array, also_refuse: Optional[Array] = None
                ) -> Tuple[AllocatorState, Array]:
  """guard.free(distinct=True) on the state's record (the frees that do not
  de-duplicate): (state, bool[] refused). Without a record, (state, also_refuse), None
  when nothing can refuse (so that guard=False traces exactly the unguarded program).
  Where a branch is cheap (kernels.by_branch_cost) guard.free_distinct, the same bits."""
  record = st.record(config, state)
  if record is None:
    return state, also_refuse

  def guarded(cheap_branch: bool):
    if cheap_branch:
      return guard.free_distinct(record, op, pages, given, also_refuse=also_refuse)
    return guard.free(record, op, pages, given, distinct=True, also_refuse=also_refuse)

  record, refused = kernels.by_branch_cost(state.free_ring, guarded)
  return state._replace(guard=record), refused


def _unless(state: AllocatorState, refused: Optional[Array], count: Array) -> Array:
  """The count to free: 0 when the ownership record refused. Without a record the count
  already says it (debug mode and a misaligned start_pos zero it themselves)."""
  return count if state.guard is None else jnp.where(refused, 0, count)


def _flag(refused: Optional[Array]) -> Array:
  """bool[] refused (False where nothing could refuse)."""
  return jnp.zeros((), bool) if refused is None else refused


def paged_free_implementation(config: AllocatorConfig, name: str, m: int) -> str:
  """The key of PAGED_FREE that the paged `free` of M = m slots runs outside debug mode
  for the concrete implementation `name` (kernels.by_device): the Triton kernels for the
  Triton family where `pallas_kernels.free_preferred` takes the sizes, else
  `free_method`'s."""
  interpret = kernels.fused_triton(config, name)
  if interpret is not None and m > 0:
    import pallas_kernels  # pylint: disable=g-import-not-at-top
    if pallas_kernels.free_preferred(config.num_pages, m):
      return "triton_interpret" if interpret else "triton"
  return free_method(config.num_pages, m)


def _free_paged_xla(config: AllocatorConfig, state: AllocatorState, free_index: Array, *,
                    method: str, op: int = guard.OP_FREE) -> Tuple[AllocatorState, Array]:
  pages = jnp.where(free_index >= 0, free_index // config.page_size, 0)
  record = st.record(config, state)
  values, count, ids, stray, marks = _sorted_unique(
      pages, config.num_pages, method, None if record is None else free_index != 0)
  err = None
  if config.debug:
    state, count, err = debug.finish_free(config, state, free_index, values, count,
                                          _debug_op(op))
  if record is None:
    return _give_back(config, state, values, count), _flag(err)

  def guarded(cheap_branch: bool):
    if cheap_branch:  # the record read and cleared at the distinct pages just found
      return guard.free_by_page(record, op, free_index, values, ids, stray, marks,
                                page_size=config.page_size, also_refuse=err)
    return guard.free(record, op, free_index // config.page_size, free_index != 0,
                      distinct=False, also_refuse=err)

  record, refused = kernels.by_branch_cost(state.free_ring, guarded)
  state = state._replace(guard=record)
  return _give_back(config, state, values, jnp.where(refused, 0, count)), refused


def _free_paged_triton(config: AllocatorConfig, state: AllocatorState, free_index: Array,
                       *, interpret: bool, op: int = guard.OP_FREE
                       ) -> Tuple[AllocatorState, Array]:
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  ring, head, length, other = st.freed_list(config.need_sort, state)
  record = st.record(config, state)
  out = pallas_kernels.free_push_front_triton(
      free_index, ring, head, length, other, page_size=config.page_size,
      interpret=interpret, record=record, op=op)
  state = st.with_freed_list(config.need_sort, state, *out[:3])
  if record is None:
    return state, jnp.zeros((), bool)
  return state._replace(guard=guard.GuardState(out[3], out[4])), out[5]


# The paged `free` by implementation (kernels.REGISTRY["free"]), each fn(config, state,
# free_index i32[M] int32, *, op) -> (state, bool[] refused by the ownership record),
# every one the same bits (the Triton ones outside debug mode only). `free` picks one
# (paged_free_implementation); PAGED_FREE drops the flag, for tests and benchmarks that
# call one by name.
_PAGED_FREE = {
    "sort": functools.partial(_free_paged_xla, method="sort"),
    "bitmap": functools.partial(_free_paged_xla, method="bitmap"),
    "triton": functools.partial(_free_paged_triton, interpret=False),
    "triton_interpret": functools.partial(_free_paged_triton, interpret=True),
}
PAGED_FREE = {name: (lambda config, state, free_index, fn=fn:
                     fn(config, state, free_index)[0])
              for name, fn in _PAGED_FREE.items()}


def _give_back(config: AllocatorConfig, state: AllocatorState, values: Array,
               count: Array) -> AllocatorState:
  """Adds values[:count] to release_pages (need_sort) or free_pages: prepended as one
  block (paged) or appended (token). A count that would overflow the pool (only possible
  through double frees) is cut to fit, so the lists never overwrite one another."""
  ring, head, length, other = st.freed_list(config.need_sort, state)
  count = jnp.minimum(count, config.num_pages - length - other)
  if config.kind == "paged":
    ring, head = st.ring_push_front(ring, head, values, count)
  else:
    ring = st.ring_push_back(ring, head, length, values, count)
  return st.with_freed_list(config.need_sort, state, ring, head, length + count)


def _num_mask(m: int, num: Optional[Array], name: str) -> Array:
  """bool[m]: entries at index < num (all of them when num is None)."""
  if num is None:
    return jnp.ones((m,), bool)
  num = validate.as_i32(num, name)
  if num.ndim != 0:
    raise ValueError(f"{name} must be a scalar, got shape {num.shape}")
  return jnp.arange(m, dtype=jnp.int32) < num


def _one_d(x: Array, name: str) -> Array:
  x = validate.as_i32(x, name)
  if x.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
  return x


def _prepend_pages(config: AllocatorConfig, state: AllocatorState, pages: Array,
                   given: Array, op: int, positions: Array,
                   err=None, refuse: Optional[Array] = None
                   ) -> Tuple[AllocatorState, Array]:
  """Prepends the given pages (in order, as one block) to release_pages (need_sort) or
  free_pages. O(K): a compaction (prefix sum + scatter) and a ring scatter, no sort.
  Returns (state, bool[] refused by the ownership record, or by `refuse`)."""
  n = config.num_pages
  valid = given & (pages >= 1) & (pages <= n)
  if refuse is not None:
    valid = valid & ~refuse
  values, count = st.compact(pages, valid)
  also = refuse
  if config.debug:
    state, count, found = debug.finish_free_page_ids(config, state, _debug_op(op), pages,
                                                     given, positions, values, count, err)
    also = found if refuse is None else refuse | found
  state, refused = _guard_free(config, state, op, pages, given, also_refuse=also)
  return _give_back(config, state, values, _unless(state, refused, count)), _flag(refused)


def free_page_ids(config: AllocatorConfig, state: AllocatorState, page_ids: Array,
                  num: Optional[Array] = None) -> AllocatorState:
  """Frees exactly these pages, in the given order, with no sort (SPEC 10).

  Paged: page_ids[:num] (zeros skipped) are prepended as one block, order kept, to
  release_pages (need_sort) or free_pages; no sort and no de-duplication, O(M). Token
  (page ids are slots): exactly `free` of those entries (appended, FIFO).

  Args:
    config: static configuration.
    state: the pool.
    page_ids: i32[M] page ids (an integer dtype; TypeError otherwise). Entries at index
      >= num and entries equal to 0 are padding. The caller promises the rest are
      distinct pages it holds; ids outside 1..num_pages are ignored (debug mode: an
      error, like a page given twice or already free, and the call frees nothing).
    num: optional i32[], the number of leading entries to consider (None: all M).

  Returns:
    The new state; an all-padding call returns an equal state. With the ownership record
    (config.guard) a given id that is not a held page (outside 1..num_pages, free,
    released, or given twice) refuses the whole call (jax_kvalloc.guard).
  """
  return free_page_ids_refused(config, state, page_ids, num)[0]


def free_page_ids_refused(config: AllocatorConfig, state: AllocatorState, page_ids: Array,
                          num: Optional[Array] = None, *, op: int = guard.OP_FREE_PAGE_IDS,
                          also_refuse: Optional[Array] = None
                          ) -> Tuple[AllocatorState, Array]:
  """`free_page_ids`, also returning whether it was refused (bool[]: by the ownership
  record, or `also_refuse`, which refuses it without a status), with `op` named in its
  status (the request table's release and window frees, release_and_alloc_decode)."""
  page_ids = _one_d(page_ids, "page_ids")
  m = page_ids.shape[0]
  given = _num_mask(m, num, "num") & (page_ids != 0)
  if also_refuse is not None:  # a refusal decided beforehand: nothing is given
    given = given & ~also_refuse
    state, refused = free_page_ids_refused(config, state, jnp.where(given, page_ids, 0),
                                           op=op)
    return state, refused | also_refuse
  if config.kind == "token":
    return _free(config, state, jnp.where(given, page_ids, 0), op)
  return _prepend_pages(config, state, page_ids, given, op,
                        jnp.arange(m, dtype=jnp.int32))


def free_segment(config: AllocatorConfig, state: AllocatorState, free_index: Array,
                 start_pos: Array, num: Optional[Array] = None) -> AllocatorState:
  """Frees one request's slots of tokens start_pos, start_pos + 1, ... (SPEC 10).

  Paged: `free_page_ids(free_index[::page_size] // page_size)`: the pages of the tokens
  that start a page, in the request's order, no sort, O(M / page_size) writes. Token:
  `free(free_index[:num])`.

  Args:
    config: static configuration.
    state: the pool.
    free_index: i32[M] slots; free_index[k] holds token start_pos + k of one request.
      Entries at index >= num are padding; a 0 at a page's first token is padding too.
    start_pos: i32[] the first token's position; a multiple of page_size, else the call
      is refused (frees nothing; recorded in debug mode).
    num: optional i32[], the number of real tokens (None: all M).

  Returns:
    The new state. With the ownership record (config.guard) a page that is not held
    (page 0, outside the pool, free, released, or named twice) refuses the whole call
    (jax_kvalloc.guard). Debug mode also refuses slots that do not lie in the page of
    their page's first token (recorded in state.debug).
  """
  return free_segment_refused(config, state, free_index, start_pos, num)[0]


def free_segment_refused(config: AllocatorConfig, state: AllocatorState, free_index: Array,
                         start_pos: Array, num: Optional[Array] = None
                         ) -> Tuple[AllocatorState, Array]:
  """`free_segment`, also returning whether it was refused (bool[]: by the ownership
  record, or a misaligned start_pos)."""
  free_index = _one_d(free_index, "free_index")
  start_pos = validate.as_i32(start_pos, "start_pos")
  if start_pos.ndim != 0:
    raise ValueError(f"start_pos must be a scalar, got shape {start_pos.shape}")
  m = free_index.shape[0]
  given = _num_mask(m, num, "num")
  ps = config.page_size
  if config.kind == "token":  # every start_pos is a multiple of 1
    return _free(config, state, jnp.where(given, free_index, 0), guard.OP_FREE_SEGMENT)
  misaligned = start_pos % ps != 0
  err = debug.segment_args(config, free_index, given, start_pos) if config.debug else None
  reps = free_index[::ps]  # tokens that start a page (start_pos is page-aligned)
  pages = reps // ps  # floor: a negative slot names a negative page (out of range)
  rep_given = given[::ps] & (reps != 0)
  return _prepend_pages(config, state, pages, rep_given, guard.OP_FREE_SEGMENT,
                        jnp.arange(0, m, ps, dtype=jnp.int32), err, refuse=misaligned)


def free_full(config: AllocatorConfig, state: AllocatorState,
              free_index: Array) -> AllocatorState:
  """SGLang's free_full: a single pool has no sliding-window peer, so this is `free`."""
  return free(config, state, free_index)


def free_full_segment(config: AllocatorConfig, state: AllocatorState, free_index: Array,
                      start_pos: Array, num: Optional[Array] = None) -> AllocatorState:
  """SGLang's free_full_segment: without a sliding-window peer, `free_segment`."""
  return free_segment(config, state, free_index, start_pos, num)


def get_all_free_pages(config: AllocatorConfig,
                       state: AllocatorState) -> Tuple[Array, Array]:
  """free_pages ++ release_pages (SPEC 10): (i32[num_pages] padded with 0, i32[] count).

  O(num_pages) gather; meant for censuses and tests, not the hot path.
  """
  n = config.num_pages
  i = jnp.arange(n, dtype=jnp.int32)
  total = state.free_len + state.release_len
  from_free = st.ring_window(state.free_ring, state.free_head, state.free_len, n)
  rel = state.release_ring[(state.release_head + i - state.free_len) % max(n, 1)]
  out = jnp.where(i < state.free_len, from_free, jnp.where(i < total, rel, 0))
  return out, total
