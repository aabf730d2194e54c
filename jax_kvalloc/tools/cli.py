"""The `jax-kvalloc` command: one subcommand per tool, user errors in one line.

A command is one line of COMMANDS: (name, module, help); the module defines
`add_arguments(parser)` and `run(args) -> int` (the exit status) and is imported only
when named. A bad option value fails inside argparse (the types below), a check that
needs the run's context raises `UsageError(option, what is allowed)`: either way one
line, `jax-kvalloc CMD: error: --option: ...`, and exit status 2; any other exception
keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

COMMANDS = (
    ("simulate", "jax_kvalloc.tools.simulate_cli",
     "a simulated serving workload through the allocator"),
    ("bench", "jax_kvalloc.tools.bench",
     "benchmark suites: kernels, serving loop, request table, classes, SWA, ranks, "
     "processes, simulate"),
    ("parity", "jax_kvalloc.tools.parity",
     "replay allocator traces through jax_kvalloc, torch_ref and SGLang in lock step"),
    ("report", "jax_kvalloc.tools.report",
     "BENCHMARKS.md's and the README's generated tables from the result folders"),
    ("serve", "jax_kvalloc.serve.cli",
     "generate with a real model (SmolLM2-135M GGUF) through the request table"),
    ("export-hf", "jax_kvalloc.serve.export_hf",
     "write a GGUF model (SmolLM2-135M) as a Hugging Face folder (config, safetensors, "
     "tokenizer)"),
)


class UsageError(Exception):
  """A user error found after parsing: `option` and what it allows, shown in one line."""

  def __init__(self, option: str, message: str):
    super().__init__(f"{option}: {message}")


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (no usage block) and exit with 2."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def show(value: Any, sep: str = ",") -> str:
  """A default as a user types it: lists joined by `sep`, nested lists flattened."""
  if isinstance(value, (list, tuple)):
    return sep.join(show(v, sep) for v in value)
  if isinstance(value, float):
    return f"{value:g}"
  return str(value)


class Formatter(argparse.RawDescriptionHelpFormatter):
  """Appends "(default: X)" to an option's help, X as a user types it; nothing for
  flags, None, or help that already names its default."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    d = action.default
    if (d is None or d is False or d is argparse.SUPPRESS or "default" in text
        or isinstance(action, argparse._StoreConstAction)):  # pylint: disable=protected-access
      return text
    sep = " " if action.nargs in ("*", "+") else ","
    return f"{text} (default: {show(d, sep)})".replace("%", "%%")


def _split(text: str) -> List[str]:
  return list(filter(None, text.replace(" ", "").split(",")))


def int_list(text: str) -> List[int]:
  """'1,16,64' -> [1, 16, 64], each >= 1 (argparse type)."""
  try:
    values = [int(v) for v in _split(text)]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def name_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
  """An argparse type: a comma-separated, non-empty subset of `choices`."""
  def parse(text: str) -> List[str]:
    values = _split(text)
    if not values or any(v not in choices for v in values):
      raise argparse.ArgumentTypeError(
          f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
    return values
  return parse


def positive(kind: Callable[[str], Any] = int, minimum: Any = 1,
             maximum: Optional[Any] = None) -> Callable[[str], Any]:
  """An argparse type: `kind(text)` within [minimum, maximum]."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}")
    if value < minimum or (maximum is not None and value > maximum):
      top = f" and <= {maximum}" if maximum is not None else ""
      raise argparse.ArgumentTypeError(f"must be >= {minimum}{top}, got {text!r}")
    return value
  parse.__name__ = kind.__name__
  return parse


def pairs(what: str, example: str) -> Callable[[str], List[Tuple[int, int]]]:
  """An argparse type: 'AxB,...' (`what`, e.g. BSxTOKENS) -> [(A, B), ...], each >= 1."""
  def parse(text: str) -> List[Tuple[int, int]]:
    try:
      out = [tuple(int(v) for v in item.lower().split("x")) for item in _split(text)]
    except ValueError:
      out = []
    if not out or any(len(p) != 2 or min(p) < 1 for p in out):
      raise argparse.ArgumentTypeError(f"expected {what},... (e.g. {example}), got {text!r}")
    return out
  return parse


def existing_file(text: str) -> str:
  """An argparse type: a path to a file that exists."""
  if not os.path.isfile(text):
    raise argparse.ArgumentTypeError(f"no such file: {text!r}")
  return text


def check_kernel(kernel: str, platform: Optional[str] = None,
                 option: str = "--kernel") -> None:
  """UsageError naming `option` when `kernel` cannot run on `platform` (None: the default
  JAX backend), found before anything is compiled (jax_kvalloc.kernels.unavailable)."""
  from jax_kvalloc import kernels  # pylint: disable=g-import-not-at-top  (imports jax)
  from jax_kvalloc.config import KERNELS  # pylint: disable=g-import-not-at-top
  if kernel not in KERNELS:
    raise UsageError(option, f"must be one of {', '.join(KERNELS)}, got {kernel!r}")
  why = kernels.unavailable(kernel, platform)
  if why:
    raise UsageError(option, f"{kernel} cannot run here: {why} (auto and jnp run on "
                     "every backend)")


def build(argv: Sequence[str]) -> argparse.ArgumentParser:
  """The parser; the arguments of the command named first in `argv` only (lazy imports)."""
  parser = Parser(prog="jax-kvalloc", formatter_class=Formatter,
                  description="A JAX KV-cache slot allocator: its tools.",
                  epilog="`jax-kvalloc COMMAND --help` lists a command's options.")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
  for name, module, text in COMMANDS:
    p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                       formatter_class=Formatter)
    if argv and argv[0] == name:
      mod = importlib.import_module(module)
      mod.add_arguments(p)
      p.set_defaults(run=mod.run)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of the `jax-kvalloc` console script and of `python -m jax_kvalloc`."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build(argv)
  args = parser.parse_args(argv)
  if not args.command:
    parser.print_help()
    return 2
  try:
    return args.run(args)
  except UsageError as e:
    print(f"jax-kvalloc {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
