"""Where a layer's K/V live and how attention reads them: a paged pool addressed only
through the request table's slots and page lists, or a contiguous cache per row (the
baseline that paging must match, bit for bit on CPU).

Layouts (per layer, a (k, v) pair)::

  paged       f[Hkv, num_pages + 1, ps, Dh] each (page 0 reserved, never written): the
              layout of jax.experimental.pallas.ops.gpu.paged_attention.
  contiguous  f[Hkv, rows, max_len, Dh] each: row r's token j at [:, r, j].

Attention implementations (`impl`)::

  gather  every row's keys gathered into [B, L, Hkv, Dh] (through its page list, or its
          row of the contiguous cache) and jax_kvalloc.serve.llama.attend: the same math
          for both layouts, so the two runs' logits are identical.
  pallas  decode steps (C == 1) through Pallas' GPU paged_attention (Triton; its
          interpreter off a GPU); prefill steps gather. The contiguous layout runs the
          same kernel over its rows viewed as consecutive pages.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc.serve import llama
from jax_kvalloc.serve.loader import LlamaConfig

Array = jax.Array
IMPLS = ("gather", "pallas")
LAYOUTS = ("paged", "contiguous")


class StepAddress(NamedTuple):
  """Where a step's tokens go and what each row reads (built inside the jitted step)."""
  q_pos: Array         # i32[B, C] each query token's position in its row
  valid: Array         # bool[B, C] real tokens (padding writes nothing)
  kv_len: Array        # i32[B] tokens in each row's cache after this step (0: padding)
  slots: Array         # i32[B, C] paged: each token's slot (ignored where not valid)
  page_indices: Array  # i32[B, W] paged: each row's pages, 0 past its end
  rows: Array          # i32[B] contiguous: each entry's row of the cache


