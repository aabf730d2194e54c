"""`jax-kvalloc bench kernels`: alloc_decode, alloc_extend and free, one call at a time.

Each case (op, batch size, tokens) is drawn once (`make_case`: random lengths,
page-consistent last_loc, a shuffled pool) and every column times those inputs; every
column's output must equal the first column's. Columns:

  pallas, jnp, triton, mosaic, auto, ...  the whole jitted allocator call (pointer
             arithmetic, prefix sums, capacity check, index kernel, masking) with that
             AllocatorConfig.kernel, chained and linked in timing.chain_time. A name may
             carry config fields and free's method: `jnp[guard=False]`,
             `jnp[free=sort]` (freeing.PAGED_FREE: sort, bitmap, triton).
             --guard on,off runs each such column (and eager) also as X[guard=False],
             without the ownership record (SPEC 14), beside X, the two chains timed
             with their repetitions interleaved: the record's cost (bench.guard_cost;
             target: +10% at most from bs 64 up).
  fused[...] the one-launch Pallas-Triton kernel alone
             (pallas_kernels.alloc_{decode,extend}_triton) with tuning arguments,
             e.g. `fused[layout=rows]`, `fused[layout=tiles,num_warps=8]`.
  eager      free as a scheduler calls it: one jitted call from Python, blocking on its
             result (what torch_ref's eager free, which syncs, is compared with).
  torch_ref  on CUDA a CUDA graph of its Triton kernel, linked like ours (free: its eager
             free, host time); on CPU its eager class calls, host time.
  sglang     SGLang's released Triton kernels (--sglang-kernels PATH: the wheel's
             sglang/kernels/ops/memory/allocator.py, loaded from that file alone),
             launched as its allocator launches them (grid = bs, i64 tensors): linked in
             a CUDA graph, and bare: each kernel's own GPU time from CUPTI.

Every JAX column also reports "floor_us": the same harness around a stand-in that only
writes the case's outputs the way the column does (one XLA fusion for jnp, one Pallas
launch otherwise). --bare adds, where the call compiles to one kernel launch, that
kernel's own GPU time from CUPTI ("bare_us", the figure compared with SGLang's bare);
--extra-consumer times every JAX figure again with one more consumer of its outputs,
net of that consumer's own cost on the stand-in (a figure that moves was not counting
all of its work). The chain: each call takes the free-list head the previous one
returned, the free length held fixed (the pool never runs out, every call does the same
work). With the ownership record the allocations carry it from call to call; free's
chain puts the pages it freed back into the record after each call (one scatter of the
case's pages, made alike on a spare array without the record), so that every call frees
held pages, as it would in a serving loop.
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
  """Inputs of one case (host numpy, int32 unless said)."""
  op: str
  bs: int
  tokens: int
  page_size: int
  num_pages: int
  free_ring: np.ndarray            # the pool's free list (a shuffled permutation)
  seq: np.ndarray
  pre: Optional[np.ndarray] = None
  last: Optional[np.ndarray] = None
  free_index: Optional[np.ndarray] = None   # free: slots to free (an extend's output)
  used_pages: int = 0                       # free: pages taken before the frees

  @property
  def inputs(self) -> Tuple[np.ndarray, ...]:
    """The call's array arguments: (seq, last), (pre, seq, last) or (free_index,)."""
    return {"decode": (self.seq, self.last), "extend": (self.pre, self.seq, self.last),
            "free": (self.free_index,)}[self.op]


