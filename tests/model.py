"""A small, independent pure-Python model of SPEC.md, for checking every implementation.

Plain lists and loops, written straight from the SPEC's words (per-request Part 1/2/3
loops, not the prefix-sum formula the library uses), so that it shares no code and no
algorithm with jax_kvalloc. Failure returns None and leaves the state as SPEC says
(a merge triggered by the shortfall stays done).
"""
from __future__ import annotations

import copy

from kernel_cases import cdiv as _cdiv


class ModelAllocator:
  """SPEC 2-8 for one pool. kind is "token" (FIFO free) or "paged" (LIFO unique pages)."""

  def __init__(self, size, page_size=1, need_sort=False, kind=None):
    self.size = size
    self.page_size = page_size
    self.need_sort = need_sort
    self.kind = kind or ("token" if page_size == 1 else "paged")
    self.num_pages = size // page_size
    self.clear()

  def clear(self):
    self.free_pages = list(range(1, self.num_pages + 1))
    self.release_pages = []
    self.group = None
    self.page_group = []  # SPEC 10: free_page_ids queued in a free group

  def available_size(self):
    return (len(self.free_pages) + len(self.release_pages)) * self.page_size

  def merge_and_sort_free(self):
    if self.release_pages:
      self.free_pages = sorted(self.free_pages + self.release_pages)
      self.release_pages = []

  def backup_state(self):
    return (list(self.free_pages), list(self.release_pages))

  def restore_state(self, snap):
    self.free_pages, self.release_pages = list(snap[0]), list(snap[1])

  def _take(self, k):
    pages, self.free_pages = self.free_pages[:k], self.free_pages[k:]
    return pages

  def alloc(self, n):
    ps = self.page_size
    assert n % ps == 0
    k = n // ps
    if self.need_sort and k > len(self.free_pages):
      self.merge_and_sort_free()
    if k > len(self.free_pages):
      return None
    return [p * ps + o for p in self._take(k) for o in range(ps)]

  def alloc_extend(self, prefix_lens, seq_lens, last_loc):
    ps = self.page_size
    bs = len(prefix_lens)
    ext_total = sum(s - p for p, s in zip(prefix_lens, seq_lens))
    if self.need_sort and ext_total // ps + bs + 1 > len(self.free_pages):
      self.merge_and_sort_free()
    need = sum(_cdiv(s, ps) - _cdiv(p, ps) for p, s in zip(prefix_lens, seq_lens))
    if need > len(self.free_pages):
      return None
    pages = self._take(need)
    out = []
    for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
      mine = [pages.pop(0) for _ in range(_cdiv(seq, ps) - _cdiv(pre, ps))]
      # Part 1: the rest of the page the prefix ends in.
      n1 = min(seq, _cdiv(pre, ps) * ps) - pre
      out += [last + 1 + i for i in range(n1)]
      # Part 2: whole new pages.
      n2 = seq // ps - _cdiv(pre, ps)
      for i in range(max(n2, 0)):
        out += [mine[i] * ps + o for o in range(ps)]
      # Part 3: the first seq % ps slots of a last, partial new page.
      if seq % ps and _cdiv(seq, ps) > _cdiv(pre, ps):
        out += [mine[-1] * ps + o for o in range(seq % ps)]
    assert len(out) == ext_total
    return out

  def alloc_decode(self, seq_lens, last_loc):
    ps = self.page_size
    bs = len(seq_lens)
    if self.need_sort and bs > len(self.free_pages):
      self.merge_and_sort_free()
    needs = [_cdiv(s, ps) > _cdiv(s - 1, ps) for s in seq_lens]
    if sum(needs) > len(self.free_pages):
      return None
    pages = self._take(sum(needs))
    return [pages.pop(0) * ps if n else last + 1 for n, last in zip(needs, last_loc)]

  def free(self, idx):
    idx = [int(i) for i in idx]
    if not idx:
      return
    if self.group is not None:
      self.group.append(list(idx))
      return
    target = "release_pages" if self.need_sort else "free_pages"
    if self.kind == "paged":
      pages = sorted(set(i // self.page_size for i in idx))
      setattr(self, target, pages + getattr(self, target))
    else:
      setattr(self, target, getattr(self, target) + idx)

  def free_group_begin(self):
    assert self.group is None
    self.group = []
    self.page_group = []

  def free_group_end(self):
    group, self.group = self.group, None
    page_group, self.page_group = self.page_group, []
    if group:
      self.free([i for g in group for i in g])
    if page_group:  # SPEC 10: after the slot frees, so these end up in front
      self._prepend([p for g in page_group for p in g])

  # SPEC 10 (sglang 0.5.23's newer operations).
  def _prepend(self, pages):
    target = "release_pages" if self.need_sort else "free_pages"
    setattr(self, target, list(pages) + getattr(self, target))

  def free_page_ids(self, page_ids):
    page_ids = [int(p) for p in page_ids]
    if not page_ids:
      return
    if self.kind == "token":  # page ids are slots
      self.free(page_ids)
    elif self.group is not None:
      self.page_group.append(page_ids)
    else:
      self._prepend(page_ids)

  def free_segment(self, free_index, start_pos):
    ps = self.page_size
    assert start_pos % ps == 0, "start_pos must be page-aligned"
    free_index = [int(i) for i in free_index]
    if self.kind == "token":
      self.free(free_index)
    else:  # the slot of every token that starts a page, as a page id
      self.free_page_ids([free_index[k] // ps for k in range(0, len(free_index), ps)])

  def free_segments(self, segments):
    ps, prev_end = self.page_size, None
    for free_index, start in segments:  # check all first: an error frees nothing
      if len(free_index):
        assert prev_end is None or start // ps > (prev_end - 1) // ps, "segments share a page"
        prev_end = start + len(free_index)
    for free_index, start in segments:
      self.free_segment(free_index, start)

  def get_all_free_pages(self):
    return self.free_pages + self.release_pages

  def copy(self):
    return copy.deepcopy(self)