def init_caches(cfg: LlamaConfig, layout: str, *, dtype, layers: str, num_pages: int = 0,
                page_size: int = 0, rows: int = 0, max_len: int = 0) -> Any:
  """Zeroed per-layer (k, v) caches, stacked (layers='scan') or a list ('unroll')."""
  if layout == "paged":
    shape = (cfg.num_kv_heads, num_pages + 1, page_size, cfg.head_dim)
  elif layout == "contiguous":
    shape = (cfg.num_kv_heads, rows, max_len, cfg.head_dim)
  else:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if layers == "scan":
    full = (cfg.num_layers,) + shape
    return (jnp.zeros(full, dtype), jnp.zeros(full, dtype))
  return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def _write_paged(cache: Tuple[Array, Array], addr: StepAddress, k: Array, v: Array):
  kp, vp = cache
  num_pages, ps = kp.shape[1], kp.shape[2]
  page = jnp.where(addr.valid, addr.slots // ps, num_pages)      # out of range: dropped
  off = addr.slots % ps
  kt = jnp.moveaxis(k, 2, 0).astype(kp.dtype)                       # [Hkv, B, C, Dh]
  vt = jnp.moveaxis(v, 2, 0).astype(vp.dtype)
  return (kp.at[:, page, off].set(kt, mode="drop"), vp.at[:, page, off].set(vt, mode="drop"))


def _write_contiguous(cache: Tuple[Array, Array], addr: StepAddress, k: Array, v: Array):
  kc, vc = cache
  rows = jnp.where(addr.valid, addr.rows[:, None], kc.shape[1])   # out of range: dropped
  kt = jnp.moveaxis(k, 2, 0).astype(kc.dtype)
  vt = jnp.moveaxis(v, 2, 0).astype(vc.dtype)
  return (kc.at[:, rows, addr.q_pos].set(kt, mode="drop"),
          vc.at[:, rows, addr.q_pos].set(vt, mode="drop"))


def _gather_paged(x: Array, addr: StepAddress) -> Array:
  """[Hkv, P, ps, Dh] -> each row's tokens [B, W * ps, Hkv, Dh]."""
  g = x[:, addr.page_indices]                                       # [Hkv, B, W, ps, Dh]
  h, b, w, ps, dh = g.shape
  return jnp.moveaxis(g.reshape(h, b, w * ps, dh), 0, 2)


def _gather_contiguous(x: Array, addr: StepAddress) -> Array:
  """[Hkv, R, L, Dh] -> the entries' rows [B, L, Hkv, Dh]."""
  return jnp.moveaxis(x[:, addr.rows], 0, 2)


def pallas_blocks(width: int, page_size: int) -> Tuple[int, int, int]:
  """(table width, pages per compute block, k_splits) for Pallas' GPU paged_attention.

  Triton wants power-of-two blocks of >= 16 keys: the width is the next power of two of
  `width`, a compute block holds 64 tokens (or the whole table), and each of the k_splits
  programs of a row and KV head loops over up to 4 blocks."""
  w = 1 << (max(width, 1) - 1).bit_length()
  block = min(w, 1 << (max(1, -(-64 // page_size)) - 1).bit_length())
  return w, block, max(1, w // (4 * block))


def pallas_decode(q: Array, kp: Array, vp: Array, tables: Array, kv_len: Array, *,
                  interpret: Optional[bool] = None) -> Array:
  """Decode attention through jax.experimental.pallas.ops.gpu.paged_attention.

  Args:
    q: f[B, 1, Hq, Dh] one query token per row (unscaled).
    kp, vp: f[Hkv, P, ps, Dh] pages.
    tables: i32[B, W] each row's pages (padded here to a power of two).
    kv_len: i32[B] tokens per row (0: a padding row).
    interpret: Pallas' interpreter (default: off a GPU).

  Returns:
    f[B, 1, Hq, Dh].
  """
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa  # pylint: disable=g-import-not-at-top
  b, _, hq, dh = q.shape
  width, block, splits = pallas_blocks(tables.shape[1], kp.shape[2])
  tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
  # dh ** -0.5 folded into q (exact for a power-of-4 head dim such as 64). Padding rows
  # read one token of page 0 (zeros) instead of none, which would give NaN.
  o = gpu_pa.paged_attention(q[:, 0] * jnp.asarray(dh ** -0.5, q.dtype), kp, vp, tables,
                             jnp.maximum(kv_len, 1), pages_per_compute_block=block,
                             k_splits=splits,
                             interpret=(jax.default_backend() != "gpu" if interpret is None
                                        else interpret))
  return o.reshape(b, 1, hq, dh)


def write_and_gather(layout: str, cache: Tuple[Array, Array], addr: StepAddress, k: Array,
                     v: Array) -> Tuple[Tuple[Array, Array], Array, Array]:
  """Writes a step's k, v f[B, C, Hkv, Dh] into one layer's cache (at the table's slots,
  or each row's positions), then reads every entry's row back.

  Returns (cache, keys, values), keys and values f[B, L, Hkv, Dh] with row b's token j at
  [b, j] (L: the table width times ps, or max_len); entries past kv_len hold anything."""
  paged = layout == "paged"
  cache = (_write_paged if paged else _write_contiguous)(cache, addr, k, v)
  gather = _gather_paged if paged else _gather_contiguous
  return cache, gather(cache[0], addr), gather(cache[1], addr)


def attention_fn(layout: str, impl: str, addr: StepAddress) -> llama.Attention:
  """The Attention of jax_kvalloc.serve.llama for one step: writes the step's K/V into a
  layer's cache, then attends over it."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  paged = layout == "paged"
  write = _write_paged if paged else _write_contiguous
  gather = _gather_paged if paged else _gather_contiguous

  def attention(cache, q, k, v):
    cache = write(cache, addr, k, v)
    kc, vc = cache
    if impl == "pallas" and q.shape[1] == 1:
      if paged:
        tables, kp, vp = addr.page_indices, kc, vc
      else:  # row r's cache as pages r * W .. r * W + W - 1 of ps = 16 tokens
        h, r, length, dh = kc.shape
        ps = 16 if length % 16 == 0 else length
        w = length // ps
        kp, vp = kc.reshape(h, r * w, ps, dh), vc.reshape(h, r * w, ps, dh)
        tables = addr.rows[:, None] * w + jnp.arange(w, dtype=jnp.int32)[None, :]
      return cache, pallas_decode(q, kp, vp, tables, addr.kv_len)
    # The barrier materializes the gathered keys, so that the attention's dots see the
    # same operands, laid out alike, whichever layout they came from.
    keys, values = jax.lax.optimization_barrier((gather(kc, addr), gather(vc, addr)))
    o = llama.attend(q, keys, values, addr.q_pos, addr.kv_len)
    return cache, o

  return attention


def cache_bytes(caches: Any) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(caches))
