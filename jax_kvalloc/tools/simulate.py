"""`jax-kvalloc simulate`: a serving workload driven through the allocator.

Requests arrive (jax_kvalloc.workload), share prefixes through a small prefix cache,
prefill in chunked batches, decode one token per step, finish and are freed, all on the
default JAX device, through the request table (SPEC 11). Two drivers run the same
policy and make the same decisions:

- `--driver device` (default; jax_kvalloc.tools.simulate_device): the scheduler runs on
  the device, K steps per jitted call;
- `--driver host` (this module's `_Simulation`): a host scheduler that, like SGLang's,
  runs a prefill batch whenever requests can be admitted and a decode batch otherwise,
  and frees each iteration's finished requests and evicted cache entries in one free
  group; each step is one jitted call (jax_kvalloc.tools.simulate_steps).

Admission control is exact: the scheduler counts the pool's pages with the same
arithmetic the allocator uses (ceil(seq/ps) - ceil(pre/ps) new pages per request) and
admits a request only when its whole lifetime, prompt plus output, fits in the free pages
not yet promised to running requests; the first request that does not fit may evict
unused cached prefixes, least recently used first, and is then the iteration's last
admission. So no allocation may fail. The host driver never waits for the device to learn
that: each step's status (ok, the device's page count, a checksum of its slots) is
checked against the count STATUS_LAG steps later, when the device has long finished it
(the free-list census, `runs`, is read at the end for the same reason); the device driver
checks every step inside its loop. The run ends with a leak check that the free list, the
release list and the pages the prefix cache holds partition the pool exactly.

With `--swa-window W` (SPEC 13; both drivers) the pool is an SWA allocator: a
full pool of `pool_size` slots and an SWA pool of `swa_ratio * pool_size` slots (whole
pages). Every token takes a full slot and an SWA slot (jax_kvalloc.swa_table's
extend_rows / decode_rows); each step frees, for every live request, the SWA pages lying
wholly before `seq - W` (window_rows, after the step's free group and before its
allocation); a finished request frees both pools (release_rows). Admission counts both
pools: a request reserves its whole length in the full pool and, in the SWA pool, the
most SWA pages it can hold from now on (`swa_need`): while it prefills, the window plus
one prefill chunk, min(ceil(total / ps), ceil((W + min(prompt, max_prefill_tokens)) /
ps) + 1) (SGLang's alloc_extend takes SWA slots for the whole chunk; the window frees
them at the next step); once it decodes, the window plus one token, min(ceil(total / ps),
ceil((W + 1) / ps) + 1). A reservation only shrinks, so no allocation fails in either
pool. Prefix sharing is off in SWA mode:
SPEC 13 leaves SGLang's SWA radix-cache hooks out of scope and the SWA request table has
no borrowed prefixes, so requests whose prompts start with a shared prefix prefill it
themselves (the workload is the same; the report's prefix hits are 0). Page size 1 is
left out (SGLang's SWA alloc_extend and alloc_decode assert page_size > 1). The leak check
then covers both pools and the mapping.

Run once per page size on the same requests, it answers the seed write-up's question:
what a larger page costs in slots allocated but unused inside pages (internal
fragmentation) against what it saves in management (free-list entries, per-step time).
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_kvalloc.tools import simulate_steps as steps
from jax_kvalloc import guard
from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc import swa as swa_core
from jax_kvalloc import swa_table
from jax_kvalloc.buckets import bucket
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.swa import SWAConfig
from jax_kvalloc.tools.workload import Workload, make_workload, parse_dist

EMPTY, PREFILL, DECODE, FREEING = 0, 1, 2, 3
# Steps between launching a step and reading its status: by then the device has run it,
# so the read does not wait (a read of the newest status would, every step).
STATUS_LAG = 8
DRIVERS = ("device", "host")


class LeakCheckError(RuntimeError):
  """The pool's pages are not where the scheduler's accounting says they are."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """Everything a simulation run depends on (see `jax-kvalloc simulate --help`)."""
  num_requests: int = 600
  pool_size: int = 32768
  page_sizes: Tuple[int, ...] = (1, 16, 64)
  need_sort: bool = False
  arrival: str = "poisson"
  rate: float = 2.0
  prompt_len: str = "lognormal:256:0.8:2048"
  output_len: str = "uniform:16:320"
  num_prefixes: int = 8
  prefix_len: str = "uniform:64:1024"
  share_prob: float = 0.5
  max_running: int = 128
  max_prefill_tokens: int = 4096
  max_prefill_reqs: int = 16
  max_frees: int = 16
  seed: int = 0
  kernel: str = "auto"
  runs_every: int = 16
  max_steps: int = 1_000_000
  driver: str = "device"     # "device": K steps per call, planned on the device; "host"
  steps_per_call: int = 256  # K (device driver)
  inject_leak: bool = False  # test hook: the first finished request's free is dropped
  swa_window: int = 0        # SWA mode (module docstring): window in tokens; 0 = off
  swa_ratio: float = 0.25    # SWA mode: SWA pool slots / pool_size (whole pages)
  guard: bool = True         # the pools' ownership record (SPEC 14); False: its cost off

  def workload(self) -> Workload:
    return make_workload(num_requests=self.num_requests, arrival=self.arrival,
                         rate=self.rate, prompt_len=self.prompt_len,
                         output_len=self.output_len, num_prefixes=self.num_prefixes,
                         prefix_len=self.prefix_len, share_prob=self.share_prob,
                         seed=self.seed)


@dataclasses.dataclass
class PageSizeResult:
  """What one page size did with the workload. Usage and waste are fractions."""
  page_size: int
  num_pages: int
  kernel: str
  driver: str = "host"
  steps: int = 0
  prefill_steps: int = 0
  decode_steps: int = 0
  sim_time: int = 0              # scheduler iterations including idle ones
  requests_done: int = 0
  prefix_hits: int = 0
  tokens_allocated: int = 0
  pages_allocated: int = 0
  alloc_failures: int = 0
  peak_usage: float = 0.0        # max over steps of (pages in use) / num_pages
  mean_usage: float = 0.0
  peak_reserved: float = 0.0     # max of (in use + promised to running requests) / num_pages
  mean_running: float = 0.0      # requests holding a row, mean over steps
  waste_mean: float = 0.0        # unused slots in allocated pages / allocated slots
  waste_peak_slots: int = 0
  runs_mean: float = 0.0         # runs of consecutive pages in the free list
  runs_final: int = 0
  free_pages_final: int = 0
  in_use_final: int = 0
  evictions: int = 0
  step_us_p50: float = 0.0       # host driver: host time to launch a step (no wait)
  step_us_p99: float = 0.0
  step_wall_us: float = 0.0      # wall time / steps: the throughput, device included
  prefill_us_p50: float = 0.0
  decode_us_p50: float = 0.0
  steps_per_call: int = 1        # device driver: K
  calls: int = 0                 # device driver: jitted calls (host round trips)
  compile_s: float = 0.0
  compile_options: str = "default"
  wall_s: float = 0.0            # the run, compile excluded
  leak_check: str = "not run"
  usage: List[float] = dataclasses.field(default_factory=list, repr=False)
  step_us: List[float] = dataclasses.field(default_factory=list, repr=False)
  step_kind: List[str] = dataclasses.field(default_factory=list, repr=False)
  records: Any = dataclasses.field(default=None, repr=False)  # i64[steps, RECORD]
  free_list_final: List[int] = dataclasses.field(default_factory=list, repr=False)
  release_list_final: List[int] = dataclasses.field(default_factory=list, repr=False)
  # SWA mode only (absent from the JSON otherwise): both pools in pages.
  swa_window: int = 0
  swa_num_pages: int = 0
  full_peak_pages: int = 0
  full_mean_pages: float = 0.0
  swa_peak_pages: int = 0
  swa_mean_pages: float = 0.0
  swa_peak_usage: float = 0.0
  swa_mean_usage: float = 0.0
  window_frees: int = 0          # SWA pages the window freed (finishes not counted)
  refused_full: int = 0          # steps whose next admission the full pool stopped
  refused_swa: int = 0           # ... the SWA pool stopped (both: counted in each)
  swa_usage: List[float] = dataclasses.field(default_factory=list, repr=False)


SWA_FIELDS = ("swa_window", "swa_num_pages", "full_peak_pages", "full_mean_pages",
              "swa_peak_pages", "swa_mean_pages", "swa_peak_usage", "swa_mean_usage",
              "window_frees", "refused_full", "refused_swa", "swa_usage")



def _pct(x: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else 0.0


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sizes of one page size's run (both drivers use the same)."""
  acfg: AllocatorConfig
  rows: int          # R request rows (max_running, bucketed)
  groups: int        # G prefix-cache rows, one per group, after the request rows
  batch: int         # B requests per prefill
  tokens: int        # T prefill token budget (the extend's slot array)
  frees: int         # F rows per free group
  width: int         # page columns per table row
  prefix_width: int  # page columns a cached prefix can span
  swa: Optional[SWAConfig] = None  # SWA mode: both pools (acfg is swa.full)
  window: int = 0                  # SWA mode: the window in tokens

  @property
  def swa_pages(self) -> int:
    return self.swa.swa.num_pages if self.swa is not None else 0

  @property
  def num_pages(self) -> int:
    return self.acfg.num_pages


