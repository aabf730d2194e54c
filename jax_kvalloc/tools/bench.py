"""`jax-kvalloc bench SUITE`: one harness, one parser, every benchmark a suite of cases.

    jax-kvalloc bench kernels --ops decode --impls pallas,jnp,sglang --json decode.json
    jax-kvalloc report decode.json        # its tables again, from the file

A suite (`Suite`, one line in SUITES) is data: its columns (`impls`), its options (`dims`,
each a `Dim("--name", default, "help")`, `opts.name` in `cases`) and `cases(opts) ->
[Case]`. A `Case` is one cell of the suite's table:

    Case(row={"op": "decode", "bs": 64}, impl="sglang", setup=lambda: graph(fn))

`setup()` runs when the case does (imports, allocations, the first call) and returns a
`Timed`: the timed work, every output consumed, and optionally `output()`, what the call
produced. Every output of a row must equal the first column's (put the plain jnp path or
the model first), else the cell reads "MISMATCH". What a case is compared against is
another column of the same row (SGLang's released kernels and classes, sglang-jax's
allocator loaded by path, torch_ref, the jnp path). Ready-made Timed: `chained`, `host`,
`per_call`, `graph`; else `Timed(measure)`, measure(opts) -> the cell's dict. `setup`
raises Skip("why") where an implementation cannot run (no GPU, no SGLang): the record
keeps the reason.

A column may carry arguments, `jnp[guard=False]` (`parse_impl`). A suite naming its
`guarded` columns gets `--guard on,off`: each such column X runs as X and X[guard=False]
side by side (`guard_impls`), and the table of the ownership record's cost (SPEC 14,
`guard_cost`) is checked against the suite's `guard_target`.

Every run writes, after each case, a record (`--json`): {"suite", "env", "settings",
"rows": [{row fields..., "cells": {impl: cell}}], "skipped": {impl: why}}; a cell holds
us figures ("us" the median, "q1_us"/"q3_us" the quartiles, "min_us", "spread") or
"error". `Suite.compare` pairs (ours, theirs) columns whose verdict the table shows:
faster or slower only where the quartile ranges do not overlap (report.verdict).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import importlib
import importlib.util
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from jax_kvalloc.tools import cli
from jax_kvalloc.tools import report
from jax_kvalloc.tools import timing

SUITES = {  # name -> "module:attribute" of its Suite
    "kernels": "jax_kvalloc.tools.bench_kernels:SUITE",
    "serving": "jax_kvalloc.tools.bench_serving:SERVING",
    "table": "jax_kvalloc.tools.bench_table:SUITE",
    "class": "jax_kvalloc.tools.bench_classes:CLASS",
    "swa": "jax_kvalloc.tools.bench_classes:SWA",
    "ranks": "jax_kvalloc.tools.bench_ranks:RANKS",
    "processes": "jax_kvalloc.tools.bench_ranks:PROCESSES",
    "simulate": "jax_kvalloc.tools.bench_simulate:SUITE",
    "sgljax-replay": "jax_kvalloc.tools.bench_sgljax:SUITE",
}
# Every suite's timing options: (type, minimum, help, (GPU/TPU, CPU) default, --quick value).
TIMING = {"reps": (int, 1, "repetitions per figure (its median, quartiles)", (5, 5), 3),
          "min_time": (float, 0.0, "seconds per timed run", (0.05, 0.02), 0.005),
          "unroll": (int, 1, "chained calls per loop iteration", (32, 8), 4)}


class Skip(Exception):
  """Raised by a case's setup when its implementation cannot run here (the reason)."""


@dataclasses.dataclass
class Timed:
  """The timed work of a case: measure(opts) -> the cell's figures; output() -> what the
  work produced (compared across the row's columns), or None."""
  measure: Callable[[argparse.Namespace], Dict[str, Any]]
  output: Optional[Callable[[], Any]] = None


@dataclasses.dataclass(frozen=True)
class Case:
  row: Dict[str, Any]           # the row's fields, e.g. {"op": "decode", "bs": 64}
  impl: str                     # the column
  setup: Callable[[], Timed]


