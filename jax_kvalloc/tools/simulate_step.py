"""The simulator's policy: one scheduler iteration, written once, as array code (`step`).

`jax-kvalloc simulate` runs it under one of two drivers (jax_kvalloc.tools.simulate):
`--driver device` runs `run_steps`, many iterations per jitted call in a loop on the
device; `--driver host` launches the jitted `host_step`, one iteration per call, from a
Python loop, as a host scheduler with a device-resident table would. The drivers make the
same decisions because they run the same function.

An iteration runs the table work of the step planned in the previous iteration and,
beside it (they share no data), the scheduler's next decisions (`plan`, on the next
requests in the queue and the scheduler's state `Sched`: per request row and per prefix
group), as an overlapped scheduler does; on a GPU the two run at once. `plan` is
elementwise operations and reductions over small vectors only, so where the pool's
kernels are Triton (`Layout.plan_kernel`) it runs as one Triton program
(pallas_kernels.one_program), else as XLA operations; the decisions are the same. Its
parts:
  1. arrivals join the queue (request ids [head, arrived), in arrival order);
  2. up to `frees` finished rows leave the free-group queue (a ring, in finishing order);
  3. a prefill batch: rows still prefilling (in admission order) take their next chunk,
     then queued requests are admitted in order while the batch has room (`batch` rows,
     `tokens` tokens), a row was empty at the start of the iteration and the request's
     whole lifetime fits in the pages not promised to running requests. The first request
     that does not fit may evict unused cached prefixes (least recently used first, as
     many as the free group has room for); if that admits it, it is the last admission.
     A request whose group's prefix is cached borrows its pages;
  4. the step: a prefill when the batch is not empty, else a decode of every decoding row
     (or only the free group), else nothing: the clock moves to the next arrival (an
     idle iteration, no record);
  5. a row that completed its prompt hands its group's prefix (whole pages) to the cache
     when none is cached; a row that generated its last token joins the free queue.

The table work of an iteration (`_table_step`): the free group (`release_rows` of the
finished rows and the evicted cache rows), the borrows, the extend or decode, and the
hand-overs, through the request table (SPEC 11; `step_rows` for the three pool phases,
`borrow_from_rows` for the borrows and hand-overs).
Admission counts pages with the allocator's arithmetic, so no allocation may fail; every
record carries the device's status (ok, free + released pages, a checksum of the slots)
for the driver to compare with the scheduler's count.

SWA mode (`Layout.swa`, simulate's --swa-window): the pool is an SWAState and the table an
SWATable of request rows only (SPEC 13). Step 2 also frees every row's SWA pages wholly
before seq - window (`window_rows`); admission also counts the SWA pool (`swa_need`); no
prefix cache (the workload's groups are -1 then), so no borrows and no eviction.

`Layout.branch` (static) picks how the table phases that a decode-only step does not need
are skipped: inside one `lax.cond` (on the CPU, where a branch is cheap and a phase over a
large table is not) or by running them with no rows (on accelerators, where a branch
costs a round trip to the host, and the three pool phases are one `step_rows`). The
decisions are the same either way.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc import swa as swa_core
from jax_kvalloc import swa_table
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.swa import SWAConfig, SWAState
from pallas_kernels import one_program

Array = jax.Array
i32 = jnp.int32
EMPTY, PREFILL, DECODE, FREEING = 0, 1, 2, 3
KIND_PREFILL, KIND_DECODE = 1, 2
ERR_STUCK = 1
PLAN_WARPS = 8  # the plan program's warps: the fastest of 1-16 on the H200
# (benchmarks/results/2026-12-02-h200-sim-plan2, warps.log)

# One row per step (an iteration that ran a prefill or a decode), from either driver.
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
          "runs",          # free-list runs after every runs_every-th iteration; else -1
          "ok",            # every table operation of the step succeeded (device status)
          "device_pages",  # free + released pages on the device after the step
          "checksum")      # `checksum` of the slots allocated
SWA_RECORD = ("swa_used",          # SWA pages in use after the step (the scheduler's count)
              "swa_committed",     # SWA pages reserved by running requests, not held
              "window_freed",      # SWA pages the step's window frees released
              "swa_device_pages",  # free + released SWA pages on the device after the step
              "refused")           # the next admission did not fit: 1 full pool, 2 SWA, 3 both
COL = {name: i for i, name in enumerate(RECORD + SWA_RECORD)}
STATUS = ("ok", "device_pages", "checksum", "swa_device_pages")  # from the table work


def record_columns(swa: bool) -> Tuple[str, ...]:
  """The record's columns (SWA mode appends SWA_RECORD)."""
  return RECORD + SWA_RECORD if swa else RECORD


