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
back and only ships lengths. Both state and table are donated. Shapes are fixed for a
whole run (padded with inert rows), so each step function compiles once per config.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import allocation
from jax_kvalloc import freeing
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


class Batch(NamedTuple):
  """The requests of a prefill (pre -> seq) or decode (seq counts the new token) batch."""
  rows: Array      # i32[B] table rows, real ones first
  pre: Array       # i32[B] tokens already in the table (decode: seq - 1)
  seq: Array       # i32[B] tokens after this step
  num_reqs: Array  # i32[] real rows


def _copy(table: Array, copies: Copies, width: int) -> Array:
  """Applies `copies` (O(C * width) gather + scatter, skipped when there are none)."""
  def apply(table):
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    vals = table[copies.src[:, None], jnp.minimum(j, table.shape[1] - 1)]
    dst = jnp.where(j < copies.length[:, None], copies.dst[:, None], table.shape[0])
    return table.at[dst, j].set(vals, mode="drop")
  return jax.lax.cond(jnp.any(copies.length > 0), apply, lambda t: t, table)


def _free_group(config: AllocatorConfig, state: AllocatorState, table: Array,
                frees: Frees) -> AllocatorState:
  """One `free` call for the whole group (skipped when the group is empty)."""
  return jax.lax.cond(
      jnp.any(frees.end > frees.start),
      lambda s: freeing.free(config, s, free_group_indices(config, table, frees)),
      lambda s: s, state)


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


def _pages(config: AllocatorConfig, state: AllocatorState) -> Array:
  del config
  return state.free_len + state.release_len


@functools.partial(jax.jit, static_argnames=("config", "max_tokens", "copy_width"),
                   donate_argnames=("state", "table"))
def prefill_step(config: AllocatorConfig, state: AllocatorState, table: Array,
                 copy_out: Copies, frees: Frees, copy_in: Copies, batch: Batch, *,
                 max_tokens: int, copy_width: int) -> Tuple[AllocatorState, Array, Array, Array]:
  """One prefill iteration. Returns (state, table, ok bool[], free+released pages i32[]).

  On failure (ok False) nothing is allocated or written; the copies and frees stay done.
  """
  table = _copy(table, copy_out, copy_width)
  state = _free_group(config, state, table, frees)
  table = _copy(table, copy_in, copy_width)
  real = jnp.arange(batch.rows.shape[0]) < batch.num_reqs
  pre = jnp.where(real, batch.pre, 0)
  seq = jnp.where(real, batch.seq, 0)
  ext = seq - pre
  if config.kind == "token":
    state, out, ok = allocation.alloc(config, state, jnp.sum(ext), max_size=max_tokens)
  else:
    last_loc = jnp.where(pre > 0, table[batch.rows, jnp.maximum(pre - 1, 0)], -1)
    state, out, ok = allocation.alloc_extend(config, state, pre, seq, last_loc,
                                             max_tokens=max_tokens, num_reqs=batch.num_reqs)
  tok_start = jnp.cumsum(ext) - ext
  t = jnp.arange(max_tokens, dtype=jnp.int32)
  r = jnp.searchsorted(tok_start + ext, t, side="right").astype(jnp.int32)
  r = jnp.minimum(r, batch.rows.shape[0] - 1)
  pos = pre[r] + t - tok_start[r]
  table = _write(table, batch.rows[r], pos, out, ok & (t < jnp.sum(ext)))
  return state, table, ok, _pages(config, state)


@functools.partial(jax.jit, static_argnames=("config", "copy_width"),
                   donate_argnames=("state", "table"))
def decode_step(config: AllocatorConfig, state: AllocatorState, table: Array,
                copy_out: Copies, frees: Frees, batch: Batch, *,
                copy_width: int) -> Tuple[AllocatorState, Array, Array, Array]:
  """One decode iteration (one new token per real row); returns as `prefill_step`."""
  table = _copy(table, copy_out, copy_width)
  state = _free_group(config, state, table, frees)
  real = jnp.arange(batch.rows.shape[0]) < batch.num_reqs
  seq = jnp.where(real, batch.seq, 1)
  if config.kind == "token":
    state, out, ok = allocation.alloc(config, state, batch.num_reqs,
                                      max_size=batch.rows.shape[0])
  else:
    last_loc = jnp.where(seq >= 2, table[batch.rows, jnp.maximum(seq - 2, 0)], -1)
    state, out, ok = allocation.alloc_decode(config, state, seq, last_loc,
                                             num_reqs=batch.num_reqs)
  table = _write(table, batch.rows, seq - 1, out, ok & real)
  return state, table, ok, _pages(config, state)


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


def table_pages(table_row, tokens: int, page_size: int):
  """Host helper: the page ids holding tokens [0, tokens) of one (host) table row."""
  return table_row[0:tokens:page_size] // page_size


def new_pages(seq_before, seq_after, page_size: int):
  """Pages a request takes to grow from seq_before to seq_after tokens (host or device)."""
  return cdiv(seq_after, page_size) - cdiv(seq_before, page_size)
