"""Stateful property tests: hypothesis drives random sequences of every operation of the
SGLang-compatible classes (both allocators, page sizes 1..128, need_sort on and off, debug
mode on and off) against the independent model (tests/model.py), and checks after every
step that:
  - every output equals the model's, has no repeated slot and never touches page 0;
  - free_pages / release_pages equal the model's, and free + released + in use ==
    num_pages, with every page held by one owner at most (no page 0 anywhere);
  - a restored snapshot gives back exactly the lists it was taken with;
  - misuse (bad input in any mode, double frees in debug mode) raises and changes
    nothing; in debug mode the state's bookkeeping agrees with the lists (debug.audit).

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
      at = 0
      for i, e in zip(pick, ext):
        self.reqs[i] = self.reqs[i] + got[at:at + e]
        at += e

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
      self._double_free(data)
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

  def _double_free(self, data):
    """Debug mode: freeing a free page (in free_pages or parked in release_pages) raises,
    even mixed with a valid free, and nothing is freed."""
    if not self.debug or not (self.model.free_pages or self.model.release_pages):
      return
    page = data.draw(st.sampled_from(self.model.free_pages + self.model.release_pages))
    slots = [page * self.ps + data.draw(st.integers(0, self.ps - 1))]
    held = self.reqs + self.raw
    if held:
      slots = [data.draw(st.sampled_from(held))[0]] + slots
    lists = self._lists()
    with pytest.raises(debug.AllocatorDebugError, match=r"free: free_index\[\d+\]=\d+: "
                       "double free"):
      self.impl.free(np.array(slots))
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
