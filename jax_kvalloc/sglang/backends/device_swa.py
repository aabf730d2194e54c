"""The device backend of an SWA pool pair (SPEC 13), and its debug mode.

Each class call is one jitted program of the functional core (jax_kvalloc.swa) over the
whole `SWAState` (both pools and the mapping), built and cached by the device backend's
machinery (jax_kvalloc.sglang.backends.device.Programs), donated unless a snapshot holds
a part of it. Inputs are packed and padded as the single pool's are: per-request ints in
one host i32 array, a device last_loc or free_index padded on the device, an output
longer than asked cut by a cached slice, alloc_decode at its exact size up to
EXACT_ROWS requests (one launch). Allocations run with need_sort off inside the program:
the class runs each pool's merge first, as its own call, when its mirror says that
SPEC's trigger fires.

Every program but the merge and the mapping's returns a status (jax_kvalloc.sglang.
backends.status), and takes and returns the pool pair's running status (kept by the
backend, as the single pool's: `running`). What only the state
shows is checked inside, and a call that fails a check changes nothing: an allocation
whose rows continue the page of a last_loc without an SWA peer (LAST_NO_PEER: it would
pair slots of the reserved page 0), a segment free naming a full page without an SWA
peer (NO_PEER: SGLang's own `swa.peer_mapped` invariant), and a free whose entries do not
reach their list (NOT_LISTED).

Ownership (SPEC 14, each pool's record): a free program reads this call's refusal apart
from the sticky status (`_fresh`, `_settle`) and returns it as an OWNED status; `free`,
`free_segment` and free_swa at page size > 1 (its free group half too) check the full
pool's record first (`_full_refusal`), so that a call either pool refuses frees nothing
in either. The SWA count a free's entries must reach (`_listed`) is the class's, from
its host record (jax_kvalloc.sglang.swa_peers), or -1 where only the program knows.

Debug mode (`DebugSWABackend`): the same programs with each pool's debug record
(double frees and the like, jax_kvalloc.debug), every status and record read after each
call, and SWA checks before it (SWADebugError): an SWA free of a slot without a peer,
a full-only free of a slot whose peer is still held.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import buckets
from jax_kvalloc import debug as _debug
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import swa as core
from jax_kvalloc import validate
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import status as _status
from jax_kvalloc.sglang.backends.device import DeviceBackend
from jax_kvalloc.sglang.backends.device import Programs
from jax_kvalloc.sglang.backends.device import RunningStatus
from jax_kvalloc.sglang.backends.device import decode_row_sizes
from jax_kvalloc.sglang.backends.device import decode_rows
from jax_kvalloc.sglang.backends.device import pack
from jax_kvalloc.sglang.backends.device import placer
from jax_kvalloc.sglang.backends.device import rows
from jax_kvalloc.sglang.backends.device import warmup_exact
from jax_kvalloc.warmup import WarmupReport
from jax_kvalloc.warmup import bucket_sizes

Array = jax.Array
SWAState = core.SWAState

class SWADebugError(ValueError):
  """Debug mode: an SWA free of a slot without a peer, or a full-only free of a slot
  whose SWA peer is still held."""


def _peerless(mapping: Array, slots: Array, reads: Array) -> Tuple[Array, Array]:
  """(bool[] some read slot has no SWA peer, i32[] the first such position)."""
  bad = reads & (core.translate(mapping, slots) <= 0)
  return bad.any(), jnp.argmax(bad)


def _listed(old: SWAState, new: SWAState, counts: Array,
            need_sort: bool) -> Tuple[SWAState, Array, Array]:
  """A free's result checked against `counts` (i32[2], the entries each pool's list must
  take; -1: any). Returns (state, i32[2] entries taken, status): when a list took other
  than its count (NOT_LISTED), both pools keep their old heads and lengths, so the free
  is refused (the entries it wrote lie outside the lists)."""
  pairs = ((old.full, new.full), (old.swa, new.swa))
  pushed = jnp.stack([st.freed_list(need_sort, n)[2] - st.freed_list(need_sort, o)[2]
                      for o, n in pairs])
  short = jnp.where(counts >= 0, counts - pushed, 0)
  bad = jnp.any(short != 0)
  kept = []
  for o, n in pairs:
    ring, head, length = st.freed_list(need_sort, n)[:3]
    _, old_head, old_len = st.freed_list(need_sort, o)[:3]
    kept.append(st.with_freed_list(need_sort, n, ring, jnp.where(bad, old_head, head),
                                   jnp.where(bad, old_len, length)))
  k = jnp.argmax(short != 0)
  return (new._replace(full=kept[0], swa=kept[1]), jnp.where(bad, 0, pushed),
          _status.make(_status.NOT_LISTED, bad, -1, short[k]))


def _fresh(state: SWAState) -> Tuple[SWAState, Any]:
  """The state with each pool's ownership status emptied, so that a program reads this
  call's refusal alone; and the statuses it had (None without a record)."""
  if state.full.guard is None:
    return state, None
  zero = jnp.zeros((3,), jnp.int32)
  old = (state.full.guard.status, state.swa.guard.status)
  return state._replace(full=_with_status(state.full, zero),
                        swa=_with_status(state.swa, zero)), old


