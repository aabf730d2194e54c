"""What one `jax-kvalloc simulate` step does to the pool: the request-table operations of
a scheduler iteration, shared by both drivers.

A step, in order (SPEC 11's operations, jax_kvalloc.request_table):

  1. free group: finished requests and evicted prefix-cache entries are released in ONE
     `release_rows` call (one `free_page_ids` of their pages, row by row, no sort);
  2. borrow: newly admitted requests whose prompt starts with a cached prefix start from
     its pages (`borrow_pages` from the cache's table row);
  3. allocation: `extend_rows` of the prefill batch (chunked prompts), or `decode_rows`
     of every decoding request;
  4. hand-over: a request that just finished prefilling a shared prefix that is not
     cached yet hands the prefix's whole pages to the cache (the cache's row borrows them
     and then owns them; the request keeps them as a borrowed prefix).

The table has `max_running` request rows followed by one row per prefix group (the
cache). The host driver (jax_kvalloc.tools.simulate) plans each step on the host and
launches `prefill_step` or `decode_step` with the plan packed into one i32 vector; the
device driver (jax_kvalloc.tools.simulate_device) plans on the device and runs
`apply_step` inside its loop. Both return a status: ok (every operation succeeded), the
free + released pages after the step, and a checksum of the slots handed out (so the two
drivers' allocations can be compared step by step without shipping them).

SWA mode (simulate's --swa-window) runs `swa_free_and_window` (the free group in both
pools, then every row's window frees) and `swa_allocate` on an SWAState and SWATable
(jax_kvalloc.swa_table) instead; no borrows or hand-overs; its status adds the SWA pool's
free + released pages and its records the columns SWA_RECORD.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc import swa_table
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.request_table import RequestTable
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.swa import SWAConfig, SWAState
from jax_kvalloc.swa_table import SWATable

Array = jax.Array


class Plan(NamedTuple):
  """One step's work. Entries at index >= the matching count are padding."""
  free_rows: Array     # i32[F] rows released in this step's free group, in order
  num_free: Array      # i32[]
  forget_row: Array    # i32[] a row whose pages are dropped, not freed (-1: none; test hook)
  borrow_rows: Array   # i32[B] admitted rows that start from a cached prefix
  borrow_src: Array    # i32[B] the cache rows they borrow from
  borrow_pages: Array  # i32[B] whole pages borrowed
  num_borrow: Array    # i32[]
  rows: Array          # i32[N] rows to extend (prefill, N = B) or decode (N = max_running)
  n: Array             # i32[N] tokens each row gets (1 when decoding)
  num_rows: Array      # i32[]
  ins_rows: Array      # i32[B] rows whose prefix pages go to the cache after the step
  ins_dst: Array       # i32[B] the cache rows
  ins_pages: Array     # i32[B] pages handed over
  num_ins: Array       # i32[]


def plan_sizes(f: int, b: int, n: int) -> Tuple[int, ...]:
  """Static lengths of the Plan fields (in order) for F frees, B admissions, N rows."""
  return (f, 1, 1, b, b, b, 1, n, n, 1, b, b, b, 1)


def pack_plan(plan: Plan) -> np.ndarray:
  """The host side of a step's inputs: every field in one i32 vector, one transfer."""
  return np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in plan])


def unpack_plan(packed: Array, sizes: Tuple[int, ...]) -> Plan:
  out, at = [], 0
  for size in sizes:
    part = packed[at:at + size]
    out.append(part[0] if size == 1 and len(out) in (1, 2, 6, 9, 13) else part)
    at += size
  return Plan(*out)


def checksum(slots: Array, count: Array) -> Array:
  """i32[]: sum of (i + 1) * slots[i] over the first `count` slots, wrapping (the same
  slots in the same order give the same value)."""
  i = jnp.arange(slots.shape[0], dtype=jnp.uint32)
  s = jnp.where(i < count.astype(jnp.uint32), slots.astype(jnp.uint32), 0)
  return jnp.sum((i + 1) * s, dtype=jnp.uint32).astype(jnp.int32)