def make_layout(cfg: SimConfig, wl: Workload, page_size: int) -> Layout:
  """The static sizes; ValueError when a request cannot fit in the pool at all."""
  kind = "token" if page_size == 1 else "paged"
  acfg = AllocatorConfig(size=cfg.pool_size, page_size=page_size, need_sort=cfg.need_sort,
                         kind=kind, kernel=cfg.kernel, guard=cfg.guard)
  need = cdiv(wl.prompt + wl.output, page_size)
  if need.size and int(need.max()) > acfg.num_pages:
    i = int(np.argmax(need))
    raise ValueError(
        f"request {i} needs {int(need[i])} pages ({int(wl.prompt[i] + wl.output[i])} "
        f"tokens) at page_size={page_size}, but the pool has only {acfg.num_pages}; "
        f"raise --pool-size or shorten the length distributions")
  # Widths from the distributions' bounds, not from the draws: every seed and share
  # probability of one config has the same shapes (and compiles once).
  prefix_hi = parse_dist(cfg.prefix_len).hi if cfg.num_prefixes > 0 else 0
  longest = parse_dist(cfg.prompt_len).hi + prefix_hi + parse_dist(cfg.output_len).hi
  lay = Layout(acfg=acfg, rows=bucket(cfg.max_running, 1), groups=max(cfg.num_prefixes, 1),
               batch=bucket(cfg.max_prefill_reqs, 1),
               tokens=bucket(cfg.max_prefill_tokens, 1), frees=max(cfg.max_frees, 1),
               width=max(1, cdiv(max(longest, wl.max_context), page_size)),
               prefix_width=max(1, cdiv(prefix_hi, page_size)))
  if cfg.swa_window <= 0:
    return lay
  check_swa_args(cfg)
  swa_pages = int(round(cfg.swa_ratio * cfg.pool_size / page_size))
  need = swa_need(wl.prompt, wl.output, cfg.swa_window, lay.tokens, page_size)
  most = int(need.max()) if need.size else 0
  if swa_pages < max(most, 1):
    raise ValueError(
        f"--swa-ratio {cfg.swa_ratio} gives an SWA pool of {swa_pages} pages at "
        f"page_size={page_size}, but one request's window (--swa-window "
        f"{cfg.swa_window} plus a prefill chunk) needs up to {most}; raise --swa-ratio")
  scfg = SWAConfig(size=cfg.pool_size, size_swa=swa_pages * page_size,
                   page_size=page_size, need_sort=cfg.need_sort, kernel=cfg.kernel,
                   guard=cfg.guard)
  return dataclasses.replace(lay, acfg=scfg.full, swa=scfg, window=int(cfg.swa_window))


def swa_need(prompt, output, window: int, tokens: int, ps: int, *, decoding=False):
  """SWA pages a request may hold at most from now on (numpy or jax arrays): after a step
  that extends it from L to L + n tokens, having freed the pages wholly before
  L - window, it holds ceil((L + n) / ps) - floor((L - window) / ps)
  <= ceil((window + n) / ps) + 1 pages, with n <= min(prompt, tokens) while it prefills
  and n = 1 once it decodes (`decoding`, bool or bool array); never more than its whole
  length's pages."""
  xp = np if isinstance(prompt, np.ndarray) else jax.numpy
  n = xp.where(decoding, 1, xp.minimum(prompt, tokens))
  return xp.minimum(cdiv(prompt + output, ps), cdiv(window + n, ps) + 1)