@dataclasses.dataclass(frozen=True)
class Dim:
  """A suite option: `flag` (--name), its default (its type follows: a list of ints
  takes '1,2,3', a bool is a flag), help, and the value under --quick."""
  flag: str
  default: Any
  help: str
  type: Optional[Callable[[str], Any]] = None
  quick: Any = None


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  help: str
  impls: Tuple[str, ...]                        # every column, in table order
  cases: Callable[[argparse.Namespace], Iterable[Case]]
  dims: Tuple[Dim, ...] = ()
  default_impls: Tuple[str, ...] = ()           # () = every impl
  render: Optional[Callable[[Dict[str, Any]], str]] = None   # default: table()
  compare: Tuple[Tuple[str, str], ...] = ()     # (ours, theirs) verdict columns
  defaults: Tuple[Tuple[str, Any], ...] = ()    # e.g. (("unroll", 8),)
  guarded: Tuple[str, ...] = ()                 # columns that take [guard=False]: --guard
  # (row, column) -> (limit, "%" or "us") of the ownership record's cost there, or None
  guard_target: Optional[Callable[[Dict[str, Any], str],
                                  Optional[Tuple[float, str]]]] = None


def cell(t: Dict[str, float], prefix: str = "") -> Dict[str, float]:
  """A timing result (seconds: "s", "min_s", "q1_s", ...) as a cell's us figures, keys
  prefixed with `prefix` ("bare_": bare_us, bare_q1_us, ...)."""
  out = {prefix + ("us" if k == "s" else k[:-1] + "us"): v * 1e6 for k, v in t.items()
         if k == "s" or (k.endswith("_s") and k != "compile_s")}
  out.update({prefix + k: t[k] for k in ("spread", "compile_s", "iters") if k in t})
  return out


def chained(call, carry, inputs, *, output=None) -> Timed:
  """Device time per call of `call(carry, inputs) -> (carry, outputs)` chained in one jit
  (timing.chain_time)."""
  return Timed(lambda o: cell(timing.chain_time(call, carry, inputs, unroll=o.unroll,
                                                min_time=o.min_time, reps=o.reps)), output)


def host(fn, sync=lambda: None, *, n=None, output=None) -> Timed:
  """Host time per call of `fn()`, calls back to back, `sync()` after each run of n
  calls (n grown until a run takes --min-time unless given)."""
  return Timed(lambda o: cell(timing.host_time(fn, sync=sync, min_time=o.min_time,
                                               reps=o.reps, n=n)), output)


def per_call(fn, *, before=None, sync=None, wait=lambda out: None, output=None) -> Timed:
  """Host time of each call of `fn()` alone (timing.per_call)."""
  return Timed(lambda o: cell(timing.per_call(fn, before=before, sync=sync, wait=wait,
                                              reps=o.reps)), output)


def graph(fn, *, output=None) -> Timed:
  """Device time per call of `fn` from replays of a torch CUDA graph of `unroll` calls."""
  return Timed(lambda o: cell(timing.torch_graph_time(fn, unroll=o.unroll,
                                                      min_time=o.min_time, reps=o.reps)),
               output)


def skipped(why: str) -> Timed:
  """The setup of a column that cannot run here: raises Skip(why)."""
  raise Skip(why)


def parse_impl(spec: str) -> Tuple[str, Dict[str, Any]]:
  """'jnp[guard=False,free=sort]' -> ('jnp', {'guard': False, 'free': 'sort'})."""
  base, _, rest = spec.partition("[")
  kw: Dict[str, Any] = {}
  for item in filter(None, rest.rstrip("]").split(",")):
    k, _, v = item.partition("=")
    kw[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
  return base, kw


def impl_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
  """An argparse type: a comma list of columns of `choices`, each optionally with
  [key=value,...] (constructor or config arguments, e.g. jnp[guard=False])."""
  def parse(text: str) -> List[str]:
    specs = re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text.replace(" ", ""))
    if not specs or any(parse_impl(s)[0] not in choices for s in specs):
      raise argparse.ArgumentTypeError(f"expected a comma list of {','.join(choices)} "
                                       f"(each optionally [key=value,...]), got {text!r}")
    return specs
  return parse


def error(e: BaseException) -> Dict[str, str]:
  return {"error": f"{type(e).__name__}: {e}"[:300]}


def label(row: Dict[str, Any]) -> str:
  return "/".join(str(v) for k, v in row.items() if k != "cells")


def same(a: Any, b: Any) -> bool:
  """Whether two outputs (arrays or tuples of them, any framework) hold the same ints."""
  from jax_kvalloc.tools.traces import as_int_list  # pylint: disable=g-import-not-at-top
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  return np.array_equal(as_int_list(a), as_int_list(b))


