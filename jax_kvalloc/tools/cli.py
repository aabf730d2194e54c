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
  from jax_kvalloc.tools import simulate  # pylint: disable=g-import-not-at-top
  simulate.add_parser(sub)
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
  return simulate.run_cli(args)


if __name__ == "__main__":
  sys.exit(main())
