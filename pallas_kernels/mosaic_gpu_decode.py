"""alloc_decode on GPU through Pallas' Mosaic GPU backend (Hopper and newer): one launch.

Reference: jax_kvalloc.allocation.alloc_decode on the jnp path (SPEC 4.3, no need_sort
merge), bit for bit; the same contract as triton_decode.alloc_decode_triton. Row i needs a
page iff ceil(seq/ps) > ceil((seq-1)/ps); the pages go out in batch order, so row i's page
is ring[head + k_i], k_i the pages of the rows before it.

Layout (mosaic_gpu_common says what Mosaic GPU can and cannot do):

- G programs of one warpgroup; program g owns rows [g R, g R + R), R = 4 Q, and warp w of
  it the Q rows [g R + w Q, g R + w Q + Q) (a stream, scalar code, rows unrolled).
- Counting, vectors: with several programs, each counts over ALL rows, in 128k-wide
  static chunks of seq (the last one ends at row B; lanes an earlier chunk counted are
  masked), the rows needing a page, the bad rows (seq < 1; ok False) and the needing rows
  before its block: contiguous loads and reductions, the one vector work Mosaic GPU has
  for this. With one program (B < 128, below one chunk) the warps' counts suffice.
- Phase A (streams): each warp counts its rows' pages into shared memory.
- Phase B (streams): each warp adds the counts of the warps before it, then per row the
  page ring[head + k] (wrapped once, clamped into the ring: read for every row, used for
  the needing ones), slot = page * ps, else last_loc + 1; 0 for padding rows and for
  every row when not ok; CHUNK_ROWS rows' loads before their stores. Program 0's warp 0
  writes the new head, length and ok.

Ownership (SPEC 14): the pages taken are ring[head .. head + total); given the record's
held pages (`held=`, an in-place operand), phase B's needing rows store held[page] = 1
(a scalar store per page taken, when ok), in the same launch. guard.take on the jnp path
sets exactly those entries.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels import _util
from pallas_kernels import mosaic_gpu_common as mg
from pallas_kernels._util import cdiv

Array = jax.Array

MAX_ROWS = 2**16        # rows per call (as alloc_decode_triton)
MAX_PROGRAMS = 128      # programs of a large batch (the H200 has 132 SMs)
SMALL_ROWS = 128        # below one vector chunk: one program
CHUNK = 2048            # rows per vector load of the counting pass (at most)
# Rows a warp loads before it stores any of their slots: a store may alias the next
# row's loads, so the compiler keeps them in order; loads first keeps them in flight
# together.
CHUNK_ROWS = 16
_NEEDS, _BAD = 0, mg.WARPS          # shared memory: per-warp counts, then
_BEFORE, _TOTAL, _BAD_ALL = 2 * mg.WARPS, 2 * mg.WARPS + 1, 2 * mg.WARPS + 2  # program's


@dataclasses.dataclass(frozen=True)
class _Params:
  num_rows: int       # B
  page_size: int
  ring_len: int       # n
  rows_per_warp: int  # Q
  grid: int           # G programs
  chunk: int          # C, the counting pass's vector length (0: one program, no pass)
  guard: bool = False  # the ownership record's held pages, in place

  @property
  def rows_per_program(self) -> int:
    return mg.WARPS * self.rows_per_warp


def layout(num_rows: int) -> Tuple[int, int]:
  """(Q rows per warp, G programs) for B rows: one program below 128 rows; else at least
  8 rows a warp and at most MAX_PROGRAMS programs."""
  b = num_rows
  if b < SMALL_ROWS:
    return -(-b // mg.WARPS), 1
  q = max(8, _util.next_pow2(-(-b // (mg.WARPS * MAX_PROGRAMS))))
  return q, -(-b // (mg.WARPS * q))


def supported(num_rows: int, ring_len: int) -> bool:
  """Whether alloc_decode_mosaic_gpu takes these static sizes (and this jax builds it)."""
  return mg.available() and 1 <= num_rows <= MAX_ROWS and ring_len >= 1


def _needs_page(seq, ps: int):
  return cdiv(seq, ps) > cdiv(seq - 1, ps)


# ---------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------

def _count_all(p: _Params, seq_ref, nreq, start_row, smem) -> None:
  """The counting pass (one warpgroup, vectors): smem[_TOTAL] pages needed by all rows,
  smem[_BAD_ALL] bad rows, smem[_BEFORE] pages needed by the rows before start_row."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  c, b, ps = p.chunk, p.num_rows, p.page_size
  strided = plgpu.Layout.WG_STRIDED((c,), vec_size=1)
  lane = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (c,), 0), strided)
  total = before = bad = jnp.zeros((), jnp.int32)
  for i in range(-(-b // c)):
    start = min(i * c, b - c)     # static: the last chunk ends at row B
    seq = plgpu.layout_cast(seq_ref[start:start + c], strided)
    idx = lane + start
    real = (idx >= i * c) & (idx < nreq)
    seq = jnp.where(real, seq, 1)
    needs = jnp.where(real & _needs_page(seq, ps), 1, 0)
    total = total + jnp.sum(needs)
    before = before + jnp.sum(jnp.where(idx < start_row, needs, 0))
    bad = bad + jnp.sum(jnp.where(real & (seq < 1), 1, 0))
  smem[_TOTAL] = total
  smem[_BEFORE] = before
  smem[_BAD_ALL] = bad


def _kernel(ring_ref, head_ref, flen_ref, nreq_ref,   # inputs: i32[n], i32[1] x3
            seq_ref, last_ref,                        # inputs: i32[B] x2
            *refs,  # [held i32[n + 1], in place]; outputs: i32[B], i32[1] x3; scratch:
            p: _Params):                              #   i32[2 * 4 + 3] shared
  if p.guard:
    held_ref, out_ref, head_o, len_o, ok_o, smem = refs
  else:
    (out_ref, head_o, len_o, ok_o, smem), held_ref = refs, None
  b, ps, n, q = p.num_rows, p.page_size, p.ring_len, p.rows_per_warp
  prog = mg.program_id()
  nreq = jnp.clip(nreq_ref[0], 0, b)
  start_row = prog * p.rows_per_program
  if p.grid > 1:
    _count_all(p, seq_ref, nreq, start_row, smem)

  def row(r):
    """(real, seq, needs as 0/1, bad as 0/1) of row r (< B or padding of the last
    program: not real)."""
    seq = seq_ref[jnp.minimum(r, b - 1)]
    real = r < nreq
    seq = jnp.where(real, seq, 1)
    needs = jnp.where(real & _needs_page(seq, ps), 1, 0)
    return real, seq, needs, jnp.where(real & (seq < 1), 1, 0)

  def count(w):
    needs = bad = jnp.zeros((), jnp.int32)
    for i in range(q):
      _, _, n_i, b_i = row(start_row + w * q + i)
      needs, bad = needs + n_i, bad + b_i
    smem[_NEEDS + w] = needs
    smem[_BAD + w] = bad

  mg.streams(1, count)

  def write(w):
    before, total = mg.before_and_total(smem, _NEEDS, w, mg.WARPS)
    _, bad = mg.before_and_total(smem, _BAD, w, mg.WARPS)
    if p.grid > 1:
      before = before + smem[_BEFORE]
      total, bad = smem[_TOTAL], smem[_BAD_ALL]
    head, flen = head_ref[0], flen_ref[0]
    ok = (bad == 0) & (total <= flen)
    k = before
    for i0 in range(0, q, CHUNK_ROWS):
      slots = []
      for i in range(i0, min(i0 + CHUNK_ROWS, q)):  # the chunk's loads, then its stores
        r = start_row + w * q + i
        real, _, needs, _ = row(r)
        last = last_ref[jnp.minimum(r, b - 1)]
        page = ring_ref[mg.wrap(head + k, n)]
        slot = jnp.where(needs > 0, page * ps, last + 1)
        slots.append((r, jnp.where(ok & real, slot, 0), needs, page))
        k = k + needs
      for r, slot, needs, page in slots:
        mg.store(out_ref, r, slot, True if p.grid * p.rows_per_program <= b else r < b)
        if held_ref is not None:  # guard.take: the pages taken, marked held
          mg.mark_held(held_ref, page, ok & (needs > 0), n)

    def finish():
      taken = jnp.where(ok, total, 0)
      new_head = head + taken
      head_o[0] = jnp.where(new_head >= n, new_head - n, new_head)
      len_o[0] = flen - taken
      ok_o[0] = ok.astype(jnp.int32)

    mg.when((prog == 0) & (w == 0), finish)

  mg.streams(1, write)


# ---------------------------------------------------------------------------------------
# Wrapper.
# ---------------------------------------------------------------------------------------

def alloc_decode_mosaic_gpu(free_ring: Array, free_head: Array, free_len: Array,
                            num_reqs: Array, seq_lens: Array, last_loc: Array, *,
                            page_size: int, interpret=False,
                            held: Optional[Array] = None) -> Tuple[Array, ...]:
  """A whole alloc_decode (SPEC 4.3, no need_sort merge) in one Mosaic GPU launch.

  Args:
    free_ring: i32[n] the state's free ring; free_head, free_len: i32[] its head/length.
    num_reqs: i32[] real rows (rows at index >= num_reqs are padding, output 0).
    seq_lens, last_loc: i32[B].
    page_size: static.
    interpret: run in jax's Mosaic GPU interpreter (True, or its parameters; CPU tests).
    held: optional i32[n + 1], the ownership record's held pages (jax_kvalloc.guard),
      written in place: the pages taken are marked 1 in the same launch.

  Returns:
    (i32[B] slots, i32[] new free_head, i32[] new free_len, bool[] ok), and with `held`
    the new held last; equal to jax_kvalloc.allocation.alloc_decode on the jnp path: ok
    is False (slots all 0, head, length and held unchanged) when a real row has
    seq_lens < 1 or the pages needed exceed free_len.

  Raises TypeError naming the argument for a non-integer dtype, ValueError for sizes
  `supported` refuses.
  """
  free_ring, free_head, free_len, num_reqs, seq_lens, last_loc = _util.check_ints(
      free_ring=free_ring, free_head=free_head, free_len=free_len, num_reqs=num_reqs,
      seq_lens=seq_lens, last_loc=last_loc)
  b, n = seq_lens.shape[0], free_ring.shape[0]
  if not supported(b, n):
    raise ValueError(f"alloc_decode_mosaic_gpu does not take {b=} rows, ring length {n} "
                     f"(see supported; jax {jax.__version__})")
  q, g = layout(b)
  p = _Params(num_rows=b, page_size=page_size, ring_len=n, rows_per_warp=q, grid=g,
              chunk=min(CHUNK, 128 * (b // 128)) if g > 1 else 0, guard=held is not None)
  record = () if held is None else mg.as_i32_refs(mg.check_held(held, n))
  i32 = lambda k: jax.ShapeDtypeStruct((k,), jnp.int32)
  kernel = mg.call(_bind(p), (i32(b), i32(1), i32(1), i32(1)),
                   name="jax_kvalloc_alloc_decode_mosaic_gpu", grid=g,
                   scratch=(mg.smem(2 * mg.WARPS + 3),), interpret=interpret)
  one = lambda x: jnp.reshape(x, (1,))
  out, head, length, ok = kernel(free_ring, one(free_head), one(free_len), one(num_reqs),
                                 seq_lens, last_loc, *record)
  res = (out, head.reshape(()), length.reshape(()), ok.reshape(()) > 0)
  return res + tuple(ref[...] for ref in record)


def _bind(p: _Params):
  def body(*refs):
    _kernel(*refs, p=p)
  return body
