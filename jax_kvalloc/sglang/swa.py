"""SGLang 0.5.23's SWATokenToKVPoolAllocator (SPEC 13) over our two pool classes.

`full_attn_allocator` and `swa_attn_allocator` are our TokenToKVPoolAllocator (page size
1) or PagedTokenToKVPoolAllocator, used only through their public methods; this class
adds the full-to-SWA mapping (`full_to_swa_index_mapping`, a jax array on the device
backend, numpy on the host backend, updated by jax_kvalloc.swa's pure functions) and
SGLang's method names.

Device backend, page size > 1, outside debug mode: each steady call (alloc_extend,
alloc_extend_swa_tail, alloc_decode, free, free_swa, free_swa_segment, free_segment) is
one jitted program of the functional core (jax_kvalloc.swa) over both pools' states and
the mapping, donated unless a snapshot holds a part of it, with inputs padded to shape
buckets (jax_kvalloc.sglang.swa_device); free_full / free_full_segment are the full
pool's one program. The host mirrors of both pools' list lengths decide before the
launch whether the call fits and whether need_sort merges first (a merge is its own
call). Refusals, free groups, page size 1 and debug mode take the pools' own calls.

Waits (device backend). Allocations never wait (a device last_loc is taken as it is).
The segment frees (free_swa_segment, free_segment, free_full_segment; device-array
free_index too) never wait either: each pool's mirror counts one page per full page of
the segment, so each of them must have its SWA peer (as SGLang expects; debug mode checks
it, reading the values). free_swa (and free) at page size > 1 read back once, as SGLang's
own free_swa synchronizes there: the pools' list lengths after the program (the SWA
pool's count of sorted unique pages needs the mapping's values). Page size 1: the token
pools' frees read device arrays.

One deliberate difference (SPEC 13): `alloc_decode` allocates in neither pool unless
both fit (SGLang keeps what the fitting pool took). Debug mode (`debug=True`) also
checks, before anything changes, that SWA frees find a peer for every slot and that
full-only frees find none left (SWADebugError), on top of each pool's own checks.
"""
from __future__ import annotations

import functools
from typing import Any, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The lead repoints these at jax_kvalloc.sglang's own modules at merge.
from jax_kvalloc.sglang.base import check_dp_ranks
from jax_kvalloc.sglang.base import concat
from jax_kvalloc.sglang.paged import PagedTokenToKVPoolAllocator
from jax_kvalloc.sglang.token import TokenToKVPoolAllocator
from jax_kvalloc.sglang import swa_device
from jax_kvalloc import buckets
from jax_kvalloc import swa as core
from jax_kvalloc import validate
from jax_kvalloc.config import _env_debug


class SWADebugError(ValueError):
  """Debug mode: an SWA free of a slot without a peer, or a full-only free of a slot
  whose SWA peer is still held."""


class SWASnapshot(NamedTuple):
  """What `backup_state` returns: both pools' snapshots and the mapping."""
  full: Any
  swa: Any
  mapping: Any


def _jit_pair(fn):
  return jax.jit(fn), jax.jit(fn, donate_argnums=0)


_SET = _jit_pair(core.set_mapping)
_CLEAR = _jit_pair(core.clear_mapping)
_TAIL = _jit_pair(core.pair_tail)
_TRANSLATE = jax.jit(core.translate)
_SEGMENT = (jax.jit(core.take_segment_pages, static_argnums=2),
            jax.jit(core.take_segment_pages, static_argnums=2, donate_argnums=0))


@jax.jit
def _swa_last_loc(mapping, last, unread):
  """translate(last) where the SWA pool reads it, -1 where it does not (a page-aligned
  prefix; a decode that starts a page), so the SWA pool's checks see a valid value."""
  return jnp.where(unread, -1, core.translate(mapping, last))


def _ranked(method):
  """With dp_size > 1, `method(..., dp_rank=r)` runs rank r's allocator; dp_rank
  defaults to 0."""
  @functools.wraps(method)
  def wrapper(self, *args, dp_rank: int = 0, **kwargs):
    rank = self._rank(dp_rank)
    if rank is not None:
      return getattr(rank, method.__name__)(*args, **kwargs)
    return method(self, *args, **kwargs)
  return wrapper


