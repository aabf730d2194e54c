"""`jax-kvalloc simulate --trace FILE`: replays recorded allocator traces (the format of
jax_kvalloc.tools.traces, which is the golden format) through the SGLang-compatible classes
and reports the same metrics as the synthetic run, one row per page size.

Each trace is replayed twice: once to compile every shape bucket it touches, once timed
(per operation, through the eager class API, host conversion included). Recorded
results and lists, where the trace has them, are checked on the way (a mismatch raises
jax_kvalloc.tools.traces.TraceMismatch). A tracker follows which slots each operation hands out
and frees (free groups and snapshots included), for the fragmentation metric and for the
final leak check: free + released + still held must be exactly pages 1..num_pages.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Dict, List, Optional

import numpy as np

from jax_kvalloc.tools.simulate import (PageSizeResult, SimConfig, SimConfigError, SimResult,
                                        check_partition, device_name, percentile, versions)

ALLOC_OPS = ("alloc", "alloc_extend", "alloc_decode")


class _Tracker:
  """Pages in use and the slots handed out inside them, following the allocator's
  semantics (paged free releases whole pages; token free single slots)."""

  def __init__(self, page_size: int):
    self.ps = page_size
    self.held: Dict[int, set] = {}
    self.waste = 0
    self.group: Optional[List[int]] = None
    self.snapshot = None

  def take(self, slots) -> None:
    for s in slots:
      page = s // self.ps
      got = self.held.get(page)
      if got is None:
        self.held[page] = {s}
        self.waste += self.ps - 1
      elif s not in got:
        got.add(s)
        self.waste -= 1

  def free(self, slots) -> None:
    if self.group is not None:
      self.group.extend(slots)
      return
    for page in {s // self.ps for s in slots}:
      got = self.held.pop(page, None)
      if got is not None:
        self.waste -= self.ps - len(got)

  def apply(self, op: str, result) -> None:
    if op in ALLOC_OPS and result is not None:
      self.take(result)
    elif op == "free_group_begin":
      self.group = []
    elif op == "free_group_end":
      queued, self.group = self.group or [], None
      self.free(queued)
    elif op == "backup_state":
      self.snapshot = ({p: set(s) for p, s in self.held.items()}, self.waste)
    elif op == "restore_state" and self.snapshot is not None:
      held, self.waste = self.snapshot
      self.held = {p: set(s) for p, s in held.items()}
    elif op in ("clear", "init"):
      self.held, self.waste, self.group = {}, 0, None


def _runs(pages: List[int]) -> int:
  if not pages:
    return 0
  a = np.asarray(pages)
  return int(1 + np.sum(a[1:] != a[:-1] + 1))


def _replay_one(records, replayer, res: PageSizeResult, times: List[float],
                runs: List[int], runs_every: int) -> None:
  from jax_kvalloc.tools import traces  # pylint: disable=g-import-not-at-top
  init = traces.init_args(records[0].get("args", {}))
  ps, num_pages = init["page_size"], init["size"] // init["page_size"]
  tracker = _Tracker(ps)
  observed = None
  for step, rec in enumerate(records):
    op, args = rec["op"], rec.get("args")
    t0 = time.perf_counter()
    result = replayer.apply(op, args)
    us = (time.perf_counter() - t0) * 1e6
    tracker.apply(op, result)
    if op == "free":
      tracker.free([int(s) for s in args["free_index"]])
    if op == "init":
      continue
    times.append(us)
    res.steps += 1
    if op in ALLOC_OPS:
      if result is None:
        res.alloc_failures += 1
      else:
        res.tokens_allocated += len(result)
      if op == "alloc_decode":
        res.decode_steps += 1
      else:
        res.prefill_steps += 1
    checked = any(k in rec for k in traces.STATE_FIELDS[1:])
    if checked or step % runs_every == 0 or step == len(records) - 1:
      observed = replayer.observe()
      got = dict(observed, result=result)
      diff = traces.compare(rec, got)
      if diff:
        raise traces.TraceMismatch(f"trace {rec['trace']!r} step {step} ({op}): {diff}")
      runs.append(_runs(observed["free_pages"]))
      avail = observed["available_size"]
    else:
      avail = int(replayer.allocator.available_size())
    used = num_pages - avail // ps
    res.usage.append(used / num_pages)
    res.waste_peak_slots = max(res.waste_peak_slots, tracker.waste)
    res.waste_mean += tracker.waste / max(used * ps, 1)
  free = observed["free_pages"] + observed["release_pages"]
  check_partition(f", trace {records[0]['trace']!r}", ps, num_pages,
                  [np.asarray(free), np.asarray(sorted(tracker.held))])
  res.free_pages_final += len(free)
  res.in_use_final += len(tracker.held)
  res.runs_final = runs[-1] if runs else 0


def run(cfg: SimConfig, path: str, *, progress: bool = True) -> SimResult:
  """Replays every trace in the file `path` (jax_kvalloc.tools.traces' format); one
  aggregated result per page size. SimConfigError naming --trace for a file that is not
  a trace, or --swa-window / --no-guard (which do not apply)."""
  import tqdm  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import traces  # pylint: disable=g-import-not-at-top
  if cfg.swa_window:
    raise SimConfigError("--swa-window", "does not apply to --trace (a trace replays its "
                         "own operations)")
  if not cfg.guard:
    raise SimConfigError("--no-guard", "does not apply to --trace (a trace replays "
                         "through the default classes)")
  try:
    all_traces = traces.read(path)
    inits = {tid: traces.init_args(recs[0].get("args", {}))
             for tid, recs in all_traces.items()}
  except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
    raise SimConfigError("--trace", f"{path} is not a readable trace file ({e})") from None
  if not all_traces:
    raise SimConfigError("--trace", f"{path} holds no trace")
  by_ps: Dict[int, List[Any]] = collections.defaultdict(list)
  for tid, init in inits.items():
    by_ps[init["page_size"]].append(tid)
  make = traces.jax_factory(cfg.kernel)
  out = []
  for ps in sorted(by_ps):
    tids = by_ps[ps]
    pages = [inits[t]["size"] // ps for t in tids]
    res = PageSizeResult(ps, max(pages), cfg.kernel)
    times: List[float] = []
    runs: List[int] = []
    t0 = time.perf_counter()
    for tid in tqdm.tqdm(tids, desc=f"page_size={ps}", unit="trace", disable=not progress,
                         leave=False):
      records = all_traces[tid]
      warm = traces.Replayer(make)
      for rec in records:  # compile every shape bucket this trace uses
        warm.apply(rec["op"], rec.get("args"))
      _replay_one(records, traces.Replayer(make), res, times, runs, cfg.runs_every)
      res.requests_done += 1
    res.wall_s = time.perf_counter() - t0
    res.step_us = times
    res.step_kind = ["op"] * len(times)
    res.waste_mean /= max(len(res.usage), 1)
    res.peak_usage = max(res.usage, default=0.0)
    res.mean_usage = float(np.mean(res.usage)) if res.usage else 0.0
    res.runs_mean = float(np.mean(runs)) if runs else 0.0
    res.step_us_p50, res.step_us_p99 = percentile(times, 50), percentile(times, 99)
    res.leak_check = (f"ok: free {res.free_pages_final} + in use {res.in_use_final} "
                      f"== {sum(pages)} ({len(tids)} traces)")
    out.append(res)
  conf = {"trace": path, "kernel": cfg.kernel, "runs_every": cfg.runs_every}
  return SimResult(conf, device_name(), versions(), out, mode="trace")
