"""`jax-kvalloc bench kernels`: alloc_decode, alloc_extend and free, one call at a time.

Each case (op, batch size, tokens) is drawn once (random lengths, page-consistent
last_loc, a shuffled pool) and every column times those inputs. Columns:

  pallas, jnp, triton, mosaic, auto, ...  the whole jitted allocator call (pointer
             arithmetic, prefix sums, capacity check, index kernel, masking) with that
             AllocatorConfig.kernel, chained and linked in timing.chain_time. A name may
             carry config fields and free's method: `jnp[guard=False]`,
             `jnp[free=sort]` (freeing.PAGED_FREE: sort, bitmap, triton).
  fused[...] the one-launch Pallas-Triton kernel alone
             (pallas_kernels.alloc_{decode,extend}_triton) with tuning arguments,
             e.g. `fused[layout=rows]`, `fused[layout=tiles,num_warps=8]`.
  eager      free as a scheduler calls it: one jitted call from Python, blocking on its
             result (what torch_ref's eager free, which syncs, is compared with).
  torch_ref  on CUDA a CUDA graph of its Triton kernel, linked like ours (free: its eager
             free, host time); on CPU its eager class calls, host time.
  sglang     SGLang's released Triton kernels (--sglang-kernels), launched as its
             allocator launches them (grid = bs, i64 tensors): linked in a CUDA graph,
             and bare: each kernel's own GPU time from CUPTI.

Every JAX column also reports "floor_us": the same harness around a stand-in that only
writes the case's outputs the way the column does (one XLA fusion for jnp, one Pallas
launch otherwise). --bare adds, where the call compiles to one kernel launch, that
kernel's own GPU time from CUPTI ("bare_us", the figure compared with SGLang's bare);
--extra-consumer times every JAX figure again with one more consumer of its outputs,
net of that consumer's own cost on the stand-in (a figure that moves was not counting
all of its work). The chain: each call takes the free-list head the previous one
returned, the free length held fixed, so that every call does the same work; free's
chain puts the pages it freed back into the ownership record after each call (without
the record, the same scatter on a spare array), so that every call frees held pages.
X and X[guard=False] of one run are timed with their repetitions interleaved.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc.config import KERNELS, AllocatorConfig
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import cli
from jax_kvalloc.tools import report
from jax_kvalloc.tools import timing as bt

DECODE_BS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
EXTEND_CASES = ((1, 8192), (16, 8192), (64, 32768), (256, 65536), (1024, 65536),
                (4096, 262144), (16384, 262144))
OTHERS = ("fused", "eager", "torch_ref", "sglang")
PALLAS = ("pallas", "triton", "mosaic", "mosaic_gpu", "fused")   # columns that need a GPU or TPU
# Bare figures: each kernel's GPU time over BARE_CALLS launches, ours in the bare chain
# of BARE_UNROLL calls, SGLang's in replays of a CUDA graph of BARE_UNROLL launches.
BARE_UNROLL = 128
BARE_CALLS = 2048
OUR_KERNELS = "jax_kvalloc_alloc_"   # jax_kvalloc_alloc_{decode,extend}_triton*
GUARD_TARGET_PCT = 10.0   # the ownership record's cost per call, from bs 64 up (issue 32)


@dataclasses.dataclass
class Case:
  """Inputs of one case (host numpy, int32)."""
  op: str
  bs: int
  tokens: int
  page_size: int
  num_pages: int
  free_ring: np.ndarray            # the pool's free list (a shuffled permutation)
  inputs: Tuple[np.ndarray, ...]   # (seq, last), (pre, seq, last) or (free_index,)
  used_pages: int = 0              # free: pages taken before the frees


def make_case(op: str, bs: int, tokens: int, page_size: int, seed: int) -> Case:
  """A reproducible case; free's slots are an extend's whole new pages."""
  rng = np.random.default_rng([seed, bs, tokens, page_size])
  ps = page_size
  if op == "decode":
    seq = rng.integers(2, 4096, bs)
    inputs = (seq, rng.integers(1, 1000, bs) * ps + (seq - 2) % ps)
    need = tokens = bs
  else:
    ext = (rng.multinomial(tokens - bs, np.full(bs, 1.0 / bs)) + 1 if tokens >= bs
           else np.ones(bs, np.int64))
    pre = (np.where(rng.random(bs) < 0.25, 0, rng.integers(0, 2048, bs)) if op == "extend"
           else np.zeros(bs, np.int64))
    seq = pre + ext
    inputs = (pre, seq, np.where(pre > 0, rng.integers(1, 1000, bs) * ps + (pre - 1) % ps, -1))
    need, tokens = int(np.sum(-(-seq // ps) - (-(-pre // ps)))), int(np.sum(ext))
  num_pages = 2 * need + 1024
  case = Case(op, bs, tokens, ps, num_pages, (rng.permutation(num_pages) + 1).astype(np.int32),
              tuple(np.asarray(a, np.int32) for a in inputs))
  if op == "free":
    extend = functools.partial(allocation.alloc_extend, _config(case, "jnp"),
                               max_tokens=tokens)
    state, out, ok = jax.jit(extend)(_state(case), *case.inputs)
    assert bool(ok)
    case.inputs, case.used_pages = (np.asarray(out),), int(num_pages - state.free_len)
  return case


def _config(case: Case, kernel: str, **kw) -> AllocatorConfig:
  return AllocatorConfig(size=case.num_pages * case.page_size, page_size=case.page_size,
                         kernel=kernel, **kw)


def _state(case: Case, taken: int = 0, guarded: bool = True) -> st.AllocatorState:
  """The pool with `taken` pages already handed out (from the front of the ring), its
  ownership record (where guarded) agreeing: those pages held."""
  cfg = _config(case, "jnp", guard=guarded)
  s = jax.jit(st.init, static_argnums=0)(cfg)
  return st.with_record(cfg, s._replace(
      free_ring=jnp.asarray(case.free_ring),
      free_head=jnp.asarray(taken % case.num_pages, jnp.int32),
      free_len=jnp.asarray(case.num_pages - taken, jnp.int32)))


def jax_call(case: Case, impl: str):
  """(once: () -> the call's result, call(carry, inputs) -> (carry, outputs), carry,
  inputs) of a JAX column. The carry is the state; only its head and ownership record
  move from call to call (free: the ring too, and the record with the freed pages put
  back; without a record, the same scatter on a spare array)."""
  base, kw = bench.parse_impl(impl)
  method = kw.pop("free", None)   # free's method (freeing.PAGED_FREE); the rest: config
  guarded = kw.get("guard", True)
  carry = state0 = _state(case, case.used_pages, guarded)
  args = tuple(map(jnp.asarray, case.inputs))
  if base == "fused":
    import pallas_kernels  # pylint: disable=g-import-not-at-top
    kernel = (functools.partial(pallas_kernels.alloc_decode_triton, **kw)
              if case.op == "decode" else functools.partial(
                  pallas_kernels.alloc_extend_triton, out_len=case.tokens, **kw))

    def call(s, x):
      out, head, length, ok = kernel(s.free_ring, s.free_head, s.free_len,
                                     jnp.int32(case.bs), *x, page_size=case.page_size)
      return s._replace(free_head=head), (out, ok, head, length)
  elif case.op == "free":
    fn = functools.partial(freeing.PAGED_FREE[method] if method else freeing.free,
                           _config(case, base, **kw))
    n = case.num_pages

    def call(c, x):
      s, spare = (c, None) if guarded else c
      res = fn(s, *x)
      held = (res.guard.held if guarded else spare).at[
          jnp.where(x[0] > 0, x[0] // case.page_size, n + 1)].set(1, mode="drop")
      s = s._replace(free_ring=res.free_ring, free_head=res.free_head)
      out = (res.free_head, res.free_len)
      return (s._replace(guard=res.guard._replace(held=held)) if guarded else (s, held)), out
    if not guarded:
      carry = (state0, jnp.zeros((n + 1,), jnp.int32))
  else:
    alloc = (allocation.alloc_decode if case.op == "decode" else
             functools.partial(allocation.alloc_extend, max_tokens=case.tokens))
    cfg = _config(case, base, **kw)

    def call(s, x):
      new, out, ok = alloc(cfg, s, *x)
      return (s._replace(free_head=new.free_head, guard=new.guard),
              (out, ok, new.free_head, new.free_len))

  def once():
    if case.op == "free":
      res = jax.jit(fn)(state0, *args)
      guard.raise_if_refused(res)   # a refused free would time no work
      return st.live_free_pages(res)
    out, ok = jax.jit(call)(state0, args)[1][:2]
    if not bool(ok):
      raise RuntimeError(f"{case.op} bs={case.bs}: the allocation did not fit")
    return out
  return once, call, carry, args


def one_custom_call(call, carry, inputs) -> bool:
  """Whether the compiled call is one custom call and nothing else that launches (the
  condition under which a bare, unlinked chain loses no work)."""
  ops = bt.launches(jax.jit(call).lower(carry, inputs).compile().as_text())
  kernels = ("fusion", "custom-call", "gather", "scatter", "sort", "reduce")
  return ops.get("custom-call") == 1 and sum(ops.get(k, 0) for k in kernels) == 1


def bare_time(run: Callable[[], Any], name_prefix: str) -> Dict[str, float]:
  """The "bare_" figures of a cell: the own GPU time (CUPTI, through torch.profiler) of
  the kernels named `name_prefix`* that `run()` launches BARE_CALLS times."""
  run()  # warm-up
  tb = bt.kernel_time(bt.cuda_activities(run), name_prefix, min_count=BARE_CALLS // 2)
  return dict(bench.cell({k: tb[k] for k in ("s", "q1_s", "q3_s")}, "bare_"),
              bare_spread=tb["spread"])


def time_jax(case: Case, impl: str, opts) -> Dict[str, Any]:
  """A JAX column's cell: the chained call, its floor, and with --bare / --extra-consumer
  the bare kernel time / the +1 consumer check (the module docstring)."""
  _, call, carry, inputs = jax_call(case, impl)
  shapes = jax.eval_shape(call, carry, inputs)[1]
  base, _ = bench.parse_impl(impl)
  stand = (bt.stand_in(shapes) if base == "jnp" or (base == "auto" and not _accel())
           else bt.stand_in_pallas(shapes, interpret=impl.endswith("_interpret")))
  kw = dict(unroll=opts.unroll, min_time=opts.min_time, reps=opts.reps)
  zero = jnp.zeros((), jnp.int32)
  if opts.extra_consumer:
    c = bt.DEFAULT_CONSUMERS
    t2, t3, f2, f3 = bt.chain_time_interleaved(
        [dict(call=call, carry=carry, inputs=inputs, consumers=c),
         dict(call=call, carry=carry, inputs=inputs, consumers=c + 1),
         dict(call=stand, carry=zero, inputs=inputs, consumers=c),
         dict(call=stand, carry=zero, inputs=inputs, consumers=c + 1)], **kw)
    out = bench.cell(t2)
    out.update(us_extra_consumer=t3["s"] * 1e6, extra_consumer_change=t3["s"] / t2["s"] - 1,
               extra_consumer_net_change=(t3["s"] - t2["s"] - (f3["s"] - f2["s"])) / t2["s"],
               floor_us=f2["s"] * 1e6, stand_in_extra_consumer_us=f3["s"] * 1e6)
  else:
    out = bench.cell(_chained(case, impl, opts.impls, kw) or bt.chain_time(
        call, carry, inputs, **kw))
    out["floor_us"] = bt.chain_time(stand, zero, inputs, **kw)["s"] * 1e6
  if opts.bare and case.op != "free":
    try:
      out["single_launch"] = one_custom_call(call, carry, inputs)
      if out["single_launch"]:  # the bare chain: BARE_CALLS launches, BARE_UNROLL a loop
        loop, sink = bt.chain_loop(call, BARE_UNROLL, linked=False), bt.sink_init(
            call, carry, inputs)
        iters = np.int32(BARE_CALLS // BARE_UNROLL)
        out.update(bare_time(lambda: jax.block_until_ready(loop(carry, inputs, sink, iters)),
                             OUR_KERNELS))
    except Exception as e:  # pylint: disable=broad-except
      out["bare_error"] = bench.error(e)["error"]
  return out


_PAIR: Dict[str, Any] = {}   # the last row's guard pair: {"case", "pair", "results"}


def _chained(case: Case, impl: str, impls, kw) -> Optional[Dict[str, float]]:
  """Where the run has both X and X[guard=False] (bench.guard_pairs) and `impl` is one of
  them: this column's chain_time figures, both timed once per row with their repetitions
  interleaved (timing.chain_time_interleaved: a drift of the machine falls on both
  alike). Else None."""
  pair = next((p for p in bench.guard_pairs(impls) if impl in p), None)
  if pair is None:
    return None
  if _PAIR.get("case") is not case or _PAIR.get("pair") != pair:
    variants = [dict(zip(("call", "carry", "inputs"), jax_call(case, i)[1:])) for i in pair]
    _PAIR.update(case=case, pair=pair, results=dict(zip(pair, bt.chain_time_interleaved(
        variants, **kw))))
  return _PAIR["results"][impl]


def eager_free(case: Case, guarded: bool = True) -> bench.Timed:
  """free called from Python, one jitted call blocking on its result each time (every
  call from the same state, which holds the pages it frees)."""
  fn = jax.jit(functools.partial(freeing.free, _config(case, "jnp", guard=guarded)))
  state0, idx = _state(case, case.used_pages, guarded), jnp.asarray(case.inputs[0])
  return bench.host(lambda: jax.block_until_ready(fn(state0, idx)))


def _with_method(timed: bench.Timed, method: str) -> bench.Timed:
  return bench.Timed(lambda o: dict(timed.measure(o), method=method), timed.output)


# ---------------------------------------------------------------------------------------
# torch_ref and SGLang's released kernels.
# ---------------------------------------------------------------------------------------

def torch_timed(case: Case) -> bench.Timed:
  """torch_ref on this case: on CUDA its Triton kernel in a CUDA graph, linked (free: the
  eager free, which syncs); on CPU its eager class calls."""
  torch, dev = bench.torch_device()
  import torch_ref  # pylint: disable=g-import-not-at-top
  cuda, ps = dev == "cuda", case.page_size
  t64 = lambda a, d=dev: torch.as_tensor(np.asarray(a, np.int64), device=d)
  alloc = torch_ref.PagedTokenToKVPoolAllocator(case.num_pages * ps, ps, None, dev, None,
                                                False, kernel="triton" if cuda else "torch")
  alloc.free_pages = t64(case.free_ring)[case.used_pages:]
  inputs, snap = tuple(map(t64, case.inputs)), alloc.backup_state()
  if case.op == "free":
    eager = lambda: alloc.free(inputs[0]) or alloc.free_pages
  else:  # the lengths each beside a host copy, last_loc, extend's token count
    args = [a for x, d in zip(case.inputs[:-1], inputs) for a in (d, t64(x, "cpu"))]
    args += [inputs[-1]] + [case.tokens] * (case.op == "extend")
    eager = lambda: getattr(alloc, "alloc_" + case.op)(*args)
  out = eager()
  alloc.restore_state(snap)
  if out is None:
    raise RuntimeError(f"torch_ref {case.op} bs={case.bs}: the allocation did not fit")
  out = out.cpu().numpy().copy()

  def call():
    alloc.restore_state(snap)
    return eager()
  if case.op == "free" or not cuda:
    return _with_method(
        bench.host(call, torch.cuda.synchronize if cuda else lambda: None,
                   output=lambda: out),
        ("eager free(), host time per call" + " (torch.unique syncs)" * cuda)
        if case.op == "free" else "eager class call (torch on CPU)")
  from torch_ref import triton_kernels  # pylint: disable=g-import-not-at-top
  ring = t64(case.free_ring)
  if case.op == "decode":
    kernel = lambda: triton_kernels.decode_indices(*inputs, ring, page_size=ps)
  else:
    kernel = lambda: triton_kernels.extend_indices(*inputs, ring, page_size=ps,
                                                   extend_num_tokens=case.tokens)
  return _with_method(bench.graph(bt.torch_linked(kernel, inputs), output=lambda: out),
                      "CUDA graph replay of its Triton kernel, linked")


@functools.lru_cache(maxsize=2)
def load_sglang_kernels(path: str):
  """SGLang's `sglang/kernels/ops/memory/allocator.py` (it imports only torch and
  triton), loaded from that file alone."""
  module = bench.load_file(path, "sglang_allocator_kernels")
  for name in ("alloc_extend_kernel", "alloc_decode_kernel"):
    if not hasattr(module, name):
      raise AttributeError(f"--sglang-kernels {path!r} has no {name}")
  return module


def sglang_timed(case: Case, path: Optional[str]) -> bench.Timed:
  """SGLang's Triton kernel on this case, launched as SGLang's allocator launches it
  (grid = bs, bs_upper = the next power of two, i64 tensors): linked in a CUDA graph
  ("us"), and bare ("bare_us": its own GPU time over BARE_CALLS graph-replayed launches)."""
  torch, dev = bench.torch_device()
  if not path:
    raise bench.Skip("give --sglang-kernels PATH (sglang/kernels/ops/memory/allocator.py "
                     "of the sglang wheel)")
  if dev != "cuda":
    raise bench.Skip("SGLang's Triton kernels need torch with CUDA")
  import triton  # pylint: disable=g-import-not-at-top
  kernel = getattr(load_sglang_kernels(path), f"alloc_{case.op}_kernel")
  wheel = os.path.join(os.path.dirname(path), "VERSION")
  version = open(wheel).read().strip() if os.path.exists(wheel) else None
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device="cuda")
  inputs, free = tuple(map(t64, case.inputs)), t64(case.free_ring)
  out = torch.empty(case.tokens, dtype=torch.int64, device="cuda")  # decode: tokens = bs
  upper = triton.next_power_of_2(case.bs)

  def call():
    kernel[(case.bs,)](*inputs, free, out, upper, case.page_size)
    return out
  result = call().cpu().numpy()

  def measure(o):
    g = bt.torch_graph(call, BARE_UNROLL)

    def replays():
      for _ in range(BARE_CALLS // BARE_UNROLL):
        g.replay()
      torch.cuda.synchronize()
    return dict(bench.graph(bt.torch_linked(call, inputs)).measure(o),
                **bare_time(replays, f"alloc_{case.op}_kernel"), sglang_version=version)
  return bench.Timed(measure, lambda: result)


# ---------------------------------------------------------------------------------------
# The suite.
# ---------------------------------------------------------------------------------------

def _accel() -> bool:
  return jax.default_backend() != "cpu"


def cases(o):
  jax_impls = [i for i in o.impls if bench.parse_impl(i)[0] in KERNELS
               and (_accel() or bench.parse_impl(i)[0] not in PALLAS)]
  if jax_impls:  # the harness's own floor: a scalar call
    yield bench.Case({"op": "harness", "bs": 1, "tokens": 1}, jax_impls[0], lambda: bench.Timed(
        lambda opts: {"us": bt.loop_overhead(unroll=opts.unroll, min_time=opts.min_time,
                                             reps=opts.reps) * 1e6}))
  for op in o.ops:
    sizes = ([(bs, bs) for bs in o.batch_sizes] if op == "decode" else o.extend_cases)
    for bs, tokens in sizes:
      case = functools.lru_cache(1)(lambda op=op, bs=bs, t=tokens: make_case(
          op, bs, t, o.page_size, o.seed))
      row = {"op": op, "bs": bs, "tokens": tokens}
      for impl in o.impls:
        base, kw = bench.parse_impl(impl)
        if (base == "eager") != (op == "free") and base in ("eager", "fused", "sglang"):
          continue  # eager: free only; fused kernels and SGLang's: decode, extend only
        if base in PALLAS and not _accel():
          setup = lambda: bench.skipped("no GPU/TPU: the Pallas kernels need one")
        elif base in ("eager", "torch_ref", "sglang"):
          setup = {"eager": lambda c=case, g=kw.get("guard", True): eager_free(c(), g),
                   "torch_ref": lambda c=case: torch_timed(c()),
                   "sglang": lambda c=case: sglang_timed(c(), o.sglang_kernels)}[base]
        else:
          setup = lambda c=case, i=impl: bench.Timed(
              lambda opts, c=c, i=i: time_jax(c(), i, opts), jax_call(c(), i)[0])
        yield bench.Case(row, impl, setup)


SUITE = bench.Suite(
    name="kernels", impls=KERNELS + OTHERS,
    help="alloc_decode, alloc_extend and free per call: jax_kvalloc's paths (any kernel, "
    "tuning or config field), torch_ref, SGLang's released Triton kernels",
    default_impls=("pallas", "jnp", "eager", "torch_ref", "sglang"), cases=cases,
    dims=(bench.Dim("--ops", ["decode", "extend", "free"], "operations",
                    cli.name_list(("decode", "extend", "free"))),
          bench.Dim("--batch-sizes", list(DECODE_BS), "decode batch sizes", quick=[1, 64]),
          bench.Dim("--extend-cases", ",".join(f"{b}x{t}" for b, t in EXTEND_CASES),
                    "extend and free cases, BSxTOKENS", cli.pairs("BSxTOKENS", "16x8192"),
                    quick="4x512"),
          bench.Dim("--page-size", 64, "page size"),
          bench.Dim("--seed", 0, "seed of the cases' draws"),
          bench.Dim("--bare", False, "also each kernel's own GPU time, where the call is "
                    "one launch (CUPTI through torch.profiler; CUDA)"),
          bench.Dim("--extra-consumer", False, "time every JAX figure again with one more "
                    "consumer of its outputs, net of the consumer's own cost"),
          bench.Dim("--sglang-kernels", None, "SGLang's sglang/kernels/ops/memory/"
                    "allocator.py from its wheel (CUDA)", cli.existing_file)),
    render=lambda r: render(r), guarded=KERNELS + ("eager",),
    guard_target=lambda row, col: (GUARD_TARGET_PCT, "%") if row["bs"] >= 64 and (
        bench.parse_impl(col)[0] in KERNELS) else None)


# ---------------------------------------------------------------------------------------
# The tables of a kernels or serving record.
# ---------------------------------------------------------------------------------------

SCAN_ALLOC_TARGET_US = 5.0
DECODE_BIG_SPEEDUP = 20.0
EXTRA_CONSUMER_TOLERANCE = 0.10
RATIOS = (("sglang", "pallas", "bare_"), ("torch_ref", "eager", ""))  # (theirs, ours, figure)
SGLANG_NOTE = ("; sglang: its Triton kernel, CUDA graph replay, linked like ours (bare: each "
               "kernel's own GPU time, median over 2048 launches, from CUPTI; faster / "
               "slower only where the interquartile ranges do not overlap, else tie); "
               "linked figures include each side's own link (XLA fuses ours into 1-2 "
               "kernels, torch runs 4-5 eager ones), so no ratio is taken between them")


def _fig(row: Dict[str, Any], impl: str, key: str = "us") -> Any:
  return (row["cells"].get(impl) or {}).get(key)


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
  return num / den if num and den else None


def consumer_change(cell: Dict[str, Any]) -> float:
  """The +1 consumer change the check reads: net of the consumer's own cost where the
  run measured it, else the raw change."""
  return cell.get("extra_consumer_net_change", cell["extra_consumer_change"])


def consumer_cell(cell: Dict[str, Any]) -> str:
  """'+raw% (net +n%)' for the +1 consumer column."""
  if "extra_consumer_change" not in cell:
    return "-"
  raw = f"{100 * cell['extra_consumer_change']:+.0f}%"
  net = cell.get("extra_consumer_net_change")
  return raw if net is None else f"{raw} ({100 * net:+.0f}%)"


def bare_cells(row: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """(pallas cell, sglang cell) of a record's row, each possibly empty."""
  return row["cells"].get("pallas") or {}, row["cells"].get("sglang") or {}


