"""alloc_extend slot indices on GPU: a Pallas kernel through the Triton lowering.

Reference: jax_kvalloc.index_jnp.extend_indices (the contract, SPEC 4.2). Two entry points
share one kernel body:

- `extend_indices_triton`: the contract itself. The caller passes the free-list window and
  the prefix sums tok_start/page_start; reads of the window are clamped into it.
- `alloc_extend_triton`: the whole allocation in one launch (what the GPU allocator runs).
  It reads the free ring of the state directly, computes the prefix sums, the validity and
  capacity checks, the indices (all 0 on failure) and the new head/length of the free list.
  Every read of the ring is masked by the capacity check and wrapped into the ring, so no
  read leaves it (SGLang issue 34399).

Tiling (output-stationary). Program p owns the output tile [p*T, p*T + T). Every program
loads all rows (a power-of-two vector; rows are few next to tokens), forms the prefix sums
in registers (`jnp.cumsum` lowers to tt.scan), and finds the rows that overlap its tile:
r_lo = #rows ending at or before the tile's first token, r_hi likewise for its last. Those
rows' per-row constants go to a per-program scratch window in global memory; after a CTA
barrier every token finds its row there by binary lifting over tok_end (a few L1-resident
gathers: one row per tile needs none) and computes its slot from SPEC's three parts:

  pos = t + A                     sequence position of token t       (A = pre - tok_start)
  Part 1 (t < E):  t + C          rest of the prefix's last page     (C = last_loc+1-tok_start)
  Parts 2/3:       free[k]*ps + pos % ps,  k = Bp + pos // ps        (Bp = page_start - fnp)

where fnp = ceil(pre/ps) and E = fnp*ps - A. If more than W rows overlap a tile (many tiny
or empty rows), the tile takes several passes of W rows each.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _util
from pallas_kernels._util import INT32_MAX, cdiv, floordiv, mod

Array = jax.Array

# Per-row values kept in the search scratch, in this order.
_TOK_END, _A, _E, _C, _BP = range(5)
_NUM_VALUES = 5

DEFAULT_TILE = 1024          # output tokens per program
DEFAULT_WINDOW = 256         # rows per search pass


@dataclasses.dataclass(frozen=True)
class _Params:
  fused: bool          # whole allocation (ring, checks, head/len) or the bare contract
  num_rows: int        # B
  rows_pad: int        # next power of two >= B
  tile: int            # T, output tokens per program (power of two)
  window: int          # W, rows per search pass (power of two)
  page_size: int
  out_len: int
  src_len: int         # length of the free ring (fused) or of the window (contract)
  barrier: bool        # False in interpret mode (programs run one after another there)
  exact_totals: bool   # rows * limit may pass 2**31: detect totals over the limits exactly


# ---------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------

def _load(ref, idx, mask, other=0):
  """Masked gather of ref[idx]; idx is clamped into ref, so no lane ever leaves it."""
  n = ref.shape[0]
  return pltriton.load(ref.at[jnp.clip(idx, 0, n - 1)], mask=mask, other=other)


def _store(ref, idx, value, mask):
  """Masked scatter. Masked-off lanes point past the end: they write nothing, also in
  interpret mode, where a lane that aliased a written one could otherwise win."""
  n = ref.shape[0]
  pltriton.store(ref.at[jnp.where(mask, jnp.clip(idx, 0, n - 1), n)], value, mask=mask)


def _scalar(ref):
  return ref[0]


def _pick(vec: Array, lane: Array, r: Array) -> Array:
  """vec[lane] for a scalar lane, out of a register vector (0 if lane is out of range)."""
  return jnp.sum(jnp.where(r == lane, vec, 0))


def _sum_exceeds(x: Array, cap) -> Array:
  """sum(x) > cap, exactly, for 0 <= x < 2**31 and at most 2**15 lanes: the sums of the
  high and low 16-bit halves cannot wrap, and are compared with cap's halves."""
  hi = jnp.sum(x >> 16)
  lo = jnp.sum(x & 0xFFFF)
  hi = hi + (lo >> 16)
  lo = lo & 0xFFFF
  cap_hi = cap >> 16
  return (hi > cap_hi) | ((hi == cap_hi) & (lo > (cap & 0xFFFF)))


