"""release_and_alloc_decode: a decode step's free_page_ids then alloc_decode, and its
one-launch Triton kernel (pallas_kernels.release_alloc_decode_triton).

The contract is the composition, bit for bit (whole state, slots, ok):
  alloc_decode(cfg, free_page_ids(cfg, state, page_ids, num), seq_lens, last_loc,
               num_reqs=num_reqs)
checked on CPU with the kernel in Pallas' interpreter against the jnp composition, on
random pools whose dead ring entries are poisoned (a stray write shows), and against the
independent loop model of SPEC (tests/model.py) as a second oracle. The random cases
draw: rings that wrap, releases cut to the room left (double frees, a non-empty release
list), zeros / out-of-range ids / `num` cutting the ids, decode batches that need exactly
the free pages plus the released ones, one page more, or fewer, rows with seq_lens < 1,
padding rows, empty releases. A fresh seed each run (JAX_KVALLOC_TEST_SEED repeats one;
failures print it). Also: hand-worked vectors, the fallbacks (need_sort, debug, token,
sizes beyond the kernel, kernel="auto" on a CPU pool), argument errors and the H200
lowering. tests/test_pallas_gpu.py runs `check_release_decode` on the compiled kernel.
"""
import dataclasses
import functools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import pallas_kernels
from jax_kvalloc import state as st
import lowering_check
from pallas_kernels import triton_decode
from model import ModelAllocator
import kernel_cases as testing

KERNEL_NAME = "jax_kvalloc_release_alloc_decode_triton"
TRITON = "__gpu$xla.gpu.triton"
POISON = 1_000_000   # dead ring entries hold POISON + index: not a page, and distinct
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

SEED = int(os.environ.get("JAX_KVALLOC_TEST_SEED",
                          np.random.SeedSequence().entropy % 2**32))


def _rng(*key):
  return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _configs(ps, num_pages, kernel="triton_interpret", **kw):
  # guard=False: these cases free junk ids on purpose (ignored without the ownership
  # record); tests/test_guard.py checks the kernel with the record against the jnp path.
  kw.setdefault("guard", False)
  jnp_cfg = kv.AllocatorConfig(size=num_pages * ps, page_size=ps, kernel="jnp",
                               debug=False, **kw)
  return jnp_cfg, dataclasses.replace(jnp_cfg, kernel=kernel)


def _state(cfg, ring, head, length, release_len=0):
  s = kv.init(cfg)._replace(free_ring=jnp.asarray(ring, jnp.int32),
                            free_head=jnp.asarray(head, jnp.int32),
                            free_len=jnp.asarray(length, jnp.int32),
                            release_len=jnp.asarray(release_len, jnp.int32))
  if s.guard is None:
    return s
  # The ownership record agrees with the free list (traceable: the cases are vmapped):
  # every page outside the live window is held.
  n = cfg.num_pages
  live = ((jnp.arange(n) - s.free_head) % n) < s.free_len
  held = jnp.ones(n + 1, jnp.int32).at[0].set(0).at[
      jnp.where(live, s.free_ring, n + 1)].set(0, mode="drop")
  return s._replace(guard=s.guard._replace(held=held))


def _fused(cfg, ring, head, length, rel, ids, num, seq, last, nreq):
  return kv.release_and_alloc_decode(cfg, _state(cfg, ring, head, length, rel), ids, seq,
                                     last, num=num, num_reqs=nreq)


def _composed(cfg, ring, head, length, rel, ids, num, seq, last, nreq):
  s = kv.free_page_ids(cfg, _state(cfg, ring, head, length, rel), ids, num)
  return kv.alloc_decode(cfg, s, seq, last, num_reqs=nreq)


def _assert_same(a, b, msg=""):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=msg)


def _runs_kernel(fn, *args) -> bool:
  return KERNEL_NAME in str(jax.make_jaxpr(fn)(*args))


# ---------------------------------------------------------------------------------------
# Random cases.
# ---------------------------------------------------------------------------------------

