"""GPU check of the Pallas-Triton kernels: correctness tests, then tunings of the fused
kernels, timed in the benchmark harness (jax_kvalloc.tools.timing).

Run on a machine with a CUDA GPU, from the repository root:

  python tests/gpu_check.py [--no-tests] [--tests-k K] [--no-tuning] [--budget SECONDS]
      [--out DIR]

1. Runs tests/test_pallas_gpu.py (bit-for-bit against the jnp path on the GPU, and the
   model) unless --no-tests.
2. Times tile/warp/window choices of the one-launch kernels (`alloc_extend_triton`,
   `alloc_decode_triton`) on the cases of `jax-kvalloc bench` (bench_micro.make_case: one
   draw per case, the same inputs for every variant), each variant's output checked
   against the jnp path first. The timing is `timing.chain_time`, the harness of the
   bench: every output consumed, calls linked, no fusion across calls.

The allocator's own tables (Pallas, jnp, torch_ref and SGLang's kernels side by side)
come from `jax-kvalloc bench`; this script does not time them again.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_kvalloc.tools import bench_micro
from jax_kvalloc.tools import timing

UNROLL = 32
REPS = 5
MIN_TIME = 0.03

# (bs, tokens) x (layout, tile, warps, window, chunks) and bs x (warps,
# row_block) to try. dict(): the default layout (tuning.extend_layout); the tiles' tile
# sizes name their layout. benchmarks/extend_layouts_gpu.py times the two layouts bare.
EXTEND_CASES = ((1, 8192), (16, 8192), (16, 32768), (64, 32768), (256, 65536),
                (1024, 65536))
EXTEND_TUNINGS = (dict(), dict(layout="tiles"), dict(layout="rows"),
                  dict(layout="rows", num_warps=8), dict(layout="rows", tile=256),
                  dict(layout="tiles", tile=256, num_warps=1),
                  dict(layout="tiles", tile=1024, num_warps=4),
                  dict(layout="tiles", tile=2048, num_warps=8))
DECODE_BS = (1, 16, 64, 256, 1024)
DECODE_TUNINGS = (dict(), dict(num_warps=1), dict(num_warps=2), dict(num_warps=4))


def fused_call(case: bench_micro.Case, tuning: dict):
  """(call(state, inputs) -> (state, outputs), state, inputs) of the one-launch kernel
  with these tuning arguments, for timing.chain_time."""
  _, _, state, inputs = bench_micro.jax_call(case, "jnp")
  ps = case.page_size
  nreq = jnp.int32(case.bs)
  if case.op == "decode":
    fn = functools.partial(pallas_kernels.alloc_decode_triton, page_size=ps, **tuning)
  else:
    fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps,
                           out_len=case.tokens, **tuning)

  def call(s, x):
    out, head, length, ok = fn(s.free_ring, s.free_head, s.free_len, nreq, *x)
    return s._replace(free_head=head), (out, ok, head, length)
  return call, state, inputs


def check_and_time(case, tuning) -> dict:
  call, state, inputs = fused_call(case, tuning)
  want = np.asarray(bench_micro.jax_call(case, "jnp")[0]()[1])
  got = np.asarray(jax.jit(call)(state, inputs)[1][0])
  if not np.array_equal(got, want):
    return {"us": float("nan"), "error": "MISMATCH against the jnp path"}
  r = timing.chain_time(call, state, inputs, unroll=UNROLL, min_time=MIN_TIME, reps=REPS)
  return {"us": r["s"] * 1e6, "spread": r["spread"]}


def run_tests(select: str = "") -> int:
  cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-x", "-p", "no:cacheprovider",
         "tests/test_pallas_gpu.py"] + (["-k", select] if select else [])
  print("$", " ".join(cmd), flush=True)
  t0 = time.perf_counter()
  rc = subprocess.call(cmd)
  print(f"tests: rc={rc} in {time.perf_counter() - t0:.0f} s", flush=True)
  return rc


def header() -> str:
  dev = jax.devices()[0]
  try:
    import triton  # pylint: disable=g-import-not-at-top
    tv = triton.__version__
  except ImportError:
    tv = "-"
  return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  "
          f"device {dev.device_kind} ({jax.default_backend()})  jax {jax.__version__}  "
          f"triton {tv}  python {platform.python_version()}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--no-tests", action="store_true")
  ap.add_argument("--tests-k", default="", help="pytest -k selection of the GPU tests")
  ap.add_argument("--no-tuning", action="store_true")
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--budget", type=float, default=1e9,
                  help="seconds after which remaining timings are skipped")
  ap.add_argument("--out", default=os.environ.get("OUT"))
  args = ap.parse_args(argv)
  start = time.perf_counter()
  print(header(), flush=True)
  rc = 0 if args.no_tests else run_tests(args.tests_k)
  results = []
  if not args.no_tuning:
    jobs = [("extend", bs, tok, t) for bs, tok in EXTEND_CASES for t in EXTEND_TUNINGS]
    jobs += [("decode", bs, bs, t) for bs in DECODE_BS for t in DECODE_TUNINGS]
    for op, bs, tok, tuning in jobs:
      if time.perf_counter() - start > args.budget:
        print("budget spent: skipping", op, bs, tuning, flush=True)
        continue
      case = bench_micro.make_case(op, bs, tok, args.page_size, seed=0)
      try:
        r = check_and_time(case, tuning)
      except Exception as e:  # pylint: disable=broad-except
        r = {"us": float("nan"), "error": f"{type(e).__name__}: {str(e)[:200]}"}
      results.append({"op": op, "bs": bs, "tokens": case.tokens, "tuning": tuning, **r})
      print(f"{op} bs={bs} tokens={case.tokens} {tuning or 'default'}: "
            f"{r['us']:.2f} us {r.get('error', '')}", flush=True)
  lines = [header(), f"tunings of the one-launch kernels, page_size {args.page_size}, "
           f"us per call (timing.chain_time, unroll {UNROLL}, median of {REPS}):"]
  for op in ("extend", "decode"):
    keys = sorted({(r["bs"], r["tokens"]) for r in results if r["op"] == op})
    for bs, tok in keys:
      rs = [r for r in results if r["op"] == op and r["bs"] == bs]
      best = min(rs, key=lambda r: r["us"] if r["us"] == r["us"] else 1e9)
      cells = "  ".join(f"{json.dumps(r['tuning'])}={r['us']:.2f}" for r in rs)
      lines.append(f"  {op} bs={bs} tokens={tok}: best {json.dumps(best['tuning'])} "
                   f"{best['us']:.2f} | {cells}")
  table = "\n".join(lines)
  print("\n" + table, flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
      f.write(table + "\n")
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
      json.dump({"results": results, "tests_rc": rc}, f)
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return rc


if __name__ == "__main__":
  sys.exit(main())
