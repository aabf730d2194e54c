"""The device backend: the state is an `AllocatorState` of jax arrays on one device, and
each class call is one cached jitted program launched without waiting.

The class keeps an exact host mirror of `free_len` and `release_len` (SGLang's `*_cpu`
copies give every page count; jax_kvalloc.sglang.base), so it knows before launching
whether a call fits and whether need_sort must merge first. What is left for the device
is the index computation and the ring write:

  * inputs travel in one transfer: the per-request ints are packed into one i32 array
    that the program slices apart again; a `last_loc` that is already a device array
    (SGLang computes it on the device) is not read back but passed as a second input,
    padded to the row bucket on the device by a cached tiny program (`padded`); page ids
    that are a device array (free_page_ids, free_segment) are padded the same way;
  * an allocation takes only (free_ring, free_head, free_len) and returns the new head,
    length and indices: it never writes a ring, so nothing is donated or copied and a
    snapshot that holds the rings stays valid for free;
  * a free takes and returns only the ring it writes, donated unless a snapshot still
    holds it (then that one ring is copied: copy-on-write);
  * the merge runs as its own call, only when the host's mirror says it triggers, so the
    allocation programs carry no merge branch (config.need_sort is off inside them);
  * outputs are padded to a shape bucket (jax_kvalloc.buckets); `exact` cuts them to the
    exact length with a cached jitted slice (a second, tiny launch; no wait), compiled
    once per (bucket, length); `warmup` compiles them ahead.

Programs are cached per (config, operation, bucket) across instances and devices
(`ops_for`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Dict, Iterable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import buckets
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc import warmup as _warmup
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import host
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport

Array = jax.Array


def _zero() -> Array:
  return jnp.zeros((), jnp.int32)


def _alloc_state(ring: Array, head: Array, length: Array) -> AllocatorState:
  """A state for the allocation functions: only the free list is read (need_sort off)."""
  return AllocatorState(free_ring=ring, free_head=head, free_len=length, release_ring=ring,
                        release_head=_zero(), release_len=_zero())


def _write_state(config: AllocatorConfig, ring: Array, head: Array, length: Array,
                 other_len: Array) -> AllocatorState:
  """A state for the free functions: the list they write (release_pages when need_sort,
  else free_pages) and the other list's length (the room check reads it)."""
  dummy = jnp.zeros((0,), jnp.int32)  # never read: the free writes the other list
  if config.need_sort:
    return AllocatorState(dummy, _zero(), other_len, ring, head, length)
  return AllocatorState(ring, head, length, dummy, _zero(), other_len)


def _written(config: AllocatorConfig, state: AllocatorState) -> Tuple[Array, Array, Array]:
  return st.freed_list(config.need_sort, state)[:3]


def compiler_options() -> Dict[str, Any]:
  """XLA options for the fast-path programs: on a GPU host, a CUDA graph for every
  program, however few its kernels (`xla_gpu_graph_min_graph_size=1`; XLA's default
  needs 5): these programs are 1-10 small kernels, and launching each one separately
  costs host time (BENCHMARKS.md has the measurement). JAX_KVALLOC_GPU_GRAPHS=0 turns it
  off (to compare). Not passed where there is no GPU."""
  if os.environ.get("JAX_KVALLOC_GPU_GRAPHS", "1") == "0":
    return {}
  try:
    has_gpu = bool(jax.devices("gpu"))
  except RuntimeError:
    has_gpu = False
  return {"xla_gpu_graph_min_graph_size": 1} if has_gpu else {}


@functools.lru_cache(maxsize=None)
def ops_for(config: AllocatorConfig) -> "DeviceOps":
  """The (shared) fast-path programs of one config."""
  return DeviceOps(config)


