"""`jax-kvalloc bench`: microbenchmarks (jax_kvalloc.bench_micro) and the serving-loop
benchmark (jax_kvalloc.bench_serving) on whatever device is present, with tables, ratios
against torch_ref, the H200 targets, JSON and an optional log-log plot.

Columns degrade gracefully: "pallas" needs a GPU or TPU, "torch" needs torch and
torch_ref (on CPU it times torch_ref's eager calls).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

PATHS = ("pallas", "jnp", "torch")
OPS = ("decode", "extend", "free")

# Targets on the H200 (issues 3 and 5).
SGLANG_EAGER_US = {"alloc_decode": (65.0, 100.0), "free": (75.0, 180.0)}
SCAN_ALLOC_TARGET_US = 5.0
DECODE_BIG_SPEEDUP = 20.0


def _pairs(text: str) -> List[Tuple[int, int]]:
  out = []
  for item in str(text).replace(" ", "").split(","):
    if not item:
      continue
    try:
      bs, tokens = (int(v) for v in item.lower().split("x"))
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected BSxTOKENS,... (e.g. 16x8192), got {text!r}")
    if bs < 1 or tokens < 1:
      raise argparse.ArgumentTypeError(f"sizes must be positive, got {item!r}")
    out.append((bs, tokens))
  if not out:
    raise argparse.ArgumentTypeError("no cases given")
  return out


@dataclasses.dataclass
class BenchConfig:
  ops: Tuple[str, ...]
  paths: Tuple[str, ...]
  batch_sizes: Tuple[int, ...]
  extend_cases: Tuple[Tuple[int, int], ...]
  page_size: int
  unroll: int
  min_time: float
  reps: int
  serving_bs: Tuple[int, ...]
  serving_steps: int
  serving_warmup: int
  seed: int
  micro: bool = True
  serving: bool = True


def add_parser(sub) -> argparse.ArgumentParser:
  from jax_kvalloc.tools.cli import int_list, name_list  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools.bench_micro import DECODE_BS, EXTEND_CASES  # pylint: disable=g-import-not-at-top
  p = sub.add_parser(
      "bench", help="microbenchmarks and the serving-loop benchmark",
      description="Times alloc_decode, alloc_extend and free (the whole jitted call, as "
      "many dependent calls inside one jit) for the Pallas and jnp paths and torch_ref "
      "(CUDA-graph replay of its Triton kernel on GPU), then a serving loop of decode "
      "steps three ways (one jitted call per step, all steps in one scan, torch_ref "
      "eager). Prints tables with ratios against torch_ref and the H200 targets.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--ops", type=name_list(OPS), default=list(OPS), help="microbenchmarked operations")
  a("--paths", type=name_list(PATHS), default=None,
    help="columns (default: pallas on GPU/TPU, jnp, torch if torch_ref imports)")
  a("--batch-sizes", type=int_list, default=None,
    help=f"decode batch sizes (default {','.join(map(str, DECODE_BS))})")
  a("--extend-cases", type=_pairs, default=None, metavar="BSxTOKENS,...",
    help="extend/free cases (default "
    + ",".join(f"{b}x{t}" for b, t in EXTEND_CASES) + ")")
  a("--page-size", type=int, default=64)
  a("--unroll", type=int, default=None,
    help="dependent calls per loop iteration (default 32 on GPU/TPU, 8 on CPU)")
  a("--min-time", type=float, default=None,
    help="seconds per measurement (default 0.05 on GPU/TPU, 0.02 on CPU)")
  a("--reps", type=int, default=None, help="measurements per number (default 5)")
  a("--serving-bs", type=int_list, default=None,
    help="serving-loop batch sizes (default 64,256,1024)")
  a("--serving-steps", type=int, default=None,
    help="timed decode steps per way (default 1000)")
  a("--no-micro", action="store_true", help="skip the microbenchmarks")
  a("--no-serving", action="store_true", help="skip the serving loop")
  a("--quick", action="store_true",
    help="a tiny, noisy smoke run (decode bs 1,64; extend 4x512; serving bs 16, 50 "
    "steps); explicit options still win")
  a("--seed", type=int, default=0)
  a("--json", metavar="FILE", help="write all numbers as JSON")
  a("--plot", metavar="FILE.png", help="time against batch size, log-log (matplotlib)")
  a("--no-progress", action="store_true")
  a("--from-json", metavar="FILE", nargs="+",
    help="measure nothing: print the tables (and --plot) of JSON files earlier runs "
    "wrote; a later file's microbenchmarks or serving rows replace an earlier file's; "
    "--no-micro / --no-serving leave those out")
  return p


def environment(torch_note: Optional[str]) -> Dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import __version__  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  env = {"date": datetime.date.today().isoformat(), "platform": d.platform,
         "device": str(getattr(d, "device_kind", d)), "python": platform.python_version(),
         "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
         "jax_kvalloc": __version__, "machine": platform.machine(),
         "cpus": os.cpu_count(), "command": "jax-kvalloc " + " ".join(sys.argv[1:])}
  if torch_note is None:
    import torch  # pylint: disable=g-import-not-at-top
    env["torch"] = torch.__version__
    env["torch_device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                           else "cpu")
    try:
      import triton  # pylint: disable=g-import-not-at-top
      env["triton"] = triton.__version__
    except ImportError:
      env["triton"] = None
  else:
    env["torch"] = torch_note
  return env


def resolve(args) -> Tuple[BenchConfig, List[str]]:
  """The run's configuration and notes on dropped columns."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench_micro  # pylint: disable=g-import-not-at-top
  accel = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
  notes = []
  paths = list(args.paths or [p for p in PATHS if p != "pallas" or accel])
  if "pallas" in paths and not accel:
    paths.remove("pallas")
    notes.append("pallas column skipped: no GPU/TPU (the Pallas kernels need one)")
  if "torch" in paths:
    why = bench_micro.torch_available()
    if why:
      paths.remove("torch")
      notes.append(f"torch column skipped: {why}")
  q = args.quick
  pick = lambda given, quick, full: tuple(given) if given else (quick if q else full)
  cfg = BenchConfig(
      ops=tuple(args.ops), paths=tuple(paths),
      batch_sizes=pick(args.batch_sizes, (1, 64), bench_micro.DECODE_BS),
      extend_cases=pick(args.extend_cases, ((4, 512),), bench_micro.EXTEND_CASES),
      page_size=args.page_size,
      unroll=args.unroll or (4 if q else 32 if accel else 8),
      min_time=args.min_time or (0.005 if q else 0.05 if accel else 0.02),
      reps=args.reps or (3 if q else 5),
      serving_bs=pick(args.serving_bs, (16,), (64, 256, 1024)),
      serving_steps=args.serving_steps or (50 if q else 1000),
      serving_warmup=5 if q else 20, seed=args.seed, micro=not args.no_micro,
      serving=not args.no_serving)
  return cfg, notes


