"""The serve benchmark: SmolLM2-135M's shapes with random weights (bfloat16 on a GPU),
decode and prefill through the engine, paged against contiguous, in one run.

For each batch B (default 64 and 256 running requests) and each KV layout (the paged
pool through the request table, and a contiguous cache per row with the same attention
kernel), B requests of a `--prompt-len`-token prompt (default 512) each generate
`--new-tokens` (default 128, eos ignored), all arriving at once. The engine runs them
twice: the first run compiles, the second (warm) is measured:

  decode tokens/s     tokens emitted by the warm decode round trips in which the most
                      requests decode (all B, unless the first finish before the last
                      leave prefill, or the pool is small) / their time (each round trip
                      is `--decode-steps` device steps of every row)
  decode step         a round trip's median time / its steps (one token per row)
  prefill tokens/s    prompt tokens / the warm prefill steps' time
  TTFT                each request's first token after the warm run's start (queueing
                      behind earlier prefill steps included): median and max
  table share         the paged run's steps replayed with only the table work (prefix
                      cache, step_rows, attention inputs, the device loop) against the
                      full steps, median decode round trip over median decode round trip
  late compiles       backend compiles after the first step of each kind (both runs)
  retractions         requests the engine retracted in the warm run, and the KV tokens
                      it computed again for them (where the engine reports them)

--pool-fraction F sizes the pool at F of every request's worst case (at least one
request's), so that admission and retraction work under a small pool. A configuration the
engine refuses (e.g. a page size the Pallas kernel cannot run) is a case with an "error"
(its ValueError), not a crash; a rate with no step to measure it is null.

Writes <out>/serve.json and <out>/manifest.json (jax_kvalloc.tools.bench.manifest) and,
with $OUT set (the device tool), <out>.tgz into $OUT; or, with --json FILE, that file
alone (inside benchmarks/run_device.sh, which writes the folder and manifest).

  python -m jax_kvalloc.serve.bench --out benchmarks/results/$(date -u +%F)-h200-serve
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tarfile
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv
from jax_kvalloc.serve import engine as eng
from jax_kvalloc.serve import loader

TINY = loader.LlamaConfig(vocab_size=128, hidden=64, intermediate=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                          rope_dim=16, rms_eps=1e-5, context_length=4096, name="tiny")


def _median(values: Sequence[float]) -> float:
  return float(statistics.median(values)) if values else float("nan")


def _rate(entries: Sequence[Dict[str, Any]]) -> Optional[float]:
  """Tokens per second of logged steps; None where there is no step (or no time)."""
  seconds = sum(x["s"] for x in entries)
  return sum(x["tokens"] for x in entries) / seconds if entries and seconds > 0 else None


def step_figures(log: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """The decode and prefill figures of an engine's log (see the module docstring).
  Decode figures come from the round trips with the most rows decoding (while the first
  rows decode, later ones may still be prefilling; with many requests the first may
  finish before the last start); a housekeeping-only step (flush) is no round trip.
  Rates are None where no step of the kind ran."""
  steps = [x for x in log if not x.get("flush")]
  rows = _full_rows(steps)
  dec = [x for x in steps if x["kind"] == "decode" and x.get("rows") == rows]
  pre = [x for x in steps if x["kind"] == "prefill"]
  trip = _median([x["s"] for x in dec])
  per_trip = [-(-x["tokens"] // max(rows, 1)) for x in dec]   # device steps of a trip
  return dict(
      decode_tokens_per_s=_rate(dec), decode_trip_median_s=trip,
      decode_step_median_s=trip / max(1, _median(per_trip)) if dec else float("nan"),
      decode_trips=len(dec), decode_rows=rows,
      decode_trips_all=sum(x["kind"] == "decode" for x in steps),
      prefill_tokens_per_s=_rate(pre), prefill_step_median_s=_median([x["s"] for x in pre]),
      prefill_steps=len(pre))


def table_replay(engine: eng.Engine) -> Dict[str, float]:
  """Replays the engine's last run (its logged batches) with model=False from a fresh
  pool and table: the same table work, no model. Returns median seconds per decode round
  trip of the replay and of the real run (each kind's first step left out)."""
  e = engine.ecfg
  acfg = e.alloc_config()
  carry = eng.Carry(kv.init(acfg), kv.init_table(acfg, e.max_reqs, e.max_pages_per_req),
                    engine.carry.caches, jnp.zeros((e.num_pages,), jnp.int32))
  seen, replay, full = set(), [], []
  rows = _full_rows(engine.log)
  for entry in engine.log:
    fn = eng.jitted_step(engine.cfg, e, entry["kind"], entry["layout"], model=False)
    if entry["kind"] not in seen:   # compile on a copy first (the carry is donated)
      seen.add(entry["kind"])
      jax.block_until_ready(fn(None, jax.tree.map(jnp.copy, carry), entry["x"]))
      carry, _ = fn(None, carry, entry["x"])
      continue
    t0 = time.perf_counter()
    carry, out = fn(None, carry, entry["x"])
    jax.block_until_ready(out)
    if entry["kind"] == "decode" and entry.get("rows") == rows:
      replay.append(time.perf_counter() - t0)
      full.append(entry["s"])
  return dict(replay_decode_s=_median(replay), full_decode_s=_median(full),
              share=_median(replay) / _median(full) if full else float("nan"))


def _full_rows(log: Sequence[Dict[str, Any]]) -> int:
  """The most rows any decode round trip of `log` ran (the batch, unless the first
  requests finish before the last ones leave prefill)."""
  return max((x.get("rows", 0) for x in log if x["kind"] == "decode"), default=0)


def run_case(cfg: loader.LlamaConfig, params, *, batch: int, layout: str, prompt_len: int,
             new_tokens: int, decode_steps: int, page_size: int, prefill_rows: int,
             impl: str, layers: str, seed: int, pool_fraction: float = 1.0
             ) -> Dict[str, Any]:
  """One batch size and layout: two runs (cold, warm); the warm run's figures, or the
  engine's ValueError ("error") where it refuses the configuration."""
  width = -(-(prompt_len + new_tokens) // page_size)
  num_pages = max(width, int(np.ceil(pool_fraction * batch * width)))
  out: Dict[str, Any] = dict(
      batch=batch, layout=layout, impl=impl, layers=layers, prompt_len=prompt_len,
      new_tokens=new_tokens, decode_steps=decode_steps, page_size=page_size,
      pool_fraction=pool_fraction, num_pages=num_pages)
  try:
    ecfg = eng.EngineConfig(page_size=page_size, num_pages=num_pages, max_reqs=batch,
                            max_pages_per_req=width, prefill_rows=min(prefill_rows, batch),
                            chunk=prompt_len, decode_steps=decode_steps, layout=layout,
                            impl=impl, layers=layers, prefix_cache=False)
  except ValueError as e:
    return dict(out, error=f"{type(e).__name__}: {e}")
  rng = np.random.default_rng(seed)
  reqs = [eng.Request(tuple(rng.integers(3, cfg.vocab_size, prompt_len).tolist()),
                      new_tokens, ignore_eos=True) for _ in range(batch)]
  engine = eng.Engine(cfg, params, ecfg, dtype=params["embed"].dtype)
  t0 = time.perf_counter()
  cold = engine.run(reqs)
  cold_s = time.perf_counter() - t0
  before = eng.compile_count()
  warm = engine.run(reqs)
  warm_compiles = eng.compile_count() - before
  out.update(
      prefill_rows=ecfg.prefill_rows, cold_run_s=cold_s,
      warm_run_s=warm.stats["wall_s"], same_tokens=cold.new_ids == warm.new_ids,
      **step_figures(engine.log),
      ttft_median_s=_median(warm.stats["ttft_s"]), ttft_max_s=max(warm.stats["ttft_s"]),
      ttft_min_s=min(warm.stats["ttft_s"]),
      late_compiles_cold=cold.stats["late_compiles"], compiles_warm_run=warm_compiles,
      kv_cache_bytes=sum(int(np.prod(a.shape)) * a.dtype.itemsize
                         for a in jax.tree.leaves(engine.carry.caches)))
  for key in ("retractions", "recomputed_tokens"):   # an engine with retraction
    if key in warm.stats:
      out[key] = warm.stats[key]
  if layout == "paged":
    out["table"] = table_replay(engine)
  del engine
  return out


def _f(value: Optional[float], scale: float = 1.0, spec: str = ".0f") -> str:
  return "-" if value is None or value != value else format(value * scale, spec)


def summary(case: Dict[str, Any]) -> str:
  """One line of progress for a case."""
  head = f"batch {case['batch']:4d} {case['layout']:10s} ps {case['page_size']}"
  if "error" in case:
    return f"{head}: refused: {case['error']}"
  share = case.get("table", {}).get("share")
  retract = (f", {case['retractions']} retractions" if "retractions" in case else "")
  return (f"{head}: decode {_f(case['decode_tokens_per_s'])} tok/s "
          f"({_f(case['decode_step_median_s'], 1e3, '.2f')} ms/step), prefill "
          f"{_f(case['prefill_tokens_per_s'])} tok/s, TTFT median "
          f"{_f(case['ttft_median_s'], 1e3)} ms"
          + (f", table share {_f(share, 100, '.1f')}%" if share is not None else "")
          + retract
          + f", late compiles {case['late_compiles_cold']}+{case['compiles_warm_run']}")


def run(cfg: loader.LlamaConfig, *, batches: Sequence[int], layouts: Sequence[str],
        dtype, prompt_len: int, new_tokens: int, decode_steps: int, page_size: int,
        prefill_rows: int, impl: str, layers: str, seed: int = 0,
        pool_fraction: float = 1.0, progress=print) -> Dict[str, Any]:
  params = loader.random_params(cfg, jax.random.PRNGKey(seed), dtype)
  cases: List[Dict[str, Any]] = []
  for batch in batches:
    for layout in layouts:
      t0 = time.perf_counter()
      case = run_case(cfg, params, batch=batch, layout=layout, prompt_len=prompt_len,
                      new_tokens=new_tokens, decode_steps=decode_steps, page_size=page_size,
                      prefill_rows=prefill_rows, impl=impl, layers=layers, seed=seed,
                      pool_fraction=pool_fraction)
      cases.append(case)
      progress(f"{summary(case)} ({time.perf_counter() - t0:.0f} s)")
  ratios = {}
  for batch in batches:
    by = {c["layout"]: c for c in cases if c["batch"] == batch
          and c.get("decode_tokens_per_s")}
    if {"paged", "contiguous"} <= set(by):
      ratios[str(batch)] = by["paged"]["decode_tokens_per_s"] / by["contiguous"]["decode_tokens_per_s"]
  return dict(model=cfg.name, config=dataclasses.asdict(cfg), dtype=str(jnp.dtype(dtype)),
              device=str(jax.devices()[0]), backend=jax.default_backend(), cases=cases,
              paged_over_contiguous_decode=ratios)


def table(doc: Dict[str, Any]) -> str:
  """The result's Markdown table: one line per (batch, layout)."""
  head = ("| running requests | KV | decode rows | decode tok/s | decode step | prefill tok/s | TTFT median "
          "(max) | table share | late compiles |\n|---|---|---|---|---|---|---|---|---|")
  rows = []
  for c in doc["cases"]:
    if "error" in c:
      rows.append(f"| {c['batch']} | {c['layout']} (page size {c['page_size']}) | refused: "
                  f"{c['error']} | | | | | | |")
      continue
    share = c.get("table", {}).get("share")
    rows.append(
        f"| {c['batch']} | {c['layout']} | {c.get('decode_rows', c['batch'])} | "
        f"{_f(c['decode_tokens_per_s'])} | "
        f"{_f(c['decode_step_median_s'], 1e3, '.2f')} ms | {_f(c['prefill_tokens_per_s'])} | "
        f"{_f(c['ttft_median_s'], 1e3)} ({_f(c['ttft_max_s'], 1e3)}) ms | "
        + (f"{_f(share, 100, '.1f')}%" if share is not None else "-")
        + f" | {c['late_compiles_cold'] + c['compiles_warm_run']} |")
  ratios = ", ".join(f"{b}: {r:.3f}" for b, r in doc["paged_over_contiguous_decode"].items())
  return (head + "\n" + "\n".join(rows) + f"\n\n{doc['model']}, {doc['dtype']}, on "
          f"{doc['device']}; paged / contiguous decode tokens/s by batch: {ratios or '-'}\n")


def _write(out_dir: str, doc: Dict[str, Any], command: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "serve.json"), "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
  from jax_kvalloc.tools import bench as harness  # pylint: disable=g-import-not-at-top
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(harness.manifest(out_dir, command), f, indent=1)
    f.write("\n")
  if os.environ.get("OUT"):
    name = os.path.basename(os.path.normpath(out_dir))
    with tarfile.open(os.path.join(os.environ["OUT"], name + ".tgz"), "w:gz") as tar:
      tar.add(out_dir, arcname=name)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_kvalloc.serve.bench",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  gpu = jax.default_backend() != "cpu"
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--out", help="the result folder to write (serve.json, manifest.json; "
                     "with $OUT set, also <folder>.tgz in $OUT)")
  where.add_argument("--json", help="write only this JSON file (for a harness that writes "
                     "the folder and its manifest itself, e.g. benchmarks/run_device.sh)")
  p.add_argument("--batches", default="64,256", help="running requests, comma-separated")
  p.add_argument("--layouts", default="paged,contiguous", help="paged and/or contiguous")
  p.add_argument("--prompt-len", type=int, default=512)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--decode-steps", type=int, default=16, help="device steps per round trip")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--prefill-rows", type=int, default=64,
                 help="rows of a prefill step")
  p.add_argument("--dtype", choices=("bfloat16", "float32"),
                 default="bfloat16" if gpu else "float32")
  p.add_argument("--attention", choices=("gather", "pallas"),
                 default="pallas" if gpu else "gather")
  p.add_argument("--layers", choices=("scan", "unroll"), default="unroll" if gpu else "scan")
  p.add_argument("--pool-fraction", type=float, default=1.0,
                 help="pool pages as a fraction of every request's worst case (at least "
                 "one request's): below 1, admission and retraction under a small pool")
  p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
  args = p.parse_args(argv)
  batches = [int(b) for b in args.batches.split(",") if b]
  layouts = [x for x in args.layouts.split(",") if x]
  bad = [x for x in layouts if x not in ("paged", "contiguous")]
  if not 0 < args.pool_fraction <= 1:
    p.error(f"--pool-fraction must be in (0, 1], got {args.pool_fraction}")
  if bad or not batches or min(batches) < 1:
    p.error(f"--batches must be positive integers and --layouts paged/contiguous, got "
            f"{args.batches!r}, {args.layouts!r}")
  t0 = time.perf_counter()
  doc = run(TINY if args.tiny else loader.SMOLLM2_135M, batches=batches, layouts=layouts,
            dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
            prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            decode_steps=args.decode_steps, page_size=args.page_size,
            prefill_rows=args.prefill_rows, impl=args.attention, layers=args.layers,
            pool_fraction=args.pool_fraction)
  doc["total_s"] = time.perf_counter() - t0
  command = "python -m jax_kvalloc.serve.bench " + " ".join(
      sys.argv[1:] if argv is None else argv)
  if args.out:
    _write(args.out, doc, command)
  else:
    with open(args.json, "w") as f:
      json.dump(doc, f, indent=1)
      f.write("\n")
  print(table(doc))
  for batch, ratio in doc["paged_over_contiguous_decode"].items():
    print(f"batch {batch}: paged decode = {ratio:.3f} x contiguous")
  print(f"wrote {args.out or args.json} ({doc['total_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
