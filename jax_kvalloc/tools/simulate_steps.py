"""The jitted device half of `jax-kvalloc simulate`: one serving step as one XLA call.

A step runs, in order, what a scheduler iteration does to the KV pool:

  1. copy-out: prefixes inserted into the prefix cache last step are copied from their
     request's row of the token table into the cache's row;
  2. free group: finished requests and evicted cache entries are freed in ONE `free`
     call (SGLang's free_group_begin/end around a batch's result processing);
  3. copy-in (prefill only): cached prefixes are copied into newly admitted requests' rows;
  4. allocation: `alloc_extend` (prefill) or `alloc_decode` (decode) for the batch
     (`alloc` for the token allocator, page_size 1, as SGLang's callers do);
  5. the new slots are written into the token table (SGLang's req_to_token).

The token table (i32[rows + groups, ctx]) lives on the device next to the allocator
state: `last_loc` is gathered from it and frees read it, so the host never needs an index
back and only ships lengths, packed into one i32 vector (one transfer in, one i32[2]
status back). Both state and table are donated. Shapes are fixed for a whole run (padded
with inert rows), so each step function compiles once per config.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import index_jnp
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.state import AllocatorState

Array = jax.Array


class Copies(NamedTuple):
  """Row-prefix copies in the token table: table[dst, :length] = table[src, :length]."""
  src: Array     # i32[C] source rows
  dst: Array     # i32[C] destination rows (padding: length 0)
  length: Array  # i32[C] tokens to copy


class Frees(NamedTuple):
  """One free group: the pages holding tokens [start, end) of each listed table row."""
  rows: Array    # i32[F] table rows (padding: end = start = 0)
  start: Array   # i32[F] first owned token (page aligned)
  end: Array     # i32[F] one past the last owned token


def _maybe(skip_empty: bool, pred: Array, fn, x):
  """fn(x), or x when `skip_empty` and not pred. On CPU a lax.cond saves the work; on GPU
  it would read its predicate back to the host, which costs more than the work."""
  if not skip_empty:
    return fn(x)
  return jax.lax.cond(pred, fn, lambda v: v, x)


def _copy(table: Array, copies: Copies, width: int, skip_empty: bool) -> Array:
  """Applies `copies` (O(C * width) gather + scatter; length-0 entries do nothing)."""
  def apply(table):
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    vals = table[copies.src[:, None], jnp.minimum(j, table.shape[1] - 1)]
    dst = jnp.where(j < copies.length[:, None], copies.dst[:, None], table.shape[0])
    return table.at[dst, j].set(vals, mode="drop")
  return _maybe(skip_empty, jnp.any(copies.length > 0), apply, table)


def _free_group(config: AllocatorConfig, state: AllocatorState, table: Array,
                frees: Frees, skip_empty: bool) -> AllocatorState:
  """One `free` call for the whole group (an empty group frees nothing)."""
  return _maybe(skip_empty, jnp.any(frees.end > frees.start),
                lambda s: freeing.free(config, s, free_group_indices(config, table, frees)),
                state)


def free_group_indices(config: AllocatorConfig, table: Array, frees: Frees) -> Array:
  """The slot indices a free group hands to `free`, i32[F * width] (0 = padding).

  Paged: one slot per page (freeing any slot frees its page), width = ceil(ctx / ps).
  Token: every slot, width = ctx.
  """
  ctx = table.shape[1]
  stride = config.page_size
  width = -(-ctx // stride)
  k = jnp.arange(width, dtype=jnp.int32)[None, :]
  tok = frees.start[:, None] + k * stride
  idx = table[frees.rows[:, None], jnp.minimum(tok, ctx - 1)]
  return jnp.where(tok < frees.end[:, None], idx, 0).reshape(-1)


def _write(table: Array, rows: Array, pos: Array, values: Array, valid: Array) -> Array:
  """table[rows, pos] = values where valid (others dropped)."""
  rows = jnp.where(valid, rows, table.shape[0])
  return table.at[rows, pos].set(values, mode="drop")


def _status(ok: Array, state: AllocatorState) -> Array:
  """i32[2]: ok, free + released pages (one transfer back to the host)."""
  return jnp.stack([ok.astype(jnp.int32), state.free_len + state.release_len])


def pack(*parts) -> np.ndarray:
  """The host side of a step's inputs: everything in one i32 vector, one transfer."""
  return np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in parts])


def _unpack(packed: Array, sizes):
  """Splits `pack`'s vector back into arrays of the static `sizes`."""
  out, at = [], 0
  for n in sizes:
    out.append(packed[at:at + n])
    at += n
  return out


def _copies(packed: Array, n: int) -> Copies:
  return Copies(*_unpack(packed, (n, n, n)))


@functools.partial(jax.jit, static_argnames=("config", "max_tokens", "copy_width",
                                             "sizes", "skip_empty"),
                   donate_argnames=("state", "table"))
