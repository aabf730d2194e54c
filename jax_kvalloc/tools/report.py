"""Markdown tables, JSON files and (optional) matplotlib for the tools, the verdict rule
of every comparison, and `jax-kvalloc report`: BENCHMARKS.md's and the README's generated
tables printed again from the result folders they cite."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from jax_kvalloc.tools import cli


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *,
          align: str = "") -> str:
  """A GitHub-markdown table. `align` is one character per column ("l" or "r");
  by default the first column is left-aligned and the others right-aligned."""
  cells = [[str(h) for h in header]] + [["" if c is None else str(c) for c in r]
                                         for r in rows]
  align = align or "l" + "r" * (len(header) - 1)
  width = [max(map(len, column)) for column in zip(*cells)]

  def fmt(r):
    return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                             for c, w, a in zip(r, width, align)) + " |"

  rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                        for w, a in zip(width, align)) + "|"
  return "\n".join([fmt(cells[0]), rule] + [fmt(r) for r in cells[1:]])


def fmt_us(x: Any) -> str:
  """Microseconds with sensible precision; '-' for missing."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  x = float(x)
  return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_ratio(x: Any) -> str:
  if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
    return "-"
  return f"{float(x):.2f}x"


NO_SPREAD = "no spread recorded"


def verdict(ours: Optional[Tuple[float, float]],
            theirs: Optional[Tuple[float, float]]) -> str:
  """'faster' / 'slower' (ours against theirs, lower is faster) only when the two
  interquartile ranges (q1, q3) do not overlap, else 'tie'; NO_SPREAD when either side's
  quartiles were not recorded (nothing is guessed)."""
  if ours is None or theirs is None:
    return NO_SPREAD
  if ours[1] < theirs[0]:
    return "faster"
  if ours[0] > theirs[1]:
    return "slower"
  return "tie"


def iqr(cell: Optional[Dict[str, Any]], prefix: str = "") -> Optional[Tuple[float, float]]:
  """(q1, q3) in us of a result cell's `{prefix}q1_us` / `{prefix}q3_us`, or None."""
  if not cell or f"{prefix}q1_us" not in cell:
    return None
  return cell[f"{prefix}q1_us"], cell[f"{prefix}q3_us"]


def write_json(path: str, data: Any) -> None:
  """`data` as indented JSON, numpy (and jax) values as the Python values they hold."""
  with open(path, "w") as f:
    json.dump(data, f, indent=1, default=_plain)
    f.write("\n")


def _plain(o):
  if hasattr(o, "tolist"):
    return o.tolist()
  raise TypeError(f"cannot write {type(o).__name__} as JSON")


