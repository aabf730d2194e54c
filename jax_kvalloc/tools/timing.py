"""How every benchmark takes a time (jax_kvalloc.tools.bench's harness uses these).

Device time per call, JAX: `chain_time(call, carry, inputs)` compiles ONE function that
runs `unroll` chained calls `call(carry, inputs) -> (carry, outputs)` per iteration of a
`fori_loop` with a traced trip count, times it at 1 and at n iterations (n grown until a
run takes `min_time`) and reports the slope per call, median over repetitions. Every
call's work stays in the program (BENCHMARKS.md, "How the numbers are taken"): each
call's outputs are linked into the next call's inputs (`link`: 0 for outputs >= 0, as
slots, counts and flags are, but opaque to XLA), calls are kept apart by
`optimization_barrier`s, and with consumers >= 2 (the default) every output is
XOR-folded into a sink; `consumers=3` adds a sum of every output (the +1 consumer
check, net of its own cost on `stand_in` / `stand_in_pallas`). The link is part of
every figure, so linked figures are never compared with torch's (`torch_linked`); bare
ones are (`chain_loop(..., linked=False)`, valid only for a call that is one custom
call, timed by `kernel_time` from `cuda_activities`).
"""
from __future__ import annotations

import functools
import json
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_ITERS = 1 << 16
DEFAULT_CONSUMERS = 2
Call = Callable[[Any, Any], Tuple[Any, Any]]


class TimingError(RuntimeError):
  """A measurement that cannot be told apart from noise (a slope that is not positive):
  reported as an error, never as a time of 0."""


