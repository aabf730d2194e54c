"""GPU check of the Pallas-Triton kernels: correctness tests, then device-time table.

Run on a machine with a CUDA GPU, from the repository root:

  python tests/gpu_check.py [--no-tests] [--no-jnp] [--no-tuning]
      [--budget SECONDS] [--out DIR]

1. Runs tests/test_pallas_gpu.py (bit-for-bit against the jnp path on the GPU, and the
   model) unless --no-tests.
2. Times whole jitted allocator calls, `alloc_decode` and `alloc_extend` with
   kernel="pallas" (on GPU: one fused kernel launch, or for very large extend batches
   XLA prefix sums + the contract kernel) and kernel="jnp" (XLA only): a fori_loop with a
   traced trip count whose body makes U dependent calls (each call's state feeds the
   next), timed at 1 and n iterations; device time per call = slope / U, median over
   repeats (the same method as `jax-kvalloc bench`). Each iteration refills the pool
   (head and length reset to constants), so every call does the same work.
3. Times tunings of the fused kernels (tile/window/warps, row block/warps).

Prints a table at the end; --out writes it (and the raw numbers as JSON) to DIR.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv
import pallas_kernels
import kernel_cases as testing

UNROLL = 32       # dependent calls per loop iteration
REPEATS = 5
MIN_SECONDS = 0.02

# (bs, ps) and (bs, tokens, ps) of the targets; SGLang's Triton kernel alone on an
# H200 takes (us) decode 1.3 at bs <= 256, 2.8 at 1024, 22 at 4096, 292 at 16384;
# extend 2.4-3.4 at bs 1-256 with 8k-65k tokens, 6.4-8.2 at bs 1024 with 65k tokens.
DECODE = [(bs, ps) for ps in (1, 16) for bs in (1, 64, 256, 1024, 4096, 16384)]
EXTEND = [(bs, tok, ps) for ps in (1, 16)
          for bs, tok in ((1, 8192), (1, 65536), (16, 8192), (64, 65536), (256, 8192),
                          (256, 65536), (1024, 65536), (4096, 262144), (16384, 262144))]
TARGET_US = {("decode", 1): 1.3, ("decode", 64): 1.3, ("decode", 256): 1.3,
             ("decode", 1024): 2.8, ("decode", 4096): 22.0, ("decode", 16384): 292 / 20,
             ("extend", 1): 3.4, ("extend", 64): 3.4, ("extend", 256): 3.4,
             ("extend", 16): 3.4, ("extend", 1024): 8.2}


def _sync_wall(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def time_calls(step, carry, reset=lambda c: c, *, unroll=UNROLL, repeats=REPEATS) -> dict:
  """Device seconds per call of `step` (carry -> carry): a fori_loop with a traced trip
  count whose body runs `unroll` dependent calls (after `reset`, which refills the pool),
  timed at 1 and n iterations; the slope removes dispatch and transfers. The loop's own
  per-iteration cost, divided by `unroll`, stays in (see loop_overhead_us)."""
  @jax.jit
  def run(c, n):
    def body(_, c):
      c = reset(c)
      for _ in range(unroll):
        c = step(c)
      return c
    return jax.lax.fori_loop(0, n, body, c)

  one = np.int32(1)
  t0 = time.perf_counter()
  jax.block_until_ready(run(carry, one))
  compile_s = time.perf_counter() - t0
  n = 2
  while n < 4096 and _sync_wall(lambda: run(carry, np.int32(n))) < MIN_SECONDS:
    n *= 2
  per_call = []
  for _ in range(repeats):
    ta = _sync_wall(lambda: run(carry, one))
    tb = _sync_wall(lambda: run(carry, np.int32(n)))
    per_call.append(max(tb - ta, 0.0) / ((n - 1) * unroll))
  med = statistics.median(per_call)
  return {"us": med * 1e6, "spread": (max(per_call) - min(per_call)) / max(med, 1e-12),
          "iters": n, "compile_s": compile_s}


def _chained(call, use_sink):
  """step((state, sink)) for call(state) -> (state, out, ok). With use_sink, `out` is
  folded into a sink (a max, which XLA fuses into the index computation) so that XLA
  cannot drop unused indices: needed wherever the indices come from XLA or from a
  kernel whose only output they are (the contract kernel). The fused kernel needs none:
  it also returns the state, so it always runs (a custom call is never pruned in part).
  Note: on the jnp path XLA also fuses across consecutive calls and hoists their
  loop-invariant parts, so its numbers are lower bounds, not per-call costs."""
  def step(c):
    state, sink = c
    state, out, _ = call(state)
    return state, (jnp.maximum(sink, out) if use_sink else sink)
  return step


def _refill(cfg):
  """reset(): the initial free list's head (0) and length (all pages) at each iteration,
  written as functions of the carried values that XLA cannot fold to constants: with
  constants the loop body would be loop-invariant and hoisted out of the loop."""
  def reset(c):
    state, sink = c
    return state._replace(free_head=jnp.minimum(state.free_head, 0),
                          free_len=jnp.maximum(state.free_len, cfg.num_pages)), sink
  return reset


def _decode_inputs(rng, bs, ps):
  seq = rng.integers(2, 4000, bs)
  last = rng.integers(1, 1000, bs) * ps + (seq - 2) % ps
  needs = int(np.sum(-(-seq // ps) > -(-(seq - 1) // ps)))
  return jnp.asarray(seq, jnp.int32), jnp.asarray(last, jnp.int32), needs


def _extend_inputs(rng, bs, tokens, ps):
  cuts = np.sort(rng.integers(0, tokens + 1, bs - 1))
  ext = np.diff(np.concatenate([[0], cuts, [tokens]]))
  pre = rng.integers(0, 50, bs) * ps + np.where(rng.random(bs) < 0.5,
                                                rng.integers(0, ps, bs), 0)
  seq = pre + ext
  last = np.where(pre > 0, rng.integers(1, 1000, bs) * ps + (pre - 1) % ps, -1)
  pages = int(np.sum(-(-seq // ps) + (pre // -ps)))
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return i32(pre), i32(seq), i32(last), pages


def _config(ps, pages, kernel):
  return kv.AllocatorConfig(size=(pages * UNROLL + 16) * ps, page_size=ps, kernel=kernel,
                            debug=False)


def bench_decode(bs, ps, kernel, rng, **tuning):
  seq, last, needs = _decode_inputs(rng, bs, ps)
  cfg = _config(ps, max(needs, 1), kernel)
  if tuning:
    fn = functools.partial(pallas_kernels.alloc_decode_triton, page_size=ps, **tuning)
    nreq = jnp.int32(bs)

    def call(s):
      out, head, length, ok = fn(s.free_ring, s.free_head, s.free_len, nreq, seq, last)
      return s._replace(free_head=head, free_len=length), out, ok
  else:
    call = lambda s: kv.alloc_decode(cfg, s, seq, last)
  use_sink = kernel == "jnp" or not (
      tuning or pallas_kernels.decode_fused_supported(bs, cfg.num_pages))
  return time_calls(_chained(call, use_sink), (kv.init(cfg), jnp.zeros((bs,), jnp.int32)),
                    _refill(cfg))


def bench_extend(bs, tokens, ps, kernel, rng, **tuning):
  pre, seq, last, pages = _extend_inputs(rng, bs, tokens, ps)
  cfg = _config(ps, pages, kernel)
  if tuning:
    fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps,
                           out_len=tokens, **tuning)
    nreq = jnp.int32(bs)

    def call(s):
      out, head, length, ok = fn(s.free_ring, s.free_head, s.free_len, nreq, pre, seq,
                                 last)
      return s._replace(free_head=head, free_len=length), out, ok
  else:
    call = lambda s: kv.alloc_extend(cfg, s, pre, seq, last, max_tokens=tokens)
  use_sink = kernel == "jnp" or not (
      tuning or pallas_kernels.extend_fused_preferred(bs, tokens, cfg.num_pages))
  return time_calls(_chained(call, use_sink),
                    (kv.init(cfg), jnp.zeros((tokens,), jnp.int32)), _refill(cfg))


def loop_overhead_us() -> float:
  """Per call: one tiny XLA kernel (a scalar add kept apart by an optimization barrier)
  plus 1/UNROLL of the loop's per-iteration cost: the floor of these numbers."""
  def step(c):
    return jax.lax.optimization_barrier(c + 1)
  return time_calls(step, jnp.zeros((), jnp.int32))["us"]