def bare_verdict(row: Dict[str, Any]) -> Optional[str]:
  """The pallas kernel against SGLang's, both bare (report.verdict of their quartiles);
  None where either bare figure is missing."""
  pb, sg = bare_cells(row)
  if pb.get("bare_us") is None or sg.get("bare_us") is None:
    return None
  return report.verdict(report.iqr(pb, "bare_"), report.iqr(sg, "bare_"))


def _check(row: Dict[str, Any]) -> str:
  return next((c["check"] for c in row["cells"].values() if "check" in c), "ok")


def micro_tables(record: Dict[str, Any]) -> str:
  """A table per operation: each column's median (us per call), then every floor, bare
  and +1 consumer figure the run recorded, the RATIOS, the bare verdict of pallas against
  sglang and the outputs' check; each failed cell's error below."""
  f = report.fmt_us
  out = []
  for op in dict.fromkeys(r["op"] for r in record["rows"] if r["op"] != "harness"):
    rows = [r for r in record["rows"] if r["op"] == op]
    impls = list(dict.fromkeys(i for r in rows for i in r["cells"]))
    has = lambda key: [i for i in impls if any(_fig(r, i, key) is not None for r in rows)]
    fig = lambda i, key: lambda r: f(_fig(r, i, key))
    cols = [(f"{i} (us)", lambda r, i=i: "error" if _fig(r, i, "error") else f(_fig(r, i)))
            for i in impls]
    cols += [(f"{i} floor (us)", fig(i, "floor_us")) for i in has("floor_us")]
    cols += [(f"{i} bare (us)", fig(i, "bare_us")) for i in has("bare_us")]
    cols += [(f"{a}{' bare' * bool(p)} / {b}{' bare' * bool(p)}", lambda r, a=a, b=b, p=p:
              report.fmt_ratio(_ratio(_fig(r, a, p + "us"), _fig(r, b, p + "us"))))
             for a, b, p in RATIOS if a in has(p + "us") and b in has(p + "us")]
    if "sglang" in impls and "pallas" in has("bare_us"):
      cols.append(("pallas bare vs sglang bare", lambda r: bare_verdict(r) or "-"))
    cols += [(f"{i} +1 consumer (net)", lambda r, i=i: consumer_cell(r["cells"].get(i) or {}))
             for i in has("extra_consumer_change")]
    methods = ", ".join(dict.fromkeys(m for r in rows if (m := _fig(r, "torch_ref", "method"))))
    out.append(f"{op} (page_size {record['settings']['page_size']}; us per call, median"
               + (f"; torch_ref: {methods}" if methods else "")
               + (SGLANG_NOTE if "sglang" in impls else "") + ")")
    out.append(report.table(["bs", "tokens"] + [h for h, _ in cols] + ["check"],
                            [[r["bs"], r["tokens"]] + [c(r) for _, c in cols] + [_check(r)]
                             for r in rows]))
    out += [f"  {op} bs={r['bs']} {i}: {c['error']}" for r in rows
            for i, c in r["cells"].items() if "error" in c]
    out.append("")
  return "\n".join(out)


