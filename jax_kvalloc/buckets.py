"""Shape buckets: how the SGLang-compatible classes pad run-time sizes to static shapes.

A jitted function compiles once per input shape. Batch sizes, extend token counts and
free lengths vary every step, so each is padded up to the next power of two (with a
floor), and the real count travels as a traced value. A serving loop therefore compiles
at most log2(largest / floor) + 1 variants of each operation, and never again once warm:
batch sizes 1..8 share one compile, 9..16 the next, and so on.

Padding values are chosen to be inert: padded requests have prefix_lens = seq_lens = 0 and
are masked by `num_reqs`; padded free entries are 0 (slot 0 lies in the reserved page 0,
which `free` ignores); padded outputs are 0.
"""
from __future__ import annotations

import numpy as np

MIN_BATCH = 8        # smallest batch bucket (rows)
MIN_TOKENS = 64      # smallest extend / alloc bucket (slots)
MIN_FREE = 64        # smallest free bucket (indices)


def bucket(n: int, minimum: int) -> int:
  """The smallest power of two that is >= max(n, minimum)."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


def pad(x: np.ndarray, length: int, fill: int = 0) -> np.ndarray:
  """x (1-D) padded with `fill` to `length` entries, as int32."""
  out = np.full((length,), fill, np.int32)
  out[: x.shape[0]] = x
  return out
