"""`jax-kvalloc bench-swa`: the SWA allocator's extend, decode and window free (SPEC 13),
one eager call at a time, ours beside SGLang 0.5.23's SWATokenToKVPoolAllocator in the
same run on the same inputs.

Implementations (columns; one that cannot run is skipped with the reason):
  class   our SWATokenToKVPoolAllocator, device backend (jax arrays in and out)
  core    the functional core's operation (jax_kvalloc.swa), jitted with the state
          donated, called once per step from Python
  sglang  SGLang 0.5.23's SWATokenToKVPoolAllocator on torch (CUDA when present, else
          CPU) with a stand-in kvcache; from the installed package or, failing that, the
          bundle folder (--sglang-bundle, benchmarks/sglang_bundle.sh)

Rows (page size --page-size; pools --size / --size-swa slots):
  swa_extend/R       alloc_extend of R requests of --extend-tokens new tokens each (prefix
                     0); the previous call's slots are freed (free, untimed) first
  swa_decode/B       alloc_decode of B requests continuing a prefill, 1 in page_size of
                     them starting a page in both pools
  swa_window_free/R  free_swa of R requests' oldest page (R * page_size full slots, the
                     window KV leaving the window); set up untimed before each call
                     (free_full of the previous call's slots, then an alloc_extend)

Each timed call is followed by a wait for everything it produced (its outputs and the
allocator's state: jax.block_until_ready / torch.cuda.synchronize), so every output is
consumed and the figure is the call's latency as a scheduler step sees it. Inputs are on
the implementation's device before timing (host copies for the *_cpu arguments, as SGLang
takes them). Reported per cell: median and quartiles over --reps calls (us). Verdicts
(class and core against sglang): faster / slower only when the interquartile ranges do
not overlap (report.verdict), else tie.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

IMPLS = ("class", "core", "sglang")
OPS = ("swa_extend", "swa_decode", "swa_window_free")


def _stats(times: List[float]) -> Dict[str, float]:
  from jax_kvalloc.tools.timing import quartiles  # pylint: disable=g-import-not-at-top
  q1, q3 = quartiles(times)
  return {"median_us": statistics.median(times) * 1e6, "q1_us": q1 * 1e6,
          "q3_us": q3 * 1e6, "min_us": min(times) * 1e6, "reps": len(times)}


def time_calls(call: Callable[[], Any], before: Optional[Callable[[], Any]],
               sync: Callable[[Any], None], reps: int, warm: int = 3) -> Dict[str, float]:
  """Per-call seconds of `call()` + `sync(its result)`, after the untimed `before()`:
  median, quartiles and min over `reps` calls (after `warm` untimed ones), in us."""
  for _ in range(warm):
    if before:
      before()
    sync(call())
  times = []
  for _ in range(reps):
    if before:
      before()
    t0 = time.perf_counter()
    sync(call())
    times.append(time.perf_counter() - t0)
  return _stats(times)


class _Impl:
  """One implementation behind the calls the rows time. Slots go in and come out in the
  implementation's own arrays (jax or torch); `ints` converts host ints to them."""

  def __init__(self, name: str, args):
    self.name, self.ps = name, args.page_size
    size, size_swa, ps = args.size, args.size_swa, args.page_size
    if name in ("class", "core"):
      import jax  # pylint: disable=g-import-not-at-top
      import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
      from jax_kvalloc.sglang.backends import resolve_device  # pylint: disable=g-import-not-at-top
      self.jax, dev = jax, resolve_device(args.device)
      self.ints = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
      self.host = lambda x: np.asarray(x, np.int64)
      if name == "class":
        from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator  # pylint: disable=g-import-not-at-top
        self.a = SWATokenToKVPoolAllocator(size, size_swa, ps, None, args.device, None,
                                           False, backend="device", debug=False)
      else:
        from jax_kvalloc import swa as core  # pylint: disable=g-import-not-at-top
        self.core, self.cfg = core, core.SWAConfig(size, size_swa, ps, False, debug=False)
        self.state = jax.device_put(core.init(self.cfg), dev)
        jit = lambda f, **kw: jax.jit(f, static_argnums=0, donate_argnums=1, **kw)
        self._extend = jit(core.alloc_extend, static_argnames=("max_tokens",))
        self._decode = jit(core.alloc_decode)
        self._free = jit(core.free)
        self._free_swa = jit(core.free_swa)
        self._free_full = jit(core.free_full)
        self._zeros = jnp.zeros
      return
    from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
    if sglang_oracle.import_error() is not None:
      sglang_oracle.use_bundle(args.sglang_bundle)
    err = sglang_oracle.import_error()
    if err:
      raise ImportError(err)
    import torch  # pylint: disable=g-import-not-at-top
    cls, standin = sglang_oracle.sglang_swa_class()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    self.torch, self.dev = torch, dev
    self.a = cls(size, size_swa, ps, torch.float16, dev, standin(), False)
    self.ints = lambda x: torch.as_tensor(np.asarray(x, np.int64), device=dev)
    self.host = lambda x: torch.as_tensor(np.asarray(x, np.int64))

  def sync(self, out: Any) -> None:
    """Waits for `out` and for the allocator's state."""
    if self.name == "sglang":
      if self.dev == "cuda":
        self.torch.cuda.synchronize()
      return
    if self.name == "core":
      self.jax.block_until_ready((out, self.state))
      return
    self.jax.block_until_ready((out, self.a._pools[0].state))  # pylint: disable=protected-access

  # The calls (core: the state is threaded through self.state).
  def extend(self, pre, pre_h, seq, seq_h, last, n: int):
    if self.name != "core":
      return self.a.alloc_extend(pre, pre_h, seq, seq_h, last, n)
    self.state, out, ok = self._extend(self.cfg, self.state, pre, seq, last, max_tokens=n)
    return out, ok

  def decode(self, seq, seq_h, last):
    if self.name != "core":
      return self.a.alloc_decode(seq, seq_h, last)
    self.state, out, ok = self._decode(self.cfg, self.state, seq, last)
    return out, ok

  def free(self, idx) -> None:
    if self.name != "core":
      self.a.free(idx)
    else:
      self.state = self._free(self.cfg, self.state, idx)

  def free_swa(self, idx) -> None:
    if self.name != "core":
      self.a.free_swa(idx)
    else:
      self.state = self._free_swa(self.cfg, self.state, idx)

  def free_full(self, idx) -> None:
    if self.name != "core":
      self.a.free_full(idx)
    else:
      self.state = self._free_full(self.cfg, self.state, idx)

  def prefill(self, lens: np.ndarray):
    """alloc_extend of len(lens) requests from prefix 0; the full slots (checked)."""
    z = np.zeros(len(lens), np.int64)
    res = self.extend(self.ints(z), self.host(z), self.ints(lens), self.host(lens),
                      self.ints(np.full(len(lens), -1)), int(lens.sum()))
    if self.name == "core":
      out, ok = res
      if not bool(ok):
        raise RuntimeError("core: pool too small for the rows")
      return out
    if res is None:
      raise RuntimeError(f"{self.name}: pool too small for the rows")
    return res