def _dead(old: Any) -> Array:
  """bool[]: the state holds a refusal (`_fresh`'s statuses): frees free nothing more,
  as the host backend raises at once."""
  return jnp.zeros((), bool) if old is None else (old[0][0] != 0) | (old[1][0] != 0)


def _with_status(part: Any, status: Array) -> Any:
  return part._replace(guard=part.guard._replace(status=status))


def _settle(state: SWAState, old: Any) -> Tuple[SWAState, Array]:
  """(the state with each pool's sticky status back, the OWNED status of this call's
  refusal: the full pool's, else the SWA pool's; 0 if none). `old`: `_fresh`'s."""
  if old is None:
    return state, _status.make(0, False)
  mine = (state.full.guard.status, state.swa.guard.status)
  sticky = [guard.record_status(o, m[0] != 0, m) for o, m in zip(old, mine)]
  return (state._replace(full=_with_status(state.full, sticky[0]),
                         swa=_with_status(state.swa, sticky[1])),
          _status.first(_status.owned(mine[0], 1), _status.owned(mine[1], 2)))


def _full_refusal(config: core.SWAConfig, state: SWAState, op: str, idx: Array,
                  given: Array) -> Tuple[SWAState, Array]:
  """The full pool's ownership check of `op` ("free": its slots' pages; else a segment's
  page-starting slots), before anything changes, so that a call the full pool refuses
  frees nothing in the SWA pool either. Returns (state, bool[] refused), the refusal
  recorded in the full pool's status; without a record, (state, False)."""
  rec = state.full.guard
  if rec is None:
    return state, jnp.zeros((), bool)
  ps = config.page_size
  distinct = ps == 1 or op != "free"  # the token free and segments do not de-duplicate
  if ps > 1 and op != "free":
    idx, given = idx[::ps], given[::ps]
  given = given & (idx != 0)
  pages = idx // ps  # floor: a negative slot names a negative page (outside the pool)
  why, h0, work = guard.reasons(rec.held, pages, given, distinct=distinct)
  found, new = guard.first_offence(guard.OP_FREE if op == "free" else guard.OP_FREE_SEGMENT,
                                   why, pages)
  held = rec.held
  if distinct:  # undo the count `reasons` wrote, in place (its values back)
    n = held.shape[0] - 1
    held = work.at[jnp.where(given & (pages >= 1) & (pages <= n), pages, n + 1)].set(
        h0, mode="drop")
  part = state.full._replace(guard=rec._replace(
      held=held, status=guard.record_status(rec.status, found, new)))
  return state._replace(full=part), found


# Free programs: (state, idx i32[m], info i32[4]) -> (state, i32[2], status), keyed by
# (op, m, donate). A class call's frees, and a free group's pool frees (pool, page ids?).
FREES = ("free", "free_swa", "free_swa_segment", "free_segment", "free_full",
         "free_full_segment")
NO_STATUS = ("merge", "set_mapping", "clear_mapping")  # programs returning the state alone
POOL_FREES = {"swa_free_page_ids": ("swa", True), "swa_free": ("swa", False),
              "full_free": ("full", False), "full_free_page_ids": ("full", True)}


