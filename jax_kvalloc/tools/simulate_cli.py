"""`jax-kvalloc simulate`: the main job's options and printout (the run: tools/simulate.py).

Length distributions: const:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX], exp:MEAN[:MAX].

Compiled programs go to a persistent compilation cache (`--compile-cache`, by default in
the user's cache folder), so a second run loads them instead of compiling.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import List, Optional

from jax_kvalloc.tools import simulate
from jax_kvalloc.tools.cli import check_kernel, existing_file, int_list


def _typed(field: str):
  """The argparse type of a setting: its default's type, then simulate.RULES."""
  kind = type(getattr(simulate.SimConfig(), field))
  test, allowed = simulate.RULES[field]

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not test(value):
      raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    return value
  parse.__name__ = kind.__name__
  return parse


def options() -> List[dataclasses.Field]:
  """The SimConfig fields that are options (their metadata holds the help)."""
  return [f for f in dataclasses.fields(simulate.SimConfig) if "help" in f.metadata]


def default_cache_dir() -> str:
  """$XDG_CACHE_HOME (else ~/.cache)/jax-kvalloc/xla."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax-kvalloc", "xla")


def add_arguments(p: argparse.ArgumentParser) -> None:
  d = simulate.SimConfig()
  p.description = (
      "Drives a serving workload through the allocator on the default JAX device "
      "(requests arrive, share prefixes, prefill in batches, decode, finish and are "
      "freed in free groups, under admission control that never over-commits the pool) "
      "once per page size, and prints a table with a column per page size.\n\n"
      + __doc__.split("\n\n", 1)[1])
  a = p.add_argument
  a("--page-size", type=int_list, default=list(d.page_sizes), dest="page_sizes",
    metavar="SIZES", help="page sizes to compare; 1 is SGLang's token allocator")
  a("--need-sort", action="store_true", help="park frees in release_pages (PD mode)")
  a("--no-guard", action="store_true", help="drop the pools' ownership record "
    "(AllocatorConfig(guard=False), SPEC 14): SGLang's costs and trust")
  choices = {"arrival": simulate.ARRIVALS, "driver": simulate.DRIVERS,
             "kernel": simulate.KERNELS}
  for field in options():
    kw = {"choices": choices[field.name]} if field.name in choices else {
        "type": _typed(field.name)}
    a(simulate.option(field.name), default=field.default, help=field.metadata["help"], **kw)
  a("--trace", metavar="FILE", type=existing_file, help="replay a recorded trace file "
    "(jax_kvalloc.tools.traces / golden format) instead of the synthetic workload")
  a("--json", metavar="FILE", help="also write the results as JSON")
  a("--json-series", action="store_true",
    help="include the per-step series (pool usage, step time, records) in the JSON")
  a("--plot", metavar="FILE.png", help="draw pool usage over time and the per-step time "
    "distribution (needs matplotlib)")
  a("--compile-cache", metavar="DIR", help="keep compiled programs in DIR, so that the "
    "next run starts warm (default: $XDG_CACHE_HOME/jax-kvalloc/xla, else "
    "~/.cache/jax-kvalloc/xla)")
  a("--no-compile-cache", action="store_true", help="compile everything, keep nothing")
  a("--no-progress", action="store_true", help="no progress bar")


@contextlib.contextmanager
def persistent_cache(path: Optional[str]):
  """JAX's persistent compilation cache in `path` inside the block, the previous settings
  back after it (None: nothing changes)."""
  if path is None:
    yield
    return
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.warmup import enable_persistent_cache  # pylint: disable=g-import-not-at-top
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  saved = [getattr(jax.config, k) for k in keys]
  os.makedirs(path, exist_ok=True)
  compilation_cache.reset_cache()
  enable_persistent_cache(path)
  try:
    yield
  finally:
    for k, v in zip(keys, saved):
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def run(args) -> int:
  """0; 1 on allocation failures; 2 on a failed leak check (a user error raises
  simulate.SimConfigError, a cli.UsageError: one line, status 2); 3 when a replayed
  trace disagrees."""
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  cfg = simulate.SimConfig(page_sizes=tuple(args.page_sizes), need_sort=args.need_sort,
                           guard=not args.no_guard,
                           **{f.name: getattr(args, f.name) for f in options()})
  for opt, path in (("--json", args.json), ("--plot", args.plot)):
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
      raise simulate.SimConfigError(opt, f"no such folder: {folder}")
  if args.plot:
    try:
      report.pyplot()  # fail before the run, not after it
    except RuntimeError as e:
      raise simulate.SimConfigError("--plot", str(e)) from None
  check_kernel(cfg.kernel)  # before anything compiles
  progress = not args.no_progress
  cache = None if args.no_compile_cache else (args.compile_cache or default_cache_dir())
  try:
    with persistent_cache(cache):
      if args.trace:
        from jax_kvalloc.tools import simulate_trace  # pylint: disable=g-import-not-at-top
        result = simulate_trace.run(cfg, args.trace, progress=progress)
      else:
        result = simulate.run(cfg, progress=progress)
  except simulate.LeakCheckError as e:
    print(f"\nLEAK CHECK FAILED: {e}", file=sys.stderr)
    return 2
  except AssertionError as e:  # traces.TraceMismatch: a replayed op disagreed
    print(f"\nTRACE MISMATCH: {e}", file=sys.stderr)
    return 3
  what = f"trace {args.trace}" if args.trace else (
      f"{cfg.num_requests} requests, {cfg.arrival} arrivals at {cfg.rate}/step, pool "
      f"{cfg.pool_size} slots, prompt {cfg.prompt_len} (+ shared prefix {cfg.prefix_len}"
      f" with p={cfg.share_prob} over {cfg.num_prefixes} groups), output {cfg.output_len}"
      f", need_sort={cfg.need_sort}" + ", guard=False" * (not cfg.guard) +
      f", seed {cfg.seed}") + (
          f"; SWA window {cfg.swa_window} tokens, SWA pool {cfg.swa_ratio} x the full "
          f"pool" if cfg.swa_window and not args.trace else "")
  v = result.versions
  print(f"jax-kvalloc simulate: {what}")
  print(f"device {result.device}; kernel={cfg.kernel}; jax {v['jax']}, python {v['python']}")
  rows = simulate.summary_rows(result)
  print(report.table(["metric"] + [f"page_size={p}" for p in rows[0][1]],
                     [[name] + vals for name, vals in rows[1:]]))
  if not args.trace:
    print(simulate.compile_line(result))
  if args.json:
    report.write_json(args.json, simulate.to_json(result, series=args.json_series))
    print(f"wrote {args.json}")
  if args.plot:
    simulate.plot(result, args.plot)
    print(f"wrote {args.plot}")
  failures = sum(r.alloc_failures for r in result.results)
  if failures and not args.trace:
    print(f"\nALLOCATION FAILURES: {failures} (admission control should prevent every one)",
          file=sys.stderr)
    return 1
  return 0