def _rows(args) -> List[Dict[str, Any]]:
  rows = [{"op": "swa_extend", "size": r} for r in args.extend]
  rows += [{"op": "swa_decode", "size": b} for b in args.decode]
  rows += [{"op": "swa_window_free", "size": r} for r in args.window_free]
  return [r for r in rows if r["op"] in args.ops]


def decode_lens(b: int, ps: int, seed: int = 0) -> np.ndarray:
  """seq_lens of a decode batch of b rows: rows 0, ps, 2ps, ... start a page (seq % ps
  == 1), the others continue one (seq % ps in 2..ps, or 0)."""
  rng = np.random.default_rng(seed)
  seq = ps * rng.integers(1, 4, b) + rng.integers(2, ps + 1, b)
  seq[::ps] = ps * rng.integers(1, 4, len(seq[::ps])) + 1
  return seq.astype(np.int64)


def run_row(impl: _Impl, row: Dict[str, Any], args) -> Dict[str, float]:
  ps, n, reps = impl.ps, row["size"], args.reps
  if row["op"] == "swa_extend":
    t = args.extend_tokens
    z, seq = np.zeros(n, np.int64), np.full(n, t, np.int64)
    args_ = (impl.ints(z), impl.host(z), impl.ints(seq), impl.host(seq),
             impl.ints(np.full(n, -1)), n * t)
    held = {}

    def before():
      if "out" in held:
        impl.free(held.pop("out"))

    def call():
      res = impl.extend(*args_)
      held["out"] = res[0] if impl.name == "core" else res
      return res
    return time_calls(call, before, impl.sync, reps)
  if row["op"] == "swa_decode":
    seq = decode_lens(n, ps)
    full = impl.prefill(seq - 1)
    ends = np.cumsum(seq - 1) - 1
    last = full[impl.ints(ends)]
    args_ = (impl.ints(seq), impl.host(seq), last)
    return time_calls(lambda: impl.decode(*args_), None, impl.sync, reps)
  # swa_window_free: each request's oldest page leaves the window.
  lens = np.full(n, ps, np.int64)
  held = {}

  def before():
    if "idx" in held:
      impl.free_full(held["idx"])
    held["idx"] = impl.prefill(lens)
  return time_calls(lambda: impl.free_swa(held["idx"]), before, impl.sync, reps)


