"""Plain-torch computation of the extend/decode slot indices (SPEC 4.2/4.3): the path
torch_ref takes when Triton is not available (CPU without TRITON_INTERPRET), and the
reference the Triton kernels are tested against.

Written per request, as SPEC words it: Part 1 (the rest of the page the prefix ends in),
then the request's new pages, all their slots in order, cut at its sequence length (this
covers SPEC's Parts 2 and 3 at once). The caller has checked capacity: `free_pages`
holds at least the pages the batch needs, and only those are read.
"""
from __future__ import annotations

from typing import Sequence

import torch

from torch_ref.base import _cdiv


def extend_indices(prefix_lens: Sequence[int], seq_lens: Sequence[int],
                   last_loc: Sequence[int], free_pages: torch.Tensor, *,
                   page_size: int) -> torch.Tensor:
  """Slots of an alloc_extend batch.

  Args:
    prefix_lens, seq_lens, last_loc: host ints, one per request (SPEC 4.2).
    free_pages: i64[F] the free list, F >= sum(ceil(seq/ps) - ceil(pre/ps)).
    page_size: slots per page.

  Returns:
    i64[sum(seq_lens - prefix_lens)] on free_pages' device, in batch order.
  """
  ps = page_size
  dev = free_pages.device
  offsets = torch.arange(ps, dtype=torch.int64, device=dev)
  pieces = []
  page_at = 0
  for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
    pre, seq, last = int(pre), int(seq), int(last)
    first_new = _cdiv(pre, ps)
    n1 = min(seq, first_new * ps) - pre
    if n1 > 0:
      pieces.append(torch.arange(last + 1, last + 1 + n1, dtype=torch.int64, device=dev))
    n_new = _cdiv(seq, ps) - first_new
    if n_new > 0:
      pages = free_pages[page_at: page_at + n_new]
      slots = (pages[:, None] * ps + offsets[None, :]).reshape(-1)
      pieces.append(slots[: seq - pre - max(n1, 0)])
      page_at += n_new
  if not pieces:
    return torch.zeros((0,), dtype=torch.int64, device=dev)
  return torch.cat(pieces)


def decode_indices(seq_lens: Sequence[int], last_loc: torch.Tensor,
                   free_pages: torch.Tensor, *, page_size: int) -> torch.Tensor:
  """Slots of an alloc_decode batch (one new token per request).

  Args:
    seq_lens: host ints, one per request, counting the new token (>= 1).
    last_loc: i64[bs] slot of each request's previous token (any device).
    free_pages: i64[F] the free list, F >= the number of requests that need a page.
    page_size: slots per page.

  Returns:
    i64[bs]: free_pages[k] * ps for the k-th request (in batch order) whose new token
    starts a page (ceil(seq/ps) > ceil((seq-1)/ps), any page size), else last_loc + 1.
  """
  ps = page_size
  dev = free_pages.device
  needs = [_cdiv(int(s), ps) > _cdiv(int(s) - 1, ps) for s in seq_lens]
  out = last_loc.to(device=dev, dtype=torch.int64) + 1
  rows = [i for i, n in enumerate(needs) if n]
  if rows:
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    out = out.index_put((rows_t,), free_pages[: len(rows)] * ps)
  return out
