"""The paged `free`'s sorted unique pages on GPU: Pallas kernels through the Triton lowering.

Reference: `reference_sorted_unique` below (the contract of
jax_kvalloc.freeing.free_pages_sorted_unique, SPEC 4.4): the distinct pages
`slot // page_size` of the non-negative slots that lie in [1, num_pages], ascending, in
values[:count], 0 after them.

No sort and no atomics: a mark per page, then a prefix sum over the marks, in three
launches after one memset (XLA's bitmap program is about ten kernels on the H200, each
a launch of about 2 us):

  K1 "mark"   grid over blocks of SB slots: marks[page] = 1 for each valid slot's page, in
              a zeroed i32[nb * B] buffer (input_output_aliases: the memset is the only
              other op). Repeats of a page store the same 1: which store lands does not
              matter, so no atomics.
  K2 "count"  grid over blocks of B pages: counts[b] = the marks of block b. (Values mode:
              the same programs also zero `values`, which K3 then overwrites up to count.)
  K3 "place"  grid over blocks of B pages: each program sums the counts of the blocks
              before its own (nb <= MAX_BLOCKS entries, one vector) for its base, takes the
              exclusive prefix sum of its marks (tt.scan) for each marked page's rank, and
              stores the page at base + rank: ascending by construction.

Two entry points share the kernels:

- `sorted_unique_pages_triton`: the contract, (values i32[M], count i32[]).
- `free_push_front_triton`: the paged `free` itself (SPEC 4.4, no debug): K3 writes the
  pages straight into the target ring (free or release list) as one block prepended at
  head - count (mod ring length), count cut to the room left (num_pages - both lengths,
  as freeing._give_back), and program 0 writes the new head and length. The ring is
  aliased in and out (in place when the caller donates it or XLA can reuse it).

Every load and store index is clamped into its buffer (_util.load/store).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _util
from pallas_kernels._util import cdiv

Array = jax.Array

# Slots per K1 program and pages per K2/K3 program (powers of two), and warps, from the
# H200 sweep (run 11, 2026-11-30, `free_methods_gpu.py --sweep-blocks`; page size 64,
# 262144 pages; us per paged free, M = 8k / 64k / 256k slots): 2048/2048/4 warps
# 8.97 / 9.84 / 13.41; the first choice 2048/4096/4 9.80 / 10.57 / 14.46; 1024/4096/4
# 9.06 / 10.38 / 14.49; 2048/4096/8 9.42 / 10.14 / 14.01; larger slot blocks (4096,
# 8192) or page blocks (8192) 11-18. XLA's sort took 60-82 us, its bitmap 21-56.
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
# measured (the H200 runs used 262144 pages).
PREFERRED_PAGES = 2**20
PREFERRED_RATIO = 128


# ---------------------------------------------------------------------------------------
# Reference and static checks.
# ---------------------------------------------------------------------------------------

def _pages_of(slots: Array, ps: int) -> Array:
  """Each slot's page, 0 for a negative slot (as jax_kvalloc.freeing._free)."""
  return jnp.where(slots >= 0, _util.floordiv(slots, ps), 0)


def reference_sorted_unique(slots: Array, *, num_pages: int,
                            page_size: int = 1) -> Tuple[Array, Array]:
  """Pure jnp (one sort): (values i32[M], count i32[]) as the kernels give them."""
  slots = jnp.asarray(slots, jnp.int32).reshape(-1)
  pages = _pages_of(slots, page_size)
  big = jnp.int32(_util.INT32_MAX)
  pages = jnp.sort(jnp.where((pages >= 1) & (pages <= num_pages), pages, big))
  first = jnp.concatenate([jnp.ones((1,), bool), pages[1:] != pages[:-1]]) & (pages != big)
  keep = first.astype(jnp.int32)
  pos = jnp.where(first, jnp.cumsum(keep) - keep, pages.shape[0])
  values = jnp.zeros_like(pages).at[pos].set(pages, mode="drop")
  return values, jnp.sum(keep)


