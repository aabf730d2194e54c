"""sglang-jax's allocator classes (SPEC 15) over the SGLang classes' pools and backends.

TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator are the classes of
jax_kvalloc.sglang with sglang-jax's constructors, signatures and attributes: every
allocation, free, free group, snapshot and refusal is theirs. What changes:

  * results are NumPy int32 on every backend (sglang-jax's callers do NumPy work on
    them); on the device backend each allocation therefore reads its result back;
  * alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank=0) and
    alloc_decode(seq_lens, last_loc, dp_rank=0) take host ints (no `*_cpu` twins), and
    the paged merge runs on sglang-jax's trigger: only when the new pages exceed
    free_pages (SGLang's counts rows and tokens too);
  * the paged free always parks pages in release_pages (need_sort on);
  * free_pages[r], release_pages[r] (paged) and free_slots[r] (token) are per-rank
    lists of host int32 arrays (copies; reads the device on the device backend), and
    free_group[r] is rank r's queue of frees while a free group is open (else []);
  * size_per_rank, pages_per_rank, num_pages, origin_size, debug_mode.

Ownership (SPEC 14, 15). guard=True (default): a free naming a page that is not held
(free, released, never handed out) raises ValueError naming the operation and the page
and frees nothing (on the device backend at the latest within 8 calls, or at `check()`),
where sglang-jax drops it silently. guard=False: sglang-jax's tolerance exactly: the paged
free drops pages already free or released (as its setdiff1d; one read of both lists, a
wait on the device backend), the token free appends what it is given (SGLang's trust;
its free list holds at most size_per_rank slots, where sglang-jax's grows).

SWATokenToKVPoolAllocator is sglang-jax's composition, not SPEC 13's class: a full and a
sliding-window allocator of the classes above (`full_attn_allocator`,
`swa_attn_allocator`: page_size 1 token pools, else paged pools) and
`full_to_swa_index_mapping`, the host int32 array (length size_per_rank + page_size, one
per rank when dp_size > 1) that sglang-jax's KV pool and attention read by reference; it
is the mapping itself, written on every change. Its semantics (SPEC 15):

  * page_size defaults to 1; `alloc` at page_size > 1 takes whole pages in both pools;
  * every allocation takes both pools or neither (checked before either changes);
    sglang-jax allocates the full side first and frees it back when the SWA side is
    short, which at page_size > 1 also frees the page the prefix ends in;
  * `free` frees the full slots, then the SWA peers still mapped; `free_swa` frees the
    mapped peers only and clears their mapping (twice is a no-op). At page_size > 1 both
    act on whole full pages (the mapping of every slot of the pages named is cleared, as
    their SWA pages are freed whole), so an SWA page is never freed twice;
  * backup_state / restore_state cover both pools and the mapping (sglang-jax raises).
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.sglang import paged as _paged
from jax_kvalloc.sglang import token as _token
from jax_kvalloc.sglang.base import _live
from jax_kvalloc.sglang.base import check_dp_rank

__all__ = ["PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator",
           "TokenToKVPoolAllocator"]


def _host(x: Any) -> Optional[np.ndarray]:
  """An allocation result as sglang-jax returns it: NumPy int32 (None stays None)."""
  return None if x is None else np.asarray(x, np.int32)


class _Flavour:
  """What the token and paged flavours add to the SGLang classes (mixed in first)."""

  @property
  def size_per_rank(self) -> int:
    return self.size // self.dp_size

  def _per_rank(self, held: List[Any]) -> List[Any]:
    """Per-rank views are lists at every dp_size (None at ranks held elsewhere)."""
    out: List[Any] = [None] * self.dp_size
    for r, x in zip(self.dp_ranks, held):
      out[r] = x
    return out

  @property
  def free_group(self) -> List[List[np.ndarray]]:
    """free_group[r]: the frees queued for rank r in the open free group (else []), as
    copies (the queue is the class's: its lists are reused by the next group)."""
    if self._group is None:
      return [[] for _ in range(self.dp_size)]
    return self._per_rank([[x.copy() for x in q.slots] for q in self._group])  # copies

  def alloc(self, need_size: int, dp_rank: int = 0) -> Optional[np.ndarray]:
    """need_size slots (whole pages when paged), NumPy int32, or None if short."""
    out = self._class_alloc(need_size, dp_rank)
    return out if out.__class__ is np.ndarray else _host(out)  # (host: int32 already)

  def check(self) -> None:
    """Raises a refusal still pending (device backend: waits for every status)."""
    self._settled(self.dp_ranks[0])

  def get_cpu_copy(self, indices):
    return self._kvcache_for("get_cpu_copy").get_cpu_copy(indices)

  def load_cpu_copy(self, kv_cache_cpu, indices):
    return self._kvcache_for("load_cpu_copy").load_cpu_copy(kv_cache_cpu, indices)


class TokenToKVPoolAllocator(_Flavour, _token.TokenToKVPoolAllocator):
  """sglang-jax's token allocator: slots 1..size_per_rank per rank, FIFO free.

  Args (sglang-jax's): size, kvcache, dp_size. Ours, keyword-only: backend ("host",
  the default, or "device"), guard (see the module docstring), device, kernel, debug.
  """

  def __init__(self, size: int, kvcache: Any = None, dp_size: int = 1, *,
               backend: str = "host", guard: bool = True, device: Any = None,
               kernel: Optional[str] = None, debug: Optional[bool] = None):
    super().__init__(size, None, device, kvcache, False, kernel=kernel, debug=debug,
                     guard=guard, backend=backend, dp_size=dp_size)
    self.origin_size = self.size_per_rank

  _class_alloc = _token.TokenToKVPoolAllocator.alloc  # (`_Flavour.alloc`, no super())
  free_pages = None     # sglang-jax's token allocator keeps free_slots only
  release_pages = None

  @property
  def free_slots(self) -> List[np.ndarray]:
    """free_slots[r]: rank r's free slots in order, host int32 (a copy)."""
    self._poll(everything=True)
    return self._per_rank([_live(pool.state, "free") for pool in self._pools])


class PagedTokenToKVPoolAllocator(_Flavour, _paged.PagedTokenToKVPoolAllocator):
  """sglang-jax's paged allocator: pages 1..pages_per_rank per rank, frees parked in
  release_pages and merged on an exact shortfall.

  Args (sglang-jax's): size, page_size, kvcache, debug_mode (kept as an attribute; the
  alignment checks it turns on in sglang-jax always run here), dp_size. Ours,
  keyword-only: backend ("host" default, or "device"), guard, device, kernel, debug.
  """

  def __init__(self, size: int, page_size: int, kvcache: Any = None,
               debug_mode: bool = False, dp_size: int = 1, *, backend: str = "host",
               guard: bool = True, device: Any = None, kernel: Optional[str] = None,
               debug: Optional[bool] = None):
    super().__init__(size, page_size, None, device, kvcache, True, kernel=kernel,
                     debug=debug, guard=guard, backend=backend, dp_size=dp_size)
    self.debug_mode = debug_mode
    self.num_pages = size // page_size
    self.pages_per_rank = self.num_pages // dp_size

  _class_alloc = _paged.PagedTokenToKVPoolAllocator.alloc  # (`_Flavour.alloc`)

  def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int,
                   dp_rank: int = 0) -> Optional[np.ndarray]:
    """Slots for a prefill batch (SPEC 4.2's layout), NumPy int32[extend_num_tokens],
    or None; release_pages merged first only when the new pages exceed free_pages.
    Bad input raises as the SGLang class's alloc_extend (nothing changed)."""
    pool = self._pools[self._pool_index(dp_rank)]
    plan = self._extend_plan(pool, prefix_lens, None, seq_lens, None, last_loc,
                             extend_num_tokens, None)
    if plan is None:
      return np.zeros((0,), np.int32)
    return _host(self._allocate(
        pool, "alloc_extend", plan.pages > pool.sides[0].free_len, plan.pages,
        lambda s, fits: pool.backend.alloc_extend(s, plan, fits)))

  def alloc_decode(self, seq_lens, last_loc, dp_rank: int = 0) -> Optional[np.ndarray]:
    """One slot per request (SPEC 4.3's layout), NumPy int32[bs], or None; merge as
    alloc_extend."""
    pool = self._pools[self._pool_index(dp_rank)]
    plan = self._decode_plan(pool, seq_lens, None, last_loc)
    if plan is None:
      return np.zeros((0,), np.int32)
    return _host(self._allocate(
        pool, "alloc_decode", plan.pages > pool.sides[0].free_len, plan.pages,
        lambda s, fits: pool.backend.alloc_decode(s, plan, fits)))

  def _free_small(self, pool, x: np.ndarray, slots: list) -> bool:
    """guard=False: the pages already listed dropped first, as `_free_now`."""
    if self.config.guard:
      return super()._free_small(pool, x, slots)
    ps = self.page_size
    pages = sorted({s // ps for s in slots})
    listed = _listed(pool)
    keep = [p * ps for p, known in zip(pages, listed[pages].tolist()) if not known]
    return not keep or super()._free_small(pool, None, keep)

  def _free_now(self, pool, idx: np.ndarray, op: str = "free") -> None:
    """guard=False: sglang-jax's setdiff1d, pages already free or released dropped."""
    if not self.config.guard:
      pages = np.unique(idx // self.page_size)
      pages = pages[~_listed(pool)[pages]]
      if pages.size == 0:
        return
      idx = pages * self.page_size
    super()._free_now(pool, idx, op)


def _listed(pool) -> np.ndarray:
  """bool[num_pages + 1]: the pages on the pool's free or release list (a read of both
  lists: a wait on the device backend)."""
  listed = np.zeros((pool.config.num_pages + 1,), bool)
  state = pool.state
  if isinstance(state.free_ring, np.ndarray):  # host: the rings' windows, no copies
    for ring, head, length in ((state.free_ring, state.free_head, state.free_len),
                               (state.release_ring, state.release_head, state.release_len)):
      listed[st.ring_window(ring, head, length, length, xp=np)] = True
  else:
    listed[_live(state, "free")] = True
    listed[_live(state, "release")] = True
  return listed


class SWATokenToKVPoolAllocator:
  """sglang-jax's SWA allocator: two pools and the host mapping (module docstring).

  Args (sglang-jax's): size, size_swa, kvcache (its full_kv_pool / swa_kv_pool go to
  the two pools, and its full_to_swa_index_mapping is set to ours; may be None),
  page_size (default 1), dp_size. Ours, keyword-only: backend, guard, device, kernel.
  """

  _token_cls = TokenToKVPoolAllocator
  _paged_cls = PagedTokenToKVPoolAllocator

  def __init__(self, size: int, size_swa: int, kvcache: Any = None, page_size: int = 1,
               dp_size: int = 1, *, backend: str = "host", guard: bool = True,
               device: Any = None, kernel: Optional[str] = None):
    kw = dict(dp_size=dp_size, backend=backend, guard=guard, device=device, kernel=kernel)
    full_kv = getattr(kvcache, "full_kv_pool", None)
    swa_kv = getattr(kvcache, "swa_kv_pool", None)
    if page_size == 1:
      self.full_attn_allocator = self._token_cls(size, full_kv, **kw)
      self.swa_attn_allocator = self._token_cls(size_swa, swa_kv, **kw)
    else:
      self.full_attn_allocator = self._paged_cls(size, page_size, full_kv, **kw)
      self.swa_attn_allocator = self._paged_cls(size_swa, page_size, swa_kv, **kw)
    self.size, self.page_size, self.dp_size = size, page_size, dp_size
    self.size_per_rank = size // dp_size
    self._size_full, self._size_swa = size, size_swa
    self._kvcache = kvcache
    length = self.full_attn_allocator.size_per_rank + page_size
    self._maps = [np.zeros(length, np.int32) for _ in range(dp_size)]
    self.full_to_swa_index_mapping = self._maps[0] if dp_size == 1 else self._maps
    self.free_group: List[List[np.ndarray]] = [[] for _ in range(dp_size)]
    self.is_not_in_free_group = True
    if kvcache is not None:
      kvcache.full_to_swa_index_mapping = self.full_to_swa_index_mapping

  free_pages = None
  release_pages = None

  # -- sizes ---------------------------------------------------------------------------
  @property
  def size_full(self) -> int:
    return self._size_full

  @property
  def size_swa(self) -> int:
    return self._size_swa

  def full_available_size(self, dp_rank: int = 0) -> int:
    return self.full_attn_allocator.available_size(dp_rank=dp_rank)

  def swa_available_size(self, dp_rank: int = 0) -> int:
    return self.swa_attn_allocator.available_size(dp_rank=dp_rank)

  def available_size(self, dp_rank: int = 0) -> int:
    return min(self.full_available_size(dp_rank), self.swa_available_size(dp_rank))

  def get_kvcache(self) -> Any:
    return self._kvcache

  def debug_print(self) -> str:
    return (f"#swa-available-size: {self.swa_available_size()}, "
            f"#full-attn-available-size: {self.full_available_size()}, ")

  def _map(self, dp_rank: Any) -> np.ndarray:
    return self._maps[check_dp_rank(dp_rank, self.dp_size)]

  def count_swa_mapped(self, indices, dp_rank: int = 0) -> int:
    """How many of these full slots still have an SWA peer."""
    return int((self._map(dp_rank)[np.asarray(indices)] > 0).sum())

  # -- allocation ----------------------------------------------------------------------
  def _pair(self, dp_rank: int, full_call, swa_call) -> Optional[np.ndarray]:
    """full_call() then swa_call(full slots); both or neither (a short or raising SWA
    side puts the full pool back as it was); mapping[full] = swa."""
    mapping = self._map(dp_rank)
    before = self.full_attn_allocator.backup_state()
    full = full_call()
    if full is None:
      return None
    try:
      swa = swa_call(mapping)
    except BaseException:
      self.full_attn_allocator.restore_state(before)
      raise
    if swa is None:
      self.full_attn_allocator.restore_state(before)
      return None
    mapping[full] = swa
    return full

  def _fits(self, dp_rank: int, slots: int) -> bool:
    return slots <= self.full_available_size(dp_rank) and slots <= self.swa_available_size(
        dp_rank)

  def alloc(self, need_size: int, dp_rank: int = 0) -> Optional[np.ndarray]:
    """need_size slots in both pools (whole pages at page_size > 1), or None."""
    need = validate.need_size(need_size, self.page_size)
    if not self._fits(dp_rank, need):
      return None
    return self._pair(dp_rank, lambda: self.full_attn_allocator.alloc(need, dp_rank),
                      lambda m: self.swa_attn_allocator.alloc(need, dp_rank))

  def _new_pages_fit(self, dp_rank: int, pages: int) -> bool:
    return self._fits(dp_rank, pages * self.page_size)

  def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int,
                   dp_rank: int = 0) -> Optional[np.ndarray]:
    """Both pools' alloc_extend (the SWA side continues from mapping[last_loc]); the
    full slots, or None when either pool lacks the new pages."""
    if self.page_size == 1:
      return self.full_attn_allocator.alloc_extend()  # raises, as sglang-jax's
    ps = self.page_size
    pre, seq = np.asarray(prefix_lens), np.asarray(seq_lens)
    if pre.shape == seq.shape and pre.ndim == 1 and pre.dtype.kind in "iu":
      pages = int((-(-seq // ps) - -(-pre // ps)).sum())
      if pages > 0 and not self._new_pages_fit(dp_rank, pages):
        return None
    return self._pair(
        dp_rank, lambda: self.full_attn_allocator.alloc_extend(
            prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank=dp_rank),
        lambda m: self.swa_attn_allocator.alloc_extend(
            prefix_lens, seq_lens, _translate(m, last_loc), extend_num_tokens,
            dp_rank=dp_rank))

  def alloc_decode(self, seq_lens, last_loc, dp_rank: int = 0) -> Optional[np.ndarray]:
    """Both pools' alloc_decode; the full slots, or None (neither allocates)."""
    if self.page_size == 1:
      return self.full_attn_allocator.alloc_decode()  # raises, as sglang-jax's
    ps = self.page_size
    seq = np.asarray(seq_lens)
    if seq.ndim == 1 and seq.dtype.kind in "iu":
      pages = int(((seq - 1) % ps == 0).sum())
      if pages > 0 and not self._new_pages_fit(dp_rank, pages):
        return None
    return self._pair(
        dp_rank, lambda: self.full_attn_allocator.alloc_decode(seq_lens, last_loc,
                                                               dp_rank=dp_rank),
        lambda m: self.swa_attn_allocator.alloc_decode(seq_lens, _translate(m, last_loc),
                                                       dp_rank=dp_rank))

  # -- freeing -------------------------------------------------------------------------
  def free(self, free_index, dp_rank: int = 0) -> None:
    """The full slots' free, then free_swa of them (their SWA peers still mapped);
    queued whole while a free group is open."""
    idx = np.asarray(free_index)
    if idx.size == 0:
      return
    self._map(dp_rank)  # checks dp_rank first
    if not self.is_not_in_free_group:
      self.free_group[dp_rank].append(np.array(idx, copy=True))
      return
    self.full_attn_allocator.free(idx, dp_rank=dp_rank)
    self.free_swa(idx, dp_rank=dp_rank)

  def free_swa(self, free_index, dp_rank: int = 0) -> None:
    """Frees the SWA peers still mapped of these full slots (of their whole pages at
    page_size > 1) and clears their mapping; slots without a peer are skipped."""
    mapping = self._map(dp_rank)
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return
    validate.free_index(idx, page_size=1, num_slots=mapping.shape[0])
    ps = self.page_size
    if ps > 1:  # every slot of the pages named
      idx = (np.unique(idx // ps)[:, None] * ps + np.arange(ps)).reshape(-1)
    peers = mapping[idx]
    peers = peers[peers > 0]
    if peers.size:
      self.swa_attn_allocator.free(peers, dp_rank=dp_rank)
    mapping[idx] = 0

  def free_group_begin(self) -> None:
    self.is_not_in_free_group = False

  def free_group_end(self) -> None:
    """Closes the group: each rank's queued frees as one `free`."""
    self.is_not_in_free_group = True
    for r in range(self.dp_size):
      queued, self.free_group[r] = self.free_group[r], []
      if queued:
        self.free(np.concatenate(queued), dp_rank=r)

  def merge_and_sort_free(self, dp_rank: int = 0) -> None:
    self.full_attn_allocator.merge_and_sort_free(dp_rank=dp_rank)
    self.swa_attn_allocator.merge_and_sort_free(dp_rank=dp_rank)

  # -- state ---------------------------------------------------------------------------
  def clear(self, dp_rank: Optional[int] = None) -> None:
    """Both pools and the mapping back to the start (every rank, or rank dp_rank)."""
    ranks = (range(self.dp_size) if dp_rank is None
             else [check_dp_rank(dp_rank, self.dp_size)])
    self.swa_attn_allocator.clear(dp_rank)
    self.full_attn_allocator.clear(dp_rank)
    for r in ranks:
      self._maps[r].fill(0)
      self.free_group[r] = []
    if dp_rank is None:
      self.is_not_in_free_group = True

  def backup_state(self):
    """Both pools' snapshots and a copy of the mapping."""
    return (self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(),
            [m.copy() for m in self._maps])

  def restore_state(self, state) -> None:
    """Puts a backup_state back (the mapping written into the live array)."""
    full, swa, maps = state
    self.full_attn_allocator.restore_state(full)
    self.swa_attn_allocator.restore_state(swa)
    for live, saved in zip(self._maps, maps):
      live[:] = saved

  def check(self) -> None:
    """Raises a refusal still pending in either pool (see _Flavour.check)."""
    self.full_attn_allocator.check()
    self.swa_attn_allocator.check()

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(size={self.size}, size_swa={self.size_swa}, "
            f"page_size={self.page_size}, dp_size={self.dp_size}, "
            f"backend={self.full_attn_allocator.backend!r})")


def _translate(mapping: np.ndarray, last_loc) -> np.ndarray:
  """mapping[last_loc], -1 kept (a request without a prefix)."""
  last = np.asarray(last_loc, np.int64)
  return np.where(last < 0, -1, mapping[np.clip(last, 0, mapping.shape[0] - 1)])
