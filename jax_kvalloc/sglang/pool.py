"""One pool of an SGLang-compatible class (one data-parallel rank): its state over a
backend, the host mirror of its list lengths, the copy-on-write flags of its rings, and
the statuses of its recent calls.

The mirror (`Lists`: SGLang's `*_cpu` copies give every page count) lets the class decide
on the host, without reading the device, whether a call fits and whether need_sort
merges first; `available_size` reads it. An SWA pool holds two allocators (full and
sliding-window) and so two mirrors. The flags say whether something outside (a
snapshot, the `state` handed to jitted code) still holds a ring: a write to a held ring
copies it first, so a snapshot costs O(1).

The ownership record (SPEC 14, `state.guard`) is written by every allocation, so a
single pool's snapshot does not keep it (`backend.detach`): the pool writes its record
in place (donated on the device), and `restore` puts a snapshot's back by patching the
live one, O(pages taken between the two states) when both hold the same rings (only
allocations lie between them), else by rebuilding it from the snapshot's lists
(O(num_pages); `backend.restore`). The patch is exact only between states of one
lineage (the states this pool made since its last clear or foreign state: there, two
states holding one ring differ only by allocations); a snapshot names its pool's
lineage. A restore to a snapshot with fewer free pages than the live state rebuilds. A
record handed outside (`state`) is copied before the next write (`record_shared`). An
SWA pool pair writes its whole state anew, so its snapshots keep everything.

Statuses (SPEC 14; jax_kvalloc.sglang.backends.status): every backend call returns what
it refused. The host backend raises at once. A device backend also keeps a running
status on the device (the first refusal since `clear` or `restore`, passed from program
to program), and the pool reads only that one, without waiting: `record` keeps each
call's own status unread, with the running status after it (off the CPU its copy to the
host started at once); `poll` (at every class call) reads the newest running status
that has landed (programs run in order: those landed are a prefix), and waits only for
one kept WITHIN_CALLS or more class calls ago, so that a refusal raises at the first
call after its status has landed and at the latest WITHIN_CALLS class calls after its
call; `poll` with `everything` (the views, which read the device anyway) reads the
newest at once. A running status showing no refusal clears the calls it covers; one
showing a refusal has the kept statuses read in order (waits: the error path) to name
the call that refused. A refusal rolls the mirror back to the state's lengths (one
read) and raises ValueError; the pool then refuses every call until `clear` or
`restore`. So does a refusal read at once (host backend, debug mode), as the ownership
record's own status is sticky: the backends agree. A device status may be i32[6], the
running status then the call's own (one array fewer a launch): `poll` reads the first
three, the error path the last three.

A backend may keep part of the state beside it between its calls (the device backend's
list scalars, one array fewer each way a launch): `state` reads it in (`unpacked`, one
launch) for everything but the per-step calls, which pass `_state` as it is; a
snapshot keeps that part too (`packed`), so its restore needs no launch for it. (Debug mode's own checks, beyond the record, raise at once and are not sticky.)
"""
from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple, Optional, Tuple

import numpy as np

from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.backends import Backend
from jax_kvalloc.sglang.backends import status as _status

WITHIN_CALLS = 8  # a device refusal raises at the latest this many class calls later


class AllocatorSnapshot(NamedTuple):
  """What `backup_state` returns: the state, the config it belongs to and the lengths
  (free_len, release_len; an SWA pool's: full then SWA) as host ints, so that restoring
  it needs no device read. A single pool's state is detached (no ownership record: the
  pool puts it back on restore); `origin` is the lineage of the pool that took it;
  `running`: a device pool's running status after its last call not yet known clean
  (None: every earlier call was), so that a refusal not yet read when the snapshot was
  taken (its lengths counted the refused call) still raises after a restore; `packed`:
  what the backend keeps beside the state (the device backend's list scalars), or None;
  `peers`: an SWA pool pair's record of live SWA mappings (jax_kvalloc.sglang.swa_peers),
  or None."""
  config: Any
  state: Any
  lengths: Optional[Tuple[int, ...]] = None
  origin: Any = None
  running: Any = None
  packed: Any = None
  peers: Any = None


