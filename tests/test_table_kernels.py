"""The request table's one-launch Triton kernel (pallas_kernels.triton_table) against the
jnp path and the loop model.

- Random pools and tables, vmapped over cases, kernel in Pallas' interpreter vs the jnp
  path (whole state, whole table, slots, ok) for release_rows, extend_rows, decode_rows
  and step_rows (vs the jnp composition). Dead ring entries and dead table entries
  (columns past a row's pages) hold poison, so a stray read or write shows. The cases
  draw: borrowed prefixes, full rows, empty rows, rings that wrap, free lists short by
  one page or exactly enough, repeated rows, rows outside the table, num_rows cutting
  the rows, negative n, n past the row's capacity, more tokens than max_tokens, a
  release cut to the room left, and a table a caller has broken (an owned page already
  free, named by two rows, outside the pool, or 0), so that the ownership record's
  refusals and status (SPEC 14) are compared too. A fresh seed per run (JAX_KVALLOC_TEST_SEED repeats one).
- The random workload of tests/test_request_table.py (ModelTable over tests/model.py)
  with the kernel, poisoning the dead entries after every operation.
- Lowered for an abstract H200: each operation and step_rows hold the stated number of
  Triton custom calls and no XLA scatter or gather.
- The borrows (pallas_kernels.triton_borrow: borrow_pages, borrow_from_rows with and
  without hand_over) against the jnp path on random tables with every refusal drawn, and
  lowered for an abstract H200 (one launch, the table aliased in and out).
tests/test_pallas_gpu.py runs `check_table_ops` on the compiled kernel; the `gpu` tests
at the end run the compiled table and borrow kernels.
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
from jax_kvalloc import kernels
from jax_kvalloc import request_table as rt
import lowering_check
from pallas_kernels import triton_borrow
from pallas_kernels import triton_table
import test_request_table as trt
from model import ModelAllocator
from gpu import needs_gpu

KERNEL_NAME = "jax_kvalloc_table_step_triton"
KERNEL_NAMES = {"triton": KERNEL_NAME, "mosaic_gpu": "jax_kvalloc_table_step_mosaic_gpu"}
TRITON = lowering_check.TRITON_CUSTOM_CALL
POISON = 1_000_000
SEED = int(os.environ.get("JAX_KVALLOC_TEST_SEED",
                          np.random.SeedSequence().entropy % 2**32))
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)


def _rng(*key):
  return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _cdiv(a, b):
  return -(-a // b)


# ---------------------------------------------------------------------------------------
# Random pools and tables.
# ---------------------------------------------------------------------------------------

def table_case(rng, ps, n, max_reqs, width):
  """A consistent pool and table with poisoned dead entries, as host arrays:
  (ring, head, free_len, release_len, pages, lens, owned_from)."""
  perm = list((rng.permutation(n) + 1).astype(np.int32))
  pages = (POISON + rng.integers(0, 1000, (max_reqs, width))).astype(np.int32)
  pages[rng.random((max_reqs, width)) < 0.1] = -7
  lens = np.zeros(max_reqs, np.int32)
  owned = np.zeros(max_reqs, np.int32)
  for r in range(max_reqs):
    kind = trt_pick(rng, {"empty": 2, "own": 5, "borrow": 2, "full": 1})
    if kind == "empty":
      continue
    length = width * ps if kind == "full" else int(rng.integers(1, width * ps + 1))
    need = _cdiv(length, ps)
    k = 0
    lenders = [q for q in range(r) if lens[q] >= ps and owned[q] == 0]
    if kind == "borrow" and lenders:
      q = int(rng.choice(lenders))
      k = int(rng.integers(1, min(lens[q] // ps, need) + 1))
      pages[r, :k] = pages[q, :k]
      length = max(length, k * ps)
    if need - k > len(perm):
      continue
    pages[r, k:need] = [perm.pop() for _ in range(need - k)]
    lens[r], owned[r] = length, k
  free = int(rng.integers(0, len(perm) + 1)) if rng.random() < 0.7 else len(perm)
  head = int(rng.integers(0, n))
  ring = (POISON + np.arange(n)).astype(np.int32)
  ring[(head + np.arange(free)) % n] = perm[:free]
  rel = int(rng.integers(0, n - free + 1)) if rng.random() < 0.15 else 0
  return (ring, np.int32(head), np.int32(free), np.int32(rel), pages, lens, owned)


MISUSE = 0.2  # cases whose table a caller has broken (the ownership record's refusals)


def misuse(rng, ps, case, released, sure=False):
  """One owned column broken in place, as a misbehaving caller leaves a table (SPEC 14),
  most often in a row of `released` (the real release rows): its page freed behind the
  table's back (on the free list: not held, so a release of the row is refused, and the
  page may go to another row), the page of another owned column (named twice when both
  rows are released), a page outside the pool, or 0 (padding: skipped, not refused).
  sure: only a break of a released row that the release must refuse (the rows valid);
  returns whether one was made."""
  ring, head, free, _, pages, lens, owned = case
  n, max_reqs = ring.shape[0], lens.shape[0]
  cols = [(r, j) for r in range(max_reqs) for j in range(owned[r], _cdiv(lens[r], ps))]
  hit = [(r, j) for r, j in cols if r in set(released.tolist())]
  pick = lambda among: among[int(rng.integers(0, len(among)))]
  if sure:
    valid = (len(set(released.tolist())) == len(released)
             and ((released >= 0) & (released < max_reqs)).all())
    kinds = {"freed": free > 0, "twice": len(hit) > 1, "outside": True}
    kinds = {k: 1 for k, ok in kinds.items() if ok}
    if not (valid and hit):
      return False
    kind, among = trt_pick(rng, kinds), hit
  else:
    if not cols:
      return False
    kind = trt_pick(rng, {"freed": 3, "twice": 3, "outside": 1, "zero": 1})
    among = hit if hit and rng.random() < 0.8 else cols
  r, j = pick(among)
  if kind == "freed" and free:
    ring[(head + int(rng.integers(0, free))) % n] = pages[r, j]
  elif kind == "twice":
    q, k = pick([c for c in among if c != (r, j)] or among)
    pages[r, j] = pages[q, k]
  elif kind == "outside":
    pages[r, j] = rng.choice([-3, n + 1, n + 9, POISON])
  elif kind == "zero":
    pages[r, j] = 0
  return True


def trt_pick(rng, weights):
  names = list(weights)
  p = np.array([weights[k] for k in names], float)
  return names[rng.choice(len(names), p=p / p.sum())]


def _rows(rng, max_reqs, b):
  """i32[b] rows (distinct, in random order) and a num_rows; sometimes a repeat or a
  row outside the table among the real ones."""
  rows = rng.permutation(max(max_reqs, b))[:b].astype(np.int32) % max_reqs
  num = b if rng.random() < 0.5 else int(rng.integers(-1, b + 2))
  real = max(0, min(num, b))
  u = rng.random()
  if u < 0.08 and real >= 2:
    rows[int(rng.integers(1, real))] = rows[0]
  elif u < 0.12 and real >= 1:
    rows[int(rng.integers(0, real))] = rng.choice([-1, max_reqs, 2**31 - 1])
  return rows, np.int32(num)


def ops_case(rng, ps, width, max_reqs, rel_b, ext_b, dec_b):
  rel, nrel = _rows(rng, max_reqs, rel_b)
  ext, next_ = _rows(rng, max_reqs, ext_b)
  n = rng.integers(0, 3 * ps + 5, ext_b).astype(np.int32)
  u = rng.random()
  if u < 0.08:
    n[int(rng.integers(0, ext_b))] = -1
  elif u < 0.16:
    n[int(rng.integers(0, ext_b))] = width * ps
  dec, ndec = _rows(rng, max_reqs, dec_b)
  return rel, nrel, ext, n, next_, dec, ndec


def _stack(cases):
  return tuple(np.stack(x) for x in zip(*cases))


def make_cases(ps, n, max_reqs, width, count, tag, rel_b=4, ext_b=4, dec_b=None,
               refused_first=False):
  """count cases (a pool and table, then the rows of each phase), stacked; a broken
  table (`misuse`) in about MISUSE of them, and in the first one a release that the
  ownership record must refuse when refused_first."""
  rng = _rng(tag, ps, n, max_reqs, width)
  dec_b = dec_b or max_reqs
  cases = []
  while len(cases) < count:
    case = table_case(rng, ps, n, max_reqs, width)
    ops = ops_case(rng, ps, width, max_reqs, rel_b, ext_b, dec_b)
    released = ops[0][:max(0, int(ops[1]))]
    if refused_first and not cases:
      if not misuse(rng, ps, case, released, sure=True):
        continue  # drawn again
    elif rng.random() < MISUSE:
      misuse(rng, ps, case, released)
    cases.append(case + ops)
  return _stack(cases)


def _pool_table(cfg, ring, head, free, rel, pages, lens, owned):
  state = kv.init(cfg)._replace(free_ring=ring, free_head=head, free_len=free,
                                release_len=rel)
  if state.guard is not None:  # the ownership record agrees: pages off the free list held
    n = cfg.num_pages
    live = ((jnp.arange(n) - head) % n) < free
    held = jnp.ones(n + 1, jnp.int32).at[0].set(0).at[jnp.where(live, ring, n + 1)].set(
        0, mode="drop")
    state = state._replace(guard=state.guard._replace(held=held))
  return state, rt.RequestTable(pages, lens, owned)


def _op_fns(cfg, max_tokens):
  """Each operation on one case (the args of make_cases)."""
  def unpack(args):
    state, table = _pool_table(cfg, *args[:7])
    return (state, table) + tuple(args[7:])

  def release(*args):
    s, t, rel, nrel, *_ = unpack(args)
    return rt.release_rows(cfg, s, t, rel, num_rows=nrel)

  def extend(*args):
    s, t, _, _, ext, n, next_, *_ = unpack(args)
    return rt.extend_rows(cfg, s, t, ext, n, max_tokens=max_tokens, num_rows=next_)

  def decode(*args):
    s, t, *_, dec, ndec = unpack(args)
    return rt.decode_rows(cfg, s, t, dec, num_rows=ndec)

  def step(*args):
    s, t, rel, nrel, ext, n, next_, dec, ndec = unpack(args)
    return rt.step_rows(cfg, s, t, release=rel, num_release=nrel, extend=ext, n=n,
                        num_extend=next_, max_tokens=max_tokens, decode=dec,
                        num_decode=ndec)

  def decode_step(*args):
    s, t, rel, nrel, *_, dec, ndec = unpack(args)
    return rt.step_rows(cfg, s, t, release=rel, num_release=nrel, decode=dec,
                        num_decode=ndec)

  return dict(release=release, extend=extend, decode=decode, step=step,
              decode_step=decode_step)


def _configs(ps, n, kernel="pallas_interpret"):
  jnp_cfg = kv.AllocatorConfig(size=n * ps, page_size=ps, kernel="jnp", debug=False)
  return jnp_cfg, dataclasses.replace(jnp_cfg, kernel=kernel)


def _kernel_name(kernel):
  """The table kernel's name in a jaxpr of `kernel`'s step ("auto" as resolved here)."""
  family = kernels.family(kernels.resolve(kernel, "table"))[0]
  return KERNEL_NAMES["mosaic_gpu" if family == "mosaic_gpu" else "triton"]


def _assert_same(a, b, msg):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb), msg
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=msg)


def check_table_ops(ps, n, max_reqs, width, count, tag, kernel="pallas_interpret",
                    ops=("release", "extend", "decode", "step", "decode_step"),
                    max_tokens=None, records=None, **sizes):
  """Every operation through the kernel == the jnp path, bit for bit (the ownership
  record's held and status included), on random cases (vmapped; `make_cases`' sizes).
  Returns how many cases each op refused (to check the draw); `records`, a dict, gets
  how many cases each op's record refused (status set)."""
  jnp_cfg, cfg = _configs(ps, n, kernel)
  max_tokens = max_tokens or 8 * ps + 16
  args = make_cases(ps, n, max_reqs, width, count, tag, **sizes)
  got_fns, want_fns = _op_fns(cfg, max_tokens), _op_fns(jnp_cfg, max_tokens)
  name = _kernel_name(kernel)
  refused = {}
  for op in ops:
    fn = jax.jit(jax.vmap(got_fns[op]))
    assert name in str(jax.make_jaxpr(fn)(*args)), op
    got = fn(*args)
    want = jax.jit(jax.vmap(want_fns[op]))(*args)
    _assert_same(got, want, f"seed {SEED}, {tag}, ps {ps}, {op}")
    oks = [np.asarray(x) for x in jax.tree_util.tree_leaves(want) if x.dtype == bool]
    refused[op] = int(np.sum(~np.all(np.stack(oks), axis=0)))
    if records is not None:
      records[op] = int(np.sum(np.asarray(want[0].guard.status)[:, 0] != 0))
  return refused


