"""A ranked random trace over every operation of jax_kvalloc.ranks (pool and request
table), driven from this process's ranks only, for one process or several.

Each rank's inputs come from its own generator (seeded by (seed, rank)) and its own host
mirror (its raw requests' slots and its table rows), which only its own outputs update;
the operation of each step comes from a generator shared by every process (every
operation of the trace's list once or more in each len(list) steps). So a process
that holds ranks 4-7 issues, for them, exactly the inputs a single process holding all
eight issues, and no process needs another's results. Inputs go in through
multiprocess.put_ranks, outputs come back through multiprocess.get_ranks.

Every rank also runs the independent model (tests/model.py) beside the device: each
step's slots, ok and free lists must be the model's, and the mirror's pages held plus
the pool's free pages must make up the pool (nothing lost or handed out twice).

Used by tests/test_multiprocess.py (the reference run, in the pytest process) and
tests/multiprocess_worker.py (each of the spawned processes).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv
from jax_kvalloc import multiprocess
from jax_kvalloc import ranks
from kernel_cases import cdiv
from model import ModelAllocator

OPS = ("alloc", "extend", "extend", "decode", "decode", "free", "free_page_ids",
       "free_segment", "release_decode", "merge", "t_extend", "t_extend", "t_decode",
       "t_decode", "t_release", "t_borrow", "t_admit", "t_attn", "avail", "clear")
# A serving step's operations (fewer programs to compile, for the default test set).
SERVING_OPS = ("release_decode", "t_extend", "t_extend", "t_decode", "t_decode",
               "t_release", "t_borrow", "t_attn")


@dataclasses.dataclass(frozen=True)
class Shape:
  """Static sizes of the trace (small: every program compiles fast)."""
  dp: int = 8
  pages_per_rank: int = 24
  page_size: int = 4
  need_sort: bool = True
  rows: int = 4           # batch rows per rank and call
  max_tokens: int = 32    # extend / extend_rows tokens per rank
  max_alloc: int = 16     # alloc slots per rank
  max_free: int = 32      # free / free_segment slots, free_page_ids ids per rank
  max_reqs: int = 6       # table rows per rank
  max_pages_per_req: int = 6

  def config(self) -> kv.AllocatorConfig:
    return kv.AllocatorConfig(size=self.dp * self.pages_per_rank * self.page_size,
                              page_size=self.page_size, need_sort=self.need_sort,
                              kernel="jnp")


class RankMirror:
  """One rank's host view: its raw requests, its table rows, its model."""

  def __init__(self, shape: Shape, seed: int, rank: int):
    self.s = shape
    self.rng = np.random.default_rng([seed, rank])
    self.model = ModelAllocator(shape.pages_per_rank * shape.page_size, shape.page_size,
                                shape.need_sort, "paged")
    self.reqs: List[List[int]] = []              # raw requests: slots in token order
    self.rows: Dict[int, List[int]] = {}         # table row -> pages in column order
    self.lens: Dict[int, int] = {}               # table row -> tokens
    self.owned_from: Dict[int, int] = {}
    self.borrowers: Dict[int, List[int]] = {}    # source row -> rows borrowing from it

  def pages_of(self, slots: List[int]) -> List[int]:
    return [s // self.s.page_size for s in slots[::self.s.page_size]]

  def held_pages(self) -> int:
    raw = sum(len(self.pages_of(r)) for r in self.reqs)
    return raw + sum(len(p) - self.owned_from[r] for r, p in self.rows.items())

  def digest(self) -> str:
    doc = {"reqs": self.reqs, "rows": sorted(self.rows.items()),
           "lens": sorted(self.lens.items()), "owned": sorted(self.owned_from.items()),
           "free": self.model.free_pages, "release": self.model.release_pages}
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()

  def pick(self, items, most):
    items = list(items)
    k = int(self.rng.integers(0, min(most, len(items)) + 1))
    return [items[i] for i in self.rng.permutation(len(items))[:k]]


def _host(x) -> np.ndarray:
  """Rows as one NumPy array: int32 unless bool."""
  x = np.asarray(x)
  return x if x.dtype == np.bool_ else x.astype(np.int32)


def _pad(rows, width, fill=0, dtype=np.int32):
  out = np.full((len(rows), width), fill, dtype)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


class RankTrace:
  """Runs the trace on `allocator` (a RankedAllocator, placed or not) for the ranks this
  process holds; `record` keeps every output of those ranks, step by step."""

  def __init__(self, shape: Shape, allocator: ranks.RankedAllocator, seed: int,
               ops: Tuple[str, ...] = OPS):
    self.s, self.r, self.ops = shape, allocator, ops
    mesh = allocator.mesh
    if mesh is None:
      self.mine = tuple(range(shape.dp))
      self.put = lambda x: jnp.asarray(_host(x))
    else:
      self.mine = multiprocess.process_ranks(mesh, allocator.axis_name, shape.dp)
      self.put = lambda x: multiprocess.put_ranks(_host(x), mesh, allocator.axis_name,
                                                  shape.dp)
    self.get = multiprocess.get_ranks
    # With a mesh, each operation's first call is kept, to read its compiled program.
    self.first_calls = {}
    self.r = allocator._replace(**{
        name: self._recorded(name, fn) for name, fn in allocator._asdict().items()
        if hasattr(fn, "lower")})
    self.m = {r: RankMirror(shape, seed, r) for r in self.mine}
    self.ops_rng = np.random.default_rng([seed, 1 << 20])
    self.state = allocator.init()
    self.table = allocator.init_table(shape.max_reqs, shape.max_pages_per_req)
    self.record: Dict[str, np.ndarray] = {}
    self.schedule: List[str] = []

  # -- helpers ---------------------------------------------------------------------------

  def _recorded(self, name, fn):
    def call(*args, **kwargs):
      self.first_calls.setdefault(name, (fn, args, dict(kwargs)))
      return fn(*args, **kwargs)
    return call

  def collectives(self) -> Dict[str, Dict[str, int]]:
    """ranks.collectives_in of every operation's compiled program (as first called; the
    compile comes from JAX's cache)."""
    return {name: ranks.collectives_in(fn.lower(*args, **kwargs).compile().as_text())
            for name, (fn, args, kwargs) in sorted(self.first_calls.items())}

  def _keep(self, step, name, value):
    for i, leaf in enumerate(jax.tree.leaves(self.get(value))):
      self.record[f"{step:04d}.{name}.{i}"] = leaf

  def _check_lists(self, step, op):
    free, counts = self.get(self.r.get_all_free_pages(self.state))
    avail = self.get(self.r.available_size(self.state))
    for i, rank in enumerate(self.mine):
      m = self.m[rank]
      want = m.model.get_all_free_pages()
      assert free[i][:counts[i]].tolist() == want, (step, op, rank)
      assert avail[i] == m.model.available_size(), (step, op, rank)
      assert len(want) + m.held_pages() == self.s.pages_per_rank, (step, op, rank)
    return free, counts, avail

  def _check_out(self, step, op, out, ok, want, lens):
    out, ok = self.get(out), self.get(ok)
    for i, rank in enumerate(self.mine):
      assert bool(ok[i]) == (want[rank] is not None), (step, op, rank, want[rank])
      if want[rank] is not None:
        assert out[i][:lens[rank]].tolist() == list(want[rank]), (step, op, rank)
    return out, ok

  def _last_loc(self, m, row):
    n = m.lens.get(row, 0)
    if n == 0:
      return -1
    ps = self.s.page_size
    return m.rows[row][(n - 1) // ps] * ps + (n - 1) % ps

  # -- one step --------------------------------------------------------------------------

  def step(self, step: int) -> None:
    n = len(self.ops)
    if step % n == 0:  # every operation within each len(ops) steps
      self.cycle = [self.ops[i] for i in self.ops_rng.permutation(n)]
    op = self.cycle[step % n]
    self.schedule.append(op)
    getattr(self, "_" + op)(step, op)
    self._check_lists(step, op)

  def run(self, steps: int) -> "RankTrace":
    for k in range(steps):
      self.step(k)
    return self

  # -- raw pool operations ---------------------------------------------------------------

  def _alloc(self, step, op):
    s, need, want = self.s, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      need[rank] = int(m.rng.integers(0, s.max_alloc // s.page_size + 1)) * s.page_size
      want[rank] = m.model.alloc(need[rank])
    self.state, out, ok = self.r.alloc(self.state, self.put([need[r] for r in self.mine]),
                                       max_size=s.max_alloc)
    self._keep(step, op, (out, ok))
    self._check_out(step, op, out, ok, want, need)
    for rank in self.mine:
      if want[rank]:
        self.m[rank].reqs.append(list(want[rank]))

  def _extend(self, step, op):
    s, ps = self.s, self.s.page_size
    pre, seq, last, picks, want, lens, pages = {}, {}, {}, {}, {}, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      n = int(m.rng.integers(0, s.rows + 1))
      pick = m.pick(range(len(m.reqs)), n)
      ext = m.rng.integers(0, 2 * ps + 3, n)
      while ext.sum() > s.max_tokens:
        ext //= 2
      rows = [(len(m.reqs[i]), m.reqs[i][-1]) for i in pick] + [(0, -1)] * (n - len(pick))
      pre[rank] = [p for p, _ in rows]
      seq[rank] = [p + int(e) for (p, _), e in zip(rows, ext)]
      last[rank] = [l for _, l in rows]
      picks[rank] = pick
      lens[rank] = int(sum(ext))
      pages[rank] = sum(cdiv(q, ps) - cdiv(p, ps) for p, q in zip(pre[rank], seq[rank]))
      if m.rng.random() < 0.15:  # a caller's wrong page count: refused, pool untouched
        pages[rank] += 1
        want[rank] = None
      else:
        want[rank] = m.model.alloc_extend(pre[rank], seq[rank], last[rank])
    mine = self.mine
    self.state, out, ok = self.r.alloc_extend(
        self.state, self.put(_pad([pre[r] for r in mine], s.rows)),
        self.put(_pad([seq[r] for r in mine], s.rows)),
        self.put(_pad([last[r] for r in mine], s.rows, -1)), max_tokens=s.max_tokens,
        num_reqs=self.put([len(pre[r]) for r in mine]),
        num_new_pages=self.put([pages[r] for r in mine]))
    self._keep(step, op, (out, ok))
    self._check_out(step, op, out, ok, want, lens)
    for rank in mine:
      m, at = self.m[rank], 0
      if want[rank] is None:
        continue
      for k, (p, q) in enumerate(zip(pre[rank], seq[rank])):
        new = list(want[rank][at:at + q - p])
        at += q - p
        if k < len(picks[rank]):
          m.reqs[picks[rank][k]] += new
        elif new:
          m.reqs.append(new)

  def _decode(self, step, op, release=False):
    """alloc_decode of some raw requests; with release, release_and_alloc_decode that
    first frees up to two others' pages."""
    s, ids, picks, seq, last, want = self.s, {}, {}, {}, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      ids[rank] = [p for req in (self._take_reqs(m, s.max_free * s.page_size)
                                 if release else []) for p in m.pages_of(req)]
      m.model.free_page_ids(ids[rank])
      picks[rank] = m.pick(range(len(m.reqs)), s.rows)
      seq[rank] = [len(m.reqs[i]) + 1 for i in picks[rank]]
      last[rank] = [m.reqs[i][-1] for i in picks[rank]]
      want[rank] = m.model.alloc_decode(seq[rank], last[rank])
    mine = self.mine
    args = (self.put(_pad([seq[r] for r in mine], s.rows, 1)),
            self.put(_pad([last[r] for r in mine], s.rows, -1)))
    num_reqs = self.put([len(seq[r]) for r in mine])
    if release:
      self.state, out, ok = self.r.release_and_alloc_decode(
          self.state, self.put(_pad([ids[r] for r in mine], s.max_free)), *args,
          num=self.put([len(ids[r]) for r in mine]), num_reqs=num_reqs)
    else:
      self.state, out, ok = self.r.alloc_decode(self.state, *args, num_reqs=num_reqs)
    self._keep(step, op, (out, ok))
    self._check_out(step, op, out, ok, want, {r: len(seq[r]) for r in mine})
    for rank in mine:
      for i, slot in zip(picks[rank], want[rank] or []):
        self.m[rank].reqs[i].append(int(slot))

  def _take_reqs(self, m, most_slots):
    """Removes up to two whole raw requests (at most most_slots slots together)."""
    taken = []
    for k in sorted(m.pick(range(len(m.reqs)), 2), reverse=True):
      if sum(map(len, taken)) + len(m.reqs[k]) <= most_slots:
        taken.append(m.reqs.pop(k))
    return taken

  def _free(self, step, op):
    slots = {}
    for rank in self.mine:
      m = self.m[rank]
      slots[rank] = [x for req in self._take_reqs(m, self.s.max_free) for x in req]
      m.model.free(slots[rank])
    self.state = self.r.free(self.state,
                             self.put(_pad([slots[r] for r in self.mine], self.s.max_free)))

  def _free_page_ids(self, step, op):
    ids = {}
    for rank in self.mine:
      m = self.m[rank]
      ids[rank] = [p for req in self._take_reqs(m, self.s.max_free * self.s.page_size)
                   for p in m.pages_of(req)]
      m.model.free_page_ids(ids[rank])
    # num: each rank's count; the entries after it are garbage the call must ignore.
    junk = [ids[r] + [1] * (self.s.max_free - len(ids[r])) for r in self.mine]
    self.state = self.r.free_page_ids(self.state, self.put(_pad(junk, self.s.max_free)),
                                      self.put([len(ids[r]) for r in self.mine]))

  def _free_segment(self, step, op):
    ps, seg, start = self.s.page_size, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      seg[rank], start[rank] = [], 0
      if m.reqs:
        i = int(m.rng.integers(len(m.reqs)))
        req = m.reqs[i]
        start[rank] = int(m.rng.integers(0, cdiv(len(req), ps))) * ps
        seg[rank] = req[start[rank]:][:self.s.max_free // ps * ps]
        if len(req) - start[rank] > len(seg[rank]):
          seg[rank], start[rank] = [], 0  # too long for one call: skip
        elif start[rank]:
          m.reqs[i] = req[:start[rank]]
        else:
          m.reqs.pop(i)
      m.model.free_segment(seg[rank], start[rank])
    self.state = self.r.free_segment(
        self.state, self.put(_pad([seg[r] for r in self.mine], self.s.max_free)),
        self.put([start[r] for r in self.mine]), self.put([len(seg[r]) for r in self.mine]))

  def _release_decode(self, step, op):
    self._decode(step, op, release=True)

  def _merge(self, step, op):
    which = {r: bool(self.m[r].rng.random() < 0.7) for r in self.mine}
    for rank in self.mine:
      if which[rank]:
        self.m[rank].model.merge_and_sort_free()
    self.state = self.r.merge_and_sort_free(
        self.state, self.put(np.asarray([which[r] for r in self.mine], bool)))

  def _avail(self, step, op):
    self._keep(step, op, (self.r.available_size(self.state),
                          self.r.get_all_free_pages(self.state)))

  def _clear(self, step, op):
    """Rarely: a few ranks release every table row, then go back to the initial pool."""
    which = {r: bool(self.m[r].rng.random() < 0.3) for r in self.mine}
    rows = {r: sorted(self.m[r].rows) if which[r] else [] for r in self.mine}
    self._release_table(step, op, rows)
    for rank in self.mine:
      if which[rank]:
        m = self.m[rank]
        m.model.clear()
        m.reqs = []
    self.state = self.r.clear(self.state,
                              self.put(np.asarray([which[r] for r in self.mine], bool)))

  # -- the request table -----------------------------------------------------------------

  def _t_extend(self, step, op):
    s, ps, width = self.s, self.s.page_size, self.s.max_pages_per_req
    rows, n, want = {}, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      live = [r for r in m.rows if not m.borrowers.get(r)]  # sources stay as lent
      free_rows = [r for r in range(s.max_reqs) if r not in m.rows]
      rows[rank] = (m.pick(live, 2) + m.pick(free_rows, 2))[:s.rows]
      n[rank] = [int(x) for x in m.rng.integers(0, 3 * ps + 2, len(rows[rank]))]
      while sum(n[rank]) > s.max_tokens:
        n[rank] = [x // 2 for x in n[rank]]
      pre = [m.lens.get(r, 0) for r in rows[rank]]
      if any(p + k > width * ps for p, k in zip(pre, n[rank])):
        want[rank] = None  # a row over its capacity: refused before the pool
      else:
        want[rank] = m.model.alloc_extend(pre, [p + k for p, k in zip(pre, n[rank])],
                                          [self._last_loc(m, r) for r in rows[rank]])
    mine = self.mine
    self.state, self.table, out, ok = self.r.extend_rows(
        self.state, self.table, self.put(_pad([rows[r] for r in mine], s.rows)),
        self.put(_pad([n[r] for r in mine], s.rows)), max_tokens=s.max_tokens,
        num_rows=self.put([len(rows[r]) for r in mine]))
    self._keep(step, op, (out, ok))
    self._check_out(step, op, out, ok, want, {r: sum(n[r]) for r in mine})
    for rank in mine:
      m, at = self.m[rank], 0
      if want[rank] is None:
        continue
      for row, k in zip(rows[rank], n[rank]):
        pre = m.lens.get(row, 0)
        for j, slot in enumerate(want[rank][at:at + k]):
          if (pre + j) % ps == 0:
            m.rows.setdefault(row, []).append(slot // ps)
        at += k
        if pre + k:
          m.rows.setdefault(row, [])
          m.lens[row] = pre + k
          m.owned_from.setdefault(row, 0)

  def _t_decode(self, step, op):
    s, ps = self.s, self.s.page_size
    rows, want = {}, {}
    for rank in self.mine:
      m = self.m[rank]
      rows[rank] = m.pick([r for r in m.rows if not m.borrowers.get(r)], s.rows)
      pre = [m.lens[r] for r in rows[rank]]
      if any(p >= s.max_pages_per_req * ps for p in pre):
        want[rank] = None
      else:
        want[rank] = m.model.alloc_decode([p + 1 for p in pre],
                                          [self._last_loc(m, r) for r in rows[rank]])
    mine = self.mine
    self.state, self.table, out, ok = self.r.decode_rows(
        self.state, self.table, self.put(_pad([rows[r] for r in mine], s.rows)),
        num_rows=self.put([len(rows[r]) for r in mine]))
    self._keep(step, op, (out, ok))
    self._check_out(step, op, out, ok, want, {r: len(rows[r]) for r in mine})
    for rank in mine:
      m = self.m[rank]
      if want[rank] is None:
        continue
      for row, slot in zip(rows[rank], want[rank]):
        if m.lens[row] % ps == 0:
          m.rows[row].append(slot // ps)
        m.lens[row] += 1

  def _release_table(self, step, op, rows):
    """release_rows of rows[rank] for every rank (a source's borrowers go with it)."""
    for rank in self.mine:
      m = self.m[rank]
      for row in list(rows[rank]):
        rows[rank] += [b for b in m.borrowers.get(row, []) if b not in rows[rank]]
      ids = []
      for row in rows[rank]:
        ids += m.rows[row][m.owned_from[row]:]
      m.model.free_page_ids(ids)
      for row in rows[rank]:
        for src in m.borrowers.values():
          if row in src:
            src.remove(row)
      for row in rows[rank]:
        m.borrowers.pop(row, None)
        del m.rows[row], m.lens[row], m.owned_from[row]
    width = self.s.max_reqs
    self.state, self.table, ok = self.r.release_rows(
        self.state, self.table, self.put(_pad([rows[r] for r in self.mine], width)),
        num_rows=self.put([len(rows[r]) for r in self.mine]))
    self._keep(step, op, ok)
    assert self.get(ok).all(), (step, op)

  def _t_release(self, step, op):
    self._release_table(step, op, {r: self.m[r].pick(self.m[r].rows, 2) for r in self.mine})

  def _t_borrow(self, step, op):
    s, ps, width = self.s, self.s.page_size, self.s.max_pages_per_req
    rows, ids, num, srcs = {}, {}, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      borrowing = {b for bs in m.borrowers.values() for b in bs}
      sources = [r for r in m.rows if m.lens[r] >= ps and r not in borrowing]
      empty = [r for r in range(s.max_reqs) if r not in m.rows]
      rows[rank], ids[rank], num[rank], srcs[rank] = [], [], [], []
      if sources and empty:
        src = sources[int(m.rng.integers(len(sources)))]
        row = empty[int(m.rng.integers(len(empty)))]
        k = int(m.rng.integers(1, m.lens[src] // ps + 1))
        rows[rank], ids[rank], num[rank], srcs[rank] = [row], [m.rows[src][:k]], [k], [src]
        m.rows[row], m.lens[row], m.owned_from[row] = list(m.rows[src][:k]), k * ps, k
        m.borrowers.setdefault(src, []).append(row)
    mine = self.mine
    put_rows = lambda d: self.put(_pad([d[r] for r in mine], 1))
    counts = self.put([len(rows[r]) for r in mine])
    if self.schedule.count(op) % 2:  # every other borrow: the call reads the source rows
      self.table, ok = self.r.borrow_from_rows(self.state, self.table, put_rows(rows),
                                               put_rows(srcs), put_rows(num),
                                               num_rows=counts)
    else:
      page_ids = np.zeros((len(mine), 1, width), np.int32)
      for i, rank in enumerate(mine):
        if ids[rank]:
          page_ids[i, 0, :len(ids[rank][0])] = ids[rank][0]
      self.table, ok = self.r.borrow_pages(self.state, self.table, put_rows(rows),
                                           self.put(page_ids), put_rows(num),
                                           num_rows=counts)
    self._keep(step, op, ok)
    assert self.get(ok).all(), (step, op)

  def _t_admit(self, step, op):
    s, ps, width = self.s, self.s.page_size, self.s.max_pages_per_req
    rows, n, want = {}, {}, {}
    for rank in self.mine:
      m = self.m[rank]
      rows[rank] = [int(x) for x in m.rng.permutation(s.max_reqs)[:s.rows]]
      n[rank] = [int(x) for x in m.rng.integers(0, 3 * ps, s.rows)]
      avail, k = len(m.model.get_all_free_pages()), 0
      for row, add in zip(rows[rank], n[rank]):
        pre = m.lens.get(row, 0)
        if pre + add > width * ps:
          break
        avail -= cdiv(pre + add, ps) - cdiv(pre, ps)
        if avail < 0:
          break
        k += 1
      want[rank] = k
    mine = self.mine
    got = self.r.admit_rows(self.state, self.table,
                            self.put(_pad([rows[r] for r in mine], s.rows)),
                            self.put(_pad([n[r] for r in mine], s.rows)))
    self._keep(step, op, got)
    assert self.get(got).tolist() == [want[r] for r in mine], (step, op)

  def _t_attn(self, step, op):
    s, ps = self.s, self.s.page_size
    rows, q = {}, {}
    for rank in self.mine:
      m = self.m[rank]
      rows[rank] = m.pick(m.rows, s.rows)
      q[rank] = [min(m.lens[r], 1 + int(m.rng.integers(3))) for r in rows[rank]]
    mine = self.mine
    got = self.r.attention_inputs(self.table, self.put(_pad([rows[r] for r in mine], s.rows)),
                                  self.put(_pad([q[r] for r in mine], s.rows)),
                                  num_rows=self.put([len(rows[r]) for r in mine]))
    self._keep(step, op, got)
    got = self.get(got)
    for i, rank in enumerate(mine):
      m = self.m[rank]
      for b, row in enumerate(rows[rank]):
        used = cdiv(m.lens[row], ps)
        assert got.kv_lens[i][b] == m.lens[row], (step, op, rank)
        assert got.page_indices[i][b][:used].tolist() == m.rows[row][:used], (step, op, rank)
      assert got.cu_q_lens[i][-1] == sum(q[rank]), (step, op, rank)

  # -- the end ---------------------------------------------------------------------------

  def final(self) -> Dict[str, np.ndarray]:
    """This process's ranks of the final state and table, as NumPy."""
    leaves = jax.tree.leaves(self.get((self.state, self.table)))
    return {f"final.{i}": x for i, x in enumerate(leaves)}

  def digests(self) -> Dict[int, str]:
    return {r: self.m[r].digest() for r in self.mine}

  def schedule_digest(self) -> str:
    return hashlib.sha256(" ".join(self.schedule).encode()).hexdigest()


def rank_processes(mesh: jax.sharding.Mesh, axis_name: str,
                   dp_size: int) -> Tuple[Tuple[int, ...], ...]:
  """For each rank, the processes that hold it (ascending; one unless the mesh
  replicates the rank across processes)."""
  holders = [set() for _ in range(dp_size)]
  for device, held in multiprocess._rank_slices(mesh, axis_name, dp_size).items():  # pylint: disable=protected-access
    for r in held:
      holders[r].add(device.process_index)
  return tuple(tuple(sorted(h)) for h in holders)


def held_ranks(x: jax.Array) -> Tuple[int, ...]:
  """The global ranks whose rows `multiprocess.get_ranks(x)` returns, ascending."""
  held = set()
  for shard in x.addressable_shards:
    held.update(range(x.shape[0])[shard.index[0]])
  return tuple(sorted(held))
