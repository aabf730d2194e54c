"""Lock-step random traces for the SWA allocator (SPEC 13): one generator, many impls.

An impl answers the model's methods on host lists (alloc, alloc_extend,
alloc_extend_swa_tail, alloc_decode, free, free_swa, free_swa_segment, free_full,
free_full_segment, free_segment, free_group_begin/end) and four views: `lists()` ->
(full free, full released, SWA free, SWA released) as lists, and `peers(slots)` -> the
SWA slot of each full slot. The model (swa_model.ModelSWA) runs first and says which
slots each request holds; every impl must return the same slots and show the same
lists (released lists as sets when `release_unordered`) and peers after every step.
"""
from __future__ import annotations

import numpy as np

from kernel_cases import cdiv
from swa_model import ModelSWA


class Mismatch(AssertionError):
  pass


def _lists_of_model(m: ModelSWA):
  return (list(m.full.free_pages), list(m.full.release_pages), list(m.swa.free_pages),
          list(m.swa.release_pages))


def _check(step, what, impls, model, reqs):
  want_lists = _lists_of_model(model)
  live = [s for r in reqs for s in r["slots"]]
  want_peers = model.translate(live)
  for impl in impls:
    got = impl.lists()
    for k, name in enumerate(("full free", "full release", "swa free", "swa release")):
      a, b = list(map(int, got[k])), want_lists[k]
      if k % 2 == 1 and getattr(impl, "release_unordered", False):
        a, b = sorted(a), sorted(b)
      if a != b:
        raise Mismatch(f"step {step} ({what}), {impl.name}: {name} {a} != model {b}")
    if live:
      got_peers = list(map(int, impl.peers(live)))
      if got_peers != want_peers:
        raise Mismatch(f"step {step} ({what}), {impl.name}: peers {got_peers} != model "
                       f"{want_peers}")


def _same(step, what, impls, outs, want):
  for impl, out in zip(impls, outs):
    got = None if out is None else list(map(int, np.asarray(out).reshape(-1)))
    if got != want:
      raise Mismatch(f"step {step} ({what}), {impl.name}: returned {got}, model {want}")


