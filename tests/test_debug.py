"""Debug mode (jax_kvalloc.debug): every check fires under jit, names the operation and
the first offending entry, refuses the call (state unchanged), and stays silent on the
valid call next to it; debug off traces none of it; the classes raise at once."""
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import debug
from model import ModelAllocator
from serving_driver import run_workload

ALLOC = jax.jit(kv.alloc, static_argnames=("config", "max_size"))
EXTEND = jax.jit(kv.alloc_extend, static_argnames=("config", "max_tokens"))
DECODE = jax.jit(kv.alloc_decode, static_argnames=("config",))
FREE = jax.jit(kv.free, static_argnames=("config",))
MERGE = jax.jit(kv.merge_and_sort_free, static_argnames=("config",))

P4 = kv.AllocatorConfig(64, 4, debug=True)  # 16 pages; slots 4..67 (num_slots 68)
P4S = kv.AllocatorConfig(64, 4, need_sort=True, debug=True)
TOK = kv.AllocatorConfig(16, 1, kind="token", debug=True)
ROWS, FREE_LEN, MAX_TOKENS = 4, 8, 16


def _pad(x, n, fill=0):
  out = np.full(n, fill, np.int32)
  out[:len(x)] = x
  return jnp.asarray(out)


def _free(cfg, s, idx):
  return FREE(cfg, s, _pad(idx, FREE_LEN))


def _alloc(cfg, s, n, max_size=16):
  return ALLOC(cfg, s, jnp.int32(n), max_size=max_size)


def _extend(cfg, s, pre, seq, last):
  return EXTEND(cfg, s, _pad(pre, ROWS), _pad(seq, ROWS), _pad(last, ROWS, -1),
                max_tokens=MAX_TOKENS, num_reqs=jnp.int32(len(pre)))


def _decode(cfg, s, seq, last):
  return DECODE(cfg, s, _pad(seq, ROWS), _pad(last, ROWS, -1), num_reqs=jnp.int32(len(seq)))


def _held(cfg, pages):
  """A state whose first `pages` pages are in use (paged: slots 4 .. 4*pages+3)."""
  s, _, ok = _alloc(cfg, kv.init(cfg), pages * cfg.page_size, max_size=64)
  assert bool(ok)
  return s


def _freed(cfg, pages, free_idx):
  return _free(cfg, _held(cfg, pages), free_idx)


def _record(s):
  d = s.debug
  return tuple(int(x) for x in (d.op, d.code, d.index, d.value))


def _without_record(s):
  """The state without its error records (debug's, and the ownership record's status,
  which a refused free sets too)."""
  s = s._replace(debug=s.debug._replace(code=0, op=0, index=0, value=0))
  return s if s.guard is None else s._replace(guard=s.guard._replace(status=0))


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(_without_record(a)), jax.tree.leaves(_without_record(b))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@dataclasses.dataclass
class Case:
  name: str
  cfg: Any
  prepare: Callable   # () -> state
  bad: Callable       # state -> state or (state, out, ok)
  good: Callable      # the valid call next to it
  want: tuple         # (op, code, index, value)