def _row_table(p: _Params, pre, seq, last, tok_start, page_start, valid_lane):
  """Per-row constants (each i32[rows_pad]); lanes that are not rows get tok_end = MAX."""
  ps = p.page_size
  ext = seq - pre
  fnp = cdiv(pre, ps)
  tok_end = jnp.where(valid_lane, tok_start + ext, INT32_MAX)
  a = pre - tok_start
  return (tok_end, a, fnp * ps - a, last + 1 - tok_start, page_start - fnp)


def _fill_tile(p: _Params, pid, table, limit, read_page, out_ref, scr_ref):
  """Writes the output tile of program `pid`: slots of tokens t < limit, 0 after."""
  ps, tile, win = p.page_size, p.tile, p.window
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  t0 = pid * tile
  t = t0 + jnp.arange(tile, dtype=jnp.int32)
  tok_end = table[_TOK_END]
  ntok = jnp.clip(limit - t0, 0, tile)
  r_lo = jnp.sum((tok_end <= t0).astype(jnp.int32))
  r_hi = jnp.sum((tok_end <= t0 + ntok - 1).astype(jnp.int32))
  base = pid * (_NUM_VALUES * win)

  def one_pass(carry):
    w0, acc, done = carry
    nw = jnp.minimum(win, r_hi - w0 + 1)
    sel = (r >= w0) & (r < w0 + nw)
    for v, vec in enumerate(table):
      _store(scr_ref, base + v * win + (r - w0), vec, sel)
    if p.barrier:
      pltriton.debug_barrier()

    # Binary lifting: pos = #window rows with tok_end <= t.
    def lift(c):
      step, pos = c
      cand = pos + step
      inside = cand <= nw
      te = _load(scr_ref, base + cand - 1, inside, INT32_MAX)
      return step >> 1, jnp.where(inside & (te <= t), cand, pos)

    _, pos = lax.while_loop(lambda c: c[0] > 0, lift,
                            (_util.highest_pow2_at_most(nw), jnp.zeros_like(t)))
    mine = (done == 0) & (pos < nw) & (t < limit)
    at = base + jnp.minimum(pos, win - 1)
    a = _load(scr_ref, at + _A * win, mine)
    e = _load(scr_ref, at + _E * win, mine)
    c = _load(scr_ref, at + _C * win, mine)
    bp = _load(scr_ref, at + _BP * win, mine)
    seqpos = t + a
    part1 = t < e
    page = read_page(bp + floordiv(seqpos, ps), mine & ~part1)
    slot = jnp.where(part1, t + c, page * ps + mod(seqpos, ps))
    if p.barrier:
      pltriton.debug_barrier()  # everyone has read the scratch before it is rewritten
    return (w0 + nw, jnp.where(mine, slot, acc), jnp.where(mine, 1, done))

  zeros = jnp.zeros_like(t)
  _, acc, _ = lax.while_loop(lambda c: (ntok > 0) & (c[0] <= r_hi), one_pass,
                             (r_lo, zeros, zeros))
  _store(out_ref, t, jnp.where(t < limit, acc, 0), t < p.out_len)


def _contract_kernel(win_ref, pre_ref, seq_ref, last_ref, ts_ref, pst_ref,  # inputs
                     out_ref, scr_ref,                                      # outputs
                     *, p: _Params):
  """Contract mode. win_ref i32[P]; row refs i32[B]; out_ref i32[out_len];
  scr_ref i32[grid * 5 * W] (search scratch)."""
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  lane = r < p.num_rows
  pre = _load(pre_ref, r, lane)
  seq = _load(seq_ref, r, lane)
  last = _load(last_ref, r, lane)
  tok_start = _load(ts_ref, r, lane)
  page_start = _load(pst_ref, r, lane)
  table = _row_table(p, pre, seq, last, tok_start, page_start, lane)
  total = _pick(table[_TOK_END], p.num_rows - 1, r)

  def read_page(k, mask):
    return _load(win_ref, k, mask)  # clamped into the window, as the contract says

  _fill_tile(p, pl.program_id(0), table, total, read_page, out_ref, scr_ref)