def release_decode_case(rng, ps, num_pages, rows, m, junk=True, double=False):
  """One case: (ring, head, free_len, release_len, page_ids i32[m], num, seq_lens,
  last_loc, num_reqs) as host int32 values, and info {"clean": the caller's promise
  holds (distinct held pages, no room cut), "valid": the released ids in order}.
  double=True: the ids name at least one free page (a double free), none cut off."""
  n = num_pages
  seq, last, nreq = testing.decode_rows(rng, ps, rows)
  real = np.arange(rows) < nreq
  need = int(np.sum(real & (testing.cdiv(seq, ps) > testing.cdiv(seq - 1, ps))))
  pick = testing._pick  # pylint: disable=protected-access
  kind = pick(rng, {"exact": 3, "short": 2, "plenty": 3,
                    "empty_pool": 0 if double else 0.5})
  k = int(rng.integers(0, min(m, n) + 1)) if rng.random() < 0.85 else 0
  if double:
    k = min(k, m - 1)
  if kind == "empty_pool":
    free = 0
  else:
    free = {"exact": need - k, "short": need - k - 1,
            "plenty": need - k + int(rng.integers(0, n + 1))}[kind]
  free = int(np.clip(free, 1 if double else 0, n))
  k = min(k, n - free)
  perm = (rng.permutation(n) + 1).astype(np.int32)
  head = int(rng.integers(0, n))
  ring = (POISON + np.arange(n)).astype(np.int32)
  ring[(head + np.arange(free)) % n] = perm[:free]
  held = perm[free:]
  valid = list(rng.permutation(held)[:k])
  mode = "double" if double else pick(rng, {"clean": 6, "double": 1, "release_list": 1})
  rel_len = 0
  if mode == "double" and free:   # pages already free, given again: the room cut
    valid += list(rng.choice(perm[:free], size=min(free, 1 + int(rng.integers(0, 4))),
                             replace=False))
  if mode == "release_list":      # a non-empty release list shrinks the room
    rel_len = int(rng.integers(0, n - free + 1))
  # Lay the ids out over m entries with padding: zeros and ids outside 1..n.
  # junk=False: padding zeros only (with the ownership record other junk is refused).
  junk = np.array([0, 0, 0, -1, -n, n + 1, n + 7, 2**31 - 1] if junk else [0], np.int32)
  ids = junk[rng.integers(0, junk.size, m)]
  valid = valid[:m]
  at = np.sort(rng.choice(m, size=len(valid), replace=False)) if valid else []
  ids[at] = valid
  num = m
  if rng.random() < 0.3 and not double:  # num cuts the ids (possibly through the valid ones)
    num = int(rng.integers(-1, m + 1))
  if rng.random() < 0.08 and nreq:  # a real row with seq_lens < 1: the decode is refused
    seq[int(rng.integers(0, nreq))] = int(rng.integers(-3, 1))
  given = [int(x) for x in ids[:max(num, 0)] if 1 <= x <= n]
  info = dict(clean=mode == "clean" and rel_len == 0, valid=given)
  return (ring, np.int32(head), np.int32(free), np.int32(rel_len), ids, np.int32(num),
          seq, last, np.int32(nreq)), info


def _cases(ps, num_pages, rows, m, count, tag, junk=True, doubles=0):
  """count cases; the first `doubles` of them double frees."""
  rng = _rng(tag, ps, num_pages, rows, m)
  cases, infos = zip(*[release_decode_case(rng, ps, num_pages, rows, m, junk, i < doubles)
                       for i in range(count)])
  return testing.stack(cases), list(infos)


def check_against_model(ps, args, result, info, msg=""):
  """The loop model of SPEC: free_page_ids of the valid ids, then alloc_decode."""
  ring, head, free, _, _, _, seq, last, nreq = args
  new_state, out, ok = result
  n = ring.shape[0]
  m = ModelAllocator(size=n * ps, page_size=ps, kind="paged")
  m.free_pages = testing.window(ring, head, free, int(free)).tolist()
  m.free_page_ids(info["valid"])
  k = int(nreq)
  if np.any(seq[:k] < 1):  # SPEC 9: refused, nothing allocated (the model has no check)
    expect = None
  else:
    expect = m.alloc_decode(seq[:k].tolist(), last[:k].tolist())
  assert bool(ok) == (expect is not None), msg
  np.testing.assert_array_equal(np.asarray(out)[:k], expect if expect is not None else 0,
                                err_msg=msg)
  assert not np.asarray(out)[k:].any(), msg
  assert st.live_free_pages(new_state).tolist() == m.free_pages, msg


