"""SGLang's PagedTokenToKVPoolAllocator (whole pages, LIFO free) over the functional core."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.base import BaseAllocator
from jax_kvalloc.sglang.base import concat
from jax_kvalloc.sglang.token import _pair


class PagedTokenToKVPoolAllocator(BaseAllocator):
  """Hands out KV slots a page at a time; page 0 is reserved (SPEC 4).

  Args:
    size: number of usable slots; the pool has size // page_size pages.
    page_size: slots per page.
    dtype, device, kvcache: as in SGLang (see TokenToKVPoolAllocator).
    need_sort: park freed pages in release_pages until a shortfall merges them.
    kernel, debug: see AllocatorConfig (default from JAX_KVALLOC_KERNEL/JAX_KVALLOC_DEBUG).
    guard: keep the ownership record (SPEC 14; default True): a free of a page not held
      raises ValueError (jax_kvalloc.sglang.base, "Refusals"). False: SGLang's trust.
    backend: "device" (jax arrays on `device`, calls launch without waiting) or "host"
      (NumPy state and results, for host schedulers); see jax_kvalloc.sglang.base.
    dp_size: data-parallel ranks (sglang-jax's dp_size), each a pool of size // dp_size
      slots with rank-local page ids; every method then takes `dp_rank=` (default 0).
    dp_ranks: the ranks this process holds (default None: all). On several hosts each
      host passes its own, `multiprocess.process_ranks(mesh, "dp", dp_size)`, and holds
      only those ranks' pools and host mirrors (a rank's scheduler runs on the host that
      owns its devices; see jax_kvalloc.sglang.base). A call with another dp_rank
      raises ValueError naming it and the ranks held here.
  """

  def __init__(self, size: int, page_size: int, dtype: Any = None, device: Any = None,
               kvcache: Any = None, need_sort: bool = False, *,
               kernel: Optional[str] = None, debug: Optional[bool] = None,
               guard: bool = True, backend: str = "device", dp_size: int = 1,
               dp_ranks: Optional[Sequence[int]] = None):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = AllocatorConfig(size=size, page_size=page_size, need_sort=need_sort,
                             kind="paged", guard=guard, **extra)
    super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size,
                     dp_ranks=dp_ranks)

  # -- allocation ----------------------------------------------------------------------
  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens: int, num_new_pages: Optional[int] = None,
                   dp_rank: int = 0):
    """Slots for a prefill batch (SPEC 4.2), or None if its new pages do not fit.

    Args:
      prefix_lens, seq_lens: [bs] integers (any array type or list); the `*_cpu` copies
        are used instead when given (SGLang passes both; either may be None).
      last_loc: [bs] slot of each request's last prefix token, -1 for an empty prefix.
        On the device backend a jax.Array is taken as it is, without reading it back
        (as SGLang passes it, computed on the device): only its shape and dtype are
        checked (debug mode checks its values).
      extend_num_tokens: sum(seq_lens - prefix_lens).
      num_new_pages: optional, the batch's new-page count as the caller computed it
        (SGLang 0.5.23); it must equal sum(ceil(seq/ps) - ceil(pre/ps)).
      dp_rank: the data-parallel rank (dp_size > 1) whose pool serves the batch.

    Returns:
      i32[extend_num_tokens] in batch order (a jax array, returned without waiting, on
      the device backend; numpy on the host backend), or None (nothing allocated).

    Raises:
      TypeError for non-integer arrays; ValueError (naming the request and value) for
      arrays of different lengths, values beyond int32, prefix_lens < 0,
      seq_lens < prefix_lens, a last_loc outside the pool or breaking SPEC's alignment
      (last_loc + 1) % page_size == prefix_lens % page_size, or a wrong extend_num_tokens
      or num_new_pages.
    """
    pool = self._pools[self._pool_index(dp_rank)]
    plan = self._extend_plan(pool, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                             last_loc, extend_num_tokens, num_new_pages)
    if plan is None:  # SPEC 4.2's trigger still fires: 0 // ps + 0 + 1 > free
      pool.merge_if(1 > pool.sides[0].free_len)
      return pool.backend.empty()
    # SPEC 4.2's need_sort trigger counts every row, empty ones too.
    return self._allocate(
        pool, "alloc_extend",
        plan.tokens // self.page_size + plan.rows + 1 > pool.sides[0].free_len,
        plan.pages, lambda s, fits: pool.backend.alloc_extend(s, plan, fits))

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, dp_rank: int = 0):
    """One slot per request for its new token (SPEC 4.3), or None if the pages needed
    do not fit.

    Args:
      seq_lens: [bs] lengths counting the new token (seq_lens_cpu used when given).
      last_loc: [bs] slot of each request's previous token (a jax.Array is taken as
        it is on the device backend, as in alloc_extend).
      dp_rank: the data-parallel rank (dp_size > 1) whose pool serves the batch.

    Returns:
      i32[bs] (jax array without waiting / numpy, as alloc_extend), or None (nothing
      allocated).

    Raises:
      TypeError for non-integer arrays; ValueError (naming the request and value) for
      arrays of different lengths, values beyond int32, seq_lens < 1, or a last_loc
      outside the pool or breaking (last_loc + 2) % page_size == seq_lens % page_size.
    """
    pool = self._pools[self._pool_index(dp_rank)]
    plan = self._decode_plan(pool, seq_lens, seq_lens_cpu, last_loc)
    if plan is None:
      return pool.backend.empty()
    return self._allocate(pool, "alloc_decode", plan.rows > pool.sides[0].free_len,
                          plan.pages,  # SPEC 4.3's trigger
                          lambda s, fits: pool.backend.alloc_decode(s, plan, fits))

  # -- page-id frees (SPEC 10) ---------------------------------------------------------
  def free_page_ids(self, page_ids, dp_rank: int = 0) -> None:
    """Frees exactly these pages, in the given order, without sorting (SPEC 10).

    The pages are prepended as one block to release_pages (need_sort) or free_pages,
    O(pages); inside a free group they are queued apart and freed after the group's
    slot frees.

    page_ids: integer pages, each in 1..num_pages and none twice (ValueError naming the
    entry otherwise; TypeError for floats and bools). A page that is not held (free,
    released, never handed out) is refused by the ownership record (guard, on by
    default: ValueError naming the operation and the page; nothing freed), as for
    `free`. On the device backend a jax.Array is taken as it is, without reading it
    back (its count is its length): only its dtype and rank are checked here, and its
    values on the device (a refusal raises as jax_kvalloc.sglang.base says).
    """
    r = self._pool_index(dp_rank)
    ids = validate.device_ints(page_ids, "page_ids") if self._keeps(r) else None
    if ids is None:
      ids = validate.host_ints(page_ids, "page_ids")
      if ids.size:
        validate.page_ids(ids, num_pages=self._pools[r].config.num_pages)
    if ids.shape[0]:
      self._queue_or_free_page_ids(r, ids)

  def free_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """Frees one request's slots of tokens start_pos, start_pos + 1, ... (SPEC 10):
    `free_page_ids(free_index[::page_size] // page_size)`, the request's pages in its own
    order, no sort.

    Raises (nothing freed): ValueError when start_pos is negative or not a multiple of
    page_size, a slot is not allocatable, or free_index is not one request's
    consecutive slots (a token outside the page of its page's first token, a page
    twice); TypeError for non-integers. A page not held is refused by the ownership
    record, as in `free_page_ids`. On the device backend a jax.Array free_index is
    taken as it is (no read; the pages are computed on the device), and only start_pos,
    its dtype and rank are checked here (the record checks its pages on the device).
    """
    r = self._pool_index(dp_rank)
    _, n, pages = self._segment(r, free_index, start_pos)
    if n:
      self._queue_or_free_page_ids(r, pages, "free_segment")

  def free_segments(self, segments: Sequence[Tuple[Any, int]], dp_rank: int = 0) -> None:
    """Frees several (free_index, start_pos) segments of one request, each in turn as
    `free_segment` does (SPEC 10).

    Every segment is checked first: a bad one, or two consecutive non-empty segments
    that share a page, raises ValueError (naming `segments[i]`) and frees nothing.
    (Pages named twice across host segments are found here; across device arrays, by
    the ownership record on the device.)
    """
    r = self._pool_index(dp_rank)
    checked, spans = [], []
    for i, seg in enumerate(segments):
      free_index, start = _pair(seg, i)
      try:
        start, n, pages = self._segment(r, free_index, start)
      except (TypeError, ValueError) as e:
        raise type(e)(f"segments[{i}]: {e}") from e
      spans.append((n, start))
      if n:
        checked.append(pages)
    validate.segments_disjoint(spans, self.page_size)
    if not checked:
      return
    host = [p for p in checked if isinstance(p, np.ndarray)]
    if len(host) > 1:  # one request: no page twice
      validate.repeated_at(np.concatenate(host), "segments' pages (free_index[::"
                           "page_size] // page_size, concatenated)", "names a page twice")
    if self._group is not None:
      self._group[r].page_ids.extend(checked)
    else:
      # Each segment is prepended in turn, so the last one ends up in front: one block
      # of the segments in reverse order is the same list, in one call.
      self._free_page_ids_now(self._pools[r], concat(checked[::-1]), "free_segments")

  def _segment(self, r: int, free_index, start_pos) -> Tuple[int, int, Any]:
    """Checks one segment: (start_pos, its token count, its pages: host int64, or a
    device i32 array computed on the device)."""
    start = validate.start_pos(start_pos, self.page_size)
    dev = validate.device_ints(free_index, "free_index") if self._keeps(r) else None
    if dev is not None:
      n = dev.shape[0]
      return start, n, _segment_pages(dev, self.page_size) if n else None
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return start, 0, None
    validate.free_index(idx, page_size=self.page_size, num_slots=self.config.num_slots)
    return start, idx.size, validate.segment(idx, page_size=self.page_size)

  def _queue_or_free_page_ids(self, r: int, ids: Any, op: str = "free_page_ids") -> None:
    if self._group is not None:
      self._group[r].page_ids.append(ids)  # a host copy or an immutable device array:
      return                               # later changes to the caller's buffer do not
    self._free_page_ids_now(self._pools[r], ids, op)  # reach the queue


def _segment_pages(free_index, page_size: int):
  """free_index[::page_size] // page_size of a device i32 array, on its device (one
  cached program per length; no wait)."""
  return _SEGMENT_PAGES(free_index, page_size)


_SEGMENT_PAGES = jax.jit(lambda x, ps: x[::ps] // ps, static_argnums=1)