SERVING_COLUMNS = (  # (header, figure of serving_figures)
    ("jit/step sync", "jit_sync"), ("jit/step async", "jit"),
    ("jit/step, no allocator", "jit_none"), ("scan/step", "scan"),
    ("scan, no allocator", "scan_none"), ("allocator in scan", "alloc"),
    ("alloc_decode in scan", "alloc_decode"), ("free in scan", "free"),
    ("allocator in scan, page release", "alloc_pages"),
    ("allocator in scan, fused release+decode", "alloc_fused"),
    ("torch_ref sync/step", "torch_sync"), ("torch_ref async/step", "torch"))


def serving_figures(row: Dict[str, Any]) -> Dict[str, float]:
  """us per step of a serving row's columns, and what the allocator adds to a step in
  the scan: alloc, alloc_pages, alloc_fused (scan, scan_pages, scan_fused less
  scan_none) and alloc_decode, free (what one more call of each adds to scan)."""
  u = {i: c["us"] for i, c in row["cells"].items() if "us" in c}
  for name, a, b in (("alloc", "scan", "scan_none"), ("alloc_pages", "scan_pages", "scan_none"),
                     ("alloc_fused", "scan_fused", "scan_none"),
                     ("alloc_decode", "scan_extra_alloc", "scan"),
                     ("free", "scan_extra_free", "scan")):
    if a in u and b in u:
      u[name] = u[a] - u[b]
  return u


