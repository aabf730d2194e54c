"""A request table for the sliding-window allocator (SPEC 11 and 13), for one jitted step.

Per row: its full pages in token order, its length, and `swa_from`, the first page column
that still holds SWA KV (columns before it left the window). A row's SWA pages need no
column of their own: both pools page in step, so column j's SWA page is
`mapping[pages[r, j] * ps] // ps`.

Operations (pure, traceable; rows i32[B] with optional num_rows, as jax_kvalloc.
request_table; real rows must be distinct and inside the table, else ok=False and
nothing changes)::

  extend_rows / decode_rows   SPEC 13's alloc_extend / alloc_decode of lens -> lens + n,
                              last_loc read from the table; new pages appended.
  window_rows                 for each row, the SWA pages of its columns that lie wholly
                              before lens - window: exactly `free_swa_segment` of each
                              row's segment inside one free group (one free_page_ids of
                              the rows' pages, in row order); swa_from moves past them.
                              Refused by the SWA pool's ownership record: ok False,
                              nothing changes (SPEC 14).
  release_rows                each row as `free_segment` inside one free group: its SWA
                              pages from swa_from (one free_page_ids, row order), then its
                              full pages (one free_page_ids, row order); rows cleared.
                              Refused by either pool's record: ok False, rows kept,
                              nothing freed (as jax_kvalloc.swa's free).
  attention_inputs            full-layer page indices, and for SWA layers the rows' SWA
                              page indices (translated) of the pages inside the window.

Borrowed prefixes (SPEC 11's owned_from) are out of scope here, as SGLang's SWA prefix
cache hooks are (SPEC 13).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import swa as core
from jax_kvalloc import validate
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.swa import SWAConfig, SWAState

Array = jax.Array


class SWATable(NamedTuple):
  """The requests served with an SWA allocator."""
  pages: Array     # i32[max_reqs, max_pages_per_req] full page ids in token order, 0: none
  lens: Array      # i32[max_reqs] tokens held
  swa_from: Array  # i32[max_reqs] first column whose SWA page is still held


class SWAAttentionInputs(NamedTuple):
  """Paged-attention inputs for the given rows (padding rows: all 0)."""
  page_indices: Array      # i32[B, P] full pages (full-attention layers), 0 past the end
  kv_lens: Array           # i32[B] tokens in the full KV cache
  swa_page_indices: Array  # i32[B, P] SWA pages inside the window, from column
                           # swa_start // ps on, left-aligned; 0 past the end
  swa_start: Array         # i32[B] position of the first token of swa_page_indices[:, 0]
  swa_kv_lens: Array       # i32[B] kv_lens - swa_start: tokens the SWA pages cover
  cu_q_lens: Array         # i32[B + 1] cumulative query lengths
  num_seqs: Array          # i32[1] real rows


def init_table(config: SWAConfig, max_reqs: int, max_pages_per_req: int) -> SWATable:
  """An empty table of `max_reqs` rows of `max_pages_per_req` page columns."""
  del config
  for name, v in (("max_reqs", max_reqs), ("max_pages_per_req", max_pages_per_req)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  z = lambda: jnp.zeros((max_reqs,), jnp.int32)
  return SWATable(jnp.zeros((max_reqs, max_pages_per_req), jnp.int32), z(), z())


def _batch(table: SWATable, rows: Array, num_rows: Optional[Array]):
  """(rows clipped, bool[B] real, bool[] rows ok)."""
  rows = validate.as_i32(rows, "rows")
  if rows.ndim != 1:
    raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
  b, r = rows.shape[0], table.lens.shape[0]
  real = (jnp.ones((b,), bool) if num_rows is None
          else jnp.arange(b) < validate.as_i32(num_rows, "num_rows"))
  inside = (rows >= 0) & (rows < r)
  same = (rows[:, None] == rows[None, :]) & real[:, None] & real[None, :]
  distinct = jnp.sum(same) == jnp.sum(real)
  ok = jnp.all(inside | ~real) & distinct
  return jnp.clip(rows, 0, r - 1), real, ok


def _last_loc(config: SWAConfig, table: SWATable, rows: Array, lens: Array) -> Array:
  ps = config.page_size
  col = jnp.clip((lens - 1) // ps, 0, table.pages.shape[1] - 1)
  page = table.pages[rows, col]
  return jnp.where(lens > 0, page * ps + (lens - 1) % ps, -1)


def _select(ok, new, old):
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def extend_rows(config: SWAConfig, state: SWAState, table: SWATable, rows: Array,
                n: Array, *, max_tokens: int, num_rows: Optional[Array] = None
                ) -> Tuple[SWAState, SWATable, Array, Array]:
  """Extends rows by n[i] >= 0 tokens in both pools (SPEC 13 alloc_extend).

  Returns:
    (state, table, i32[max_tokens] full slots in batch order, bool[] ok). Refused (all
    unchanged) when the pools are short, a row would pass max_pages_per_req, or the rows
    are bad.
  """
  ps, width = config.page_size, table.pages.shape[1]
  rows, real, rows_ok = _batch(table, rows, num_rows)
  n = jnp.where(real, validate.as_i32(n, "n"), 0)
  lens = jnp.where(real, table.lens[rows], 0)
  fits_row = jnp.all(cdiv(lens + n, ps) <= width) & jnp.all(n >= 0)
  go = rows_ok & fits_row
  last = jnp.where(real, _last_loc(config, table, rows, lens), -1)
  new, out, ok = core.alloc_extend(config, state, lens, jnp.where(go, lens + n, lens),
                                   last, max_tokens=max_tokens,
                                   num_reqs=None if num_rows is None else num_rows)
  ok = ok & go
  tok_start = jnp.cumsum(n) - n
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  fresh = (cols >= cdiv(lens, ps)[:, None]) & (cols < cdiv(lens + n, ps)[:, None]) & \
      real[:, None]
  pos = jnp.clip(tok_start[:, None] + cols * ps - lens[:, None], 0, max_tokens - 1)
  page = jnp.take(out, pos) // ps
  old_rows = table.pages[rows]
  pages = table.pages.at[jnp.where(real, rows, table.pages.shape[0])].set(
      jnp.where(fresh, page, old_rows), mode="drop")
  lens_t = table.lens.at[jnp.where(real, rows, table.lens.shape[0])].set(
      lens + n, mode="drop")
  new_table = table._replace(pages=pages, lens=lens_t)
  return (_select(ok, new, state), _select(ok, new_table, table), jnp.where(ok, out, 0),
          ok)


def decode_rows(config: SWAConfig, state: SWAState, table: SWATable, rows: Array, *,
                num_rows: Optional[Array] = None
                ) -> Tuple[SWAState, SWATable, Array, Array]:
  """One token for each row in both pools (SPEC 13 alloc_decode: each pool's merge
  trigger runs; both pools or neither allocate). Returns (state, table, i32[B], ok)."""
  ps, width = config.page_size, table.pages.shape[1]
  rows, real, rows_ok = _batch(table, rows, num_rows)
  lens = jnp.where(real, table.lens[rows], 0)
  go = rows_ok & jnp.all(cdiv(lens + 1, ps) <= width)
  last = jnp.where(real, _last_loc(config, table, rows, lens), -1)
  seq = jnp.where(real & go, lens + 1, 1)
  new, out, ok = core.alloc_decode(config, state, seq, last,
                                   num_reqs=jnp.where(go, jnp.sum(real), 0))
  ok = ok & go
  starts = real & (lens % ps == 0)
  col = jnp.clip(lens // ps, 0, width - 1)
  r = jnp.where(starts, rows, table.pages.shape[0])
  pages = table.pages.at[r, col].set(out // ps, mode="drop")
  lens_t = table.lens.at[jnp.where(real, rows, table.lens.shape[0])].set(lens + 1,
                                                                          mode="drop")
  new_table = table._replace(pages=pages, lens=lens_t)
  return (_select(ok, new, state), _select(ok, new_table, table), jnp.where(ok, out, 0),
          ok)


def _free_swa_columns(config: SWAConfig, state: SWAState, page_rows: Array,
                      mask: Array, op: int) -> Tuple[SWAState, Array]:
  """Frees the SWA pages of the full pages page_rows[mask] (row-major order) with one
  free_page_ids (`op` named by the SWA pool's ownership record), and clears those full
  pages' mapping. Returns (state, bool[] refused: then nothing changed but the SWA
  pool's status)."""
  ps = config.page_size
  full_pages = page_rows.reshape(-1)
  mask = mask.reshape(-1) & (full_pages > 0)
  reps = full_pages * ps
  peers = core.translate(state.mapping, jnp.where(mask, reps, 0))
  swa_pages = jnp.where(mask & (peers > 0), peers // ps, 0)
  values, count = st.compact(swa_pages, swa_pages > 0)
  swa, refused = freeing.free_page_ids_refused(config.swa, state.swa, values, count, op=op)
  wide = (reps[:, None] + jnp.arange(ps, dtype=jnp.int32)[None, :]).reshape(-1)
  mapping = core.clear_mapping(state.mapping, wide, jnp.repeat(mask & ~refused, ps))
  return state._replace(swa=swa, mapping=mapping), refused


def window_rows(config: SWAConfig, state: SWAState, table: SWATable, rows: Array,
                window: Array, *, num_rows: Optional[Array] = None
                ) -> Tuple[SWAState, SWATable, Array]:
  """Frees, for each row, the SWA pages of its columns lying wholly before
  lens - window (columns swa_from .. (lens - window) // ps - 1), as `free_swa_segment`
  of each row's segment inside one free group. Returns (state, table, ok)."""
  ps, width = config.page_size, table.pages.shape[1]
  rows, real, ok = _batch(table, rows, num_rows)
  window = validate.as_i32(window, "window")
  ok = ok & jnp.all(window >= 0)
  lens = table.lens[rows]
  frm = table.swa_from[rows]
  end = jnp.clip(jnp.maximum(lens - window, 0) // ps, 0, width)
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  mask = (cols >= frm[:, None]) & (cols < end[:, None]) & (real & ok)[:, None]
  state, refused = _free_swa_columns(config, state, table.pages[rows], mask,
                                     guard.OP_WINDOW_ROWS)
  ok = ok & ~refused
  r = jnp.where(real & ok, rows, table.lens.shape[0])
  swa_from = table.swa_from.at[r].set(jnp.maximum(frm, end), mode="drop")
  return state, table._replace(swa_from=swa_from), ok


def release_rows(config: SWAConfig, state: SWAState, table: SWATable, rows: Array, *,
                 num_rows: Optional[Array] = None) -> Tuple[SWAState, SWATable, Array]:
  """Finishes rows: each as `free_segment` of its whole length inside one free group
  (SWA pages from swa_from, then full pages, each one free_page_ids in row order); the
  rows are cleared. Returns (state, table, ok)."""
  ps, width = config.page_size, table.pages.shape[1]
  rows, real, ok = _batch(table, rows, num_rows)
  lens = table.lens[rows]
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  held = (cols < cdiv(lens, ps)[:, None]) & (real & ok)[:, None]
  page_rows = table.pages[rows]
  after, swa_refused = _free_swa_columns(
      config, state, page_rows, held & (cols >= table.swa_from[rows][:, None]),
      guard.OP_RELEASE_ROWS)
  flat = page_rows.reshape(-1)
  values, count = st.compact(flat, held.reshape(-1) & (flat > 0))
  full, refused = freeing.free_page_ids_refused(config.full, after.full, values, count,
                                                op=guard.OP_RELEASE_ROWS,
                                                also_refuse=swa_refused)
  state = core.undo_swa_side(state, after, full, swa_refused, refused)
  ok = ok & ~refused  # refused: nothing freed, the rows stay
  r = jnp.where(real & ok, rows, table.lens.shape[0])
  table = SWATable(table.pages.at[r].set(0, mode="drop"),
                   table.lens.at[r].set(0, mode="drop"),
                   table.swa_from.at[r].set(0, mode="drop"))
  return state, table, ok


def attention_inputs(config: SWAConfig, state: SWAState, table: SWATable, rows: Array,
                     q_lens: Array, window: Array, *,
                     num_rows: Optional[Array] = None) -> SWAAttentionInputs:
  """Attention inputs for the rows: full pages for full-attention layers, and the SWA
  pages (translated through the mapping) of the pages holding a token at position
  >= lens - window, left-aligned, for sliding-window layers. Padding rows and rows
  outside the table have length 0 and no pages, and num_seqs counts neither."""
  ps, width = config.page_size, table.pages.shape[1]
  rows_in = validate.as_i32(rows, "rows")
  rows, real, _ = _batch(table, rows_in, num_rows)
  real = real & (rows_in >= 0) & (rows_in < table.lens.shape[0])  # outside: padding
  lens = jnp.where(real, table.lens[rows], 0)
  q = jnp.where(real, validate.as_i32(q_lens, "q_lens"), 0)
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  n_pages = cdiv(lens, ps)
  page_rows = jnp.where(cols < n_pages[:, None], table.pages[rows], 0)
  first = jnp.maximum(table.swa_from[rows],
                      jnp.maximum(lens - validate.as_i32(window, "window"), 0) // ps)
  first = jnp.where(real, jnp.minimum(first, n_pages), 0)
  src = jnp.clip(cols + first[:, None], 0, width - 1)
  shifted = jnp.take_along_axis(page_rows, src, axis=1)
  keep = (cols + first[:, None]) < n_pages[:, None]
  peers = core.translate(state.mapping, jnp.where(keep, shifted * ps, 0))
  swa_pages = jnp.where(keep & (peers > 0), peers // ps, 0)
  start = first * ps
  return SWAAttentionInputs(
      page_indices=page_rows, kv_lens=lens, swa_page_indices=swa_pages,
      swa_start=start, swa_kv_lens=jnp.where(real, lens - start, 0),
      cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q)]),
      num_seqs=jnp.sum(real.astype(jnp.int32))[None])
