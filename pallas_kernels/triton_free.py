"""The paged `free` on GPU: Pallas kernels through the Triton lowering.

Reference: jax_kvalloc.freeing's XLA free (SPEC 4.4): the distinct pages
`slot // page_size` of the non-negative slots that lie in [1, num_pages], ascending,
prepended as one block to a ring.

No sort and no atomics: a mark per page, then a prefix sum over the marks, in three
launches after one memset::

  K1 "mark"   grid over blocks of SB slots: marks[page] = 1 for each valid slot's page, in
              a zeroed i32[nb * B] buffer (input_output_aliases: the memset is the only
              other op). Repeats of a page store the same 1: which store lands does not
              matter, so no atomics.
  K2 "count"  grid over blocks of B pages: counts[b] = the marks of block b.
  K3 "place"  grid over blocks of B pages: each program sums the counts of the blocks
              before its own (nb <= MAX_BLOCKS entries, one vector) for its base, takes the
              exclusive prefix sum of its marks (tt.scan) for each marked page's rank, and
              writes the page into the target ring (free or release list) at
              head - count + rank (mod ring length): one block prepended, ascending by
              construction, count cut to the room left (num_pages - both lengths, as
              freeing._give_back). Program 0 writes the new head and length.

With the ownership record (jax_kvalloc.guard; `record=(held, status)`), in the same
launches: K1 also checks every non-zero slot (its page must be held: not page 0, inside
the pool, handed out) and writes the position of its block's first offending slot to a
cell of its own after the marks (the memset zeroes those too); K3 reads every cell, and
when any slot offends the whole free is refused (no ring write), else it clears held at
the pages it places; its program 0 records the status (the first offending slot's
page and reason) and the verdict.

`free_push_front_triton` is the entry point. The ring is aliased in and out (in place
when the caller donates it or XLA can reuse it), and so are held and status.

Every load and store index is clamped into its buffer (_util.load/store).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _guard
from pallas_kernels import _util
from pallas_kernels._util import cdiv

Array = jax.Array

# Slots per K1 program and pages per K2/K3 program (powers of two), and warps: the best
# of an H200 block sweep (benchmarks/results/2026-11-30-h200x2-run11, free-blocks.json).
SLOT_BLOCK = 2048
PAGE_BLOCK = 2048
NUM_WARPS = 4
# K3 loads every block's count as one vector: at most this many blocks (pools up to
# MAX_BLOCKS * PAGE_BLOCK - 1 = 2**25 - 1 pages).
MAX_BLOCKS = 2**14
# `preferred`: the kernels read and write 4 bytes per page of the pool per call (the
# memset, K2, K3), a sort touches only the M slots. Up to 2**20 pages (4 MiB, about a
# microsecond of H200 bandwidth per pass) the launches dominate; past it the kernels are
# preferred only while the pool is within PREFERRED_RATIO * M pages. That bound is not
# measured.
PREFERRED_PAGES = 2**20
PREFERRED_RATIO = 128


# ---------------------------------------------------------------------------------------
# Reference and static checks.
# ---------------------------------------------------------------------------------------

def _pages_of(slots: Array, ps: int) -> Array:
  """Each slot's page, 0 for a negative slot (as jax_kvalloc.freeing._free)."""
  return jnp.where(slots >= 0, _util.floordiv(slots, ps), 0)


def supported(num_pages: int, num_slots: int) -> bool:
  """Whether the kernels take these static sizes (K3 loads all block counts, and K1's
  cells, at once)."""
  return (1 <= num_pages and cdiv(num_pages + 1, PAGE_BLOCK) <= MAX_BLOCKS
          and 1 <= num_slots and cdiv(num_slots, SLOT_BLOCK) <= MAX_BLOCKS)


def preferred(num_pages: int, num_slots: int) -> bool:
  """Whether the allocator's "auto" should take the kernels for these static sizes."""
  return supported(num_pages, num_slots) and (
      num_pages <= max(PREFERRED_PAGES, PREFERRED_RATIO * num_slots))


def _check(num_pages: int, num_slots: int, page_size: int) -> None:
  if page_size < 1:
    raise ValueError(f"page_size must be >= 1, got {page_size}")
  if not supported(num_pages, num_slots):
    raise ValueError(f"the free kernels do not take num_pages={num_pages}, "
                     f"{num_slots} slots (see supported)")


@dataclasses.dataclass(frozen=True)
class _Params:
  stage: str          # "mark", "count", "place"
  num_slots: int      # M
  num_pages: int      # n
  page_size: int
  slot_block: int     # SB, slots per K1 program
  page_block: int     # B, pages per K2/K3 program
  num_blocks: int     # nb = cdiv(n + 1, B); the marks buffer holds nb * B entries
  blocks_pad: int     # next power of two >= nb
  guard: bool = False  # the ownership record (module docstring)
  op: int = 0          # the operation its status names
  slot_blocks: int = 1  # K1 programs (cdiv(M, SB)): their cells follow the marks (guard)
  slot_blocks_pad: int = 1


