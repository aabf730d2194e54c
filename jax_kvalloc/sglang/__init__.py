"""SGLang's allocator classes over jax_kvalloc's functional core (SGLang's interface and
names; sglang-jax's dp_size / dp_rank). Its modules::

  token.py    TokenToKVPoolAllocator (page_size 1, FIFO free)
  paged.py    PagedTokenToKVPoolAllocator (whole pages, LIFO free, alloc_extend/decode)
  base.py     what both share: input checks, free groups, snapshots, data-parallel ranks
  swa.py      SWATokenToKVPoolAllocator (two pools, full and sliding-window, and a mapping)
  pool.py     one rank's pool: state, host mirror of the list lengths, copy-on-write
  backends/   where a pool lives and how its calls run: one Backend interface, with
              device (jax arrays, no waits), host (NumPy) and debug (checks) backends

The functional core (jax_kvalloc) never imports this package.
"""
from jax_kvalloc.sglang.backends import Backend
from jax_kvalloc.sglang.base import BaseAllocator
from jax_kvalloc.sglang.base import RankedSnapshot
from jax_kvalloc.sglang.paged import PagedTokenToKVPoolAllocator
from jax_kvalloc.sglang.pool import AllocatorSnapshot
from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
from jax_kvalloc.sglang.token import TokenToKVPoolAllocator
from jax_kvalloc.warmup import WarmupReport

__all__ = [
    "AllocatorSnapshot",
    "Backend",
    "BaseAllocator",
    "PagedTokenToKVPoolAllocator",
    "RankedSnapshot",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "WarmupReport",
]
