"""`jax-kvalloc simulate --trace FILE`: replays recorded allocator traces (the format of
jax_kvalloc.tools.traces, which is the golden format) through the SGLang-compatible classes
and reports the same metrics as the synthetic run, one row per page size.

Each trace is replayed twice: once to compile every shape bucket it touches, once timed
(per operation, through the eager class API, host conversion included). Recorded
results and lists, where the trace has them, are checked on the way (a mismatch raises
jax_kvalloc.tools.traces.TraceMismatch). A traces.PageTracker books the pages each
operation hands out and frees, for the fragmentation metric and the final leak check:
free + released + still held must be exactly pages 1..num_pages.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

import numpy as np

from jax_kvalloc.tools import traces
from jax_kvalloc.tools.simulate import (PageSizeResult, SimConfig, SimConfigError, SimResult,
                                        check_partition, device_name, percentile, versions)


def _replay_one(records, replayer: traces.Replayer, res: PageSizeResult, runs: List[int],
                runs_every: int) -> None:
  """Replays one trace into `res` (its counts, series and step times) and `runs` (the
  free-list census where the state is read back: recorded steps, every runs_every-th
  and the last)."""
  init = traces.init_args(records[0].get("args", {}))
  ps, num_pages = init["page_size"], init["size"] // init["page_size"]
  tracker = traces.PageTracker(ps)
  replayer.apply("init", records[0].get("args"))
  seen, last = replayer.observe(), len(records) - 1
  for step, rec in enumerate(records[1:], 1):
    op, args = rec["op"], rec.get("args") or {}
    t0 = time.perf_counter()
    result = replayer.apply(op, args)
    res.step_us.append((time.perf_counter() - t0) * 1e6)
    tracker.apply(op, args, result)
    if op in traces.ALLOC_OPS:
      res.alloc_failures += result is None
      res.tokens_allocated += len(result or ())
      res.decode_steps += op == "alloc_decode"
      res.prefill_steps += op != "alloc_decode"
    if any(k in rec for k in traces.STATE_FIELDS[1:]) or step % runs_every == 0 or step == last:
      seen = replayer.observe()
      diff = traces.compare(rec, dict(seen, result=result))
      if diff:
        raise traces.TraceMismatch(f"trace {rec['trace']!r} step {step} ({op}): {diff}")
      runs.append(int(np.sum(np.diff(seen["free_pages"]) != 1)) + bool(seen["free_pages"]))
      avail = seen["available_size"]
    else:
      avail = int(replayer.allocator.available_size())
    used = num_pages - avail // ps
    res.usage.append(used / num_pages)
    res.waste_peak_slots = max(res.waste_peak_slots, tracker.waste)
    res.waste_mean += tracker.waste / max(used * ps, 1)
  free = seen["free_pages"] + seen["release_pages"]
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
  by_ps: Dict[int, List[Any]] = {}
  for tid, init in inits.items():
    by_ps.setdefault(init["page_size"], []).append(tid)
  make = traces.jax_factory(cfg.kernel)
  out = []
  for ps in sorted(by_ps):
    pages = [inits[t]["size"] // ps for t in by_ps[ps]]
    res, runs, t0 = PageSizeResult(ps, max(pages), cfg.kernel), [], time.perf_counter()
    for tid in tqdm.tqdm(by_ps[ps], desc=f"page_size={ps}", unit="trace",
                         disable=not progress, leave=False):
      warm = traces.Replayer(make)
      for rec in all_traces[tid]:  # compile every shape bucket this trace uses
        warm.apply(rec["op"], rec.get("args"))
      _replay_one(all_traces[tid], traces.Replayer(make), res, runs, cfg.runs_every)
      res.requests_done += 1
    res.wall_s = time.perf_counter() - t0
    res.steps = len(res.step_us)
    res.waste_mean /= max(len(res.usage), 1)
    res.peak_usage = max(res.usage, default=0.0)
    res.mean_usage = float(np.mean(res.usage)) if res.usage else 0.0
    res.runs_mean = float(np.mean(runs)) if runs else 0.0
    res.step_us_p50, res.step_us_p99 = percentile(res.step_us, 50), percentile(res.step_us, 99)
    res.leak_check = (f"ok: free {res.free_pages_final} + in use {res.in_use_final} "
                      f"== {sum(pages)} ({len(pages)} traces)")
    out.append(res)
  conf = {"trace": path, "kernel": cfg.kernel, "runs_every": cfg.runs_every}
  return SimResult(conf, device_name(), versions(), out, mode="trace")
