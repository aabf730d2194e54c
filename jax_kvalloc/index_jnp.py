"""Pure-jnp (XLA) computation of the extend/decode slot indices: the CPU default and the
truth that every Pallas kernel is checked against.

Both functions implement the index part of SPEC 4.2/4.3 and nothing else: the caller
(jax_kvalloc.allocation) has already computed the prefix sums, checked capacity and gathered
the front of the free list into a contiguous `free_window`. They are the kernel contract
shared with `pallas_kernels` (same arguments, same outputs, bit for bit).

Extend, one formula for SPEC's three parts. Output position t belongs to request r (the
row whose token range [tok_start[r], tok_start[r] + ext[r]) holds t); it is that request's
j-th new token, at sequence position pos = prefix_lens[r] + j. If pos lies in the page the
prefix ends in (pos < ceil(pre/ps) * ps, Part 1) its slot is last_loc[r] + 1 + j;
otherwise it lies in the request's new page number pos // ps - ceil(pre/ps) (Parts 2 and 3),
which is free_window[page_start[r] + that], at offset pos % ps.

Both take an array namespace `xp` (jax.numpy by default). With numpy the inputs are
exact-length host arrays and `out_len` is the batch's exact token count: the form in which
tests/test_host_backend.py checks the classes' host backend (jax_kvalloc.sglang.backends
.host, which computes the same rules in its own host forms) against this definition.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def searchsorted_right(sorted_: Array, values: Array, xp: Any = jnp) -> Array:
  """`xp.searchsorted(sorted_, values, side="right")`. For jax.numpy the binary search is
  unrolled (method="scan_unrolled"): the same result as the default while loop, but
  XLA fuses its log2(len) steps instead of running one loop iteration (several kernel
  launches on a GPU) per step."""
  if xp is jnp:
    return jnp.searchsorted(sorted_, values, side="right", method="scan_unrolled")
  return xp.searchsorted(sorted_, values, side="right")


def cdiv(a: Array, b: int) -> Array:
  """Ceil division for non-negative a (also right for a = -1 with b >= 1: gives 0)."""
  return -((-a) // b)


def extend_indices(free_window: Array, prefix_lens: Array, seq_lens: Array,
                   last_loc: Array, tok_start: Array, page_start: Array, *,
                   page_size: int, out_len: int, xp: Any = jnp) -> Array:
  """Slot indices of an alloc_extend batch, SPEC 4.2.

  Args:
    free_window: i32[P] the first P entries of the free list (0 past its end).
    prefix_lens: i32[B] tokens already cached per request (padded rows: 0).
    seq_lens: i32[B] tokens after this extend (padded rows: 0, so ext = 0).
    last_loc: i32[B] slot of each request's last prefix token (-1 if none).
    tok_start: i32[B] exclusive prefix sum of ext = seq_lens - prefix_lens.
    page_start: i32[B] exclusive prefix sum of new pages
      ceil(seq/ps) - ceil(pre/ps).
    page_size: static, slots per page.
    out_len: static, output length (>= the total of ext when the call succeeds).
    xp: array namespace, jax.numpy (traced, default) or numpy (host arrays).

  Returns:
    i32[out_len]: entry t < sum(ext) is the slot of the t-th new token in batch order,
    entries past it are 0. Every read of free_window is clamped inside it, so inputs that
    would not fit (which the caller then discards) cannot read out of bounds.
  """
  ps = page_size
  num_rows = prefix_lens.shape[0]
  ext = seq_lens - prefix_lens
  tok_end = tok_start + ext
  total = tok_end[-1] if num_rows else xp.zeros((), xp.int32)
  t = xp.arange(out_len, dtype=xp.int32)
  # First row whose token range ends after t; empty rows (ext = 0) are skipped.
  row = searchsorted_right(tok_end, t, xp).astype(xp.int32)
  row = xp.minimum(row, num_rows - 1)
  pre = prefix_lens[row]
  j = t - tok_start[row]
  pos = pre + j
  first_new_page = cdiv(pre, ps)
  # pos < first_new_page * ps, without the product (it wraps for a prefix that ends
  # within a page of 2**31 - 1).
  in_part1 = pos // ps < first_new_page
  k = page_start[row] + pos // ps - first_new_page
  k = xp.clip(k, 0, free_window.shape[0] - 1)
  slot_new = free_window[k] * ps + pos % ps
  slot = xp.where(in_part1, last_loc[row] + 1 + j, slot_new)
  return xp.where(t < total, slot, 0).astype(xp.int32)


def decode_indices(free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int, xp: Any = jnp) -> Array:
  """Slot indices of an alloc_decode batch, SPEC 4.3 (one new token per request).

  Args:
    free_window: i32[P] the first P entries of the free list (0 past its end).
    seq_lens: i32[B] sequence lengths counting the new token (>= 1 for real rows).
    last_loc: i32[B] slot of token seq - 2.
    page_start: i32[B] exclusive prefix sum of needs_page = ceil(seq/ps) > ceil((seq-1)/ps).
    page_size: static, slots per page.
    xp: array namespace, jax.numpy (traced, default) or numpy (host arrays).

  Returns:
    i32[B]: free_window[page_start[i]] * ps where row i needs a page, else last_loc[i] + 1.
    The caller zeroes padded rows.
  """
  ps = page_size
  needs_page = cdiv(seq_lens, ps) > cdiv(seq_lens - 1, ps)
  k = xp.clip(page_start, 0, free_window.shape[0] - 1)
  return xp.where(needs_page, free_window[k] * ps, last_loc + 1).astype(xp.int32)
