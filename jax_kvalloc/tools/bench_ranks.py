"""`jax-kvalloc bench ranks` and `bench processes`: data-parallel ranks at a fixed load
per rank, over devices and over processes.

ranks: for each device count n (a mesh of the first n devices, axis "dp") and ranks per
device, the ranked state (jax_kvalloc.ranks) holds n * ranks_per_device ranks sharded
over the mesh, and one step runs every rank's alloc_decode (or alloc_extend) as a jitted
shard_map, chained in timing.chain_time. The step's outputs feed the next step inside
the carry (decode: each row's new slot is its next last_loc; extend: the prefix grows),
so nothing is dead and the harness's link has nothing left to reduce (a reduction over
a sharded output would add an all-reduce); each step keeps the head the previous one
returned and resets the free length, so every step does the same work. With perfect
scaling the time per step does not change with n; "collectives" counts the compiled
program's cross-device ops (none expected). Columns: pool (one rank's load on a plain
pool: no rank axis, vmap or shard_map), ranks, need_sort (need_sort pools: the merge
present, never taken), select (need_sort with the merge as a plain lax.cond, which vmap
turns into a select that sorts every pool every step). On CPU force host devices first:
XLA_FLAGS=--xla_force_host_platform_device_count=2.

processes: for each layout PxD (P processes of D CPU devices each,
jax_kvalloc.tools.local_processes) every rank's alloc_decode, in every process: "call"
one jitted call per step whose slots come back to the host (per-step wall time; "cpu_us"
the process's CPU time per step), "chained" --chain steps in one jitted loop.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Dict, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import ranks
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import cli
from jax_kvalloc.tools import local_processes
from jax_kvalloc.tools import timing


def _config(o, dp: int, need_sort: bool) -> AllocatorConfig:
  return AllocatorConfig(size=dp * o.pages_per_rank * o.page_size, page_size=o.page_size,
                         need_sort=need_sort, kind="paged", kernel=o.kernel, debug=False)


def plain_cond_merge(config: AllocatorConfig, state, shortfall):
  """allocation.maybe_merge as a plain lax.cond (a select under vmap), for the select
  column only."""
  if not config.need_sort:
    return state
  return jax.lax.cond(shortfall & (state.release_len > 0),
                      lambda s: freeing.merge_and_sort_free(config, s), lambda s: s, state)


def decode_step(config: AllocatorConfig, carry):
  """(state, seq, last, check) -> the same after one alloc_decode (see the docstring)."""
  state, seq, last, check = carry
  full = state.free_len
  state, out, ok = allocation.alloc_decode(config, state, seq, last)
  return (state._replace(free_len=full), seq + 1, out, check + ok.astype(jnp.int32))


def extend_step(config: AllocatorConfig, tokens: int, carry):
  """(state, pre, check) -> the same after one alloc_extend of `tokens` per row."""
  state, pre, check = carry
  full, seq = state.free_len, pre + tokens
  state, out, ok = allocation.alloc_extend(  # page-aligned prefixes: last_loc unread
      config, state, pre, seq, jnp.full_like(pre, -1), max_tokens=pre.size * tokens)
  return (state._replace(free_len=full), seq, check + jnp.max(out) + ok.astype(jnp.int32))


def _step(config: AllocatorConfig, o, op: str):
  return (functools.partial(decode_step, config) if op == "decode" else
          functools.partial(extend_step, config, o.extend_tokens))


def _carry(o, op: str, state: st.AllocatorState):
  """One rank's carry at step 0: row r holds 1 + r % ps tokens in page r + 1, so rows
  reach a new page at staggered steps."""
  if op == "decode":
    r = jnp.arange(o.decode_rows, dtype=jnp.int32)
    seq = 2 + r % o.page_size
    return (state, seq, (r + 1) * o.page_size + seq - 2, jnp.zeros((), jnp.int32))
  return (state, jnp.zeros((o.extend_rows,), jnp.int32), jnp.zeros((), jnp.int32))


def ranks_timed(o, op: str, n: int, per_device: int, impl: str) -> bench.Timed:
  devices = jax.devices()
  if impl == "pool":
    config = _config(o, 1, False)
    step = _step(config, o, op)
    return bench.chained(lambda c, i: (step(c), ()), _carry(o, op, st.init(config)), ())
  if n > len(devices):
    raise bench.Skip(f"{n} devices: only {len(devices)} ({devices[0].platform})")
  dp = n * per_device
  config = _config(o, dp, impl != "ranks")
  mesh = jax.sharding.Mesh(np.array(devices[:n]), ("dp",))
  step = jax.vmap(_step(ranks.rank_config(config, dp), o, op))
  sharded = ranks.shard(lambda *c: step(c), mesh, "dp")
  carry = jax.device_put(jax.vmap(lambda s: _carry(o, op, s))(ranks.init_ranks(config, dp)),
                         ranks.rank_sharding(mesh, "dp"))
  call = lambda c, inputs: (tuple(sharded(*c)), ())

  def measure(opts):
    with (mock.patch.object(allocation, "maybe_merge", plain_cond_merge) if impl == "select"
          else contextlib.nullcontext()):
      out = bench.chained(call, carry, ()).measure(opts)
      hlo = timing.chain_loop(call, opts.unroll).lower(
          carry, (), timing.sink_init(call, carry, ()), np.int32(1)).compile().as_text()
    return dict(out, collectives=ranks.collectives_in(hlo))
  return bench.Timed(measure)


def ranks_cases(o):
  if o.extend_tokens % o.page_size:
    raise cli.UsageError("--extend-tokens", "must be a multiple of --page-size "
                         "(page-aligned prefixes)")
  for op in o.ops:
    for i, (n, r) in enumerate((n, r) for n in o.devices for r in o.ranks_per_device):
      row = {"op": op, "devices": n, "ranks_per_device": r}
      for impl in RANKS.impls:
        if impl != "pool" or i == 0:
          yield bench.Case(row, impl, functools.partial(ranks_timed, o, op, n, r, impl))


RANKS = bench.Suite(
    name="ranks", help="data-parallel ranks over devices at a fixed load per rank, against "
    "one rank's load on a plain pool", impls=("pool", "ranks", "need_sort", "select"),
    default_impls=("pool", "ranks"), cases=ranks_cases, compare=(("ranks", "pool"),),
    defaults=(("unroll", 8),),
    dims=(bench.Dim("--devices", [1, 2], "device counts"),
          bench.Dim("--ranks-per-device", [1, 4], "ranks per device"),
          bench.Dim("--ops", ["decode", "extend"], "operations",
                    cli.name_list(("decode", "extend"))),
          bench.Dim("--pages-per-rank", 1 << 16, "pool pages per rank", quick=64),
          bench.Dim("--page-size", 16, "page size"),
          bench.Dim("--decode-rows", 64, "alloc_decode rows per rank", quick=4),
          bench.Dim("--extend-rows", 8, "alloc_extend rows per rank", quick=2),
          bench.Dim("--extend-tokens", 64, "tokens per extended row (page-aligned)",
                    quick=16),
          bench.Dim("--kernel", "auto", "AllocatorConfig.kernel")))


# ---------------------------------------------------------------------------------------
# Over processes.
# ---------------------------------------------------------------------------------------

WORKER_OPTIONS = ("ranks_per_device", "pages_per_rank", "page_size", "decode_rows",
                  "steps", "chain")


def worker(a: argparse.Namespace) -> None:
  """One process of a layout: times its ranks' decode steps and writes p{worker}.json."""
  with local_processes.start(a.worker, a.num_processes, a.port, a.devices_per_process):
    from jax_kvalloc import multiprocess  # pylint: disable=g-import-not-at-top
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    dp, ps = len(devices) * a.ranks_per_device, a.page_size
    config = AllocatorConfig(size=dp * a.pages_per_rank * ps, page_size=ps, kernel="jnp")
    r = ranks.ranks_allocator(config, dp, mesh=mesh, axis_name="dp")
    k = len(multiprocess.process_ranks(mesh, "dp", dp))
    i = np.arange(a.decode_rows, dtype=np.int32)
    seq = multiprocess.put_ranks(np.tile(2 + i % ps, (k, 1)), mesh, "dp", dp)
    last = multiprocess.put_ranks(np.tile((i + 1) * ps + i % ps, (k, 1)), mesh, "dp", dp)
    step = jax.vmap(lambda c: decode_step(ranks.rank_config(config, dp), c))
    chained = jax.jit(ranks.shard(lambda s, q, l: jax.lax.fori_loop(
        0, a.chain, lambda _, c: step(c), (s, q, l, jnp.zeros(q.shape[:1], jnp.int32))),
                                  mesh, "dp"))
    found = ranks.collectives_in(chained.lower(r.init(), seq, last).compile().as_text())
    found.update(ranks.collectives_in(r.alloc_decode.lower(r.init(), seq, last)
                                      .compile().as_text()))

    def calls():
      state, times = r.init(), []
      for _ in range(a.steps):
        t0 = time.perf_counter()
        state, slots, ok = r.alloc_decode(state, seq, last)
        multiprocess.get_ranks(slots)
        times.append(time.perf_counter() - t0)
      assert multiprocess.get_ranks(ok).all()
      return times

    def chains():
      times = []
      for _ in range(max(1, a.steps // a.chain)):
        state = jax.block_until_ready(r.init())
        t0 = time.perf_counter()
        multiprocess.get_ranks(chained(state, seq, last)[3])
        times.append((time.perf_counter() - t0) / a.chain)
      return times

    cpu = lambda: sum(os.times()[:2])
    calls(), chains()  # compile and warm up
    out = {"call": [], "chained": [], "cpu": []}
    for _ in range(a.reps):
      c0 = cpu()
      out["call"] += calls()
      out["cpu"].append((cpu() - c0) / a.steps)
      out["chained"] += chains()
    (pathlib.Path(a.out) / f"p{a.worker}.json").write_text(json.dumps(
        dict(out, collectives=found)))


@functools.lru_cache(maxsize=4)
def _layout(o_items: tuple, processes: int, devices: int) -> Dict[str, Any]:
  """Every process's times for one layout (run once for both columns)."""
  o = dict(o_items)
  with tempfile.TemporaryDirectory() as tmp:
    job = dict(o, num_processes=processes, devices_per_process=devices, out=tmp,
               port=local_processes.free_port())
    argv = lambda w: [sys.executable, "-m", "jax_kvalloc.tools.bench_ranks",
                      json.dumps(dict(job, worker=w))]
    results = local_processes.run([argv(w) for w in range(processes)],
                                  deadline_s=o["deadline"], env=local_processes.child_env())
    for res in results:
      if res.returncode:
        raise RuntimeError(f"a worker exited {res.returncode}:\n{res.stderr[-4000:]}")
    return [json.loads((pathlib.Path(tmp) / f"p{w}.json").read_text())
            for w in range(processes)]


def _summary(times: Sequence[float]) -> Dict[str, float]:
  t = np.asarray(times) * 1e6
  med = float(np.median(t))
  spread = np.percentile(t, 90) - np.percentile(t, 10)
  return {"us": med, "spread": float(spread / med) if med > 0 else float("inf"),
          "n": int(t.size)}


def processes_timed(o, processes: int, devices: int, how: str) -> bench.Timed:
  items = tuple(sorted((k, getattr(o, k)) for k in WORKER_OPTIONS + ("deadline",)))

  def measure(opts):
    per = _layout(items + (("reps", opts.reps),), processes, devices)
    every = [t for p in per for t in p[how]]
    q1, q3 = timing.quartiles(every)
    out = {"us": float(np.median(every)) * 1e6, "q1_us": q1 * 1e6, "q3_us": q3 * 1e6,
           "per_process": [_summary(p[how]) for p in per],
           "collectives": {k: v for p in per for k, v in p["collectives"].items()}}
    if how == "call":
      out["cpu_us"] = [_summary(p["cpu"]) for p in per]
    return out
  return bench.Timed(measure)


def processes_cases(o):
  if o.steps < o.chain or (o.pages_per_rank - o.decode_rows - 1) * o.page_size < (
      o.steps * o.decode_rows):
    raise cli.UsageError("--steps", "must be >= --chain, and each rank's pool must last "
                         "--steps steps (pages_per_rank * page_size >= steps * decode_rows "
                         "+ a page per row)")
  for processes, devices in o.layouts:
    for how in ("call", "chained"):
      yield bench.Case({"layout": f"{processes}x{devices}",
                        "ranks_per_device": o.ranks_per_device}, how,
                       functools.partial(processes_timed, o, processes, devices, how))


PROCESSES = bench.Suite(
    name="processes", help="a ranked decode step over several JAX processes on this "
    "machine against one process", impls=("call", "chained"), cases=processes_cases,
    defaults=(("reps", 3),),
    dims=(bench.Dim("--layouts", "1x2,1x4,2x2", "processes x CPU devices per process",
                    cli.pairs("PxD", "1x2,2x2"), quick="1x2,2x1"),
          bench.Dim("--ranks-per-device", 4, "ranks per device", quick=2),
          bench.Dim("--pages-per-rank", 4096, "pool pages per rank", quick=64),
          bench.Dim("--page-size", 16, "page size"),
          bench.Dim("--decode-rows", 64, "alloc_decode rows per rank", quick=4),
          bench.Dim("--steps", 200, "timed steps per repetition", quick=4),
          bench.Dim("--chain", 50, "steps per chained call", quick=2),
          bench.Dim("--deadline", 600, "seconds per layout")))


if __name__ == "__main__":  # a worker of `bench processes`: its settings as JSON
  worker(argparse.Namespace(**json.loads(sys.argv[1])))