def _new_pages(pre: np.ndarray, seq: np.ndarray, ps: int) -> int:
  return int(np.sum(-(-seq // ps) - -(-pre // ps)))


class SWATokenToKVPoolAllocator:
  """Two pools (full attention, sliding window) and the mapping between them (SPEC 13).

  Args:
    size: full-attention slots; size_swa: sliding-window slots.
    page_size: slots per page of both pools (1: token pools and `alloc`; > 1:
      alloc_extend / alloc_decode).
    dtype, device: as SGLang's (device places the state: "cpu", "cuda", a jax.Device).
    kvcache: stored and returned by get_kvcache(); may be None (the mapping is ours).
    need_sort: both pools park freed pages until a shortfall merges them.
    kernel, debug, backend: as our pool classes ("device": jax arrays, no waits on
      allocation; "host": NumPy).
    dp_size: data-parallel ranks, each an SWA allocator of size // dp_size and
      size_swa // dp_size slots; methods then take `dp_rank=` (default 0).
    dp_ranks: the ranks this process holds (default None: all), as on the pool classes
      (jax_kvalloc.sglang.base): only their allocators are built; a call with another
      dp_rank raises ValueError naming it; backup_state gives None at the others.
  """

  def __init__(self, size: int, size_swa: int, page_size: int, dtype: Any = None,
               device: Any = None, kvcache: Any = None, need_sort: bool = False, *,
               kernel: Optional[str] = None, debug: Optional[bool] = None,
               backend: str = "device", dp_size: int = 1,
               dp_ranks: Optional[Sequence[int]] = None):
    dp_size = validate.count(dp_size, "dp_size")
    if dp_size < 1:
      raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    self.dp_ranks = check_dp_ranks(dp_ranks, dp_size)
    self.page_size, self.dtype, self.device = page_size, dtype, device
    self.need_sort, self.backend, self.dp_size = need_sort, backend, dp_size
    self._kvcache = kvcache
    self._debug = _env_debug() if debug is None else bool(debug)
    self._size_full, self._size_swa = size, size_swa
    self._ranks: Optional[List[SWATokenToKVPoolAllocator]] = None
    if dp_size > 1:
      if size % dp_size or size_swa % dp_size:
        raise ValueError(f"size={size} and size_swa={size_swa} must be multiples of "
                         f"dp_size={dp_size}")
      self._ranks = [SWATokenToKVPoolAllocator(
          size // dp_size, size_swa // dp_size, page_size, dtype, device, kvcache,
          need_sort, kernel=kernel, debug=debug, backend=backend)
          if i in self.dp_ranks else None for i in range(dp_size)]
      return
    kw = dict(kernel=kernel, debug=debug, backend=backend)
    if page_size == 1:
      self.full_attn_allocator = TokenToKVPoolAllocator(size, dtype, device, None,
                                                        need_sort, **kw)
      self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, dtype, device, None,
                                                       need_sort, **kw)
    else:
      self.full_attn_allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype,
                                                             device, None, need_sort, **kw)
      self.swa_attn_allocator = PagedTokenToKVPoolAllocator(size_swa, page_size, dtype,
                                                            device, None, need_sort, **kw)
    # guard=False until the class surfaces the ownership record's refusals (SPEC 14).
    self._config = core.SWAConfig(size, size_swa, page_size, need_sort,
                                  debug=self._debug, guard=False,
                                  **({"kernel": kernel} if kernel else {}))
    self._host = backend == "host"
    self._jax_device = None
    if not self._host:
      from jax_kvalloc.sglang.backends import resolve_device  # pylint: disable=g-import-not-at-top
      self._jax_device = resolve_device(device)
    self.clear()

  def _rank(self, dp_rank: int) -> Optional["SWATokenToKVPoolAllocator"]:
    if self._ranks is None:
      if dp_rank != 0:
        raise ValueError(f"dp_rank={dp_rank}, but this allocator has dp_size=1")
      return None
    if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < self.dp_size:
      raise ValueError(f"dp_rank must be in 0..{self.dp_size - 1}, got {dp_rank!r}")
    rank = self._ranks[int(dp_rank)]
    if rank is None:
      raise ValueError(f"dp_rank={int(dp_rank)} is held by another process (this allocator "
                       f"holds dp_ranks={self.dp_ranks} of dp_size={self.dp_size})")
    return rank

  # -- sizes -----------------------------------------------------------------------------
  @property
  def size(self) -> int:
    return min(self._size_full, self._size_swa)

  @property
  def size_full(self) -> int:
    return self._size_full

  @property
  def size_swa(self) -> int:
    return self._size_swa

  @_ranked
  def full_available_size(self) -> int:
    return self.full_attn_allocator.available_size()

  @_ranked
  def swa_available_size(self) -> int:
    return self.swa_attn_allocator.available_size()

  @_ranked
  def available_size(self) -> int:
    """min(full, SWA) available slots. Never waits."""
    return min(self.full_available_size(), self.swa_available_size())

  @_ranked
  def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
    ps = self.page_size
    return (num_full_pages <= self.full_available_size() // ps
            and num_swa_pages <= self.swa_available_size() // ps)

  def get_kvcache(self) -> Any:
    return self._kvcache

  @_ranked
  def debug_print(self) -> str:
    """SGLang's summary line: both pools' available sizes."""
    return (f"#swa-available-size: {self.swa_available_size()}, "
            f"#full-attn-available-size: {self.full_available_size()}, ")

  # -- the mapping -------------------------------------------------------------------------
  @property
  def full_to_swa_index_mapping(self):
    """i32[size + page_size + 1]: the SWA slot of each full slot (0: none), last -1."""
    if self._ranks is not None:
      raise AttributeError("with dp_size > 1 each rank has its mapping "
                           "(translate_loc_from_full_to_swa(..., dp_rank=))")
    self._mapping_shared = True
    return self._mapping

  def _map(self, pair, *args):
    """mapping = pair's function(mapping, *args), donating unless a snapshot holds it."""
    if self._host:
      raise AssertionError("host backend updates the mapping in numpy")
    fn = pair[0] if self._mapping_shared else pair[1]
    self._mapping = fn(self._mapping, *args)
    self._mapping_shared = False

  def _host_mapping(self):
    """A numpy mapping the host backend may write (copied first if a snapshot holds it)."""
    if self._mapping_shared:
      self._mapping = self._mapping.copy()
      self._mapping_shared = False
    return self._mapping

  @_ranked
  def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
    """mapping[full_indices] = swa_indices."""
    if self._host:
      f = validate.host_ints(full_indices, "full_indices")
      s = validate.host_ints(swa_indices, "swa_indices")
      if f.shape != s.shape:
        raise ValueError(f"full_indices {f.shape} and swa_indices {s.shape} differ")
      if f.size:
        self._check_slots(f, "full_indices")
        self._host_mapping()[f] = s
      return
    if np.shape(full_indices) != np.shape(swa_indices):
      raise ValueError(f"full_indices {np.shape(full_indices)} and swa_indices "
                       f"{np.shape(swa_indices)} differ")
    if np.size(full_indices):
      self._map(_SET, self._dev(full_indices), self._dev(swa_indices))

  @_ranked
  def clear_full_to_swa_mapping(self, full_indices) -> None:
    """mapping[full_indices] = 0."""
    if self._host:
      f = validate.host_ints(full_indices, "full_indices")
      if f.size:
        self._check_slots(f, "full_indices")
        self._host_mapping()[f] = 0
      return
    if np.size(full_indices):
      self._map(_CLEAR, self._dev(full_indices))

  @_ranked
  def translate_loc_from_full_to_swa(self, kv_indices):
    """mapping[kv_indices] (-1 stays -1): a jax array (device backend, no wait) or numpy."""
    if self._host:
      return self._translate_host(validate.host_ints(kv_indices, "kv_indices"))
    return _TRANSLATE(self._mapping, self._dev(kv_indices))

  def _translate_host(self, loc: np.ndarray) -> np.ndarray:
    n = self._mapping.shape[0]
    pos = np.where(loc < 0, n - 1, np.minimum(loc, n - 1))
    return np.where(loc >= n, 0, self._mapping[pos]).astype(np.int32)

  def _dev(self, x):
    """x as an int32 jax array on the pool's device (a jax array is taken as it is)."""
    if isinstance(x, jax.Array):
      return x.astype(jnp.int32) if x.dtype != jnp.int32 else x
    return jax.device_put(validate.host_ints(x, "indices").astype(np.int32),
                          self._jax_device)

  def _read(self, idx: np.ndarray) -> np.ndarray:
    """mapping[idx] on the host (device backend: a wait)."""
    if self._host:
      return self._translate_host(idx)
    return np.asarray(_TRANSLATE(self._mapping, self._dev(idx)))

  def _free_args(self, free_index) -> Optional[np.ndarray]:
    """free_index as checked host int64 slots, or None when empty."""
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return None
    self._check_slots(idx, "free_index")
    return idx

  def _check_slots(self, idx: np.ndarray, name: str) -> None:
    validate.free_index(idx, page_size=self.page_size,
                        num_slots=self.full_attn_allocator.config.num_slots)

  # -- the device fast path: one program of the core per call (jax_kvalloc.sglang.swa_device)
  def _fast(self, free: bool = False) -> bool:
    """Device backend, page size > 1, outside debug mode (which checks on the host
    first); a free also outside free groups (which queue)."""
    return (not self._host and not self._debug and self.page_size > 1
            and not (free and self._group is not None))

  def _pool_pair(self):
    return self.full_attn_allocator._pools[0], self.swa_attn_allocator._pools[0]  # pylint: disable=protected-access

  def _launch(self, op: str, shape, *args):
    """One launch of the core's `op` over (full state, SWA state, mapping), donated
    unless a snapshot holds a part of it; takes the new state, returns the output."""
    fp, sp = self._pool_pair()
    donate = not (fp.free_shared or fp.release_shared or sp.free_shared
                  or sp.release_shared or self._mapping_shared)
    state = core.SWAState(fp.state, sp.state, self._mapping)
    new, out = swa_device.run(self._config, op, shape, donate, state, *args)
    fp.state, sp.state, self._mapping = new.full, new.swa, new.mapping
    fp.free_shared = fp.release_shared = sp.free_shared = sp.release_shared = False
    self._mapping_shared = False
    return out

  @staticmethod
  def _freed(pool, count: int) -> None:
    """The host mirror after `count` pages reached the list (cut to the room left)."""
    count = min(count, pool.config.num_pages - pool.free_len - pool.release_len)
    if pool.config.need_sort:
      pool.release_len += count
    else:
      pool.free_len += count

  def _take_lengths(self, lengths) -> None:
    """The mirror from a program's i32[4] lengths (a read: a wait)."""
    fp, sp = self._pool_pair()
    fp.free_len, fp.release_len, sp.free_len, sp.release_len = (
        int(v) for v in np.asarray(lengths))

  def _padded(self, x, rows: int, fill: int):
    """Host ints or a device i32[n] padded to rows (device: the pool's pad program)."""
    if isinstance(x, jax.Array):
      return self._pool_pair()[0].backend.ops.padded(x, rows, fill)
    return buckets.pad(np.asarray(x), rows, fill)

  def _exact(self, out, n: int):
    return self._pool_pair()[0].backend.ops.exact(out, n)

  # -- state ---------------------------------------------------------------------------------
  def clear(self, dp_rank: Optional[int] = None) -> None:
    """Both pools as new, the mapping all 0 but its last -1, no free group."""
    if self._ranks is not None:
      if dp_rank is not None:
        self._rank(dp_rank)  # a rank of this allocator, held here
      for i, r in enumerate(self._ranks):
        if r is not None and (dp_rank is None or dp_rank == i):
          r.clear()
      return
    self.full_attn_allocator.clear()
    self.swa_attn_allocator.clear()
    mapping = np.zeros((self._config.mapping_len,), np.int32)
    mapping[-1] = -1
    self._mapping = mapping if self._host else jax.device_put(mapping, self._jax_device)
    self._mapping_shared = False
    self._group: Optional[List[np.ndarray]] = None  # queued SWA page ids
    self._group_slots: List[np.ndarray] = []       # queued SWA slots

  def backup_state(self):
    """A snapshot of both pools and the mapping (our addition: SGLang's SWA class has
    none). O(1) on the device backend (the mapping is copied only when next written)."""
    if self._ranks is not None:
      return [None if r is None else r.backup_state() for r in self._ranks]
    self._mapping_shared = True
    return SWASnapshot(self.full_attn_allocator.backup_state(),
                       self.swa_attn_allocator.backup_state(), self._mapping)

  def restore_state(self, state) -> None:
    """Puts a `backup_state` snapshot back exactly."""
    if self._ranks is not None:
      if (not isinstance(state, (list, tuple)) or len(state) != self.dp_size
          or any((r is None) != (s is None) for r, s in zip(self._ranks, state))):
        raise ValueError(f"state must be backup_state() of an allocator with dp_size="
                         f"{self.dp_size} holding dp_ranks={self.dp_ranks}")
      for r, s in zip(self._ranks, state):
        if r is not None:
          r.restore_state(s)
      return
    if not isinstance(state, SWASnapshot):
      raise TypeError(f"state must be an SWASnapshot from backup_state, got "
                      f"{type(state).__name__}")
    self.full_attn_allocator.restore_state(state.full)
    self.swa_attn_allocator.restore_state(state.swa)
    self._mapping = state.mapping
    self._mapping_shared = True

  @_ranked
  def merge_and_sort_free(self) -> None:
    """Both pools' merge_and_sort_free (SPEC 6)."""
    self.full_attn_allocator.merge_and_sort_free()
    self.swa_attn_allocator.merge_and_sort_free()

  # -- allocation ----------------------------------------------------------------------------
  def _pair(self, full_out, swa_out) -> None:
    if self._host:
      self._host_mapping()[np.asarray(full_out)] = swa_out
    else:
      self._map(_SET, full_out, swa_out)

  @_ranked
  def alloc(self, need_size: int):
    """`need_size` slots in both pools (page size 1 only), or None if either is short."""
    if self.page_size != 1:
      raise ValueError(f"alloc needs page_size 1 (as SGLang asserts), got "
                       f"{self.page_size}; use alloc_extend")
    need_size = validate.count(need_size, "need_size")
    if (need_size > self.full_available_size()
        or need_size > self.swa_available_size()):
      return None
    full = self.full_attn_allocator.alloc(need_size)
    swa = self.swa_attn_allocator.alloc(need_size)
    if need_size:
      self._pair(full, swa)
    return full

  def _swa_last(self, last_loc, unread: np.ndarray):
    """The SWA pool's last_loc: translate(last_loc), -1 where it is not read."""
    if self._host:
      last = validate.host_ints(last_loc, "last_loc")
      if last.shape != unread.shape:
        return last  # the full pool names the shape error
      swa_last = np.where(unread, -1, self._translate_host(last))
      bad = np.flatnonzero(~unread & (swa_last <= 0))
      if bad.size:
        i = int(bad[0])
        raise ValueError(f"last_loc[{i}]={int(last[i])} has no SWA peer (its sliding-"
                         f"window KV was freed), so the SWA pool cannot continue its page")
      return swa_last
    last = self._dev(last_loc)
    if last.shape != unread.shape:
      return last
    return _swa_last_loc(self._mapping, last, jax.device_put(unread, self._jax_device))

  @_ranked
  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens: int, num_new_pages: Optional[int] = None):
    """Slots for a prefill batch in both pools (SPEC 13), or None if either is short.

    Arguments as PagedTokenToKVPoolAllocator.alloc_extend; last_loc is the full pool's
    (the SWA pool gets its translation). Returns the full slots (the SWA slots are in
    the mapping).
    """
    if self.page_size == 1:
      raise ValueError("alloc_extend needs page_size > 1 (as SGLang asserts); use alloc")
    pre = validate.host_ints(prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu,
                             "prefix_lens")
    seq = validate.host_ints(seq_lens if seq_lens_cpu is None else seq_lens_cpu,
                             "seq_lens")
    if pre.shape != seq.shape:
      raise ValueError(f"prefix_lens {pre.shape} and seq_lens {seq.shape} differ")
    p = _new_pages(pre, seq, self.page_size)
    if num_new_pages is not None:
      validate.num_new_pages(num_new_pages, p)
    if not self.new_pages_available(p, p):
      return None
    if self._fast() and pre.shape[0]:
      return self._extend_fast(pre, seq, last_loc, extend_num_tokens, p)
    swa_last = self._swa_last(last_loc, pre % self.page_size == 0)
    full = self.full_attn_allocator.alloc_extend(pre, pre, seq, seq, last_loc,
                                                 extend_num_tokens, num_new_pages=p)
    swa = self.swa_attn_allocator.alloc_extend(pre, pre, seq, seq, swa_last,
                                               extend_num_tokens, num_new_pages=p)
    assert full is not None and swa is not None
    if int(extend_num_tokens):
      self._pair(full, swa)
    return full

  def _extend_fast(self, pre, seq, last_loc, extend_num_tokens, p: int):
    """alloc_extend as one program, the batch known to fit (`p` new pages each)."""
    ps, bs = self.page_size, pre.shape[0]
    dev_last = validate.device_last_loc(last_loc, bs)
    last = validate.host_last_loc(last_loc, dev_last, pre, ps, 1)
    tokens = validate.extend_args(pre, seq, last, extend_num_tokens, page_size=ps,
                                  num_slots=self.full_attn_allocator.config.num_slots
                                  ).total_tokens
    fp, sp = self._pool_pair()
    trigger = tokens // ps + bs + 1  # SPEC 4.2's need_sort trigger, in each pool
    fp.merge_if(trigger > fp.free_len)
    sp.merge_if(trigger > sp.free_len)
    rows = swa_device.bucket_rows(bs)
    packed = swa_device.pack_extend(pre, seq, None if dev_last is not None else last, rows)
    extra = () if dev_last is None else (self._padded(dev_last, rows, -1),)
    out = self._launch("extend", (rows, swa_device.bucket_tokens(tokens)), packed, *extra)
    fp.free_len -= p
    sp.free_len -= p
    return self._exact(out, tokens)

  @_ranked
  def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                            last_loc, extend_num_tokens: int, swa_tail_len: int):
    """One request's extend: full slots for every token, SWA slots only for the last
    `swa_tail_len` (a fresh SWA request); None if either pool is short (SPEC 13)."""
    if self.page_size == 1:
      raise ValueError("alloc_extend_swa_tail needs page_size > 1 (as SGLang asserts)")
    ps = self.page_size
    pre = validate.host_ints(prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu,
                             "prefix_lens")
    seq = validate.host_ints(seq_lens if seq_lens_cpu is None else seq_lens_cpu,
                             "seq_lens")
    if pre.shape != (1,) or seq.shape != (1,):
      raise ValueError(f"alloc_extend_swa_tail takes one request (as SGLang), got "
                       f"prefix_lens {pre.shape}, seq_lens {seq.shape}")
    ext = validate.count(extend_num_tokens, "extend_num_tokens")
    tail = validate.count(swa_tail_len, "swa_tail_len")
    if tail > ext:
      raise ValueError(f"swa_tail_len={tail} must be <= extend_num_tokens={ext}")
    pf = _new_pages(pre, seq, ps)
    if not self.new_pages_available(pf, -(-tail // ps)):
      return None
    if self._fast():
      return self._tail_fast(pre, seq, last_loc, ext, tail, pf)
    full = self.full_attn_allocator.alloc_extend(pre, pre, seq, seq, last_loc, ext)
    assert full is not None
    if tail == 0:  # the head is all of it: mapping 0 (SPEC 13; 0 already in valid use)
      self.clear_full_to_swa_mapping(full)
      return full
    zero, one = np.zeros((1,), np.int64), np.array([tail], np.int64)
    swa = self.swa_attn_allocator.alloc_extend(zero, zero, one, one,
                                               np.array([-1], np.int64), tail)
    assert swa is not None
    if self._host:
      m = self._host_mapping()
      m[full[ext - tail:]] = swa
      m[full[:ext - tail]] = 0
    else:
      self._map(_TAIL, full, swa)
    return full

  def _tail_fast(self, pre, seq, last_loc, ext: int, tail: int, pf: int):
    """alloc_extend_swa_tail as one program, known to fit."""
    ps = self.page_size
    dev_last = validate.device_last_loc(last_loc, 1)
    last = validate.host_last_loc(last_loc, dev_last, pre, ps, 1)
    validate.extend_args(pre, seq, last, ext, page_size=ps,
                         num_slots=self.full_attn_allocator.config.num_slots)
    fp, sp = self._pool_pair()
    fp.merge_if(ext // ps + 2 > fp.free_len)  # each pool's SPEC 4.2 trigger
    if tail:
      sp.merge_if(tail // ps + 2 > sp.free_len)
    packed = np.array([pre[0], seq[0], -1 if dev_last is not None else last[0], tail],
                      np.int32)
    extra = () if dev_last is None else (dev_last,)
    out = self._launch("tail", (swa_device.bucket_tokens(ext),), packed, *extra)
    fp.free_len -= pf
    sp.free_len -= -(-tail // ps)
    return self._exact(out, ext)

  @_ranked
  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
    """One slot per request in both pools (SPEC 13), or None.

    Each pool first runs its own need_sort merge trigger (bs > len(free_pages)), as
    SGLang's two calls do; unless both pools then fit, neither allocates (SGLang keeps
    what the fitting pool took). Returns the full slots.
    """
    if self.page_size == 1:
      raise ValueError("alloc_decode needs page_size > 1 (as SGLang asserts); use alloc")
    ps = self.page_size
    seq = validate.host_ints(seq_lens if seq_lens_cpu is None else seq_lens_cpu,
                             "seq_lens")
    need = int(np.count_nonzero((seq - 1) % ps == 0))
    fit_f = need <= self.full_available_size() // ps
    fit_s = need <= self.swa_available_size() // ps
    if fit_f != fit_s:
      # Only the short pool's call runs (it merges if its trigger fires, then refuses);
      # the other pool runs just its merge trigger. Reads a free list (a wait), on this
      # refusal path only.
      short, fits = ((self.swa_attn_allocator, self.full_attn_allocator) if fit_f
                     else (self.full_attn_allocator, self.swa_attn_allocator))
      if self.need_sort and seq.shape[0] > len(fits.free_pages):
        fits.merge_and_sort_free()
      last = self._swa_last(last_loc, (seq - 1) % ps == 0) if short is \
          self.swa_attn_allocator else last_loc
      assert short.alloc_decode(seq, seq, last) is None
      return None
    if fit_f and self._fast() and seq.shape[0]:
      return self._decode_fast(seq, last_loc, need)
    swa_last = self._swa_last(last_loc, (seq - 1) % ps == 0)
    full = self.full_attn_allocator.alloc_decode(seq, seq, last_loc)
    swa = self.swa_attn_allocator.alloc_decode(seq, seq, swa_last)
    if full is None or swa is None:
      assert full is None and swa is None
      return None
    if seq.shape[0]:
      self._pair(full, swa)
    return full

  def _decode_fast(self, seq, last_loc, need: int):
    """alloc_decode as one program, both pools known to fit (`need` new pages each)."""
    ps, bs = self.page_size, seq.shape[0]
    dev_last = validate.device_last_loc(last_loc, bs)
    last = validate.host_last_loc(last_loc, dev_last, seq, ps, 2)
    validate.decode_args(seq, last, page_size=ps,
                         num_slots=self.full_attn_allocator.config.num_slots)
    fp, sp = self._pool_pair()
    fp.merge_if(bs > fp.free_len)  # SPEC 4.3's trigger, in each pool
    sp.merge_if(bs > sp.free_len)
    rows = swa_device.bucket_rows(bs)
    packed = swa_device.pack_decode(seq, None if dev_last is not None else last, rows)
    extra = () if dev_last is None else (self._padded(dev_last, rows, -1),)
    out = self._launch("decode", (rows,), packed, *extra)
    fp.free_len -= need
    sp.free_len -= need
    return self._exact(out, bs)

  # -- freeing -------------------------------------------------------------------------------
  def _debug_peers(self, idx: np.ndarray, mapped: bool, op: str) -> None:
    if not self._debug or idx.size == 0:
      return
    peers = self._read(idx)
    bad = np.flatnonzero((peers <= 0) if mapped else (peers != 0))
    if bad.size:
      i = int(bad[0])
      what = ("has no SWA peer (call free_full)" if mapped else
              f"still has SWA peer {int(peers[i])} (call free, or free_swa first)")
      raise SWADebugError(f"{op}: free_index[{i}]={int(idx[i])} {what} "
                          f"(jax_kvalloc debug mode)")

  @_ranked
  def free(self, free_index) -> None:
    """free_swa then free_full of these full slots (SPEC 13)."""
    idx = self._free_args(free_index)
    if idx is None:
      return
    if self._fast(free=True):
      rows = swa_device.bucket_free(idx.shape[0])
      self._take_lengths(self._launch("free", (rows,), buckets.pad(idx, rows)))
      return
    self.free_swa(idx)
    self.full_attn_allocator.free(idx)

  @_ranked
  def free_swa(self, free_index) -> None:
    """Frees the SWA peers of these full slots and clears their mapping (SPEC 13).

    Page size 1: as free_swa_segment(free_index, start_pos=0). Page size > 1: every slot
    of their full pages; the SWA pool frees the sorted unique pages of the peers found
    (SPEC 4.4), whose count needs their values: one read of the mapping (device: a
    wait), as SGLang's own free_swa synchronizes at page size > 1.
    """
    idx = self._free_args(free_index)
    if idx is None:
      return
    ps = self.page_size
    if ps == 1:
      self._free_swa_pages(idx, "free_swa")
      return
    if self._fast(free=True):
      rows = swa_device.bucket_free(idx.shape[0])
      self._take_lengths(self._launch("free_swa", (rows,), buckets.pad(idx, rows)))
      return
    self._debug_peers(idx, True, "free_swa")
    wide = ((idx // ps) * ps)[:, None] + np.arange(ps)[None, :]
    wide = wide.reshape(-1)
    peers = self._read(wide)
    self.clear_full_to_swa_mapping(wide)
    peers = peers[peers > 0]
    if self._group is not None:
      self._group_slots.append(peers)
    elif peers.size:
      self.swa_attn_allocator.free(peers)

  def _segment_arg(self, free_index, start_pos) -> Any:
    """free_index of a segment call: a device i32 array as it is (device backend, never
    read back), else checked host int64 slots; None when empty."""
    validate.start_pos(start_pos, self.page_size)
    dev = None if self._host else validate.device_ints(free_index, "free_index")
    if dev is not None:
      return dev if dev.shape[0] else None
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return None
    self._check_slots(idx, "free_index")
    return idx

  def _debug_segment(self, idx, mapped: bool, op: str) -> None:
    """Debug mode: a device free_index is read (a wait) and checked as host slots, then
    every slot (mapped: each page's first token) is checked for its peer."""
    if not self._debug:
      return
    if isinstance(idx, jax.Array):
      idx = np.asarray(idx).astype(np.int64)
      self._check_slots(idx, "free_index")
    self._debug_peers(idx[::self.page_size] if mapped else idx, mapped, op)

  @_ranked
  def free_swa_segment(self, free_index, *, start_pos: int) -> None:
    """Frees the SWA pages of one request's tokens start_pos, start_pos + 1, ...:
    mapping[free_index[::ps]] // ps through the SWA pool's free_page_ids, in that order,
    and clears the mapping of those full pages (SPEC 13).

    Device backend: never waits. free_index may be a device array (taken as it is); the
    pages are gathered, and the mapping cleared, in one jitted program, and handed to
    the SWA pool as a device array: its count is one page per full page of the segment,
    so each of them must have its SWA peer (as SGLang expects; debug mode checks it,
    reading the values). Page size 1: the SWA token pool's free reads the slots back, as
    the token class does for every device array.
    """
    idx = self._segment_arg(free_index, start_pos)
    if idx is None:
      return
    if self._fast(free=True):
      self._segment_fast("free_swa_segment", idx, start_pos)
      return
    self._free_swa_pages(idx, "free_swa_segment")

  def _segment_fast(self, op: str, idx, start_pos: int) -> None:
    """free_swa_segment / free_segment as one program; each pool's mirror counts one
    page per full page of the segment, as the pools' free_page_ids do."""
    n = idx.shape[0]
    if op == "free_segment" and not isinstance(idx, jax.Array):
      validate.segment(idx, page_size=self.page_size)  # the full pool's checks, first
    rows = swa_device.bucket_free(n)
    self._launch(op, (rows,), self._padded(idx, rows, 0), np.int32(start_pos), np.int32(n))
    fp, sp = self._pool_pair()
    pages = -(-n // self.page_size)
    self._freed(sp, pages)
    if op == "free_segment":
      self._freed(fp, pages)

  def _free_swa_pages(self, idx, op: str) -> None:
    """Frees the SWA pages of checked segment slots (host int64 or device i32)."""
    ps = self.page_size
    self._debug_segment(idx, True, op)
    if self._host:
      reps = idx[::ps]
      peers = self._translate_host(reps)
      pages = (peers // ps)[peers > 0]
      wide = reps if ps == 1 else (((reps // ps) * ps)[:, None]
                                   + np.arange(ps)[None, :]).reshape(-1)
      self.clear_full_to_swa_mapping(wide)
    else:
      fn = _SEGMENT[0] if self._mapping_shared else _SEGMENT[1]
      self._mapping, pages = fn(self._mapping, self._dev(idx), ps)
      self._mapping_shared = False
    if self._group is not None:
      self._group.append(pages)
    elif pages.shape[0]:
      self.swa_attn_allocator.free_page_ids(pages)

  @_ranked
  def free_full(self, free_index) -> None:
    """The full pool's free alone; the slots must have no SWA peer left."""
    idx = self._free_args(free_index)
    if idx is None:
      return
    self._debug_peers(idx, False, "free_full")
    self.full_attn_allocator.free(idx)

  @_ranked
  def free_segment(self, free_index, *, start_pos: int) -> None:
    """free_swa_segment, then the full pool's free_segment (SPEC 13). Device backend:
    never waits (a device free_index is taken as it is; see free_swa_segment)."""
    idx = self._segment_arg(free_index, start_pos)
    if idx is None:
      return
    if self._fast(free=True):
      self._segment_fast("free_segment", idx, start_pos)
      return
    self._free_swa_pages(idx, "free_segment")
    self.full_attn_allocator.free_segment(idx, start_pos=start_pos)

  @_ranked
  def free_full_segment(self, free_index, *, start_pos: int) -> None:
    """The full pool's free_segment alone; the slots must have no SWA peer left.
    Device backend: never waits (outside debug mode)."""
    idx = self._segment_arg(free_index, start_pos)
    if idx is None:
      return
    self._debug_segment(idx, False, "free_full_segment")
    self.full_attn_allocator.free_segment(idx, start_pos=start_pos)

  def free_group_begin(self) -> None:
    """Opens a free group over both pools (SPEC 13): SWA peers are resolved at call
    time and queued; the full pool's own group queues its frees."""
    if self._ranks is not None:
      for r in self._ranks:
        if r is not None:
          r.free_group_begin()
      return
    validate.group_begin(self._group)
    self.full_attn_allocator.free_group_begin()
    self._group, self._group_slots = [], []

  def free_group_end(self) -> None:
    """Frees the queued SWA page ids (one free_page_ids), the queued SWA slots (one
    free), then closes the full pool's group (SPEC 13)."""
    if self._ranks is not None:
      for r in self._ranks:
        if r is not None:
          r.free_group_end()
      return
    validate.group_end(self._group)
    pages, slots = self._group, self._group_slots
    self._group, self._group_slots = None, []
    if pages and sum(p.shape[0] for p in pages):
      self.swa_attn_allocator.free_page_ids(concat(pages))
    if slots and sum(s.size for s in slots):
      self.swa_attn_allocator.free(np.concatenate(slots))
    self.full_attn_allocator.free_group_end()

  @property
  def is_not_in_free_group(self) -> bool:
    return self._group is None

  def __repr__(self) -> str:
    return (f"SWATokenToKVPoolAllocator(size={self._size_full}, size_swa={self._size_swa}, "
            f"page_size={self.page_size}, need_sort={self.need_sort}, "
            f"backend={self.backend!r}, dp_size={self.dp_size})")