def apply_step(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
               plan: Plan, *, prefill: bool, max_tokens: int, prefix_width: int
               ) -> Tuple[AllocatorState, RequestTable, Array]:
  """Runs one planned step (the module docstring's four parts): `free_and_borrow`, then
  `allocate`.

  Args:
    config: the pool's static configuration.
    state, table: the pool and the request table (rows: requests, then the cache).
    plan: the step's work (`Plan`).
    prefill: static; extend the plan's rows by `n` and hand prefixes over (True) or
      decode them (False; the plan then has no borrows and no hand-overs).
    max_tokens: static length of the extend's slot array (the prefill token budget).
    prefix_width: static page columns a cached prefix can span.

  Returns:
    (state, table, i32[3] status: ok, free + released pages after the step, checksum of
    the slots allocated).
  """
  state, table, ok = free_and_borrow(config, state, table, plan, prefix_width=prefix_width,
                                     borrow=prefill)
  return allocate(config, state, table, plan, ok, prefill=prefill, max_tokens=max_tokens,
                  prefix_width=prefix_width)


def free_and_borrow(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
                    plan: Plan, *, prefix_width: int, borrow: bool = True
                    ) -> Tuple[AllocatorState, RequestTable, Array]:
  """Parts 1-2: the free group (`release_rows`) and the borrows. Returns (state, table,
  bool[] ok)."""
  ps = config.page_size
  max_reqs = table.lens.shape[0]
  forget = jnp.where(plan.forget_row >= 0, plan.forget_row, max_reqs)
  table = table._replace(owned_from=table.owned_from.at[forget].set(
      cdiv(table.lens[jnp.minimum(forget, max_reqs - 1)], ps), mode="drop"))
  state, table, ok = rt.release_rows(config, state, table, plan.free_rows,
                                     num_rows=plan.num_free)
  if borrow:
    src = table.pages[plan.borrow_src, :prefix_width]
    table, ok_borrow = rt.borrow_pages(config, table, plan.borrow_rows, src,
                                       plan.borrow_pages, num_rows=plan.num_borrow)
    ok = ok & ok_borrow
  return state, table, ok


def allocate(config: AllocatorConfig, state: AllocatorState, table: RequestTable,
             plan: Plan, ok: Array, *, prefill: bool, max_tokens: int, prefix_width: int,
             hide_merge: Optional[Array] = None
             ) -> Tuple[AllocatorState, RequestTable, Array]:
  """Parts 3-4: `extend_rows` and the hand-overs (prefill) or `decode_rows`. `ok` is the
  first parts' flag; returns (state, table, status) as `apply_step`.

  hide_merge (bool[], prefill only): an extend of no rows that must not run the need_sort
  merge that an empty free list would trigger (the device driver's branch-free step runs
  the extend of every step, with no rows when it decodes); the release list is hidden
  from that call.
  """
  if prefill:
    before = state
    if hide_merge is not None and config.need_sort:
      state = state._replace(release_len=jnp.where(hide_merge, 0, state.release_len))
    state, table, slots, ok_alloc = rt.extend_rows(config, state, table, plan.rows, plan.n,
                                                   max_tokens=max_tokens,
                                                   num_rows=plan.num_rows)
    if hide_merge is not None and config.need_sort:
      state = state._replace(release_len=jnp.where(hide_merge, before.release_len,
                                                   state.release_len))
    real = jnp.arange(plan.n.shape[0]) < plan.num_rows
    count = jnp.sum(jnp.where(real, plan.n, 0))
    table, ok_ins = hand_over(config, table, plan.ins_rows, plan.ins_dst, plan.ins_pages,
                              plan.num_ins, prefix_width=prefix_width)
    ok_alloc = ok_alloc & ok_ins
  else:
    state, table, slots, ok_alloc = rt.decode_rows(config, state, table, plan.rows,
                                                   num_rows=plan.num_rows)
    count = plan.num_rows
  ok = ok & ok_alloc
  status = jnp.stack([ok.astype(jnp.int32), state.free_len + state.release_len,
                      checksum(slots, count)])
  return state, table, status