def run(args) -> Dict[str, Any]:
  from jax_kvalloc.tools.report import verdict  # pylint: disable=g-import-not-at-top
  rows = _rows(args)
  results: Dict[str, Dict[str, Any]] = {}
  skipped: Dict[str, str] = {}
  for name in args.impls:
    if name not in IMPLS:
      skipped[name] = f"unknown implementation (choose from {', '.join(IMPLS)})"
      continue
    try:
      _Impl(name, args)
    except Exception as e:  # pylint: disable=broad-except
      skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      continue
    for row in rows:
      key = f"{row['op']}/{row['size']}"
      try:
        impl = _Impl(name, args)  # a fresh pool per row
        results.setdefault(key, {})[name] = run_row(impl, row, args)
      except Exception as e:  # pylint: disable=broad-except
        results.setdefault(key, {})[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
      cell = results[key][name]
      print(f"  {key:24s} {name:7s} {cell.get('median_us', float('nan')):10.1f} us "
            f"[{cell.get('q1_us', float('nan')):.1f}, {cell.get('q3_us', float('nan')):.1f}]",
            flush=True)
  for cells in results.values():
    iq = {k: (c["q1_us"], c["q3_us"]) for k, c in cells.items() if "q1_us" in c}
    for ours in ("class", "core"):
      if ours in iq and "sglang" in iq:
        cells.setdefault("verdicts", {})[f"{ours}_vs_sglang"] = verdict(iq[ours],
                                                                        iq["sglang"])
  return {"machine": platform.node(), "python": sys.version.split()[0],
          "platform": _platform(), "sglang": _sglang_version(skipped),
          "size": args.size, "size_swa": args.size_swa, "page_size": args.page_size,
          "extend_tokens": args.extend_tokens, "reps": args.reps,
          "timing": "per call: perf_counter around the call and a wait for its outputs "
                    "and state; median and quartiles over reps",
          "skipped": skipped, "rows": results}


def _platform() -> str:
  try:
    import jax  # pylint: disable=g-import-not-at-top
    return f"jax {jax.__version__} on {jax.devices()[0].device_kind}"
  except Exception:  # pylint: disable=broad-except
    return "?"


def _sglang_version(skipped: Dict[str, str]) -> Optional[str]:
  if "sglang" in skipped:
    return None
  try:
    import sglang  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top
    where = "cuda" if torch.cuda.is_available() else "cpu"
    return f"{getattr(sglang, '__version__', '?')} (torch {torch.__version__}, {where})"
  except Exception:  # pylint: disable=broad-except
    return None


def table(record: Dict[str, Any]) -> str:
  """The record as a markdown table: median [q1, q3] us per implementation, verdicts."""
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  impls = [n for n in IMPLS if any(n in r for r in record["rows"].values())]

  def cell(c):
    if c is None:
      return "-"
    if "error" in c:
      return "error"
    return (f"{report.fmt_us(c['median_us'])} [{report.fmt_us(c['q1_us'])}, "
            f"{report.fmt_us(c['q3_us'])}]")
  head = ["row"] + [f"{n} us" for n in impls] + ["class vs sglang", "core vs sglang"]
  body = []
  for key, cells in record["rows"].items():
    v = cells.get("verdicts", {})
    body.append([key] + [cell(cells.get(n)) for n in impls]
                + [v.get("class_vs_sglang", "-"), v.get("core_vs_sglang", "-")])
  lines = [report.table(head, body)]
  for name, why in record["skipped"].items():
    lines.append(f"skipped {name}: {why}")
  return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
  p = sub.add_parser("bench-swa", help="SWA allocator extend / decode / window free per "
                     "call: our class and core beside SGLang 0.5.23's SWA class",
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(p)
  p.set_defaults(func=main_args)
  return p


def add_arguments(p: argparse.ArgumentParser) -> None:
  ints = lambda s: [int(x) for x in s.split(",") if x]
  p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS),
                 help=f"comma list of {','.join(IMPLS)}")
  p.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS),
                 help=f"comma list of {','.join(OPS)}")
  p.add_argument("--size", type=int, default=1 << 20, help="full pool slots")
  p.add_argument("--size-swa", type=int, default=1 << 18, help="SWA pool slots")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--device", default=None, help="jax device of ours (default: jax's)")
  p.add_argument("--extend", type=ints, default=[1, 16, 64])
  p.add_argument("--extend-tokens", type=int, default=64, help="new tokens per request")
  p.add_argument("--decode", type=ints, default=[1, 64, 256, 1024])
  p.add_argument("--window-free", type=ints, default=[16, 256, 1024])
  p.add_argument("--reps", type=int, default=50)
  p.add_argument("--sglang-bundle", default=None,
                 help="SGLang bundle folder (benchmarks/sglang_bundle.sh), appended to "
                      "sys.path when sglang is not installed (default: "
                      "$JAX_KVALLOC_SGLANG_BUNDLE, else <repo>/.sglang_py312)")
  p.add_argument("--json", default=None, help="write the record here")


def main_args(args) -> int:
  bad = [o for o in args.ops if o not in OPS]
  if bad:
    raise SystemExit(f"--ops: unknown {bad} (choose from {', '.join(OPS)})")
  record = run(args)
  print(table(record))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="bench_swa", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(p)
  return main_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
