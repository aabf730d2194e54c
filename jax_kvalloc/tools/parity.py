r"""`jax-kvalloc parity`: allocator traces replayed through jax_kvalloc, torch_ref and (when
installed) SGLang itself in lock step; the first mismatch reported.

A trace (the JSON-lines format of jax_kvalloc.tools.traces) is replayed step by step:
the first implementation (the lead) against the trace's recorded fields, every other one
against the lead: each step's result (slot ids or failure), the full free and release
lists (SGLang's release list as a set: newer releases keep it unordered) and
available_size. `--generate` draws seeded serving workloads instead (traces.SchedulerSim),
driven by the lead with a leak check at every step. On a mismatch it prints the trace,
step, op and arguments, which implementations disagree and the field's first differing
index, and saves the trace up to there (--write, else a temporary file) for replay.

Exit status: 0 all steps matched, 1 a mismatch, 2 bad arguments or trace file, 3 a
requested implementation is not available.

    jax-kvalloc parity my_trace.jsonl --torch-kernel torch             # quick, CPU
    jax-kvalloc parity --generate 12 --seed 300 --steps 250            # Triton interp.
    jax-kvalloc parity --device cuda --kernel triton --torch-kernel triton,torch \
        --generate 4 --seed 1000 --steps 3000                          # a GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from jax_kvalloc.config import KERNELS
from jax_kvalloc.tools.cli import UsageError, check_kernel, existing_file, int_list, name_list, positive
from jax_kvalloc.tools import traces


@dataclasses.dataclass
class Impl:
  """One implementation under comparison: `name` in reports, the `replayer` that drives
  it, and skip(init_args): why it cannot run a trace of that pool, or None."""
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

  def count(self, prev: traces.Record, rec: traces.Record) -> None:
    self.steps += 1
    if rec["op"].startswith("alloc"):
      failed = rec.get("result", []) is None
      self.failed_allocs += failed
      self.emptied += (not failed and bool(prev.get("free_pages"))
                       and rec.get("free_pages") == [])
      self.shortfall_merges += (bool(prev.get("release_pages"))
                                and not rec.get("release_pages"))


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
  return Impl(f"torch_ref[{resolved}, {dev}]", _torch_replayer(make, dev))


def sglang_impl(device: str = "cpu") -> Impl:
  """The installed SGLang's allocators (see jax_kvalloc.tools.sglang_oracle)."""
  import torch  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  dev = torch.device(device)
  make = lambda **init: sglang_oracle.SGLangAllocator(**init, device=dev)  # noqa: E731
  return Impl(f"sglang {sglang_oracle.version()}",
              _torch_replayer(make, dev, release_unordered=True),
              lambda init: sglang_oracle.unsupported_reason(**init))


def _torch_array(device):
  import torch  # pylint: disable=g-import-not-at-top
  return lambda values: torch.tensor(values, dtype=torch.int64, device=device)


def _torch_replayer(make, device, **kw) -> traces.Replayer:
  return traces.Replayer(make, _torch_array(device), _torch_array("cpu"), **kw)


def _describe(trace_id: Any, step: int, rec: traces.Record) -> str:
  args = ", ".join(f"{k}={v}" for k, v in (rec.get("args") or {}).items())
  return f"trace {trace_id!r} step {step} ({rec['op']} {args[:300]}{'...' * (len(args) > 300)})"


def _step(impl: Impl, trace_id: Any, step: int, want: traces.Record, against: str,
          records: Sequence[traces.Record]) -> traces.Record:
  """impl.replayer.step of `want`'s op, compared with `want` (what `against` did);
  ParityMismatch carrying `records` on an exception or a difference."""
  try:
    got = impl.replayer.step(want["op"], want.get("args"))
  except Exception as e:  # pylint: disable=broad-except
    raise ParityMismatch(f"ERROR {_describe(trace_id, step, want)}: {impl.name} raised "
                         f"{type(e).__name__}: {e}", records) from e
  diff = traces.compare(want, got, release_unordered=impl.replayer.release_unordered)
  if diff:
    raise ParityMismatch(f"MISMATCH {_describe(trace_id, step, want)}: {impl.name} vs "
                         f"{against}: {diff}", records)
  return got


def _lock_step(impls: Sequence[Impl], init: Dict[str, Any], trace_id: Any, stats: Stats,
               records: List[traces.Record]) -> Tuple[Impl, Callable[[int, traces.Record], None]]:
  """The lead (the first implementation that can run a pool of `init`; the others'
  reasons go to stats) and on_step(step, record): appends the lead's record to
  `records`, steps every other implementation and compares it with the lead."""
  why = {impl.name: impl.skip(init) for impl in impls}
  stats.skipped.update({name: r for name, r in why.items() if r})
  lead, *others = [impl for impl in impls if not why[impl.name]]

  def on_step(step: int, rec: traces.Record) -> None:
    records.append(rec)
    for impl in others:
      _step(impl, trace_id, step, rec, lead.name, records)
      stats.compared[impl.name] = stats.compared.get(impl.name, 0) + 1
    stats.count(records[-2] if len(records) > 1 else {}, rec)
  return lead, on_step


def replay_trace(records: Sequence[traces.Record], impls: Sequence[Impl],
                 stats: Optional[Stats] = None) -> Stats:
  """Replays one recorded trace through every implementation in lock step.

  Each step of the first active implementation (the lead) is checked against the
  trace's recorded fields, and every other one against the lead. Raises ParityMismatch
  on the first difference.
  """
  stats = stats or Stats()
  trace_id, done = records[0]["trace"], []
  lead, on_step = _lock_step(impls, traces.init_args(records[0].get("args", {})), trace_id,
                             stats, done)
  for step, want in enumerate(records):
    stats.recorded += any(f in want for f in traces.STATE_FIELDS)
    on_step(step, dict(want, **_step(lead, trace_id, step, want, "the trace", done + [want])))
  stats.traces += 1
  return stats


