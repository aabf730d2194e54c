"""torch_ref: a torch + Triton reference of SGLang's token-to-KV-pool allocators, written
from the contract in docs/spec.md.

Allocators (same class and method names as jax_kvalloc's SGLang-compatible classes):
  TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort)
  PagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort,
                              *, kernel="auto"|"triton"|"torch")
The free and release lists are int64 torch tensors on `device`; outputs are int64
tensors, None on failure. The paged allocator checks capacity on the host, then computes
extend/decode slots with Triton kernels of one program per request
(torch_ref.triton_kernels) or with plain torch (torch_ref.index_torch). Triton runs on
CUDA, or on CPU under TRITON_INTERPRET=1 (set it before torch_ref.triton_kernels is first
imported). Importing torch_ref needs torch but no GPU and not triton; without torch it
raises an ImportError that says what to install.

torch_ref imports nothing of jax_kvalloc's: it is an independent reference. The
lock-step parity harness that compares the two (and SGLang) is `jax-kvalloc parity`
(jax_kvalloc/tools/parity.py).
"""
try:
  import torch  # noqa: F401  pylint: disable=unused-import
except ImportError as e:
  raise ImportError(
      "torch_ref needs torch: pip install torch (or the `torch` extra: "
      "pip install \"jax_kvalloc[torch]\", which adds triton)") from e

from torch_ref.base import TorchAllocatorSnapshot  # pylint: disable=g-import-not-at-top
from torch_ref.paged import PagedTokenToKVPoolAllocator
from torch_ref.token import TokenToKVPoolAllocator

__all__ = [
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "TorchAllocatorSnapshot",
]