def serving_table(record: Dict[str, Any]) -> str:
  f, rows = report.fmt_us, record["rows"]
  torch_on = any("torch" in r["cells"] or "torch_sync" in r["cells"] for r in rows)
  cols = [c for c in SERVING_COLUMNS if torch_on or not c[1].startswith("torch")]
  body = []
  for r in rows:
    u = serving_figures(r)
    parity = ("MISMATCH" if _check(r) != "ok" else "identical" if torch_on else "jax only")
    body.append([r["bs"]] + [f(u.get(k)) for _, k in cols] + [
        report.fmt_ratio(_ratio(u.get("torch_sync"), u.get("jit_sync"))),
        report.fmt_ratio(_ratio(u.get("torch"), u.get("jit"))), parity] * torch_on)
  header = ["bs"] + [h for h, _ in cols] + ["sync: torch / jit", "async: torch / jit",
                                            "parity"] * torch_on
  return (f"serving loop (page_size {rows[0]['page_size']}, {rows[0]['steps']} decode steps; "
          f"us per step, median of {record['settings']['reps']} runs; sync: the host waits "
          "for each step, async: once at the end; 'no allocator': free and alloc_decode "
          "replaced by stand-ins; 'in scan': what the allocator, or one more alloc_decode "
          "or free, adds to a step; page release: free_page_ids; fused: "
          "release_and_alloc_decode, one call)\n"
          + report.table(header, body) + "\n")


