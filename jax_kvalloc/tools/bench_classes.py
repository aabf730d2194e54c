"""`jax-kvalloc bench class` and `bench swa`: one SGLang-style class call at a time.

class: host time per call as a serving loop sees it, consecutive calls with the same
inputs, each timed alone with perf_counter (median, quartiles); "sync_us" is the mean
per call of the same loop with one wait at the end (the throughput bound of the
asynchronous implementations). Columns (a column that cannot run is skipped with why):

  device     jax_kvalloc's class, backend="device" (jax arrays, no waits), called as
             SGLang's class is (per-request arrays on the device beside host copies);
             constructor arguments in brackets, e.g. `device[kernel=jnp]`; its cells
             also count `status_waits`, the calls that waited for an earlier call's
             status (SPEC 14)
  host       jax_kvalloc's class, backend="host" (NumPy state and results)
  sgljax     sglang-jax's host-NumPy PagedTokenToKVPoolAllocator, loaded by path from
             --sgljax (default ../shared/anchors/sgljax; third-party code, never copied)
  torch_ref  torch_ref's eager class (plain torch on CPU, Triton on CUDA)
  sglang     SGLang's own PagedTokenToKVPoolAllocator (jax_kvalloc.tools.sglang_oracle)

Rows: decode/B (alloc_decode of B requests, one in page_size starting a page), extend/R
(alloc_extend of R requests of --extend-tokens tokens from random prefixes), free/T (T
slots of whole pages, allocated again untimed before each call),
decode_after_restore/B and free_after_restore/T (the call right after restore_state),
restore_after_decode/B and restore_after_free/T (restore_state itself, of a snapshot
taken before that call: the ownership record is patched, or rebuilt after a free),
floor (device: a jitted x + 1, timed alike), stalls/cold and stalls/warm (--stalls N
random alloc_extend + free calls on a fresh device class, before and after `warmup`:
the calls over 50 ms are compile stalls).

swa: the SWA allocator (SPEC 13), each call followed by a wait for everything it
produced (outputs and state), so the figure is the call's latency as a scheduler step
sees it. Columns: class (our SWATokenToKVPoolAllocator, device backend), core (the
functional jax_kvalloc.swa ops, jitted with the state donated), sglang (SGLang 0.5.23's
SWATokenToKVPoolAllocator with a stand-in kvcache, installed or from --sglang-bundle).
Rows: swa_extend/R (R requests of --extend-tokens tokens; the previous call's slots are
freed untimed), swa_decode/B, swa_window_free/R (free_swa of R requests' oldest page).
"""
from __future__ import annotations

import functools
import itertools
import os
import pathlib
import time
from typing import Any, Dict

import jax
import numpy as np

import jax_kvalloc.sglang as kvs
from jax_kvalloc import swa as swa_core
from jax_kvalloc.sglang.backends import resolve_device
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import cli
from jax_kvalloc.tools import timing

DEFAULT_SGLJAX = pathlib.Path(os.environ.get(  # ../shared beside the checkout, as the tests
    "JAX_KVALLOC_SHARED", pathlib.Path(__file__).resolve().parents[3] / "shared")) / (
        "anchors/sgljax")