A, E, D, F = debug.OP_ALLOC, debug.OP_ALLOC_EXTEND, debug.OP_ALLOC_DECODE, debug.OP_FREE
CASES = [
    # Double free: a page already in free_pages, one parked in release_pages (SGLang's
    # check misses that one), one never handed out; the token allocator's repeats.
    Case("double_free_free_list", P4, lambda: _freed(P4, 2, [4]),
         lambda s: _free(P4, s, [8, 5]), lambda s: _free(P4, s, [8, 9]),
         (F, debug.DOUBLE_FREE, 1, 5)),
    Case("double_free_release_list", P4S, lambda: _freed(P4S, 2, [4]),
         lambda s: _free(P4S, s, [5]), lambda s: _free(P4S, s, [11]),
         (F, debug.DOUBLE_FREE, 0, 5)),
    Case("double_free_never_allocated", P4, lambda: _held(P4, 2),
         lambda s: _free(P4, s, [4, 20]), lambda s: _free(P4, s, [4, 11]),
         (F, debug.DOUBLE_FREE, 1, 20)),
    Case("token_repeat_within_call", TOK, lambda: _held(TOK, 4),
         lambda s: _free(TOK, s, [2, 3, 2]), lambda s: _free(TOK, s, [2, 3, 4]),
         (F, debug.DOUBLE_FREE, 2, 2)),
    Case("token_double_free", TOK, lambda: _freed(TOK, 4, [1]),
         lambda s: _free(TOK, s, [1]), lambda s: _free(TOK, s, [2]),
         (F, debug.DOUBLE_FREE, 0, 1)),
    # Frees of reserved (page 0, other than the padding 0) and out-of-range slots.
    Case("free_reserved", P4, lambda: _held(P4, 2),
         lambda s: _free(P4, s, [4, 2]), lambda s: _free(P4, s, [4, 0]),
         (F, debug.FREE_RESERVED, 1, 2)),
    Case("free_beyond_pool", P4, lambda: _held(P4, 2),
         lambda s: _free(P4, s, [4, 68]), lambda s: _free(P4, s, [4, 11]),
         (F, debug.FREE_OUT_OF_RANGE, 1, 68)),
    Case("free_negative", TOK, lambda: _held(TOK, 4),
         lambda s: _free(TOK, s, [-1]), lambda s: _free(TOK, s, [1]),
         (F, debug.FREE_OUT_OF_RANGE, 0, -1)),
    # last_loc: SPEC's alignment rule, continuing a free page, page 0 or past the pool.
    Case("extend_misaligned_last_loc", P4, lambda: _held(P4, 1),
         lambda s: _extend(P4, s, [0, 2], [1, 3], [-1, 4]),
         lambda s: _extend(P4, s, [0, 2], [1, 3], [-1, 5]),
         (E, debug.MISALIGNED_LAST_LOC, 1, 4)),
    Case("decode_misaligned_last_loc", P4, lambda: _held(P4, 1),
         lambda s: _decode(P4, s, [3], [4]), lambda s: _decode(P4, s, [3], [5]),
         (D, debug.MISALIGNED_LAST_LOC, 0, 4)),
    Case("extend_last_loc_in_free_page", P4, lambda: _held(P4, 1),
         lambda s: _extend(P4, s, [2], [3], [9]), lambda s: _extend(P4, s, [2], [3], [5]),
         (E, debug.LAST_LOC_IN_FREE_PAGE, 0, 9)),
    Case("decode_last_loc_in_free_page", P4, lambda: _held(P4, 1),
         lambda s: _decode(P4, s, [3], [9]), lambda s: _decode(P4, s, [3], [5]),
         (D, debug.LAST_LOC_IN_FREE_PAGE, 0, 9)),
    Case("extend_continues_page_0", P4, lambda: _held(P4, 1),
         lambda s: _extend(P4, s, [2], [11], [1]), lambda s: _extend(P4, s, [2], [11], [5]),
         (E, debug.LAST_LOC_OUTSIDE_POOL, 0, 1)),
    Case("decode_last_loc_past_pool", P4, lambda: _held(P4, 1),
         lambda s: _decode(P4, s, [3, 7], [5, 69]), lambda s: _decode(P4, s, [3], [5]),
         (D, debug.LAST_LOC_OUTSIDE_POOL, 1, 69)),
    # Two requests continuing one page: one slot handed out twice in a call.
    Case("extend_duplicate_outputs", P4, lambda: _held(P4, 1),
         lambda s: _extend(P4, s, [1, 1], [2, 2], [4, 4]),
         lambda s: _extend(P4, s, [1, 0], [2, 1], [4, -1]),
         (E, debug.DUPLICATE_OUTPUT, 1, 5)),
    Case("decode_duplicate_outputs", P4, lambda: _held(P4, 1),
         lambda s: _decode(P4, s, [3, 3], [5, 5]), lambda s: _decode(P4, s, [3, 1], [5, -1]),
         (D, debug.DUPLICATE_OUTPUT, 1, 6)),
    # Sizes and lengths the core refuses (ok=False) are named too.
    Case("alloc_unaligned", P4, lambda: kv.init(P4),
         lambda s: _alloc(P4, s, 6), lambda s: _alloc(P4, s, 8), (A, debug.BAD_SIZE, 0, 6)),
    Case("alloc_beyond_max_size", P4, lambda: kv.init(P4),
         lambda s: _alloc(P4, s, 20), lambda s: _alloc(P4, s, 16), (A, debug.BAD_SIZE, 0, 20)),
    Case("alloc_negative", TOK, lambda: kv.init(TOK),
         lambda s: _alloc(TOK, s, -1), lambda s: _alloc(TOK, s, 1), (A, debug.BAD_SIZE, 0, -1)),
    Case("extend_negative_prefix", P4, lambda: kv.init(P4),
         lambda s: _extend(P4, s, [0, -4], [1, 2], [-1, -1]),
         lambda s: _extend(P4, s, [0, 0], [1, 2], [-1, -1]),
         (E, debug.NEGATIVE_PREFIX, 1, -4)),
    Case("extend_seq_below_prefix", P4, lambda: _held(P4, 1),
         lambda s: _extend(P4, s, [4], [3], [7]), lambda s: _extend(P4, s, [4], [5], [7]),
         (E, debug.SEQ_TOO_SHORT, 0, 3)),
    Case("extend_beyond_max_tokens", P4, lambda: kv.init(P4),
         lambda s: _extend(P4, s, [0, 0], [10, 10], [-1, -1]),
         lambda s: _extend(P4, s, [0, 0], [10, 6], [-1, -1]),
         (E, debug.BAD_SIZE, 0, 20)),
    Case("decode_seq_zero", P4, lambda: kv.init(P4),
         lambda s: _decode(P4, s, [1, 0], [-1, -1]), lambda s: _decode(P4, s, [1, 1], [-1, -1]),
         (D, debug.SEQ_TOO_SHORT, 1, 0)),
]


