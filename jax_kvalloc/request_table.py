"""A device-resident request table (SPEC 11): per request, its pages in order and its
length, so that one jitted step allocates, releases and builds paged-attention inputs
without host index tensors.

SGLang keeps `req_to_token` (one slot per token) on the device, but its scheduler slices
it into index tensors on the host and calls `free`/`free_segment` request by request;
sglang-jax builds its attention metadata in NumPy every step. Here the table is a pytree
beside the `AllocatorState`, and every function below is pure and traceable: it composes
with jit, vmap, scan and donation like jax_kvalloc.allocation.

Rows and padding. Each operation takes `rows: i32[B]` (table rows, in batch order) and an
optional `num_rows: i32[]`: entries at index >= num_rows are padding and ignored. Real
rows must be distinct and inside the table; otherwise the call refuses (ok=False,
nothing changes).

Exactness. `extend_rows` is exactly `alloc_extend(prefix_lens=lens, seq_lens=lens + n,
last_loc)` with `last_loc` read from the table, so its slots equal SGLang's; `decode_rows`
is `alloc_decode` likewise; `release_rows` is `free_page_ids` of each row's owned pages in
the row's order (SGLang's `free_segment` of the whole row), no sort.

Borrowed prefixes. A row may start from whole pages that another row (or a prefix cache)
owns: `borrow_pages` assigns them and sets `owned_from`, the first column the row owns
(`borrow_from_rows` takes them from other rows, or hands a row's first pages over).
Release never frees the columns before it; keeping their owner alive is the caller's job,
as a radix cache's lock is in SGLang.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import index_jnp
from jax_kvalloc import kernels
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.state import AllocatorState

Array = jax.Array


class RequestTable(NamedTuple):
  """The requests being served. Shapes fix max_reqs and max_pages_per_req.

  Row r holds `lens[r]` tokens in pages `pages[r, :ceil(lens[r] / page_size)]`, token i
  at slot `pages[r, i // ps] * ps + i % ps`. Columns `< owned_from[r]` are borrowed
  (never freed by this row). Unused entries are 0 (the reserved page).
  """
  pages: Array       # i32[max_reqs, max_pages_per_req] page ids, in token order
  lens: Array        # i32[max_reqs] tokens held
  owned_from: Array  # i32[max_reqs] first page column the row owns


class AttentionInputs(NamedTuple):
  """Inputs of a ragged paged-attention kernel for a batch of rows (padding rows: 0)."""
  page_indices: Array  # i32[B, max_pages_per_req] the rows' pages, 0 past their end
  kv_lens: Array       # i32[B] tokens in each row's KV cache (new tokens included)
  cu_q_lens: Array     # i32[B + 1] cumulative query lengths, cu_q_lens[0] = 0
  num_seqs: Array      # i32[1] real rows


def init_table(config: AllocatorConfig, max_reqs: int,
               max_pages_per_req: int) -> RequestTable:
  """An empty table: every row has no pages, length 0.

  Args:
    config: the pool's static configuration (unused; kept for a uniform signature).
    max_reqs: static number of rows (>= 1).
    max_pages_per_req: static page columns per row (>= 1); a row holds at most
      max_pages_per_req * page_size tokens.

  Raises:
    ValueError naming the argument when a size is not a positive int.
  """
  del config
  for name, value in (("max_reqs", max_reqs), ("max_pages_per_req", max_pages_per_req)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  # Separate buffers for every field, so that each can be donated.
  return RequestTable(pages=jnp.zeros((max_reqs, max_pages_per_req), jnp.int32),
                      lens=jnp.zeros((max_reqs,), jnp.int32),
                      owned_from=jnp.zeros((max_reqs,), jnp.int32))


# ---------------------------------------------------------------------------------------
# Shared pieces.
# ---------------------------------------------------------------------------------------

def _check_table(table: RequestTable) -> Tuple[int, int]:
  if not isinstance(table, RequestTable):
    raise TypeError(f"table must be a RequestTable, got {type(table).__name__}")
  if table.pages.ndim != 2 or table.lens.shape != table.pages.shape[:1] or (
      table.owned_from.shape != table.lens.shape):
    raise ValueError(f"table shapes do not match: {table.pages.shape=}, "
                     f"{table.lens.shape=}, {table.owned_from.shape=}")
  return table.pages.shape


def _static_batch(table: RequestTable, rows: Array, **per_row: Array):
  """The static checks of a batch (trace time, no ops): (rows i32[B], the per-row
  arrays as int32, B). TypeError / ValueError naming the argument."""
  _check_table(table)
  rows = validate.as_i32(rows, "rows")
  arrays = {k: validate.as_i32(v, k) for k, v in per_row.items()}
  num = validate.static_rows(rows=rows, **arrays)
  if num == 0:
    raise ValueError("rows must hold at least one entry (pad with num_rows instead)")
  return rows, arrays, num


def _batch(table: RequestTable, rows: Array, num_rows: Optional[Array], **per_row: Array):
  """Checks shapes; returns (rows clipped into the table, bool[B] real, i32[] count,
  bool[] rows valid, the per-row arrays as int32)."""
  max_reqs, _ = _check_table(table)
  rows, arrays, num = _static_batch(table, rows, **per_row)
  if num_rows is None:
    real, count = jnp.ones((num,), bool), jnp.full((), num, jnp.int32)
  else:
    count = jnp.clip(validate.as_i32(num_rows, "num_rows"), 0, num)
    real = jnp.arange(num) < count
  inside = (rows >= 0) & (rows < max_reqs)
  valid = jnp.all(inside | ~real) & ~_repeated(rows, real & inside, max_reqs)
  return jnp.clip(rows, 0, max_reqs - 1), real, count, valid, arrays


def _repeated(rows: Array, mask: Array, max_reqs: int) -> Array:
  """bool[]: some row in [0, max_reqs) appears twice among rows[mask] (a scatter-add of
  ones per row, O(B + max_reqs))."""
  hits = jnp.zeros((max_reqs,), jnp.int32).at[jnp.where(mask, rows, max_reqs)].add(
      1, mode="drop")
  return jnp.any(hits > 1)


def _last_loc(table: RequestTable, rows: Array, lens: Array, ps: int) -> Array:
  """Slot of each row's last token: pages[r, (len-1)//ps] * ps + (len-1) % ps; -1 at 0."""
  col = jnp.maximum(lens - 1, 0) // ps
  col = jnp.minimum(col, table.pages.shape[1] - 1)
  slot = table.pages[rows, col] * ps + jnp.maximum(lens - 1, 0) % ps
  return jnp.where(lens > 0, slot, -1)