def supported(num_pages: int, num_slots: int) -> bool:
  """Whether the kernels take these static sizes (K3 loads all block counts at once)."""
  return 1 <= num_pages and cdiv(num_pages + 1, PAGE_BLOCK) <= MAX_BLOCKS and num_slots >= 1


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
  ring: bool          # place into a ring (free_push_front_triton), else into values
  num_slots: int      # M
  num_pages: int      # n
  page_size: int
  slot_block: int     # SB, slots per K1 program
  page_block: int     # B, pages per K2/K3 program
  num_blocks: int     # nb = cdiv(n + 1, B); the marks buffer holds nb * B entries
  blocks_pad: int     # next power of two >= nb

  @property
  def values_blocks(self) -> int:  # K2 programs that zero values (values mode)
    return 0 if self.ring else cdiv(self.num_slots, self.page_block)


# ---------------------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------------------

def _mark_kernel(slots_ref, marks_in,      # inputs: i32[M], i32[nb*B] zeros (aliased)
                 marks_ref,                # output: i32[nb*B]
                 *, p: _Params):
  del marks_in  # the same buffer as marks_ref
  i = pl.program_id(0) * p.slot_block + jnp.arange(p.slot_block, dtype=jnp.int32)
  lane = i < p.num_slots
  page = _pages_of(_util.load(slots_ref, i, lane), p.page_size)
  valid = lane & (page >= 1) & (page <= p.num_pages)
  _util.store(marks_ref, page, jnp.ones_like(page), valid)


def _block_pages(p: _Params) -> Array:
  return pl.program_id(0) * p.page_block + jnp.arange(p.page_block, dtype=jnp.int32)


def _count_kernel(marks_ref,               # input: i32[nb*B]
                  *outs,                   # outputs: i32[nb] counts (, i32[M] values)
                  p: _Params):
  pid = pl.program_id(0)
  page = _block_pages(p)

  @pl.when(pid < p.num_blocks)
  def _():
    marks = _util.load(marks_ref, page, page < p.num_blocks * p.page_block)
    outs[0][pid] = jnp.sum(marks)

  if not p.ring:  # K3 writes values[:count]; the rest must read 0
    _util.store(outs[1], page, jnp.zeros_like(page), page < p.num_slots)


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


def _place_values_kernel(marks_ref, counts_ref, values_in,   # i32[nb*B], i32[nb], i32[M]
                         values_ref, count_ref,              # outputs: i32[M], i32[1]
                         *, p: _Params):
  del values_in  # the same buffer as values_ref, zeroed by K2
  page, marked, rank, total = _place(p, marks_ref, counts_ref)
  _util.store(values_ref, rank, page, marked & (rank < p.num_slots))

  @pl.when(pl.program_id(0) == 0)
  def _():
    count_ref[0] = total


def _place_ring_kernel(marks_ref, counts_ref,                # i32[nb*B], i32[nb]
                       ring_in, head_ref, len_ref, other_ref,  # i32[n] (aliased), i32[1] x3
                       ring_ref, head_out, len_out,          # outputs: i32[n], i32[1] x2
                       *, p: _Params):
  del ring_in  # the same buffer as ring_ref
  n = p.num_pages
  page, marked, rank, total = _place(p, marks_ref, counts_ref)
  length = len_ref[0]
  # As freeing._give_back: the count cut to the room both lists leave (only double frees
  # can exceed it), then state.ring_push_front.
  count = jnp.minimum(total, n - length - other_ref[0])
  head = (head_ref[0] - count) % n
  pos = head + rank  # head < n and rank < count <= n: one wrap at most
  pos = jnp.where(pos >= n, pos - n, pos)
  _util.store(ring_ref, pos, page, marked & (rank < count))

  @pl.when(pl.program_id(0) == 0)
  def _():
    head_out[0] = head
    len_out[0] = length + count


# ---------------------------------------------------------------------------------------
# Grids, shapes and wrappers.
# ---------------------------------------------------------------------------------------

class _Call(_util.TritonCall):
  """One stage's pallas_call."""

  def spec(self):
    p = self.p
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    marks = i32(p.num_blocks * p.page_block)
    if p.stage == "mark":
      return (marks,), _mark_kernel, (cdiv(p.num_slots, p.slot_block),)
    if p.stage == "count":
      out = (i32(p.num_blocks),) if p.ring else (i32(p.num_blocks), i32(p.num_slots))
      return out, _count_kernel, (max(p.num_blocks, p.values_blocks),)
    if p.ring:
      return ((i32(p.num_pages), i32(1), i32(1)), _place_ring_kernel, (p.num_blocks,))
    return (i32(p.num_slots), i32(1)), _place_values_kernel, (p.num_blocks,)

  def aliases(self):
    p = self.p
    if p.stage == "mark":
      return {1: 0}   # the zeroed marks
    if p.stage == "place":
      return {2: 0}   # values (zeroed by K2) or the ring
    return {}


