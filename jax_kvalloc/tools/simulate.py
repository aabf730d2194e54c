"""`jax-kvalloc simulate`: a serving workload driven through the allocator.

Requests arrive (jax_kvalloc.workload), share prefixes through a small prefix cache,
prefill in chunked batches, decode one token per step, finish and are freed, all on the
default JAX device. The device half of each scheduler iteration is one jitted call
(jax_kvalloc.tools.simulate_steps); this module is the host half: a scheduler that, like
SGLang's, runs a prefill batch whenever requests can be admitted and a decode batch
otherwise, and frees each iteration's finished requests and evicted cache entries in one
free group.

Admission control is exact: the host mirrors the pool's page count with the same
arithmetic the allocator uses (ceil(seq/ps) - ceil(pre/ps) new pages per request) and
admits a request only when its whole lifetime, prompt plus output, fits in the free pages
not yet promised to running requests (evicting unused cached prefixes, least recently
used first, when that helps). So no allocation may fail, and the host never waits for
the device to learn that: each step's status (ok, the device's page count) is checked
against the mirror STATUS_LAG steps later, when the device has long finished it, so the
host keeps launching steps ahead of the device (the free-list census, `runs`, is read at
the end for the same reason). The run ends with every remaining status checked and a
leak check that the free list, the release list and the pages still held partition the
pool exactly.

Run once per page size on the same requests, it answers the seed write-up's question:
what a larger page costs in slots allocated but unused inside pages (internal
fragmentation) against what it saves in management (free-list entries, per-step time).
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import jax
import numpy as np

from jax_kvalloc.tools import simulate_steps as steps
from jax_kvalloc import state as st
from jax_kvalloc.buckets import bucket
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.tools.workload import Workload, make_workload

EMPTY, PREFILL, DECODE, FREEING = 0, 1, 2, 3
# Steps between launching a step and reading its status: by then the device has run it,
# so the read does not wait (a read of the newest status would, every step).
STATUS_LAG = 8


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
  inject_leak: bool = False  # test hook: the first finished request's free is dropped

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
  step_us_p50: float = 0.0       # host time to launch a step (no wait: see STATUS_LAG)
  step_us_p99: float = 0.0
  step_wall_us: float = 0.0      # wall time / steps: the throughput, device included
  prefill_us_p50: float = 0.0
  decode_us_p50: float = 0.0
  compile_s: float = 0.0
  wall_s: float = 0.0
  leak_check: str = "not run"
  usage: List[float] = dataclasses.field(default_factory=list, repr=False)
  step_us: List[float] = dataclasses.field(default_factory=list, repr=False)
  step_kind: List[str] = dataclasses.field(default_factory=list, repr=False)



def _pct(x: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else 0.0


class _Simulation:
  """One page size: host scheduler state plus the device state and token table."""

  def __init__(self, cfg: SimConfig, wl: Workload, page_size: int, progress: bool):
    self.cfg, self.wl, self.ps = cfg, wl, page_size
    kind = "token" if page_size == 1 else "paged"
    self.acfg = AllocatorConfig(size=cfg.pool_size, page_size=page_size,
                                need_sort=cfg.need_sort, kind=kind, kernel=cfg.kernel)
    self.num_pages = self.acfg.num_pages
    self.res = PageSizeResult(page_size, self.num_pages, cfg.kernel)
    self.progress = progress
    # A lax.cond skips empty copies/free groups on CPU; on GPU reading its predicate
    # back costs more than the work it skips.
    self.skip_empty = jax.default_backend() == "cpu"
    r = self.R = bucket(cfg.max_running, 1)
    g = self.G = max(cfg.num_prefixes, 1)
    self.B = bucket(cfg.max_prefill_reqs, 1)
    self.T = bucket(cfg.max_prefill_tokens, 1)
    self.F = max(cfg.max_frees, 1)
    self.ctx = cdiv(max(wl.max_context, 1), 64) * 64
    longest_prefix = int(wl.prefix_len.max()) if wl.prefix_len.size else 1
    self.copy_width = cdiv(max(longest_prefix, 1), 64) * 64
    need = cdiv(wl.prompt + wl.output, page_size)
    if need.size and int(need.max()) > self.num_pages:
      i = int(np.argmax(need))
      raise ValueError(
          f"request {i} needs {int(need[i])} pages ({int(wl.prompt[i] + wl.output[i])} "
          f"tokens) at page_size={page_size}, but the pool has only {self.num_pages}; "
          f"raise --pool-size or shorten the length distributions")
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
    # Prefix cache, one entry per group; its tokens live in table row R + g.
    self.cache_tokens = np.zeros(g, np.int64)
    self.refcount = np.zeros(g, np.int64)
    self.last_used = np.full(g, -1, np.int64)
    self.free_pages = self.num_pages       # mirror of free_len + release_len
    self.pending_free: collections.deque = collections.deque()  # (row, start, end, pages)
    self.pending_copy_out: List[Tuple[int, int, int]] = []
    self.leak_injected = False

  # -- accounting ---------------------------------------------------------------------
  def held(self) -> np.ndarray:
    """Pages each row holds of its own."""
    live = self.phase != EMPTY
    return np.where(live, cdiv(self.seq, self.ps) - self.own // self.ps, 0)

  def committed(self) -> int:
    """Pages promised to running requests but not yet taken."""
    live = (self.phase == PREFILL) | (self.phase == DECODE)
    return int(np.sum(np.where(live, self.reserved - self.held(), 0)))

  # -- planning -----------------------------------------------------------------------
  def _evict_for(self, need: int, avail: int, keep: int, frees: list) -> int:
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
      frees.append((self.R + h, 0, int(self.cache_tokens[h]), p))
      self.cache_tokens[h] = 0
      avail += p
      self.free_pages += p
    return avail

  def plan_prefill(self, waiting: collections.deque, frees: list, clock: int):
    """A prefill batch [(row, pre, seq)] plus copy-ins, admitting from `waiting`."""
    batch, copy_in = [], []
    budget = self.T
    avail = self.free_pages - self.committed()
    rows = np.flatnonzero(self.phase == PREFILL)
    for r in rows[np.argsort(self.admitted_at[rows], kind="stable")]:
      if len(batch) == self.B or budget == 0:
        break
      chunk = int(min(self.prompt[r] - self.seq[r], budget))
      batch.append((int(r), int(self.seq[r]), int(self.seq[r]) + chunk))
      budget -= chunk
    while waiting and len(batch) < self.B and budget > 0:
      empty = np.flatnonzero(self.phase == EMPTY)
      if not empty.size:
        break
      q = waiting[0]
      g = int(self.wl.group[q])
      hit = g >= 0 and self.cache_tokens[g] > 0
      pre0 = int(self.cache_tokens[g]) if hit else 0
      total = int(self.wl.prompt[q] + self.wl.output[q])
      need = cdiv(total, self.ps) - pre0 // self.ps
      if need > avail:
        avail = self._evict_for(need, avail, g, frees)
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
        self.res.prefix_hits += 1
        copy_in.append((self.R + g, r, pre0))
      chunk = int(min(self.prompt[r] - pre0, budget))
      batch.append((r, pre0, pre0 + chunk))
      budget -= chunk
    return batch, copy_in

  def pop_frees(self) -> list:
    frees = []
    while self.pending_free and len(frees) < self.F:
      row, start, end, pages = self.pending_free.popleft()
      frees.append((row, start, end, pages))
      self.free_pages += pages
      if row < self.R:
        self.phase[row] = EMPTY
        self.req[row] = -1
    return frees

  # -- device calls -------------------------------------------------------------------
  def _copies(self, entries) -> np.ndarray:
    c = np.zeros((3, self.B), np.int32)
    for i, e in enumerate(entries):
      c[:, i] = e
    return c

  def _frees(self, entries) -> np.ndarray:
    f = np.zeros((3, self.F), np.int32)
    for i, (row, start, end, _) in enumerate(entries):
      f[:, i] = (row, start, end)
    return f

  def _batch(self, rows, pre, seq, size) -> np.ndarray:
    """rows, pre, seq padded to `size`, then the number of real rows."""
    b = np.zeros(3 * size + 1, np.int32)
    n = len(rows)
    b[:n], b[size:size + n], b[2 * size:2 * size + n], b[-1] = rows, pre, seq, n
    return b

  def _run(self, fn, *parts, **kw) -> Tuple[Any, float]:
    """Launches one step; returns its status (i32[2] device array: ok, free + released
    pages), unread, and the host time the launch took (us)."""
    packed = steps.pack(*parts)
    t0 = time.perf_counter()
    self.state, self.table, status = fn(self.acfg, self.state, self.table, packed,
                                        copy_width=self.copy_width,
                                        skip_empty=self.skip_empty, **kw)
    return status, (time.perf_counter() - t0) * 1e6

  def _expect(self, status, pages_after: int) -> None:
    """Queues a step's status for the lagged check (the step is assumed to succeed:
    admission control makes every allocation fit)."""
    self.pending_status.append((self.res.steps, pages_after, status))
    self._check_statuses(STATUS_LAG)

  def _check_statuses(self, lag: int) -> None:
    """Checks the queued statuses older than `lag` steps (0: all; waits for them)."""
    while len(self.pending_status) > lag:
      step, pages_after, status = self.pending_status.popleft()
      ok, pages = (int(v) for v in np.asarray(status))
      if not ok:
        raise LeakCheckError(
            f"allocation failed at step {step} (page_size={self.ps}) although admission "
            f"control had reserved its pages ({pages} free + released on the device)")
      self._check_pages(step, pages, pages_after)

  def _prefill_call(self, copy_out, frees, copy_in, batch) -> Tuple[Any, float]:
    return self._run(steps.prefill_step, self._copies(copy_out), self._frees(frees),
                     self._copies(copy_in), batch, max_tokens=self.T,
                     sizes=(self.B, self.F, self.B))

  def _decode_call(self, copy_out, frees, batch) -> Tuple[Any, float]:
    return self._run(steps.decode_step, self._copies(copy_out), self._frees(frees), batch,
                     sizes=(self.B, self.F, self.R))

  def _check_pages(self, step: int, device_pages: int, expected: int) -> None:
    if device_pages != expected:
      raise LeakCheckError(
          f"leak check failed at step {step} (page_size={self.ps}): the device has "
          f"{device_pages} free + released pages, the scheduler's accounting expects "
          f"{expected} (difference {device_pages - expected})")

  def warm_up(self) -> None:
    """Compiles both step functions on all-padding inputs (the state is unchanged)."""
    t0 = time.perf_counter()
    self.state = jax.jit(st.init, static_argnums=0)(self.acfg)
    self.table = jax.numpy.zeros((self.R + self.G, self.ctx), jax.numpy.int32)
    s1, _ = self._prefill_call([], [], [], self._batch([], [], [], self.B))
    s2, _ = self._decode_call([], [], self._batch([], [], [], self.R))
    (ok1, p1), (ok2, p2) = np.asarray(s1).tolist(), np.asarray(s2).tolist()
    self.pending_status = collections.deque()
    if not (ok1 and ok2 and p1 == p2 == self.num_pages):
      raise RuntimeError(f"warm-up changed the pool: ok={ok1, ok2}, pages={p1, p2}")
    jax.block_until_ready(steps.free_list_runs(self.state))
    self.res.compile_s = time.perf_counter() - t0

  # -- the loop -----------------------------------------------------------------------
  def run(self) -> PageSizeResult:
    import tqdm  # pylint: disable=g-import-not-at-top
    cfg, wl, res, ps = self.cfg, self.wl, self.res, self.ps
    n = wl.num_requests
    bar = tqdm.tqdm(total=n, desc=f"page_size={ps} (compiling)", unit="req",
                    disable=not self.progress, file=sys.stderr, dynamic_ncols=True,
                    leave=False)
    self.warm_up()
    bar.set_description(f"page_size={ps}")
    t_start = time.perf_counter()
    waiting: collections.deque = collections.deque()
    nxt, clock, runs = 0, 0, []
    waste, running = [], []
    while res.requests_done < n or self.pending_free or self.pending_copy_out:
      if res.steps >= cfg.max_steps:
        raise RuntimeError(f"no progress after {res.steps} steps (page_size={ps}); "
                           f"waiting={len(waiting)}")
      while nxt < n and wl.arrival[nxt] <= clock:
        waiting.append(nxt)
        nxt += 1
      frees = self.pop_frees()
      batch, copy_in = self.plan_prefill(waiting, frees, clock) if waiting or (
          self.phase == PREFILL).any() else ([], [])
      copy_out, self.pending_copy_out = self.pending_copy_out, []
      decoding = np.flatnonzero(self.phase == DECODE)
      if batch:
        ok = self._prefill(batch, copy_out, frees, copy_in)
      elif decoding.size or frees or copy_out:
        ok = self._decode(decoding, copy_out, frees, bar)
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
      res.alloc_failures += 0 if ok else 1
      used = self.num_pages - self.free_pages
      res.usage.append(used / self.num_pages)
      held = self.held()
      live = self.phase != EMPTY
      w = int(np.sum(np.where(live, held * ps - (self.seq - self.own), 0)))
      waste.append((w, max(used * ps, 1)))
      running.append(int(np.sum(live)))
      res.peak_reserved = max(res.peak_reserved,
                              (used + self.committed()) / self.num_pages)
      if res.steps % cfg.runs_every == 0:
        runs.append(steps.free_list_runs(self.state))  # read at the end: no wait here
    self._check_statuses(0)
    bar.close()
    res.wall_s = time.perf_counter() - t_start
    res.sim_time = clock
    res.runs_final = int(steps.free_list_runs(self.state))
    runs = [int(r) for r in runs] + [res.runs_final]
    res.runs_mean = float(np.mean(runs))
    res.peak_usage = max(res.usage, default=0.0)
    res.mean_usage = float(np.mean(res.usage)) if res.usage else 0.0
    res.mean_running = float(np.mean(running)) if running else 0.0
    if waste:
      wa = np.asarray(waste, np.float64)
      res.waste_mean = float(np.mean(wa[:, 0] / wa[:, 1]))
      res.waste_peak_slots = int(wa[:, 0].max())
    res.step_us_p50, res.step_us_p99 = _pct(res.step_us, 50), _pct(res.step_us, 99)
    res.step_wall_us = res.wall_s * 1e6 / max(res.steps, 1)
    kinds = np.asarray(res.step_kind)
    times = np.asarray(res.step_us)
    res.prefill_us_p50 = _pct(times[kinds == "prefill"], 50)
    res.decode_us_p50 = _pct(times[kinds == "decode"], 50)
    self.final_leak_check()
    return res

  def _prefill(self, batch, copy_out, frees, copy_in) -> bool:
    rows, pre, seq = (np.array(c, np.int64) for c in zip(*batch))
    pages = int(np.sum(steps.new_pages(pre, seq, self.ps)))
    status, us = self._prefill_call(copy_out, frees, copy_in,
                                    self._batch(rows, pre, seq, self.B))
    self.res.step_us.append(us)
    self.res.step_kind.append("prefill")
    self.free_pages -= pages
    self._expect(status, self.free_pages)
    self.res.prefill_steps += 1
    self.res.tokens_allocated += int(np.sum(seq - pre))
    self.res.pages_allocated += pages
    self.seq[rows] = seq
    for r in rows[seq == self.prompt[rows]]:
      self.phase[r] = DECODE
      self._maybe_insert(int(r))
    return True

  def _maybe_insert(self, r: int) -> None:
    """Hands the whole pages of a freshly prefilled shared prefix to the cache."""
    g = int(self.group[r])
    if g < 0 or self.hit[r] or self.cache_tokens[g] > 0 or self.own[r] != 0:
      return
    aligned = int(self.wl.prefix_len[g]) // self.ps * self.ps
    if aligned == 0:
      return
    self.cache_tokens[g] = aligned
    self.own[r] = aligned
    self.reserved[r] -= aligned // self.ps
    self.hit[r] = True
    self.refcount[g] = 1
    self.last_used[g] = self.admitted_at[r]
    self.pending_copy_out.append((r, self.R + g, aligned))

  def _decode(self, rows, copy_out, frees, bar) -> bool:
    seq = self.seq[rows] + 1
    pages = int(np.sum(steps.new_pages(self.seq[rows], seq, self.ps)))
    status, us = self._decode_call(copy_out, frees,
                                   self._batch(rows, seq - 1, seq, self.R))
    self.res.step_us.append(us)
    self.res.step_kind.append("decode")
    self.free_pages -= pages
    self._expect(status, self.free_pages)
    self.res.decode_steps += 1
    self.res.tokens_allocated += int(rows.size)
    self.res.pages_allocated += pages
    self.seq[rows] = seq
    self.gen[rows] += 1
    done = rows[self.gen[rows] >= self.out[rows]]
    for r in done:
      r = int(r)
      self.phase[r] = FREEING
      if self.hit[r]:
        self.refcount[self.group[r]] -= 1
      start, end = int(self.own[r]), int(self.seq[r])
      pages_held = cdiv(end, self.ps) - start // self.ps
      if self.cfg.inject_leak and not self.leak_injected:
        self.leak_injected = True
        end = start  # the scheduler "forgets" to free this request's pages
      self.pending_free.append((r, start, end, pages_held))
    self.res.requests_done += int(done.size)
    if done.size:
      bar.update(int(done.size))
    return True

  def final_leak_check(self) -> None:
    """free + released + held by the prefix cache must be exactly pages 1..num_pages."""
    ps, res = self.ps, self.res
    free = st.live_free_pages(self.state)
    release = st.live_release_pages(self.state)
    table = np.asarray(self.table[self.R:self.R + self.G])
    held = []
    for g in np.flatnonzero(self.cache_tokens > 0):
      row = table[g, :int(self.cache_tokens[g])]
      base = row[::ps]
      if not np.array_equal(row, np.repeat(base, ps)[:row.size]
                            + np.tile(np.arange(ps), base.size)[:row.size]):
        raise LeakCheckError(f"cache entry {g} (page_size={ps}) is not made of whole "
                             f"pages: {row[:2 * ps]}...")
      held.append(base // ps)
    held = np.concatenate(held) if held else np.zeros(0, np.int64)
    everything = np.concatenate([free, release, held]).astype(np.int64)
    res.free_pages_final = int(free.size + release.size)
    res.in_use_final = int(held.size)
    total = res.free_pages_final + res.in_use_final
    uniq = np.unique(everything)
    expected = np.arange(1, self.num_pages + 1)
    if total != self.num_pages or not np.array_equal(uniq, expected):
      missing = np.setdiff1d(expected, uniq).size
      dup = everything.size - uniq.size
      res.leak_check = "FAILED"
      raise LeakCheckError(
          f"leak check failed (page_size={ps}): free {res.free_pages_final} + in use "
          f"{res.in_use_final} = {total} != total {self.num_pages} pages; "
          f"{missing} pages missing, {dup} held twice")
    res.leak_check = (f"ok: free {res.free_pages_final} + in use {res.in_use_final} "
                      f"== {self.num_pages}")


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
  wl = cfg.workload()
  out = []
  for ps in cfg.page_sizes:
    out.append(_Simulation(cfg, wl, int(ps), progress).run())
  return SimResult(dataclasses.asdict(cfg), device_name(), versions(), out)


def run_trace(cfg: SimConfig, path: str, *, progress: bool = True) -> SimResult:
  """Replays the traces in `path` (jax_kvalloc.traces format), one result per page size."""
  from jax_kvalloc.tools import simulate_trace  # pylint: disable=g-import-not-at-top
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
      row("wall time per step (us)", lambda r: f"{r.step_wall_us:.0f}"),
      row("prefill / decode p50 (us)",
          lambda r: f"{r.prefill_us_p50:.0f} / {r.decode_us_p50:.0f}"),
      row("sim time (iterations)", lambda r: f"{r.sim_time}"),
      row("wall time (s), compile (s)", lambda r: f"{r.wall_s:.1f}, {r.compile_s:.1f}"),
      row("leak check", lambda r: r.leak_check),
  ]
  if result.mode == "trace":
    rows = [r for r in rows if r[0] not in _SYNTHETIC_ONLY]
    rename = {"steps (prefill/decode)": "ops (extend+alloc/decode)",
              "requests done": "traces replayed", "step time p50 (us)": "op time p50 (us)",
              "step time p99 (us)": "op time p99 (us)"}
    rows = [(rename.get(n, n), v) for n, v in rows
            if n != "prefill / decode p50 (us)"]
  return rows


def to_json(result: SimResult, *, series: bool = True) -> Dict[str, Any]:
  d = dataclasses.asdict(result)
  if not series:
    for r in d["results"]:
      for k in ("usage", "step_us", "step_kind"):
        r.pop(k)
  return d


def plot(result: SimResult, path: str) -> None:
  """Pool usage over time and the per-step time distribution, one line per page size."""
  from jax_kvalloc.tools.report import pyplot  # pylint: disable=g-import-not-at-top
  plt = pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
  for r in result.results:
    ax1.plot(np.arange(1, len(r.usage) + 1), 100 * np.asarray(r.usage), lw=1,
             label=f"page_size={r.page_size}")
    t = np.sort(np.asarray(r.step_us))
    if t.size:
      ax2.plot(t, np.arange(1, t.size + 1) / t.size, lw=1, label=f"page_size={r.page_size}")
  ax1.set(xlabel="step", ylabel="pool usage (%)", title="Pool usage over time",
          ylim=(0, 105))
  ax2.set(xlabel="step time (us, log)", ylabel="fraction of steps",
          title="Per-step time (CDF)", xscale="log")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"jax-kvalloc simulate on {result.device}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
