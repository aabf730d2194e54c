"""Adapters from the request table (SPEC 11) to the inputs of paged-attention kernels,
and the KV write that puts a step's new K/V into the pages at the allocator's slots.

Every function is pure and traceable (no host work, static shapes): call it inside the
jitted step, after `extend_rows` / `decode_rows`, so that kv_lens count the new tokens.
The kernels read pages of the pool's K/V buffer, page p holding slots p*ps .. p*ps+ps-1
(page 0 is the reserved padding page, so a buffer has num_pages + 1 pages).

Forms (which kernel takes which, and the K/V layout each expects):

  dense    page_indices i32[B, W], kv_lens, cu_q_lens, num_seqs (`dense_inputs`).
           jax.experimental.pallas.ops.tpu.ragged_paged_attention (jax >= 0.6; TPU) and
           its jnp `ref_ragged_paged_attention`: K/V combined, f[P, ps, 2*Hkv, D], K of
           head h at 2h and V at 2h+1 (`write_kv_combined`).
           ...ops.tpu.paged_attention (decode, q [B, Hq, D]; W a multiple of
           pages_per_compute_block) and ...ops.gpu.paged_attention (decode, Pallas-Triton,
           block_tables = page_indices, lengths = kv_lens; W a multiple of k_splits, each
           split a power of two pages): K and V split, f[Hkv, P, ps, D] each
           (`write_kv_split`). `width=` pads W for them.
  ragged   every row's pages packed back to back, row b's at
           page_indices[page_starts[b] : page_starts[b + 1]] (`ragged_inputs`): the table
           a TPU kernel scalar-prefetches shrinks from B * W to the pages in use.
  flat     tpu-inference's ragged paged attention v3: page_indices flattened
           i32[B * W] (row i's pages at i * W), rows reordered decode first, and
           `distribution` = (decode end, prefill-only end, num seqs) computed on the
           device (`flat_inputs`); queries and outputs follow `token_order`. That kernel
           writes the new K/V itself, into [P, ps, 2*Hkv // packing, packing, D] pages
           (for f32, packing 1: the combined layout with a unit axis).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import index_jnp
from jax_kvalloc import request_table as rt
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv

Array = jax.Array


class RaggedInputs(NamedTuple):
  """The rows' pages packed back to back (padding rows: no pages, length 0)."""
  page_indices: Array  # i32[max_pages] row b's pages at [page_starts[b], page_starts[b+1])
  page_starts: Array   # i32[B + 1] exclusive cumsum of ceil(kv_lens / ps)
  cu_kv_lens: Array    # i32[B + 1] page_starts * ps: cdiv(cu_kv_lens[b], ps) = page_starts[b]
  kv_lens: Array       # i32[B] tokens in each row's KV cache (new tokens included)
  cu_q_lens: Array     # i32[B + 1] cumulative query lengths
  num_seqs: Array      # i32[1] real rows
  ok: Array            # bool[] every page fit in max_pages (else the tail is cut off)


class FlatInputs(NamedTuple):
  """tpu-inference v3 inputs: rows in kernel order, decode rows (q_len == 1) first."""
  page_indices: Array  # i32[B * W] row i (kernel order) at [i * W, i * W + ceil(kv/ps))
  kv_lens: Array       # i32[B] kernel order
  cu_q_lens: Array     # i32[B + 1] kernel order
  distribution: Array  # i32[3] (decode rows, decode rows, real rows): no prefill-only group
  row_order: Array     # i32[B] kernel row i is batch entry row_order[i]
  token_order: Array   # i32[max_tokens] kernel token t is packed batch token token_order[t]


def dense_inputs(config: AllocatorConfig, table: rt.RequestTable, rows: Array,
                 q_lens: Array, *, num_rows: Optional[Array] = None,
                 width: Optional[int] = None) -> rt.AttentionInputs:
  """The dense form: `request_table.attention_inputs`, page columns padded to `width`.

  Args:
    config: static configuration.
    table: the request table (after the step's extend/decode).
    rows: i32[B] table rows, in the order of the packed queries.
    q_lens: i32[B] query tokens per row this step.
    num_rows: optional i32[]; entries at index >= num_rows are padding.
    width: optional static page columns (>= max_pages_per_req); the extra columns are 0.
      The decode kernels want a multiple of their page block (TPU) or k_splits (GPU).

  Returns:
    AttentionInputs with page_indices i32[B, width or max_pages_per_req].
  """
  att = rt.attention_inputs(config, table, rows, q_lens, num_rows=num_rows)
  w = att.page_indices.shape[1]
  if width is not None:
    if isinstance(width, bool) or not isinstance(width, int) or width < w:
      raise ValueError(f"width must be an int >= max_pages_per_req={w}, got {width!r}")
    att = att._replace(page_indices=jnp.pad(att.page_indices, ((0, 0), (0, width - w))))
  return att