# The default set runs the whole step (all three phases in one launch) at page size 4;
# every operation alone and the decode step at page sizes 1, 3 and 64 are slow tests
# (page size 16: test_kernel_equals_jnp_path_larger).
ALL_OPS = ("release", "extend", "decode", "step", "decode_step")
RELEASING = ("release", "step", "decode_step")


@pytest.mark.parametrize("ps,ops", [(4, ("step",))] + [
    pytest.param(ps, ALL_OPS, marks=pytest.mark.slow) for ps in (1, 3, 64)])
def test_kernel_equals_jnp_path(ps, ops):
  records = {}
  # Page size 1: 8 rows of up to 6 pages fit in 56 pages (40 refuse nearly every case).
  refused = check_table_ops(ps, 40 if ps > 1 else 56, 8, 6, 32, "small", ops=ops,
                            records=records, refused_first=True)
  # Both outcomes were drawn for every operation; the record refused a release.
  assert all(0 < k < 32 for k in refused.values()), (SEED, refused)
  assert all(records[op] >= 1 for op in ops if op in RELEASING), (SEED, records)


@pytest.mark.slow
def test_kernel_equals_jnp_path_larger():
  # Non-power-of-two widths and batches, more rows than one extend tile's search.
  check_table_ops(16, 300, 37, 11, 6, "larger", rel_b=9, ext_b=19, dec_b=37,
                  max_tokens=700)


