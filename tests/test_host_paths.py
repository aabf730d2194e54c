"""The host backend's two fast paths (Python ints for up to host_ops.SMALL_BATCH requests,
whole-batch numpy for more) against the independent model (tests/model.py), and their
checks against jax_kvalloc.validate: a plan accepts exactly the input validate accepts,
and bad input reaches validate's message with the allocator unchanged."""
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import host as host_ops
from jax_kvalloc import validate
from model import ModelAllocator

INT32_MAX = 2**31 - 1


def _host(ps, num_pages, need_sort):
  return kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                        backend="host", debug=False)


def _same_state(a, model, where):
  np.testing.assert_array_equal(a.free_pages, model.free_pages, err_msg=where)
  np.testing.assert_array_equal(a.release_pages, model.release_pages, err_msg=where)
  assert a.available_size() == model.available_size(), where


def _extend_rows(rng, ps, live, bs, avail_pages):
  """A batch of bs rows: continued live requests (each at most once) and new ones, with
  empty rows, prefixes and ends on page boundaries, and sometimes exactly the free
  pages or one more. Returns (ids, pre, seq, last)."""
  ids, pre, seq, last = [], [], [], []
  cont = list(rng.permutation(list(live)))[:int(rng.integers(0, bs + 1))]
  for rid in cont:
    slots = live[rid]
    ids.append(rid)
    pre.append(len(slots))
    last.append(slots[-1] if slots else -1)
  while len(ids) < bs:
    ids.append(None)
    pre.append(0)
    last.append(-1)
  for p in pre:
    kind = rng.random()
    if kind < 0.15:
      seq.append(p)                                  # an empty row
    elif kind < 0.3:
      seq.append(p + (-p % ps or ps))                # ends on a page boundary
    elif kind < 0.45:
      seq.append(p + int(rng.integers(0, max(-p % ps, 1))))  # needs no new page
    else:
      seq.append(p + int(rng.integers(1, (4 if bs <= 8 else 2) * ps + 2)))
  if bs and rng.random() < 0.2 and avail_pages > 0:
    # One new request takes exactly what is left after the others (an exact fit), or
    # one page more (a failure).
    others = sum(-(-s // ps) - (-(-p // ps)) for p, s in zip(pre[:-1], seq[:-1]))
    if ids[-1] is None and others < avail_pages:
      seq[-1] = (avail_pages - others + (rng.random() < 0.5)) * ps
  return ids, np.array(pre, np.int64), np.array(seq, np.int64), np.array(last, np.int64)


@pytest.mark.parametrize("ps", [1, 3, 4, 16])
@pytest.mark.parametrize("need_sort", [False, True])
def test_fast_paths_match_the_model(ps, need_sort, monkeypatch):
  """Random serving sequences (extend, decode, free; batch sizes 0..24) on two host
  allocators, one with the small path and one with numpy only, and on the model: same
  outputs, same failures, same lists after every call. Covers empty batches and rows,
  rows needing no page, page-boundary prefixes and ends, exact fits of the free list,
  failures, and need_sort merges (frees park pages that shortfalls merge back)."""
  rng = np.random.default_rng(ps * 10 + need_sort)
  num_pages = 128
  small, numpy_only = _host(ps, num_pages, need_sort), _host(ps, num_pages, need_sort)
  model = ModelAllocator(num_pages * ps, ps, need_sort=need_sort, kind="paged")
  live = {}  # request id -> its slots
  next_id = 0
  snap = None
  seen = {"failures": 0, "exact fits": 0, "merges": 0, "numpy extends": 0}

  def both(call):
    out = call(small)
    with monkeypatch.context() as m:
      m.setattr(host_ops, "SMALL_BATCH", 0)
      out_np = call(numpy_only)
    return out, out_np

  for step in range(200):
    where = f"step {step}"
    # Free while the pool runs low, so that most calls can succeed.
    low = len(model.free_pages) + len(model.release_pages) < num_pages // 4
    op = 1.0 if low and live else rng.random()
    if op < 0.45:
      bs = int(rng.choice([0, 1, 2, 5, 8, 9, 16, 24]))
      avail = len(model.free_pages) + (len(model.release_pages) if need_sort else 0)
      ids, pre, seq, last = _extend_rows(rng, ps, live, bs, avail)
      total = int((seq - pre).sum())
      parked = len(model.release_pages)
      # An empty batch too runs SPEC 4.2's need_sort trigger (as SGLang's does).
      want = model.alloc_extend(pre.tolist(), seq.tolist(), last.tolist())
      got, got_np = both(lambda a: a.alloc_extend(pre, pre, seq, seq, last, total))
      seen["merges"] += bool(parked and not model.release_pages)
      seen["numpy extends"] += bs > host_ops.SMALL_BATCH and want is not None
      if want is not None:
        seen["exact fits"] += bs > 0 and not model.free_pages
        pos = 0
        for rid, p, s in zip(ids, pre, seq):
          if rid is None:
            rid, next_id = next_id, next_id + 1
            live[rid] = []
          live[rid] = live[rid] + want[pos:pos + s - p]
          pos += s - p
    elif op < 0.75:
      ready = [r for r, slots in live.items() if slots]
      pick = list(rng.permutation(ready))[:int(rng.choice([0, 1, 3, 8, 9, 20]))]
      seq = np.array([len(live[r]) + 1 for r in pick], np.int64)
      last = np.array([live[r][-1] for r in pick], np.int64)
      want = model.alloc_decode(seq.tolist(), last.tolist())
      got, got_np = both(lambda a: a.alloc_decode(seq, None, last))
      if want is not None:
        for r, slot in zip(pick, want):
          live[r] = live[r] + [slot]
    else:
      pick = list(rng.permutation(list(live)))[:int(rng.integers(1, 4))] if live else []
      idx = np.array([s for r in pick for s in live.pop(r)], np.int64)
      model.free(idx.tolist())
      got = got_np = want = None
      for a in (small, numpy_only):
        a.free(idx)
      if rng.random() < 0.1:
        snap = ([a.backup_state() for a in (small, numpy_only)], model.backup_state(),
                dict(live))
    if want is None:
      seen["failures"] += op < 0.75
      assert got is None and got_np is None, where
    else:
      for out in (got, got_np):
        assert isinstance(out, np.ndarray) and out.dtype == np.int32, where
        np.testing.assert_array_equal(out, want, err_msg=where)
    for a in (small, numpy_only):
      _same_state(a, model, where)
    if rng.random() < 0.05 and snap is not None:
      for a, s in zip((small, numpy_only), snap[0]):
        a.restore_state(s)
      model.restore_state(snap[1])
      live = dict(snap[2])
      for a in (small, numpy_only):
        _same_state(a, model, where)
  if not need_sort:
    del seen["merges"]
  assert all(seen.values()), seen  # every case above was met


def _extend_cases(rng, ps, slots):
  """Random alloc_extend arguments, mostly valid, each with one kind of damage."""
  for _ in range(300):
    bs = int(rng.integers(1, 14))
    pre = rng.integers(0, 4 * ps, bs)
    seq = pre + rng.integers(0, 3 * ps, bs)
    last = np.where(pre > 0, ps * rng.integers(1, slots // ps, bs) + (pre - 1) % ps, -1)
    total = int((seq - pre).sum())
    i = int(rng.integers(0, bs))
    damage = int(rng.integers(0, 14))
    if damage == 1:
      pre[i] = -1 - int(rng.integers(0, 3))
    elif damage == 2:
      seq[i] = pre[i] - 1
    elif damage == 3:
      last[i] += int(rng.integers(1, ps + 1)) if ps > 1 else slots
    elif damage == 4:
      last[i] = slots
    elif damage == 5:
      last[i] = -2
    elif damage == 6:
      seq[i] = INT32_MAX + 1
    elif damage == 7:
      pre[i], seq[i] = 2**62, 2**62 + 1
    elif damage == 8:
      seq[i] = -(2**63)
    elif damage == 9:
      last[i] = 2**63 - 1
    elif damage == 10:
      total += 1
    elif damage == 11:
      total = np.int64(total)  # accepted: an integer of another type
    elif damage == 12:
      last = last[:-1]
    yield pre, seq, last, total


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_extend_plans_accept_exactly_what_validate_accepts(ps):
  rng = np.random.default_rng(ps)
  cfg = kv.AllocatorConfig(size=1000 * ps, page_size=ps, kind="paged")
  hc = host_ops.host_config(cfg)
  seen = {True: 0, False: 0}
  for pre, seq, last, total in _extend_cases(rng, ps, cfg.num_slots):
    try:
      want = validate.extend_args(pre, seq, last, total, page_size=ps,
                                  num_slots=cfg.num_slots)
    except ValueError:
      want = None
    plan = host_ops.extend_plan(hc, pre, seq, last, total)
    assert (plan is None) == (want is None), (pre, seq, last, total)
    if plan is not None:
      assert plan[:2] == tuple(want)
    if len(pre) <= host_ops.SMALL_BATCH:
      small = host_ops.extend_plan_small(hc, pre.tolist(), seq.tolist(), last.tolist(),
                                         total)
      if small is not None:  # it may pass valid input on (np.int64 total, many pages)
        assert want is not None and small == tuple(want)
    seen[want is not None] += 1
  assert min(seen.values()) > 50  # both kinds were tried


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_decode_plans_accept_exactly_what_validate_accepts(ps):
  rng = np.random.default_rng(ps + 1)
  cfg = kv.AllocatorConfig(size=1000 * ps, page_size=ps, kind="paged")
  hc = host_ops.host_config(cfg)
  seen = {True: 0, False: 0}
  for _ in range(300):
    bs = int(rng.integers(1, 14))
    seq = rng.integers(1, 5 * ps, bs)
    last = ps * rng.integers(0, cfg.num_pages, bs) + (seq - 2) % ps
    i, damage = int(rng.integers(0, bs)), int(rng.integers(0, 9))
    if damage == 1:
      seq[i] = int(rng.integers(-2, 1))
    elif damage == 2 and ps > 1:
      last[i] += 1
    elif damage == 3:
      last[i] = cfg.num_slots
    elif damage == 4:
      last[i] = -2
    elif damage == 5:
      seq[i] = INT32_MAX + 1
    elif damage == 6:
      seq[i] = -(2**63)
    elif damage == 7:
      last = last[:-1]
    try:
      validate.decode_args(seq, last, page_size=ps, num_slots=cfg.num_slots)
      ok = True
    except ValueError:
      ok = False
    plan = host_ops.decode_plan(hc, seq, last)
    assert (plan is not None) == ok, (seq, last)
    if ok:
      assert plan[2] == int(np.count_nonzero((seq - 1) % ps == 0))
    if bs <= host_ops.SMALL_BATCH:
      small = host_ops.decode_plan_small(hc, seq.tolist(), last.tolist())
      assert (small is not None) == ok
    seen[ok] += 1
  assert min(seen.values()) > 50


@pytest.mark.parametrize("bs", [3, 12])
def test_bad_input_raises_validates_message_and_changes_nothing(bs):
  """Either path (3 rows: Python ints, 12 rows: numpy) refuses bad input with validate's
  message naming the argument, and the allocator is unchanged."""
  ps = 4
  a = _host(ps, 64, need_sort=False)
  a.alloc(8)
  before = (a.free_pages.copy(), a.available_size())
  pre = np.arange(bs, dtype=np.int64) * 0 + 5
  seq = pre + 3
  last = np.full(bs, 4 * 7, np.int64)  # (28 + 1) % 4 == 5 % 4
  total = int((seq - pre).sum())
  bad_last = last.copy()
  bad_last[bs - 1] += 1
  with pytest.raises(ValueError, match=rf"last_loc\[{bs - 1}\]=29 breaks"):
    a.alloc_extend(pre, pre, seq, seq, bad_last, total)
  with pytest.raises(ValueError, match=f"extend_num_tokens={total + 1} != "):
    a.alloc_extend(pre, pre, seq, seq, last, total + 1)
  with pytest.raises(ValueError, match=r"seq_lens\[0\]=4 < prefix_lens\[0\]=5"):
    a.alloc_extend(pre, pre, seq - 4, seq - 4, last, total - 4 * bs)
  with pytest.raises(ValueError, match="num_new_pages=99 != "):
    a.alloc_extend(pre, pre, seq, seq, last, total, num_new_pages=99)
  with pytest.raises(TypeError, match="extend_num_tokens must be an int"):
    a.alloc_extend(pre, pre, seq, seq, last, float(total))
  with pytest.raises(TypeError):
    a.alloc_extend(pre.astype(float), None, seq, None, last, total)
  with pytest.raises(ValueError, match="differ in length"):
    a.alloc_extend(pre, pre, seq, seq, last[:-1], total)
  dseq = np.full(bs, 6, np.int64)
  dlast = np.full(bs, 4 * 9, np.int64)  # token 4 at offset 0 of page 9: (36 + 2) % 4 == 6 % 4
  with pytest.raises(ValueError, match=rf"seq_lens\[{bs - 1}\]=0 must be >= 1"):
    bad = dseq.copy()
    bad[-1] = 0
    a.alloc_decode(bad, None, dlast)
  with pytest.raises(ValueError, match=rf"last_loc\[0\]={a.config.num_slots} is not a slot"):
    bad = dlast.copy()
    bad[0] = a.config.num_slots
    a.alloc_decode(dseq, None, bad)
  np.testing.assert_array_equal(a.free_pages, before[0])
  assert a.available_size() == before[1]
  # The same arguments without the damage work, and as lists too (converted first).
  out = a.alloc_extend(pre, pre, seq, seq, last, total, num_new_pages=0)
  np.testing.assert_array_equal(out, np.tile(29 + np.arange(3), bs))
  out = a.alloc_decode(dseq.tolist(), None, dlast.tolist())
  np.testing.assert_array_equal(out, dlast + 1)


def test_other_integer_dtypes_and_empty_batches():
  a = _host(16, 128, need_sort=False)
  for dtype in (np.int32, np.uint32, np.int16, np.uint64):
    pre = np.zeros(10, dtype)
    seq = np.full(10, 17, dtype)
    out = a.alloc_extend(pre, None, seq, None, np.full(10, -1, np.int64), 170)
    assert out.dtype == np.int32 and out.shape == (170,)
    assert len(np.unique(out)) == 170
  huge = np.full(10, 2**64 - 1, np.uint64)
  with pytest.raises(ValueError, match="does not fit int32"):
    a.alloc_decode(huge, None, np.zeros(10, np.int64))
  empty = np.zeros((0,), np.int64)
  assert a.alloc_extend(empty, None, empty, None, empty, 0).shape == (0,)
  assert a.alloc_decode(empty, None, empty).shape == (0,)


@pytest.mark.parametrize("bs", [2, 12])
@pytest.mark.parametrize("merge", [False, True])
def test_need_sort_merge_triggers_at_their_boundaries(bs, merge):
  """SPEC 4.2/4.3's need_sort triggers, one short of firing and firing, on both paths
  (2 rows: Python ints, 12 rows: numpy): the lists equal the model's afterwards."""
  ps, num_pages = 4, 40
  for op in ("extend", "decode"):
    a = _host(ps, num_pages, need_sort=True)
    model = ModelAllocator(num_pages * ps, ps, need_sort=True, kind="paged")
    free_len = 20 if op == "extend" else bs - merge
    for impl in (a, model):
      impl.alloc(ps * (num_pages - free_len))
      impl.free(list(range(ps, 6 * ps)))  # pages 1..5 parked in release_pages
    if op == "extend":
      # Trigger: total // ps + bs + 1 > free_len.
      total = ps * (free_len - bs - 1 + merge)
      seq = np.zeros(bs, np.int64)
      seq[0] = total
      pre = np.zeros(bs, np.int64)
      last = np.full(bs, -1, np.int64)
      got = a.alloc_extend(pre, None, seq, None, last, total)
      want = model.alloc_extend(pre.tolist(), seq.tolist(), last.tolist())
    else:
      # Trigger: bs > free_len. seq 2 after a page-aligned last_loc needs no page.
      seq = np.full(bs, 2, np.int64)
      last = ps * np.arange(20, 20 + bs, dtype=np.int64)
      got = a.alloc_decode(seq, None, last)
      want = model.alloc_decode(seq.tolist(), last.tolist())
    np.testing.assert_array_equal(got, want)
    assert (len(model.release_pages) == 0) == merge
    _same_state(a, model, f"{op} bs={bs} merge={merge}")


@pytest.mark.parametrize("backend,debug", [("host", False), ("device", False),
                                           ("device", True)])
def test_empty_extend_batch_still_runs_the_need_sort_trigger(backend, debug):
  """SGLang's alloc_extend merges when extend_num_tokens // ps + bs + 1 > len(free_pages),
  also for an empty batch (0 + 0 + 1 > 0 once the free list is empty)."""
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(8 * ps, ps, need_sort=True, backend=backend,
                                     kernel="jnp", debug=debug)
  m = ModelAllocator(8 * ps, ps, True)
  got, want = a.alloc(8 * ps), m.alloc(8 * ps)       # empties the free list
  np.testing.assert_array_equal(np.asarray(got), want)
  a.free(np.asarray(want[:2 * ps], np.int64))         # two pages to release_pages
  m.free(want[:2 * ps])
  empty = np.zeros((0,), np.int64)
  out = a.alloc_extend(empty, None, empty, None, empty, 0)
  assert m.alloc_extend([], [], []) == []
  assert np.asarray(out).shape == (0,)
  np.testing.assert_array_equal(a.free_pages, m.free_pages)  # merged: [1, 2]
  np.testing.assert_array_equal(a.release_pages, m.release_pages)
  assert list(m.free_pages) == [1, 2]