def hand_over(config: AllocatorConfig, table: RequestTable, src: Array, dst: Array,
              pages: Array, num: Array, *, prefix_width: int) -> Tuple[RequestTable, Array]:
  """Row dst[i] (empty) takes ownership of the first pages[i] pages of row src[i], which
  keeps them as a borrowed prefix (owned_from = pages[i]). Returns (table, ok)."""
  ids = table.pages[src, :prefix_width]
  table, ok = rt.borrow_pages(config, table, dst, ids, pages, num_rows=num)
  max_reqs = table.lens.shape[0]
  real = jnp.arange(src.shape[0]) < num
  owned = table.owned_from.at[jnp.where(real, dst, max_reqs)].set(0, mode="drop")
  owned = owned.at[jnp.where(real & ok, src, max_reqs)].set(pages, mode="drop")
  return table._replace(owned_from=owned), ok


def _step(config, state, table, packed, *, prefill, sizes, max_tokens, prefix_width):
  plan = unpack_plan(packed, sizes)
  return apply_step(config, state, table, plan, prefill=prefill, max_tokens=max_tokens,
                    prefix_width=prefix_width)


_STATIC = ("config", "sizes", "max_tokens", "prefix_width")
prefill_step = jax.jit(functools.partial(_step, prefill=True), static_argnames=_STATIC,
                       donate_argnames=("state", "table"))
prefill_step.__doc__ = """apply_step(prefill=True) of a plan packed by `pack_plan`."""
decode_step = jax.jit(functools.partial(_step, prefill=False), static_argnames=_STATIC,
                      donate_argnames=("state", "table"))
decode_step.__doc__ = """apply_step(prefill=False) of a plan packed by `pack_plan`."""


def swa_free_and_window(config: SWAConfig, state: SWAState, table: SWATable, plan: Plan,
                        *, window: int) -> Tuple[SWAState, SWATable, Array]:
  """SWA mode's part 1: the free group (`swa_table.release_rows`: both pools), then every
  row's SWA pages that left the window (`swa_table.window_rows` of all rows; empty rows
  free nothing). No borrows (SWA mode has no prefix cache). Returns (state, table, ok).
  The test hook forget_row clears that row's length first, so its pages leak in both
  pools."""
  max_reqs = table.lens.shape[0]
  forget = jnp.where(plan.forget_row >= 0, plan.forget_row, max_reqs)
  table = table._replace(lens=table.lens.at[forget].set(0, mode="drop"))
  state, table, ok = swa_table.release_rows(config, state, table, plan.free_rows,
                                            num_rows=plan.num_free)
  state, table, ok_w = swa_table.window_rows(config, state, table,
                                             jnp.arange(max_reqs, dtype=jnp.int32), window)
  return state, table, ok & ok_w


def swa_allocate(config: SWAConfig, state: SWAState, table: SWATable, plan: Plan,
                 ok: Array, *, prefill: bool, max_tokens: int
                 ) -> Tuple[SWAState, SWATable, Array]:
  """SWA mode's part 3: `swa_table.extend_rows` (prefill) or `decode_rows` in both pools.
  Returns (state, table, i32[4] status: ok, the full pool's free + released pages, the
  slots' checksum, the SWA pool's free + released pages)."""
  if prefill:
    state, table, slots, ok_alloc = swa_table.extend_rows(
        config, state, table, plan.rows, plan.n, max_tokens=max_tokens,
        num_rows=plan.num_rows)
    real = jnp.arange(plan.n.shape[0]) < plan.num_rows
    count = jnp.sum(jnp.where(real, plan.n, 0))
  else:
    state, table, slots, ok_alloc = swa_table.decode_rows(config, state, table, plan.rows,
                                                          num_rows=plan.num_rows)
    count = plan.num_rows
  full, swa = state.full, state.swa
  status = jnp.stack([(ok & ok_alloc).astype(jnp.int32), full.free_len + full.release_len,
                      checksum(slots, count), swa.free_len + swa.release_len])
  return state, table, status


