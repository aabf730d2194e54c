"""Stateful property tests: hypothesis drives random sequences of every operation of the
SGLang-compatible classes (both allocators, page sizes 1..128, need_sort on and off, debug
mode on and off) against the independent model (tests/model.py), and checks after every
step that:
  - every output equals the model's, has no repeated slot and never touches page 0;
  - free_pages / release_pages equal the model's, and free + released + in use ==
    num_pages, with every page held by one owner at most (no page 0 anywhere);
  - a restored snapshot gives back exactly the lists it was taken with;
  - misuse raises and changes nothing: bad input in any mode, and frees the ownership
    record refuses (SPEC 14, on by default, every backend: a double free, a page never
    handed out, a page twice in one call, a segment of a freed request), after which
    every call raises until restore_state; the record always equals the lists, and in
    debug mode the state's bookkeeping agrees with them too (debug.audit).

Profiles: JAX_KVALLOC_HYPOTHESIS=ci (the default: derandomized, so CI is reproducible and
fits its time budget) or =thorough (random, many more examples, for local runs).
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, rule,
                                 run_state_machine_as_test)

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import debug
from landed import settle
from model import ModelAllocator

# (kind, page_size, num_pages, need_sort, debug): every page size class, both flags.
CONFIGS = [
    ("token", 1, 24, False, False),
    ("token", 1, 20, True, True),
    ("paged", 1, 24, True, False),
    ("paged", 2, 16, False, True),
    ("paged", 3, 12, True, True),
    ("paged", 4, 12, False, False),
    ("paged", 16, 8, True, False),
    ("paged", 64, 6, False, True),
    ("paged", 128, 4, True, True),
]

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
PROFILES = {
    "ci": settings(max_examples=6, stateful_step_count=25, derandomize=True, **_COMMON),
    "thorough": settings(max_examples=150, stateful_step_count=80, **_COMMON),
}
PROFILE = os.environ.get("JAX_KVALLOC_HYPOTHESIS", "ci")
SETTINGS = PROFILES[PROFILE]


def _grow(reqs, pick, slots, counts):
  """Appends the extend's slots to the picked requests, counts[k] to reqs[pick[k]]."""
  at = 0
  for i, e in zip(pick, counts):
    reqs[i] = reqs[i] + slots[at:at + e]
    at += e


