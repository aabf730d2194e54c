"""Microbenchmarks of alloc_decode, alloc_extend and free (part of `jax-kvalloc bench`).

Each case is drawn once (`make_case`) and every path times those same inputs:

- "pallas" and "jnp": the whole jitted allocator call (pointer arithmetic, prefix sums,
  capacity check, free-list window, index kernel, masking), chained and linked in the
  one harness of jax_kvalloc.tools.timing (every output consumed, the next call's
  inputs depending on it, no fusion across calls);
- torch_ref: on CUDA, a CUDA graph of its Triton kernel with the same link (the outputs'
  max, clamped to 0, added to the inputs in place); its eager `free` (torch.unique syncs,
  so it cannot be captured); on CPU its eager class calls;
- SGLang (CUDA, `--sglang-kernels PATH`): the released Triton kernels of SGLang
  (`sglang/kernels/ops/memory/allocator.py` of a wheel, loaded from that file alone, as
  SGLang's allocator launches them: one program per request, i64 tensors), timed as
  torch_ref's, linked ("sglang") and alone ("sglang_bare": the kernel's own GPU time
  from CUPTI over replays of its CUDA graph, as our "pallas bare": see BARE_UNROLL).

Before timing, every path's output for the case is checked against the jnp path. A path
named with the suffix "-noguard" ("pallas-noguard", "jnp-noguard") runs the same call
with AllocatorConfig(guard=False): beside its guarded twin, the cost of the ownership
record (SPEC 14).

The chain (jax_call): each call takes the free-list head the previous one returned, with
the free length held fixed (the pool never runs out and every call does the same work).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc.tools import timing as bt
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig

DECODE_BS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
EXTEND_CASES = ((1, 8192), (16, 8192), (64, 32768), (256, 65536), (1024, 65536),
                (4096, 262144), (16384, 262144))


@dataclasses.dataclass
class Case:
  """Inputs of one microbenchmark case (host numpy, int32 unless said)."""
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


def make_case(op: str, bs: int, tokens: int, page_size: int, seed: int) -> Case:
  """A reproducible case: random lengths, page-consistent last_loc, a shuffled pool."""
  rng = np.random.default_rng([seed, bs, tokens, page_size])
  ps = page_size
  if op == "decode":
    seq = rng.integers(2, 4096, bs)
    pre = last = None
    last = (rng.integers(1, 1000, bs) * ps + (seq - 2) % ps)
    need = bs
  else:
    ext = rng.multinomial(tokens - bs, np.full(bs, 1.0 / bs)) + 1 if tokens >= bs else \
        np.ones(bs, np.int64)
    # free: the slots of whole new pages only (a Part 1 slot would name a page that
    # this pool never handed out).
    pre = np.where(rng.random(bs) < 0.25, 0, rng.integers(0, 2048, bs)) if op == "extend" \
        else np.zeros(bs, np.int64)
    seq = pre + ext
    last = np.where(pre > 0, rng.integers(1, 1000, bs) * ps + (pre - 1) % ps, -1)
    need = int(np.sum(-(-seq // ps) - (-(-pre // ps))))
  num_pages = 2 * need + 1024
  ring = (rng.permutation(num_pages) + 1).astype(np.int32)
  i32 = lambda a: None if a is None else np.asarray(a, np.int32)
  case = Case(op, bs, int(np.sum(seq - pre)) if pre is not None else bs, ps, num_pages,
              ring, i32(seq), i32(pre), i32(last))
  if op == "free":
    state = _state(case)
    cfg = _config(case, "jnp")
    state, out, ok = jax.jit(functools.partial(allocation.alloc_extend, cfg),
                             static_argnames="max_tokens")(
                                 state, case.pre, case.seq, case.last,
                                 max_tokens=case.tokens)
    assert bool(ok)
    case.free_index = np.asarray(out)
    case.used_pages = int(num_pages - state.free_len)
  return case


# A path ending in NO_GUARD runs with AllocatorConfig(guard=False): the cost of the
# ownership record (SPEC 14) is "pallas" against "pallas-noguard" in one run.
NO_GUARD = "-noguard"


def split_path(path: str) -> Tuple[str, bool]:
  """(the kernel a path runs, whether it keeps the ownership record)."""
  if path.endswith(NO_GUARD):
    return path[:-len(NO_GUARD)], False
  return path, True


def _config(case: Case, path: str) -> AllocatorConfig:
  kernel, guard = split_path(path)
  return AllocatorConfig(size=case.num_pages * case.page_size, page_size=case.page_size,
                         kernel=kernel, guard=guard)


def _state(case: Case, taken: int = 0,
           cfg: Optional[AllocatorConfig] = None) -> st.AllocatorState:
  """The pool with `taken` pages already handed out (from the front of the ring), its
  ownership record agreeing (config `cfg`, default the jnp path's)."""
  cfg = cfg or _config(case, "jnp")
  s = jax.jit(st.init, static_argnums=0)(cfg)
  s = s._replace(free_ring=jnp.asarray(case.free_ring),
                 free_head=jnp.asarray(taken % case.num_pages, jnp.int32),
                 free_len=jnp.asarray(case.num_pages - taken, jnp.int32))
  return st.with_record(cfg, s)


def jax_call(case: Case, path: str):
  """(one call: () -> outputs, chained call (carry, inputs) -> (carry, outputs), carry,
  inputs) for a JAX path. The carry is the state; only the head moves from call to
  call (see the module docstring); every output (indices, ok, new head and length, or
  for free the new ring, head and length) is returned for the harness to consume."""
  cfg = _config(case, path)
  if case.op == "decode":
    fn = functools.partial(allocation.alloc_decode, cfg)
    args = (case.seq, case.last)
  elif case.op == "extend":
    fn = functools.partial(allocation.alloc_extend, cfg, max_tokens=case.tokens)
    args = (case.pre, case.seq, case.last)
  else:
    fn = functools.partial(freeing.free, cfg)
    args = (case.free_index,)

  def call(state, inputs):
    res = fn(state, *inputs)
    if case.op == "free":
      # The record is not carried (the same pages are freed on every call, so they must
      # stay held): it is an output, consumed by the harness like the others (the floor
      # column, a stand-in with the same outputs, shows what consuming it costs).
      rec = () if res.guard is None else tuple(res.guard)
      return (state._replace(free_ring=res.free_ring, free_head=res.free_head),
              (res.free_head, res.free_len) + rec)
    new, out, ok = res
    # The record is carried: the pages each call takes are marked held in it.
    return (state._replace(free_head=new.free_head, guard=new.guard),
            (out, ok, new.free_head, new.free_len))

  state0 = _state(case, case.used_pages, cfg)
  args = tuple(jnp.asarray(a) for a in args)
  once = lambda: jax.jit(fn)(state0, *args)
  return once, call, state0, args


def _jax_output(case: Case, once) -> np.ndarray:
  res = once()
  if case.op == "free":
    return np.asarray(st.live_free_pages(res))
  state, out, ok = res
  if not bool(ok):
    raise RuntimeError(f"{case.op} bs={case.bs}: the allocation did not fit")
  return np.asarray(out)


def time_jax(case: Case, path: str, *, unroll: int, min_time: float, reps: int,
             consumers: int = bt.DEFAULT_CONSUMERS,
             linked: bool = True) -> Tuple[Dict[str, float], np.ndarray]:
  once, call, carry, inputs = jax_call(case, path)
  out = _jax_output(case, once)
  return bt.chain_time(call, carry, inputs, unroll=unroll, min_time=min_time, reps=reps,
                       consumers=consumers, linked=linked), out


# The bare columns are kernel execution times from CUPTI (timing.kernel_time), ours and
# SGLang's alike: the median over BARE_CALLS launches (ours in the bare chain loop,
# SGLang's in replays of its CUDA graph of BARE_UNROLL). Wall-clock figures of the kernel
# alone cannot be taken alike: XLA's loop adds its predicate copy and the sink's
# fusions, and an XLA program replayed as a CUDA graph is host-bound (XLA updates the
# graph's buffer addresses on every run: 3.3-6.5 us per call on the H200, run 12).
BARE_UNROLL = 128
BARE_CALLS = 2048
OUR_KERNELS = "jax_kvalloc_alloc_"   # jax_kvalloc_alloc_{decode,extend}_triton*


def bare_kernel_time(call, carry, inputs, name_prefix: str = OUR_KERNELS, *,
                     unroll: int = BARE_UNROLL, calls: int = BARE_CALLS
                     ) -> Dict[str, float]:
  """The kernel's own GPU time (timing.kernel_time) over `calls` calls of the bare
  chain (timing.chain_loop, linked=False) of `call`, a call that is one custom call
  (`one_custom_call`). Needs torch (CUPTI) and a GPU."""
  run = bt.chain_loop(call, unroll, linked=False)
  sink = bt.sink_init(call, carry, inputs)
  iters = np.int32(max(1, calls // unroll))
  jax.block_until_ready(run(carry, inputs, sink, iters))
  acts = bt.cuda_activities(lambda: jax.block_until_ready(run(carry, inputs, sink, iters)))
  return bt.kernel_time(acts, name_prefix, min_count=int(iters) * unroll // 2)


def time_bare(case: Case, path: str) -> Dict[str, float]:
  """`bare_kernel_time` of this case's call on `path`."""
  _, call, carry, inputs = jax_call(case, path)
  return bare_kernel_time(call, carry, inputs)


def _sglang_kernel_time(call, name: str) -> Dict[str, float]:
  """SGLang's kernel's own GPU time over BARE_CALLS launches: replays of a CUDA graph of
  BARE_UNROLL launches (timing.torch_graph), profiled as `time_bare`."""
  import torch  # pylint: disable=g-import-not-at-top
  graph = bt.torch_graph(call, BARE_UNROLL)

  def run():
    for _ in range(BARE_CALLS // BARE_UNROLL):
      graph.replay()
    torch.cuda.synchronize()
  res = bt.kernel_time(bt.cuda_activities(run), name, min_count=BARE_CALLS // 2)
  del graph
  return res


def one_custom_call(case: Case, path: str) -> bool:
  """Whether the compiled call is a single kernel launch of ours and nothing else that
  launches (the condition under which a bare, unlinked chain loses no work)."""
  _, call, carry, inputs = jax_call(case, path)
  text = jax.jit(call).lower(carry, inputs).compile().as_text()
  body = text[text.index("ENTRY"):]
  launches = len(re.findall(r"= [^=]*? (fusion|custom-call|gather|scatter|sort|reduce)\(",
                            body))
  return body.count("custom-call(") == 1 and launches == 1


def time_floor(case: Case, path: str = "jnp", *, unroll: int, min_time: float,
               reps: int) -> Dict[str, float]:
  """The harness's own cost at this case's output shapes, around a stand-in that writes
  those outputs the way `path` writes them: one XLA fusion for jnp (timing.stand_in),
  one Pallas kernel launch for the Pallas paths (timing.stand_in_pallas). A floor taken
  with the XLA stand-in for a Pallas figure costs more than the figure itself at small
  sizes (several fusions and their launches against one kernel), so each path gets its
  own."""
  kernel, guard = split_path(path)
  _, call, carry, inputs = jax_call(case, "jnp" + ("" if guard else NO_GUARD))
  outs = jax.eval_shape(call, carry, inputs)[1]
  if kernel == "jnp":
    return bt.floor_time(outs, inputs, unroll=unroll, min_time=min_time, reps=reps)
  stand = bt.stand_in_pallas(outs, interpret=kernel == "pallas_interpret")
  return bt.chain_time(stand, jnp.zeros((), jnp.int32), inputs, unroll=unroll,
                       min_time=min_time, reps=reps)


# ---------------------------------------------------------------------------------------
# torch_ref
# ---------------------------------------------------------------------------------------

def torch_available() -> Optional[str]:
  """None if torch and torch_ref import, else why not."""
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import torch_ref  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return f"torch_ref unavailable ({e})"
  return None


def torch_linked(call, inputs):
  """call() followed by the harness's link in torch: dep = min(max(out), 0) (0 at run
  time) added to every input tensor in place, so that each launch's output is consumed
  and the next launch's inputs depend on it, as in timing.chain_loop."""
  def linked():
    out = call()
    dep = out.amax().clamp(max=0)
    for x in inputs:
      x.add_(dep)
    return out
  return linked


def time_torch(case: Case, *, unroll: int, min_time: float, reps: int
               ) -> Tuple[Dict[str, float], np.ndarray, str]:
  """(timing, output as numpy, method) for torch_ref on this case."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch_ref  # pylint: disable=g-import-not-at-top
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  ps = case.page_size
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)
  alloc = torch_ref.PagedTokenToKVPoolAllocator(case.num_pages * ps, ps, None, dev, None,
                                                False, kernel="triton" if cuda else "torch")
  alloc.free_pages = t64(case.free_ring)
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  if case.op == "free":
    alloc.free_pages = alloc.free_pages[case.used_pages:]
    snap = alloc.backup_state()
    idx = t64(case.free_index)

    def call():
      alloc.restore_state(snap)
      alloc.free(idx)

    call()
    out = alloc.free_pages.cpu().numpy()
    return (bt.host_time(call, sync=sync, min_time=min_time, reps=reps), out,
            "eager free(), host time per call (torch.unique syncs)" if cuda
            else "eager free(), host time per call")
  seq, last = t64(case.seq), t64(case.last)
  seq_cpu = torch.as_tensor(np.asarray(case.seq, np.int64))
  if case.op == "decode":
    out = alloc.alloc_decode(seq, seq_cpu, last)
    if cuda:
      from torch_ref import triton_kernels  # pylint: disable=g-import-not-at-top
      free = t64(case.free_ring)
      call = torch_linked(lambda: triton_kernels.decode_indices(seq, last, free,
                                                                page_size=ps),
                          (seq, last))
    else:
      alloc.free_pages = t64(case.free_ring)
      snap = alloc.backup_state()

      def call():
        alloc.restore_state(snap)
        return alloc.alloc_decode(seq, seq_cpu, last)
  else:
    pre = t64(case.pre)
    pre_cpu = torch.as_tensor(np.asarray(case.pre, np.int64))
    snap = alloc.backup_state()
    out = alloc.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, case.tokens)
    alloc.restore_state(snap)
    if cuda:
      from torch_ref import triton_kernels  # pylint: disable=g-import-not-at-top
      free = t64(case.free_ring)
      call = torch_linked(lambda: triton_kernels.extend_indices(
          pre, seq, last, free, page_size=ps, extend_num_tokens=case.tokens),
                          (pre, seq, last))
    else:
      def call():
        alloc.restore_state(snap)
        return alloc.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, case.tokens)
  if out is None:
    raise RuntimeError(f"torch_ref {case.op} bs={case.bs}: the allocation did not fit")
  out = out.cpu().numpy()
  if cuda:
    return (bt.torch_graph_time(call, unroll=unroll, min_time=min_time, reps=reps), out,
            "CUDA graph replay of its Triton kernel, linked")
  return (bt.host_time(call, sync=sync, min_time=min_time, reps=reps), out,
          "eager class call (torch on CPU)")


# ---------------------------------------------------------------------------------------
# SGLang's released kernels
# ---------------------------------------------------------------------------------------

def load_sglang_kernels(path: str):
  """The module at `path` (SGLang's `sglang/kernels/ops/memory/allocator.py`, which
  imports only torch and triton), loaded from that file alone; its version is whatever
  wheel it came from (the caller records it)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("sglang_allocator_kernels", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"--sglang-kernels {path!r}: not a Python file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for name in ("alloc_extend_kernel", "alloc_decode_kernel"):
    if not hasattr(module, name):
      raise AttributeError(f"--sglang-kernels {path!r} has no {name}")
  return module


def sglang_call(case: Case, module):
  """(call() -> out tensor, the call's input tensors) of SGLang's Triton kernel on this
  case, launched as SGLang's PagedTokenToKVPoolAllocator launches it (grid = bs, bs_upper
  = the next power of two, i64 tensors, the free list from its front)."""
  import torch  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  if case.op not in ("decode", "extend"):
    raise ValueError("SGLang has no free kernel")
  dev = torch.device("cuda")
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)
  ps, bs = case.page_size, case.bs
  free = t64(case.free_ring)
  seq, last = t64(case.seq), t64(case.last)
  upper = triton.next_power_of_2(bs)
  if case.op == "decode":
    out = torch.empty(bs, dtype=torch.int64, device=dev)

    def call():
      module.alloc_decode_kernel[(bs,)](seq, last, free, out, upper, ps)
      return out
    return call, (seq, last)
  pre = t64(case.pre)
  out = torch.empty(case.tokens, dtype=torch.int64, device=dev)

  def call():
    module.alloc_extend_kernel[(bs,)](pre, seq, last, free, out, upper, ps)
    return out
  return call, (pre, seq, last)


def sglang_bare(case: Case, module) -> Tuple[Dict[str, float], np.ndarray]:
  """(SGLang's kernel's own GPU time, as `time_bare` takes ours; its output)."""
  call, _ = sglang_call(case, module)
  result = call().cpu().numpy()
  return _sglang_kernel_time(call, f"alloc_{case.op}_kernel"), result


def time_sglang(case: Case, module, *, unroll: int, min_time: float, reps: int
                ) -> Tuple[Dict[str, float], Dict[str, float], np.ndarray]:
  """(linked timing, bare timing, output) of SGLang's Triton kernel on this case
  (`sglang_call`): linked, replays of a CUDA graph of `unroll` linked launches; bare, the
  kernel's own GPU time (`sglang_bare`)."""
  call, inputs = sglang_call(case, module)
  bare, result = sglang_bare(case, module)
  linked = bt.torch_graph_time(torch_linked(call, inputs), unroll=unroll,
                               min_time=min_time, reps=reps)
  return linked, bare, result


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

def cases(ops: Sequence[str], batch_sizes: Sequence[int],
          extend_cases: Sequence[Tuple[int, int]]) -> List[Tuple[str, int, int]]:
  out = []
  for op in ops:
    if op == "decode":
      out += [("decode", bs, bs) for bs in batch_sizes]
    else:
      out += [(op, bs, t) for bs, t in extend_cases]
  return out


def _quartiles_us(timing: Dict[str, float], prefix: str = "") -> Dict[str, float]:
  """{prefix + "q1_us", prefix + "q3_us"} of a timing result that has quartiles."""
  if "q1_s" not in timing:
    return {}
  return {f"{prefix}q1_us": timing["q1_s"] * 1e6, f"{prefix}q3_us": timing["q3_s"] * 1e6}


def _err(e: Exception) -> Dict[str, str]:
  return {"error": f"{type(e).__name__}: {e}"[:300]}


def _jax_host_free(case: Case, *, min_time: float, reps: int) -> Dict[str, float]:
  """free as a scheduler calls it eagerly: one jitted call from Python, blocking on its
  result each time (what torch_ref's eager free, which syncs, is compared with)."""
  cfg = _config(case, "jnp")
  fn = jax.jit(functools.partial(freeing.free, cfg))
  state0 = _state(case, case.used_pages, cfg)
  idx = jnp.asarray(case.free_index)
  return bt.host_time(lambda: jax.block_until_ready(fn(state0, idx)), sync=lambda: None,
                      min_time=min_time, reps=reps)


def time_with_extra_consumer(case: Case, path: str, *, unroll: int, min_time: float,
                             reps: int) -> Tuple[Dict[str, Any], np.ndarray]:
  """The +1 consumer check of one path: the call with DEFAULT_CONSUMERS and with one more
  consumer, and a stand-in that writes the same outputs the way the path does (an XLA
  fusion for jnp, one Pallas kernel launch for the Pallas paths) with the same two
  consumer counts, all four timed with their repetitions interleaved
  (timing.chain_time_interleaved). Returns (timing of the call as chain_time's, with
  "us_extra_consumer", "extra_consumer_change" = t3 / t2 - 1 and
  "extra_consumer_net_change" = (t3 - t2 - (f3 - f2)) / t2: the change less what the
  consumer costs by itself on the stand-in, i.e. work the figure did not count before
  the consumer forced it), the call's output)."""
  once, call, carry, inputs = jax_call(case, path)
  out = _jax_output(case, once)
  shapes = jax.eval_shape(call, carry, inputs)[1]
  kernel, _ = split_path(path)
  if kernel == "jnp":
    stand = bt.stand_in(shapes)
  else:
    stand = bt.stand_in_pallas(shapes, interpret=kernel == "pallas_interpret")
  zero = jnp.zeros((), jnp.int32)
  base = bt.DEFAULT_CONSUMERS
  t2, t3, f2, f3 = bt.chain_time_interleaved(
      [dict(call=call, carry=carry, inputs=inputs, consumers=base),
       dict(call=call, carry=carry, inputs=inputs, consumers=base + 1),
       dict(call=stand, carry=zero, inputs=inputs, consumers=base),
       dict(call=stand, carry=zero, inputs=inputs, consumers=base + 1)],
      unroll=unroll, min_time=min_time, reps=reps)
  res = dict(t2)
  res.update(us_extra_consumer=t3["s"] * 1e6, extra_consumer_change=t3["s"] / t2["s"] - 1,
             extra_consumer_net_change=(t3["s"] - t2["s"] - (f3["s"] - f2["s"])) / t2["s"],
             stand_in_us=f2["s"] * 1e6, stand_in_extra_consumer_us=f3["s"] * 1e6)
  return res, out


def run(*, ops: Sequence[str], paths: Sequence[str], torch_on: bool,
        batch_sizes: Sequence[int], extend_cases: Sequence[Tuple[int, int]],
        page_size: int, unroll: int, min_time: float, reps: int, seed: int,
        sglang=None, extra_consumer: bool = False, bare: bool = False,
        progress=None) -> List[Dict[str, Any]]:
  """Times every case; returns one row (dict) per case. `sglang`: the module of
  `load_sglang_kernels` (or None). `extra_consumer`: time every JAX path together with
  one more consumer of its outputs and with a stand-in of the same outputs
  (`time_with_extra_consumer`). `bare`: also
  take the "pallas" kernel's own GPU time where the call compiles to one kernel launch
  (`time_bare`, comparable with SGLang's kernel's, taken the same way). `progress(desc)` is called before each
  measurement."""
  rows = []
  for op, bs, tokens in cases(ops, batch_sizes, extend_cases):
    case = make_case(op, bs, tokens, page_size, seed)   # one draw for every path
    row: Dict[str, Any] = {"op": op, "bs": bs, "tokens": case.tokens,
                           "page_size": page_size, "num_pages": case.num_pages,
                           "jax": {}, "torch": None, "sglang": None, "check": "ok"}
    ref = None
    # free: the XLA path only (kernel="jnp"); benchmarks/free_methods_gpu.py times the
    # Pallas free kernel against it.
    op_paths = [p for p in paths if op != "free" or split_path(p)[0] == "jnp"] or list(
        paths[:1])
    for path in op_paths:
      if progress:
        progress(f"{op} bs={bs} tokens={case.tokens} {path}")
      try:
        if extra_consumer:
          timing, out = time_with_extra_consumer(case, path, unroll=unroll,
                                                 min_time=min_time, reps=reps)
        else:
          timing, out = time_jax(case, path, unroll=unroll, min_time=min_time, reps=reps)
      except Exception as e:  # pylint: disable=broad-except
        row["jax"][path] = _err(e)
        continue
      cell = {"us": timing["s"] * 1e6, "min_us": timing["min_s"] * 1e6,
              "spread": timing["spread"], "compile_s": timing["compile_s"],
              **_quartiles_us(timing)}
      for key in ("us_extra_consumer", "extra_consumer_change", "extra_consumer_net_change",
                  "stand_in_us", "stand_in_extra_consumer_us"):
        if key in timing:
          cell[key] = timing[key]
      if bare and split_path(path)[0] == "pallas" and op != "free":
        try:
          cell["single_launch"] = one_custom_call(case, path)
          if cell["single_launch"]:
            tb = time_bare(case, path)
            cell["bare_us"] = tb["s"] * 1e6
            cell["bare_spread"] = tb["spread"]
            cell.update(_quartiles_us(tb, "bare_"))
        except Exception as e:  # pylint: disable=broad-except
          cell["bare_error"] = _err(e)["error"]
      row["jax"][path] = cell
      if ref is None:
        ref = out
      elif not np.array_equal(out, ref):
        row["check"] = f"MISMATCH: {path} differs from {op_paths[0]}"
    for path in op_paths:  # the Pallas paths' floor: a Pallas stand-in (time_floor)
      cell = row["jax"].get(path) or {}
      if split_path(path)[0] != "jnp" and "us" in cell:
        try:
          cell["floor_us"] = time_floor(case, path, unroll=unroll, min_time=min_time,
                                        reps=reps)["s"] * 1e6
        except Exception as e:  # pylint: disable=broad-except
          cell["floor_error"] = _err(e)["error"]
    if "stand_in_us" in (row["jax"].get("jnp") or {}):  # measured with the check
      row["floor_us"] = row["jax"]["jnp"]["stand_in_us"]
    else:
      try:
        row["floor_us"] = time_floor(case, unroll=unroll, min_time=min_time,
                                     reps=reps)["s"] * 1e6
      except Exception as e:  # pylint: disable=broad-except
        row["floor_error"] = _err(e)["error"]
    if op == "free":
      try:
        row["jax_host"] = {"us": _jax_host_free(case, min_time=min_time,
                                                reps=reps)["s"] * 1e6}
      except Exception as e:  # pylint: disable=broad-except
        row["jax_host"] = _err(e)
    if torch_on:
      if progress:
        progress(f"{op} bs={bs} tokens={case.tokens} torch_ref")
      try:
        timing, out, method = time_torch(case, unroll=unroll, min_time=min_time, reps=reps)
        row["torch"] = {"us": timing["s"] * 1e6, "spread": timing["spread"],
                        "method": method, **_quartiles_us(timing)}
        if ref is not None and not np.array_equal(np.asarray(out, np.int64),
                                                  np.asarray(ref, np.int64)):
          row["check"] = "MISMATCH: torch_ref differs from jax"
      except Exception as e:  # pylint: disable=broad-except
        row["torch"] = _err(e)
    if sglang is not None and op != "free":
      if progress:
        progress(f"{op} bs={bs} tokens={case.tokens} sglang")
      try:
        linked, alone, out = time_sglang(case, sglang, unroll=unroll, min_time=min_time,
                                         reps=reps)
        row["sglang"] = {"us": linked["s"] * 1e6, "spread": linked["spread"],
                         "bare_us": alone["s"] * 1e6, "bare_spread": alone["spread"],
                         **_quartiles_us(linked), **_quartiles_us(alone, "bare_")}
        if ref is not None and not np.array_equal(np.asarray(out, np.int64),
                                                  np.asarray(ref, np.int64)):
          row["check"] = "MISMATCH: SGLang's kernel differs from jax"
      except Exception as e:  # pylint: disable=broad-except
        row["sglang"] = _err(e)
    rows.append(row)
  return rows
