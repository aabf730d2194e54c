"""SGLang 0.5.23's SWATokenToKVPoolAllocator (SPEC 13): two pools, full attention and
sliding window, and the mapping between them, on the same machinery as the pool classes.

Each rank's pool (jax_kvalloc.sglang.pool) holds an `SWAState` (jax_kvalloc.swa: both
pools' states and the mapping) and two host mirrors, one per pool; its backend runs the
SPEC 13 operations (jax_kvalloc.sglang.backends: device_swa, host_swa, debug mode). A
method checks everything the host can (jax_kvalloc.validate), decides from the mirrors
whether both pools fit and which need_sort merges SPEC's triggers run, then makes one
backend call: on the device, one jitted program over both pools and the mapping. What
only the state knows (a last_loc or a freed segment without an SWA peer) the backend
checks: the host backend raises at once, the device backend returns it as the call's
status, read later without waiting (SPEC 14; jax_kvalloc.sglang.base). Data-parallel
ranks, free groups, snapshots, `state` / `set_state` and warm-up are the base class's.

Waits (device backend). Allocations, the segment frees (free_swa_segment, free_segment,
free_full_segment, device-array free_index too) and free_full never wait: each pool's
mirror counts one page per full page of a segment, so each must have its SWA peer (as
SGLang's `swa.peer_mapped` invariant says; a page without one is refused). free_swa and
free of host slots at page size > 1 free the sorted unique SWA pages of the peers
found; each rank's pool keeps a host record of which full pages still have SWA KV
(jax_kvalloc.sglang.swa_peers), and the count comes from it, without a wait. Where the
record cannot know (a mapping set by hand, an SWA tail not aligned to the pages) the
count is read, as SGLang's own free_swa synchronizes there, and the record is rebuilt
from the state then. free / free_swa / free_full of a device array read it (the host
checks need the values). free_swa at page size > 1 refuses a full page the full pool
does not hold (SPEC 14's ownership record), as free does.

One deliberate difference (SPEC 13): `alloc_decode` allocates in neither pool unless
both fit (SGLang keeps what the fitting pool took). Debug mode (`debug=True`) also
checks, before anything changes, that SWA frees find a peer for every slot and that
full-only frees find none left (SWADebugError), on top of each pool's own checks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_kvalloc import ranks as _ranks
from jax_kvalloc import swa as core
from jax_kvalloc import validate
from jax_kvalloc.sglang.backends.device_swa import SWADebugError
from jax_kvalloc.sglang.base import BaseAllocator
from jax_kvalloc.sglang.base import concat
from jax_kvalloc.sglang.pool import Pool
from jax_kvalloc.sglang.swa_peers import PeerRecord
from jax_kvalloc.sglang.token import _pair

__all__ = ["SWADebugError", "SWATokenToKVPoolAllocator"]

FULL, SWA = 0, 1  # the pools of an SWA pool pair, in its mirrors (Pool.sides)


class SWATokenToKVPoolAllocator(BaseAllocator):
  """Two pools (full attention, sliding window) and the mapping between them (SPEC 13).

  Args:
    size: full-attention slots; size_swa: sliding-window slots.
    page_size: slots per page of both pools (1: token pools and `alloc`; > 1:
      alloc_extend / alloc_decode).
    dtype, device: as SGLang's (device places the state: "cpu", "cuda", a jax.Device,
      or one per rank).
    kvcache: stored and returned by get_kvcache(); may be None (the mapping is ours).
    need_sort: both pools park freed pages until a shortfall merges them.
    kernel, debug, guard, backend: as our pool classes ("device": jax arrays, no waits
      on allocation; "host": NumPy; guard: each pool keeps its ownership record).
    dp_size, dp_ranks: data-parallel ranks as on the pool classes
      (jax_kvalloc.sglang.base), each an SWA pool pair of size // dp_size and
      size_swa // dp_size slots; methods then take `dp_rank=` (default 0).
  """

  def __init__(self, size: int, size_swa: int, page_size: int, dtype: Any = None,
               device: Any = None, kvcache: Any = None, need_sort: bool = False, *,
               kernel: Optional[str] = None, debug: Optional[bool] = None,
               guard: bool = True, backend: str = "device", dp_size: int = 1,
               dp_ranks: Optional[Sequence[int]] = None):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = core.SWAConfig(size, size_swa, page_size, need_sort, guard=guard, **extra)
    super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size,
                     dp_ranks=dp_ranks)
    for pool in self._pools:  # a deferring backend's SWA counts (swa_peers); without
      # the ownership record a free page's SWA count is the mapping's: read, as SGLang
      if guard and pool.backend.defers_status and page_size > 1:
        pool.peers = PeerRecord(pool.backend.pools[FULL].num_pages, page_size)

  @staticmethod
  def _rank_config(config: core.SWAConfig, dp_size: int) -> core.SWAConfig:
    full = _ranks.rank_config(config.full, dp_size)  # validates dp_size
    if dp_size > 1 and (config.size % dp_size or config.size_swa % dp_size):
      raise ValueError(f"size={config.size} and size_swa={config.size_swa} must be "
                       f"multiples of dp_size={dp_size}")
    swa = _ranks.rank_config(config.swa, dp_size)
    return dataclasses.replace(config, size=full.size, size_swa=swa.size)

  # -- sizes -----------------------------------------------------------------------------
  @property
  def size(self) -> int:
    return min(self.config.size, self.config.size_swa)

  @property
  def size_full(self) -> int:
    return self.config.size

  @property
  def size_swa(self) -> int:
    return self.config.size_swa

  def full_available_size(self, dp_rank: int = 0) -> int:
    return self._pools[self._pool_index(dp_rank)].available_size(FULL)

  def swa_available_size(self, dp_rank: int = 0) -> int:
    return self._pools[self._pool_index(dp_rank)].available_size(SWA)

  def available_size(self, dp_rank: int = 0) -> int:
    """min(full, SWA) available slots, from the host mirrors."""
    pool = self._pools[self._pool_index(dp_rank)]
    return min(pool.available_size(FULL), pool.available_size(SWA))

  def new_pages_available(self, num_full_pages: int, num_swa_pages: int,
                          dp_rank: int = 0) -> bool:
    return self._fits(self._pools[self._pool_index(dp_rank)], num_full_pages,
                      num_swa_pages)

  @staticmethod
  def _fits(pool: Pool, full_pages: int, swa_pages: int) -> bool:
    """Both counts fit their pool's free and released pages (SGLang's check)."""
    return (full_pages <= pool.sides[FULL].available()
            and swa_pages <= pool.sides[SWA].available())

  def _debug_line(self, r: int) -> str:
    """SGLang's summary line: both pools' available sizes."""
    pool = self._pools[r]
    return (f"#swa-available-size: {pool.available_size(SWA)}, "
            f"#full-attn-available-size: {pool.available_size(FULL)}, ")

  # -- SGLang's views ----------------------------------------------------------------------
  @property
  def full_attn_allocator(self) -> "_PoolView":
    """The full-attention pool (of rank 0, or of `view.rank(r)`): page_size, size,
    available_size(), free_pages, release_pages (read-only; the class changes it)."""
    return _PoolView(self, FULL)

  @property
  def swa_attn_allocator(self) -> "_PoolView":
    """The sliding-window pool, as full_attn_allocator."""
    return _PoolView(self, SWA)

  @property
  def free_pages(self) -> None:
    """None, as SGLang's SWA class has (each pool's are on its view)."""
    return None

  @property
  def release_pages(self) -> None:
    return None

  def get_all_free_pages(self, dp_rank: int = 0) -> None:
    """None, as SGLang's SWA class returns (each pool's are on its view)."""
    self._pool_index(dp_rank)

  # -- the mapping -------------------------------------------------------------------------
  @property
  def full_to_swa_index_mapping(self):
    """i32[size + page_size + 1]: the SWA slot of each full slot (0: none), last -1 (a
    list per rank with dp_size > 1, None at ranks held elsewhere). Held from now on:
    the next write copies it."""
    self._poll()
    return self._per_rank([pool.backend.mapping(pool.hold()) for pool in self._pools])

  def set_full_to_swa_mapping(self, full_indices, swa_indices, dp_rank: int = 0) -> None:
    """mapping[full_indices] = swa_indices."""
    pool = self._pools[self._pool_index(dp_rank)]
    if np.shape(full_indices) != np.shape(swa_indices):
      raise ValueError(f"full_indices {np.shape(full_indices)} and swa_indices "
                       f"{np.shape(swa_indices)} differ")
    full = self._checked_slots(pool, full_indices, "full_indices")
    if full.shape[0]:
      pool.update(lambda s, shared: pool.backend.set_mapping(s, full, swa_indices, shared))
      self._irregular(pool)

  def clear_full_to_swa_mapping(self, full_indices, dp_rank: int = 0) -> None:
    """mapping[full_indices] = 0."""
    pool = self._pools[self._pool_index(dp_rank)]
    full = self._checked_slots(pool, full_indices, "full_indices")
    if full.shape[0]:
      pool.update(lambda s, shared: pool.backend.clear_mapping(s, full, shared))
      self._irregular(pool)

  @staticmethod
  def _irregular(pool: Pool) -> None:
    """A mapping written by hand: SWA counts come from the device until the pairing is
    regular again (jax_kvalloc.sglang.swa_peers)."""
    if pool.peers is not None:
      pool.peers.irregular_now()

  def translate_loc_from_full_to_swa(self, kv_indices, dp_rank: int = 0):
    """mapping[kv_indices] (-1 stays -1): a jax array (device backend, no wait) or
    numpy."""
    pool = self._pools[self._pool_index(dp_rank)]
    return pool.backend.translate(pool.state, kv_indices)

  def _checked_slots(self, pool: Pool, x: Any, name: str) -> Any:
    """Full slots as the backend takes them: a device array as it is, else host ints
    in 1..num_slots - 1 (ValueError naming `name` otherwise)."""
    dev = validate.device_ints(x, name) if pool.backend.keeps_device_arrays else None
    if dev is not None:
      return dev
    idx = validate.host_ints(x, name)
    if idx.size:
      validate.free_index(idx, page_size=1, num_slots=pool.backend.pools[FULL].num_slots)
    return idx

  # -- allocation ----------------------------------------------------------------------------
  def _launch(self, pool: Pool, op: str, pages: Tuple[int, int], triggers: Tuple[int, int],
              run) -> Any:
    """Each pool's need_sort merge when its SPEC trigger (rows or pages it compares with
    len(free_pages)) exceeds it, then the call if both pools fit, else None."""
    for side in (FULL, SWA):
      pool.merge_if(triggers[side] > pool.sides[side].free_len, side)
    if pages[FULL] > pool.sides[FULL].free_len or pages[SWA] > pool.sides[SWA].free_len:
      return None
    return pool.allocate(op, self._calls, pages, run)

  def alloc(self, need_size: int, dp_rank: int = 0):
    """`need_size` slots in both pools (page size 1 only), or None if either is short."""
    pool = self._pools[self._pool_index(dp_rank)]
    if self.page_size != 1:
      raise ValueError(f"alloc needs page_size 1 (as SGLang asserts), got "
                       f"{self.page_size}; use alloc_extend")
    need_size = validate.count(need_size, "need_size")
    if not self._fits(pool, need_size, need_size):
      return None
    if need_size == 0:
      return pool.backend.empty()
    return self._launch(pool, "alloc", (need_size, need_size), (need_size, need_size),
                        lambda s, shared: pool.backend.alloc(s, need_size, shared))

  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens: int, num_new_pages: Optional[int] = None,
                   dp_rank: int = 0):
    """Slots for a prefill batch in both pools (SPEC 13), or None if either is short.

    Arguments as PagedTokenToKVPoolAllocator.alloc_extend; last_loc is the full pool's
    (the SWA pool gets its translation: a row continuing a page whose SWA KV was freed
    is refused, ValueError naming last_loc). Returns the full slots (the SWA slots are
    in the mapping).
    """
    pool = self._pools[self._pool_index(dp_rank)]
    if self.page_size == 1:
      raise ValueError("alloc_extend needs page_size > 1 (as SGLang asserts); use alloc")
    plan = self._extend_plan(pool, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                             last_loc, extend_num_tokens, num_new_pages)
    pages = 0 if plan is None else plan.pages
    if not self._fits(pool, pages, pages):
      return None
    if plan is None:  # each pool's SPEC 4.2 trigger still fires: 0 // ps + 0 + 1 > free
      for side in (FULL, SWA):
        pool.merge_if(1 > pool.sides[side].free_len, side)
      return pool.backend.empty()
    trigger = plan.tokens // self.page_size + plan.rows + 1  # SPEC 4.2, in each pool
    return self._launch(pool, "alloc_extend", (pages, pages), (trigger, trigger),
                        lambda s, shared: pool.backend.alloc_extend(s, plan, shared))

  def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                            last_loc, extend_num_tokens: int, swa_tail_len: int,
                            dp_rank: int = 0):
    """One request's extend: full slots for every token, SWA slots only for the last
    `swa_tail_len` (a fresh SWA request); None if either pool is short (SPEC 13)."""
    pool = self._pools[self._pool_index(dp_rank)]
    if self.page_size == 1:
      raise ValueError("alloc_extend_swa_tail needs page_size > 1 (as SGLang asserts)")
    ps = self.page_size
    for name, arg in (("prefix_lens", prefix_lens if prefix_lens_cpu is None else
                       prefix_lens_cpu), ("seq_lens", seq_lens if seq_lens_cpu is None
                                          else seq_lens_cpu)):
      shape = tuple(arg.shape) if hasattr(arg, "shape") else np.shape(arg)  # no read
      if shape != (1,):
        raise ValueError(f"alloc_extend_swa_tail takes one request (as SGLang), got "
                         f"{name} of shape {shape}")
    ext = validate.count(extend_num_tokens, "extend_num_tokens")
    tail = validate.count(swa_tail_len, "swa_tail_len")
    if tail > ext:
      raise ValueError(f"swa_tail_len={tail} must be <= extend_num_tokens={ext}")
    plan = self._extend_plan(pool, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                             last_loc, ext, None)
    swa_pages = -(-tail // ps)
    if plan is None or not self._fits(pool, plan.pages, swa_pages):
      return None
    # Each pool's SPEC 4.2 trigger, the SWA pool's only when it is called (tail > 0).
    triggers = (ext // ps + 2, tail // ps + 2 if tail else 0)
    out = self._launch(pool, "alloc_extend_swa_tail", (plan.pages, swa_pages), triggers,
                       lambda s, shared: pool.backend.alloc_extend_swa_tail(
                           s, plan, tail, shared))
    if out is not None and pool.peers is not None:
      self._tail_peers(pool, int(plan.data[0][0]), ext - tail, tail, out)
    return out

  def _tail_peers(self, pool: Pool, pre: int, head: int, tail: int, out: Any) -> None:
    """The record after an SWA tail (swa_peers), for a request that starts a page: its
    tail pages pair as any allocation's when the tail starts a page; the head's pages
    have no SWA KV (their ids read once `out` has landed). Else irregular."""
    ps = self.page_size
    if pre % ps or (head % ps and tail):
      pool.peers.irregular_now()
    elif head:
      pool.peers.mark(out, False, ps, head)

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, dp_rank: int = 0):
    """One slot per request in both pools (SPEC 13), or None.

    Each pool first runs its own need_sort merge trigger (bs > len(free_pages)), as
    SGLang's two calls do; unless both pools then fit, neither allocates (SGLang keeps
    what the fitting pool took). Returns the full slots.
    """
    pool = self._pools[self._pool_index(dp_rank)]
    if self.page_size == 1:
      raise ValueError("alloc_decode needs page_size > 1 (as SGLang asserts); use alloc")
    plan = self._decode_plan(pool, seq_lens, seq_lens_cpu, last_loc)
    if plan is None:
      return pool.backend.empty()
    return self._launch(pool, "alloc_decode", (plan.pages, plan.pages),
                        (plan.rows, plan.rows),
                        lambda s, shared: pool.backend.alloc_decode(s, plan, shared))

  # -- freeing -------------------------------------------------------------------------------
  def _slots(self, pool: Pool, free_index) -> np.ndarray:
    """free_index as checked host int64 slots (a device array is read)."""
    idx = validate.host_ints(free_index, "free_index")
    if idx.size:
      validate.free_index(idx, page_size=self.page_size,
                          num_slots=pool.backend.pools[FULL].num_slots)
    return idx

  def _segment_arg(self, pool: Pool, free_index, start_pos, full: bool) -> Any:
    """A segment's free_index: a device i32 array as it is (device backend, never read
    back), else checked host int64 slots (with the full pool's segment checks when
    `full`: one request's consecutive tokens, no page twice)."""
    validate.start_pos(start_pos, self.page_size)
    dev = (validate.device_ints(free_index, "free_index")
           if pool.backend.keeps_device_arrays else None)
    if dev is not None:
      return dev
    idx = self._slots(pool, free_index)
    if full and idx.size and self.page_size > 1:
      validate.segment(idx, page_size=self.page_size)
    return idx

  def _full_pages(self, idx: Any) -> int:
    """Entries a full-pool `free` of these slots lists: its sorted unique pages (host
    slots), or the slots themselves at page size 1."""
    ps = self.page_size
    return np.unique(idx // ps).shape[0] if ps > 1 else idx.shape[0]

  def _free(self, pool: Pool, op: str, idx: Any, start: int,
            counts: Tuple[Optional[int], Optional[int]], name: Optional[str] = None) -> None:
    """The backend's free `op`; a refusal names the class call `name` (default op). A
    count left to the backend (None) was read: the record is rebuilt after it."""
    pool.write(name or op, self._calls, counts, lambda s, cut, shared: pool.backend.free(
        s, op, idx, start, cut, shared))
    if pool.peers is not None and None in counts:
      pool.peers.rebuild(pool.state)

  def _release(self, pool: Pool, idx: np.ndarray, value: bool) -> Optional[int]:
    """The SWA pages a free_swa of host slots `idx` (page size > 1) releases, from the
    record (swa_peers), its pages then set to `value`; None where only the device
    knows (host backend, debug mode, an irregular pairing)."""
    if pool.peers is None:
      return None
    return pool.peers.release(np.unique(idx // self.page_size), value)

  def _mark(self, pool: Pool, idx: Any, value: bool, pages: bool = False) -> None:
    """The record's full pages of a segment `idx` (slots from a page start; `pages`:
    page ids) set to `value`: True freed in the full pool, False their SWA KV freed."""
    if pool.peers is None:
      return
    step = 1 if pages else self.page_size
    if isinstance(idx, np.ndarray):
      pool.peers.mark(idx[::step] // step, value)
    else:
      pool.peers.mark(idx, value, step, idx.shape[0])

  def _take(self, r: int, op: str, idx: Any, name: str) -> None:
    """Inside a free group: the SWA half resolved now (mapping read and cleared), its
    SWA page ids ("take_pages", counted: one per full page) or slots ("take_peers")
    queued (SPEC 13)."""
    pool = self._pools[r]
    count = None
    if op == "take_pages":
      self._mark(pool, idx, False)
    else:
      count = self._release(pool, idx, False)
    out = pool.allocate(name, self._calls, (0, 0),
                        lambda s, shared: pool.backend.take(s, op, idx, shared, name))
    if op == "take_pages":
      self._group[r].swa_page_ids.append((out, -(-idx.shape[0] // self.page_size)))
    else:
      self._group[r].swa_slots.append((out, count))

  def free(self, free_index, dp_rank: int = 0) -> None:
    """free_swa then free_full of these full slots (SPEC 13)."""
    r = self._pool_index(dp_rank)
    pool = self._pools[r]
    idx = self._slots(pool, free_index)
    if idx.size == 0:
      return
    ps = self.page_size
    if self._group is not None:
      self._take(r, "take_pages" if ps == 1 else "take_peers", idx, "free_swa")
      self._group[r].slots.append(np.array(idx, copy=True))
      return
    swa = idx.size if ps == 1 else self._release(pool, idx, True)
    self._free(pool, "free", idx, 0, (self._full_pages(idx), swa))

  def free_swa(self, free_index, dp_rank: int = 0) -> None:
    """Frees the SWA peers of these full slots and clears their mapping (SPEC 13).

    Page size 1: as free_swa_segment(free_index, start_pos=0). Page size > 1: every slot
    of their full pages; the SWA pool frees the sorted unique pages of the peers found
    (SPEC 4.4), counted from the host record of live SWA mappings (swa_peers: device
    backend, no wait; a read where it cannot know). A full page the full pool does not
    hold refuses the call (ValueError naming free_swa and the page: at once on the host
    backend, within 8 calls on the device); one still held whose SWA KV is gone frees
    nothing.
    """
    r = self._pool_index(dp_rank)
    pool = self._pools[r]
    idx = self._slots(pool, free_index)
    if idx.size == 0:
      return
    if self.page_size == 1:
      self._swa_segment(r, idx, 0, "free_swa")
    elif self._group is not None:
      self._take(r, "take_peers", idx, "free_swa")
    else:
      self._free(pool, "free_swa", idx, 0, (0, self._release(pool, idx, False)))

  def free_swa_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """Frees the SWA pages of one request's tokens start_pos, start_pos + 1, ...:
    mapping[free_index[::ps]] // ps through the SWA pool's free_page_ids, in that order,
    and clears the mapping of those full pages (SPEC 13).

    Device backend: never waits; free_index may be a device array (taken as it is). The
    SWA pool's mirror counts one page per full page of the segment, so each must have
    its SWA peer (SGLang's invariant): a page without one refuses the call (ValueError
    naming it: at once on the host backend, at the first call after its status has
    landed on the device, within 8 calls).
    """
    r = self._pool_index(dp_rank)
    idx = self._segment_arg(self._pools[r], free_index, start_pos, full=False)
    if idx.shape[0]:
      self._swa_segment(r, idx, start_pos, "free_swa_segment")

  def _swa_segment(self, r: int, idx: Any, start_pos: int, op: str) -> None:
    if self._group is not None:
      self._take(r, "take_pages", idx, op)
      return
    pool = self._pools[r]
    self._mark(pool, idx, False)
    self._free(pool, op, idx, start_pos, (0, -(-idx.shape[0] // self.page_size)))

  def free_full(self, free_index, dp_rank: int = 0) -> None:
    """The full pool's free alone; the slots must have no SWA peer left."""
    r = self._pool_index(dp_rank)
    idx = self._slots(self._pools[r], free_index)
    if idx.size == 0:
      return
    if self._group is not None:
      self._group[r].slots.append(np.array(idx, copy=True))
      return
    pool = self._pools[r]
    self._mark(pool, np.unique(idx // self.page_size), True, pages=True)
    self._free(pool, "free_full", idx, 0, (self._full_pages(idx), 0))

  def free_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """free_swa_segment, then the full pool's free_segment (SPEC 13). Device backend:
    never waits (see free_swa_segment). Every check runs first: a bad segment frees
    nothing in either pool."""
    self._segment_call(dp_rank, free_index, start_pos, swa=True)

  def free_full_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    """The full pool's free_segment alone; the slots must have no SWA peer left.
    Device backend: never waits."""
    self._segment_call(dp_rank, free_index, start_pos, swa=False)

  def _segment_call(self, dp_rank: int, free_index, start_pos, swa: bool) -> None:
    r = self._pool_index(dp_rank)
    pool = self._pools[r]
    idx = self._segment_arg(pool, free_index, start_pos, full=True)
    n = idx.shape[0]
    if n == 0:
      return
    pages = -(-n // self.page_size)
    if self._group is None:
      self._mark(pool, idx, True)
      self._free(pool, "free_segment" if swa else "free_full_segment", idx, start_pos,
                 (pages, pages if swa else 0))
      return
    if swa:
      self._take(r, "take_pages", idx, "free_segment")
    ps = self.page_size
    if ps == 1:  # token pools: page ids are slots, queued with the slot frees (FIFO)
      self._group[r].slots.append(idx)
    else:
      self._group[r].page_ids.append(pool.backend.segment_pages(idx))

  def free_segments(self, segments: Sequence[Tuple[Any, int]], dp_rank: int = 0) -> None:
    """Each (free_index, start_pos) segment of one request through free_segment, in
    order, every one checked first (consecutive segments must not share a page). What
    only the state shows is checked segment by segment: one whose page has no SWA peer
    is refused, after the segments before it were freed."""
    self._segments(segments, dp_rank, swa=True)

  def free_full_segments(self, segments: Sequence[Tuple[Any, int]],
                         dp_rank: int = 0) -> None:
    """Each segment through free_full_segment, every one checked first."""
    self._segments(segments, dp_rank, swa=False)

  def _segments(self, segments, dp_rank: int, swa: bool) -> None:
    pool = self._pools[self._pool_index(dp_rank)]
    checked, spans = [], []
    for i, seg in enumerate(segments):
      free_index, start = _pair(seg, i)
      try:
        idx = self._segment_arg(pool, free_index, start, full=True)
      except (TypeError, ValueError) as e:
        raise type(e)(f"segments[{i}]: {e}") from e
      spans.append((idx.shape[0], validate.count(start, "start_pos")))
      checked.append((idx, start))
    validate.segments_disjoint(spans, self.page_size)
    for idx, start in checked:
      if idx.shape[0]:
        self._segment_call(dp_rank, idx, start, swa)

  def _flush(self, pool: Pool, q) -> None:
    """One rank's free group (SPEC 13): the queued SWA page ids (one free_page_ids of
    their concatenation), the queued SWA slots (one free), then the full pool's queue
    (its slot frees, then its page ids)."""
    end = "free_group_end"
    if q.swa_page_ids:
      ids = concat([p for p, _ in q.swa_page_ids])
      self._free(pool, "swa_free_page_ids", ids, 0, (0, sum(c for _, c in q.swa_page_ids)),
                 end)
    if q.swa_slots:
      counts = [c for _, c in q.swa_slots]
      self._free(pool, "swa_free", concat([s for s, _ in q.swa_slots]), 0,
                 (0, None if None in counts else sum(counts)), end)
    if q.slots:
      idx = concat(q.slots)
      self._mark(pool, np.unique(idx // self.page_size), True, pages=True)
      self._free(pool, "full_free", idx, 0, (self._full_pages(idx), 0), end)
    if q.page_ids:
      ids = concat(q.page_ids)
      self._mark(pool, ids, True, pages=True)
      self._free(pool, "full_free_page_ids", ids, 0, (ids.shape[0], 0), end)


class _PoolView:
  """One pool of an SWA allocator as SGLang's `full_attn_allocator` /
  `swa_attn_allocator` expose it, read-only (of rank 0 unless `rank(r)`)."""

  def __init__(self, owner: SWATokenToKVPoolAllocator, side: int, dp_rank: int = 0):
    self._owner, self._side, self._rank = owner, side, dp_rank

  def rank(self, dp_rank: int) -> "_PoolView":
    return _PoolView(self._owner, self._side, dp_rank)

  def _pool(self) -> Pool:
    return self._owner._pools[self._owner._pool_index(self._rank)]  # pylint: disable=protected-access

  @property
  def page_size(self) -> int:
    return self._owner.page_size

  @property
  def size(self) -> int:
    pool = self._pool()
    return pool.backend.pools[self._side].size

  def available_size(self) -> int:
    return self._pool().available_size(self._side)

  def _part(self):
    state = self._pool().state
    return state.full if self._side == FULL else state.swa

  @property
  def free_pages(self) -> np.ndarray:
    """The pool's free list in order, host int32 (reads the device)."""
    from jax_kvalloc import state as st  # pylint: disable=g-import-not-at-top
    return st.live_free_pages(jax.tree.map(np.asarray, self._part()))

  @property
  def release_pages(self) -> np.ndarray:
    from jax_kvalloc import state as st  # pylint: disable=g-import-not-at-top
    return st.live_release_pages(jax.tree.map(np.asarray, self._part()))
