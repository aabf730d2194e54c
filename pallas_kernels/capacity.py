"""Capacity and int32-overflow semantics, shared by jax_kvalloc's jnp path and every kernel.

The one rule: a batch fits iff the TRUE (mathematical) sum of its per-row counts (tokens
or new pages, each >= 0) is at most the capacity. int32 sums of large lengths would
wrap (two rows of 2**31 - 1 tokens sum to -2), so no path adds raw counts. Each path
instead adds counts clipped to `cap + 1` (`clip_counts`): a row that alone exceeds the
capacity still exceeds it after clipping, and rows that fit are unchanged, so the verdict
is the same as with true sums. What remains is the sum of up to B clipped counts:

- when B * (cap + 1) fits int32 (`sums_may_wrap` is False, a static check) the plain
  int32 sum is exact;
- otherwise the jnp path scans with a saturating add (`saturating_prefix_sums`, total
  capped at cap + 1) and the kernels, where only an add-scan lowers, compare the exact
  sum with the capacity by 16-bit halves (`sum_exceeds`, up to 2**15 lanes).

Either way the prefix sums are only used when the batch fits, and then none of them
exceeds the capacity, so none wraps. Everything here is plain jnp: it runs inside the
Triton and Mosaic kernel bodies and in XLA alike.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

Array = jax.Array
INT32_MAX = 2**31 - 1
MAX_EXACT_LANES = 2**15   # sum_exceeds: the low halves of 2**15 lanes sum below 2**31


def count_limit(cap: int) -> int:
  """The value counts are clipped to for a static capacity `cap`: cap + 1 (<= int32)."""
  return min(int(cap) + 1, INT32_MAX)


def clip_counts(x: Array, cap: int) -> Array:
  """x (>= 0) clipped to cap + 1: same fits/does-not-fit verdict, no single huge entry."""
  return jnp.minimum(x, count_limit(cap))


def sums_may_wrap(num_rows: int, cap: int) -> bool:
  """Whether a sum of num_rows counts clipped by `clip_counts(., cap)` may pass int32."""
  return int(num_rows) * count_limit(cap) > INT32_MAX


def sum_exceeds(x: Array, cap: Array) -> Array:
  """sum(x) > cap, exactly, for 0 <= x <= INT32_MAX, 0 <= cap and at most 2**15 lanes:
  the sums of the high and low 16-bit halves cannot wrap; they are compared with cap's
  halves. bool[]."""
  hi = jnp.sum(x >> 16)
  lo = jnp.sum(x & 0xFFFF)
  hi = hi + (lo >> 16)
  lo = lo & 0xFFFF
  cap_hi = cap >> 16
  return (hi > cap_hi) | ((hi == cap_hi) & (lo > (cap & 0xFFFF)))


def saturating_prefix_sums(x: Array, cap: int) -> Tuple[Array, Array]:
  """(exclusive prefix sums, total) of x >= 0 (i32[B]) in XLA; exact whenever the true
  total is <= cap, and otherwise a total > cap (never a wrapped small one)."""
  lim = count_limit(cap)
  x = jnp.minimum(x, lim)
  if x.shape[0] == 0:
    return x, jnp.zeros((), jnp.int32)
  if not sums_may_wrap(x.shape[0], cap):
    incl = jnp.cumsum(x)
  else:  # min(a + b, lim) without forming a + b
    incl = jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, lim - a), x)
  return incl - x, incl[-1]
