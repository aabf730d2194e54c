"""Handing slots out: `alloc` (SPEC 3, 4.1), `alloc_extend` (4.2), `alloc_decode` (4.3),
and `release_and_alloc_decode` (a decode step's free_page_ids, SPEC 10, then 4.3).

Every function is pure and traceable: it takes the static config and a state, and returns
`(new_state, indices, ok)`. Shapes are static (padded); counts are traced, so a serving
loop compiles once per shape bucket (jax_kvalloc.buckets). On failure `ok` is False,
`indices` is all 0 and nothing is allocated; the only change kept is a merge of
release_pages that the shortfall triggered (need_sort), exactly as in SGLang.

Capacity is checked before any index is computed, and every read of the free list goes
through a masked window of it, so nothing ever reads past the free list (SGLang issue
34399). Lengths are summed without int32 overflow (`_prefix_sums`), so no batch, however
long its requests, can wrap into one that looks small.

Debug mode (config.debug; see jax_kvalloc.debug) refuses misuse the same way (ok=False,
nothing allocated) and records the first error in `state.debug`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import debug
from jax_kvalloc import freeing
from jax_kvalloc import kernels
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.freeing import maybe_merge
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.state import AllocatorState
from pallas_kernels import capacity

Array = jax.Array
AllocResult = Tuple[AllocatorState, Array, Array]


def _take_pages(state: AllocatorState, num_pages: Array, ok: Array) -> AllocatorState:
  """Drops `num_pages` from the front of the free list when ok. No array is written."""
  n = state.free_ring.shape[0]
  taken = jnp.where(ok, num_pages, 0)
  return state._replace(free_head=(state.free_head + taken) % max(n, 1),
                        free_len=state.free_len - taken)


def _window_len(config: AllocatorConfig, pages_needed_at_most: int) -> int:
  """Static length of the free-list window a call may read: no more than the pool."""
  return max(1, min(config.num_pages, pages_needed_at_most))


def _row_mask(num_rows: int, num_reqs: Optional[Array]) -> Tuple[Array, Array]:
  """(bool[B] real rows, i32[] their count): rows at index >= num_reqs are padding."""
  if num_reqs is None:
    return jnp.ones((num_rows,), bool), jnp.full((), num_rows, jnp.int32)
  num_reqs = jnp.clip(validate.as_i32(num_reqs, "num_reqs"), 0, num_rows)
  return jnp.arange(num_rows) < num_reqs, num_reqs


def _prefix_sums(x: Array, cap: int) -> Tuple[Array, Array]:
  """(exclusive prefix sums, total) of x >= 0 (i32[B]); exact whenever the total is <= cap.

  The capacity rule shared with every kernel (pallas_kernels.capacity): counts are
  clipped to cap + 1 and summed without wrapping, so a batch whose true total exceeds
  cap always has a total > cap here, and the caller refuses it.
  """
  return capacity.saturating_prefix_sums(x, cap)


def alloc(config: AllocatorConfig, state: AllocatorState, need_size: Array, *,
          max_size: int) -> AllocResult:
  """Takes `need_size` slots from the front of the free list (SPEC 3 and 4.1).

  Args:
    config: static configuration.
    state: the pool.
    need_size: i32[] slots wanted; for the paged allocator a multiple of page_size.
    max_size: static length of the returned index array.

  Returns:
    (state, i32[max_size] slots, bool[] ok). Paged: whole pages p give p*ps .. p*ps+ps-1,
    in free-list order. Entries past need_size are 0. ok is False (nothing allocated) when
    the pool is short even after a need_sort merge, when need_size is negative, larger
    than max_size, or not a multiple of page_size.
  """
  ps = config.page_size
  need_size = validate.as_i32(need_size, "need_size")
  valid = (need_size >= 0) & (need_size <= max_size) & (need_size % ps == 0)
  num_pages = need_size // ps
  if config.debug:
    err = debug.alloc_args(~valid, need_size)
  state = maybe_merge(config, state, valid & (num_pages > state.free_len))
  ok = valid & (num_pages <= state.free_len)

  t = jnp.arange(max_size, dtype=jnp.int32)
  window = st.ring_window(state.free_ring, state.free_head, jnp.where(ok, state.free_len, 0),
                          _window_len(config, -(-max_size // ps)))
  page = window[jnp.clip(t // ps, 0, window.shape[0] - 1)]
  out = jnp.where(ok & (t < need_size), page * ps + t % ps, 0)
  if config.debug:
    state, ok = debug.finish_alloc(config, state, debug.OP_ALLOC, err, ok, window,
                                   num_pages, out, t < need_size)
    out = jnp.where(ok, out, 0)
  return _take_pages(state, num_pages, ok), out, ok


def _pages_agree(config: AllocatorConfig, num_new_pages: Optional[Array],
                 total_pages: Array) -> Array:
  """bool[]: the caller's num_new_pages (None: not given) equals the true count.

  total_pages saturates at num_pages + 1 (`_prefix_sums`), so a larger claim is compared
  saturated too: either way such a batch does not fit and is refused.
  """
  if num_new_pages is None:
    return jnp.ones((), bool)
  num_new_pages = validate.as_i32(num_new_pages, "num_new_pages")
  if num_new_pages.ndim != 0:
    raise ValueError(f"num_new_pages must be a scalar, got shape {num_new_pages.shape}")
  return ((num_new_pages >= 0)
          & (jnp.minimum(num_new_pages, config.num_pages + 1) == total_pages))


def _refuse_unless(agree: Optional[Array], before: AllocatorState,
                   result: AllocResult) -> AllocResult:
  """The fused kernel does not see num_new_pages: a disagreeing count undoes its take
  (the kernel moves only the free list's head and length). `agree` None: nothing to do."""
  if agree is None:
    return result
  after, out, ok = result
  state = after._replace(free_head=jnp.where(agree, after.free_head, before.free_head),
                         free_len=jnp.where(agree, after.free_len, before.free_len))
  return state, jnp.where(agree, out, 0), ok & agree


def alloc_extend(config: AllocatorConfig, state: AllocatorState, prefix_lens: Array,
                 seq_lens: Array, last_loc: Array, *, max_tokens: int,
                 num_reqs: Optional[Array] = None,
                 num_new_pages: Optional[Array] = None) -> AllocResult:
  """Allocates the slots of a prefill (extend) batch (SPEC 4.2).

  Args:
    config: static configuration.
    state: the pool.
    prefix_lens: i32[B] tokens each request already has in the cache.
    seq_lens: i32[B] tokens each request has after this extend (>= prefix_lens).
    last_loc: i32[B] slot of each request's last prefix token, -1 when prefix_lens is 0;
      SPEC requires (last_loc + 1) % page_size == prefix_lens % page_size.
    max_tokens: static length of the returned index array (a bucket of the batch's
      extend_num_tokens = sum(seq_lens - prefix_lens)).
    num_reqs: optional i32[], the number of real rows; rows at index >= num_reqs are
      padding and allocate nothing. Default: all B rows are real. It also sets `bs` in
      the need_sort merge trigger `extend_num_tokens // ps + bs + 1 > len(free_pages)`.
    num_new_pages: optional i32[], the batch's new-page count as the caller knows it
      (SGLang 0.5.23's keyword, SPEC 10). When given it must equal the true count
      sum(ceil(seq/ps) - ceil(pre/ps)) over the real rows; otherwise the call is refused
      (ok=False, nothing allocated, no merge) and debug mode records the mismatch.

  Returns:
    (state, i32[max_tokens] slots, bool[] ok). The first extend_num_tokens entries are
    the new tokens' slots in batch order (SPEC 4.2 Parts 1-3), the rest 0. ok is False
    (nothing allocated; only a triggered merge kept) when the new pages do not fit in the
    free list, when extend_num_tokens > max_tokens, or when a real row has
    prefix_lens < 0 or seq_lens < prefix_lens.
  """
  ps = config.page_size
  prefix_lens = validate.as_i32(prefix_lens, "prefix_lens")
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  num_rows = validate.static_rows(prefix_lens=prefix_lens, seq_lens=seq_lens,
                                  last_loc=last_loc)
  real, bs = _row_mask(num_rows, num_reqs)
  pre = jnp.where(real, prefix_lens, 0)
  seq = jnp.where(real, seq_lens, 0)
  rows_valid = jnp.all((pre >= 0) & (seq >= pre))
  pre = jnp.where(rows_valid, pre, 0)
  seq = jnp.where(rows_valid, seq, 0)

  ext = seq - pre
  new_pages = cdiv(seq, ps) - cdiv(pre, ps)
  tok_start, total_tokens = _prefix_sums(ext, max_tokens)
  page_start, total_pages = _prefix_sums(new_pages, config.num_pages)
  valid = rows_valid & (total_tokens <= max_tokens)
  pages_agree = _pages_agree(config, num_new_pages, total_pages)
  valid = valid & pages_agree
  if config.debug:
    err = debug.extend_args(config, state, real, prefix_lens, seq_lens, last_loc,
                            total_tokens, max_tokens)
    if num_new_pages is not None:
      err = debug.either(err, debug.num_new_pages_arg(num_new_pages, pages_agree))
    valid = valid & (err[0] == 0)
  state = maybe_merge(config, state, valid & (total_tokens // ps + bs + 1 > state.free_len))

  def rest(name: str) -> AllocResult:
    fused = None
    if num_rows:  # zero rows: no kernel (an index kernel over zero rows does not lower)
      fused = kernels.alloc_extend_fused(config, state, prefix_lens, seq_lens, last_loc,
                                         num_reqs, max_tokens=max_tokens, name=name)
    if fused is not None:  # GPU: the rest in one kernel launch (jax_kvalloc.kernels)
      return _refuse_unless(None if num_new_pages is None else pages_agree, state, fused)
    s = state
    ok = valid & (total_pages <= s.free_len)
    # Enough pages for any batch of at most max_tokens tokens: sum(ceil(ext_i / ps)).
    window = st.ring_window(s.free_ring, s.free_head, jnp.where(ok, s.free_len, 0),
                            _window_len(config, max_tokens // ps + num_rows + 1))
    out = jnp.zeros((max_tokens,), jnp.int32)
    if num_rows:
      out = kernels.extend_indices(name, window, pre, seq, last_loc, tok_start,
                                   page_start, page_size=ps, out_len=max_tokens)
    if config.debug:
      s, ok = debug.finish_alloc(config, s, debug.OP_ALLOC_EXTEND, err, ok, window,
                                 total_pages, out, jnp.arange(max_tokens) < total_tokens)
    out = jnp.where(ok, out, 0)
    return _take_pages(s, total_pages, ok), out, ok

  # "auto" follows the device that holds the pool (kernels.by_device).
  return kernels.by_device(config.kernel, state.free_ring, rest, "alloc_extend")


def alloc_decode(config: AllocatorConfig, state: AllocatorState, seq_lens: Array,
                 last_loc: Array, *, num_reqs: Optional[Array] = None) -> AllocResult:
  """Allocates one new token's slot per request (SPEC 4.3).

  Args:
    config: static configuration.
    state: the pool.
    seq_lens: i32[B] sequence lengths that already count the new token (>= 1).
    last_loc: i32[B] slot of each request's previous token (token seq_lens - 2);
      SPEC requires (last_loc + 2) % page_size == seq_lens % page_size.
    num_reqs: optional i32[], the number of real rows; rows at index >= num_reqs are
      padding (output 0, nothing allocated). Default: all B rows. It is `bs` in the
      need_sort merge trigger `bs > len(free_pages)`.

  Returns:
    (state, i32[B] slots, bool[] ok). A request whose new token starts a page
    (ceil(seq/ps) > ceil((seq-1)/ps)) gets the next free page's first slot, in batch
    order; the others get last_loc + 1. ok is False (nothing allocated; only a triggered
    merge kept) when the pages needed exceed the free list or a real row has seq_lens < 1.
  """
  return _alloc_decode(config, state, seq_lens, last_loc, num_reqs)


def _alloc_decode(config: AllocatorConfig, state: AllocatorState, seq_lens: Array,
                  last_loc: Array, num_reqs: Optional[Array],
                  name: Optional[str] = None) -> AllocResult:
  """alloc_decode; `name`: the concrete implementation a caller's kernels.by_device
  already resolved (None: resolve config.kernel here)."""
  ps = config.page_size
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  num_rows = validate.static_rows(seq_lens=seq_lens, last_loc=last_loc)
  real, bs = _row_mask(num_rows, num_reqs)
  seq = jnp.where(real, seq_lens, 1)
  rows_valid = jnp.all(seq >= 1)
  if config.debug:
    err = debug.decode_args(config, state, real, seq_lens, last_loc)
    rows_valid = rows_valid & (err[0] == 0)
  needs_page = real & (cdiv(seq, ps) > cdiv(seq - 1, ps))
  needs_page = needs_page.astype(jnp.int32)
  page_start = jnp.cumsum(needs_page) - needs_page
  total_pages = jnp.sum(needs_page)
  state = maybe_merge(config, state, rows_valid & (bs > state.free_len))

  def rest(name: str) -> AllocResult:
    fused = kernels.alloc_decode_fused(config, state, seq_lens, last_loc, num_reqs,
                                       name=name)
    if fused is not None:  # GPU: the rest in one kernel launch (jax_kvalloc.kernels)
      return fused
    s = state
    ok = rows_valid & (total_pages <= s.free_len)
    window = st.ring_window(s.free_ring, s.free_head, jnp.where(ok, s.free_len, 0),
                            _window_len(config, num_rows))
    seq_for_kernel = jnp.where(real, seq, 0)  # padded rows need no page
    out = kernels.decode_indices(name, window, seq_for_kernel, last_loc, page_start,
                                 page_size=ps)
    if config.debug:
      s, ok = debug.finish_alloc(config, s, debug.OP_ALLOC_DECODE, err, ok, window,
                                 total_pages, out, real)
    out = jnp.where(ok & real, out, 0)
    return _take_pages(s, total_pages, ok), out, ok

  if name is not None:
    return rest(name)
  # "auto" follows the device that holds the pool (kernels.by_device).
  return kernels.by_device(config.kernel, state.free_ring, rest, "alloc_decode")


def release_and_alloc_decode(config: AllocatorConfig, state: AllocatorState,
                             page_ids: Array, seq_lens: Array, last_loc: Array, *,
                             num: Optional[Array] = None,
                             num_reqs: Optional[Array] = None) -> AllocResult:
  """A decode step's allocator work: free the finished requests' pages, then allocate
  one slot per running request (SPEC 10 `free_page_ids`, then SPEC 4.3).

  Exactly `alloc_decode(config, freeing.free_page_ids(config, state, page_ids, num),
  seq_lens, last_loc, num_reqs=num_reqs)`, bit for bit. On the Triton backend (a paged
  pool, need_sort and debug off, up to 2048 rows and 8192 page ids) both run as one
  kernel launch (`pallas_kernels.release_alloc_decode_triton`; jax_kvalloc.kernels);
  elsewhere as the two calls.

  Args:
    config: static configuration.
    state: the pool.
    page_ids: i32[M] pages to free, in request order (as free_page_ids: entries at index
      >= num and zeros are padding; ids outside 1..num_pages are ignored, an error in
      debug mode).
    seq_lens: i32[B] sequence lengths that already count the new token (>= 1).
    last_loc: i32[B] slot of each request's previous token, as alloc_decode.
    num: optional i32[], the number of leading page_ids to consider (None: all M).
    num_reqs: optional i32[], the number of real decode rows (None: all B).

  Returns:
    (state, i32[B] slots, bool[] ok), as alloc_decode after the release. ok is False
    (slots all 0, nothing allocated) when the pages needed exceed the free list after the
    release or a real row has seq_lens < 1; the release is done either way.

  Raises:
    TypeError naming the argument for a non-integer dtype; ValueError for page_ids that
    is not 1-D, num or num_reqs that is not a scalar, or rows of different lengths.
  """
  page_ids = validate.as_i32(page_ids, "page_ids")
  if page_ids.ndim != 1:
    raise ValueError(f"page_ids must be 1-D, got shape {page_ids.shape}")
  for name, value in (("num", num), ("num_reqs", num_reqs)):
    if value is not None and validate.as_i32(value, name).ndim != 0:
      raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}")
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  validate.static_rows(seq_lens=seq_lens, last_loc=last_loc)

  def rest(name: str) -> AllocResult:
    fused = kernels.release_alloc_decode_fused(config, state, page_ids, num, seq_lens,
                                               last_loc, num_reqs, name=name)
    if fused is not None:  # GPU: both in one kernel launch
      return fused
    released = freeing.free_page_ids(config, state, page_ids, num)
    return _alloc_decode(config, released, seq_lens, last_loc, num_reqs, name=name)

  # "auto" follows the device that holds the pool (kernels.by_device).
  return kernels.by_device(config.kernel, state.free_ring, rest, "release_decode")
