"""The host backend (backend="host"): numpy results, its small-batch path (Python ints)
equal to its general vectorized path and to the device backend, O(1) snapshots that copy
a ring only when a free writes it."""
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import host as host_ops
from serving_driver import run_workload


def _pair(ps, num_pages, need_sort):
  return [kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                         backend=b, debug=False) for b in ("host", "device")]


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("need_sort", [False, True])
def test_small_path_matches_general_path_and_device(ps, need_sort, monkeypatch):
  rng = np.random.default_rng(ps)
  small, dev = _pair(ps, 64, need_sort)
  general = kvs.PagedTokenToKVPoolAllocator(64 * ps, ps, need_sort=need_sort, backend="host",
                                           debug=False)
  lens = []  # live requests: (seq_len, last slot)
  for step in range(80):
    if rng.random() < 0.5 or not lens:
      bs = int(rng.integers(1, 9))
      pre = np.zeros(bs, np.int64)
      seq = rng.integers(0, 3 * ps + 3, bs)
      args = (pre, pre, seq, seq, np.full(bs, -1), int(seq.sum()))
      outs = [a.alloc_extend(*args) for a in (small, dev)]
      with monkeypatch.context() as m:
        m.setattr(host_ops, "SMALL_BATCH", 0)
        outs.append(general.alloc_extend(*args))
      if outs[0] is not None:
        starts = np.concatenate([[0], np.cumsum(seq)])
        lens += [(int(s), int(outs[0][starts[i + 1] - 1])) for i, s in enumerate(seq) if s]
    else:
      pick = lens[: int(rng.integers(1, 9))]
      seq = np.array([s + 1 for s, _ in pick])
      last = np.array([l for _, l in pick])
      outs = [a.alloc_decode(seq, None, last) for a in (small, dev)]
      with monkeypatch.context() as m:
        m.setattr(host_ops, "SMALL_BATCH", 0)
        outs.append(general.alloc_decode(seq, None, last))
      if outs[0] is not None:
        lens = [(s + 1, int(o)) for (s, _), o in zip(pick, outs[0])] + lens[len(pick):]
    assert (outs[0] is None) == (outs[1] is None) == (outs[2] is None), step
    if outs[0] is not None:
      assert isinstance(outs[0], np.ndarray) and outs[0].dtype == np.int32
      np.testing.assert_array_equal(outs[0], np.asarray(outs[1]), err_msg=f"step {step}")
      np.testing.assert_array_equal(outs[0], outs[2], err_msg=f"step {step}")
    if rng.random() < 0.15:
      for a in (small, dev, general):
        a.clear()
      lens = []


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 4)])
def test_general_path_on_random_traces(kind, ps, monkeypatch):
  monkeypatch.setattr(host_ops, "SMALL_BATCH", 0)
  for need_sort in (False, True):
    if kind == "token":
      impl = kvs.TokenToKVPoolAllocator(40, need_sort=need_sort, backend="host")
    else:
      impl = kvs.PagedTokenToKVPoolAllocator(24 * ps, ps, need_sort=need_sort, backend="host")
    run_workload(impl, size=impl.size, page_size=ps, need_sort=need_sort, kind=kind,
                 steps=120, seed=5)


def test_small_path_refuses_bad_input_with_the_usual_message():
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, backend="host")
  with pytest.raises(ValueError, match=r"last_loc\[0\]=4 breaks"):
    a.alloc_decode([3], None, [4])
  with pytest.raises(ValueError, match="extend_num_tokens=4 != "):
    a.alloc_extend([0], None, [3], None, [-1], 4)
  with pytest.raises(TypeError):
    a.alloc_decode(np.array([3.0]), None, np.array([4]))
  assert a.available_size() == 64


def test_snapshots_are_o1_and_copy_on_write():
  a = kvs.PagedTokenToKVPoolAllocator(64 * 4, 4, backend="host")
  out = a.alloc(16)
  ring = a._pools[0].state.free_ring  # pylint: disable=protected-access
  snap = a.backup_state()
  a.alloc(8)                   # allocation never writes the ring: still shared, no copy
  assert a._pools[0].state.free_ring is ring  # pylint: disable=protected-access
  a.restore_state(snap)
  assert a._pools[0].state.free_ring is ring  # pylint: disable=protected-access
  a.free(out)                  # the first write copies (the snapshot keeps its ring)
  assert a._pools[0].state.free_ring is not ring  # pylint: disable=protected-access
  before = a._pools[0].state.free_ring  # pylint: disable=protected-access
  a.free(a.alloc(8))           # no snapshot holds the new ring: written in place
  assert a._pools[0].state.free_ring is before  # pylint: disable=protected-access
  a.restore_state(snap)
  np.testing.assert_array_equal(a.free_pages, np.arange(5, 65))
  assert a.available_size() == 60 * 4


