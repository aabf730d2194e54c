"""Shared mechanics of torch_ref's allocators: the free and release lists as torch
tensors, free groups, merges, snapshots, input conversion and checks.

Every change to a list builds a new tensor (slicing, `torch.cat`, `torch.sort`); nothing
is written in place, so a snapshot is simply the pair of list tensors of the moment.
Lists and outputs are int64 on the allocator's device, as in SGLang.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import torch


class TorchAllocatorSnapshot(NamedTuple):
  """What `backup_state` returns: the two lists (never modified in place afterwards)."""
  free_pages: torch.Tensor      # i64[len(free_pages)]
  release_pages: torch.Tensor   # i64[len(release_pages)]


def as_index_tensor(x: Any, device: torch.device, name: str) -> torch.Tensor:
  """A 1-D int64 tensor on `device` from a tensor, numpy array or list of ints.

  Raises TypeError naming `name` for non-integer input and ValueError for other ranks.
  """
  t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
  if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or
                    t.dtype == torch.bool):
    raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
  if t.dim() == 0:
    t = t.reshape(1)
  if t.dim() != 1:
    raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
  return t.to(device=device, dtype=torch.int64)


def host_list(x: Any, name: str) -> List[int]:
  """Host ints from a tensor (any device), numpy array or list, for the checks and page
  counts that SGLang also computes on the host."""
  if isinstance(x, torch.Tensor):
    x = x.detach().cpu()
  return [int(v) for v in as_index_tensor(x, torch.device("cpu"), name).tolist()]


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class BaseAllocator:
  """SGLang's allocator interface over two tensor lists (see TokenToKVPoolAllocator and
  PagedTokenToKVPoolAllocator)."""

  kind = "paged"

  def __init__(self, size: int, page_size: int, dtype: Any, device: Any, kvcache: Any,
               need_sort: bool):
    for name, value in (("size", size), ("page_size", page_size)):
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if size < page_size:
      raise ValueError(f"size must hold at least one page: size={size} < "
                       f"page_size={page_size}")
    self.size = size
    self.page_size = page_size
    self.dtype = dtype
    self.device = torch.device(device if device is not None else "cpu")
    self._kvcache = kvcache
    self.need_sort = bool(need_sort)
    self.num_pages = size // page_size
    self.clear()

  # -- state ---------------------------------------------------------------------------
  def clear(self) -> None:
    """Back to the initial state (SPEC 2); closes any open free group."""
    self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64,
                                   device=self.device)
    self.release_pages = torch.zeros((0,), dtype=torch.int64, device=self.device)
    self.free_group: Optional[List[torch.Tensor]] = None
    self._page_id_group: List[torch.Tensor] = []  # free_page_ids queued in a group

  def available_size(self) -> int:
    """Free slots, released ones included: (len(free) + len(release)) * page_size."""
    return (len(self.free_pages) + len(self.release_pages)) * self.page_size

  def get_kvcache(self) -> Any:
    return self._kvcache

  @property
  def is_not_in_free_group(self) -> bool:
    return self.free_group is None

  def backup_state(self) -> TorchAllocatorSnapshot:
    """A snapshot that `restore_state` puts back exactly (SPEC 8)."""
    return TorchAllocatorSnapshot(self.free_pages, self.release_pages)

  def restore_state(self, state: TorchAllocatorSnapshot) -> None:
    """Puts a snapshot from `backup_state` back."""
    if not isinstance(state, TorchAllocatorSnapshot):
      raise TypeError(f"state must come from backup_state(), got {type(state).__name__}")
    self.free_pages, self.release_pages = state.free_pages, state.release_pages

  def merge_and_sort_free(self) -> None:
    """free_pages = sort(free_pages ++ release_pages), release_pages = [] (SPEC 6)."""
    if len(self.release_pages) > 0:
      self.free_pages, _ = torch.sort(torch.cat((self.free_pages, self.release_pages)))
      self.release_pages = self.release_pages[:0]

  def _take_front(self, num_pages: int) -> Optional[torch.Tensor]:
    """The first num_pages free pages, dropped from the list; None (and nothing taken)
    when they are not there even after a need_sort merge."""
    if self.need_sort and num_pages > len(self.free_pages):
      self.merge_and_sort_free()
    if num_pages > len(self.free_pages):
      return None
    pages = self.free_pages[:num_pages]
    self.free_pages = self.free_pages[num_pages:]
    return pages

  # -- operations ----------------------------------------------------------------------
  def alloc(self, need_size: int) -> Optional[torch.Tensor]:
    """`need_size` slots from the front of the free list (SPEC 3, 4.1), or None.

    Returns i64[need_size]. Paged: need_size must be a multiple of page_size (ValueError
    otherwise); page p gives slots p*ps .. p*ps+ps-1.
    """
    if isinstance(need_size, bool) or not isinstance(need_size, int):
      raise TypeError(f"need_size must be an int, got {type(need_size).__name__}")
    if need_size < 0:
      raise ValueError(f"need_size must be >= 0, got {need_size}")
    if need_size % self.page_size:
      raise ValueError(f"need_size={need_size} must be a multiple of "
                       f"page_size={self.page_size}")
    pages = self._take_front(need_size // self.page_size)
    if pages is None or self.page_size == 1:
      return pages
    offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
    return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

  def free(self, free_index: Any) -> None:
    """Returns slots to the pool (queued while a free group is open, SPEC 7)."""
    idx = as_index_tensor(free_index, self.device, "free_index")
    if idx.numel() == 0:
      return
    self._check_free_index(idx)
    if self.free_group is not None:
      self.free_group.append(idx.clone())  # later writes to the caller's buffer must not
      return                               # change what is freed
    self._release(idx)

  def _release(self, idx: torch.Tensor) -> None:
    raise NotImplementedError

  def _check_free_index(self, idx: torch.Tensor) -> None:
    lo, hi = int(idx.min()), int(idx.max())
    top = (self.num_pages + 1) * self.page_size - 1
    if lo < self.page_size or hi > top:
      bad = lo if lo < self.page_size else hi
      raise ValueError(f"free_index holds {bad}, not an allocatable slot: valid slots are "
                       f"{self.page_size}..{top} (page 0 is reserved)")

  def free_group_begin(self) -> None:
    """Opens a free group: frees are queued until free_group_end (SPEC 7)."""
    if self.free_group is not None:
      raise RuntimeError("free_group_begin() called while a free group is already open")
    self.free_group = []
    self._page_id_group = []

  def free_group_end(self) -> None:
    """Closes the free group and frees everything queued in one call (SPEC 7); then the
    queued page-id frees, in front (SPEC 10)."""
    if self.free_group is None:
      raise RuntimeError("free_group_end() called without free_group_begin()")
    queued, self.free_group = self.free_group, None
    page_ids, self._page_id_group = self._page_id_group, []
    if queued:
      self._release(torch.cat(queued))
    if page_ids:
      self._prepend_pages(torch.cat(page_ids))

  # -- SPEC 10 (sglang 0.5.23's newer operations) --------------------------------------
  def _prepend_pages(self, pages: torch.Tensor) -> None:
    if self.need_sort:
      self.release_pages = torch.cat((pages, self.release_pages))
    else:
      self.free_pages = torch.cat((pages, self.free_pages))

  def free_page_ids(self, page_ids: Any) -> None:
    """Frees exactly these pages in the given order, no sort (paged: prepended as one
    block; token: `free`, its page ids are slots). Pages must be in 1..num_pages."""
    ids = as_index_tensor(page_ids, self.device, "page_ids")
    if ids.numel() == 0:
      return
    if self.kind == "token":
      self.free(ids)
      return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 1 or hi > self.num_pages:
      raise ValueError(f"page_ids holds {lo if lo < 1 else hi}, not a page of the pool "
                       f"(1..{self.num_pages})")
    if self.free_group is not None:
      self._page_id_group.append(ids.clone())
      return
    self._prepend_pages(ids)

  def free_segment(self, free_index: Any, *, start_pos: int) -> None:
    """One request's slots of tokens start_pos.. (start_pos a multiple of page_size):
    paged, free_page_ids(free_index[::page_size] // page_size); token, free."""
    if start_pos % self.page_size:
      raise ValueError(f"start_pos={start_pos} must be a multiple of "
                       f"page_size={self.page_size}")
    idx = as_index_tensor(free_index, self.device, "free_index")
    if idx.numel() == 0:
      return
    if self.kind == "token":
      self.free(idx)
      return
    self._check_free_index(idx)
    self.free_page_ids(idx[::self.page_size] // self.page_size)

  def free_segments(self, segments: Any) -> None:
    """Each (free_index, start_pos) in turn through free_segment; consecutive non-empty
    segments must not share a page (ValueError, nothing freed)."""
    segments = list(segments)
    prev_end = None
    for free_index, start in segments:
      n = as_index_tensor(free_index, self.device, "free_index").numel()
      if n == 0:
        continue
      if prev_end is not None and start // self.page_size <= (prev_end - 1) // self.page_size:
        raise ValueError(f"segment at {start} shares a page with the one ending at "
                         f"{prev_end}")
      prev_end = start + n
    for free_index, start in segments:
      self.free_segment(free_index, start_pos=start)

  def free_full(self, free_index: Any) -> None:
    self.free(free_index)

  def free_full_segment(self, free_index: Any, *, start_pos: int) -> None:
    self.free_segment(free_index, start_pos=start_pos)

  def free_full_segments(self, segments: Any) -> None:
    self.free_segments(segments)

  def get_all_free_pages(self) -> torch.Tensor:
    return torch.cat((self.free_pages, self.release_pages))

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"need_sort={self.need_sort}, device={str(self.device)!r})")