def _tally_columns(swa: bool) -> Tuple[str, ...]:
  """The record's columns that the plan gives (all but STATUS), in order."""
  return tuple(c for c in record_columns(swa) if c not in STATUS)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sizes of one page size's run (jax_kvalloc.tools.simulate.make_layout)."""
  acfg: AllocatorConfig
  rows: int          # R request rows
  groups: int        # G prefix-cache rows, one per group, after the request rows
  batch: int         # B requests per prefill
  tokens: int        # T prefill token budget (the extend's slot array)
  frees: int         # F rows per free group
  width: int         # page columns per table row
  swa: Optional[SWAConfig] = None  # SWA mode: both pools (acfg is swa.full)
  window: int = 0                  # SWA mode: the window in tokens
  branch: bool = True              # skip unneeded table phases in lax.cond (module doc)
  plan_kernel: str = ""            # "triton" / "triton_interpret": `plan` as one program

  @property
  def swa_pages(self) -> int:
    return self.swa.swa.num_pages if self.swa is not None else 0

  @property
  def num_pages(self) -> int:
    return self.acfg.num_pages


class Workload(NamedTuple):
  """The requests on the device (i32), and the step cap."""
  arrival: Array     # i32[N] non-decreasing
  group: Array       # i32[N] prefix group or -1
  prompt: Array      # i32[N] prompt tokens, shared prefix included
  output: Array      # i32[N]
  prefix_len: Array  # i32[max(G, 1)]
  max_steps: Array   # i32[] no step runs once this many have


class Sched(NamedTuple):
  """The scheduler's state."""
  phase: Array        # i32[R] EMPTY / PREFILL / DECODE / FREEING
  seq: Array          # i32[R] tokens held
  prompt: Array       # i32[R]
  out: Array          # i32[R]
  gen: Array          # i32[R] tokens generated
  own: Array          # i32[R] first token the row owns (page aligned)
  group: Array        # i32[R]
  hit: Array          # i32[R] 1: holds a reference on its group's cache entry
  reserved: Array     # i32[R] pages of its own it may ever hold
  admitted_at: Array  # i32[R]
  finished_at: Array  # i32[R] FREEING rows: the step they finished (ties: row order)
  swa_from: Array     # i32[R] SWA mode: first page column whose SWA page is held
  swa_reserved: Array  # i32[R] SWA mode: SWA pages it may hold from now on
  empty: Array        # i32[R] a stack of the empty rows; the first n_empty are
  n_empty: Array      # i32[]
  prefilling: Array   # i32[B] rows still prefilling, in admission order (at most B)
  n_prefilling: Array  # i32[]
  cache_tokens: Array  # i32[G]
  refcount: Array     # i32[G]
  last_used: Array    # i32[G]
  free_pages: Array   # i32[] the scheduler's count of free + released pages
  swa_free: Array     # i32[] SWA mode: the same for the SWA pool
  clock: Array        # i32[]
  head: Array         # i32[] next request to admit
  steps: Array        # i32[] steps so far
  done: Array         # i32[] requests finished
  error: Array        # i32[] 0, or ERR_STUCK


class Plan(NamedTuple):
  """An iteration's table work. Entries at index >= the matching count are padding."""
  free_rows: Array     # i32[F] the free group's rows, in order
  num_free: Array
  borrow_rows: Array   # i32[B] admitted rows that start from a cached prefix
  borrow_src: Array    # i32[B] the cache rows they borrow from
  borrow_pages: Array  # i32[B] whole pages borrowed
  num_borrow: Array
  ext_rows: Array      # i32[B] rows to extend, in batch order
  ext_n: Array         # i32[B] tokens each
  num_ext: Array
  ext_tokens: Array    # i32[] tokens extended (ext_n over the first num_ext)
  dec_rows: Array      # i32[R] rows to decode
  num_dec: Array
  ins_rows: Array      # i32[B] rows whose prefix pages go to the cache after the step
  ins_dst: Array       # i32[B] the cache rows
  ins_pages: Array     # i32[B] pages handed over
  num_ins: Array
  window: Array        # i32[] SWA mode: rows whose window frees run (0 or R)


class Pending(NamedTuple):
  """A planned step whose table work runs in the next iteration."""
  work: Plan
  tally: Tuple[Array, ...]  # i32[] per record column but STATUS, in order


class Carry(NamedTuple):
  state: object   # AllocatorState, or SWAState in SWA mode
  table: object   # RequestTable (request rows, then one row per prefix group) or SWATable
  sched: Sched    # the scheduler after every plan so far
  pending: Pending  # the step whose table work runs in the next iteration


def swa_need(prompt, output, window: int, tokens: int, ps: int, *, decoding=False):
  """SWA pages a request may hold at most from now on (numpy or jax arrays): after a step
  that extends it from L to L + n tokens, having freed the pages wholly before
  L - window, it holds ceil((L + n) / ps) - floor((L - window) / ps)
  <= ceil((window + n) / ps) + 1 pages, with n <= min(prompt, tokens) while it prefills
  and n = 1 once it decodes (`decoding`, bool or bool array); never more than its whole
  length's pages."""
  xp, up = (np, cdiv) if isinstance(prompt, np.ndarray) else (jnp, _up)
  n = xp.where(decoding, 1, xp.minimum(prompt, tokens))
  return xp.minimum(up(prompt + output, ps), up(window + n, ps) + 1)