def _hold_back_merge(config: AllocatorConfig, state: AllocatorState, go: Array):
  """When `go` is False the table refuses before the allocator: the allocator then sees
  no rows, but a need_sort merge could still trigger on an empty free list. Hiding the
  release list for that call (O(1)) keeps the pool exactly as it was."""
  if not config.need_sort:
    return state
  return state._replace(release_len=jnp.where(go, state.release_len, 0))


def _restore_release(config: AllocatorConfig, before: AllocatorState,
                     after: AllocatorState, go: Array) -> AllocatorState:
  if not config.need_sort:
    return after
  return after._replace(release_len=jnp.where(go, after.release_len, before.release_len))


def _columns_mask(start: Array, end: Array, width: int) -> Array:
  """bool[B, width]: start[b] <= j < end[b]."""
  j = jnp.arange(width, dtype=jnp.int32)[None, :]
  return (j >= start[:, None]) & (j < end[:, None])


def _count(num_rows: Optional[Array], num: int) -> Array:
  """i32[] the num_rows argument (None: all num entries)."""
  if num_rows is None:
    return jnp.full((), num, jnp.int32)
  return validate.as_i32(num_rows, "num_rows")


def _table_kernel(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                  name: str, *, max_tokens: int = 0, release=None, extend=None,
                  decode=None):
  """The given phases (release (rows, num), extend (rows, n, num), decode (rows, num); in
  that order) as one launch (two with extend) that writes the pool and the table
  (pallas_kernels.table_step_triton, or table_step_mosaic_gpu for the Mosaic GPU
  family), or None where it does not apply: the jnp path, the TPU's Mosaic backend,
  need_sort (a merge may run), debug mode, the token allocator, and sizes the kernel's
  `supported` refuses. Returns (state, table, the kernel's per-phase results)."""
  if config.kind != "paged" or config.need_sort or config.debug:
    return None
  impl, interpret = kernels.family(name)
  if impl not in ("triton", "mosaic_gpu"):
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  supported, step = ((pallas_kernels.table_supported, pallas_kernels.table_step_triton)
                     if impl == "triton" else
                     (pallas_kernels.table_mosaic_gpu_supported,
                      pallas_kernels.table_step_mosaic_gpu))
  max_reqs, width = table.pages.shape
  size = lambda phase: 0 if phase is None else phase[0].shape[0]
  if not supported(
      max_reqs=max_reqs, width=width, num_pages=config.num_pages,
      page_size=config.page_size, release=size(release), extend=size(extend),
      max_tokens=max_tokens, decode=size(decode)):
    return None
  out = step(
      state.free_ring, state.free_head, state.free_len, state.release_len, table.pages,
      table.lens, table.owned_from, page_size=config.page_size, release=release,
      extend=extend, max_tokens=max_tokens, decode=decode,
      interpret=interpret, record=state.guard, op=guard.OP_RELEASE_ROWS)
  state = state._replace(free_ring=out["ring"], free_head=out["head"],
                         free_len=out["length"])
  if state.guard is not None:
    state = state._replace(guard=guard.GuardState(out["held"], out["status"]))
  return state, RequestTable(out["pages"], out["lens"], out["owned_from"]), out


