"""`jax-kvalloc simulate --driver device` (the default): the scheduler runs on the device.

The workload (arrival step, prompt and output lengths, prefix group of every request)
goes to the device once. One jitted call (`run_steps`) then runs up to K scheduler
iterations (`--steps-per-call`) in a `lax.while_loop` and returns the carry (pool, request
table, scheduler state) for the next call plus one record per step
(simulate_steps.RECORD): what the progress bar and the report need, nothing else. The
host only launches calls and reads their records, one call behind, so it never waits for
the device between steps.

The policy is the host scheduler's (jax_kvalloc.tools.simulate), written as array code,
and both drivers make the same decisions step by step (tests/test_simulate_drivers.py):

  1. arrivals join the queue (requests in arrival order: the queue is the range of
     request ids [head, arrived));
  2. up to max_frees finished requests leave the free-group queue (a ring of rows, in
     finishing order);
  3. a prefill batch: rows still prefilling (in admission order) take their next chunk,
     then queued requests are admitted in order while the batch has room (max_prefill_reqs
     rows, max_prefill_tokens tokens), a row is empty and the request's whole lifetime
     fits in the pages not promised to running requests. The first request that does not
     fit may evict unused cached prefixes (least recently used first) to make room; if
     that admits it, it is the iteration's last admission. A request whose group's prefix
     is cached borrows its pages;
  4. the step: a prefill when the batch is not empty, else a decode of every decoding
     request (or only the free group), else an idle iteration that advances the clock to
     the next arrival (simulate_steps.apply_step runs the table operations);
  5. a request that finished its prompt hands its group's prefix (whole pages) to the
     cache if none is cached; one that generated its last token joins the free queue.

Each step also checks the scheduler's page count against the device's free + released
pages; the host raises the host driver's errors from the records (simulate.LeakCheckError).

SWA mode (`lay.swa`, simulate's --swa-window; see jax_kvalloc.tools.simulate): the pool
is an SWAState and the table an SWATable of request rows only. Step 2 also frees, on the
scheduler's side as on the device, every remaining row's SWA pages wholly before
seq - window; step 3 admits a request only when both pools fit (the SWA pool:
simulate.swa_need pages), with no prefix cache (the workload's groups are -1 on the
device) and so no eviction; the records carry both pools' counts, checked every step.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.tools import simulate as sim
from jax_kvalloc.tools import simulate_steps as steps
from jax_kvalloc.tools.workload import Workload

Array = jax.Array
EMPTY, PREFILL, DECODE, FREEING = sim.EMPTY, sim.PREFILL, sim.DECODE, sim.FREEING
ERR_STUCK = 1


class DeviceWorkload(NamedTuple):
  """The requests, on the device (i32 throughout)."""
  arrival: Array     # i32[N] non-decreasing
  group: Array       # i32[N] prefix group or -1
  prompt: Array      # i32[N]
  output: Array      # i32[N]
  prefix_len: Array  # i32[G]


class Sched(NamedTuple):
  """The scheduler's state: the host scheduler's mirror, as arrays."""
  req: Array          # i32[R] request in each row, -1 when empty
  phase: Array        # i32[R] EMPTY / PREFILL / DECODE / FREEING
  seq: Array          # i32[R] tokens held
  prompt: Array       # i32[R]
  out: Array          # i32[R]
  gen: Array          # i32[R] tokens generated
  own: Array          # i32[R] first token the row owns (page aligned)
  group: Array        # i32[R]
  hit: Array          # bool[R] holds a reference on its group's cache entry
  reserved: Array     # i32[R] pages of its own it may ever hold
  admitted_at: Array  # i32[R]
  cache_tokens: Array  # i32[G]
  refcount: Array     # i32[G]
  last_used: Array    # i32[G]
  fifo: Array         # i32[R] ring of finished rows waiting for a free group
  fifo_forget: Array  # bool[R] test hook: drop that row's pages instead of freeing them
  fifo_head: Array    # i32[]
  fifo_len: Array     # i32[]
  free_pages: Array   # i32[] the scheduler's count of free + released pages
  clock: Array        # i32[]
  head: Array         # i32[] next request to admit
  steps: Array        # i32[] steps so far
  done: Array         # i32[] requests finished
  leak_injected: Array  # bool[] (starts True unless the test hook inject_leak is on)
  error: Array        # i32[] 0, or ERR_STUCK
  swa_from: Array     # i32[R] SWA mode: first page column whose SWA page is held
  swa_reserved: Array  # i32[R] SWA mode: SWA pages it may hold from now on
  swa_free: Array     # i32[] SWA mode: the scheduler's count of free + released SWA pages


def init_sched(lay: sim.Layout, inject_leak: bool = False) -> Sched:
  r, g = lay.rows, lay.groups
  z = lambda n: jnp.zeros((n,), jnp.int32)
  s = lambda v: jnp.full((), v, jnp.int32)
  return Sched(req=jnp.full((r,), -1, jnp.int32), phase=z(r), seq=z(r), prompt=z(r),
               out=z(r), gen=z(r), own=z(r), group=jnp.full((r,), -1, jnp.int32),
               hit=jnp.zeros((r,), bool), reserved=z(r), admitted_at=z(r),
               cache_tokens=z(g), refcount=z(g), last_used=jnp.full((g,), -1, jnp.int32),
               fifo=z(r), fifo_forget=jnp.zeros((r,), bool), fifo_head=s(0), fifo_len=s(0),
               free_pages=s(lay.num_pages), clock=s(0), head=s(0), steps=s(0), done=s(0),
               leak_injected=jnp.full((), not inject_leak), error=s(0),
               swa_from=z(r), swa_reserved=z(r), swa_free=s(lay.swa_pages))


def _rank(key: Array, member: Array) -> Array:
  """i32[n]: position of each member in ascending `key` order (ties by index; keys are
  distinct here). O(n^2) compares, no sort: n is at most max_running."""
  lt = (key[None, :] < key[:, None]) & member[None, :]
  return jnp.sum(lt, axis=1).astype(jnp.int32)


def _excl_cumsum(x: Array) -> Array:
  """Exclusive prefix sum of a short vector as one masked reduction (jnp.cumsum lowers to
  a scan of many small ops on CPU and GPU, slower to compile and to launch)."""
  i = jnp.arange(x.shape[0])
  return jnp.sum(jnp.where(i[None, :] < i[:, None], x[None, :], 0), axis=1).astype(x.dtype)


# Scatters into the scheduler's short vectors, written as compares and reductions: XLA
# fuses them (a scatter is a kernel of its own), which compiles and runs faster.
def _match(idx: Array, n: int) -> Array:
  """bool[n, m]: idx[j] == i; indices outside [0, n) match nothing."""
  return idx[None, :] == jnp.arange(n, dtype=idx.dtype)[:, None]


def _set(base: Array, idx: Array, vals) -> Array:
  """base.at[idx].set(vals, mode="drop"), for indices that repeat only with equal values."""
  m = _match(idx, base.shape[0])
  v = jnp.broadcast_to(jnp.asarray(vals).astype(jnp.int32), idx.shape)
  got = jnp.max(jnp.where(m, v[None, :], jnp.iinfo(jnp.int32).min), axis=1)
  return jnp.where(jnp.any(m, axis=1), got.astype(base.dtype), base)


def _add(base: Array, idx: Array, vals) -> Array:
  """base.at[idx].add(vals, mode="drop")."""
  v = jnp.broadcast_to(jnp.asarray(vals, jnp.int32), idx.shape)
  return base + jnp.sum(jnp.where(_match(idx, base.shape[0]), v[None, :], 0),
                        axis=1).astype(base.dtype)


def _compact(values: Array, keep: Array, size: int, fill: int = 0) -> Array:
  """values[keep] moved to the front (order kept), length `size`, padded with fill."""
  pos = _excl_cumsum(keep.astype(jnp.int32))
  pos = jnp.where(keep & (pos < size), pos, size)
  return _set(jnp.full((size,), fill, values.dtype), pos, values)


class _Planned(NamedTuple):
  sched: Sched
  plan_prefill: steps.Plan
  plan_decode: steps.Plan
  kind: Array       # i32[] 0 idle, 1 prefill, 2 decode
  rec: dict         # record entries known before the step


def _plan(lay: sim.Layout, wl: DeviceWorkload, c: Sched) -> _Planned:
  """Steps 1-3 of the module docstring (and the hand-overs of a prefill)."""
  ps, r_, g_, b_, t_, f_ = (lay.acfg.page_size, lay.rows, lay.groups, lay.batch,
                            lay.tokens, lay.frees)
  n_req = wl.arrival.shape[0]
  rows = jnp.arange(r_, dtype=jnp.int32)
  # 1. arrivals.
  arrived = jnp.sum(wl.arrival <= c.clock).astype(jnp.int32)
  # 2. the free group's finished requests, in finishing order.
  j_f = jnp.arange(f_, dtype=jnp.int32)
  npop = jnp.minimum(c.fifo_len, f_)
  popped = j_f < npop
  pop_rows = jnp.where(popped, c.fifo[(c.fifo_head + j_f) % r_], 0)
  pop_forget = popped & c.fifo_forget[(c.fifo_head + j_f) % r_]
  held = cdiv(c.seq, ps) - c.own // ps
  free_pages = c.free_pages + jnp.sum(jnp.where(popped, held[pop_rows], 0))
  gone = _set(jnp.zeros((r_,), bool), jnp.where(popped, pop_rows, r_), True)
  phase = jnp.where(gone, EMPTY, c.phase)
  req = jnp.where(gone, -1, c.req)
  live = (phase == PREFILL) | (phase == DECODE)
  held = jnp.where(phase != EMPTY, held, 0)
  committed = jnp.sum(jnp.where(live, c.reserved - held, 0))
  avail = free_pages - committed
  swa = lay.swa is not None
  if swa:  # the finished rows' SWA pages, then every row's pages that left the window
    swa_held = cdiv(c.seq, ps) - c.swa_from
    swa_free = c.swa_free + jnp.sum(jnp.where(popped, swa_held[pop_rows], 0))
    win_end = jnp.clip(jnp.maximum(c.seq - lay.window, 0) // ps, 0, lay.width)
    win_end = jnp.where(phase != EMPTY, win_end, c.swa_from)
    window_freed = jnp.sum(jnp.maximum(win_end - c.swa_from, 0))
    swa_from = jnp.maximum(c.swa_from, win_end)
    swa_free = swa_free + window_freed
    swa_held = jnp.where(phase != EMPTY, cdiv(c.seq, ps) - swa_from, 0)
    avail_swa = swa_free - _swa_committed(c.swa_reserved, swa_held, live)
  # 3a. rows still prefilling, in admission order, while the batch has room.
  pre_rows = phase == PREFILL
  rank = _rank(c.admitted_at * r_ + rows, pre_rows)
  rem = c.prompt - c.seq
  before = jnp.sum(jnp.where(pre_rows[None, :] & (rank[None, :] < rank[:, None]),
                             rem[None, :], 0), axis=1)
  spent = jnp.minimum(before, t_)
  cont = pre_rows & (rank < b_) & (spent < t_)
  cont_chunk = jnp.where(cont, jnp.minimum(rem, t_ - spent), 0)
  n_cont = jnp.sum(cont).astype(jnp.int32)
  used_budget = jnp.sum(cont_chunk)
  # 3b. queued requests, in arrival order.
  j = jnp.arange(b_, dtype=jnp.int32)
  q = c.head + j
  qc = jnp.minimum(q, n_req - 1)
  valid = q < arrived
  g = wl.group[qc]
  gc = jnp.maximum(g, 0)
  hit = valid & (g >= 0) & (c.cache_tokens[gc] > 0)
  pre0 = jnp.where(hit, c.cache_tokens[gc], 0)
  need = cdiv(wl.prompt[qc] + wl.output[qc], ps) - pre0 // ps
  need = jnp.where(valid, need, 0)
  rem_q = wl.prompt[qc] - pre0
  spent_q = jnp.minimum(used_budget + _excl_cumsum(jnp.where(valid, rem_q, 0)), t_)
  empty = phase == EMPTY
  n_empty = jnp.sum(empty)
  room = valid & (n_cont + j < b_) & (spent_q < t_) & (j < n_empty)
  need_before = _excl_cumsum(need)
  fits = room & (need_before + need <= avail)
  if swa:
    need_swa = jnp.where(valid, sim.swa_need(wl.prompt[qc], wl.output[qc], lay.window, t_,
                                             ps), 0)
    swa_before = _excl_cumsum(need_swa)
    fits_full = fits
    fits = fits & (swa_before + need_swa <= avail_swa)
  k0 = jnp.min(jnp.where(fits, b_, j))
  # The first request that does not fit may evict unused cached prefixes.
  at = jnp.minimum(k0, b_ - 1)
  try_evict = (k0 < b_) & room[at] & ~fits[at]
  admitted_hits = _add(jnp.zeros((g_,), jnp.int32), jnp.where(hit & (j < k0), g, g_),
                       1)
  groups = jnp.arange(g_, dtype=jnp.int32)
  evictable = (c.cache_tokens > 0) & (c.refcount + admitted_hits == 0) & (
      groups != jnp.where(g[at] >= 0, g[at], g_)) & try_evict
  lru = _rank(c.last_used * g_ + groups, evictable)
  pages_g = jnp.where(evictable, c.cache_tokens // ps, 0)
  deficit = need[at] - (avail - need_before[at])
  enough = jnp.sum(pages_g) >= deficit
  got_before = jnp.sum(jnp.where(evictable[None, :] & (lru[None, :] < lru[:, None]),
                                 pages_g[None, :], 0), axis=1)
  evict = evictable & enough & (got_before < deficit) & (lru < f_ - npop)
  gained = jnp.sum(jnp.where(evict, pages_g, 0))
  k = k0 + (try_evict & (gained >= deficit)).astype(jnp.int32)
  if swa:  # no prefix cache: nothing to evict; which pool stopped the admission
    k = k0
    blocked = try_evict
    refused = ((blocked & ~fits_full[at]).astype(jnp.int32)
               + 2 * (blocked & (swa_before[at] + need_swa[at] > avail_swa)))
  n_evict = jnp.sum(evict).astype(jnp.int32)
  free_pages = free_pages + gained
  cache_tokens = jnp.where(evict, 0, c.cache_tokens)
  evict_code = jnp.sum(jnp.where(evict, (groups + 1) << lru, 0))
  # The free group: finished rows, then evicted cache rows in LRU order.
  free_rows = jnp.where(popped, pop_rows, 0)
  free_rows = _set(free_rows, jnp.where(evict, npop + lru, f_), r_ + groups)
  forget = jnp.max(jnp.where(pop_forget, pop_rows, -1))
  nfree = npop + n_evict
  # Admission: candidate j < k takes the j-th empty row.
  adm = j < k
  erank = _excl_cumsum(empty.astype(jnp.int32))
  slot_rows = _set(jnp.zeros((b_,), jnp.int32), jnp.where(empty, erank, b_), rows)
  dest = jnp.where(adm, slot_rows, r_)
  put = lambda a, v: _set(a, dest, v)
  req = put(req, q)
  phase = put(phase, PREFILL)
  seq = put(c.seq, pre0)
  prompt = put(c.prompt, wl.prompt[qc])
  out = put(c.out, wl.output[qc])
  gen = put(c.gen, 0)
  own = put(c.own, pre0)
  group = put(c.group, g)
  hit_r = put(c.hit, hit)
  reserved = put(c.reserved, need)
  admitted_at = put(c.admitted_at, c.clock)
  adm_hit = adm & hit
  refcount = _add(c.refcount, jnp.where(adm_hit, g, g_), 1)
  last_used = _set(c.last_used, jnp.where(adm_hit, g, g_), c.clock)
  # The batch: continuing rows by rank, then the admitted ones.
  chunk_q = jnp.where(adm, jnp.minimum(rem_q, t_ - spent_q), 0)
  pos = jnp.where(cont, rank, b_)
  batch_rows = _set(jnp.zeros((b_,), jnp.int32), pos, rows)
  batch_n = _set(jnp.zeros((b_,), jnp.int32), pos, cont_chunk)
  pos_q = jnp.where(adm, n_cont + j, b_)
  batch_rows = _set(batch_rows, pos_q, slot_rows)
  batch_n = _set(batch_n, pos_q, chunk_q)
  n_batch = n_cont + k
  borrow_rows = _compact(slot_rows, adm_hit, b_)
  borrow_src = _compact(r_ + g, adm_hit, b_)
  borrow_pages = _compact(pre0 // ps, adm_hit, b_)
  n_borrow = jnp.sum(adm_hit).astype(jnp.int32)
  # Hand-overs after the prefill: rows that finish their prompt, first of their group.
  in_batch = j < n_batch
  br = batch_rows
  new_seq = seq[br] + batch_n
  completes = in_batch & (new_seq == prompt[br])
  bg = group[br]
  aligned = wl.prefix_len[jnp.maximum(bg, 0)] // ps * ps
  eligible = completes & (bg >= 0) & ~hit_r[br] & (cache_tokens[jnp.maximum(bg, 0)] == 0) & (
      own[br] == 0) & (aligned > 0)
  earlier = jnp.any(eligible[None, :] & (bg[None, :] == bg[:, None]) & (j[None, :] < j[:, None]),
                    axis=1)
  ins = eligible & ~earlier
  plan_prefill = steps.Plan(
      free_rows=free_rows, num_free=nfree, forget_row=forget,
      borrow_rows=borrow_rows, borrow_src=borrow_src, borrow_pages=borrow_pages,
      num_borrow=n_borrow, rows=batch_rows, n=batch_n, num_rows=n_batch,
      ins_rows=_compact(br, ins, b_), ins_dst=_compact(r_ + bg, ins, b_),
      ins_pages=_compact(aligned // ps, ins, b_), num_ins=jnp.sum(ins).astype(jnp.int32))
  decoding = phase == DECODE
  n_dec = jnp.sum(decoding).astype(jnp.int32)
  zb = jnp.zeros((b_,), jnp.int32)
  plan_decode = steps.Plan(
      free_rows=free_rows, num_free=nfree, forget_row=forget, borrow_rows=zb,
      borrow_src=zb, borrow_pages=zb, num_borrow=jnp.zeros((), jnp.int32),
      rows=_compact(rows, decoding, r_), n=jnp.ones((r_,), jnp.int32), num_rows=n_dec,
      ins_rows=zb, ins_dst=zb, ins_pages=zb, num_ins=jnp.zeros((), jnp.int32))
  kind = jnp.where(n_batch > 0, steps.KIND_PREFILL,
                   jnp.where((n_dec > 0) | (nfree > 0), steps.KIND_DECODE, 0))
  sched = c._replace(req=req, phase=phase, seq=seq, prompt=prompt, out=out, gen=gen,
                     own=own, group=group, hit=hit_r, reserved=reserved,
                     admitted_at=admitted_at, cache_tokens=cache_tokens, refcount=refcount,
                     last_used=last_used, fifo_head=(c.fifo_head + npop) % r_,
                     fifo_len=c.fifo_len - npop, free_pages=free_pages,
                     head=c.head + k)
  rec = {"admitted": k, "evicted": n_evict, "evict_code": evict_code,
         "hits": n_borrow, "arrived": arrived, "ins": (br, bg, aligned, ins),
         "batch": (br, batch_n, in_batch)}
  if swa:
    sched = sched._replace(swa_from=put(swa_from, 0), swa_free=swa_free,
                           swa_reserved=put(c.swa_reserved, need_swa))
    rec.update(window_freed=window_freed, refused=refused)
  return _Planned(sched, plan_prefill, plan_decode, kind, rec)


def _swa_committed(reserved: Array, held: Array, live: Array) -> Array:
  """SWA pages the live rows may still take (a decoding row's reservation can be below
  what it holds right after its prefill: the window frees the difference first)."""
  return jnp.sum(jnp.where(live, jnp.maximum(reserved - held, 0), 0))


def _after_prefill(lay: sim.Layout, c: Sched, rec: dict) -> Tuple[Sched, dict]:
  ps, g_ = lay.acfg.page_size, lay.groups
  br, bn, in_batch = rec["batch"]
  _, bg, aligned, ins = rec["ins"]
  r_ = lay.rows
  dest = jnp.where(in_batch, br, r_)
  pre = c.seq[br]
  pages = jnp.sum(jnp.where(in_batch, steps.new_pages(pre, pre + bn, ps), 0))
  seq = _add(c.seq, dest, bn)
  completes = in_batch & (seq[br] == c.prompt[br])
  phase = _set(c.phase, jnp.where(completes, br, r_), DECODE)
  swa_reserved = c.swa_reserved
  if lay.swa is not None:  # a decoding row's SWA reservation: the window and one token
    swa_reserved = jnp.where(phase == DECODE, sim.swa_need(
        c.prompt, c.out, lay.window, lay.tokens, ps, decoding=True), c.swa_reserved)
  di = jnp.where(ins, br, r_)
  gi = jnp.where(ins, bg, g_)
  c = c._replace(
      seq=seq, phase=phase, own=_set(c.own, di, aligned),
      reserved=_add(c.reserved, di, -(aligned // ps)),
      hit=_set(c.hit, di, True),
      cache_tokens=_set(c.cache_tokens, gi, aligned),
      refcount=_set(c.refcount, gi, 1),
      last_used=_set(c.last_used, gi, c.admitted_at[jnp.minimum(di, r_ - 1)]),
      free_pages=c.free_pages - pages, swa_free=c.swa_free - pages * (lay.swa is not None),
      swa_reserved=swa_reserved)
  return c, {"tokens": jnp.sum(jnp.where(in_batch, bn, 0)), "pages": pages,
             "finished": jnp.zeros((), jnp.int32)}


def _after_decode(lay: sim.Layout, c: Sched) -> Tuple[Sched, dict]:
  ps, r_, g_ = lay.acfg.page_size, lay.rows, lay.groups
  decoding = c.phase == DECODE
  pages = jnp.sum(jnp.where(decoding, steps.new_pages(c.seq, c.seq + 1, ps), 0))
  seq = jnp.where(decoding, c.seq + 1, c.seq)
  gen = jnp.where(decoding, c.gen + 1, c.gen)
  fin = decoding & (gen >= c.out)
  phase = jnp.where(fin, FREEING, c.phase)
  refcount = _add(c.refcount, jnp.where(fin & c.hit, c.group, g_), -1)
  order = _excl_cumsum(fin.astype(jnp.int32))
  slot = jnp.where(fin, (c.fifo_head + c.fifo_len + order) % r_, r_)
  rows = jnp.arange(r_, dtype=jnp.int32)
  n_fin = jnp.sum(fin).astype(jnp.int32)
  forget = fin & (order == 0) & ~c.leak_injected
  leak = c.leak_injected | (n_fin > 0)
  c = c._replace(seq=seq, gen=gen, phase=phase, refcount=refcount,
                 fifo=_set(c.fifo, slot, rows),
                 fifo_forget=_set(c.fifo_forget, slot, forget),
                 fifo_len=c.fifo_len + n_fin, done=c.done + n_fin, leak_injected=leak,
                 free_pages=c.free_pages - pages,
                 swa_free=c.swa_free - pages * (lay.swa is not None))
  return c, {"tokens": jnp.sum(decoding).astype(jnp.int32), "pages": pages,
             "finished": n_fin}


class Carry(NamedTuple):
  state: object
  table: object
  sched: Sched


def _runs(state, sample: Array, branch: bool) -> Array:
  state = getattr(state, "full", state)  # SWA mode: the full pool's free list
  if branch:
    return jax.lax.cond(sample, steps.free_list_runs, lambda s: jnp.full((), -1, jnp.int32),
                        state)
  return jnp.where(sample, steps.free_list_runs(state), -1)


def _iteration(lay: sim.Layout, wl: DeviceWorkload, carry: Carry, *, runs_every: int,
               branch: bool) -> Tuple[Carry, Array, Array]:
  """One scheduler iteration. Returns (carry, i32[len(RECORD)] record, bool[] a step ran)."""
  p = _plan(lay, wl, carry.sched)
  kw = dict(max_tokens=lay.tokens, prefix_width=lay.prefix_width)
  plan = p.plan_prefill  # its free group and borrows are every kind's (none when idle)

  def free_and_borrow(x):
    state, table = x
    return steps.free_and_borrow(lay.acfg, state, table, plan,
                                 prefix_width=lay.prefix_width)
  x = (carry.state, carry.table)
  swa = lay.swa is not None
  if swa:  # the window frees run every step (the scheduler counted them)
    state, table, ok = steps.swa_free_and_window(lay.swa, carry.state, carry.table, plan,
                                                 window=lay.window)
  elif branch:  # skip the empty free group and borrows (most steps)
    state, table, ok = jax.lax.cond(
        (plan.num_free > 0) | (plan.num_borrow > 0), free_and_borrow,
        lambda x: (x[0], x[1], jnp.ones((), bool)), x)
  else:
    state, table, ok = free_and_borrow(x)
  zero = jnp.zeros((), jnp.int32)

  def idle_sched():
    c = p.sched
    n_req = wl.arrival.shape[0]
    arrived = p.rec["arrived"]
    waiting = c.head < arrived
    finished = (arrived >= n_req) & ~waiting
    stuck = (~finished & ((arrived >= n_req) | waiting)) | (finished & (
        (c.done < n_req) | (c.fifo_len > 0)))
    nxt = wl.arrival[jnp.minimum(arrived, n_req - 1)]
    return c._replace(clock=jnp.where(finished | stuck, c.clock - 1,
                                      jnp.maximum(c.clock + 1, nxt) - 1),
                      error=jnp.where(stuck, ERR_STUCK, c.error), steps=c.steps - 1)

  if branch or swa:
    def alloc(pl, prefill):
      if swa:
        return steps.swa_allocate(lay.swa, state, table, pl, ok, prefill=prefill,
                                  max_tokens=lay.tokens)
      return steps.allocate(lay.acfg, state, table, pl, ok, prefill=prefill, **kw)

    def prefill(_):
      out = alloc(plan, True)
      c, post = _after_prefill(lay, p.sched, p.rec)
      return out, c, post

    def decode(_):
      out = alloc(p.plan_decode, False)
      c, post = _after_decode(lay, p.sched)
      return out, c, post

    def idle(_):
      post = {"tokens": zero, "pages": zero, "finished": zero}
      return (state, table, jnp.zeros((4 if swa else 3,), jnp.int32)), idle_sched(), post

    (state, table, status), c, post = jax.lax.switch(p.kind, (idle, prefill, decode), None)
  else:  # both allocations every step, the one not taken with no rows: no branch
    is_pre, is_dec = p.kind == steps.KIND_PREFILL, p.kind == steps.KIND_DECODE
    pre_plan = plan._replace(num_rows=jnp.where(is_pre, plan.num_rows, 0),
                             num_ins=jnp.where(is_pre, plan.num_ins, 0))
    dec_plan = p.plan_decode._replace(num_rows=jnp.where(is_dec, p.plan_decode.num_rows, 0))
    state, table, st_pre = steps.allocate(lay.acfg, state, table, pre_plan, ok,
                                          prefill=True, hide_merge=~is_pre, **kw)
    state, table, st_dec = steps.allocate(lay.acfg, state, table, dec_plan, ok,
                                          prefill=False, **kw)
    status = jnp.where(is_pre, st_pre, st_dec)
    c_pre, post_pre = _after_prefill(lay, p.sched, p.rec)
    c_dec, post_dec = _after_decode(lay, p.sched)
    c_idle = idle_sched()
    pick = lambda a, b, i: jnp.where(is_pre, a, jnp.where(is_dec, b, i))
    c = jax.tree.map(pick, c_pre, c_dec, c_idle)
    post = {k: jnp.where(is_pre, post_pre[k], jnp.where(is_dec, post_dec[k], 0))
            for k in post_pre}
  c = c._replace(clock=c.clock + 1, steps=c.steps + 1)
  ps = lay.acfg.page_size
  live = c.phase != EMPTY
  held = cdiv(c.seq, ps) - c.own // ps
  active = (c.phase == PREFILL) | (c.phase == DECODE)
  vals = dict(p.rec, **post)
  vals.update(
      kind=p.kind, used=lay.num_pages - c.free_pages,
      waste=jnp.sum(jnp.where(live, held * ps - (c.seq - c.own), 0)),
      running=jnp.sum(live), committed=jnp.sum(jnp.where(active, c.reserved - held, 0)),
      runs=_runs(state, (p.kind > 0) & (c.steps % runs_every == 0), branch),
      ok=status[0], device_pages=status[1], checksum=status[2])
  if swa:
    swa_held = jnp.where(live, cdiv(c.seq, ps) - c.swa_from, 0)
    vals.update(swa_used=lay.swa_pages - c.swa_free, swa_device_pages=status[3],
                swa_committed=_swa_committed(c.swa_reserved, swa_held, active))
  rec = jnp.stack([jnp.asarray(vals[k], jnp.int32) for k in steps.record_columns(swa)])
  return Carry(state, table, c), rec, p.kind > 0


def _finished(lay: sim.Layout, n_req: int, c: Sched) -> Array:
  return ((c.done >= n_req) & (c.fifo_len == 0)) | (c.error != 0)


@functools.partial(jax.jit, static_argnames=("lay", "steps_per_call", "runs_every",
                                             "branch"),
                   donate_argnames=("carry",))
def run_steps(lay: sim.Layout, wl: DeviceWorkload, carry: Carry, *, steps_per_call: int,
              runs_every: int, branch: bool
              ) -> Tuple[Carry, Array, Array, Array]:
  """Up to `steps_per_call` scheduler iterations (fewer when the workload is done).

  Returns (carry, i32[steps_per_call, len(RECORD)] records of the steps run, in order,
  i32[] how many, bool[] finished: every request done and freed, or the scheduler stuck
  (carry.sched.error)).
  """
  n_req = wl.arrival.shape[0]
  recs = jnp.zeros((steps_per_call, len(steps.record_columns(lay.swa is not None))),
                   jnp.int32)

  def cond(x):
    i, carry, _, _ = x
    return (i < steps_per_call) & ~_finished(lay, n_req, carry.sched)

  def body(x):
    i, carry, recs, n = x
    carry, rec, ran = _iteration(lay, wl, carry, runs_every=runs_every, branch=branch)
    recs = jax.lax.dynamic_update_index_in_dim(recs, jnp.where(ran, rec, recs[n]), n, 0)
    return i + 1, carry, recs, n + ran.astype(jnp.int32)

  zero = jnp.zeros((), jnp.int32)
  _, carry, recs, n = jax.lax.while_loop(cond, body, (zero, carry, recs, zero))
  return carry, recs, n, _finished(lay, n_req, carry.sched)


def _check_records(lay: sim.Layout, first_step: int, recs: np.ndarray) -> None:
  """The host driver's checks, from the records: every step ok, and the device's page
  count equal to the scheduler's (SWA mode: in both pools)."""
  c = steps.COL
  ps, num_pages = lay.acfg.page_size, lay.num_pages
  for i, rec in enumerate(recs):
    step = first_step + i
    if not rec[c["ok"]]:
      raise sim.failed_error(ps, step, int(rec[c["device_pages"]]))
    expected = num_pages - int(rec[c["used"]])
    if int(rec[c["device_pages"]]) != expected:
      raise sim.leak_error(ps, step, int(rec[c["device_pages"]]), expected)
    if lay.swa is not None:
      expected = lay.swa_pages - int(rec[c["swa_used"]])
      if int(rec[c["swa_device_pages"]]) != expected:
        raise sim.leak_error(ps, step, int(rec[c["swa_device_pages"]]), expected,
                             pool="SWA ")


