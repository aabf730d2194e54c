"""Triton kernels for the paged allocator's extend/decode slot indices (SPEC 4.2/4.3).

Launch shape as in SGLang: one program per request, grid (bs,). Each program finds its
own place in the batch, the exclusive prefix sums of tokens and of new pages over the
requests before it, with one masked `tl.sum` over a block of next_power_of_2(bs) lanes
(so a batch costs O(bs^2) work, as SGLang's does), then writes its slots.

What differs from SGLang (SPEC's fixes):
- No read leaves the free list: every load of it is masked by its length `num_free`, and
  the caller checks capacity before launching, so an allocation that does not fit never
  reaches a kernel (sgl-project/sglang issue 34399).
- Decode uses the general new-page test ceil(seq/ps) > ceil((seq-1)/ps), right at every
  page size including 1.

The free list's pointer and length are not specialized on (`do_not_specialize`): slicing
the list moves its data pointer, and specializing on its alignment or on the length would
compile a new variant for nothing. Import this module only after deciding on
TRITON_INTERPRET (it is read when the kernels are decorated); torch_ref.paged imports it
lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slots written per iteration of the new-pages loop (runtime trip count, so a long
# extend neither unrolls nor recompiles).
BLOCK = 1024


@triton.jit(do_not_specialize=["free_pages_ptr", "num_free"])
def _extend_kernel(
    # inputs
    prefix_lens_ptr,   # i64[bs]
    seq_lens_ptr,      # i64[bs]
    last_loc_ptr,      # i64[bs]
    free_pages_ptr,    # i64[num_free]
    num_free,          # i64 scalar
    # outputs
    out_ptr,           # i64[sum(seq - pre)]
    # static
    BS_UPPER: tl.constexpr,    # next_power_of_2(bs)
    PAGE_SIZE: tl.constexpr,
    PS_UPPER: tl.constexpr,    # next_power_of_2(PAGE_SIZE)
    BLOCK_SIZE: tl.constexpr,
):
  pid = tl.program_id(0)
  bs = tl.num_programs(0)

  # This request's place in the batch: prefix sums over the requests before it.
  rows = tl.arange(0, BS_UPPER)
  before = rows < pid
  pre_all = tl.load(prefix_lens_ptr + rows, mask=rows < bs, other=0)
  seq_all = tl.load(seq_lens_ptr + rows, mask=rows < bs, other=0)
  new_pages_all = ((seq_all + PAGE_SIZE - 1) // PAGE_SIZE
                   - (pre_all + PAGE_SIZE - 1) // PAGE_SIZE)
  tok_start = tl.sum(tl.where(before, seq_all - pre_all, 0), axis=0)
  page_start = tl.sum(tl.where(before, new_pages_all, 0), axis=0)

  pre = tl.load(prefix_lens_ptr + pid)
  seq = tl.load(seq_lens_ptr + pid)
  last = tl.load(last_loc_ptr + pid)

  # Part 1: the rest of the page the prefix ends in (fewer than PAGE_SIZE slots).
  boundary = (pre + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
  n1 = tl.minimum(seq, boundary) - pre
  j = tl.arange(0, PS_UPPER)
  tl.store(out_ptr + tok_start + j, last + 1 + j, mask=j < n1)

  # Parts 2 and 3: the request's new pages, slot by slot, from a page boundary on.
  n_rest = (seq - pre - n1).to(tl.int32)
  for start in range(0, n_rest, BLOCK_SIZE):
    t = start + tl.arange(0, BLOCK_SIZE)
    live = t < n_rest
    k = page_start + t // PAGE_SIZE
    page = tl.load(free_pages_ptr + k, mask=live & (k < num_free), other=0)
    tl.store(out_ptr + tok_start + n1 + t, page * PAGE_SIZE + t % PAGE_SIZE, mask=live)


@triton.jit(do_not_specialize=["free_pages_ptr", "num_free"])
def _decode_kernel(
    # inputs
    seq_lens_ptr,      # i64[bs], counting the new token
    last_loc_ptr,      # i64[bs]
    free_pages_ptr,    # i64[num_free]
    num_free,          # i64 scalar
    # outputs
    out_ptr,           # i64[bs]
    # static
    BS_UPPER: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
  pid = tl.program_id(0)
  bs = tl.num_programs(0)

  rows = tl.arange(0, BS_UPPER)
  seq_all = tl.load(seq_lens_ptr + rows, mask=rows < bs, other=1)
  needs_all = ((seq_all + PAGE_SIZE - 1) // PAGE_SIZE
               > (seq_all + PAGE_SIZE - 2) // PAGE_SIZE).to(tl.int64)
  page_start = tl.sum(tl.where(rows < pid, needs_all, 0), axis=0)

  seq = tl.load(seq_lens_ptr + pid)
  last = tl.load(last_loc_ptr + pid)
  needs = (seq + PAGE_SIZE - 1) // PAGE_SIZE > (seq + PAGE_SIZE - 2) // PAGE_SIZE
  page = tl.load(free_pages_ptr + page_start, mask=needs & (page_start < num_free), other=0)
  tl.store(out_ptr + pid, tl.where(needs, page * PAGE_SIZE, last + 1))


def _as_i64(x: torch.Tensor, device: torch.device) -> torch.Tensor:
  return x.to(device=device, dtype=torch.int64).contiguous()


def _free_arg(free_pages: torch.Tensor) -> torch.Tensor:
  """An empty list's tensor may have no storage; the kernel needs a real pointer (its
  loads are all masked off by num_free = 0)."""
  if free_pages.numel() == 0:
    return torch.zeros((1,), dtype=torch.int64, device=free_pages.device)
  return free_pages.contiguous()


def extend_indices(prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                   last_loc: torch.Tensor, free_pages: torch.Tensor, *, page_size: int,
                   extend_num_tokens: int) -> torch.Tensor:
  """Slots of an alloc_extend batch (SPEC 4.2), one program per request.

  Args:
    prefix_lens, seq_lens, last_loc: [bs] integer tensors (any device; moved to
      free_pages' device).
    free_pages: i64[F] the free list; only its first F entries are ever read.
    page_size: slots per page.
    extend_num_tokens: sum(seq_lens - prefix_lens), the output length.

  Returns:
    i64[extend_num_tokens] on free_pages' device, in batch order. The caller must have
    checked that the batch's new pages fit in F; if they do not, the slots of the missing
    pages read as page 0 (no out-of-bounds read).
  """
  dev = free_pages.device
  bs = int(prefix_lens.shape[0])
  out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=dev)
  if bs == 0 or extend_num_tokens == 0:
    return out
  _extend_kernel[(bs,)](
      _as_i64(prefix_lens, dev), _as_i64(seq_lens, dev), _as_i64(last_loc, dev),
      _free_arg(free_pages), free_pages.shape[0], out,
      BS_UPPER=triton.next_power_of_2(bs), PAGE_SIZE=page_size,
      PS_UPPER=triton.next_power_of_2(page_size), BLOCK_SIZE=BLOCK)
  return out


def decode_indices(seq_lens: torch.Tensor, last_loc: torch.Tensor,
                   free_pages: torch.Tensor, *, page_size: int) -> torch.Tensor:
  """Slots of an alloc_decode batch (SPEC 4.3), one program per request.

  Args:
    seq_lens: [bs] lengths counting the new token (>= 1).
    last_loc: [bs] slot of each request's previous token.
    free_pages: i64[F] the free list; only its first F entries are ever read.
    page_size: slots per page.

  Returns:
    i64[bs] on free_pages' device.
  """
  dev = free_pages.device
  bs = int(seq_lens.shape[0])
  out = torch.empty((bs,), dtype=torch.int64, device=dev)
  if bs == 0:
    return out
  _decode_kernel[(bs,)](
      _as_i64(seq_lens, dev), _as_i64(last_loc, dev), _free_arg(free_pages),
      free_pages.shape[0], out, BS_UPPER=triton.next_power_of_2(bs), PAGE_SIZE=page_size)
  return out
