"""Cross-implementation parity: replays allocator traces through jax_kvalloc, torch_ref
and (when installed) SGLang itself, step by step, and reports the first mismatch.

    jax-kvalloc parity TRACE.jsonl [--device cpu|cuda] [--kernel jnp|triton|...]
    jax-kvalloc parity --generate N --seed S [--steps K] [--write OUT.jsonl]

The trace format (JSON lines of operations, optionally with expected results and lists)
is documented in jax_kvalloc.traces. After every step it compares each implementation's
result (slot ids, or failure), full free_pages and release_pages lists and
available_size against the trace's recorded fields (where given) and against the first
implementation, jax_kvalloc. Exit status: 0 all steps matched, 1 a mismatch (the message names the trace, the step,
the op and the first differing index), 2 bad arguments or trace file, 3 a required
implementation is not available.

Usage
-----
    python -m torch_ref.parity TRACE.jsonl [TRACE2.jsonl ...] [options]
    python -m torch_ref.parity --generate N --seed S [--steps K] [options]

replays traces (the JSON-lines format documented in jax_kvalloc.traces: one operation a
line, optionally with its expected result, free_pages, release_pages and available_size)
through jax_kvalloc, torch_ref and, when the `sglang` package is importable, SGLang's own
allocator, in lock step. After every step it compares each one's result (slot ids or
failure), full free and release lists (SGLang's release list as a set: newer releases
keep it unordered) and available_size with the trace and with jax_kvalloc. `--generate`
makes seeded serving workloads instead (arrivals, shared prefixes, chunked prefill
batches, decode, speculative steps with snapshots and rollbacks, random finishes, free
groups, evictions; page sizes 1, 4, 16, 64; need_sort on and off; pools that run out),
driven by jax_kvalloc, with a leak check at every step.

Options: --device cpu|cuda (default cpu); --kernel jnp|triton|triton_interpret|auto|...
(jax_kvalloc's index kernel, default jnp); --torch-kernel triton|torch|auto or a comma
list such as triton,torch to compare both (default triton; on cpu it sets
TRITON_INTERPRET=1); --impls jax,torch (which to run besides SGLang, the first one
leading; `--impls torch` checks torch_ref alone against a file's recorded results);
--sglang auto|on|off; --steps K (default 300) --page-sizes 1,4,16,64 --scale ci|long
(pool and batch sizes, default ci on cpu and long on cuda) --need-sort mixed|on|off;
--segment-prob P (chance that a finished request is freed through SPEC 10's
free_segment / free_page_ids, default 0.25; 0 gives the traces of earlier versions);
--write OUT.jsonl saves the generated traces (and, on a mismatch, the trace up to it,
for replay); --quiet.

It prints one line per trace and a summary ("parity OK: ... steps ... matched by ..."),
or the first mismatch: trace, step, op and arguments, which implementations disagree,
and the field (result, free_pages, release_pages, available_size) with its first
differing index (or, if one raised, its exception), and saves the trace up to there.
Exit status 0 (all matched), 1 (mismatch or exception), 2 (bad arguments or trace
file), 3 (a requested implementation is unavailable).

Examples:
    python -m torch_ref.parity my_trace.jsonl --torch-kernel torch      # quick, CPU
    python -m torch_ref.parity --generate 12 --seed 300 --steps 250     # Triton interp.
    python -m torch_ref.parity --device cuda --kernel triton --torch-kernel triton,torch
        --generate 4 --seed 1000 --steps 3000                           # H200, one line
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from jax_kvalloc.config import KERNELS
from jax_kvalloc.tools import traces


@dataclasses.dataclass
class Impl:
  """One implementation under comparison.

  name: how reports call it. replayer: drives it. skip: skip(init_args) gives a reason
  why it cannot run a trace of that pool, or None.
  """
  name: str
  replayer: traces.Replayer
  skip: Callable[[Dict[str, Any]], Optional[str]] = lambda init: None


class ParityMismatch(AssertionError):
  """Two implementations (or one and the trace) disagreed; the message says where."""

  def __init__(self, message: str, records: Sequence[traces.Record] = ()):
    super().__init__(message)
    self.records = list(records)


@dataclasses.dataclass
class Stats:
  traces: int = 0
  steps: int = 0
  failed_allocs: int = 0
  shortfall_merges: int = 0
  emptied: int = 0     # successful allocations that took the last free page
  recorded: int = 0    # steps whose trace record carried expected fields
  compared: Dict[str, int] = dataclasses.field(default_factory=dict)  # impl -> steps
  skipped: Dict[str, str] = dataclasses.field(default_factory=dict)   # impl -> reason

  def count(self, prev: Optional[traces.Record], rec: traces.Record) -> None:
    self.steps += 1
    if rec["op"].startswith("alloc") and rec.get("result", []) is None:
      self.failed_allocs += 1
    elif (rec["op"].startswith("alloc") and prev is not None and prev.get("free_pages")
          and rec.get("free_pages") == []):
      self.emptied += 1
    if (prev is not None and rec["op"].startswith("alloc") and prev.get("release_pages")
        and not rec.get("release_pages")):
      self.shortfall_merges += 1


# ---------------------------------------------------------------------------------------
# Implementations.
# ---------------------------------------------------------------------------------------

def jax_impl(kernel: str = "jnp", device: str = "cpu", backend: str = "device") -> Impl:
  """jax_kvalloc's SGLang-compatible classes, with the given index kernel and backend
  ("host": NumPy state, the index kernel unused)."""
  name = f"jax_kvalloc[{kernel}]" if backend == "device" else "jax_kvalloc[host]"
  return Impl(name, traces.Replayer(traces.jax_factory(kernel, device, backend)))


def torch_impl(kernel: str = "auto", device: str = "cpu") -> Impl:
  """torch_ref's allocators on `device`, with the Triton or the plain-torch index path."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch_ref  # pylint: disable=g-import-not-at-top
  from torch_ref.paged import triton_usable  # pylint: disable=g-import-not-at-top
  dev = torch.device(device)
  resolved = kernel if kernel != "auto" else ("triton" if triton_usable(dev) else "torch")

  def make(size, page_size, need_sort, kind):
    if kind == "token":
      return torch_ref.TokenToKVPoolAllocator(size, device=dev, need_sort=need_sort)
    return torch_ref.PagedTokenToKVPoolAllocator(size, page_size, device=dev,
                                                 need_sort=need_sort, kernel=resolved)
  return Impl(f"torch_ref[{resolved}, {dev}]",
              traces.Replayer(make, _torch_array(dev), _torch_array(torch.device("cpu"))))


