"""Tile sizes and warp counts of the Triton kernels, from H200 measurements.

Source: `tests/gpu_check.py` on an NVIDIA H200 (2026-11-30, jax 0.11.2, triton 3.6.0;
benchmarks/results/2026-11-30-h200x2-run3-ranks/machine.txt), alloc_extend_triton timed in the bench harness
(jax_kvalloc.tools.timing: every output consumed, calls linked), page size 64, us/call:

  fused extend          default  (256,1)  (1024,4)  (2048,8)  one-hot: default  8 warps  tile 128
    bs 1,   8k tokens     5.68     5.78     5.61      5.70            9.30      6.78     4.85
    bs 16,  8k tokens     7.04     6.89     7.04      7.60           20.71     13.09    11.43
    bs 64,  33k tokens    7.95     7.76     7.74      8.40           15.85     13.40    16.04
    bs 256, 65k tokens    8.39     8.58     8.92      9.85           44.48     98.18    72.23

The defaults are within the noise of the best (tile, warps) at every size; the one-hot
row search (EXTEND_ONEHOT_MAX_ROWS) wins only at one row. The decode tunings were not
reached in that run. Figures from the earlier loop (which kept one call's outputs and
let XLA drop the rest) were removed. Every configuration is checked bit for bit against
the jnp path (tests/test_pallas_gpu.py); the kernels are correct for any power-of-two
choice.
"""
from __future__ import annotations

from typing import Optional, Tuple

from pallas_kernels._util import next_pow2

EXTEND_WINDOW = 256          # rows per search pass of the fused extend kernel
DECODE_ROW_BLOCK = 2048      # rows per program of the fused decode kernel
CONTRACT_DECODE_ROW_BLOCK = 1024
# Fused decode: up to this many rows per program, the rows' page offsets come from one
# masked [rows, rows] sum instead of a prefix scan. H200 (run 14, kernel GPU time from
# CUPTI, us; SGLang's kernel 1.06 / 1.12 / 1.25 / 1.47): scan 1.02 / 1.15 / 1.25 / 1.28
# at bs 1 / 16 / 64 / 256, masked 1.02 / 1.12 / 1.73 / 6.27 (benchmarks/gpu_profile.py
# --decode-variants: at 16 rows masked 1.15-1.18 against scan 1.18-1.25 over warps).
DECODE_MASKED_PREFIX_MAX_ROWS = 16
# Fused extend: up to this many rows (padded) each token finds its row by a [tile, rows]
# comparison in registers instead of the scratch search (0: never). Tiles then hold
# ONEHOT_WORK / rows tokens, so the comparison stays the same size.
EXTEND_ONEHOT_MAX_ROWS = 0
EXTEND_ONEHOT_WORK = 2**14

# Fused extend layout (alloc_extend_triton; triton_extend's docstring): "rows", a program
# per (row, chunk) with no row search, for EXTEND_ROWS_MIN_ROWS <= rows_pad <=
# EXTEND_ROWS_MAX_ROWS; "tiles" otherwise (and whenever the one-hot search is asked for).
# From the H200 (run 13, 2026-11-30, jax 0.11.2, triton 3.6; page size 64; each kernel's
# own GPU time from CUPTI, median over 2048 launches; benchmarks/extend_layouts_gpu.py and
# `jax-kvalloc bench --bare`), us:
#                          tiles   rows   blocks   SGLang 0.5.23's kernel (same run)
#   1 row,     8k tokens    2.30   1.76     1.70     2.94
#   16 rows,  33k tokens    3.39   1.92     2.05     1.92
#   64 rows,  33k tokens    3.46   1.92       -      2.21
#   256 rows, 65k tokens       -   2.11       -      3.20
#   1024 rows, 65k tokens      -   3.33       -      5.98
# so "rows" from 1 row up; past 1024 rows each of the B or more programs loads all B rows
# (and the allocator takes XLA's prefix sums + the contract kernel past
# extend_fused_preferred). "blocks" was not timed at 64-1024 rows nor on a skewed batch
# (one row of nearly all tokens, where "rows" loops on that row's C programs): the run's
# budget ended first.
EXTEND_ROWS_MIN_ROWS = 1
EXTEND_ROWS_MAX_ROWS = 1024
# The per-row layout the rule returns in that range: "rows" (SGLang's program shape) or
# "blocks" (one block per program whatever the row lengths, for one more prefix scan per
# program and up to B programs that only load the rows).
EXTEND_ROWS_LAYOUT = "rows"
EXTEND_ROWS_BLOCK = (128, 1024)   # bounds of the rows layout's block T (tokens)


def extend_tile_warps(rows_pad: int, out_len: int, fused: bool,
                      onehot: bool = False) -> Tuple[int, int]:
  """(tokens per program, warps) of the extend kernels."""
  if fused and onehot:
    tile = min(next_pow2(out_len), max(64, EXTEND_ONEHOT_WORK // rows_pad))
    return tile, 4
  tile = 512 if fused and rows_pad <= 256 else 1024
  tile = min(next_pow2(out_len), tile)
  warps = max(1, min(8, tile // 256))
  if fused and rows_pad >= 4096:
    warps = 8  # every program holds all rows
  return tile, warps


def decode_warps(rows_pad: int) -> int:
  """Warps of a decode program (it holds min(rows_pad, row block) rows, and in the
  fused kernel all rows once more when there are several programs)."""
  if rows_pad <= 8:
    return 1
  return 4 if rows_pad <= 1024 else 8 if rows_pad <= 4096 else 16


def extend_layout(rows_pad: int, out_len: int) -> str:
  """The fused extend kernel's default layout: EXTEND_ROWS_LAYOUT or "tiles" (above)."""
  del out_len  # the measurement may make the rule depend on tokens per row
  if EXTEND_ROWS_MIN_ROWS <= rows_pad <= EXTEND_ROWS_MAX_ROWS:
    return EXTEND_ROWS_LAYOUT
  return "tiles"


def extend_rows_block(num_rows: int, out_len: int,
                      tile: Optional[int] = None) -> Tuple[int, int, int]:
  """(T tokens per block, C programs per row, warps) of the fused extend kernel's "rows"
  layout (T and warps also of "blocks"). out_len / num_rows is the mean row of a full
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