def _state_of(result):
  return result if isinstance(result, kv.AllocatorState) else result[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_check_fires_under_jit_and_refuses_the_call(case):
  before = case.prepare()
  assert debug.audit(case.cfg, before) == []
  result = case.bad(before)
  after = _state_of(result)
  assert _record(after) == case.want
  if not isinstance(result, kv.AllocatorState):  # an alloc: refused, outputs all padding
    _, out, ok = result
    assert not bool(ok) and not np.asarray(out).any()
  _assert_same(after, before)  # nothing but the record changed
  err = debug.get_error(after)
  op, _, index, value = case.want
  assert err.op_name == debug.OP_NAMES[op] and (err.index, err.value) == (index, value)
  assert f"{debug.OP_NAMES[op]}: {err.argument}[{index}]={value}: " in str(err)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_check_is_silent_on_the_valid_call(case):
  result = case.good(case.prepare())
  after = _state_of(result)
  assert _record(after) == (0, 0, 0, 0)
  if not isinstance(result, kv.AllocatorState):
    assert bool(result[2])
  assert debug.audit(case.cfg, after) == []


def test_record_is_sticky_and_later_calls_still_work():
  s = _freed(P4, 3, [4])
  s = _free(P4, s, [5])             # first error: page 1 again
  s = _free(P4, s, [2])             # second error: reserved
  assert _record(s) == (F, debug.DOUBLE_FREE, 0, 5)
  s = _free(P4, s, [8])             # a valid call after the error runs normally
  assert kv.live_free_pages(s).tolist()[:2] == [2, 1]
  assert debug.audit(P4, s) == []
  assert _record(debug.clear_error(s)) == (0, 0, 0, 0)


def test_capacity_failure_changes_nothing_in_debug_mode():
  before = _held(P4, 16)
  s, out, ok = _alloc(P4, before, 4)
  assert not bool(ok) and _record(s) == (0, 0, 0, 0)
  _assert_same(s, before)


def test_merge_keeps_the_map_and_double_free_after_merge_is_caught():
  s = _freed(P4S, 4, [4, 9])
  s = MERGE(P4S, s)
  assert kv.live_free_pages(s).tolist()[:2] == [1, 2] and debug.audit(P4S, s) == []
  s = _free(P4S, s, [6])
  assert _record(s) == (F, debug.DOUBLE_FREE, 0, 6)


def test_kernel_bugs_are_caught(monkeypatch):
  """Defence in depth: outputs that the index kernel got wrong (page 0, a repeat) are
  refused even when the arguments are fine."""
  from jax_kvalloc import kernels
  real = kernels.extend_indices
  for bug, code in (("page0", debug.OUTPUT_OUTSIDE_POOL), ("repeat", debug.DUPLICATE_OUTPUT)):
    def buggy(*args, bug=bug, **kwargs):
      out = real(*args, **kwargs)
      return out.at[1].set(2 if bug == "page0" else out[0])
    monkeypatch.setattr(kernels, "extend_indices", buggy)
    fn = jax.jit(lambda *a, **k: kv.alloc_extend(P4, *a, **k),  # a fresh trace per bug
                 static_argnames=("max_tokens",))
    s, out, ok = fn(kv.init(P4), _pad([0], 2), _pad([3], 2), _pad([-1], 2, -1),
                    max_tokens=8, num_reqs=jnp.int32(1))
    assert not bool(ok) and _record(s) == (E, code, 1, 2 if bug == "page0" else 4)
    assert kv.live_free_pages(s).tolist() == list(range(1, 17))


def test_corrupted_free_list_is_caught():
  s = kv.init(P4)
  s = s._replace(debug=s.debug._replace(is_free=s.debug.is_free.at[1].set(False)))
  s, _, ok = _alloc(P4, s, 8)
  assert not bool(ok) and _record(s) == (A, debug.HANDED_OUT_IN_USE, 0, 1)


def test_works_under_vmap():
  pools = jax.tree.map(lambda *x: jnp.stack(x), _held(P4, 2), _held(P4, 2))
  free = jax.vmap(functools.partial(kv.free, P4))
  pools = free(pools, jnp.asarray([[4, 0], [8, 0]], jnp.int32))
  pools = free(pools, jnp.asarray([[8, 0], [8, 0]], jnp.int32))  # pool 1 frees page 2 again
  np.testing.assert_array_equal(pools.debug.code, [0, debug.DOUBLE_FREE])
  np.testing.assert_array_equal(pools.debug.value, [0, 8])
  np.testing.assert_array_equal(pools.free_len, [16, 15])


def test_works_under_scan_and_names_the_first_bad_step():
  def step(s, idx):
    s = kv.free(P4, s, idx)
    return s, s.free_len
  frees = jnp.asarray([[4, 0], [8, 9], [5, 0], [12, 0]], jnp.int32)  # step 2: page 1 again
  s, lens = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(_held(P4, 3), frees)
  assert _record(s) == (F, debug.DOUBLE_FREE, 0, 5)
  np.testing.assert_array_equal(lens, [14, 15, 15, 16])  # step 2 refused, step 3 ran
  assert kv.live_free_pages(s).tolist()[:3] == [3, 2, 1] and debug.audit(P4, s) == []


def test_checkify_helper():
  def step(s, idx):
    s = kv.free(P4, s, idx)
    debug.checkify_check(s)
    return s
  checked = jax.jit(checkify.checkify(step))
  err, s = checked(_held(P4, 2), jnp.asarray([4, 0], jnp.int32))
  assert err.get() is None
  err, _ = checked(s, jnp.asarray([0, 5], jnp.int32))
  assert "free: free_index[1]=5: double free" in err.get()
  with pytest.raises(Exception, match=r"free_index\[1\]=5"):
    err.throw()


def test_debug_off_carries_and_traces_nothing(monkeypatch):
  off = dataclasses.replace(P4S, debug=False, guard=False)
  state = kv.init(off)
  assert state.debug is None and len(jax.tree.leaves(state)) == 6
  hooks = ("init", "alloc_args", "extend_args", "decode_args", "finish_alloc",
           "finish_free")
  def trace_all(cfg, s):
    rows = jnp.zeros(ROWS, jnp.int32)
    jax.make_jaxpr(functools.partial(kv.alloc, cfg, max_size=16))(s, jnp.int32(4))
    jax.make_jaxpr(functools.partial(kv.alloc_extend, cfg, max_tokens=16))(
        s, rows, rows, rows)
    jax.make_jaxpr(functools.partial(kv.alloc_decode, cfg))(s, rows, rows)
    jax.make_jaxpr(functools.partial(kv.free, cfg))(s, rows)
    jax.make_jaxpr(functools.partial(kv.merge_and_sort_free, cfg))(s)
  on_state = kv.init(P4S)
  def boom(*args, **kwargs):
    raise AssertionError("debug code traced")
  for name in hooks:
    monkeypatch.setattr(debug, name, boom)
  trace_all(off, state)  # nothing from jax_kvalloc.debug is reached with debug off
  with pytest.raises(AssertionError, match="debug code traced"):
    trace_all(P4S, on_state)  # ... and the patch would have seen it


def test_valid_serving_traces_are_silent():
  """The workload of test_random_traces through debug-mode classes: every check runs on
  every call of a long valid trace and none fires (a firing one raises)."""
  for kind, ps, num_pages, need_sort in (("paged", 4, 24, True), ("token", 1, 40, False)):
    if kind == "token":
      impl = kvs.TokenToKVPoolAllocator(num_pages, need_sort=need_sort, debug=True)
    else:
      impl = kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                            debug=True)
    counts = run_workload(impl, size=num_pages * ps, page_size=ps, need_sort=need_sort,
                          kind=kind, steps=150, seed=11)
    assert sum(counts.values()) > 80, counts
    assert debug.audit(impl.config, impl.state) == []