def init_carry(lay: Layout) -> Carry:
  """An empty pool and table, and an idle scheduler (traceable; jit it with lay static)."""
  r, g = lay.rows, lay.groups
  if lay.swa is not None:
    state = swa_core.init(lay.swa)
    table = swa_table.init_table(lay.swa, r, lay.width)
  else:
    state = st.init(lay.acfg)
    table = rt.init_table(lay.acfg, r + g, lay.width)
  z = lambda n, v=0: jnp.full((n,), v, i32)
  s = lambda v: jnp.full((), v, i32)
  sched = Sched(
      phase=z(r), seq=z(r), prompt=z(r), out=z(r), gen=z(r), own=z(r), group=z(r, -1),
      hit=z(r), reserved=z(r), admitted_at=z(r), finished_at=z(r), swa_from=z(r),
      swa_reserved=z(r), empty=jnp.arange(r - 1, -1, -1, dtype=i32), n_empty=s(r),
      prefilling=z(lay.batch), n_prefilling=s(0), cache_tokens=z(g), refcount=z(g),
      last_used=z(g, -1), free_pages=s(lay.num_pages), swa_free=s(lay.swa_pages),
      clock=s(0), head=s(0), steps=s(0), done=s(0), error=s(0))
  any_wl = Workload(*[one_program.Gather(z(1))] * 4, z(g), s(0))
  shapes = jax.eval_shape(functools.partial(_decide, lay), any_wl, sched)[1]
  return Carry(state, table, sched,
               jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, i32), shapes))


# Small-vector helpers: O(n * m) compares and reductions instead of gathers, sorts,
# cumsums and scatters (n, m are at most max_running). They use only what a single Triton
# program can run (elementwise operations, broadcasts, reductions), so on a GPU the whole
# plan is one kernel (`Layout.plan_kernel`); on the CPU XLA fuses them into few loops.
def _get(x: Array, i: Array) -> Array:
  """x[clip(i)] for an index array or scalar i (bool x gives bool)."""
  n = x.shape[0]
  hit = jnp.clip(i, 0, n - 1)[..., None] == jnp.arange(n, dtype=i32)
  got = jnp.sum(jnp.where(hit, x.astype(i32), 0), axis=-1)
  return got > 0 if x.dtype == jnp.bool_ else got


def _any(x: Array, axis=None) -> Array:
  return jnp.max(x.astype(i32), axis=axis) > 0


def _div(a: Array, n: int) -> Array:
  """a // n for a >= 0 (one division, where // on signed ints is several operations)."""
  return jax.lax.div(a, jnp.asarray(n, a.dtype))


def _up(a: Array, n: int) -> Array:
  """ceil(a / n) for a >= 0."""
  return _div(a + (n - 1), n)


def _excl_cumsum(x: Array) -> Array:
  i = jnp.arange(x.shape[0])
  return jnp.sum(jnp.where(i[None, :] < i[:, None], x[None, :], 0), axis=1).astype(x.dtype)


def _at(idx: Array, n: int, values=1) -> Array:
  """i32[n]: out[i] = sum of values over the entries with idx == i (0 where none; idx
  outside [0, n) matches nothing)."""
  v = jnp.broadcast_to(jnp.asarray(values, i32), idx.shape)
  m = idx[None, :] == jnp.arange(n, dtype=idx.dtype)[:, None]
  return jnp.sum(jnp.where(m, v[None, :], 0), axis=1)


def _compact(values: Array, keep: Array) -> Array:
  """values[keep], in order, at the front (0 after)."""
  pos = _excl_cumsum(keep.astype(i32))
  return _at(jnp.where(keep, pos, values.shape[0]), values.shape[0], values)


def stopped(wl: Workload, c: Sched) -> Array:
  """bool[]: every request done and freed, the scheduler stuck, or the step cap reached."""
  return _stopped(wl.arrival.shape[0], wl.max_steps, c)


def _stopped(n_req: int, max_steps: Array, c: Sched) -> Array:
  return (((c.done >= n_req) & ~_any(c.phase == FREEING)) | (c.error != 0)
          | (c.steps >= max_steps))


class Queue(NamedTuple):
  """The next B requests in arrival order, from the scheduler's head (entries past
  `waiting` are padding)."""
  waiting: Array        # i32[] requests arrived and not yet admitted, at most B
  next_arrival: Array   # i32[] the head request's arrival (the last request's, past it)
  group: Array          # i32[B]
  prompt: Array         # i32[B]
  output: Array         # i32[B]


def queue(lay: Layout, wl: Workload, c: Sched) -> Queue:
  """The Queue at the scheduler's head and clock (arrivals are non-decreasing); wl's
  per-request arrays are one_program.Gather (read by index only)."""
  n = wl.arrival.source.shape[0]
  idx = c.head + jnp.arange(lay.batch, dtype=i32)
  arrived = (idx < n) & (wl.arrival.take(idx) <= c.clock)
  return Queue(jnp.sum(arrived.astype(i32)), wl.arrival.take(c.head), wl.group.take(idx),
               wl.prompt.take(idx), wl.output.take(idx))