def make_case(op: str, bs: int, tokens: int, page_size: int, seed: int) -> Case:
  """A reproducible case: random lengths, page-consistent last_loc, a shuffled pool;
  free's slots are an extend's whole new pages."""
  rng = np.random.default_rng([seed, bs, tokens, page_size])
  ps = page_size
  if op == "decode":
    seq = rng.integers(2, 4096, bs)
    pre = None
    last = rng.integers(1, 1000, bs) * ps + (seq - 2) % ps
    need = bs
  else:
    ext = (rng.multinomial(tokens - bs, np.full(bs, 1.0 / bs)) + 1 if tokens >= bs
           else np.ones(bs, np.int64))
    pre = (np.where(rng.random(bs) < 0.25, 0, rng.integers(0, 2048, bs)) if op == "extend"
           else np.zeros(bs, np.int64))
    seq = pre + ext
    last = np.where(pre > 0, rng.integers(1, 1000, bs) * ps + (pre - 1) % ps, -1)
    need = int(np.sum(-(-seq // ps) - (-(-pre // ps))))
  num_pages = 2 * need + 1024
  ring = (rng.permutation(num_pages) + 1).astype(np.int32)
  i32 = lambda a: None if a is None else np.asarray(a, np.int32)
  case = Case(op, bs, int(np.sum(seq - pre)) if pre is not None else bs, ps, num_pages,
              ring, i32(seq), i32(pre), i32(last))
  if op == "free":
    extend = functools.partial(allocation.alloc_extend, _config(case, "jnp"))
    state, out, ok = jax.jit(extend, static_argnames="max_tokens")(
        _state(case), case.pre, case.seq, case.last, max_tokens=case.tokens)
    assert bool(ok)
    case.free_index = np.asarray(out)
    case.used_pages = int(num_pages - state.free_len)
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
  back; without a record, the same scatter on a spare array); every output is returned
  for the harness to consume."""
  base, kw = bench.parse_impl(impl)
  method = kw.pop("free", None)   # free's method (freeing.PAGED_FREE); the rest: config
  guarded = kw.get("guard", True)
  state0 = _state(case, case.used_pages, guarded)
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
      held = res.guard.held if guarded else spare
      held = held.at[jnp.where(x[0] > 0, x[0] // case.page_size, n + 1)].set(1, mode="drop")
      s = s._replace(free_ring=res.free_ring, free_head=res.free_head)
      out = (res.free_head, res.free_len)
      if guarded:
        return s._replace(guard=res.guard._replace(held=held)), out
      return (s, held), out
    if not guarded:
      state0 = (state0, jnp.zeros((n + 1,), jnp.int32))
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
      res = jax.jit(fn)(state0 if guarded else state0[0], *args)
      guard.raise_if_refused(res)   # a refused free would time no work
      return st.live_free_pages(res)
    out, ok = jax.jit(call)(state0, args)[1][:2]
    if not bool(ok):
      raise RuntimeError(f"{case.op} bs={case.bs}: the allocation did not fit")
    return out
  return once, call, state0, args


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
  """A JAX column's cell: the chained call, its floor (a stand-in writing its outputs
  like the column: one Pallas launch unless the column is jnp, or auto on the CPU), and
  with --bare / --extra-consumer the bare kernel time / the +1 consumer check. X and
  X[guard=False] of one run: the chained figure interleaved with the other's (`_chained`)."""
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
               stand_in_us=f2["s"] * 1e6, stand_in_extra_consumer_us=f3["s"] * 1e6,
               floor_us=f2["s"] * 1e6)
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
  them: the chain_time figures of both, their repetitions interleaved
  (timing.chain_time_interleaved, so that a drift of the machine falls on both alike),
  timed once per row for the two columns; this column's. Else None."""
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
  state0, idx = _state(case, case.used_pages, guarded), jnp.asarray(case.free_index)
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
  t64 = lambda a: None if a is None else torch.as_tensor(np.asarray(a, np.int64), device=dev)
  c64 = lambda a: torch.as_tensor(np.asarray(a, np.int64))
  alloc = torch_ref.PagedTokenToKVPoolAllocator(case.num_pages * ps, ps, None, dev, None,
                                                False, kernel="triton" if cuda else "torch")
  alloc.free_pages = t64(case.free_ring)[case.used_pages:]
  pre, seq, last, snap = t64(case.pre), t64(case.seq), t64(case.last), alloc.backup_state()
  if case.op == "free":
    idx = t64(case.free_index)
    eager = lambda: alloc.free(idx) or alloc.free_pages
  elif case.op == "decode":
    eager = lambda: alloc.alloc_decode(seq, c64(case.seq), last)
  else:
    eager = lambda: alloc.alloc_extend(pre, c64(case.pre), seq, c64(case.seq), last,
                                       case.tokens)
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
    kernel = lambda: triton_kernels.decode_indices(seq, last, ring, page_size=ps)
  else:
    kernel = lambda: triton_kernels.extend_indices(pre, seq, last, ring, page_size=ps,
                                                   extend_num_tokens=case.tokens)
  inputs = tuple(x for x in (pre, seq, last) if x is not None)
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
  module = load_sglang_kernels(path)
  wheel = os.path.join(os.path.dirname(path), "VERSION")
  version = open(wheel).read().strip() if os.path.exists(wheel) else None
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device="cuda")
  free, seq, last = t64(case.free_ring), t64(case.seq), t64(case.last)
  bs, upper = case.bs, triton.next_power_of_2(case.bs)
  if case.op == "decode":
    out, inputs = torch.empty(bs, dtype=torch.int64, device="cuda"), (seq, last)
    launch = lambda: module.alloc_decode_kernel[(bs,)](seq, last, free, out, upper,
                                                       case.page_size)
  else:
    pre = t64(case.pre)
    out, inputs = torch.empty(case.tokens, dtype=torch.int64, device="cuda"), (pre, seq, last)
    launch = lambda: module.alloc_extend_kernel[(bs,)](pre, seq, last, free, out, upper,
                                                       case.page_size)

  def call():
    launch()
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
    render=lambda r: render(legacy(r)), guarded=KERNELS + ("eager",),
    guard_target=lambda row, col: (GUARD_TARGET_PCT, "%") if row["bs"] >= 64 and (
        bench.parse_impl(col)[0] in KERNELS) else None)


