"""SPEC 13 (the sliding-window allocator) as a small pure-Python model, for the tests.

Two `model.ModelAllocator` pools and a dict for the mapping, written from the SPEC's
words; it shares no code with jax_kvalloc. Failure returns None.
"""
from __future__ import annotations

import copy

from kernel_cases import cdiv
from model import ModelAllocator


class ModelSWA:
  """SPEC 13: a full pool, an SWA pool and mapping[full slot] = SWA slot."""

  def __init__(self, size, size_swa, page_size=1, need_sort=False):
    self.size_full, self.size_swa, self.page_size = size, size_swa, page_size
    self.need_sort = need_sort
    self.full = ModelAllocator(size, page_size, need_sort)
    self.swa = ModelAllocator(size_swa, page_size, need_sort)
    self.clear()

  def clear(self):
    self.full.clear()
    self.swa.clear()
    self.mapping = {}  # full slot -> SWA slot; absent means 0
    self.group = None  # (SWA page-id queue, SWA slot queue) while a free group is open

  # -- sizes ---------------------------------------------------------------------------
  def full_available_size(self):
    return self.full.available_size()

  def swa_available_size(self):
    return self.swa.available_size()

  def available_size(self):
    return min(self.full_available_size(), self.swa_available_size())

  def translate(self, locs):
    return [-1 if f == -1 else self.mapping.get(f, 0) for f in locs]

  def _pair(self, full, swa):
    for f, s in zip(full, swa):
      self.mapping[f] = s

  def _unpair(self, full):
    for f in full:
      self.mapping.pop(f, None)

  def _pages_fit(self, num_full_pages, num_swa_pages):
    ps = self.page_size
    return (num_full_pages <= self.full.available_size() // ps
            and num_swa_pages <= self.swa.available_size() // ps)

  # -- allocation ------------------------------------------------------------------------
  def alloc(self, n):
    assert self.page_size == 1
    if n > self.full.available_size() or n > self.swa.available_size():
      return None
    full, swa = self.full.alloc(n), self.swa.alloc(n)
    self._pair(full, swa)
    return full

  def alloc_extend(self, prefix_lens, seq_lens, last_loc):
    ps = self.page_size
    p = sum(cdiv(s, ps) - cdiv(q, ps) for q, s in zip(prefix_lens, seq_lens))
    if not self._pages_fit(p, p):
      return None
    swa_last = self.translate(last_loc)
    full = self.full.alloc_extend(prefix_lens, seq_lens, last_loc)
    swa = self.swa.alloc_extend(prefix_lens, seq_lens, swa_last)
    assert full is not None and swa is not None
    self._pair(full, swa)
    return full

  def alloc_extend_swa_tail(self, prefix_len, seq_len, last_loc, tail):
    ps = self.page_size
    ext = seq_len - prefix_len
    assert 0 <= tail <= ext
    if not self._pages_fit(cdiv(seq_len, ps) - cdiv(prefix_len, ps), cdiv(tail, ps)):
      return None
    full = self.full.alloc_extend([prefix_len], [seq_len], [last_loc])
    if tail == 0:  # SPEC 13: the head (all of it) gets 0; SGLang writes nothing there,
      self._unpair(full)  # where valid use has 0 already
      return full
    swa = self.swa.alloc_extend([0], [tail], [-1])
    self._pair(full[ext - tail:], swa)
    self._unpair(full[:ext - tail])
    return full

  def alloc_decode(self, seq_lens, last_loc):
    """Ours (SPEC 13): each pool's own merge trigger, then both or neither."""
    ps, bs = self.page_size, len(seq_lens)
    for pool in (self.full, self.swa):
      if self.need_sort and bs > len(pool.free_pages):
        pool.merge_and_sort_free()
    need = sum(cdiv(s, ps) > cdiv(s - 1, ps) for s in seq_lens)
    if need > len(self.full.free_pages) or need > len(self.swa.free_pages):
      return None
    swa_last = self.translate(last_loc)
    full = self.full.alloc_decode(seq_lens, last_loc)
    swa = self.swa.alloc_decode(seq_lens, swa_last)
    self._pair(full, swa)
    return full

  # -- freeing -----------------------------------------------------------------------------
  def _widen(self, idx):
    ps = self.page_size
    return [p * ps + o for p in (i // ps for i in idx) for o in range(ps)]

  def free_swa_segment(self, idx, start_pos):
    ps = self.page_size
    assert start_pos % ps == 0
    idx = [int(i) for i in idx]
    if not idx:
      return
    reps = idx[::ps]
    peers = [self.mapping.get(f, 0) for f in reps]
    pages = [s // ps for s in peers if s > 0]
    self._unpair(reps if ps == 1 else self._widen(reps))
    if self.group is not None:
      self.group[0].extend(pages)
    elif pages:
      self.swa.free_page_ids(pages)

  def free_swa(self, idx):
    idx = [int(i) for i in idx]
    if not idx:
      return
    if self.page_size == 1:
      self.free_swa_segment(idx, 0)
      return
    wide = self._widen(idx)
    peers = [self.mapping.get(f, 0) for f in wide]
    self._unpair(wide)
    peers = [s for s in peers if s > 0]
    if self.group is not None:
      self.group[1].extend(peers)
    elif peers:
      self.swa.free(peers)

  def free_full(self, idx):
    self.full.free([int(i) for i in idx])

  def free(self, idx):
    if len(idx) == 0:
      return
    self.free_swa(idx)
    self.free_full(idx)

  def free_full_segment(self, idx, start_pos):
    if len(idx):
      self.full.free_segment([int(i) for i in idx], start_pos)

  def free_segment(self, idx, start_pos):
    if len(idx) == 0:
      return
    self.free_swa_segment(idx, start_pos)
    self.full.free_segment([int(i) for i in idx], start_pos)

  def free_group_begin(self):
    assert self.group is None
    self.group = ([], [])
    self.full.free_group_begin()

  def free_group_end(self):
    (pages, slots), self.group = self.group, None
    if pages:
      self.swa.free_page_ids(pages)
    if slots:
      self.swa.free(slots)
    self.full.free_group_end()

  def merge_and_sort_free(self):
    self.full.merge_and_sort_free()
    self.swa.merge_and_sort_free()

  # -- snapshots -----------------------------------------------------------------------------
  def backup_state(self):
    return (self.full.backup_state(), self.swa.backup_state(), dict(self.mapping))

  def restore_state(self, snap):
    self.full.restore_state(snap[0])
    self.swa.restore_state(snap[1])
    self.mapping = dict(snap[2])

  def copy(self):
    return copy.deepcopy(self)
