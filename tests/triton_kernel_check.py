"""Checks torch_ref's Triton kernels against the plain-torch path and the independent model
on random batches. Run as a script (tests/test_parity.py runs it in a subprocess with
TRITON_INTERPRET=1 on CPU; on a GPU run it with --device cuda). Prints OK or raises.

Covers: every page size shape (1, 2, 4, 16, 64), batches up to 40 rows (several
power-of-two blocks), extends longer than one kernel loop block (> 1024 slots), rows that
extend by zero, prefixes ending mid-page, decode at page starts, and free lists that are
exactly as long as needed or shorter, where every missing page must read as page 0
rather than out of bounds.
"""
import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import cdiv  # noqa: E402  pylint: disable=g-import-not-at-top
from model import ModelAllocator  # noqa: E402  pylint: disable=g-import-not-at-top
from torch_ref import index_torch  # noqa: E402  pylint: disable=g-import-not-at-top
from torch_ref import triton_kernels as tk  # noqa: E402  pylint: disable=g-import-not-at-top


def _model(pages, ps):
  m = ModelAllocator(10**6 * ps, ps, False, "paged")
  m.free_pages = list(pages)
  return m


def check(rng, dev, trial):
  ps = rng.choice([1, 2, 4, 16, 64])
  bs = rng.choice([1, 2, 3, rng.randint(4, 17), rng.randint(18, 40)])
  long = rng.random() < 0.2
  pre = [rng.choice([0, rng.randint(0, 300)]) for _ in range(bs)]
  seq = [p + rng.choice([0, rng.randint(1, 2500 if long else 200)]) for p in pre]
  last = [-1 if p == 0 else (50_000 + i) * ps + (p - 1) % ps for i, p in enumerate(pre)]
  need = sum(cdiv(s, ps) - cdiv(p, ps) for p, s in zip(pre, seq))
  pages = rng.sample(range(1, 40_000), need + rng.choice([0, 0, 3]))
  want = _model(pages, ps).alloc_extend(pre, seq, last)
  t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)
  fp = t(pages)
  total = sum(s - p for p, s in zip(pre, seq))
  got = tk.extend_indices(t(pre), t(seq), t(last), fp, page_size=ps,
                          extend_num_tokens=total).tolist()
  ref = index_torch.extend_indices(pre, seq, last, fp, page_size=ps).tolist()
  assert got == want == ref, f"extend trial {trial}: ps={ps} pre={pre} seq={seq}"
  if need:
    # One page short: the kernel must not read past the list; the last page reads as 0.
    short = tk.extend_indices(t(pre), t(seq), t(last), t(pages[: need - 1]), page_size=ps,
                              extend_num_tokens=total).tolist()
    gone = pages[need - 1]
    assert short == [x % ps if x // ps == gone else x for x in want], (
        f"short extend trial {trial}")

  dseq = [rng.randint(1, 300) for _ in range(bs)]
  dlast = [(60_000 + i) * ps + (s - 2) % ps for i, s in enumerate(dseq)]
  need = sum(cdiv(s, ps) > cdiv(s - 1, ps) for s in dseq)
  pages = rng.sample(range(1, 40_000), need + rng.choice([0, 2]))
  want = _model(pages, ps).alloc_decode(dseq, dlast)
  got = tk.decode_indices(t(dseq), t(dlast), t(pages), page_size=ps).tolist()
  ref = index_torch.decode_indices(dseq, t(dlast), t(pages), page_size=ps).tolist()
  assert got == want == ref, f"decode trial {trial}: ps={ps} seq={dseq}"
  if need:
    short = tk.decode_indices(t(dseq), t(dlast), t(pages[: need - 1]), page_size=ps).tolist()
    gone = pages[need - 1] * ps
    assert short == [0 if x == gone else x for x in want], f"short decode trial {trial}"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--device", default="cpu")
  p.add_argument("--trials", type=int, default=40)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 on cpu")
  rng = random.Random(args.seed)
  for trial in range(args.trials):
    check(rng, torch.device(args.device), trial)
  # An empty free list: decode rows inside their pages launch with no page to read.
  out = tk.decode_indices(torch.tensor([3, 7]), torch.tensor([5, 9]),
                          torch.zeros((0,), dtype=torch.int64), page_size=4).tolist()
  assert out == [6, 10], out
  print(f"OK: {args.trials} random extend/decode batches")


if __name__ == "__main__":
  main()
