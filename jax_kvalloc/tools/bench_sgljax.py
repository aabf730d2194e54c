"""`jax-kvalloc bench sgljax-replay`: the allocator calls of a recorded sglang-jax engine
run, replayed through sglang-jax's allocator and through jax_kvalloc's sglang-jax flavour.

A trace (--traces, JSON, written by tests/sgljax_engine.py --out) holds the allocator's
constructor arguments and every call sglang-jax's Scheduler made to it, in order, with
its arguments and results. One repetition replays the whole trace through a fresh
allocator of each column, one column after the other (the order flips every repetition),
timing every call alone with perf_counter; every result must equal the recorded one
(else the cell reads MISMATCH). A row is one call kind and size: n is the slots asked
(alloc) or freed (free), the requests (alloc_extend, alloc_decode), "-" for the rest,
grouped in powers of two; a free inside a free group (between free_group_begin and
free_group_end, where sglang-jax only queues it) is its own kind, "free in group". A
cell: per repetition, the row's mean time per call; their median and quartiles over the
repetitions ("us", "q1_us", "q3_us"), and the calls per repetition ("calls"). The last
row of a trace, "whole trace/N", is the total of its N calls per repetition.

Columns:
  host    jax_kvalloc.sgl_jax's class, backend="host" (guard on, the default;
          --guard on,off adds host[guard=False] beside it)
  device  the same, backend="device" (not run by default)
  sgljax  sglang-jax's host-NumPy allocator, loaded by path from --sgljax (default
          ../shared/anchors/sgljax; third-party code, never copied)
"""
from __future__ import annotations

import functools
import gc
import json
import os
import pathlib
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from jax_kvalloc.tools import bench
from jax_kvalloc.tools import cli
from jax_kvalloc.tools import timing
from jax_kvalloc.tools.bench_classes import DEFAULT_SGLJAX

DEFAULT_TRACES = str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
                     "2026-12-05-cpu-sgljax-replay")


def _value(x: Any) -> Any:
  """A recorded argument back as the engine passed it ({"array", "dtype"} -> ndarray)."""
  if isinstance(x, dict) and "array" in x:
    return np.asarray(x["array"], dtype=x["dtype"])
  if isinstance(x, list):
    return [_value(v) for v in x]
  return x


def _plain(x: Any) -> Any:
  """A result as the trace records it (tests/sgljax_engine.py's encoding)."""
  if isinstance(x, np.ndarray):
    return {"array": x.tolist(), "dtype": str(x.dtype)}
  if isinstance(x, np.integer):
    return int(x)
  return x


def size_of(call: Dict[str, Any]) -> str:
  """The row's n: slots (alloc, free), requests (alloc_extend, alloc_decode), "-"."""
  kind, args = call["kind"], call["args"]
  if kind == "alloc":
    n = args[0]
  elif kind == "free":
    n = len(args[0]["array"])
  elif kind in ("alloc_extend", "alloc_decode"):
    n = len(args[0]["array"] if isinstance(args[0], dict) else args[0])
  else:
    return "-"
  lo = 1 << (max(int(n), 1).bit_length() - 1)
  return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def load_trace(path: str) -> Dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    trace = json.load(f)
  if "calls" not in trace or "constructor" not in trace:
    raise cli.UsageError("--traces", f"{path} is not a recorded run (tests/sgljax_engine.py"
                         " --out): no calls or constructor")
  return trace


def make(column: str, ctor: Dict[str, Any], o) -> Any:
  """A fresh allocator of the column with the recorded constructor arguments."""
  cls, size, ps, dp = ctor["class"], ctor["size"], ctor["page_size"], ctor["dp_size"]
  if column == "sgljax":
    path = pathlib.Path(o.sgljax) / "sgljax_allocator.py"
    if not path.exists():
      raise bench.Skip(f"--sgljax {o.sgljax}: no sgljax_allocator.py there")
    module = bench.load_file(str(path), "_sgljax_allocator_anchor")
    kw = {}
  else:
    from jax_kvalloc import sgl_jax as module  # pylint: disable=g-import-not-at-top
    base, kw = bench.parse_impl(column)
    kw["backend"] = base
  if cls == "TokenToKVPoolAllocator":
    return getattr(module, cls)(size, None, dp_size=dp, **kw)
  return getattr(module, cls)(size, ps, None, dp_size=dp, **kw)


def replay_once(a: Any, calls: List[Dict[str, Any]], check: bool) -> List[float]:
  """Seconds of each call, replayed in order on `a`; with check, raises AssertionError at
  the first result that differs from the recorded one."""
  prepared = [(getattr(a, c["kind"]), _value(c["args"]),
               {k: _value(v) for k, v in c["kwargs"].items()}) for c in calls]
  times, clock = [], time.perf_counter
  for i, (method, args, kwargs) in enumerate(prepared):
    t0 = clock()
    out = method(*args, **kwargs)
    times.append(clock() - t0)
    if check and _plain(out) != calls[i]["result"]:
      raise AssertionError(f"call {i} ({calls[i]['kind']}) returned {_plain(out)!r}, the "
                           f"engine's allocator {calls[i]['result']!r}")
  return times