class DeviceOps:
  """Jitted fast-path programs of one config, compiled once per shape bucket."""

  def __init__(self, config: AllocatorConfig):
    self.config = config
    # The host runs any merge as its own call first, so allocations need no merge branch.
    self._alloc_cfg = dataclasses.replace(config, need_sort=False)
    self._fns: Dict[Tuple[Any, ...], Callable[..., Any]] = {}
    self._options = compiler_options()

  # -- program cache -------------------------------------------------------------------
  def _fn(self, key: Tuple[Any, ...]) -> Callable[..., Any]:
    fn = self._fns.get(key)
    if fn is None:
      fn = self._fns[key] = self._build(*key)
    return fn

  def _build(self, op: str, *shape: Any) -> Callable[..., Any]:
    jit = functools.partial(jax.jit, compiler_options=self._options)
    acfg, cfg = self._alloc_cfg, self.config
    if op == "slice":
      n = shape[1]
      return jit(lambda x: x[:n])
    if op == "alloc":
      (size,) = shape

      def alloc_fn(ring, head, length, need):
        s, out, _ = allocation.alloc(acfg, _alloc_state(ring, head, length), need,
                                     max_size=size)
        return s.free_head, s.free_len, out
      return jit(alloc_fn)
    if op == "extend":
      rows, tokens = shape

      def extend_fn(ring, head, length, packed, last=None):
        last = packed[2 * rows:3 * rows] if last is None else last
        s, out, _ = allocation.alloc_extend(
            acfg, _alloc_state(ring, head, length), packed[:rows], packed[rows:2 * rows],
            last, max_tokens=tokens, num_reqs=packed[3 * rows])
        return s.free_head, s.free_len, out
      return jit(extend_fn)
    if op == "decode":
      (rows,) = shape

      def decode_fn(ring, head, length, packed, last=None):
        last = packed[rows:2 * rows] if last is None else last
        s, out, _ = allocation.alloc_decode(
            acfg, _alloc_state(ring, head, length), packed[:rows], last,
            num_reqs=packed[2 * rows])
        return s.free_head, s.free_len, out
      return jit(decode_fn)
    if op == "pad":
      n, rows, fill = shape
      return jit(lambda x: jnp.pad(x.astype(jnp.int32), (0, rows - n), constant_values=fill))
    if op in ("free", "free_page_ids"):
      _, donate = shape
      body = freeing.free if op == "free" else freeing.free_page_ids

      def free_fn(ring, head, length, other_len, values):
        return _written(cfg, body(cfg, _write_state(cfg, ring, head, length, other_len),
                                  values))
      return jit(free_fn, donate_argnums=(0,) if donate else ())
    if op == "merge":
      (donate,) = shape

      def merge_fn(free_ring, free_head, free_len, release_ring, release_head, release_len):
        s = freeing.merge_and_sort_free(cfg, AllocatorState(
            free_ring, free_head, free_len, release_ring, release_head, release_len))
        return s.free_ring, s.free_head, s.free_len, s.release_head, s.release_len
      return jit(merge_fn, donate_argnums=(0,) if donate else ())
    raise ValueError(f"unknown operation {op!r}")

  def padded(self, x: Array, rows: int, fill: int) -> Array:
    """A device i32[n] padded with `fill` to i32[rows] without waiting: `x` itself when
    it has that length, else one launch of a cached jitted pad (compiled once per
    (n, rows, fill), like `exact`)."""
    if x.shape[0] == rows:
      return x
    return self._fn(("pad", x.shape[0], rows, fill))(x)

  def exact(self, out: Array, n: int) -> Array:
    """out[:n] without waiting: `out` itself when it has that length, else one launch of
    a cached jitted slice."""
    if out.shape[0] == n:
      return out
    return self._fn(("slice", out.shape[0], n))(out)

  # -- operations (the class has validated the input and decided that it fits) ---------
  def alloc(self, state: AllocatorState, need_size: int) -> Tuple[AllocatorState, Array]:
    size = buckets.bucket(need_size, buckets.MIN_TOKENS)
    head, length, out = self._fn(("alloc", size))(
        state.free_ring, state.free_head, state.free_len, np.int32(need_size))
    return state._replace(free_head=head, free_len=length), self.exact(out, need_size)

  def alloc_extend(self, state: AllocatorState, pre: Any, seq: Any,
                   last: Any, total: int) -> Tuple[AllocatorState, Array]:
    """pre, seq: host ints[bs] (int64 arrays or lists); `last`: the same, or a device
    i32[bs] (jax.Array) taken as it is: padded on the device, never read back."""
    bs = len(pre)
    rows = buckets.bucket(bs, buckets.MIN_BATCH)
    packed = np.zeros((3 * rows + 1,), np.int32)
    packed[:bs] = pre
    packed[rows:rows + bs] = seq
    extra = ()
    if isinstance(last, jax.Array):
      extra = (self.padded(last, rows, -1),)
    else:
      packed[2 * rows:3 * rows] = -1
      packed[2 * rows:2 * rows + bs] = last
    packed[3 * rows] = bs
    head, length, out = self._fn(("extend", rows, buckets.bucket(total, buckets.MIN_TOKENS)))(
        state.free_ring, state.free_head, state.free_len, packed, *extra)
    return state._replace(free_head=head, free_len=length), self.exact(out, total)

  def alloc_decode(self, state: AllocatorState, seq: Any,
                   last: Any) -> Tuple[AllocatorState, Array]:
    """seq: host ints[bs] (an int64 array or a list); `last`: the same, or a device
    i32[bs] (jax.Array) taken as it is: padded on the device, never read back."""
    bs = len(seq)
    rows = buckets.bucket(bs, buckets.MIN_BATCH)
    packed = np.zeros((2 * rows + 1,), np.int32)
    packed[:bs] = seq
    extra = ()
    if isinstance(last, jax.Array):
      extra = (self.padded(last, rows, -1),)
    else:
      packed[rows:rows + bs] = last
    packed[2 * rows] = bs
    head, length, out = self._fn(("decode", rows))(
        state.free_ring, state.free_head, state.free_len, packed, *extra)
    return state._replace(free_head=head, free_len=length), self.exact(out, bs)

  def _write(self, op: str, state: AllocatorState, values: Any, minimum: int,
             shared: bool) -> AllocatorState:
    """values: host ints, or a device i32[n] (padded with 0 on the device, not read)."""
    rows = buckets.bucket(values.shape[0], minimum)
    if isinstance(values, jax.Array):
      padded = self.padded(values, rows, 0)
    else:
      padded = buckets.pad(values, rows)
    ring, head, length = self._fn((op, padded.shape[0], not shared))(
        *st.freed_list(self.config.need_sort, state), padded)
    return st.with_freed_list(self.config.need_sort, state, ring, head, length)

  def free(self, state: AllocatorState, idx: np.ndarray, shared: bool) -> AllocatorState:
    """`free` of validated slots; `shared`: the ring it writes is held by a snapshot."""
    return self._write("free", state, idx, buckets.MIN_FREE, shared)

  def free_page_ids(self, state: AllocatorState, page_ids: np.ndarray,
                    shared: bool) -> AllocatorState:
    """SPEC 10 `free_page_ids` of validated page ids (0 pads)."""
    return self._write("free_page_ids", state, page_ids, buckets.MIN_FREE, shared)

  def merge_and_sort_free(self, state: AllocatorState, shared: bool) -> AllocatorState:
    """The merge (SPEC 6); `shared`: the free ring is held by a snapshot."""
    ring, head, length, rhead, rlen = self._fn(("merge", not shared))(*state[:6])
    return state._replace(free_ring=ring, free_head=head, free_len=length,
                          release_head=rhead, release_len=rlen)