def run_trace(impls, *, size, size_swa, ps, need_sort, steps, seed, window=None,
              groups=True):
  """Drives `impls` and the model through `steps` random serving steps; raises Mismatch
  at the first difference. Returns a dict of counts (ops run, refusals)."""
  rng = np.random.default_rng(seed)
  m = ModelSWA(size, size_swa, ps, need_sort)
  window = window or 2 * ps + 1
  reqs = []  # {"slots": full slots, "swa_from": first token whose SWA KV is alive}
  stats = {"ops": 0, "refused": 0, "skipped_decode": 0}
  group_open = False

  def both(what, *args):
    want = getattr(m, what)(*args)
    outs = [getattr(impl, what)(*args) for impl in impls]
    return want, outs

  for step in range(steps):
    r = rng.random()
    what = ""
    if group_open and r < 0.3:
      what = "free_group_end"
      both(what)
      group_open = False
    elif groups and not group_open and r < 0.08:
      what = "free_group_begin"
      both(what)
      group_open = True
    elif r < 0.38:  # prefill: new requests, or extend one
      if ps == 1:
        n = int(rng.integers(0, 3 * 4))
        what = f"alloc({n})"
        want, outs = both("alloc", n)
        _same(step, what, impls, outs, want)
        if want is None:
          stats["refused"] += 1
        elif want:
          reqs.append({"slots": list(want), "swa_from": 0})
      elif rng.random() < 0.25:
        ext = int(rng.integers(ps, 4 * ps + 1))
        head = ps * int(rng.integers(0, ext // ps + 1))
        tail = ext - head
        what = f"alloc_extend_swa_tail(0, {ext}, -1, {tail})"
        want, outs = both("alloc_extend_swa_tail", 0, ext, -1, tail)
        _same(step, what, impls, outs, want)
        if want is None:
          stats["refused"] += 1
        else:
          reqs.append({"slots": list(want), "swa_from": head})
      else:
        grow = [q for q in reqs if len(q["slots"]) - q["swa_from"] >= 1]
        old = [grow[i] for i in sorted(set(rng.integers(0, len(grow), 2).tolist()))] \
            if grow and rng.random() < 0.5 else []
        new = int(rng.integers(0 if old else 1, 3))
        pre = [len(q["slots"]) for q in old] + [0] * new
        seq = [p + int(rng.integers(0, 3 * ps + 2)) for p in pre]
        last = [q["slots"][-1] for q in old] + [-1] * new
        what = f"alloc_extend({pre}, {seq}, {last})"
        want, outs = both("alloc_extend", pre, seq, last)
        _same(step, what, impls, outs, want)
        if want is None:
          stats["refused"] += 1
        else:
          at = 0
          for i, (p, s) in enumerate(zip(pre, seq)):
            got = want[at:at + s - p]
            at += s - p
            if i < len(old):
              old[i]["slots"] += got
            else:
              reqs.append({"slots": list(got), "swa_from": 0})
    elif r < 0.6 and reqs:  # decode (page size > 1) / one more token (page size 1)
      if ps == 1:
        q = reqs[int(rng.integers(0, len(reqs)))]
        what = "alloc(1)"
        want, outs = both("alloc", 1)
        _same(step, what, impls, outs, want)
        if want:
          q["slots"] += want
      else:
        run = [q for q in reqs if len(q["slots"]) > q["swa_from"]]
        seq = [len(q["slots"]) + 1 for q in run]
        last = [q["slots"][-1] for q in run]
        need = sum(1 for s in seq if cdiv(s, ps) > cdiv(s - 1, ps))
        fit_f = need <= m.full.available_size() // ps
        fit_s = need <= m.swa.available_size() // ps
        if not run or fit_f != fit_s:  # SGLang leaks here; ours refuses (SPEC 13)
          stats["skipped_decode"] += 1
          what = "skip"
        else:
          what = f"alloc_decode({seq}, {last})"
          want, outs = both("alloc_decode", seq, last)
          _same(step, what, impls, outs, want)
          if want is None:
            stats["refused"] += 1
          else:
            for q, s in zip(run, want):
              q["slots"].append(s)
    elif r < 0.8 and reqs:  # the window: free SWA pages wholly before len - window
      q = reqs[int(rng.integers(0, len(reqs)))]
      end = ((len(q["slots"]) - window) // ps) * ps
      if end > q["swa_from"]:
        seg = q["slots"][q["swa_from"]:end]
        if rng.random() < 0.5:
          what = f"free_swa_segment({seg}, {q['swa_from']})"
          both("free_swa_segment", seg, q["swa_from"])
        else:
          what = f"free_swa({seg})"
          both("free_swa", seg)
        q["swa_from"] = end
    elif reqs:  # finish a request
      q = reqs.pop(int(rng.integers(0, len(reqs))))
      slots, alive = q["slots"], q["slots"][q["swa_from"]:]
      how = int(rng.integers(0, 4))
      if how == 0 and (ps > 1 or q["swa_from"] == 0):
        what = "free"
        both("free", slots)
      elif how == 1 and q["swa_from"] == 0:
        what = "free_segment"
        both("free_segment", slots, 0)
      elif how == 2:
        what = "free_swa_segment+free_full_segment"
        both("free_swa_segment", alive, q["swa_from"])
        both("free_full_segment", slots, 0)
      else:
        what = "free_swa+free_full"
        both("free_swa", alive)
        both("free_full", slots)
    else:
      continue
    stats["ops"] += 1
    _check(step, what, impls, m, reqs)
  if group_open:
    both("free_group_end")
    _check(steps, "free_group_end", impls, m, reqs)
  return stats