def run(cfg: BenchConfig, *, progress: bool = True,
        checkpoint: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
  """Runs everything; returns {"env", "config", "loop_overhead_us", "micro", "serving"}.

  `checkpoint(partial_result)`, if given, runs after each operation's microbenchmarks
  and each serving batch size (so a run cut short still leaves its numbers).
  """
  import tqdm  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench_micro  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench_serving  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import timing  # pylint: disable=g-import-not-at-top
  torch_on = "torch" in cfg.paths
  jax_paths = [p for p in cfg.paths if p != "torch"]
  env = environment(None if torch_on else "not used")
  n_micro = len(bench_micro.cases(cfg.ops, cfg.batch_sizes, cfg.extend_cases)) * (
      len(cfg.paths)) if cfg.micro else 0
  n_serv = len(cfg.serving_bs) * (1 + torch_on) if cfg.serving else 0
  bar = tqdm.tqdm(total=n_micro + n_serv + 1, disable=not progress, unit="run",
                  file=sys.stderr, dynamic_ncols=True, leave=False)

  def tick(desc):
    bar.set_description(desc[:60])
    bar.update(1)

  tick("loop overhead")
  overhead = timing.loop_overhead(unroll=cfg.unroll, min_time=cfg.min_time,
                                        reps=cfg.reps)
  result = {"env": env, "config": dataclasses.asdict(cfg),
            "loop_overhead_us": overhead * 1e6, "micro": [], "serving": []}
  save = checkpoint or (lambda r: None)

  def micro(op):
    result["micro"] += bench_micro.run(
        ops=(op,), paths=jax_paths, torch_on=torch_on, batch_sizes=cfg.batch_sizes,
        extend_cases=cfg.extend_cases, page_size=cfg.page_size, unroll=cfg.unroll,
        min_time=cfg.min_time, reps=cfg.reps, seed=cfg.seed, progress=tick)
    save(result)

  ops = list(cfg.ops if cfg.micro else ())
  for op in ops:
    if op != "free":
      micro(op)
  for bs in (cfg.serving_bs if cfg.serving else ()):
    # A serving step is tens of kernels: 8 steps per loop iteration amortize the loop.
    result["serving"] += bench_serving.run(
        batch_sizes=(bs,), page_size=cfg.page_size, steps=cfg.serving_steps,
        warmup=cfg.serving_warmup, unroll=min(cfg.unroll, 8), min_time=cfg.min_time,
        reps=cfg.reps, seed=cfg.seed, torch_on=torch_on, progress=tick)
    save(result)
  if "free" in ops:  # last: the least telling of the three (a run cut short loses it)
    micro("free")
  bar.close()
  return result


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------

def _us(cell: Optional[Dict[str, Any]]) -> Optional[float]:
  return None if not cell or "us" not in cell else cell["us"]


def micro_tables(result: Dict[str, Any]) -> str:
  from jax_kvalloc.tools.report import fmt_ratio, fmt_us, table  # pylint: disable=g-import-not-at-top
  cfg = result["config"]
  paths = [p for p in cfg["paths"] if p != "torch"]
  torch_on = "torch" in cfg["paths"]
  out = []
  for op in cfg["ops"]:
    rows = [r for r in result["micro"] if r["op"] == op]
    if not rows:
      continue
    header = ["bs", "tokens"] + [f"{p} (us)" for p in paths]
    if torch_on:
      header += ["torch_ref (us)"] + [f"{p} speedup" for p in paths]
    gpu = result["env"]["platform"] in ("gpu", "cuda")
    header += (["SGLang H200 (us)"] if gpu else []) + ["check"]
    body = []
    for r in rows:
      cells = [r["bs"], r["tokens"]]
      cells += [fmt_us(_us(r["jax"].get(p))) if _us(r["jax"].get(p)) is not None
                else "error" for p in paths]
      if torch_on:
        t = _us(r["torch"])
        cells.append(fmt_us(t) if t is not None else "error")
        cells += [fmt_ratio(t / _us(r["jax"].get(p)))
                  if t and _us(r["jax"].get(p)) else "-" for p in paths]
      fig = r.get("sglang_us")
      if gpu:
        cells.append("-" if not fig else (fmt_us(fig[0]) if fig[0] == fig[1]
                                          else f"{fmt_us(fig[0])}-{fmt_us(fig[1])}"))
      cells.append(r["check"])
      body.append(cells)
    note = ""
    if op == "free":
      note = " (free has no Pallas kernel: one XLA path)"
    tmethod = next((r["torch"]["method"] for r in rows
                    if r.get("torch") and "method" in r["torch"]), None)
    out.append(f"{op} (page_size {rows[0]['page_size']}; us per call{note}"
               + (f"; torch_ref: {tmethod}" if tmethod else "") + ")")
    out.append(table(header, body))
    errors = [f"  {op} bs={r['bs']} {k}: {v['error']}" for r in rows
              for k, v in list(r["jax"].items()) + [("torch_ref", r.get("torch") or {})]
              if v and "error" in v]
    out += errors
    out.append("")
  return "\n".join(out)


def breakdown(row: Dict[str, Any], part: str) -> Optional[float]:
  """us per step that alloc_decode ("alloc") or free ("free") costs inside the scan.

  Measured as one extra call per step (scan_extra_*); runs before that method measured it
  with the other call stubbed out (scan_decode_only / scan_free_only minus the baseline).
  """
  extra = row.get(f"scan_extra_{part}_us")
  if extra is not None:
    return extra - row["scan_us"]
  old = row.get("scan_decode_only_us" if part == "alloc" else "scan_free_only_us")
  return None if old is None else old - row["scan_baseline_us"]


def serving_table(result: Dict[str, Any]) -> str:
  from jax_kvalloc.tools.report import fmt_ratio, fmt_us, table  # pylint: disable=g-import-not-at-top
  rows = result["serving"]
  if not rows:
    return ""
  torch_on = any("torch_step_us" in r for r in rows)
  header = ["bs", "jit/step", "jit/step, no allocator", "jit/step blocking", "scan/step",
            "scan, no allocator", "allocator in scan", "alloc_decode in scan",
            "free in scan"]
  if torch_on:
    header += ["torch_ref eager/step", "jit vs torch", "parity"]
  body = []
  for r in rows:
    base = r["scan_baseline_us"]
    cells = [r["bs"], fmt_us(r["jit_step_us"]), fmt_us(r.get("jit_step_baseline_us")),
             fmt_us(r["jit_step_blocking_us"]), fmt_us(r["scan_us"]), fmt_us(base),
             fmt_us(r["scan_alloc_us"]), fmt_us(breakdown(r, "alloc")),
             fmt_us(breakdown(r, "free"))]
    if torch_on:
      t = r.get("torch_step_us")
      cells += [fmt_us(t) if t else r.get("torch_error", "-")[:40],
                fmt_ratio(t / r["jit_step_us"]) if t else "-", r.get("parity", "-")]
    body.append(cells)
  r0 = rows[0]
  return (f"serving loop (page_size {r0['page_size']}, {r0['steps']} decode steps; us per "
          f"step; each step: free group of the rows that finished, alloc_decode for every "
          f"row, last_loc gather and token-table write; 'no allocator' = the same step with "
          f"free and alloc_decode replaced by stand-ins; the alloc_decode / free columns "
          f"are what one more call of each adds per step"
          + ("" if all("scan_extra_free_us" in r for r in rows) else
             " (older runs: the step with the other call stubbed, minus 'no allocator')")
          + ")\n" + table(header, body) + "\n")


def targets(result: Dict[str, Any]) -> List[Tuple[str, str, str]]:
  """(target, measured, verdict) rows; the H200 targets only make sense on a GPU.

  Times are judged as measured; "net" numbers subtract the in-jit loop's own cost per
  call (a property of the measuring loop, not of the allocator) and are shown beside.
  """
  out = []
  micro = result["micro"]
  loop = result.get("loop_overhead_us", 0.0)
  main = "pallas" if "pallas" in result["config"]["paths"] else "jnp"
  t = lambda r: _us(r["jax"].get(main))
  for op in ("decode", "extend"):
    rows = [r for r in micro if r["op"] == op and t(r) is not None]
    with_fig = [r for r in rows if r.get("sglang_us")]
    if with_fig:
      slower = [r for r in with_fig if t(r) > r["sglang_us"][1]]
      slower_net = [r for r in with_fig if t(r) - loop > r["sglang_us"][1]]
      worst = max(with_fig, key=lambda r: t(r) / r["sglang_us"][1])
      verdict = "met" if not slower else (
          f"MISSED at {len(slower)}/{len(with_fig)} sizes" +
          (f" ({len(slower_net)} net)" if len(slower_net) != len(slower) else ""))
      out.append((f"{op}: {main} no slower than SGLang's Triton figure at any size",
                  f"worst bs={worst['bs']}: {t(worst):.2f} us ({t(worst) - loop:.2f} net) "
                  f"vs {worst['sglang_us'][1]} us", verdict))
    with_torch = [r for r in rows if _us(r.get("torch"))]
    if with_torch:
      slower = [r for r in with_torch if t(r) > _us(r["torch"])]
      slower_net = [r for r in with_torch if t(r) - loop > _us(r["torch"])]
      out.append((f"{op}: {main} no slower than torch_ref (same run) at any size",
                  f"slower at bs {', '.join(str(r['bs']) for r in slower) or '-'}"
                  f" (net: {', '.join(str(r['bs']) for r in slower_net) or '-'})",
                  "met" if not slower else f"MISSED at {len(slower)}/{len(with_torch)}"))
    big = sorted((r for r in rows if r["bs"] >= 1024), key=lambda r: r["bs"])
    if len(big) >= 2:
      exps = [(math.log(t(b) / t(a)) / math.log(b["bs"] / a["bs"]), b["bs"])
              for a, b in zip(big, big[1:])]
      worst_e, at = max(exps)
      out.append((f"{op}: linear growth in bs (largest log-log slope between "
                  f"consecutive sizes from bs 1024)", f"{worst_e:.2f} (up to bs {at})",
                  "met" if worst_e <= 1.25 else "MISSED"))
  d16 = [r for r in micro if r["op"] == "decode" and r["bs"] == 16384 and t(r) is not None]
  if d16:
    r = d16[0]
    sp = 292.0 / t(r)
    out.append(("decode bs 16384: >= 20x faster than SGLang's 292 us",
                f"{t(r):.2f} us = {sp:.0f}x",
                "met" if sp >= DECODE_BIG_SPEEDUP else "MISSED"))
    if _us(r.get("torch")):
      sp = _us(r["torch"]) / t(r)
      out.append(("decode bs 16384: >= 20x faster than torch_ref (same run)",
                  f"{sp:.0f}x", "met" if sp >= DECODE_BIG_SPEEDUP else "MISSED"))
  half_sglang = 0.5 * (SGLANG_EAGER_US["alloc_decode"][0] + SGLANG_EAGER_US["free"][0])
  for r in result["serving"]:
    if r.get("torch_step_us"):
      ok = r["jit_step_us"] <= 0.5 * r["torch_step_us"]
      out.append((f"serving bs={r['bs']}: jit/step <= half of torch_ref eager/step",
                  f"{r['jit_step_us']:.1f} vs {r['torch_step_us']:.1f} us",
                  "met" if ok else "MISSED"))
    out.append((f"serving bs={r['bs']}: jit/step <= {half_sglang:.0f} us (half of SGLang's "
                f"65 + 75 us)", f"{r['jit_step_us']:.1f} us",
                "met" if r["jit_step_us"] <= half_sglang else "MISSED"))
    out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us "
                f"per step in a scan", f"{r['scan_alloc_us']:.2f} us",
                "met" if r["scan_alloc_us"] <= SCAN_ALLOC_TARGET_US else "MISSED"))
  return out


