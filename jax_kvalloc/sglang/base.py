"""What the SGLang-compatible classes share (token, paged and SWA): input checks, free
groups, snapshots, statuses and data-parallel ranks, over one `Pool` per rank
(jax_kvalloc.sglang.pool), each running its calls on a backend
(jax_kvalloc.sglang.backends: "device", "host", or debug mode).

Backends (`backend=` on every constructor):
  * "device" (default): the state is an `AllocatorState` of jax arrays on the class's
    device, ready to hand to jitted code; calls launch without waiting and return jax
    arrays.
  * "host": the state is held in NumPy and every call runs on the host; returns numpy.
  * debug mode (`debug=True`, default JAX_KVALLOC_DEBUG) on either: each call also reads
    the state's error record and raises `AllocatorDebugError` at the first misuse the
    ownership record does not cover (a last_loc in a page the request does not hold,
    say); the call was refused inside, so the state is as it was.

Waits (device backend). No call waits for an earlier call's status (SPEC 14), even with
a model step queued before it: `available_size()` and the other sizes, `backup_state`,
`free_group_end` and `debug_print` read the host mirror; allocations, `free` of host
data, and `free_page_ids` / `free_segment(s)` of host data or of device arrays launch
and return (a device array's count is its shape; its values are checked on the device,
a refusal coming back as the call's status). What still reads the device:
`free` of a device array (the count of distinct pages needs its values, as SGLang's
`free` reads them in torch.unique); the `free_pages`/`release_pages` views;
`restore_state` of a snapshot built by hand; `set_state` (it checks the lengths); debug
mode; and the 8th call after a call whose status has not landed (below).

Bad input raises before anything changes (jax_kvalloc.validate: TypeError, ValueError or
RuntimeError naming the argument and value), so after an exception the allocator is as
it was.

Refusals (SPEC 14). Every pool keeps the ownership record (`guard=True`, the
default; `guard=False` drops it, for SGLang's trust and costs): a free naming a page
that is not held (free, released, never handed out, or named twice by a call that does
not de-duplicate: the token `free`, `free_page_ids`, `free_segment(s)`) is refused
whole, and the class raises ValueError naming the operation and the page, e.g.
`free: page 4 is not held (free, released, or never handed out); nothing was freed`.
The host backend and debug mode find it at once. On the device backend the record
lives on the device, so every refusal of the record (for host inputs too: a free of a
page never handed out) and a device array naming page 0 come back as the call's status
(jax_kvalloc.sglang.backends.status), read without waiting (jax_kvalloc.sglang.pool):
it raises at the first class call after that status has landed on the host, and within
8 calls (the 8th call waits for it if it has not landed); the refused call changed
nothing and the host mirror is rolled back to the state's lengths. A snapshot taken
before the refusal was read carries the status along (restoring it raises it too). On every backend, every call then raises until
`clear()` or `restore_state` (bad input the host checks find, above, is not a refusal:
it raises once). `status_waits` counts the statuses a call had to wait for (none in a
steady serving loop, where each lands within 8 calls). A free group's
end frees its queue in SPEC 7's order; a refused part frees nothing, and neither do
the parts after it.

Snapshots cost O(1): `backup_state` keeps references to the current rings, which a later
free copies first (copy-on-write, jax_kvalloc.sglang.pool). A single pool's snapshot
leaves the ownership record out: `restore_state` patches the live one (O(pages taken
since the snapshot) when only allocations lie between them: a launch on the device),
or rebuilds it from the snapshot's lists (O(num_pages)).

Data parallelism (SPEC 12, sglang-jax's names): `dp_size` pools of `size // dp_size`
slots each, page ids local to each rank; every method takes `dp_rank=` (default 0), and
`_pool_index` is the one place that maps it to a pool. One free group spans every rank
(frees queue per rank; `free_group_end` flushes every rank). `clear()` resets every rank
and closes the group; `clear(dp_rank=r)` resets rank r and drops the frees queued for it.
`backup_state` / `restore_state`, `free_pages` / `release_pages` and `state` /
`set_state` cover every rank (with dp_size > 1: a `RankedSnapshot`, lists, and the ranks
stacked along a leading axis as jax_kvalloc.ranks works on), all or nothing. `device`
may be one device for every rank or a sequence of dp_size devices.

Ranks over several processes (`dp_ranks=`): on a pod each host runs the scheduler of the
ranks whose devices it owns, so an allocator there holds the pools and host mirrors of
those ranks only (`dp_ranks`, e.g. `multiprocess.process_ranks(mesh, "dp", dp_size)`);
nothing of another host's rank is needed, and replicating every rank's mirror on every
host (as sglang-jax replicates its scheduler) would make every host do every rank's host
work. A call naming a rank held elsewhere raises ValueError (naming dp_rank and the ranks
held here) before anything changes; `available_size` / `merge_and_sort_free` take held
ranks only; `clear()` and free groups act on the held ranks; `backup_state` /
`restore_state` (a snapshot of the same held ranks only), `state` / `set_state` (the held
ranks stacked in dp_ranks order) and the views (None at ranks held elsewhere) cover them.
`device` as a sequence still has dp_size entries; only the held ranks' are used.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import ranks as _ranks
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import make_backend
from jax_kvalloc.sglang.pool import AllocatorSnapshot
from jax_kvalloc.sglang.pool import Pool
from jax_kvalloc.warmup import WarmupReport


class RankedSnapshot(NamedTuple):
  """What `backup_state` returns when dp_size > 1: one snapshot per held rank."""
  config: AllocatorConfig          # the whole pool's
  ranks: Tuple[Any, ...]           # each held rank's AllocatorSnapshot, rank order
  dp_ranks: Optional[Tuple[int, ...]] = None  # the ranks held (None: every rank)


def check_dp_rank(dp_rank: Any, dp_size: int) -> int:
  """dp_rank as an int in 0..dp_size-1 (TypeError / ValueError naming it otherwise)."""
  if isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral):
    raise TypeError(f"dp_rank must be an int, got {type(dp_rank).__name__} {dp_rank!r}")
  if not 0 <= int(dp_rank) < dp_size:
    raise ValueError(f"dp_rank={dp_rank} is out of range: dp_size={dp_size} "
                     f"(ranks 0..{dp_size - 1})")
  return int(dp_rank)


def check_dp_ranks(dp_ranks: Any, dp_size: int) -> Tuple[int, ...]:
  """The ranks a process holds, ascending: every rank for None, else distinct ints in
  0..dp_size-1, at least one (TypeError / ValueError naming dp_ranks otherwise)."""
  if dp_ranks is None:
    return tuple(range(dp_size))
  if isinstance(dp_ranks, (str, bytes)) or not hasattr(dp_ranks, "__iter__"):
    raise TypeError(f"dp_ranks must be a sequence of ints, got "
                    f"{type(dp_ranks).__name__} {dp_ranks!r}")
  got = list(dp_ranks)
  for r in got:
    if isinstance(r, bool) or not isinstance(r, numbers.Integral):
      raise TypeError(f"dp_ranks must hold ints, got {type(r).__name__} {r!r} in "
                      f"{got!r}")
  got = [int(r) for r in got]
  if not got:
    raise ValueError("dp_ranks is empty: an allocator holds at least one rank")
  bad = [r for r in got if not 0 <= r < dp_size]
  if bad:
    raise ValueError(f"dp_ranks={got} names rank {bad[0]}, out of range for "
                     f"dp_size={dp_size} (ranks 0..{dp_size - 1})")
  if len(set(got)) != len(got):
    raise ValueError(f"dp_ranks={got} names a rank twice")
  return tuple(sorted(got))


def concat(parts: List[Any]) -> Any:
  """Queued index arrays as one: on the device (no wait) when any is a device array."""
  if any(isinstance(p, jax.Array) for p in parts):
    return jnp.concatenate([jnp.asarray(p, jnp.int32) for p in parts])
  return np.concatenate(parts)


class _Queued(NamedTuple):
  """One rank's frees queued in an open free group: slot frees, then page-id frees
  (an SWA pool's full side), and the SWA side's page ids and slots."""
  slots: List[np.ndarray]
  page_ids: List[Any]
  swa_page_ids: List[Any]
  swa_slots: List[Any]

  @classmethod
  def empty(cls) -> "_Queued":
    return tuple.__new__(cls, ([], [], [], []))  # (without namedtuple's Python __new__)


class BaseAllocator:
  """SGLang's allocator interface over `dp_size` pools (see the module docstring)."""

  def __init__(self, config: Any, dtype: Any = None, device: Any = None,
               kvcache: Any = None, backend: str = "device", dp_size: int = 1,
               dp_ranks: Optional[Sequence[int]] = None):
    rank_config = self._rank_config(config, dp_size)  # validates dp_size
    held = check_dp_ranks(dp_ranks, dp_size)
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * dp_size
    if len(devices) != dp_size:
      raise ValueError(f"device: a sequence needs one device per rank, got "
                       f"{len(devices)} for dp_size={dp_size}")
    self.config = config
    self.dtype = dtype
    self.device = device
    self.backend = backend
    self._kvcache = kvcache
    self._dp_size = dp_size
    self._dp_ranks = held                           # global rank of self._pools[i]
    self._index = {r: i for i, r in enumerate(held)}
    self._pools = [Pool(rank_config, make_backend(backend, rank_config, devices[r]),
                        f"dp_rank={r}: " if dp_size > 1 else "")
                   for r in held]
    self._group: Optional[List[_Queued]] = None  # per held rank, while a group is open
    # What every free group takes as its queue: its lists are emptied whenever a group
    # ends or is dropped, so a group opens without building anything.
    self._spare: List[_Queued] = [_Queued.empty() for _ in self._pools]
    self._calls = 0  # class calls so far: a device refusal raises within 8 of them
    # The fast paths' pool: the one pool of an allocator holding one rank, whose
    # `quiet` (not None: statuses read at once, no sticky refusal) lets a call skip
    # `_pool_index`'s poll; with several pools or deferred statuses, a stand-in whose
    # `quiet` is None. `_rank0`: the rank it holds, an int; a fast path takes a
    # dp_rank that `is` it (CPython keeps one object per small int; False, numpy ints
    # and other objects take the full checks).
    self._solo = self._pools[0] if len(self._pools) == 1 else _NO_POOL
    self._rank0 = held[0]

  @staticmethod
  def _rank_config(config: Any, dp_size: int) -> Any:
    """The config of one rank's pool (ValueError for a dp_size that does not fit)."""
    return _ranks.rank_config(config, dp_size)

  # -- attributes SGLang exposes -----------------------------------------------------
  @property
  def size(self) -> int:
    return self.config.size

  @property
  def page_size(self) -> int:
    return self.config.page_size

  @property
  def need_sort(self) -> bool:
    return self.config.need_sort

  @property
  def dp_size(self) -> int:
    return self._dp_size

  @property
  def dp_ranks(self) -> Tuple[int, ...]:
    """The ranks this allocator holds, ascending (every rank unless `dp_ranks=`)."""
    return self._dp_ranks

  @property
  def is_not_in_free_group(self) -> bool:
    return self._group is None

  def get_kvcache(self) -> Any:
    return self._kvcache

  @property
  def status_waits(self) -> int:
    """How many reads of a device pool's running status came before it had landed (each
    a wait): the 8-call limit, the views, or a refusal's error path."""
    return sum(pool.waits for pool in self._pools)

  def _pool_index(self, dp_rank: Any, everything: bool = False) -> int:
    """Where in self._pools rank dp_rank's pool is (TypeError / ValueError naming it
    otherwise, and ValueError for a rank held by another process). Every call goes
    through here first: it reads the statuses that have landed (`_poll`; all of them
    when `everything`)."""
    self._calls += 1  # `_poll`, inlined: every class call passes here
    for pool in self._pools:
      if pool.pending or pool.error is not None:
        pool.poll(self._calls, everything)
    if type(dp_rank) is int:
      i = self._index.get(dp_rank)
      if i is not None:
        return i  # the common case (`_rank_index`'s), without a call
    return self._rank_index(dp_rank)

  def _rank_index(self, dp_rank: Any) -> int:
    """`_pool_index` without reading statuses (clear: the way out of a refusal)."""
    if type(dp_rank) is int:
      i = self._index.get(dp_rank)
      if i is not None:
        return i  # the common case, without a call
    r = check_dp_rank(dp_rank, self._dp_size)
    i = self._index.get(r)
    if i is None:
      raise ValueError(f"dp_rank={r} is held by another process (this allocator holds "
                       f"dp_ranks={self._dp_ranks} of dp_size={self._dp_size})")
    return i

  def _poll(self, everything: bool = False) -> None:
    """Counts a class call and reads the device statuses that have landed (every one
    when `everything`: the views, which read the device anyway); raises a refusal."""
    self._calls += 1
    for pool in self._pools:
      if pool.pending or pool.error is not None:
        pool.poll(self._calls, everything)

  def _settled(self, dp_rank: Any = 0) -> int:
    """`_pool_index` for a call that reads the device anyway (the views): every status
    read first."""
    return self._pool_index(dp_rank, everything=True)

  def available_size(self, dp_rank: int = 0) -> int:
    """Free slots, released ones included, from the host mirror (no wait: SPEC 14)."""
    lists = self._solo.quiet
    if lists is None or dp_rank is not self._rank0:
      lists = self._pools[self._pool_index(dp_rank)].sides[0]
    return lists.avail

  # -- allocation ----------------------------------------------------------------------
  def alloc(self, need_size: int, dp_rank: int = 0):
    """`need_size` slots from the front of the free list, or None if they do not fit.

    Returns i32[need_size]: a jax array (device backend; returned without waiting) or a
    numpy array (host backend). Paged: need_size must be a multiple of page_size
    (ValueError otherwise; SGLang floors silently outside its debug mode). TypeError for
    non-ints, ValueError for negative sizes and sizes beyond int32.
    """
    pool = self._solo
    side = pool.quiet
    if (side is not None and pool.small and type(need_size) is int
        and dp_rank is self._rank0
        and 0 < need_size <= side.free_len * side.page_size
        and need_size % side.page_size == 0):
      return pool.alloc_now(need_size, need_size // side.page_size)  # fits, no merge
    pool = self._pools[self._pool_index(dp_rank)]
    side = pool.sides[0]
    if not (type(need_size) is int and 0 < need_size <= validate.INT32_MAX
            and need_size % side.page_size == 0):  # (else the checks that name it)
      need_size = validate.need_size(need_size, side.page_size)
      if need_size == 0:
        return pool.backend.empty()
    pages = need_size // side.page_size
    backend = pool.backend
    return self._allocate(pool, "alloc", pages > side.free_len, pages,  # SPEC 4.1
                          lambda s, fits: backend.alloc(s, need_size, fits))

  def _allocate(self, pool: Pool, op: str, trigger: bool, pages: int,
                run: Callable[[Any, bool], Tuple[Any, Any, Any]]) -> Any:
    """What every single-pool allocation ends with: the need_sort merge when its SPEC
    trigger fired, then run(state, fits) -> (state, slots or None, status), fits =
    `pages` fit the free list."""
    pool.merge_if(trigger)
    fits = pages <= pool.sides[0].free_len
    return pool.allocate(op, self._calls, (pages,), lambda s, _: run(s, fits))

  def _extend_plan(self, pool: Pool, prefix_lens, prefix_lens_cpu, seq_lens,
                   seq_lens_cpu, last_loc, extend_num_tokens,
                   num_new_pages: Optional[int]) -> Optional[Plan]:
    """An alloc_extend batch checked and counted (the *_cpu copies used when given), or
    None for an empty batch; ValueError / TypeError naming what is wrong otherwise."""
    backend = pool.backend
    pre_arg = prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu
    seq_arg = seq_lens if seq_lens_cpu is None else seq_lens_cpu
    plan = backend.extend_plan(pre_arg, seq_arg, last_loc, extend_num_tokens, None)
    if plan is None:  # input the backend's own checks did not take: the checks that name
      pre = validate.host_ints(pre_arg, "prefix_lens")  # what is wrong
      seq = validate.host_ints(seq_arg, "seq_lens")
      dev_last = self._device_last_loc(pool, last_loc, pre.shape[0])
      last = validate.host_last_loc(last_loc, dev_last, pre, self.page_size, 1)
      checked = validate.extend_args(pre, seq, last, extend_num_tokens,
                                     page_size=self.page_size,
                                     num_slots=pool.backend.pools[0].num_slots)
      if num_new_pages is not None:
        validate.num_new_pages(num_new_pages, checked.new_pages)
      if pre.shape[0] == 0:
        return None
      last = last if dev_last is None else dev_last
      plan = backend.extend_plan(pre, seq, last, checked.total_tokens, checked)
    elif num_new_pages is not None:
      validate.num_new_pages(num_new_pages, plan.pages)
    return plan

  def _decode_plan(self, pool: Pool, seq_lens, seq_lens_cpu, last_loc) -> Optional[Plan]:
    """An alloc_decode batch checked and counted, or None for an empty batch. A device
    seq_lens given beside seq_lens_cpu (as SGLang passes both) goes with it, taken as it
    is where the backend keeps device arrays (its host copy is what the checks read)."""
    backend = pool.backend
    seq_arg = seq_lens if seq_lens_cpu is None else seq_lens_cpu
    plan = backend.decode_plan(seq_arg, last_loc, False)
    if plan is None:  # the checks that name what is wrong
      seq = validate.host_ints(seq_arg, "seq_lens")
      dev_last = self._device_last_loc(pool, last_loc, seq.shape[0])
      last = validate.host_last_loc(last_loc, dev_last, seq, self.page_size, 2)
      validate.decode_args(seq, last, page_size=self.page_size,
                           num_slots=pool.backend.pools[0].num_slots)
      if seq.shape[0] == 0:
        return None
      plan = backend.decode_plan(seq, last if dev_last is None else dev_last, True)
    if seq_lens_cpu is not None and backend.keeps_device_arrays:
      dev_seq = validate.device_ints(seq_lens, "seq_lens")
      if dev_seq is not None:
        if dev_seq.shape != (plan.rows,):
          raise ValueError(f"seq_lens must have shape ({plan.rows},) as seq_lens_cpu, got "
                           f"{dev_seq.shape}")
        plan = plan._replace(seq_lens=dev_seq)
    return plan

  @staticmethod
  def _device_last_loc(pool: Pool, last_loc, bs: int):
    """last_loc as a backend that keeps device arrays takes a jax.Array (as it is,
    never read back); None where the host checks apply."""
    if not pool.backend.keeps_device_arrays or bs == 0:
      return None
    return validate.device_last_loc(last_loc, bs)

  def _keeps(self, r: int) -> bool:
    """Whether rank r's backend takes device arrays as they are (never read back)."""
    return self._pools[r].backend.keeps_device_arrays

  # -- free ----------------------------------------------------------------------------
  def free(self, free_index, dp_rank: int = 0) -> None:
    """Returns slots to the pool (queued while a free group is open).

    free_index: integer slots, each in page_size..num_slots-1 (ValueError otherwise:
    page 0 is reserved); TypeError for floats. Host data (numpy, lists) is freed without
    waiting. A device array is first read back (one wait, as SGLang's `free` has in
    torch.unique): the checks and the paged allocator's count of distinct pages need
    its values; `free_page_ids` / `free_segment` take device arrays without a read.
    """
    pool = self._solo
    if pool.quiet is not None and dp_rank is self._rank0:
      if free_index.__class__ is _NDARRAY and free_index.size == 0 and (
          free_index.ndim == 1):
        return  # nothing to free (the fast-path pool: nothing to poll)
      r = 0
    else:
      r = self._pool_index(dp_rank)
      pool = self._pools[r]
    if pool.small:  # a host pool: small frees of checked slots on Python ints
      slots = pool.backend.small_slots(free_index)
      if slots is not None:
        if not slots:
          return  # nothing to free
        if self._group is not None:
          self._group[r].slots.append(free_index.copy())  # a copy (SPEC 7)
          return
        if self._free_small(pool, free_index, slots):
          return
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return
    validate.free_index(idx, page_size=self.page_size, num_slots=self.config.num_slots)
    self._queue_or_free(r, idx, "free")

  def _free_small(self, pool: Pool, x: np.ndarray, slots: list) -> bool:
    """`_free_now` of checked small host slots on the host backend's Python-int path:
    True when it ran, False (nothing changed) where `_free_now` must decide."""
    return pool.free_small(x, slots)

  def _queue_or_free(self, r: int, idx: np.ndarray, op: str) -> None:
    """Checked host slots freed now (`op` names the class call in a refusal), or queued
    in the open free group."""
    if self._group is not None:
      # A copy: later changes to the caller's buffer must not reach the queue (SPEC 7).
      self._group[r].slots.append(np.array(idx, copy=True))
      return
    self._free_now(self._pools[r], idx, op)

  def _free_now(self, pool: Pool, idx: np.ndarray, op: str = "free") -> None:
    if self.config.kind == "paged":  # the sorted unique pages reach the list (SPEC 4.4)
      values = np.unique(idx // self.page_size)
    else:                            # the slots as given, FIFO (SPEC 3)
      values = idx
    pool.write(op, self._calls, (values.shape[0],),
               lambda s, counts, shared: pool.backend.free(s, idx, values, counts, shared))

  def _free_page_ids_now(self, pool: Pool, ids: Any, op: str = "free_page_ids") -> None:
    """Prepends checked, distinct page ids (host int64 or device i32) as one block."""
    if isinstance(ids, np.ndarray):
      ids = ids.astype(np.int32)
    pool.write(op, self._calls, (ids.shape[0],),
               lambda s, counts, shared: pool.backend.free_page_ids(s, ids, counts, shared))

  # A single pool has no sliding-window peer: SGLang's free_full* are the plain frees
  # (free_segment(s) as each class defines them).
  def free_full(self, free_index, dp_rank: int = 0) -> None:
    """SGLang's free_full: without a sliding-window peer, `free`."""
    self.free(free_index, dp_rank=dp_rank)

  def free_full_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """SGLang's free_full_segment: without a sliding-window peer, `free_segment`."""
    self.free_segment(free_index, start_pos=start_pos, dp_rank=dp_rank)

  def free_full_segments(self, segments, dp_rank: int = 0) -> None:
    """SGLang's free_full_segments: without a sliding-window peer, `free_segments`."""
    self.free_segments(segments, dp_rank=dp_rank)

  def merge_and_sort_free(self, dp_rank: int = 0) -> None:
    """release_pages merged, sorted, into free_pages (SPEC 6)."""
    pool = self._pools[self._pool_index(dp_rank)]
    for side in range(len(pool.sides)):
      pool.merge_if(True, side)

  # -- free groups ---------------------------------------------------------------------
  def free_group_begin(self) -> None:
    """Opens a free group on every held rank: frees are queued until free_group_end
    (SPEC 7; page-id frees in a second queue, SPEC 10)."""
    if self._solo.quiet is None or self._group is not None:  # (else nothing to poll)
      self._poll()
      if self._group is not None:
        validate.group_begin(self._group)  # raises
    self._group = self._spare  # (empty: see `_drop_queue`)

  def free_group_end(self) -> None:
    """Closes the free group: on each held rank, the queued slot frees as one `free`,
    then the queued page-id frees as one block in front (SPEC 7 and 10). The group is
    closed whatever it raises: after a refusal its queue is dropped (nothing freed)."""
    queued, self._group = self._group, None  # closed even when a refusal raises below
    if queued is not None and self._solo.quiet is not None:
      q = queued[0]
      if not (q.slots or q.page_ids or q.swa_page_ids or q.swa_slots):
        return  # nothing queued and nothing to poll
    try:
      self._poll()
      validate.group_end(queued)
      for pool, q in zip(self._pools, queued):
        self._flush(pool, q)
    finally:
      self._drop_queue(queued)

  def _drop_queue(self, queued: Optional[List[_Queued]]) -> None:
    """Empties a queue that is no longer open (the next group reuses its lists)."""
    for q in queued or ():
      for part in q:
        part.clear()

  def _flush(self, pool: Pool, q: _Queued) -> None:
    """One rank's queued frees, in SPEC 7 and 10's order."""
    if q.slots:
      idx = q.slots[0] if len(q.slots) == 1 else np.concatenate(q.slots)
      slots = pool.backend.small_slots(idx) if pool.small else None
      if slots is None or not self._free_small(pool, idx, slots):
        self._free_now(pool, idx, "free_group_end")
    if q.page_ids:
      self._free_page_ids_now(pool, concat(q.page_ids), "free_group_end")

  # -- state ---------------------------------------------------------------------------
  def clear(self, dp_rank: Optional[int] = None) -> None:
    """Back to the initial state (SPEC 2): every held rank, closing any open free group;
    or rank dp_rank only, dropping the frees queued for it (the group stays open for the
    other ranks unless dp_size == 1)."""
    if dp_rank is None:
      targets = range(len(self._pools))
    else:
      targets = [self._rank_index(dp_rank)]
    for r in targets:
      self._pools[r].clear()
      if self._group is not None:
        for part in self._group[r]:
          part.clear()
    if dp_rank is None or self._dp_size == 1:
      self._group = None

  def backup_state(self):
    """A snapshot that `restore_state` puts back exactly (SPEC 8): an AllocatorSnapshot,
    or with dp_size > 1 a RankedSnapshot of every held rank. O(1) per rank: the snapshot
    holds the current rings, which are copied only if a later free writes them. No
    wait: lengths from the host mirror."""
    self._poll()
    snaps = tuple(pool.snapshot() for pool in self._pools)
    if self._dp_size == 1:
      return snaps[0]
    return RankedSnapshot(self.config, snaps, self._dp_ranks)

  def restore_state(self, state) -> None:
    """Puts a snapshot from `backup_state` of an allocator of the same config and held
    ranks back, every held rank or none (TypeError / ValueError otherwise). O(1); a
    snapshot without lengths (built by hand) has them read from its state (a wait)."""
    if self._dp_size == 1:
      snaps = (state,)
    else:
      if not isinstance(state, RankedSnapshot):
        raise TypeError(f"state must be a RankedSnapshot from backup_state() of an "
                        f"allocator with dp_size={self.dp_size}, got "
                        f"{type(state).__name__}")
      taken = (tuple(range(len(state.ranks))) if state.dp_ranks is None
               else tuple(state.dp_ranks))
      if (state.config != self.config or taken != self._dp_ranks
          or len(state.ranks) != len(taken)):
        raise ValueError(f"state is a snapshot of another allocator ({state.config}, "
                         f"{len(state.ranks)} ranks, dp_ranks={taken}), not of "
                         f"{self.config} with dp_size={self.dp_size} holding "
                         f"dp_ranks={self._dp_ranks}")
      snaps = state.ranks
    for pool, snap in zip(self._pools, snaps):
      pool.check_snapshot(snap)
    for pool, snap in zip(self._pools, snaps):
      pool.restore(snap, self._calls)

  @property
  def state(self):
    """The functional state (for handing the pool to jitted code; give it back with
    `set_state`). Its rings count as held from now on: the next write to one copies it.
    With dp_size > 1, every held rank's state stacked along a leading axis in dp_ranks
    order (a new array, O(pool): the state jax_kvalloc.ranks works on; ranks on
    different devices cannot be stacked)."""
    self._poll()
    states = [pool.hold() for pool in self._pools]
    return states[0] if self._dp_size == 1 else _ranks.stack_ranks(states)

  def set_state(self, state) -> None:
    """Takes back a state that jitted code returned (it got the pool from `state`).

        state, slots, ok = my_step(allocator.state, ...)   # the class does not donate
        allocator.set_state(state)                         # what `state` handed out

    state: an AllocatorState of this pool's shapes and dtypes (with dp_size > 1: ranked,
    the held ranks along the leading axis in dp_ranks order), not a tracer, whose
    lengths and heads describe lists of this pool (TypeError / ValueError naming the
    field otherwise; nothing changed, on any rank). A refusal the caller's code recorded
    in the ownership record raises guard.FreeRefusedError (a ValueError), and in debug
    mode a misuse it recorded raises AllocatorDebugError; the state is not taken. Reads
    the lengths (a wait). The caller may still hold these arrays, so the next write copies
    rather than donates.
    """
    self._poll(everything=True)
    if self._dp_size == 1:
      parts = [state]
    else:
      ring = jax.tree.leaves(state)[0]  # the (full) pool's free ring: i32[ranks, pages]
      if np.ndim(ring) != 2:
        raise ValueError(f"expected a ranked state (free_ring i32[dp_size, "
                         f"pages_per_rank]), got free_ring of shape {np.shape(ring)}")
      if np.shape(ring)[0] != len(self._pools):
        raise ValueError(f"state has {np.shape(ring)[0]} ranks, this allocator holds "
                         f"{len(self._pools)} (dp_ranks={self._dp_ranks})")
      parts = [jax.tree.map(lambda x, i=i: x[i], state) for i in range(len(self._pools))]
    checked = [pool.check_state(part) for pool, part in zip(self._pools, parts)]
    for pool, part, lengths in zip(self._pools, parts, checked):
      pool.take(part, lengths)

  # -- views ---------------------------------------------------------------------------
  @property
  def free_pages(self):
    """The free list in order (slot ids for the token allocator), i32[len]; with
    dp_size > 1 a list, rank r's at [r] (None for a rank held by another process).
    Reads the device (device backend)."""
    self._poll(everything=True)
    return self._per_rank([_live(pool.state, "free") for pool in self._pools])

  @property
  def release_pages(self):
    """The release list in order (need_sort), i32[len]; a list per rank as free_pages.
    Reads the device (device backend)."""
    self._poll(everything=True)
    return self._per_rank([_live(pool.state, "release") for pool in self._pools])

  def _per_rank(self, held: List[Any]) -> Any:
    """One value per held rank as the views give it: the value itself with dp_size 1,
    else a list over every rank, None at ranks held elsewhere."""
    if self._dp_size == 1:
      return held[0]
    out: List[Any] = [None] * self._dp_size
    for r, x in zip(self._dp_ranks, held):
      out[r] = x
    return out

  def get_all_free_pages(self, dp_rank: int = 0) -> np.ndarray:
    """free_pages ++ release_pages of rank dp_rank (SPEC 10), a host int32 array (reads
    the device)."""
    state = self._pools[self._settled(dp_rank)].state
    return np.concatenate([_live(state, "free"), _live(state, "release")])

  def debug_print(self, dp_rank: Optional[int] = None) -> str:
    """One line: free, released and in-use pages, and any open free group (from the
    host mirror: no wait). Returns the string (as SGLang's does). With dp_size > 1 and
    dp_rank None, one line per held rank, prefixed "rank r:"."""
    if dp_rank is not None or self._dp_size == 1:
      return self._debug_line(self._pool_index(0 if dp_rank is None else dp_rank))
    self._poll()
    return "\n".join(f"rank {r}: {self._debug_line(i)}"
                     for i, r in enumerate(self._dp_ranks))

  def _debug_line(self, r: int) -> str:
    lists = self._pools[r].sides[0]
    free, released = lists.free_len, lists.release_len
    num_pages = lists.num_pages
    group = ""
    if self._group is not None:
      q = self._group[r]
      group = (f", free group open ({sum(a.size for a in q.slots)} slots and "
               f"{sum(a.shape[0] for a in q.page_ids)} page ids queued)")
    return (f"{type(self).__name__}: page_size={self.page_size} free={free} "
            f"released={released} in_use={num_pages - free - released} of {num_pages} "
            f"pages (available_size={(free + released) * self.page_size}){group}")

  # -- host copies of the KV cache: delegated, as SGLang does --------------------------
  def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
    """SGLang's get_cpu_copy: the kvcache's get_cpu_copy of these indices."""
    return self._kvcache_for("get_cpu_copy").get_cpu_copy(
        indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

  def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None,
                    req_pool_index=None):
    """SGLang's load_cpu_copy: the kvcache's load_cpu_copy."""
    return self._kvcache_for("load_cpu_copy").load_cpu_copy(
        kv_cache_cpu, indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

  def _kvcache_for(self, op: str) -> Any:
    kvcache = self.get_kvcache()
    if kvcache is None:
      raise RuntimeError(f"{op}() delegates to the kvcache, but this allocator was built "
                         "with kvcache=None")
    return kvcache

  # -- compiling ahead -----------------------------------------------------------------
  def warmup(self, max_batch: int = 256, max_tokens: int = 8192,
             max_free: Optional[int] = None, exact_sizes: Sequence[int] = (),
             device_last_loc: bool = False, verbose: bool = False) -> WarmupReport:
    """Compiles, before serving, every program a call within these maxima can need.

    Device backend: every shape bucket of alloc (up to max_tokens slots), alloc_decode
    (each batch size up to 64 rows, which run at their exact size, then buckets up to
    max_batch), alloc_extend (every rows x tokens bucket pair), the frees (up to
    max_free indices, default max_tokens; donating and copying variants) and the
    need_sort merge; the SWA class: its programs over both pools alike. Plus the
    exact-length output slices of `exact_sizes` (an output shorter than its bucket is
    cut by a tiny program compiled once per (bucket, length): list the lengths you
    expect). `device_last_loc=True` when last_loc (and seq_lens, page ids, segments'
    free_index) will come as device arrays: also the programs that take them so, and
    the pads of a last_loc from each of `exact_sizes` rows. The state is not changed.
    The host backend and debug mode compile nothing here (debug mode compiles its
    programs on first use). Ranks of one config share their programs.

    Returns WarmupReport(programs, seconds), summed over the ranks. With JAX's
    persistent compilation cache on (jax_kvalloc.warmup.enable_persistent_cache) a
    second process loads these programs from disk.
    """
    for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
      validate.count(value, name)
    max_free = max_tokens if max_free is None else validate.count(max_free, "max_free")
    sizes = [validate.count(n, "exact_sizes") for n in exact_sizes if n]
    programs, seconds = 0, 0.0
    for pool in self._pools:
      report = pool.backend.warmup(
          pool.state, max_batch=max(max_batch, 1), max_tokens=max(max_tokens, 1),
          max_free=max(max_free, 1), exact_sizes=sizes, extend=True,
          device_last_loc=device_last_loc)
      programs, seconds = programs + report.programs, seconds + report.seconds
    if verbose:
      print(f"{type(self).__name__}.warmup: {programs} programs in {seconds:.2f} s")
    return WarmupReport(programs, seconds)

  def __repr__(self) -> str:
    c = self.config
    dp = f", dp_size={self.dp_size}" if self.dp_size > 1 else ""
    if len(self._pools) != self._dp_size:
      dp += f", dp_ranks={self._dp_ranks}"
    swa = f", size_swa={c.size_swa}" if hasattr(c, "size_swa") else ""  # SWA pools
    return (f"{type(self).__name__}(size={c.size}{swa}, page_size={c.page_size}, "
            f"need_sort={c.need_sort}, kernel={c.kernel!r}, debug={c.debug}, "
            f"backend={self.backend!r}{dp})")


_NDARRAY = np.ndarray


class _NoPool(NamedTuple):
  """`BaseAllocator._solo` of an allocator without a fast-path pool."""
  quiet: Any = None


_NO_POOL = _NoPool()


def _live(state, which: str) -> np.ndarray:
  """One list of a state in order, host int32 (reads the device)."""
  from jax_kvalloc import state as st  # pylint: disable=g-import-not-at-top
  return st.live_free_pages(state) if which == "free" else st.live_release_pages(state)
