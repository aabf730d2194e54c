"""Timing methods shared by `jax-kvalloc bench`: warm up, many dependent calls per
measurement, medians over repetitions, the fixed overhead removed.

JAX: `jax_loop_time` compiles ONE function that runs `unroll` dependent calls per
iteration of a `fori_loop` with a traced trip count, times it at 1 and at n iterations
(n grown until the run takes `min_time`), and takes the slope: device time per call, with
dispatch, argument copies and the loop's exit removed (the loop's own per-iteration cost,
divided by `unroll`, stays in and is reported separately by `loop_overhead`).

torch: `torch_graph_time` captures `unroll` calls in one CUDA graph and times replays with
CUDA events; `torch_eager_time` times plain calls from Python (synchronizing at the end),
which is how a scheduler pays for them.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Tuple

import jax
import numpy as np

MAX_ITERS = 1 << 16


def _wall(fn: Callable[[], Any]) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def make_loop(body: Callable[[Any], Any], unroll: int):
  """jit(carry, n) -> carry after n iterations of `unroll` calls of body."""
  @jax.jit
  def run(carry, n):
    def outer(_, c):
      for _ in range(unroll):
        c = body(c)
      return c
    return jax.lax.fori_loop(0, n, outer, carry)
  return run


def jax_loop_time(body: Callable[[Any], Any], carry: Any, *, unroll: int,
                  min_time: float, reps: int) -> Dict[str, float]:
  """Per-call seconds of `body` (carry -> carry) as dependent calls inside one jit.

  Returns {"s": per call from the fastest run of each length, "median_s": the median of
  the per-repetition slopes, "spread": their (max - min) / median, "iters": n,
  "compile_s": first call}.
  """
  run = make_loop(body, unroll)
  one = np.int32(1)
  compile_s = _wall(lambda: run(carry, one))
  t1 = min(_wall(lambda: run(carry, one)) for _ in range(3))
  n = 2
  while n < MAX_ITERS and _wall(lambda: run(carry, np.int32(n))) < max(min_time, 8 * t1):
    n *= 2
  ta, tb = [], []
  for _ in range(reps):
    ta.append(_wall(lambda: run(carry, one)))
    tb.append(_wall(lambda: run(carry, np.int32(n))))
  # Noise only adds time: the fastest run of each length is the best estimate.
  per_call = max(min(tb) - min(ta), 0.0) / ((n - 1) * unroll)
  slopes = [max(b - a, 0.0) / ((n - 1) * unroll) for a, b in zip(ta, tb)]
  med = statistics.median(slopes)
  spread = (max(slopes) - min(slopes)) / med if med > 0 else 0.0
  return {"s": per_call, "median_s": med, "spread": spread, "iters": n,
          "compile_s": compile_s}


def loop_overhead(*, unroll: int, min_time: float, reps: int) -> float:
  """Seconds per loop iteration of a near-empty body (one scalar add per call), divided
  by `unroll`: the floor of what `jax_loop_time` can report."""
  res = jax_loop_time(lambda c: c + 1, np.int32(0), unroll=unroll, min_time=min_time,
                      reps=reps)
  return res["s"]


def host_time(fn: Callable[[], Any], *, sync: Callable[[], None], min_time: float,
              reps: int) -> Dict[str, float]:
  """Per-call seconds of `fn()` called back to back from Python, `sync()` at the end."""
  for _ in range(3):
    fn()
  sync()
  n = 1
  while True:
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    sync()
    t = time.perf_counter() - t0
    if t >= min_time or n >= MAX_ITERS:
      break
    n *= 2
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    sync()
    times.append((time.perf_counter() - t0) / n)
  med = statistics.median(times)
  return {"s": med, "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
          "iters": n}


def torch_graph_time(fn: Callable[[], Any], *, unroll: int, min_time: float,
                     reps: int) -> Dict[str, float]:
  """Per-call seconds of `fn` (CUDA work only) from replays of a graph of `unroll` calls."""
  import torch  # pylint: disable=g-import-not-at-top
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    for _ in range(3):
      fn()
  torch.cuda.current_stream().wait_stream(side)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for _ in range(unroll):
      fn()
  graph.replay()
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def timed(n: int) -> float:
    start.record()
    for _ in range(n):
      graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

  n = 1
  while timed(n) < min_time and n < MAX_ITERS:
    n *= 2
  times = [timed(n) / (n * unroll) for _ in range(reps)]
  med = statistics.median(times)
  del graph
  return {"s": med, "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
          "iters": n}


def loglog_slope(x, y) -> float:
  """Least-squares slope of log(y) against log(x) (1 = linear growth)."""
  x, y = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
  if x.size < 2:
    return float("nan")
  return float(np.polyfit(x, y, 1)[0])


def summarize(res: Dict[str, float]) -> Tuple[float, float]:
  """(microseconds, spread) of a timing result."""
  return res["s"] * 1e6, res["spread"]