class Lists:
  """The host mirror of one allocator's free and release lists: their lengths, and
  whether a snapshot still holds their rings."""
  __slots__ = ("num_pages", "page_size", "need_sort", "free_len", "release_len", "avail",
               "free_shared", "release_shared")

  def __init__(self, config: AllocatorConfig):
    self.num_pages, self.page_size = config.num_pages, config.page_size
    self.need_sort = config.need_sort
    self.reset(config.num_pages, 0)

  def reset(self, free_len: int, release_len: int, shared: bool = False) -> None:
    self.free_len, self.release_len = free_len, release_len
    self.avail = (free_len + release_len) * self.page_size  # slots free or released
    self.free_shared = self.release_shared = shared

  def available(self) -> int:
    """Pages free or released."""
    return self.free_len + self.release_len

  def room(self, count: int) -> int:
    """`count` cut to the room left (only double frees can overflow a list)."""
    return min(count, self.num_pages - self.free_len - self.release_len)

  def give(self, count: int) -> None:
    """`count` entries (cut by `room`) reached release_pages (need_sort) or free_pages."""
    if self.need_sort:
      self.release_len += count
    else:
      self.free_len += count
    self.avail += count * self.page_size

  def take(self, pages: int) -> None:
    """`pages` left free_pages (an allocation)."""
    self.free_len -= pages
    self.avail -= pages * self.page_size

  def written_shared(self) -> bool:
    """Whether the ring a free writes (release_pages with need_sort) is held."""
    return self.release_shared if self.need_sort else self.free_shared

  def written(self, count: int) -> None:
    """The ring a free writes is fresh now, unless nothing reached it."""
    if count:
      if self.need_sort:
        self.release_shared = False
      else:
        self.free_shared = False

  def freed(self, count: int) -> None:
    """`give` then `written` (a free that wrote its own ring)."""
    if count:
      if self.need_sort:
        self.release_len += count
        self.release_shared = False
      else:
        self.free_len += count
        self.free_shared = False
      self.avail += count * self.page_size

  def merged(self) -> None:
    self.free_len, self.release_len = self.free_len + self.release_len, 0
    self.free_shared = False