def plan(lay: Layout, wl: Workload, c: Sched) -> Tuple[Sched, Plan, dict]:
  """The scheduler's decisions of one iteration (the module docstring's parts 1-5):
  (the next Sched, the table work as a Plan, {record column: i32[]} for every column but
  the device's status: ok, device_pages, checksum, swa_device_pages). wl's per-request
  arrays are one_program.Gather. Elementwise operations, reductions and those gathers
  only (see the helpers above)."""
  n_req, q = wl.arrival.source.shape[0], queue(lay, wl, c)
  prefix_len, max_steps = wl.prefix_len, wl.max_steps
  ps, r_, g_, b_, t_, f_ = (lay.acfg.page_size, lay.rows, lay.groups, lay.batch,
                            lay.tokens, lay.frees)
  swa = lay.swa is not None
  rows = jnp.arange(r_, dtype=i32)
  go = ~_stopped(n_req, max_steps, c)
  # 1-2. Arrivals; the free group: the rows that finished first (at most F).
  freeing = c.phase == FREEING
  key = c.finished_at * r_ + rows
  order = jnp.sum(((key[None, :] < key[:, None]) & freeing[None, :]).astype(i32), axis=1)
  gone = freeing & (order < f_) & go
  npop = jnp.sum(gone.astype(i32))
  pop_rows = _at(jnp.where(gone, order, f_), f_, rows)
  held = _up(c.seq, ps) - _div(c.own, ps)
  free_pages = c.free_pages + jnp.sum(jnp.where(gone, held, 0))
  phase = jnp.where(gone, EMPTY, c.phase)
  live = (phase == PREFILL) | (phase == DECODE)
  avail = free_pages - jnp.sum(jnp.where(live, c.reserved - held, 0))
  swa_free, swa_from = c.swa_free, c.swa_from
  if swa:  # the finished rows' SWA pages, then every row's pages that left the window
    swa_free += jnp.sum(jnp.where(gone, _up(c.seq, ps) - swa_from, 0))
    win_end = jnp.clip(_div(jnp.maximum(c.seq - lay.window, 0), ps), 0, lay.width)
    win_end = jnp.where((phase != EMPTY) & go, jnp.maximum(win_end, swa_from), swa_from)
    window_freed = jnp.sum(win_end - swa_from)
    swa_from = win_end
    swa_free += window_freed
    avail_swa = swa_free - jnp.sum(jnp.where(live, jnp.maximum(
        c.swa_reserved - (_up(c.seq, ps) - swa_from), 0), 0))
  # 3a. Rows still prefilling, in admission order, while the budget lasts.
  p = jnp.arange(b_, dtype=i32)
  pf = jnp.clip(c.prefilling, 0, r_ - 1)
  rem = jnp.where(p < c.n_prefilling, _get(c.prompt, pf) - _get(c.seq, pf), 0)
  before = _excl_cumsum(rem)
  cont = (p < c.n_prefilling) & (before < t_) & go
  n_cont = jnp.sum(cont.astype(i32))
  # 3b. Queued requests, in arrival order (candidate j: request head + j).
  valid = (p < q.waiting) & go
  g, p_q, o_q = q.group, q.prompt, q.output
  gc = jnp.maximum(g, 0)
  hit = valid & (g >= 0) & (_get(c.cache_tokens, gc) > 0)
  pre0 = jnp.where(hit, _get(c.cache_tokens, gc), 0)
  need = jnp.where(valid, _up(p_q + o_q, ps) - _div(pre0, ps), 0)
  spent_q = jnp.sum(jnp.where(cont, jnp.minimum(rem, t_ - before), 0)) + _excl_cumsum(
      jnp.where(valid, p_q - pre0, 0))
  room = valid & (n_cont + p < b_) & (spent_q < t_) & (p < c.n_empty)
  need_before = _excl_cumsum(need)
  fits = room & (need_before + need <= avail)
  if swa:
    need_swa = jnp.where(valid, swa_need(p_q, o_q, lay.window, t_, ps), 0)
    fits_swa = _excl_cumsum(need_swa) + need_swa <= avail_swa
    fits_full, fits = fits, fits & fits_swa
  k0 = jnp.min(jnp.where(fits, b_, p))
  at = jnp.minimum(k0, b_ - 1)
  blocked = (k0 < b_) & _get(room, at) & ~_get(fits, at)
  if swa:  # no prefix cache, nothing to evict: which pool stopped the admission
    k, n_evict, evict_code = k0, jnp.zeros((), i32), jnp.zeros((), i32)
    cache_tokens, evicted = c.cache_tokens, jnp.zeros((f_,), i32)
    refused = ((blocked & ~_get(fits_full, at)).astype(i32)
               + 2 * (blocked & ~_get(fits_swa, at)).astype(i32))
  else:  # the blocked request may evict unused cached prefixes, LRU first
    groups = jnp.arange(g_, dtype=i32)
    in_use = c.refcount + _at(jnp.where(hit & (p < k0), g, g_), g_)
    evictable = (c.cache_tokens > 0) & (in_use == 0) & (groups != _get(g, at)) & blocked
    lru_key = c.last_used * g_ + groups
    lru = jnp.sum(((lru_key[None, :] < lru_key[:, None]) & evictable[None, :]).astype(i32),
                  axis=1)
    pages_g = jnp.where(evictable, _div(c.cache_tokens, ps), 0)
    deficit = _get(need, at) - (avail - _get(need_before, at))
    got_before = jnp.sum(jnp.where(evictable[None, :] & (lru[None, :] < lru[:, None]),
                                   pages_g[None, :], 0), axis=1)
    evict = (evictable & (jnp.sum(pages_g) >= deficit) & (got_before < deficit)
             & (lru < f_ - npop))
    gained = jnp.sum(jnp.where(evict, pages_g, 0))
    k = k0 + (blocked & (gained >= deficit)).astype(i32)
    n_evict = jnp.sum(evict.astype(i32))
    evict_code = jnp.sum(jnp.where(evict, (groups + 1) << lru, 0))
    free_pages += gained
    cache_tokens = jnp.where(evict, 0, c.cache_tokens)
    evicted = _at(jnp.where(evict, npop + lru, f_), f_, r_ + groups)  # after the finished
  adm = p < k
  adm_rows = _get(c.empty, c.n_empty - 1 - p)  # off the top of the stack

  # The batch: position i holds the i-th prefilling row, then the admitted requests.
  # (Admissions happen only when every prefilling row got its chunk, so the batch is
  # the first n_cont + k positions.)
  j = jnp.clip(p - c.n_prefilling, 0, b_ - 1)
  old = p < c.n_prefilling
  new = ~old & (p - c.n_prefilling < k)
  brow = jnp.where(old, pf, _get(adm_rows, j))
  n_batch = n_cont + k
  seq0 = jnp.where(new, _get(pre0, j), _get(c.seq, brow))
  prompt_b = jnp.where(new, _get(p_q, j), _get(c.prompt, brow))
  group_b = jnp.where(new, _get(g, j), _get(c.group, brow))
  hit_b = jnp.where(new, _get(hit, j), _get(c.hit, brow) > 0)
  spent_a = jnp.minimum(spent_q, t_)
  chunk = jnp.where(p < n_batch, jnp.where(
      old, jnp.minimum(rem, t_ - before), _get(jnp.minimum(p_q - pre0, t_ - spent_a), j)),
      0)
  # 4. The step's kind.
  decoding = (phase == DECODE) & go
  n_dec = jnp.sum(decoding.astype(i32))
  nfree = npop + n_evict
  is_pre = n_batch > 0
  is_dec = ~is_pre & ((n_dec > 0) | (nfree > 0))
  kind = KIND_PREFILL * is_pre.astype(i32) + KIND_DECODE * is_dec.astype(i32)
  dec = decoding & ~is_pre
  # 5. Hand-overs: a row that completed its prompt, first of its group in the batch.
  completes = is_pre & (p < n_batch) & (seq0 + chunk == prompt_b)
  gb = jnp.maximum(group_b, 0)
  aligned = _div(_get(prefix_len, gb), ps) * ps
  own_b = jnp.where(new, _get(pre0, j), _get(c.own, brow))
  eligible = (completes & (group_b >= 0) & ~hit_b & (_get(cache_tokens, gb) == 0)
              & (own_b == 0) & (aligned > 0))
  earlier = _any(eligible[None, :] & (group_b[None, :] == group_b[:, None])
                 & (p[None, :] < p[:, None]), axis=1)
  ins = eligible & ~earlier
  # Back to rows: row r's batch entry, where it has one.
  listed = (p < c.n_prefilling + k)
  m = (brow[None, :] == rows[:, None]) & listed[None, :]
  back = lambda v: jnp.sum(jnp.where(m, v.astype(i32)[None, :], 0), axis=1)
  adm_r, ins_r, completes_r = back(new) > 0, back(ins) > 0, back(completes) > 0
  grow = jnp.where(is_pre, back(chunk), dec.astype(i32))
  seq = jnp.where(adm_r, back(seq0), c.seq)
  pages = jnp.sum(_up(seq + grow, ps) - _up(seq, ps))
  seq = seq + grow
  reserved = jnp.where(adm_r, back(_get(need, j)), c.reserved)
  own = jnp.where(ins_r, back(aligned), jnp.where(adm_r, back(own_b), c.own))
  reserved = jnp.where(ins_r, reserved - _div(own, ps), reserved)
  hit_r = jnp.where(adm_r, back(hit_b) > 0, c.hit > 0) | ins_r
  gen = jnp.where(adm_r, 0, c.gen) + dec.astype(i32)
  phase = jnp.where(adm_r, PREFILL, phase)
  phase = jnp.where(completes_r, DECODE, phase)
  out = jnp.where(adm_r, back(_get(o_q, j)), c.out)
  prompt = jnp.where(adm_r, back(prompt_b), c.prompt)
  fin = dec & (gen >= out)
  phase = jnp.where(fin, FREEING, phase)
  n_fin = jnp.sum(fin.astype(i32))
  group = jnp.where(adm_r, back(group_b), c.group)
  admitted_at = jnp.where(adm_r, c.clock, c.admitted_at)
  # The groups: admitted hits take a reference; hand-overs fill the cache.
  adm_hit_g = _at(jnp.where(adm & hit, g, g_), g_)
  ins_g = _at(jnp.where(ins, group_b, g_), g_)
  cache_tokens = jnp.where(ins_g > 0, _at(jnp.where(ins, group_b, g_), g_, aligned),
                           cache_tokens)
  refcount = jnp.where(ins_g > 0, 1, c.refcount + adm_hit_g)
  refcount -= _at(jnp.where(fin & hit_r, group, g_), g_)
  last_used = jnp.where(adm_hit_g > 0, c.clock, c.last_used)
  last_used = jnp.where(ins_g > 0, _at(jnp.where(ins, group_b, g_), g_, jnp.where(
      new, c.clock, _get(c.admitted_at, brow))), last_used)
  keep = listed & ~completes
  n_empty = c.n_empty - k
  slot = rows - n_empty  # the finished rows go back on the stack, in order
  empty = jnp.where((slot >= 0) & (slot < npop), _get(pop_rows, slot), c.empty)
  swa_reserved = c.swa_reserved
  if swa:
    swa_from = jnp.where(adm_r, 0, swa_from)
    swa_reserved = jnp.where(adm_r, back(need_swa), swa_reserved)
    # A decoding row's reservation: the window and one token.
    swa_reserved = jnp.where(completes_r, swa_need(
        prompt, out, lay.window, t_, ps, decoding=True), swa_reserved)
    swa_free -= pages
  # The idle iteration: the clock jumps to the next arrival, or the scheduler is stuck.
  idle = go & (kind == 0)
  stuck = idle & ((q.waiting > 0) | (c.head >= n_req))
  clock = jnp.where(kind > 0, c.clock + 1, jnp.where(
      idle & ~stuck, jnp.maximum(c.clock + 1, q.next_arrival), c.clock))
  sched = Sched(
      phase=phase, seq=seq, prompt=prompt, out=out, gen=gen, own=own, group=group,
      hit=hit_r.astype(i32), reserved=reserved, admitted_at=admitted_at,
      finished_at=jnp.where(fin, c.steps, c.finished_at), swa_from=swa_from,
      swa_reserved=swa_reserved, empty=empty, n_empty=n_empty + npop,
      prefilling=_compact(brow, keep), n_prefilling=jnp.sum(keep.astype(i32)),
      cache_tokens=cache_tokens, refcount=refcount, last_used=last_used,
      free_pages=free_pages - pages, swa_free=swa_free, clock=clock, head=c.head + k,
      steps=c.steps + (kind > 0).astype(i32), done=c.done + n_fin,
      error=jnp.where(stuck, ERR_STUCK, c.error))

  # The table work: the free group (finished rows, then evicted cache rows), the borrows
  # (every admitted row; 0 pages without a cache hit), the extend or decode, hand-overs.
  ins_at = jnp.where(ins, _excl_cumsum(ins.astype(i32)), b_)
  work = Plan(
      free_rows=jnp.where(jnp.arange(f_) < npop, pop_rows, evicted), num_free=nfree,
      borrow_rows=adm_rows, borrow_src=r_ + gc,
      borrow_pages=jnp.where(hit, _div(pre0, ps), 0), num_borrow=k,
      ext_rows=jnp.where(p < n_batch, brow, 0), ext_n=chunk,
      num_ext=jnp.where(is_pre, n_batch, 0), ext_tokens=jnp.sum(chunk),
      dec_rows=_compact(rows, dec), num_dec=jnp.where(is_dec, n_dec, 0),
      ins_rows=_at(ins_at, b_, brow), ins_dst=_at(ins_at, b_, r_ + group_b),
      ins_pages=_at(ins_at, b_, _div(aligned, ps)), num_ins=jnp.sum(ins.astype(i32)),
      window=r_ * (go & (window_freed > 0)).astype(i32) if swa else jnp.zeros((), i32))

  live = phase != EMPTY
  held = _up(seq, ps) - _div(own, ps)
  active = (phase == PREFILL) | (phase == DECODE)
  tally = dict(
      waste=jnp.where(live, held * ps - (seq - own), 0), running=live,
      committed=jnp.where(active, reserved - held, 0), tokens=grow)
  if swa:
    swa_held = jnp.where(live, _up(seq, ps) - swa_from, 0)
    tally["swa_committed"] = jnp.where(active, jnp.maximum(swa_reserved - swa_held, 0), 0)
  tally = {name: jnp.sum(jnp.asarray(v, i32)) for name, v in tally.items()}
  tally.update(
      kind=kind, admitted=k, finished=n_fin, evicted=n_evict, evict_code=evict_code,
      hits=jnp.sum((adm & hit).astype(i32)), pages=pages,
      used=lay.num_pages - sched.free_pages, runs=jnp.full((), -1, i32))
  if swa:
    tally.update(swa_used=lay.swa_pages - swa_free, window_freed=window_freed,
                 refused=refused)
  tally = {name: jnp.asarray(v, i32) for name, v in tally.items()}
  return sched, work, tally


