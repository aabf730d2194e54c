"""Tile sizes, warp counts and layout rules of the Triton kernels.

The kernels are correct for any power-of-two choice (tests/test_pallas_gpu.py checks
every configuration bit for bit against the jnp path); these defaults are the best or
within the noise of the best of the H200 measurements in benchmarks/results/
(`jax-kvalloc bench kernels --impls fused[...]` times any tuning against the defaults).
"""
from __future__ import annotations

from typing import Optional, Tuple

from pallas_kernels._util import next_pow2

EXTEND_WINDOW = 256          # rows per search pass of the fused extend kernel
DECODE_ROW_BLOCK = 2048      # rows per program of the fused decode kernel
CONTRACT_DECODE_ROW_BLOCK = 1024
# Fused decode: up to this many rows per program, the rows' page offsets come from one
# masked [rows, rows] sum instead of a prefix scan (faster for small blocks, slower from
# 64 rows on the H200).
DECODE_MASKED_PREFIX_MAX_ROWS = 16
# Fused extend layout (alloc_extend_triton; triton_extend's docstring): "rows", a program
# per (row, chunk) with no row search, for EXTEND_ROWS_MIN_ROWS <= rows_pad <=
# EXTEND_ROWS_MAX_ROWS; "tiles" beyond, where each of the B or more programs of "rows"
# would load all B rows (and the allocator takes XLA's prefix sums + the contract kernel
# past extend_fused_preferred).
EXTEND_ROWS_MIN_ROWS = 1
EXTEND_ROWS_MAX_ROWS = 1024
EXTEND_ROWS_BLOCK = (128, 1024)   # bounds of the rows layout's block T (tokens)


def extend_tile_warps(rows_pad: int, out_len: int, fused: bool) -> Tuple[int, int]:
  """(tokens per program, warps) of the extend kernels' "tiles" layout and of the
  contract kernel."""
  tile = 512 if fused and rows_pad <= 256 else 1024
  tile = min(next_pow2(out_len), tile)
  warps = max(1, min(8, tile // 256))
  if fused and rows_pad >= 4096:
    warps = 8  # every program holds all rows
  return tile, warps


def decode_warps(rows_pad: int) -> int:
  """Warps of a decode program (it holds min(rows_pad, row block) rows, and in the
  fused kernel all rows once more when there are several programs)."""
  # Two warps, not one, for the smallest blocks: benchmarks/results/2026-12-01-h200-checks
  # (decode-variants.json).
  if rows_pad <= 8:
    return 2
  return 4 if rows_pad <= 1024 else 8 if rows_pad <= 4096 else 16


def table_warps(lanes: int) -> int:
  """Warps of a one-program table kernel (the request table's step and its borrows),
  from its widest phase's lanes / 4: decode_warps', but 8 from 513 on (16 rows x 256
  columns run faster on 8 than on 4: benchmarks/results/2026-12-02-h200-sim-warps)."""
  return 8 if 512 < lanes <= 4096 else decode_warps(lanes)


def extend_layout(rows_pad: int, out_len: int) -> str:
  """The fused extend kernel's default layout: "rows" or "tiles" (above)."""
  del out_len  # the rule depends on the rows alone
  if EXTEND_ROWS_MIN_ROWS <= rows_pad <= EXTEND_ROWS_MAX_ROWS:
    return "rows"
  return "tiles"


def extend_rows_block(num_rows: int, out_len: int,
                      tile: Optional[int] = None) -> Tuple[int, int, int]:
  """(T tokens per block, C programs per row, warps) of the fused extend kernel's "rows"
  layout. out_len / num_rows is the mean row of a full
  batch. T (unless given) is twice the mean as a power of two in EXTEND_ROWS_BLOCK, so
  a row of up to twice the mean is one block; where twice the mean is longer than T, C
  programs share each row so that it still takes one block per program (C * T covers
  min(2 * mean, out_len)). Programs whose chunk starts past their row's end (short
  rows) only load the rows."""
  lo, hi = EXTEND_ROWS_BLOCK
  span = min(2 * -(-out_len // num_rows), out_len)
  if tile is None:
    tile = min(max(next_pow2(span), lo), hi, next_pow2(out_len))
  chunks = max(1, -(-span // tile))
  warps = max(1, min(8, max(tile, next_pow2(num_rows)) // 256))
  return tile, chunks, warps