# XLA options for the loop's program. CPU: LLVM's optimization level 0 (the program is
# hundreds of tiny kernels; -O0 roughly halves the compile and leaves the steps' time to
# dispatch, not to code quality). GPU: the while loop, its conditionals and every fusion
# in CUDA graphs (command buffers), so that K steps run without the host; if this jaxlib
# does not take the option, the default is used (PageSizeResult.compile_options says).
CPU_OPTIONS: dict = {}
GPU_OPTIONS = {"xla_gpu_enable_command_buffer":
               "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
               "xla_gpu_graph_min_graph_size": 1}


class Prepared(NamedTuple):
  lay: sim.Layout
  wl: DeviceWorkload
  carry: Carry
  compiled: object
  compile_s: float
  options: str


def prepare(cfg: sim.SimConfig, wl: Workload, page_size: int) -> Prepared:
  """The device arrays and the compiled loop of one page size (thread-safe: the page
  sizes compile concurrently)."""
  lay = sim.make_layout(cfg, wl, page_size)
  group = wl.group if lay.swa is None else np.full_like(wl.group, -1)  # no prefix cache
  dwl = DeviceWorkload(*(jnp.asarray(a, jnp.int32) for a in (
      wl.arrival, group, wl.prompt, wl.output,
      wl.prefix_len if wl.prefix_len.size else np.zeros(1))))
  backend = jax.default_backend()
  # "cond": lax.cond/switch skip the work a step does not need; "masked": no branch,
  # every operation every step (for comparison where a branch costs a host sync).
  branches = os.environ.get("JAX_KVALLOC_SIM_BRANCHES", "cond")
  kw = dict(steps_per_call=cfg.steps_per_call, runs_every=cfg.runs_every,
            branch=branches == "cond")
  t0 = time.perf_counter()
  state, table = sim.init_pool(lay)
  carry = Carry(state, table, init_sched(lay, cfg.inject_leak))
  lowered = run_steps.lower(lay, dwl, carry, **kw)
  options = CPU_OPTIONS if backend == "cpu" else GPU_OPTIONS if backend == "gpu" else {}
  if os.environ.get("JAX_KVALLOC_SIM_OPTIONS", "1") == "0":
    options = {}
  try:
    compiled = lowered.compile(options)
  except Exception:  # pylint: disable=broad-except
    options = {}
    compiled = lowered.compile()
  used = f"branches={branches}; " + (
      ",".join(f"{k}={v}" for k, v in options.items()) or "default XLA options")
  return Prepared(lay, dwl, carry, compiled, time.perf_counter() - t0, used)