class ClassImpl:
  """One paged class behind the calls the rows time; inputs converted once, untimed."""

  def __init__(self, spec: str, o):
    name, kw = bench.parse_impl(spec)
    self.name, self.ps, pool = name, o.page_size, o.pool
    self.wait = lambda out: None
    self.conv = self.cpu = lambda x: np.asarray(x, np.int64)
    if name in ("device", "host"):
      self.a = kvs.PagedTokenToKVPoolAllocator(pool, self.ps, backend=name, device=o.device,
                                              **dict(dict(debug=False), **kw))
      if name == "device":
        self.wait = jax.block_until_ready
        dev = self.a._pools[0].backend.device  # pylint: disable=protected-access
        self.conv = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
    elif name == "sgljax":
      path = pathlib.Path(o.sgljax) / "sgljax_allocator.py"
      if not path.exists():
        raise bench.Skip(f"--sgljax {o.sgljax}: no sgljax_allocator.py there")
      module = bench.load_file(str(path), "_sgljax_allocator_anchor")
      self.a = module.PagedTokenToKVPoolAllocator(pool, self.ps, None)
    else:
      torch, dev = bench.torch_device()
      if name == "torch_ref":
        import torch_ref  # pylint: disable=g-import-not-at-top
        self.a = torch_ref.PagedTokenToKVPoolAllocator(pool, self.ps, device=dev)
      else:
        self.a = bench.sglang().SGLangAllocator(pool, self.ps, False, "paged", dev)
      self.conv = lambda x: torch.as_tensor(np.asarray(x, np.int64), device=dev)
      self.cpu = lambda x: torch.as_tensor(np.asarray(x, np.int64))
      if dev == "cuda":
        self.wait = lambda out: torch.cuda.synchronize()

  def decode(self, seq, last):
    args = ((seq, last) if self.name == "sgljax" else
            (self.conv(seq), self.cpu(seq), self.conv(last)))
    return lambda: self.a.alloc_decode(*args)

  def extend(self, pre, seq, last, n):
    args = ((pre, seq, last, n) if self.name == "sgljax" else
            (self.conv(pre), self.cpu(pre), self.conv(seq), self.cpu(seq), self.conv(last), n))
    return lambda: self.a.alloc_extend(*args)

  def pages(self, n: int) -> np.ndarray:
    """n pages handed out (host ints)."""
    out = self.a.alloc(n * self.ps)
    if out is None:
      raise RuntimeError(f"{self.name}: pool too small for the rows")
    return np.asarray(out.cpu() if hasattr(out, "cpu") else out)[::self.ps] // self.ps


