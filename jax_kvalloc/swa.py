"""The sliding-window (SWA) allocator (SPEC 13) as pure functions: two pools and a mapping.

Hybrid models keep a full-attention KV pool and a smaller sliding-window pool; a token's
window KV is freed once the token leaves the window. The state is the two pools' states
(each the allocator of SPEC 3/4, run by jax_kvalloc.allocation / freeing, so each pool's
paged operations use the same kernels as a single pool) and `mapping`, the SWA slot of
every full slot's token (0: none). Every operation updates the mapping in the same traced
call, so one jitted step allocates in both pools and records the pairing.

Failure returns the old state (ok=False), except where SPEC says a merge stays done:
`alloc_decode` keeps each pool's own need_sort merge, as SGLang's two calls do, but
allocates in neither pool unless both fit (SGLang keeps what the fitting pool took).

Free groups and the debug-mode peer checks live in the class
(jax_kvalloc.sglang.swa); each pool's own debug record (double frees) works here as in a
single pool when the config has debug=True.

Ownership (SPEC 14; config.guard): each pool keeps its own record and refuses its own
part of a free whole. A free of both pools (`free`, `free_segment`) frees the SWA side
first; when that part is refused, the full side is refused too. When the full side
alone is refused, the SWA side and the mapping are put back as they were
(`undo_swa_side`): a refused free changes nothing but the refusing pool's status
(SPEC 14). The mapping of a refused SWA free is kept as it was.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.config import _env_debug, _env_kernel
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.state import AllocatorState
from pallas_kernels import capacity

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SWAConfig:
  """Static configuration of an SWA allocator: two pools of one page size.

  Attributes:
    size: full-attention slots (SGLang's `size`).
    size_swa: sliding-window slots.
    page_size: slots per page of both pools (1: token pools, FIFO free).
    need_sort, kernel, debug, guard: as AllocatorConfig, for both pools (each pool keeps
      its own ownership record).
  """
  size: int
  size_swa: int
  page_size: int = 1
  need_sort: bool = False
  kernel: str = dataclasses.field(default_factory=_env_kernel)
  debug: bool = dataclasses.field(default_factory=_env_debug)
  guard: bool = True

  def __post_init__(self):
    for name in ("full", "swa"):  # each pool's config checks its fields
      try:
        getattr(self, name)
      except (TypeError, ValueError) as e:
        raise type(e)(f"{'size' if name == 'full' else 'size_swa'} pool: {e}") from e

  def _pool(self, size: int) -> AllocatorConfig:
    return AllocatorConfig(size=size, page_size=self.page_size, need_sort=self.need_sort,
                           kind="token" if self.page_size == 1 else "paged",
                           kernel=self.kernel, debug=self.debug, guard=self.guard)

  @property
  def full(self) -> AllocatorConfig:
    """The full-attention pool's config."""
    return self._pool(self.size)

  @property
  def swa(self) -> AllocatorConfig:
    """The sliding-window pool's config."""
    return self._pool(self.size_swa)

  @property
  def mapping_len(self) -> int:
    """size + page_size + 1: every full slot, then the -1 that translate(-1) reads."""
    return self.size + self.page_size + 1


class SWAState(NamedTuple):
  """Both pools and the full-to-SWA mapping (SPEC 13)."""
  full: AllocatorState  # the full-attention pool
  swa: AllocatorState   # the sliding-window pool
  mapping: Array        # i32[size + page_size + 1]; mapping[f] = SWA slot of full slot f
                        # (0: none); the last entry is -1 and never written


def init(config: SWAConfig) -> SWAState:
  """Both pools as SPEC 2 says; the mapping all 0 but its last entry, -1 (SPEC 13 clear)."""
  mapping = jnp.zeros((config.mapping_len,), jnp.int32).at[-1].set(-1)
  return SWAState(st.init(config.full), st.init(config.swa), mapping)


def clear(config: SWAConfig, state: SWAState) -> SWAState:
  """SGLang's clear(): the initial state (the old one is dropped)."""
  del state
  return init(config)


def _select(ok: Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


# ---------------------------------------------------------------------------------------
# The mapping. Slots outside 1 .. size + ps - 1 are never written (the last entry holds
# the -1 that translate(-1) returns).
# ---------------------------------------------------------------------------------------

def _write_mask(mapping: Array, full: Array, mask: Array) -> Array:
  """i32[M] write positions: full where mask and 0 < full < len - 1, else out of range."""
  n = mapping.shape[0]
  ok = mask & (full > 0) & (full < n - 1)
  return jnp.where(ok, full, n)


def set_mapping(mapping: Array, full: Array, swa: Array,
                mask: Optional[Array] = None) -> Array:
  """mapping[full[i]] = swa[i] where mask[i] (SGLang's set_full_to_swa_mapping).

  Args:
    mapping: i32[L].
    full, swa: i32[M] full slots and their SWA slots.
    mask: optional bool[M] (None: all). Slots <= 0 and the last entry are never written.

  Returns:
    The new mapping, i32[L].
  """
  full = validate.as_i32(full, "full").reshape(-1)
  swa = validate.as_i32(swa, "swa").reshape(-1)
  mask = jnp.ones(full.shape, bool) if mask is None else mask
  return mapping.at[_write_mask(mapping, full, mask)].set(swa, mode="drop")


def clear_mapping(mapping: Array, full: Array, mask: Optional[Array] = None) -> Array:
  """mapping[full[i]] = 0 where mask[i] (SGLang's clear_full_to_swa_mapping)."""
  full = validate.as_i32(full, "full").reshape(-1)
  mask = jnp.ones(full.shape, bool) if mask is None else mask
  return mapping.at[_write_mask(mapping, full, mask)].set(0, mode="drop")


def translate(mapping: Array, loc: Array) -> Array:
  """SWA slots of full slots (SGLang's translate_loc_from_full_to_swa): mapping[loc].

  loc: i32[...] full slots; -1 (no prefix) reads the last entry and gives -1; other
  negatives give -1 too; slots past the mapping give 0. Same shape as loc.
  """
  loc = validate.as_i32(loc, "loc")
  n = mapping.shape[0]
  pos = jnp.where(loc < 0, n - 1, jnp.minimum(loc, n))
  return jnp.take(mapping, pos, mode="fill", fill_value=0)


def translate_state(config: SWAConfig, state: SWAState, loc: Array) -> Array:
  """`translate` of the state's mapping (same shape as loc)."""
  del config
  return translate(state.mapping, loc)


def pair_tail(mapping: Array, full: Array, swa: Array) -> Array:
  """The mapping after `alloc_extend_swa_tail` (static shapes): the last len(swa) full
  slots pair with swa, and the ones before them get 0 (all of them when swa is empty).

  Args:
    mapping: i32[L]; full: i32[ext] the extend's full slots; swa: i32[tail], tail <= ext.
  """
  ext, tail = full.shape[0], swa.shape[0]
  mapping = set_mapping(mapping, full[ext - tail:], swa)
  return clear_mapping(mapping, full[:ext - tail])


def _widen(idx: Array, ps: int) -> Array:
  """i32[M * ps]: every slot of the page of each idx[i] (page order kept)."""
  base = (idx // ps) * ps
  return (base[:, None] + jnp.arange(ps, dtype=jnp.int32)[None, :]).reshape(-1)


# ---------------------------------------------------------------------------------------
# Sizes.
# ---------------------------------------------------------------------------------------

def full_available_size(config: SWAConfig, state: SWAState) -> Array:
  """The full pool's available_size (i32[])."""
  return st.available_size(config.full, state.full)


def swa_available_size(config: SWAConfig, state: SWAState) -> Array:
  """The SWA pool's available_size (i32[])."""
  return st.available_size(config.swa, state.swa)


def available_size(config: SWAConfig, state: SWAState) -> Array:
  """min(full, swa) available slots (i32[])."""
  return jnp.minimum(full_available_size(config, state), swa_available_size(config, state))


def new_pages_available(config: SWAConfig, state: SWAState, num_full_pages: Array,
                        num_swa_pages: Array) -> Array:
  """bool[]: both counts fit their pool's available pages (released ones included)."""
  ps = config.page_size
  return ((num_full_pages <= full_available_size(config, state) // ps)
          & (num_swa_pages <= swa_available_size(config, state) // ps))


def merge_and_sort_free(config: SWAConfig, state: SWAState) -> SWAState:
  """Both pools' merge_and_sort_free (SPEC 6)."""
  return state._replace(full=freeing.merge_and_sort_free(config.full, state.full),
                        swa=freeing.merge_and_sort_free(config.swa, state.swa))


# ---------------------------------------------------------------------------------------
# Allocation.
# ---------------------------------------------------------------------------------------

def alloc(config: SWAConfig, state: SWAState, need_size: Array, *,
          max_size: int) -> Tuple[SWAState, Array, Array]:
  """`need_size` slots in both pools, paired in the mapping (page size 1 only).

  Args:
    config: static; page_size must be 1 (ValueError otherwise, as SGLang asserts).
    state: the SWA state.
    need_size: i32[] slots wanted.
    max_size: static length of the output.

  Returns:
    (state, i32[max_size] full slots (0 past need_size), bool[] ok). Refused (old state,
    no merge) when need_size exceeds either pool's available size or is invalid for the
    pool (negative, > max_size).
  """
  if config.page_size != 1:
    raise ValueError(f"alloc needs page_size 1 (SGLang asserts it), got {config.page_size}")
  need_size = validate.as_i32(need_size, "need_size")
  fits = ((need_size <= full_available_size(config, state))
          & (need_size <= swa_available_size(config, state)))
  n = jnp.where(fits, need_size, 0)
  full, out_f, ok_f = allocation.alloc(config.full, state.full, n, max_size=max_size)
  swa, out_s, ok_s = allocation.alloc(config.swa, state.swa, n, max_size=max_size)
  ok = fits & ok_f & ok_s
  mapping = set_mapping(state.mapping, out_f, out_s, ok & (jnp.arange(max_size) < n))
  new = SWAState(full, swa, mapping)
  return _select(ok, new, state), jnp.where(ok, out_f, 0), ok


def _new_pages(config: SWAConfig, prefix_lens: Array, seq_lens: Array,
               num_reqs: Optional[Array]) -> Array:
  """i32[] sum(ceil(seq/ps) - ceil(pre/ps)) over the real rows, saturating past the
  smaller pool (a larger count is refused either way)."""
  ps = config.page_size
  b = prefix_lens.shape[0]
  real = (jnp.ones((b,), bool) if num_reqs is None
          else jnp.arange(b) < validate.as_i32(num_reqs, "num_reqs"))
  per = jnp.where(real, cdiv(seq_lens, ps) - cdiv(prefix_lens, ps), 0)
  cap = max(config.full.num_pages, config.swa.num_pages)
  return capacity.saturating_prefix_sums(jnp.maximum(per, 0), cap)[1]


def alloc_extend(config: SWAConfig, state: SWAState, prefix_lens: Array, seq_lens: Array,
                 last_loc: Array, *, max_tokens: int,
                 num_reqs: Optional[Array] = None) -> Tuple[SWAState, Array, Array]:
  """A prefill batch in both pools (SPEC 13; each pool as SPEC 4.2), paired.

  Args:
    config: static; page_size > 1 (ValueError otherwise, as SGLang asserts).
    state: the SWA state.
    prefix_lens, seq_lens, last_loc: i32[B] as `jax_kvalloc.alloc_extend`; last_loc is
      the full pool's slot; the SWA pool gets translate(last_loc).
    max_tokens: static output length (>= the batch's extend tokens).
    num_reqs: optional i32[] real rows (the rest padding).

  Returns:
    (state, i32[max_tokens] full slots in batch order, bool[] ok). Refused (old state,
    no merge) when the batch's new pages exceed either pool's available pages, or when
    either pool refuses the input (see alloc_extend).
  """
  if config.page_size == 1:
    raise ValueError("alloc_extend needs page_size > 1 (SGLang asserts it)")
  prefix_lens = validate.as_i32(prefix_lens, "prefix_lens")
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  validate.static_rows(prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
  p = _new_pages(config, prefix_lens, seq_lens, num_reqs)
  fits = new_pages_available(config, state, p, p)
  full, out_f, ok_f = allocation.alloc_extend(config.full, state.full, prefix_lens,
                                              seq_lens, last_loc, max_tokens=max_tokens,
                                              num_reqs=num_reqs)
  swa, out_s, ok_s = allocation.alloc_extend(config.swa, state.swa, prefix_lens, seq_lens,
                                             translate(state.mapping, last_loc),
                                             max_tokens=max_tokens, num_reqs=num_reqs)
  ok = fits & ok_f & ok_s
  mapping = set_mapping(state.mapping, out_f, out_s, ok & (out_f > 0))
  return _select(ok, SWAState(full, swa, mapping), state), jnp.where(ok, out_f, 0), ok


def alloc_extend_swa_tail(config: SWAConfig, state: SWAState, prefix_lens: Array,
                          seq_lens: Array, last_loc: Array, swa_tail_len: Array, *,
                          max_tokens: int) -> Tuple[SWAState, Array, Array]:
  """One request's extend with full KV for every token and SWA KV for the last
  `swa_tail_len` only (SPEC 13).

  Args:
    config: static; page_size > 1.
    state: the SWA state.
    prefix_lens, seq_lens, last_loc: i32[1] (one request; ValueError otherwise).
    swa_tail_len: i32[], 0 <= tail <= seq - pre (else refused).
    max_tokens: static output length.

  Returns:
    (state, i32[max_tokens] full slots, bool[] ok). The SWA slots are a fresh request's
    (prefix 0, last_loc -1) and pair with the last tail full slots; the head's mapping is
    set to 0 (SPEC 13; at tail 0 SGLang writes nothing, and in valid use those entries are 0
    already: every free of SWA KV clears its whole full pages). Refused (old state, no
    merge) when the full pages or ceil(tail / ps) SWA pages are not available.
  """
  if config.page_size == 1:
    raise ValueError("alloc_extend_swa_tail needs page_size > 1 (SGLang asserts it)")
  ps = config.page_size
  prefix_lens = validate.as_i32(prefix_lens, "prefix_lens")
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  if validate.static_rows(prefix_lens=prefix_lens, seq_lens=seq_lens,
                          last_loc=last_loc) != 1:
    raise ValueError(f"alloc_extend_swa_tail takes one request, got {prefix_lens.shape}")
  tail = validate.as_i32(swa_tail_len, "swa_tail_len")
  ext = seq_lens[0] - prefix_lens[0]
  valid = (tail >= 0) & (tail <= ext)
  tail = jnp.where(valid, tail, 0)
  pf = _new_pages(config, prefix_lens, seq_lens, None)
  fits = valid & new_pages_available(config, state, pf, cdiv(tail, ps))
  full, out_f, ok_f = allocation.alloc_extend(config.full, state.full, prefix_lens,
                                              seq_lens, last_loc, max_tokens=max_tokens)
  one = jnp.ones((1,), jnp.int32)
  swa, out_s, ok_s = allocation.alloc_extend(config.swa, state.swa, 0 * one, tail * one,
                                             -one, max_tokens=max_tokens)
  has_tail = tail > 0
  swa = _select(has_tail, swa, state.swa)  # tail 0: SGLang never calls the SWA pool
  ok = fits & ok_f & (ok_s | ~has_tail)
  j = jnp.arange(max_tokens, dtype=jnp.int32)
  head = ext - tail
  peer = jnp.take(out_s, jnp.clip(j - head, 0, max_tokens - 1))
  mapping = set_mapping(state.mapping, out_f, peer, ok & (j >= head) & (j < ext))
  mapping = clear_mapping(mapping, out_f, ok & (j < head))
  return _select(ok, SWAState(full, swa, mapping), state), jnp.where(ok, out_f, 0), ok


def _decode_rows(seq_lens: Array, num_reqs: Optional[Array]) -> Tuple[Array, Array]:
  """(bool[] real rows valid, i32[] bs) exactly as alloc_decode decides its trigger."""
  b = seq_lens.shape[0]
  if num_reqs is None:
    real, bs = jnp.ones((b,), bool), jnp.full((), b, jnp.int32)
  else:
    bs = jnp.clip(validate.as_i32(num_reqs, "num_reqs"), 0, b)
    real = jnp.arange(b) < bs
  return jnp.all(jnp.where(real, seq_lens, 1) >= 1), bs


def alloc_decode(config: SWAConfig, state: SWAState, seq_lens: Array, last_loc: Array, *,
                 num_reqs: Optional[Array] = None) -> Tuple[SWAState, Array, Array]:
  """One new token per request in both pools (SPEC 13; each pool as SPEC 4.3), paired.

  Args:
    config: static; page_size > 1.
    state: the SWA state.
    seq_lens, last_loc: i32[B] as `jax_kvalloc.alloc_decode` (last_loc: full slots; the
      SWA pool gets translate(last_loc)).
    num_reqs: optional i32[] real rows.

  Returns:
    (state, i32[B] full slots, bool[] ok). Each pool first runs its own need_sort merge
    trigger (bs > len(free_pages)), as SGLang's two calls do; that merge stays. Then,
    unless both pools fit, neither allocates and ok is False (SGLang keeps the slots of
    the pool that fit: a leak).
  """
  if config.page_size == 1:
    raise ValueError("alloc_decode needs page_size > 1 (SGLang asserts it)")
  seq_lens = validate.as_i32(seq_lens, "seq_lens")
  last_loc = validate.as_i32(last_loc, "last_loc")
  validate.static_rows(seq_lens=seq_lens, last_loc=last_loc)
  rows_valid, bs = _decode_rows(seq_lens, num_reqs)
  merged_f = freeing.maybe_merge(config.full, state.full,
                                 rows_valid & (bs > state.full.free_len))
  merged_s = freeing.maybe_merge(config.swa, state.swa,
                                 rows_valid & (bs > state.swa.free_len))
  full, out_f, ok_f = allocation.alloc_decode(config.full, merged_f, seq_lens, last_loc,
                                              num_reqs=num_reqs)
  swa, out_s, ok_s = allocation.alloc_decode(config.swa, merged_s, seq_lens,
                                             translate(state.mapping, last_loc),
                                             num_reqs=num_reqs)
  ok = ok_f & ok_s
  mapping = set_mapping(state.mapping, out_f, out_s, ok & (out_f > 0))
  new = SWAState(full, swa, mapping)
  kept = SWAState(merged_f, merged_s, state.mapping)
  return _select(ok, new, kept), jnp.where(ok, out_f, 0), ok


# ---------------------------------------------------------------------------------------
# Freeing.
# ---------------------------------------------------------------------------------------

def _given(m: int, num: Optional[Array]) -> Array:
  if num is None:
    return jnp.ones((m,), bool)
  return jnp.arange(m, dtype=jnp.int32) < validate.as_i32(num, "num")


def take_segment_pages(mapping: Array, free_index: Array, page_size: int,
                       given: Optional[Array] = None) -> Tuple[Array, Array]:
  """The SWA pages of a segment's full pages, read and unpaired in one step.

  Args:
    mapping: i32[L].
    free_index: i32[M] full slots of consecutive tokens of one request, from a page
      start (free_swa_segment's argument).
    page_size: static.
    given: optional bool[M]; entries where it is False are skipped (None: all given).

  Returns:
    (mapping with every slot of the full pages of free_index[::page_size] set to 0 (the
    representatives alone at page size 1), i32[ceil(M / page_size)] the SWA pages
    mapping[free_index[::page_size]] // page_size, 0 where a representative is not given
    or has no peer).
  """
  ps = page_size
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  reps = free_index[::ps]
  rep_given = jnp.ones(reps.shape, bool) if given is None else given[::ps]
  peers = translate(mapping, jnp.where(rep_given, reps, 0))
  pages = jnp.where(rep_given & (peers > 0), peers // ps, 0)
  if ps == 1:
    return clear_mapping(mapping, reps, rep_given), pages
  return clear_mapping(mapping, _widen(reps, ps), jnp.repeat(rep_given, ps)), pages


def free_swa_segment(config: SWAConfig, state: SWAState, free_index: Array,
                     start_pos: Array, num: Optional[Array] = None) -> SWAState:
  """Frees the SWA KV of one request's tokens start_pos, start_pos + 1, ... (SPEC 13).

  Args:
    free_index: i32[M] full slots of consecutive tokens of one request (entries >= num
      and 0 are padding).
    start_pos: i32[] first token's position, a multiple of page_size (else nothing
      happens).
    num: optional i32[] real entries.

  Returns:
    The state with the SWA pages mapping[free_index[::ps]] // ps freed through the SWA
    pool's free_page_ids in that order (page size 1: the SWA slots, appended), and the
    mapping of every slot of those full pages set to 0. Full pages without a peer free
    nothing in the SWA pool. A free the SWA pool's ownership record refuses changes
    nothing but that record's status.
  """
  return _free_swa_segment(config, state, free_index, start_pos, num)[0]


def _free_swa_segment(config: SWAConfig, state: SWAState, free_index: Array,
                      start_pos: Array, num: Optional[Array]) -> Tuple[SWAState, Array]:
  """free_swa_segment and whether the SWA pool refused it (bool[])."""
  ps = config.page_size
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  start_pos = validate.as_i32(start_pos, "start_pos")
  given = _given(free_index.shape[0], num) & (free_index > 0) & (start_pos % ps == 0)
  _, pages = take_segment_pages(state.mapping, free_index, ps, given)
  swa, refused = freeing.free_page_ids_refused(config.swa, state.swa, pages)
  mapping, _ = take_segment_pages(state.mapping, free_index, ps, given & ~refused)
  return state._replace(swa=swa, mapping=mapping), refused


def free_swa(config: SWAConfig, state: SWAState, free_index: Array,
             num: Optional[Array] = None) -> SWAState:
  """Frees the SWA KV of these full slots (SPEC 13).

  Page size 1: `free_swa_segment(free_index, start_pos=0)`. Page size > 1: every slot of
  each given slot's full page is looked up and its mapping set to 0, and the SWA pool
  frees the peers found (SPEC 4.4's free: sorted unique pages, prepended). A free the
  SWA pool's ownership record refuses changes nothing but that record's status.

  Args:
    free_index: i32[M] full slots (0 and entries >= num are padding).
  """
  return _free_swa(config, state, free_index, num)[0]


def _free_swa(config: SWAConfig, state: SWAState, free_index: Array,
              num: Optional[Array]) -> Tuple[SWAState, Array]:
  """free_swa and whether the SWA pool refused it (bool[])."""
  ps = config.page_size
  if ps == 1:
    return _free_swa_segment(config, state, free_index, jnp.zeros((), jnp.int32), num)
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  given = jnp.repeat(_given(free_index.shape[0], num) & (free_index > 0), ps)
  wide = _widen(free_index, ps)
  peers = jnp.where(given, translate(state.mapping, jnp.where(given, wide, 0)), 0)
  swa, refused = freeing.free_refused(config.swa, state.swa, jnp.maximum(peers, 0))
  mapping = clear_mapping(state.mapping, wide, given & ~refused)
  return state._replace(swa=swa, mapping=mapping), refused


def free_full(config: SWAConfig, state: SWAState, free_index: Array) -> SWAState:
  """The full pool's `free` alone (the tokens must have no SWA peer left)."""
  return state._replace(full=freeing.free(config.full, state.full, free_index))


def free_full_segment(config: SWAConfig, state: SWAState, free_index: Array,
                      start_pos: Array, num: Optional[Array] = None) -> SWAState:
  """The full pool's `free_segment` alone (the tokens must have no SWA peer left)."""
  return state._replace(full=freeing.free_segment(config.full, state.full, free_index,
                                                  start_pos, num))


def undo_swa_side(before: SWAState, after: SWAState, full: Any, swa_refused: Array,
                  full_refused: Array) -> SWAState:
  """`after` (whose SWA side, pool and mapping, was freed) with the full pool `full`;
  when the full side alone was refused (bool[]), the SWA pool and mapping as `before`
  had them: the free changed nothing but the full pool's status (SPEC 14)."""
  undo = full_refused & ~swa_refused
  return SWAState(full, _select(undo, before.swa, after.swa),
                  jnp.where(undo, before.mapping, after.mapping))


def free(config: SWAConfig, state: SWAState, free_index: Array,
         num: Optional[Array] = None) -> SWAState:
  """`free_swa` then `free_full` of these full slots (SPEC 13). Padding: 0 and >= num.
  A refusal of either side frees nothing (module docstring)."""
  after, refused = _free_swa(config, state, free_index, num)
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  given = _given(free_index.shape[0], num)
  full, full_refused = freeing.free_refused(config.full, after.full,
                                            jnp.where(given, free_index, 0),
                                            also_refuse=refused)
  return undo_swa_side(state, after, full, refused, full_refused)


def free_segment(config: SWAConfig, state: SWAState, free_index: Array, start_pos: Array,
                 num: Optional[Array] = None) -> SWAState:
  """`free_swa_segment` then the full pool's `free_segment` (SPEC 13). A refusal of
  either side frees nothing (module docstring)."""
  after, refused = _free_swa_segment(config, state, free_index, start_pos, num)
  free_index = validate.as_i32(free_index, "free_index").reshape(-1)
  full, full_refused = freeing.free_segment_refused(
      config.full, after.full, free_index, start_pos,
      jnp.where(refused, 0, free_index.shape[0] if num is None
                else validate.as_i32(num, "num")))
  return undo_swa_side(state, after, full, refused, full_refused)


# ---------------------------------------------------------------------------------------
# The optax-style entry point.
# ---------------------------------------------------------------------------------------

class SWAAllocator(NamedTuple):
  """The SPEC 13 operations with an SWAConfig bound (see jax_kvalloc.allocator)."""
  config: SWAConfig
  init: Callable[..., Any]                   # () -> SWAState
  alloc: Callable[..., Any]                  # (state, need_size, *, max_size)
  alloc_extend: Callable[..., Any]           # (state, pre, seq, last_loc, *, max_tokens, num_reqs=None)
  alloc_extend_swa_tail: Callable[..., Any]  # (state, pre, seq, last_loc, tail, *, max_tokens)
  alloc_decode: Callable[..., Any]           # (state, seq, last_loc, *, num_reqs=None)
  free: Callable[..., Any]                   # (state, free_index, num=None) -> state
  free_swa: Callable[..., Any]               # (state, free_index, num=None)
  free_swa_segment: Callable[..., Any]       # (state, free_index, start_pos, num=None)
  free_full: Callable[..., Any]              # (state, free_index)
  free_full_segment: Callable[..., Any]      # (state, free_index, start_pos, num=None)
  free_segment: Callable[..., Any]           # (state, free_index, start_pos, num=None)
  translate: Callable[..., Any]              # (state, loc) -> SWA slots
  available_size: Callable[..., Any]         # (state) -> i32[]
  full_available_size: Callable[..., Any]
  swa_available_size: Callable[..., Any]
  merge_and_sort_free: Callable[..., Any]    # (state) -> state


def swa_allocator(config: Optional[SWAConfig] = None, **kwargs) -> SWAAllocator:
  """SPEC 13's SWA allocator as pure functions with the config bound.

  Args:
    config: an SWAConfig, or its fields as keyword arguments
      (`swa_allocator(size=4096, size_swa=1024, page_size=16)`).
  """
  if config is None:
    config = SWAConfig(**kwargs)
  elif kwargs:
    raise TypeError(f"pass either config or keyword arguments, not both (got {sorted(kwargs)})")
  bind = lambda fn: functools.partial(fn, config)
  return SWAAllocator(
      config=config, init=bind(init), alloc=bind(alloc), alloc_extend=bind(alloc_extend),
      alloc_extend_swa_tail=bind(alloc_extend_swa_tail), alloc_decode=bind(alloc_decode),
      free=bind(free), free_swa=bind(free_swa), free_swa_segment=bind(free_swa_segment),
      free_full=bind(free_full), free_full_segment=bind(free_full_segment),
      free_segment=bind(free_segment), translate=bind(translate_state),
      available_size=bind(available_size), full_available_size=bind(full_available_size),
      swa_available_size=bind(swa_available_size),
      merge_and_sort_free=bind(merge_and_sort_free))


# ---------------------------------------------------------------------------------------
# Host views, for the classes and tests.
# ---------------------------------------------------------------------------------------

def live_mapping(state: SWAState) -> np.ndarray:
  """The mapping as a host numpy int32 array (syncs)."""
  return np.asarray(state.mapping, np.int32)
