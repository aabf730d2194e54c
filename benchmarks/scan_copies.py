"""The copies XLA puts into a compiled serving loop: which buffers, in which computation,
and how many device memcpys each step runs (GPU: CUPTI). For issue 20's question "does
the compiled scan copy the ring (copy(carry_0__free_ring)) before the in-place kernel
every step?".

Steps (each a carry -> carry function of jax_kvalloc's tools):
  old          bench_serving.serve_step(release="fused"): release_and_alloc_decode with a
               hand-kept table (the loop the issue measured)
  calls        bench_table.table_step, decode step, the table operations as calls
  step         the same through request_table.step_rows (one launch)
  calls_ext    bench_table's extend step as calls
  step_ext     the extend step through step_rows
Harnesses:
  chain        timing.chain_loop (the bench harness: 8 steps per fori_loop iteration,
               optimization barriers, entry arguments not donated)
  scan         jit(lax.scan of the step over 64 steps), the carry NOT donated
  scan_donated the same with donate_argnums=0 (how an engine would run it)

For each (step, harness): the compiled HLO goes to DIR/<step>_<harness>.hlo.txt, and
DIR/scan_copies.json lists every copy with its computation (ENTRY: once per call of the
jitted function; a while body: every iteration, i.e. every step of a scan, every 8 steps
of chain) and, on a GPU with torch, the memcpy activities per step from CUPTI.

  PYTHONPATH=$PWD python benchmarks/scan_copies.py --out DIR [--bs 256] [--page-size 64]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc.tools import bench_serving
from jax_kvalloc.tools import bench_table
from jax_kvalloc.tools import timing

SCAN_STEPS = 64
CHAIN_UNROLL = 8


def steps(bs: int, ps: int, kernel: str):
  """{name: (call(carry, x) -> (carry, outs), initial carry)}."""
  out = {}
  case = bench_serving.make_case(bs, ps, 1000, 0)
  cfg = bench_serving._config(case)  # pylint: disable=protected-access
  if kernel != "auto":
    import dataclasses  # pylint: disable=g-import-not-at-top
    cfg = dataclasses.replace(cfg, kernel=kernel)
  step = functools.partial(bench_serving.serve_step, cfg, case.max_frees, release="fused")
  out["old"] = (lambda c, x: bench_serving._step_call(step, c, x),  # pylint: disable=protected-access
                bench_serving.initial_carry(case))
  for ext in (False, True):
    tcase = bench_table.TableCase(bs=bs, page_size=ps, prompt=256, extend=ext,
                                  kernel=kernel)
    for variant in ("calls", "step"):
      name = variant + ("_ext" if ext else "")
      out[name] = (functools.partial(bench_table.table_step, tcase, variant=variant),
                   bench_table.initial_carry(tcase))
  return out


def harness(call, carry, which: str):
  """(jitted function, its arguments, steps per call)."""
  zero = jnp.zeros((), jnp.int32)
  if which == "chain":
    run = timing.chain_loop(call, CHAIN_UNROLL)
    sink = timing.sink_init(call, carry, zero)
    return run, (carry, zero, sink, np.int32(4)), 4 * CHAIN_UNROLL

  def scan(c):
    def body(c, _):
      c, outs = call(c, zero)
      return c, timing.link(outs)
    return jax.lax.scan(body, c, None, length=SCAN_STEPS)

  donate = (0,) if which == "scan_donated" else ()
  return jax.jit(scan, donate_argnums=donate), (carry,), SCAN_STEPS


def computations(text: str) -> Dict[str, List[str]]:
  """Each computation's name -> its instruction lines (compiled HLO text)."""
  comps, name = {}, None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      name = ("ENTRY " if head.group(1) else "") + head.group(2)
      comps[name] = []
    elif name is not None and line.startswith(" "):
      comps[name].append(line.strip())
  return comps