_INIT = jax.jit(st.init, static_argnames=("config",))


class DeviceBackend:
  """The Backend (jax_kvalloc.sglang.backends) of jax arrays on `device`: each call one
  launch of `ops_for(config)`'s programs, never a wait."""

  keeps_device_arrays = True

  def __init__(self, config: AllocatorConfig, device: Any):
    from jax_kvalloc.sglang.backends import resolve_device  # pylint: disable=g-import-not-at-top
    self.config = config
    self.device = resolve_device(device)
    self.ops = ops_for(config)
    self._hc = host.host_config(config)
    self._empty = None

  def init(self) -> AllocatorState:
    state = _INIT(self.config)
    return state if self.device is None else jax.device_put(state, self.device)

  def adopt(self, state: AllocatorState) -> AllocatorState:
    """A state from elsewhere (a snapshot, set_state) as this backend holds it."""
    if isinstance(state.free_ring, jax.Array):
      return state
    return jax.device_put(jax.tree.map(np.asarray, state), self.device)

  def empty(self) -> Array:
    if self._empty is None:
      self._empty = jax.device_put(np.zeros((0,), np.int32), self.device)
    return self._empty

  def alloc(self, state, need_size, fits):
    if not fits:
      return state, None
    return self.ops.alloc(state, need_size)

  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    """Checked input (`checked`: validate.extend_args' result), or host data the host
    backend's plans check and count (host.extend_plan_small / extend_plan: the same
    checks in fewer numpy calls); None otherwise (the class then checks it)."""
    if checked is not None:
      return Plan(pre.shape[0], checked.new_pages, checked.total_tokens, (pre, seq, last))
    hc = self._hc
    spre = host.small_ints(pre)
    sseq = host.small_ints(seq) if spre is not None else None
    slast = host.small_ints(last) if sseq is not None else None
    if slast is not None:
      plan = host.extend_plan_small(hc, spre, sseq, slast, extend_num_tokens)
      if plan is not None:
        return Plan(len(spre), plan[1], plan[0], (spre, sseq, slast))
    pre, seq, last = host.i64(pre), host.i64(seq), host.i64(last)
    if pre is None or seq is None or last is None:
      return None
    plan = host.extend_plan(hc, pre, seq, last, extend_num_tokens)
    if plan is None:
      return None
    return Plan(pre.shape[0], plan[1], plan[0], (pre, seq, last))

  def alloc_extend(self, state, plan, fits):
    if not fits:
      return state, None
    pre, seq, last = plan.data
    return self.ops.alloc_extend(state, pre, seq, last, plan.tokens)

  def decode_plan(self, seq, last, checked):
    """Checked input (host int64 seq_lens; last_loc host int64 or device i32), or host
    data the host backend's plans check and count; None otherwise."""
    if checked:
      pages = int(np.count_nonzero((seq - 1) % self.config.page_size == 0))  # SPEC 4.3
      return Plan(seq.shape[0], pages, seq.shape[0], (seq, last))
    sseq = host.small_ints(seq)
    slast = host.small_ints(last) if sseq is not None else None
    if slast is not None:
      pages = host.decode_plan_small(self._hc, sseq, slast)
      return None if pages is None else Plan(len(sseq), pages, len(sseq), (sseq, slast))
    seq, last = host.i64(seq), host.i64(last)
    if seq is None or last is None:
      return None
    plan = host.decode_plan(self._hc, seq, last)
    return None if plan is None else Plan(seq.shape[0], plan[2], seq.shape[0], (seq, last))

  def alloc_decode(self, state, plan, fits):
    if not fits:
      return state, None
    return self.ops.alloc_decode(state, *plan.data)

  def free(self, state, idx, values, count, shared):
    del values  # the program finds the sorted unique pages itself
    return state if count == 0 else self.ops.free(state, idx, shared)

  def free_page_ids(self, state, ids, count, shared):
    return state if count == 0 else self.ops.free_page_ids(state, ids, shared)

  def merge_and_sort_free(self, state, shared):
    return self.ops.merge_and_sort_free(state, shared)

  def warmup(self, state, *, max_batch, max_tokens, max_free, exact_sizes, extend,
             device_last_loc) -> WarmupReport:
    return warmup_programs(self.ops, state, max_batch=max_batch, max_tokens=max_tokens,
                           max_free=max_free, exact_sizes=exact_sizes, extend=extend,
                           device_last_loc=device_last_loc)


