"""Compiling ahead of serving: no compile stall at the first batch of a new size.

A jitted function compiles once per input shape, and the classes pad every size to a
power-of-two bucket (jax_kvalloc.buckets), so a serving loop meets at most a handful of
shapes per operation; but each first meeting costs a compile (tens of ms on a CPU,
0.3-3 s on a GPU) in the middle of serving. `warmup` compiles them all up front:

  * the classes' `warmup(max_batch=..., max_tokens=..., max_free=...)`
    (jax_kvalloc.sglang; the device backend's programs, in
    jax_kvalloc.sglang.backends.device).
  * `warmup_calls(fn, args_for, sizes)` (the functional API): calls your jitted step
    once per size (with `args_for(size)` as arguments), waits, and times it.
  * `enable_persistent_cache(path)`: JAX's persistent compilation cache, so that a
    second process loads every program from disk instead of compiling it. The same as
    setting JAX_COMPILATION_CACHE_DIR, with the size and time thresholds lowered to 0 so
    that the allocator's small programs are cached too.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, List, NamedTuple

import jax

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