def ragged_inputs(config: AllocatorConfig, table: rt.RequestTable, rows: Array,
                  q_lens: Array, *, max_pages: int,
                  num_rows: Optional[Array] = None) -> RaggedInputs:
  """The ragged form: each row's ceil(kv_len / ps) pages, rows back to back.

  page_starts is the exclusive cumsum of ceil(kv_lens / ps); one gather fills the packed
  list. Footprint: max_pages x 4 B instead of B x max_pages_per_req x 4 B.

  Args:
    config: static configuration.
    table: the request table (after the step's extend/decode).
    rows: i32[B] table rows, in the order of the packed queries.
    q_lens: i32[B] query tokens per row this step.
    max_pages: static length of the packed list (>= 1).
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    RaggedInputs; entries past page_starts[B] are 0. ok is False when the rows hold more
    than max_pages pages: then the pages past max_pages are missing (page_starts and the
    lengths are still exact).
  """
  if isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 1:
    raise ValueError(f"max_pages must be a positive int, got {max_pages!r}")
  ps = config.page_size
  att = rt.attention_inputs(config, table, rows, q_lens, num_rows=num_rows)
  num, width = att.page_indices.shape
  n_pages = cdiv(att.kv_lens, ps)
  ends = jnp.cumsum(n_pages).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  k = jnp.arange(max_pages, dtype=jnp.int32)
  b = jnp.minimum(index_jnp.searchsorted_right(ends, k).astype(jnp.int32), num - 1)
  col = jnp.clip(k - starts[b], 0, width - 1)
  packed = jnp.where(k < ends[-1], att.page_indices[b, col], 0)
  return RaggedInputs(page_indices=packed, page_starts=starts, cu_kv_lens=starts * ps,
                      kv_lens=att.kv_lens, cu_q_lens=att.cu_q_lens,
                      num_seqs=att.num_seqs, ok=ends[-1] <= max_pages)


def flat_inputs(config: AllocatorConfig, table: rt.RequestTable, rows: Array,
                q_lens: Array, *, max_tokens: int,
                num_rows: Optional[Array] = None) -> FlatInputs:
  """The flattened, decode-first form of tpu-inference's ragged paged attention v3.

  Real rows with q_len == 1 come first (batch order kept), then the other real rows,
  then padding. distribution = (d, d, S) with d decode rows and S real rows: every
  non-decode row goes to the kernel's general (mixed) group, which accepts any q_len.

  Args:
    config: static configuration.
    table: the request table (after the step's extend/decode).
    rows: i32[B] table rows, in the order of the packed queries.
    q_lens: i32[B] query tokens per row this step.
    max_tokens: static length of the packed queries (>= sum(q_lens)).
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    FlatInputs. Feed the kernel q[token_order]; its output row t belongs to packed token
    token_order[t] (`out_batch = jnp.zeros_like(out).at[token_order].set(out)`).
    token_order is a permutation of range(max_tokens) (tokens past sum(q_lens) stay).
  """
  att = rt.attention_inputs(config, table, rows, q_lens, num_rows=num_rows)
  num, width = att.page_indices.shape
  q = att.cu_q_lens[1:] - att.cu_q_lens[:-1]
  real = jnp.arange(num) < att.num_seqs[0]
  decode = real & (q == 1)
  # Stable partition: decode rows, other real rows, padding.
  key = jnp.where(decode, 0, jnp.where(real, 1, 2))
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  q_k = q[order]
  cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_k).astype(jnp.int32)])
  # Packed token s of batch entry e moves to cu_k[pos[e]] + (s - cu_q_lens[e]).
  pos = jnp.zeros((num,), jnp.int32).at[order].set(jnp.arange(num, dtype=jnp.int32))
  s = jnp.arange(max_tokens, dtype=jnp.int32)
  e = jnp.minimum(index_jnp.searchsorted_right(att.cu_q_lens[1:], s).astype(jnp.int32),
                  num - 1)
  dest = jnp.where(s < att.cu_q_lens[-1], cu_k[pos[e]] + s - att.cu_q_lens[e], s)
  token_order = jnp.zeros((max_tokens,), jnp.int32).at[dest].set(s, mode="drop")
  n_dec = jnp.sum(decode).astype(jnp.int32)
  return FlatInputs(page_indices=att.page_indices[order].reshape(num * width),
                    kv_lens=att.kv_lens[order], cu_q_lens=cu_k,
                    distribution=jnp.stack([n_dec, n_dec, att.num_seqs[0]]),
                    row_order=order, token_order=token_order)


