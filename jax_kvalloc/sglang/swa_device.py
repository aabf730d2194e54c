"""The SWA class's device-backend programs: each steady serving call of
SWATokenToKVPoolAllocator is one jitted program of the functional core (jax_kvalloc.swa)
over both pools' states and the mapping, donated unless a snapshot holds a part of it.

Inputs are padded to shape buckets (jax_kvalloc.buckets), the real counts travelling as
traced values, so a serving loop compiles each program once per bucket. Per-request ints
travel packed in one host i32 array; a device last_loc or free_index that is not of its
bucket's length is padded on the device by the pool's cached pad program, and an output
longer than asked is cut by its cached slice (jax_kvalloc.sglang.backends.device), as the
paged class does: at bucket sizes a call is exactly one launch.

Allocations run with need_sort off inside the program: the class runs each pool's merge
first, as its own call, when the host mirror says that SPEC's trigger fires.

tests/test_swa_dispatch.py counts the launches of a call (one at bucket sizes).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import buckets
from jax_kvalloc import swa as core
from jax_kvalloc.sglang.backends.device import compiler_options

Array = jax.Array


def _lengths(state: core.SWAState) -> Array:
  """i32[4]: (full free_len, full release_len, swa free_len, swa release_len)."""
  return jnp.stack([state.full.free_len, state.full.release_len,
                    state.swa.free_len, state.swa.release_len])


def _build(config: core.SWAConfig, op: str, shape: Tuple[Any, ...]) -> Callable[..., Any]:
  acfg = dataclasses.replace(config, need_sort=False)  # allocations: merged by the host
  if op == "extend":
    rows, tokens = shape

    def fn(state, packed, last=None):
      last = packed[2 * rows:3 * rows] if last is None else last
      state, out, _ = core.alloc_extend(acfg, state, packed[:rows], packed[rows:2 * rows],
                                        last, max_tokens=tokens, num_reqs=packed[3 * rows])
      return state, out
  elif op == "tail":
    (tokens,) = shape

    def fn(state, packed):
      state, out, _ = core.alloc_extend_swa_tail(acfg, state, packed[0:1], packed[1:2],
                                                 packed[2:3], packed[3],
                                                 max_tokens=tokens)
      return state, out
  elif op == "decode":
    (rows,) = shape

    def fn(state, packed, last=None):
      last = packed[rows:2 * rows] if last is None else last
      state, out, _ = core.alloc_decode(acfg, state, packed[:rows], last,
                                        num_reqs=packed[2 * rows])
      return state, out
  elif op in ("free", "free_swa"):
    body = core.free if op == "free" else core.free_swa

    def fn(state, idx):
      state = body(config, state, idx)
      return state, _lengths(state)
  elif op in ("free_swa_segment", "free_segment"):
    body = core.free_swa_segment if op == "free_swa_segment" else core.free_segment

    def fn(state, idx, start_pos, num):
      return body(config, state, idx, start_pos, num), None
  else:
    raise ValueError(f"unknown operation {op!r}")
  return fn


@functools.lru_cache(maxsize=None)
def program(config: core.SWAConfig, op: str, shape: Tuple[Any, ...],
            donate: bool) -> Callable[..., Any]:
  """The jitted program of `op` at these bucket sizes (cached across instances)."""
  return jax.jit(_build(config, op, shape), donate_argnums=(0,) if donate else (),
                 compiler_options=compiler_options())


def run(config: core.SWAConfig, op: str, shape: Tuple[Any, ...], donate: bool,
        *args: Any) -> Any:
  """One launch of `program(config, op, shape, donate)(*args)`."""
  return program(config, op, shape, donate)(*args)


def pack_extend(pre: Any, seq: Any, last: Any, rows: int) -> np.ndarray:
  """i32[3 * rows + 1]: prefix_lens, seq_lens, last_loc (-1 padded; zeros when `last` is
  None), then the row count."""
  bs = len(pre)
  packed = np.zeros((3 * rows + 1,), np.int32)
  packed[:bs] = pre
  packed[rows:rows + bs] = seq
  packed[2 * rows:3 * rows] = -1
  if last is not None:
    packed[2 * rows:2 * rows + bs] = last
  packed[3 * rows] = bs
  return packed


def pack_decode(seq: Any, last: Any, rows: int) -> np.ndarray:
  """i32[2 * rows + 1]: seq_lens, last_loc (-1 padded; when `last` is None too), then
  the row count."""
  bs = len(seq)
  packed = np.zeros((2 * rows + 1,), np.int32)
  packed[:bs] = seq
  packed[rows:2 * rows] = -1
  if last is not None:
    packed[rows:rows + bs] = last
  packed[2 * rows] = bs
  return packed


def bucket_rows(n: int) -> int:
  return buckets.bucket(n, buckets.MIN_BATCH)


def bucket_tokens(n: int) -> int:
  return buckets.bucket(n, buckets.MIN_TOKENS)


def bucket_free(n: int) -> int:
  return buckets.bucket(n, buckets.MIN_FREE)