def _fused_kernel(ring_ref, head_ref, flen_ref, nreq_ref,                  # inputs: state
                  pre_ref, seq_ref, last_ref,                              # inputs: batch
                  out_ref, head_out, len_out, ok_out, scr_ref,            # outputs
                  *, p: _Params):
  """Fused mode. ring_ref i32[n]; head/flen/nreq i32[1]; row refs i32[B];
  out_ref i32[out_len]; head_out/len_out i32[1]; ok_out bool[1]; scr_ref as above."""
  ps, n = p.page_size, p.src_len
  pid = pl.program_id(0)
  head = _scalar(head_ref)
  flen = _scalar(flen_ref)
  nrows = jnp.clip(_scalar(nreq_ref), 0, p.num_rows)
  r = jnp.arange(p.rows_pad, dtype=jnp.int32)
  real = r < nrows
  pre = _load(pre_ref, r, real)
  seq = _load(seq_ref, r, real)
  last = _load(last_ref, r, r < p.num_rows)
  rows_valid = jnp.sum((real & ((pre < 0) | (seq < pre))).astype(jnp.int32)) == 0
  pre = jnp.where(rows_valid, pre, 0)
  seq = jnp.where(rows_valid, seq, 0)
  ext = seq - pre
  new_pages = cdiv(seq, ps) - cdiv(pre, ps)
  tok_end = jnp.cumsum(ext)
  page_end = jnp.cumsum(new_pages)
  total = jnp.sum(ext)
  total_pages = jnp.sum(new_pages)
  if p.exact_totals:  # int32 sums could wrap: compare the true sums with the limits
    ok = rows_valid & ~_sum_exceeds(ext, p.out_len) & ~_sum_exceeds(new_pages, flen)
  else:
    ok = rows_valid & (total <= p.out_len) & (total_pages <= flen)
  table = _row_table(p, pre, seq, last, tok_end - ext, page_end - new_pages,
                     jnp.ones_like(real))

  def read_page(k, mask):
    i = head + k
    i = jnp.where(i >= n, i - n, i)
    return _load(ring_ref, i, mask & ok & (k >= 0) & (k < flen))

  _fill_tile(p, pid, table, jnp.where(ok, total, 0), read_page, out_ref, scr_ref)

  @pl.when(pid == 0)
  def _():
    taken = jnp.where(ok, total_pages, 0)
    new_head = head + taken
    head_out[0] = jnp.where(new_head >= n, new_head - n, new_head)
    len_out[0] = flen - taken
    ok_out[0] = ok


# ---------------------------------------------------------------------------------------
# Grid, shapes and wrappers.
# ---------------------------------------------------------------------------------------

def _params(fused, num_rows, page_size, out_len, src_len, tile, window, interpret):
  rows_pad = _util.next_pow2(num_rows)
  tile = min(_util.next_pow2(out_len), tile or DEFAULT_TILE)
  window = min(rows_pad, window or DEFAULT_WINDOW)
  if not (_util.is_pow2(tile) and _util.is_pow2(window)):
    raise ValueError(f"tile={tile} and window={window} must be powers of two")
  return _Params(fused=fused, num_rows=num_rows, rows_pad=rows_pad, tile=tile,
                 window=window, page_size=page_size, out_len=out_len, src_len=src_len,
                 barrier=not interpret,
                 exact_totals=fused and _may_wrap(num_rows, out_len, src_len))


def _may_wrap(num_rows: int, out_len: int, ring_len: int) -> bool:
  return num_rows * (max(out_len, ring_len) + 1) > INT32_MAX


MAX_FUSED_ROWS = 2**15


def fused_supported(num_rows: int, out_len: int, ring_len: int) -> bool:
  """Whether alloc_extend_triton takes these static sizes: every program holds all rows
  in registers, and its exact total check (int32 sums could wrap) needs <= 2**15 lanes."""
  return (1 <= num_rows and _util.next_pow2(num_rows) <= MAX_FUSED_ROWS
          and out_len >= 1 and ring_len >= 1)


def _default_warps(p: _Params) -> int:
  return 8 if max(p.tile, p.rows_pad) >= 4096 else 4