@pytest.mark.slow  # op by op in Pallas' interpreter
def test_hand_worked_step():
  # test_request_table.test_hand_worked_ps4's first steps, through step_rows.
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel="pallas_interpret", debug=False)
  state, table = kv.init(cfg), rt.init_table(cfg, 4, 8)
  state, table, out = rt.step_rows(cfg, state, table, extend=jnp.array([0, 1]),
                                   n=jnp.array([6, 3]), max_tokens=16,
                                   decode=jnp.array([0, 1]))
  assert out.release_ok is None and bool(out.extend_ok) and bool(out.decode_ok)
  np.testing.assert_array_equal(out.extend_slots[:9], [4, 5, 6, 7, 8, 9, 12, 13, 14])
  np.testing.assert_array_equal(out.decode_slots, [10, 15])
  np.testing.assert_array_equal(table.pages[:2, :3], [[1, 2, 0], [3, 0, 0]])
  # Release row 1 (page 3 to the front), extend row 1 by 5 (pages 3, 4), decode 0, 1:
  # row 0 at 7 -> 8 tokens ends page 2 (slot 11); row 1 at 5 -> 6 continues (17).
  state, table, out = rt.step_rows(cfg, state, table, release=jnp.array([1]),
                                   extend=jnp.array([1]), n=jnp.array([5]), max_tokens=8,
                                   decode=jnp.array([0, 1]))
  assert bool(out.release_ok) and bool(out.extend_ok) and bool(out.decode_ok)
  np.testing.assert_array_equal(out.extend_slots, [12, 13, 14, 15, 16, 0, 0, 0])
  np.testing.assert_array_equal(out.decode_slots, [11, 17])
  np.testing.assert_array_equal(table.pages[:2, :3], [[1, 2, 0], [3, 4, 0]])
  np.testing.assert_array_equal(table.lens[:2], [8, 6])