def _one_launch(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                pick: Tuple[str, ...], fallback, **phases):
  """(state, table, *the kernel's results named in pick) from one table launch where it
  applies (on the pool's device, kernels.by_device), else fallback()."""
  def run(name: str):
    out = _table_kernel(config, state, table, name, **phases)
    if out is None:
      return fallback()
    state2, table2, res = out
    return (state2, table2) + tuple(res[k] for k in pick)

  return kernels.by_device(config.kernel, state.free_ring, run, "table")


# ---------------------------------------------------------------------------------------
# Operations.
# ---------------------------------------------------------------------------------------

def extend_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                rows: Array, n: Array, *, max_tokens: int,
                num_rows: Optional[Array] = None
                ) -> Tuple[AllocatorState, RequestTable, Array, Array]:
  """Extends rows by n tokens each (a prefill chunk; SPEC 11).

  Exactly `alloc_extend(prefix_lens=lens[rows], seq_lens=lens[rows] + n, last_loc)` with
  last_loc read from the table; the new pages are appended to each row, in order, and
  `lens += n`.

  Args:
    config: static configuration.
    state: the pool.
    table: the request table.
    rows: i32[B] distinct table rows, in batch order.
    n: i32[B] tokens to add per row (>= 0; 0 adds nothing).
    max_tokens: static length of the returned slots (a bucket of sum(n)).
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    (state, table, i32[max_tokens] slots, bool[] ok). The first sum(n) slots are the new
    tokens' K/V slots in batch order (row by row), the rest 0. ok is False when the pool
    is short (as alloc_extend: only a need_sort merge that the shortfall triggered stays),
    when a row would exceed max_pages_per_req pages, when sum(n) > max_tokens, when some
    n < 0, or when the rows repeat or leave the table (then the pool is untouched); the
    table is unchanged whenever ok is False.
  """
  rows, a, num = _static_batch(table, rows, n=n)
  return _one_launch(
      config, state, table, ("extend_slots", "extend_ok"),
      lambda: _extend_rows_jnp(config, state, table, rows, a["n"], max_tokens, num_rows),
      max_tokens=max_tokens, extend=(rows, a["n"], _count(num_rows, num)))