# ---------------------------------------------------------------------------------------
# KV writes.
# ---------------------------------------------------------------------------------------

def _slot_targets(slots: Array, num_tokens: Optional[Array], num_pages: int, ps: int
                  ) -> Tuple[Array, Array]:
  slots = validate.as_i32(slots, "slots")
  if slots.ndim != 1:
    raise ValueError(f"slots must be i32[T], got shape {slots.shape}")
  live = slots >= 0
  if num_tokens is not None:
    live = live & (jnp.arange(slots.shape[0]) < validate.as_i32(num_tokens, "num_tokens"))
  page = jnp.where(live, slots // ps, num_pages)  # num_pages: out of range, dropped
  return page, slots % ps


def write_kv_combined(kv_pages: Array, slots: Array, k: Array, v: Array, *,
                      num_tokens: Optional[Array] = None) -> Array:
  """Writes a step's new K/V into combined pages (JAX's ragged paged attention layout).

  Args:
    kv_pages: f[P, ps, 2 * Hkv, D]; K of head h at index 2h, V at 2h + 1.
    slots: i32[T] each token's slot (from extend_rows / decode_rows).
    k, v: f[T, Hkv, D] the tokens' keys and values.
    num_tokens: optional i32[]; tokens at index >= num_tokens are not written.

  Returns:
    kv_pages with kv_pages[slot // ps, slot % ps] set for each written token. Tokens
    with a negative slot are not written.
  """
  num_pages, ps, heads2, dim = kv_pages.shape
  if k.shape != v.shape or k.ndim != 3 or k.shape[0] != jnp.shape(slots)[0] or (
      2 * k.shape[1] != heads2) or k.shape[2] != dim:
    raise ValueError(f"k and v must be f[T, {heads2 // 2}, {dim}] with T = len(slots), "
                     f"got {k.shape=}, {v.shape=}, slots shape {jnp.shape(slots)}")
  page, off = _slot_targets(slots, num_tokens, num_pages, ps)
  both = jnp.stack([k, v], axis=2).reshape(k.shape[0], heads2, dim).astype(kv_pages.dtype)
  return kv_pages.at[page, off].set(both, mode="drop")


def write_kv_split(k_pages: Array, v_pages: Array, slots: Array, k: Array, v: Array, *,
                   num_tokens: Optional[Array] = None) -> Tuple[Array, Array]:
  """Writes a step's new K/V into split pages (the Pallas decode kernels' layout).

  Args:
    k_pages, v_pages: f[Hkv, P, ps, D].
    slots: i32[T] each token's slot.
    k, v: f[T, Hkv, D].
    num_tokens: optional i32[]; tokens at index >= num_tokens are not written.

  Returns:
    (k_pages, v_pages) with [:, slot // ps, slot % ps] set for each written token.
  """
  heads, num_pages, ps, dim = k_pages.shape
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages and v_pages differ: {k_pages.shape} vs {v_pages.shape}")
  if k.shape != v.shape or k.shape != (jnp.shape(slots)[0], heads, dim):
    raise ValueError(f"k and v must be f[T, {heads}, {dim}] with T = len(slots), got "
                     f"{k.shape=}, {v.shape=}, slots shape {jnp.shape(slots)}")
  page, off = _slot_targets(slots, num_tokens, num_pages, ps)
  kt = jnp.swapaxes(k, 0, 1).astype(k_pages.dtype)
  vt = jnp.swapaxes(v, 0, 1).astype(v_pages.dtype)
  return (k_pages.at[:, page, off].set(kt, mode="drop"),
          v_pages.at[:, page, off].set(vt, mode="drop"))