# ---------------------------------------------------------------------------------------
# The tables (of this suite's and the serving suite's records, and of the files earlier
# runs wrote: {"env", "config", "loop_overhead_us", "micro", "serving", "notes"}).
# ---------------------------------------------------------------------------------------

SERVING_KEYS = {"jit_sync": "jit_step_sync", "jit": "jit_step", "jit_none":
                "jit_step_baseline", "scan": "scan", "scan_none": "scan_baseline",
                "scan_extra_alloc": "scan_extra_alloc", "scan_extra_free": "scan_extra_free",
                "scan_pages": "scan_pages", "scan_fused": "scan_fused",
                "torch_sync": "torch_step_sync", "torch": "torch_step"}
SCAN_ALLOC_TARGET_US = 5.0
DECODE_BIG_SPEEDUP = 20.0
EXTRA_CONSUMER_TOLERANCE = 0.10


def legacy(record: Dict[str, Any]) -> Dict[str, Any]:
  """A kernels or serving record in the shape `render` reads (an earlier run's file as
  it is)."""
  if "suite" not in record:
    return record
  s, rows, env = record["settings"], record["rows"], dict(record["env"])
  env["triton"] = env.get("triton") or "-"
  out = {"env": env, "micro": [], "serving": [],
         "notes": [f"{k} column skipped: {v}" for k, v in record["skipped"].items()],
         "config": {"suite": record["suite"], "ops": s.get("ops", []), "unroll": s["unroll"],
                    "runs": s["reps"],
                    "page_size": s.get("page_size")}}
  paths = []
  for r in rows:
    c = r["cells"]
    checks = [x["check"] for x in c.values() if x.get("check", "ok") != "ok"]
    if record["suite"] == "serving":
      row = {k: r[k] for k in ("bs", "page_size", "steps")}
      row.update({f"{SERVING_KEYS[i]}_us": x["us"] for i, x in c.items() if "us" in x})
      for part, key in (("", "scan_us"), ("_pages", "scan_pages_us"),
                        ("_fused", "scan_fused_us")):
        if key in row and "scan_baseline_us" in row:
          row[f"scan_alloc{part}_us"] = row[key] - row["scan_baseline_us"]
      row["parity"] = ("MISMATCH" if checks else "identical" if "torch" in c else "jax only")
      row["ok"] = all(x.get("ok", True) for x in c.values())
      out["serving"].append(row)
    elif r["op"] == "harness":
      out["loop_overhead_us"] = next(iter(c.values())).get("us")
    else:
      jax_cells = {i: x for i, x in c.items()
                   if bench.parse_impl(i)[0] not in ("eager", "torch_ref", "sglang")}
      paths += [i for i in jax_cells if i not in paths]
      if c.get("sglang", {}).get("sglang_version"):
        env["sglang"] = c["sglang"]["sglang_version"]
      out["micro"].append({"op": r["op"], "bs": r["bs"], "tokens": r["tokens"],
                           "page_size": s["page_size"], "jax": jax_cells,
                           "torch": c.get("torch_ref"), "sglang": c.get("sglang"),
                           "jax_host": c.get("eager"), "check": (checks or ["ok"])[0]})
  torch_on = any(r.get("torch") for r in out["micro"]) or any(
      "torch_step_us" in r for r in out["serving"])
  out["config"]["paths"] = paths + (["torch"] if torch_on else [])
  return out