def _extend_rows_jnp(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                     rows: Array, n: Array, max_tokens: int, num_rows: Optional[Array]):
  """extend_rows as XLA ops (and the allocator's own dispatch)."""
  ps = config.page_size
  rows, real, count, go, a = _batch(table, rows, num_rows, n=n)
  n = jnp.where(real, a["n"], 0)
  max_reqs, width = table.pages.shape
  pre = jnp.where(real, table.lens[rows], 0)
  # Row capacity, written so that no sum can overflow: n <= width * ps - pre.
  go = go & jnp.all((n >= 0) & (n <= width * ps - pre))
  n = jnp.where(go, n, 0)
  seq = pre + n
  last_loc = _last_loc(table, rows, pre, ps)
  before = state
  state, slots, ok = allocation.alloc_extend(
      config, _hold_back_merge(config, state, go), pre, seq, last_loc,
      max_tokens=max_tokens, num_reqs=jnp.where(go, count, 0))
  state = _restore_release(config, before, state, go)
  ok = ok & go

  # The k-th new page of the batch starts at the token in column pre // ps + ... of its
  # row; its first slot (offset 0) sits in `slots` at tok_start[row] + col * ps - pre.
  ext = jnp.where(ok, n, 0)
  new_pages = cdiv(pre + ext, ps) - cdiv(pre, ps)
  tok_start = jnp.cumsum(ext) - ext
  page_end = jnp.cumsum(new_pages)
  total_pages = page_end[-1]
  k = jnp.arange(max(1, min(config.num_pages, max_tokens // ps + rows.shape[0])),
                 dtype=jnp.int32)
  b = jnp.minimum(index_jnp.searchsorted_right(page_end, k).astype(jnp.int32),
                  rows.shape[0] - 1)
  col = cdiv(pre[b], ps) + k - (page_end[b] - new_pages[b])
  at = jnp.clip(tok_start[b] + col * ps - pre[b], 0, max_tokens - 1)
  page = slots[at] // ps
  dest = jnp.where(k < total_pages, rows[b], max_reqs)  # max_reqs: dropped
  pages = table.pages.at[dest, jnp.minimum(col, width - 1)].set(page, mode="drop")
  lens = table.lens.at[jnp.where(ok & real, rows, max_reqs)].set(seq, mode="drop")
  return state, table._replace(pages=pages, lens=lens), slots, ok


def decode_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                rows: Array, *, num_rows: Optional[Array] = None
                ) -> Tuple[AllocatorState, RequestTable, Array, Array]:
  """One new token for each row (SPEC 11 decode): `alloc_decode(seq_lens=lens[rows] + 1,
  last_loc)` with last_loc read from the table; a new page is appended where the token
  starts one, and `lens += 1`.

  Args:
    config: static configuration.
    state: the pool.
    table: the request table.
    rows: i32[B] distinct table rows.
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    (state, table, i32[B] slots, bool[] ok). Padding entries get slot 0. ok is False (table
    unchanged) when the pool is short (as alloc_decode: a triggered need_sort merge
    stays), when a row is full (lens == max_pages_per_req * page_size), or when the rows
    repeat or leave the table (then the pool is untouched too).
  """
  rows, _, num = _static_batch(table, rows)
  return _one_launch(config, state, table, ("decode_slots", "decode_ok"),
                     lambda: _decode_rows_jnp(config, state, table, rows, num_rows),
                     decode=(rows, _count(num_rows, num)))


def _decode_rows_jnp(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                     rows: Array, num_rows: Optional[Array]):
  """decode_rows as XLA ops (and the allocator's own dispatch)."""
  ps = config.page_size
  rows, real, count, go, _ = _batch(table, rows, num_rows)
  max_reqs, width = table.pages.shape
  pre = jnp.where(real, table.lens[rows], 0)
  go = go & jnp.all(~real | (pre < width * ps))
  seq = pre + 1
  last_loc = _last_loc(table, rows, pre, ps)
  # alloc_decode's merge trigger is bs > len(free_pages): with no rows it cannot fire.
  state, slots, ok = allocation.alloc_decode(config, state, seq, last_loc,
                                             num_reqs=jnp.where(go, count, 0))
  ok = ok & go
  live = ok & real
  starts_page = live & (pre % ps == 0)
  pages = table.pages.at[jnp.where(starts_page, rows, max_reqs),
                         jnp.minimum(pre // ps, width - 1)].set(slots // ps, mode="drop")
  lens = table.lens.at[jnp.where(live, rows, max_reqs)].set(seq, mode="drop")
  return state, table._replace(pages=pages, lens=lens), slots, ok


def release_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                 rows: Array, *, num_rows: Optional[Array] = None
                 ) -> Tuple[AllocatorState, RequestTable, Array]:
  """Frees every page the rows own and clears the rows (SPEC 11).

  One `free_page_ids` of the concatenation, for each row in the given order, of
  `pages[r, owned_from[r] : ceil(lens[r] / ps)]`: SGLang's `free_segment` of each whole
  row, pages prepended in that order, no sort. Borrowed columns are not freed.

  Args:
    config: static configuration.
    state: the pool.
    table: the request table.
    rows: i32[B] distinct table rows (an empty row frees nothing).
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    (state, table, bool[] ok). ok is False, and nothing changes, when the rows repeat or
    leave the table, or when the ownership record (config.guard) refuses the free: an
    owned page that is not held, or a page two released columns name (then
    state.guard.status records it, op release_rows).
  """
  rows, _, num = _static_batch(table, rows)
  return _one_launch(config, state, table, ("release_ok",),
                     lambda: _release_rows_jnp(config, state, table, rows, num_rows),
                     release=(rows, _count(num_rows, num)))


def _release_rows_jnp(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                      rows: Array, num_rows: Optional[Array]):
  """release_rows as XLA ops."""
  ps = config.page_size
  rows, real, _, go, _ = _batch(table, rows, num_rows)
  max_reqs, width = table.pages.shape
  live = real & go
  end = jnp.where(live, cdiv(table.lens[rows], ps), 0)
  owned = _columns_mask(table.owned_from[rows], end, width)
  # Zeros are free_page_ids' padding (page 0 is never a row's page): no compaction here,
  # free_page_ids does the one the ring needs.
  state, refused = freeing.free_page_ids_refused(
      config, state, jnp.where(owned, table.pages[rows], 0).reshape(-1),
      op=guard.OP_RELEASE_ROWS)
  if state.guard is not None:  # a refused release leaves the rows as they were
    go, live = go & ~refused, live & ~refused
  dest = jnp.where(live, rows, max_reqs)
  table = RequestTable(pages=table.pages.at[dest].set(0, mode="drop"),
                       lens=table.lens.at[dest].set(0, mode="drop"),
                       owned_from=table.owned_from.at[dest].set(0, mode="drop"))
  return state, table, go



class StepOutputs(NamedTuple):
  """What `step_rows` returns beside the pool and the table; None for a phase not run."""
  release_ok: Optional[Array]    # bool[] as release_rows
  extend_slots: Optional[Array]  # i32[max_tokens] as extend_rows
  extend_ok: Optional[Array]     # bool[]
  decode_slots: Optional[Array]  # i32[Bd] as decode_rows
  decode_ok: Optional[Array]     # bool[]


def step_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable, *,
              release: Optional[Array] = None, num_release: Optional[Array] = None,
              extend: Optional[Array] = None, n: Optional[Array] = None,
              num_extend: Optional[Array] = None, max_tokens: int = 0,
              decode: Optional[Array] = None, num_decode: Optional[Array] = None
              ) -> Tuple[AllocatorState, RequestTable, StepOutputs]:
  """A serving step's table work: `release_rows`, then `extend_rows`, then `decode_rows`
  (each optional), bit for bit their composition, as one kernel launch on a GPU pool
  (two when it extends: the slots by a program per row).

  Args:
    config: static configuration.
    state: the pool.
    table: the request table.
    release: i32[Br] rows to release (None: no release); num_release as release_rows'
      num_rows.
    extend: i32[Be] rows to extend (None: no extend) by n (i32[Be]) tokens each, into
      max_tokens (static) slots; num_extend as extend_rows' num_rows.
    decode: i32[Bd] rows to decode (None: no decode); num_decode likewise.

  Returns:
    (state, table, StepOutputs): the pool and table after all phases and each phase's
    result as its own operation returns it. A refused phase changes nothing, as that
    operation alone; the later phases run on what the earlier ones left. On the Triton
    and Mosaic GPU families (paged pool, need_sort and debug off, sizes the kernel
    takes) pallas_kernels.table_step_triton / table_step_mosaic_gpu (one launch, two
    with extend); elsewhere the three calls.

  Raises:
    TypeError / ValueError naming the argument, as the operations do; ValueError when
    extend is given without n or without max_tokens.
  """
  if extend is not None and n is None:
    raise ValueError("n must be given with extend (tokens per extended row)")
  if extend is not None and max_tokens < 1:
    raise ValueError(f"max_tokens must be given with extend (the static length of the "
                     f"extend slots, >= the tokens extended), got max_tokens={max_tokens}")
  phases = {}
  if release is not None:
    rows, _, num = _static_batch(table, release)
    phases["release"] = (rows, _count(num_release, num))
  if extend is not None:
    rows, a, num = _static_batch(table, extend, n=n)
    phases["extend"] = (rows, a["n"], _count(num_extend, num))
  if decode is not None:
    rows, _, num = _static_batch(table, decode)
    phases["decode"] = (rows, _count(num_decode, num))

  def composed():
    s, t = state, table
    out = dict.fromkeys(StepOutputs._fields)
    if "release" in phases:
      s, t, out["release_ok"] = release_rows(config, s, t, release, num_rows=num_release)
    if "extend" in phases:
      s, t, out["extend_slots"], out["extend_ok"] = extend_rows(
          config, s, t, extend, n, max_tokens=max_tokens, num_rows=num_extend)
    if "decode" in phases:
      s, t, out["decode_slots"], out["decode_ok"] = decode_rows(config, s, t, decode,
                                                                num_rows=num_decode)
    return s, t, StepOutputs(**out)

  if not phases:
    return composed()

  def run(name: str):
    got = _table_kernel(config, state, table, name, max_tokens=max_tokens, **phases)
    if got is None:
      return composed()
    s, t, res = got
    return s, t, StepOutputs(**{k: res.get(k) for k in StepOutputs._fields})

  return kernels.by_device(config.kernel, state.free_ring, run, "table")


def borrow_pages(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                 rows: Array, page_ids: Array, num_pages: Array, *,
                 num_rows: Optional[Array] = None) -> Tuple[RequestTable, Array]:
  """Starts empty rows from whole pages that someone else owns (a shared prefix).

  Row rows[b] gets pages page_ids[b, :num_pages[b]], lens = num_pages[b] * page_size and
  owned_from = num_pages[b]: those columns are never freed by this row. The caller keeps
  their owner alive (e.g. a prefix cache's node) while any borrower holds them. To take
  another row's first pages, `borrow_from_rows` reads them itself.

  Args:
    config: static configuration.
    state: the pool (not changed): with the ownership record (config.guard) every page
      lent must be held.
    table: the request table.
    rows: i32[B] distinct, empty (lens == 0) table rows.
    page_ids: i32[B, W] page ids (W <= max_pages_per_req, static).
    num_pages: i32[B] pages to borrow per row (0 <= num_pages <= W).
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    (table, bool[] ok). ok is False, table unchanged, when a row is not empty, repeats or
    leaves the table, a count is out of range, a borrowed id is not a page of the pool,
    or (with the ownership record) a borrowed page is not held (SPEC 14: free, released
    or never handed out). On the Triton family (any pool kind; up to pallas_kernels.borrow_supported's rows)
    one launch, pallas_kernels.borrow_triton; elsewhere XLA's ops.

  Raises:
    TypeError / ValueError naming the argument for a non-integer dtype or a bad shape.
  """
  rows, a, num = _static_batch(table, rows, num_pages=num_pages)
  page_ids = validate.as_i32(page_ids, "page_ids")
  width = table.pages.shape[1]
  if page_ids.ndim != 2 or page_ids.shape[0] != num or page_ids.shape[1] > width:
    raise ValueError(f"page_ids must be i32[B, W] with B={num} rows and "
                     f"W <= max_pages_per_req={width}, got shape {page_ids.shape}")
  return _borrow(config, state, table, rows, a["num_pages"], num_rows,
                 page_ids=page_ids)


def borrow_from_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                     rows: Array, src: Array, num_pages: Array, *,
                     num_rows: Optional[Array] = None,
                     hand_over: bool = False) -> Tuple[RequestTable, Array]:
  """Starts empty rows from the first whole pages of other rows: `borrow_pages` with
  page_ids = table.pages[src, :max_pages_per_req], read by the call itself.

  Row rows[b] gets pages[src[b], :num_pages[b]] and lens = num_pages[b] * page_size.
  By default it borrows them (owned_from = num_pages[b]): the source keeps owning them,
  and the caller keeps it alive while any borrower holds them. With hand_over the row
  owns them instead (owned_from = 0) and the source keeps them as a borrowed prefix
  (owned_from[src[b]] = num_pages[b]): a finished prompt handing its prefix to a cache
  row, which then outlives it.

  Args:
    config: static configuration.
    state: the pool (not changed): with the ownership record every page taken must be
      held.
    table: the request table.
    rows: i32[B] distinct, empty (lens == 0) table rows.
    src: i32[B] table rows to take pages from (may repeat, unless hand_over).
    num_pages: i32[B] pages each row takes: 0 <= num_pages[b] and num_pages[b] *
      page_size <= lens[src[b]] (whole pages the source holds).
    num_rows: optional i32[]; entries at index >= num_rows are padding.
    hand_over: static; hand the pages over (above).

  Returns:
    (table, bool[] ok). ok is False, table unchanged, when a row is not empty, repeats or
    leaves the table, a source leaves the table, a count is out of range, a page taken
    is not a page of the pool (0 included) or (with the ownership record) not held, or,
    with hand_over, a source repeats or does not own its first columns
    (owned_from[src] != 0). On the Triton family (any pool
    kind; up to pallas_kernels.borrow_supported's rows) one launch,
    pallas_kernels.borrow_triton, with no gather before it; elsewhere XLA's ops.

  Raises:
    TypeError / ValueError naming the argument for a non-integer dtype or a bad shape.
  """
  rows, a, _ = _static_batch(table, rows, src=src, num_pages=num_pages)
  return _borrow(config, state, table, rows, a["num_pages"], num_rows, src=a["src"],
                 hand_over=bool(hand_over))


