"""`jax-kvalloc bench-class`: what one SGLang-style class call costs, per implementation.

Steady state as a serving loop sees it: consecutive calls with the same inputs, timed one
by one with perf_counter (the host time the caller's thread spends in the call), median
over the calls. Asynchronous implementations (the device backend, torch on CUDA) may run
ahead of the device; `sync_us` is the mean per call of the same loop with one wait at the
end (the throughput bound), reported beside the median.

Implementations (rows are skipped, with the reason, where one cannot run):
  device      jax_kvalloc's class, backend="device" (jax arrays, no waits), called as
              SGLang's class is: per-request arrays on the device beside host copies
  host        jax_kvalloc's class, backend="host" (numpy state and results)
  sgljax      sglang-jax's host-numpy PagedTokenToKVPoolAllocator, loaded BY PATH from
              --sgljax DIR (default ../shared/anchors/sgljax, see its PROVENANCE.txt; it
              is third-party code and is never copied into this repository)
  torch_ref   torch_ref's eager classes (plain torch on CPU, Triton on CUDA)
  sglang      SGLang's own PagedTokenToKVPoolAllocator (sglang 0.5.23) when importable

Rows (page size --page-size, pool --pool slots):
  decode/B         alloc_decode of B requests, 1 in page_size of them starting a page
  extend/R         alloc_extend of R requests, each extending by --extend-tokens tokens
                   from a prefix of random length (last_loc aligned as SPEC 4.2 says)
  free/T           free of T slots (whole pages; re-allocated untimed between calls)
  decode_after_restore/B, free_after_restore/T: the same call right after restore_state

Writes a JSON record (--json) and prints a table with each implementation's median, the
host's trivial-jit floor beside the device backend (`floor`: a jitted x + 1, timed alike) and
the ratios to sglang-jax (CPU target: host >= 1.5x faster) and to SGLang's class.

--stalls N (device backend only): N random alloc_extend + free calls (1..--stall-max-batch
requests) on a fresh allocator, once cold and once after `warmup(...)` up to the same
maxima; reports the calls slower than 50 ms and their total (compile stalls).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

IMPLS = ("device", "host", "sgljax", "torch_ref", "sglang")
DEFAULT_SGLJAX = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "anchors" / "sgljax"


def load_sgljax(folder: str) -> Any:
  """sglang-jax's allocator module, imported by path from `folder` (never copied)."""
  path = pathlib.Path(folder) / "sgljax_allocator.py"
  if not path.exists():
    raise FileNotFoundError(f"--sgljax {folder}: no sgljax_allocator.py there")
  spec = importlib.util.spec_from_file_location("_sgljax_allocator_anchor", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


class _Impl:
  """One implementation behind a common call surface (inputs converted once, untimed)."""

  def __init__(self, name: str, pool: int, ps: int, args):
    self.name, self.ps = name, ps
    self.torch = None
    self.sync: Callable[[Any], None] = lambda out: None
    if name in ("device", "host"):
      import jax  # pylint: disable=g-import-not-at-top
      import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top
      self.a = kvs.PagedTokenToKVPoolAllocator(pool, ps, backend=name, device=args.device,
                                              debug=False)
      self.conv = lambda x: np.asarray(x, np.int64)
      if name == "device":  # as SGLang is called: device arrays and host copies
        self.sync = lambda out: jax.block_until_ready(out)
        dev = self.a._pools[0].backend.device  # pylint: disable=protected-access
        self.conv = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
        self.cpu = lambda x: np.asarray(x, np.int64)
    elif name == "sgljax":
      mod = load_sgljax(args.sgljax)
      self.a = mod.PagedTokenToKVPoolAllocator(pool, ps, None)
      self.conv = lambda x: np.asarray(x, np.int32)
    else:
      import torch  # pylint: disable=g-import-not-at-top
      self.torch = torch
      dev = "cuda" if torch.cuda.is_available() else "cpu"
      if name == "torch_ref":
        import torch_ref  # pylint: disable=g-import-not-at-top
        self.a = torch_ref.PagedTokenToKVPoolAllocator(pool, ps, device=dev)
      else:
        from sglang.srt.mem_cache import allocator as sgl  # pylint: disable=g-import-not-at-top
        self.a = sgl.PagedTokenToKVPoolAllocator(pool, ps, torch.float16, dev, None, False)
      self.conv = lambda x: torch.as_tensor(np.asarray(x, np.int64), device=dev)
      self.cpu = lambda x: torch.as_tensor(np.asarray(x, np.int64))
      if dev == "cuda":
        self.sync = lambda out: torch.cuda.synchronize()

  def decode(self, seq, last):
    if self.name == "sgljax":
      return lambda: self.a.alloc_decode(seq, last)
    s, l = self.conv(seq), self.conv(last)
    scpu = self.cpu(seq) if hasattr(self, "cpu") else s
    return lambda: self.a.alloc_decode(s, scpu, l)

  def extend(self, pre, seq, last, n):
    if self.name == "sgljax":
      return lambda: self.a.alloc_extend(pre, seq, last, n)
    p, s, l = self.conv(pre), self.conv(seq), self.conv(last)
    if hasattr(self, "cpu"):
      pc, sc = self.cpu(pre), self.cpu(seq)
      return lambda: self.a.alloc_extend(p, pc, s, sc, l, n)
    return lambda: self.a.alloc_extend(p, p, s, s, l, n)

  def alloc_pages(self, n):
    out = self.a.alloc(n)
    if out is None:
      raise RuntimeError(f"{self.name}: pool too small for the free rows")
    return out


def _time(call: Callable[[], Any], before: Optional[Callable[[], Any]], reps: int,
          sync: Callable[[Any], None]) -> Dict[str, float]:
  """Median host time of `call` (after the untimed `before`), and the mean with a final
  wait (only meaningful when `before` is None)."""
  for _ in range(3):  # warm: compiles, caches
    if before:
      before()
    sync(call())
  times = []
  out = None
  t_all = time.perf_counter()
  for _ in range(reps):
    if before:
      before()
    t0 = time.perf_counter()
    out = call()
    times.append(time.perf_counter() - t0)
  sync(out)
  total = time.perf_counter() - t_all
  return {"median_us": statistics.median(times) * 1e6,
          "sync_us": total / reps * 1e6 if before is None else float("nan")}


def _rows(args) -> List[Dict[str, Any]]:
  ps = args.page_size
  rng = np.random.default_rng(0)
  rows = []
  for bs in args.decode:
    # seq_lens with one row in page_size starting a new page (ceil(seq/ps) grows).
    seq = ps * rng.integers(0, 4, bs) + rng.integers(2, ps + 1, bs)  # seq % ps != 1
    seq[:: ps] = ps * rng.integers(1, 4, len(seq[:: ps])) + 1          # these need one
    rows.append({"op": "decode", "size": bs, "seq": seq})
  for r in args.extend:
    pre = rng.integers(0, 4 * ps, r)
    seq = pre + args.extend_tokens
    rows.append({"op": "extend", "size": r, "pre": pre, "seq": seq})
  for t in args.free:
    rows.append({"op": "free", "size": t})
  for bs in args.restore_decode:
    rows.append({"op": "decode_after_restore", "size": bs, "seq": None})
  for t in args.restore_free:
    rows.append({"op": "free_after_restore", "size": t})
  return rows


def _last_loc_decode(impl: _Impl, seq: np.ndarray, ps: int) -> np.ndarray:
  """last_loc of token seq - 2 inside pages the allocator handed out (aligned)."""
  base = np.asarray(impl_pages(impl, len(seq)))
  return base * ps + (seq - 2) % ps


def impl_pages(impl: _Impl, n: int) -> np.ndarray:
  out = impl.alloc_pages(n * impl.ps)
  arr = out.cpu().numpy() if hasattr(out, "cpu") else np.asarray(out)
  return arr[:: impl.ps] // impl.ps


def run_row(impl: _Impl, row: Dict[str, Any], reps: int) -> Dict[str, float]:
  """The row's timings; for our classes also `status_waits`: the calls of the row (warm
  ones included) that waited for an earlier call's status (SPEC 14)."""
  waits = getattr(impl.a, "status_waits", None)
  result = _run_row(impl, row, reps)
  if waits is not None:
    result["status_waits"] = impl.a.status_waits - waits
  return result


def _run_row(impl: _Impl, row: Dict[str, Any], reps: int) -> Dict[str, float]:
  ps = impl.ps
  op, n = row["op"], row["size"]
  if op in ("decode", "decode_after_restore"):
    seq = row["seq"] if row.get("seq") is not None else np.full(n, 3 if ps > 2 else 2)
    last = _last_loc_decode(impl, seq, ps)
    call = impl.decode(seq, last)
    before = None
    if op == "decode_after_restore":
      snap = impl.a.backup_state()
      before = lambda: impl.a.restore_state(snap)
    return _time(call, before, reps, impl.sync)
  if op == "extend":
    pre = row["pre"]
    last = np.where(pre > 0, _last_loc_decode(impl, pre + 1, ps), -1)
    n_tok = int((row["seq"] - pre).sum())
    return _time(impl.extend(pre, row["seq"], last, n_tok), None, reps, impl.sync)
  # free rows: free T slots, re-allocate them (untimed) before every call.
  need = -(-n // ps) * ps
  holder = {"idx": impl.alloc_pages(need)}
  if impl.name == "sgljax":
    holder["idx"] = np.asarray(holder["idx"])[:n]
  elif impl.torch is not None:
    holder["idx"] = holder["idx"][:n]
  else:
    holder["idx"] = np.asarray(holder["idx"])[:n]  # host data: what a scheduler frees
  snap = impl.a.backup_state() if op == "free_after_restore" else None

  def before():
    if snap is not None:
      impl.a.restore_state(snap)
    else:
      impl.a.alloc(need)  # LIFO: takes back exactly the pages just freed
  return _time(lambda: impl.a.free(holder["idx"]), before, reps, impl.sync)


def floor(args) -> Dict[str, float]:
  """The trivial-jit floor of this host, timed as the rows are: a jitted x + 1 of an
  i32[8] on the device backend's device (one input, one output, nothing else)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.sglang.backends import resolve_device  # pylint: disable=g-import-not-at-top
  x = jax.device_put(jnp.zeros((8,), jnp.int32), resolve_device(args.device))
  fn = jax.jit(lambda v: v + 1)
  return _time(lambda: fn(x), None, args.reps, jax.block_until_ready)


def stalls(args) -> Dict[str, Any]:
  """Compile stalls of a random serving sequence, cold and after warm-up."""
  import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top
  ps, max_bs = args.page_size, args.stall_max_batch
  max_tokens = max_bs * args.extend_tokens
  out = {}
  for mode in ("cold", "warm"):
    a = kvs.PagedTokenToKVPoolAllocator(args.pool, ps, device=args.device, debug=False)
    warm_s = 0.0
    if mode == "warm":
      warm_s = a.warmup(max_batch=max_bs, max_tokens=max_tokens).seconds
    rng = np.random.default_rng(1)
    times = []
    for _ in range(args.stalls):
      bs = int(rng.integers(1, max_bs + 1))
      z = np.zeros(bs, np.int64)
      seq = rng.integers(1, args.extend_tokens + 1, bs)
      t0 = time.perf_counter()
      got = a.alloc_extend(z, z, seq, seq, np.full(bs, -1), int(seq.sum()))
      if got is not None:
        a.free(ps * np.arange(1, bs + 1))  # host data: a slot of each of pages 1..bs
      times.append(time.perf_counter() - t0)
      a.clear()
    slow = [t for t in times if t > 0.05]
    out[mode] = {"calls": len(times), "stalls_over_50ms": len(slow),
                 "stall_s": sum(slow), "median_us": statistics.median(times) * 1e6,
                 "warmup_s": warm_s, "status_waits": a.status_waits}
    print(f"  stalls {mode}: {len(slow)} of {len(times)} calls > 50 ms, {sum(slow):.2f} s"
          f" (warm-up {warm_s:.1f} s)", flush=True)
  return out


def run(args) -> Dict[str, Any]:
  rows = _rows(args)
  results: Dict[str, Dict[str, Any]] = {}
  skipped: Dict[str, str] = {}
  for name in args.impls:
    if name not in IMPLS:
      skipped[name] = f"unknown implementation (choose from {', '.join(IMPLS)})"
      continue
    try:
      _Impl(name, args.pool, args.page_size, args)
    except Exception as e:  # pylint: disable=broad-except
      skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      continue
    for row in rows:
      key = f"{row['op']}/{row['size']}"
      impl = _Impl(name, args.pool, args.page_size, args)  # a fresh pool per row
      try:
        results.setdefault(key, {})[name] = run_row(impl, row, args.reps)
      except Exception as e:  # pylint: disable=broad-except
        results.setdefault(key, {})[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
      print(f"  {key:28s} {name:10s} "
            f"{results[key][name].get('median_us', float('nan')):10.1f} us", flush=True)
  record = {"machine": platform.node(), "python": sys.version.split()[0],
            "platform": _platform(), "pool": args.pool, "page_size": args.page_size,
            "reps": args.reps, "skipped": skipped, "rows": results}
  if "device" in args.impls and "device" not in skipped:
    record["floor"] = floor(args)
    print(f"  {'trivial jit (floor)':28s} {'device':10s} "
          f"{record['floor']['median_us']:10.1f} us", flush=True)
  if args.stalls:
    record["stalls"] = stalls(args)
  return record


def _platform() -> str:
  try:
    import jax  # pylint: disable=g-import-not-at-top
    return f"jax {jax.__version__} on {jax.devices()[0].device_kind}"
  except Exception:  # pylint: disable=broad-except
    return "?"


def table(record: Dict[str, Any]) -> str:
  """The record as a text table: medians (us) and speed-ups over sgljax / sglang."""
  impls = [n for n in IMPLS if any(n in r for r in record["rows"].values())]
  head = f"{'row':28s}" + "".join(f"{n:>11s}" for n in impls) + "  host/sgljax  device/sglang"
  lines = [head, "-" * len(head)]
  for key, res in record["rows"].items():
    med = {n: res.get(n, {}).get("median_us") for n in impls}
    cells = "".join(f"{med[n]:11.1f}" if med[n] is not None else f"{'-':>11s}" for n in impls)
    ratio = lambda a, b: (f"{med[b] / med[a]:8.2f}x" if med.get(a) and med.get(b) else "       -")
    lines.append(f"{key:28s}{cells}     {ratio('host', 'sgljax')}     {ratio('device', 'sglang')}")
  if "floor" in record:
    fl = record["floor"]["median_us"]
    lines.append(f"{'trivial jit (floor)':28s}{fl:11.1f}  (device rows over the floor: " +
                 ", ".join(f"{k} {r['device']['median_us'] / fl:.1f}x"
                           for k, r in record["rows"].items()
                           if r.get("device", {}).get("median_us")) + ")")
  waits = {k: r["device"]["status_waits"] for k, r in record["rows"].items()
           if "status_waits" in r.get("device", {})}
  if waits:
    lines.append("device calls that waited for a status: " +
                 ", ".join(f"{k} {n}" for k, n in waits.items()))
  for name, why in record["skipped"].items():
    lines.append(f"skipped {name}: {why}")
  for mode, st in record.get("stalls", {}).items():
    lines.append(f"stalls ({mode}): {st['stalls_over_50ms']} of {st['calls']} calls over "
                 f"50 ms, {st['stall_s']:.2f} s in all; warm-up {st['warmup_s']:.1f} s; "
                 f"{st.get('status_waits', 0)} status waits")
  return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
  p = sub.add_parser("bench-class", help="per-call cost of the SGLang-style classes "
                     "(device and host backends, sglang-jax, torch_ref, SGLang)",
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(p)
  p.set_defaults(func=main_args)
  return p


def add_arguments(p: argparse.ArgumentParser) -> None:
  ints = lambda s: [int(x) for x in s.split(",") if x]
  p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS),
                 help=f"comma list of {','.join(IMPLS)}")
  p.add_argument("--sgljax", default=str(DEFAULT_SGLJAX),
                 help="folder holding sglang-jax's sgljax_allocator.py (loaded by path)")
  p.add_argument("--pool", type=int, default=2**24, help="pool size in slots")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--device", default=None, help="jax device of the device backend")
  p.add_argument("--decode", type=ints, default=[1, 8, 64, 256, 1024, 4096])
  p.add_argument("--extend", type=ints, default=[1, 4, 16, 64, 256, 1024])
  p.add_argument("--extend-tokens", type=int, default=64, help="new tokens per request")
  p.add_argument("--free", type=ints, default=[64, 1024, 16384, 65536])
  p.add_argument("--restore-decode", type=ints, default=[64])
  p.add_argument("--restore-free", type=ints, default=[1024])
  p.add_argument("--reps", type=int, default=50)
  p.add_argument("--json", default=None, help="write the record here")
  p.add_argument("--stalls", type=int, default=0,
                 help="random alloc_extend+free calls for the compile-stall count (0: off)")
  p.add_argument("--stall-max-batch", type=int, default=256)


def main_args(args) -> int:
  record = run(args)
  print(table(record))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="bench_class", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(p)
  return main_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