def _us(cell: Optional[Dict[str, Any]]) -> Optional[float]:
  return None if not cell or "us" not in cell else cell["us"]


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
  if "extra_consumer_net_change" in cell:
    return f"{raw} ({100 * cell['extra_consumer_net_change']:+.0f}%)"
  return raw


def bare_cells(r: Dict[str, Any]):
  """(pallas cell, SGLang cell) of a row, each possibly empty."""
  return (r["jax"].get("pallas") or {}), (r.get("sglang") or {})


def bare_verdict(r: Dict[str, Any]) -> Optional[str]:
  """The pallas kernel against SGLang's, both bare (report.verdict of their quartiles);
  None where either bare figure is missing."""
  pb, sg = bare_cells(r)
  if pb.get("bare_us") is None or sg.get("bare_us") is None:
    return None
  return report.verdict(report.iqr(pb, "bare_"), report.iqr(sg, "bare_"))


LINKED_NOTE = ("linked figures include each side's own link (XLA fuses ours into 1-2 "
               "kernels, torch runs 4-5 eager ones), so no ratio is taken between them")
SGLANG_NOTE = ("; SGLang: its Triton kernel, CUDA graph replay, linked like ours (bare: "
               "each kernel's own GPU time, median over 2048 launches, from CUPTI; faster "
               "/ slower only where the interquartile ranges do not overlap, else tie)")


