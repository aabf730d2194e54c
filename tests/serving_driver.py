"""A seeded random serving workload, applied step by step to an implementation and to the
independent model (tests/model.py), comparing every returned index and the full lists.

The workload keeps a set of live requests (their slots, token by token) so that every
operation is one a scheduler would issue: new requests prefill (prefix 0), running ones
prefill another chunk (mid-page prefixes) or decode, speculative rows extend by zero, some
finish and are freed (sometimes inside a free group), raw `alloc`s come and go, snapshots
are taken and restored, merges are requested. Pools are small, so they run out.
"""
from __future__ import annotations

import numpy as np

from model import ModelAllocator


class Mismatch(AssertionError):
  pass


def _check(step, op, got, want):
  if want is None or got is None:
    if not (want is None and got is None):
      raise Mismatch(f"step {step} {op}: expected {want}, got {got}")
    return
  got = [int(x) for x in np.asarray(got).reshape(-1)]
  if got != list(want):
    i = next((k for k, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    raise Mismatch(f"step {step} {op}: first difference at index {i}: "
                   f"got {got[i:i + 4]}, expected {list(want)[i:i + 4]} "
                   f"(lengths {len(got)} vs {len(want)})")


def run_workload(impl, *, size, page_size, need_sort, kind, steps, seed,
                 max_batch=6, max_chunk=None):
  """Drives `impl` (SGLang-style methods) and the model through `steps` random steps.

  Raises Mismatch naming the step and the first differing index. Returns op counts.
  """
  rng = np.random.default_rng(seed)
  ps = page_size
  model = ModelAllocator(size, ps, need_sort, kind)
  max_chunk = max_chunk or 3 * ps + 2
  reqs = []           # live requests: list of slot lists
  raw = []            # live raw allocations (alloc())
  snap = None
  counts = {}
  paged_ops = kind == "paged"

  def compare_lists(step, op):
    _check(step, op + " free_pages", impl.free_pages, model.free_pages)
    _check(step, op + " release_pages", impl.release_pages, model.release_pages)
    if impl.available_size() != model.available_size():
      raise Mismatch(f"step {step} {op}: available_size {impl.available_size()} "
                     f"!= {model.available_size()}")

  for step in range(steps):
    choices = ["alloc", "free_raw", "finish", "merge", "snapshot", "restore"]
    if paged_ops:
      choices += ["prefill", "prefill", "chunk", "decode", "decode", "decode", "spec"]
    op = rng.choice(choices)
    if op == "prefill":
      bs = int(rng.integers(1, max_batch + 1))
      seq = rng.integers(1, max_chunk + 1, bs).tolist()
      want = model.alloc_extend([0] * bs, seq, [-1] * bs)
      got = impl.alloc_extend(np.zeros(bs, np.int64), None, np.array(seq), None,
                              np.full(bs, -1), sum(seq))
      _check(step, op, got, want)
      if want is not None:
        at = 0
        for s in seq:
          reqs.append(list(want[at:at + s]))
          at += s
    elif op in ("chunk", "decode", "spec") and reqs:
      pick = rng.choice(len(reqs), size=min(len(reqs), int(rng.integers(1, max_batch + 1))),
                        replace=False).tolist()
      pre = [len(reqs[i]) for i in pick]
      last = [reqs[i][-1] for i in pick]
      if op == "decode":
        seq = [p + 1 for p in pre]
        want = model.alloc_decode(seq, last)
        got = impl.alloc_decode(np.array(seq), None, np.array(last))
      else:
        ext = (rng.integers(1, max_chunk + 1, len(pick)) if op == "chunk"
               else rng.integers(0, 3, len(pick)))  # spec: zero-extension rows too
        seq = [p + int(e) for p, e in zip(pre, ext)]
        want = model.alloc_extend(pre, seq, last)
        got = impl.alloc_extend(np.array(pre), None, np.array(seq), None, np.array(last),
                                sum(seq) - sum(pre))
      _check(step, op, got, want)
      if want is not None:
        at = 0
        for i, p, s in zip(pick, pre, seq):
          reqs[i] += list(want[at:at + s - p])
          at += s - p
    elif op == "alloc":
      n = int(rng.integers(0, 4 * ps + 1)) // ps * ps
      want = model.alloc(n)
      got = impl.alloc(n)
      _check(step, op, got, want)
      if want:
        raw.append(list(want))
    elif op in ("finish", "free_raw"):
      pool = reqs if op == "finish" else raw
      if not pool:
        continue
      k = int(rng.integers(1, len(pool) + 1))
      idx = sorted(rng.choice(len(pool), size=k, replace=False).tolist(), reverse=True)
      group = bool(rng.integers(0, 2))
      if group:
        impl.free_group_begin(), model.free_group_begin()
      for i in idx:
        slots = pool.pop(i)
        impl.free(np.array(slots, np.int64)), model.free(slots)
      if group:
        impl.free_group_end(), model.free_group_end()
    elif op == "merge":
      impl.merge_and_sort_free(), model.merge_and_sort_free()
    elif op == "snapshot":
      snap = (impl.backup_state(), model.backup_state(),
              [list(r) for r in reqs], [list(r) for r in raw])
    elif op == "restore" and snap is not None:
      impl.restore_state(snap[0]), model.restore_state(snap[1])
      reqs, raw = [list(r) for r in snap[2]], [list(r) for r in snap[3]]
    else:
      continue
    counts[op] = counts.get(op, 0) + 1
    compare_lists(step, op)
  return counts