def check_release_decode(ps, num_pages, rows, m, count, tag, kernel="triton_interpret",
                         guard=False):
  """kernel path == jnp composition (vmapped, whole results), and == the model on the
  clean cases. guard=True: with the ownership record (states that agree with it, no junk
  ids but padding), against the jnp path's release_and_alloc_decode (which refuses a
  release naming a page not held, and then the decode)."""
  jnp_cfg, cfg = _configs(ps, num_pages, kernel, guard=guard)
  args, infos = _cases(ps, num_pages, rows, m, count, tag, junk=not guard,
                       doubles=4 if guard else 0)
  fused = jax.jit(jax.vmap(functools.partial(_fused, cfg)))
  assert _runs_kernel(fused, *args)
  got = fused(*args)
  want = jax.jit(jax.vmap(functools.partial(_fused if guard else _composed, jnp_cfg)))(
      *args)
  msg = f"seed {SEED}, {tag}, ps {ps}, guard {guard}"
  _assert_same(got, want, msg)
  got = jax.device_get(got)
  for i, info in enumerate(infos):
    if info["clean"]:
      one = lambda tree, i=i: jax.tree_util.tree_map(lambda x: x[i], tree)
      check_against_model(ps, one(args), one(got), info, f"{msg}, case {i}")
  return args, infos, got


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
def test_kernel_equals_composition_and_model(ps):
  check_release_decode(ps, 64, 8, 16, 24, "small")


@pytest.mark.parametrize("ps", (16, 1))
def test_kernel_with_the_ownership_record_equals_the_jnp_path(ps):
  # Double frees, pages released twice (the room cut) and valid releases: the kernel
  # refuses (and records) exactly where the jnp path does, and otherwise matches the model.
  _, infos, got = check_release_decode(ps, 64, 8, 16, 24, "guard", guard=True)
  status = np.asarray(got[0].guard.status)
  refused = status[:, 0] != 0
  assert refused.any() and (~refused).any(), (SEED, status)
  assert not any(refused[i] for i, info in enumerate(infos) if info["clean"]), SEED


@pytest.mark.parametrize("ps", (1, 64))
def test_kernel_equals_composition_masked_prefix(ps, monkeypatch):
  # The decode half with its page offsets from the masked sum instead of the scan.
  from pallas_kernels import tuning  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tuning, "DECODE_MASKED_PREFIX_MAX_ROWS", 4096)
  check_release_decode(ps, 64, 8, 16, 24, "masked")


@pytest.mark.parametrize("ps", (1, 16))
def test_kernel_equals_composition_larger(ps):
  # Non-power-of-two rows and ids (padding lanes), a larger, non-power-of-two ring.
  check_release_decode(ps, 300, 37, 100, 8, "larger")


def test_cases_draw_every_edge():
  # The generator reaches the edges the module docstring lists, whatever the seed.
  ps, n = 4, 64
  args, infos = _cases(ps, n, 8, 16, 400, "coverage")
  msg = f"seed {SEED}"
  _, head, free, rel, ids, num, seq, _, nreq = args
  counts = np.array([len(i["valid"]) for i in infos])
  room = n - free - rel
  released = np.minimum(counts, room)
  real = np.arange(8)[None, :] < nreq[:, None]
  need = np.sum(real & (testing.cdiv(seq, ps) > testing.cdiv(seq - 1, ps)), axis=1)
  have = free + released
  assert np.any(head + free > n), msg  # the free list wraps
  assert np.any((head - released < 0) & (released > 0)), msg  # the release wraps
  assert np.any(counts > room), msg  # cut to the room
  assert np.any(need == have) and np.any(need == have + 1) and np.any(need < have), msg
  assert np.any(np.any(real & (seq < 1), axis=1)), msg  # a bad row
  assert np.any(nreq < 8) and np.any(counts == 0) and np.any(num < 16), msg
  assert np.any((ids == 0) | (ids > n) | (ids < 0)), msg