def render(result: Dict[str, Any], notes: Sequence[str] = ()) -> str:
  from jax_kvalloc.tools.report import table  # pylint: disable=g-import-not-at-top
  e = result["env"]
  lines = [f"jax-kvalloc bench on {e['platform']}:{e['device']} ({e['date']}; python "
           f"{e['python']}, jax {e['jax']}, torch {e.get('torch')}, triton "
           f"{e.get('triton', '-')})",
           f"in-jit loop overhead: {result['loop_overhead_us']:.3f} us per call "
           f"(unroll {result['config']['unroll']}; included in every jax number)"]
  lines += [f"note: {n}" for n in notes]
  lines.append("")
  if result["micro"]:
    lines.append(micro_tables(result))
  if result["serving"]:
    lines.append(serving_table(result))
  rows = targets(result)
  if rows:
    gpu = e["platform"] in ("gpu", "cuda")
    lines.append("targets (set for the H200" + ("" if gpu else "; this is not one, so "
                 "read them as context only") + ")")
    lines.append(table(["target", "measured", "verdict"], rows, align="llr"))
  mism = [r for r in result["micro"] if r["check"] != "ok"] + [
      r for r in result["serving"] if r.get("parity") == "MISMATCH" or not r.get("ok", 1)]
  if mism:
    lines.append(f"\nCHECK FAILED in {len(mism)} case(s): outputs disagree (see 'check').")
  return "\n".join(lines)