def _lent_held(state: AllocatorState, table: RequestTable, rows: Array,
               num_pages: Array, num_rows: Optional[Array], page_ids: Optional[Array],
               src: Optional[Array]) -> Array:
  """bool[]: every page a borrow takes (the first num_pages[b] of page_ids[b] or of row
  src[b], real rows only) is held in the ownership record (True without one). Ids
  outside the pool count as held here: the borrow refuses them itself."""
  if state.guard is None:
    return jnp.ones((), bool)
  held = state.guard.held
  if src is not None:
    page_ids = table.pages[jnp.clip(src, 0, table.pages.shape[0] - 1)]
  real = jnp.arange(rows.shape[0]) < _count(num_rows, rows.shape[0])
  used = (jnp.arange(page_ids.shape[1])[None, :] < num_pages[:, None]) & real[:, None]
  inside = (page_ids >= 1) & (page_ids < held.shape[0])
  lent = held[jnp.where(inside, page_ids, 0)] != 0
  return jnp.all(~used | ~inside | lent)


def _borrow(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
            rows: Array, num_pages: Array, num_rows: Optional[Array], *,
            page_ids: Optional[Array] = None, src: Optional[Array] = None,
            hand_over: bool = False):
  """borrow_pages (page_ids) or borrow_from_rows (src): one Triton launch where the
  table's device and config.kernel select the Triton family, else `_borrow_jnp`; with
  the ownership record, a borrow naming a page that is not held is refused (ok False,
  table unchanged: it runs with no rows)."""
  held = _lent_held(state, table, rows, num_pages, num_rows, page_ids, src)
  table, ok = _borrow_rows(config, table, rows, num_pages,
                           jnp.where(held, _count(num_rows, rows.shape[0]), 0),
                           page_ids=page_ids, src=src, hand_over=hand_over)
  return table, ok & held