def test_device_snapshot_restore_copies_nothing():
  a = kvs.PagedTokenToKVPoolAllocator(64 * 4, 4, kernel="jnp")
  a.alloc(16)
  snap = a.backup_state()
  ring = a._pools[0].state.free_ring  # pylint: disable=protected-access
  for _ in range(3):
    a.restore_state(snap)
    a.alloc_decode(np.array([5, 9]), None, np.array([19, 23]))
    assert a._pools[0].state.free_ring is ring  # pylint: disable=protected-access
  assert not ring.is_deleted()


@pytest.mark.parametrize("ps", [1, 2, 3, 4, 16])
def test_host_extend_equals_the_shared_index_rule(ps):
  """host_ops.alloc_extend (a gather from a table of pages) == index_jnp.extend_indices
  with xp=numpy, on random batches with empty rows, page-boundary prefixes and ends."""
  from jax_kvalloc import index_jnp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(ps)
  cfg = kv.AllocatorConfig(size=4096 * ps, page_size=ps, kind="paged")
  hc = host_ops.host_config(cfg)
  for _ in range(60):
    bs = int(rng.integers(1, 40))
    pre = rng.integers(0, 5 * ps, bs) * (rng.random(bs) < 0.8)
    pre = np.where(rng.random(bs) < 0.2, pre - pre % ps, pre)  # prefix on a boundary
    seq = pre + rng.integers(0, 4 * ps, bs) * (rng.random(bs) < 0.9)
    seq = np.where(rng.random(bs) < 0.2, -(-seq // ps) * ps, seq)  # end on a boundary
    last = np.where(pre > 0, ps * rng.integers(1, 4000, bs) + (pre - 1) % ps, -1)
    ext = seq - pre
    per_row = -(-seq // ps) - (-(-pre // ps))
    total, pages = int(ext.sum()), int(per_row.sum())
    plan = host_ops.extend_plan(hc, pre, seq, last, total)
    assert plan is not None and plan[:2] == (total, pages)
    state = host_ops.init(cfg)
    state = state._replace(free_ring=rng.permutation(state.free_ring).astype(np.int32),
                           free_head=int(rng.integers(0, cfg.num_pages)))
    window = np.roll(state.free_ring, -state.free_head)[:max(pages, 1)]
    after, got = host_ops.alloc_extend(hc, state, plan)
    want = index_jnp.extend_indices(window, pre, seq, last, np.cumsum(ext) - ext,
                                    np.cumsum(per_row) - per_row, page_size=ps,
                                    out_len=total, xp=np)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert after.free_len == cfg.num_pages - pages
    assert after.free_head == (state.free_head + pages) % cfg.num_pages


def test_parity_with_host_backend_leading():
  """`jax-kvalloc parity --impls jax-host,...`: the host backend leads generated traces,
  matched step by step by the device backend and (when installed) torch_ref / SGLang."""
  pytest.importorskip("torch", reason="parity's torch_ref needs torch")
  from jax_kvalloc.tools import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(["parity", "--impls", "jax-host,jax,torch", "--torch-kernel", "torch",
                   "--generate", "2", "--steps", "120", "--quiet"]) == 0


def _outcome(fn):
  try:
    return ("ok", fn())
  except Exception as e:  # pylint: disable=broad-except
    return (type(e).__name__, str(e))


def _same_pools(a, b):
  for pa, pb in zip(a._pools, b._pools):  # pylint: disable=protected-access
    assert pa.lengths() == pb.lengths()
    for which in ("free", "release"):
      np.testing.assert_array_equal(getattr(a, which + "_pages"), getattr(b, which + "_pages"))
    ga, gb = pa.state.guard, pb.state.guard
    assert (ga is None) == (gb is None)
    if ga is not None:
      np.testing.assert_array_equal(ga.held, gb.held)


@pytest.mark.parametrize("kind,ps,need_sort,guard", [
    ("token", 1, False, True), ("token", 1, True, True), ("token", 1, False, False),
    ("paged", 4, True, True), ("paged", 4, False, True), ("paged", 4, True, False),
    ("paged", 1, False, True)])
def test_small_free_and_alloc_paths_match_the_general_path(kind, ps, need_sort, guard):
  """The host backend's Python-int frees (`free_small`, queued group frees) and record
  writes against the general path (pools with `small` off), on random frees of held,
  free, never-allocated, repeated, reserved and out-of-range slots, in and out of free
  groups, across snapshots: same results, same exceptions and messages, same lists and
  ownership record."""
  rng = np.random.default_rng([ps, need_sort, guard, kind == "token"])
  num_pages = 24

  def make():
    if kind == "token":
      return kvs.TokenToKVPoolAllocator(num_pages, need_sort=need_sort, backend="host",
                                        debug=False, guard=guard)
    return kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                           backend="host", debug=False, guard=guard)
  fast, general = make(), make()
  for pool in general._pools:  # pylint: disable=protected-access
    pool.small = False
  assert all(p.small for p in fast._pools)  # pylint: disable=protected-access
  held, snaps, slots_total = [], [], (num_pages + 1) * ps
  for _ in range(400):
    r = rng.random()
    if r < 0.3:
      n = int(rng.integers(0, 6)) * ps
      outs = [_outcome(lambda a=a: a.alloc(n)) for a in (fast, general)]
      assert outs[0][0] == outs[1][0]
      if outs[0][0] == "ok":
        x, y = outs[0][1], outs[1][1]
        assert (x is None) == (y is None)
        if x is not None:
          np.testing.assert_array_equal(x, y)
          held += np.asarray(x).tolist()
      else:
        assert outs[0] == outs[1]
    elif r < 0.75:
      m = int(rng.integers(1, 12))
      if held and rng.random() < 0.8:
        pick = list(rng.choice(held, size=min(m, len(held)), replace=False))
      else:
        pick = []
      if rng.random() < 0.25:  # a misuse: free, reserved, out of range or repeated
        pick.append(int(rng.choice([0, ps - 1 if ps > 1 else 0, slots_total,
                                    slots_total + 7, -1, int(rng.integers(ps, slots_total))]
                                   + pick[:1])))
      dtype = rng.choice([np.int32, np.int64, np.uint32, object])
      if not pick:  # a free of nothing, of any dtype, or of a 2-D empty array
        arg = np.zeros((0,) if rng.random() < 0.8 else (0, 3),
                       rng.choice([np.int32, np.float64, bool]))
      elif dtype is object:
        arg = [int(v) for v in pick]
      elif dtype == np.uint32 and min(pick) < 0:
        arg = np.array(pick, np.int64)
      else:
        arg = np.array(pick, dtype)
      outs = [_outcome(lambda a=a: a.free(arg.copy() if isinstance(arg, np.ndarray)
                                          else list(arg))) for a in (fast, general)]
      assert outs[0] == outs[1]
      if outs[0][0] == "ok":
        held = [s for s in held if s not in set(int(v) for v in pick)]
    elif r < 0.82:
      op = "free_group_begin" if fast.is_not_in_free_group else "free_group_end"
      outs = [_outcome(getattr(a, op)) for a in (fast, general)]
      assert outs[0] == outs[1]
    elif r < 0.88:
      if fast.is_not_in_free_group:
        snaps.append((fast.backup_state(), general.backup_state(), list(held)))
    elif r < 0.93 and snaps:
      if fast.is_not_in_free_group:
        sf, sg, h = snaps[int(rng.integers(len(snaps)))]
        fast.restore_state(sf)
        general.restore_state(sg)
        held = list(h)
    else:
      outs = [_outcome(a.available_size) for a in (fast, general)]
      assert outs[0] == outs[1]
    if fast._pools[0].error is not None:  # pylint: disable=protected-access
      assert general._pools[0].error is not None  # pylint: disable=protected-access
      assert str(fast._pools[0].error) == str(general._pools[0].error)  # pylint: disable=protected-access
      fast.clear()
      general.clear()
      held, snaps = [], []
    if fast.is_not_in_free_group:
      _same_pools(fast, general)
