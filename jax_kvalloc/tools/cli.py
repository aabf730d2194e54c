"""The `jax-kvalloc` command (`python -m jax_kvalloc` runs `simulate` with defaults).

  jax-kvalloc simulate [options]   a serving workload through the allocator (default)
  jax-kvalloc bench [options]      microbenchmarks and the serving-loop benchmark
  jax-kvalloc parity [options]     lock-step parity: jax_kvalloc, torch_ref, SGLang
  jax-kvalloc demo [options]       a toy decoder served through the request table
  jax-kvalloc bench-table [options] the serving loop through the request table, in one jit
  jax-kvalloc bench-swa [options]  SWA extend / decode / window free beside SGLang's SWA class
  jax-kvalloc report [--check] [DOC...]  BENCHMARKS.md's / README's tables from results

`jax-kvalloc COMMAND --help` lists each command's options.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from jax_kvalloc.config import KERNELS

COMMANDS = ("simulate", "bench", "parity", "demo", "bench-table", "bench-class", "bench-swa",
            "report")


def int_list(text: str) -> List[int]:
  """'1,16,64' -> [1, 16, 64] (argparse type)."""
  try:
    values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def name_list(choices: Sequence[str]):
  def parse(text: str) -> List[str]:
    values = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [v for v in values if v not in choices]
    if bad or not values:
      raise argparse.ArgumentTypeError(
          f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
    return values
  return parse


def _flatten(lists) -> List[int]:
  out: List[int] = []
  for x in lists:
    out.extend(x)
  return out


def simulate_parser(sub) -> argparse.ArgumentParser:
  from jax_kvalloc.tools.simulate import SimConfig  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools.workload import ARRIVALS  # pylint: disable=g-import-not-at-top
  d = SimConfig()
  p = sub.add_parser(
      "simulate", help="drive a serving workload through the allocator (default command)",
      description="Drives a serving workload through the allocator on the default JAX "
      "device (requests arrive, share prefixes, prefill in batches, decode, finish and "
      "are freed in free groups, under admission control that never over-commits the "
      "pool) once per page size, and prints a table per page size. Length "
      "distributions: const:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX], "
      "exp:MEAN[:MAX].",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--num-requests", type=int, default=d.num_requests, help="requests in the workload")
  a("--pool-size", type=int, default=d.pool_size, help="usable KV slots in the pool")
  a("--page-size", type=int_list, nargs="+", default=[list(d.page_sizes)],
    help="page size(s) to compare, e.g. 1,16,64 (1 = SGLang's token allocator)")
  a("--need-sort", action="store_true", help="park frees in release_pages (PD mode)")
  a("--arrival", choices=ARRIVALS, default=d.arrival, help="arrival pattern")
  a("--rate", type=float, default=d.rate, help="requests per step (poisson, uniform)")
  a("--prompt-len", default=d.prompt_len, help="prompt tokens after the shared prefix")
  a("--output-len", default=d.output_len, help="generated tokens per request")
  a("--num-prefixes", type=int, default=d.num_prefixes,
    help="shared-prefix groups (system prompts); 0 = no sharing")
  a("--prefix-len", default=d.prefix_len, help="tokens of each shared prefix")
  a("--share-prob", type=float, default=d.share_prob,
    help="probability that a request starts with a shared prefix")
  a("--max-running", type=int, default=d.max_running, help="request slots (decode batch)")
  a("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
    help="tokens per prefill batch (longer prompts are chunked)")
  a("--max-prefill-reqs", type=int, default=d.max_prefill_reqs, help="requests per prefill")
  a("--max-frees", type=int, default=d.max_frees, help="rows freed per free group")
  a("--seed", type=int, default=d.seed)
  a("--driver", choices=("device", "host"), default=d.driver,
    help="device: the scheduler runs on the device, --steps-per-call steps per host "
    "round trip; host: the host schedules and launches one jitted call per step")
  a("--steps-per-call", type=int, default=d.steps_per_call,
    help="scheduler iterations per jitted call (device driver)")
  a("--kernel", choices=KERNELS, default=d.kernel,
    help="implementations (jax_kvalloc.kernels; auto: Triton on GPU, Mosaic on TPU, jnp "
    "on CPU)")
  a("--swa-window", type=int, default=d.swa_window,
    help="tokens of a sliding window: run on the SWA allocator (a full pool and an SWA "
    "pool; each step frees the SWA pages that left the window; page sizes > 1, no prefix "
    "sharing); 0 = off")
  a("--swa-ratio", type=float, default=d.swa_ratio,
    help="with --swa-window: SWA pool slots = this * --pool-size, in whole pages")
  a("--no-guard", action="store_true",
    help="pools without the ownership record (AllocatorConfig(guard=False)): its cost")
  a("--trace", metavar="FILE", help="replay a recorded trace file (jax_kvalloc.traces / "
    "golden format) instead of the synthetic workload")
  a("--json", metavar="FILE", help="also write the results as JSON")
  a("--json-series", action="store_true",
    help="include the per-step series (pool usage, step time) in the JSON")
  a("--plot", metavar="FILE.png", help="draw pool usage over time and the per-step time "
    "distribution (needs matplotlib)")
  a("--no-progress", action="store_true", help="no progress bar")
  a("--inject-leak", action="store_true", help=argparse.SUPPRESS)
  return p


def run_simulate(args) -> int:
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import simulate  # pylint: disable=g-import-not-at-top
  cfg = simulate.SimConfig(
      num_requests=args.num_requests, pool_size=args.pool_size,
      page_sizes=tuple(_flatten(args.page_size)), need_sort=args.need_sort,
      arrival=args.arrival, rate=args.rate, prompt_len=args.prompt_len,
      output_len=args.output_len, num_prefixes=args.num_prefixes,
      prefix_len=args.prefix_len, share_prob=args.share_prob,
      max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
      max_prefill_reqs=args.max_prefill_reqs, max_frees=args.max_frees, seed=args.seed,
      kernel=args.kernel, driver=args.driver, steps_per_call=args.steps_per_call,
      inject_leak=args.inject_leak, swa_window=args.swa_window, swa_ratio=args.swa_ratio,
      guard=not args.no_guard)
  if args.plot:
    report.pyplot()  # fail before the run, not after it
  progress = not args.no_progress
  try:
    if args.trace:
      result = simulate.run_trace(cfg, args.trace, progress=progress)
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
      f", need_sort={cfg.need_sort}, seed {cfg.seed}") + (
          f"; SWA window {cfg.swa_window} tokens, SWA pool {cfg.swa_ratio} x the full "
          f"pool" if cfg.swa_window and not args.trace else "")
  v = result.versions
  print(f"jax-kvalloc simulate: {what}")
  print(f"device {result.device}; kernel={cfg.kernel}; jax {v['jax']}, python {v['python']}")
  rows = simulate.summary_rows(result)
  print(report.table(["metric"] + [f"page_size={p}" for p in rows[0][1]],
                     [[name] + vals for name, vals in rows[1:]]))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of the `jax-kvalloc` console script and of `python -m jax_kvalloc`."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "parity":  # its own parser: options as documented in parity.py
    from jax_kvalloc.tools import parity  # pylint: disable=g-import-not-at-top
    return parity.main(argv[1:])
  parser = argparse.ArgumentParser(
      prog="jax-kvalloc", description=__doc__.split("\n\n")[0].strip() + ".",
      epilog="Without a command, runs `simulate`.")
  sub = parser.add_subparsers(dest="command",
                              metavar="{simulate,bench,parity,demo,bench-table,bench-class,bench-swa,report}")
  simulate_parser(sub)
  from jax_kvalloc.tools import bench  # pylint: disable=g-import-not-at-top
  bench.add_parser(sub)
  from jax_kvalloc.tools import demo  # pylint: disable=g-import-not-at-top
  demo.add_parser(sub)
  from jax_kvalloc.tools import bench_table  # pylint: disable=g-import-not-at-top
  bench_table.add_parser(sub)
  from jax_kvalloc.tools import bench_class  # pylint: disable=g-import-not-at-top
  bench_class.add_parser(sub)
  from jax_kvalloc.tools import bench_swa  # pylint: disable=g-import-not-at-top
  bench_swa.add_parser(sub)
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  report.add_parser(sub)
  if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
    argv = ["simulate"] + argv
  args = parser.parse_args(argv)
  if args.command == "bench":
    return bench.run_cli(args)
  if args.command == "demo":
    return demo.run_cli(args)
  if args.command == "bench-table":
    return bench_table.run_cli(args)
  if args.command == "bench-class":
    return bench_class.main_args(args)
  if args.command == "bench-swa":
    return bench_swa.main_args(args)
  if args.command == "report":
    return report.run_report(args.docs, check=args.check)
  return run_simulate(args)


if __name__ == "__main__":
  sys.exit(main())