def class_timed(spec: str, op: str, n: int, o) -> bench.Timed:
  impl = ClassImpl(spec, o)
  ps, rng, before = impl.ps, np.random.default_rng(0), None
  if op in ("decode", "decode_after_restore", "restore_after_decode"):
    seq = bench.decode_lens(n, ps, rng)
    call = impl.decode(seq, impl.pages(n) * ps + (seq - 2) % ps)
  elif op == "extend":
    pre = rng.integers(0, 4 * ps, n)
    last = np.where(pre > 0, impl.pages(n) * ps + (pre - 1) % ps, -1)
    call = impl.extend(pre, pre + o.extend_tokens, last, n * o.extend_tokens)
  else:  # free: T slots of whole pages, taken back (LIFO) untimed before each call
    need = -(-n // ps) * ps
    held = impl.a.alloc(need)
    idx = held[:n] if hasattr(held, "cpu") else np.asarray(held)[:n]
    call = lambda: impl.a.free(idx)
    before = lambda: impl.a.alloc(need)
  if op.endswith("_after_restore"):
    snap = impl.a.backup_state()
    before = lambda: impl.a.restore_state(snap)
  elif op.startswith("restore_after_"):  # the restore itself, after the untimed call
    snap, work = impl.a.backup_state(), call
    call, before = lambda: impl.a.restore_state(snap), lambda: impl.wait(work())

  def measure(opts):
    waits = getattr(impl.a, "status_waits", None)
    out = bench.cell(timing.per_call(call, before=before, wait=impl.wait, reps=opts.reps))
    if before is not None:  # the loop's mean then includes `before`
      del out["sync_us"]
    if waits is not None:
      out["status_waits"] = impl.a.status_waits - waits
    return out
  return bench.Timed(measure)


def floor_timed(o) -> bench.Timed:
  """A jitted x + 1 of an i32[8] on the device backend's device."""
  x = jax.device_put(np.zeros(8, np.int32), resolve_device(o.device))
  fn = jax.jit(lambda v: v + 1)
  return bench.per_call(lambda: fn(x), wait=jax.block_until_ready)


def stalls_timed(mode: str, o) -> bench.Timed:
  """Compile stalls: --stalls random alloc_extend + free calls (1..--stall-max-batch
  requests) on a fresh device class, after `warmup` up to the same maxima (warm)."""
  def measure(opts) -> Dict[str, Any]:
    del opts
    a = kvs.PagedTokenToKVPoolAllocator(o.pool, o.page_size, device=o.device, debug=False)
    warm_s = (a.warmup(max_batch=o.stall_max_batch,
                       max_tokens=o.stall_max_batch * o.extend_tokens).seconds
              if mode == "warm" else 0.0)
    rng, times = np.random.default_rng(1), []
    for _ in range(o.stalls):
      bs = int(rng.integers(1, o.stall_max_batch + 1))
      z, seq = np.zeros(bs, np.int64), rng.integers(1, o.extend_tokens + 1, bs)
      t0 = time.perf_counter()
      if a.alloc_extend(z, z, seq, seq, np.full(bs, -1), int(seq.sum())) is not None:
        a.free(o.page_size * np.arange(1, bs + 1))  # a slot of each of pages 1..bs
      times.append(time.perf_counter() - t0)
      a.clear()
    slow = [t for t in times if t > 0.05]
    return {"us": float(np.median(times)) * 1e6, "calls": len(times),
            "stalls_over_50ms": len(slow), "stall_s": sum(slow), "warmup_s": warm_s,
            "status_waits": a.status_waits}
  return bench.Timed(measure)


CLASS_ROWS = (("decode", "decode"), ("extend", "extend"), ("free", "free"),  # (op, sizes)
              ("decode_after_restore", "restore_decode"),
              ("free_after_restore", "restore_free"),
              ("restore_after_decode", "restore_decode"),
              ("restore_after_free", "restore_free"))


def class_cases(o):
  for op, sizes in CLASS_ROWS:
    for n, spec in itertools.product(getattr(o, sizes), o.impls):
      yield bench.Case({"op": op, "size": n}, spec,
                       functools.partial(class_timed, spec, op, n, o))
  yield bench.Case({"op": "floor", "size": "jit"}, "device", lambda: floor_timed(o))
  for mode in ("cold", "warm") if o.stalls else ():
    yield bench.Case({"op": "stalls", "size": mode}, "device",
                     functools.partial(stalls_timed, mode, o))


def class_render(record: Dict[str, Any]) -> str:
  lines = [bench.table(record, CLASS)]
  waits = [f"{r['op']}/{r['size']} {r['cells']['device']['status_waits']}"
           for r in record["rows"] if "status_waits" in r["cells"].get("device", {})
           and r["op"] != "stalls"]
  if waits:
    lines.append("device calls that waited for a status: " + ", ".join(waits))
  for r in record["rows"]:
    s = r["cells"].get("device", {})
    if "stalls_over_50ms" in s:
      lines.append(f"stalls ({r['size']}): {s['stalls_over_50ms']} of {s['calls']} calls "
                   f"over 50 ms, {s['stall_s']:.2f} s in all; warm-up {s['warmup_s']:.1f} s; "
                   f"{s.get('status_waits', 0)} status waits")
  return "\n".join(lines)


CLASS = bench.Suite(
    name="class", help="one SGLang-style class call per implementation: jax_kvalloc's "
    "device and host backends, sglang-jax, torch_ref, SGLang", cases=class_cases,
    impls=("device", "host", "sgljax", "torch_ref", "sglang"), render=class_render,
    compare=(("host", "sgljax"), ("device", "sglang"), ("host", "sglang")),
    defaults=(("reps", 50),), guarded=("device", "host"),
    guard_target=lambda row, column: (5.0, "%"),  # issue 32: class calls +5% at most
    dims=(bench.Dim("--sgljax", str(DEFAULT_SGLJAX), "folder holding sglang-jax's "
                    "sgljax_allocator.py (loaded by path)", str),
          bench.Dim("--pool", 1 << 24, "pool slots", quick=1 << 16),
          bench.Dim("--page-size", 16, "page size"),
          bench.Dim("--device", None, "jax device of the device backend (default: jax's)",
                    str),
          bench.Dim("--decode", [1, 8, 64, 256, 1024, 4096], "decode rows", quick=[1, 9]),
          bench.Dim("--extend", [1, 4, 16, 64, 256, 1024], "extend rows", quick=[2]),
          bench.Dim("--extend-tokens", 64, "new tokens per extended request", quick=8),
          bench.Dim("--free", [64, 1024, 16384, 65536], "free sizes (slots)", quick=[64]),
          bench.Dim("--restore-decode", [64], "decode rows after restore_state", quick=[8]),
          bench.Dim("--restore-free", [1024], "free sizes after restore_state", quick=[64]),
          bench.Dim("--stalls", 0, "random alloc_extend + free calls of the compile-stall "
                    "count (0: off)"),
          bench.Dim("--stall-max-batch", 256, "largest batch of the stall calls")))


# ---------------------------------------------------------------------------------------
# SWA.
# ---------------------------------------------------------------------------------------

class SWAImpl:
  """One SWA implementation; slots in and out in its own arrays (`ints` converts).
  `spec`: a column, with constructor / config arguments in brackets for ours
  (`class[guard=False]`)."""

  def __init__(self, spec: str, o):
    name, kw = bench.parse_impl(spec)
    self.name, self.ps = name, o.page_size
    size, size_swa, ps = o.size, o.size_swa, o.page_size
    if name == "sglang":
      sglang_oracle = bench.sglang(o.sglang_bundle)
      torch, dev = bench.torch_device()
      cls, standin = sglang_oracle.sglang_swa_class()
      self.a = cls(size, size_swa, ps, torch.float16, dev, standin(), False)
      self.ints = lambda x: torch.as_tensor(np.asarray(x, np.int64), device=dev)
      self.host = lambda x: torch.as_tensor(np.asarray(x, np.int64))
      self.wait = lambda: torch.cuda.synchronize() if dev == "cuda" else None
      return
    dev = resolve_device(o.device)
    self.ints = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
    self.host = lambda x: np.asarray(x, np.int64)
    if name == "class":
      from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator  # pylint: disable=g-import-not-at-top
      self.a = SWATokenToKVPoolAllocator(size, size_swa, ps, None, o.device, None, False,
                                         backend="device", **dict(dict(debug=False), **kw))
      a = self.a
      self.wait = lambda: jax.block_until_ready(a._pools[0].state)  # pylint: disable=protected-access
      return
    self.cfg = swa_core.SWAConfig(size, size_swa, ps, False, **dict(dict(debug=False), **kw))
    self.state = jax.device_put(swa_core.init(self.cfg), dev)
    jit = lambda f, **kw: jax.jit(f, static_argnums=0, donate_argnums=1, **kw)
    self.fns = {"alloc_extend": jit(swa_core.alloc_extend, static_argnames=("max_tokens",)),
                "alloc_decode": jit(swa_core.alloc_decode), "free": jit(swa_core.free),
                "free_swa": jit(swa_core.free_swa), "free_full": jit(swa_core.free_full)}
    self.wait = lambda: jax.block_until_ready(self.state)

  def sync(self, out: Any) -> None:
    """Waits for `out` and for the allocator's state."""
    if self.name != "sglang":
      jax.block_until_ready(out)
    self.wait()

  def __call__(self, op: str, *args):
    """The op on the class, or on the core with the state threaded through."""
    if self.name != "core":
      return getattr(self.a, op)(*args)
    if not op.startswith("alloc_"):
      self.state = self.fns[op](self.cfg, self.state, *args)
      return None
    kw = {"max_tokens": args[5]} if op == "alloc_extend" else {}
    # The class's arguments with their host copies (args[1], args[3]) left out.
    self.state, out, ok = self.fns[op](self.cfg, self.state, *args[0:5:2], **kw)
    return out, ok

  def prefill(self, lens: np.ndarray):
    """alloc_extend of len(lens) requests from prefix 0: the full slots."""
    z = np.zeros(len(lens), np.int64)
    out = self("alloc_extend", self.ints(z), self.host(z), self.ints(lens), self.host(lens),
               self.ints(np.full(len(lens), -1)), int(lens.sum()))
    if self.name == "core":
      out = out[0] if bool(out[1]) else None
    if out is None:
      raise RuntimeError(f"{self.name}: pool too small for the rows")
    return out


def swa_timed(name: str, op: str, n: int, o) -> bench.Timed:
  impl, ps, held = SWAImpl(name, o), o.page_size, {}
  if op == "swa_extend":
    z, seq = np.zeros(n, np.int64), np.full(n, o.extend_tokens, np.int64)
    args = (impl.ints(z), impl.host(z), impl.ints(seq), impl.host(seq),
            impl.ints(np.full(n, -1)), n * o.extend_tokens)
    before = lambda: impl("free", held.pop("out")) if "out" in held else None

    def call():
      res = impl("alloc_extend", *args)
      held["out"] = res[0] if impl.name == "core" else res
      return res
  elif op == "swa_decode":
    seq = bench.decode_lens(n, ps, np.random.default_rng(0))
    last = impl.prefill(seq - 1)[impl.ints(np.cumsum(seq - 1) - 1)]
    args = (impl.ints(seq), impl.host(seq), last)
    before, call = None, lambda: impl("alloc_decode", *args)
  else:  # swa_window_free: each request's oldest page leaves the window
    def before():
      if "idx" in held:
        impl("free_full", held["idx"])
      held["idx"] = impl.prefill(np.full(n, ps, np.int64))
    call = lambda: impl("free_swa", held["idx"])
  return bench.per_call(call, before=before, sync=impl.sync)


OPS = ("swa_extend", "swa_decode", "swa_window_free")


def swa_cases(o):
  for op, sizes in zip(OPS, (o.extend, o.decode, o.window_free)):
    for n in sizes if op in o.ops else ():
      for name in o.impls:
        yield bench.Case({"op": op, "size": n}, name,
                         functools.partial(swa_timed, name, op, n, o))


SWA = bench.Suite(
    name="swa", help="the SWA allocator's extend, decode and window free per call: our "
    "class and core beside SGLang 0.5.23's SWA class", impls=("class", "core", "sglang"),
    cases=swa_cases, compare=(("class", "sglang"), ("core", "sglang")),
    defaults=(("reps", 50),), guarded=("class", "core"),
    guard_target=lambda row, column: (5.0, "%") if column == "class" else None,
    dims=(bench.Dim("--ops", list(OPS), "rows to time", cli.name_list(OPS)),
          bench.Dim("--size", 1 << 20, "full pool slots", quick=2048),
          bench.Dim("--size-swa", 1 << 18, "SWA pool slots", quick=1024),
          bench.Dim("--page-size", 16, "page size", quick=4),
          bench.Dim("--device", None, "jax device of ours (default: jax's)", str),
          bench.Dim("--extend", [1, 16, 64], "extend rows", quick=[2]),
          bench.Dim("--extend-tokens", 64, "new tokens per request", quick=6),
          bench.Dim("--decode", [1, 64, 256, 1024], "decode rows", quick=[5]),
          bench.Dim("--window-free", [16, 256, 1024], "window-free rows", quick=[3]),
          bench.Dim("--sglang-bundle", None, "SGLang bundle folder "
                    "(benchmarks/sglang_bundle.sh) appended to sys.path when sglang is not "
                    "installed (default: $JAX_KVALLOC_SGLANG_BUNDLE, else "
                    "<repo>/.sglang_py312)", str)))
