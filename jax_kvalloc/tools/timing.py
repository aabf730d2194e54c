"""The one timing harness of `jax-kvalloc bench` (and tests/gpu_check.py).

JAX: `chain_time(call, carry, inputs)` compiles ONE function that runs `unroll` chained
calls `call(carry, inputs) -> (carry, outputs)` per iteration of a `fori_loop` with a
traced trip count, times it at 1 and at n iterations (n grown until a run takes
`min_time`), and reports the slope per call (median over repetitions). What keeps every
call's work in the program, whatever XLA does (on CPU and GPU it expands optimization
barriers before fusion, so a barrier alone does not keep calls apart):

- The link: after each call, every output array is reduced (max) into one scalar
  `dep = sum(min(max(output), 0))`, which is 0 at run time (outputs are slots, counts and
  flags, all >= 0) but unknown to XLA. dep is added to the next call's inputs and to the
  sink the loop returns. So every output of every call is consumed, the next call's
  inputs depend on it (nothing input-only can be hoisted out of the loop), and a
  reduction separates consecutive calls (XLA never fuses a reduction into a consumer of
  another shape), so no two calls share a kernel. The link's own cost (one reduction,
  one add to the inputs) is part of every figure. The torch and SGLang graphs pay the
  same link written in torch (bench_micro.torch_linked), but there it is 4-5 eager
  kernels per call where XLA fuses it into one or two, so a ratio of two linked
  figures measures the links as much as the allocators: comparisons across sides use
  each kernel's own GPU time (`kernel_time`, CUPTI) instead.
- The carry, inputs and outputs also pass `jax.lax.optimization_barrier` between calls
  (what keeps them apart on TPU, where barriers survive).
- The fold (consumers >= 2, the default): at the end of each iteration every output of
  every call is also XOR-folded into a per-output sink. With the link as its only
  consumer, XLA fused a jnp output into the link's reduction and never wrote it to
  memory (H200, 2026-11-30: jnp decode figures 4-37% low); a second consumer makes it
  write every output, as a caller would need.
- `consumers=3` adds a third consumer (every output summed into one more sink): a figure
  that moves by more than its noise under it was not counting all of its work
  (`jax-kvalloc bench --extra-consumer`). That consumer has a cost of its own, so the
  check also times a stand-in that writes the same outputs the same way (`stand_in`,
  an XLA fusion, for jnp; `stand_in_pallas`, one Pallas kernel launch, for Pallas) at
  both consumer counts, and the four loops' repetitions are interleaved
  (`chain_time_interleaved`) so that drift falls on all of them alike.

`chain_loop` builds the loop alone, so that tests can compile it at two unroll counts and
count the call's characteristic ops (tests/test_bench_harness.py).

torch: `torch_graph_time` captures `unroll` calls in one CUDA graph and times replays with
CUDA events, reporting the same slope statistic as `chain_time`; `host_time` times plain calls from Python (synchronizing at the end), which
is how a scheduler pays for eager calls.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_ITERS = 1 << 16
Call = Callable[[Any, Any], Tuple[Any, Any]]


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
  dep = jnp.zeros((), jnp.int32)
  for x in jax.tree_util.tree_leaves(outputs):
    x = _as_bits(x)
    dep = dep + jnp.minimum(jnp.max(x) if x.ndim else x, 0)
  return dep


def _add(inputs: Any, dep: jax.Array) -> Any:
  return jax.tree_util.tree_map(lambda x: x + dep.astype(x.dtype), inputs)


DEFAULT_CONSUMERS = 2


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


def _sum_fold(total, outs_per_call):
  for o in outs_per_call:
    for x in jax.tree_util.tree_leaves(o):
      total = total + jnp.sum(_as_bits(x))
  return total


def _xor_fold(folds, outs_per_call):
  per_leaf = zip(*[jax.tree_util.tree_leaves(o) for o in outs_per_call])
  out = []
  for acc, col in zip(folds, per_leaf):
    for x in col:
      acc = acc ^ _as_bits(x)
    out.append(acc)
  return tuple(out)


@functools.lru_cache(maxsize=16)
def chain_loop(call: Call, unroll: int, consumers: int = DEFAULT_CONSUMERS,
               linked: bool = True):
  """jit(carry, inputs, sink, n) -> (carry, inputs, sink) after n iterations of `unroll`
  chained, linked calls (see the module docstring). `sink` from `sink_init`. Memoized on
  its arguments (`call` by identity unless it defines equality), so that timing and
  profiling the same call object compile its loop once.

  linked=False ("bare") drops the link: only the call's scalar outputs reach the sink and
  the inputs stay the same. That is valid only for a call that is one custom call (a
  fused Pallas kernel): XLA never runs part of one, and the next call depends on it
  through the carry; for anything else XLA may drop or hoist work."""
  barrier = jax.lax.optimization_barrier

  @jax.jit
  def run(carry, inputs, sink, n):
    def iteration(_, c):
      carry, inputs, sink = c
      total = sink[0]
      outs = ()
      for _ in range(unroll):
        carry, inputs, outs = barrier((carry, inputs, outs))
        carry, out = call(carry, inputs)
        if linked:
          dep = link(out)
          inputs = _add(inputs, dep)
        else:
          dep = link([x for x in jax.tree_util.tree_leaves(out) if not jnp.ndim(x)])
        total = total + dep
        outs = outs + ((out,) if consumers > 1 else ())
      if consumers < 2:
        return carry, inputs, (total,)
      carry, inputs, outs = barrier((carry, inputs, outs))
      folds = (total, _xor_fold(sink[1], outs))
      if consumers >= 3:
        folds = folds + (_sum_fold(sink[2], outs),)
      return carry, inputs, folds
    return jax.lax.fori_loop(0, n, iteration, (carry, inputs, sink))
  return run


def _prepared(call: Call, carry: Any, inputs: Any, *, unroll: int, min_time: float,
              consumers: int, linked: bool):
  """(timed(n) -> seconds of one run of n iterations, n, compile seconds): the loop
  compiled and n grown until a run takes `min_time` (and 8 runs of 1 iteration)."""
  run = chain_loop(call, unroll, consumers, linked)
  sink = sink_init(call, carry, inputs, consumers)
  timed = lambda k: _wall(lambda: run(carry, inputs, sink, np.int32(k)))
  compile_s = timed(1)
  t1 = min(timed(1) for _ in range(3))
  n = 2
  while n < MAX_ITERS and timed(n) < max(min_time, 8 * t1):
    n *= 2
  return timed, n, compile_s


def quartiles(values) -> Tuple[float, float]:
  """(first, third) quartile of `values` (linear interpolation between order statistics,
  numpy's default; a single value is both)."""
  q1, q3 = np.percentile(np.asarray(list(values), np.float64), [25, 75])
  return float(q1), float(q3)


def _result(ta, tb, n: int, unroll: int, compile_s: float) -> Dict[str, float]:
  slopes = [(b - a) / ((n - 1) * unroll) for a, b in zip(ta, tb)]
  med = statistics.median(slopes)
  q1, q3 = quartiles(slopes)
  return {"s": med, "min_s": (min(tb) - min(ta)) / ((n - 1) * unroll),
          "spread": (max(slopes) - min(slopes)) / med if med > 0 else float("inf"),
          "q1_s": q1, "q3_s": q3, "iters": n, "compile_s": compile_s}


def _noise_error(n: int, med: float) -> "TimingError":
  return TimingError(
      f"the run of {n} iterations was not slower than the run of 1 (median slope "
      f"{med * 1e6:.3g} us): noise dominates this measurement; raise --min-time")


def chain_time(call: Call, carry: Any, inputs: Any, *, unroll: int, min_time: float,
               reps: int, consumers: int = DEFAULT_CONSUMERS,
               linked: bool = True) -> Dict[str, float]:
  """Device seconds per call of `call(carry, inputs) -> (carry, outputs)` chained inside
  one jit (see the module docstring).

  Returns {"s": median over repetitions of the per-call slope, "min_s": the slope of the
  fastest run of each length, "spread": (max - min) / median of the slopes, "q1_s" /
  "q3_s": the slopes' quartiles, "iters": n, "compile_s": first call}.
  """
  timed, n, compile_s = _prepared(call, carry, inputs, unroll=unroll, min_time=min_time,
                                  consumers=consumers, linked=linked)
  while True:
    ta, tb = [], []
    for _ in range(reps):
      ta.append(timed(1))
      tb.append(timed(n))
    res = _result(ta, tb, n, unroll, compile_s)
    if res["s"] > 0 or n >= MAX_ITERS:
      break
    n *= 4  # noise outweighed the work: time longer runs rather than report 0
  if res["s"] <= 0:
    raise _noise_error(n, res["s"])
  return res


def chain_time_interleaved(variants, *, unroll: int, min_time: float,
                           reps: int) -> list:
  """`chain_time` of several variants, each a dict(call, carry, inputs, consumers), with
  their repetitions interleaved (rep 1 of every variant, then rep 2, ...), so that a
  drift of the machine (clocks, the other lane's load on the shared host) falls on all
  of them alike: what a comparison between them needs. Returns one result per variant,
  as chain_time's."""
  prepared = [_prepared(v["call"], v["carry"], v["inputs"], unroll=unroll,
                        min_time=min_time, consumers=v.get("consumers", DEFAULT_CONSUMERS),
                        linked=True) for v in variants]
  times = [([], []) for _ in variants]
  for _ in range(reps):
    for (timed, n, _), (ta, tb) in zip(prepared, times):
      ta.append(timed(1))
      tb.append(timed(n))
  out = []
  for (_, n, compile_s), (ta, tb) in zip(prepared, times):
    res = _result(ta, tb, n, unroll, compile_s)
    if res["s"] <= 0:
      raise _noise_error(n, res["s"])
    out.append(res)
  return out


class TimingError(RuntimeError):
  """A measurement that cannot be told apart from noise (a slope that is not positive):
  reported as an error, never as a time of 0."""


def loop_overhead(*, unroll: int, min_time: float, reps: int) -> float:
  """Seconds per call of a near-empty call (one scalar add, scalar output) in the same
  harness: the floor of what `chain_time` can report (link and loop share included)."""
  call = lambda c, x: (c + x, c)
  res = chain_time(call, jnp.zeros((), jnp.int32), jnp.ones((), jnp.int32), unroll=unroll,
                   min_time=min_time, reps=reps)
  return res["s"]


def stand_in(out_shapes: Any) -> Call:
  """A call (c, x) -> (c + 1, outputs of `out_shapes`) that does no other work. Each
  array output is iota + a loop-variant scalar (not a broadcast, which XLA could fold
  into its consumers' reductions), so its consumers cost what they cost on a real
  call's outputs."""
  def fill(o, v):
    if not o.shape:
      return jnp.full(o.shape, v, o.dtype)
    iota = jax.lax.broadcasted_iota(jnp.int32, o.shape, 0)
    return (iota + v).astype(o.dtype)

  def call(c, x):
    first = jax.tree_util.tree_leaves(x)[0].reshape(-1)[0]
    outs = jax.tree_util.tree_map(lambda o: fill(o, first + c), out_shapes)
    return c + 1, outs
  return call


STAND_IN_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class _StandInParams:
  sizes: Tuple[int, ...]    # each output's length (scalars as 1)
  dtypes: Tuple[str, ...]


def _stand_in_body(x_ref, *out_refs, p):
  from pallas_kernels import _util  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  v = x_ref[0]
  idx = pl.program_id(0) * STAND_IN_BLOCK + jnp.arange(STAND_IN_BLOCK, dtype=jnp.int32)
  for ref, n, dtype in zip(out_refs, p.sizes, p.dtypes):
    _util.store(ref, idx, (idx + v).astype(dtype), idx < n)


def stand_in_pallas(out_shapes: Any, interpret: bool = False) -> Call:
  """`stand_in`, but its outputs written by one Pallas-Triton kernel launch (GPU; Pallas'
  interpreter with interpret=True), the way the "pallas" path's fused kernels write
  theirs: consumers read them from memory, as they read that path's outputs, instead of
  fusing the producer as they can with an XLA stand-in. The floor of the Pallas
  figures' +1 consumer check (bench_micro)."""
  from pallas_kernels import _util  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree_util.tree_flatten(out_shapes)
  p = _StandInParams(tuple(max(int(np.prod(o.shape)), 1) for o in leaves),
                     tuple(jnp.dtype(o.dtype).name for o in leaves))

  class _Kernel(_util.TritonCall):
    def spec(self):
      outs = tuple(jax.ShapeDtypeStruct((n,), d) for n, d in zip(p.sizes, p.dtypes))
      grid = (-(-max(p.sizes) // STAND_IN_BLOCK),)
      return outs, _stand_in_body, grid

  kernel = _Kernel("jax_kvalloc_bench_stand_in", p, 4, interpret)

  def call(c, x):
    first = jax.tree_util.tree_leaves(x)[0].reshape(-1)[:1]
    outs = kernel.run(first + c)
    outs = [o.reshape(leaf.shape) for o, leaf in zip(outs, leaves)]
    return c + 1, jax.tree_util.tree_unflatten(treedef, outs)
  return call


def floor_time(out_shapes: Any, inputs: Any, *, unroll: int, min_time: float, reps: int
               ) -> Dict[str, float]:
  """Per-call seconds of `stand_in(out_shapes)` in the same harness: what the link, the
  loop and the consumers cost at these sizes, plus one small XLA kernel."""
  return chain_time(stand_in(out_shapes), jnp.zeros((), jnp.int32), inputs, unroll=unroll,
                    min_time=min_time, reps=reps)


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


def cuda_activities(run: Callable[[], Any]) -> list:
  """Every GPU activity (kernel, memcpy, memset) of `run()`, from CUPTI through
  torch.profiler, which records the whole process's launches (JAX's included), as
  (start us, duration us, category, name), by start. Needs torch with CUDA."""
  import os  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  try:
    prof.export_chrome_trace(path)
    with open(path) as f:
      events = json.load(f)["traceEvents"]
  finally:
    os.unlink(path)
  return activities_of(events)


def activities_of(trace_events: list) -> list:
  """The GPU activities of a Chrome trace's events (see `cuda_activities`)."""
  acts = [(float(e["ts"]), float(e.get("dur", 0.0)), e.get("cat", ""), e.get("name", ""))
          for e in trace_events if e.get("ph") == "X"
          and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
  return sorted(acts)


def kernel_time(activities: list, name_prefix: str, *, min_count: int) -> Dict[str, float]:
  """The GPU execution time of the kernels whose name starts with `name_prefix`: {"s":
  median duration, "min_s", "spread": (max - min) / median, "count"}. This is the kernel
  alone, launch excluded, the same on both sides of a comparison however each was
  launched; "q1_s" / "q3_s" are the durations' quartiles. TimingError when fewer than
  `min_count` such kernels ran (a profile that lost records, or a name that matches
  nothing)."""
  durs = [d * 1e-6 for _, d, cat, name in activities
          if cat == "kernel" and name.startswith(name_prefix)]
  if len(durs) < min_count:
    raise TimingError(f"{len(durs)} kernels named {name_prefix}* in the profile, "
                      f"expected at least {min_count}")
  med = statistics.median(durs)
  q1, q3 = quartiles(durs)
  return {"s": med, "min_s": min(durs), "spread": (max(durs) - min(durs)) / med,
          "q1_s": q1, "q3_s": q3, "count": len(durs)}


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


def torch_graph_time(fn: Callable[[], Any], *, unroll: int, min_time: float,
                     reps: int) -> Dict[str, float]:
  """Per-call seconds of `fn` (CUDA work only) from replays of a graph of `unroll` calls,
  the statistic `chain_time` reports for JAX: the slope between a run of 1 replay and a
  run of n (n grown until a run takes `min_time`), median over `reps` repetitions, so
  that the cost of starting a run (the first replay's launch, the events) falls out on
  both sides alike. Returns chain_time's keys less "compile_s"."""
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

  t1 = min(timed(1) for _ in range(3))
  n = 2
  while timed(n) < max(min_time, 8 * t1) and n < MAX_ITERS:
    n *= 2
  ta, tb = [], []
  for _ in range(reps):
    ta.append(timed(1))
    tb.append(timed(n))
  del graph
  res = _result(ta, tb, n, unroll, 0.0)
  del res["compile_s"]
  if res["s"] <= 0:
    raise _noise_error(n, res["s"])
  return res


def loglog_slope(x, y) -> float:
  """Least-squares slope of log(y) against log(x) (1 = linear growth)."""
  x, y = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
  if x.size < 2:
    return float("nan")
  return float(np.polyfit(x, y, 1)[0])


def summarize(res: Dict[str, float]) -> Tuple[float, float]:
  """(microseconds, spread) of a timing result."""
  return res["s"] * 1e6, res["spread"]