def _swa_step(config, state, table, packed, *, prefill, sizes, max_tokens, window):
  plan = unpack_plan(packed, sizes)
  state, table, ok = swa_free_and_window(config, state, table, plan, window=window)
  return swa_allocate(config, state, table, plan, ok, prefill=prefill, max_tokens=max_tokens)


_SWA_STATIC = ("config", "sizes", "max_tokens", "window")
swa_prefill_step = jax.jit(functools.partial(_swa_step, prefill=True),
                           static_argnames=_SWA_STATIC, donate_argnames=("state", "table"))
swa_prefill_step.__doc__ = """SWA mode's step of a packed plan: swa_free_and_window, then
swa_allocate(prefill=True)."""
swa_decode_step = jax.jit(functools.partial(_swa_step, prefill=False),
                          static_argnames=_SWA_STATIC, donate_argnames=("state", "table"))
swa_decode_step.__doc__ = """SWA mode's step of a packed plan: swa_free_and_window, then
swa_allocate(prefill=False)."""


def free_list_runs(state: AllocatorState) -> Array:
  """Runs of consecutive page ids in the free list, in list order (i32[]); 0 if empty.

  [5, 6, 7, 2, 3] has 2 runs. Fewer runs = more contiguous allocations. Traceable.
  """
  n = state.free_ring.shape[0]
  w = st.ring_window(state.free_ring, state.free_head, state.free_len, n)
  i = jnp.arange(n)
  brk = (i >= 1) & (i < state.free_len) & (w != jnp.roll(w, 1) + 1)
  return jnp.where(state.free_len > 0, 1 + jnp.sum(brk), 0).astype(jnp.int32)


free_list_runs_jit = jax.jit(free_list_runs)


def new_pages(seq_before, seq_after, page_size: int):
  """Pages a request takes to grow from seq_before to seq_after tokens (host or device)."""
  return cdiv(seq_after, page_size) - cdiv(seq_before, page_size)


# One row per step, the same columns from both drivers (the drivers-agree test compares
# them; the report reads its series from them).
RECORD = ("kind",          # 1 prefill, 2 decode
          "admitted",      # requests admitted (the next ones in arrival order)
          "finished",      # requests that generated their last token
          "evicted",       # prefix-cache entries evicted
          "evict_code",    # sum of (g + 1) * 2**j over the j-th evicted group g
          "hits",          # admitted requests that borrow a cached prefix
          "tokens",        # tokens allocated
          "pages",         # pages allocated
          "used",          # pages in use after the step (the scheduler's count)
          "waste",         # unused slots inside the live requests' own pages
          "running",       # requests holding a row
          "committed",     # pages promised to running requests, not yet taken
          "runs",          # free-list runs (every runs_every-th step; else -1)
          "ok",            # every operation of the step succeeded (device status)
          "device_pages",  # free + released pages on the device after the step
          "checksum")      # `checksum` of the slots allocated
# SWA mode (simulate's --swa-window) appends these columns.
SWA_RECORD = ("swa_used",          # SWA pages in use after the step (the scheduler's count)
              "swa_committed",     # SWA pages reserved by running requests, not held
              "window_freed",      # SWA pages the step's window frees released
              "swa_device_pages",  # free + released SWA pages on the device after the step
              "refused")           # the next admission did not fit: 1 full pool, 2 SWA, 3 both
COL = {name: i for i, name in enumerate(RECORD + SWA_RECORD)}


def record_columns(swa: bool) -> Tuple[str, ...]:
  """The record's columns (SWA mode appends SWA_RECORD)."""
  return RECORD + SWA_RECORD if swa else RECORD
KIND_PREFILL, KIND_DECODE = 1, 2
