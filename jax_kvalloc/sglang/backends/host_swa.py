"""The host backend of an SWA pool pair (SPEC 13): both pools in NumPy (each run by
jax_kvalloc.sglang.backends.host's functions) and the mapping as a numpy int32 array.

Every call checks what the state decides before it changes anything, and returns the
device backend's statuses (jax_kvalloc.sglang.backends.status) with the state
unchanged, for the class to raise at once: an allocation continuing the page of a
last_loc without an SWA peer, a segment free naming a full page without one, a free
either pool's ownership record refuses (SPEC 14: each pool keeps a held bitmap, as
host.py's). A call that finds a snapshot holding part of the state copies the state
first (copy-on-write), then writes in place.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from jax_kvalloc import guard
from jax_kvalloc import swa as core
from jax_kvalloc import validate
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import host
from jax_kvalloc.sglang.backends import status as _status
from jax_kvalloc.sglang.backends.host import HostBackend
from jax_kvalloc.warmup import WarmupReport

SWAState = core.SWAState


def _i64(x: Any) -> Optional[np.ndarray]:
  """x as a non-empty 1-D int64 array when it is a numpy integer array or a list of
  ints, else None (the class then checks it)."""
  if type(x) is list and x and all(type(v) is int for v in x):
    x = np.array(x, np.int64)
  return host.i64(x)


def _copy(state: SWAState) -> SWAState:
  return SWAState(*(p._replace(free_ring=p.free_ring.copy(),
                               release_ring=p.release_ring.copy(),
                               guard=None if p.guard is None else p.guard._replace(
                                   held=p.guard.held.copy(), status=p.guard.status.copy()))
                    for p in (state.full, state.swa)), state.mapping.copy())


class HostSWABackend:
  """The Backend (jax_kvalloc.sglang.backends) of an SWA pool pair in NumPy."""

  keeps_device_arrays = False
  defers_status = False
  writes_whole_state = True
  patches_record = False  # snapshots keep the whole state (copied before a write)

  def __init__(self, config: core.SWAConfig):
    self.config = config
    self.pools = (config.full, config.swa)
    self.full, self.swa = HostBackend(config.full), HostBackend(config.swa)
    self.ps = config.page_size

  # -- state -----------------------------------------------------------------------------
  def init(self) -> SWAState:
    mapping = np.zeros((self.config.mapping_len,), np.int32)
    mapping[-1] = -1
    return SWAState(self.full.init(), self.swa.init(), mapping)

  def adopt(self, state: SWAState) -> SWAState:
    if isinstance(state.mapping, np.ndarray) and type(state.full.free_len) is int:
      return state
    return SWAState(self.full.adopt(state.full), self.swa.adopt(state.swa),
                    np.array(state.mapping, np.int32))

  def lengths(self, state: SWAState) -> Tuple[int, ...]:
    return self.full.lengths(state.full) + self.swa.lengths(state.swa)

  def check_state(self, state: Any, current: SWAState) -> Tuple[int, ...]:
    validate.state_like(state, current, SWAState)
    lengths = (validate.state_lengths(state.full, self.config.full.num_pages)
               + validate.state_lengths(state.swa, self.config.swa.num_pages))
    guard.raise_if_refused(state)
    return lengths

  def empty(self) -> np.ndarray:
    return np.zeros((0,), np.int32)

  def _own(self, state: SWAState, shared: bool) -> SWAState:
    return _copy(state) if shared else state

  def _pair(self, state: SWAState, full: np.ndarray, swa: np.ndarray) -> SWAState:
    state.mapping[full] = swa
    return state

  # -- allocations (the class found that both pools fit) -------------------------------
  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    del checked  # the plan checks everything itself
    pre, seq, last = _i64(pre), _i64(seq), _i64(last)
    if pre is None or seq is None or last is None:
      return None
    plan = host.extend_plan(self.full.hc, pre, seq, last, extend_num_tokens)
    return None if plan is None else Plan(pre.shape[0], plan[1], plan[0],
                                          (plan, pre, seq, last))

  def decode_plan(self, seq, last, checked):
    del checked
    seq, last = _i64(seq), _i64(last)
    if seq is None or last is None:
      return None
    plan = host.decode_plan(self.full.hc, seq, last)
    return None if plan is None else Plan(seq.shape[0], plan[2], seq.shape[0],
                                          (plan, seq, last))

  def _swa_last(self, state: SWAState, last: np.ndarray, reads: np.ndarray,
                unread: np.ndarray) -> Tuple[np.ndarray, Any]:
    """(the SWA pool's last_loc: translate(last_loc) where a row reads it, else `unread`
    (an aligned stand-in); the LAST_NO_PEER status where a read one has no peer, else
    None)."""
    swa_last = np.where(reads, self._translate(state, last), unread)
    bad = np.flatnonzero(reads & (swa_last <= 0))
    if bad.size:
      i = int(bad[0])
      return swa_last, np.array([_status.LAST_NO_PEER, i, int(last[i])], np.int32)
    return swa_last, None

  def alloc(self, state, need_size, shared):
    state = self._own(state, shared)
    full_state, full = host.alloc(self.config.full, state.full, need_size)
    swa_state, swa = host.alloc(self.config.swa, state.swa, need_size)
    return self._pair(SWAState(full_state, swa_state, state.mapping), full, swa), full, None

  def alloc_extend(self, state, plan: Plan, shared):
    full_plan, pre, seq, last = plan.data
    ps = self.ps
    swa_last, refused = self._swa_last(state, last, (pre % ps != 0) & (seq > pre),
                                       validate.aligned_last_loc(pre, ps, 1))
    if refused is not None:
      return state, None, refused
    swa_plan = host.extend_plan(self.swa.hc, pre, seq, swa_last, plan.tokens)
    state = self._own(state, shared)
    full_state, full = host.alloc_extend(self.full.hc, state.full, full_plan)
    swa_state, swa = host.alloc_extend(self.swa.hc, state.swa, swa_plan)
    return self._pair(SWAState(full_state, swa_state, state.mapping), full, swa), full, None

  def alloc_extend_swa_tail(self, state, plan: Plan, tail: int, shared):
    full_plan = plan.data[0]
    state = self._own(state, shared)
    full_state, full = host.alloc_extend(self.full.hc, state.full, full_plan)
    ext = full.shape[0]
    state.mapping[full[:ext - tail]] = 0  # the head: no SWA KV (SPEC 13)
    swa_state = state.swa
    if tail:
      one = np.ones((1,), np.int64)
      swa_plan = host.extend_plan(self.swa.hc, 0 * one, tail * one, -one, tail)
      swa_state, swa = host.alloc_extend(self.swa.hc, state.swa, swa_plan)
      state.mapping[full[ext - tail:]] = swa
    return SWAState(full_state, swa_state, state.mapping), full, None

  def alloc_decode(self, state, plan: Plan, shared):
    full_plan, seq, last = plan.data
    swa_last, refused = self._swa_last(state, last, (seq - 1) % self.ps != 0, -1)
    if refused is not None:
      return state, None, refused
    swa_plan = host.decode_plan(self.swa.hc, seq, swa_last)
    state = self._own(state, shared)
    full_state, full = host.alloc_decode(self.full.hc, state.full, *full_plan)
    swa_state, swa = host.alloc_decode(self.swa.hc, state.swa, *swa_plan)
    return self._pair(SWAState(full_state, swa_state, state.mapping), full, swa), full, None

  # -- frees -------------------------------------------------------------------------------
  def _segment_pages(self, state: SWAState, idx: np.ndarray) -> Tuple[np.ndarray, Any]:
    """(free_swa_segment's SWA pages of checked slots; the NO_PEER status where a page's
    first token has no peer, else None)."""
    reps = idx[::self.ps]
    peers = self._translate(state, reps)
    bad = np.flatnonzero(peers <= 0)
    if bad.size:
      i = int(bad[0]) * self.ps
      return peers, np.array([_status.NO_PEER, i, int(idx[i])], np.int32)
    return peers // self.ps, None

  def _page_slots(self, idx: np.ndarray) -> np.ndarray:
    """Every slot of the full pages of idx (idx itself at page size 1)."""
    ps = self.ps
    if ps == 1:
      return idx
    return (((idx // ps) * ps)[:, None] + np.arange(ps)[None, :]).reshape(-1)

  def take(self, state, op, idx, shared, name):
    """A free group's SWA half at call time (see DeviceSWABackend.take)."""
    del name
    if op == "take_pages":
      pages, refused = self._segment_pages(state, idx)
      if refused is not None:
        return state, None, refused
      state = self._own(state, shared)
      state.mapping[self._page_slots(idx[::self.ps])] = 0
      return state, pages, None
    refused = self._not_held(state, idx)
    if refused is not None:
      return state, None, refused
    wide = self._page_slots(idx)
    peers = self._translate(state, wide)
    state = self._own(state, shared)
    state.mapping[wide] = 0
    return state, peers[peers > 0], None

  def _not_held(self, state: SWAState, idx: np.ndarray) -> Any:
    """free_swa's check (page size > 1): the OWNED status of the first full page of
    `idx` the full pool does not hold, else None (no record: None)."""
    if state.full.guard is None:
      return None
    ps = self.ps
    return host.refusal(state.full.guard.held, np.unique(idx // ps), False,
                        lambda: idx // ps, 1)

  def free(self, state, op, idx, start, counts, shared):
    """`op` of checked slots, pages or page ids (see DeviceSWABackend.free); the
    counts are computed here. Every check runs before anything changes, in the device
    programs' order: an SWA peer for each page of a segment (NO_PEER), the full pool's
    ownership record, the SWA pool's (OWNED: the status comes back, nothing freed)."""
    del start, counts
    ps = self.ps
    segment = op in ("free_swa_segment", "free_segment") or (
        ps == 1 and op in ("free", "free_swa"))
    swa_pages, refused = self._segment_pages(state, idx) if segment else (None, None)
    if op == "free_swa" and not segment:
      refused = self._not_held(state, idx)
    if refused is not None:
      return state, (0, 0), refused
    full_in = swa_in = wide = None  # (values, page_ids) each pool's list gets
    if segment:
      swa_in = (swa_pages, True)
    elif op in ("free", "free_swa"):
      wide = self._page_slots(idx)
      peers = self._translate(state, wide)
      swa_in = (peers[peers > 0], False)
    elif op in ("swa_free_page_ids", "swa_free"):
      swa_in = (idx, op == "swa_free_page_ids")
    if op in ("free", "free_full", "full_free", "full_free_page_ids"):
      full_in = (idx, op == "full_free_page_ids")
    elif op in ("free_segment", "free_full_segment"):
      full_in = (idx[::ps] // ps, True)
    full_in = full_in and self._listed(self.full, *full_in)
    swa_in = swa_in and self._listed(self.swa, *swa_in)
    for pool, part, got in ((1, state.full, full_in), (2, state.swa, swa_in)):
      if got and part.guard is not None:
        refused = host.refusal(part.guard.held, got[0], got[1], got[2], pool)
        if refused is not None:
          return state, (0, 0), refused
    state = self._own(state, shared)
    if segment:
      state.mapping[self._page_slots(idx[::ps])] = 0
    elif wide is not None:
      state.mapping[wide] = 0
    full, full_n = self._push(self.full, state.full, full_in)
    swa, swa_n = self._push(self.swa, state.swa, swa_in)
    return SWAState(full, swa, state.mapping), (full_n, swa_n), None

  @staticmethod
  def _listed(pool: HostBackend, values: np.ndarray, page_ids: bool):
    """What a free of `values` into one pool lists: (values: page ids in order, or
    slots' sorted unique pages (paged) / slots as given (token); whether a page named
    twice is a misuse; the argument's pages for a refusal's message or None; whether
    they are page ids)."""
    cfg = pool.config
    if not page_ids and cfg.kind == "paged":
      return (np.unique(values // cfg.page_size), False,
              lambda: values // cfg.page_size, False)
    return values, True, None, page_ids

  @staticmethod
  def _push(pool: HostBackend, part, listed):
    """A checked free into one pool (owned: written in place) of what `_listed` gave.
    Returns (state, entries its list took)."""
    if not listed or listed[0].size == 0:
      return part, 0
    cfg = pool.config
    values, page_ids = listed[0], listed[3]
    before = part.release_len if cfg.need_sort else part.free_len
    part = (host.free_page_ids if page_ids else host.free)(cfg, part, values, False)
    return part, (part.release_len if cfg.need_sort else part.free_len) - before

  def segment_pages(self, idx: np.ndarray) -> np.ndarray:
    """A segment's full pages, idx[::page_size] // page_size."""
    return idx[::self.ps] // self.ps

  def merge_and_sort_free(self, state, side, shared):
    # The merge builds fresh rings for its pool only; the class then counts the whole
    # state fresh, so a part a snapshot holds (the other pool, the records, the mapping)
    # is copied first.
    state = self._own(state, shared)
    if side == 0:
      return state._replace(full=host.merge_and_sort_free(self.config.full, state.full,
                                                          False))
    return state._replace(swa=host.merge_and_sort_free(self.config.swa, state.swa, False))

  # -- the mapping -------------------------------------------------------------------------
  def _translate(self, state: SWAState, loc: np.ndarray) -> np.ndarray:
    """mapping[loc] (SPEC 13's translate: -1 for negatives, 0 past the mapping)."""
    mapping = state.mapping
    n = mapping.shape[0]
    pos = np.where(loc < 0, n - 1, np.minimum(loc, n - 1))
    return np.where(loc >= n, 0, mapping[pos]).astype(np.int32)

  def set_mapping(self, state, full, swa, shared):
    f = validate.host_ints(full, "full_indices")
    s = validate.host_ints(swa, "swa_indices")
    state = self._own(state, shared)
    state.mapping[f] = s
    return state

  def clear_mapping(self, state, full, shared):
    f = validate.host_ints(full, "full_indices")
    state = self._own(state, shared)
    state.mapping[f] = 0
    return state

  def translate(self, state, loc):
    return self._translate(state, validate.host_ints(loc, "kv_indices"))

  def mapping(self, state) -> np.ndarray:
    return state.mapping

  def warmup(self, state, **kwargs) -> WarmupReport:
    del state, kwargs  # nothing to compile
    return WarmupReport(0, 0.0)