def _met(ok: bool) -> str:
  return "met" if ok else "MISSED"


def targets(record: Dict[str, Any]) -> List[Tuple[str, str, str]]:
  """(target, measured, verdict) rows, every measured figure from the record."""
  out = []
  if record["suite"] == "serving":
    for r in record["rows"]:
      u = serving_figures(r)
      if u.get("torch_sync") and u.get("jit_sync"):
        out.append((f"serving bs={r['bs']}: jit/step <= half of torch_ref eager/step "
                    f"(both syncing once per step)",
                    f"{u['jit_sync']:.1f} vs {u['torch_sync']:.1f} us",
                    _met(u["jit_sync"] <= 0.5 * u["torch_sync"])))
      for key, what in (("alloc", "free of slots, sorted unique"),
                        ("alloc_pages", "request-level page release"),
                        ("alloc_fused", "page release and alloc_decode in one call")):
        if key in u:
          out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us"
                      f" per step in a scan ({what})", f"{u[key]:.2f} us",
                      _met(u[key] <= SCAN_ALLOC_TARGET_US)))
    return out
  rows = [r for r in record["rows"] if r["op"] != "harness"]
  main = "pallas" if any("pallas" in r["cells"] for r in rows) else "jnp"
  t = lambda r: _fig(r, main)
  ratio = lambda r: bare_cells(r)[1]["bare_us"] / bare_cells(r)[0]["bare_us"]
  for op in ("decode", "extend"):
    timed = [r for r in rows if r["op"] == op and t(r) is not None]
    words = {r["bs"]: bare_verdict(r) for r in timed if bare_verdict(r)}
    if words:
      worst = min((r for r in timed if r["bs"] in words), key=ratio)
      slower = [bs for bs, w in words.items() if w == "slower"]
      measured = f"worst bs={worst['bs']}: {ratio(worst):.2f}x" + "".join(
          f"; {w} at bs {', '.join(map(str, b))}" for w, b in
          (("slower", slower), ("tie", [bs for bs, w in words.items() if w == "tie"])) if b)
      verdict = (f"MISSED at {len(slower)}/{len(words)}" if slower else report.NO_SPREAD
                 if report.NO_SPREAD in words.values() else "met")
      out.append((f"{op}: pallas kernel at least as fast as SGLang's kernel, both bare "
                  f"(same run) at every size", measured, verdict))
    big = sorted((r for r in timed if r["bs"] >= 1024), key=lambda r: r["bs"])
    if len(big) >= 2:
      worst_e, at = max((math.log(t(b) / t(a)) / math.log(b["bs"] / a["bs"]), b["bs"])
                        for a, b in zip(big, big[1:]))
      out.append((f"{op}: linear growth in bs (largest log-log slope between "
                  f"consecutive sizes from bs 1024)", f"{worst_e:.2f} (up to bs {at})",
                  _met(worst_e <= 1.25)))
  for r in rows:
    if r["op"] != "decode" or r["bs"] != 16384 or not bare_verdict(r):
      continue
    q_ours, q_theirs = (report.iqr(c, "bare_") for c in bare_cells(r))
    word = (_met(q_theirs[0] >= DECODE_BIG_SPEEDUP * q_ours[1]) if q_ours and q_theirs
            else report.NO_SPREAD)  # the whole interquartile ranges this far apart
    out.append((f"decode bs 16384: pallas kernel >= {DECODE_BIG_SPEEDUP:.0f}x faster than "
                f"SGLang's, both bare (same run)", f"{ratio(r):.0f}x", word))
  changes = [(abs(consumer_change(c)), r, i) for r in rows
             for i, c in r["cells"].items() if "extra_consumer_change" in c]
  if changes:
    worst, r, i = max(changes, key=lambda x: x[0])
    out.append((f"every JAX figure moves < {100 * EXTRA_CONSUMER_TOLERANCE:.0f}% with one "
                f"more consumer of its outputs (net of that consumer's own cost on the "
                f"stand-in)", f"worst {100 * worst:.1f}% ({r['op']} bs={r['bs']} {i})",
                _met(worst < EXTRA_CONSUMER_TOLERANCE)))
  return out