def micro_tables(result: Dict[str, Any]) -> str:
  f, fr = report.fmt_us, report.fmt_ratio
  cfg = result["config"]
  torch_on = "torch" in cfg["paths"]
  per_path = any("floor_us" in c for r in result["micro"] for c in r["jax"].values())
  out = []
  for op in cfg["ops"]:
    rows = [r for r in result["micro"] if r["op"] == op]
    if not rows:
      continue
    paths = [p for p in cfg["paths"] if p != "torch" and any(p in r["jax"] for r in rows)]
    sgl = any(r.get("sglang") for r in rows)
    extra = any("us_extra_consumer" in c for r in rows for c in r["jax"].values())
    bare = any("bare_us" in c for r in rows for c in r["jax"].values())
    err = lambda x: f(x) if x is not None else "error"
    jx = lambda r, p: r["jax"].get(p) or {}
    floor = lambda r, p: jx(r, p).get("floor_us", r.get("floor_us") if p == "jnp" else None)
    # (header, cell of a row, shown): the columns in order
    cols = [(f"{p} (us)", lambda r, p=p: err(_us(jx(r, p)) if jx(r, p) else None), True)
            for p in paths]
    cols += ([(f"{p} floor (us)", lambda r, p=p: f(floor(r, p)), True) for p in paths]
             if per_path else [("harness floor (us)", lambda r: f(r.get("floor_us")), True)])
    cols += [("jnp eager host (us)", lambda r: f(_us(r.get("jax_host"))), op == "free"),
             ("torch_ref (us)", lambda r: err(_us(r.get("torch"))), torch_on),
             ("pallas bare (us)", lambda r: f(bare_cells(r)[0].get("bare_us")), bare),
             ("SGLang (us)", lambda r: err(_us(r.get("sglang"))), sgl),
             ("SGLang bare (us)", lambda r: f(bare_cells(r)[1].get("bare_us")), sgl),
             ("torch_ref / jnp host", lambda r: fr(_ratio(_us(r.get("torch")),
                                                          _us(r.get("jax_host")))),
              torch_on and op == "free"),
             ("SGLang bare / pallas bare", lambda r: fr(_ratio(
                 bare_cells(r)[1].get("bare_us"), bare_cells(r)[0].get("bare_us"))),
              sgl and bare),
             ("pallas bare vs SGLang bare", lambda r: bare_verdict(r) or "-", sgl and bare)]
    cols += [(f"{p} +1 consumer (net)", lambda r, p=p: consumer_cell(jx(r, p)), extra)
             for p in paths] + [("check", lambda r: r["check"], True)]
    cols = [(h, c) for h, c, shown in cols if shown]
    tmethod = next((r["torch"]["method"] for r in rows
                    if r.get("torch") and "method" in r["torch"]), None)
    note = ("; free: the XLA path (kernel='jnp'; the Pallas free kernel is timed by "
            "benchmarks/free_methods_gpu.py)" if op == "free" and "suite" not in cfg else "")
    out.append(f"{op} (page_size {rows[0]['page_size']}; us per call, median{note}"
               + (f"; torch_ref: {tmethod}" if tmethod else "") + (SGLANG_NOTE if sgl else "")
               + (f"; {LINKED_NOTE}" if sgl or (torch_on and op != "free") else "")
               + ("; ratio > 1: jax_kvalloc faster)" if sgl or op == "free" else ")"))
    out.append(report.table(["bs", "tokens"] + [h for h, _ in cols],
                            [[r["bs"], r["tokens"]] + [c(r) for _, c in cols] for r in rows]))
    out += [f"  {op} bs={r['bs']} {k}: {v['error']}" for r in rows
            for k, v in list(r["jax"].items()) + [("torch_ref", r.get("torch") or {}),
                                                   ("sglang", r.get("sglang") or {})]
            if v and "error" in v]
    out.append("")
  return "\n".join(out)


def breakdown(row: Dict[str, Any], part: str) -> Optional[float]:
  """us per step that one more alloc_decode ("alloc") or free ("free") adds in the scan."""
  extra = row.get(f"scan_extra_{part}_us")
  return None if extra is None else extra - row["scan_us"]