class Pool:
  """One pool (one data-parallel rank): state, mirror, flags and statuses over
  `backend` (see the module docstring)."""

  def __init__(self, config: Any, backend: Backend, label: str = ""):
    self.config = config
    self.backend = backend
    self.label = label  # prefixed to its refusals' messages (a rank's: "dp_rank=r: ")
    self.sides = tuple(Lists(c) for c in backend.pools)
    # (call, op, status, running status after it), one per call not known clean
    self.pending: collections.deque = collections.deque()
    self.waits = 0       # statuses read before they had landed (each a wait)
    self.error: Optional[ValueError] = None
    # The allocator's hot paths read `quiet` alone: allocator 0's mirror while this
    # pool's statuses are read at once (host, debug mode) and no refusal is sticky,
    # else None (a deferred status or a refusal: the full poll must run).
    self.quiet: Optional[Lists] = None
    self.record_shared = False  # the ownership record is held outside (copy first)
    self.lineage = object()     # see the module docstring
    self.small = getattr(backend, "small", False)  # has small_slots / free_small
    self._unpacked = getattr(backend, "unpacked", None)
    self.peers: Any = None  # an SWA pair's PeerRecord (jax_kvalloc.sglang.swa_peers)
    self.clear()

  @property
  def state(self) -> Any:
    """The pool's state. A backend that keeps some of it beside the state between its
    calls (the device backend's list scalars, `unpacked`) has them read in first (one
    launch); the per-step calls use `_state` as the backend left it."""
    if self._unpacked is not None:
      self._state = self._unpacked(self._state)
    return self._state

  @state.setter
  def state(self, state: Any) -> None:
    self._state = state

  def clear(self) -> None:
    """Back to the initial state (SPEC 2); forgets any refusal."""
    self.state = self.backend.init()
    for side in self.sides:
      side.reset(side.num_pages, 0)
    if self.peers is not None:
      self.peers.reset()
    self._new_lineage(shared=False)
    self._forget()

  def _new_lineage(self, shared: bool) -> None:
    self.lineage = object()
    self.record_shared = shared and self.backend.patches_record

  def own_record(self) -> None:
    """Before a call that writes the ownership record in place: a copy of its own when
    it is held outside."""
    if self.record_shared:
      self._state = self.backend.own_record(self._state)
      self.record_shared = False

  def _forget(self) -> None:
    self._drop()
    self.error = None
    if self.backend.defers_status:
      self.backend.reset_running()
    else:
      self.quiet = self.sides[0]

  def _drop(self) -> None:
    self.pending.clear()

  def available_size(self, side: int = 0) -> int:
    return self.sides[side].avail

  # -- statuses ------------------------------------------------------------------------
  def record(self, op: str, status: Any, call: int) -> None:
    """Keeps the status of the backend call just made (class call number `call`): read
    at once where the backend does not defer it (host, debug mode), else kept unread,
    with the running status after it, until that has landed."""
    if status is None:
      return
    if not self.backend.defers_status:
      self._check(op, _status.read(status), rollback=False)
      return
    running = self.backend.running
    if self.backend.copies_status:
      _status.start_copy(running)
    self.pending.append((call, op, status, running))

  def poll(self, call: int, everything: bool = False) -> None:
    """At class call number `call` (before it runs): raises the refusal seen earlier,
    then reads the newest running status that has landed (covering every kept call up
    to it), and waits only for one kept WITHIN_CALLS or more calls ago. `everything`
    (a call that reads the device anyway): reads the newest running status now."""
    if self.error is not None:
      raise ValueError(str(self.error))
    pending = self.pending
    if not pending:
      return
    if everything or pending[-1][3].is_ready():  # (the common case: all landed)
      self._read_check(len(pending), everything)
      return
    # Programs run in order, so those that landed are a prefix; the calls kept
    # WITHIN_CALLS or more calls ago are read now, landed or not (the one wait).
    k, old = 0, call - WITHIN_CALLS
    while k < len(pending) and (pending[k][0] <= old or pending[k][3].is_ready()):
      k += 1
    if k:
      self._read_check(k, True)

  def _read_check(self, k: int, check: bool) -> None:
    """Reads the running status after the k-th kept call (a wait, counted, if it has
    not landed; `check`: it may not have): no refusal drops the first k kept calls; a
    refusal reads their own statuses in order (waits: the error path) and raises the
    first one's (ValueError)."""
    pending = self.pending
    running = pending[k - 1][3]
    if check and not running.is_ready():
      self.waits += 1
    values = _status.read(running)[:3]  # (i32[6]: the running status, then the call's)
    if not values[0]:
      if k == len(pending):
        pending.clear()
      else:
        for _ in range(k):
          pending.popleft()
      return
    for _, op, status, _ in list(pending)[:k]:  # the error path: waits
      if status is not None:
        self._check(op, _status.read(status)[-3:], rollback=True)
    self._check("an earlier call", values, rollback=True)  # (kept statuses all clean)

  def _check(self, op: str, values: np.ndarray, rollback: bool) -> None:
    if not values[0]:  # no refusal
      return
    message = self.label + _status.message(op, values)
    self.quiet = None  # every call now raises (the full poll)
    if not rollback:  # read at once: the call changed nothing, the mirror is right
      self._drop()  # sticky on every backend (SPEC 14), as the record's status
      self.error = ValueError(f"{message} (every call raises until clear() or "
                              f"restore_state())")
      raise ValueError(message)
    self._drop()
    self.set_lengths(self.backend.lengths(self.state))  # one read: the state's counts
    if self.peers is not None:
      self.peers.rebuild(self.state)
    self.error = ValueError(f"{message} (found after the call: a device status is read "
                            f"without waiting; every call raises until clear() or "
                            f"restore_state())")
    raise ValueError(str(self.error))

  # -- the mirror ----------------------------------------------------------------------
  def lengths(self) -> Tuple[int, ...]:
    """(free_len, release_len) of each allocator of the pool, flat."""
    return tuple(v for s in self.sides for v in (s.free_len, s.release_len))

  def set_lengths(self, lengths: Tuple[int, ...], shared: bool = False) -> None:
    for i, side in enumerate(self.sides):
      side.reset(lengths[2 * i], lengths[2 * i + 1], shared)

  def any_shared(self) -> bool:
    return any(s.free_shared or s.release_shared for s in self.sides)

  # -- snapshots and states from outside -------------------------------------------------
  def hold(self) -> Any:
    """The state, now held outside: the next write to a ring or the record copies it."""
    self._hold_rings()
    self.record_shared = self.backend.patches_record  # (else its programs copy)
    return self.state

  def _hold_rings(self) -> None:
    for side in self.sides:
      side.free_shared = side.release_shared = True

  def snapshot(self) -> AllocatorSnapshot:
    running = self.pending[-1][3] if self.pending else None
    if not self.backend.patches_record:
      peers = None if self.peers is None else self.peers.snapshot()
      return AllocatorSnapshot(self.config, self.hold(), self.lengths(), None, running,
                               peers=peers)
    self._hold_rings()  # the record stays the pool's (detached from the snapshot)
    state = self.state
    kept = getattr(self.backend, "kept", None)
    return AllocatorSnapshot(self.config, self.backend.detach(state), self.lengths(),
                             self.lineage, running, kept and kept(state))

  def check_snapshot(self, snap: Any) -> None:
    """`restore_state`'s checks of one rank's snapshot (TypeError / ValueError)."""
    validate.snapshot(snap, self.config, AllocatorSnapshot)
    if snap.lengths is not None and len(snap.lengths) != 2 * len(self.sides):
      raise ValueError(f"state.lengths={snap.lengths} must hold {2 * len(self.sides)} "
                       f"ints (free_len, release_len per allocator)")

  def restore(self, snap: AllocatorSnapshot, call: int = 0) -> None:
    """Puts back a checked snapshot. O(1) on the host (a single pool's record: O(pages
    taken since), see the module docstring); a snapshot without lengths (built by hand)
    has them read from its state (a wait). Forgets the calls since and any refusal
    read since; one the snapshot's running status holds is kept as class call `call`'s
    (read without waiting, as any)."""
    if self.backend.patches_record:
      same = snap.origin is self.lineage and snap.lengths is not None
      self.own_record()  # patched or rebuilt in place (the live list scalars unread)
      self.state = self.backend.restore(self._state, snap.state, self.lengths(),
                                        snap.lengths and tuple(snap.lengths), same)
      keep = getattr(self.backend, "keep", None)
      if same and keep:  # (the same pool's: its list scalars are on this device)
        keep(self._state, getattr(snap, "packed", None))
      else:
        self._new_lineage(shared=snap.state.guard is not None)  # (a hand-built one's)
    else:
      self.state = self.backend.adopt(snap.state)
      self._new_lineage(shared=True)
    lengths = snap.lengths
    if lengths is None:
      lengths = self.backend.lengths(self.state)
    self.set_lengths(tuple(lengths), shared=True)
    if self.peers is not None:
      if getattr(snap, "peers", None) is not None:
        self.peers.restore(snap.peers)
      else:  # a snapshot built by hand: from its state (a wait)
        self.peers.rebuild(self.state)
    self._forget()
    running = getattr(snap, "running", None)
    if running is not None and self.backend.defers_status:
      self.backend.running = running
      self.pending.append((call, "a call before the snapshot", None, running))

  def check_state(self, state: Any) -> Tuple[int, ...]:
    """`set_state`'s checks (shapes, dtypes, then the lengths and heads: a wait).
    Returns the lengths; TypeError / ValueError naming the field, nothing changed."""
    return self.backend.check_state(state, self.state)

  def take(self, state: Any, lengths: Tuple[int, ...]) -> None:
    """Takes a state `check_state` passed (held outside: writes copy first)."""
    self.state = self.backend.adopt(state)
    self._new_lineage(shared=True)
    self.set_lengths(lengths, shared=True)
    if self.peers is not None:
      self.peers.rebuild(self.state)

  # -- operations ------------------------------------------------------------------------
  def merge_if(self, shortfall: bool, side: int = 0) -> None:
    """The need_sort merge that a shortfall triggers (SPEC 4.2), decided on the host."""
    lists = self.sides[side]
    if shortfall and lists.need_sort and lists.release_len > 0:
      self.merge(side)

  def merge(self, side: int = 0) -> None:
    """free_pages = sort(free_pages ++ release_pages) (SPEC 6) in allocator `side`."""
    lists = self.sides[side]
    whole = self.backend.writes_whole_state
    self.state = self.backend.merge_and_sort_free(
        self.state, side, self.any_shared() if whole else lists.free_shared)
    self._wrote(whole)
    lists.merged()

  def _wrote(self, whole: bool) -> None:
    if whole:  # every part of the state is a fresh array now
      for s in self.sides:
        s.free_shared = s.release_shared = False

  def update(self, run: Callable[[Any, bool], Any]) -> Any:
    """A call that writes the state but no list (the SWA mapping): run(state, shared)
    -> state."""
    whole = self.backend.writes_whole_state
    self.state = run(self.state, self.any_shared() if whole else False)
    self._wrote(whole)

  def allocate(self, op: str, call: int, takes: Tuple[int, ...],
               run: Callable[[Any, bool], Tuple[Any, Any, Any]]) -> Any:
    """One allocation call (or any call returning an output and a status: `takes` 0):
    run(state, shared) -> (state, slots or None, status), where `shared` says a held
    part must be copied, not donated (a plain pool's allocations write no ring); the
    pages `takes[i]` leave allocator i's mirror when slots come back."""
    whole = self.backend.writes_whole_state
    self.own_record()
    self._state, out, status = run(self._state, whole and self.any_shared())
    self.record(op, status, call)
    if out is not None:
      self._wrote(whole)
      for side, pages in zip(self.sides, takes):
        side.take(pages)
    return out

  def alloc_now(self, need_size: int, pages: int) -> Any:
    """`alloc` of `need_size` slots (`pages` pages) on a `small` backend's host path,
    which the class found to fit without a merge: the slots (no status to keep)."""
    if self.record_shared:
      self.own_record()
    self._state, out = self.backend.alloc_now(self._state, need_size)
    self.sides[0].take(pages)
    return out

  def free_small(self, x: Any, slots: list) -> bool:
    """A free of checked small host slots (`backend.small_slots(x)`) on the backend's
    Python-int path (a single pool whose backend has one, `small`). True when it ran
    (state and mirror updated); False, with nothing changed, where `write` must run it
    (a refusal, or more entries than the room left)."""
    side = self.sides[0]
    if self.record_shared:
      self.own_record()
    got = self.backend.free_small(
        self._state, x, slots, side.num_pages - side.free_len - side.release_len,
        side.release_shared if side.need_sort else side.free_shared)
    if got is None:
      return False
    self._state, count = got
    side.freed(count)
    return True

  def write(self, op: str, call: int, counts: Tuple[Optional[int], ...],
            free: Callable[[Any, Tuple[Optional[int], ...], bool], Tuple[Any, Any, Any]]
            ) -> Any:
    """One free call: free(state, counts, shared) -> (state, out, status), counts[i]
    the entries that reach allocator i's list, cut to the room left (None: only the
    backend can count them, and returns every allocator's count as `out`; a wait on
    the device). `shared`: a ring the call writes is held (copy it first)."""
    whole = self.backend.writes_whole_state
    cut = tuple(None if c is None else s.room(c) for s, c in zip(self.sides, counts))
    if whole:
      shared = self.any_shared()
    else:  # (a ring nothing reaches is written too: the record refuses such a free)
      shared = any(s.written_shared() for s in self.sides)
    self.own_record()
    self._state, out, status = free(self._state, cut, shared)
    self.record(op, status, call)
    got = tuple(out[i] if c is None else c for i, c in enumerate(cut))
    self._wrote(whole)
    for side, c in zip(self.sides, got):
      side.give(c)
      if not whole:
        side.written(c)
    return out
