"""Where a bare call's time goes on the GPU: our kernel in XLA's loop against SGLang's in
a CUDA graph, from the GPU's own timeline (issue 13, item 1).

    python benchmarks/gpu_profile.py --sglang-kernels .sglang_kernels/allocator.py \
        --json $OUT/profile.json --hlo-dir $OUT

For each case (bench_micro's decode and extend cases, page size 64) it runs

  ours     jax_kvalloc.tools.timing.chain_loop(call, unroll, linked=False) (the bare
           chain: calls chained through the state's head in XLA's loop) for N iterations
  sglang   a CUDA graph of `unroll` launches of SGLang's released kernel replayed N times:
           the "SGLang bare" figure

under torch.profiler (CUPTI records every kernel, memcpy and memset of the process, JAX's
included) and reports, per call: the GPU span of the run (first activity's start to the
last one's end), the activities per call by kind and name with their mean durations,
and the median gap between consecutive activities. It also times both with the bench's
own methods (bench_micro.time_bare / time_sglang: each kernel's own GPU time, the "bare"
columns; the bare loop's wall-clock slope at each unroll in --unrolls), and writes the
optimized HLO of our bare loop to --hlo-dir. XLA_FLAGS is read from the environment and
recorded: run it once per flag set to compare.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import jax
import numpy as np

from jax_kvalloc.tools import bench_micro as bm
from jax_kvalloc.tools import timing as bt

CASES = (("decode", 1, 1), ("decode", 64, 64), ("decode", 1024, 1024),
         ("extend", 1, 8192), ("extend", 16, 32768), ("extend", 256, 65536))


def _summary(acts: list, calls: int) -> dict:
  if not acts:
    return {"error": "no GPU activity recorded"}
  span = acts[-1][0] + acts[-1][1] - acts[0][0]
  by = collections.defaultdict(list)
  for _, dur, cat, name in acts:
    by[(cat, name[:80])].append(dur)
  gaps = [b[0] - (a[0] + a[1]) for a, b in zip(acts, acts[1:])]
  busy = sum(a[1] for a in acts)
  return {
      "calls": calls, "activities": len(acts),
      "span_per_call_us": span / calls, "busy_per_call_us": busy / calls,
      "median_gap_us": statistics.median(gaps) if gaps else 0.0,
      "max_gap_us": max(gaps) if gaps else 0.0,
      "per_call": [{"cat": c, "name": n, "per_call": len(d) / calls,
                    "mean_us": statistics.fmean(d)}
                   for (c, n), d in sorted(by.items(), key=lambda kv: -len(kv[1]))],
  }


def profile_ours(case, unroll: int, iters: int, hlo_dir: str | None, tag: str) -> dict:
  _, call, carry, inputs = bm.jax_call(case, "pallas")
  run = bt.chain_loop(call, unroll, linked=False)
  sink = bt.sink_init(call, carry, inputs)
  if hlo_dir:
    text = run.lower(carry, inputs, sink, np.int32(1)).compile().as_text()
    with open(os.path.join(hlo_dir, f"hlo_{tag}.txt"), "w") as f:
      f.write(text)
  jax.block_until_ready(run(carry, inputs, sink, np.int32(2)))
  return _summary(bt.cuda_activities(lambda: jax.block_until_ready(
      run(carry, inputs, sink, np.int32(iters)))), iters * unroll)


def profile_sglang(case, module, unroll: int, iters: int) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  dev = torch.device("cuda")
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)
  ps, bs = case.page_size, case.bs
  free, seq, last = t64(case.free_ring), t64(case.seq), t64(case.last)
  upper = triton.next_power_of_2(bs)
  if case.op == "decode":
    out = torch.empty(bs, dtype=torch.int64, device=dev)
    call = lambda: module.alloc_decode_kernel[(bs,)](seq, last, free, out, upper, ps)
  else:
    pre = t64(case.pre)
    out = torch.empty(case.tokens, dtype=torch.int64, device=dev)
    call = lambda: module.alloc_extend_kernel[(bs,)](pre, seq, last, free, out, upper, ps)
  graph = bt.torch_graph(call, unroll)

  def run():
    for _ in range(iters):
      graph.replay()
    torch.cuda.synchronize()
  res = _summary(bt.cuda_activities(run), iters * unroll)
  del graph
  return res


def profile_serving(bs: int, release: str, steps_per_iter: int, iters: int) -> dict:
  """The serving scan of `jax-kvalloc bench` (bench_serving.serve_step chained in
  timing.chain_loop, linked) with release="fused" / "pages" / "sorted", or "baseline"
  (free and alloc_decode replaced by stand-ins): its GPU activities per step."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench_serving as bs_mod  # pylint: disable=g-import-not-at-top
  case = bs_mod.make_case(bs, 64, 1000, 0)
  cfg = bs_mod._config(case)  # pylint: disable=protected-access
  flags = dict(alloc=False, free=False) if release == "baseline" else dict(release=release)
  step = functools.partial(bs_mod.serve_step, cfg, case.max_frees, **flags)
  call = lambda c, x: bs_mod._step_call(step, c, x)  # pylint: disable=protected-access
  carry, inputs = bs_mod.initial_carry(case), jnp.zeros((), jnp.int32)
  run = bt.chain_loop(call, steps_per_iter)
  sink = bt.sink_init(call, carry, inputs)
  text = run.lower(carry, inputs, sink, np.int32(2)).compile().as_text()
  # The compiled program's copies (a DtoD memcpy per step in the profile: which buffer).
  copies = [l.strip()[:160] for l in text.splitlines()
            if " copy(" in l or " copy-start(" in l]
  jax.block_until_ready(run(carry, inputs, sink, np.int32(2)))
  res = _summary(bt.cuda_activities(lambda: jax.block_until_ready(
      run(carry, inputs, sink, np.int32(iters)))), iters * steps_per_iter)
  res["copies"] = copies
  return res


