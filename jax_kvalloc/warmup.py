"""Compiling ahead of serving: no compile stall at the first batch of a new size.

A jitted function compiles once per input shape, and the classes pad every size to a
power-of-two bucket (jax_kvalloc.buckets), so a serving loop meets at most a handful of
shapes per operation; but each first meeting costs a compile (tens of ms on a CPU,
0.3-3 s on a GPU) in the middle of serving. `warmup` compiles them all up front:

  * `BaseAllocator.warmup(max_batch=..., max_tokens=..., max_free=...)` (the classes):
    every fast-path program of the device backend for every bucket up to the maxima,
    optionally the exact-length slices of given sizes; the host backend compiles nothing.
  * `warmup_calls(fn, args_for, sizes)` (the functional API): calls your jitted step
    once per size (with `args_for(size)` as arguments), waits, and times it.
  * `enable_persistent_cache(path)`: JAX's persistent compilation cache, so that a
    second process loads every program from disk instead of compiling it (README,
    "Compile once"). The same as setting JAX_COMPILATION_CACHE_DIR, with the size and
    time thresholds lowered to 0 so that the allocator's small programs are cached too.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, List, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import buckets


class WarmupReport(NamedTuple):
  """What a warm-up did: programs run (each compiled unless cached) and seconds spent."""
  programs: int
  seconds: float


def bucket_sizes(maximum: int, minimum: int) -> List[int]:
  """Every bucket a size in 1..maximum pads to: minimum, 2 * minimum, ...,
  bucket(maximum)."""
  top = buckets.bucket(maximum, minimum)
  sizes, b = [], buckets.bucket(1, minimum)
  while b <= top:
    sizes.append(b)
    b *= 2
  return sizes


def warmup_calls(fn: Callable[..., Any], args_for: Callable[[int], tuple],
                 sizes: Iterable[int]) -> WarmupReport:
  """Calls `fn(*args_for(size))` for each size and waits for every result.

  For the functional API: `fn` is your jitted step, `args_for(size)` builds arguments
  whose shapes are those of the bucket `size` (a throwaway state is fine: outputs are
  discarded). Returns the number of calls and the seconds they took (compiles included).
  """
  t0 = time.perf_counter()
  outs, n = [], 0
  for size in sizes:
    outs.append(fn(*args_for(size)))
    n += 1
  jax.block_until_ready(outs)
  return WarmupReport(n, time.perf_counter() - t0)


def warmup_device_ops(ops: Any, state: Any, *, max_batch: int, max_tokens: int,
                      max_free: int, exact_sizes: Iterable[int] = (),
                      extend: bool = True, device_last_loc: bool = False) -> WarmupReport:
  """Runs every fast-path program of jax_kvalloc.device_ops up to the maxima on
  throwaway inputs (the state is not changed: allocation programs are pure and the
  donating ones get copies). `device_last_loc`: also the variants that take last_loc
  as a device array, and its pads from each of `exact_sizes` rows. Waits at the end."""
  cfg = ops.config
  t0 = time.perf_counter()
  outs, n = [], 0
  ring, head, length = state.free_ring, state.free_head, state.free_len
  rows_list = bucket_sizes(max_batch, buckets.MIN_BATCH)
  token_list = bucket_sizes(max_tokens, buckets.MIN_TOKENS)
  for size in token_list:
    outs.append(ops._fn(("alloc", size))(ring, head, length, np.int32(0)))
    n += 1
  for rows in rows_list:
    packed = np.zeros((2 * rows + 1,), np.int32)
    # Extra arguments of each variant: none (last_loc packed), or a device last_loc.
    lasts = [()] + ([(jnp.zeros((rows,), jnp.int32),)] if device_last_loc else [])
    for last in lasts:
      outs.append(ops._fn(("decode", rows))(ring, head, length, packed, *last))
      n += 1
    if extend and cfg.kind == "paged":
      for tokens in token_list:
        packed = np.zeros((3 * rows + 1,), np.int32)
        for last in lasts:
          outs.append(ops._fn(("extend", rows, tokens))(ring, head, length, packed, *last))
          n += 1
  if cfg.need_sort:
    w_ring, w_head, w_len, other = (state.release_ring, state.release_head,
                                    state.release_len, state.free_len)
  else:
    w_ring, w_head, w_len, other = ring, head, length, state.release_len
  names = ["free"] + (["free_page_ids"] if cfg.kind == "paged" else [])
  for m in bucket_sizes(max_free, buckets.MIN_FREE):
    values = np.zeros((m,), np.int32)  # all padding: frees nothing
    for name in names:
      for donate in (True, False):
        target = jnp.copy(w_ring) if donate else w_ring
        outs.append(ops._fn((name, m, donate))(target, w_head, w_len, other, values))
        n += 1
  if cfg.need_sort:
    for donate in (True, False):
      target = jnp.copy(ring) if donate else ring
      outs.append(ops._fn(("merge", donate))(target, head, length, state.release_ring,
                                             state.release_head, state.release_len))
      n += 1
  for size in exact_sizes:  # decode outputs pad to row buckets, the others to token ones
    for bucket_len in {buckets.bucket(size, buckets.MIN_BATCH),
                       buckets.bucket(size, buckets.MIN_TOKENS)}:
      if bucket_len != size:
        outs.append(ops.exact(jnp.zeros((bucket_len,), jnp.int32), size))
        n += 1
    rows = buckets.bucket(size, buckets.MIN_BATCH)
    if device_last_loc and rows != size:
      outs.append(ops.padded(jnp.zeros((size,), jnp.int32), rows, -1))
      n += 1
  jax.block_until_ready(outs)
  return WarmupReport(n, time.perf_counter() - t0)


def enable_persistent_cache(path: str, *, min_compile_time_secs: float = 0.0,
                            min_entry_size_bytes: int = 0) -> None:
  """Turns on JAX's persistent compilation cache in `path` for this process.

  Call it before the first compile. Every program compiled afterwards is written there,
  and any process that points at the same folder (same jax/jaxlib version, backend and
  flags) loads it instead of compiling. Thresholds default to 0 so that the allocator's
  programs, which compile fast, are cached too (jax's defaults skip programs that
  compile in under a second).
  """
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_size_bytes)
