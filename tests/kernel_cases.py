"""Random inputs for checking the kernels (CPU tests and the GPU check share them).

Every generator returns host numpy int32 arrays that satisfy the kernel contract
(index_jnp): prefix sums consistent with the lengths, last_loc aligned with prefix_lens
(SPEC 4.2/4.3), windows laid out as allocation.py builds them (free pages first, 0 past
the free length). Each draws the cases that break index code: zero-extension rows,
prefix 0, page-aligned and mid-page prefixes, padded rows, one row holding everything,
pools used up exactly and pools one page short.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

PAGE_SIZES = (1, 2, 4, 16, 64, 128)


def cdiv(a, b):
  return -(-a // b)


def _pick(rng, weights: Dict[str, float]) -> str:
  names = list(weights)
  p = np.array([weights[k] for k in names], float)
  return names[rng.choice(len(names), p=p / p.sum())]


def extend_rows(rng: np.random.Generator, page_size: int, rows: int, out_len: int):
  """(prefix_lens, seq_lens, last_loc, num_reqs) for one extend batch of `rows` rows with
  at most out_len new tokens in all; rows >= num_reqs are padding (0, 0, -1)."""
  ps = page_size
  num_reqs = int(rng.integers(1, rows + 1)) if rng.random() < 0.6 else rows
  shape = _pick(rng, {"spread": 4, "one_big": 1, "tiny": 1, "empty_rows": 1})
  budget = int(rng.integers(0, out_len + 1)) if rng.random() < 0.8 else out_len
  if shape == "one_big":
    ext = np.zeros(num_reqs, np.int64)
    ext[rng.integers(num_reqs)] = budget
  else:
    cuts = np.sort(rng.integers(0, budget + 1, num_reqs - 1))
    ext = np.diff(np.concatenate([[0], cuts, [budget]]))
    if shape == "tiny":
      ext = np.minimum(ext, rng.integers(0, 3, num_reqs))
    if shape == "empty_rows":
      ext[rng.random(num_reqs) < 0.5] = 0
  pre_kind = rng.integers(0, 3, num_reqs)   # 0: no prefix, 1: page-aligned, 2: mid-page
  pre = np.where(pre_kind == 0, 0, rng.integers(0, 40, num_reqs) * ps)
  pre = np.where(pre_kind == 2, pre + rng.integers(1, max(ps, 2), num_reqs), pre)
  if ps == 1:
    pre = np.where(pre_kind == 2, pre + rng.integers(0, 5, num_reqs), pre)
  seq = pre + ext
  # The prefix's last token lives in some page of its own: slot = page * ps + offset.
  last = np.where(pre > 0, rng.integers(1, 5000, num_reqs) * ps + (pre - 1) % ps, -1)
  pad = rows - num_reqs
  return (np.concatenate([pre, np.zeros(pad, np.int64)]).astype(np.int32),
          np.concatenate([seq, np.zeros(pad, np.int64)]).astype(np.int32),
          np.concatenate([last, np.full(pad, -1)]).astype(np.int32),
          np.int32(num_reqs))


def decode_rows(rng: np.random.Generator, page_size: int, rows: int):
  """(seq_lens, last_loc, num_reqs) for one decode batch; padded rows have seq 0."""
  ps = page_size
  num_reqs = int(rng.integers(1, rows + 1)) if rng.random() < 0.6 else rows
  seq = rng.integers(1, 60, num_reqs) * ps + rng.integers(0, ps, num_reqs) + 1
  starts = rng.random(num_reqs) < 0.4            # new token opens a page: seq % ps == 1
  seq = np.where(starts, (seq // ps) * ps + 1, seq)
  seq = np.where(rng.random(num_reqs) < 0.1, 1, seq)    # the request's first token
  last = np.where(seq > 1, rng.integers(1, 5000, num_reqs) * ps + (seq - 2) % ps, -1)
  pad = rows - num_reqs
  return (np.concatenate([seq, np.zeros(pad, np.int64)]).astype(np.int32),
          np.concatenate([last, np.full(pad, -1)]).astype(np.int32), np.int32(num_reqs))


def pool(rng: np.random.Generator, num_pages: int, need: int):
  """(free_ring i32[num_pages], free_head, free_len): a shuffled ring whose length is,
  relative to `need` pages, plenty, exactly enough, one page short, or empty."""
  ring = (rng.permutation(num_pages) + 1).astype(np.int32)
  head = np.int32(rng.integers(0, num_pages))
  kind = _pick(rng, {"plenty": 3, "exact": 2, "short": 2, "empty": 0.3})
  length = {"plenty": rng.integers(need, num_pages + 1) if need <= num_pages else num_pages,
            "exact": need, "short": need - 1, "empty": 0}[kind]
  return ring, head, np.int32(np.clip(length, 0, num_pages))


def window(ring, head, length, n: int) -> np.ndarray:
  """state.ring_window in numpy: the first n free pages in order, 0 past `length`."""
  i = np.arange(n)
  vals = ring[(int(head) + i) % ring.shape[0]]
  return np.where(i < length, vals, 0).astype(np.int32)


def extend_contract_case(rng: np.random.Generator, page_size: int, rows: int,
                         out_len: int, window_len: int):
  """One random batch for index_jnp.extend_indices: (args, info). args = (free_window,
  prefix_lens, seq_lens, last_loc, tok_start, page_start), padded rows zeroed as
  allocation.alloc_extend zeroes them; info = {"pages": pages needed, "free": pages in
  the window (the rest is 0), "num_reqs", "tokens"}."""
  pre, seq, last, num_reqs = extend_rows(rng, page_size, rows, out_len)
  ext = (seq - pre).astype(np.int64)
  new_pages = cdiv(seq.astype(np.int64), page_size) - cdiv(pre.astype(np.int64), page_size)
  tok_start = (np.cumsum(ext) - ext).astype(np.int32)
  page_start = (np.cumsum(new_pages) - new_pages).astype(np.int32)
  pages = int(new_pages.sum())
  ring, head, length = pool(rng, max(window_len, 1), pages)
  win = window(ring, head, length, window_len)
  info = dict(pages=pages, free=int(length), num_reqs=int(num_reqs), tokens=int(ext.sum()))
  return (win, pre, seq, last, tok_start, page_start), info


def decode_contract_case(rng: np.random.Generator, page_size: int, rows: int,
                         window_len: int):
  """One random batch for index_jnp.decode_indices, as allocation.alloc_decode passes it
  (padded rows: seq 0 and no page): (args, info), args = (free_window, seq_lens,
  last_loc, page_start), info as for extend_contract_case."""
  seq, last, num_reqs = decode_rows(rng, page_size, rows)
  real = np.arange(rows) < num_reqs
  needs = (real & (cdiv(seq, page_size) > cdiv(seq - 1, page_size))).astype(np.int64)
  page_start = (np.cumsum(needs) - needs).astype(np.int32)
  pages = int(needs.sum())
  ring, head, length = pool(rng, max(window_len, 1), pages)
  info = dict(pages=pages, free=int(length), num_reqs=int(num_reqs))
  return (window(ring, head, length, window_len), seq, last, page_start), info


def stack(cases):
  """Stacks equal-structure tuples of arrays along a new leading axis (for vmap)."""
  return tuple(np.stack([np.asarray(c[i]) for c in cases]) for i in range(len(cases[0])))
