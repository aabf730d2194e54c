"""SGLang's TokenToKVPoolAllocator (page_size 1, FIFO free) over the functional core."""
from __future__ import annotations

from typing import Any, Optional

from jax_kvalloc.base import BaseAllocator
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.data_parallel import DataParallel
from jax_kvalloc.newer_ops import NewerOperations


class TokenToKVPoolAllocator(DataParallel, NewerOperations, BaseAllocator):
  """Hands out single KV slots 1..size; slot 0 is the padding sink (SPEC 3).

  `alloc(n)` takes the first n free slots; `free` appends slots to the back of the free
  list (or of release_pages when need_sort), in the order given: FIFO. Like SGLang's,
  it has no alloc_extend/alloc_decode (callers at page size 1 use `alloc`).

  Args:
    size: number of usable slots.
    dtype, device, kvcache: as in SGLang; dtype is the KV dtype (stored, unused), device
      places the state ("cpu", "cuda", "cuda:1", "tpu", a jax.Device or None), kvcache is
      returned by get_kvcache().
    need_sort: park freed slots in release_pages until a shortfall merges them.
    kernel, debug: see AllocatorConfig (default from JAX_KVALLOC_KERNEL/JAX_KVALLOC_DEBUG).
    backend: "device" (jax arrays on `device`, calls launch without waiting) or "host"
      (NumPy state and results, for host schedulers); see jax_kvalloc.base.
    dp_size: data-parallel ranks (sglang-jax's dp_size), each a pool of size // dp_size
      slots numbered 1..size // dp_size; every method then takes `dp_rank=` (default 0).
      See jax_kvalloc.data_parallel.
  """

  def __init__(self, size: int, dtype: Any = None, device: Any = None, kvcache: Any = None,
               need_sort: bool = False, *, kernel: Optional[str] = None,
               debug: Optional[bool] = None, backend: str = "device", dp_size: int = 1):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = AllocatorConfig(size=size, page_size=1, need_sort=need_sort, kind="token",
                             **extra)
    super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size)

  def alloc_extend(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_extend (use alloc), "
                              "as in SGLang")

  def alloc_decode(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_decode (use alloc), "
                              "as in SGLang")