# ---------------------------------------------------------------------------------------
# The loop model, with poison after every operation.
# ---------------------------------------------------------------------------------------

@pytest.mark.slow  # six operations compiled in Pallas' interpreter per page size
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_random_workload_matches_model(ps):
  cfg = dataclasses.replace(trt._config(ps, False, "paged"), kernel="pallas_interpret",  # pylint: disable=protected-access
                            debug=False)
  fns = trt._jitted(cfg)  # pylint: disable=protected-access
  rng = _rng("workload", ps)
  model = trt.ModelTable(ModelAllocator(cfg.size, ps, False, "paged"), trt.MAX_REQS,
                         trt.MAX_PAGES)
  state, table = kv.init(cfg), rt.init_table(cfg, trt.MAX_REQS, trt.MAX_PAGES)
  lenders = {}
  for _ in range(60):
    op = trt._random_op(rng, cfg, model, lenders)  # pylint: disable=protected-access
    got = trt._apply_jax(fns, state, table, op)  # pylint: disable=protected-access
    want = trt._apply_model(model, op, fns["max_tokens"], lenders)  # pylint: disable=protected-access
    trt._compare_result(op, got, want)  # pylint: disable=protected-access
    if op[0] != "admit":
      state, table = got[0], got[1]
    _check_live(cfg, state, table, model)
    state, table = _poisoned(rng, cfg, state, table)


def _check_live(cfg, state, table, model):
  """test_request_table._check_same on the live entries only (the dead ones are poison)."""
  used = _cdiv(np.asarray(table.lens), cfg.page_size)
  live = np.arange(table.pages.shape[1])[None, :] < used[:, None]
  trt._check_same(cfg, state, table._replace(  # pylint: disable=protected-access
      pages=jnp.where(live, table.pages, 0)), model)