def test_oracle_catches_wrong_order():
  # The model check has teeth: a release in the wrong order (ids reversed) or a decode
  # that runs before the release gives results the model refuses.
  ps, n = 4, 64
  jnp_cfg, cfg = _configs(ps, n)
  args, infos = _cases(ps, n, 8, 16, 40, "mutation")
  rev_ids = args[4][:, ::-1]
  num = np.full_like(args[5], 16)   # all ids count, so reversal is a pure reorder
  base = args[:4] + (args[4], num) + args[6:]
  rev = args[:4] + (rev_ids, num) + args[6:]

  def swapped(ring, head, length, rel, ids, num, seq, last, nreq):
    s, out, ok = kv.alloc_decode(jnp_cfg, _state(jnp_cfg, ring, head, length, rel), seq,
                                 last, num_reqs=nreq)
    return kv.free_page_ids(jnp_cfg, s, ids, num), out, ok

  wrong_order = jax.device_get(jax.jit(jax.vmap(functools.partial(_fused, cfg)))(*rev))
  wrong_time = jax.device_get(jax.jit(jax.vmap(swapped))(*base))
  caught = {"order": 0, "time": 0}
  for i, info in enumerate(infos):
    one = lambda tree, i=i: jax.tree_util.tree_map(lambda x: x[i], tree)
    valid = [int(x) for x in args[4][i] if 1 <= x <= n]
    if not info["clean"] or len(valid) < 2:
      continue
    info = dict(info, valid=valid)
    for name, got in (("order", wrong_order), ("time", wrong_time)):
      try:
        check_against_model(ps, one(base), one(got), info)
      except AssertionError:
        caught[name] += 1
  assert caught["order"] > 0 and caught["time"] > 0, (SEED, caught)


# ---------------------------------------------------------------------------------------
# Hand-worked vectors.
# ---------------------------------------------------------------------------------------

def _worked_state(cfg):
  # 10 pages, page size 4. free list [5, 6, 7] from head 8 (wraps: ring[8], ring[9],
  # ring[0]); the other entries are poison.
  ring = np.array([7, 101, 102, 103, 104, 105, 106, 107, 5, 6], np.int32)
  return _state(cfg, ring, 8, 3)


@pytest.mark.parametrize("kernel", ("triton_interpret", "jnp"))
def test_worked_example(kernel):
  cfg = kv.AllocatorConfig(size=40, page_size=4, kernel=kernel, debug=False,
                           guard=False)  # 99 is a junk id: ignored without the record
  # Release [9, 0, 3, 99, 2] with num 4: 0 is padding, 99 is outside the pool, 2 lies
  # past num; pages 9 and 3 are prepended as a block: head 8 - 2 = 6, ring[6] = 9,
  # ring[7] = 3, free list [9, 3, 5, 6, 7].
  # Decode seq [5, 7, 9]: rows 0 and 2 start a page (seq % 4 == 1): pages 9 and 3, slots
  # 36 and 12; row 1 gets last_loc + 1 = 22. Head 8, length 3.
  s, out, ok = kv.release_and_alloc_decode(cfg, _worked_state(cfg), [9, 0, 3, 99, 2],
                                           [5, 7, 9], [19, 21, 31], num=4)
  assert bool(ok) and out.tolist() == [36, 22, 12]
  assert s.free_ring.tolist() == [7, 101, 102, 103, 104, 105, 9, 3, 5, 6]
  assert (int(s.free_head), int(s.free_len)) == (8, 3)
  assert st.live_free_pages(s).tolist() == [5, 6, 7]
  # Six rows that each start a page need 6 > 5 pages: refused, out all 0, the release
  # stays done (head 6, length 5).
  s, out, ok = kv.release_and_alloc_decode(cfg, _worked_state(cfg), [9, 0, 3, 99, 2],
                                           [1, 5, 9, 13, 17, 21], [-1, 3, 7, 11, 15, 19],
                                           num=4)
  assert not bool(ok) and not out.any()
  assert (int(s.free_head), int(s.free_len)) == (6, 5)
  assert st.live_free_pages(s).tolist() == [9, 3, 5, 6, 7]
  # Exactly enough: 5 pages for the first 5 rows (num_reqs 5; row 5 is padding, slot 0).
  s, out, ok = kv.release_and_alloc_decode(cfg, _worked_state(cfg), [9, 0, 3, 99, 2],
                                           [1, 5, 9, 13, 17, 21], [-1, 3, 7, 11, 15, 19],
                                           num=4, num_reqs=5)
  assert bool(ok) and out.tolist() == [36, 12, 20, 24, 28, 0]
  assert int(s.free_len) == 0 and int(s.free_head) == 1