def run_generated(config: traces.WorkloadConfig, impls: Sequence[Impl],
                  stats: Optional[Stats] = None) -> List[traces.Record]:
  """Generates the trace of `config` with the first active implementation driving the
  workload, stepping the others in lock step. Returns the trace; raises ParityMismatch
  (carrying the trace so far) on the first difference, and on a leak of the lead."""
  stats = stats or Stats()
  records: List[traces.Record] = []
  lead, on_step = _lock_step(impls, config.init_args(), config.seed, stats, records)
  try:
    traces.generate(config, lead.replayer, trace_id=config.seed, on_step=on_step)
  except traces.TraceMismatch as e:
    raise ParityMismatch(f"MISMATCH (leak check of {lead.name}) {e}", records) from e
  stats.traces += 1
  return records


def add_arguments(p: argparse.ArgumentParser) -> None:
  first = __doc__.split("\n\n")[0].split(": ", 1)[1]
  p.description = first[0].upper() + first[1:]
  p.epilog = "\n\n".join(__doc__.split("\n\n")[2:])
  p.add_argument("trace", nargs="*", type=existing_file, metavar="TRACE",
                 help="trace files (JSON lines, see jax_kvalloc.tools.traces)")
  p.add_argument("--generate", type=positive(minimum=0), default=0, metavar="N",
                 help="also generate N workload traces (seeds S..S+N-1)")
  p.add_argument("--seed", type=int, default=0, metavar="S", help="the first seed")
  p.add_argument("--steps", type=positive(), default=300,
                 help="operations per generated trace")
  p.add_argument("--page-sizes", type=int_list, default=[1, 4, 16, 64],
                 help="page sizes generated traces draw from")
  p.add_argument("--scale", choices=sorted(traces.SCALES), default=None,
                 help="pool and batch sizes of generated traces (default: ci on cpu, "
                      "long on cuda)")
  p.add_argument("--need-sort", choices=("mixed", "on", "off"), default="mixed",
                 help="need_sort of generated traces")
  p.add_argument("--segment-prob", type=positive(float, 0.0, 1.0), default=0.25,
                 metavar="P", help="chance that a generated trace frees a finished request "
                 "through free_segment/free_page_ids (SPEC 10); 0: none")
  p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                 help="device of the jax and torch allocators")
  p.add_argument("--kernel", default="jnp", choices=KERNELS,
                 help="jax_kvalloc's implementations (jax_kvalloc.kernels)")
  p.add_argument("--torch-kernel", default=["triton"],
                 type=name_list(("triton", "torch", "auto")),
                 help="torch_ref's index paths to compare, of triton,torch,auto (triton on "
                      "cpu runs Triton's interpreter, TRITON_INTERPRET=1, set here)")
  p.add_argument("--sglang", choices=("auto", "on", "off"), default="auto",
                 help="compare with the installed SGLang too (auto: when importable)")
  p.add_argument("--impls", default=["jax", "torch"],
                 type=name_list(("jax", "jax-host", "torch")),
                 help="implementations besides SGLang, the first leading (jax-host: "
                      "jax_kvalloc's host backend; torch alone checks torch_ref against a "
                      "trace file's recorded results without compiling any jax)")
  p.add_argument("--write", metavar="OUT.jsonl",
                 help="write the generated traces (or, on a mismatch, the trace so far)")
  p.add_argument("--quiet", action="store_true", help="print only the summary")


def _build(args: argparse.Namespace) -> List[Impl]:
  """The implementations the arguments ask for; ImportError/RuntimeError if one is
  unavailable."""
  makers = {"jax": lambda: [jax_impl(args.kernel, args.device)],
            "jax-host": lambda: [jax_impl(args.kernel, args.device, "host")],
            "torch": lambda: [torch_impl(k, args.device) for k in args.torch_kernel]}
  if "torch" in args.impls and "triton" in args.torch_kernel:
    if args.device == "cpu":
      os.environ["TRITON_INTERPRET"] = "1"   # before torch_ref.triton_kernels is imported
    import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  impls = [impl for n in args.impls for impl in makers[n]()]
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


def run(args: argparse.Namespace) -> int:
  if not args.trace and not args.generate:
    raise UsageError("TRACE", "give a trace file or --generate N")
  if "jax" in args.impls:  # jax_kvalloc's pools on --device run --kernel
    check_kernel(args.kernel, "cpu" if args.device == "cpu" else None)
  try:
    inputs = [(path, traces.read(path)) for path in args.trace]
  except ValueError as e:
    raise UsageError("TRACE", str(e))
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
      config = traces.random_config(args.seed + i, steps=args.steps, page_sizes=args.page_sizes,
                                    scale=scale, need_sort=need_sort,
                                    segment_prob=args.segment_prob)
      n, f = stats.steps, stats.failed_allocs
      written += run_generated(config, impls, stats)
      say(f"seed {config.seed}: {config.kind} page_size={config.page_size} "
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
        f"{stats.failed_allocs} failed allocations, {stats.emptied} that emptied the free "
        f"list, {stats.shortfall_merges} shortfall merges; {time.time() - t0:.1f} s")
  for name, reason in stats.skipped.items():
    print(f"parity: {name} skipped on some traces: {reason}")
  return 0


