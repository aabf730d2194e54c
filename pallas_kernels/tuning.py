"""Tile sizes and warp counts of the Triton kernels, from H200 measurements.

Source: `tests/gpu_check.py` on an NVIDIA H200 (2026-11-30, jax 0.11.2, triton 3.6.0;
benchmarks/h200_machine.txt), alloc_extend_triton timed in the bench harness
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

from typing import Tuple

from pallas_kernels._util import next_pow2

EXTEND_WINDOW = 256          # rows per search pass of the fused extend kernel
DECODE_ROW_BLOCK = 2048      # rows per program of the fused decode kernel
CONTRACT_DECODE_ROW_BLOCK = 1024
# Fused extend: up to this many rows (padded) each token finds its row by a [tile, rows]
# comparison in registers instead of the scratch search (0: never). Tiles then hold
# ONEHOT_WORK / rows tokens, so the comparison stays the same size.
EXTEND_ONEHOT_MAX_ROWS = 0
EXTEND_ONEHOT_WORK = 2**14


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