@dataclasses.dataclass(frozen=True)
class _Call:
  """The pallas_call of one kernel configuration (hashable: a primitive parameter)."""
  name: str        # the pallas_call's name, also shown in jaxprs
  p: _Params
  num_warps: int
  interpret: bool

  def __call__(self, *args):
    p = self.p
    grid = pl.cdiv(p.out_len, p.tile)
    scratch = jax.ShapeDtypeStruct((grid * _NUM_VALUES * p.window,), jnp.int32)
    out = jax.ShapeDtypeStruct((p.out_len,), jnp.int32)
    if p.fused:
      one = jax.ShapeDtypeStruct((1,), jnp.int32)
      out_shape = (out, one, one, jax.ShapeDtypeStruct((1,), jnp.bool_), scratch)
      body = _fused_kernel
    else:
      out_shape = (out, scratch)
      body = _contract_kernel
    return pl.pallas_call(
        functools.partial(body, p=p), out_shape=out_shape, grid=(grid,),
        compiler_params=pltriton.CompilerParams(num_warps=self.num_warps, num_stages=1),
        interpret=self.interpret, name=self.name)(*args)


def _run(call: _Call, *args):
  if call.interpret:
    return tuple(call(*args))
  return _util.quiet_triton(call, *args)


def _i32(x) -> Array:
  return jnp.asarray(x, jnp.int32)


def extend_indices_triton(free_window: Array, prefix_lens: Array, seq_lens: Array,
                          last_loc: Array, tok_start: Array, page_start: Array, *,
                          page_size: int, out_len: int, interpret: bool = False,
                          tile: int | None = None, window: int | None = None,
                          num_warps: int | None = None) -> Array:
  """index_jnp.extend_indices (same arguments, same i32[out_len] result) on GPU.

  tile/window/num_warps override the defaults (powers of two); for tuning.
  """
  b = prefix_lens.shape[0]
  if out_len == 0:
    return jnp.zeros((0,), jnp.int32)
  if b == 0:
    return jnp.zeros((out_len,), jnp.int32)
  p = _params(False, b, page_size, out_len, free_window.shape[0], tile, window, interpret)
  call = _Call("jax_kvalloc_extend_indices_triton", p, num_warps or _default_warps(p),
               interpret)
  out, _ = _run(call, *map(_i32, (free_window, prefix_lens, seq_lens, last_loc, tok_start,
                                  page_start)))
  return out


def alloc_extend_triton(free_ring: Array, free_head: Array, free_len: Array,
                        num_reqs: Array, prefix_lens: Array, seq_lens: Array,
                        last_loc: Array, *, page_size: int, out_len: int,
                        interpret: bool = False, tile: int | None = None,
                        window: int | None = None,
                        num_warps: int | None = None) -> Tuple[Array, Array, Array, Array]:
  """A whole alloc_extend (SPEC 4.2, no need_sort merge) in one kernel launch.

  Args:
    free_ring: i32[n] the state's free ring; free_head, free_len: i32[] its head/length.
    num_reqs: i32[] real rows (rows at index >= num_reqs are padding).
    prefix_lens, seq_lens, last_loc: i32[B].
    page_size, out_len: static.

  Returns:
    (i32[out_len] slots, i32[] new free_head, i32[] new free_len, bool[] ok), equal to
    jax_kvalloc.allocation.alloc_extend on the jnp path: ok is False (indices all 0, head
    and length unchanged) when a real row has prefix_lens < 0 or seq_lens < prefix_lens,
    when the tokens exceed out_len, or when the new pages exceed free_len.
  """
  b = prefix_lens.shape[0]
  n = free_ring.shape[0]
  if not fused_supported(b, out_len, n):
    raise ValueError(f"alloc_extend_triton does not take {b=} rows, {out_len=}, ring "
                     f"length {n} (see fused_supported)")
  p = _params(True, b, page_size, out_len, n, tile, window, interpret)
  call = _Call("jax_kvalloc_alloc_extend_triton", p, num_warps or _default_warps(p),
               interpret)
  args = (free_ring, _i32(free_head).reshape(1), _i32(free_len).reshape(1),
          _i32(num_reqs).reshape(1), prefix_lens, seq_lens, last_loc)
  out, head, length, ok, _ = _run(call, *map(_i32, args))
  return out, head.reshape(()), length.reshape(()), ok.reshape(())