def load_file(path: str, name: str) -> Any:
  """The module in the file `path`, imported as `name` (third-party code is loaded by
  path, never copied)."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def torch_device() -> Tuple[Any, str]:
  """(torch, "cuda" where torch sees a GPU, else "cpu"); Skip without torch."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise Skip(f"torch unavailable ({e})")
  return torch, "cuda" if torch.cuda.is_available() else "cpu"


def sglang(bundle: Optional[str] = None) -> Any:
  """jax_kvalloc.tools.sglang_oracle once SGLang's allocator imports, where it is not
  installed from the bundle folder `bundle` (sglang_oracle.use_bundle); Skip if not."""
  torch_device()
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  if sglang_oracle.import_error() is not None:
    try:
      sglang_oracle.use_bundle(bundle)
    except FileNotFoundError as e:
      raise Skip(str(e))
  if sglang_oracle.import_error():
    raise Skip(sglang_oracle.import_error())
  return sglang_oracle


def decode_lens(n: int, page_size: int, rng: np.random.Generator) -> np.ndarray:
  """i64[n] seq_lens of a decode batch: rows 0, ps, 2ps, ... start a page (seq % ps ==
  1), the others continue one."""
  ps = page_size
  seq = ps * rng.integers(1, 4, n) + rng.integers(2, ps + 1, n)
  seq[::ps] = ps * rng.integers(1, 4, len(seq[::ps])) + 1
  return seq.astype(np.int64)


# ---------------------------------------------------------------------------------------
# Running a suite; its table.
# ---------------------------------------------------------------------------------------

def run_suite(suite: Suite, opts: argparse.Namespace,
              save: Callable[[Dict[str, Any]], None] = lambda r: None) -> Dict[str, Any]:
  """Runs every case of `suite` whose impl is in opts.impls; returns the record, handed
  to `save` after each case (a run cut short keeps what it measured)."""
  t0 = time.perf_counter()
  record: Dict[str, Any] = {"suite": suite.name, "env": environment(), "rows": [],
                            "settings": {k: v for k, v in vars(opts).items() if k != "run"},
                            "skipped": {}}
  rows: Dict[Tuple, Dict[str, Any]] = {}
  first: Dict[Tuple, Tuple[str, Any]] = {}  # the row's first output, the reference
  for case in suite.cases(opts):
    if case.impl not in opts.impls or case.impl in record["skipped"]:
      continue
    key = tuple(case.row.items())
    if key not in rows:
      rows[key] = dict(case.row, cells={})
      record["rows"].append(rows[key])
    try:
      if opts.budget_s and time.perf_counter() - t0 > opts.budget_s:
        raise TimeoutError("skipped: --budget-s spent")
      timed = case.setup()
      got = timed.measure(opts)
      out = timed.output() if timed.output else None
      if out is not None and first.setdefault(key, (case.impl, out))[0] != case.impl:
        if not same(out, first[key][1]):
          got["check"] = f"MISMATCH: {case.impl} differs from {first[key][0]}"
    except Skip as e:
      record["skipped"][case.impl] = str(e)
      continue
    except Exception as e:  # pylint: disable=broad-except
      got = error(e)
    rows[key]["cells"][case.impl] = got
    print(f"  {label(rows[key])} {case.impl}: " + (got.get("error") or got.get("check") or
          f"{report.fmt_us(got.get('us'))} us"), file=sys.stderr, flush=True)
    record["elapsed_s"] = time.perf_counter() - t0
    save(record)
  record["env"].update({m: getattr(sys.modules.get(m), "__version__", None)
                        for m in ("torch", "triton", "sglang")})  # where the run used them
  record["env"]["torch"] = record["env"]["torch"] or "not used"
  return record


def mismatches(record: Dict[str, Any]) -> List[str]:
  return [f"{label(r)} {i}: {c['check']}" for r in record["rows"]
          for i, c in r["cells"].items() if c.get("check", "ok") != "ok"]


def fmt_cell(c: Dict[str, Any], prefix: str = "") -> str:
  """A cell's `{prefix}us` as `median [q1, q3]` (the median alone without quartiles)."""
  f, q1, q3 = report.fmt_us, prefix + "q1_us", prefix + "q3_us"
  return f(c.get(prefix + "us")) + (f" [{f(c[q1])}, {f(c[q3])}]" if q1 in c else "")


