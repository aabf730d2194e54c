"""One pool of an SGLang-compatible class: its state over a backend, the host mirror of
its list lengths, and the copy-on-write flags of its rings.

The mirror (`free_len`, `release_len`: SGLang's `*_cpu` copies give every page count) is
exact, so the class decides on the host, without reading the device, whether a call
fits and whether need_sort merges first; `available_size` reads it. The flags say whether
something outside (a snapshot, the `state` handed to jitted code) still holds a ring: a
write to a held ring copies it first, so a snapshot costs O(1).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.backends import Backend
from jax_kvalloc.state import AllocatorState


class AllocatorSnapshot(NamedTuple):
  """What `backup_state` returns: the state, the config it belongs to and the lengths
  (free_len, release_len) as host ints, so that restoring it needs no device read."""
  config: AllocatorConfig
  state: AllocatorState
  lengths: Optional[Tuple[int, int]] = None


class Pool:
  """One pool (one data-parallel rank): state, mirror and flags over `backend`."""

  def __init__(self, config: AllocatorConfig, backend: Backend):
    self.config = config
    self.backend = backend
    self.clear()

  def clear(self) -> None:
    """Back to the initial state (SPEC 2)."""
    self.state = self.backend.init()
    self.free_shared = self.release_shared = False
    self.free_len, self.release_len = self.config.num_pages, 0

  def available_size(self) -> int:
    return (self.free_len + self.release_len) * self.config.page_size

  # -- snapshots and states from outside -------------------------------------------------
  def hold(self) -> AllocatorState:
    """The state, now held outside: the next write to a ring copies it."""
    self.free_shared = self.release_shared = True
    return self.state

  def snapshot(self) -> AllocatorSnapshot:
    return AllocatorSnapshot(self.config, self.hold(), (self.free_len, self.release_len))

  def restore(self, snap: AllocatorSnapshot) -> None:
    """Puts back a snapshot the caller checked (validate.snapshot). O(1); a snapshot
    without lengths (built by hand) has them read from its state (a wait)."""
    self.state = self.backend.adopt(snap.state)
    self.free_shared = self.release_shared = True
    if snap.lengths is None:
      self.free_len = int(self.state.free_len)
      self.release_len = int(self.state.release_len)
    else:
      self.free_len, self.release_len = snap.lengths

  def check_state(self, state: AllocatorState) -> Tuple[int, int]:
    """`set_state`'s checks (shapes, dtypes, then the lengths and heads: a wait).
    Returns the lengths; TypeError / ValueError naming the field, nothing changed."""
    validate.state_like(state, self.state, AllocatorState)
    return validate.state_lengths(state, self.config.num_pages)

  def take(self, state: AllocatorState, lengths: Tuple[int, int]) -> None:
    """Takes a state `check_state` passed (held outside: writes copy first)."""
    self.state = self.backend.adopt(state)
    self.free_shared = self.release_shared = True
    self.free_len, self.release_len = lengths

  # -- operations ------------------------------------------------------------------------
  def merge_if(self, shortfall: bool) -> None:
    """The need_sort merge that a shortfall triggers (SPEC 4.2), decided on the host."""
    if shortfall and self.config.need_sort and self.release_len > 0:
      self.merge()

  def merge(self) -> None:
    """free_pages = sort(free_pages ++ release_pages) (SPEC 6)."""
    self.state = self.backend.merge_and_sort_free(self.state, self.free_shared)
    self.free_shared = False
    self.free_len, self.release_len = self.free_len + self.release_len, 0

  def allocate(self, trigger: bool, pages: int,
               run: Callable[[AllocatorState, bool], Tuple[AllocatorState, Any]]) -> Any:
    """What every allocation ends with: the need_sort merge when its SPEC trigger fired,
    then run(state, fits) -> (state, slots or None), fits = `pages` fit the free list;
    the pages taken leave the mirror."""
    self.merge_if(trigger)
    self.state, out = run(self.state, pages <= self.free_len)
    if out is not None:
      self.free_len -= pages
    return out

  def write(self, free: Callable[[AllocatorState, int, bool], AllocatorState],
            count: int) -> None:
    """A free through free(state, count, shared): `count` entries reach the list, cut to
    the room left; the ring it writes is copied first when held."""
    count = min(count, self.config.num_pages - self.free_len - self.release_len)
    if self.config.need_sort:
      self.state = free(self.state, count, self.release_shared)
      self.release_shared = self.release_shared and count == 0
      self.release_len += count
    else:
      self.state = free(self.state, count, self.free_shared)
      self.free_shared = self.free_shared and count == 0
      self.free_len += count
