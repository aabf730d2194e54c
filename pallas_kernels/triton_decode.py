"""alloc_decode slot indices on GPU: a Pallas kernel through the Triton lowering.

Reference: jax_kvalloc.index_jnp.decode_indices (the contract, SPEC 4.3). As for extend,
two entry points share the kernel file:

- `decode_indices_triton`: the contract (window and page_start from the caller); each
  program handles a block of rows, elementwise plus one gather.
- `alloc_decode_triton`: the whole allocation in one launch. Row i needs a page iff
  ceil(seq/ps) > ceil((seq-1)/ps); the pages go out in batch order, so row i's page is
  ring[head + #(rows before i that need one)]. Each program takes a block of RB rows; it
  counts the pages of all earlier rows itself (one masked reduction over every row), so
  no program waits for another. With one program (B <= RB) that count is its own scan.
  Ring reads are masked by the capacity check and wrapped into the ring.
- `release_alloc_decode_triton`: a serving step's allocator work in one launch, one
  program: freeing.free_page_ids of the finished requests' pages (the valid ids, in the
  given order, stored as one block at head - count, count cut to the room left), a CTA
  barrier so that the program's own ring writes are visible to all its threads, then the
  fused decode above from the new head and length. The ring is aliased in and out.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _guard
from pallas_kernels import _util
from pallas_kernels import tuning
from pallas_kernels._util import cdiv

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Params:
  fused: bool
  num_rows: int       # B
  rows_pad: int       # next power of two >= B
  row_block: int      # RB, rows per program (power of two, <= rows_pad)
  page_size: int
  src_len: int        # ring (fused) or window (contract) length
  # The release kernel (release_alloc_decode_triton; one program, rows_pad rows):
  release: bool = False
  num_ids: int = 0    # M, page ids given
  ids_pad: int = 0    # next power of two >= M
  barrier: bool = True  # False in interpret mode (one program, run in order there)
  # Rows' page offsets by a masked [RB, RB] sum instead of a scan (tuning.
  # DECODE_MASKED_PREFIX_MAX_ROWS: small blocks only).
  masked_prefix: bool = False
  # The ownership record (_guard): held i32[n + 1] (and, for the release, status i32[3])
  # aliased in and out; `op` names the release in the status.
  guard: bool = False
  op: int = 0


def _needs_page(seq: Array, ps: int) -> Array:
  return cdiv(seq, ps) > cdiv(seq - 1, ps)


# ---------------------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------------------

def _contract_kernel(win_ref, seq_ref, last_ref, pst_ref,   # inputs: i32[P], i32[B] x3
                     out_ref,                               # output: i32[B]
                     *, p: _Params):
  ps = p.page_size
  rows = pl.program_id(0) * p.row_block + jnp.arange(p.row_block, dtype=jnp.int32)
  lane = rows < p.num_rows
  seq = _util.load(seq_ref, rows, lane)
  last = _util.load(last_ref, rows, lane)
  page_start = _util.load(pst_ref, rows, lane)
  needs = _needs_page(seq, ps)
  page = _util.load(win_ref, page_start, lane & needs)  # clamped into the window
  _util.store(out_ref, rows, jnp.where(needs, page * ps, last + 1), lane)


def _fused_kernel(ring_ref, head_ref, flen_ref, nreq_ref,   # inputs: state i32[n], i32[1] x3
                  seq_ref, last_ref,                        # inputs: batch i32[B] x2
                  *refs,    # [held i32[n+1] (aliased)]; outputs: i32[B], i32[1] x2,
                  p: _Params):                             #   bool[1], [held i32[n+1]]
  if p.guard:
    _, out_ref, head_out, len_out, ok_out, held_ref = refs
  else:
    (out_ref, head_out, len_out, ok_out), held_ref = refs, None
  ps, n = p.page_size, p.src_len
  pid = pl.program_id(0)
  head = head_ref[0]
  flen = flen_ref[0]
  nrows = jnp.clip(nreq_ref[0], 0, p.num_rows)
  rows = pid * p.row_block + jnp.arange(p.row_block, dtype=jnp.int32)
  real = rows < nrows
  # The row loads are masked by the static batch size, not by `real` (which waits on
  # the num_reqs load), so they go out together with the state's loads: one memory
  # round trip fewer before the ring gather.
  lane = rows < p.num_rows
  seq = jnp.where(real, _util.load(seq_ref, rows, lane, 1), 1)
  last = _util.load(last_ref, rows, lane)
  needs = (real & _needs_page(seq, ps)).astype(jnp.int32)
  if p.row_block == p.rows_pad:  # one program: the block is the batch
    bad = jnp.sum((real & (seq < 1)).astype(jnp.int32))
    total_pages = jnp.sum(needs)
    before = 0
  else:
    r = jnp.arange(p.rows_pad, dtype=jnp.int32)
    real_all = r < nrows
    seq_all = jnp.where(real_all, _util.load(seq_ref, r, r < p.num_rows, 1), 1)
    bad = jnp.sum((real_all & (seq_all < 1)).astype(jnp.int32))
    needs_all = (real_all & _needs_page(seq_all, ps)).astype(jnp.int32)
    total_pages = jnp.sum(needs_all)
    before = jnp.sum(jnp.where(r < pid * p.row_block, needs_all, 0))
  ok = (bad == 0) & (total_pages <= flen)
  _write_slots(p, ring_ref, head, flen, ok, rows, real, last, needs, before, out_ref,
               held_ref)

  @pl.when(pid == 0)
  def _():
    _util.store_take(head_out, len_out, ok_out, head=head, length=flen, ring_len=n,
                     pages=total_pages, ok=ok)


def _write_slots(p: _Params, ring_ref, head, flen, ok, rows, real, last, needs, before,
                 out_ref, held_ref=None) -> None:
  """out[rows]: a needing row's page (ring[head + pages before it], wrapped once) * ps,
  else last + 1; 0 for padding rows and everywhere when not ok. Ring reads are masked by
  the capacity check. held_ref (the ownership record): the pages taken are marked."""
  ps, n = p.page_size, p.src_len
  if p.masked_prefix:  # k[i] = sum of needs[j < i]: one reduction, no cross-warp scan
    r = jnp.arange(needs.shape[0], dtype=jnp.int32)
    k = before + jnp.sum(jnp.where(r[None, :] < r[:, None], needs[None, :], 0), axis=1)
  else:
    k = before + jnp.cumsum(needs) - needs
  i = head + k
  i = jnp.where(i >= n, i - n, i)
  page = _util.load(ring_ref, i, (needs > 0) & ok & (k < flen))
  if held_ref is not None:
    _guard.mark_taken(held_ref, page, (needs > 0) & ok & (k < flen))
  out = jnp.where(needs > 0, page * ps, last + 1)
  _util.store(out_ref, rows, jnp.where(ok & real, out, 0), rows < p.num_rows)


def _release_kernel(ring_in, head_ref, flen_ref, other_ref,  # state: i32[n], i32[1] x3
                    ids_ref, num_ref,                        # release: i32[M], i32[1]
                    nreq_ref, seq_ref, last_ref,             # batch: i32[1], i32[B] x2
                    *refs,  # [held i32[n+1], status i32[3] (aliased)]; outputs:
                    p: _Params):  # ring i32[n], i32[B], i32[1] x2, bool[1], [held, status]
  """free_page_ids, then alloc_decode, in one program (grid (1,)). ring_ref is ring_in's
  buffer (input_output_aliases); so are held_ref and status_ref (the ownership record:
  a release naming a page that is not held is refused whole, and so is the decode)."""
  del ring_in  # the same buffer as ring_ref
  if p.guard:
    _, _, ring_ref, out_ref, head_out, len_out, ok_out, held_ref, status_ref = refs
  else:
    ring_ref, out_ref, head_out, len_out, ok_out = refs
  ps, n = p.page_size, p.src_len
  # Every input load first, masked by static sizes only, so that they go out together
  # (one memory round trip before the ring writes; as _fused_kernel's row loads).
  j = jnp.arange(p.ids_pad, dtype=jnp.int32)
  ids = _util.load(ids_ref, j, j < p.num_ids)
  rows = jnp.arange(p.rows_pad, dtype=jnp.int32)
  lane = rows < p.num_rows
  seq = _util.load(seq_ref, rows, lane, 1)
  last = _util.load(last_ref, rows, lane)
  flen = flen_ref[0]
  nreq = jnp.clip(nreq_ref[0], 0, p.num_rows)
  given = (j < p.num_ids) & (j < num_ref[0]) & (ids != 0)
  valid = given & (ids >= 1) & (ids <= n)
  if p.guard:  # guard.free(distinct=True); a refusal also refuses the decode
    why, h0, inside = _guard.reasons(held_ref, ids, given, n, distinct=True,
                                     barrier=p.barrier)
    refused, why1, page1 = _guard.first_offence(why, ids)
    _guard.finish(held_ref, ids, inside, h0, refused)
    _guard.record_status(status_ref, refused, p.op, why1, page1)
    valid = valid & ~refused
    nreq = jnp.where(refused, 0, nreq)
  valid = valid.astype(jnp.int32)
  # The decode's page count does not depend on the release.
  real = rows < nreq
  seq = jnp.where(real, seq, 1)
  needs = (real & _needs_page(seq, ps)).astype(jnp.int32)
  bad = jnp.sum((real & (seq < 1)).astype(jnp.int32))
  total_pages = jnp.sum(needs)
  # Release, as freeing.free_page_ids -> _give_back: entries at index < num that name a
  # page 1..n, in order, one block in front of the head; the count cut to the room left
  # (only double frees reach it).
  count = jnp.minimum(jnp.sum(valid), n - flen - other_ref[0])
  head = (head_ref[0] - count) % n
  rank = jnp.cumsum(valid) - valid
  pos = head + rank  # head < n and rank < count <= n: one wrap at most
  pos = jnp.where(pos >= n, pos - n, pos)
  _util.store(ring_ref, pos, ids, (valid > 0) & (rank < count))
  flen = flen + count
  if p.barrier:
    # The decode below reads ring entries that other threads of this program just
    # stored (and marks held at pages the release just cleared): a CTA barrier orders
    # those global writes before the reads.
    pltriton.debug_barrier()
  # Decode from the new head and length, as _fused_kernel with one program.
  ok = (bad == 0) & (total_pages <= flen)
  _write_slots(p, ring_ref, head, flen, ok, rows, real, last, needs, 0, out_ref,
               held_ref if p.guard else None)
  if p.guard:
    ok = ok & ~refused
  _util.store_take(head_out, len_out, ok_out, head=head, length=flen, ring_len=n,
                   pages=total_pages, ok=ok)


# ---------------------------------------------------------------------------------------
# Grid, shapes and wrappers.
# ---------------------------------------------------------------------------------------

class _Call(_util.TritonCall):
  """The decode kernels' pallas_call: one program per block of rows."""

  def spec(self):
    p = self.p
    out = jax.ShapeDtypeStruct((p.num_rows,), jnp.int32)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    take = (one, one, jax.ShapeDtypeStruct((1,), jnp.bool_))
    held = (jax.ShapeDtypeStruct((p.src_len + 1,), jnp.int32),) if p.guard else ()
    if p.release:
      ring = jax.ShapeDtypeStruct((p.src_len,), jnp.int32)
      status = (jax.ShapeDtypeStruct((3,), jnp.int32),) if p.guard else ()
      return (ring, out) + take + held + status, _release_kernel, (1,)
    if p.fused:
      return (out,) + take + held, _fused_kernel, (p.rows_pad // p.row_block,)
    return (out,), _contract_kernel, (p.rows_pad // p.row_block,)

  def aliases(self):
    p = self.p
    if p.release:  # the ring (and the record), written in place
      return {0: 0, 9: 5, 10: 6} if p.guard else {0: 0}
    return {6: 4} if p.guard else {}  # the fused kernel's record


def _make_call(fused, num_rows, page_size, src_len, row_block, num_warps, interpret,
               guard=False):
  rows_pad = _util.next_pow2(num_rows)
  row_block = min(rows_pad, row_block or tuning.DECODE_ROW_BLOCK)
  if not _util.is_pow2(row_block):
    raise ValueError(f"row_block={row_block} must be a power of two")
  p = _Params(fused=fused, num_rows=num_rows, rows_pad=rows_pad, row_block=row_block,
              page_size=page_size, src_len=src_len,
              masked_prefix=fused and row_block <= tuning.DECODE_MASKED_PREFIX_MAX_ROWS,
              guard=guard)
  if num_warps is None:  # the fused kernel may hold all rows; the contract one a block
    num_warps = tuning.decode_warps(rows_pad if fused else row_block)
  name = "jax_kvalloc_alloc_decode_triton" if fused else "jax_kvalloc_decode_indices_triton"
  return _Call(name, p, num_warps, interpret)


MAX_FUSED_ROWS = 2**16


def fused_supported(num_rows: int, ring_len: int) -> bool:
  """Whether alloc_decode_triton takes these static sizes (every program may hold all
  rows in registers)."""
  return 1 <= num_rows and _util.next_pow2(num_rows) <= MAX_FUSED_ROWS and ring_len >= 1


def decode_indices_triton(free_window: Array, seq_lens: Array, last_loc: Array,
                          page_start: Array, *, page_size: int, interpret: bool = False,
                          row_block: int | None = None,
                          num_warps: int | None = None) -> Array:
  """index_jnp.decode_indices (same arguments, same i32[B] result) on GPU. TypeError
  naming the argument for a non-integer dtype."""
  free_window, seq_lens, last_loc, page_start = _util.check_ints(
      free_window=free_window, seq_lens=seq_lens, last_loc=last_loc, page_start=page_start)
  b = seq_lens.shape[0]
  if b == 0:
    return jnp.zeros((0,), jnp.int32)
  call = _make_call(False, b, page_size, free_window.shape[0],
                    row_block or tuning.CONTRACT_DECODE_ROW_BLOCK,
                    num_warps, interpret)
  (out,) = call.run(free_window, seq_lens, last_loc, page_start)
  return out


def alloc_decode_triton(free_ring: Array, free_head: Array, free_len: Array,
                        num_reqs: Array, seq_lens: Array, last_loc: Array, *,
                        page_size: int, interpret: bool = False,
                        row_block: int | None = None,
                        num_warps: int | None = None,
                        held: Array | None = None) -> Tuple[Array, ...]:
  """A whole alloc_decode (SPEC 4.3, no need_sort merge) in one kernel launch.

  Args:
    free_ring: i32[n] the state's free ring; free_head, free_len: i32[] its head/length.
    num_reqs: i32[] real rows (rows at index >= num_reqs are padding, output 0).
    seq_lens, last_loc: i32[B].
    page_size: static.
    held: optional i32[n + 1], the ownership record's held pages (jax_kvalloc.guard),
      aliased in and out: the pages taken are marked 1 in the same launch.

  Returns:
    (i32[B] slots, i32[] new free_head, i32[] new free_len, bool[] ok), and with `held`
    the new held last; equal to jax_kvalloc.allocation.alloc_decode on the jnp path: ok
    is False (indices all 0, head and length unchanged) when a real row has seq_lens < 1
    or the pages needed exceed free_len.

  Raises TypeError naming the argument for a non-integer dtype.
  """
  free_ring, free_head, free_len, num_reqs, seq_lens, last_loc = _util.check_ints(
      free_ring=free_ring, free_head=free_head, free_len=free_len, num_reqs=num_reqs,
      seq_lens=seq_lens, last_loc=last_loc)
  b = seq_lens.shape[0]
  n = free_ring.shape[0]
  if not fused_supported(b, n):
    raise ValueError(f"alloc_decode_triton does not take {b=} rows, ring length {n} "
                     f"(see fused_supported)")
  call = _make_call(True, b, page_size, n, row_block, num_warps, interpret,
                    guard=held is not None)
  record = () if held is None else (_record_arg(held, n),)
  res = call.run(free_ring, jnp.reshape(free_head, (1,)), jnp.reshape(free_len, (1,)),
                 jnp.reshape(num_reqs, (1,)), seq_lens, last_loc, *record)
  out, head, length, ok = res[:4]
  return (out, head.reshape(()), length.reshape(()), ok.reshape(())) + tuple(res[4:])


def _record_arg(held: Array, n: int) -> Array:
  (held,) = _util.check_ints(held=held)
  if held.shape != (n + 1,):
    raise ValueError(f"held must be i32[{n + 1}] (ring length + 1), got {held.shape}")
  return held


# One program holds the batch's rows and the released page ids in registers.
MAX_RELEASE_ROWS = 2048    # tuning.DECODE_ROW_BLOCK: the fused decode's one-program size
MAX_RELEASE_IDS = 8192


def release_supported(num_rows: int, num_ids: int, ring_len: int) -> bool:
  """Whether release_alloc_decode_triton takes these static sizes (one program: rows and
  page ids, each padded to a power of two, held at once)."""
  return (1 <= num_rows and _util.next_pow2(num_rows) <= MAX_RELEASE_ROWS
          and _util.next_pow2(num_ids) <= MAX_RELEASE_IDS and ring_len >= 1)


def release_alloc_decode_triton(
    free_ring: Array, free_head: Array, free_len: Array, release_len: Array,
    page_ids: Array, num: Array, num_reqs: Array, seq_lens: Array, last_loc: Array, *,
    page_size: int, interpret: bool = False, num_warps: int | None = None,
    record: Tuple[Array, Array] | None = None, op: int = 0) -> Tuple[Array, ...]:
  """free_page_ids then alloc_decode (SPEC 10 and 4.3; need_sort off, no debug) in one
  kernel launch: a decode step's allocator work.

  Args:
    free_ring: i32[n] the state's free ring (n = num_pages); free_head, free_len: i32[]
      its head and length; release_len: i32[] the release list's length (the room for
      the release is n - free_len - release_len).
    page_ids: i32[M] pages to free, in order; entries at index >= num, zeros and ids
      outside 1..n are skipped. num: i32[] (pass M to consider all).
    num_reqs: i32[] real decode rows (rows at index >= num_reqs are padding, output 0).
    seq_lens, last_loc: i32[B].
    page_size: static.
    interpret: run in Pallas' interpreter (CPU tests).
    record: optional (held i32[n + 1], status i32[3]), the ownership record
      (jax_kvalloc.guard), aliased in and out: a release naming a page that is not held
      (outside 1..n, free, released, given twice) is refused whole, the status records
      it under `op`, and the decode is refused too; the pages taken are marked held.

  Returns:
    (ring i32[n], head i32[], length i32[], i32[B] slots, bool[] ok), and with `record`
    the new held and status last: the free list after both steps and the decode's
    result, the bits of `allocation.release_and_alloc_decode` on the jnp path
    (`alloc_decode(config, freeing.free_page_ids(config, state, page_ids, num), ...)`).
    ok False (a real row with seq_lens < 1, or more pages needed than the free list
    holds after the release): the release is done, the slots are all 0 and nothing is
    taken.

  Raises TypeError naming the argument for a non-integer dtype, ValueError for sizes
  `release_supported` refuses.
  """
  (free_ring, free_head, free_len, release_len, page_ids, num, num_reqs, seq_lens,
   last_loc) = _util.check_ints(
       free_ring=free_ring, free_head=free_head, free_len=free_len,
       release_len=release_len, page_ids=page_ids, num=num, num_reqs=num_reqs,
       seq_lens=seq_lens, last_loc=last_loc)
  page_ids = page_ids.reshape(-1)
  if page_ids.shape[0] == 0:  # nothing to free: one padding entry keeps shapes >= 1
    page_ids, num = jnp.zeros((1,), jnp.int32), jnp.zeros((), jnp.int32)
  b, m, n = seq_lens.shape[0], page_ids.shape[0], free_ring.shape[0]
  if not release_supported(b, m, n):
    raise ValueError(f"release_alloc_decode_triton does not take {b=} rows, {m} page "
                     f"ids, ring length {n} (see release_supported)")
  rows_pad, ids_pad = _util.next_pow2(b), _util.next_pow2(m)
  p = _Params(fused=True, num_rows=b, rows_pad=rows_pad, row_block=rows_pad,
              page_size=page_size, src_len=n, release=True, num_ids=m, ids_pad=ids_pad,
              barrier=not interpret,
              masked_prefix=rows_pad <= tuning.DECODE_MASKED_PREFIX_MAX_ROWS,
              guard=record is not None, op=op)
  if num_warps is None:
    num_warps = tuning.decode_warps(max(rows_pad, ids_pad))
  call = _Call("jax_kvalloc_release_alloc_decode_triton", p, num_warps, interpret)
  one = lambda x: jnp.reshape(x, (1,))
  extra = () if record is None else (_record_arg(record[0], n),
                                     _util.check_ints(status=record[1])[0].reshape(3))
  res = call.run(free_ring, one(free_head), one(free_len), one(release_len), page_ids,
                 one(num), one(num_reqs), seq_lens, last_loc, *extra)
  ring, out, head, length, ok = res[:5]
  return (ring, head.reshape(()), length.reshape(()), out, ok.reshape(())) + tuple(res[5:])