def table(record: Dict[str, Any], suite: Optional[Suite] = None) -> str:
  """The record as a markdown table: a row per row, `median [q1, q3]` us per column, a
  verdict column per `compare` pair; then the skipped columns, errors and mismatches."""
  order = list(suite.impls if suite else ())
  present = dict.fromkeys(i for r in record["rows"] for i in r["cells"])
  impls = sorted(present, key=lambda i: order.index(i) if i in order else len(order))
  pairs = [(a, b) for a, b in (suite.compare if suite else ()) if a in impls and b in impls]
  ok = lambda c: c is not None and "error" not in c
  cell_text = lambda c: "-" if c is None else "error" if "error" in c else fmt_cell(c)
  body = [[label(r)] + [cell_text(r["cells"].get(i)) for i in impls] + [
      report.verdict(report.iqr(r["cells"][a]), report.iqr(r["cells"][b]))
      if ok(r["cells"].get(a)) and ok(r["cells"].get(b)) else "-" for a, b in pairs]
          for r in record["rows"]]
  lines = [report.table(["row"] + [f"{i} us" for i in impls] +
                        [f"{a} vs {b}" for a, b in pairs], body)]
  lines += [f"skipped {name}: {why}" for name, why in record["skipped"].items()]
  lines += [f"error in {label(r)} {i}: {c['error']}" for r in record["rows"]
            for i, c in r["cells"].items() if "error" in c]
  return "\n".join(lines + mismatches(record))


def render(record: Dict[str, Any]) -> str:
  """The printed tables of a record, by its suite's renderer; then the ownership record's
  cost where the run has X and X[guard=False] columns."""
  suite = load_suite(record["suite"])
  cost = guard_cost(record, suite.guard_target)
  return (suite.render or (lambda r: table(r, suite)))(record) + (cost and "\n\n" + cost)


def guard_impls(impls: Sequence[str], modes: Sequence[str],
                guarded: Sequence[str]) -> List[str]:
  """The columns `--guard` runs: each of `impls` whose base is in `guarded` and which
  names no guard itself as X (mode "on", the default config) and/or X[..., guard=False]
  (mode "off"), in that order beside each other; the others as given."""
  out: List[str] = []
  for impl in impls:
    base, kw = parse_impl(impl)
    if base not in guarded or "guard" in kw:
      out.append(impl)
      continue
    off = f"{base}[{','.join([f'{k}={v}' for k, v in kw.items()] + ['guard=False'])}]"
    out += [spec for spec, mode in ((impl, "on"), (off, "off")) if mode in modes]
  return list(dict.fromkeys(out))


def guard_pairs(impls: Iterable[str]) -> List[Tuple[str, str]]:
  """(X, X[guard=False]) pairs of `impls`: a column with the ownership record (SPEC 14,
  the default) and the same column without it."""
  impls, pairs = list(impls), []
  for off in impls:
    base, kw = parse_impl(off)
    if kw.pop("guard", None) is False:
      rest = ",".join(f"{k}={v}" for k, v in kw.items())
      on = base + (f"[{rest}]" if rest else "")
      if on in impls:
        pairs.append((on, off))
  return pairs


GUARD_FIGURES = {"": "", "bare_": " bare", "kernels_": " kernels"}  # prefix -> label


def guard_cost(record: Dict[str, Any], target=None) -> str:
  """The ownership record's cost per row, (X, X[guard=False]) pair and figure (us, and
  bare_us, kernels_us where recorded): both sides, ratio, difference, the verdict of
  their quartiles and, where target(row, X) gives (limit, "%" or "us"), "met", "MISSED"
  or "over (tie)" (above the limit within the noise). "" without pairs."""
  body = []
  for on, off in guard_pairs(dict.fromkeys(i for r in record["rows"] for i in r["cells"])):
    for r in record["rows"]:
      a, b = r["cells"].get(on) or {}, r["cells"].get(off) or {}
      for p, name in GUARD_FIGURES.items():
        if a.get(p + "us") is None or b.get(p + "us") is None:
          continue
        d = a[p + "us"] - b[p + "us"]
        ratio = a[p + "us"] / b[p + "us"] if b[p + "us"] > 0 else float("nan")
        word = report.verdict(report.iqr(a, p), report.iqr(b, p))
        limit = target(r, on) if target else None
        within = "-"
        if limit is not None:
          over = (100 * (ratio - 1) if limit[1] == "%" else d) > limit[0]
          bound = f"<= +{limit[0]:g}{' ' * (limit[1] == 'us')}{limit[1]}"
          within = ({"slower": "MISSED", "tie": "over (tie)"}.get(word, f"over ({word})")
                    if over else "met") + f" ({bound})"
        body.append([label(r), on + name, fmt_cell(a, p), fmt_cell(b, p),
                     report.fmt_ratio(ratio), f"{d:+.2f}", word, within])
  if not body:
    return ""
  return ("the ownership record's cost (SPEC 14): each column with the record and with "
          "guard=False, same run, us: median [q1, q3]; ratio = with / without\n" +
          report.table(["row", "column", "with record (us)", "guard=False (us)", "ratio",
                        "cost (us)", "verdict (IQR)", "target"], body, align="llrrrrrr"))


