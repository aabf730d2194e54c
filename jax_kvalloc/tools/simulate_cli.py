"""`jax-kvalloc simulate`: the options and the printout of the main job (tools/simulate.py).

Length distributions: const:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX], exp:MEAN[:MAX].
"""
from __future__ import annotations

import argparse
import sys

from jax_kvalloc.config import KERNELS
from jax_kvalloc.tools.cli import existing_file, int_list, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
  from jax_kvalloc.tools.simulate import SimConfig  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools.workload import ARRIVALS  # pylint: disable=g-import-not-at-top
  d = SimConfig()
  p.description = (
      "Drives a serving workload through the allocator on the default JAX device "
      "(requests arrive, share prefixes, prefill in batches, decode, finish and are "
      "freed in free groups, under admission control that never over-commits the pool) "
      "once per page size, and prints a table per page size.\n\n" + __doc__.split("\n\n")[1])
  a = p.add_argument
  a("--num-requests", type=positive(), default=d.num_requests, help="requests in the workload")
  a("--pool-size", type=positive(), default=d.pool_size, help="usable KV slots in the pool")
  a("--page-size", type=int_list, default=list(d.page_sizes),
    help="page sizes to compare (1 = SGLang's token allocator)")
  a("--need-sort", action="store_true", help="park frees in release_pages (PD mode)")
  a("--arrival", choices=ARRIVALS, default=d.arrival, help="arrival pattern")
  a("--rate", type=positive(float, 0.0), default=d.rate,
    help="requests per step (poisson, uniform)")
  a("--prompt-len", default=d.prompt_len, help="prompt tokens after the shared prefix")
  a("--output-len", default=d.output_len, help="generated tokens per request")
  a("--num-prefixes", type=positive(minimum=0), default=d.num_prefixes,
    help="shared-prefix groups (system prompts); 0 = no sharing")
  a("--prefix-len", default=d.prefix_len, help="tokens of each shared prefix")
  a("--share-prob", type=positive(float, 0.0, 1.0), default=d.share_prob,
    help="probability that a request starts with a shared prefix")
  a("--max-running", type=positive(), default=d.max_running, help="request slots (decode batch)")
  a("--max-prefill-tokens", type=positive(), default=d.max_prefill_tokens,
    help="tokens per prefill batch (longer prompts are chunked)")
  a("--max-prefill-reqs", type=positive(), default=d.max_prefill_reqs,
    help="requests per prefill")
  a("--max-frees", type=positive(), default=d.max_frees, help="rows freed per free group")
  a("--seed", type=int, default=d.seed, help="seed of the workload")
  a("--driver", choices=("device", "host"), default=d.driver,
    help="device: the scheduler runs on the device, --steps-per-call steps per host "
    "round trip; host: the host schedules and launches one jitted call per step")
  a("--steps-per-call", type=positive(), default=d.steps_per_call,
    help="scheduler iterations per jitted call (device driver)")
  a("--kernel", choices=KERNELS, default=d.kernel,
    help="implementations (jax_kvalloc.kernels; auto: Triton on GPU, Mosaic on TPU, jnp "
    "on CPU)")
  a("--swa-window", type=positive(minimum=0), default=d.swa_window,
    help="tokens of a sliding window: run on the SWA allocator (a full pool and an SWA "
    "pool; each step frees the SWA pages that left the window; page sizes > 1, no prefix "
    "sharing); 0 = off")
  a("--swa-ratio", type=positive(float, 0.0, 1.0), default=d.swa_ratio,
    help="with --swa-window: SWA pool slots = this * --pool-size, in whole pages")
  a("--trace", metavar="FILE", type=existing_file,
    help="replay a recorded trace file (jax_kvalloc.tools.traces / golden format) instead "
    "of the synthetic workload")
  a("--json", metavar="FILE", help="also write the results as JSON")
  a("--json-series", action="store_true",
    help="include the per-step series (pool usage, step time) in the JSON")
  a("--plot", metavar="FILE.png", help="draw pool usage over time and the per-step time "
    "distribution (needs matplotlib)")
  a("--no-progress", action="store_true", help="no progress bar")
  a("--inject-leak", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import simulate  # pylint: disable=g-import-not-at-top
  cfg = simulate.SimConfig(
      num_requests=args.num_requests, pool_size=args.pool_size,
      page_sizes=tuple(args.page_size), need_sort=args.need_sort,
      arrival=args.arrival, rate=args.rate, prompt_len=args.prompt_len,
      output_len=args.output_len, num_prefixes=args.num_prefixes,
      prefix_len=args.prefix_len, share_prob=args.share_prob,
      max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
      max_prefill_reqs=args.max_prefill_reqs, max_frees=args.max_frees, seed=args.seed,
      kernel=args.kernel, driver=args.driver, steps_per_call=args.steps_per_call,
      inject_leak=args.inject_leak, swa_window=args.swa_window, swa_ratio=args.swa_ratio)
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
