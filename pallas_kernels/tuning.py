"""Tile sizes and warp counts of the Triton kernels, from H200 measurements.

Source: `python -m pallas_kernels.gpu_check` on an NVIDIA H200, jax 0.11.2, triton 3.6.0,
2026-11-30 (whole jitted alloc calls, fori_loop of 32 dependent calls, slope; us/call,
the loop's floor of 1.09 us/call included; page_size 16):

  fused extend (tile, warps)  (256, 1)  (512, 2)  (1024, 4)  (2048, 8)
    bs 1,    8k tokens          2.70      2.56      2.73       2.73
    bs 16,   65k tokens         3.70      3.93        -        4.56
    bs 256,  65k tokens         5.22      4.72      5.58       6.14
    bs 1024, 65k tokens        10.01      7.27      6.83       6.62
  fused decode warps            1         2         4
    bs 1                        1.43      1.51      1.49
    bs 64                       1.69      1.70      1.66
    bs 256                      3.53      1.85      1.70
  fused decode bs 16384 (row block, warps): (2048, 16) 4.54, (4096, 8) 11.61,
    (16384, 16) 14.73.

Every configuration in the table was checked bit for bit against the jnp path on the
H200 (tests/test_pallas_gpu.py); the kernels are correct for any power-of-two choice.

Whole-call times with the defaults of that run (extend tile 1024 / 4 warps, decode 1 warp
up to 256 rows; the choices below replace those where the table says so), us/call:

  decode  bs        1     64    256   1024   4096  16384
          ps 16   1.43  1.69  3.53*  2.75   3.77   4.54     (* 1.70 with 4 warps)
          ps 1    1.42  1.70  3.99*  2.47   3.71   6.54
  extend  bs/tok  1/8k  1/65k  16/8k  64/65k  256/8k  256/65k  1024/65k
          ps 16   2.73  2.70   4.21   4.30    7.15    5.58     6.83
          ps 1    2.50  2.53   4.02   4.09    7.31    5.37     6.45

That run's extend rows for 4096 and 16384 requests (262k tokens; the contract path) are
not valid: the kernel's only output was unused and XLA pruned it (gpu_check now folds it
into a sink). Its jnp-path numbers are lower bounds: XLA fuses across the chained calls.
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
