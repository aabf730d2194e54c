"""SGLang's TokenToKVPoolAllocator (page_size 1, FIFO free) over the functional core."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.base import BaseAllocator


class TokenToKVPoolAllocator(BaseAllocator):
  """Hands out single KV slots 1..size; slot 0 is the padding sink (SPEC 3).

  `alloc(n)` takes the first n free slots; `free` appends slots to the back of the free
  list (or of release_pages when need_sort), in the order given: FIFO. Like SGLang's,
  it has no alloc_extend/alloc_decode (callers at page size 1 use `alloc`). Page ids are
  slots here, so `free_page_ids` and `free_segment(s)` are `free` (queued with the slot
  frees in a free group).

  Args:
    size: number of usable slots.
    dtype, device, kvcache: as in SGLang; dtype is the KV dtype (stored, unused), device
      places the state ("cpu", "cuda", "cuda:1", "tpu", a jax.Device or None), kvcache is
      returned by get_kvcache().
    need_sort: park freed slots in release_pages until a shortfall merges them.
    kernel, debug: see AllocatorConfig (default from JAX_KVALLOC_KERNEL/JAX_KVALLOC_DEBUG).
    guard: keep the ownership record (SPEC 14; default True): a free of a page not held
      raises ValueError (jax_kvalloc.sglang.base, "Refusals"). False: SGLang's trust.
    backend: "device" (jax arrays on `device`, calls launch without waiting) or "host"
      (NumPy state and results, for host schedulers); see jax_kvalloc.sglang.base.
    dp_size: data-parallel ranks (sglang-jax's dp_size), each a pool of size // dp_size
      slots numbered 1..size // dp_size; every method then takes `dp_rank=` (default 0).
    dp_ranks: the ranks this process holds (default None: all). On several hosts each
      host passes its own, `multiprocess.process_ranks(mesh, "dp", dp_size)`, and holds
      only those ranks' pools and host mirrors (a rank's scheduler runs on the host that
      owns its devices; see jax_kvalloc.sglang.base). A call with another dp_rank
      raises ValueError naming it and the ranks held here.
  """

  def __init__(self, size: int, dtype: Any = None, device: Any = None, kvcache: Any = None,
               need_sort: bool = False, *, kernel: Optional[str] = None,
               debug: Optional[bool] = None, guard: bool = True, backend: str = "device",
               dp_size: int = 1, dp_ranks: Optional[Sequence[int]] = None):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = AllocatorConfig(size=size, page_size=1, need_sort=need_sort, kind="token",
                             guard=guard, **extra)
    super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size,
                     dp_ranks=dp_ranks)

  def alloc_extend(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_extend (use alloc), "
                              "as in SGLang")

  def alloc_decode(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_decode (use alloc), "
                              "as in SGLang")

  def free_page_ids(self, page_ids, dp_rank: int = 0) -> None:
    """`free(page_ids)` (SPEC 10: page ids are slots), after the page-id checks: each in
    1..num_pages and none twice (ValueError naming the entry; TypeError for floats)."""
    r = self._pool_index(dp_rank)
    ids = validate.host_ints(page_ids, "page_ids")
    if ids.size == 0:
      return
    validate.page_ids(ids, num_pages=self.config.num_pages)
    self._queue_or_free(r, ids, "free_page_ids")

  def free_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """`free(free_index)` (SPEC 10), after start_pos's check (a count)."""
    r = self._pool_index(dp_rank)
    _, got = _segment(self, free_index, start_pos)
    if got.size:
      self._queue_or_free(r, got, "free_segment")

  def free_segments(self, segments: Sequence[Tuple[Any, int]], dp_rank: int = 0) -> None:
    """Each segment's `free_segment`, every one checked first (FIFO appends: one `free`
    of them all is the same)."""
    r = self._pool_index(dp_rank)
    checked, spans = [], []
    for i, seg in enumerate(segments):
      free_index, start = _pair(seg, i)
      try:
        start, idx = _segment(self, free_index, start)
      except (TypeError, ValueError) as e:
        raise type(e)(f"segments[{i}]: {e}") from e
      spans.append((idx.size, start))
      checked.append(idx)
    validate.segments_disjoint(spans, self.page_size)
    got = np.concatenate(checked) if checked else np.zeros((0,), np.int64)
    if got.size:
      self._queue_or_free(r, got, "free_segments")


def _pair(seg: Any, i: int) -> Tuple[Any, Any]:
  """segments[i] as (free_index, start_pos); TypeError naming it otherwise."""
  try:
    free_index, start = seg
  except (TypeError, ValueError) as e:
    raise TypeError(f"segments[{i}] must be a (free_index, start_pos) pair, got "
                    f"{type(seg).__name__}") from e
  return free_index, start


def _segment(alloc: BaseAllocator, free_index: Any, start_pos: Any) -> Tuple[int, np.ndarray]:
  """(start_pos, slots) of one checked token segment (host int64; empty when none)."""
  start = validate.start_pos(start_pos, alloc.page_size)
  idx = validate.host_ints(free_index, "free_index")
  if idx.size:
    validate.free_index(idx, page_size=alloc.page_size, num_slots=alloc.config.num_slots)
  return start, idx
