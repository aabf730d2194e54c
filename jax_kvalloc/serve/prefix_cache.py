"""A prefix cache of whole KV pages, keyed by their token ids (a radix tree of pages).

A node is one page of KV: the tokens of that page, under its parent node (the page
before it). The page ids themselves live on the device, in the engine's `cache_pages`
array (a node's `slot` indexes it): the host never learns a page id, it only decides
which slots to fill, lend and free.

Ownership (SPEC 11's `owned_from`): a node's page belongs to the cache. A row adopts its
leading whole pages into the cache (they move into cache_pages and the row's owned_from
moves past them, so the row's release never frees them); a new row borrows a chain of
nodes with `borrow_pages`. Eviction frees a page with `free_page_ids`, only for nodes that
no running row holds (refs == 0) and that have no children, least recently used first.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass
class Node:
  key: Tuple[int, Tuple[int, ...]]  # (parent node id, the page's token ids)
  id: int
  slot: int                         # index into the device's cache_pages
  parent: Optional["Node"]
  refs: int = 0                     # running rows whose prefix includes this page
  children: int = 0
  last_use: int = 0


class PrefixCache:
  """Host bookkeeping of the cached pages (at most `capacity` of them)."""

  def __init__(self, page_size: int, capacity: int):
    self.page_size = page_size
    self.free_slots = list(range(capacity))
    self.nodes: Dict[Tuple[int, Tuple[int, ...]], Node] = {}
    self._ids = itertools.count(1)
    self._clock = itertools.count(1)
    self.hits = 0      # pages lent to new rows
    self.inserted = 0  # pages adopted
    self.evicted = 0

  def __len__(self) -> int:
    return len(self.nodes)

  def _page(self, tokens: Sequence[int], k: int) -> Tuple[int, ...]:
    return tuple(int(t) for t in tokens[k * self.page_size:(k + 1) * self.page_size])

  def match(self, tokens: Sequence[int], max_pages: int) -> List[Node]:
    """The longest chain of cached pages that starts `tokens` (at most max_pages)."""
    chain: List[Node] = []
    for k in range(max_pages):
      node = self.nodes.get((chain[-1].id if chain else 0, self._page(tokens, k)))
      if node is None:
        break
      chain.append(node)
    return chain

  def acquire(self, chain: Sequence[Node]) -> None:
    """A row now holds these nodes (they cannot be evicted until it lets go)."""
    now = next(self._clock)
    for node in chain:
      node.refs += 1
      node.last_use = now

  def let_go(self, chain: Sequence[Node]) -> None:
    now = next(self._clock)
    for node in chain:
      assert node.refs > 0, node
      node.refs -= 1
      node.last_use = now

  def insert(self, parent: Optional[Node], tokens: Sequence[int], k: int) -> Optional[Node]:
    """A new node for page k of tokens under parent, held by the inserting row (refs 1);
    None when that page is cached already (another row computed it) or no slot is left."""
    key = (parent.id if parent else 0, self._page(tokens, k))
    if key in self.nodes or not self.free_slots:
      return None
    node = Node(key=key, id=next(self._ids), slot=self.free_slots.pop(), parent=parent,
                refs=1, last_use=next(self._clock))
    if parent is not None:
      parent.children += 1
    self.nodes[key] = node
    self.inserted += 1
    return node

  def evictable(self) -> int:
    """Pages that eviction could free now (refs 0: their descendants are refs 0 too)."""
    return sum(1 for n in self.nodes.values() if n.refs == 0)

  def evict(self, count: int) -> List[int]:
    """Frees up to count pages, leaves first, least recently used first; returns their
    slots (the device frees cache_pages[slot])."""
    out: List[int] = []
    while len(out) < count:
      leaves = [n for n in self.nodes.values() if n.refs == 0 and n.children == 0]
      if not leaves:
        break
      for node in sorted(leaves, key=lambda n: n.last_use)[:count - len(out)]:
        del self.nodes[node.key]
        if node.parent is not None:
          node.parent.children -= 1
        self.free_slots.append(node.slot)
        out.append(node.slot)
    self.evicted += len(out)
    return out