def run_all(cfg: sim.SimConfig, wl: Workload, progress: bool):
  """Every page size of `cfg` under the device driver: all compile at once (in threads),
  then run one after the other."""
  with concurrent.futures.ThreadPoolExecutor(len(cfg.page_sizes)) as pool:
    futures = [pool.submit(prepare, cfg, wl, int(ps)) for ps in cfg.page_sizes]
    return [run_page_size(cfg, wl, f.result(), progress) for f in futures]


def run_page_size(cfg: sim.SimConfig, wl: Workload, prep: Prepared,
                  progress: bool) -> sim.PageSizeResult:
  """One page size under the device driver (see the module docstring)."""
  lay, dwl, carry, compiled = prep.lay, prep.wl, prep.carry, prep.compiled
  page_size = lay.acfg.page_size
  res = sim.PageSizeResult(page_size, lay.num_pages, cfg.kernel, driver="device",
                           steps_per_call=cfg.steps_per_call, compile_s=prep.compile_s,
                           compile_options=prep.options, swa_window=lay.window,
                           swa_num_pages=lay.swa_pages)
  bar = sim.progress_bar(wl.num_requests, page_size, progress)
  bar.set_description(f"page_size={page_size}")
  t_start = time.perf_counter()
  chunks, pending, step_no, call_us = [], None, 1, []
  t_prev = t_start
  while True:
    carry, recs, n, fin = compiled(dwl, carry)
    if pending is not None:  # the previous call's records, read while this call runs
      p_recs, p_n, p_fin = pending
      got = int(p_n)
      block = np.asarray(p_recs)[:got].astype(np.int64)
      now = time.perf_counter()
      call_us.extend([(now - t_prev) * 1e6 / max(got, 1)] * got)
      t_prev = now
      res.calls += 1
      _check_records(lay, step_no, block)
      step_no += got
      chunks.append(block)
      bar.update(int(block[:, steps.COL["finished"]].sum()))
      if bool(p_fin):
        break
      if step_no - 1 >= cfg.max_steps:
        raise RuntimeError(f"no progress after {step_no - 1} steps (page_size={page_size})")
    pending = (recs, n, fin)
  jax.block_until_ready(carry)
  res.wall_s = time.perf_counter() - t_start
  bar.close()
  sched = carry.sched
  if int(sched.error) == ERR_STUCK:
    waiting = int(np.sum(wl.arrival <= int(sched.clock))) - int(sched.head)
    raise RuntimeError(f"scheduler stuck at step {step_no - 1} (page_size={page_size}): "
                       f"{waiting} requests wait and none can be admitted")
  width = len(steps.record_columns(lay.swa is not None))
  records = np.concatenate(chunks) if chunks else np.zeros((0, width), np.int64)
  res.requests_done = int(sched.done)
  res.sim_time = int(sched.clock)
  res.runs_final = int(jax.jit(steps.free_list_runs)(getattr(carry.state, "full",
                                                             carry.state)))
  sim.finish_result(res, records)
  res.step_us = call_us
  res.step_kind = ["prefill" if k == steps.KIND_PREFILL else "decode"
                   for k in records[:, steps.COL["kind"]]]
  if lay.swa is not None:
    sim.final_leak_check_swa(res, lay, carry.state, carry.table)
  else:
    sim.final_leak_check(res, lay, carry.state, carry.table, sched.cache_tokens)
  return res
