"""`dp_size` and `dp_rank` for the SGLang-compatible classes (SPEC 12).

sglang-jax's allocators take `dp_size=` and give every method a `dp_rank=` (default 0):
each data-parallel rank owns `size // dp_size` slots with its own free list and page ids
local to it (1..pages_per_rank). Here a class built with `dp_size > 1` holds one allocator
of its own kind per rank (`size // dp_size` slots each, built through the same base-class
machinery, so each keeps its host mirror, backend, copy-on-write snapshots and debug
checks unchanged) and passes each call to the rank it names; ranks share nothing, so one
running short never changes another. With `dp_size == 1` (the default) every method runs
on the allocator itself, exactly as before, and `dp_rank` may only be 0.

What acts on every rank: `clear()` (or one rank: `clear(dp_rank=r)`),
`free_group_begin()`/`free_group_end()` (frees queue per rank, every rank flushes at the
end), `backup_state()`/`restore_state()` (a `RankedSnapshot` of every rank), and the
views `free_pages`/`release_pages` (a list, one array per rank, as sglang-jax's) and
`state` (the ranks stacked along a leading axis: the state `jax_kvalloc.ranks` works on;
`set_state` takes such a state back).

`device` may be one device for every rank or a sequence of `dp_size` devices, rank r's
state on `device[r]`.

`DataParallel` is a mixin listed first among the class bases; operations a class defines
itself (`alloc_extend`, `alloc_decode`) ask `_rank_for(dp_rank)` for the rank to run on.
"""
from __future__ import annotations

import numbers
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from jax_kvalloc import ranks as _ranks
from jax_kvalloc.config import AllocatorConfig


class RankedSnapshot(NamedTuple):
  """What `backup_state` returns when dp_size > 1: one snapshot per rank."""
  config: AllocatorConfig          # the whole pool's
  ranks: Tuple[Any, ...]           # each rank's AllocatorSnapshot, rank order


def check_dp_rank(dp_rank: Any, dp_size: int) -> int:
  """dp_rank as an int in 0..dp_size-1 (TypeError / ValueError naming it otherwise)."""
  if isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral):
    raise TypeError(f"dp_rank must be an int, got {type(dp_rank).__name__} {dp_rank!r}")
  if not 0 <= int(dp_rank) < dp_size:
    raise ValueError(f"dp_rank={dp_rank} is out of range: dp_size={dp_size} "
                     f"(ranks 0..{dp_size - 1})")
  return int(dp_rank)