# ---------------------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------------------

def _mark_kernel(slots_ref, marks_in,      # inputs: i32[M], i32[nb*B (+ cells)] zeros (aliased)
                 *refs,                    # [held i32[n+1]]; output: marks
                 p: _Params):
  del marks_in  # the same buffer as marks_ref
  held_ref, marks_ref = refs if p.guard else (None,) + tuple(refs)
  pid = pl.program_id(0)
  i = pid * p.slot_block + jnp.arange(p.slot_block, dtype=jnp.int32)
  lane = i < p.num_slots
  slot = _util.load(slots_ref, i, lane)
  page = _pages_of(slot, p.page_size)
  valid = lane & (page >= 1) & (page <= p.num_pages)
  _util.store(marks_ref, page, jnp.ones_like(page), valid)
  if p.guard:  # this block's first slot whose page is not held: M - its position, or 0
    why, _, _ = _guard.reasons(held_ref, _util.floordiv(slot, p.page_size),
                               lane & (slot != 0), p.num_pages, distinct=False,
                               barrier=False)
    first = jnp.min(jnp.where(why != 0, i, p.num_slots))
    marks_ref[p.num_blocks * p.page_block + pid] = p.num_slots - first


def _block_pages(p: _Params) -> Array:
  return pl.program_id(0) * p.page_block + jnp.arange(p.page_block, dtype=jnp.int32)


def _count_kernel(marks_ref,               # input: i32[nb*B]
                  counts_ref,              # output: i32[nb]
                  *, p: _Params):
  pid = pl.program_id(0)
  page = _block_pages(p)
  marks = _util.load(marks_ref, page, page < p.num_blocks * p.page_block)
  counts_ref[pid] = jnp.sum(marks)


def _place(p: _Params, marks_ref, counts_ref):
  """(page ids i32[B], marked bool[B], rank i32[B], total i32[]) of this program's block:
  a marked page's rank is the number of marked pages below it."""
  pid = pl.program_id(0)
  b = jnp.arange(p.blocks_pad, dtype=jnp.int32)
  counts = _util.load(counts_ref, b, b < p.num_blocks)
  base = jnp.sum(jnp.where(b < pid, counts, 0))
  page = _block_pages(p)
  marked = _util.load(marks_ref, page, page <= p.num_pages)
  rank = base + jnp.cumsum(marked) - marked
  return page, marked > 0, rank, jnp.sum(counts)


def _place_ring_kernel(marks_ref, counts_ref,                # i32[nb*B (+ cells)], i32[nb]
                       ring_in, head_ref, len_ref, other_ref,  # i32[n] (aliased), i32[1] x3
                       *refs,  # [slots i32[M], held, status (aliased)]; outputs: ring
                       p: _Params):  # i32[n], head, len i32[1], [held, status, refused]
  del ring_in  # the same buffer as ring_ref
  if p.guard:
    slots_ref, _, _, ring_ref, head_out, len_out, held_ref, status_ref, refused_out = refs
  else:
    ring_ref, head_out, len_out = refs
  n = p.num_pages
  page, marked, rank, total = _place(p, marks_ref, counts_ref)
  length = len_ref[0]
  # As freeing._give_back: the count cut to the room both lists leave (only double frees
  # can exceed it), then state.ring_push_front.
  count = jnp.minimum(total, n - length - other_ref[0])
  if p.guard:  # refused whole when any K1 block found a slot whose page is not held
    c = jnp.arange(p.slot_blocks_pad, dtype=jnp.int32)
    cells = _util.load(marks_ref, p.num_blocks * p.page_block + c, c < p.slot_blocks)
    last = jnp.max(cells)  # M - the first offending position, 0 when none
    refused = last > 0
    count = jnp.where(refused, 0, count)
    _util.store(held_ref, page, jnp.zeros_like(page), marked & ~refused)
  head = (head_ref[0] - count) % n
  pos = head + rank  # head < n and rank < count <= n: one wrap at most
  pos = jnp.where(pos >= n, pos - n, pos)
  _util.store(ring_ref, pos, page, marked & (rank < count))

  @pl.when(pl.program_id(0) == 0)
  def _():
    head_out[0] = head
    len_out[0] = length + count
    if p.guard:
      first = _util.floordiv(slots_ref[jnp.clip(p.num_slots - last, 0, p.num_slots - 1)],
                             p.page_size)
      why = _guard.why_of(first, n)
      _guard.record_status(status_ref, refused, p.op, why, first)
      refused_out[0] = refused.astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# Grids, shapes and wrappers.