def pyplot():
  """matplotlib.pyplot with a non-interactive backend; a clear error if absent."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError("--plot needs matplotlib: pip install 'jax_kvalloc[plot]' "
                       "(or pip install matplotlib)") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


# ---------------------------------------------------------------------------------------
# Generated blocks of BENCHMARKS.md and README.md (`jax-kvalloc report`): everything
# between a line `<!-- report: KIND ARG... -->` and the next `<!-- end report -->`, printed
# from the result files the ARGs name (under benchmarks/results/) and citing them:
#   bench FILE (or bench-swa FILE)  the tables `jax-kvalloc bench` printed for that record
#   headline SPEC...   the bare kernel comparison and the in-step allocator share;
#                      SPEC: decode=FILE:BS,BS  extend=FILE:BS,BS  serving=FILE
#   verdicts FILE...   the bare verdict of every (op, bs) the kernels files share, file by
#                      file, and whether they agree (a re-run's check)
# ---------------------------------------------------------------------------------------

_BLOCK = re.compile(
    r"(<!-- report: (?P<spec>[^\n]*?) -->\n)(?P<body>.*?)(<!-- end report -->)", re.S)


class ReportError(ValueError):
  """A marker that names an unknown kind or a file that is not there."""


def load(path: str, root: str = "") -> Dict[str, Any]:
  """A result file (JSON); ReportError naming it when it is not there."""
  full = os.path.join(root, path)
  if not os.path.exists(full):
    raise ReportError(f"report marker names {path!r}: no such file under {root!r}")
  with open(full) as f:
    return json.load(f)


def tables(record: Dict[str, Any]) -> str:
  """What `jax-kvalloc bench` printed for a record, whichever run wrote it."""
  from jax_kvalloc.tools import bench  # pylint: disable=g-import-not-at-top
  return bench.render(record)


def _cite(paths: Sequence[str]) -> str:
  return "Source: " + ", ".join(f"[`{p.split('benchmarks/results/')[-1]}`]({p})"
                                for p in paths) + "\n"


def _tables_block(root: str, paths: Sequence[str]) -> str:
  (path,) = paths
  return "```\n" + tables(load(path, root)).rstrip("\n") + "\n```\n" + _cite(paths)


def _run_name(path: str) -> str:
  """'run14' from '.../2026-11-30-h200x2-run14/decode-scan.json' (the folder's short name)."""
  return path.rstrip("/").split("/")[-2].split("-", 4)[-1]


def _headline_block(root: str, specs: Sequence[str]) -> str:
  from jax_kvalloc.tools import bench_kernels as bk  # pylint: disable=g-import-not-at-top
  kernel_rows, serving_rows, cited = [], [], []
  for spec in specs:
    kind, _, rest = spec.partition("=")
    path, _, sizes = rest.partition(":")
    if kind not in ("decode", "extend", "serving") or not path:
      raise ReportError(f"headline spec {spec!r}: expected decode=FILE:BS,..., "
                        "extend=FILE:BS,... or serving=FILE")
    data = load(path, root)
    cited.append(path)
    link = f"[{_run_name(path)}]({path})"
    if kind == "serving":
      for r in data["rows"]:
        u = bk.serving_figures(r)
        fused = u.get("alloc_fused")
        serving_rows.append([r["bs"], fmt_us(fused), fmt_us(u["alloc"]),
                             fmt_us(u.get("alloc_pages")), "-" if fused is None
                             else ("yes" if fused <= bk.SCAN_ALLOC_TARGET_US else "no"),
                             link])
      continue
    want = [int(b) for b in sizes.split(",")] if sizes else None
    for r in data["rows"]:
      if r["op"] != kind or (want is not None and r["bs"] not in want):
        continue
      pb, sg = bk.bare_cells(r)
      kernel_rows.append([kind, r["bs"], r["tokens"], fmt_us(pb.get("bare_us")),
                          fmt_us(sg.get("bare_us")),
                          fmt_ratio(sg["bare_us"] / pb["bare_us"]
                                    if pb.get("bare_us") and sg.get("bare_us") else None),
                          bk.bare_verdict(r) or "-", link])
  out = []
  if kernel_rows:
    out.append(table(["op", "bs", "tokens", "pallas bare (us)", "SGLang bare (us)",
                      "SGLang / pallas", "verdict (IQR)", "run"], kernel_rows,
                     align="lrrrrrrl"))
  if serving_rows:
    out.append(table(["serving bs", "allocator in scan, fused release+decode (us)",
                      "separate calls: free (us)", "separate calls: page release (us)",
                      f"fused <= {bk.SCAN_ALLOC_TARGET_US:.0f} us", "run"],
                     serving_rows, align="rrrrrl"))
  return "\n\n".join(out) + "\n\n" + _cite(cited)


def _verdicts_block(root: str, paths: Sequence[str]) -> str:
  """One row per (op, bs) that every file measured bare: each file's verdict (pallas
  bare against SGLang bare) and whether all agree."""
  from jax_kvalloc.tools import bench_kernels as bk  # pylint: disable=g-import-not-at-top
  if len(paths) < 2:
    raise ReportError(f"verdicts needs two or more kernels files, got {list(paths)}")
  per_file = []
  for path in paths:
    found = {}
    for r in load(path, root)["rows"]:
      v = bk.bare_verdict(r)
      if v is not None:
        pb, sg = bk.bare_cells(r)
        found[(r["op"], r["bs"])] = (v, sg["bare_us"] / pb["bare_us"])
    per_file.append(found)
  keys = sorted(set.intersection(*(set(f) for f in per_file)))
  if not keys:
    raise ReportError(f"verdicts: the files {list(paths)} share no bare (op, bs) row")
  rows = []
  for key in keys:
    same = len({f[key][0] for f in per_file}) == 1
    rows.append([key[0], key[1], *(f"{f[key][0]} ({fmt_ratio(f[key][1])})" for f in per_file),
                 "yes" if same else "NO"])
  agree = sum(r[-1] == "yes" for r in rows)
  header = ["op", "bs", *(_run_name(p) for p in paths), "same verdict"]
  return (table(header, rows, align="lr" + "r" * (len(paths) + 1)) +
          f"\n\n{agree} of {len(rows)} verdicts agree.\n\n" + _cite(paths))


_KINDS = {"bench": _tables_block, "bench-swa": _tables_block, "headline": _headline_block,
          "verdicts": _verdicts_block}


def generate_block(spec: str, root: str) -> str:
  """The body of the block whose marker says `spec` ('KIND ARG...')."""
  kind, *args = spec.split()
  if kind not in _KINDS:
    raise ReportError(f"report marker kind {kind!r}: expected one of {sorted(_KINDS)}")
  return _KINDS[kind](root, args)


def regenerate(text: str, root: str) -> str:
  """`text` with every generated block's body printed again from its result files."""
  return _BLOCK.sub(lambda m: m.group(1) + generate_block(m.group("spec"), root)
                    + m.group(4), text)


def blocks(text: str) -> List[str]:
  """The specs of the generated blocks of `text`, in order."""
  return [m.group("spec") for m in _BLOCK.finditer(text)]


def run_report(paths: Sequence[str], *, check: bool = False, write: bool = False) -> int:
  """Each result file's tables, and each Markdown file's generated blocks (root: the
  file's folder) printed again; write=True rewrites the Markdown files, check=True writes
  nothing and returns 1 with a unified diff where a committed block differs."""
  import difflib  # pylint: disable=g-import-not-at-top
  status = 0
  for path in paths:
    if path.endswith(".json"):
      record = load(path)
      if "suite" not in record:
        raise cli.UsageError("FILE", f"{path} is not a record of `jax-kvalloc bench` "
                             "(it names no suite)")
      print(tables(record))
      continue
    old = pathlib.Path(path).read_text()
    new = regenerate(old, os.path.dirname(os.path.abspath(path)))
    n = len(blocks(old))
    if not (check or write):
      for m in _BLOCK.finditer(new):
        print(f"{path}: <!-- report: {m.group('spec')} -->\n{m.group('body')}")
    elif new == old:
      print(f"{path}: {n} generated block(s) up to date")
    elif check:
      status = 1
      sys.stdout.writelines(difflib.unified_diff(
          old.splitlines(True), new.splitlines(True), path, path + " (generated)"))
      print(f"{path}: generated blocks differ from `jax-kvalloc report`")
    else:
      pathlib.Path(path).write_text(new)
      print(f"{path}: rewrote {n} generated block(s)")
  return status


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.description = (
      "Prints every block between `<!-- report: KIND ARG... -->` and `<!-- end report\n"
      "-->` of the given Markdown files again from the result files the marker names\n"
      "(benchmarks/results/<run>/...), and the tables of the given result files (.json).\n"
      "--write rewrites the Markdown files; --check fails on a difference.")
  p.add_argument("paths", nargs="*", default=["BENCHMARKS.md", "README.md"],
                 type=cli.existing_file, metavar="FILE",
                 help="Markdown files and result files (.json)")
  g = p.add_mutually_exclusive_group()
  g.add_argument("--write", action="store_true",
                 help="rewrite the Markdown files' generated blocks")
  g.add_argument("--check", action="store_true",
                 help="write nothing; exit 1 with a diff where a block is out of date")


def run(args: argparse.Namespace) -> int:
  return run_report(args.paths, check=args.check, write=args.write)