def _poisoned(rng, cfg, state, table):
  """The same pool and table with every dead ring entry and every table entry past a
  row's pages replaced by garbage."""
  ring = np.asarray(state.free_ring).copy()
  n = ring.shape[0]
  dead = np.ones(n, bool)
  dead[(int(state.free_head) + np.arange(int(state.free_len))) % n] = False
  ring[dead] = POISON + rng.integers(0, 1000, int(dead.sum()))
  pages = np.asarray(table.pages).copy()
  used = _cdiv(np.asarray(table.lens), cfg.page_size)
  past = np.arange(pages.shape[1])[None, :] >= used[:, None]
  pages[past] = POISON + rng.integers(0, 1000, int(past.sum()))
  return (state._replace(free_ring=jnp.asarray(ring)),
          table._replace(pages=jnp.asarray(pages)))


def check_scan_of_steps(kernel, steps, tag):
  """test_request_table's serving program, each step one step_rows call inside lax.scan,
  against the loop model (page size 16)."""
  ps = 16
  cfg = dataclasses.replace(trt._config(ps, False, "paged"), kernel=kernel, debug=False)  # pylint: disable=protected-access
  max_tokens = 4 * ps + 8
  prog = trt._scan_program(_rng(tag), ps, steps)  # pylint: disable=protected-access
  xs = jax.tree.map(jnp.asarray, trt._scan_xs(prog))  # pylint: disable=protected-access

  def step(carry, x):
    state, table, out = rt.step_rows(
        cfg, *carry, release=x["rel"], num_release=x["n_rel"], extend=x["ext"], n=x["n"],
        num_extend=x["n_ext"], max_tokens=max_tokens, decode=x["dec"],
        num_decode=x["n_dec"])
    return (state, table), (out.extend_slots, out.extend_ok, out.decode_slots,
                            out.decode_ok)

  run = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))
  init = (kv.init(cfg), rt.init_table(cfg, trt.MAX_REQS, trt.MAX_PAGES))
  assert _kernel_name(kernel) in str(jax.make_jaxpr(run)(init, xs))
  (state, table), ys = run(init, xs)
  model, outs = trt._model_program(cfg, prog, max_tokens)  # pylint: disable=protected-access
  trt._check_program(outs, ys)  # pylint: disable=protected-access
  trt._check_same(cfg, state, table, model)  # pylint: disable=protected-access


@pytest.mark.slow  # a scan of step_rows in Pallas' interpreter
def test_scan_of_steps_matches_model():
  check_scan_of_steps("pallas_interpret", 40, "scan")


# ---------------------------------------------------------------------------------------
# Where the kernel applies; arguments.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["need_sort", "debug", "token", "too_many_rows",
                                    "auto_on_cpu"])
def test_fallbacks_take_the_composition(change):
  ps, n = (1, 40) if change == "token" else (4, 40)
  _, cfg = _configs(ps, n)
  if change == "need_sort":
    cfg = dataclasses.replace(cfg, need_sort=True)
  if change == "debug":
    cfg = dataclasses.replace(cfg, debug=True)
  if change == "token":
    cfg = dataclasses.replace(cfg, kind="token")
  if change == "auto_on_cpu":
    cfg = dataclasses.replace(cfg, kernel="auto")
  rows = triton_table.MAX_DECODE_ROWS + 1 if change == "too_many_rows" else 4
  state, table = kv.init(cfg), rt.init_table(cfg, max(rows, 8), 4)
  # (Too many decode rows: the composition, whose 2-row release is a launch of its own.)
  release = (lambda r: None) if change == "too_many_rows" else (lambda r: r[:2])
  step = jax.jit(lambda s, t, r: rt.step_rows(cfg, s, t, release=release(r), decode=r))
  rows_arg = jnp.arange(rows, dtype=jnp.int32)
  if change == "auto_on_cpu":
    assert KERNEL_NAME not in step.lower(state, table, rows_arg).as_text()
  else:
    assert KERNEL_NAME not in str(jax.make_jaxpr(step)(state, table, rows_arg))


def test_step_rows_arguments():
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel="pallas_interpret", debug=False)
  state, table = kv.init(cfg), rt.init_table(cfg, 4, 8)
  with pytest.raises(ValueError, match="n must be given"):
    rt.step_rows(cfg, state, table, extend=jnp.array([0]), max_tokens=4)
  with pytest.raises(TypeError, match="rows must hold integers"):
    rt.step_rows(cfg, state, table, decode=jnp.array([0.0]))
  with pytest.raises(ValueError, match="differ in length"):
    rt.step_rows(cfg, state, table, extend=jnp.array([0, 1]), n=jnp.array([1]),
                 max_tokens=4)
  s, t, out = rt.step_rows(cfg, state, table)  # no phase: nothing changes
  assert out == rt.StepOutputs(None, None, None, None, None)
  _assert_same((s, t), (state, table), "empty step")