def sglang_impl(device: str = "cpu") -> Impl:
  """The installed SGLang's allocators (see torch_ref.sglang_oracle)."""
  import torch  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  dev = torch.device(device)

  def make(size, page_size, need_sort, kind):
    return sglang_oracle.SGLangAllocator(size, page_size, need_sort, kind, dev)

  def skip(init):
    return sglang_oracle.unsupported_reason(**init)
  return Impl(f"sglang {sglang_oracle.version()}",
              traces.Replayer(make, _torch_array(dev), _torch_array(torch.device("cpu")),
                              release_unordered=True), skip)


def _torch_array(device):
  import torch  # pylint: disable=g-import-not-at-top
  return lambda values: torch.tensor(values, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------
# Lock-step comparison.
# ---------------------------------------------------------------------------------------

def _describe(trace_id: Any, step: int, rec: traces.Record) -> str:
  args = ", ".join(f"{k}={v}" for k, v in (rec.get("args") or {}).items())
  if len(args) > 300:
    args = args[:300] + "..."
  return f"trace {trace_id!r} step {step} ({rec['op']} {args})"


def _step(impl: Impl, trace_id: Any, step: int, rec: traces.Record,
          records: Sequence[traces.Record]) -> traces.Record:
  """impl.replayer.step, with an exception turned into a report naming the step."""
  try:
    return impl.replayer.step(rec["op"], rec.get("args"))
  except Exception as e:  # pylint: disable=broad-except
    raise ParityMismatch(f"ERROR {_describe(trace_id, step, rec)}: {impl.name} raised "
                         f"{type(e).__name__}: {e}", records) from e


def _check_step(trace_id: Any, step: int, rec: traces.Record, lead: Impl,
                others: Sequence[Impl], stats: Stats, records: List[traces.Record]) -> None:
  """Steps every other implementation and compares it with the lead's record."""
  for impl in others:
    got = _step(impl, trace_id, step, rec, records)
    diff = traces.compare(rec, got, release_unordered=impl.replayer.release_unordered)
    if diff:
      raise ParityMismatch(f"MISMATCH {_describe(trace_id, step, rec)}: {impl.name} vs "
                           f"{lead.name}: {diff}", records)
    stats.compared[impl.name] = stats.compared.get(impl.name, 0) + 1


def _active(impls: Sequence[Impl], init: Dict[str, Any], stats: Stats) -> List[Impl]:
  out = []
  for impl in impls:
    reason = impl.skip(init)
    if reason:
      stats.skipped[impl.name] = reason
    else:
      out.append(impl)
  return out


def replay_trace(records: Sequence[traces.Record], impls: Sequence[Impl],
                 stats: Optional[Stats] = None) -> Stats:
  """Replays one recorded trace through every implementation in lock step.

  Each step of the first active implementation (the lead) is checked against the
  trace's recorded fields, and every other one against the lead. Raises ParityMismatch
  on the first difference.
  """
  stats = stats or Stats()
  trace_id = records[0]["trace"]
  active = _active(impls, traces.init_args(records[0].get("args", {})), stats)
  lead, others = active[0], active[1:]
  done: List[traces.Record] = []
  prev = None
  for step, want in enumerate(records):
    stats.recorded += any(f in want for f in traces.STATE_FIELDS)
    got = dict(want, **_step(lead, trace_id, step, want, done + [want]))
    diff = traces.compare(want, got, release_unordered=lead.replayer.release_unordered)
    if diff:
      raise ParityMismatch(f"MISMATCH {_describe(trace_id, step, want)}: {lead.name} vs "
                           f"the trace: {diff}", done + [want])
    done.append(got)
    _check_step(trace_id, step, got, lead, others, stats, done)
    stats.count(prev, got)
    prev = got
  stats.traces += 1
  return stats


def run_generated(config: traces.WorkloadConfig, impls: Sequence[Impl],
                  stats: Optional[Stats] = None) -> List[traces.Record]:
  """Generates the trace of `config` with the first active implementation driving the
  workload, stepping the others in lock step. Returns the trace; raises ParityMismatch
  (carrying the trace so far) on the first difference, and on a leak of the lead."""
  stats = stats or Stats()
  active = _active(impls, config.init_args(), stats)
  lead, others = active[0], active[1:]
  records: List[traces.Record] = []
  prev: List[Optional[traces.Record]] = [None]

  def on_step(step: int, rec: traces.Record) -> None:
    records.append(rec)
    _check_step(config.seed, step, rec, lead, others, stats, records)
    stats.count(prev[0], rec)
    prev[0] = rec

  try:
    traces.generate(config, lead.replayer, trace_id=config.seed, on_step=on_step)
  except traces.TraceMismatch as e:
    raise ParityMismatch(f"MISMATCH (leak check of {lead.name}) {e}", records) from e
  stats.traces += 1
  return records


# ---------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jax-kvalloc parity",
      description="Replay allocator traces through jax_kvalloc, torch_ref and SGLang in "
                  "lock step; report the first mismatch.")
  p.add_argument("trace", nargs="*", help="trace files (JSON lines, see jax_kvalloc.traces)")
  p.add_argument("--generate", type=int, default=0, metavar="N",
                 help="also generate N workload traces (seeds S..S+N-1)")
  p.add_argument("--seed", type=int, default=0, metavar="S")
  p.add_argument("--steps", type=int, default=300, help="operations per generated trace")
  p.add_argument("--page-sizes", default="1,4,16,64",
                 help="page sizes generated traces draw from (comma-separated)")
  p.add_argument("--scale", choices=sorted(traces.SCALES), default=None,
                 help="pool and batch sizes of generated traces (default: ci on cpu, "
                      "long on cuda)")
  p.add_argument("--need-sort", choices=("mixed", "on", "off"), default="mixed")
  p.add_argument("--segment-prob", type=float, default=0.25, metavar="P",
                 help="chance that a generated trace frees a finished request through "
                      "free_segment/free_page_ids (SPEC 10); 0: traces of earlier "
                      "versions")
  p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                 help="device of the jax and torch allocators")
  p.add_argument("--kernel", default="jnp",
                 choices=KERNELS, help="jax_kvalloc's implementations (jax_kvalloc.kernels)")
  p.add_argument("--torch-kernel", default="triton",
                 help="torch_ref's index path: triton, torch or auto, or a comma list to "
                      "compare several (triton on cpu runs Triton's interpreter, "
                      "TRITON_INTERPRET=1, set automatically)")
  p.add_argument("--sglang", choices=("auto", "on", "off"), default="auto",
                 help="compare with the installed SGLang too (auto: when importable)")
  p.add_argument("--impls", default="jax,torch",
                 help="implementations to compare besides SGLang, the first leading "
                      "(default jax,torch; jax-host is jax_kvalloc's host backend; e.g. "
                      "torch alone checks torch_ref against a trace file's recorded "
                      "results without compiling any jax)")
  p.add_argument("--write", metavar="OUT.jsonl",
                 help="write the generated traces (or, on a mismatch, the trace so far)")
  p.add_argument("--quiet", action="store_true", help="print only the summary")
  return p


