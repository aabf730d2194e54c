"""The request table's operations on GPU: one Pallas-Triton launch per step of table work,
two when it extends.

Reference: jax_kvalloc.request_table's jnp path (SPEC 11), bit for bit: `release_rows`
(free_page_ids of each row's owned pages, in row order, then the rows cleared),
`extend_rows` (alloc_extend with prefix_lens = lens and last_loc read from the table,
the new pages appended, lens += n), `decode_rows` (alloc_decode likewise). A need_sort
merge, debug mode and the token allocator are not handled here (the caller keeps the
jnp composition for them).

`table_step_triton` runs any of the three phases, in that order, in ONE program
(grid (1,)): a phase reads the allocator state and the table as the previous phase left
them. Everything but the extend slots is in that program: the row checks (rows inside
the table and distinct, row capacity), the prefix sums, the capacity checks, the reads of
the free ring, the decode slots, the new head and length, the release's ring writes, and
the table writes (pages, lens, owned_from). The ring (when there is a release), the
pages (flattened), lens, owned_from (release), and the free list's head and length (i32[1] each)
are aliased in and out (input_output_aliases), so under donation, or a loop carry XLA
can reuse, the kernel writes them in place (an unaliased output cannot take the buffer
of a carry the call reads: XLA would copy it into the carry every step). The head and
length are loaded before the first CTA barrier and stored after the last.

The extend slots (up to tens of thousands of tokens) are the one part that is per token:
one program would write them serially. The table program writes an extend plan instead
(per row: its span of the output and triton_extend._slot's constants; the free list as
extend found it; the batch's tokens, 0 when it failed) and appends the new pages to the
table page by page (page k of the batch, ring[head + k], goes to the row whose pages end
after k: a [T, rows] comparison in registers). A second launch, `_slots_kernel`, a
program per (row, chunk) as triton_extend's "rows" layout, writes each row's slots from
its plan line and the ring the first launch left, and the zero tail. Decode, later in
the first program, needs only the table and the free list's head, both final there.

Distinct rows, without a sort and without O(B^2) work: every real row inside the table
stores its lane number at scratch[row] (one region per phase); after a CTA barrier each
reads it back, and a row given twice finds the other lane's number at least once. CTA
barriers also order each phase's table and ring writes before the next phase's reads,
and the release's loads of the rows before it clears them (one program: __syncthreads
makes a CTA's global writes visible to all its threads). A write that depends on the
value it replaces (lens += n) needs none: the data dependence orders it.

The extend slots follow triton_extend._slot (Parts 1-3 of SPEC 4.2 in one expression).

Sizes: `supported` bounds the rows of each phase and the extend tokens (one program holds
the rows and loops over the new pages); larger batches take the jnp composition, whose
kernels scale over programs.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _guard
from pallas_kernels import _util
from pallas_kernels import capacity
from pallas_kernels import triton_extend
from pallas_kernels import tuning
from pallas_kernels._util import cdiv, floordiv, mod

Array = jax.Array

MAX_DECODE_ROWS = 2048      # decode rows per call (padded), one program
MAX_EXTEND_ROWS = 256       # extend rows per call (padded): the [T, rows] row search
MAX_RELEASE_LANES = 2**14   # release rows (padded) * page columns (padded)
MAX_EXTEND_TOKENS = 2**16   # extend slots per call (one program loops over them)
ONEHOT_WORK = 2**13         # T * extend rows (padded): a tile's row search

# The extend plan (the first launch's output, the slot launch's input): per extend row a
# line of _LINE ints (token span, then triton_extend._slot's constants), then one line
# with the free list as extend found it and the batch's tokens (0 when it failed).
_TS, _TE, _A, _E, _C, _BP = range(6)
_HEAD, _FLEN, _LIMIT = range(3)
_LINE = 8


@dataclasses.dataclass(frozen=True)
class _Params:
  page_size: int
  num_pages: int      # n, the ring's length
  max_reqs: int       # R, table rows
  width: int          # W, page columns
  width_pad: int      # next power of two >= W
  rel_rows: int       # release rows given (0: no release phase)
  rel_pad: int
  ext_rows: int       # extend rows given (0: no extend phase)
  ext_pad: int
  max_tokens: int     # extend slots (static)
  tile: int           # T, extend tokens per tile
  dec_rows: int       # decode rows given (0: no decode phase)
  dec_pad: int
  barrier: bool       # False in interpret mode (one program, run in order there)
  guard: bool = False  # the ownership record (held i32[n + 1], status i32[3]) in and out
  op: int = 0          # the operation a refused release names in the status

  @property
  def in_names(self) -> Tuple[str, ...]:
    names = ("ring", "head", "flen", "rlen", "pages", "lens", "owned")
    if self.rel_rows:
      names += ("rel_rows", "rel_num")
    if self.ext_rows:
      names += ("ext_rows", "ext_n", "ext_num")
    if self.dec_rows:
      names += ("dec_rows", "dec_num")
    return names + (("held", "status") if self.guard else ())

  @property
  def out_names(self) -> Tuple[str, ...]:
    rel = self.rel_rows > 0
    names = (("ring_o",) if rel else ()) + ("pages_o", "lens_o")
    names += (("owned_o",) if rel else ()) + ("head_o", "flen_o", "ok_o")
    names += (("plan",) if self.ext_rows else ()) + (("dec_out",) if self.dec_rows else ())
    return names + ("scr",) + (("held_o", "status_o") if self.guard else ())


# ---------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------

class _Rows:
  """One phase's rows: lanes b < pad; the table row (clipped into it), real lanes
  (b < count), and the lanes that mark the scratch (real and inside the table)."""

  def __init__(self, p: _Params, rows_ref, num_ref, num: int, pad: int):
    self.b = jnp.arange(pad, dtype=jnp.int32)
    raw = _util.load(rows_ref, self.b, self.b < num)
    self.count = jnp.clip(num_ref[0], 0, num)
    self.real = self.b < self.count
    inside = (raw >= 0) & (raw < p.max_reqs)
    self.outside = jnp.sum(jnp.where(self.real & ~inside, 1, 0))
    self.mark = self.real & inside
    self.row = jnp.clip(raw, 0, p.max_reqs - 1)

  def store_marks(self, scr_ref, base: int) -> None:
    _util.store(scr_ref, base + self.row, self.b, self.mark)

  def valid(self, scr_ref, base: int) -> Array:
    """bool[]: every real row inside the table and none given twice (after the marks
    and a barrier)."""
    back = _util.load(scr_ref, base + self.row, self.mark, -1)
    return (self.outside + jnp.sum(jnp.where(self.mark & (back != self.b), 1, 0))) == 0


def _last_loc(p: _Params, pages_ref, row, pre, mask):
  """request_table._last_loc: pages[row, (pre-1)//ps] * ps + (pre-1) % ps, -1 at 0."""
  ps = p.page_size
  prev = jnp.maximum(pre - 1, 0)
  col = jnp.minimum(floordiv(prev, ps), p.width - 1)
  slot = _util.load(pages_ref, row * p.width + col, mask & (pre > 0)) * ps + mod(prev, ps)
  return jnp.where(pre > 0, slot, -1)


def _read_ring(p: _Params, ring_ref, head, flen, k, mask):
  """Free page k (ring[head + k], wrapped once), read only under mask and k < flen."""
  n = p.num_pages
  i = head + k
  i = jnp.where(i >= n, i - n, i)
  return _util.load(ring_ref, i, mask & (k >= 0) & (k < flen))


def _release(p: _Params, r, rows: _Rows, go, ring_ref, pages_ref, lens_ref, owned_ref,
             head, flen, rlen):
  """freeing.free_page_ids of the rows' owned pages (row by row, in column order), then
  the rows cleared. Returns the free list's new (head, length) and whether the ownership
  record refused the release (then nothing changes but its status; None without a
  record)."""
  ps, n, w = p.page_size, p.num_pages, p.width
  shift = p.width_pad.bit_length() - 1
  i = jnp.arange(p.rel_pad * p.width_pad, dtype=jnp.int32)
  b = i >> shift
  j = i & (p.width_pad - 1)
  live = (b < rows.count) & go
  row = jnp.clip(_util.load(r["rel_rows"], b, b < p.rel_rows), 0, p.max_reqs - 1)
  end = jnp.where(live, cdiv(_util.load(lens_ref, row, live), ps), 0)
  start = _util.load(owned_ref, row, live)
  owned = live & (j >= start) & (j < end) & (j < w)
  page = _util.load(pages_ref, row * w + j, owned)
  valid = owned & (page >= 1) & (page <= n)
  refused = None
  if p.guard:  # guard.free(distinct=True) of the owned pages (0: padding)
    held_ref = r["held_o"]
    why, h0, inside = _guard.reasons(held_ref, page, owned & (page != 0), n,
                                     distinct=True, barrier=p.barrier)
    refused, why1, page1 = _guard.first_offence(why, page)
    _guard.finish(held_ref, page, inside, h0, refused)
    _guard.record_status(r["status_o"], refused, p.op, why1, page1)
    valid = valid & ~refused
    live = live & ~refused
  valid = valid.astype(jnp.int32)
  count = jnp.minimum(jnp.sum(valid), n - flen - rlen)
  head = (head - count) % n
  rank = jnp.cumsum(valid) - valid
  pos = head + rank  # head < n and rank < count <= n: one wrap at most
  pos = jnp.where(pos >= n, pos - n, pos)
  _util.store(ring_ref, pos, page, (valid > 0) & (rank < count))
  if p.barrier:
    # The clears below do not depend on the loads above, and a row's lens and owned_from
    # are loaded by the lanes of its columns but cleared by its own lane (another
    # thread): every load first.
    pltriton.debug_barrier()
  _util.store(pages_ref, row * w + j, jnp.zeros_like(j), live & (j < w))
  clear = rows.real & go
  if refused is not None:
    clear = clear & ~refused
  _util.store(lens_ref, rows.row, jnp.zeros_like(rows.b), clear)
  _util.store(owned_ref, rows.row, jnp.zeros_like(rows.b), clear)
  return head, flen + count, refused


def _extend(p: _Params, r, rows: _Rows, go, ring_ref, pages_ref, lens_ref, head, flen):
  """request_table.extend_rows after its row checks (need_sort off): alloc_extend,
  the slots, the new pages appended, lens. Returns (head, length, ok)."""
  ps, w, n_pages = p.page_size, p.width, p.num_pages
  real = rows.real
  n = jnp.where(real, _util.load(r["ext_n"], rows.b, rows.b < p.ext_rows), 0)
  pre = jnp.where(real, _util.load(lens_ref, rows.row, real), 0)
  go = go & (jnp.sum(jnp.where((n >= 0) & (n <= w * ps - pre), 0, 1)) == 0)
  n = jnp.where(go, n, 0)
  seq = pre + n
  last = _last_loc(p, pages_ref, rows.row, pre, real)
  # allocation.alloc_extend with num_reqs = go ? count : 0.
  real2 = real & go
  pre2 = jnp.where(real2, pre, 0)
  seq2 = jnp.where(real2, seq, 0)
  rows_valid = jnp.sum(jnp.where(real2 & ((pre2 < 0) | (seq2 < pre2)), 1, 0)) == 0
  pre2 = jnp.where(rows_valid, pre2, 0)
  seq2 = jnp.where(rows_valid, seq2, 0)
  fnp = cdiv(pre2, ps)
  ext = capacity.clip_counts(seq2 - pre2, p.max_tokens)
  new_pages = capacity.clip_counts(cdiv(seq2, ps) - fnp, n_pages)
  total = jnp.sum(ext)
  total_pages = jnp.sum(new_pages)
  ok = rows_valid & (total <= p.max_tokens) & (total_pages <= flen)
  tok_end = jnp.cumsum(ext)
  tok_start = tok_end - ext
  a = pre2 - tok_start
  consts = (a, fnp * ps - a, last + 1 - tok_start, jnp.cumsum(new_pages) - new_pages - fnp,
            rows.row)
  limit = jnp.where(ok, total, 0)
  # The slots are written by the second launch (_slots_kernel, a program per row and
  # chunk) from this plan: one line per row, then the free list as extend found it.
  for v, vec in enumerate((tok_start, jnp.where(ok, tok_end, tok_start)) + consts[:4]):
    _util.store(r["plan"], rows.b * _LINE + v, vec, rows.b < p.ext_pad)
  g = p.ext_pad * _LINE
  r["plan"][g + _HEAD] = head
  r["plan"][g + _FLEN] = flen
  r["plan"][g + _LIMIT] = limit
  # The new pages, appended to their rows: page k of the batch (ring[head + k]) goes to
  # the row whose pages end after k, column fnp + k - page_start there.
  page_end = jnp.cumsum(new_pages)
  pconsts = (fnp - (page_end - new_pages), rows.row)
  lanes = jnp.arange(p.tile, dtype=jnp.int32)

  def page_tile(i, carry):
    k = i * p.tile + lanes
    at = jnp.sum(jnp.where(page_end[None, :] <= k[:, None], 1, 0), axis=1)
    onehot = rows.b[None, :] == at[:, None]
    tcol, trow = (jnp.sum(jnp.where(onehot, v[None, :], 0), axis=1) for v in pconsts)
    mine = ok & (k < total_pages)
    page = _read_ring(p, ring_ref, head, flen, k, mine)
    _util.store(pages_ref, trow * w + tcol + k, page, mine)
    if p.guard:
      _guard.mark_taken(r["held_o"], page, mine)
    return carry

  lax.fori_loop(0, cdiv(jnp.where(ok, total_pages, 0), p.tile), page_tile, 0)
  ok_e = ok & go
  _util.store(lens_ref, rows.row, seq, ok_e & real)
  taken = jnp.where(ok, total_pages, 0)
  new_head = head + taken
  new_head = jnp.where(new_head >= p.num_pages, new_head - p.num_pages, new_head)
  return new_head, flen - taken, ok_e


def _decode(p: _Params, r, rows: _Rows, go, ring_ref, pages_ref, lens_ref, head, flen):
  """request_table.decode_rows after its row checks: alloc_decode with seq = lens + 1,
  a new page appended where the token starts one, lens. Returns (head, length, ok)."""
  ps, w = p.page_size, p.width
  real = rows.real
  pre = jnp.where(real, _util.load(lens_ref, rows.row, real), 0)
  go = go & (jnp.sum(jnp.where(real & (pre >= w * ps), 1, 0)) == 0)
  seq = pre + 1
  last = _last_loc(p, pages_ref, rows.row, pre, real)
  # allocation.alloc_decode with num_reqs = go ? count : 0.
  real2 = real & go
  seq2 = jnp.where(real2, seq, 1)
  bad = jnp.sum(jnp.where(real2 & (seq2 < 1), 1, 0))
  needs = (real2 & (cdiv(seq2, ps) > cdiv(seq2 - 1, ps))).astype(jnp.int32)
  total_pages = jnp.sum(needs)
  ok = (bad == 0) & (total_pages <= flen)
  k = jnp.cumsum(needs) - needs
  page = _read_ring(p, ring_ref, head, flen, k, (needs > 0) & ok)
  out = jnp.where(needs > 0, page * ps, last + 1)
  out = jnp.where(ok & real2, out, 0)
  _util.store(r["dec_out"], rows.b, out, rows.b < p.dec_rows)
  ok_d = ok & go
  live = ok_d & real
  starts = live & (mod(pre, ps) == 0)
  col = jnp.minimum(floordiv(pre, ps), w - 1)
  _util.store(pages_ref, rows.row * w + col, floordiv(out, ps), starts)
  if p.guard:
    _guard.mark_taken(r["held_o"], page, (needs > 0) & ok)
  _util.store(lens_ref, rows.row, seq, live)
  taken = jnp.where(ok, total_pages, 0)
  new_head = head + taken
  new_head = jnp.where(new_head >= p.num_pages, new_head - p.num_pages, new_head)
  return new_head, flen - taken, ok_d


def _kernel(*refs, p: _Params):
  r = dict(zip(p.in_names + p.out_names, refs))
  rel = p.rel_rows > 0
  ring_ref = r["ring_o"] if rel else r["ring"]     # aliased: read and write the output
  owned_ref = r["owned_o"] if rel else r["owned"]
  pages_ref, lens_ref, scr = r["pages_o"], r["lens_o"], r["scr"]
  head, flen, rlen = r["head"][0], r["flen"][0], r["rlen"][0]
  phases = {}
  for name, num, pad in (("rel", p.rel_rows, p.rel_pad), ("ext", p.ext_rows, p.ext_pad),
                         ("dec", p.dec_rows, p.dec_pad)):
    if num:
      phases[name] = _Rows(p, r[f"{name}_rows"], r[f"{name}_num"], num, pad)
  base = {"rel": 0, "ext": p.max_reqs, "dec": 2 * p.max_reqs}
  for name, rows in phases.items():
    rows.store_marks(scr, base[name])
  if p.barrier:
    pltriton.debug_barrier()
  go = {name: rows.valid(scr, base[name]) for name, rows in phases.items()}
  oks = [jnp.ones((), bool)] * 3
  if rel:
    head, flen, refused = _release(p, r, phases["rel"], go["rel"], ring_ref, pages_ref,
                                   lens_ref, owned_ref, head, flen, rlen)
    oks[0] = go["rel"] if refused is None else go["rel"] & ~refused
    if p.barrier:
      pltriton.debug_barrier()  # the ring and the cleared rows, before they are read
  if p.ext_rows:
    head, flen, oks[1] = _extend(p, r, phases["ext"], go["ext"], ring_ref, pages_ref,
                                 lens_ref, head, flen)
    if p.barrier:
      pltriton.debug_barrier()  # the appended pages and lens, before decode reads them
  if p.dec_rows:
    head, flen, oks[2] = _decode(p, r, phases["dec"], go["dec"], ring_ref, pages_ref,
                                 lens_ref, head, flen)
  r["head_o"][0] = head
  r["flen_o"][0] = flen
  for i, ok in enumerate(oks):
    r["ok_o"][i] = ok.astype(jnp.int32)


def _slots_kernel(ring_ref, plan_ref, out_ref, *, p: "_SlotParams"):
  """The extend slots, program pid = row * C + chunk: its row's blocks chunk, chunk + C,
  ... of T tokens from the plan's line (triton_extend._slot), then its share of the zero
  tail [limit, max_tokens). ring_ref i32[n] (as the first launch left it), plan_ref
  i32[(rows_pad + 1) * 8], out_ref i32[max_tokens]."""
  ps, tile, grid = p.page_size, p.tile, p.rows * p.chunks
  pid = pl.program_id(0)
  row = floordiv(pid, p.chunks) if p.chunks > 1 else pid
  chunk = mod(pid, p.chunks) if p.chunks > 1 else 0
  g = p.rows_pad * _LINE
  head, flen, limit = plan_ref[g + _HEAD], plan_ref[g + _FLEN], plan_ref[g + _LIMIT]
  ts, te, a, e, c, bp = (plan_ref[row * _LINE + v] for v in (_TS, _TE, _A, _E, _C, _BP))
  read_page = lambda k, mask: _read_ring(p, ring_ref, head, flen, k, mask)
  triton_extend.row_and_tail(ps, tile, p.chunks, grid, pid, chunk, ts, te, (a, e, c, bp),
                             read_page, limit, p.max_tokens, out_ref)


@dataclasses.dataclass(frozen=True)
class _SlotParams:
  page_size: int
  num_pages: int
  rows: int        # extend rows given
  rows_pad: int
  max_tokens: int
  tile: int        # T, tokens per block
  chunks: int      # C, programs per row


class _SlotCall(_util.TritonCall):
  """The extend slots' pallas_call: a program per (row, chunk)."""

  def spec(self):
    p = self.p
    out = jax.ShapeDtypeStruct((p.max_tokens,), jnp.int32)
    return (out,), _slots_kernel, (p.rows * p.chunks,)


# ---------------------------------------------------------------------------------------
# Shapes and the wrapper.
# ---------------------------------------------------------------------------------------

class _Call(_util.TritonCall):
  """The table kernel's pallas_call: one program."""

  def spec(self):
    p = self.p
    i32 = lambda n: jax.ShapeDtypeStruct((max(n, 1),), jnp.int32)
    shapes = dict(ring_o=i32(p.num_pages), pages_o=i32(p.max_reqs * p.width),
                  lens_o=i32(p.max_reqs), owned_o=i32(p.max_reqs), head_o=i32(1),
                  flen_o=i32(1), ok_o=i32(3), plan=i32((p.ext_pad + 1) * _LINE),
                  dec_out=i32(p.dec_rows), scr=i32(3 * p.max_reqs),
                  held_o=i32(p.num_pages + 1), status_o=i32(3))
    return tuple(shapes[k] for k in p.out_names), _kernel, (1,)

  def aliases(self):
    ins, outs = self.p.in_names, self.p.out_names
    # head and flen too: an output that is not aliased to its input cannot take the
    # buffer of a loop carry the call reads, so XLA would copy it into the carry.
    return {ins.index(k): outs.index(k + "_o")
            for k in ("ring", "head", "flen", "pages", "lens", "owned", "held", "status")
            if k + "_o" in outs}


def supported(*, max_reqs: int, width: int, num_pages: int, page_size: int,
              release: int = 0, extend: int = 0, max_tokens: int = 0,
              decode: int = 0) -> bool:
  """Whether `table_step_triton` takes these static sizes (rows per phase, 0: none)."""
  if not (max_reqs >= 1 and width >= 1 and num_pages >= 1 and page_size >= 1):
    return False
  if width * page_size > _util.INT32_MAX or max_reqs * width > _util.INT32_MAX:
    return False
  if 3 * max_reqs > _util.INT32_MAX:
    return False
  if release and _util.next_pow2(release) * _util.next_pow2(width) > MAX_RELEASE_LANES:
    return False
  if extend and (_util.next_pow2(extend) > MAX_EXTEND_ROWS or max_tokens < 1
                 or max_tokens > MAX_EXTEND_TOKENS
                 or capacity.sums_may_wrap(extend, max_tokens)
                 or capacity.sums_may_wrap(extend, num_pages)):
    return False
  if decode and _util.next_pow2(decode) > MAX_DECODE_ROWS:
    return False
  return bool(release or extend or decode)


def table_step_triton(free_ring: Array, free_head: Array, free_len: Array,
                      release_len: Array, pages: Array, lens: Array, owned_from: Array, *,
                      page_size: int, release: Optional[Tuple[Array, Array]] = None,
                      extend: Optional[Tuple[Array, Array, Array]] = None,
                      max_tokens: int = 0,
                      decode: Optional[Tuple[Array, Array]] = None,
                      interpret: bool = False,
                      num_warps: Optional[int] = None,
                      record: Optional[Tuple[Array, Array]] = None,
                      op: int = 0) -> Dict[str, Array]:
  """The request table's release, extend and decode (each optional, in that order) in one
  kernel launch, two with extend (the slots by a program per row; SPEC 11; need_sort off,
  no debug, paged pool).

  Args:
    free_ring: i32[n] the free ring (n = num_pages); free_head, free_len: i32[];
      release_len: i32[] (the room for released pages is n - free_len - release_len).
    pages: i32[R, W] the table's pages; lens, owned_from: i32[R].
    page_size: static.
    release: (rows i32[Br], num_rows i32[]) or None: request_table.release_rows.
    extend: (rows i32[Be], n i32[Be], num_rows i32[]) or None: extend_rows with
      `max_tokens` (static) slots.
    decode: (rows i32[Bd], num_rows i32[]) or None: decode_rows.
    interpret: run in Pallas' interpreter (CPU tests).
    record: optional (held i32[n + 1], status i32[3]), the ownership record
      (jax_kvalloc.guard), aliased in and out: a release naming a page that is not held
      (or one page in two columns) is refused whole (release_ok False, rows kept) and
      recorded under `op`; the pages extend and decode take are marked held.

  Returns:
    dict with "ring", "head", "length" (the free list after every phase), "pages",
    "lens", "owned_from" (the table after every phase), with `record` "held" and
    "status", and per phase present: "release_ok" bool[], "extend_slots"
    i32[max_tokens], "extend_ok" bool[], "decode_slots" i32[Bd], "decode_ok" bool[]:
    the bits of the jnp path's release_rows, extend_rows, decode_rows applied in turn.

  Raises TypeError naming the argument for a non-integer dtype, ValueError for sizes
  `supported` refuses.
  """
  (free_ring, free_head, free_len, release_len, pages, lens, owned_from), sizes = (
      _util.table_step_args("table_step_triton", supported, page_size, max_tokens,
                            release, extend, decode, free_ring=free_ring,
                            free_head=free_head, free_len=free_len, release_len=release_len,
                            pages=pages, lens=lens, owned_from=owned_from))
  max_reqs, width = pages.shape
  n = free_ring.shape[0]
  ext_pad = _util.next_pow2(sizes["extend"]) if extend is not None else 1
  max_new_pages = min(n, max_tokens // page_size + sizes["extend"] + 1)
  tile = min(_util.next_pow2(max_new_pages), max(16, ONEHOT_WORK // ext_pad))
  p = _Params(page_size=page_size, num_pages=n, max_reqs=max_reqs, width=width,
              width_pad=_util.next_pow2(width), rel_rows=sizes["release"],
              rel_pad=_util.next_pow2(sizes["release"]), ext_rows=sizes["extend"],
              ext_pad=ext_pad, max_tokens=max_tokens if extend is not None else 0,
              tile=tile, dec_rows=sizes["decode"],
              dec_pad=_util.next_pow2(sizes["decode"]), barrier=not interpret,
              guard=record is not None, op=op)
  if num_warps is None:
    num_warps = tuning.table_warps(max(p.dec_pad, p.rel_pad * p.width_pad // 4,
                                       p.ext_pad * 4))
  one = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
  args = [free_ring, one(free_head), one(free_len), one(release_len), pages.reshape(-1),
          lens, owned_from]
  if release is not None:
    rows, num = _util.check_ints(release_rows=release[0], release_num=release[1])
    args += [rows, one(num)]
  if extend is not None:
    rows, n_tok, num = _util.check_ints(extend_rows=extend[0], extend_n=extend[1],
                                        extend_num=extend[2])
    args += [rows, n_tok, one(num)]
  if decode is not None:
    rows, num = _util.check_ints(decode_rows=decode[0], decode_num=decode[1])
    args += [rows, one(num)]
  if record is not None:
    held, status = _util.check_ints(held=record[0], status=record[1])
    if held.shape != (n + 1,):
      raise ValueError(f"held must be i32[{n + 1}] (ring length + 1), got {held.shape}")
    args += [held, status.reshape(3)]
  call = _Call("jax_kvalloc_table_step_triton", p, num_warps, interpret)
  outs = dict(zip(p.out_names, call.run(*args)))
  ok = outs["ok_o"] > 0
  result = dict(ring=outs.get("ring_o", free_ring), head=outs["head_o"].reshape(()),
                length=outs["flen_o"].reshape(()),
                pages=outs["pages_o"].reshape(max_reqs, width), lens=outs["lens_o"],
                owned_from=outs.get("owned_o", owned_from))
  if record is not None:
    result["held"], result["status"] = outs["held_o"], outs["status_o"]
  if release is not None:
    result["release_ok"] = ok[0]
  if extend is not None:
    block, chunks, warps = tuning.extend_rows_block(p.ext_rows, p.max_tokens)
    sp = _SlotParams(page_size=page_size, num_pages=n, rows=p.ext_rows, rows_pad=p.ext_pad,
                     max_tokens=p.max_tokens, tile=block, chunks=chunks)
    slots = _SlotCall("jax_kvalloc_table_extend_slots_triton", sp, warps,
                      interpret).run(result["ring"], outs["plan"])
    result["extend_slots"], result["extend_ok"] = slots[0], ok[1]
  if decode is not None:
    result["decode_slots"], result["decode_ok"] = outs["dec_out"], ok[2]
  return result
