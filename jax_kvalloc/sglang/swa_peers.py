"""The host record, beside an SWA pool pair's mirror (device backend, page size > 1),
of which full pages still have their sliding-window KV: what lets `free` and `free_swa`
of host slots count the SWA pages they release without reading the device.

A free_swa at page size > 1 frees the sorted unique SWA pages that the mapping gives
the slots of its full pages (SPEC 13), a count only the mapping knows. In the mapping
the allocations write, the pairing is regular: each held full page maps into one SWA
page that no other full page maps into, or nowhere once its SWA KV was freed (every
SWA free clears whole full pages). Then the count is the number of named full pages
whose SWA mapping is still live, and one bool per full page says which.

`live[p]`: full page p is free, or held with its SWA KV not freed since. A free page
counts as live because the allocation that takes it always pairs it with a fresh SWA
page (alloc_extend, alloc_decode; alloc_extend_swa_tail's tail): the record needs no
page id at allocation time, which only the device knows. An SWA free (free_swa,
free_swa_segment, a free group's SWA half) sets its pages False; a full free (free,
free_full, the segments) sets them True again. A free_swa naming a free page is refused
by the full pool's ownership record, so a free page's True is never counted. The
device program checks every count it is given against what its lists took
(NOT_LISTED): a count that a free breaking SPEC 13's preconditions made wrong (free_full
of a page whose SWA KV is still held, unchecked outside debug mode; or any misuse with
guard=False) refuses the call, as any refusal, and is never taken.

What the host cannot know at call time waits in `queue`, in call order: the pages of
a device free_index (a segment free) and the head pages of alloc_extend_swa_tail
(page-aligned, without SWA KV: False), read once their arrays have landed. A count
first applies the queue (a wait only when an array in it has not landed: a host free
right after a device-array segment free or an SWA tail whose output is still
computing). Anything else leaves the pairing irregular (`irregular`): an SWA tail not
aligned to the pages, a mapping set or cleared by hand, an array of the queue deleted
before it was read. Then the counts come from the device (a wait, as SGLang's own
free_swa synchronizes), and the record is rebuilt from the state after such a read
(`rebuild`), which ends the irregular spell once its pages are gone. `rebuild` also
follows set_state, a restore of a snapshot built by hand, and a refusal's roll-back.

Snapshots keep the record (copy-on-write: the array is copied at the next write).
"""
from __future__ import annotations

import collections
from typing import Any, NamedTuple, Optional, Tuple

import jax
import numpy as np

from jax_kvalloc import state as st


QUEUE_READ = 32  # queued arrays beyond this many are read as they land (bounded)


def read(x: jax.Array) -> np.ndarray:
  """A device array of the queue on the host (a wait unless it has landed)."""
  return np.asarray(x)


class PeerSnapshot(NamedTuple):
  """The record as a snapshot keeps it (never written after it is taken)."""
  live: np.ndarray   # bool[num_pages + 1]
  queue: Tuple[Any, ...]
  irregular: bool


class PeerRecord:
  """Which full pages still have their SWA KV (see the module docstring)."""

  __slots__ = ("num_pages", "page_size", "live", "shared", "queue", "irregular")

  def __init__(self, num_pages: int, page_size: int):
    self.num_pages, self.page_size = num_pages, page_size
    self.reset()

  def reset(self) -> None:
    """Every page free (SPEC 2: the mapping all 0)."""
    self.live = np.ones((self.num_pages + 1,), bool)
    self.shared = False
    self.queue: collections.deque = collections.deque()
    self.irregular = False

  # -- snapshots -------------------------------------------------------------------------
  def snapshot(self) -> PeerSnapshot:
    self.shared = True
    return PeerSnapshot(self.live, tuple(self.queue), self.irregular)

  def restore(self, snap: PeerSnapshot) -> None:
    self.live, self.shared = snap.live, True
    self.queue = collections.deque(snap.queue)
    self.irregular = snap.irregular

  # -- updates ---------------------------------------------------------------------------
  def mark(self, pages: Any, value: bool, step: int = 1, n: Optional[int] = None) -> None:
    """Full pages `pages` (host ints; or a device array, read once landed: the pages
    are arr[:n][::step] // step) to `value` (True: freed in the full pool; False: their
    SWA KV freed)."""
    if self.irregular:
      return
    if not self.queue and isinstance(pages, np.ndarray):
      self._set(pages, value)
      return
    self.queue.append((pages, value, step, n))
    if len(self.queue) > QUEUE_READ:
      self.resolve(block=False)

  def irregular_now(self) -> None:
    """The pairing is no longer regular: counts come from the device until `rebuild`."""
    self.irregular = True
    self.queue.clear()

  def resolve(self, block: bool) -> None:
    """Applies the queue in order: every entry (`block`: waits for arrays that have
    not landed), or the entries up to the first one that has not landed."""
    queue = self.queue
    while queue:
      pages, value, step, n = queue[0]
      if not isinstance(pages, np.ndarray):
        try:
          if not block and not pages.is_ready():
            return
          pages = read(pages)[:n][::step] // step
        except RuntimeError:  # deleted (donated) before it was read
          self.irregular_now()
          return
      queue.popleft()
      self._set(pages, value)

  def release(self, pages: np.ndarray, value: bool) -> Optional[int]:
    """A free of the full pages `pages` (host ints, sorted unique) that frees their SWA
    KV: how many SWA pages it releases (None: only the device knows, irregular), then
    the pages set to `value` (False: free_swa; True: free, which frees them too)."""
    self.resolve(block=True)
    if self.irregular:
      return None
    count = int(np.count_nonzero(self.live[pages]))
    self._set(pages, value)
    return count

  def _set(self, pages: np.ndarray, value: bool) -> None:
    if self.shared:
      self.live, self.shared = self.live.copy(), False
    self.live[pages] = value

  # -- from a state ------------------------------------------------------------------------
  def rebuild(self, state: Any) -> None:
    """The record of `state` (an SWAState; reads it: a wait): live where the full
    page is free or has an SWA peer; irregular when a full page maps into two SWA
    pages, two full pages into one, or a free full page into any."""
    ps, n = self.page_size, self.num_pages
    full = jax.tree.map(np.asarray, state.full)
    held = np.ones((n + 1,), bool)
    held[0] = False
    held[st.live_free_pages(full)] = False
    held[st.live_release_pages(full)] = False
    rows = np.asarray(state.mapping)[ps:(n + 1) * ps].reshape(n, ps)
    peer = rows > 0
    has = peer.any(axis=1)
    lo = np.where(peer, rows // ps, np.iinfo(np.int32).max).min(axis=1)
    hi = np.where(peer, rows // ps, -1).max(axis=1)
    used = lo[has]
    self.irregular = bool((has & (lo != hi)).any() or (has & ~held[1:]).any()
                          or np.unique(used).shape[0] != used.shape[0])
    self.live = np.ones((n + 1,), bool)
    self.live[1:] = ~held[1:] | has
    self.shared = False
    self.queue = collections.deque()