def render(record: Dict[str, Any]) -> str:
  """The tables `jax-kvalloc bench kernels` / `serving` print (and `jax-kvalloc report`)."""
  e = record["env"]
  sglang = next((c["sglang_version"] for r in record["rows"] for c in r["cells"].values()
                 if c.get("sglang_version")), e.get("sglang"))
  lines = [f"jax-kvalloc bench on {e['platform']}:{e['device']} ({e['date']}; python "
           f"{e['python']}, jax {e['jax']}, torch {e.get('torch')}, triton "
           f"{e.get('triton') or '-'}" + (f", SGLang kernels: {sglang}" if sglang else "") + ")"]
  floor = record.get("loop_overhead_us", next(
      (_fig(r, i) for r in record["rows"] if r.get("op") == "harness" for i in r["cells"]),
      None))
  if floor is not None:
    lines.append(
        f"harness floor: {floor:.3f} us per call for a scalar call (unroll "
        f"{record['settings']['unroll']}; a column's floor is the same harness around a "
        "stand-in that only writes the case's outputs the way the column does: one XLA "
        "fusion for jnp, one Pallas launch otherwise; 'harness floor' is an XLA stand-in "
        "for every column)")
  lines += [f"note: {k} column skipped: {v}" for k, v in record["skipped"].items()] + [""]
  lines.append(serving_table(record) if record["suite"] == "serving" else
               micro_tables(record))
  rows = targets(record)
  if rows:
    lines.append("targets (each measured figure from this run)")
    lines.append(report.table(["target", "measured", "verdict"], rows, align="llr"))
  mism = bench.mismatches(record)
  if mism:
    lines.append(f"\nCHECK FAILED in {len(mism)} case(s): outputs disagree (see 'check').")
  return "\n".join(lines)