# ---------------------------------------------------------------------------------------
# The SGLang-compatible classes in debug mode: raise at the first misuse, state kept.
# ---------------------------------------------------------------------------------------

def _lists(a):
  return a.free_pages.tolist(), a.release_pages.tolist(), a.available_size()


@pytest.mark.parametrize("need_sort", [False, True])
def test_class_double_free_raises_and_keeps_state(need_sort):
  # guard=False: debug mode's own check finds it, names the argument, and the
  # allocator stays usable (with the ownership record on, the record refuses it first:
  # test_class_double_free_with_the_record).
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, need_sort=need_sort, debug=True, guard=False)
  out = a.alloc(8)
  a.free(out[:4])
  before = _lists(a)
  with pytest.raises(debug.AllocatorDebugError,
                     match=r"free: free_index\[1\]=6: double free") as info:
    a.free(np.array([8, 6]))
  assert info.value.op_name == "free" and info.value.index == 1
  assert _lists(a) == before
  a.free(np.array([8]))  # usable afterwards; the record was cleared
  assert a.available_size() == 64


def test_class_double_free_with_the_record():
  # The default (guard on): the ownership record refuses it, as on the other backends
  # (ValueError naming the operation and the page), and every call raises until a
  # restore or clear().
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, debug=True)
  out = a.alloc(8)
  snap = a.backup_state()
  a.free(out[:4])
  with pytest.raises(ValueError, match=r"^free: page 1 is not held"):
    a.free(np.array([8, 6]))
  with pytest.raises(ValueError, match=r"^free: page 1 is not held"):
    a.available_size()
  a.restore_state(snap)
  a.free(np.array([8, 6]))
  assert a.available_size() == 64