def _wall(fn: Callable[[], Any]) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def _as_bits(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return x.astype(jnp.int32)


def link(outputs: Any) -> jax.Array:
  """i32[] sum over output arrays of min(max(output), 0): 0 for outputs >= 0, opaque to
  XLA, and a function of every element of every output."""
  leaves = map(_as_bits, jax.tree_util.tree_leaves(outputs))
  return sum((jnp.minimum(jnp.max(x) if x.ndim else x, 0) for x in leaves),
             jnp.zeros((), jnp.int32))


def sink_init(call: Call, carry: Any, inputs: Any,
              consumers: int = DEFAULT_CONSUMERS) -> Any:
  """The sink `chain_loop` folds outputs into: (i32[] link sum, per-output XOR folds when
  consumers >= 2, i32[] sum of every output when consumers >= 3)."""
  zero = jnp.zeros((), jnp.int32)
  if consumers < 2:
    return (zero,)
  outs = jax.eval_shape(call, carry, inputs)[1]
  folds = tuple(jnp.zeros(o.shape, jnp.int32) for o in jax.tree_util.tree_leaves(outs))
  return (zero, folds) + ((zero,) if consumers >= 3 else ())


@functools.lru_cache(maxsize=16)
def chain_loop(call: Call, unroll: int, consumers: int = DEFAULT_CONSUMERS,
               linked: bool = True):
  """jit(carry, inputs, sink, n) -> (carry, inputs, sink) after n iterations of `unroll`
  chained, linked calls (module docstring); `sink` from `sink_init`. Memoized (`call` by
  identity), so timing and profiling one call object compile its loop once. linked=False
  ("bare"): only the call's scalar outputs reach the sink and the inputs stay the same."""
  barrier = jax.lax.optimization_barrier

  @jax.jit
  def run(carry, inputs, sink, n):
    def iteration(_, c):
      carry, inputs, sink = c
      total, outs = sink[0], ()
      for _ in range(unroll):
        carry, inputs, outs = barrier((carry, inputs, outs))
        carry, out = call(carry, inputs)
        if linked:
          dep = link(out)
          inputs = jax.tree_util.tree_map(lambda x, d=dep: x + d.astype(x.dtype), inputs)
        else:
          dep = link([x for x in jax.tree_util.tree_leaves(out) if not jnp.ndim(x)])
        total = total + dep
        outs = outs + ((out,) if consumers > 1 else ())
      if consumers < 2:
        return carry, inputs, (total,)
      carry, inputs, outs = barrier((carry, inputs, outs))
      columns = zip(*[jax.tree_util.tree_leaves(o) for o in outs])
      new = (total, tuple(functools.reduce(lambda a, x: a ^ _as_bits(x), col, acc)
                          for acc, col in zip(sink[1], columns)))
      if consumers >= 3:
        new += (sink[2] + sum(jnp.sum(_as_bits(x)) for o in outs
                              for x in jax.tree_util.tree_leaves(o)),)
      return carry, inputs, new
    return jax.lax.fori_loop(0, n, iteration, (carry, inputs, sink))
  return run


def _loop_timer(call: Call, carry: Any, inputs: Any, unroll: int, consumers: int):
  """(timed(n) -> seconds of one run of n iterations of the chain loop, compile
  seconds: the first run's)."""
  run = chain_loop(call, unroll, consumers)
  sink = sink_init(call, carry, inputs, consumers)
  timed = lambda k: _wall(lambda: run(carry, inputs, sink, np.int32(k)))
  return timed, timed(1)


def _grow(timed: Callable[[int], float], min_time: float) -> int:
  """The run length n (a power of two) at which a run takes min_time and 8 runs of 1."""
  t1 = min(timed(1) for _ in range(3))
  n = 2
  while n < MAX_ITERS and timed(n) < max(min_time, 8 * t1):
    n *= 2
  return n


def quartiles(values) -> Tuple[float, float]:
  """(first, third) quartile (numpy's linear interpolation; one value is both)."""
  q1, q3 = np.percentile(np.asarray(list(values), np.float64), [25, 75])
  return float(q1), float(q3)


def _stats(values: List[float]) -> Dict[str, float]:
  """{"s": median, "min_s", "q1_s", "q3_s", "spread": (max - min) / median}."""
  med = statistics.median(values)
  q1, q3 = quartiles(values)
  return {"s": med, "min_s": min(values), "q1_s": q1, "q3_s": q3,
          "spread": (max(values) - min(values)) / med if med > 0 else float("inf")}


def _result(ta, tb, n: int, unroll: int, compile_s: float) -> Dict[str, float]:
  """The per-call slopes' statistics from runs of 1 (ta) and n (tb) iterations; min_s:
  the slope between the fastest run of each length."""
  per = (n - 1) * unroll
  return dict(_stats([(b - a) / per for a, b in zip(ta, tb)]),
              min_s=(min(tb) - min(ta)) / per, iters=n, compile_s=compile_s)


def _slopes(timers: List[Tuple[Callable[[int], float], float]], *, unroll: int,
            min_time: float, reps: int) -> List[Dict[str, float]]:
  """Seconds per call of each (timed(n) -> seconds of n iterations, compile seconds) in
  `timers`: `reps` pairs of runs of 1 and n iterations (`unroll` calls each), n grown by
  `_grow`, the repetitions interleaved (rep 1 of every timer, then rep 2, ...) so that a
  drift of the machine falls on all alike. Where noise outweighs a timer's work, all are
  timed again with its runs 4x longer, up to MAX_ITERS (then TimingError)."""
  ns = [_grow(timed, min_time) for timed, _ in timers]
  while True:
    times = [([], []) for _ in timers]
    for _ in range(reps):
      for (timed, _), n, (ta, tb) in zip(timers, ns, times):
        ta.append(timed(1))
        tb.append(timed(n))
    results = [_result(ta, tb, n, unroll, c)
               for (_, c), n, (ta, tb) in zip(timers, ns, times)]
    for r in results:
      if r["s"] <= 0 and r["iters"] >= MAX_ITERS:
        raise TimingError(
            f"the run of {r['iters']} iterations was not slower than the run of 1 (median "
            f"slope {r['s'] * 1e6:.3g} us): noise dominates this measurement; raise "
            f"--min-time")
    if all(r["s"] > 0 for r in results):
      return results
    ns = [n * 4 if r["s"] <= 0 else n for n, r in zip(ns, results)]


def chain_time(call: Call, carry: Any, inputs: Any, *, unroll: int, min_time: float,
               reps: int) -> Dict[str, float]:
  """Device seconds per call of `call(carry, inputs) -> (carry, outputs)` chained inside
  one jit (module docstring): {"s": median per-call slope, "min_s": the slope of the
  fastest run of each length, "spread": (max - min) / median, "q1_s", "q3_s", "iters",
  "compile_s"}. TimingError when noise outweighs the work even at MAX_ITERS."""
  timer = _loop_timer(call, carry, inputs, unroll, DEFAULT_CONSUMERS)
  return _slopes([timer], unroll=unroll, min_time=min_time, reps=reps)[0]


def chain_time_interleaved(variants: List[Dict[str, Any]], *, unroll: int,
                           min_time: float, reps: int) -> List[Dict[str, float]]:
  """`chain_time` of several variants, each a dict(call, carry, inputs, consumers), their
  repetitions interleaved (`_slopes`); one result per variant."""
  return _slopes([_loop_timer(v["call"], v["carry"], v["inputs"], unroll,
                              v.get("consumers", DEFAULT_CONSUMERS)) for v in variants],
                 unroll=unroll, min_time=min_time, reps=reps)


def loop_overhead(*, unroll: int, min_time: float, reps: int) -> float:
  """Seconds per call of a near-empty call (one scalar add) in the same harness."""
  return chain_time(lambda c, x: (c + x, c), jnp.zeros((), jnp.int32),
                    jnp.ones((), jnp.int32), unroll=unroll, min_time=min_time,
                    reps=reps)["s"]


def stand_in(out_shapes: Any) -> Call:
  """A call (c, x) -> (c + 1, outputs of `out_shapes`) that does no other work. Each
  array output is iota + a loop-variant scalar (not a broadcast, which XLA could fold
  into its consumers), so its consumers cost what they cost on a real call's outputs."""
  def fill(o, v):
    if not o.shape:
      return jnp.full(o.shape, v, o.dtype)
    return (jax.lax.broadcasted_iota(jnp.int32, o.shape, 0) + v).astype(o.dtype)

  def call(c, x):
    first = jax.tree_util.tree_leaves(x)[0].reshape(-1)[0]
    return c + 1, jax.tree_util.tree_map(lambda o: fill(o, first + c), out_shapes)
  return call


STAND_IN_BLOCK = 1024


def _stand_in_body(x_ref, *out_refs, p):
  """p: ((length, dtype name), ...) per output, scalars as length 1."""
  from pallas_kernels import _util  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  v = x_ref[0]
  idx = pl.program_id(0) * STAND_IN_BLOCK + jnp.arange(STAND_IN_BLOCK, dtype=jnp.int32)
  for ref, (n, dtype) in zip(out_refs, p):
    _util.store(ref, idx, (idx + v).astype(dtype), idx < n)


def stand_in_pallas(out_shapes: Any, interpret: bool = False) -> Call:
  """`stand_in` with its outputs written by one Pallas-Triton kernel launch (Pallas'
  interpreter with interpret=True), as the Pallas paths write theirs: the floor of their
  +1 consumer check and of their floor column."""
  from pallas_kernels import _util  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree_util.tree_flatten(out_shapes)
  p = tuple((max(int(np.prod(o.shape)), 1), jnp.dtype(o.dtype).name) for o in leaves)

  class _Kernel(_util.TritonCall):
    def spec(self):
      outs = tuple(jax.ShapeDtypeStruct((n,), d) for n, d in p)
      return outs, _stand_in_body, (-(-max(n for n, _ in p) // STAND_IN_BLOCK),)

  kernel = _Kernel("jax_kvalloc_bench_stand_in", p, 4, interpret)

  def call(c, x):
    outs = kernel.run(jax.tree_util.tree_leaves(x)[0].reshape(-1)[:1] + c)
    outs = [o.reshape(leaf.shape) for o, leaf in zip(outs, leaves)]
    return c + 1, jax.tree_util.tree_unflatten(treedef, outs)
  return call


def host_time(fn: Callable[[], Any], *, sync: Callable[[], None], min_time: float,
              reps: int, n: Optional[int] = None) -> Dict[str, float]:
  """Per-call seconds of `fn()` called back to back from Python, `sync()` at the end of
  each run of n calls (n given, or grown until a run takes min_time): median over
  `reps` runs, their quartiles and min."""
  for _ in range(3):
    fn()
  sync()
  fixed, n, times = n is not None, n or 1, []
  while len(times) < reps:
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    sync()
    t = time.perf_counter() - t0
    if not fixed and t < min_time and n < MAX_ITERS:
      n *= 2
      continue
    times.append(t / n)
  return dict(_stats(times), iters=n)


def per_call(call: Callable[[], Any], *, before: Optional[Callable[[], Any]] = None,
             sync: Optional[Callable[[Any], None]] = None,
             wait: Callable[[Any], None] = lambda out: None, reps: int,
             warm: int = 3) -> Dict[str, float]:
  """Host seconds of each call of `call()` alone, after the untimed `before()` and with
  `sync(its result)` timed in when given: median, quartiles and min over `reps` calls
  after `warm` untimed ones; "sync_s": the mean per call of the whole loop, with one
  `wait(last result)` at its end (the throughput bound of asynchronous calls)."""
  sync_or_wait = sync or wait
  for _ in range(warm):
    if before:
      before()
    sync_or_wait(call())
  times, out = [], None
  t_all = time.perf_counter()
  for _ in range(reps):
    if before:
      before()
    t0 = time.perf_counter()
    out = call()
    if sync:
      sync(out)
    times.append(time.perf_counter() - t0)
  wait(out)
  return dict(_stats(times), iters=reps, sync_s=(time.perf_counter() - t_all) / reps)


LAUNCH = re.compile(r"= [^=]*? (fusion|custom-call|gather|scatter|sort|reduce|copy|"
                    r"dynamic-update-slice|dynamic-slice|while|conditional|call)\(")


def launches(compiled_text: str) -> Dict[str, int]:
  """The kernel-like ops of a compiled program's ENTRY computation, by kind."""
  ops = LAUNCH.findall(compiled_text[compiled_text.index("ENTRY"):])
  return {k: ops.count(k) for k in sorted(set(ops))}


def cuda_activities(run: Callable[[], Any]) -> list:
  """Every GPU activity (kernel, memcpy, memset) of `run()`, from CUPTI through
  torch.profiler (which records the whole process's launches, JAX's included), as
  (start us, duration us, category, name), by start. Needs torch with CUDA."""
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
      return activities_of(json.load(f)["traceEvents"])


def activities_of(trace_events: list) -> list:
  """The GPU activities of a Chrome trace's events (see `cuda_activities`)."""
  return sorted((float(e["ts"]), float(e.get("dur", 0.0)), e.get("cat", ""),
                 e.get("name", "")) for e in trace_events if e.get("ph") == "X"
                and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def kernel_time(activities: list, name_prefix: str, *, min_count: int) -> Dict[str, float]:
  """The GPU execution time of the kernels whose name starts with `name_prefix` (launch
  excluded, the same on both sides of a comparison however each was launched): {"s":
  median, "min_s", "spread", "q1_s", "q3_s", "count"}. TimingError when fewer than
  `min_count` ran (a profile that lost records, or a name that matches nothing)."""
  durs = [d * 1e-6 for _, d, cat, name in activities
          if cat == "kernel" and name.startswith(name_prefix)]
  if len(durs) < min_count:
    raise TimingError(f"{len(durs)} kernels named {name_prefix}* in the profile, "
                      f"expected at least {min_count}")
  return dict(_stats(durs), count=len(durs))


def torch_graph(fn: Callable[[], Any], unroll: int):
  """A torch.cuda.CUDAGraph of `unroll` calls of `fn` (warmed up on a side stream first),
  replayed once."""
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
  return graph


def torch_linked(call: Callable[[], Any], inputs) -> Callable[[], Any]:
  """call() followed by the harness's link in torch: dep = min(max(out), 0) added to every
  input tensor in place (as in `chain_loop`)."""
  def linked():
    out = call()
    dep = out.amax().clamp(max=0)
    for x in inputs:
      x.add_(dep)
    return out
  return linked


def torch_graph_time(fn: Callable[[], Any], *, unroll: int, min_time: float,
                     reps: int) -> Dict[str, float]:
  """Per-call seconds of `fn` (CUDA work only) from replays of a graph of `unroll` calls:
  `chain_time`'s slope between a run of 1 replay and a run of n, with CUDA events."""
  import torch  # pylint: disable=g-import-not-at-top
  graph = torch_graph(fn, unroll)
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def timed(n: int) -> float:
    start.record()
    for _ in range(n):
      graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

  return _slopes([(timed, 0.0)], unroll=unroll, min_time=min_time, reps=reps)[0]
