"""alloc_extend / alloc_decode slot indices on TPU: a Pallas kernel through Mosaic.

Reference: jax_kvalloc.index_jnp.extend_indices / decode_indices (the contract, SPEC 4.2
and 4.3). Mosaic's rules shape the kernel: int32 only, no
vector gather or scatter, no in-kernel cumsum, scalars only in SMEM, vectors only in VMEM,
blocks of (8, 128). So:

- The prefix sums come from the caller (the contract's tok_start/page_start); the wrapper
  adds, with plain XLA, each tile's first row (`searchsorted`) and the total. All per-row
  arrays travel as scalar prefetch (SMEM).
- Output-stationary tiling: grid step i owns the (8, 128) int32 output tile of tokens
  [1024 i, 1024 i + 1024), one vector register. It walks the rows that overlap the tile
  and writes each piece with a whole-tile `jnp.where` select::

    Part 1 (the prefix's page): one select, slot = t + (last_loc + 1 - tok_start);
    each new page g of the row that the tile touches: one select,
      slot = t + (free[k] * ps + A - (fnp + g) * ps), k = page_start + g, A = pre - tok_start.

  No masks, no scatter, one full vector store per tile.
- The free-list window stays in HBM. A tile's tokens use at most 1024 consecutive window
  entries (every page it touches holds one of its tokens), starting at the page of its
  first token, so one DMA of 1024 entries into SMEM per tile serves all its reads. The
  window is edge-padded by 1024 entries, so the DMA never leaves it and a page index past
  the window reads its last entry, exactly the contract's clamped read.
- Decode is extend with one token per row: prefix_lens = seq - 1, tok_start = row index.

Grid steps are independent ("parallel": megacore may split them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _util
from pallas_kernels._util import cdiv, floordiv

Array = jax.Array

SUBLANES, LANES = 8, 128
TILE = SUBLANES * LANES      # tokens per grid step (one int32 vreg)
_NUM_PREFETCH = 7


# ---------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------

def _extend_kernel(
    # Prefetch (SMEM)
    pre_ref,        # i32[B] prefix_lens
    seq_ref,        # i32[B] seq_lens
    last_ref,       # i32[B] last_loc
    ts_ref,         # i32[B] tok_start
    pst_ref,        # i32[B] page_start
    tile_row_ref,   # i32[G] first row overlapping each tile
    total_ref,      # i32[1] total tokens (tok_start[-1] + ext[-1])
    # Input
    win_hbm,        # i32[P + TILE] free window, edge-padded (HBM)
    # Output
    out_ref,        # i32[8, 128] this tile (VMEM)
    # Scratch
    win_smem,       # i32[TILE] the window entries this tile may read (SMEM)
    sem,            # DMA semaphore
    *, num_rows: int, page_size: int, win_len: int):
  ps = page_size
  i = pl.program_id(0)
  t0 = i * TILE
  total = total_ref[0]
  t_end = jnp.minimum(t0 + TILE, total)
  t = (t0 + lax.broadcasted_iota(jnp.int32, (SUBLANES, LANES), 0) * LANES
       + lax.broadcasted_iota(jnp.int32, (SUBLANES, LANES), 1))

  # The first window entry the tile can need: the page of its first token (or the first
  # new page of its first row, if that token lies in Part 1).
  r0 = tile_row_ref[i]
  pre0 = pre_ref[r0]
  fnp0 = cdiv(pre0, ps)
  k_lo = pst_ref[r0] + jnp.maximum(floordiv(pre0 + t0 - ts_ref[r0], ps) - fnp0, 0)
  k_lo = jnp.clip(k_lo, 0, win_len)
  copy = pltpu.make_async_copy(win_hbm.at[pl.ds(k_lo, TILE)], win_smem, sem)
  copy.start()
  copy.wait()

  def row_cond(carry):
    r, _ = carry
    return (r < num_rows) & (ts_ref[jnp.minimum(r, num_rows - 1)] < t_end)

  def row_body(carry):
    r, acc = carry
    pre = pre_ref[r]
    seq = seq_ref[r]
    ts = ts_ref[r]
    te = ts + (seq - pre)
    fnp = cdiv(pre, ps)
    a = pre - ts
    n1 = jnp.minimum(seq, fnp * ps) - pre
    acc = jnp.where((t >= ts) & (t < ts + n1), t + (last_ref[r] + 1 - ts), acc)
    lo = jnp.maximum(ts + n1, t0)
    hi = jnp.minimum(te, t_end)
    g_lo = floordiv(lo + a, ps) - fnp
    g_hi = jnp.where(lo < hi, floordiv(hi - 1 + a, ps) - fnp + 1, g_lo)
    page0 = pst_ref[r]

    def page_body(g, acc):
      k = page0 + g
      v = win_smem[jnp.clip(k - k_lo, 0, TILE - 1)]
      first = (fnp + g) * ps - a           # first token of page g
      mask = (t >= first) & (t < first + ps) & (t < te)
      return jnp.where(mask, t + (v * ps - first), acc)

    acc = lax.fori_loop(g_lo, g_hi, page_body, acc)
    return r + 1, acc

  acc = jnp.zeros((SUBLANES, LANES), jnp.int32)
  _, acc = lax.while_loop(row_cond, row_body, (r0, acc))
  out_ref[...] = jnp.where(t < total, acc, 0)


# ---------------------------------------------------------------------------------------
# Grid, specs and wrappers.
# ---------------------------------------------------------------------------------------

def _extend_call(num_rows: int, page_size: int, win_len: int, grid: int, interpret):
  kernel = functools.partial(_extend_kernel, num_rows=num_rows, page_size=page_size,
                             win_len=win_len)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=_NUM_PREFETCH,
      grid=(grid,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((SUBLANES, LANES), lambda i, *_: (i, 0)),
      scratch_shapes=[pltpu.SMEM((TILE,), jnp.int32), pltpu.SemaphoreType.DMA],
  )
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((grid * SUBLANES, LANES), jnp.int32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="jax_kvalloc_extend_indices_mosaic",
  )


def extend_indices_mosaic(free_window: Array, prefix_lens: Array, seq_lens: Array,
                          last_loc: Array, tok_start: Array, page_start: Array, *,
                          page_size: int, out_len: int, interpret=False) -> Array:
  """index_jnp.extend_indices (same arguments, same i32[out_len] result) on TPU.

  interpret: False, True (Pallas' HLO interpreter) or a pltpu.InterpretParams (the TPU
  interpreter, which also checks every DMA and SMEM read for out-of-bounds accesses).
  TypeError naming the argument for a non-integer dtype.
  """
  args, trivial = _util.extend_contract_args(out_len, free_window, prefix_lens, seq_lens,
                                             last_loc, tok_start, page_start)
  if trivial is not None:
    return trivial
  free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start = args
  b = prefix_lens.shape[0]
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  pre, seq, last, ts, pst = map(i32, (prefix_lens, seq_lens, last_loc, tok_start,
                                      page_start))
  win = i32(free_window)
  p = win.shape[0]
  grid = pl.cdiv(out_len, TILE)
  tok_end = ts + (seq - pre)
  tile_start = jnp.arange(grid, dtype=jnp.int32) * TILE
  tile_row = jnp.minimum(  # unrolled: fused, not a while loop of small launches
      jnp.searchsorted(tok_end, tile_start, side="right", method="scan_unrolled"), b - 1)
  total = tok_end[-1:]
  if p == 0:  # nothing to read; any page reads as 0 (never used by a valid call)
    win = jnp.zeros((1,), jnp.int32)
    p = 1
  win = jnp.pad(win, (0, TILE), mode="edge")
  out = _extend_call(b, page_size, p, grid, interpret)(
      pre, seq, last, ts, pst, tile_row.astype(jnp.int32), total, win)
  return out.reshape(-1)[:out_len]


def decode_indices_mosaic(free_window: Array, seq_lens: Array, last_loc: Array,
                          page_start: Array, *, page_size: int, interpret=False) -> Array:
  """index_jnp.decode_indices (same arguments, same i32[B] result) on TPU: the extend
  kernel with one token per row (prefix_lens = seq_lens - 1, tok_start = row index).
  TypeError naming the argument for a non-integer dtype."""
  free_window, seq_lens, last_loc, page_start = _util.check_ints(
      free_window=free_window, seq_lens=seq_lens, last_loc=last_loc, page_start=page_start)
  b = seq_lens.shape[0]
  seq = jnp.asarray(seq_lens, jnp.int32)
  rows = jnp.arange(b, dtype=jnp.int32)
  return extend_indices_mosaic(free_window, seq - 1, seq, last_loc, rows, page_start,
                               page_size=page_size, out_len=b, interpret=interpret)