def check_swa_args(cfg: SimConfig) -> None:
  """ValueError naming the argument for a bad SWA setting (window 0: SWA off; the
  ratio is then ignored)."""
  if not isinstance(cfg.swa_window, (int, np.integer)) or cfg.swa_window < 0:
    raise ValueError(f"--swa-window must be an int >= 0 (0: no SWA pool), "
                     f"got {cfg.swa_window!r}")
  if cfg.swa_window == 0:
    return
  if not cfg.swa_ratio > 0:
    raise ValueError(f"--swa-ratio must be > 0 (SWA pool slots / --pool-size), "
                     f"got {cfg.swa_ratio!r}")
  if not [p for p in cfg.page_sizes if p > 1]:
    raise ValueError(f"--swa-window needs a page size > 1 (SGLang's SWA alloc_extend "
                     f"asserts page_size > 1), got --page-size {list(cfg.page_sizes)}")


def init_pool(lay: Layout):
  """(state, table) of an empty pool and table (SWA mode: SWAState and SWATable, one row
  per request: no prefix cache)."""
  if lay.swa is not None:
    state = jax.jit(swa_core.init, static_argnums=0)(lay.swa)
    table = swa_table.init_table(lay.swa, lay.rows, lay.width)
    return state, table
  state = jax.jit(st.init, static_argnums=0)(lay.acfg)
  table = jax.jit(rt.init_table, static_argnums=(0, 1, 2))(
      lay.acfg, lay.rows + lay.groups, lay.width)
  return state, table


def leak_error(ps: int, step: int, device_pages: int, expected: int,
               pool: str = "") -> LeakCheckError:
  return LeakCheckError(
      f"leak check failed at step {step} (page_size={ps}): the device has "
      f"{device_pages} free + released {pool}pages, the scheduler's accounting expects "
      f"{expected} (difference {device_pages - expected})")


def failed_error(ps: int, step: int, pages: int) -> LeakCheckError:
  return LeakCheckError(
      f"allocation failed at step {step} (page_size={ps}) although admission "
      f"control had reserved its pages ({pages} free + released on the device)")