class AllocatorMachine(RuleBasedStateMachine):
  """One pool and its model; holders are the slot lists the test has been handed."""
  CONFIG = CONFIGS[0]
  BACKEND = "device"

  def __init__(self):
    super().__init__()
    kind, ps, n, need_sort, dbg = self.CONFIG
    self.kind, self.ps, self.n, self.debug = kind, ps, n, dbg
    if kind == "token":
      self.impl = kvs.TokenToKVPoolAllocator(n, need_sort=need_sort, debug=dbg,
                                            backend=self.BACKEND)
    else:
      self.impl = kvs.PagedTokenToKVPoolAllocator(n * ps, ps, need_sort=need_sort, debug=dbg,
                                                 backend=self.BACKEND)
    self.model = ModelAllocator(n * ps, ps, need_sort, kind)
    self.reqs = []      # requests (paged: grown by extend/decode), slot lists in order
    self.raw = []       # raw alloc() results
    self.pending = []   # holders freed inside the open free group (still in use)
    self.in_group = False
    self.snap = None
    self.max_chunk = 3 * ps + 2

  # -- helpers -------------------------------------------------------------------------
  def _outputs(self, got, want, op):
    """got must equal the model's want, with unique slots outside page 0."""
    if want is None:
      assert got is None, f"{op}: the model failed, the allocator returned {got}"
      return None
    assert got is not None, f"{op}: the allocator failed, the model returned {want}"
    got = np.asarray(got).tolist()
    assert got == list(want), f"{op}: {got} != model {want}"
    assert len(set(got)) == len(got), f"{op}: a slot handed out twice: {got}"
    assert all(self.ps <= s < (self.n + 1) * self.ps for s in got), f"{op}: page 0: {got}"
    return got

  def _lists(self):
    return (self.impl.free_pages.tolist(), self.impl.release_pages.tolist(),
            self.impl.available_size())

  def _pick(self, data, pool, most=4):
    k = data.draw(st.integers(1, min(most, len(pool))))
    return data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=k, max_size=k,
                              unique=True))

  # One rule that draws the operation from a weighted list: hypothesis does not weight
  # rules, and the cheap ones (merge, group toggles, snapshots) would crowd out the
  # allocations and frees that give everything else something to work on.
  OPS = (["allocate"] * 5 + ["finish"] * 3 + ["housekeeping"] * 2 + ["misuse"] * 2)

  @rule(data=st.data())
  def step(self, data):
    op = data.draw(st.sampled_from(self.OPS), label="op")
    getattr(self, "_" + op)(data)

  # -- allocation ----------------------------------------------------------------------
  def _allocate(self, data):
    op = data.draw(st.sampled_from(["decode", "extend", "prefill", "alloc"]))
    if self.kind == "token" or op == "alloc":
      self._alloc(data.draw(st.integers(0, 5)))
    elif op == "prefill" or not self.reqs:
      self._prefill(data)
    elif op == "extend":
      self._extend(data, data.draw(st.booleans()))
    else:
      self._decode(data)

  def _prefill(self, data):
    seq = data.draw(st.lists(st.integers(1, self.max_chunk), min_size=1, max_size=4))
    bs = len(seq)
    want = self.model.alloc_extend([0] * bs, seq, [-1] * bs)
    got = self.impl.alloc_extend(np.zeros(bs, np.int64), None, np.array(seq), None,
                                 np.full(bs, -1), sum(seq))
    got = self._outputs(got, want, "prefill")
    if got is not None:
      at = 0
      for s in seq:
        self.reqs.append(got[at:at + s])
        at += s

  def _extend(self, data, zero_rows):
    pick = self._pick(data, self.reqs)
    top = 2 if zero_rows else self.max_chunk  # speculative rows: 0..2 new tokens
    ext = data.draw(st.lists(st.integers(0, top), min_size=len(pick), max_size=len(pick)))
    pre = [len(self.reqs[i]) for i in pick]
    seq = [p + e for p, e in zip(pre, ext)]
    last = [self.reqs[i][-1] for i in pick]
    want = self.model.alloc_extend(pre, seq, last)
    got = self.impl.alloc_extend(pre, pre, seq, seq, last, sum(ext))
    got = self._outputs(got, want, "extend")
    if got is not None:
      _grow(self.reqs, pick, got, ext)

  def _decode(self, data):
    pick = self._pick(data, self.reqs, most=6)
    seq = [len(self.reqs[i]) + 1 for i in pick]
    last = [self.reqs[i][-1] for i in pick]
    want = self.model.alloc_decode(seq, last)
    got = self._outputs(self.impl.alloc_decode(np.array(seq), None, np.array(last)), want,
                        "decode")
    if got is not None:
      for i, s in zip(pick, got):
        self.reqs[i] = self.reqs[i] + [s]

  def _alloc(self, pages):
    n = pages * self.ps
    got = self._outputs(self.impl.alloc(n), self.model.alloc(n), "alloc")
    if got:
      (self.reqs if self.kind == "token" else self.raw).append(got)

  # -- freeing -------------------------------------------------------------------------
  def _finish(self, data):
    """Frees some holders: all their slots, one slot per page (paged: frees the whole
    page), or all slots shuffled and repeated (paged de-duplicates; token gets them once,
    shuffled: FIFO order). First opens a free group, or closes the open one, at times."""
    how = data.draw(st.sampled_from(["all", "one_per_page", "shuffled_twice"]))
    if data.draw(st.sampled_from([False, False, True])):
      self._toggle_free_group()
    pool = self.reqs + self.raw
    if not pool:
      return
    for i in sorted(self._pick(data, pool), reverse=True):
      holder = pool[i]
      (self.reqs if i < len(self.reqs) else self.raw).remove(holder)
      slots = list(holder)
      if how == "one_per_page" and self.kind == "paged":
        slots = sorted({s // self.ps: s for s in slots}.values())
      elif how == "shuffled_twice":
        slots = data.draw(st.permutations(slots))
        if self.kind == "paged":
          slots = slots + slots[: len(slots) // 2]
      self.impl.free(np.array(slots, np.int64))
      self.model.free(slots)
      (self.pending if self.in_group else []).append(holder)

  def _toggle_free_group(self):
    """Opens a free group, or closes the open one (frees its queue in one call)."""
    if self.in_group:
      self.impl.free_group_end(), self.model.free_group_end()
      self.in_group, self.pending = False, []
    else:
      self.impl.free_group_begin(), self.model.free_group_begin()
      self.in_group = True

  # -- merge, snapshots, clear (one rule, so that they do not crowd out the rest) -------
  def _housekeeping(self, data):
    what = data.draw(st.sampled_from(["merge"] * 4 + ["backup"] * 3 + ["restore"] * 3
                                     + ["clear"]))
    if what == "merge":
      self.impl.merge_and_sort_free(), self.model.merge_and_sort_free()
    elif what == "backup" and not self.in_group:
      self.snap = (self.impl.backup_state(), self.model.backup_state(),
                   [list(h) for h in self.reqs], [list(h) for h in self.raw], self._lists())
    elif what == "restore" and self.snap is not None and not self.in_group:
      impl_snap, model_snap, reqs, raw, lists = self.snap
      self.impl.restore_state(impl_snap), self.model.restore_state(model_snap)
      self.reqs, self.raw = [list(h) for h in reqs], [list(h) for h in raw]
      assert self._lists() == lists, "a restored snapshot differs from the one taken"
    elif what == "clear":
      self.impl.clear(), self.model.clear()
      self.reqs, self.raw, self.pending, self.in_group = [], [], [], False

  # -- misuse --------------------------------------------------------------------------
  def _misuse(self, data):
    """Bad input raises (in any mode), a double free raises in debug mode; nothing
    changes. (Not inside a free group, where a double free surfaces at its end.)"""
    if self.in_group:
      return
    what = data.draw(st.sampled_from(["double_free", "page0", "past_pool", "floats",
                                      "misaligned"]))
    if what == "double_free":
      self._ownership_misuse(data)
      return
    state, lists = self.impl.state, self._lists()
    ps = self.ps
    if what == "misaligned" and self.kind == "paged" and self.reqs and ps > 1:
      i = data.draw(st.integers(0, len(self.reqs) - 1))
      pre = len(self.reqs[i])
      call = lambda: self.impl.alloc_extend([pre], None, [pre + 1], None,  # noqa: E731
                                            [self.reqs[i][-1] + 1], 1)
    elif what == "floats":
      call = lambda: self.impl.free(np.array([float(ps)]))  # noqa: E731
    elif what == "past_pool":
      call = lambda: self.impl.free([(self.n + 1) * ps])  # noqa: E731
    else:
      call = lambda: self.impl.free([data.draw(st.integers(0, ps - 1))])  # noqa: E731
    with pytest.raises((ValueError, TypeError)):
      call()
    assert self.impl.state is state and self._lists() == lists

  def _ownership_misuse(self, data):
    """A free the ownership record refuses, mixed with a valid entry where there is one:
    it raises (the device backend: once its status has landed), nothing changes,
    every call raises until restore_state."""
    gone = self.model.free_pages + self.model.release_pages  # free or released pages
    held = self.reqs + self.raw
    ps = self.ps
    what = data.draw(st.sampled_from(["free", "free_page_ids", "segment", "twice"]))
    # A held page named twice by a call that does not de-duplicate: the token free, or
    # a device array of page ids (host data: bad input, refused before the record).
    if what == "twice" and held and (self.kind == "token" or (
        self.BACKEND == "device" and not self.debug)):
      slot = data.draw(st.sampled_from(held))[0]
      call = (lambda: self.impl.free([slot, slot])) if self.kind == "token" else (
          lambda: self.impl.free_page_ids(_jnp.array([slot // ps, slot // ps])))
    elif not gone:
      return
    elif what == "segment" and self.kind == "paged":
      page = data.draw(st.sampled_from(gone))
      call = lambda: self.impl.free_segment(  # noqa: E731
          np.arange(page * ps, page * ps + data.draw(st.integers(1, ps))), start_pos=0)
    else:
      page = data.draw(st.sampled_from(gone))
      pages = [page] + ([data.draw(st.sampled_from(held))[0] // ps] if held else [])
      pages = data.draw(st.permutations(pages))
      if what == "free_page_ids":
        ids = _jnp.array(pages) if self.BACKEND == "device" else pages
        call = lambda: self.impl.free_page_ids(ids)  # noqa: E731
      else:
        slots = [p * ps + data.draw(st.integers(0, ps - 1)) for p in pages]
        call = lambda: self.impl.free(np.array(slots))  # noqa: E731
    lists, snap = self._lists(), self.impl.backup_state()
    with pytest.raises(ValueError):
      call()
      settle(self.impl)  # a device refusal raises once its status has landed (SPEC 14)
    pool = self.impl._pools[0]  # pylint: disable=protected-access
    assert (_st.live_free_pages(pool.state).tolist(),
            _st.live_release_pages(pool.state).tolist()) == lists[:2]
    with pytest.raises(ValueError):
      self.impl.alloc(0)
    self.impl.restore_state(snap)
    assert self._lists() == lists

  # -- invariants ----------------------------------------------------------------------
  @invariant()
  def every_page_is_accounted_for_once(self):
    free, rel, avail = self._lists()
    assert free == self.model.free_pages and rel == self.model.release_pages
    assert avail == self.model.available_size() == (len(free) + len(rel)) * self.ps
    holders = [{s // self.ps for s in h} for h in self.reqs + self.raw + self.pending]
    in_use = set().union(*holders)
    assert sum(map(len, holders)) == len(in_use), "a page held by two owners"
    if self.kind == "token":
      assert sum(map(len, self.reqs + self.raw + self.pending)) == len(in_use)
    assert len(free) + len(rel) + len(in_use) == self.n
    assert sorted(free + rel + sorted(in_use)) == list(range(1, self.n + 1))
    held = np.asarray(self.impl._pools[0].state.guard.held)  # pylint: disable=protected-access
    assert np.flatnonzero(held).tolist() == sorted(in_use), "the record != the lists"

  @invariant()
  def requests_follow_the_page_layout(self):
    """Token j of a request sits at offset j % ps of its (j // ps)-th page."""
    ps = self.ps
    if self.kind == "paged":
      for slots in self.reqs:
        for j, s in enumerate(slots):
          assert s % ps == j % ps and s // ps == slots[j - j % ps] // ps, slots

  @invariant()
  def debug_bookkeeping_agrees(self):
    if self.debug:
      assert debug.audit(self.impl.config, self.impl.state) == []
      assert debug.get_error(self.impl.state) is None


def test_the_state_machine_catches_a_lossy_free():
  """Negative control: an allocator whose every second `free` is dropped must fail the
  machine (the lists stop matching the model), or the machine checks nothing."""

  class Lossy(AllocatorMachine):
    CONFIG = ("paged", 4, 12, False, False)

    def __init__(self):
      super().__init__()
      real, calls = self.impl.free, []

      def free(idx):
        calls.append(1)
        if len(calls) % 2:
          real(idx)
      self.impl.free = free

  with pytest.raises(AssertionError):
    run_state_machine_as_test(
        Lossy, settings=settings(SETTINGS, max_examples=20, phases=[Phase.generate],
                                 print_blob=False))


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"{c[0]}-ps{c[1]}-n{c[2]}-sort{int(c[3])}-dbg{int(c[4])}")
def test_allocator_state_machine(config, backend):
  machine = type(f"Machine_{config[0]}_{config[1]}", (AllocatorMachine,),
                 {"CONFIG": config, "BACKEND": backend})
  run_state_machine_as_test(machine, settings=SETTINGS)


# ---------------------------------------------------------------------------------------
# The functional core with its ownership record (SPEC 14), on every kernel path.
# ---------------------------------------------------------------------------------------
#
# CoreMachine drives the jitted functional API (guard on, debug off) through one kernel
# path (jnp, Triton, Mosaic TPU or Mosaic GPU, in Pallas' interpreters) beside the jnp
# path and the model: valid allocations and frees of every kind (free, free_page_ids,
# free_segment, release_and_alloc_decode), and misuse: double frees, a page never handed
# out, page 0, a page twice in one page-id free, a segment of a freed request, a slot
# past the pool, each mixed with a valid entry. After every step the kernel path's state
# equals the jnp path's bit for bit (held and status included), the lists equal the
# model's, held is exactly the pages in neither list, and the status is the first
# refusal's (sticky, restored with a snapshot).

import dataclasses as _dc  # noqa: E402
import functools as _ft  # noqa: E402

import jax as _jax  # noqa: E402
import jax.numpy as _jnp  # noqa: E402

from jax_kvalloc import guard as _guard  # noqa: E402
from jax_kvalloc import state as _st  # noqa: E402
from pallas_kernels import mosaic_gpu_common as _mosaic_gpu_common  # noqa: E402

ROWS = 4  # padded rows of every allocation call
# (kind, page_size, num_pages, need_sort): machines over the core.
CORE_CONFIGS = [("paged", 4, 16, False), ("paged", 1, 24, True), ("token", 1, 24, False),
                ("paged", 16, 8, True)]
# The Mosaic GPU kernels (alloc_decode, release_and_alloc_decode's decode) in jax's
# interpreter need jax >= 0.11: skipped before.
CORE_IMPLS = ("jnp", "triton_interpret", "mosaic_interpret", pytest.param(
    "mosaic_gpu_interpret", marks=pytest.mark.skipif(
        not _mosaic_gpu_common.available(), reason="jax < 0.11: no Mosaic GPU kernels")))


@_ft.lru_cache(maxsize=None)
def _core_ops(config: kv.AllocatorConfig):
  """The jitted operations of one config, with static shapes (compiled once each)."""
  ps = config.page_size
  lmax, tokens = _core_limits(config)
  jit = lambda fn: _jax.jit(_ft.partial(fn, config))  # noqa: E731
  return dict(
      extend=jit(_ft.partial(kv.alloc_extend, max_tokens=tokens)),
      decode=jit(kv.alloc_decode),
      free=jit(kv.free),
      page_ids=jit(kv.free_page_ids),
      segment=jit(kv.free_segment),
      release_decode=jit(kv.release_and_alloc_decode),
      merge=jit(kv.merge_and_sort_free),
      shapes=(lmax, tokens, -(-lmax // ps)))


def _core_limits(config):
  """(longest request in tokens, extend tokens per call)."""
  ps = config.page_size
  return min(config.num_pages * ps, 5 * ps + 3), ROWS * (2 * ps + 1)


def _pad(values, n, fill=0):
  out = np.full(n, fill, np.int32)
  out[:len(values)] = values
  return _jnp.asarray(out)


class CoreMachine(RuleBasedStateMachine):
  """One pool through IMPL and through jnp, and the model; requests are slot lists."""
  CONFIG = CORE_CONFIGS[0]
  IMPL = "jnp"

  def __init__(self):
    super().__init__()
    kind, ps, n, need_sort = self.CONFIG
    self.ps, self.n, self.kind = ps, n, kind
    self.ref_cfg = kv.AllocatorConfig(size=n * ps, page_size=ps, need_sort=need_sort,
                                      kind=kind, kernel="jnp", debug=False)
    self.cfg = _dc.replace(self.ref_cfg, kernel=self.IMPL)
    self.ops, self.ref_ops = _core_ops(self.cfg), _core_ops(self.ref_cfg)
    self.lmax, self.tokens, self.max_pages = self.ops["shapes"]
    self.state, self.ref = kv.init(self.cfg), kv.init(self.ref_cfg)
    self.model = ModelAllocator(n * ps, ps, need_sort, kind)
    self.reqs, self.freed = [], []   # live requests' slots; freed requests' slots
    self.status = (0, 0, 0)
    self.snap = None

  def _both(self, name, *args, **kwargs):
    """Runs op `name` on both paths; returns the kernel path's result (both states kept)."""
    got = self.ops[name](self.state, *args, **kwargs)
    want = self.ref_ops[name](self.ref, *args, **kwargs)
    state, ref = (got, want) if name in ("free", "page_ids", "segment", "merge") else (
        got[0], want[0])
    _jax.tree.map(np.testing.assert_array_equal, got, want)  # bit for bit, record too
    self.state, self.ref = state, ref
    return got

  OPS = ["prefill"] * 3 + ["extend"] * 2 + ["decode"] * 2 + ["finish"] * 3 + [
      "misuse"] * 3 + ["housekeeping"]

  @rule(data=st.data())
  def step(self, data):
    getattr(self, "_" + data.draw(st.sampled_from(self.OPS), label="op"))(data)

  # -- allocation ----------------------------------------------------------------------
  def _extend_rows(self, pre, seq, last):
    k = len(pre)
    got = self._both("extend", _pad(pre, ROWS), _pad(seq, ROWS), _pad(last, ROWS, -1),
                     num_reqs=_jnp.int32(k))
    want = self.model.alloc_extend(pre, seq, last)
    total = sum(s - p for p, s in zip(pre, seq))
    out = np.asarray(got[1])
    assert bool(got[2]) == (want is not None)
    assert out[:total].tolist() == (want or [0] * total) and not out[total:].any()
    return want

  def _prefill(self, data):
    seq = data.draw(st.lists(st.integers(1, 2 * self.ps + 1), min_size=1, max_size=ROWS))
    got = self._extend_rows([0] * len(seq), seq, [-1] * len(seq))
    if got is not None:
      at = 0
      for s in seq:
        self.reqs.append(got[at:at + s])
        at += s

  def _pick(self, data, pool, most=ROWS):
    k = data.draw(st.integers(1, min(most, len(pool))))
    return data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=k, max_size=k,
                              unique=True))

  def _extend(self, data):
    grow = [i for i, r in enumerate(self.reqs) if len(r) < self.lmax]
    if not grow:
      return self._prefill(data)
    pick = [grow[i] for i in self._pick(data, grow)]
    pre = [len(self.reqs[i]) for i in pick]
    ext = [data.draw(st.integers(0, min(self.ps + 1, self.lmax - p))) for p in pre]
    got = self._extend_rows(pre, [p + e for p, e in zip(pre, ext)],
                            [self.reqs[i][-1] for i in pick])
    if got is not None:
      _grow(self.reqs, pick, got, ext)

  def _decode_rows(self, pick):
    seq = [len(self.reqs[i]) + 1 for i in pick]
    last = [self.reqs[i][-1] for i in pick]
    return seq, last, self.model.alloc_decode(seq, last)

  def _take_decode(self, pick, got, want):
    out = np.asarray(got[1])
    assert bool(got[2]) == (want is not None)
    assert out[:len(pick)].tolist() == (want or [0] * len(pick))
    if want is not None:
      for i, s in zip(pick, want):
        self.reqs[i] = self.reqs[i] + [s]

  def _decode(self, data):
    grow = [i for i, r in enumerate(self.reqs) if len(r) < self.lmax]
    if not grow:
      return self._prefill(data)
    pick = [grow[i] for i in self._pick(data, grow)]
    seq, last, want = self._decode_rows(pick)
    got = self._both("decode", _pad(seq, ROWS, 1), _pad(last, ROWS, -1),
                     num_reqs=_jnp.int32(len(pick)))
    self._take_decode(pick, got, want)

  # -- freeing -------------------------------------------------------------------------
  def _pages(self, slots):
    return [slots[k] // self.ps for k in range(0, len(slots), self.ps)]

  def _finish(self, data):
    """Frees one request by one of the four paths (the model frees it the same way)."""
    if not self.reqs:
      return self._prefill(data)
    i = data.draw(st.integers(0, len(self.reqs) - 1))
    slots = self.reqs.pop(i)
    how = data.draw(st.sampled_from(["free", "page_ids", "segment", "release_decode"]))
    if how == "free":
      order = data.draw(st.permutations(slots))
      if self.kind == "paged" and data.draw(st.booleans()):
        order = order + order[:len(order) // 2]   # two slots of a page are one page
      self._both("free", _pad(order, 2 * self.lmax))
      self.model.free(order)
    elif how == "page_ids":
      pages = self._pages(slots) if self.kind == "paged" else slots
      self._both("page_ids", _pad(pages, self.lmax), _jnp.int32(len(pages)))
      self.model.free_page_ids(pages)
    elif how == "segment":
      self._both("segment", _pad(slots, self.lmax), _jnp.int32(0), _jnp.int32(len(slots)))
      self.model.free_segment(slots, 0)
    else:
      pages = self._pages(slots) if self.kind == "paged" else slots
      pick = self._pick(data, self.reqs) if self.reqs and data.draw(st.booleans()) else []
      self.model.free_page_ids(pages)
      seq, last, want = self._decode_rows(pick)
      got = self._both("release_decode", _pad(pages, self.lmax), _pad(seq, ROWS, 1),
                       _pad(last, ROWS, -1), num_reqs=_jnp.int32(len(pick)))
      self._take_decode(pick, got, want)
    self.freed.append(slots)

  # -- misuse --------------------------------------------------------------------------
  def _misuse(self, data):
    """A free that names a page not held, mixed with a valid entry: refused whole."""
    ps, n = self.ps, self.n
    valid = [data.draw(st.sampled_from(self.reqs))[0]] if self.reqs else []
    kinds = ["never_held", "past_pool"] + (["double"] if self.freed else []) + (
        ["page0"] if ps > 1 else []) + (["repeat"] if self.reqs else [])
    what = data.draw(st.sampled_from(kinds))
    lists = (self.model.free_pages[:], self.model.release_pages[:])
    how = data.draw(st.sampled_from(["free", "page_ids", "segment"]))
    if what == "page0" and how == "page_ids":
      how = "free"   # a page id 0 is padding (guard module docstring): slots name page 0
    if what == "repeat":  # a held page twice in one page-id free (a paged free dedups)
      how = "page_ids" if self.kind == "paged" else data.draw(
          st.sampled_from(["free", "page_ids"]))
      req = data.draw(st.sampled_from(self.reqs))
      bad_pages = self._pages(req) if self.kind == "paged" else req
      entries, why = bad_pages + bad_pages[:1], _guard.REPEATED
      page = bad_pages[0]
    else:
      if what == "double":
        slot = data.draw(st.sampled_from(self.freed))[0]
        why = _guard.NOT_HELD
      elif what == "never_held":
        free = self.model.free_pages + self.model.release_pages
        if not free:
          return
        slot = data.draw(st.sampled_from(free)) * ps
        why = _guard.NOT_HELD
      elif what == "page0":
        slot, why = data.draw(st.integers(1, ps - 1)), _guard.PAGE_ZERO
      else:
        slot = (n + 1 + data.draw(st.integers(0, 3))) * ps
        why = _guard.OUT_OF_RANGE
      if why == _guard.NOT_HELD and slot // ps in {s // ps for r in self.reqs for s in r}:
        return   # the freed page was handed out again since: not a misuse now
      page = slot // ps
      front = data.draw(st.booleans())
      if how == "page_ids" and self.kind == "paged":
        entries = [page] + [v // ps for v in valid] if front else [v // ps for v in valid] + [page]
      elif how == "segment" and self.kind == "paged":
        entries = [slot] if front or not valid else valid[:1] + [0] * (ps - 1) + [slot]
      else:
        entries = [slot] + valid if front else valid + [slot]
    op = {"free": _guard.OP_FREE, "page_ids": _guard.OP_FREE_PAGE_IDS,
          "segment": _guard.OP_FREE_SEGMENT}[how]
    if how == "free":
      self._both("free", _pad(entries, 2 * self.lmax))
    elif how == "page_ids":
      self._both("page_ids", _pad(entries, self.lmax), _jnp.int32(len(entries)))
    else:
      self._both("segment", _pad(entries, self.lmax), _jnp.int32(0),
                 _jnp.int32(len(entries)))
    assert (self.model.free_pages, self.model.release_pages) == lists
    if self.status == (0, 0, 0):
      self.status = (op, why, page)

  # -- merge, snapshots ----------------------------------------------------------------
  def _housekeeping(self, data):
    what = data.draw(st.sampled_from(["merge", "backup", "restore"]))
    if what == "merge":
      self._both("merge")
      self.model.merge_and_sort_free()
    elif what == "backup":
      self.snap = (self.state, self.ref, self.model.backup_state(),
                   [list(r) for r in self.reqs], [list(r) for r in self.freed],
                   self.status)
    elif self.snap is not None:
      self.state, self.ref, m, reqs, freed, self.status = self.snap
      self.model.restore_state(m)
      self.reqs, self.freed = [list(r) for r in reqs], [list(r) for r in freed]

  # -- invariants ----------------------------------------------------------------------
  @invariant()
  def lists_record_and_status_agree(self):
    free, rel = _st.live_free_pages(self.state).tolist(), _st.live_release_pages(
        self.state).tolist()
    assert (free, rel) == (self.model.free_pages, self.model.release_pages)
    held = _guard.from_free(self.n, np.asarray(free + rel, np.int32))
    np.testing.assert_array_equal(np.asarray(self.state.guard.held), held)
    in_use = [s // self.ps for r in self.reqs for s in r]
    assert sorted(set(in_use)) == np.flatnonzero(held).tolist()
    assert tuple(np.asarray(self.state.guard.status).tolist()) == self.status


def test_the_core_machine_catches_a_silent_double_free():
  """Negative control: with guard=False the misuse moves go through and the machine
  fails (the model's lists stay, the pool's do not), or its misuse moves check nothing."""

  class Unguarded(CoreMachine):
    CONFIG = ("paged", 4, 16, False)

    def __init__(self):
      super().__init__()
      off = _dc.replace(self.ref_cfg, guard=False)
      self.ops = self.ref_ops = _core_ops(off)
      self.state = self.ref = kv.init(off)

    @invariant()
    def lists_record_and_status_agree(self):
      free = _st.live_free_pages(self.state).tolist()
      assert free == self.model.free_pages

  with pytest.raises(AssertionError):
    run_state_machine_as_test(
        Unguarded, settings=settings(SETTINGS, max_examples=20, phases=[Phase.generate],
                                     print_blob=False))


@pytest.mark.parametrize("impl", CORE_IMPLS)
@pytest.mark.parametrize("config", CORE_CONFIGS,
                         ids=lambda c: f"{c[0]}-ps{c[1]}-n{c[2]}-sort{int(c[3])}")
def test_core_state_machine_with_misuse(config, impl):
  machine = type(f"Core_{config[0]}_{config[1]}_{impl}", (CoreMachine,),
                 {"CONFIG": config, "IMPL": impl})
  run_state_machine_as_test(machine, settings=SETTINGS)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("config", [CORE_CONFIGS[0], CORE_CONFIGS[3]],
                         ids=lambda c: f"{c[0]}-ps{c[1]}-n{c[2]}-sort{int(c[3])}")
def test_core_state_machine_with_the_compiled_kernels(config, impl):
  # The same machine with the Triton or Mosaic GPU kernels compiled for the GPU (the jnp
  # path beside them on the same device).
  from gpu import has_gpu  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import kernels  # pylint: disable=g-import-not-at-top
  if not has_gpu():
    pytest.skip("needs a CUDA GPU (jax sees none)")
  if impl == "mosaic_gpu" and not kernels.usable("mosaic_gpu"):
    pytest.skip("needs a Hopper or newer GPU and jax >= 0.11")
  machine = type(f"Core_{config[0]}_{config[1]}_{impl}_gpu", (CoreMachine,),
                 {"CONFIG": config, "IMPL": impl})
  run_state_machine_as_test(machine, settings=SETTINGS)