# ---------------------------------------------------------------------------------------
# Where a run ran: the record's env, and the manifest of a result folder.
# ---------------------------------------------------------------------------------------

def _out(cmd: List[str]) -> Optional[str]:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def _read(path: Optional[str]) -> Optional[str]:
  return pathlib.Path(path).read_text() if path and os.path.exists(path) else None


def gpus() -> List[Dict[str, str]]:
  """[{"name", "driver", "memory"}] from nvidia-smi (empty without one)."""
  text = _out(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
               "--format=csv,noheader"])
  return [dict(zip(("name", "driver", "memory"), (c.strip() for c in line.split(","))))
          for line in (text or "").splitlines()]


def machine_tag() -> str:
  """'h200' / 'h200x2' for NVIDIA H200s, the GPU's last word otherwise, 'cpu' without."""
  g = gpus()
  if not g:
    return "cpu"
  word = "".join(ch for ch in g[0]["name"].split()[-1].lower() if ch.isalnum()) or "gpu"
  return word + (f"x{len(g)}" if len(g) > 1 else "")


VERSION_MODULES = ("jax", "jaxlib", "torch", "triton", "numpy")


def versions(modules: Optional[Sequence[str]] = None) -> Dict[str, Optional[str]]:
  """{"python", and each module's (VERSION_MODULES') __version__, None where it does not
  import}."""
  out: Dict[str, Optional[str]] = {"python": platform.python_version()}
  for mod in modules or VERSION_MODULES:
    try:
      out[mod] = importlib.import_module(mod).__version__
    except Exception:  # pylint: disable=broad-except  (absent or broken: say so)
      out[mod] = None
  return out


def commit() -> Optional[str]:
  return os.environ.get("COMMIT") or _out(["git", "rev-parse", "--short", "HEAD"])


def environment() -> Dict[str, Any]:
  """The record's "env": date, device, versions, machine, command, commit."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import __version__  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  return {"date": datetime.date.today().isoformat(), "platform": d.platform,
          "device": str(getattr(d, "device_kind", d)), **versions(("jax", "jaxlib", "numpy")),
          "jax_kvalloc": __version__, "machine": platform.machine(), "cpus": os.cpu_count(),
          "command": "jax-kvalloc " + " ".join(sys.argv[1:]), "commit": commit()}


def manifest(directory: str, command: str, steps_tsv: Optional[str] = None,
             kernels: Optional[str] = None) -> Dict[str, Any]:
  """A result folder's manifest.json: command, commit, date, machine, GPUs, driver, CPU,
  versions, the SGLang kernels file's sha256 and wheel, the runner's steps (name, exit,
  seconds, command), the folder's files; a field that cannot be read is null."""
  g, sglang, steps = gpus(), None, []
  cpus = [l.split(":", 1)[1].strip() for l in (_read("/proc/cpuinfo") or "").splitlines()
          if l.startswith("model name")]
  if kernels and os.path.exists(kernels):
    wheel = _read(os.path.join(os.path.dirname(kernels), "VERSION"))
    sglang = {"wheel": wheel and wheel.strip(), "file": kernels,
              "sha256": hashlib.sha256(pathlib.Path(kernels).read_bytes()).hexdigest()}
  for line in (_read(steps_tsv) or "").splitlines():
    name, rc, secs, cmd = line.split("\t", 3)
    steps.append({"name": name, "exit": int(rc), "seconds": int(secs), "command": cmd.strip()})
  return {"command": command, "commit": commit(),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "machine": machine_tag(), "gpus": len(g), "gpu": g[0]["name"] if g else None,
          "driver": g[0]["driver"] if g else None,
          "cpu": f"{cpus[0]} x {len(cpus)}" if cpus else None, "versions": versions(),
          "sglang": sglang, "steps": steps,
          "files": sorted(f for f in os.listdir(directory) if f != "manifest.json"),
          "reconstructed": []}


