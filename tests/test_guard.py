"""The ownership record (SPEC 14, jax_kvalloc.guard): every free path refuses a page that
is not held, whole, with debug off; the status is sticky, names the operation, the
reason and the page, and travels with the state (jit, vmap, scan, donation, shard_map);
every kernel keeps the record bit for bit as the jnp rules do, in the launches it already
makes; guard=False is exactly the unguarded program.

tests/test_properties.py's CoreMachine drives random valid and misuse sequences through
every kernel path against the jnp path; this file holds the hand-worked vectors, each
operation's refusals, the compositions and the lowering checks.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_kvalloc as kv
import pallas_kernels
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import ranks
from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc import swa
from jax_kvalloc import swa_table
from pallas_kernels import _guard as kguard
from pallas_kernels import mosaic_gpu_common
import lowering_check

TRITON = "__gpu$xla.gpu.triton"
MOSAIC_GPU = "mosaic_gpu_v2"
# The Mosaic GPU kernels in jax's interpreter (jax >= 0.11; skipped before).
MOSAIC_GPU_INTERPRET = pytest.param(
    "mosaic_gpu_interpret", marks=pytest.mark.skipif(
        not mosaic_gpu_common.available(),
        reason=f"jax {jax.__version__} cannot build the Mosaic GPU kernels"))
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
a32 = lambda *x: jnp.asarray(x, jnp.int32)

# Jitted entry points: eager op-by-op dispatch would compile every jnp op on its own.
_jit = lambda fn, *static: jax.jit(fn, static_argnames=("config",) + static)
ALLOC = _jit(kv.alloc, "max_size")
EXTEND = _jit(kv.alloc_extend, "max_tokens")
DECODE = _jit(kv.alloc_decode)
FREE = _jit(kv.free)
PAGE_IDS = _jit(kv.free_page_ids)
SEGMENT = _jit(kv.free_segment)
RELEASE_DECODE = _jit(kv.release_and_alloc_decode)
MERGE = _jit(kv.merge_and_sort_free)

P16 = kv.AllocatorConfig(size=64, page_size=16, kernel="jnp")   # 4 pages
P4 = kv.AllocatorConfig(size=64, page_size=4, kernel="jnp")     # 16 pages, slots 4..67
TOK = kv.AllocatorConfig(size=16, page_size=1, kind="token", kernel="jnp")


def _status(state):
  return tuple(int(x) for x in np.asarray(state.guard.status))


def _lists(state):
  return st.live_free_pages(state).tolist(), st.live_release_pages(state).tolist()


def _consistent(config, state):
  """held is exactly the pages in neither list."""
  free = np.concatenate([st.live_free_pages(state), st.live_release_pages(state)])
  np.testing.assert_array_equal(np.asarray(state.guard.held),
                                guard.from_free(config.num_pages, free))


def _same_but_status(a, b):
  strip = lambda s: s._replace(guard=s.guard._replace(status=jnp.zeros(3, jnp.int32)))
  jax.tree.map(np.testing.assert_array_equal, strip(a), strip(b))


def _held(config, pages):
  s, _, ok = ALLOC(config, kv.init(config), pages * config.page_size,
                   max_size=pages * config.page_size)
  assert bool(ok)
  return s


# ---------------------------------------------------------------------------------------
# The example, and the codes the kernels repeat.
# ---------------------------------------------------------------------------------------

def test_free_of_a_slot_never_handed_out_is_refused():
  # 4 pages of 16 slots, 2 in use: SGLang's free([64]) of page 4 (never handed out)
  # raises available_size from 32 to 48 and later hands slot 64 out twice. Refused here.
  s = _held(P16, 2)
  assert int(kv.available_size(P16, s)) == 32
  s = FREE(P16, s, a32(64))
  assert int(kv.available_size(P16, s)) == 32
  assert _status(s) == (guard.OP_FREE, guard.NOT_HELD, 4)
  err = guard.error(s)
  assert isinstance(err, ValueError) and "free: page 4 is not held" in str(err)
  outs = []
  for _ in range(3):
    s, out, ok = ALLOC(P16, s, 16, max_size=16)
    outs.append(int(out[0]) if bool(ok) else None)
  assert outs == [48, 64, None]   # pages 3 and 4, then the pool is dry: nothing twice
  _consistent(P16, s)


def test_kernel_codes_are_the_references():
  assert (kguard.PAGE_ZERO, kguard.OUT_OF_RANGE, kguard.NOT_HELD, kguard.REPEATED) == (
      guard.PAGE_ZERO, guard.OUT_OF_RANGE, guard.NOT_HELD, guard.REPEATED)
  assert (mosaic_gpu_common.OUT_OF_RANGE, mosaic_gpu_common.NOT_HELD,
          mosaic_gpu_common.REPEATED) == (guard.OUT_OF_RANGE, guard.NOT_HELD,
                                          guard.REPEATED)


# ---------------------------------------------------------------------------------------
# Every free path refuses each kind of misuse whole, and frees the valid call beside it.
# ---------------------------------------------------------------------------------------

def _freed(config, pages, free_idx):
  return FREE(config, _held(config, pages), a32(*free_idx))


F, FP, FS = guard.OP_FREE, guard.OP_FREE_PAGE_IDS, guard.OP_FREE_SEGMENT
# (name, config, prepare, bad call, valid call, status): P4 with 2 pages held = pages 1, 2
# (slots 4..11).
CASES = [
    ("free_double", P4, lambda: _freed(P4, 2, [4]), lambda s: FREE(P4, s, a32(8, 5)),
     lambda s: FREE(P4, s, a32(8, 9)), (F, guard.NOT_HELD, 1)),
    ("free_never_held", P4, lambda: _held(P4, 2), lambda s: FREE(P4, s, a32(4, 20)),
     lambda s: FREE(P4, s, a32(4, 11)), (F, guard.NOT_HELD, 5)),
    ("free_page_zero", P4, lambda: _held(P4, 2), lambda s: FREE(P4, s, a32(4, 2)),
     lambda s: FREE(P4, s, a32(4, 0)), (F, guard.PAGE_ZERO, 0)),
    ("free_past_pool", P4, lambda: _held(P4, 2), lambda s: FREE(P4, s, a32(4, 68)),
     lambda s: FREE(P4, s, a32(4, 7)), (F, guard.OUT_OF_RANGE, 17)),
    ("free_negative", P4, lambda: _held(P4, 2), lambda s: FREE(P4, s, a32(-5, 4)),
     lambda s: FREE(P4, s, a32(4, 5)), (F, guard.OUT_OF_RANGE, -2)),
    ("free_released", dataclasses.replace(P4, need_sort=True),
     lambda: _freed(dataclasses.replace(P4, need_sort=True), 2, [4]),
     lambda s: FREE(dataclasses.replace(P4, need_sort=True), s, a32(5)),
     lambda s: FREE(dataclasses.replace(P4, need_sort=True), s, a32(9)),
     (F, guard.NOT_HELD, 1)),
    ("token_repeat", TOK, lambda: _held(TOK, 4), lambda s: FREE(TOK, s, a32(2, 3, 2)),
     lambda s: FREE(TOK, s, a32(2, 3, 4)), (F, guard.REPEATED, 2)),
    ("page_ids_repeat", P4, lambda: _held(P4, 3),
     lambda s: PAGE_IDS(P4, s, a32(3, 1, 3)),
     lambda s: PAGE_IDS(P4, s, a32(3, 1, 0)), (FP, guard.REPEATED, 3)),
    ("page_ids_never_held", P4, lambda: _held(P4, 2),
     lambda s: PAGE_IDS(P4, s, a32(2, 9)),
     lambda s: PAGE_IDS(P4, s, a32(2, 1)), (FP, guard.NOT_HELD, 9)),
    ("page_ids_past_num_ignored_but_negative_refused", P4, lambda: _held(P4, 2),
     lambda s: PAGE_IDS(P4, s, a32(1, -1, 9), 2),
     lambda s: PAGE_IDS(P4, s, a32(1, 2, 9), 2), (FP, guard.OUT_OF_RANGE, -1)),
    ("segment_of_a_freed_request", P4, lambda: _freed(P4, 3, [8, 9, 10, 11]),
     lambda s: SEGMENT(P4, s, a32(4, 5, 6, 7, 8, 9), 0),
     lambda s: SEGMENT(P4, s, a32(4, 5, 6, 7), 0), (FS, guard.NOT_HELD, 2)),
    ("segment_page_twice", P4, lambda: _held(P4, 3),
     lambda s: SEGMENT(P4, s, a32(8, 9, 10, 11, 8), 4),
     lambda s: SEGMENT(P4, s, a32(8, 9, 10, 11, 12), 4), (FS, guard.REPEATED, 2)),
    ("segment_page_zero", P4, lambda: _held(P4, 2),
     lambda s: SEGMENT(P4, s, a32(1, 2, 3, 4, 4), 0),
     lambda s: SEGMENT(P4, s, a32(4, 5, 6, 7), 0), (FS, guard.PAGE_ZERO, 0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_each_misuse_is_refused_whole_and_the_valid_call_is_not(case):
  _, config, prepare, bad, good, want = case
  before = prepare()
  _consistent(config, before)
  after = bad(before)
  assert _status(after) == want
  _same_but_status(after, before)   # nothing freed
  ok = good(before)
  assert _status(ok) == (0, 0, 0) and _lists(ok) != _lists(before)
  _consistent(config, ok)
  # Sticky: the first refusal stays through a later refusal and a valid call.
  again = good(bad(bad(before)))
  assert _status(again) == want


def test_status_clears_only_by_init_or_restore():
  s = _held(P4, 2)
  snap = s
  s = FREE(P4, s, a32(30))
  assert guard.error(s) is not None
  s, _, ok = ALLOC(P4, s, 8, max_size=8)
  s = MERGE(P4, s)
  assert bool(ok) and guard.error(s) is not None
  assert guard.error(snap) is None and guard.error(kv.init(P4)) is None
  with pytest.raises(guard.FreeRefusedError, match="page 7"):
    guard.raise_if_refused(s)


def test_a_refused_or_short_allocation_returns_slot_0():
  s = _held(P4, 15)
  s2, out, ok = EXTEND(P4, s, a32(0, 0), a32(3, 4), a32(-1, -1), max_tokens=8)
  assert not bool(ok) and not np.asarray(out).any() and _status(s2) == (0, 0, 0)
  s2, out, ok = DECODE(P4, s, a32(1, 1), a32(-1, -1))
  assert not bool(ok) and not np.asarray(out).any()
  _same_but_status(s2, s)


def test_release_and_alloc_decode_refused_release_refuses_the_decode():
  kernels = ("jnp", "triton_interpret") + (
      ("mosaic_gpu_interpret",) if mosaic_gpu_common.available() else ())
  for kernel in kernels:
    cfg = dataclasses.replace(P4, kernel=kernel)
    s = _held(cfg, 2)
    s2, out, ok = RELEASE_DECODE(cfg, s, a32(2, 2), a32(1, 5), a32(-1, 3))
    assert not bool(ok) and not np.asarray(out).any(), kernel
    assert _status(s2) == (guard.OP_RELEASE_AND_ALLOC_DECODE, guard.REPEATED, 2)
    _same_but_status(s2, s)
    s3, out, ok = RELEASE_DECODE(cfg, s, a32(2, 0), a32(1, 5), a32(-1, 3))
    assert bool(ok) and out.tolist() == [8, 12] and _status(s3) == (0, 0, 0), kernel
    _consistent(cfg, s3)


@pytest.mark.parametrize("kernel", ["jnp", "triton_interpret", MOSAIC_GPU_INTERPRET])
def test_request_table_release_refusal_keeps_the_rows(kernel):
  cfg = dataclasses.replace(P4, kernel=kernel)
  release = _jit(rt.release_rows)
  s, t = kv.init(cfg), rt.init_table(cfg, 4, 4)
  s, t, _, ok = _jit(rt.extend_rows, "max_tokens")(cfg, s, t, a32(0, 1), a32(6, 5),
                                                   max_tokens=16)
  assert bool(ok)
  # The caller frees row 1's first page behind the table's back, then releases row 1.
  s = PAGE_IDS(cfg, s, t.pages[1, :1])
  s2, t2, ok = release(cfg, s, t, a32(1, 0))
  assert not bool(ok) and _status(s2) == (guard.OP_RELEASE_ROWS, guard.NOT_HELD,
                                          int(t.pages[1, 0]))
  jax.tree.map(np.testing.assert_array_equal, t2, t)
  _same_but_status(s2, s)
  s3, t3, ok = release(cfg, s, t, a32(0))
  assert bool(ok) and int(t3.lens[0]) == 0 and _status(s3) == (0, 0, 0)


def test_swa_pools_keep_their_own_records():
  cfg = swa.SWAConfig(size=64, size_swa=32, page_size=4, kernel="jnp")
  free = jax.jit(functools.partial(swa.free, cfg))
  window = jax.jit(functools.partial(swa_table.window_rows, cfg))
  s, t, _, ok = jax.jit(functools.partial(swa_table.extend_rows, cfg, max_tokens=12))(
      swa.init(cfg), swa_table.init_table(cfg, 2, 4), a32(0), a32(9))
  assert bool(ok)
  slots = t.pages[0, :3, None] * 4 + jnp.arange(4)   # full pages 1, 2, 3
  # A full slot never handed out: the full pool refuses; the SWA side had nothing to free.
  s2 = free(s, a32(40))
  assert _status(s2.full) == (F, guard.NOT_HELD, 10) and _status(s2.swa) == (0, 0, 0)
  # A valid free of both pools, then the same again: the mapping is cleared, so the SWA
  # side frees nothing and the full side refuses.
  s3 = free(s, slots[0])
  assert guard.error(s3) is None
  s4 = free(s3, slots[0])
  assert _status(s4.full) == (F, guard.NOT_HELD, 1) and "full pool" in str(
      guard.error(s4))
  # The SWA pool's own record: window frees through a corrupted mapping name an SWA page
  # the pool does not hold (page 1's peer set to SWA page 7): refused, table kept.
  bad = s._replace(mapping=s.mapping.at[4].set(7 * 4))
  s5, t5, ok = window(bad, t, a32(0), a32(1))
  assert not bool(ok) and _status(s5.swa) == (guard.OP_WINDOW_ROWS, guard.NOT_HELD, 7)
  jax.tree.map(np.testing.assert_array_equal, t5, t)
  s6, t6, ok = window(s, t, a32(0), a32(1))
  assert bool(ok) and guard.error(s6) is None and int(t6.swa_from[0]) == 2


# ---------------------------------------------------------------------------------------
# Where a branch is cheap (CPU, TPU) the paged free reads the record once per distinct
# page (guard.free_by_page) and the other frees clear first (guard.free_distinct): the
# per-entry rules' bits; on a GPU, where a branch waits for the host, the rules
# themselves.
# ---------------------------------------------------------------------------------------

def _against_the_rules(run, draw, op, seed, n=24, b=16):
  """Four batches of b random records (some with a status already): run(record, *args)
  gives (the rules' result, the one checked), args = draw(rng, order) with order the
  pages of each record, held ones first. Returns the reasons of the statuses set."""
  rng = np.random.default_rng(seed)
  reasons = set()
  for _ in range(4):
    held = (rng.random((b, n + 1)) < 0.7).astype(np.int32)
    held[:, 0] = 0
    status = np.where(rng.random((b, 1)) < 0.25, [[op, guard.NOT_HELD, 9]], 0)
    order = np.argsort(rng.random((b, n + 1)) + 2 * (held == 0), 1)
    record = guard.GuardState(jnp.asarray(held), jnp.asarray(status, jnp.int32))
    want, got = run(record, *draw(rng, order))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    reasons |= set(np.asarray(want[0].status)[status[:, 0] == 0, 1].tolist())
  return reasons


def _mostly(rng, good, junk):
  """good, with junk in about 10% of the entries of half the rows and 60% of the rest."""
  rows = rng.random((good.shape[0], 1)) < 0.5
  return np.where(rng.random(good.shape) < 0.9 - 0.5 * rows, good, junk)


@pytest.mark.parametrize("method", freeing.XLA_METHODS)
def test_paged_free_by_page_equals_the_per_entry_rules(method):
  ps, n, m = 4, 24, 20

  def both(record, x, also):
    pages = jnp.where(x >= 0, x // ps, 0)
    values, _, ids, stray, marks = freeing._sorted_unique(pages, n, method, x != 0)
    return (guard.free(record, F, x // ps, x != 0, distinct=False, also_refuse=also),
            guard.free_by_page(record, F, x, values, ids, stray, marks, page_size=ps,
                               also_refuse=also))

  def draw(rng, order):   # slots of held pages, mostly (two of one page: one page)
    good = order[:, :m] * ps + rng.integers(0, ps, (order.shape[0], m))
    junk = rng.choice([0, 0, 1, 3, -1, -7, (n + 1) * ps, 5 * ps], good.shape)
    return (jnp.asarray(_mostly(rng, good, junk), jnp.int32),
            jnp.asarray(rng.random(order.shape[0]) < 0.2))

  # vmap: the status branch batched, taken by some rows.
  reasons = _against_the_rules(jax.jit(jax.vmap(both)), draw, F, 5, n)
  assert reasons == {0, guard.PAGE_ZERO, guard.OUT_OF_RANGE, guard.NOT_HELD}


def test_distinct_free_equals_the_per_entry_rules():
  n, m = 24, 12
  both = lambda record, pages, given, also: (
      guard.free(record, FP, pages, given, distinct=True, also_refuse=also),
      guard.free_distinct(record, FP, pages, given, also_refuse=also))

  def draw(rng, order):   # held pages, distinct, mostly; some rows name one twice
    pages = _mostly(rng, order[:, :m], rng.choice([0, -1, -4, n + 1, n + 7, 3, 5],
                                                  (order.shape[0], m)))
    twice = rng.random(order.shape[0]) < 0.2
    pages[twice, -1] = pages[twice, 0]
    given = ((pages != 0) | (rng.random(pages.shape) < 0.3)) & (
        rng.random(pages.shape) < 0.95)
    return (jnp.asarray(pages, jnp.int32), jnp.asarray(given),
            jnp.asarray(rng.random(order.shape[0]) < 0.2))

  reasons = _against_the_rules(jax.jit(jax.vmap(both)), draw, FP, 6, n)
  assert reasons == {0, guard.PAGE_ZERO, guard.OUT_OF_RANGE, guard.NOT_HELD,
                     guard.REPEATED}


@pytest.mark.parametrize("op", ["free", "free_page_ids", "token_free"])
def test_frees_branch_only_where_a_branch_is_cheap(op):
  cfg = (kv.AllocatorConfig(size=4096, page_size=1, kind="token", kernel="jnp")
         if op == "token_free" else
         kv.AllocatorConfig(size=4096 * 16, page_size=16, kernel="jnp"))
  state = jax.eval_shape(functools.partial(kv.init, cfg))
  fn = functools.partial(kv.free_page_ids if op == "free_page_ids" else kv.free, cfg)
  gpu = lowering_check.export_for("h200", fn, state, i32(512)).mlir_module()
  tpu = lowering_check.export_for("tpu_v6e", fn, state, i32(512)).mlir_module()
  cpu = jax.jit(fn).lower(state, i32(512)).as_text()
  assert "stablehlo.case" not in gpu
  assert tpu.count("stablehlo.case") == cpu.count("stablehlo.case") == 1


# ---------------------------------------------------------------------------------------
# The kernels keep the record as the jnp rules do (the random sequences are
# tests/test_properties.py's CoreMachine); their paged free over many programs.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [(16, 8)])
def test_free_kernel_across_programs_equals_the_rules(blocks, monkeypatch):
  from pallas_kernels import triton_free  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(triton_free, "SLOT_BLOCK", blocks[0])
  monkeypatch.setattr(triton_free, "PAGE_BLOCK", blocks[1])
  ps, n, m = 4, 40, 60
  cfg = kv.AllocatorConfig(size=n * ps, page_size=ps, kernel="triton_interpret")
  rng = np.random.default_rng(11)
  s = _held(cfg, 30)
  kernel = jax.jit(functools.partial(freeing.PAGED_FREE["triton_interpret"], cfg))
  ref = jax.jit(functools.partial(freeing.PAGED_FREE["sort"], cfg))
  held = np.arange(1, 31)
  for k in range(6):
    slots = rng.choice(held, m) * ps + rng.integers(0, ps, m)
    slots[rng.random(m) < 0.3] = 0
    if k % 2:  # one bad slot, late in the vector (another program finds it)
      slots[int(rng.integers(m // 2, m))] = int(rng.choice([2, 35 * ps, -9, 200]))
    x = jnp.asarray(slots, jnp.int32)
    got, want = kernel(s, x), ref(s, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert (guard.error(want) is not None) == bool(k % 2), k


# ---------------------------------------------------------------------------------------
# The status travels with the state: jit, vmap, scan, donation, shard_map.
# ---------------------------------------------------------------------------------------

def test_status_survives_vmap_scan_and_donation():
  s = _held(P4, 4)

  def step(state, x):
    state = kv.free(P4, state, x)
    state, out, _ = kv.alloc(P4, state, 4, max_size=4)
    return state, out

  xs = a32(4, 30, 8)[:, None]  # the second free is refused; the loop goes on
  final, outs = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(s, xs)
  assert _status(final) == (F, guard.NOT_HELD, 7) and outs[:, 0].tolist() == [4, 20, 8]
  _consistent(P4, final)
  copy = jax.tree.map(jnp.copy, final)  # donated: its buffers are gone afterwards
  donated = jax.jit(functools.partial(kv.free, P4), donate_argnums=0)(copy, a32(20))
  assert _status(donated) == (F, guard.NOT_HELD, 7)   # sticky through donation
  pools = ranks.stack_ranks([s, s, s])
  out = jax.jit(jax.vmap(functools.partial(kv.free, P4)))(pools,
                                                          a32(4, 40, 5).reshape(3, 1))
  assert np.asarray(out.guard.status)[:, 0].tolist() == [0, F, 0]
  assert "rank 1" in str(guard.error(out))


def test_ranks_over_a_mesh_refuse_per_rank():
  devices = np.array(jax.devices()[:2])
  if devices.size < 2:
    pytest.skip("needs 2 devices")
  mesh = jax.sharding.Mesh(devices, ("dp",))
  cfg = kv.AllocatorConfig(size=4 * 64, page_size=4, kernel="jnp")
  r = kv.ranks_allocator(cfg, 4, mesh=mesh, axis_name="dp")
  s = r.init()
  s, _, ok = r.alloc(s, a32(8, 8, 8, 8), max_size=8)
  s = r.free(s, a32(4, 4, 40, 8).reshape(4, 1))   # rank 2: page 10, never handed out
  assert np.asarray(s.guard.status)[:, 0].tolist() == [0, 0, F, 0]
  assert "rank 2" in str(guard.error(s))
  assert ranks.collectives_in(r.free.lower(s, a32(0, 0, 0, 0).reshape(4, 1))
                              .compile().as_text()) == {}


def test_checkify_names_the_refusal():
  def step(state, x):
    state = kv.free(P4, state, x)
    guard.checkify_check(state)
    return state
  err, _ = checkify.checkify(jax.jit(step))(_held(P4, 2), a32(4))
  assert err.get() is None
  err, _ = checkify.checkify(jax.jit(step))(_held(P4, 2), a32(44))
  assert "op 4, why 3, page 11" in err.get()


# ---------------------------------------------------------------------------------------
# guard=False: no record, the unguarded program; the kernels' extra operands only with it.
# ---------------------------------------------------------------------------------------

def test_guard_off_carries_and_traces_nothing():
  off = dataclasses.replace(P4, guard=False, kernel="triton_interpret")
  on = dataclasses.replace(off, guard=True)
  s = kv.init(off)
  assert s.guard is None and len(jax.tree.leaves(s)) == 6
  held_shape = f"i32[{off.num_pages + 1}]"
  rows = jnp.zeros(4, jnp.int32)
  fns = [lambda c, s: kv.alloc_decode(c, s, rows, rows),
         lambda c, s: kv.alloc_extend(c, s, rows, rows, rows, max_tokens=16),
         lambda c, s: kv.free(c, s, rows),
         lambda c, s: kv.free_page_ids(c, s, rows),
         lambda c, s: kv.release_and_alloc_decode(c, s, rows, rows, rows)]
  for fn in fns:
    assert held_shape not in str(jax.make_jaxpr(functools.partial(fn, off))(s))
    assert held_shape in str(jax.make_jaxpr(functools.partial(fn, on))(kv.init(on)))
  # Junk is ignored, as before the record existed.
  s = FREE(off, s, a32(2, 200, -4))
  assert _lists(s) == _lists(kv.init(off))
  with pytest.raises(ValueError, match="ownership record"):
    kv.free(on, s, rows)   # a state without its record under a guarded config


# ---------------------------------------------------------------------------------------
# Lowering: every guarded GPU path in the launches it makes without the record; the
# Mosaic path for an abstract TPU.
# ---------------------------------------------------------------------------------------

def _launches(config, fn, *specs, target=TRITON):
  state = jax.eval_shape(functools.partial(kv.init, config))
  e = lowering_check.export_for("h200", functools.partial(fn, config), state, *specs)
  text = e.mlir_module()
  return (lowering_check.custom_call_targets(e).count(target),
          text.count("stablehlo.scatter") + text.count("stablehlo.gather"),
          text.count("#stablehlo.output_operand_alias<"))


@pytest.mark.parametrize("ps", [16])
def test_guarded_gpu_paths_make_the_same_launches(ps):
  on = kv.AllocatorConfig(size=4096 * ps, page_size=ps, kernel="triton")
  off = dataclasses.replace(on, guard=False)
  b, big = 256, 4096
  cases = {
      "decode": (lambda c, s, q, l: kv.alloc_decode(c, s, q, l), (i32(b), i32(b)), 1, 1),
      "extend": (lambda c, s, p, q, l: kv.alloc_extend(c, s, p, q, l, max_tokens=4096),
                 (i32(b), i32(b), i32(b)), 1, 1),
      # Past extend_fused_preferred: XLA's prefix sums around the contract kernel, which
      # marks the pages itself.
      "extend_contract": (lambda c, s, p, q, l: kv.alloc_extend(c, s, p, q, l,
                                                                 max_tokens=2**18),
                          (i32(big), i32(big), i32(big)), 1, 1),
      "free": (kv.free, (i32(8192),), 3, 2),
      "release_decode": (lambda c, s, i, q, l: kv.release_and_alloc_decode(c, s, i, q, l),
                         (i32(512), i32(b), i32(b)), 1, 2),
  }
  for name, (fn, specs, launches, more_aliases) in cases.items():
    g, x, a = _launches(on, fn, *specs)
    g0, x0, a0 = _launches(off, fn, *specs)
    assert g == g0 == launches and x == x0, name   # no XLA scatter or gather more
    assert name == "extend_contract" or x == 0, name
    assert a == a0 + more_aliases, name            # the record, in place


@pytest.mark.skipif(not mosaic_gpu_common.available(),
                    reason=f"jax {jax.__version__} cannot build the Mosaic GPU kernels")
def test_guarded_mosaic_gpu_paths_make_the_same_launches():
  # alloc_decode and the table's decode step (release + decode) on the Mosaic GPU
  # kernels: the record in the same launch (its held, and the table's status, aliased in
  # place), no XLA scatter or gather around it.
  on = kv.AllocatorConfig(size=2048 * 16, page_size=16, kernel="mosaic_gpu")
  off = dataclasses.replace(on, guard=False)

  def serve(config, state, table, rel, seq, last, dec):
    state, out, ok = kv.alloc_decode(config, state, seq, last)
    return rt.step_rows(config, state, table, release=rel, decode=dec), out, ok

  table = jax.eval_shape(lambda: rt.init_table(on, 64, 16))
  specs = (table, i32(8), i32(64), i32(64), i32(64))
  g, x, a = _launches(on, serve, *specs, target=MOSAIC_GPU)
  g0, x0, a0 = _launches(off, serve, *specs, target=MOSAIC_GPU)
  assert g == g0 == 2 and x == x0 == 0
  assert a == a0 + 3   # held (decode), held and status (table step)


def test_guarded_table_step_lowers_for_h200_in_one_launch():
  cfg = kv.AllocatorConfig(size=2048 * 16, page_size=16, kernel="triton")
  state = jax.eval_shape(functools.partial(kv.init, cfg))
  table = jax.eval_shape(lambda: rt.init_table(cfg, 256, 16))

  def step(s, t, rel, dec):
    return rt.step_rows(cfg, s, t, release=rel, decode=dec)

  e = lowering_check.export_for("h200", step, state, table, i32(8), i32(256))
  assert lowering_check.custom_call_targets(e).count(TRITON) == 1
  assert "stablehlo.scatter" not in e.mlir_module()


def test_guarded_mosaic_path_lowers_for_tpu():
  cfg = kv.AllocatorConfig(size=4096 * 16, page_size=16, kernel="mosaic")
  state = jax.eval_shape(functools.partial(kv.init, cfg))
  fn = lambda s, p, q, l: kv.alloc_extend(cfg, s, p, q, l, max_tokens=2048)
  e = lowering_check.export_for("tpu_v6e", fn, state, i32(64), i32(64), i32(64))
  assert "tpu_custom_call" in lowering_check.custom_call_targets(e)
  e = lowering_check.export_for("tpu_v6e", functools.partial(kv.free, cfg), state, i32(512))
  assert e is not None


def test_record_kernels_lower_for_h200_at_their_largest_sizes():
  n = 70000
  held, status = i32(n + 1), i32(3)
  fn = functools.partial(pallas_kernels.release_alloc_decode_triton, page_size=16, op=7)
  e = lowering_check.export_for(
      "h200", lambda *a: fn(*a[:9], record=(a[9], a[10])), i32(n), i32(), i32(), i32(),
      i32(8192), i32(), i32(), i32(2048), i32(2048), held, status)
  assert lowering_check.custom_call_targets(e).count(TRITON) == 1
  push = functools.partial(pallas_kernels.free_push_front_triton, page_size=1, op=4)
  e = lowering_check.export_for("h200", lambda x, r, h, s: push(x, r, 0, 0, 0,
                                                                 record=(h, s)),
                                i32(2**20), i32(n), held, status)
  assert lowering_check.custom_call_targets(e).count(TRITON) == 3
