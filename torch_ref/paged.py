"""SGLang's PagedTokenToKVPoolAllocator (whole pages, LIFO free) in torch + Triton."""
from __future__ import annotations

import os
from typing import Any, List, Optional

import torch

from torch_ref import index_torch
from torch_ref.base import BaseAllocator, _cdiv, as_index_tensor, host_list

KERNELS = ("auto", "triton", "torch")


def triton_usable(device: torch.device) -> bool:
  """Whether Triton can run here: a CUDA device, or any device under TRITON_INTERPRET=1,
  with triton importable."""
  if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
    return False
  try:
    import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


class PagedTokenToKVPoolAllocator(BaseAllocator):
  """Hands out KV slots a page at a time; page 0 is reserved (SPEC 4).

  alloc_extend/alloc_decode check capacity on the host first (from the *_cpu lengths, as
  SGLang's callers pass them), then compute the slots with a Triton kernel of one program
  per request (torch_ref.triton_kernels) or with plain torch (torch_ref.index_torch).

  Args:
    size: number of usable slots; the pool has size // page_size pages.
    page_size: slots per page (1 works too, with SPEC's general decode page count).
    dtype, kvcache: as in SGLang (stored).
    device: torch device of the lists and outputs (default "cpu").
    need_sort: park freed pages in release_pages until a shortfall merges them.
    kernel: "triton", "torch", or "auto": Triton when `triton_usable(device)`, else torch.
  """

  def __init__(self, size: int, page_size: int, dtype: Any = None, device: Any = "cpu",
               kvcache: Any = None, need_sort: bool = False, *, kernel: str = "auto"):
    if kernel not in KERNELS:
      raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    super().__init__(size, page_size, dtype, device, kvcache, need_sort)
    if kernel == "auto":
      kernel = "triton" if triton_usable(self.device) else "torch"
    if kernel == "triton":
      from torch_ref import triton_kernels  # pylint: disable=g-import-not-at-top
      self._triton = triton_kernels
    self.kernel = kernel

  def _release(self, idx: torch.Tensor) -> None:
    pages = torch.unique(idx // self.page_size)  # sorted
    if self.need_sort:
      self.release_pages = torch.cat((pages, self.release_pages))
    else:
      self.free_pages = torch.cat((pages, self.free_pages))

  def alloc_extend(self, prefix_lens: Any, prefix_lens_cpu: Any, seq_lens: Any,
                   seq_lens_cpu: Any, last_loc: Any,
                   extend_num_tokens: int) -> Optional[torch.Tensor]:
    """Slots for a prefill batch (SPEC 4.2), or None if its new pages do not fit.

    Args:
      prefix_lens, seq_lens: [bs] integer tensors (or lists) on any device; the *_cpu
        host copies are used for the checks and page count when given (either may be
        None).
      last_loc: [bs] slot of each request's last prefix token, -1 for an empty prefix.
      extend_num_tokens: sum(seq_lens - prefix_lens).

    Returns:
      i64[extend_num_tokens] on the allocator's device, or None (nothing allocated; a
      need_sort merge that the shortfall triggered stays done).
    """
    pre = host_list(prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu,
                    "prefix_lens")
    seq = host_list(seq_lens if seq_lens_cpu is None else seq_lens_cpu, "seq_lens")
    last = as_index_tensor(last_loc, self.device, "last_loc")
    self._check_lengths(prefix_lens=len(pre), seq_lens=len(seq), last_loc=last.shape[0])
    for i, (p, s) in enumerate(zip(pre, seq)):
      if not 0 <= p <= s:
        raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got "
                         f"prefix_lens[{i}]={p}, seq_lens[{i}]={s}")
    total = sum(s - p for p, s in zip(pre, seq))
    if int(extend_num_tokens) != total:
      raise ValueError(f"extend_num_tokens={int(extend_num_tokens)} != "
                       f"sum(seq_lens - prefix_lens)={total}")
    ps = self.page_size
    if self.need_sort and total // ps + len(pre) + 1 > len(self.free_pages):
      self.merge_and_sort_free()
    num_new = sum(_cdiv(s, ps) - _cdiv(p, ps) for p, s in zip(pre, seq))
    if num_new > len(self.free_pages):
      return None
    if self.kernel == "triton":
      out = self._triton.extend_indices(
          self._device_lens(prefix_lens, prefix_lens_cpu, "prefix_lens"),
          self._device_lens(seq_lens, seq_lens_cpu, "seq_lens"), last, self.free_pages,
          page_size=ps, extend_num_tokens=total)
    else:
      out = index_torch.extend_indices(pre, seq, last.tolist(), self.free_pages,
                                       page_size=ps)
    self.free_pages = self.free_pages[num_new:]
    return out

  def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any,
                   last_loc: Any) -> Optional[torch.Tensor]:
    """One slot per request for its new token (SPEC 4.3), or None if the pages needed
    do not fit.

    Args:
      seq_lens: [bs] lengths counting the new token (seq_lens_cpu used when given).
      last_loc: [bs] slot of each request's previous token.

    Returns:
      i64[bs] on the allocator's device, or None (nothing allocated).
    """
    seq = host_list(seq_lens if seq_lens_cpu is None else seq_lens_cpu, "seq_lens")
    last = as_index_tensor(last_loc, self.device, "last_loc")
    self._check_lengths(seq_lens=len(seq), last_loc=last.shape[0])
    if any(s < 1 for s in seq):
      i = next(i for i, s in enumerate(seq) if s < 1)
      raise ValueError(f"seq_lens[{i}]={seq[i]} must be >= 1 (it counts the new token)")
    ps = self.page_size
    if self.need_sort and len(seq) > len(self.free_pages):
      self.merge_and_sort_free()
    num_new = sum(_cdiv(s, ps) > _cdiv(s - 1, ps) for s in seq)
    if num_new > len(self.free_pages):
      return None
    if self.kernel == "triton":
      out = self._triton.decode_indices(
          self._device_lens(seq_lens, seq_lens_cpu, "seq_lens"), last, self.free_pages,
          page_size=ps)
    else:
      out = index_torch.decode_indices(seq, last, self.free_pages, page_size=ps)
    self.free_pages = self.free_pages[num_new:]
    return out

  def _device_lens(self, lens: Any, lens_cpu: Any, name: str) -> torch.Tensor:
    """The kernel's copy of a length array: the device one, else the host one moved."""
    return as_index_tensor(lens if lens is not None else lens_cpu, self.device, name)

  @staticmethod
  def _check_lengths(**lengths: int) -> None:
    if len(set(lengths.values())) > 1:
      raise ValueError(f"per-request arrays differ in length: {lengths}")

  def __repr__(self) -> str:
    return super().__repr__()[:-1] + f", kernel={self.kernel!r})"


__all__: List[str] = ["PagedTokenToKVPoolAllocator", "triton_usable"]