def serving_table(result: Dict[str, Any]) -> str:
  fmt_us, fmt_ratio = report.fmt_us, report.fmt_ratio
  rows = result["serving"]
  torch_on = any("torch_step_us" in r for r in rows)
  header = ["bs", "jit/step sync", "jit/step async", "jit/step, no allocator",
            "scan/step", "scan, no allocator", "allocator in scan",
            "alloc_decode in scan", "free in scan", "allocator in scan, page release",
            "allocator in scan, fused release+decode"] + [
                "torch_ref sync/step", "torch_ref async/step", "sync: torch / jit",
                "async: torch / jit", "parity"] * torch_on
  body = []
  for r in rows:
    cells = [r["bs"], fmt_us(r.get("jit_step_sync_us")), fmt_us(r.get("jit_step_us")),
             fmt_us(r.get("jit_step_baseline_us")), fmt_us(r.get("scan_us")),
             fmt_us(r.get("scan_baseline_us")), fmt_us(r.get("scan_alloc_us")),
             fmt_us(breakdown(r, "alloc")), fmt_us(breakdown(r, "free")),
             fmt_us(r.get("scan_alloc_pages_us")), fmt_us(r.get("scan_alloc_fused_us"))]
    if torch_on:
      t, ts = r.get("torch_step_us"), r.get("torch_step_sync_us")
      cells += [fmt_us(ts) if ts else r.get("torch_error", "-")[:40], fmt_us(t),
                fmt_ratio(_ratio(ts, r.get("jit_step_sync_us"))),
                fmt_ratio(_ratio(t, r.get("jit_step_us"))), r.get("parity", "-")]
    body.append(cells)
  r0 = rows[0]
  return (f"serving loop (page_size {r0['page_size']}, {r0['steps']} decode steps; us per "
          f"step, median of {result['config'].get('runs', 3)} runs for jit and torch alike; sync = the host reads each "
          f"step's ok (JAX) / synchronizes (torch) once per step, async = once at the end; "
          f"each step: free group of the rows that finished, alloc_decode for every row, "
          f"last_loc gather and token-table write; 'no allocator' = the same step with "
          f"free and alloc_decode replaced by stand-ins; the alloc_decode / free columns "
          f"are what one more call of each adds per step; 'page release' frees the finished "
          f"requests' pages with free_page_ids, in request order, no sort; 'fused "
          f"release+decode' frees the same pages and allocates in one "
          f"release_and_alloc_decode call, one kernel launch on GPU)\n"
          + report.table(header, body) + "\n")


def _met(ok: bool) -> str:
  return "met" if ok else "MISSED"


def targets(result: Dict[str, Any]) -> List[Tuple[str, str, str]]:
  """(target, measured, verdict) rows, every measured figure from the run."""
  out = []
  micro = result["micro"]
  main = "pallas" if "pallas" in result["config"]["paths"] else "jnp"
  t = lambda r: _us(r["jax"].get(main))
  for op in ("decode", "extend"):
    rows = [r for r in micro if r["op"] == op and t(r) is not None]
    cmp = [r for r in rows if bare_verdict(r)]
    if cmp:
      words = {r["bs"]: bare_verdict(r) for r in cmp}
      slower = [bs for bs, w in words.items() if w == "slower"]
      ties = [bs for bs, w in words.items() if w == "tie"]
      ratio = lambda r: r["sglang"]["bare_us"] / r["jax"]["pallas"]["bare_us"]
      worst = min(cmp, key=ratio)
      measured = f"worst bs={worst['bs']}: {ratio(worst):.2f}x" + "".join(
          f"; {w} at bs {', '.join(map(str, b))}" for w, b in
          (("slower", slower), ("tie", ties)) if b)
      verdict = (f"MISSED at {len(slower)}/{len(cmp)}" if slower else report.NO_SPREAD
                 if report.NO_SPREAD in words.values() else "met")
      out.append((f"{op}: pallas kernel at least as fast as SGLang's kernel, both bare "
                  f"(same run) at every size", measured, verdict))
    big = sorted((r for r in rows if r["bs"] >= 1024), key=lambda r: r["bs"])
    if len(big) >= 2:
      worst_e, at = max((math.log(t(b) / t(a)) / math.log(b["bs"] / a["bs"]), b["bs"])
                        for a, b in zip(big, big[1:]))
      out.append((f"{op}: linear growth in bs (largest log-log slope between "
                  f"consecutive sizes from bs 1024)", f"{worst_e:.2f} (up to bs {at})",
                  _met(worst_e <= 1.25)))
  for r in micro:
    if r["op"] != "decode" or r["bs"] != 16384 or not bare_verdict(r):
      continue
    pb, sg = bare_cells(r)
    q_ours, q_theirs = report.iqr(pb, "bare_"), report.iqr(sg, "bare_")
    word = (_met(q_theirs[0] >= DECODE_BIG_SPEEDUP * q_ours[1]) if q_ours and q_theirs
            else report.NO_SPREAD)  # the whole interquartile ranges this far apart
    out.append((f"decode bs 16384: pallas kernel >= {DECODE_BIG_SPEEDUP:.0f}x faster than "
                f"SGLang's, both bare (same run)", f"{sg['bare_us'] / pb['bare_us']:.0f}x",
                word))
  changes = [(abs(consumer_change(c)), r, p) for r in micro
             for p, c in r["jax"].items() if "extra_consumer_change" in c]
  if changes:
    worst, r, p = max(changes, key=lambda x: x[0])
    out.append((f"every JAX figure moves < {100 * EXTRA_CONSUMER_TOLERANCE:.0f}% with one "
                f"more consumer of its outputs (net of that consumer's own cost on the "
                f"stand-in)", f"worst {100 * worst:.1f}% ({r['op']} bs={r['bs']} {p})",
                _met(worst < EXTRA_CONSUMER_TOLERANCE)))
  for r in result["serving"]:
    if r.get("torch_step_sync_us") and r.get("jit_step_sync_us"):
      out.append((f"serving bs={r['bs']}: jit/step <= half of torch_ref eager/step "
                  f"(both syncing once per step)",
                  f"{r['jit_step_sync_us']:.1f} vs {r['torch_step_sync_us']:.1f} us",
                  _met(r["jit_step_sync_us"] <= 0.5 * r["torch_step_sync_us"])))
    for key, what in (("scan_alloc_us", "free of slots, sorted unique"),
                      ("scan_alloc_pages_us", "request-level page release"),
                      ("scan_alloc_fused_us", "page release and alloc_decode in one call")):
      if r.get(key) is not None:
        out.append((f"serving bs={r['bs']}: allocator adds <= {SCAN_ALLOC_TARGET_US:.0f} us"
                    f" per step in a scan ({what})", f"{r[key]:.2f} us",
                    _met(r[key] <= SCAN_ALLOC_TARGET_US)))
  return out


