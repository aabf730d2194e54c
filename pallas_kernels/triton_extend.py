"""alloc_extend slot indices on GPU: a Pallas kernel through the Triton lowering.

Reference: jax_kvalloc.index_jnp.extend_indices (the contract, SPEC 4.2). Both entry
points tile the output (program p owns tokens [p*T, p*T + T)) and compute each token's
slot from its row's constants, SPEC's three parts in one formula:

  pos = t + A                     sequence position of token t       (A = pre - tok_start)
  Part 1 (t < E):  t + C          rest of the prefix's last page     (C = last_loc+1-tok_start)
  Parts 2/3:       free[k]*ps + pos % ps,  k = Bp + pos // ps        (Bp = page_start - fnp)

where fnp = ceil(pre/ps) and E = fnp*ps - A. They differ in how a token finds its row:

- `extend_indices_triton`, the contract: the caller passes the prefix sums, so every
  token binary-searches tok_start in global memory (log2(B) L1/L2 gathers, statically
  unrolled) and gathers its row's four inputs. Cost grows with tokens * log(rows).
- `alloc_extend_triton`, a whole alloc_extend in one launch: it reads the state's free
  ring directly and computes the validity and capacity checks, the prefix sums, the
  indices (all 0 on failure) and the new head/length of the free list. Every program
  loads all rows (one power-of-two vector), forms the prefix sums in registers
  (`jnp.cumsum` lowers to tt.scan) and finds the rows overlapping its tile (r_lo = #rows
  ending at or before its first token, r_hi likewise for its last). Those rows'
  constants go to a per-program scratch in global memory, one 32-byte line per row;
  after a CTA barrier each token finds its row there by binary lifting over tok_end
  (one line per probe, L1-resident; none when one row covers the tile). If more than W
  rows overlap a tile (many tiny or empty rows), the tile takes several passes. The row
  work is repeated by every program, so `fused_supported` limits rows * programs; beyond
  it the allocator computes the prefix sums in XLA and calls the contract kernel.

`alloc_extend_triton` has two layouts (static `layout`, default `tuning.extend_layout`):

- "tiles", as above: a program per tile of T output tokens, rows found by a search.
- "rows": a program per (row, chunk), grid B * C. Every program loads all rows once (the
  batch's checks and totals, and its row's token and page offsets as masked sums over
  the rows before it: no prefix scan, no scratch, no barrier), then writes its row's
  blocks chunk, chunk + C, chunk + 2C, ... of T tokens each (a loop with a traced trip
  count), and last its share of the zero tail [total, out_len) (blocks pid, pid + B*C,
  ...; all of out_len when the batch fails). C and T come from the mean row length
  (`tuning.extend_rows_block`), so a batch of even rows takes about one block per
  program; a row far above the mean loops on its C programs (one row of all out_len
  tokens: out_len / (C * T) blocks in a row on each), and programs whose chunk lies past
  their row's end do only the row loads.

Every read of the free list is masked by the capacity check (fused) or clamped into the
window (contract), and every index is clamped into its array: no read leaves its buffer
(SGLang issue 34399).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _guard
from pallas_kernels import _util
from pallas_kernels import capacity
from pallas_kernels import tuning
from pallas_kernels._util import INT32_MAX, cdiv, floordiv, mod

Array = jax.Array

# Per-row values kept in the fused kernel's search scratch: one 8-int (32-byte) line per
# row, so the probe that reads a row's tok_end brings its other values into L1.
_TOK_END, _A, _E, _C, _BP = range(5)
_LINE = 8

MAX_FUSED_ROWS = capacity.MAX_EXACT_LANES  # the exact total check's lane limit
MAX_FUSED_ROW_WORK = 2**17   # rows_pad * programs: beyond, the contract path scales better
LAYOUTS = ("rows", "tiles")  # alloc_extend_triton's layouts (module docstring)


@dataclasses.dataclass(frozen=True)
class _Params:
  fused: bool          # whole allocation (ring, checks, head/len) or the bare contract
  num_rows: int        # B
  rows_pad: int        # next power of two >= B
  tile: int            # T, output tokens per program (power of two)
  window: int          # W, rows per search pass (power of two; fused)
  page_size: int
  out_len: int
  src_len: int         # length of the free ring (fused) or of the window (contract)
  barrier: bool        # False in interpret mode (programs run one after another there)
  exact_totals: bool   # rows * limit may pass 2**31: detect totals over the limits exactly
  layout: str = "tiles"  # fused: one of LAYOUTS (the module docstring)
  chunks: int = 1      # C, programs per row (layout "rows"); `tile` is then their block
  guard: bool = False  # the ownership record's held (i32[n + 1]) aliased in and out;
                       # the first token of each new page marks that page taken
  held_len: int = 0    # contract kernel with guard: n + 1 (its window is shorter)


# ---------------------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------------------

def _slot(ps, t, a, e, c, bp, read_page, mask, mark=None):
  """Slots of tokens t from their rows' constants (see the module docstring). `mark`
  (page, mask) (the ownership record): called with the token that starts each new page
  (Parts 2 and 3 start every page at offset 0), to mark its page taken."""
  pos = t + a
  part1 = t < e
  page = read_page(bp + floordiv(pos, ps), mask & ~part1)
  if mark is not None:
    mark(page, mask & ~part1 & (mod(pos, ps) == 0))
  return jnp.where(part1, t + c, page * ps + mod(pos, ps))


def _marker(held_ref, real_only: bool = False):
  """The `mark` of _slot for a held ref (None: no record). real_only: pages >= 1 only
  (the contract kernel's window holds 0 past the free list, e.g. for a failed call)."""
  if held_ref is None:
    return None
  if real_only:
    return lambda page, mask: _guard.mark_taken(held_ref, page, mask & (page >= 1))
  return lambda page, mask: _guard.mark_taken(held_ref, page, mask)


def _contract_kernel(win_ref, pre_ref, seq_ref, last_ref, ts_ref, pst_ref,  # inputs
                     *refs,  # [held (aliased)]; output: out_ref, [held]
                     p: _Params):
  """win_ref i32[P]; row refs i32[B]; out_ref i32[out_len]; held i32[n + 1] (p.guard:
  the pages of the window that the tokens start are marked; window entries 0, a failed
  call's, mark nothing)."""
  out_ref, held_ref = (refs[1], refs[2]) if p.guard else (refs[0], None)
  ps, b = p.page_size, p.num_rows
  t = pl.program_id(0) * p.tile + jnp.arange(p.tile, dtype=jnp.int32)
  total = ts_ref[b - 1] + seq_ref[b - 1] - pre_ref[b - 1]
  live = t < total
  # count = #rows with tok_start <= t; the row holding t is count - 1 (an empty row
  # shares its tok_start with a later one, so it never ends the count).
  count = jnp.zeros_like(t)
  step = 1 << (b.bit_length() - 1)
  while step:
    cand = count + step
    inside = cand <= b
    ts = _util.load(ts_ref, cand - 1, live & inside, INT32_MAX)
    count = jnp.where(inside & (ts <= t), cand, count)
    step >>= 1
  row = jnp.clip(count - 1, 0, b - 1)
  pre = _util.load(pre_ref, row, live)
  tok_start = _util.load(ts_ref, row, live)
  last = _util.load(last_ref, row, live)
  page_start = _util.load(pst_ref, row, live)
  fnp = cdiv(pre, ps)
  a = pre - tok_start

  def read_page(k, mask):
    return _util.load(win_ref, k, mask)  # clamped into the window, as the contract says

  slot = _slot(ps, t, a, fnp * ps - a, last + 1 - tok_start, page_start - fnp, read_page,
               live, _marker(held_ref, real_only=True))
  _util.store(out_ref, t, jnp.where(live, slot, 0), t < p.out_len)


def _fill_tile(p: _Params, pid, table, limit, read_page, out_ref, scr_ref, held_ref=None):
  """Writes the output tile of program `pid` (fused kernel): slots of tokens t < limit,
  0 after. table: per-row constants, each i32[rows_pad], tok_end non-decreasing."""
  tile, win = p.tile, p.window
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  t0 = pid * tile
  t = t0 + jnp.arange(tile, dtype=jnp.int32)
  tok_end = table[_TOK_END]
  ntok = jnp.clip(limit - t0, 0, tile)
  # r_lo and r_hi (each < 2**15) in one reduction.
  both = jnp.sum(jnp.where(tok_end <= t0, 1, 0) + jnp.where(tok_end <= t0 + ntok - 1,
                                                              1 << 16, 0))
  r_lo = both & 0xFFFF
  r_hi = both >> 16
  base = pid * (win * _LINE)

  def one_pass(carry):
    w0, acc, done = carry
    nw = jnp.minimum(win, r_hi - w0 + 1)
    sel = (r >= w0) & (r < w0 + nw)
    for v, vec in enumerate(table):
      _util.store(scr_ref, base + (r - w0) * _LINE + v, vec, sel)
    if p.barrier:
      pltriton.debug_barrier()

    # Binary lifting: pos = #window rows with tok_end <= t.
    def lift(c):
      step, pos = c
      cand = pos + step
      inside = cand <= nw
      te = _util.load(scr_ref, base + (cand - 1) * _LINE + _TOK_END, inside, INT32_MAX)
      return step >> 1, jnp.where(inside & (te <= t), cand, pos)

    _, pos = lax.while_loop(lambda c: c[0] > 0, lift,
                            (_util.highest_pow2_at_most(nw), jnp.zeros_like(t)))
    mine = (done == 0) & (pos < nw) & (t < limit)
    at = base + jnp.minimum(pos, win - 1) * _LINE
    a, e, c, bp = (_util.load(scr_ref, at + v, mine) for v in (_A, _E, _C, _BP))
    slot = _slot(p.page_size, t, a, e, c, bp, read_page, mine, _marker(held_ref))
    if p.barrier:
      pltriton.debug_barrier()  # everyone has read the scratch before it is rewritten
    return (w0 + nw, jnp.where(mine, slot, acc), jnp.where(mine, 1, done))

  zeros = jnp.zeros_like(t)
  _, acc, _ = lax.while_loop(lambda c: (ntok > 0) & (c[0] <= r_hi), one_pass,
                             (r_lo, zeros, zeros))
  _util.store(out_ref, t, jnp.where(t < limit, acc, 0), t < p.out_len)


class _Batch(NamedTuple):
  """The fused kernels' view of the whole batch, which every program computes: per-row
  i32[rows_pad] vectors (padded rows 0, and all rows 0 when one is invalid) and the
  verdict."""
  nrows: Array        # i32[] real rows, num_reqs clipped into [0, B]
  pre: Array          # prefix_lens
  fnp: Array          # ceil(pre / ps): the prefix's pages
  ext: Array          # new tokens, clipped by the capacity rule
  new_pages: Array    # new pages, clipped likewise
  total: Array        # i32[] sum(ext), exact when ok
  total_pages: Array  # i32[] sum(new_pages), exact when ok
  ok: Array           # bool[] rows valid, tokens <= out_len, pages <= free_len


def _batch(p: _Params, flen, nreq_ref, pre_ref, seq_ref) -> _Batch:
  """Loads every row and applies the validity and capacity checks (capacity.py)."""
  ps, n = p.page_size, p.src_len
  nrows = jnp.clip(nreq_ref[0], 0, p.num_rows)
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  real = r < nrows
  pre = _util.load(pre_ref, r, real)
  seq = _util.load(seq_ref, r, real)
  rows_valid = jnp.sum(jnp.where(real & ((pre < 0) | (seq < pre)), 1, 0)) == 0
  pre = jnp.where(rows_valid, pre, 0)
  seq = jnp.where(rows_valid, seq, 0)
  fnp = cdiv(pre, ps)
  # The capacity rule of pallas_kernels.capacity: counts clipped to limit + 1 (the ring
  # bounds free_len), so that the sums below wrap only where `exact_totals` says.
  ext = capacity.clip_counts(seq - pre, p.out_len)
  new_pages = capacity.clip_counts(cdiv(seq, ps) - fnp, n)
  total = jnp.sum(ext)
  total_pages = jnp.sum(new_pages)
  if p.exact_totals:  # the int32 sums could wrap: compare the true sums with the limits
    ok = (rows_valid & ~capacity.sum_exceeds(ext, jnp.int32(p.out_len))
          & ~capacity.sum_exceeds(new_pages, flen))
  else:
    ok = rows_valid & (total <= p.out_len) & (total_pages <= flen)
  return _Batch(nrows, pre, fnp, ext, new_pages, total, total_pages, ok)


def _ring_reader(p: _Params, ring_ref, head, flen, ok):
  """read_page(k, mask): free page k (ring[head + k], wrapped), read only where the
  batch fits and k is inside the free list; 0 elsewhere."""
  n = p.src_len

  def read_page(k, mask):
    i = head + k
    i = jnp.where(i >= n, i - n, i)
    return _util.load(ring_ref, i, mask & ok & (k >= 0) & (k < flen))
  return read_page


def _own_row(p: _Params, b: _Batch, row, pre_ref, seq_ref, last_ref):
  """A per-row layout's row `row` (i32[], may be >= B: no row): (bool[rows_pad] rows
  before it, its tokens' span tok_start, tok_end in the output, its _slot constants
  (a, e, c, bp)). Its offsets are masked sums over the rows before it; its own inputs
  come by three scalar loads (a lane of the vectors would cost a reduction each). Only
  a row of a batch that fits has tokens (tok_end > tok_start), and then its clipped and
  raw counts agree and its offsets are exact."""
  ps = p.page_size
  before = jnp.arange(p.rows_pad, dtype=jnp.int32) < row
  tok_start = jnp.sum(jnp.where(before, b.ext, 0))
  page_start = jnp.sum(jnp.where(before, b.new_pages, 0))
  live = b.ok & (row < b.nrows)
  pre = _util.load(pre_ref, row, live)
  ext = _util.load(seq_ref, row, live) - pre
  last = _util.load(last_ref, row, live)
  fnp = cdiv(pre, ps)
  a = pre - tok_start
  return (before, tok_start, tok_start + ext,
          (a, fnp * ps - a, last + 1 - tok_start, page_start - fnp))


def _fused_kernel(ring_ref, head_ref, flen_ref, nreq_ref,                  # inputs: state
                  pre_ref, seq_ref, last_ref,                              # inputs: batch
                  *refs,  # [held (aliased)]; out, head, len, ok, scratch, [held]
                  p: _Params):
  """Layout "tiles". ring_ref i32[n]; head/flen/nreq i32[1]; row refs i32[B]; out_ref
  i32[out_len]; head_out/len_out i32[1]; ok_out bool[1]; scr_ref i32[grid * W * 8]
  (search scratch); held i32[n + 1] (p.guard)."""
  out_ref, head_out, len_out, ok_out, scr_ref, held_ref = _outputs(p, refs, 5)
  ps = p.page_size
  pid = pl.program_id(0)
  head = head_ref[0]
  flen = flen_ref[0]
  b = _batch(p, flen, nreq_ref, pre_ref, seq_ref)
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  last = _util.load(last_ref, r, r < p.num_rows)
  tok_end = jnp.cumsum(b.ext)
  page_start = jnp.cumsum(b.new_pages) - b.new_pages
  a = b.pre - (tok_end - b.ext)
  table = (tok_end, a, b.fnp * ps - a, last + 1 - (tok_end - b.ext), page_start - b.fnp)
  read_page = _ring_reader(p, ring_ref, head, flen, b.ok)
  limit = jnp.where(b.ok, b.total, 0)
  _fill_tile(p, pid, table, limit, read_page, out_ref, scr_ref, held_ref)

  _store_take_once(p, pid, b, head, flen, head_out, len_out, ok_out)


def _outputs(p: _Params, refs, count: int):
  """The fused kernels' output refs after the inputs (`count` of them), then the
  ownership record's held ref (the output one, aliased to the extra input) or None."""
  if p.guard:
    return tuple(refs[1:1 + count]) + (refs[1 + count],)
  return tuple(refs[:count]) + (None,)


def _store_take_once(p: _Params, pid, b, head, flen, head_out, len_out, ok_out) -> None:
  """Program 0 writes the new head, length and ok of the fused extend (every layout)."""
  @pl.when(pid == 0)
  def _():
    _util.store_take(head_out, len_out, ok_out, head=head, length=flen, ring_len=p.src_len,
                     pages=b.total_pages, ok=b.ok)


def _rows_kernel(ring_ref, head_ref, flen_ref, nreq_ref,    # inputs: state
                 pre_ref, seq_ref, last_ref,                # inputs: batch
                 *refs,  # [held (aliased)]; out, head, len, ok, [held]
                 p: _Params):
  """Layout "rows": program pid = row * C + chunk (module docstring). Refs as in
  _fused_kernel, no scratch."""
  out_ref, head_out, len_out, ok_out, held_ref = _outputs(p, refs, 4)
  ps, tile, grid = p.page_size, p.tile, p.num_rows * p.chunks
  pid = pl.program_id(0)
  row = floordiv(pid, p.chunks)
  chunk = mod(pid, p.chunks)
  head = head_ref[0]
  flen = flen_ref[0]
  b = _batch(p, flen, nreq_ref, pre_ref, seq_ref)
  _, tok_start, tok_end, consts = _own_row(p, b, row, pre_ref, seq_ref, last_ref)
  read_page = _ring_reader(p, ring_ref, head, flen, b.ok)
  row_and_tail(ps, tile, p.chunks, grid, pid, chunk, tok_start, tok_end, consts, read_page,
               jnp.where(b.ok, b.total, 0), p.out_len, out_ref, held_ref)
  _store_take_once(p, pid, b, head, flen, head_out, len_out, ok_out)


def row_and_tail(ps: int, tile: int, chunks: int, grid: int, pid, chunk, tok_start,
                 tok_end, consts, read_page, tail_start, out_len: int, out_ref,
                 held_ref=None) -> None:
  """The "rows" layout's writes of program pid (its row's chunk `chunk` of C = chunks):
  the row's slots in blocks chunk, chunk + C, ... of `tile` tokens of [tok_start,
  tok_end) (_slot with consts = (a, e, c, bp); held_ref: the pages taken are marked),
  then its share of the zero tail [tail_start, out_len) (blocks pid, pid + grid, ...).
  Also the request table's slot kernel (triton_table)."""
  lanes = jnp.arange(tile, dtype=jnp.int32)

  def row_block(i, carry):
    t = tok_start + (chunk + i * chunks) * tile + lanes
    mine = t < tok_end
    _util.store(out_ref, t, _slot(ps, t, *consts, read_page, mine, _marker(held_ref)),
                mine)
    return carry

  blocks = cdiv(tok_end - tok_start, tile)  # 0 for padded rows and failed batches
  lax.fori_loop(0, cdiv(jnp.maximum(blocks - chunk, 0), chunks), row_block, 0)

  def tail_block(i, carry):
    t = tail_start + (pid + i * grid) * tile + lanes
    _util.store(out_ref, t, jnp.zeros_like(t), t < out_len)
    return carry

  blocks = cdiv(out_len - tail_start, tile)
  lax.fori_loop(0, cdiv(jnp.maximum(blocks - pid, 0), grid), tail_block, 0)


# ---------------------------------------------------------------------------------------
# Grid, shapes and wrappers.
# ---------------------------------------------------------------------------------------

def _params(fused, num_rows, page_size, out_len, src_len, tile, window, interpret,
            layout="tiles", chunks=None, guard=False):
  rows_pad = _util.next_pow2(num_rows)
  if layout == "rows":
    tile, default_chunks, _ = tuning.extend_rows_block(num_rows, out_len, tile)
    chunks = default_chunks if chunks is None else chunks
    if not (_util.is_pow2(tile) and isinstance(chunks, int) and chunks >= 1):
      raise ValueError(f"tile={tile} must be a power of two and chunks={chunks} an int "
                       ">= 1")
    return _Params(fused=True, num_rows=num_rows, rows_pad=rows_pad, tile=tile, window=1,
                   page_size=page_size, out_len=out_len, src_len=src_len,
                   barrier=not interpret,
                   exact_totals=_may_wrap(num_rows, out_len, src_len), layout=layout,
                   chunks=chunks, guard=guard)
  default_tile, _ = tuning.extend_tile_warps(rows_pad, out_len, fused)
  tile = min(_util.next_pow2(out_len), tile or default_tile)
  window = min(rows_pad, window or tuning.EXTEND_WINDOW)
  if not (_util.is_pow2(tile) and _util.is_pow2(window)):
    raise ValueError(f"tile={tile} and window={window} must be powers of two")
  return _Params(fused=fused, num_rows=num_rows, rows_pad=rows_pad, tile=tile,
                 window=window, page_size=page_size, out_len=out_len, src_len=src_len,
                 barrier=not interpret,
                 exact_totals=fused and _may_wrap(num_rows, out_len, src_len),
                 guard=guard)


def _may_wrap(num_rows: int, out_len: int, ring_len: int) -> bool:
  return (capacity.sums_may_wrap(num_rows, out_len)
          or capacity.sums_may_wrap(num_rows, ring_len))


def fused_supported(num_rows: int, out_len: int, ring_len: int) -> bool:
  """Whether alloc_extend_triton takes these static sizes: every program holds all rows
  in registers, and its exact total check (int32 sums could wrap) needs <= 2**15 lanes."""
  return (1 <= num_rows and _util.next_pow2(num_rows) <= MAX_FUSED_ROWS
          and out_len >= 1 and ring_len >= 1)


def fused_preferred(num_rows: int, out_len: int, ring_len: int) -> bool:
  """Whether the one-launch kernel is the better GPU path: it repeats the row work in
  every program (rows_pad * programs), which must stay small next to the tokens."""
  if not fused_supported(num_rows, out_len, ring_len):
    return False
  rows_pad = _util.next_pow2(num_rows)
  tile, _ = tuning.extend_tile_warps(rows_pad, out_len, True)
  return rows_pad * pl.cdiv(out_len, tile) <= MAX_FUSED_ROW_WORK


def _default_warps(p: _Params) -> int:
  if p.layout == "rows":
    return tuning.extend_rows_block(p.num_rows, p.out_len, p.tile)[2]
  tile, warps = tuning.extend_tile_warps(p.rows_pad, p.out_len, p.fused)
  if p.tile != tile:  # a tile set by hand: warps by the same rule
    warps = max(1, min(8, p.tile // 256))
  return warps


class _Call(_util.TritonCall):
  """The extend kernels' pallas_call: one program per tile of output tokens, or per
  (row, chunk) in the fused kernel's "rows" layout."""

  def spec(self):
    p = self.p
    grid = pl.cdiv(p.out_len, p.tile)
    out = jax.ShapeDtypeStruct((p.out_len,), jnp.int32)
    if p.fused:
      one = jax.ShapeDtypeStruct((1,), jnp.int32)
      flag = jax.ShapeDtypeStruct((1,), jnp.bool_)
      held = (jax.ShapeDtypeStruct((p.src_len + 1,), jnp.int32),) if p.guard else ()
      if p.layout == "rows":
        return (out, one, one, flag) + held, _rows_kernel, (p.num_rows * p.chunks,)
      scratch = jax.ShapeDtypeStruct((grid * p.window * _LINE,), jnp.int32)
      return (out, one, one, flag, scratch) + held, _fused_kernel, (grid,)
    held = (jax.ShapeDtypeStruct((p.held_len,), jnp.int32),) if p.guard else ()
    return (out,) + held, _contract_kernel, (grid,)

  def aliases(self):
    p = self.p
    if not p.guard:
      return {}
    if not p.fused:
      return {6: 1}   # the contract kernel's held
    return {7: 4 if p.layout == "rows" else 5}  # held, written in place


def _layout(layout: str | None, num_rows: int, out_len: int) -> str:
  """alloc_extend_triton's layout: the argument, checked, or the default rule."""
  if layout is None:
    return tuning.extend_layout(_util.next_pow2(num_rows), out_len)
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
  return layout


def _i32(x) -> Array:
  return jnp.asarray(x, jnp.int32)


def extend_indices_triton(free_window: Array, prefix_lens: Array, seq_lens: Array,
                          last_loc: Array, tok_start: Array, page_start: Array, *,
                          page_size: int, out_len: int, interpret: bool = False,
                          tile: int | None = None, window: int | None = None,
                          num_warps: int | None = None, held: Array | None = None):
  """index_jnp.extend_indices (same arguments, same i32[out_len] result) on GPU.

  tile/num_warps override the defaults (powers of two); for tuning. window is unused
  (the contract kernel searches the caller's tok_start directly). held: optional
  i32[n + 1], the ownership record's held pages, aliased in and out: the window pages
  the tokens take (entries >= 1) are marked 1 in the same launch, and (out, held) is
  returned. TypeError naming the argument for a non-integer dtype.
  """
  args, trivial = _util.extend_contract_args(out_len, free_window, prefix_lens, seq_lens,
                                             last_loc, tok_start, page_start)
  if trivial is not None:
    return trivial if held is None else (trivial, held)
  free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start = args
  b = prefix_lens.shape[0]
  p = _params(False, b, page_size, out_len, free_window.shape[0], tile, window, interpret,
              guard=held is not None)
  extra = ()
  if held is not None:
    (held,) = _util.check_ints(held=held)
    p = dataclasses.replace(p, held_len=held.shape[0])
    extra = (held,)
  call = _Call("jax_kvalloc_extend_indices_triton", p, num_warps or _default_warps(p),
               interpret)
  res = call.run(*map(_i32, (free_window, prefix_lens, seq_lens, last_loc, tok_start,
                             page_start) + extra))
  return res[0] if held is None else (res[0], res[1])


def alloc_extend_triton(free_ring: Array, free_head: Array, free_len: Array,
                        num_reqs: Array, prefix_lens: Array, seq_lens: Array,
                        last_loc: Array, *, page_size: int, out_len: int,
                        interpret: bool = False, tile: int | None = None,
                        window: int | None = None, num_warps: int | None = None,
                        layout: str | None = None, chunks: int | None = None,
                        held: Array | None = None) -> Tuple[Array, ...]:
  """A whole alloc_extend (SPEC 4.2, no need_sort merge) in one kernel launch.

  Args:
    free_ring: i32[n] the state's free ring; free_head, free_len: i32[] its head/length.
    num_reqs: i32[] real rows (rows at index >= num_reqs are padding).
    prefix_lens, seq_lens, last_loc: i32[B].
    page_size, out_len: static.
    layout: static, "rows" or "tiles" (module docstring); None: `tuning.extend_layout`.
    tile, window, num_warps, chunks: static tuning overrides. "tiles": tile (tokens per
      program) and window; "rows": tile (tokens per block) and chunks (programs per
      row). Powers of two except chunks (>= 1).
    held: optional i32[n + 1], the ownership record's held pages (jax_kvalloc.guard),
      aliased in and out: the new pages are marked 1 in the same launch.

  Returns:
    (i32[out_len] slots, i32[] new free_head, i32[] new free_len, bool[] ok), and with
    `held` the new held last; equal to jax_kvalloc.allocation.alloc_extend on the jnp
    path: ok is False (indices all 0, head and length unchanged) when a real row has
    prefix_lens < 0 or seq_lens < prefix_lens, when the tokens exceed out_len, or when
    the new pages exceed free_len.

  Raises TypeError naming the argument for a non-integer dtype, ValueError for an
  unknown layout.
  """
  (free_ring, free_head, free_len, num_reqs, prefix_lens, seq_lens,
   last_loc) = _util.check_ints(free_ring=free_ring, free_head=free_head,
                                free_len=free_len, num_reqs=num_reqs,
                                prefix_lens=prefix_lens, seq_lens=seq_lens,
                                last_loc=last_loc)
  b = prefix_lens.shape[0]
  n = free_ring.shape[0]
  if not fused_supported(b, out_len, n):
    raise ValueError(f"alloc_extend_triton does not take {b=} rows, {out_len=}, ring "
                     f"length {n} (see fused_supported)")
  layout = _layout(layout, b, out_len)
  p = _params(True, b, page_size, out_len, n, tile, window, interpret, layout, chunks,
              guard=held is not None)
  name = "jax_kvalloc_alloc_extend_triton" + ("" if layout == "tiles" else "_" + layout)
  call = _Call(name, p, num_warps or _default_warps(p), interpret)
  args = (free_ring, _i32(free_head).reshape(1), _i32(free_len).reshape(1),
          _i32(num_reqs).reshape(1), prefix_lens, seq_lens, last_loc)
  if held is not None:
    (held,) = _util.check_ints(held=held)
    if held.shape != (n + 1,):
      raise ValueError(f"held must be i32[{n + 1}] (ring length + 1), got {held.shape}")
    args += (held,)
  res = call.run(*map(_i32, args))
  out, head, length, ok = res[:4]
  extra = () if held is None else (res[-1],)
  return (out, head.reshape(()), length.reshape(()), ok.reshape(())) + extra