def _borrow_rows(config: AllocatorConfig, table: RequestTable, rows: Array,
                 num_pages: Array, num_rows: Optional[Array], *,
                 page_ids: Optional[Array] = None, src: Optional[Array] = None,
                 hand_over: bool = False):
  """`_borrow` without the ownership record."""
  max_reqs, width = table.pages.shape
  num = rows.shape[0]

  def run(name: str):
    impl, interpret = kernels.family(name)
    if impl == "triton" and (page_ids is None or page_ids.shape[1] >= 1):
      import pallas_kernels  # pylint: disable=g-import-not-at-top
      if pallas_kernels.borrow_supported(max_reqs=max_reqs, width=width,
                                         page_size=config.page_size, rows=num):
        pages, lens, owned, ok = pallas_kernels.borrow_triton(
            table.pages, table.lens, table.owned_from, rows, _count(num_rows, num),
            num_pages, page_size=config.page_size, pool_pages=config.num_pages,
            page_ids=page_ids, src=src, hand_over=hand_over, interpret=interpret)
        return RequestTable(pages, lens, owned), ok
    return _borrow_jnp(config, table, rows, num_pages, num_rows, page_ids, src, hand_over)

  return kernels.by_device(config.kernel, table.pages, run, "table")


def _borrow_jnp(config: AllocatorConfig, table: RequestTable, rows: Array,
                num_pages: Array, num_rows: Optional[Array], page_ids: Optional[Array],
                src: Optional[Array], hand_over: bool):
  """borrow_pages / borrow_from_rows as XLA ops."""
  rows, real, _, go, a = _batch(table, rows, num_rows, num_pages=num_pages)
  max_reqs, width = table.pages.shape
  k = jnp.where(real, a["num_pages"], 0)
  if src is not None:
    inside = (src >= 0) & (src < max_reqs)
    src = jnp.clip(src, 0, max_reqs - 1)
    page_ids = table.pages[src]
    src_ok = inside & (k <= table.lens[src] // config.page_size)
    if hand_over:
      src_ok = src_ok & (table.owned_from[src] == 0)
      go = go & ~_repeated(src, real & inside, max_reqs)
    go = go & jnp.all(~real | src_ok)
  wide = page_ids.shape[1]
  used = _columns_mask(jnp.zeros_like(k), k, wide)
  ids_ok = (page_ids >= 1) & (page_ids <= config.num_pages)
  go = go & jnp.all(~real | ((table.lens[rows] == 0) & (k >= 0) & (k <= wide)))
  go = go & jnp.all(ids_ok | ~used)
  dest = jnp.where(real & go, rows, max_reqs)
  new_row = jnp.zeros((rows.shape[0], width), jnp.int32).at[:, :wide].set(
      jnp.where(used, page_ids, 0))
  owned = table.owned_from.at[dest].set(0 if hand_over else k, mode="drop")
  if hand_over:
    owned = owned.at[jnp.where(real & go, src, max_reqs)].set(k, mode="drop")
  table = RequestTable(pages=table.pages.at[dest].set(new_row, mode="drop"),
                       lens=table.lens.at[dest].set(k * config.page_size, mode="drop"),
                       owned_from=owned)
  return table, go


def admit_rows(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
               rows: Array, n: Array, *, num_rows: Optional[Array] = None,
               max_tokens: Optional[int] = None) -> Array:
  """How many queued requests fit together: the largest k such that `extend_rows` (or
  `decode_rows`, n = 1) of the first k entries succeeds.

  The first k must fit in the pool's free pages, counting release_pages when need_sort
  is on (a merge always runs when the free list alone is short: the merge triggers of
  SPEC 4.2/4.3 fire whenever the pages needed exceed it), each within its row's
  max_pages_per_req, with n >= 0, rows distinct and inside the table, and (when
  max_tokens is given) at most max_tokens tokens together.

  Args:
    config: static configuration.
    state: the pool (not changed).
    table: the request table.
    rows: i32[B] table rows in queue order.
    n: i32[B] tokens each would add.
    num_rows: optional i32[]; entries at index >= num_rows are not queued.
    max_tokens: optional static token budget of the batch.

  Returns:
    i32[] k in [0, num_rows].
  """
  ps = config.page_size
  max_reqs, width = _check_table(table)
  rows_in = validate.as_i32(rows, "rows")
  r, real, _, _, a = _batch(table, rows_in, num_rows, n=n)
  n = a["n"]
  num = rows_in.shape[0]
  pre = table.lens[r]
  inside = (rows_in >= 0) & (rows_in < max_reqs)
  i = jnp.arange(num, dtype=jnp.int32)
  first = jnp.full((max_reqs,), num, jnp.int32).at[jnp.where(inside, rows_in, max_reqs)].min(
      i, mode="drop")
  alone_ok = inside & (first[r] == i) & (n >= 0) & (n <= width * ps - pre)
  need = jnp.where(alone_ok, cdiv(pre + jnp.where(alone_ok, n, 0), ps) - cdiv(pre, ps), 0)
  avail = state.free_len + (state.release_len if config.need_sort else 0)
  excl, _ = allocation._prefix_sums(need, config.num_pages)  # pylint: disable=protected-access
  fits = alone_ok & (excl + need <= avail)
  if max_tokens is not None:
    tok = jnp.minimum(jnp.where(alone_ok, n, 0), max_tokens + 1)
    excl_t, _ = allocation._prefix_sums(tok, max_tokens)  # pylint: disable=protected-access
    fits = fits & (excl_t + tok <= max_tokens)
  fits_all = jnp.cumsum((~fits).astype(jnp.int32)) == 0
  return jnp.sum((fits_all & real).astype(jnp.int32))


def attention_inputs(config: AllocatorConfig, table: RequestTable, rows: Array,
                     q_lens: Array, *, num_rows: Optional[Array] = None) -> AttentionInputs:
  """Ragged paged-attention inputs for the given rows (SPEC 11).

  Call it after the step's extend/decode, so kv_lens count the new tokens: the query
  tokens of row b are its last q_lens[b] tokens, and the kernel's KV pages are the pool's
  K/V buffer viewed as [num_pages + 1, page_size, ...].

  Args:
    config: static configuration.
    table: the request table.
    rows: i32[B] table rows, in the order of the packed queries.
    q_lens: i32[B] query tokens per row this step.
    num_rows: optional i32[]; entries at index >= num_rows are padding.

  Returns:
    AttentionInputs: page_indices i32[B, max_pages_per_req] (0 past each row's
    ceil(lens / ps) pages), kv_lens i32[B], cu_q_lens i32[B + 1], num_seqs i32[1]
    (the rows that are neither padding nor outside the table); padding rows and rows
    outside the table have length 0 and no pages (put them last).
  """
  ps = config.page_size
  max_reqs, width = _check_table(table)
  rows_in = validate.as_i32(rows, "rows")
  r, real, _, _, a = _batch(table, rows_in, num_rows, q_lens=q_lens)
  real = real & (rows_in >= 0) & (rows_in < max_reqs)
  kv_lens = jnp.where(real, table.lens[r], 0)
  used = _columns_mask(jnp.zeros_like(kv_lens), cdiv(kv_lens, ps), width)
  page_indices = jnp.where(used, table.pages[r], 0)
  q = jnp.where(real, a["q_lens"], 0)
  cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q).astype(jnp.int32)])
  num_seqs = jnp.sum(real.astype(jnp.int32))  # rows outside the table are padding too
  return AttentionInputs(page_indices=page_indices, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                         num_seqs=num_seqs.reshape(1))