# ---------------------------------------------------------------------------------------
# Lowered for an abstract H200.
# ---------------------------------------------------------------------------------------

BS, MAX_FREES, PROMPT = 1024, 8, 256


def _h200_step(ps, which, kernel="triton"):
  cfg = kv.AllocatorConfig(size=(BS * 20 + 8) * ps, page_size=ps, kernel=kernel,
                           debug=False)
  width = _cdiv(1024 + PROMPT + 1, ps)
  state = jax.eval_shape(functools.partial(kv.init, cfg))
  table = jax.eval_shape(lambda: rt.init_table(cfg, BS, width))
  max_tokens = MAX_FREES * PROMPT

  def separate(s, t, rel, nrel, n, dec):
    s, t, ok1 = rt.release_rows(cfg, s, t, rel, num_rows=nrel)
    outs = (ok1,)
    if which == "extend":
      s, t, e, ok2 = rt.extend_rows(cfg, s, t, rel, n, max_tokens=max_tokens,
                                    num_rows=nrel)
      outs += (e, ok2)
    s, t, d, ok3 = rt.decode_rows(cfg, s, t, dec)
    return s, t, outs + (d, ok3)

  def combined(s, t, rel, nrel, n, dec):
    kw = dict(extend=rel, n=n, num_extend=nrel, max_tokens=max_tokens) if (
        which == "extend") else {}
    return rt.step_rows(cfg, s, t, release=rel, num_release=nrel, decode=dec, **kw)

  specs = (state, table, i32(MAX_FREES), i32(), i32(MAX_FREES), i32(BS))
  return separate, combined, specs


def _launches(fn, specs):
  e = lowering_check.export_for("h200", fn, *specs)
  text = e.mlir_module()
  return (lowering_check.custom_call_targets(e).count(TRITON),
          text.count("stablehlo.scatter"), text.count("stablehlo.gather"))


@pytest.mark.parametrize("ps", (64, pytest.param(16, marks=pytest.mark.slow)))
def test_serving_steps_launch_counts_on_h200(ps):
  # The decode step (release <= 8 rows + decode every row): 2 launches as two calls, 1
  # as step_rows; release + extend (256 tokens each) + decode: 4 and 2 (an extend takes
  # two: the one-program table work, then its slots by a program per row). No XLA
  # scatter or gather of the table anywhere.
  for which, n_separate, n_step in (("decode", 2, 1), ("extend", 4, 2)):
    separate, combined, specs = _h200_step(ps, which)
    assert _launches(separate, specs) == (n_separate, 0, 0), (which, ps)
    assert _launches(combined, specs) == (n_step, 0, 0), (which, ps)


@pytest.mark.parametrize("ps", (3, pytest.param(1, marks=pytest.mark.slow),
                                pytest.param(128, marks=pytest.mark.slow)))
def test_kernel_lowers_for_h200(ps):
  # The largest sizes `supported` takes, and small odd ones.
  for r, w, rel, ext, tok, dec in ((2048, 8, 2048, 256, 2**16, 2048),
                                   (37, 11, 9, 19, 700, 37), (1, 1, 1, 1, 1, 1)):
    assert triton_table.supported(max_reqs=r, width=w, num_pages=70000, page_size=ps,
                                  release=rel, extend=ext, max_tokens=tok, decode=dec)

    def fn(ring, scalars, pages, lens, owned, rel_rows, ext_rows, n, dec_rows, num,
           tok=tok):
      return pallas_kernels.table_step_triton(
          ring, scalars[0], scalars[1], scalars[2], pages, lens, owned, page_size=ps,
          release=(rel_rows, num), extend=(ext_rows, n, num), max_tokens=tok,
          decode=(dec_rows, num))

    e = lowering_check.export_for("h200", fn, i32(70000), i32(3), i32(r, w), i32(r),
                                  i32(r), i32(rel), i32(ext), i32(ext), i32(dec), i32())
    assert lowering_check.custom_call_targets(e).count(TRITON) == 2  # table work, slots
    # The table program writes ring, head, length, pages, lens and owned_from in place
    # (unaliased, a scan copies its scalar outputs into the carry every step).
    assert e.mlir_module().count("#stablehlo.output_operand_alias<") == 6