def _calls(ring: bool, m: int, n: int, ps: int, interpret: bool):
  nb = cdiv(n + 1, PAGE_BLOCK)
  base = dict(ring=ring, num_slots=m, num_pages=n, page_size=ps,
              slot_block=min(SLOT_BLOCK, _util.next_pow2(m)), page_block=PAGE_BLOCK,
              num_blocks=nb, blocks_pad=_util.next_pow2(nb))
  name = "jax_kvalloc_free_" + ("push" if ring else "unique")
  return [_Call(f"{name}_{stage}", _Params(stage=stage, **base), NUM_WARPS, interpret)
          for stage in ("mark", "count", "place")]


def _marks_and_counts(mark, count, slots: Array):
  p = mark.p
  (marks,) = mark.run(slots, jnp.zeros((p.num_blocks * p.page_block,), jnp.int32))
  return marks, count.run(marks)


def sorted_unique_pages_triton(slots: Array, *, num_pages: int, page_size: int = 1,
                               interpret: bool = False) -> Tuple[Array, Array]:
  """The distinct pages of the slots, ascending, in one memset and three launches.

  Args:
    slots: i32[M] slot indices (page ids when page_size is 1); a negative slot, and a slot
      whose page lies outside [1, num_pages], is ignored.
    num_pages: the pool's pages (static; `supported` bounds it).
    page_size: static, >= 1.
    interpret: run in Pallas' interpreter (CPU tests).

  Returns:
    (values, count): i32[M] with the pages in values[:count], ascending, 0 after them,
    and i32[] count; the bits of `reference_sorted_unique` and of
    jax_kvalloc.freeing.free_pages_sorted_unique. TypeError naming the argument for a
    non-integer dtype, ValueError for sizes `supported` refuses.
  """
  (slots,) = _util.check_ints(slots=slots)
  slots = slots.reshape(-1)
  m = slots.shape[0]
  if m == 0:
    return jnp.zeros((0,), jnp.int32), jnp.zeros((), jnp.int32)
  _check(num_pages, m, page_size)
  mark, count, place = _calls(False, m, num_pages, page_size, interpret)
  marks, (counts, zeros) = _marks_and_counts(mark, count, slots)
  values, total = place.run(marks, counts, zeros)
  return values, total.reshape(())


def free_push_front_triton(slots: Array, ring: Array, head: Array, length: Array,
                           other_len: Array, *, page_size: int,
                           interpret: bool = False) -> Tuple[Array, Array, Array]:
  """The paged `free` (SPEC 4.4, no debug) into one ring, in one memset and three launches.

  Args:
    slots: i32[M] slot indices, as `sorted_unique_pages_triton`.
    ring: i32[n] the list the pages go to (free_pages, or release_pages with need_sort);
      n is the pool's num_pages. head, length: i32[] its head and length.
    other_len: i32[] the other list's length (the room left is n - length - other_len).
    page_size: static, >= 1.
    interpret: run in Pallas' interpreter (CPU tests).

  Returns:
    (ring, head, length) after prepending the sorted unique pages as one block, count cut
    to the room left: the bits of jax_kvalloc.freeing._give_back of the sorted unique
    pages. TypeError naming the argument for a non-integer dtype, ValueError for sizes
    `supported` refuses.
  """
  slots, ring, head, length, other_len = _util.check_ints(
      slots=slots, ring=ring, head=head, length=length, other_len=other_len)
  slots = slots.reshape(-1)
  m, n = slots.shape[0], ring.shape[0]
  if m == 0:
    return ring, head, length
  _check(n, m, page_size)
  mark, count, place = _calls(True, m, n, page_size, interpret)
  marks, (counts,) = _marks_and_counts(mark, count, slots)
  one = lambda x: jnp.reshape(x, (1,))
  ring, head, length = place.run(marks, counts, ring, one(head), one(length),
                                 one(other_len))
  return ring, head.reshape(()), length.reshape(())
