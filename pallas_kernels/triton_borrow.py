"""The request table's borrows on GPU: one Pallas-Triton launch.

Reference: jax_kvalloc.request_table's jnp path, bit for bit: `borrow_pages` (empty rows
start from given page ids) and `borrow_from_rows` (from the first pages of source rows,
optionally handed over: the row owns them, the source keeps them borrowed). The table's
pages (flattened), lens and owned_from are aliased in and out (input_output_aliases), so
under donation or a loop carry the kernel writes them in place.

One program (grid (1,)): every check must pass before any row is written.
  1. Each real row inside the table stores its lane number at scratch[row] (hand-over:
     each source at scratch[R + src] too); the per-row checks read lens (and the
     sources' lens, owned_from); the page ids the rows take are checked against the pool
     [1, pool_pages] in passes of `tile` columns over a [rows_pad * tile] lane layout.
  2. A CTA barrier: the marks are visible, and every table read above is done before any
     write below. A row given twice finds the other lane's number at least once.
  3. When everything passed: the rows' pages (page ids, then 0 to the table's width), in
     passes again (a source row with pages to lend is never a destination: those are
     empty), then lens, owned_from, and the hand-over sources' owned_from.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _util
from pallas_kernels import tuning
from pallas_kernels._util import floordiv

Array = jax.Array

MAX_ROWS = 2048    # rows per call (padded): one program holds them
# rows_pad * tile: the most lanes of one pass over the columns. Fewer, wider passes are
# faster on the H200 up to this many, on table_warps' 16 warps
# (benchmarks/results/2026-12-02-h200-borrow-lanes, borrow-sweep.log).
LANES = 2**16


@dataclasses.dataclass(frozen=True)
class _Params:
  page_size: int
  pool_pages: int     # page ids in [1, pool_pages] are the pool's
  max_reqs: int       # R, table rows
  width: int          # W, page columns
  rows: int           # B, rows given
  rows_pad: int
  ids_width: int      # columns of the page ids given; 0: source rows instead
  tile: int           # columns per pass (power of two)
  hand_over: bool
  barrier: bool       # False in interpret mode (one program, run in order there)

  @property
  def wide(self) -> int:
    """Columns a row may take: the page ids' width, or the table's."""
    return self.ids_width or self.width

  @property
  def in_names(self) -> Tuple[str, ...]:
    return ("pages", "lens", "owned", "rows", "num", "counts",
            "ids" if self.ids_width else "src")

  @property
  def out_names(self) -> Tuple[str, ...]:
    return ("pages_o", "lens_o", "owned_o", "ok_o", "scr")


class _Lanes:
  """Per lane b (an array of entry numbers, any length): the destination row (clipped
  into the table), the count k (0 for padding), whether the entry is real, and for source
  rows the source row (clipped) and whether it is inside the table."""

  def __init__(self, p: _Params, r, b: Array):
    inb = b < p.rows
    count = jnp.clip(r["num"][0], 0, p.rows)
    self.real = b < count
    raw = _util.load(r["rows"], b, inb)
    self.inside = (raw >= 0) & (raw < p.max_reqs)
    self.row = jnp.clip(raw, 0, p.max_reqs - 1)
    self.k = jnp.where(self.real, _util.load(r["counts"], b, inb), 0)
    if not p.ids_width:
      raw_src = _util.load(r["src"], b, inb)
      self.src_inside = (raw_src >= 0) & (raw_src < p.max_reqs)
      self.src = jnp.clip(raw_src, 0, p.max_reqs - 1)

  def page(self, p: _Params, r, pages_ref, b: Array, j: Array, mask: Array) -> Array:
    """The page id entry b takes in column j (read under mask)."""
    if p.ids_width:
      return _util.load(r["ids"], b * p.ids_width + j, mask & (j < p.ids_width))
    return _util.load(pages_ref, self.src * p.width + j, mask)


def _passes(p: _Params, body, init):
  """fori_loop over the column passes: body(b, j, acc) on lanes (entry b, column j)."""
  shift = p.tile.bit_length() - 1
  i = jnp.arange(p.rows_pad * p.tile, dtype=jnp.int32)

  def one(t, acc):
    return body(i >> shift, t * p.tile + (i & (p.tile - 1)), acc)

  return lax.fori_loop(0, -(-p.width // p.tile), one, init)


def _kernel(*refs, p: _Params):
  r = dict(zip(p.in_names + p.out_names, refs))
  pages_ref, lens_ref, owned_ref, scr = r["pages_o"], r["lens_o"], r["owned_o"], r["scr"]
  n, ps, w = p.pool_pages, p.page_size, p.width
  b = jnp.arange(p.rows_pad, dtype=jnp.int32)
  e = _Lanes(p, r, b)
  mark = e.real & e.inside
  _util.store(scr, e.row, b, mark)
  bad = e.real & (~e.inside | (e.k < 0) | (e.k > p.wide)
                  | (_util.load(lens_ref, e.row, mark) != 0))
  if not p.ids_width:
    # Whole pages the source holds: k * ps <= lens[src], written so it cannot overflow.
    lens_src = _util.load(lens_ref, e.src, e.real & e.src_inside)
    bad = bad | (e.real & (~e.src_inside | (e.k > floordiv(lens_src, ps))))
    if p.hand_over:
      smark = e.real & e.src_inside
      _util.store(scr, p.max_reqs + e.src, b, smark)
      bad = bad | (e.real & (_util.load(owned_ref, e.src, smark) != 0))

  def check(bb, j, acc):
    lane = _Lanes(p, r, bb)
    used = lane.real & (j < lane.k) & (j < p.wide)
    if not p.ids_width:
      used = used & lane.src_inside
    page = lane.page(p, r, pages_ref, bb, j, used)
    return acc + jnp.sum(jnp.where(used & ((page < 1) | (page > n)), 1, 0))

  wrong = jnp.sum(jnp.where(bad, 1, 0)) + _passes(p, check, jnp.zeros((), jnp.int32))
  if p.barrier:
    pltriton.debug_barrier()  # the marks; every table read before any write
  back = _util.load(scr, e.row, mark, -1)
  wrong += jnp.sum(jnp.where(mark & (back != b), 1, 0))
  if p.hand_over:
    back = _util.load(scr, p.max_reqs + e.src, smark, -1)
    wrong += jnp.sum(jnp.where(smark & (back != b), 1, 0))
  go = wrong == 0

  def write(bb, j, acc):
    lane = _Lanes(p, r, bb)
    live = lane.real & go & (j < w)
    taken = live & (j < lane.k)
    page = jnp.where(taken, lane.page(p, r, pages_ref, bb, j, taken), 0)
    _util.store(pages_ref, lane.row * w + j, page, live)
    return acc

  _passes(p, write, jnp.zeros((), jnp.int32))
  live = e.real & go
  _util.store(lens_ref, e.row, e.k * ps, live)
  _util.store(owned_ref, e.row, jnp.zeros_like(b) if p.hand_over else e.k, live)
  if p.hand_over:
    # A source that is also a destination lends 0 pages: both stores write 0 there.
    _util.store(owned_ref, e.src, e.k, live)
  r["ok_o"][0] = go.astype(jnp.int32)


class _Call(_util.TritonCall):
  """The borrow kernel's pallas_call: one program."""

  def spec(self):
    p = self.p
    i32 = lambda k: jax.ShapeDtypeStruct((k,), jnp.int32)
    out = (i32(p.max_reqs * p.width), i32(p.max_reqs), i32(p.max_reqs), i32(1),
           i32((2 if p.hand_over else 1) * p.max_reqs))
    return out, _kernel, (1,)

  def aliases(self):
    return {0: 0, 1: 1, 2: 2}  # pages, lens, owned_from