def render(result: Dict[str, Any]) -> str:
  """The tables `jax-kvalloc bench kernels` / `serving` print (and `jax-kvalloc report`)."""
  e = result["env"]
  per_path = any("floor_us" in c for r in result["micro"] for c in r["jax"].values())
  lines = [f"jax-kvalloc bench on {e['platform']}:{e['device']} ({e['date']}; python "
           f"{e['python']}, jax {e['jax']}, torch {e.get('torch')}, triton "
           f"{e.get('triton', '-')}" + (f", SGLang kernels: {e['sglang']}"
                                         if e.get("sglang") else "") + ")"]
  if result.get("loop_overhead_us") is not None:
    lines.append(
        f"harness floor: {result['loop_overhead_us']:.3f} us per call for a scalar call "
        f"(unroll {result['config']['unroll']}; " + (
            "each path's floor column is the same harness around a stand-in that only "
            "writes the case's outputs the way the path does: one XLA fusion for jnp, "
            "one Pallas launch for pallas)" if per_path else
            "the per-case floor column is the same harness around an XLA stand-in that "
            "only writes outputs of the case's shapes, for every path: where it exceeds "
            "a Pallas figure, that stand-in's fusions cost more than the one Pallas "
            "launch; runs since issue 26 take a Pallas stand-in for the Pallas path)"))
  lines += [f"note: {n}" for n in result.get("notes", ())] + [""]
  if result["micro"]:
    lines.append(micro_tables(result))
  if result["serving"]:
    lines.append(serving_table(result))
  rows = targets(result)
  if rows:
    lines.append("targets (each measured figure from this run)")
    lines.append(report.table(["target", "measured", "verdict"], rows, align="llr"))
  mism = [r for r in result["micro"] if r["check"] != "ok"] + [
      r for r in result["serving"] if r.get("parity") == "MISMATCH" or not r.get("ok", 1)]
  if mism:
    lines.append(f"\nCHECK FAILED in {len(mism)} case(s): outputs disagree (see 'check').")
  return "\n".join(lines)