# ---------------------------------------------------------------------------------------

class _Call(_util.TritonCall):
  """One stage's pallas_call."""

  def spec(self):
    p = self.p
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    marks = i32(_marks_len(p))
    if p.stage == "mark":
      return (marks,), _mark_kernel, (p.slot_blocks,)
    if p.stage == "count":
      return (i32(p.num_blocks),), _count_kernel, (p.num_blocks,)
    record = (i32(p.num_pages + 1), i32(3), i32(1)) if p.guard else ()
    return ((i32(p.num_pages), i32(1), i32(1)) + record, _place_ring_kernel,
            (p.num_blocks,))

  def aliases(self):
    p = self.p
    if p.stage == "mark":
      return {1: 0}   # the zeroed marks
    if p.stage == "place":
      return {2: 0, 7: 3, 8: 4} if p.guard else {2: 0}   # the ring (and the record)
    return {}


def _marks_len(p: _Params) -> int:
  """The marks buffer: a mark per page id 0 .. nb*B - 1, then K1's cells (guard)."""
  return p.num_blocks * p.page_block + (p.slot_blocks if p.guard else 0)


def _calls(m: int, n: int, ps: int, interpret: bool, guard: bool = False, op: int = 0):
  nb = cdiv(n + 1, PAGE_BLOCK)
  slot_block = min(SLOT_BLOCK, _util.next_pow2(m))
  base = dict(num_slots=m, num_pages=n, page_size=ps, slot_block=slot_block,
              page_block=PAGE_BLOCK, num_blocks=nb, blocks_pad=_util.next_pow2(nb),
              guard=guard, op=op, slot_blocks=cdiv(m, slot_block),
              slot_blocks_pad=_util.next_pow2(cdiv(m, slot_block)))
  return [_Call(f"jax_kvalloc_free_push_{stage}", _Params(stage=stage, **base), NUM_WARPS,
                interpret)
          for stage in ("mark", "count", "place")]


def free_push_front_triton(slots: Array, ring: Array, head: Array, length: Array,
                           other_len: Array, *, page_size: int, interpret: bool = False,
                           record: Tuple[Array, Array] | None = None,
                           op: int = 0) -> Tuple[Array, ...]:
  """The paged `free` (SPEC 4.4, no debug) into one ring, in one memset and three launches.

  Args:
    slots: i32[M] slot indices; a negative slot, and a slot whose page lies outside
      [1, n], is ignored.
    ring: i32[n] the list the pages go to (free_pages, or release_pages with need_sort);
      n is the pool's num_pages. head, length: i32[] its head and length.
    other_len: i32[] the other list's length (the room left is n - length - other_len).
    page_size: static, >= 1.
    interpret: run in Pallas' interpreter (CPU tests).
    record: optional (held i32[n + 1], status i32[3]), the ownership record
      (jax_kvalloc.guard), aliased in and out: a non-zero slot whose page is not held
      (page 0, outside the pool, free) refuses the whole free, and the status records
      it under `op`; otherwise held is cleared at the pages freed.

  Returns:
    (ring, head, length) after prepending the sorted unique pages as one block, count cut
    to the room left: the bits of jax_kvalloc.freeing's XLA free (PAGED_FREE["sort"]);
    with `record` also the new held and status and bool[] refused. TypeError naming the
    argument for a non-integer dtype, ValueError for sizes `supported` refuses.
  """
  slots, ring, head, length, other_len = _util.check_ints(
      slots=slots, ring=ring, head=head, length=length, other_len=other_len)
  slots = slots.reshape(-1)
  m, n = slots.shape[0], ring.shape[0]
  if m == 0:
    return (ring, head, length) + (() if record is None else
                                   (record[0], record[1], jnp.zeros((), bool)))
  _check(n, m, page_size)
  guard = record is not None
  mark, count, place = _calls(m, n, page_size, interpret, guard, op)
  held = ()
  if guard:
    held, status = _util.check_ints(held=record[0], status=record[1])
    if held.shape != (n + 1,):
      raise ValueError(f"held must be i32[{n + 1}] (ring length + 1), got {held.shape}")
    held = (held,)
  (marks,) = mark.run(slots, jnp.zeros((_marks_len(mark.p),), jnp.int32), *held)
  (counts,) = count.run(marks)
  one = lambda x: jnp.reshape(x, (1,))
  extra = () if not guard else (slots, held[0], status.reshape(3))
  res = place.run(marks, counts, ring, one(head), one(length), one(other_len), *extra)
  out = (res[0], res[1].reshape(()), res[2].reshape(()))
  if guard:
    out += (res[3], res[4], res[5].reshape(()) > 0)
  return out