def _decide(lay: Layout, wl: Workload, c: Sched) -> Tuple[Sched, Pending]:
  """`plan` as (the next Sched, its Pending)."""
  sched, work, tally = plan(lay, wl, c)
  return sched, Pending(work, tuple(tally[c] for c in _tally_columns(lay.swa is not None)))


def step(lay: Layout, wl: Workload, carry: Carry) -> Tuple[Carry, Array]:
  """One iteration: the table work planned in the previous iteration (`_table_step`),
  and beside it, independent of it, the next plan (`plan`), as an overlapped scheduler
  runs them (on a GPU both run at once).

  Returns (carry, i32[len(record_columns)] record of the step whose table work ran); its
  kind is 0 when none did (an idle iteration, the first, or the run is over: `finished`),
  and then nothing changed but the clock (or the error flag).
  """
  now = carry.pending
  with jax.named_scope("table"):
    state, table, status = _table_step(lay, carry.state, carry.table, now.work)
  gather = one_program.Gather
  args = (wl._replace(arrival=gather(wl.arrival), group=gather(wl.group),
                      prompt=gather(wl.prompt), output=gather(wl.output)), carry.sched)
  decide = functools.partial(_decide, lay)
  if lay.plan_kernel:  # one Triton program (pallas_kernels.one_program), Sched in place
    sched, nxt = one_program.run(
        decide, *args, interpret=lay.plan_kernel == "triton_interpret", name="plan",
        num_warps=PLAN_WARPS, update=((1, 0),))
  else:
    sched, nxt = decide(*args)
  swa = lay.swa is not None
  tally = dict(zip(_tally_columns(swa), now.tally))
  tally.update(zip(STATUS, status))
  rec = jnp.stack([tally[name] for name in record_columns(swa)])
  return Carry(state, table, sched, nxt), rec


