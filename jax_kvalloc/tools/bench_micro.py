"""Microbenchmarks of alloc_decode, alloc_extend and free (part of `jax-kvalloc bench`).

Each case is timed as the whole jitted allocator call (the functional API: pointer
arithmetic, prefix sums, capacity check, free-list window, index kernel, masking) run as
many dependent calls inside one jit (jax_kvalloc.tools.timing), for the "pallas" and
"jnp" index-kernel paths; and, in the same process, the torch_ref reference: on CUDA the
replay of a CUDA graph of its Triton kernel (alloc_extend/alloc_decode) or its eager
`free` (torch.unique syncs, so it cannot be captured); on CPU its eager class calls.

Before timing, every path's output for the case is checked against the jnp path.

Dependence between calls (jax_call_and_body): each call takes the free-list head the
previous one returned, with the free length held fixed (the pool never runs out and
every call does the same work), and its indices are loop-carried, so XLA can neither
hoist a call out of the loop nor drop any part of its output.
"""
from __future__ import annotations

import dataclasses
import functools
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


def sglang_figure(op: str, bs: int, tokens: int) -> Optional[Tuple[float, float]]:
  """SGLang's own Triton kernel time on the H200 for this size, (low, high) us, if known.

  decode: 1.3 us at bs 1-256, 2.8 at 1024, 22 at 4096, 292 at 16384; extend: 2.4-3.4 us
  at bs 1-256 with 8k-65k tokens, 6.4-8.2 at bs 1024 with 65k tokens.
  """
  if op == "decode":
    return {1024: (2.8, 2.8), 4096: (22.0, 22.0), 16384: (292.0, 292.0)}.get(
        bs, (1.3, 1.3) if bs <= 256 else None)
  if op == "extend":
    if bs <= 256 and 8192 <= tokens <= 65536:
      return (2.4, 3.4)
    if bs == 1024 and tokens == 65536:
      return (6.4, 8.2)
  return None


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


def _config(case: Case, path: str) -> AllocatorConfig:
  return AllocatorConfig(size=case.num_pages * case.page_size, page_size=case.page_size,
                         kernel=path)


def _state(case: Case, taken: int = 0) -> st.AllocatorState:
  """The pool with `taken` pages already handed out (from the front of the ring)."""
  cfg = _config(case, "jnp")
  s = jax.jit(st.init, static_argnums=0)(cfg)
  return s._replace(free_ring=jnp.asarray(case.free_ring),
                    free_head=jnp.asarray(taken % case.num_pages, jnp.int32),
                    free_len=jnp.asarray(case.num_pages - taken, jnp.int32))


def _needs_dep(case: Case, path: str) -> bool:
  """Whether the call's per-request inputs must be made loop-variant.

  A call that is one Pallas kernel launch (the fused Triton allocation) reads the
  loop-carried free-list head, so XLA cannot hoist any of it, and an extra input op
  would cost a launch of its own. Anything else (the jnp path, the index kernel with
  XLA bookkeeping) has parts that depend on the inputs alone, which XLA would hoist.
  """
  if path not in ("pallas", "pallas_interpret") or case.op == "free":
    return True
  try:
    import pallas_kernels  # pylint: disable=g-import-not-at-top
    if case.op == "decode":
      return not pallas_kernels.decode_fused_supported(case.bs, case.num_pages)
    return not pallas_kernels.extend_fused_supported(case.bs, case.tokens, case.num_pages)
  except (ImportError, AttributeError, TypeError):
    return True


def jax_call_and_body(case: Case, path: str):
  """(one call: () -> outputs, loop body, initial carry) for a JAX path.

  The loop carries the state. Each call's new free-list head (and, for free, ring)
  feeds the next call, while the free length stays at its initial value: the pool is a
  full ring (or, for free, holds exactly the pages being freed), so every call does the
  same work and the pool never runs out. The indices are carried too (the loop returns
  the last ones), so XLA must compute them in every call. Where `_needs_dep`, the inputs
  get `head >> 31` added (0 at run time, unknown to XLA; fused into their first use).
  """
  cfg = _config(case, path)
  dep_on = _needs_dep(case, path)
  dep = (lambda s: jnp.right_shift(s.free_head, 31)) if dep_on else (lambda s: 0)
  if case.op == "decode":
    fn = functools.partial(allocation.alloc_decode, cfg)
    args = (case.seq, case.last)
  elif case.op == "extend":
    fn = functools.partial(allocation.alloc_extend, cfg, max_tokens=case.tokens)
    args = (case.pre, case.seq, case.last)
  else:
    fn = functools.partial(freeing.free, cfg)
    args = (case.free_index,)

  def body(c):
    state, inputs, _ = c
    d = dep(state)
    res = fn(state, *(x + d for x in inputs))
    if case.op == "free":
      return state._replace(free_ring=res.free_ring, free_head=res.free_head), inputs, ()
    return state._replace(free_head=res[0].free_head), inputs, res[1]

  state0 = _state(case, case.used_pages)
  once = lambda: jax.jit(fn)(state0, *args)
  out0 = () if case.op == "free" else jnp.zeros(jax.eval_shape(fn, state0, *args)[1].shape,
                                                jnp.int32)
  return once, body, (state0, args, out0)