# ---------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------

def load_suite(name: str) -> Suite:
  module, attr = SUITES[name].split(":")
  return getattr(importlib.import_module(module), attr)


def _type(d: Dim) -> Dict[str, Any]:
  if d.type is not None:
    return {"type": d.type}
  if isinstance(d.default, bool):
    return {"action": "store_true"}
  if isinstance(d.default, (list, tuple)):
    return {"type": cli.int_list}
  if isinstance(d.default, (int, float)):
    return {"type": cli.positive(type(d.default), 0)}
  return {"type": str}


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.description = ("One harness for every benchmark: `jax-kvalloc bench SUITE --help` "
                   "says what a suite times and against what.")
  sub = p.add_subparsers(dest="suite", metavar="SUITE", title="suites", required=True)
  for name in SUITES:
    suite = load_suite(name)
    defaults = dict(suite.defaults)
    s = sub.add_parser(name, help=suite.help, formatter_class=cli.Formatter,
                       description=sys.modules[suite.cases.__module__].__doc__)
    for d in suite.dims:  # quick-able options default to None: resolve() fills them
      extra = (f" (default: {cli.show(d.default)}; --quick: {cli.show(d.quick)})"
               if d.quick is not None else "")
      s.add_argument(d.flag, default=None if extra else d.default, help=d.help + extra,
                     **_type(d))
    s.add_argument("--impls", type=impl_list(suite.impls),
                   default=list(suite.default_impls or suite.impls),
                   help=f"columns to run, of {','.join(suite.impls)}")
    for name_, (kind, minimum, what, (accel, cpu), quick) in TIMING.items():
      default = defaults.get(name_, accel if accel == cpu else
                             f"{accel} on GPU/TPU, {cpu} on CPU")
      s.add_argument("--" + name_.replace("_", "-"), type=cli.positive(kind, minimum),
                     help=f"{what} (default: {default}; --quick: {quick})")
    if suite.guarded:
      s.add_argument("--guard", type=cli.name_list(("on", "off")), default=["on"],
                     help="the allocator columns' ownership record (SPEC 14): on (the "
                     "default config), off (guard=False), or on,off: each such column X "
                     "also as X[guard=False] beside it, and the record's cost")
    s.add_argument("--quick", action="store_true", help="a tiny, noisy smoke run: the "
                   "--quick values of the options not given")
    s.add_argument("--budget-s", type=cli.positive(float, 0.0),
                   help="start no case after this many seconds (the rest say so)")
    s.add_argument("--json", metavar="FILE", help="write the record here (after every "
                   "case, so a run cut short keeps what it measured)")
    s.set_defaults(dims=suite.dims, suite_defaults=defaults, guarded=suite.guarded)


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
  """Fills the options left at None: their --quick value under --quick, else the suite's
  default, else the device's (TIMING)."""
  import jax  # pylint: disable=g-import-not-at-top
  cpu = jax.default_backend() == "cpu"
  for d in opts.dims:
    name = d.flag[2:].replace("-", "_")
    if getattr(opts, name) is None:
      value = d.quick if opts.quick and d.quick is not None else d.default
      setattr(opts, name, d.type(value) if d.type and isinstance(value, str) else value)
  for name, (_, _, _, device, quick) in TIMING.items():
    if getattr(opts, name) is None:
      setattr(opts, name, quick if opts.quick else opts.suite_defaults.get(name, device[cpu]))
  guarded = vars(opts).pop("guarded", ())
  if guarded:
    opts.impls = guard_impls(opts.impls, opts.guard, guarded)
  del opts.dims, opts.suite_defaults
  return opts


def run(args: argparse.Namespace) -> int:
  # JAX must not take most of the GPU before torch gets any.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  opts = resolve(args)
  if getattr(opts, "kernel", None) is not None:  # the suites whose pools take --kernel
    cli.check_kernel(opts.kernel)
  save = (lambda rec: report.write_json(opts.json, rec)) if opts.json else (lambda r: None)
  record = run_suite(load_suite(args.suite), opts, save)
  save(record)
  print(render(record) + (f"\nwrote {opts.json}" if opts.json else ""))
  return 1 if mismatches(record) else 0