def _safe(fn, *args, **kwargs):
  try:
    return fn(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    print("  FAILED", msg, flush=True)
    return {"us": float("nan"), "error": msg}


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
          f"jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}  "
          f"triton {tv}  python {platform.python_version()}")


def _fmt(r) -> str:
  return f"{r['us']:.2f} us (compile {r.get('compile_s', float('nan')):.1f} s)"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--no-tests", action="store_true")
  ap.add_argument("--tests-k", default="", help="pytest -k selection of the GPU tests")
  ap.add_argument("--no-tuning", action="store_true")
  ap.add_argument("--no-jnp", action="store_true", help="skip the jnp-path timings")
  ap.add_argument("--budget", type=float, default=1e9,
                  help="seconds after which remaining timings are skipped")
  ap.add_argument("--out", default=os.environ.get("OUT"))
  args = ap.parse_args(argv)
  start = time.perf_counter()
  print(header(), flush=True)
  rc = 0 if args.no_tests else run_tests(args.tests_k)

  rng = np.random.default_rng(0)
  empty = loop_overhead_us()
  print(f"loop floor (tiny kernel + loop share): {empty:.2f} us/call", flush=True)
  # Most important first: the fused kernels at the target sizes (ps 16), tunings, the
  # jnp path, then ps 1; stop when the budget is spent.
  def sizes(ps, kernel):
    return ([("decode", bs, "-", ps, kernel) for bs, p in DECODE if p == ps]
            + [("extend", bs, tok, ps, kernel) for bs, tok, p in EXTEND if p == ps])

  jobs = sizes(16, "pallas")
  if not args.no_tuning:
    for bs, tok in ((1, 8192), (16, 65536), (256, 65536), (1024, 65536)):
      for tile, warps in ((256, 1), (512, 2), (2048, 8)):
        jobs.append(("extend", bs, tok, 16, "pallas", dict(tile=tile, num_warps=warps)))
    for bs in (1, 64, 256):
      for warps in (2, 4):
        jobs.append(("decode", bs, "-", 16, "pallas", dict(num_warps=warps)))
    for rb, warps in ((4096, 8), (16384, 16)):
      jobs.append(("decode", 16384, "-", 16, "pallas", dict(row_block=rb, num_warps=warps)))
  jobs += sizes(1, "pallas")
  if not args.no_jnp:
    jobs += sizes(16, "jnp")
    jobs += sizes(1, "jnp")

  results = {}
  for job in jobs:
    if time.perf_counter() - start > args.budget:
      print("budget spent: skipping", job, flush=True)
      continue
    op, bs, tok, ps, kernel, *tuning = job
    tuning = tuning[0] if tuning else {}
    if op == "decode":
      r = _safe(bench_decode, bs, ps, kernel, rng, **tuning)
    else:
      r = _safe(bench_extend, bs, tok, ps, kernel, rng, **tuning)
    key = (op, bs, tok, ps, kernel, tuple(sorted(tuning.items())))
    results[key] = r
    print(op, f"bs={bs} tokens={tok} ps={ps} {kernel} {tuning or ''}:", _fmt(r), flush=True)

  lines = [header(), f"fori_loop of {UNROLL} dependent calls per iteration, slope, median "
           f"of {REPEATS}; floor (tiny kernel + loop share) {empty:.2f} us/call; target = "
           "SGLang's Triton kernel alone (decode 16384: /20)", "",
           f"{'op':7} {'bs':>6} {'tokens':>6} {'ps':>3} {'pallas us':>10} {'jnp us':>9} "
           f"{'target us':>9}"]
  for key, r in results.items():
    op, bs, tok, ps, kernel, tuning = key
    if kernel != "pallas" or tuning:
      continue
    j = results.get((op, bs, tok, ps, "jnp", ()), {"us": float("nan")})
    target = TARGET_US.get((op, bs), float("nan"))
    lines.append(f"{op:7} {bs:>6} {tok:>6} {ps:>3} {r['us']:>10.2f} {j['us']:>9.2f} "
                 f"{target:>9.1f}")
  tuned = [(k, r) for k, r in results.items() if k[5]]
  if tuned:
    lines += ["", "tunings of the fused kernels (ps 16):"]
    lines += [f"  {k[0]} bs={k[1]} tokens={k[2]} {dict(k[5])}: {r['us']:.2f} us"
              for k, r in tuned]
  table = "\n".join(lines)
  print("\n" + table, flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
      f.write(table + "\n")
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
      json.dump({"results": [[list(map(str, k)), r] for k, r in results.items()],
                 "empty_us": empty, "tests_rc": rc}, f)
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return rc


if __name__ == "__main__":
  sys.exit(main())