DECODE_VARIANTS = ((None, False), (None, True), (1, True), (2, True), (8, True),
                   (1, False), (2, False), (8, False))


def decode_variants(batch_sizes) -> dict:
  """The fused decode kernel's own GPU time (bench_micro.bare_kernel_time, 512 calls of a
  16-call chain) for each (num_warps or tuning's default, masked prefix sum or scan)."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import tuning  # pylint: disable=g-import-not-at-top
  out = {}
  saved = tuning.DECODE_MASKED_PREFIX_MAX_ROWS
  try:
    for bs in batch_sizes:
      case = bm.make_case("decode", bs, bs, 64, 0)
      _, _, state, (seq, last) = bm.jax_call(case, "pallas")
      for warps, masked in DECODE_VARIANTS:
        tuning.DECODE_MASKED_PREFIX_MAX_ROWS = 1 << 20 if masked else 0

        def call(st, x, warps=warps):
          o, head, length, ok = pallas_kernels.alloc_decode_triton(
              st.free_ring, st.free_head, st.free_len, jax.numpy.int32(bs), x[0], x[1],
              page_size=64, num_warps=warps)
          return st._replace(free_head=head), (o, ok, head, length)
        key = f"bs{bs}/warps{warps or 'default'}/{'masked' if masked else 'scan'}"
        try:
          out[key] = bm.bare_kernel_time(call, state, (seq, last), unroll=16,
                                         calls=512)["s"] * 1e6
        except Exception as e:  # pylint: disable=broad-except
          out[key] = f"{type(e).__name__}: {e}"[:200]
        print(f"  decode {key}: {out[key]}", flush=True)
  finally:
    tuning.DECODE_MASKED_PREFIX_MAX_ROWS = saved
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sglang-kernels", default=None)
  ap.add_argument("--json", default=None)
  ap.add_argument("--hlo-dir", default=None)
  ap.add_argument("--unroll", type=int, default=bm.BARE_UNROLL)
  ap.add_argument("--unrolls", default="32",
                  help="also the old bare loop (timing.chain_loop, linked=False) at these "
                  "unrolls")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--tag", default="default")
  ap.add_argument("--serving", default="",
                  help="instead: profile the serving scan at these batch sizes (e.g. "
                  "64,1024) for each release variant")
  ap.add_argument("--decode-variants", default="",
                  help="instead: the decode kernel's own time at these batch sizes for "
                  "each of DECODE_VARIANTS (warps, masked prefix sum or scan)")
  args = ap.parse_args(argv)
  if args.decode_variants:
    res = decode_variants([int(x) for x in args.decode_variants.split(",")])
    if args.json:
      with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0
  if args.serving:
    res = {}
    for bs in [int(x) for x in args.serving.split(",")]:
      for release in ("baseline", "fused"):
        try:
          r = profile_serving(bs, release, 8, args.iters)
        except Exception as e:  # pylint: disable=broad-except
          r = {"error": f"{type(e).__name__}: {e}"[:400]}
        res[f"{bs}/{release}"] = r
        print(f"== serving bs={bs} {release}: " + (r.get("error") or
              f"span/step {r['span_per_call_us']:.2f} us, busy/step "
              f"{r['busy_per_call_us']:.2f} us, activities/step "
              f"{r['activities'] / r['calls']:.1f}"), flush=True)
        for a in r.get("per_call", [])[:14]:
          print(f"    {a['per_call']:7.3f}/step  {a['mean_us']:8.3f} us  {a['cat']:10s} "
                f"{a['name']}", flush=True)
        for c in r.get("copies", [])[:12]:
          print(f"    copy: {c}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "serving": res}, f,
                  indent=1)
    return 0
  module = bm.load_sglang_kernels(args.sglang_kernels) if args.sglang_kernels else None
  out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0]),
         "jax": jax.__version__, "unroll": args.unroll, "iters": args.iters, "cases": []}

  def save():
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
  for op, bs, tokens in CASES:
    case = bm.make_case(op, bs, tokens, 64, 0)
    row = {"op": op, "bs": bs, "tokens": case.tokens}
    tag = f"{args.tag}_{op}{bs}"
    try:
      row["ours"] = profile_ours(case, args.unroll, args.iters,
                                 args.hlo_dir if bs in (1, 16) else None, tag)
    except Exception as e:  # pylint: disable=broad-except
      row["ours"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    if module is not None:
      try:
        row["sglang"] = profile_sglang(case, module, args.unroll, args.iters)
      except Exception as e:  # pylint: disable=broad-except
        row["sglang"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    row["timed"] = {}
    try:
      row["timed"]["ours_kernel_us"] = bm.time_bare(case, "pallas")["s"] * 1e6
      if module is not None:
        _, alone, _ = bm.time_sglang(case, module, unroll=32, min_time=0.02, reps=3)
        row["timed"]["sglang_kernel_us"] = alone["s"] * 1e6
      for u in [int(x) for x in args.unrolls.split(",") if x]:
        t, _ = bm.time_jax(case, "pallas", unroll=u, min_time=0.02, reps=3, linked=False)
        row["timed"][f"ours_bare_loop_u{u}_us"] = t["s"] * 1e6
    except Exception as e:  # pylint: disable=broad-except
      row["timed"]["error"] = f"{type(e).__name__}: {e}"[:400]
    out["cases"].append(row)
    save()
    print(f"== {op} bs={bs} tokens={case.tokens} [{args.tag}] timed: "
          + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in row["timed"].items()))
    for side in ("ours", "sglang"):
      s = row.get(side)
      if not s:
        continue
      if "error" in s:
        print(f"  {side}: {s['error']}")
        continue
      print(f"  {side}: span/call {s['span_per_call_us']:.3f} us, busy/call "
            f"{s['busy_per_call_us']:.3f} us, median gap {s['median_gap_us']:.3f} us, "
            f"max gap {s['max_gap_us']:.1f} us")
      for a in s["per_call"][:6]:
        print(f"    {a['per_call']:7.3f}/call  {a['mean_us']:8.3f} us  {a['cat']:10s} "
              f"{a['name']}")
  save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