@pytest.mark.slow  # lowers the jnp composition with its Mosaic kernels
def test_steps_lower_for_tpu():
  # On a TPU pool the table operations take the jnp composition (Mosaic kernels inside
  # alloc_extend / alloc_decode): they lower, with no Triton call.
  separate, combined, specs = _h200_step(16, "extend", kernel="auto")
  for fn in (separate, combined):
    e = lowering_check.export_for("tpu_v6e", fn, *specs)
    assert TRITON not in lowering_check.custom_call_targets(e)


# ---------------------------------------------------------------------------------------
# Borrows (pallas_kernels.triton_borrow): borrow_pages, borrow_from_rows.
# ---------------------------------------------------------------------------------------

BORROW_MODES = ("ids", "src", "hand_over")
BORROW_KERNEL = "jax_kvalloc_borrow_triton"


def borrow_case(rng, ps, n, max_reqs, width, b, ids_width, mode):
  """A table (table_case's, dead entries poisoned) and a borrow of b entries:
  (pages, lens, owned_from, rows, num_rows, src, page_ids, num_pages). Most destinations
  are emptied first (their pages stay poison: the borrow writes the whole row); the
  draw breaks a count (negative, past the source's whole pages or the width), a source
  (outside the table) or a page id (0, outside the pool) now and then, and hand-overs
  meet sources that repeat or borrowed their first columns."""
  _, _, _, _, pages, lens, owned = table_case(rng, ps, n, max_reqs, width)
  rows, num = _rows(rng, max_reqs, b)
  for r in rows:
    if 0 <= r < max_reqs and rng.random() < 0.9:
      lens[r], owned[r] = 0, 0
  holders = [q for q in range(max_reqs) if lens[q] >= ps and q not in set(rows.tolist())]
  holders = holders or [int(rng.integers(0, max_reqs))]
  if mode == "hand_over" and len(holders) >= b and rng.random() < 0.8:
    src = rng.permutation(holders)[:b]
  else:
    src = rng.choice(holders, b)
  src = src.astype(np.int32)
  whole = np.maximum(lens[src], 0) // ps
  if mode == "ids":
    whole = np.minimum(whole, ids_width)
  k = rng.integers(0, whole + 1).astype(np.int32)
  ids = pages[src, :ids_width].copy()
  u, i = rng.random(), int(rng.integers(0, b))
  if u < 0.05:
    k[i] = -1
  elif u < 0.1:
    k[i] = rng.choice([whole[i] + 1, width + 1])
  elif u < 0.15:
    src[i] = rng.choice([-1, max_reqs])
  elif u < 0.25 and k[i] > 0:
    bad = rng.choice([0, -3, n + 1, POISON])
    if mode == "ids":
      ids[i, int(rng.integers(0, k[i]))] = bad
    elif 0 <= src[i] < max_reqs:
      pages[src[i], int(rng.integers(0, k[i]))] = bad
  return pages, lens, owned, rows, num, src, ids, k


def _borrow_fn(cfg, mode):
  def fn(pages, lens, owned, rows, num, src, ids, k):
    table = rt.RequestTable(pages, lens, owned)
    state = kv.init(cfg)._replace(guard=None)  # the table kernels alone: no record
    if mode == "ids":
      return rt.borrow_pages(cfg, state, table, rows, ids, k, num_rows=num)
    return rt.borrow_from_rows(cfg, state, table, rows, src, k, num_rows=num,
                               hand_over=mode == "hand_over")
  return fn


def check_borrows(ps, n, max_reqs, width, count, b, tag, kernel="triton_interpret",
                  ids_width=None, modes=BORROW_MODES):
  """borrow_pages ("ids") and borrow_from_rows ("src", "hand_over") through the kernel ==
  the jnp path, bit for bit, on `count` random cases each (vmapped). Returns the
  refusals per mode."""
  jnp_cfg, cfg = _configs(ps, n, kernel)
  ids_width = ids_width or max(1, width - 2)
  refused = {}
  for mode in modes:
    rng = _rng("borrow", tag, mode, ps, n, max_reqs, width, b)
    args = _stack([borrow_case(rng, ps, n, max_reqs, width, b, ids_width, mode)
                   for _ in range(count)])
    fn = jax.jit(jax.vmap(_borrow_fn(cfg, mode)))
    assert BORROW_KERNEL in str(jax.make_jaxpr(fn)(*args)), mode
    want = jax.jit(jax.vmap(_borrow_fn(jnp_cfg, mode)))(*args)
    _assert_same(fn(*args), want, f"seed {SEED}, {tag}, ps {ps}, {mode}")
    refused[mode] = int(np.sum(~np.asarray(want[1])))
  return refused