def finished(wl: Workload, carry: Carry) -> Array:
  """bool[]: the scheduler has `stopped` and no table work is pending."""
  return stopped(wl, carry.sched) & (carry.pending.tally[RECORD.index("kind")] == 0)


def checksum(*parts: Tuple[Array, Array]) -> Array:
  """i32[]: over each (slots, count), the sum of (i + 1) * slots[i] over its first count
  slots, wrapping (one reduction over all the parts)."""
  i = jnp.concatenate([jnp.arange(s.shape[0], dtype=jnp.uint32) for s, _ in parts])
  n = jnp.concatenate([jnp.full(s.shape, c, jnp.uint32) for s, c in parts])
  s = jnp.concatenate([s.astype(jnp.uint32) for s, _ in parts])
  return jnp.sum(jnp.where(i < n, (i + 1) * s, 0), dtype=jnp.uint32).astype(i32)


def _pools(state):
  return (state.full, state.swa) if isinstance(state, SWAState) else (state,)


def _hide_release(state, hide, keep=None):
  """The state with its release list(s) empty when `hide` (an allocation of no rows must
  not run need_sort's merge that an empty free list would trigger), or, with `keep`,
  the release lengths of `keep` put back."""
  if hide is False:
    return state
  src = _pools(keep) if keep is not None else None
  new = [p._replace(release_len=jnp.where(hide, 0 if src is None else src[i].release_len,
                                          p.release_len))
         for i, p in enumerate(_pools(state))]
  return state._replace(full=new[0], swa=new[1]) if isinstance(state, SWAState) else new[0]


