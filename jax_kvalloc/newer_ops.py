"""SGLang 0.5.23's newer class operations (SPEC 10), mixed into both classes.

`free_page_ids`, `free_segment(s)`, the `free_full*` aliases, `get_all_free_pages`,
`debug_print`, `get_cpu_copy`/`load_cpu_copy`, and `set_state` (the way back for a state
handed to jitted code through the `state` property). They live apart from
jax_kvalloc.base so that the class mechanics there (backends, host mirror, donation) can
change without touching them: everything here goes through the base class's `free`,
free-group queue (`_free_group`), state and `_call`, plus one hook,
`_free_page_ids_now`, which uses the base's fast write path when it has one.

Free groups (SPEC 10): page-id frees go to a second queue; `free_group_end` first frees
the slot-index queue as one `free`, then prepends the concatenated page-id queue, so the
page-id frees end up in front. The token allocator's page ids are slots: its
`free_page_ids` is `free`, queued with the slots.

Bad input raises (jax_kvalloc.validate: TypeError / ValueError naming the argument and
value) before anything changes.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_kvalloc import buckets
from jax_kvalloc import debug as _debug
from jax_kvalloc import freeing as _free
from jax_kvalloc import validate
from jax_kvalloc.state import AllocatorState

# (copying, donating) jitted free_page_ids, for `_call`.
_FREE_PAGE_IDS = (jax.jit(_free.free_page_ids, static_argnames=("config",)),
                  jax.jit(_free.free_page_ids, static_argnames=("config",),
                          donate_argnames=("state",)))


class NewerOperations:
  """Mixin over jax_kvalloc.base.BaseAllocator (listed before it in the class bases)."""

  # -- free groups: the second queue -------------------------------------------------
  def clear(self) -> None:
    super().clear()
    self._page_id_group: List[np.ndarray] = []

  def free_group_begin(self) -> None:
    super().free_group_begin()
    self._page_id_group = []

  def free_group_end(self) -> None:
    """Closes the free group: the queued slot frees as one `free`, then the queued
    page-id frees as one block in front (SPEC 7 and 10)."""
    page_ids, self._page_id_group = self._page_id_group, []
    super().free_group_end()  # raises (nothing queued is lost) when no group is open
    if page_ids:
      self._free_page_ids_now(np.concatenate(page_ids))

  # -- free_page_ids -------------------------------------------------------------------
  def free_page_ids(self, page_ids) -> None:
    """Frees exactly these pages, in the given order, without sorting (SPEC 10).

    Paged: the pages are prepended as one block to release_pages (need_sort) or
    free_pages, O(pages); inside a free group they are queued apart and freed after the
    group's slot frees. Token allocator: page ids are slots, so this is `free(page_ids)`.

    page_ids: integer pages, each in 1..num_pages and none twice (ValueError naming the
    entry otherwise; TypeError for floats and bools). A page that is already free is
    found only in debug mode (AllocatorDebugError), as for `free`.
    """
    ids = validate.host_ints(page_ids, "page_ids")
    if ids.size == 0:
      return
    validate.page_ids(ids, num_pages=self.config.num_pages)
    if self.config.kind == "token":
      self.free(ids)
    else:
      self._queue_or_free_page_ids(ids)

  def _queue_or_free_page_ids(self, ids: np.ndarray) -> None:
    if self._free_group is not None:
      self._page_id_group.append(ids)  # a host copy: later changes to the caller's
      return                           # buffer do not reach the queue
    self._free_page_ids_now(ids)

  def _free_page_ids_now(self, ids: np.ndarray) -> None:
    """Prepends validated, distinct page ids (int64 host array) as one block."""
    ids = ids.astype(np.int32)
    if not self._legacy:
      self._write("free_page_ids", ids, ids.shape[0])  # the base's fast path (no wait)
      return
    n = buckets.bucket(ids.shape[0], buckets.MIN_FREE)
    self._call(_FREE_PAGE_IDS, buckets.pad(ids, n), np.int32(ids.shape[0]))

  # -- free_segment(s) -----------------------------------------------------------------
  def _segment(self, free_index, start_pos) -> Tuple[int, int, Optional[np.ndarray]]:
    """Checks one segment. Returns (start_pos, its token count, its slots (token) or its
    pages (paged), or None when empty)."""
    start = validate.start_pos(start_pos, self.page_size)
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return start, 0, None
    validate.free_index(idx, page_size=self.page_size, num_slots=self.config.num_slots)
    if self.config.kind == "token":
      return start, idx.size, idx
    return start, idx.size, validate.segment(idx, page_size=self.page_size)

  def free_segment(self, free_index, *, start_pos: int) -> None:
    """Frees one request's slots of tokens start_pos, start_pos + 1, ... (SPEC 10).

    free_index[k] is the slot of token start_pos + k. Paged:
    `free_page_ids(free_index[::page_size] // page_size)`, the request's pages in its
    own order, no sort. Token: `free(free_index)`.

    Raises (nothing freed): ValueError when start_pos is negative or not a multiple of
    page_size, a slot is not allocatable, or free_index is not one request's
    consecutive slots (a token outside the page of its page's first token, a page
    twice); TypeError for non-integers.
    """
    _, _, got = self._segment(free_index, start_pos)
    if got is None:
      return
    if self.config.kind == "token":
      self.free(got)
    else:
      self._queue_or_free_page_ids(got)

  def free_segments(self, segments: Sequence[Tuple[Any, int]]) -> None:
    """Frees several (free_index, start_pos) segments of one request, each in turn as
    `free_segment` does (SPEC 10).

    Every segment is checked first: a bad one, or two consecutive non-empty segments
    that share a page, raises ValueError (naming `segments[i]`) and frees nothing.
    """
    checked, spans = [], []
    for i, seg in enumerate(segments):
      try:
        free_index, start = seg
      except (TypeError, ValueError) as e:
        raise TypeError(f"segments[{i}] must be a (free_index, start_pos) pair, got "
                        f"{type(seg).__name__}") from e
      try:
        start, n, got = self._segment(free_index, start)
      except (TypeError, ValueError) as e:
        raise type(e)(f"segments[{i}]: {e}") from e
      spans.append((n, start))
      if got is not None:
        checked.append(got)
    validate.segments_disjoint(spans, self.page_size)
    if not checked:
      return
    if self.config.kind == "paged" and len(checked) > 1:  # one request: no page twice
      validate.repeated_at(np.concatenate(checked), "segments' pages (free_index[::"
                           "page_size] // page_size, concatenated)", "names a page twice")
    if self.config.kind == "token":
      self.free(np.concatenate(checked))  # FIFO appends: one call is the same
    elif self._free_group is not None:
      self._page_id_group.extend(checked)
    else:
      # Each segment is prepended in turn, so the last one ends up in front: one block
      # of the segments in reverse order is the same list, in one call.
      self._free_page_ids_now(np.concatenate(checked[::-1]))

  # -- aliases: a single pool has no sliding-window peer -------------------------------
  def free_full(self, free_index) -> None:
    """SGLang's free_full: without a sliding-window peer, `free`."""
    self.free(free_index)

  def free_full_segment(self, free_index, *, start_pos: int) -> None:
    """SGLang's free_full_segment: without a sliding-window peer, `free_segment`."""
    self.free_segment(free_index, start_pos=start_pos)

  def free_full_segments(self, segments) -> None:
    """SGLang's free_full_segments: without a sliding-window peer, `free_segments`."""
    self.free_segments(segments)

  # -- census and debugging ------------------------------------------------------------
  def get_all_free_pages(self) -> np.ndarray:
    """free_pages ++ release_pages (SPEC 10), a host int32 array (reads the device)."""
    return np.concatenate([self.free_pages, self.release_pages])

  def debug_print(self) -> str:
    """One line: free, released and in-use pages, and any open free group. Returns the
    string (as SGLang's does); the lengths come from the class's host mirror when it
    keeps one (no wait), else from the state."""
    if hasattr(self, "_free_len"):
      free, released = self._free_len, self._release_len
    else:
      free, released = int(self._state.free_len), int(self._state.release_len)
    in_use = self.config.num_pages - free - released
    group = ""
    if self._free_group is not None:
      group = (f", free group open ({sum(a.size for a in self._free_group)} slots and "
               f"{sum(a.size for a in self._page_id_group)} page ids queued)")
    return (f"{type(self).__name__}: page_size={self.page_size} free={free} "
            f"released={released} in_use={in_use} of {self.config.num_pages} pages "
            f"(available_size={(free + released) * self.page_size}){group}")

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

  # -- the way back from jitted code ---------------------------------------------------
  def set_state(self, state: AllocatorState) -> None:
    """Takes back a state that jitted code returned (it got the pool from `state`).

        state, slots, ok = my_step(allocator.state, ...)   # the class does not donate
        allocator.set_state(state)                         # what `state` handed out

    state: an AllocatorState of this pool's shapes and dtypes, not a tracer (TypeError /
    ValueError naming the field otherwise; nothing changed). In debug mode a misuse the
    caller's code recorded raises AllocatorDebugError, and the state is not taken.
    Reads the state's lengths (a wait). The caller may still hold these arrays, so the
    next write copies rather than donates them.
    """
    validate.state_like(state, self._state, AllocatorState)
    if state.debug is not None:
      err = _debug.get_error(state)
      if err is not None:
        raise err
    if self.backend == "host" and not self._legacy:
      from jax_kvalloc import host_ops  # pylint: disable=g-import-not-at-top
      state = host_ops.from_jax(state)
    elif not isinstance(state.free_ring, jax.Array):
      state = jax.tree_util.tree_map(jax.numpy.asarray, state)
    self._state = state
    self._free_shared = self._release_shared = True
    self._sync_mirror()  # the base's host mirror of the lengths