# The default set: borrow_pages and the hand-over (borrow_from_rows' superset) at page
# size 4, in passes of two columns; every mode at page sizes 1, 3 and 64 is slow.
@pytest.mark.parametrize("ps,lanes,modes", [(4, 8, ("ids", "hand_over"))] + [
    pytest.param(ps, None, BORROW_MODES, marks=pytest.mark.slow) for ps in (1, 3, 64)],
                         ids=["ps4-passes", "ps1", "ps3", "ps64"])
def test_borrow_kernel_equals_jnp_path(monkeypatch, ps, lanes, modes):
  # lanes 8: two columns per pass over 4 rows, so the 6 columns take 3 passes.
  if lanes:
    monkeypatch.setattr(triton_borrow, "LANES", lanes)
  refused = check_borrows(ps, 40 if ps > 1 else 56, 8, 6, 32, 4, "small", modes=modes)
  assert all(0 < k < 32 for k in refused.values()), (SEED, refused)


@pytest.mark.slow
def test_borrow_kernel_equals_jnp_path_larger():
  # Non-power-of-two rows and widths, more entries than rows free to take them.
  check_borrows(16, 300, 37, 11, 8, 19, "larger")


def test_borrow_lowers_for_h200():
  # One Triton launch, no XLA gather or scatter, the table's three arrays aliased in and
  # out; for a simulator-sized table and the largest batch `supported` takes.
  assert triton_borrow.supported(max_reqs=4096, width=81, page_size=16,
                                 rows=triton_borrow.MAX_ROWS)
  assert not triton_borrow.supported(max_reqs=4096, width=81, page_size=16,
                                     rows=triton_borrow.MAX_ROWS + 1)
  cfg = kv.AllocatorConfig(size=30000 * 16, page_size=16, kernel="triton", debug=False)
  for r, w, b, modes in ((1032, 81, 64, BORROW_MODES),
                         (4096, 81, triton_borrow.MAX_ROWS, ("ids", "hand_over"))):
    for mode in modes:
      e = lowering_check.export_for("h200", _borrow_fn(cfg, mode), i32(r, w), i32(r),
                                    i32(r), i32(b), i32(), i32(b), i32(b, w - 1), i32(b))
      text = e.mlir_module()
      assert lowering_check.custom_call_targets(e).count(TRITON) == 1, mode
      assert (text.count("stablehlo.scatter"), text.count("stablehlo.gather")) == (0, 0)
      assert text.count("#stablehlo.output_operand_alias<") == 3, mode


# ---------------------------------------------------------------------------------------
# The compiled kernel on a GPU (pytest -m gpu; skipped without one).
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ps", (1, 3, 16, 64))
def test_compiled_kernel_equals_jnp_path_on_gpu(ps):
  refused = check_table_ops(ps, 40, 8, 6, 64, "gpu", kernel="pallas", ops=ALL_OPS)
  assert all(0 < k < 64 for k in refused.values()), (SEED, refused)
  # A serving-sized table: 1024 decode rows, 8 released and extended by up to 3 pages.
  check_table_ops(ps, 30000, 1024, 21, 4, "gpu-large", kernel="pallas", ops=ALL_OPS,
                  rel_b=8, ext_b=8, dec_b=1024, max_tokens=8 * 3 * ps + 64)


@pytest.mark.gpu
@needs_gpu
def test_compiled_scan_of_steps_matches_model_on_gpu():
  check_scan_of_steps("pallas", 60, "scan-gpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ps", (1, 16, 64))
def test_compiled_borrow_equals_jnp_path_on_gpu(monkeypatch, ps):
  refused = check_borrows(ps, 40 if ps > 1 else 56, 8, 6, 64, 4, "gpu", kernel="triton")
  assert all(0 < k < 64 for k in refused.values()), (SEED, refused)
  # A simulator-sized table and a batch past one warp, in one pass of columns and in two
  # (LANES 4096); at page size 1 the simulator's table, 16 rows of 3392 columns in one
  # pass of 65536 lanes on 16 warps.
  check_borrows(ps, 30000, 1032, 81, 4, 64, "gpu-large", kernel="triton")
  if ps == 1:
    check_borrows(ps, 32768, 136, 3392, 4, 16, "gpu-wide", kernel="triton")
  monkeypatch.setattr(triton_borrow, "LANES", 4096)
  check_borrows(ps, 30000, 1032, 81, 4, 64, "gpu-large-passes", kernel="triton")
