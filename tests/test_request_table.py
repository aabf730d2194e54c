"""The request table (SPEC 11) against hand-worked vectors and against a loop model built
on tests/model.py: slots equal alloc_extend/alloc_decode with last_loc read from the
model's req_to_token, release equals one free group of free_segment per row (the row's
owned pages, in order, no sort). Random workloads run eagerly-jitted op by op, inside one
lax.scan, vmapped over pools, and with donation; page sizes 1/4/16/64, need_sort on/off.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
from jax_kvalloc import request_table as rt
from model import ModelAllocator

B = 4            # rows per call (padded with num_rows)
MAX_REQS = 6
MAX_PAGES = 6    # page columns per row


def _cdiv(a, b):
  return -(-a // b)


class ModelTable:
  """SPEC 11 in loops: one req_to_token list of slots per row, over a ModelAllocator.

  A failed call returns None and changes nothing but what the model allocator's own
  failure keeps (a triggered need_sort merge), exactly as SPEC says.
  """

  def __init__(self, alloc: ModelAllocator, max_reqs: int, max_pages: int):
    self.alloc, self.max_reqs, self.max_pages = alloc, max_reqs, max_pages
    self.tokens = [[] for _ in range(max_reqs)]  # req_to_token: slot of each token
    self.owned_from = [0] * max_reqs             # first owned token (a multiple of ps)

  def _rows_ok(self, rows):
    return len(set(rows)) == len(rows) and all(0 <= r < self.max_reqs for r in rows)

  def _fits(self, rows, n):
    ps = self.alloc.page_size
    return all(k >= 0 and len(self.tokens[r]) + k <= self.max_pages * ps
               for r, k in zip(rows, n))

  def extend(self, rows, n, max_tokens):
    if not self._rows_ok(rows) or not self._fits(rows, n) or sum(n) > max_tokens:
      return None
    pre = [len(self.tokens[r]) for r in rows]
    last = [self.tokens[r][-1] if self.tokens[r] else -1 for r in rows]
    out = self.alloc.alloc_extend(pre, [p + k for p, k in zip(pre, n)], last)
    if out is None:
      return None
    at = 0
    for r, k in zip(rows, n):
      self.tokens[r] += out[at:at + k]
      at += k
    return out

  def decode(self, rows):
    if not self._rows_ok(rows) or not self._fits(rows, [1] * len(rows)):
      return None
    seq = [len(self.tokens[r]) + 1 for r in rows]
    last = [self.tokens[r][-1] if self.tokens[r] else -1 for r in rows]
    out = self.alloc.alloc_decode(seq, last)
    if out is None:
      return None
    for r, s in zip(rows, out):
      self.tokens[r].append(s)
    return out

  def release(self, rows):
    if not self._rows_ok(rows):
      return False
    # How SGLang's scheduler frees finished requests: one free group of free_segment calls.
    self.alloc.free_group_begin()
    for r in rows:
      start = self.owned_from[r]
      self.alloc.free_segment(self.tokens[r][start:], start_pos=start)
      self.tokens[r], self.owned_from[r] = [], 0
    self.alloc.free_group_end()
    return True

  def borrow(self, row, src, num_pages):
    ps = self.alloc.page_size
    assert not self.tokens[row]
    self.tokens[row] = list(self.tokens[src][:num_pages * ps])
    self.owned_from[row] = num_pages * ps

  def admit(self, rows, n, max_tokens=None):
    """Largest k whose extend succeeds, found by trying every k on a copy."""
    for k in range(len(rows), -1, -1):
      trial = ModelTable(self.alloc.copy(), self.max_reqs, self.max_pages)
      trial.tokens = [list(t) for t in self.tokens]
      cap = sum(n[:k]) if max_tokens is None else max_tokens
      if trial.extend(rows[:k], n[:k], cap) is not None:
        return k
    return 0

  def pages(self):
    ps = self.alloc.page_size
    out = np.zeros((self.max_reqs, self.max_pages), np.int32)
    for r, toks in enumerate(self.tokens):
      p = [s // ps for s in toks[::ps]]
      out[r, :len(p)] = p
    return out

  def lens(self):
    return np.array([len(t) for t in self.tokens], np.int32)


def _pad(x, fill=0):
  x = list(x)
  return np.array(x + [fill] * (B - len(x)), np.int32)


def _check_same(cfg, state, table, model: ModelTable):
  np.testing.assert_array_equal(kv.live_free_pages(state), model.alloc.free_pages)
  np.testing.assert_array_equal(kv.live_release_pages(state), model.alloc.release_pages)
  np.testing.assert_array_equal(np.asarray(table.pages), model.pages())
  np.testing.assert_array_equal(np.asarray(table.lens), model.lens())
  np.testing.assert_array_equal(np.asarray(table.owned_from),
                                np.array(model.owned_from) // cfg.page_size)


def _ops(cfg):
  """The table functions, jitted (max_tokens static): faster to test than op by op."""
  jit = lambda f, **kw: jax.jit(functools.partial(f, cfg), **kw)
  return dict(extend=jit(rt.extend_rows, static_argnames="max_tokens"),
              decode=jit(rt.decode_rows), release=jit(rt.release_rows),
              borrow=jit(rt.borrow_pages), admit=jit(rt.admit_rows),
              attn=jit(rt.attention_inputs))


# ---------------------------------------------------------------------------------------
# Hand-worked vectors (ps = 4, free_pages = [1, 2, ...]).
# ---------------------------------------------------------------------------------------

def test_hand_worked_ps4():
  cfg = kv.AllocatorConfig(size=64, page_size=4)
  state, table = kv.init(cfg), rt.init_table(cfg, 4, 8)
  op = _ops(cfg)
  # Row 0 gets 6 tokens (pages 1, 2: slots 4..9), row 1 gets 3 (page 3: slots 12..14).
  state, table, slots, ok = op["extend"](state, table, jnp.array([0, 1]), jnp.array([6, 3]),
                                         max_tokens=16)
  assert bool(ok)
  np.testing.assert_array_equal(slots[:9], [4, 5, 6, 7, 8, 9, 12, 13, 14])
  np.testing.assert_array_equal(table.pages[:2, :3], [[1, 2, 0], [3, 0, 0]])
  # Decode: row 0 (6 -> 7) continues page 2 at slot 10; row 1 (3 -> 4) fills slot 15.
  state, table, slots, ok = op["decode"](state, table, jnp.array([0, 1]))
  np.testing.assert_array_equal(slots, [10, 15])
  # Row 2 borrows row 0's first page (4 tokens), then adds 5: new pages 4, 5.
  table, ok = op["borrow"](state, table, jnp.array([2]), table.pages[:1, :2],
                           jnp.array([1]))
  assert bool(ok) and int(table.lens[2]) == 4 and int(table.owned_from[2]) == 1
  state, table, slots, ok = op["extend"](state, table, jnp.array([2]), jnp.array([5]),
                                         max_tokens=8)
  np.testing.assert_array_equal(slots, [16, 17, 18, 19, 20, 0, 0, 0])
  np.testing.assert_array_equal(table.pages[2, :3], [1, 4, 5])
  # Attention inputs for rows 2 and 0 (q = 5 and 1); the third entry is padding.
  att = op["attn"](table, jnp.array([2, 0, 3]), jnp.array([5, 1, 7]), num_rows=2)
  np.testing.assert_array_equal(att.page_indices[:, :3], [[1, 4, 5], [1, 2, 0], [0, 0, 0]])
  np.testing.assert_array_equal(att.kv_lens, [9, 7, 0])
  np.testing.assert_array_equal(att.cu_q_lens, [0, 5, 6, 6])
  np.testing.assert_array_equal(att.num_seqs, [2])
  # Admission with 16 - 5 = 11 free pages: row 3 + 20 tokens (5 pages) fits, row 1 +
  # 30 more (8 pages, 9 in all) would exceed its 8 columns, so k = 1.
  k = op["admit"](state, table, jnp.array([3, 1, 2]), jnp.array([20, 30, 1]))
  assert int(k) == 1
  # Release rows 2 then 0: free_page_ids([4, 5] ++ [1, 2]); row 2's borrowed page 1 is
  # freed by its owner (row 0), once.
  state, table, ok = op["release"](state, table, jnp.array([2, 0]))
  assert bool(ok)
  np.testing.assert_array_equal(kv.live_free_pages(state)[:5], [4, 5, 1, 2, 6])
  assert int(table.lens[0]) == int(table.lens[2]) == 0


@pytest.mark.parametrize("kernel", ["jnp", "triton_interpret"])
def test_borrow_from_rows_hand_worked(kernel):
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel=kernel, debug=False)
  table = rt.RequestTable(jnp.array([[1, 2, 3, 0], [0] * 4, [5, 6, 0, 0], [0] * 4]),
                          jnp.array([10, 0, 8, 0]), jnp.array([0, 0, 1, 0]))
  take = functools.partial(  # the table alone: a state without the ownership record
      jax.jit(kv.paged_allocator(cfg).borrow_from_rows, static_argnames="hand_over"),
      kv.init(cfg)._replace(guard=None))
  pad = lambda x: jnp.array(list(x) + [0] * (2 - len(x)))  # one shape: two compiles
  # Rows 1 and 3 borrow row 0's first two pages and one of row 2's.
  t, ok = take(table, pad([1, 3]), pad([0, 2]), pad([2, 1]), num_rows=2)
  assert bool(ok)
  np.testing.assert_array_equal(t.pages[jnp.array([1, 3])], [[1, 2, 0, 0], [5, 0, 0, 0]])
  np.testing.assert_array_equal(t.lens, [10, 8, 8, 4])
  np.testing.assert_array_equal(t.owned_from, [0, 2, 1, 1])
  # Row 0 hands its first two pages to row 1, and keeps them as a borrowed prefix.
  t, ok = take(table, pad([1]), pad([0]), pad([2]), num_rows=1, hand_over=True)
  assert bool(ok)
  np.testing.assert_array_equal(t.pages[1], [1, 2, 0, 0])
  np.testing.assert_array_equal(t.owned_from, [2, 0, 1, 0])
  for rows, src, k, hand_over in (
      ([1], [0], [3], False),          # row 0 holds two whole pages (10 tokens)
      ([1], [4], [0], False),          # source outside the table
      ([2], [0], [1], False),          # row 2 is not empty
      ([1, 1], [0, 0], [1, 1], False),  # row 1 twice
      ([1], [0], [-1], False),         # negative count
      ([1], [2], [1], True),           # row 2 borrowed its first column: not its to hand
      ([1, 3], [0, 0], [1, 1], True)):  # row 0 handed over twice
    t, ok = take(table, pad(rows), pad(src), pad(k), num_rows=len(rows),
                 hand_over=hand_over)
    assert not bool(ok), (rows, src, k, hand_over)
    chex.assert_trees_all_equal(t, table)


def test_refusals_change_nothing():
  cfg = kv.AllocatorConfig(size=16, page_size=4, need_sort=True)   # 4 pages
  state, table = kv.init(cfg), rt.init_table(cfg, 3, 2)
  op = _ops(cfg)
  # One shape for every call (2 entries, num_rows says how many count): one compile each.
  ext = lambda s, t, rows, n: op["extend"](s, t, _pad2(rows), _pad2(n),
                                           num_rows=len(rows), max_tokens=16)
  for row in (0, 1):                                                   # pages 1, 2; 3, 4
    state, table, _, ok = ext(state, table, [row], [8])
    assert bool(ok)
  state, table, _ = op["release"](state, table, _pad2([0]), num_rows=1)   # release [1, 2]
  assert int(state.free_len) == 0 and int(state.release_len) == 2
  for rows, n in (([2], [9]),          # 3 pages > 2 columns: refused before the pool
                  ([2, 2], [1, 1]),    # a repeated row
                  ([5], [1]),          # outside the table
                  ([2], [-1])):        # negative count
    s2, t2, slots, ok = ext(state, table, rows, n)
    assert not bool(ok) and not np.asarray(slots).any()
    chex.assert_trees_all_equal(s2, state)   # no merge either, though the free list is empty
    chex.assert_trees_all_equal(t2, table)
  s2, t2, _, ok = op["decode"](state, table, _pad2([1]), num_rows=1)  # row 1 is full
  assert not bool(ok)
  chex.assert_trees_all_equal((s2, t2), (state, table))
  s2, t2, ok = op["release"](state, table, _pad2([1, 1]), num_rows=2)
  assert not bool(ok)
  chex.assert_trees_all_equal((s2, t2), (state, table))
  for row, page in ((1, 3),            # row 1 is not empty
                    (2, 5)):           # page 5 is not in the pool
    t2, ok = op["borrow"](state, table, _pad2([row]), jnp.array([[page], [0]]),
                          _pad2([1]), num_rows=1)
    assert not bool(ok)
    chex.assert_trees_all_equal(t2, table)
  # A pool shortfall is alloc_extend's: the triggered merge stays, the table does not move.
  s2, t2, _, ok = ext(state, table, [2], [1])
  assert bool(ok) and int(s2.release_len) == 0     # merged, then took page 1
  np.testing.assert_array_equal(t2.pages[2], [1, 0])


def _pad2(x):
  return np.array(list(x) + [0] * (2 - len(x)), np.int32)


def test_bad_arguments_raise():
  cfg = kv.AllocatorConfig(size=64, page_size=4)
  state, table = kv.init(cfg), rt.init_table(cfg, 4, 8)
  with pytest.raises(ValueError, match="max_pages_per_req"):
    rt.init_table(cfg, 4, 0)
  with pytest.raises(TypeError, match="n must hold integers"):
    rt.extend_rows(cfg, state, table, jnp.array([0]), jnp.array([1.0]), max_tokens=4)
  with pytest.raises(ValueError, match="differ in length"):
    rt.extend_rows(cfg, state, table, jnp.array([0, 1]), jnp.array([1]), max_tokens=4)
  with pytest.raises(ValueError, match="page_ids"):
    rt.borrow_pages(cfg, state, table, jnp.array([0]), jnp.zeros((1, 9), jnp.int32),
                    jnp.array([1]))
  with pytest.raises(TypeError, match="RequestTable"):
    rt.decode_rows(cfg, state, (table.pages, table.lens), jnp.array([0]))


# ---------------------------------------------------------------------------------------
# Random workloads against the model.
# ---------------------------------------------------------------------------------------

# Fast set: every page size, need_sort on and off across it and the scan test below, and
# debug mode once (borrowed pages and row releases must not look like misuse to it); the
# other combinations run with the slow tests.
FAST = [(1, False, "token", False), (4, True, "paged", False), (16, False, "paged", True),
        (64, True, "paged", False)]
CONFIGS = FAST + [
    pytest.param(ps, ns, kind, False, marks=pytest.mark.slow)
    for ps, ns, kind in [(1, False, "paged"), (1, True, "paged"), (1, True, "token"),
                         (4, False, "paged"), (16, False, "paged"), (16, True, "paged"),
                         (64, False, "paged")]]


def _config(ps, need_sort, kind, debug=False):
  # A pool a little smaller than the table can hold, so that shortfalls happen.
  return kv.AllocatorConfig(size=ps * (MAX_REQS * MAX_PAGES * 2 // 3), page_size=ps,
                            need_sort=need_sort, kind=kind, debug=debug)


@functools.lru_cache(maxsize=None)
def _jitted(cfg):
  max_tokens = 2 * MAX_PAGES * cfg.page_size
  return dict(
      extend=jax.jit(functools.partial(rt.extend_rows, cfg, max_tokens=max_tokens)),
      decode=jax.jit(functools.partial(rt.decode_rows, cfg)),
      release=jax.jit(functools.partial(rt.release_rows, cfg)),
      borrow=jax.jit(functools.partial(rt.borrow_pages, cfg)),
      admit=jax.jit(functools.partial(rt.admit_rows, cfg, max_tokens=max_tokens)),
      attn=jax.jit(functools.partial(rt.attention_inputs, cfg)),
      max_tokens=max_tokens)


def _random_op(rng, cfg, model: ModelTable, lenders):
  """One random operation as (name, args for both sides). Borrowing rows keep their
  lender alive (a lender is never released while it has borrowers)."""
  ps = cfg.page_size
  busy = [r for r in range(MAX_REQS) if model.tokens[r]]
  empty = [r for r in range(MAX_REQS) if not model.tokens[r]]
  kind = rng.choice(["extend", "decode", "release", "borrow", "admit"],
                    p=[0.35, 0.25, 0.15, 0.1, 0.15])
  k = int(rng.integers(1, B + 1))
  rows = [int(r) for r in rng.permutation(MAX_REQS)[:k]]
  if rng.random() < 0.05:
    rows[-1] = rows[0]  # a repeated row: refused
  if kind in ("extend", "admit"):
    n = [int(rng.integers(0, MAX_PAGES * ps // 2 + 2)) for _ in rows]
    return kind, (rows, n)
  if kind == "decode":
    return kind, (rows,)
  if kind == "release":
    rows = [r for r in rows if not any(l == r for l in lenders.values())]
    return kind, (rows,)
  full_pages = [r for r in busy if len(model.tokens[r]) >= ps]
  if not empty or not full_pages:
    return "decode", (rows,)
  src = int(rng.choice(full_pages))
  return kind, ([int(rng.choice(empty))], src,
                int(rng.integers(1, len(model.tokens[src]) // ps + 1)))


def _apply_model(model: ModelTable, op, max_tokens, lenders):
  kind, args = op
  if kind == "extend":
    return model.extend(*args, max_tokens)
  if kind == "decode":
    return model.decode(*args)
  if kind == "release":
    if model._rows_ok(args[0]):  # pylint: disable=protected-access
      for r in args[0]:
        lenders.pop(r, None)
    return model.release(*args)
  if kind == "borrow":
    row, src, num = args
    model.borrow(row[0], src, num)
    lenders[row[0]] = src
    return True
  return model.admit(args[0], args[1], max_tokens)


def _apply_jax(fns, state, table, op):
  kind, args = op
  rows = _pad(args[0])
  num = jnp.int32(len(args[0]))
  if kind == "extend":
    return fns["extend"](state, table, rows, _pad(args[1]), num_rows=num)
  if kind == "decode":
    return fns["decode"](state, table, rows, num_rows=num)
  if kind == "release":
    return fns["release"](state, table, rows, num_rows=num)
  if kind == "borrow":
    row, src, k = args
    t, ok = fns["borrow"](state, table, rows, table.pages[jnp.full((B,), src)],
                          _pad([k]), num_rows=num)
    return state, t, ok
  return fns["admit"](state, table, rows, _pad(args[1]), num_rows=num)


def _compare_result(op, got, want):
  kind, args = op
  if kind == "admit":
    assert int(got) == want, (op, int(got), want)
    return
  ok = bool(got[-1])
  assert ok == (want is not None and want is not False), (op, ok, want)
  if kind in ("extend", "decode") and ok:
    slots = np.asarray(got[2])
    n = len(want)
    np.testing.assert_array_equal(slots[:n], want, err_msg=str(op))
    assert not slots[n:].any()


@pytest.mark.parametrize("ps,need_sort,kind,debug", CONFIGS)
def test_random_workload_matches_model(ps, need_sort, kind, debug):
  cfg = _config(ps, need_sort, kind, debug)
  fns = _jitted(cfg)
  rng = np.random.default_rng([ps, need_sort, kind == "token"])
  model = ModelTable(ModelAllocator(cfg.size, ps, need_sort, kind), MAX_REQS, MAX_PAGES)
  state, table = kv.init(cfg), rt.init_table(cfg, MAX_REQS, MAX_PAGES)
  lenders = {}
  for _ in range(120):
    op = _random_op(rng, cfg, model, lenders)
    got = _apply_jax(fns, state, table, op)
    want = _apply_model(model, op, fns["max_tokens"], lenders)
    _compare_result(op, got, want)
    if op[0] != "admit":
      state, table = got[0], got[1]
    _check_same(cfg, state, table, model)
    # Attention inputs of every row, as the model's req_to_token gives them.
    q = rng.integers(0, 3, MAX_REQS).astype(np.int32)
    att = fns["attn"](table, jnp.arange(MAX_REQS), q)
    np.testing.assert_array_equal(att.page_indices, model.pages())
    np.testing.assert_array_equal(att.kv_lens, model.lens())
    np.testing.assert_array_equal(att.cu_q_lens, np.concatenate([[0], np.cumsum(q)]))
  if debug:
    assert int(state.debug.code) == 0, state.debug   # no misuse recorded


def _scan_program(rng, ps, steps):
  """A fixed serving program: per step, release some rows, extend some, decode some."""
  prog = []
  for _ in range(steps):
    perm = rng.permutation(MAX_REQS)
    rel = [int(r) for r in perm[:int(rng.integers(0, 2))]]
    ext = [int(r) for r in perm[2:2 + int(rng.integers(0, 3))]]
    n = [int(rng.integers(0, 2 * ps + 3)) for _ in ext]
    dec = [int(r) for r in perm[4:4 + int(rng.integers(0, 3))]]
    prog.append((rel, ext, n, dec))
  return prog


def _scan_xs(prog):
  cols = lambda i, **kw: np.stack([_pad(p[i], **kw) for p in prog])
  lens = lambda i: np.array([len(p[i]) for p in prog], np.int32)
  return dict(rel=cols(0), n_rel=lens(0), ext=cols(1), n=cols(2), n_ext=lens(1),
              dec=cols(3), n_dec=lens(3))


def _scan_step(cfg, max_tokens, carry, x):
  state, table = carry
  state, table, _ = rt.release_rows(cfg, state, table, x["rel"], num_rows=x["n_rel"])
  state, table, ext, ok1 = rt.extend_rows(cfg, state, table, x["ext"], x["n"],
                                          max_tokens=max_tokens, num_rows=x["n_ext"])
  state, table, dec, ok2 = rt.decode_rows(cfg, state, table, x["dec"], num_rows=x["n_dec"])
  return (state, table), (ext, ok1, dec, ok2)


def _model_program(cfg, prog, max_tokens):
  model = ModelTable(ModelAllocator(cfg.size, cfg.page_size, cfg.need_sort, cfg.kind),
                     MAX_REQS, MAX_PAGES)
  outs = []
  for rel, ext, n, dec in prog:
    model.release(rel)
    outs.append((model.extend(ext, n, max_tokens), model.decode(dec)))
  return model, outs


def _check_program(outs, ys):
  ext, ok1, dec, ok2 = (np.asarray(y) for y in ys)
  for i, (e, d) in enumerate(outs):
    assert bool(ok1[i]) == (e is not None), i
    assert bool(ok2[i]) == (d is not None), i
    if e is not None:
      np.testing.assert_array_equal(ext[i, :len(e)], e)
    if d is not None:
      np.testing.assert_array_equal(dec[i, :len(d)], d)


@pytest.mark.parametrize("ps,need_sort", [
    (1, True), (64, False),
    pytest.param(4, False, marks=pytest.mark.slow), pytest.param(16, True, marks=pytest.mark.slow)])
def test_scan_matches_model(ps, need_sort):
  cfg = _config(ps, need_sort, "paged")
  max_tokens = 4 * ps + 8
  prog = _scan_program(np.random.default_rng(ps), ps, 60)
  xs = jax.tree.map(jnp.asarray, _scan_xs(prog))
  run = jax.jit(lambda c, xs: jax.lax.scan(
      functools.partial(_scan_step, cfg, max_tokens), c, xs))
  (state, table), ys = run((kv.init(cfg), rt.init_table(cfg, MAX_REQS, MAX_PAGES)), xs)
  model, outs = _model_program(cfg, prog, max_tokens)
  _check_program(outs, ys)
  _check_same(cfg, state, table, model)
  assert any(e is None for e, _ in outs) and any(e for e, _ in outs)  # both kinds seen


def test_vmap_over_pools():
  cfg = _config(4, True, "paged")
  max_tokens = 24
  pools = 3
  progs = [_scan_program(np.random.default_rng(10 + i), 4, 30) for i in range(pools)]
  xs = jax.tree.map(lambda *a: jnp.stack([jnp.asarray(v) for v in a], axis=1),
                    *[_scan_xs(p) for p in progs])   # [steps, pools, ...]
  init = jax.vmap(lambda _: (kv.init(cfg), rt.init_table(cfg, MAX_REQS, MAX_PAGES)))(
      jnp.arange(pools))
  step = jax.vmap(functools.partial(_scan_step, cfg, max_tokens))
  (state, table), ys = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))(init, xs)
  for i, prog in enumerate(progs):
    model, outs = _model_program(cfg, prog, max_tokens)
    pick = lambda t, i=i: jax.tree.map(lambda a: a[i], t)
    _check_program(outs, jax.tree.map(lambda y, i=i: y[:, i], ys))
    _check_same(cfg, pick(state), pick(table), model)


def test_donation_and_no_recompile():
  cfg = _config(16, False, "paged")
  max_tokens = 64

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  @chex.assert_max_traces(n=1)
  def step(state, table, rel, n_rel, ext, n, n_ext, dec, n_dec):
    (state, table), ys = _scan_step(cfg, max_tokens, (state, table), dict(
        rel=rel, n_rel=n_rel, ext=ext, n=n, n_ext=n_ext, dec=dec, n_dec=n_dec))
    return state, table, ys

  prog = _scan_program(np.random.default_rng(3), 16, 25)
  model, outs = _model_program(cfg, prog, max_tokens)
  state, table = kv.init(cfg), rt.init_table(cfg, MAX_REQS, MAX_PAGES)
  ys = []
  for x in (dict((k, v[i]) for k, v in _scan_xs(prog).items()) for i in range(len(prog))):
    old = table.pages
    state, table, y = step(state, table, **x)
    assert old.is_deleted()   # donated
    ys.append(y)
  chex.clear_trace_counter()
  _check_program(outs, jax.tree.map(lambda *a: np.stack(a), *ys))
  _check_same(cfg, state, table, model)