def _table_step(lay: Layout, state, table, p: Plan):
  """The plan's table operations: (state, table, i32[3] status: ok, free + released
  pages, the slots' checksum; SWA mode adds the SWA pool's free + released pages)."""
  swa = lay.swa is not None
  tbl, cfg = (swa_table, lay.swa) if swa else (rt, lay.acfg)
  ps, nrows = lay.acfg.page_size, table.lens.shape[0]
  fused = not swa and not lay.branch and not cfg.need_sort

  def changes(s, t):
    """The borrows (into rows that were empty before this step's free group), the free
    group, the window frees, the extend (and, fused, the decode) and the hand-overs."""
    ok = jnp.ones((), bool)
    if not swa:
      with jax.named_scope("borrow"):
        t, ok = rt.borrow_from_rows(cfg, s, t, p.borrow_rows, p.borrow_src, p.borrow_pages,
                                    num_rows=p.num_borrow)
    if fused:  # the three pool phases in one step_rows
      s, t, o = jax.named_scope("step_rows")(rt.step_rows)(
          cfg, s, t, release=p.free_rows, num_release=p.num_free, extend=p.ext_rows,
          n=p.ext_n, num_extend=p.num_ext, max_tokens=lay.tokens, decode=p.dec_rows,
          num_decode=p.num_dec)
      ok = ok & o.release_ok & o.extend_ok & o.decode_ok
      slots = (o.extend_slots, o.decode_slots)
    else:
      with jax.named_scope("release"):
        s, t, ok_r = tbl.release_rows(cfg, s, t, p.free_rows, num_rows=p.num_free)
      ok = ok & ok_r
      if swa:
        with jax.named_scope("window"):
          s, t, ok_w = swa_table.window_rows(cfg, s, t, jnp.arange(nrows, dtype=i32),
                                             lay.window, num_rows=p.window)
        ok = ok & ok_w
      hide = (p.num_ext == 0) if cfg.need_sort else False  # no merge without rows
      with jax.named_scope("extend"):
        s2, t, slots_e, ok_e = tbl.extend_rows(cfg, _hide_release(s, hide), t,
                                               p.ext_rows, p.ext_n, max_tokens=lay.tokens,
                                               num_rows=p.num_ext)
      s, ok, slots = _hide_release(s2, hide, keep=s), ok & ok_e, (slots_e,)
    if not swa:
      with jax.named_scope("hand_over"):
        t, ok_h = rt.borrow_from_rows(cfg, s, t, p.ins_dst, p.ins_rows, p.ins_pages,
                                      num_rows=p.num_ins, hand_over=True)
      ok = ok & ok_h
    return (s, t, ok) + slots

  if fused:  # accelerators: no branch
    state, table, ok, slots_e, slots_d = changes(state, table)
  else:  # skipped on the steps that only decode (CPU); the decode, masked, after it
    changes = jax.named_scope("changes")(changes)
    if lay.branch:
      skip = lambda s, t: (s, t, jnp.ones((), bool), jnp.zeros((lay.tokens,), i32))
      state, table, ok, slots_e = jax.lax.cond(
          (p.num_free > 0) | (p.num_ext > 0) | (p.window > 0), changes, skip, state, table)
    else:
      state, table, ok, slots_e = changes(state, table)
    with jax.named_scope("decode"):
      state, table, slots_d, ok_d = tbl.decode_rows(cfg, state, table, p.dec_rows,
                                                    num_rows=p.num_dec)
    ok = ok & ok_d
  status = [ok.astype(i32)] + [st.available_size(c, s) // ps for c, s in zip(
      (cfg.full, cfg.swa) if swa else (cfg,), _pools(state))]
  status.insert(2, checksum((slots_e, p.ext_tokens), (slots_d, p.num_dec)))
  return state, table, jnp.stack(status)


