"""The device backend's fast path: each class operation as one jitted call that the host
has already decided will succeed.

The classes keep an exact host mirror of `free_len` and `release_len` (SGLang's `*_cpu`
copies give every page count; jax_kvalloc.base), so they know before launching whether a
call fits and whether need_sort must merge first. What is left for the device is the
index computation and the ring write, launched here without waiting:

  * inputs travel in one transfer: the per-request ints are packed into one i32 array
    that the jitted function slices apart again; a `last_loc` that is already a device
    array (SGLang computes it on the device) is not read back but passed as a second
    input, padded to the row bucket on the device by a cached tiny program (`padded`);
  * an allocation takes only (free_ring, free_head, free_len) and returns the new head,
    length and indices: it never writes a ring, so nothing is donated or copied and a
    snapshot that holds the rings stays valid for free;
  * a free takes and returns only the ring it writes, donated unless a snapshot still
    holds it (then that one ring is copied: copy-on-write);
  * the merge runs as its own call, only when the host's mirror says it triggers, so the
    allocation programs carry no merge branch (config.need_sort is off inside them);
  * outputs are padded to a shape bucket (jax_kvalloc.buckets); `exact` cuts them to the
    exact length with a cached jitted slice (a second, tiny launch; no wait). A new exact
    length compiles one such slice, once per (bucket, length). Measured on the 2-core
    CPU (decode, 5 rows): bucket + slice 33.7 us per call against 22.9 us for a program
    compiled for the exact row count, but a new length then costs a whole allocation
    program (167 ms to compile) instead of a slice (58 ms), and extend lengths take
    thousands of values: the slice stays. Any program that returns a new shape compiles
    for it, so an exact length without either would need the output computed on the
    host and transferred (the host backend's work, plus a copy).

Programs are cached per (config, operation, bucket) across instances. Debug mode does not
come here (its checks live in the state and it reads them after every call).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import buckets
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

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


def _compiler_options() -> Dict[str, Any]:
  """XLA options for the fast-path programs: on a GPU host, a CUDA graph for every
  program, however few its kernels (`xla_gpu_graph_min_graph_size=1`; XLA's default
  needs 5). These programs are 1-10 small kernels, and launching each one separately
  costs host time: H200 run of 2026-11-30, the 64-row decode program's dispatch took
  85.6 us with XLA's default and 57.0 us with graphs (benchmarks/device_probe.py).
  JAX_KVALLOC_GPU_GRAPHS=0 turns it off (to compare). CPU compiles ignore the option; it
  is not passed where there is no GPU (TPU hosts)."""
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
    self._options = _compiler_options()

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
      return jit(lambda x: jnp.pad(x, (0, rows - n), constant_values=fill))
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

  def alloc_extend(self, state: AllocatorState, pre: np.ndarray, seq: np.ndarray,
                   last: Any, total: int) -> Tuple[AllocatorState, Array]:
    """`last`: host int64[bs], or a device i32[bs] (jax.Array) taken as it is: padded on
    the device, never read back."""
    bs = pre.shape[0]
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

  def alloc_decode(self, state: AllocatorState, seq: np.ndarray,
                   last: Any) -> Tuple[AllocatorState, Array]:
    """`last`: host int64[bs], or a device i32[bs] (jax.Array) taken as it is: padded on
    the device, never read back."""
    bs = seq.shape[0]
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

  def _write(self, op: str, state: AllocatorState, values: np.ndarray, minimum: int,
             shared: bool) -> AllocatorState:
    padded = buckets.pad(values, buckets.bucket(values.shape[0], minimum))
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
