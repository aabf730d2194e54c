"""The one-launch extend kernel's layouts, timed bare on a GPU (issue 13 item 1).

    python benchmarks/extend_layouts_gpu.py --json $OUT/extend_layouts.json \
        --sglang-kernels .sglang_kernels/allocator.py                        # a GPU, < 90 s
    python benchmarks/extend_layouts_gpu.py --small                          # CPU, interpreter

For each extend case of `jax-kvalloc bench` on the H200 (bench_micro.make_case, seed 0,
page size 64: bs 1 x 8192 tokens, 16 x 32768, 64 x 32768, 256 x 65536, 1024 x 65536),
and two skewed batches (the same, but one row holds all tokens but 8 per other row: bs
64 x 32768 and 1024 x 65536), it runs `pallas_kernels.alloc_extend_triton` with
layout="tiles" and "rows" (default tile, chunks and warps of each), checks the
whole result (indices, new head and length, ok) against the jnp path (kernel="jnp", the
same case), then takes its own GPU time as `jax-kvalloc bench --bare` does
(bench_micro.bare_kernel_time: CUPTI's kernel durations over the bare chain; valid
because the call is one kernel launch, which `single_launch` records), and with
--sglang-kernels SGLang's extend kernel's on the same case in the same run
(bench_micro.sglang_bare).

Prints a table (us per call; the layout tuning.extend_layout picks is marked *) and writes
every figure, the kernel configurations and the machine to --json. Budget: cases left
when --budget seconds have passed are skipped (and listed).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import tuning
from pallas_kernels._util import next_pow2
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import bench_micro
from jax_kvalloc.tools import timing

# (bs, tokens, skewed)
CASES = ((1, 8192, False), (16, 32768, False), (64, 32768, False), (256, 65536, False),
         (1024, 65536, False), (64, 32768, True), (1024, 65536, True))
SMALL_CASES = ((1, 300, False), (16, 512, False), (64, 1024, False), (16, 512, True))
LAYOUTS = ("tiles", "rows")
SKEW_OTHERS = 8   # tokens of every row but the first in a skewed batch


def make_case(bs: int, tokens: int, page_size: int, skewed: bool) -> bench_micro.Case:
  """bench_micro.make_case's extend case; skewed: row 0 holds all tokens but
  SKEW_OTHERS per other row (same prefixes; a pool with room for it)."""
  case = bench_micro.make_case("extend", bs, tokens, page_size, seed=0)
  if not skewed:
    return case
  ext = np.full(bs, SKEW_OTHERS, np.int64)
  ext[0] = tokens - SKEW_OTHERS * (bs - 1)
  pre = case.pre.astype(np.int64)
  seq = pre + ext
  need = int(np.sum(-(-seq // page_size) - (-(-pre // page_size))))
  num_pages = max(case.num_pages, 2 * need + 1024)
  ring = (np.random.default_rng([1, bs, tokens]).permutation(num_pages) + 1)
  return dataclasses.replace(case, seq=seq.astype(np.int32), tokens=int(ext.sum()),
                             num_pages=num_pages, free_ring=ring.astype(np.int32))


def kernel_config(layout: str, bs: int, tokens: int) -> dict:
  """The launch of alloc_extend_triton at its defaults (tuning.py's rules)."""
  rows_pad = next_pow2(bs)
  if layout == "rows":
    tile, chunks, warps = tuning.extend_rows_block(bs, tokens)
    return dict(tile=tile, chunks=chunks, warps=warps, programs=bs * chunks)
  tile, warps = tuning.extend_tile_warps(rows_pad, tokens, True)
  return dict(tile=tile, warps=warps, programs=-(-tokens // tile))


def layout_call(case: bench_micro.Case, layout: str, interpret: bool):
  """(call(state, inputs) -> (state, outputs), state, inputs): alloc_extend_triton on
  the case; the state's head moves from call to call (bench_micro.jax_call's chain)."""
  _, _, state, inputs = bench_micro.jax_call(case, "jnp")
  nreq = jnp.int32(case.bs)
  fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=case.page_size,
                         out_len=case.tokens, layout=layout, interpret=interpret)

  def call(s, x):
    out, head, length, ok = fn(s.free_ring, s.free_head, s.free_len, nreq, *x)
    return s._replace(free_head=head), (out, ok, head, length)
  return call, state, inputs


def check(case: bench_micro.Case, layout: str, interpret: bool, want) -> str:
  """"ok", or what differs from `want`, the jnp path's (state, indices, ok) on the case
  (whole result of one call)."""
  state, out, ok = want
  if not bool(ok):
    return "the case does not fit (jnp path refused it)"
  call, s0, inputs = layout_call(case, layout, interpret)
  _, (got, got_ok, head, length) = jax.jit(call)(s0, inputs)
  for name, a, b in (("indices", got, out), ("ok", got_ok, ok),
                     ("free_head", head, state.free_head),
                     ("free_len", length, state.free_len)):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      return f"MISMATCH in {name} against the jnp path"
  return "ok"


def single_launch(call, state, inputs) -> bool:
  """Whether the compiled call is one custom call and no fusion (what makes the bare
  program lose no work; bench_micro.one_custom_call's condition)."""
  text = jax.jit(call).lower(state, inputs).compile().as_text()
  body = text[text.index("ENTRY"):]
  return body.count("custom-call(") == 1 and "fusion(" not in body


def header() -> dict:
  """The bench's record of the machine (bench.environment, without torch) and triton's
  version."""
  env = bench.environment("not used")
  env["command"] = "python " + " ".join(sys.argv)
  try:
    env["triton"] = importlib.metadata.version("triton")
  except importlib.metadata.PackageNotFoundError:
    env["triton"] = None
  return env


def _fmt(x) -> str:
  return "-" if x is None or x != x else f"{x:.2f}"


def table(results: list, skipped: list, unroll: int, reps: int, page_size: int) -> list:
  """The printed table's lines (us per call, * = tuning.extend_layout's pick)."""
  lines = [f"alloc_extend_triton bare (each kernel's own GPU time from CUPTI, median over "
           f"{bench_micro.BARE_CALLS} launches; interpreter: the bare loop), page size "
           f"{page_size}, us per call; * = tuning.extend_layout's pick",
           f"{'bs':>5} {'tokens':>7} {'batch':>6} "
           + "".join(f"{l:>9}" for l in LAYOUTS)
           + f" {'best/tiles':>10} {'SGLang':>8} {'SGLang/pick':>11}  check"]
  keys = dict.fromkeys((r["bs"], r["tokens"], r["skewed"]) for r in results)
  for bs, tokens, skewed in keys:
    by = {r["layout"]: r for r in results if (r["bs"], r["tokens"], r["skewed"]) ==
          (bs, tokens, skewed)}
    cell = lambda l: (_fmt(by[l].get("us")) + ("*" if by[l]["default"] else " ")
                      if l in by else "-")
    us = {l: by[l]["us"] for l in by if by[l].get("us")}
    best = min((v, l) for l, v in us.items() if l != "tiles") if len(us) > 1 else None
    ratio = f"{best[0] / us['tiles']:.2f} {best[1]}" if best and "tiles" in us else "-"
    any_row = next(iter(by.values()))
    sg = any_row.get("sglang_us")
    picked = [by[l].get("us") for l in by if by[l]["default"]]
    pick_ratio = f"{sg / picked[0]:.2f}x" if sg and picked and picked[0] else "-"
    checks = ",".join(sorted({by[l].get("check") or by[l].get("error", "?")[:40]
                              for l in by}))
    lines.append(f"{bs:>5} {tokens:>7} {'skewed' if skewed else 'even':>6} "
                 + "".join(f"{cell(l):>9}" for l in LAYOUTS)
                 + f" {ratio:>10} {_fmt(sg):>8} {pick_ratio:>11}  {checks}")
  if skipped:
    lines.append("skipped (budget): " + ", ".join(skipped))
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", help="write the results here")
  ap.add_argument("--small", action="store_true",
                  help="small cases in Pallas' interpreter (CPU; checks the script)")
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--sglang-kernels", metavar="PATH",
                  help="SGLang's allocator kernels file (as jax-kvalloc bench): its "
                  "extend kernel's own GPU time on the same cases, same run")
  ap.add_argument("--unroll", type=int, default=None,
                  help="calls per graph, default bench_micro.BARE_UNROLL (small: 2)")
  ap.add_argument("--min-time", type=float, default=None, help="default 0.03 s")
  ap.add_argument("--reps", type=int, default=None, help="default 5 (small: 1)")
  ap.add_argument("--budget", type=float, default=65.0,
                  help="seconds after which the remaining cases are skipped")
  ap.add_argument("--layouts", default=",".join(LAYOUTS),
                  help="comma-separated layouts to time (default all)")
  args = ap.parse_args(argv)
  start = time.perf_counter()
  interpret = args.small
  if not interpret and jax.default_backend() not in ("gpu", "cuda", "rocm"):
    print("no GPU: run on a GPU, or with --small (interpreter, CPU)", file=sys.stderr)
    return 2
  unroll = args.unroll or (2 if interpret else bench_micro.BARE_UNROLL)
  min_time = args.min_time or (0.001 if interpret else 0.03)
  reps = args.reps or (1 if interpret else 5)
  env = header()
  print(" ".join(f"{k} {env[k]}" for k in ("date", "device", "jax", "triton", "python")),
        flush=True)
  module = (bench_micro.load_sglang_kernels(args.sglang_kernels) if args.sglang_kernels
            else None)
  results, skipped = [], []

  def save() -> list:
    """The table so far; written with every figure to --json after each case, so that
    a run cut short by a timeout leaves what it measured."""
    lines = table(results, skipped, unroll, reps, args.page_size)
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"env": env, "config": {
            "unroll": unroll, "min_time": min_time, "reps": reps, "interpret": interpret,
            "per_row_range": [tuning.EXTEND_ROWS_MIN_ROWS, tuning.EXTEND_ROWS_MAX_ROWS]},
                   "results": results, "skipped": skipped, "table": lines,
                   "total_s": time.perf_counter() - start}, f, indent=1)
    return lines

  for bs, tokens, skewed in SMALL_CASES if interpret else CASES:
    label = f"bs={bs} tokens={tokens}{' skewed' if skewed else ''}"
    if time.perf_counter() - start > args.budget:
      skipped.append(label)
      continue
    case = make_case(bs, tokens, args.page_size, skewed)
    pick = tuning.extend_layout(next_pow2(bs), case.tokens)
    want = bench_micro.jax_call(case, "jnp")[0]()
    sglang_us = None
    if module is not None:  # SGLang's kernel, the same case, the same run
      try:
        sg, sg_out = bench_micro.sglang_bare(case, module)
        if np.array_equal(np.asarray(sg_out, np.int64), np.asarray(want[1], np.int64)):
          sglang_us = sg["s"] * 1e6
        else:
          print(f"{label}: SGLang's kernel differs from the jnp path", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{label}: SGLang: {type(e).__name__}: {e}"[:300], flush=True)
    for layout in args.layouts.split(","):
      row = {"bs": bs, "tokens": case.tokens, "skewed": skewed,
             "page_size": args.page_size, "layout": layout, "default": layout == pick,
             "config": kernel_config(layout, bs, case.tokens)}
      try:
        row["check"] = check(case, layout, interpret, want)
        if row["check"] == "ok":
          call, state, inputs = layout_call(case, layout, interpret)
          if not interpret:
            row["single_launch"] = single_launch(call, state, inputs)
          if interpret:  # no CUPTI: the bare loop's wall-clock slope (checks the script)
            r = timing.chain_time(call, state, inputs, unroll=unroll, min_time=min_time,
                                  reps=reps, linked=False)
          else:  # the kernel's own GPU time, as bench's "pallas bare"
            r = bench_micro.bare_kernel_time(call, state, inputs, "jax_kvalloc_alloc_extend")
          row.update(us=r["s"] * 1e6, min_us=r["min_s"] * 1e6, spread=r["spread"])
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      row["sglang_us"] = sglang_us
      results.append(row)
      print(f"{label} {layout}: {_fmt(row.get('us'))} us {row['config']} "
            f"{row.get('check', '')} {row.get('error', '')}", flush=True)
    save()

  lines = save()
  print("\n" + "\n".join(lines), flush=True)
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  bad = [r for r in results if r.get("check") != "ok"]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