def free_list_runs(state) -> Array:
  """Runs of consecutive page ids in the (full) pool's free list, in list order (i32[]);
  0 if empty. [5, 6, 7, 2, 3] has 2 runs. Traceable."""
  state = state.full if isinstance(state, SWAState) else state
  n = state.free_ring.shape[0]
  w = st.ring_window(state.free_ring, state.free_head, state.free_len, n)
  i = jnp.arange(n)
  brk = (i >= 1) & (i < state.free_len) & (w != jnp.roll(w, 1) + 1)
  return jnp.where(state.free_len > 0, 1 + jnp.sum(brk), 0).astype(i32)


@jax.named_scope("census")
def _with_runs(rec: Array, state) -> Array:
  """The record with the free-list census in its runs column, when a step ran."""
  at = COL["runs"]
  return rec.at[at].set(jnp.where(rec[COL["kind"]] > 0, free_list_runs(state), -1))


@functools.partial(jax.jit, static_argnames=("lay", "blocks", "runs_every"),
                   donate_argnames=("carry",))
def run_steps(lay: Layout, wl: Workload, carry: Carry, *, blocks: int, runs_every: int
              ) -> Tuple[Carry, Array, Array]:
  """The device driver's call: blocks * runs_every iterations (`step`), the free-list
  census after every runs_every-th. Returns (carry, i32[blocks * runs_every, C] records
  (kind 0: no step ran), bool[] `finished`).

  With the plan program the runs_every iterations of a block are one straight-line loop
  body, so a GPU overlaps each plan with the table work of the step before it across the
  whole block, not only within an iteration (and the Pending it writes into a new
  buffer is copied into the loop's carry once per block, not once per step)."""
  unroll = runs_every if lay.plan_kernel else 1

  def block(carry, _):
    carry, recs = jax.lax.scan(lambda x, _: step(lay, wl, x), carry, None,
                               length=runs_every, unroll=unroll)
    return carry, recs.at[-1].set(_with_runs(recs[-1], carry.state))

  carry, recs = jax.lax.scan(block, carry, None, length=blocks)
  return carry, recs.reshape(blocks * runs_every, -1), finished(wl, carry)


@functools.partial(jax.jit, static_argnames=("lay",), donate_argnames=("carry",))
def host_step(lay: Layout, wl: Workload, carry: Carry) -> Tuple[Carry, Array, Array]:
  """The host driver's call: one iteration (`step`). Returns (carry, i32[C] record,
  bool[] `finished`); the runs column is -1 (`census` gives it)."""
  carry, rec = step(lay, wl, carry)
  return carry, rec, finished(wl, carry)


census = jax.jit(free_list_runs)
census.__doc__ = "free_list_runs, jitted (the host driver's free-list census)."