class SWAOps(Programs):
  """The SWA pool pair's programs of one SWAConfig (see the module docstring), keyed by
  (op, *shape, donate)."""

  init_state = staticmethod(core.init)

  def _build(self, op: str, *shape: Any) -> Callable[..., Any]:
    if op in ("slice", "pad", "init", "copy"):
      return super()._build(op, *shape)
    if op == "translate":
      return self._jit(core.translate)
    if op == "segment_pages":
      ps = self.config.page_size
      return self._jit(lambda x: x[::ps] // ps)
    *args, donate = shape
    if op in NO_STATUS:  # (state, ...) -> state
      return self._jit(getattr(self, f"_{op}")(*args),
                       donate_argnums=(0,) if donate else ())
    if op in FREES:
      fn = self._free_op(op)
    elif op in POOL_FREES:
      fn = self._pool_free(*POOL_FREES[op])
    elif op in ("take_pages", "take_peers"):
      fn = getattr(self, f"_{op}")()
    else:  # alloc, extend, tail, decode (shapes)
      fn = getattr(self, f"_{op}")(*args)
    return self._jit_status(fn, (0,) if donate else ())

  # -- allocations: (state, packed[, device last_loc]) -> (state, slots, status) --------
  def _acfg(self) -> core.SWAConfig:
    return dataclasses.replace(self.config, need_sort=False)  # merged by the host first

  def _alloc(self, size: int):
    def fn(state, packed):
      state, out, ok = core.alloc(self._acfg(), state, packed[0], max_size=size)
      return state, out, _status.make(_status.REFUSED, ~ok)
    return fn

  def _extend(self, r: int, tokens: int):
    ps = self.config.page_size

    def fn(state, packed, last=None):
      pre, seq, bs = packed[:r], packed[r:2 * r], packed[3 * r]
      last = packed[2 * r:3 * r] if last is None else last
      reads = (jnp.arange(r) < bs) & (seq > pre) & (pre % ps != 0)  # Part 1 continues
      bad, i = _peerless(state.mapping, last, reads)
      # Rows that read no last_loc (SPEC 4.2) as a fresh row of nothing (rows without
      # tokens) or with last_loc -1, so that neither pool's checks read a peer's value.
      empty = seq == pre
      pre, seq = jnp.where(empty, 0, pre), jnp.where(empty, 0, seq)
      last = jnp.where(pre % ps == 0, -1, last)
      state, out, ok = core.alloc_extend(self._acfg(), state, pre, seq, last,
                                         max_tokens=tokens, num_reqs=jnp.where(bad, 0, bs))
      return state, out, _status.first(
          _status.make(_status.LAST_NO_PEER, bad, i, last[i]),
          _status.make(_status.REFUSED, ~ok))
    return fn

  def _tail(self, tokens: int):
    def fn(state, packed, last=None):
      last = packed[2:3] if last is None else last
      state, out, ok = core.alloc_extend_swa_tail(self._acfg(), state, packed[0:1],
                                                  packed[1:2], last, packed[3],
                                                  max_tokens=tokens)
      return state, out, _status.make(_status.REFUSED, ~ok)
    return fn

  def _decode(self, r: int):
    ps = self.config.page_size

    def fn(state, packed, last=None):
      seq, bs = packed[:r], packed[2 * r]
      last = packed[r:2 * r] if last is None else last
      reads = (jnp.arange(r) < bs) & ((seq - 1) % ps != 0)  # continues its page
      bad, i = _peerless(state.mapping, last, reads)
      last = jnp.where(reads, last, -1)  # unread (SPEC 4.3): -1 in both pools
      state, out, ok = core.alloc_decode(self._acfg(), state, jnp.where(bad, 1, seq), last,
                                         num_reqs=jnp.where(bad, 0, bs))
      return state, out, _status.first(
          _status.make(_status.LAST_NO_PEER, bad, i, last[i]),
          _status.make(_status.REFUSED, ~ok))
    return fn

  # -- frees: (state, idx i32[m], info i32[4] = (n, start_pos, full count, SWA count))
  #    -> (state, i32[2] entries each list took, status) ------------------------------
  def _free_op(self, op: str):
    cfg, ps = self.config, self.config.page_size
    segment = op in ("free_swa_segment", "free_segment") or (
        ps == 1 and op in ("free", "free_swa"))

    def fn(state, idx, info=None):
      if info is None:  # host slots: the counts ride at their end (one transfer)
        idx, info = idx[:-4], idx[-4:]
      old = state
      state, sticky = _fresh(state)
      n, start = jnp.where(_dead(sticky), 0, info[0]), info[1]
      given = jnp.arange(idx.shape[0]) < n
      bad = jnp.zeros((), bool)
      if segment:  # every page's first token must have its peer (SGLang's invariant)
        reps = jnp.arange(idx.shape[0]) % ps == 0
        bad, i = _peerless(state.mapping, idx, given & reps)
        n = jnp.where(bad, 0, n)
      if op in ("free", "free_segment") or (op == "free_swa" and not segment):
        # the full pool refuses (free_swa: pages it does not hold) before the SWA frees
        state, refused = _full_refusal(cfg, state, "free" if op == "free_swa" else op,
                                       idx, jnp.arange(idx.shape[0]) < n)
        n = jnp.where(refused, 0, n)
      if op == "free":
        new = core.free(cfg, state, idx, n)
      elif op == "free_swa":
        new = core.free_swa(cfg, state, idx, n)
      elif op == "free_swa_segment":
        new = core.free_swa_segment(cfg, state, idx, start, n)
      elif op == "free_segment":
        new = core.free_segment(cfg, state, idx, start, n)
      elif op == "free_full":
        new = core.free_full(cfg, state, jnp.where(given, idx, 0))
      else:
        new = core.free_full_segment(cfg, state, idx, start, n)
      new, owned = _settle(new, sticky)
      new, pushed, status = _listed(old, new, info[2:], cfg.need_sort)
      status = _status.first(owned, status)
      if segment:
        status = _status.first(_status.make(_status.NO_PEER, bad, i, idx[i]), status)
      return new, pushed, status
    return fn

  # -- free groups: the SWA side resolved at call time, freed at the group's end -------
  def _take_pages(self):
    """(state, idx, info) -> (state with the segment's mapping cleared, i32[m'] its SWA
    pages, status): free_swa_segment's first half."""
    ps = self.config.page_size

    def fn(state, idx, info=None):
      if info is None:
        idx, info = idx[:-4], idx[-4:]
      given = jnp.arange(idx.shape[0]) < info[0]
      bad, i = _peerless(state.mapping, idx, given & (jnp.arange(idx.shape[0]) % ps == 0))
      mapping, pages = core.take_segment_pages(state.mapping, idx, ps, given & ~bad)
      return (state._replace(mapping=mapping), pages,
              _status.make(_status.NO_PEER, bad, i, idx[i]))
    return fn

  def _take_peers(self):
    """(state, idx, info) -> (state with the idx's pages' mapping cleared, their SWA
    slots i32[m * ps] (0 where none), status): free_swa's first half. A full page the
    full pool does not hold refuses it (OWNED; nothing taken)."""
    cfg, ps = self.config, self.config.page_size

    def fn(state, idx, info=None):
      if info is None:
        idx, info = idx[:-4], idx[-4:]
      state, sticky = _fresh(state)
      n = jnp.where(_dead(sticky), 0, info[0])
      state, refused = _full_refusal(cfg, state, "free", idx, jnp.arange(idx.shape[0]) < n)
      n = jnp.where(refused, 0, n)
      given = jnp.repeat((jnp.arange(idx.shape[0]) < n) & (idx > 0), ps)
      wide = ((idx // ps) * ps)[:, None] + jnp.arange(ps, dtype=jnp.int32)[None, :]
      wide = wide.reshape(-1)
      peers = jnp.where(given, core.translate(state.mapping, jnp.where(given, wide, 0)), 0)
      state, owned = _settle(state._replace(
          mapping=core.clear_mapping(state.mapping, wide, given)), sticky)
      return state, jnp.maximum(peers, 0), owned
    return fn

  def _pool_free(self, side: str, page_ids: bool):
    """One pool's free of a free group's queue: page ids in order, or slots."""
    cfg = self.config

    def fn(state, values, info=None):
      if info is None:
        values, info = values[:-4], values[-4:]
      old = state
      state, sticky = _fresh(state)
      pool_cfg = getattr(cfg, side)
      given = (jnp.arange(values.shape[0]) < info[0]) & ~_dead(sticky)
      if page_ids and side == "full" and pool_cfg.guard:  # a segment's page 0 is no
        values = jnp.where(given & (values == 0), -1, values)  # padding: refused (the
      # SWA side's queue is `take_pages`' padded outputs: its zeros are padding)
      values = jnp.where(given, values, 0)
      if page_ids:
        new_pool = freeing.free_page_ids(pool_cfg, getattr(state, side), values)
      else:
        new_pool = freeing.free(pool_cfg, getattr(state, side), values)
      new, owned = _settle(state._replace(**{side: new_pool}), sticky)
      new, pushed, status = _listed(old, new, info[2:], cfg.need_sort)
      return new, pushed, _status.first(owned, status)
    return fn

  # -- the rest ----------------------------------------------------------------------------
  def _merge(self, side: int):
    cfg = self.config

    def fn(state):
      name = ("full", "swa")[side]
      return state._replace(**{name: freeing.merge_and_sort_free(
          getattr(cfg, name), getattr(state, name))})
    return fn

  def _set_mapping(self):
    return lambda state, full, swa: state._replace(
        mapping=core.set_mapping(state.mapping, full, swa))

  def _clear_mapping(self):
    return lambda state, full: state._replace(mapping=core.clear_mapping(state.mapping,
                                                                         full))




class DeviceSWABackend(RunningStatus):
  """The Backend (jax_kvalloc.sglang.backends) of an SWA pool pair in jax arrays on
  `device`: each call one launch of `SWAOps.for_config(config)`'s programs."""

  keeps_device_arrays = True
  defers_status = True
  writes_whole_state = True
  patches_record = False  # snapshots keep the whole state (copied before a write)

  def __init__(self, config: core.SWAConfig, device: Any):
    self.config = config
    self.pools = (config.full, config.swa)
    self.full = DeviceBackend(config.full, device)  # its plans (host checks) and empty
    self.device = self.full.device
    self.ops = SWAOps.for_config(config)
    self._start_running(self.device)

  # -- state -----------------------------------------------------------------------------
  def init(self) -> SWAState:
    state = self.ops.fn(("init",))()
    return state if self.device is None else jax.device_put(state, self.device)

  def adopt(self, state: SWAState) -> SWAState:
    if isinstance(state.mapping, jax.Array):
      return state
    return jax.device_put(jax.tree.map(np.asarray, state), self.device)

  def lengths(self, state: SWAState) -> Tuple[int, ...]:
    return tuple(int(x) for x in np.asarray(jnp.stack([
        state.full.free_len, state.full.release_len, state.swa.free_len,
        state.swa.release_len])))

  def check_state(self, state: Any, current: SWAState) -> Tuple[int, ...]:
    validate.state_like(state, current, SWAState)
    full = validate.state_lengths(state.full, self.config.full.num_pages)
    swa = validate.state_lengths(state.swa, self.config.swa.num_pages)
    return full + swa

  def empty(self) -> Any:
    return self.full.empty()

  def _out(self, out: Array, n: int) -> Any:
    return self.ops.exact(out, n)

  def _run(self, key, state, shared, *args):
    """One program: its new state, or (state, output, status), the running status
    kept."""
    fn = self.ops.fn(key + (not shared,))
    if key[0] in NO_STATUS:
      return fn(state, *args)
    *result, self.running = fn(self.running, state, *args)
    return tuple(result)

  # -- allocations (the class found that both pools fit) -------------------------------
  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    """The full pool's plan (its host checks; jax_kvalloc.sglang.backends.device)."""
    return self.full.extend_plan(pre, seq, last, extend_num_tokens, checked)

  def decode_plan(self, seq, last, checked):
    return self.full.decode_plan(seq, last, checked)

  def alloc(self, state, need_size, shared):
    size = buckets.bucket(need_size, buckets.MIN_TOKENS)
    state, out, status = self._run(("alloc", size), state, shared,
                                   np.array([need_size], np.int32))
    return state, self._out(out, need_size), status

  def _packed_last(self, r: int, columns, last):
    on_device = isinstance(last, jax.Array)
    packed = pack(r, len(columns[0]), *columns, None if on_device else last)
    return packed, ((self.ops.padded(last, r, -1),) if on_device else ())

  def alloc_extend(self, state, plan: Plan, shared):
    pre, seq, last = plan.data
    r = rows(plan.rows)
    packed, extra = self._packed_last(r, (pre, seq), last)
    key = ("extend", r, buckets.bucket(plan.tokens, buckets.MIN_TOKENS))
    state, out, status = self._run(key, state, shared, packed, *extra)
    return state, self._out(out, plan.tokens), status

  def alloc_extend_swa_tail(self, state, plan: Plan, tail: int, shared):
    pre, seq, last = plan.data
    on_device = isinstance(last, jax.Array)
    packed = np.array([pre[0], seq[0], -1 if on_device else last[0], tail], np.int32)
    key = ("tail", buckets.bucket(plan.tokens, buckets.MIN_TOKENS))
    state, out, status = self._run(key, state, shared, packed,
                                   *((last,) if on_device else ()))
    return state, self._out(out, plan.tokens), status

  def alloc_decode(self, state, plan: Plan, shared):
    seq, last = plan.data
    r = decode_rows(plan.rows)
    packed, extra = self._packed_last(r, (seq,), last)
    state, out, status = self._run(("decode", r), state, shared, packed, *extra)
    return state, self._out(out, plan.rows), status

  # -- frees -------------------------------------------------------------------------------
  def free(self, state, op: str, idx: Any, start: int, counts, shared):
    """`op` of checked full slots `idx` (host ints, or a device i32[n] never read) from
    token `start`: counts (full, SWA) as the class counted them, None where only the
    program can count (then read: a wait). Returns (state, the counts, status)."""
    n = idx.shape[0]
    m = buckets.bucket(n, buckets.MIN_FREE)
    info = [n, start] + [-1 if c is None else c for c in counts]
    state, pushed, status = self._run((op, m), state, shared,
                                      *self.ops.with_counts(idx, m, *info))
    if None in counts:
      return state, tuple(int(v) for v in np.asarray(pushed)), status
    return state, counts, status

  def take(self, state, op: str, idx: Any, shared, name: str):
    """A free group's SWA half at call time: "take_pages" (free_swa_segment: the SWA
    pages) or "take_peers" (free_swa: the SWA slots of the idx's full pages), the
    mapping cleared; `name`: the class call. Returns (state, the array to queue,
    status)."""
    del name
    n = idx.shape[0]
    m = buckets.bucket(n, buckets.MIN_FREE)
    return self._run((op, m), state, shared, *self.ops.with_counts(idx, m, n, 0, 0, 0))

  def segment_pages(self, idx: Any) -> Any:
    """A segment's full pages, idx[::page_size] // page_size, where idx lives (a device
    array: one cached program per length, no wait)."""
    ps = self.config.page_size
    if isinstance(idx, jax.Array):
      return self.ops.fn(("segment_pages",))(idx)
    return idx[::ps] // ps

  def merge_and_sort_free(self, state, side, shared):
    return self._run(("merge", side), state, shared)

  # -- the mapping -------------------------------------------------------------------------
  def device_ints(self, x: Any, name: str) -> Array:
    """Index data as a device i32 array (a device array as it is, host data put)."""
    dev = validate.device_ints(x, name)
    if dev is not None:
      return dev
    return jax.device_put(validate.host_ints(x, name).astype(np.int32), self.device)

  def set_mapping(self, state, full, swa, shared):
    return self._run(("set_mapping",), state, shared, self.device_ints(full, "full_indices"),
                     self.device_ints(swa, "swa_indices"))

  def clear_mapping(self, state, full, shared):
    return self._run(("clear_mapping",), state, shared,
                     self.device_ints(full, "full_indices"))

  def translate(self, state, loc):
    return self.ops.fn(("translate",))(state.mapping, self.device_ints(loc, "kv_indices"))

  def mapping(self, state) -> Array:
    return state.mapping

  # -- compiling ahead ---------------------------------------------------------------------
  def warmup(self, state, *, max_batch, max_tokens, max_free, exact_sizes, extend,
             device_last_loc) -> WarmupReport:
    """Runs every program of the serving calls up to the maxima on throwaway inputs
    (never donated: the state is not changed). Waits at the end."""
    del extend
    import time  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    ops, outs, ps = self.ops, [], self.config.page_size
    tokens_list = bucket_sizes(max_tokens, buckets.MIN_TOKENS)
    put = placer(self.device)
    lasts = lambda r: [()] + ([(put(np.full(r, -1)),)] if device_last_loc else [])
    def run(key, *args):  # both variants: copying, and donating (a copy of the state)
      for donate in (False, True):
        target = jax.tree.map(jnp.copy, state) if donate else state
        first = () if key[0] in NO_STATUS else (self._zero,)
        outs.append(ops.fn(key + (donate,))(*first, target, *args))
    if ps == 1:
      for t in tokens_list:
        run(("alloc", t), np.zeros((1,), np.int32))
    else:
      for r in bucket_sizes(max_batch, buckets.MIN_BATCH):
        for t in tokens_list:
          for last in lasts(r):
            run(("extend", r, t), np.zeros((3 * r + 1,), np.int32), *last)
      for r in decode_row_sizes(max_batch):
        for last in lasts(r):
          run(("decode", r), np.zeros((2 * r + 1,), np.int32), *last)
      for t in tokens_list:
        run(("tail", t), np.array([0, 0, -1, 0], np.int32))
    frees = ["free", "free_swa", "free_full"] + (
        ["free_swa_segment", "free_segment", "free_full_segment"] if ps > 1 else [])
    for m in bucket_sizes(max_free, buckets.MIN_FREE):
      for op in frees:  # host slots; device free_index (the segment frees)
        run((op, m), *ops.with_counts(np.zeros(m, np.int32), m, 0, 0, 0, 0))
        if "segment" in op and device_last_loc:
          run((op, m), *ops.with_counts(put(np.zeros(m)), m, 0, 0, 0, 0))
    for side in (0, 1) if self.config.need_sort else ():
      run(("merge", side))
    outs += warmup_exact(ops, exact_sizes, device_last_loc, put)
    jax.block_until_ready(outs)
    return WarmupReport(len(outs), time.perf_counter() - t0)


class DebugSWABackend(DeviceSWABackend):
  """Debug mode of the SWA pool pair (see the module docstring): never donates, reads
  every status and both pools' debug records after each call, and checks peers first.
  `host_results`: outputs as numpy (backend="host" in debug mode)."""

  keeps_device_arrays = False
  defers_status = False

  def __init__(self, config: core.SWAConfig, device: Any, host_results: bool):
    super().__init__(config, device)
    self.host_results = host_results

  def empty(self) -> Any:
    return np.zeros((0,), np.int32) if self.host_results else super().empty()

  def _out(self, out: Array, n: int) -> Any:
    out = super()._out(out, n)
    return np.array(np.asarray(out), np.int32) if self.host_results else out

  def _run(self, key, state, shared, *args):
    del shared  # never donated: a refused call keeps the state as it was
    result = super()._run(key, state, True, *args)
    if isinstance(result, SWAState):
      self._raise_recorded(result)
    elif int(np.asarray(result[-1])[0]) != _status.OWNED:  # else the class raises it
      self._raise_recorded(result[0])
    return result

  def translate(self, state, loc):
    out = super().translate(state, loc)
    return np.asarray(out) if self.host_results else out

  def peers_check(self, state, idx: np.ndarray, op: str, mapped: bool) -> None:
    """SWADebugError unless every slot of `idx` has an SWA peer (`mapped`) / none."""
    if idx.size == 0:
      return
    peers = np.asarray(self.ops.fn(("translate",))(state.mapping, idx.astype(np.int32)))
    bad = np.flatnonzero((peers <= 0) if mapped else (peers != 0))
    if bad.size:
      i = int(bad[0])
      what = ("has no SWA peer (call free_full)" if mapped else
              f"still has SWA peer {int(peers[i])} (call free, or free_swa first)")
      raise SWADebugError(f"{op}: free_index[{i}]={int(idx[i])} {what} "
                          f"(jax_kvalloc debug mode)")

  def free(self, state, op, idx, start, counts, shared):
    ps = self.config.page_size
    if op in ("free", "free_swa"):  # every slot must have its peer (SPEC 13)
      self.peers_check(state, idx, "free_swa", True)
    elif op in ("free_swa_segment", "free_segment"):  # each page's first token
      self.peers_check(state, idx[::ps], op, True)
    elif op in ("free_full", "free_full_segment"):
      self.peers_check(state, idx, op, False)
    return super().free(state, op, idx, start, counts, shared)

  def take(self, state, op, idx, shared, name):
    ps = self.config.page_size
    self.peers_check(state, idx if op == "take_peers" else idx[::ps], name, True)
    return super().take(state, op, idx, shared, name)

  def check_state(self, state: Any, current: SWAState) -> Tuple[int, ...]:
    lengths = super().check_state(state, current)
    self._raise_recorded(state)
    return lengths

  @staticmethod
  def _raise_recorded(state: SWAState) -> None:
    """AllocatorDebugError for a misuse either pool's debug record holds."""
    for part in (state.full, state.swa):
      err = _debug.get_error(part)
      if err is not None:
        raise err

  def warmup(self, state, **kwargs) -> WarmupReport:
    del state, kwargs  # debug mode compiles its programs on first use
    return WarmupReport(0, 0.0)