class DataParallel:
  """Mixin: `dp_size` ranks behind one SGLang-style allocator (see the module docstring).

  The class's constructor builds the whole pool's config and calls
  `super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size)`.
  """

  _dp_ranks: Optional[List[Any]] = None  # one allocator per rank; None when dp_size == 1

  def __init__(self, config: AllocatorConfig, dtype: Any = None, device: Any = None,
               kvcache: Any = None, backend: str = "device", *, dp_size: int = 1):
    rank_config = _ranks.rank_config(config, dp_size)  # validates dp_size
    if dp_size == 1:
      self._dp_ranks = None
      super().__init__(config, dtype, device, kvcache, backend)
      return
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * dp_size
    if len(devices) != dp_size:
      raise ValueError(f"device: a sequence needs one device per rank, got "
                       f"{len(devices)} for dp_size={dp_size}")
    built = []
    for r in range(dp_size):
      # The same class, built past its own __init__ (which only makes the config): every
      # rank is an ordinary single-pool allocator.
      rank = type(self).__new__(type(self))
      DataParallel.__init__(rank, rank_config, dtype, devices[r], kvcache, backend)
      built.append(rank)
    self._dp_ranks = built
    super().__init__(config, dtype, None, kvcache, backend)  # no pool of its own
    self.device = device

  # -- which rank --------------------------------------------------------------------
  @property
  def dp_size(self) -> int:
    return 1 if self._dp_ranks is None else len(self._dp_ranks)

  def _rank_for(self, dp_rank: Any) -> Optional[Any]:
    """The allocator of rank dp_rank, or None when this object is the only rank."""
    if self._dp_ranks is None and type(dp_rank) is int and dp_rank == 0:
      return None  # the default, checked without a call: every method passes here
    r = check_dp_rank(dp_rank, self.dp_size)
    return None if self._dp_ranks is None else self._dp_ranks[r]

  def _every_rank(self) -> List[Any]:
    return list(self._dp_ranks)

  # -- per-rank operations ------------------------------------------------------------
  def available_size(self, dp_rank: int = 0) -> int:
    rank = self._rank_for(dp_rank)
    return super().available_size() if rank is None else rank.available_size()

  def alloc(self, need_size: int, dp_rank: int = 0):
    rank = self._rank_for(dp_rank)
    return super().alloc(need_size) if rank is None else rank.alloc(need_size)

  def free(self, free_index, dp_rank: int = 0) -> None:
    rank = self._rank_for(dp_rank)
    return super().free(free_index) if rank is None else rank.free(free_index)

  def free_page_ids(self, page_ids, dp_rank: int = 0) -> None:
    rank = self._rank_for(dp_rank)
    return super().free_page_ids(page_ids) if rank is None else rank.free_page_ids(page_ids)

  def free_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    rank = self._rank_for(dp_rank)
    if rank is None:
      return super().free_segment(free_index, start_pos=start_pos)
    return rank.free_segment(free_index, start_pos=start_pos)

  def free_segments(self, segments, dp_rank: int = 0) -> None:
    rank = self._rank_for(dp_rank)
    return super().free_segments(segments) if rank is None else rank.free_segments(segments)

  # The free_full* aliases are the plain frees of the rank named (no sliding-window peer).
  def free_full(self, free_index, dp_rank: int = 0) -> None:
    return self.free(free_index, dp_rank=dp_rank)

  def free_full_segment(self, free_index, *, start_pos: int, dp_rank: int = 0) -> None:
    return self.free_segment(free_index, start_pos=start_pos, dp_rank=dp_rank)

  def free_full_segments(self, segments, dp_rank: int = 0) -> None:
    return self.free_segments(segments, dp_rank=dp_rank)

  def merge_and_sort_free(self, dp_rank: int = 0) -> None:
    rank = self._rank_for(dp_rank)
    return super().merge_and_sort_free() if rank is None else rank.merge_and_sort_free()

  def get_all_free_pages(self, dp_rank: int = 0) -> np.ndarray:
    rank = self._rank_for(dp_rank)
    return super().get_all_free_pages() if rank is None else rank.get_all_free_pages()

  def debug_print(self, dp_rank: Optional[int] = None) -> str:
    """One line per rank (dp_rank=None: every rank, prefixed "rank r:")."""
    if self._dp_ranks is None:
      if dp_rank is not None:
        check_dp_rank(dp_rank, 1)
      return super().debug_print()
    if dp_rank is not None:
      return self._rank_for(dp_rank).debug_print()
    return "\n".join(f"rank {r}: {a.debug_print()}" for r, a in enumerate(self._dp_ranks))

  # -- every rank ----------------------------------------------------------------------
  def warmup(self, *args, **kwargs):
    """BaseAllocator.warmup on every rank (ranks of one config on one device share their
    programs, so all but the first find them compiled). Returns the summed report."""
    if self._dp_ranks is None:
      return super().warmup(*args, **kwargs)
    reports = [rank.warmup(*args, **kwargs) for rank in self._dp_ranks]
    return reports[0]._replace(programs=sum(r.programs for r in reports),
                               seconds=sum(r.seconds for r in reports))

  def clear(self, dp_rank: Optional[int] = None) -> None:
    """Back to the initial state (SPEC 2): rank dp_rank, or every rank when None. Closes
    the free group (of that rank, or of all)."""
    if self._dp_ranks is None:
      if dp_rank is not None:
        check_dp_rank(dp_rank, 1)
      return super().clear()
    targets = self._every_rank() if dp_rank is None else [self._rank_for(dp_rank)]
    for rank in targets:
      rank.clear()
    return None

  def free_group_begin(self) -> None:
    """Opens a free group on every rank: frees queue per rank (SPEC 7, 12)."""
    if self._dp_ranks is None:
      return super().free_group_begin()
    if not self._dp_ranks[0].is_not_in_free_group:
      self._dp_ranks[0].free_group_begin()  # raises the nested-begin error, nothing changed
    for rank in self._dp_ranks:
      rank.free_group_begin()
    return None

  def free_group_end(self) -> None:
    """Closes the free group: every rank frees what it queued, in one call each."""
    if self._dp_ranks is None:
      return super().free_group_end()
    for rank in self._dp_ranks:
      rank.free_group_end()  # the first raises (nothing lost) when no group is open
    return None

  @property
  def is_not_in_free_group(self) -> bool:
    if self._dp_ranks is None:
      return super().is_not_in_free_group
    return self._dp_ranks[0].is_not_in_free_group

  def backup_state(self):
    """A snapshot of every rank (SPEC 8, 12); O(1) per rank."""
    if self._dp_ranks is None:
      return super().backup_state()
    return RankedSnapshot(self.config, tuple(r.backup_state() for r in self._dp_ranks))

  def restore_state(self, state) -> None:
    """Puts back a snapshot of `backup_state` (every rank)."""
    if self._dp_ranks is None:
      return super().restore_state(state)
    if not isinstance(state, RankedSnapshot):
      raise TypeError(f"state must be a RankedSnapshot from backup_state() of an "
                      f"allocator with dp_size={self.dp_size}, got {type(state).__name__}")
    if state.config != self.config or len(state.ranks) != self.dp_size:
      raise ValueError(f"state is a snapshot of another allocator ({state.config}, "
                       f"{len(state.ranks)} ranks), not of {self.config} with "
                       f"dp_size={self.dp_size}")
    for rank, snap in zip(self._dp_ranks, state.ranks):
      rank.restore_state(snap)
    return None

  # -- views ---------------------------------------------------------------------------
  @property
  def free_pages(self):
    """dp_size == 1: the free list (i32[len]). Else a list: rank r's free list at [r]."""
    if self._dp_ranks is None:
      return super().free_pages
    return [r.free_pages for r in self._dp_ranks]

  @property
  def release_pages(self):
    """dp_size == 1: the release list. Else a list: rank r's release list at [r]."""
    if self._dp_ranks is None:
      return super().release_pages
    return [r.release_pages for r in self._dp_ranks]

  @property
  def state(self):
    """dp_size == 1: the functional state. Else every rank's state stacked along a
    leading axis (a new array, O(pool): the state jax_kvalloc.ranks works on; give it
    back with `set_state`). Ranks placed on different devices cannot be stacked."""
    if self._dp_ranks is None:
      return super().state
    return _ranks.stack_ranks([r.state for r in self._dp_ranks])

  def set_state(self, state) -> None:
    """Takes back a state that jitted code returned: dp_size == 1 as before; else a
    ranked state of dp_size ranks (rank r goes to rank r, each checked as a single
    pool's, nothing changed on error)."""
    if self._dp_ranks is None:
      return super().set_state(state)
    if _ranks.num_ranks(state) != self.dp_size:
      raise ValueError(f"state has {_ranks.num_ranks(state)} ranks, this allocator "
                       f"{self.dp_size}")
    parts = [_ranks.rank_state(state, r) for r in range(self.dp_size)]
    snap = self.backup_state()
    try:
      for rank, part in zip(self._dp_ranks, parts):
        rank.set_state(part)
    except Exception:
      self.restore_state(snap)  # all ranks or none
      raise
    return None

  def __repr__(self) -> str:
    text = super().__repr__()
    if self._dp_ranks is None:
      return text
    return text[:-1] + f", dp_size={self.dp_size})"
