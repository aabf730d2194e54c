"""Mosaic GPU against Triton and XLA on one GPU (issue 33): every kernel checked bit for
bit against the jnp path on fresh random inputs, then timed side by side with quartiles.

  python benchmarks/mosaic_gpu.py --json FILE [--decode-bs 1,4,...] [--table-bs 64,...]
      [--steps decode,extend] [--budget-s S] [--seed N]

decode  alloc_decode per batch size, on bench_micro's cases (page size 64): each family
        (mosaic_gpu, triton, jnp) through the whole jitted allocator call, chained and
        linked in the bench's harness (timing.chain_time: median and quartiles of the
        per-call slope, every output consumed); for the two kernels also their own GPU
        time (bench_micro.bare_kernel_time, CUPTI: median and quartiles over 2048
        launches). Each family's output for the case equals the jnp path's first.
table   the request table's serving step, through the engine-step benchmark
        (tools/bench_table: rows at random points of their lives, up to 8 finishing rows
        released and restarted every step): the decode step (release + decode every row)
        and the extend step (release, extend the restarted rows by 256 tokens, decode),
        per batch size, step_rows on each family, and the stand-ins once; share = step -
        stand-ins; the jax_kvalloc kernels' GPU time per step (CUPTI). First, each
        family's 200-step scan from the same random table equals the jnp family's:
        every step's slots and the final pool and table, bit for bit.

The seed (default: fresh) draws the cases; the JSON records it. The JSON is rewritten
after every case, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import kernels
from jax_kvalloc.tools import bench_micro
from jax_kvalloc.tools import bench_table
from jax_kvalloc.tools import report
from jax_kvalloc.tools import timing

# The families timed; JAX_KVALLOC_BENCH_INTERPRET=1 runs the script's checks and loops on
# CPU with the two kernels in their interpreters (a dry run of this script).
FAMILIES = ("mosaic_gpu", "triton", "jnp")
if os.environ.get("JAX_KVALLOC_BENCH_INTERPRET") == "1":
  FAMILIES = ("mosaic_gpu_interpret", "triton_interpret", "jnp")
DECODE_BS = bench_micro.DECODE_BS
TABLE_BS = (64, 256, 1024)
PAGE_SIZE = 64
CHECK_STEPS = 200


def _leaves_equal(a, b) -> Optional[str]:
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  if len(la) != len(lb):
    return f"{len(la)} leaves against {len(lb)}"
  for i, (x, y) in enumerate(zip(la, lb)):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or not np.array_equal(x, y):
      bad = np.flatnonzero(x.reshape(-1) != y.reshape(-1)) if x.shape == y.shape else []
      return f"leaf {i} differs ({len(bad)} entries{', first at ' + str(bad[0]) if len(bad) else ''})"
  return None


def _cell(res: Dict[str, float], prefix: str = "") -> Dict[str, float]:
  return {f"{prefix}us": res["s"] * 1e6, f"{prefix}q1_us": res["q1_s"] * 1e6,
          f"{prefix}q3_us": res["q3_s"] * 1e6}


def decode_case(bs: int, seed: int, args) -> Dict[str, Any]:
  case = bench_micro.make_case("decode", bs, bs, PAGE_SIZE, seed)
  row: Dict[str, Any] = {"op": "decode", "bs": bs, "page_size": PAGE_SIZE}
  want = jax.device_get(bench_micro.jax_call(case, "jnp")[0]())
  for fam in FAMILIES:
    cell: Dict[str, Any] = {"implementation": kernels.resolve(fam, "alloc_decode")}
    try:
      once, call, carry, inputs = bench_micro.jax_call(case, fam)
      err = _leaves_equal(jax.device_get(once()), want)
      if err:
        cell["error"] = f"MISMATCH against the jnp path: {err}"
      else:
        cell["check"] = "equal to the jnp path"
        cell.update(_cell(timing.chain_time(call, carry, inputs, unroll=args.unroll,
                                            min_time=args.min_time, reps=args.reps)))
        if fam != "jnp" and jax.default_backend() == "gpu":
          cell.update(_bare(call, carry, inputs))
    except Exception as e:  # pylint: disable=broad-except
      cell["error"] = f"{type(e).__name__}: {e}"[:400]
    row[kernels.family(fam)[0]] = cell
  return row


def _bare(call, carry, inputs) -> Dict[str, Any]:
  """The kernel's own GPU time, and the names of every kernel the bare loop launched
  (the Mosaic GPU kernel's name is whatever its module calls it)."""
  run = timing.chain_loop(call, bench_micro.BARE_UNROLL, linked=False)
  sink = timing.sink_init(call, carry, inputs)
  iters = np.int32(bench_micro.BARE_CALLS // bench_micro.BARE_UNROLL)
  jax.block_until_ready(run(carry, inputs, sink, iters))
  acts = timing.cuda_activities(lambda: jax.block_until_ready(run(carry, inputs, sink,
                                                                 iters)))
  counts: Dict[str, int] = {}
  for _, _, cat, name in acts:
    if cat == "kernel":
      counts[name] = counts.get(name, 0) + 1
  out: Dict[str, Any] = {"kernel_names": counts}
  ours = [n for n in counts if "jax_kvalloc" in n or "mosaic" in n.lower()]
  if len(ours) == 1:
    res = timing.kernel_time(acts, ours[0], min_count=int(iters) *
                             bench_micro.BARE_UNROLL // 2)
    out.update(_cell(res, "bare_"))
  return out


# One initial table per (batch size, step, seed), whichever family then runs on it:
# bench_table caches it per case, and the case names the family.
_initial_carry = bench_table.initial_carry
bench_table.initial_carry = lambda case: _initial_carry(dataclasses.replace(case,
                                                                            kernel="jnp"))


def table_check(case: bench_table.TableCase, steps: int = CHECK_STEPS) -> Optional[str]:
  """None when `steps` steps of step_rows on case.kernel equal the jnp family's: every
  step's outputs and the final carry; else what differs."""
  def scan(kernel):
    c = dataclasses.replace(case, kernel=kernel)
    step = functools.partial(bench_table.table_step, c, variant="step")
    run = jax.jit(lambda carry: jax.lax.scan(
        lambda cr, _: step(cr, jnp.zeros((), jnp.int32)), carry, None,
        length=steps))
    return jax.device_get(run(bench_table.initial_carry(c)))
  got, want = scan(case.kernel), scan("jnp")
  if not bool(want[0][-1]):
    return "the jnp loop refused a step"
  return _leaves_equal(got, want)


def table_case(step: str, bs: int, seed: int, args) -> Dict[str, Any]:
  row: Dict[str, Any] = {"op": f"table_{step}", "bs": bs, "page_size": PAGE_SIZE,
                         "prompt": 256, "max_frees": 8}
  base = bench_table.TableCase(bs=bs, page_size=PAGE_SIZE, prompt=256, seed=seed,
                               extend=step == "extend", kernel="jnp")
  none = bench_table.run_case(base, unroll=args.unroll, min_time=args.min_time,
                              reps=args.reps, variants=("none",), profile=False)
  row["none"] = {k[len("none_"):]: v for k, v in none.items() if k.startswith("none_")}
  for fam in FAMILIES:
    case = dataclasses.replace(base, kernel=fam)
    cell: Dict[str, Any] = {"implementation": kernels.resolve(fam, "table")}
    try:
      err = table_check(case, args.check_steps) if fam != "jnp" else None
      if err:
        cell["error"] = f"MISMATCH against the jnp path: {err}"
      else:
        cell["check"] = "equal to the jnp path" if fam != "jnp" else "reference"
        res = bench_table.run_case(case, unroll=args.unroll, min_time=args.min_time,
                                   reps=args.reps, variants=("step",), profile=True)
        cell.update({k[len("step_"):]: v for k, v in res.items() if k.startswith("step_")})
        for k in ("us", "q1_us", "q3_us"):
          if k in cell and "us" in row["none"]:
            cell[f"share_{k}"] = cell[k] - row["none"]["us"]
    except Exception as e:  # pylint: disable=broad-except
      cell["error"] = f"{type(e).__name__}: {e}"[:400]
    row[kernels.family(fam)[0]] = cell
  return row


def main(argv=None) -> int:
  from jax_kvalloc.tools.cli import int_list  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", required=True)
  ap.add_argument("--decode-bs", type=int_list, default=list(DECODE_BS))
  ap.add_argument("--table-bs", type=int_list, default=list(TABLE_BS))
  ap.add_argument("--steps", default="decode,extend")
  ap.add_argument("--unroll", type=int, default=8)
  ap.add_argument("--min-time", type=float, default=0.02)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--budget-s", type=float, default=1e9)
  ap.add_argument("--seed", type=int, default=None)
  ap.add_argument("--check-steps", type=int, default=CHECK_STEPS,
                  help="steps of the table check's scan")
  args = ap.parse_args(argv)
  seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
  t0 = time.perf_counter()
  d = jax.devices()[0]
  meta = {"device": f"{d.platform}:{getattr(d, 'device_kind', d)}", "jax": jax.__version__,
          "seed": seed, "unroll": args.unroll, "min_time": args.min_time, "reps": args.reps,
          "usable": {f: kernels.usable(kernels.family(f)[0]) for f in FAMILIES},
          "auto": {op: kernels.resolve("auto", op) for op in kernels.GPU_PREFERENCE}}
  print(meta, flush=True)
  rows: List[Dict[str, Any]] = []
  # The decode step's table first (the serving path's target), then alloc_decode, then
  # the other steps: a run cut short by --budget-s keeps the most wanted figures.
  steps = [s for s in args.steps.split(",") if s]
  jobs = [(f"table_{s}", s, bs) for s in steps[:1] for bs in args.table_bs]
  jobs += [("decode", None, bs) for bs in args.decode_bs]
  jobs += [(f"table_{s}", s, bs) for s in steps[1:] for bs in args.table_bs]
  for op, step, bs in jobs:
    if time.perf_counter() - t0 > args.budget_s:
      rows.append({"op": op, "bs": bs, "skipped": "budget"})
      print("budget spent: skipped", op, bs, flush=True)
      report.write_json(args.json, {**meta, "rows": rows,
                                    "elapsed_s": time.perf_counter() - t0})
      continue
    t1 = time.perf_counter()
    row = decode_case(bs, seed, args) if step is None else table_case(step, bs, seed, args)
    row["seconds"] = time.perf_counter() - t1
    rows.append(row)
    print(row, flush=True)
    report.write_json(args.json, {**meta, "rows": rows,
                                  "elapsed_s": time.perf_counter() - t0})
  print("\n" + report.mosaic_gpu_tables(rows), flush=True)
  print(f"{time.perf_counter() - t0:.0f} s", flush=True)
  bad = [r for r in rows for f in ("mosaic_gpu", "triton", "jnp")
         if "MISMATCH" in r.get(f, {}).get("error", "")]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