def _jax_output(case: Case, once) -> np.ndarray:
  res = once()
  if case.op == "free":
    return np.asarray(st.live_free_pages(res))
  state, out, ok = res
  if not bool(ok):
    raise RuntimeError(f"{case.op} bs={case.bs}: the allocation did not fit")
  return np.asarray(out)


def time_jax(case: Case, path: str, *, unroll: int, min_time: float, reps: int
             ) -> Tuple[Dict[str, float], np.ndarray]:
  once, body, carry = jax_call_and_body(case, path)
  out = _jax_output(case, once)
  return bt.jax_loop_time(body, carry, unroll=unroll, min_time=min_time, reps=reps), out


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
            "eager free() (torch.unique syncs)" if cuda else "eager free()")
  seq, last = t64(case.seq), t64(case.last)
  seq_cpu = torch.as_tensor(np.asarray(case.seq, np.int64))
  if case.op == "decode":
    out = alloc.alloc_decode(seq, seq_cpu, last)
    if cuda:
      from torch_ref import triton_kernels  # pylint: disable=g-import-not-at-top
      free = t64(case.free_ring)
      call = lambda: triton_kernels.decode_indices(seq, last, free, page_size=ps)
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
      call = lambda: triton_kernels.extend_indices(pre, seq, last, free, page_size=ps,
                                                   extend_num_tokens=case.tokens)
    else:
      def call():
        alloc.restore_state(snap)
        return alloc.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, case.tokens)
  if out is None:
    raise RuntimeError(f"torch_ref {case.op} bs={case.bs}: the allocation did not fit")
  out = out.cpu().numpy()
  if cuda:
    return (bt.torch_graph_time(call, unroll=unroll, min_time=min_time, reps=reps), out,
            "CUDA graph replay of its Triton kernel")
  return (bt.host_time(call, sync=sync, min_time=min_time, reps=reps), out,
          "eager class call (torch on CPU)")


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


def run(*, ops: Sequence[str], paths: Sequence[str], torch_on: bool,
        batch_sizes: Sequence[int], extend_cases: Sequence[Tuple[int, int]],
        page_size: int, unroll: int, min_time: float, reps: int, seed: int,
        progress=None) -> List[Dict[str, Any]]:
  """Times every case; returns one row (dict) per case. `progress(desc)` is called
  before each measurement."""
  rows = []
  for op, bs, tokens in cases(ops, batch_sizes, extend_cases):
    case = make_case(op, bs, tokens, page_size, seed)
    row: Dict[str, Any] = {"op": op, "bs": bs, "tokens": case.tokens,
                           "page_size": page_size, "num_pages": case.num_pages,
                           "jax": {}, "torch": None, "check": "ok",
                           "sglang_us": sglang_figure(op, bs, case.tokens)}
    ref = None
    for path in paths:
      if op == "free" and path != paths[0]:
        row["jax"][path] = dict(row["jax"][paths[0]], same_as=paths[0])
        continue
      if progress:
        progress(f"{op} bs={bs} tokens={case.tokens} {path}")
      try:
        timing, out = time_jax(case, path, unroll=unroll, min_time=min_time, reps=reps)
      except Exception as e:  # pylint: disable=broad-except
        row["jax"][path] = {"error": f"{type(e).__name__}: {e}"[:300]}
        continue
      row["jax"][path] = {"us": timing["s"] * 1e6, "spread": timing["spread"],
                          "compile_s": timing["compile_s"]}
      if ref is None:
        ref = out
      elif not np.array_equal(out, ref):
        row["check"] = f"MISMATCH: {path} differs from {paths[0]}"
    if torch_on:
      if progress:
        progress(f"{op} bs={bs} tokens={case.tokens} torch_ref")
      try:
        timing, out, method = time_torch(case, unroll=unroll, min_time=min_time, reps=reps)
        row["torch"] = {"us": timing["s"] * 1e6, "spread": timing["spread"],
                        "method": method}
        if ref is not None and not np.array_equal(np.asarray(out, np.int64),
                                                  np.asarray(ref, np.int64)):
          row["check"] = "MISMATCH: torch_ref differs from jax"
      except Exception as e:  # pylint: disable=broad-except
        row["torch"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    rows.append(row)
  return rows
