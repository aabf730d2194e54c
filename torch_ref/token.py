"""SGLang's TokenToKVPoolAllocator (page size 1, FIFO free) in torch."""
from __future__ import annotations

from typing import Any

import torch

from torch_ref.base import BaseAllocator


class TokenToKVPoolAllocator(BaseAllocator):
  """Hands out single KV slots 1..size; slot 0 is the padding sink (SPEC 3).

  `alloc(n)` takes the first n free slots; `free` appends slots to the back of the free
  list (or of release_pages when need_sort), in the order given, without
  de-duplication: FIFO. Like SGLang's, it has no alloc_extend/alloc_decode.

  Args:
    size: number of usable slots.
    dtype, kvcache: as in SGLang (stored; get_kvcache returns kvcache).
    device: torch device of the lists and outputs (default "cpu").
    need_sort: park freed slots in release_pages until a shortfall merges them.
  """

  kind = "token"

  def __init__(self, size: int, dtype: Any = None, device: Any = "cpu",
               kvcache: Any = None, need_sort: bool = False):
    super().__init__(size, 1, dtype, device, kvcache, need_sort)

  def _release(self, idx: torch.Tensor) -> None:
    if self.need_sort:
      self.release_pages = torch.cat((self.release_pages, idx))
    else:
      self.free_pages = torch.cat((self.free_pages, idx))

  def alloc_extend(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_extend (use alloc), "
                              "as in SGLang")

  def alloc_decode(self, *args, **kwargs):
    raise NotImplementedError("TokenToKVPoolAllocator has no alloc_decode (use alloc), "
                              "as in SGLang")
