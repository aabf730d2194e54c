"""A ranked decode step over several processes against one: time per step.

    python -m jax_kvalloc.tools.bench_processes --json benchmarks/processes.json

For each layout (processes x CPU devices per process, e.g. 1x2, 1x4, 2x2) this starts
the processes (jax_kvalloc.tools.local_processes: jax.distributed over localhost, each
process its own CPU devices), shards `ranks_per_device` ranks on every device of a mesh
spanning all processes, and times every rank's alloc_decode two ways, in every process:

- "call": one jitted call per step, as a scheduler makes it: the inputs (built once, per
  process, with multiprocess.put_ranks) go in, the step's slots come back to the host
  (multiprocess.get_ranks), so each step waits for its own result. Per-step wall times.
- "chained": `--chain` steps in one jitted loop (each step's slots are the next step's
  last_loc, lengths grow by one; the free length is reset each step as in bench_ranks,
  so the pool never runs dry); the time per call divided by the steps.

Every rank carries the same load whatever the layout, and the programs have no
collectives (checked, reported), so with one core per device the time per step would
not depend on the layout. On a shared CPU the devices of all processes compete for the
cores: compare 2x2 with 1x4 (same devices, same ranks) for what a second process adds,
and with 1x2 (same ranks per device and per process). Each row gives every process's
median and its spread (the 10th-90th percentile range over the median). Since other
work on a shared CPU inflates wall times, "call CPU" also gives each process's CPU time
(user + system, all its threads) per step of the "call" loop, one value per repetition:
the work a step costs, whoever else runs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from jax_kvalloc.tools import local_processes


def _worker(a: argparse.Namespace) -> None:
  with local_processes.start(a.worker, a.num_processes, a.port, a.devices_per_process):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax_kvalloc import multiprocess  # pylint: disable=g-import-not-at-top
    from jax_kvalloc import ranks  # pylint: disable=g-import-not-at-top
    from jax_kvalloc.config import AllocatorConfig  # pylint: disable=g-import-not-at-top
    from jax_kvalloc.tools import bench_ranks  # pylint: disable=g-import-not-at-top

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    dp = len(devices) * a.ranks_per_device
    ps = a.page_size
    config = AllocatorConfig(size=dp * a.pages_per_rank * ps, page_size=ps, kernel="jnp")
    r = ranks.ranks_allocator(config, dp, mesh=mesh, axis_name="dp")
    k = len(multiprocess.process_ranks(mesh, "dp", dp))
    # Row i holds 1 + i % ps tokens in page i + 1: one row in ps starts a page each step.
    i = np.arange(a.decode_rows, dtype=np.int32)
    seq = multiprocess.put_ranks(np.tile(2 + i % ps, (k, 1)), mesh, "dp", dp)
    last = multiprocess.put_ranks(np.tile((i + 1) * ps + i % ps, (k, 1)), mesh, "dp", dp)

    def call_times():
      state = r.init()
      times = []
      for _ in range(a.steps):
        t0 = time.perf_counter()
        state, slots, ok = r.alloc_decode(state, seq, last)
        multiprocess.get_ranks(slots)
        times.append(time.perf_counter() - t0)
      assert multiprocess.get_ranks(ok).all()
      return times

    # The chained loop: bench_ranks' decode step on each device's ranks, --chain steps.
    rc = ranks.rank_config(config, dp)
    step = jax.vmap(lambda c: bench_ranks._decode_step(rc, c))  # pylint: disable=protected-access

    def loop(state, seq, last):
      def body(_, c):
        return step(c)
      return jax.lax.fori_loop(0, a.chain, body,
                               (state, seq, last, jnp.zeros(seq.shape[:1], jnp.int32)))

    chained = jax.jit(ranks.shard(loop, mesh, "dp"))
    found = ranks.collectives_in(chained.lower(r.init(), seq, last).compile().as_text())
    found.update(ranks.collectives_in(r.alloc_decode.lower(r.init(), seq, last)
                                      .compile().as_text()))

    def chain_times():
      times = []
      for _ in range(max(1, a.steps // a.chain)):
        state = r.init()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        out = chained(state, seq, last)
        multiprocess.get_ranks(out[3])
        times.append((time.perf_counter() - t0) / a.chain)
      return times

    def cpu():
      t = os.times()
      return t.user + t.system

    call_times(), chain_times()  # compile and warm up
    rows = {"call": [], "chained": [], "call_cpu": []}
    for _ in range(a.reps):
      c0 = cpu()
      rows["call"] += call_times()
      rows["call_cpu"].append((cpu() - c0) / a.steps)
      rows["chained"] += chain_times()
    out = pathlib.Path(a.out) / f"p{a.worker}.json"
    out.write_text(json.dumps({"process": a.worker, "ranks": k, "collectives": found,
                               "devices": len(jax.local_devices()), **rows}))


def _summary(times: Sequence[float]) -> Dict[str, float]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  t = np.asarray(times) * 1e6
  med = float(np.median(t))
  return {"us": med, "spread": float((np.percentile(t, 90) - np.percentile(t, 10)) / med),
          "n": int(t.size)}


def run_layout(a: argparse.Namespace, processes: int, devices: int) -> Dict[str, Any]:
  """One layout's row: every process's median and spread, for both ways of timing."""
  with tempfile.TemporaryDirectory() as tmp:
    port = local_processes.free_port()
    common = ["--num-processes", str(processes), "--port", str(port), "--out", tmp,
              "--devices-per-process", str(devices)]
    for name in ("ranks_per_device", "pages_per_rank", "page_size", "decode_rows", "steps",
                 "chain", "reps"):
      common += ["--" + name.replace("_", "-"), str(getattr(a, name))]
    cmds = [[sys.executable, "-m", "jax_kvalloc.tools.bench_processes", "--worker", str(w)]
            + common for w in range(processes)]
    results = local_processes.run(cmds, deadline_s=a.deadline, env=local_processes.child_env())
    for res in results:
      if res.returncode:
        raise RuntimeError(f"a worker exited {res.returncode}:\n{res.stderr[-4000:]}")
    per = [json.loads((pathlib.Path(tmp) / f"p{w}.json").read_text())
           for w in range(processes)]
  row = {"processes": processes, "devices_per_process": devices,
         "ranks_per_device": a.ranks_per_device, "ranks": processes * devices * a.ranks_per_device,
         "collectives": {k: v for p in per for k, v in p["collectives"].items()}}
  for how in ("call", "chained", "call_cpu"):
    row[how] = [_summary(p[how]) for p in per]
  return row


def _line(row: Dict[str, Any]) -> str:
  cell = lambda s: " / ".join(f"{p['us']:.0f} ({p['spread']:.2f})" for p in s)
  coll = ", ".join(f"{k} x{v}" for k, v in row["collectives"].items()) or "none"
  return (f"| {row['processes']} x {row['devices_per_process']} | {row['ranks']} | "
          f"{cell(row['call'])} | {cell(row['call_cpu'])} | {cell(row['chained'])} | "
          f"{coll} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layouts", default="1x2,1x4,2x2",
                 help="processes x devices per process, comma separated")
  p.add_argument("--ranks-per-device", type=int, default=4)
  p.add_argument("--pages-per-rank", type=int, default=4096)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-rows", type=int, default=64)
  p.add_argument("--steps", type=int, default=200, help="timed steps per repetition")
  p.add_argument("--chain", type=int, default=50, help="steps per chained call")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--deadline", type=int, default=600, help="seconds per layout")
  p.add_argument("--json", help="write the rows to this file")
  # Worker mode (started by the parent).
  p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--devices-per-process", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--out", default="", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker is not None:
    _worker(a)
    return 0
  if a.steps < a.chain or (a.pages_per_rank - a.decode_rows - 1) * a.page_size < (
      a.steps * a.decode_rows):
    p.error("--steps must be >= --chain, and each rank's pool must last --steps steps "
            "(pages_per_rank * page_size >= steps * decode_rows + a page per row)")
  rows: List[Dict[str, Any]] = []
  print("| processes x devices | ranks | call us/step per process (spread) | "
        "call CPU us/step per process (spread) | chained us/step per process (spread) | "
        "collectives |\n|---|---|---|---|---|---|")
  for layout in a.layouts.split(","):
    procs, devs = (int(x) for x in layout.split("x"))
    rows.append(run_layout(a, procs, devs))
    print(_line(rows[-1]), flush=True)
    if a.json:
      pathlib.Path(a.json).write_text(json.dumps(
          {"load": {k: getattr(a, k) for k in ("ranks_per_device", "pages_per_rank",
                                               "page_size", "decode_rows", "steps",
                                               "chain", "reps")},
           "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