def test_kernel_alone_worked_example():
  # The kernel's own entry point: room cut to 1 (10 pages, 8 free, 1 released): of the
  # ids [4, 8], only 4 goes back.
  ring = np.array([1, 2, 3, 5, 6, 7, 9, 10, 0, 0], np.int32)
  out = pallas_kernels.release_alloc_decode_triton(
      ring, 0, 8, 1, np.int32([4, 8]), 2, 1, np.int32([3]), np.int32([5]), page_size=4,
      interpret=True)
  ring2, head, length, slots, ok = jax.device_get(out)
  assert ring2.tolist() == [1, 2, 3, 5, 6, 7, 9, 10, 0, 4]
  assert (int(head), int(length), slots.tolist(), bool(ok)) == (9, 9, [6], True)


def test_empty_release_and_num_none():
  ps, n = 16, 64
  jnp_cfg, cfg = _configs(ps, n)
  args, _ = _cases(ps, n, 8, 16, 2, "empty")
  for i in range(2):
    ring, head, free, rel, ids, _, seq, last, nreq = (a[i] for a in args)
    for page_ids, num in ((np.zeros((0,), np.int32), None), (ids, None)):
      run = lambda c: kv.release_and_alloc_decode(c, _state(c, ring, head, free, rel),
                                                  page_ids, seq, last, num=num,
                                                  num_reqs=nreq)
      want = kv.alloc_decode(jnp_cfg, kv.free_page_ids(
          jnp_cfg, _state(jnp_cfg, ring, head, free, rel), page_ids, num), seq, last,
                             num_reqs=nreq)
      _assert_same(run(cfg), want, f"seed {SEED}")
      _assert_same(run(jnp_cfg), want, f"seed {SEED}")


# ---------------------------------------------------------------------------------------
# Where the kernel applies, and where the composition runs instead.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["need_sort", "debug", "token", "too_many_ids",
                                    "too_many_rows", "auto_on_cpu"])
def test_fallbacks_equal_the_composition(change):
  ps, n, rows, m = 4, 64, 8, 16
  kw = {"need_sort": True} if change == "need_sort" else {}
  jnp_cfg, cfg = _configs(ps, n, **kw)
  if change == "debug":
    jnp_cfg, cfg = (dataclasses.replace(c, debug=True) for c in (jnp_cfg, cfg))
  if change == "token":
    ps = 1
    jnp_cfg, cfg = (dataclasses.replace(c, kind="token", page_size=1, size=n)
                    for c in (jnp_cfg, cfg))
  if change == "auto_on_cpu":
    cfg = dataclasses.replace(cfg, kernel="auto")
  args, _ = _cases(ps, n, rows, m, 1, change)
  args = [a[0] for a in args]
  if change == "too_many_ids":
    big = np.zeros(triton_decode.MAX_RELEASE_IDS + 1, np.int32)
    big[:m] = args[4]
    args[4] = big
  if change == "too_many_rows":
    r = triton_decode.MAX_RELEASE_ROWS + 1
    args[6] = np.concatenate([args[6], np.zeros(r - rows, np.int32)])
    args[7] = np.concatenate([args[7], np.full(r - rows, -1, np.int32)])
  fused = jax.jit(functools.partial(_fused, cfg))
  if change == "auto_on_cpu":  # every device's branch is traced; the CPU one is lowered
    assert KERNEL_NAME not in fused.lower(*args).as_text()
  else:
    assert not _runs_kernel(fused, *args)
  if change in ("too_many_ids", "too_many_rows"):
    assert not triton_decode.release_supported(args[6].shape[0], args[4].shape[0], n)
    return  # the composition itself; running it interpreted is slow and adds nothing
  _assert_same(fused(*args), jax.jit(functools.partial(_composed, jnp_cfg))(*args))


def test_allocator_namedtuple_and_jit_without_recompiles():
  alloc = kv.paged_allocator(size=64 * 4, page_size=4, kernel="triton_interpret")
  state = alloc.init()
  state, out, ok = alloc.alloc_decode(state, jnp.ones(4, jnp.int32), jnp.full(4, -1))
  traces = []

  @jax.jit
  def step(state, ids, seq, last):
    traces.append(1)
    return alloc.release_and_alloc_decode(state, ids, seq, last)

  assert out.tolist() == [4, 8, 12, 16]
  # Pages 2 and 1 go back in that order, in front: rows 0 and 1 start pages 2 and 1.
  state, out2, ok2 = step(state, jnp.int32([2, 1]), jnp.int32([1, 1, 2, 2]), out)
  assert bool(ok) and bool(ok2)
  assert out2.tolist() == [8, 4, 13, 17]
  step(state, jnp.int32([0, 0]), jnp.int32([2, 2, 3, 3]), out2)
  assert len(traces) == 1


