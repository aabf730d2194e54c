"""`jax-kvalloc bench`: microbenchmarks (jax_kvalloc.tools.bench_micro) and the
serving-loop benchmark (jax_kvalloc.tools.bench_serving) on whatever device is present,
with tables, torch_ref and SGLang's released kernels (`--sglang-kernels PATH`) side by
side, the targets, JSON and an optional log-log plot. Only each kernel's own GPU time
(bare) is compared across sides, with report.verdict's rule (faster / slower only where
the interquartile ranges do not overlap); a linked figure carries its side's own link.

Every number in a measured column or a verdict comes from the run itself (or the JSON of
one); nothing is typed in. Columns degrade gracefully: "pallas" needs a GPU or TPU,
"torch" needs torch and torch_ref (on CPU it times torch_ref's eager calls), "SGLang"
needs CUDA and the kernels file.
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

PATHS = ("pallas", "jnp", "torch", "pallas-noguard", "jnp-noguard")
DEFAULT_PATHS = PATHS[:3]  # the "-noguard" twins (guard=False) only when asked for
OPS = ("decode", "extend", "free")

# Targets (issues 3, 5, 13): budgets and ratios, compared with same-run measurements.
SCAN_ALLOC_TARGET_US = 5.0
DECODE_BIG_SPEEDUP = 20.0
EXTRA_CONSUMER_TOLERANCE = 0.10


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
  sglang_kernels: Optional[str] = None
  extra_consumer: bool = False
  bare: bool = False


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
    help="columns (default: pallas on GPU/TPU, jnp, torch if torch_ref imports; "
    "pallas-noguard and jnp-noguard: the same with AllocatorConfig(guard=False), the "
    "ownership record's cost)")
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
  a("--sglang-kernels", metavar="PATH",
    help="SGLang's sglang/kernels/ops/memory/allocator.py (from the sglang wheel; it "
    "imports only torch and triton): its Triton kernels are timed in the same run "
    "(CUDA only)")
  a("--bare", action="store_true",
    help="also take the pallas kernel's own GPU time where the call compiles to one "
    "kernel launch, and SGLang's kernel's, both from CUPTI (torch.profiler; CUDA)")
  a("--extra-consumer", action="store_true",
    help="time every JAX figure a second time with one more consumer of the call's "
    "outputs and report the change (a figure that moves was not counting all its work)")
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
  paths = list(args.paths or [p for p in DEFAULT_PATHS if p != "pallas" or accel])
  for name in ("pallas", "pallas-noguard"):
    if name in paths and not accel:
      paths.remove(name)
      notes.append(f"{name} column skipped: no GPU/TPU (the Pallas kernels need one)")
  if "torch" in paths:
    why = bench_micro.torch_available()
    if why:
      paths.remove("torch")
      notes.append(f"torch column skipped: {why}")
  sglang_kernels = args.sglang_kernels
  if sglang_kernels:
    if not os.path.exists(sglang_kernels):
      raise SystemExit(f"--sglang-kernels {sglang_kernels!r}: no such file")
    try:
      import torch  # pylint: disable=g-import-not-at-top
      cuda = torch.cuda.is_available()
    except ImportError:
      cuda = False
    if not cuda:
      notes.append("SGLang column skipped: its Triton kernels need torch with CUDA")
      sglang_kernels = None
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
      serving=not args.no_serving, sglang_kernels=sglang_kernels,
      extra_consumer=args.extra_consumer, bare=args.bare)
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
  sglang = None
  if cfg.sglang_kernels:
    sglang = bench_micro.load_sglang_kernels(cfg.sglang_kernels)
    env["sglang_kernels"] = cfg.sglang_kernels
    version = os.path.join(os.path.dirname(cfg.sglang_kernels), "VERSION")
    if os.path.exists(version):
      with open(version) as f:
        env["sglang"] = f.read().strip()
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
    sizes = ([((bs,), cfg.extend_cases) for bs in cfg.batch_sizes] if op == "decode"
             else [(cfg.batch_sizes, (case,)) for case in cfg.extend_cases])
    for batch_sizes, extend_cases in sizes:  # one case at a time, saved after each
      result["micro"] += bench_micro.run(
          ops=(op,), paths=jax_paths, torch_on=torch_on, batch_sizes=batch_sizes,
          extend_cases=extend_cases, page_size=cfg.page_size, unroll=cfg.unroll,
          min_time=cfg.min_time, reps=cfg.reps, seed=cfg.seed, sglang=sglang,
          extra_consumer=cfg.extra_consumer, bare=cfg.bare, progress=tick)
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


def _consumer_change(cell: Dict[str, Any]) -> float:
  """The +1 consumer change the check reads: net of the consumer's own cost where the
  run measured it (bench_micro._net_changes), else the raw change."""
  return cell.get("extra_consumer_net_change", cell["extra_consumer_change"])


def _consumer_cell(cell: Dict[str, Any]) -> str:
  """'+raw% (net +n%)' for the +1 consumer column."""
  if "extra_consumer_change" not in cell:
    return "-"
  raw = f"{100 * cell['extra_consumer_change']:+.0f}%"
  if "extra_consumer_net_change" in cell:
    return f"{raw} ({100 * cell['extra_consumer_net_change']:+.0f}%)"
  return raw


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
  return num / den if num and den else None


def _main_path(result: Dict[str, Any]) -> str:
  return "pallas" if "pallas" in result["config"]["paths"] else "jnp"


def _bare_cells(r: Dict[str, Any]):
  """(pallas bare cell, SGLang cell) of a row, each possibly empty."""
  return (r["jax"].get("pallas") or {}), (r.get("sglang") or {})


def bare_verdict(r: Dict[str, Any]) -> Optional[str]:
  """The pallas kernel against SGLang's, both bare (report.verdict of their quartiles);
  None where either bare figure is missing."""
  from jax_kvalloc.tools.report import iqr, verdict  # pylint: disable=g-import-not-at-top
  pb, sg = _bare_cells(r)
  if pb.get("bare_us") is None or sg.get("bare_us") is None:
    return None
  return verdict(iqr(pb, "bare_"), iqr(sg, "bare_"))


LINKED_NOTE = ("linked figures include each side's own link (XLA fuses ours into 1-2 "
               "kernels, torch runs 4-5 eager ones), so no ratio is taken between them")


def micro_tables(result: Dict[str, Any]) -> str:
  from jax_kvalloc.tools.report import fmt_ratio, fmt_us, table  # pylint: disable=g-import-not-at-top
  cfg = result["config"]
  torch_on = "torch" in cfg["paths"]
  out = []
  for op in cfg["ops"]:
    rows = [r for r in result["micro"] if r["op"] == op]
    if not rows:
      continue
    paths = [p for p in cfg["paths"] if p != "torch" and (op != "free" or p.startswith(
        "jnp"))]
    sgl = any(r.get("sglang") for r in rows)
    extra = any("us_extra_consumer" in c for r in rows for c in r["jax"].values())
    per_path_floor = _per_path_floor(result)
    header = ["bs", "tokens"] + [f"{p} (us)" for p in paths]
    header += ([f"{p} floor (us)" for p in paths] if per_path_floor
               else ["harness floor (us)"])
    if op == "free":
      header += ["jnp eager host (us)"]
    if torch_on:
      header += ["torch_ref (us)"]
    bare = any("bare_us" in c for r in rows for c in r["jax"].values())
    if bare:
      header += ["pallas bare (us)"]
    if sgl:
      header += ["SGLang (us)", "SGLang bare (us)"]
    if torch_on and op == "free":
      header += ["torch_ref / jnp host"]
    if sgl and bare:
      header += ["SGLang bare / pallas bare", "pallas bare vs SGLang bare"]
    if extra:
      header += [f"{p} +1 consumer (net)" for p in paths]
    header += ["check"]
    body = []
    for r in rows:
      j = {p: _us(r["jax"].get(p)) for p in paths}
      cells = [r["bs"], r["tokens"]]
      cells += [fmt_us(j[p]) if j[p] is not None else "error" for p in paths]
      if per_path_floor:
        cells += [fmt_us((r["jax"].get(p) or {}).get("floor_us",
                                                     r.get("floor_us") if p == "jnp" else None))
                  for p in paths]
      else:
        cells.append(fmt_us(r.get("floor_us")))
      if op == "free":
        cells.append(fmt_us(_us(r.get("jax_host"))))
      t = _us(r.get("torch"))
      g = _us(r.get("sglang"))
      if torch_on:
        cells.append(fmt_us(t) if t is not None else "error")
      pb, sg = _bare_cells(r)
      if bare:
        cells.append(fmt_us(pb.get("bare_us")))
      if sgl:
        cells += [fmt_us(g) if g is not None else "error", fmt_us(sg.get("bare_us"))]
      if torch_on and op == "free":
        cells.append(fmt_ratio(_ratio(t, _us(r.get("jax_host")))))
      if sgl and bare:
        cells += [fmt_ratio(_ratio(sg.get("bare_us"), pb.get("bare_us"))),
                  bare_verdict(r) or "-"]
      if extra:
        cells += [_consumer_cell(r["jax"].get(p) or {}) for p in paths]
      cells.append(r["check"])
      body.append(cells)
    tmethod = next((r["torch"]["method"] for r in rows
                    if r.get("torch") and "method" in r["torch"]), None)
    note = ("; free: the XLA path (kernel='jnp'; the Pallas free kernel is timed by "
            "benchmarks/free_methods_gpu.py)" if op == "free" else "")
    out.append(f"{op} (page_size {rows[0]['page_size']}; us per call, median{note}"
               + (f"; torch_ref: {tmethod}" if tmethod else "")
               + ("; SGLang: its Triton kernel, CUDA graph replay, linked like ours "
                  "(bare: each kernel's own GPU time, median over 2048 launches, from "
                  "CUPTI; faster / slower only where the interquartile ranges do not "
                  "overlap, else tie)" if sgl else "")
               + (f"; {LINKED_NOTE}" if sgl or (torch_on and op != "free") else "")
               + ("; ratio > 1: jax_kvalloc faster)" if sgl or op == "free" else ")"))
    out.append(table(header, body))
    errors = [f"  {op} bs={r['bs']} {k}: {v['error']}" for r in rows
              for k, v in list(r["jax"].items()) + [("torch_ref", r.get("torch") or {}),
                                                     ("sglang", r.get("sglang") or {})]
              if v and "error" in v]
    out += errors
    out.append("")
  return "\n".join(out)


def breakdown(row: Dict[str, Any], part: str) -> Optional[float]:
  """us per step that alloc_decode ("alloc") or free ("free") costs inside the scan:
  one extra call per step (scan_extra_*) minus the plain step."""
  extra = row.get(f"scan_extra_{part}_us")
  return None if extra is None else extra - row["scan_us"]


def serving_table(result: Dict[str, Any]) -> str:
  from jax_kvalloc.tools.report import fmt_ratio, fmt_us, table  # pylint: disable=g-import-not-at-top
  rows = result["serving"]
  if not rows:
    return ""
  torch_on = any("torch_step_us" in r for r in rows)
  header = ["bs", "jit/step sync", "jit/step async", "jit/step, no allocator",
            "scan/step", "scan, no allocator", "allocator in scan",
            "alloc_decode in scan", "free in scan", "allocator in scan, page release",
            "allocator in scan, fused release+decode"]
  if torch_on:
    header += ["torch_ref sync/step", "torch_ref async/step", "sync: torch / jit",
               "async: torch / jit", "parity"]
  body = []
  for r in rows:
    cells = [r["bs"], fmt_us(r.get("jit_step_sync_us")), fmt_us(r["jit_step_us"]),
             fmt_us(r.get("jit_step_baseline_us")), fmt_us(r["scan_us"]),
             fmt_us(r["scan_baseline_us"]), fmt_us(r["scan_alloc_us"]),
             fmt_us(breakdown(r, "alloc")), fmt_us(breakdown(r, "free")),
             fmt_us(r.get("scan_alloc_pages_us")), fmt_us(r.get("scan_alloc_fused_us"))]
    if torch_on:
      t, ts = r.get("torch_step_us"), r.get("torch_step_sync_us")
      cells += [fmt_us(ts) if ts else r.get("torch_error", "-")[:40], fmt_us(t),
                fmt_ratio(_ratio(ts, r.get("jit_step_sync_us"))),
                fmt_ratio(_ratio(t, r["jit_step_us"])), r.get("parity", "-")]
    body.append(cells)
  r0 = rows[0]
  return (f"serving loop (page_size {r0['page_size']}, {r0['steps']} decode steps; us per "
          f"step, median of 3 runs for jit and torch alike; sync = the host reads each "
          f"step's ok (JAX) / synchronizes (torch) once per step, async = once at the end; "
          f"each step: free group of the rows that finished, alloc_decode for every row, "
          f"last_loc gather and token-table write; 'no allocator' = the same step with "
          f"free and alloc_decode replaced by stand-ins; the alloc_decode / free columns "
          f"are what one more call of each adds per step; 'page release' frees the finished "
          f"requests' pages with free_page_ids, in request order, no sort; 'fused "
          f"release+decode' frees the same pages and allocates in one "
          f"release_and_alloc_decode call, one kernel launch on GPU)\n"
          + table(header, body) + "\n")


def targets(result: Dict[str, Any]) -> List[Tuple[str, str, str]]:
  """(target, measured, verdict) rows, every measured figure from this run."""
  from jax_kvalloc.tools.report import NO_SPREAD, iqr  # pylint: disable=g-import-not-at-top
  out = []
  micro = result["micro"]
  main = _main_path(result)
  t = lambda r: _us(r["jax"].get(main))
  for op in ("decode", "extend"):
    rows = [r for r in micro if r["op"] == op and t(r) is not None]
    cmp = [r for r in rows if bare_verdict(r)]
    if cmp:
      words = {r["bs"]: bare_verdict(r) for r in cmp}
      slower = [bs for bs, w in words.items() if w == "slower"]
      ties = [bs for bs, w in words.items() if w == "tie"]
      unknown = [bs for bs, w in words.items() if w == NO_SPREAD]
      gb = lambda r: r["sglang"]["bare_us"]
      tb = lambda r: r["jax"]["pallas"]["bare_us"]
      worst = min(cmp, key=lambda r: gb(r) / tb(r))
      measured = f"worst bs={worst['bs']}: {gb(worst) / tb(worst):.2f}x"
      measured += "".join(f"; {w} at bs {', '.join(map(str, b))}" for w, b in
                          (("slower", slower), ("tie", ties)) if b)
      verdict = (f"MISSED at {len(slower)}/{len(cmp)}" if slower else
                 NO_SPREAD if unknown else "met")
      out.append((f"{op}: pallas kernel at least as fast as SGLang's kernel, both bare "
                  f"(same run) at every size", measured, verdict))
    big = sorted((r for r in rows if r["bs"] >= 1024), key=lambda r: r["bs"])
    if len(big) >= 2:
      exps = [(math.log(t(b) / t(a)) / math.log(b["bs"] / a["bs"]), b["bs"])
              for a, b in zip(big, big[1:])]
      worst_e, at = max(exps)
      out.append((f"{op}: linear growth in bs (largest log-log slope between "
                  f"consecutive sizes from bs 1024)", f"{worst_e:.2f} (up to bs {at})",
                  "met" if worst_e <= 1.25 else "MISSED"))
  for r in micro:
    if r["op"] != "decode" or r["bs"] != 16384 or not bare_verdict(r):
      continue
    pb, sg = _bare_cells(r)
    sp = sg["bare_us"] / pb["bare_us"]
    q_ours, q_theirs = iqr(pb, "bare_"), iqr(sg, "bare_")
    if q_ours and q_theirs:   # the whole interquartile ranges DECODE_BIG_SPEEDUP apart
      ok = q_theirs[0] >= DECODE_BIG_SPEEDUP * q_ours[1]
      word = "met" if ok else "MISSED"
    else:
      word = NO_SPREAD
    out.append((f"decode bs 16384: pallas kernel >= {DECODE_BIG_SPEEDUP:.0f}x faster than "
                f"SGLang's, both bare (same run)", f"{sp:.0f}x", word))
  changes = [(abs(_consumer_change(c)), r, p) for r in micro
             for p, c in r["jax"].items() if "extra_consumer_change" in c]
  if changes:
    worst, r, p = max(changes, key=lambda x: x[0])
    out.append((f"every JAX figure moves < {100 * EXTRA_CONSUMER_TOLERANCE:.0f}% with one "
                f"more consumer of its outputs (net of that consumer's own cost on the "
                f"stand-in)", f"worst {100 * worst:.1f}% ({r['op']} bs={r['bs']} {p})",
                "met" if worst < EXTRA_CONSUMER_TOLERANCE else "MISSED"))
  for r in result["serving"]:
    if r.get("torch_step_sync_us") and r.get("jit_step_sync_us"):
      ok = r["jit_step_sync_us"] <= 0.5 * r["torch_step_sync_us"]
      out.append((f"serving bs={r['bs']}: jit/step <= half of torch_ref eager/step "
                  f"(both syncing once per step)",
                  f"{r['jit_step_sync_us']:.1f} vs {r['torch_step_sync_us']:.1f} us",
                  "met" if ok else "MISSED"))
    out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us "
                f"per step in a scan (free of slots, sorted unique)",
                f"{r['scan_alloc_us']:.2f} us",
                "met" if r["scan_alloc_us"] <= SCAN_ALLOC_TARGET_US else "MISSED"))
    if r.get("scan_alloc_pages_us") is not None:
      out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us "
                  f"per step in a scan (request-level page release)",
                  f"{r['scan_alloc_pages_us']:.2f} us",
                  "met" if r["scan_alloc_pages_us"] <= SCAN_ALLOC_TARGET_US else "MISSED"))
    if r.get("scan_alloc_fused_us") is not None:
      out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us "
                  f"per step in a scan (page release and alloc_decode in one call)",
                  f"{r['scan_alloc_fused_us']:.2f} us",
                  "met" if r["scan_alloc_fused_us"] <= SCAN_ALLOC_TARGET_US else "MISSED"))
  return out


def _per_path_floor(result: Dict[str, Any]) -> bool:
  return any("floor_us" in c for r in result["micro"] for c in r["jax"].values())


def render(result: Dict[str, Any], notes: Sequence[str] = ()) -> str:
  from jax_kvalloc.tools.report import table  # pylint: disable=g-import-not-at-top
  e = result["env"]
  lines = [f"jax-kvalloc bench on {e['platform']}:{e['device']} ({e['date']}; python "
           f"{e['python']}, jax {e['jax']}, torch {e.get('torch')}, triton "
           f"{e.get('triton', '-')}" + (f", SGLang kernels: {e['sglang']}"
                                         if e.get("sglang") else "") + ")",
           f"harness floor: {result['loop_overhead_us']:.3f} us per call for a scalar "
           f"call (unroll {result['config']['unroll']}; " + (
               "each path's floor column is the same harness around a stand-in that only "
               "writes the case's outputs the way the path does: one XLA fusion for jnp, "
               "one Pallas launch for pallas)" if _per_path_floor(result) else
               "the per-case floor column is the same harness around an XLA stand-in that "
               "only writes outputs of the case's shapes, for every path: where it exceeds "
               "a Pallas figure, that stand-in's fusions cost more than the one Pallas "
               "launch; runs since issue 26 take a Pallas stand-in for the Pallas path)")]
  lines += [f"note: {n}" for n in notes]
  lines.append("")
  if result["micro"]:
    lines.append(micro_tables(result))
  if result["serving"]:
    lines.append(serving_table(result))
  rows = targets(result)
  if rows:
    lines.append("targets (each measured figure from this run)")
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
      for key, label in (("jit_step_sync_us", "jit/step (sync)"), ("scan_us", "scan/step"),
                         ("torch_step_sync_us", "torch_ref eager (sync)")):
        ys = [r.get(key) for r in rs]
        if all(y for y in ys):
          ax.plot(bs, ys, "o-", ms=3, label=label)
    else:
      rs = [r for r in result["micro"] if r["op"] == op]
      bs = np.array([r["bs"] for r in rs], float)
      paths = [p for p in result["config"]["paths"] if p != "torch"]
      if op == "free":  # the XLA path (and its unguarded twin)
        paths = [p for p in paths if p.startswith("jnp")]
      top = []
      for p in paths + ["torch"]:
        ys = [(_us(r["torch"]) if p == "torch" else _us(r["jax"].get(p))) for r in rs]
        if all(y for y in ys) and ys:
          label = "torch_ref" if p == "torch" else ("jax (XLA)" if op == "free" else p)
          ax.plot(bs, ys, "o-", ms=3, label=label)
          top.append(ys[-1])
      figs = [(r["bs"], _us(r.get("sglang"))) for r in rs if _us(r.get("sglang"))]
      if figs:
        ax.plot(*zip(*figs), "k+-", ms=7, lw=0.8, label="SGLang kernel (same run)")
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