def warmup_programs(ops: Any, state: Any, *, max_batch: int, max_tokens: int,
                      max_free: int, exact_sizes: Iterable[int] = (),
                      extend: bool = True, device_last_loc: bool = False) -> _warmup.WarmupReport:
  """Runs every fast-path program of this module up to the maxima on
  throwaway inputs (the state is not changed: allocation programs are pure and the
  donating ones get copies). `device_last_loc`: also the variants that take last_loc
  as a device array, and its pads from each of `exact_sizes` rows. Waits at the end."""
  cfg = ops.config
  t0 = time.perf_counter()
  outs, n = [], 0
  ring, head, length = state.free_ring, state.free_head, state.free_len
  rows_list = _warmup.bucket_sizes(max_batch, buckets.MIN_BATCH)
  token_list = _warmup.bucket_sizes(max_tokens, buckets.MIN_TOKENS)
  for size in token_list:
    outs.append(ops._fn(("alloc", size))(ring, head, length, np.int32(0)))
    n += 1
  for rows in rows_list:
    packed = np.zeros((2 * rows + 1,), np.int32)
    # Extra arguments of each variant: none (last_loc packed), or a device last_loc.
    lasts = [()] + ([(jnp.zeros((rows,), jnp.int32),)] if device_last_loc else [])
    for last in lasts:
      outs.append(ops._fn(("decode", rows))(ring, head, length, packed, *last))
      n += 1
    if extend and cfg.kind == "paged":
      for tokens in token_list:
        packed = np.zeros((3 * rows + 1,), np.int32)
        for last in lasts:
          outs.append(ops._fn(("extend", rows, tokens))(ring, head, length, packed, *last))
          n += 1
  if cfg.need_sort:
    w_ring, w_head, w_len, other = (state.release_ring, state.release_head,
                                    state.release_len, state.free_len)
  else:
    w_ring, w_head, w_len, other = ring, head, length, state.release_len
  names = ["free"] + (["free_page_ids"] if cfg.kind == "paged" else [])
  for m in _warmup.bucket_sizes(max_free, buckets.MIN_FREE):
    values = np.zeros((m,), np.int32)  # all padding: frees nothing
    for name in names:
      for donate in (True, False):
        target = jnp.copy(w_ring) if donate else w_ring
        outs.append(ops._fn((name, m, donate))(target, w_head, w_len, other, values))
        n += 1
  if cfg.need_sort:
    for donate in (True, False):
      target = jnp.copy(ring) if donate else ring
      outs.append(ops._fn(("merge", donate))(target, head, length, state.release_ring,
                                             state.release_head, state.release_len))
      n += 1
  for size in exact_sizes:  # decode outputs pad to row buckets, the others to token ones
    for bucket_len in {buckets.bucket(size, buckets.MIN_BATCH),
                       buckets.bucket(size, buckets.MIN_TOKENS)}:
      if bucket_len != size:
        outs.append(ops.exact(jnp.zeros((bucket_len,), jnp.int32), size))
        n += 1
    rows = buckets.bucket(size, buckets.MIN_BATCH)
    if device_last_loc and rows != size:
      outs.append(ops.padded(jnp.zeros((size,), jnp.int32), rows, -1))
      n += 1
  jax.block_until_ready(outs)
  return _warmup.WarmupReport(n, time.perf_counter() - t0)