def supported(*, max_reqs: int, width: int, page_size: int, rows: int) -> bool:
  """Whether `borrow_triton` takes these static sizes."""
  if not (max_reqs >= 1 and width >= 1 and page_size >= 1 and rows >= 1):
    return False
  if (width * page_size > _util.INT32_MAX or max_reqs * width > _util.INT32_MAX
      or 2 * max_reqs > _util.INT32_MAX):
    return False
  return _util.next_pow2(rows) <= MAX_ROWS


def borrow_triton(pages: Array, lens: Array, owned_from: Array, rows: Array,
                  num_rows: Array, num_pages: Array, *, page_size: int, pool_pages: int,
                  page_ids: Optional[Array] = None, src: Optional[Array] = None,
                  hand_over: bool = False, interpret: bool = False,
                  num_warps: Optional[int] = None, tile: Optional[int] = None
                  ) -> Tuple[Array, Array, Array, Array]:
  """request_table.borrow_pages (page_ids given) or borrow_from_rows (src given) in one
  kernel launch.

  Args:
    pages: i32[R, W] the table's pages; lens, owned_from: i32[R].
    rows: i32[B] destination rows; num_rows: i32[] (entries at index >= num_rows are
      padding); num_pages: i32[B] pages each row takes.
    page_size, pool_pages: static; page ids in [1, pool_pages] are the pool's.
    page_ids: i32[B, Wi] (Wi <= W) the ids to take, or
    src: i32[B] the rows whose first pages to take; hand_over (src only): the rows own
      them and the sources keep them borrowed.
    interpret: run in Pallas' interpreter (CPU tests).
    num_warps, tile: the launch's warps and the columns per pass (a power of two);
      defaults from the rows and LANES.

  Returns:
    (pages i32[R, W], lens i32[R], owned_from i32[R], ok bool[]): the jnp path's bits;
    ok False leaves the table as it was.

  Raises TypeError naming an argument of a non-integer dtype; ValueError when exactly
  one of page_ids and src is not given, for hand_over with page_ids, for shapes that do
  not match, and for sizes `supported` refuses.
  """
  if (page_ids is None) == (src is None):
    raise ValueError("give exactly one of page_ids and src")
  if hand_over and src is None:
    raise ValueError("hand_over needs src (source rows)")
  pages, lens, owned_from, rows, num_pages = _util.check_ints(
      pages=pages, lens=lens, owned_from=owned_from, rows=rows, num_pages=num_pages)
  (num_rows,) = _util.check_ints(num_rows=num_rows)
  max_reqs, width = pages.shape
  num = rows.shape[0]
  if page_ids is not None:
    (last,) = _util.check_ints(page_ids=page_ids)
    ids_width = last.shape[1] if last.ndim == 2 else -1
    if last.ndim != 2 or last.shape[0] != num or not 1 <= ids_width <= width:
      raise ValueError(f"page_ids must be i32[{num}, Wi] with 1 <= Wi <= {width}, got "
                       f"{last.shape}")
    last = last.reshape(-1)
  else:
    (last,) = _util.check_ints(src=src)
    ids_width = 0
    if last.shape != (num,):
      raise ValueError(f"src must be i32[{num}], got {last.shape}")
  if num_pages.shape != (num,) or lens.shape != (max_reqs,) or (
      owned_from.shape != (max_reqs,)):
    raise ValueError(f"shapes do not match: {rows.shape=}, {num_pages.shape=}, "
                     f"{pages.shape=}, {lens.shape=}, {owned_from.shape=}")
  if not supported(max_reqs=max_reqs, width=width, page_size=page_size, rows=num):
    raise ValueError(f"borrow_triton does not take {num} rows of a table of "
                     f"{max_reqs}x{width} (see supported)")
  rows_pad = _util.next_pow2(num)
  if tile is None:
    tile = min(_util.next_pow2(width), max(1, LANES // rows_pad))
  if not _util.is_pow2(tile):
    raise ValueError(f"tile must be a power of two, got {tile}")
  p = _Params(page_size=page_size, pool_pages=pool_pages, max_reqs=max_reqs, width=width,
              rows=num, rows_pad=rows_pad, ids_width=ids_width, tile=tile,
              hand_over=hand_over, barrier=not interpret)
  if num_warps is None:
    num_warps = tuning.table_warps(rows_pad * tile // 4)
  call = _Call("jax_kvalloc_borrow_triton", p, num_warps, interpret)
  out = call.run(pages.reshape(-1), lens, owned_from, rows, num_rows.reshape(1),
                 num_pages, last)
  return out[0].reshape(max_reqs, width), out[1], out[2], out[3][0] > 0