@pytest.mark.parametrize("guard", [False, True])
def test_class_double_free_in_a_free_group_raises_at_end(guard):
  a = kvs.TokenToKVPoolAllocator(16, debug=True, guard=guard)
  out = np.asarray(a.alloc(4))
  a.free_group_begin()
  a.free(out[:2])
  a.free(out[1:3])  # slot out[1] twice in the group
  before = _lists(a)
  with pytest.raises(debug.AllocatorDebugError if not guard else ValueError,
                     match=r"page 2 is named twice" if guard else r"free_index\[2\]=2"):
    a.free_group_end()
  assert a.is_not_in_free_group and a._pools[0].lengths() == (12, 0)  # pylint: disable=protected-access
  if not guard:
    assert _lists(a) == before


def test_class_extend_continuing_a_free_page_raises():
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, debug=True)
  with pytest.raises(debug.AllocatorDebugError, match=r"alloc_extend: last_loc\[0\]=5"):
    a.alloc_extend([2], None, [3], None, [5], 1)  # nothing holds page 1
  assert a.available_size() == 64
  m = ModelAllocator(64, 4)
  np.testing.assert_array_equal(a.alloc_extend([0], None, [3], None, [-1], 3),
                                m.alloc_extend([0], [3], [-1]))


def test_environment_variable_sets_the_default(monkeypatch):
  monkeypatch.setenv("JAX_KVALLOC_DEBUG", "1")
  assert kvs.PagedTokenToKVPoolAllocator(64, 4).config.debug
  assert kvs.TokenToKVPoolAllocator(8).state.debug is not None
  assert not kvs.TokenToKVPoolAllocator(8, debug=False).config.debug
  monkeypatch.setenv("JAX_KVALLOC_DEBUG", "0")
  assert kvs.TokenToKVPoolAllocator(8).state.debug is None


def test_repeat_detection_handles_padding_and_the_largest_slot():
  """The cheap presence test must not take padding for repeats, nor miss a repeat of the
  largest int32 slot (the value padding uses inside it)."""
  top = 2**31 - 1
  repeats = jax.jit(debug._repeats)  # pylint: disable=protected-access
  cases = [  # (values, mask, entries that repeat an earlier one)
      ([5, top, 3, top], [1, 1, 1, 1], [0, 0, 0, 1]),
      ([5, top, 3, top], [1, 1, 1, 0], [0, 0, 0, 0]),
      ([0, 0, 7, 7], [0, 0, 1, 1], [0, 0, 0, 1]),
      ([0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]),
      ([4, 9, 4, 4], [1, 1, 0, 1], [0, 0, 0, 1]),
  ]
  for values, mask, want in cases:
    got = repeats(jnp.asarray(values, jnp.int32), jnp.asarray(mask, bool))
    np.testing.assert_array_equal(got, np.asarray(want, bool), err_msg=str(values))