def plot(result: Dict[str, Any], path: str) -> None:
  """Time against batch size on log-log axes, one panel per op, one line per path."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools.report import pyplot  # pylint: disable=g-import-not-at-top
  plt = pyplot()
  ops = [op for op in result["config"]["ops"] if any(r["op"] == op for r in result["micro"])]
  panels = ops + (["serving"] if result["serving"] else [])
  fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(3.6 * max(len(panels), 1), 3.4),
                           dpi=80, squeeze=False)
  for ax, op in zip(axes[0], panels):
    if op == "serving":
      rs = result["serving"]
      bs = [r["bs"] for r in rs]
      for key, label in (("jit_step_us", "jit/step"), ("scan_us", "scan/step"),
                         ("torch_step_us", "torch_ref eager")):
        ys = [r.get(key) for r in rs]
        if all(y for y in ys):
          ax.plot(bs, ys, "o-", ms=3, label=label)
    else:
      rs = [r for r in result["micro"] if r["op"] == op]
      bs = np.array([r["bs"] for r in rs], float)
      paths = [p for p in result["config"]["paths"] if p != "torch"]
      if op == "free":  # one XLA path: the columns are the same numbers
        paths = paths[-1:]
      top = []
      for p in paths + ["torch"]:
        ys = [(_us(r["torch"]) if p == "torch" else _us(r["jax"].get(p))) for r in rs]
        if all(y for y in ys) and ys:
          label = "torch_ref" if p == "torch" else ("jax (XLA)" if op == "free" else p)
          ax.plot(bs, ys, "o-", ms=3, label=label)
          top.append(ys[-1])
      figs = [(r["bs"], r["sglang_us"][1]) for r in rs if r.get("sglang_us")]
      if figs and result["env"]["platform"] in ("gpu", "cuda"):
        ax.plot(*zip(*figs), "k+", ms=7, label="SGLang H200")
      if bs.size > 1 and top:
        x = np.array([bs[-1] / 64, bs[-1]])  # a slope-1 guide over the top 64x of bs
        ax.plot(x, min(top) * x / bs[-1], ":", color="gray", lw=1, label="slope 1")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="us per call",
           title=op if op != "serving" else "serving loop (per step)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  e = result["env"]
  fig.suptitle(f"jax-kvalloc bench, {e['platform']}:{e['device']} ({e['date']})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def load_json(paths: Sequence[str], *, micro: bool = True,
              serving: bool = True) -> Dict[str, Any]:
  """Results of earlier runs, merged: the first file's environment and settings; each
  section (micro, serving) from the last file that has it."""
  import json  # pylint: disable=g-import-not-at-top
  result: Dict[str, Any] = {}
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    if not result:
      result = data
      continue
    for key in ("micro", "serving"):
      if data.get(key):
        result[key] = data[key]
        if key == "micro":
          result["loop_overhead_us"] = data["loop_overhead_us"]
  if not micro:
    result["micro"] = []
  if not serving:
    result["serving"] = []
  return result


def run_cli(args) -> int:
  # JAX must not take most of the GPU before torch_ref gets any.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  if args.from_json:
    result = load_json(args.from_json, micro=not args.no_micro,
                       serving=not args.no_serving)
    text = render(result, result.get("notes", ()))
    print(text)
    if args.plot:
      plot(result, args.plot)
      print(f"wrote {args.plot}")
    return 1 if "CHECK FAILED" in text else 0
  cfg, notes = resolve(args)
  if args.plot:
    report.pyplot()
  save = None
  if args.json:
    save = lambda partial: report.write_json(args.json, dict(partial, notes=notes,
                                                              partial=True))
  result = run(cfg, progress=not args.no_progress, checkpoint=save)
  result["notes"] = list(notes)
  text = render(result, notes)
  print(text)
  if args.json:
    report.write_json(args.json, result)
    print(f"wrote {args.json}")
  if args.plot:
    plot(result, args.plot)
    print(f"wrote {args.plot}")
  return 1 if "CHECK FAILED" in text else 0