class _Simulation:
  """One page size under the host scheduler: a numpy mirror of the requests, one jitted
  call (simulate_steps.prefill_step / decode_step) per step."""

  def __init__(self, cfg: SimConfig, wl: Workload, page_size: int, progress: bool):
    self.cfg, self.wl, self.ps = cfg, wl, page_size
    self.lay = lay = make_layout(cfg, wl, page_size)
    self.acfg, self.num_pages = lay.acfg, lay.num_pages
    self.res = PageSizeResult(page_size, self.num_pages, cfg.kernel, driver="host",
                              swa_window=lay.window, swa_num_pages=lay.swa_pages)
    # SWA mode (lay.swa): no prefix cache (every request's group is -1), and per row the
    # first column whose SWA page is held and the SWA pages it may hold from now on.
    self.swa = lay.swa is not None
    self.group_of = np.full_like(wl.group, -1) if self.swa else wl.group
    self.swa_from = np.zeros(lay.rows, np.int64)
    self.swa_reserved = np.zeros(lay.rows, np.int64)
    self.swa_free = lay.swa_pages          # mirror of the SWA pool's free + released
    self.refused = 0
    self.progress = progress
    r, g = self.R, self.G = lay.rows, lay.groups
    self.B, self.T, self.F = lay.batch, lay.tokens, lay.frees
    # Host mirror, one entry per request row.
    self.req = np.full(r, -1, np.int64)
    self.phase = np.zeros(r, np.int64)
    self.seq = np.zeros(r, np.int64)
    self.prompt = np.zeros(r, np.int64)
    self.out = np.zeros(r, np.int64)
    self.gen = np.zeros(r, np.int64)
    self.own = np.zeros(r, np.int64)       # first token the request owns (page aligned)
    self.group = np.full(r, -1, np.int64)
    self.hit = np.zeros(r, bool)           # holds a reference on its group's cache entry
    self.reserved = np.zeros(r, np.int64)  # pages of its own it may ever hold
    self.admitted_at = np.zeros(r, np.int64)
    # Prefix cache, one entry per group; its pages are owned by table row R + g.
    self.cache_tokens = np.zeros(g, np.int64)
    self.refcount = np.zeros(g, np.int64)
    self.last_used = np.full(g, -1, np.int64)
    self.free_pages = self.num_pages       # mirror of free_len + release_len
    self.pending_free: collections.deque = collections.deque()  # (row, pages, forget)
    self.leak_injected = False
    self.records: List[List[int]] = []

  # -- accounting ---------------------------------------------------------------------
  def held(self) -> np.ndarray:
    """Pages each row holds of its own."""
    live = self.phase != EMPTY
    return np.where(live, cdiv(self.seq, self.ps) - self.own // self.ps, 0)

  def committed(self) -> int:
    """Pages promised to running requests but not yet taken."""
    live = (self.phase == PREFILL) | (self.phase == DECODE)
    return int(np.sum(np.where(live, self.reserved - self.held(), 0)))

  def swa_committed(self) -> int:
    """SWA mode: SWA pages the running requests may still take."""
    live = (self.phase == PREFILL) | (self.phase == DECODE)
    held = cdiv(self.seq, self.ps) - self.swa_from
    return int(np.sum(np.where(live, np.maximum(self.swa_reserved - held, 0), 0)))

  def apply_window(self) -> int:
    """SWA mode: every row's SWA pages wholly before seq - window leave (as the step's
    window_rows does); returns how many."""
    end = np.clip(np.maximum(self.seq - self.lay.window, 0) // self.ps, 0, self.lay.width)
    end = np.where(self.phase != EMPTY, end, self.swa_from)
    freed = int(np.sum(np.maximum(end - self.swa_from, 0)))
    self.swa_from = np.maximum(self.swa_from, end)
    self.swa_free += freed
    return freed

  # -- planning -----------------------------------------------------------------------
  def _evict_for(self, need: int, avail: int, keep: int, frees: list, evicted: list) -> int:
    """Evicts unused cache entries (LRU, never `keep`) until need fits; returns avail."""
    order = np.argsort(self.last_used, kind="stable")
    cand = [int(h) for h in order if self.cache_tokens[h] > 0 and self.refcount[h] == 0
            and h != keep]
    pages = sum(int(self.cache_tokens[h]) // self.ps for h in cand)
    if need > avail + pages:
      return avail
    for h in cand:
      if avail >= need or len(frees) >= self.F:
        break
      p = int(self.cache_tokens[h]) // self.ps
      frees.append((self.R + h, p, False))
      evicted.append(h)
      self.cache_tokens[h] = 0
      avail += p
      self.free_pages += p
    return avail

  def plan_prefill(self, waiting: collections.deque, frees: list, evicted: list,
                   clock: int):
    """A prefill batch [(row, tokens)] and borrows [(row, cache row, pages)], admitting
    from `waiting` in arrival order; a request admitted by evicting cached prefixes is
    the iteration's last admission."""
    batch, borrow = [], []
    budget = self.T
    avail = self.free_pages - self.committed()
    avail_swa = self.swa_free - self.swa_committed() if self.swa else 0
    rows = np.flatnonzero(self.phase == PREFILL)
    for r in rows[np.argsort(self.admitted_at[rows], kind="stable")]:
      if len(batch) == self.B or budget == 0:
        break
      chunk = int(min(self.prompt[r] - self.seq[r], budget))
      batch.append((int(r), chunk))
      budget -= chunk
    while waiting and len(batch) < self.B and budget > 0:
      empty = np.flatnonzero(self.phase == EMPTY)
      if not empty.size:
        break
      q = waiting[0]
      g = int(self.group_of[q])
      hit = g >= 0 and self.cache_tokens[g] > 0
      pre0 = int(self.cache_tokens[g]) if hit else 0
      total = int(self.wl.prompt[q] + self.wl.output[q])
      need = cdiv(total, self.ps) - pre0 // self.ps
      if self.swa:  # no cache to evict: the first request that does not fit waits
        need_swa = int(swa_need(np.asarray(self.wl.prompt[q]), np.asarray(self.wl.output[q]),
                                self.lay.window, self.T, self.ps))
        if need > avail or need_swa > avail_swa:
          self.refused = int(need > avail) + 2 * int(need_swa > avail_swa)
          break
        avail_swa -= need_swa
        r = int(empty[0])
        self.swa_from[r], self.swa_reserved[r] = 0, need_swa
      last = need > avail
      if last:
        avail = self._evict_for(need, avail, g, frees, evicted)
        if need > avail:
          break
      waiting.popleft()
      r = int(empty[0])
      self.req[r], self.phase[r], self.seq[r] = q, PREFILL, pre0
      self.prompt[r], self.out[r], self.gen[r] = self.wl.prompt[q], self.wl.output[q], 0
      self.own[r], self.group[r], self.hit[r] = pre0, g, hit
      self.reserved[r], self.admitted_at[r] = need, clock
      avail -= need
      if hit:
        self.refcount[g] += 1
        self.last_used[g] = clock
        borrow.append((r, self.R + g, pre0 // self.ps))
      chunk = int(min(self.prompt[r] - pre0, budget))
      batch.append((r, chunk))
      budget -= chunk
      if last:
        break
    return batch, borrow

  def pop_frees(self) -> list:
    frees = []
    while self.pending_free and len(frees) < self.F:
      row, pages, forget = self.pending_free.popleft()
      frees.append((row, pages, forget))
      self.free_pages += pages
      if self.swa:
        self.swa_free += int(cdiv(self.seq[row], self.ps) - self.swa_from[row])
      self.phase[row] = EMPTY
      self.req[row] = -1
    return frees

  # -- device calls -------------------------------------------------------------------
  def _plan(self, frees, borrow, rows, n, ins) -> steps.Plan:
    def col(entries, i, size, fill=0):
      out = np.full(size, fill, np.int32)
      out[:len(entries)] = [e[i] for e in entries]
      return out
    forget = [row for row, _, f in frees if f]
    b = self.B
    return steps.Plan(
        free_rows=col(frees, 0, self.F), num_free=len(frees),
        forget_row=forget[0] if forget else -1,
        borrow_rows=col(borrow, 0, b), borrow_src=col(borrow, 1, b),
        borrow_pages=col(borrow, 2, b), num_borrow=len(borrow),
        rows=np.asarray(rows, np.int32), n=np.asarray(n, np.int32),
        num_rows=self._num_rows,
        ins_rows=col(ins, 0, b), ins_dst=col(ins, 1, b), ins_pages=col(ins, 2, b),
        num_ins=len(ins))

  def _run(self, plan: steps.Plan, prefill: bool) -> Tuple[Any, float]:
    """Launches one step; returns its status (i32[3] device array), unread, and the host
    time the launch took (us)."""
    packed = steps.pack_plan(plan)
    n = self.B if prefill else self.R
    t0 = time.perf_counter()
    if self.swa:
      fn = steps.swa_prefill_step if prefill else steps.swa_decode_step
      self.state, self.table, status = fn(
          self.lay.swa, self.state, self.table, packed,
          sizes=steps.plan_sizes(self.F, self.B, n), max_tokens=self.T,
          window=self.lay.window)
      return status, (time.perf_counter() - t0) * 1e6
    fn = steps.prefill_step if prefill else steps.decode_step
    self.state, self.table, status = fn(
        self.acfg, self.state, self.table, packed,
        sizes=steps.plan_sizes(self.F, self.B, n), max_tokens=self.T,
        prefix_width=self.lay.prefix_width)
    return status, (time.perf_counter() - t0) * 1e6

  def _check_statuses(self, lag: int) -> None:
    """Checks the queued statuses older than `lag` steps (0: all; waits for them)."""
    while len(self.pending_status) > lag:
      step, status = self.pending_status.popleft()
      ok, pages, check, *swa_pages = (int(v) for v in np.asarray(status))
      rec = self.records[step - 1]
      if swa_pages:
        rec[steps.COL["swa_device_pages"]] = swa_pages[0]
        if swa_pages[0] != self.lay.swa_pages - rec[steps.COL["swa_used"]]:
          raise leak_error(self.ps, step, swa_pages[0],
                           self.lay.swa_pages - rec[steps.COL["swa_used"]], pool="SWA ")
      rec[steps.COL["ok"]], rec[steps.COL["device_pages"]] = ok, pages
      rec[steps.COL["checksum"]] = check
      if not ok:
        raise failed_error(self.ps, step, pages)
      if pages != self.num_pages - rec[steps.COL["used"]]:
        raise leak_error(self.ps, step, pages, self.num_pages - rec[steps.COL["used"]])

  def warm_up(self) -> None:
    """Compiles both step functions on all-padding plans (the pool is unchanged)."""
    t0 = time.perf_counter()
    self.state, self.table = init_pool(self.lay)
    statuses = []
    for prefill in (True, False):
      n = self.B if prefill else self.R
      self._num_rows = 0
      plan = self._plan([], [], np.zeros(n), np.zeros(n), [])
      statuses.append(self._run(plan, prefill)[0])
    got = [np.asarray(s).tolist()[:2] for s in statuses]
    self.pending_status = collections.deque()
    if got != [[1, self.num_pages]] * 2:
      raise RuntimeError(f"warm-up changed the pool: {got}")
    jax.block_until_ready(steps.free_list_runs_jit(self._pool()))
    self.res.compile_s = time.perf_counter() - t0

  # -- the loop -----------------------------------------------------------------------
  def run(self) -> PageSizeResult:
    cfg, wl, res, ps = self.cfg, self.wl, self.res, self.ps
    n = wl.num_requests
    bar = progress_bar(n, ps, self.progress)
    self.warm_up()
    bar.set_description(f"page_size={ps}")
    t_start = time.perf_counter()
    waiting: collections.deque = collections.deque()
    nxt, clock, runs = 0, 0, []
    while res.requests_done < n or self.pending_free:
      if res.steps >= cfg.max_steps:
        raise RuntimeError(f"no progress after {res.steps} steps (page_size={ps}); "
                           f"waiting={len(waiting)}")
      while nxt < n and wl.arrival[nxt] <= clock:
        waiting.append(nxt)
        nxt += 1
      frees = self.pop_frees()
      window_freed = self.apply_window() if self.swa else 0
      self.refused = 0
      evicted: List[int] = []
      before = len(waiting)
      batch, borrow = self.plan_prefill(waiting, frees, evicted, clock) if waiting or (
          self.phase == PREFILL).any() else ([], [])
      decoding = np.flatnonzero(self.phase == DECODE)
      if batch:
        rec = self._prefill(batch, frees, borrow)
      elif decoding.size or frees:
        rec = self._decode(decoding, frees, bar)
      else:
        if nxt >= n and not waiting:
          break
        if nxt >= n or waiting:
          raise RuntimeError(f"scheduler stuck at step {res.steps} (page_size={ps}): "
                             f"{len(waiting)} requests wait and none can be admitted")
        clock = max(clock + 1, int(wl.arrival[nxt]))
        continue
      clock += 1
      res.steps += 1
      rec["admitted"] = before - len(waiting)
      rec["hits"] = len(borrow)
      rec["evicted"] = len(evicted)
      rec["evict_code"] = sum((g + 1) << j for j, g in enumerate(evicted))
      used = self.num_pages - self.free_pages
      live = self.phase != EMPTY
      rec["used"] = used
      rec["waste"] = int(np.sum(np.where(live, self.held() * ps - (self.seq - self.own), 0)))
      rec["running"] = int(np.sum(live))
      rec["committed"] = self.committed()
      rec["runs"] = -1
      if res.steps % cfg.runs_every == 0:
        runs.append((res.steps, steps.free_list_runs_jit(self._pool())))  # read at the end
      if self.swa:
        rec.update(swa_used=self.lay.swa_pages - self.swa_free, window_freed=window_freed,
                   swa_committed=self.swa_committed(), refused=self.refused)
      self.records.append([rec.get(k, 0) for k in steps.record_columns(self.swa)])
      self._check_statuses(STATUS_LAG)
    self._check_statuses(0)
    bar.close()
    res.wall_s = time.perf_counter() - t_start
    for step, value in runs:
      self.records[step - 1][steps.COL["runs"]] = int(value)
    res.runs_final = int(steps.free_list_runs_jit(self._pool()))
    res.sim_time = clock
    finish_result(res, np.asarray(self.records, np.int64).reshape(
        -1, len(steps.record_columns(self.swa))))
    res.step_us_p50, res.step_us_p99 = _pct(res.step_us, 50), _pct(res.step_us, 99)
    kinds = np.asarray(res.step_kind)
    times = np.asarray(res.step_us)
    res.prefill_us_p50 = _pct(times[kinds == "prefill"], 50)
    res.decode_us_p50 = _pct(times[kinds == "decode"], 50)
    if self.swa:
      final_leak_check_swa(res, self.lay, self.state, self.table)
    else:
      final_leak_check(res, self.lay, self.state, self.table, self.cache_tokens)
    return res

  def _pool(self):
    """The (full) pool whose free list `runs` counts."""
    return self.state.full if self.swa else self.state

  def _prefill(self, batch, frees, borrow) -> Dict[str, int]:
    rows, n = (np.array(c, np.int64) for c in zip(*batch))
    pre = self.seq[rows]
    pages = int(np.sum(steps.new_pages(pre, pre + n, self.ps)))
    self.seq[rows] = pre + n
    self.swa_free -= pages if self.swa else 0
    ins = []
    for r in rows[self.seq[rows] == self.prompt[rows]]:
      self.phase[r] = DECODE
      if self.swa:  # from now on: the window and one token
        self.swa_reserved[r] = int(swa_need(np.asarray(self.prompt[r]),
                                            np.asarray(self.out[r]), self.lay.window,
                                            self.T, self.ps, decoding=True))
      ins.extend(self._maybe_insert(int(r)))
    self._num_rows = len(batch)
    plan = self._plan(frees, borrow, np.pad(rows, (0, self.B - rows.size)),
                      np.pad(n, (0, self.B - n.size)), ins)
    status, us = self._run(plan, True)
    self.pending_status.append((self.res.steps + 1, status))
    self.res.step_us.append(us)
    self.res.step_kind.append("prefill")
    self.free_pages -= pages
    return {"kind": steps.KIND_PREFILL, "tokens": int(np.sum(n)), "pages": pages}

  def _maybe_insert(self, r: int) -> list:
    """Hands the whole pages of a freshly prefilled shared prefix to the cache."""
    g = int(self.group[r])
    if g < 0 or self.hit[r] or self.cache_tokens[g] > 0 or self.own[r] != 0:
      return []
    aligned = int(self.wl.prefix_len[g]) // self.ps * self.ps
    if aligned == 0:
      return []
    self.cache_tokens[g] = aligned
    self.own[r] = aligned
    self.reserved[r] -= aligned // self.ps
    self.hit[r] = True
    self.refcount[g] = 1
    self.last_used[g] = self.admitted_at[r]
    return [(r, self.R + g, aligned // self.ps)]

  def _decode(self, rows, frees, bar) -> Dict[str, int]:
    seq = self.seq[rows] + 1
    pages = int(np.sum(steps.new_pages(self.seq[rows], seq, self.ps)))
    self._num_rows = rows.size
    plan = self._plan(frees, [], np.pad(rows, (0, self.R - rows.size)),
                      np.ones(self.R), [])
    status, us = self._run(plan, False)
    self.pending_status.append((self.res.steps + 1, status))
    self.res.step_us.append(us)
    self.res.step_kind.append("decode")
    self.free_pages -= pages
    self.swa_free -= pages if self.swa else 0
    self.seq[rows] = seq
    self.gen[rows] += 1
    done = rows[self.gen[rows] >= self.out[rows]]
    for r in done:
      r = int(r)
      self.phase[r] = FREEING
      if self.hit[r]:
        self.refcount[self.group[r]] -= 1
      pages_held = cdiv(int(self.seq[r]), self.ps) - int(self.own[r]) // self.ps
      forget = self.cfg.inject_leak and not self.leak_injected
      self.leak_injected |= forget
      self.pending_free.append((r, pages_held, forget))
    self.res.requests_done += int(done.size)
    if done.size:
      bar.update(int(done.size))
    return {"kind": steps.KIND_DECODE, "tokens": int(rows.size), "pages": pages,
            "finished": int(done.size)}


def progress_bar(n: int, ps: int, progress: bool):
  import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(total=n, desc=f"page_size={ps} (compiling)", unit="req",
                   disable=not progress, file=sys.stderr, dynamic_ncols=True, leave=False)


def finish_result(res: PageSizeResult, records: np.ndarray) -> None:
  """Fills the result's counts and series from the step records (simulate_steps.RECORD),
  the same for both drivers; `res.runs_final` must be set."""
  c = steps.COL
  n = res.num_pages
  res.records = records
  kind = records[:, c["kind"]]
  res.steps = int(kind.size)
  res.prefill_steps = int(np.sum(kind == steps.KIND_PREFILL))
  res.decode_steps = int(np.sum(kind == steps.KIND_DECODE))
  res.prefix_hits = int(np.sum(records[:, c["hits"]]))
  res.tokens_allocated = int(np.sum(records[:, c["tokens"]]))
  res.pages_allocated = int(np.sum(records[:, c["pages"]]))
  res.alloc_failures = int(np.sum(records[:, c["ok"]] == 0))
  res.evictions = int(np.sum(records[:, c["evicted"]]))
  used = records[:, c["used"]]
  res.usage = (used / n).tolist()
  res.peak_usage = float(used.max() / n) if used.size else 0.0
  res.mean_usage = float(used.mean() / n) if used.size else 0.0
  res.peak_reserved = (float((used + records[:, c["committed"]]).max() / n)
                       if used.size else 0.0)
  res.mean_running = float(records[:, c["running"]].mean()) if used.size else 0.0
  if used.size:
    waste = records[:, c["waste"]]
    res.waste_mean = float(np.mean(waste / np.maximum(used * res.page_size, 1)))
    res.waste_peak_slots = int(waste.max())
  runs = records[:, c["runs"]]
  runs = np.concatenate([runs[runs >= 0], [res.runs_final]])
  res.runs_mean = float(np.mean(runs))
  res.step_wall_us = res.wall_s * 1e6 / max(res.steps, 1)
  if records.shape[1] > len(steps.RECORD):  # SWA mode
    n_swa = max(res.swa_num_pages, 1)
    swa_used = records[:, c["swa_used"]]
    res.swa_usage = (swa_used / n_swa).tolist()
    if used.size:
      res.full_peak_pages, res.full_mean_pages = int(used.max()), float(used.mean())
      res.swa_peak_pages, res.swa_mean_pages = int(swa_used.max()), float(swa_used.mean())
      res.swa_peak_usage = res.swa_peak_pages / n_swa
      res.swa_mean_usage = res.swa_mean_pages / n_swa
    res.window_frees = int(np.sum(records[:, c["window_freed"]]))
    refused = records[:, c["refused"]]
    res.refused_full = int(np.sum((refused & 1) != 0))
    res.refused_swa = int(np.sum((refused & 2) != 0))


def final_leak_check(res: PageSizeResult, lay: Layout, state, table, cache_tokens) -> None:
  """free + released + held by the prefix cache must be exactly pages 1..num_pages, and
  every request row empty; no free was refused (the ownership record's status)."""
  ps, num_pages, r = lay.acfg.page_size, lay.num_pages, lay.rows
  _no_refusal(ps, state)
  free = st.live_free_pages(state)
  release = st.live_release_pages(state)
  pages, lens, owned = (np.asarray(a) for a in table)
  cache_tokens = np.asarray(cache_tokens)
  held = []
  for g in range(lay.groups):
    want = int(cache_tokens[g])
    if int(lens[r + g]) != want or (want and int(owned[r + g]) != 0):
      raise LeakCheckError(f"cache entry {g} (page_size={ps}) holds {int(lens[r + g])} "
                           f"tokens from column {int(owned[r + g])}, the scheduler "
                           f"expects {want} from column 0")
    held.append(pages[r + g, :want // ps])
  if np.any(lens[:r]):
    raise LeakCheckError(f"request rows still hold tokens at the end (page_size={ps}): "
                         f"rows {np.flatnonzero(lens[:r]).tolist()}")
  held = np.concatenate(held).astype(np.int64)
  everything = np.concatenate([free, release, held]).astype(np.int64)
  res.free_pages_final = int(free.size + release.size)
  res.in_use_final = int(held.size)
  res.free_list_final = free.tolist()
  res.release_list_final = release.tolist()
  total = res.free_pages_final + res.in_use_final
  uniq = np.unique(everything)
  expected = np.arange(1, num_pages + 1)
  if total != num_pages or not np.array_equal(uniq, expected):
    missing = np.setdiff1d(expected, uniq).size
    dup = everything.size - uniq.size
    res.leak_check = "FAILED"
    raise LeakCheckError(
        f"leak check failed (page_size={ps}): free {res.free_pages_final} + in use "
        f"{res.in_use_final} = {total} != total {num_pages} pages; "
        f"{missing} pages missing, {dup} held twice")
  res.leak_check = (f"ok: free {res.free_pages_final} + in use {res.in_use_final} "
                    f"== {num_pages}")


def _no_refusal(ps: int, state) -> None:
  err = guard.error(state)
  if err is not None:
    raise LeakCheckError(f"a free was refused (page_size={ps}): {err}")


def final_leak_check_swa(res: PageSizeResult, lay: Layout, state, table) -> None:
  """SWA mode: each pool's free + released pages are exactly its pages 1..n, no full slot
  maps to an SWA slot any more, and every request row is empty."""
  ps = lay.acfg.page_size
  _no_refusal(ps, state)
  lens = np.asarray(table.lens)
  if np.any(lens):
    raise LeakCheckError(f"request rows still hold tokens at the end (page_size={ps}): "
                         f"rows {np.flatnonzero(lens).tolist()}")
  counts = []
  for name, pool, n in (("full", state.full, lay.num_pages),
                        ("SWA", state.swa, lay.swa_pages)):
    free, release = st.live_free_pages(pool), st.live_release_pages(pool)
    everything = np.concatenate([free, release]).astype(np.int64)
    uniq = np.unique(everything)
    expected = np.arange(1, n + 1)
    if everything.size != n or not np.array_equal(uniq, expected):
      res.leak_check = "FAILED"
      raise LeakCheckError(
          f"leak check failed (page_size={ps}, {name} pool): free + released "
          f"{everything.size} != total {n} pages; {np.setdiff1d(expected, uniq).size} "
          f"pages missing, {everything.size - uniq.size} held twice")
    counts.append(everything.size)
    if name == "full":
      res.free_list_final, res.release_list_final = free.tolist(), release.tolist()
  mapped = np.flatnonzero(swa_core.live_mapping(state)[:-1])
  if mapped.size:
    res.leak_check = "FAILED"
    raise LeakCheckError(f"leak check failed (page_size={ps}): {mapped.size} full slots "
                         f"still map to SWA slots, e.g. {mapped[:5].tolist()}")
  res.free_pages_final, res.in_use_final = counts[0], 0
  res.leak_check = (f"ok: full free {counts[0]} == {lay.num_pages}, SWA free "
                    f"{counts[1]} == {lay.swa_pages}")


@dataclasses.dataclass
class SimResult:
  config: Dict[str, Any]
  device: str
  versions: Dict[str, str]
  results: List[PageSizeResult]
  mode: str = "synthetic"   # or "trace"

  @property
  def ok(self) -> bool:
    return all(r.leak_check.startswith("ok") and r.alloc_failures == 0
               for r in self.results)


def versions() -> Dict[str, str]:
  import platform  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import __version__  # pylint: disable=g-import-not-at-top
  return {"python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "numpy": np.__version__,
          "jax_kvalloc": __version__}


def device_name() -> str:
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d)} ({jax.device_count()} device(s))"


def run(cfg: SimConfig, *, progress: bool = True) -> SimResult:
  """Runs the workload once per page size. Raises LeakCheckError on a leak."""
  if not cfg.page_sizes:
    raise ValueError("page_sizes is empty")
  if cfg.driver not in DRIVERS:
    raise ValueError(f"driver must be one of {DRIVERS}, got {cfg.driver!r}")
  if cfg.steps_per_call < 1:
    raise ValueError(f"steps_per_call must be >= 1, got {cfg.steps_per_call}")
  check_swa_args(cfg)
  if cfg.swa_window > 0 and 1 in cfg.page_sizes:
    print("jax-kvalloc simulate: --swa-window leaves page_size=1 out (SGLang's SWA "
          "alloc_extend asserts page_size > 1)", file=sys.stderr)
    cfg = dataclasses.replace(cfg, page_sizes=tuple(p for p in cfg.page_sizes if p > 1))
  if cfg.swa_window > 0 and cfg.num_prefixes > 0 and cfg.share_prob > 0:
    print("jax-kvalloc simulate: --swa-window turns prefix sharing off (the SWA request "
          "table has no borrowed prefixes); shared prefixes are prefilled per request",
          file=sys.stderr)
  wl = cfg.workload()
  if cfg.driver == "host":
    out = [_Simulation(cfg, wl, int(ps), progress).run() for ps in cfg.page_sizes]
  else:
    from jax_kvalloc.tools import simulate_device  # pylint: disable=g-import-not-at-top
    out = simulate_device.run_all(cfg, wl, progress)
  return SimResult(dataclasses.asdict(cfg), device_name(), versions(), out)


def run_trace(cfg: SimConfig, path: str, *, progress: bool = True) -> SimResult:
  """Replays the traces in `path` (jax_kvalloc.traces format), one result per page size."""
  from jax_kvalloc.tools import simulate_trace  # pylint: disable=g-import-not-at-top
  if cfg.swa_window:
    raise ValueError("--swa-window does not apply to --trace (a trace replays its own ops)")
  results = simulate_trace.run_trace(path, kernel=cfg.kernel, runs_every=cfg.runs_every,
                                     progress=progress)
  conf = {"trace": path, "kernel": cfg.kernel, "runs_every": cfg.runs_every}
  return SimResult(conf, device_name(), versions(), results, mode="trace")


_SYNTHETIC_ONLY = ("prefix cache hits", "pool reserved peak (in use + promised)",
                   "running requests mean", "sim time (iterations)", "pages allocated",
                   "wall time per step (us)")


def summary_rows(result: SimResult) -> List[Tuple[str, List[str]]]:
  """(metric, one value per page size) rows of the results table."""
  rs = result.results

  def row(name, fn):
    return (name, [fn(r) for r in rs])

  rows = [
      row("page_size", lambda r: str(r.page_size)),
      row("pages in pool", lambda r: f"{r.num_pages}"),
      row("steps (prefill/decode)",
          lambda r: f"{r.steps} ({r.prefill_steps}/{r.decode_steps})"),
      row("requests done", lambda r: f"{r.requests_done}"),
      row("prefix cache hits", lambda r: f"{r.prefix_hits}"),
      row("tokens allocated", lambda r: f"{r.tokens_allocated}"),
      row("pages allocated", lambda r: f"{r.pages_allocated}"),
      row("allocation failures", lambda r: f"{r.alloc_failures}"),
      row("pool usage peak", lambda r: f"{100 * r.peak_usage:.1f}%"),
      row("pool usage mean", lambda r: f"{100 * r.mean_usage:.1f}%"),
      row("pool reserved peak (in use + promised)",
          lambda r: f"{100 * r.peak_reserved:.1f}%"),
      row("running requests mean", lambda r: f"{r.mean_running:.1f}"),
      row("unused slots in pages (mean)", lambda r: f"{100 * r.waste_mean:.2f}%"),
      row("unused slots in pages (peak)", lambda r: f"{r.waste_peak_slots}"),
      row("free-list runs (mean/final)", lambda r: f"{r.runs_mean:.0f} / {r.runs_final}"),
      row("step time p50 (us)", lambda r: f"{r.step_us_p50:.0f}"),
      row("step time p99 (us)", lambda r: f"{r.step_us_p99:.0f}"),
      row("wall time per step (us)", lambda r: f"{r.step_wall_us:.1f}"),
      row("launch time per step p50 / p99 (us)",
          lambda r: f"{r.step_us_p50:.0f} / {r.step_us_p99:.0f}"),
      row("steps per host round trip", lambda r: f"{r.steps / max(r.calls, 1):.0f} "
          f"({r.calls} calls of up to {r.steps_per_call})"),
      row("sim time (iterations)", lambda r: f"{r.sim_time}"),
      row("wall time (s), compile (s)", lambda r: f"{r.wall_s:.2f}, {r.compile_s:.1f}"),
      row("leak check", lambda r: r.leak_check),
  ]
  if result.mode == "synthetic":
    drop = {"step time p50 (us)", "step time p99 (us)"}
    drop.add("steps per host round trip" if result.results and
             result.results[0].driver == "host" else "launch time per step p50 / p99 (us)")
    rows = [r for r in rows if r[0] not in drop]
  if rs and rs[0].swa_window:
    at = [n for n, _ in rows].index("pool reserved peak (in use + promised)")
    rows[at:at] = [
        row("SWA window (tokens), SWA pool (pages)",
            lambda r: f"{r.swa_window}, {r.swa_num_pages}"),
        row("full pool used pages peak / mean",
            lambda r: f"{r.full_peak_pages} / {r.full_mean_pages:.0f}"),
        row("SWA pool usage peak", lambda r: f"{100 * r.swa_peak_usage:.1f}%"),
        row("SWA pool usage mean", lambda r: f"{100 * r.swa_mean_usage:.1f}%"),
        row("SWA pool used pages peak / mean",
            lambda r: f"{r.swa_peak_pages} / {r.swa_mean_pages:.0f}"),
        row("SWA pages freed by the window", lambda r: f"{r.window_frees}"),
        row("admission stopped by full / SWA pool (steps)",
            lambda r: f"{r.refused_full} / {r.refused_swa}"),
    ]
  if result.mode == "trace":
    rows = [r for r in rows if r[0] not in _SYNTHETIC_ONLY]
    rename = {"steps (prefill/decode)": "ops (extend+alloc/decode)",
              "requests done": "traces replayed", "step time p50 (us)": "op time p50 (us)",
              "step time p99 (us)": "op time p99 (us)"}
    rows = [(rename.get(n, n), v) for n, v in rows
            if n not in ("launch time per step p50 / p99 (us)", "steps per host round trip")]
  return rows


def to_json(result: SimResult, *, series: bool = True) -> Dict[str, Any]:
  d = dataclasses.asdict(result)
  swa = bool(d["config"].get("swa_window"))
  if not swa:  # without an SWA pool, the JSON of before SWA mode existed
    for k in ("swa_window", "swa_ratio"):
      d["config"].pop(k, None)
  for r in d["results"]:
    recs = r.pop("records")
    if series and recs is not None:
      r["records"] = {"columns": list(steps.record_columns(swa)),
                      "rows": np.asarray(recs).tolist()}
    if not swa:
      for k in SWA_FIELDS:
        r.pop(k)
    if not series:
      for k in ("usage", "step_us", "step_kind", "free_list_final", "release_list_final") + (
          ("swa_usage",) if swa else ()):
        r.pop(k)
  return d


def plot(result: SimResult, path: str) -> None:
  """Pool usage over time and the per-step time distribution, one line per page size."""
  from jax_kvalloc.tools.report import pyplot  # pylint: disable=g-import-not-at-top
  plt = pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
  for r in result.results:
    line, = ax1.plot(np.arange(1, len(r.usage) + 1), 100 * np.asarray(r.usage), lw=1,
                     label=f"page_size={r.page_size}" + (" full" if r.swa_window else ""))
    if r.swa_window:
      ax1.plot(np.arange(1, len(r.swa_usage) + 1), 100 * np.asarray(r.swa_usage), lw=1,
               ls="--", color=line.get_color(), label=f"page_size={r.page_size} SWA")
    t = np.sort(np.asarray(r.step_us))
    if t.size:
      ax2.plot(t, np.arange(1, t.size + 1) / t.size, lw=1, label=f"page_size={r.page_size}")
  ax1.set(xlabel="step", ylabel="pool usage (%)", title="Pool usage over time",
          ylim=(0, 105))
  what = ("wall time per step of its call" if result.results and
          result.results[0].driver == "device" else "launch time")
  ax2.set(xlabel=f"{what} (us, log)", ylabel="fraction of steps",
          title="Per-step time (CDF)", xscale="log")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"jax-kvalloc simulate on {result.device}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