@pytest.mark.parametrize("bad,exc,name", [
    (dict(page_ids=np.float32([1.0])), TypeError, "page_ids"),
    (dict(page_ids=np.int32([[1]])), ValueError, "page_ids"),
    (dict(num=np.int32([1, 2])), ValueError, "num"),
    (dict(num=np.float32(1.0)), TypeError, "num"),
    (dict(num_reqs=np.int32([1])), ValueError, "num_reqs"),
    (dict(num_reqs=1.5), TypeError, "num_reqs"),
    (dict(seq_lens=np.float32([2.0, 2.0])), TypeError, "seq_lens"),
    (dict(last_loc=np.int32([1, 2, 3])), ValueError, "last_loc"),
])
def test_bad_arguments_name_the_argument(bad, exc, name):
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel="triton_interpret", debug=False)
  args = dict(page_ids=np.int32([3]), seq_lens=np.int32([2, 2]),
              last_loc=np.int32([4, 8]), num=None, num_reqs=None)
  args.update(bad)
  with pytest.raises(exc, match=name):
    kv.release_and_alloc_decode(cfg, kv.init(cfg), args["page_ids"], args["seq_lens"],
                                args["last_loc"], num=args["num"],
                                num_reqs=args["num_reqs"])


# ---------------------------------------------------------------------------------------
# Lowering for an abstract H200 (the Python side of the Triton lowering, on CPU).
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ps", (1, 64, 3))
def test_kernel_lowers_for_h200(ps):
  fn = functools.partial(pallas_kernels.release_alloc_decode_triton, page_size=ps)
  scalars = [i32()] * 3
  for rows, ids in ((2048, 8192), (37, 100), (1, 1)):
    e = lowering_check.export_for("h200", fn, i32(100_000), *scalars, i32(ids), i32(),
                                  i32(), i32(rows), i32(rows))
    assert TRITON in lowering_check.custom_call_targets(e)


@pytest.mark.parametrize("kernel", ("auto", "triton"))
def test_whole_step_is_one_launch_on_h200(kernel):
  cfg = kv.AllocatorConfig(size=4096 * 64, page_size=64, kernel=kernel, debug=False)
  state = jax.eval_shape(functools.partial(kv.init, cfg))

  def step(state, ids, seq, last, n):
    return kv.release_and_alloc_decode(cfg, state, ids, seq, last, num_reqs=n)

  e = lowering_check.export_for("h200", step, state, i32(512), i32(256), i32(256), i32())
  text = e.mlir_module()
  assert lowering_check.custom_call_targets(e).count(TRITON) == 1
  assert "stablehlo.scatter" not in text and "stablehlo.sort" not in text
  pools = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((3,) + x.shape, x.dtype),
                                 state)
  e = lowering_check.export_for("h200", jax.vmap(step), pools, i32(3, 512), i32(3, 256),
                                i32(3, 256), i32(3))
  assert lowering_check.custom_call_targets(e).count(TRITON) == 1


def test_serving_step_fused_release_equals_page_release():
  # The benchmark's release="fused" step (jax_kvalloc.tools.bench_serving) runs the same
  # loop as release="pages": identical carries after every step, rows finishing included.
  from jax_kvalloc.tools import bench_serving  # pylint: disable=g-import-not-at-top
  # Lengths of 8-48 tokens: every row finishes (and is released) within the 40 steps.
  case = bench_serving.make_case(16, 16, 40, seed=SEED % 1000, len_lo=8, len_hi=48)
  cfg = dataclasses.replace(bench_serving._config(case), kernel="triton_interpret")  # pylint: disable=protected-access
  steps = {r: jax.jit(functools.partial(bench_serving.serve_step, cfg, case.max_frees,
                                        release=r)) for r in ("pages", "fused")}
  assert _runs_kernel(steps["fused"], bench_serving.initial_carry(case))
  a = b = bench_serving.initial_carry(case)
  freed = 0
  for _ in range(40):
    freed += int(np.sum(np.asarray(a[4])))
    a, b = steps["pages"](a), steps["fused"](b)
    _assert_same(b, a, f"seed {SEED}")
  assert bool(a[5]) and freed > 0 and int(a[0].guard.status[0]) == 0   # none refused