def prefill_step(config: AllocatorConfig, state: AllocatorState, table: Array,
                 packed: Array, *, max_tokens: int, copy_width: int,
                 sizes: Tuple[int, int, int], skip_empty: bool
                 ) -> Tuple[AllocatorState, Array, Array]:
  """One prefill iteration. Returns (state, table, i32[2] [ok, free + released pages]).

  packed = pack(copy_out, frees, copy_in, batch, num_reqs) with sizes = (C, F, B):
  copy_out and copy_in are Copies of C entries, frees a Frees of F rows, batch the B rows
  (rows, pre, seq). On failure (ok 0) nothing is allocated or written; the copies and
  frees stay done.
  """
  c, f, b = sizes
  copy_out, frees_, copy_in, batch_, n = _unpack(packed, (3 * c, 3 * f, 3 * c, 3 * b, 1))
  rows, pre_in, seq_in = _unpack(batch_, (b, b, b))
  num_reqs = n[0]
  table = _copy(table, _copies(copy_out, c), copy_width, skip_empty)
  state = _free_group(config, state, table, Frees(*_unpack(frees_, (f, f, f))), skip_empty)
  table = _copy(table, _copies(copy_in, c), copy_width, skip_empty)
  real = jnp.arange(b) < num_reqs
  pre = jnp.where(real, pre_in, 0)
  seq = jnp.where(real, seq_in, 0)
  ext = seq - pre
  if config.kind == "token":
    state, out, ok = allocation.alloc(config, state, jnp.sum(ext), max_size=max_tokens)
  else:
    last_loc = jnp.where(pre > 0, table[rows, jnp.maximum(pre - 1, 0)], -1)
    state, out, ok = allocation.alloc_extend(config, state, pre, seq, last_loc,
                                             max_tokens=max_tokens, num_reqs=num_reqs)
  tok_start = jnp.cumsum(ext) - ext
  t = jnp.arange(max_tokens, dtype=jnp.int32)
  r = index_jnp.searchsorted_right(tok_start + ext, t).astype(jnp.int32)
  r = jnp.minimum(r, b - 1)
  pos = pre[r] + t - tok_start[r]
  table = _write(table, rows[r], pos, out, ok & (t < jnp.sum(ext)))
  return state, table, _status(ok, state)


@functools.partial(jax.jit, static_argnames=("config", "copy_width", "sizes",
                                             "skip_empty"),
                   donate_argnames=("state", "table"))
def decode_step(config: AllocatorConfig, state: AllocatorState, table: Array,
                packed: Array, *, copy_width: int, sizes: Tuple[int, int, int],
                skip_empty: bool) -> Tuple[AllocatorState, Array, Array]:
  """One decode iteration (one new token per real row); returns as `prefill_step`.

  packed = pack(copy_out, frees, batch, num_reqs) with sizes = (C, F, R); batch rows are
  (rows, seq - 1, seq), seq counting the new token.
  """
  c, f, r = sizes
  copy_out, frees_, batch_, n = _unpack(packed, (3 * c, 3 * f, 3 * r, 1))
  rows, _, seq_in = _unpack(batch_, (r, r, r))
  num_reqs = n[0]
  table = _copy(table, _copies(copy_out, c), copy_width, skip_empty)
  state = _free_group(config, state, table, Frees(*_unpack(frees_, (f, f, f))), skip_empty)
  real = jnp.arange(r) < num_reqs
  seq = jnp.where(real, seq_in, 1)
  if config.kind == "token":
    state, out, ok = allocation.alloc(config, state, num_reqs, max_size=r)
  else:
    last_loc = jnp.where(seq >= 2, table[rows, jnp.maximum(seq - 2, 0)], -1)
    state, out, ok = allocation.alloc_decode(config, state, seq, last_loc,
                                             num_reqs=num_reqs)
  table = _write(table, rows, seq - 1, out, ok & real)
  return state, table, _status(ok, state)


@jax.jit
def free_list_runs(state: AllocatorState) -> Array:
  """Runs of consecutive page ids in the free list, in list order (i32[]); 0 if empty.

  [5, 6, 7, 2, 3] has 2 runs. Fewer runs = more contiguous allocations.
  """
  n = state.free_ring.shape[0]
  w = st.ring_window(state.free_ring, state.free_head, state.free_len, n)
  i = jnp.arange(n)
  brk = (i >= 1) & (i < state.free_len) & (w != jnp.roll(w, 1) + 1)
  return jnp.where(state.free_len > 0, 1 + jnp.sum(brk), 0).astype(jnp.int32)


def new_pages(seq_before, seq_after, page_size: int):
  """Pages a request takes to grow from seq_before to seq_after tokens (host or device)."""
  return cdiv(seq_after, page_size) - cdiv(seq_before, page_size)