def _build(args: argparse.Namespace) -> List[Impl]:
  """The implementations the arguments ask for; RuntimeError/ImportError if one is
  unavailable."""
  torch_kernels = [k.strip() for k in args.torch_kernel.split(",") if k.strip()]
  if not torch_kernels or set(torch_kernels) - {"triton", "torch", "auto"}:
    raise RuntimeError(f"--torch-kernel {args.torch_kernel!r}: use triton, torch, auto "
                       f"or a comma list of them")
  makers = {"jax": lambda: [jax_impl(args.kernel, args.device)],
            "jax-host": lambda: [jax_impl(args.kernel, args.device, "host")],
            "torch": lambda: [torch_impl(k, args.device) for k in torch_kernels]}
  names = [n.strip() for n in args.impls.split(",") if n.strip()]
  unknown = [n for n in names if n not in makers]
  if unknown or not names:
    raise RuntimeError(f"--impls: unknown {unknown}; choose from {sorted(makers)}")
  if "torch" in names and "triton" in torch_kernels:
    if args.device == "cpu":
      os.environ["TRITON_INTERPRET"] = "1"   # before torch_ref.triton_kernels is imported
    import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  impls = [impl for n in names for impl in makers[n]()]
  if args.sglang != "off":
    from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
    err = sglang_oracle.import_error()
    if err is None:
      impls.append(sglang_impl(args.device))
    elif args.sglang == "on":
      raise RuntimeError(err)
    else:
      print(f"parity: SGLang oracle skipped: {err}", file=sys.stderr)
  return impls


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if not args.trace and not args.generate:
    _parser().error("give a trace file or --generate N")
  try:
    page_sizes = tuple(int(x) for x in args.page_sizes.split(","))
    inputs = [(path, traces.read(path)) for path in args.trace]
  except (OSError, ValueError) as e:
    print(f"parity: {e}", file=sys.stderr)
    return 2
  if args.device == "cuda":
    # jax and torch share the GPU: keep jax from taking 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  try:
    impls = _build(args)
  except (ImportError, RuntimeError) as e:
    print(f"parity: {e}", file=sys.stderr)
    return 3
  scale = args.scale or ("long" if args.device == "cuda" else "ci")
  need_sort = {"mixed": None, "on": True, "off": False}[args.need_sort]
  stats = Stats()
  written: List[traces.Record] = []
  t0 = time.time()
  say = (lambda *a: None) if args.quiet else print
  try:
    for path, by_id in inputs:
      for tid, records in by_id.items():
        n = stats.steps
        replay_trace(records, impls, stats)
        say(f"{path} trace {tid!r}: {stats.steps - n} steps match")
    for i in range(args.generate):
      config = traces.random_config(args.seed + i, steps=args.steps, page_sizes=page_sizes,
                                    scale=scale, need_sort=need_sort,
                                    segment_prob=args.segment_prob)
      n, f = stats.steps, stats.failed_allocs
      written += run_generated(config, impls, stats)
      say(f"seed {config.seed}: {config.resolved_kind} page_size={config.page_size} "
          f"size={config.size} need_sort={config.need_sort}: {stats.steps - n} steps "
          f"match ({stats.failed_allocs - f} failed allocations)")
  except ParityMismatch as e:
    print(str(e))
    path = args.write or tempfile.mkstemp(prefix="parity_mismatch_", suffix=".jsonl")[1]
    traces.write(path, written + e.records)
    print(f"parity: the trace up to the mismatch is in {path} (replay it: "
          f"jax-kvalloc parity {path})")
    return 1
  if args.write and written:
    traces.write(args.write, written)
  names = ", ".join(f"{name} ({n} steps)" for name, n in stats.compared.items())
  recorded = (f" (and matched the recorded results of {stats.recorded} steps)"
              if stats.recorded else "")
  print(f"parity OK: {stats.traces} traces, {stats.steps} steps; {impls[0].name} "
        f"led{recorded}, matched by {names or 'no other implementation'}; "
        f"{stats.failed_allocs} failed allocations, {stats.emptied} that emptied the free list, {stats.shortfall_merges} "
        f"shortfall merges; {time.time() - t0:.1f} s")
  for name, reason in stats.skipped.items():
    print(f"parity: {name} skipped on some traces: {reason}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