def copies(text: str) -> List[Dict[str, str]]:
  out = []
  for comp, lines in computations(text).items():
    for line in lines:
      if " copy(" in line or " copy-start(" in line:
        m = re.match(r"%?([\w.\-]+)\s*=\s*(\S+)\s+copy(?:-start)?\((.*?)\)", line)
        out.append({"computation": comp, "name": m.group(1) if m else "",
                    "shape": m.group(2) if m else "", "operand": m.group(3) if m else "",
                    "line": line[:200]})
  return out


def memcpys_per_step(fn, args, steps_per_call: int, calls: int = 5) -> Dict[str, Any]:
  """CUPTI (torch.profiler) over `calls` runs: memcpy / memset / kernel activities per
  step, and the memcpys' mean duration."""
  # Warm (compile) outside the profile; donated carries need fresh arguments each run.
  fresh = lambda: jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), args)
  jax.block_until_ready(fn(*fresh()))
  runs = [fresh() for _ in range(calls)]
  jax.block_until_ready(runs)
  acts = timing.cuda_activities(lambda: [jax.block_until_ready(fn(*a)) for a in runs])
  steps = calls * steps_per_call
  mem = [d for _, d, cat, _ in acts if cat == "gpu_memcpy"]
  return {"memcpy_per_step": len(mem) / steps,
          "memcpy_mean_us": float(np.mean(mem)) if mem else 0.0,
          "memset_per_step": sum(cat == "gpu_memset" for _, _, cat, _ in acts) / steps,
          "kernels_per_step": sum(cat == "kernel" for _, _, cat, _ in acts) / steps}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="folder for the HLO texts and the JSON")
  ap.add_argument("--bs", type=int, default=256)
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--kernel", default="auto")
  ap.add_argument("--steps", default="old,calls,step,calls_ext,step_ext")
  ap.add_argument("--harnesses", default="chain,scan,scan_donated")
  ap.add_argument("--no-profile", action="store_true")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  gpu = jax.default_backend() == "gpu"
  record: Dict[str, Any] = {"device": str(jax.devices()[0]), "jax": jax.__version__,
                            "bs": args.bs, "page_size": args.page_size, "runs": {}}
  all_steps = steps(args.bs, args.page_size, args.kernel)
  for name in args.steps.split(","):
    call, carry = all_steps[name]
    for which in args.harnesses.split(","):
      key = f"{name}_{which}"
      try:
        fn, fargs, per_call = harness(call, carry, which)
        text = fn.lower(*fargs).compile().as_text()
        with open(os.path.join(args.out, f"{key}.hlo.txt"), "w") as f:
          f.write(text)
        cps = copies(text)
        in_loops = [c for c in cps if not c["computation"].startswith("ENTRY")]
        r: Dict[str, Any] = {"copies": cps, "copies_in_loop_bodies": len(in_loops),
                             "copies_in_entry": len(cps) - len(in_loops)}
        if gpu and not args.no_profile:
          try:
            r.update(memcpys_per_step(fn, fargs, per_call))
          except Exception as e:  # pylint: disable=broad-except
            r["profile_error"] = f"{type(e).__name__}: {e}"[:300]
      except Exception as e:  # pylint: disable=broad-except
        r = {"error": f"{type(e).__name__}: {e}"[:400]}
      record["runs"][key] = r
      print(f"== {key}: " + (r.get("error") or (
          f"{r['copies_in_entry']} copies in ENTRY, {r['copies_in_loop_bodies']} in loop "
          f"bodies" + (f"; memcpy/step {r['memcpy_per_step']:.3f} "
                       f"({r['memcpy_mean_us']:.2f} us each), kernels/step "
                       f"{r['kernels_per_step']:.2f}" if "memcpy_per_step" in r else ""))),
            flush=True)
      for c in r.get("copies", []):
        if not c["computation"].startswith("ENTRY"):
          print(f"    body copy: {c['shape']} of {c['operand']} in {c['computation']}",
                flush=True)
  with open(os.path.join(args.out, "scan_copies.json"), "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {os.path.join(args.out, 'scan_copies.json')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