@functools.lru_cache(maxsize=None)
def replays(path: str, columns: Tuple[str, ...], reps: int, sgljax: str) -> Dict[str, Any]:
  """{column: [per-repetition call times]} for the trace, the columns interleaved: each
  repetition replays the trace once per column, in an order that flips every repetition.
  A column that cannot run maps to its bench.Skip; one whose results differ from the
  recording to its AssertionError."""
  trace = load_trace(path)
  o = type("Opts", (), {"sgljax": sgljax})
  out: Dict[str, Any] = {}
  for col in columns:  # one untimed, checked replay each (imports, first calls)
    try:
      replay_once(make(col, trace["constructor"], o), trace["calls"], check=True)
      out[col] = []
    except (bench.Skip, AssertionError) as e:
      out[col] = e
  live = [c for c in columns if isinstance(out[c], list)]
  enabled = gc.isenabled()
  gc.disable()  # as timeit does: a collection lands in no call
  try:
    for rep in range(reps):
      for col in (live if rep % 2 == 0 else live[::-1]):
        a = make(col, trace["constructor"], o)
        out[col].append(replay_once(a, trace["calls"], check=False))
        del a
        gc.collect()
  finally:
    if enabled:
      gc.enable()
  return out


WHOLE = "whole trace"


def rows_of(trace: Dict[str, Any]) -> Dict[Tuple[str, str], List[int]]:
  """(kind, n) -> the indices of its calls, in order of first appearance; a free between
  free_group_begin and free_group_end is kind "free in group" (sglang-jax only queues
  it there). Last, (WHOLE, calls) -> every call."""
  rows: Dict[Tuple[str, str], List[int]] = {}
  grouped = False
  for i, c in enumerate(trace["calls"]):
    kind = c["kind"]
    grouped = {"free_group_begin": True, "free_group_end": False}.get(kind, grouped)
    if kind == "free" and grouped:
      kind = "free in group"
    rows.setdefault((kind, size_of(c)), []).append(i)
  rows[WHOLE, str(len(trace["calls"]))] = list(range(len(trace["calls"])))
  return rows


def cell_timed(path: str, key: Tuple[str, str], column: str, o) -> bench.Timed:
  res = replays(path, tuple(o.impls), o.reps, o.sgljax)[column]
  if isinstance(res, bench.Skip):
    raise res
  if isinstance(res, AssertionError):  # the cell says so, and the run exits 1
    return bench.Timed(lambda opts: {"error": f"MISMATCH: {res}"[:300],
                                     "check": f"MISMATCH: {column} differs from the trace"})
  idx = rows_of(load_trace(path))[key]

  per = 1 if key[0] == WHOLE else len(idx)   # the whole trace: its total

  def measure(opts):
    del opts
    per_rep = [sum(times[i] for i in idx) / per for times in res]
    return dict(bench.cell(timing._stats(per_rep)), calls=len(idx), reps=len(per_rep))  # pylint: disable=protected-access
  return bench.Timed(measure)


def traces(o) -> List[str]:
  paths = [p for p in o.traces.split(",") if p]
  out = []
  for p in paths:
    if os.path.isdir(p):
      out += sorted(str(q) for q in pathlib.Path(p).glob("trace-*.json"))
    elif os.path.isfile(p):
      out.append(p)
    else:
      raise cli.UsageError("--traces", f"no such file or folder: {p}")
  if not out:
    raise cli.UsageError("--traces", f"no trace-*.json in {o.traces}")
  return out


def cases(o):
  for path in traces(o):
    trace = load_trace(path)
    name = os.path.basename(path)[:-len(".json")].replace("trace-", "")
    for key in rows_of(trace):
      for col in o.impls:
        yield bench.Case({"trace": name, "kind": key[0], "n": key[1]}, col,
                         functools.partial(cell_timed, path, key, col, o))


SUITE = bench.Suite(
    name="sgljax-replay", help="a recorded sglang-jax engine run's allocator calls replayed "
    "through sglang-jax's allocator and jax_kvalloc's sglang-jax flavour", cases=cases,
    impls=("host", "sgljax", "device"), default_impls=("host", "sgljax"),
    compare=(("host", "sgljax"), ("device", "sgljax")), defaults=(("reps", 21),),
    guarded=("host", "device"),
    dims=(bench.Dim("--traces", DEFAULT_TRACES, "recorded runs (tests/sgljax_engine.py "
                    "--out): files or folders of trace-*.json, comma-separated", str),
          bench.Dim("--sgljax", str(DEFAULT_SGLJAX), "folder holding sglang-jax's "
                    "sgljax_allocator.py (loaded by path)", str)))
