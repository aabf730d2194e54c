"""`jax-kvalloc simulate`: a serving workload driven through the allocator.

Requests (jax_kvalloc.tools.workload) run through the request table (SPEC 11) on the
default JAX device, once per page size on the same requests, under the policy of
jax_kvalloc.tools.simulate_step (its docstring: the scheduler, the two drivers, SWA mode).
Here: the drivers' host loops (`--driver device` reads each call's records while the next
runs; `--driver host` reads a step's record STATUS_LAG calls later, so the host never
waits for the device), the checks (every step's device page count against the
scheduler's; at the end, free + released + what the prefix cache holds partition each
pool exactly) and the results: what a larger page costs in slots allocated but unused
inside pages, against what it saves in management (free-list entries, per-step time).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import guard
from jax_kvalloc import kernels
from jax_kvalloc import state as st
from jax_kvalloc import swa as swa_core
from jax_kvalloc.buckets import bucket
from jax_kvalloc.config import INT32_MAX, KERNELS, AllocatorConfig
from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.swa import SWAConfig
from jax_kvalloc.tools import simulate_step as sstep
from jax_kvalloc.tools.cli import UsageError
from jax_kvalloc.tools.simulate_step import COL, Layout, record_columns
from jax_kvalloc.tools.workload import ARRIVALS, FORMS, Workload, make_workload, parse_dist

DRIVERS = ("device", "host")
STATUS_LAG = 8  # host driver: calls between launching a step and reading its record


class LeakCheckError(RuntimeError):
  """The pool's pages are not where the scheduler's accounting says they are."""


class SimConfigError(UsageError, ValueError):
  """A setting the simulator cannot run; the message names the command-line option."""


def _opt(default: Any, text: str) -> Any:
  """A SimConfig field that is the option `--field-name` of `jax-kvalloc simulate`."""
  return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """Everything a simulation run depends on (see `jax-kvalloc simulate --help`)."""
  num_requests: int = _opt(600, "requests in the workload")
  pool_size: int = _opt(32768, "usable KV slots in the pool")
  page_sizes: Tuple[int, ...] = (1, 16, 64)
  need_sort: bool = False
  arrival: str = _opt("poisson", "arrival pattern")
  rate: float = _opt(2.0, "requests per step, poisson and uniform arrivals")
  prompt_len: str = _opt("lognormal:256:0.8:2048", "prompt tokens after the shared prefix")
  output_len: str = _opt("uniform:16:320", "generated tokens per request")
  num_prefixes: int = _opt(8, "shared-prefix groups (system prompts); 0: no sharing")
  prefix_len: str = _opt("uniform:64:1024", "tokens of each shared prefix")
  share_prob: float = _opt(0.5, "probability that a request starts with a shared prefix")
  max_running: int = _opt(128, "request rows, the largest decode batch")
  max_prefill_tokens: int = _opt(4096, "tokens per prefill batch; longer prompts are "
                                 "chunked")
  max_prefill_reqs: int = _opt(16, "requests per prefill batch")
  max_frees: int = _opt(16, "rows freed per free group")
  seed: int = _opt(0, "seed of the workload's random draws")
  kernel: str = _opt("auto", "implementations (jax_kvalloc.kernels; auto: Triton on GPU, "
                     "Mosaic on TPU, jnp on CPU)")
  runs_every: int = 16         # free-list census every this many iterations
  max_steps: int = 1_000_000   # a run that needs more steps fails
  driver: str = _opt("device", "device: the scheduler's loop runs on the device, "
                     "--steps-per-call steps per host round trip; host: one jitted call "
                     "per step from Python")
  steps_per_call: int = _opt(256, "scheduler iterations per call of the device driver, "
                             "rounded up to a multiple of 16")
  swa_window: int = _opt(0, "tokens of a sliding window: run on the SWA allocator (a "
                         "full pool and an SWA pool; each step frees the SWA pages that "
                         "left the window; page sizes > 1, no prefix sharing); 0: off")
  swa_ratio: float = _opt(0.25, "with --swa-window: SWA pool slots = this * --pool-size, "
                          "in whole pages")
  guard: bool = True           # the pools' ownership record (SPEC 14); False: dropped
  plan_kernel: bool = True     # the plan as one Triton program with Triton pools (Layout)

  def workload(self) -> Workload:
    return make_workload(num_requests=self.num_requests, arrival=self.arrival,
                         rate=self.rate, prompt_len=self.prompt_len,
                         output_len=self.output_len, num_prefixes=self.num_prefixes,
                         prefix_len=self.prefix_len, share_prob=self.share_prob,
                         seed=self.seed)


def _is_dist(spec) -> bool:
  try:
    parse_dist(spec)
  except ValueError:
    return False
  return True


def _ints(lo: int):
  return (lambda v: not isinstance(v, bool) and isinstance(v, (int, np.integer))
          and lo <= v <= INT32_MAX), f"an integer in [{lo}, {INT32_MAX}]"


# Each setting's rule: (test, what is allowed); the option is the field's name as
# `--field-name` (the CLI's argparse types and check_config use the same rules).
RULES = {
    **{f: _ints(1) for f in ("num_requests", "pool_size", "max_running",
                             "max_prefill_tokens", "max_prefill_reqs", "max_frees",
                             "steps_per_call", "runs_every", "max_steps")},
    **{f: _ints(0) for f in ("num_prefixes", "seed", "swa_window")},
    **{f: (_is_dist, f"a length distribution: {FORMS}")
       for f in ("prompt_len", "output_len", "prefix_len")},
    "rate": (lambda v: v > 0, "a number > 0"),
    "share_prob": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "swa_ratio": (lambda v: v > 0, "a number > 0 (SWA pool slots / --pool-size)"),
    "arrival": (lambda v: v in ARRIVALS, f"one of {', '.join(ARRIVALS)}"),
    "driver": (lambda v: v in DRIVERS, f"one of {', '.join(DRIVERS)}"),
    "kernel": (lambda v: v in KERNELS, f"one of {', '.join(KERNELS)}"),
}


def option(field: str) -> str:
  return "--" + field.replace("_", "-")


def check_config(cfg: SimConfig) -> None:
  """SimConfigError naming the option for a setting out of range, or a run whose memory
  would exceed this machine's."""
  for field, (test, allowed) in RULES.items():
    v = getattr(cfg, field)
    if not (field == "swa_ratio" and not cfg.swa_window) and not test(v):
      raise SimConfigError(option(field), f"must be {allowed}, got {v!r}")
  if not cfg.page_sizes or not all(_ints(1)[0](p) and p <= cfg.pool_size
                                   for p in cfg.page_sizes):
    raise SimConfigError("--page-size", f"must be integers in [1, --pool-size "
                         f"{cfg.pool_size}], got {list(cfg.page_sizes)}")
  if cfg.swa_window and not [p for p in cfg.page_sizes if p > 1]:
    raise SimConfigError("--swa-window", f"needs a page size > 1 (SGLang's SWA alloc_extend "
                         f"asserts page_size > 1), got --page-size {list(cfg.page_sizes)}")
  per_request, pools = memory_estimate(cfg)
  have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  gb = lambda x: f"{x / 2**30:.1f} GB"
  if pools > 0.4 * have:
    raise SimConfigError("--pool-size", f"{cfg.pool_size} (with the length distributions' "
                         f"longest request) needs about {gb(pools)} of memory for the "
                         f"pools and tables; this machine has {gb(have)}")
  if per_request * cfg.num_requests + pools > 0.8 * have:
    raise SimConfigError("--num-requests", f"{cfg.num_requests} needs about "
                         f"{gb(per_request * cfg.num_requests + pools)} of memory; this "
                         f"machine has {gb(have)}: use at most about "
                         f"{int((0.8 * have - pools) / per_request)}")


def memory_estimate(cfg: SimConfig) -> Tuple[float, float]:
  """(bytes per request: the workload and its steps' records; bytes of every page size's
  pool, table and step temporaries), from the distributions' means and bounds."""
  rng = np.random.default_rng(0)
  mean = lambda spec: float(parse_dist(spec).sample(rng, 4096).mean())
  out = mean(cfg.output_len)
  length = mean(cfg.prompt_len) + out + (
      cfg.share_prob * mean(cfg.prefix_len) if cfg.num_prefixes else 0)
  running = max(1.0, min(cfg.max_running, cfg.pool_size / length))
  per_request = 200 + 1000 * (out / running + 1)  # ~1 KB a step: records, series, JSON
  longest = sum(parse_dist(d).hi for d in (cfg.prompt_len, cfg.output_len, cfg.prefix_len))
  rows = cfg.max_running + cfg.num_prefixes
  pools = sum(64.0 * cdiv(cfg.pool_size, p) + 16.0 * rows * cdiv(longest, p)
              for p in cfg.page_sizes)
  return per_request, pools


class Metric(NamedTuple):
  """A field of PageSizeResult. `compute(cols, result)` gives it from the step records
  (cols: record column -> i64[steps]; the metrics above it already set); None where the
  driver, the leak check or a trace replay sets it. `rows`: the table rows it prints,
  each (label, a str.format of its value `{}` and of the result `{r.field}`, or a
  function of the result[, the runs that show it: synthetic, trace, device, host or swa;
  default every run]). `json`: the JSON keeps it always (""), in SWA mode only ("swa"),
  with the per-step series only ("series")."""
  key: str
  default: Any
  compute: Optional[Callable[[Dict[str, np.ndarray], Any], Any]]
  rows: Tuple[Tuple[Any, ...], ...]
  json: str


def _m(key: str, default: Any, compute=None, *rows, json: str = "") -> Metric:
  return Metric(key, default, compute, rows, json)


def _mean(x: np.ndarray):
  return x.mean() if x.size else 0.0


def _sum(col: str, bit: int = 0):
  """A column's total; with `bit`, the steps whose value has that bit."""
  return lambda c, r: np.sum((c[col] & bit) != 0) if bit else np.sum(c[col])


SYN, TRACE, SWA = "synthetic", "trace", "swa"
_STEPS = "{r.steps} ({r.prefill_steps}/{r.decode_steps})"
_ROUND_TRIP = lambda r: (f"{r.steps / max(r.calls, 1):.0f} ({r.calls} calls of up to "
                         f"{r.steps_per_call})")
_swa_share = lambda key: lambda c, r: getattr(r, key) / max(r.swa_num_pages, 1)

# Usage and waste are fractions; usage is pages in use / num_pages after each step.
METRICS = (
    _m("page_size", dataclasses.MISSING, None, ("page_size", "{}")),
    _m("num_pages", dataclasses.MISSING, None, ("pages in pool", "{}")),
    _m("kernel", dataclasses.MISSING),
    _m("driver", "device"),
    _m("steps", 0, lambda c, r: c["kind"].size, ("steps (prefill/decode)", _STEPS, SYN),
       ("ops (extend+alloc/decode)", _STEPS, TRACE)),
    _m("prefill_steps", 0, lambda c, r: np.sum(c["kind"] == sstep.KIND_PREFILL)),
    _m("decode_steps", 0, lambda c, r: np.sum(c["kind"] == sstep.KIND_DECODE)),
    _m("requests_done", 0, None, ("requests done", "{}", SYN),
       ("traces replayed", "{}", TRACE)),
    _m("prefix_hits", 0, _sum("hits"), ("prefix cache hits", "{}", SYN)),
    _m("evictions", 0, _sum("evicted")),
    _m("tokens_allocated", 0, _sum("tokens"), ("tokens allocated", "{}")),
    _m("pages_allocated", 0, _sum("pages"), ("pages allocated", "{}", SYN)),
    _m("alloc_failures", 0, lambda c, r: np.sum(c["ok"] == 0),
       ("allocation failures", "{}")),
    _m("peak_usage", 0.0, lambda c, r: np.max(c["used"], initial=0) / r.num_pages,
       ("pool usage peak", "{:.1%}")),
    _m("mean_usage", 0.0, lambda c, r: _mean(c["used"]) / r.num_pages,
       ("pool usage mean", "{:.1%}")),
    # SWA mode: both pools, in pages.
    _m("swa_window", 0, None, ("SWA window (tokens), SWA pool (pages)",
                               "{}, {r.swa_num_pages}", SWA), json=SWA),
    _m("swa_num_pages", 0, json=SWA),
    _m("full_peak_pages", 0, lambda c, r: np.max(c["used"], initial=0),
       ("full pool used pages peak / mean", "{} / {r.full_mean_pages:.0f}", SWA), json=SWA),
    _m("full_mean_pages", 0.0, lambda c, r: _mean(c["used"]), json=SWA),
    _m("swa_peak_pages", 0, lambda c, r: np.max(c["swa_used"], initial=0), json=SWA),
    _m("swa_mean_pages", 0.0, lambda c, r: _mean(c["swa_used"]), json=SWA),
    _m("swa_peak_usage", 0.0, _swa_share("swa_peak_pages"),
       ("SWA pool usage peak", "{:.1%}", SWA), json=SWA),
    _m("swa_mean_usage", 0.0, _swa_share("swa_mean_pages"),
       ("SWA pool usage mean", "{:.1%}", SWA),
       ("SWA pool used pages peak / mean", "{r.swa_peak_pages} / {r.swa_mean_pages:.0f}",
        SWA),
       json=SWA),
    _m("window_frees", 0, _sum("window_freed"),  # finishes not counted
       ("SWA pages freed by the window", "{}", SWA), json=SWA),
    _m("refused_full", 0, _sum("refused", 1),  # steps whose next admission it stopped
       ("admission stopped by full / SWA pool (steps)", "{} / {r.refused_swa}", SWA),
       json=SWA),
    _m("refused_swa", 0, _sum("refused", 2), json=SWA),
    _m("peak_reserved", 0.0,
       lambda c, r: np.max(c["used"] + c["committed"], initial=0) / r.num_pages,
       ("pool reserved peak (in use + promised)", "{:.1%}", SYN)),
    _m("mean_running", 0.0, lambda c, r: _mean(c["running"]),
       ("running requests mean", "{:.1f}", SYN)),
    _m("waste_mean", 0.0,  # unused slots in allocated pages / their slots
       lambda c, r: _mean(c["waste"] / np.maximum(c["used"] * r.page_size, 1)),
       ("unused slots in pages (mean)", "{:.2%}")),
    _m("waste_peak_slots", 0, lambda c, r: np.max(c["waste"], initial=0),
       ("unused slots in pages (peak)", "{}")),
    _m("runs_mean", 0.0, lambda c, r: np.mean(np.append(c["runs"][c["runs"] >= 0],
                                                        r.runs_final)),
       ("free-list runs (mean/final)", "{:.0f} / {r.runs_final}")),
    _m("runs_final", 0),   # runs of consecutive pages in the free list at the end
    _m("free_pages_final", 0),
    _m("in_use_final", 0),
    # Host driver: the time to launch a step; trace: an op's time.
    _m("step_us_p50", 0.0, lambda c, r: percentile(r.step_us, 50),
       ("op time p50 (us)", "{:.0f}", TRACE)),
    _m("step_us_p99", 0.0, lambda c, r: percentile(r.step_us, 99),
       ("op time p99 (us)", "{:.0f}", TRACE)),
    _m("step_wall_us", 0.0, lambda c, r: r.wall_s * 1e6 / max(r.steps, 1),  # device incl.
       ("wall time per step (us)", "{:.1f}", SYN),
       ("launch time per step p50 / p99 (us)", "{r.step_us_p50:.0f} / {r.step_us_p99:.0f}",
        "host")),
    _m("steps_per_call", 1),
    _m("calls", 0, None, ("steps per host round trip", _ROUND_TRIP, "device")),
    _m("sim_time", 0, None, ("sim time (iterations)", "{}", SYN)),
    _m("compile_s", 0.0),        # this page size's compile (they overlap: SimResult)
    _m("cache_hit", False),      # its loop came from the persistent compilation cache
    _m("compile_options", "default"),
    _m("wall_s", 0.0, None, ("wall time (s)", "{:.2f}")),  # compile excluded
    _m("leak_check", "not run", None, ("leak check", "{}")),
    _m("usage", [], lambda c, r: (c["used"] / r.num_pages).tolist(), json="series"),
    _m("step_us", [], json="series"),
    _m("records", None, json="series"),   # i64[steps, record_columns]
    _m("free_list_final", [], json="series"),
    _m("release_list_final", [], json="series"),
    _m("swa_usage", [], lambda c, r: (c["swa_used"] / max(r.swa_num_pages, 1)).tolist(),
       json="swa series"),
)

PageSizeResult = dataclasses.make_dataclass("PageSizeResult", [
    (m.key, Any, dataclasses.field(default_factory=list, repr=False) if m.default == []
     else dataclasses.field(default=m.default, repr=m.json != "series")) for m in METRICS])
PageSizeResult.__doc__ = "What one page size did with the workload: METRICS' fields."


@dataclasses.dataclass
class SimResult:
  config: Dict[str, Any]
  device: str
  versions: Dict[str, str]
  results: List[PageSizeResult]
  mode: str = "synthetic"   # or "trace"
  compile_wall_s: float = 0.0  # every page size's compile, together (they overlap)
  compile_cache: str = ""      # the persistent compilation cache's folder, "" when off


def percentile(x: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else 0.0


def make_layout(cfg: SimConfig, wl: Workload, page_size: int) -> Layout:
  """The static sizes; SimConfigError when a request cannot fit in the pool at all."""
  kind = "token" if page_size == 1 else "paged"
  acfg = AllocatorConfig(size=cfg.pool_size, page_size=page_size, need_sort=cfg.need_sort,
                         kind=kind, kernel=cfg.kernel, guard=cfg.guard)
  need = cdiv(wl.prompt + wl.output, page_size)
  if need.size and int(need.max()) > acfg.num_pages:
    i = int(np.argmax(need))
    raise SimConfigError(
        "--pool-size", f"request {i} needs {int(need[i])} pages "
        f"({int(wl.prompt[i] + wl.output[i])} tokens) at page_size={page_size}, but "
        f"{cfg.pool_size} slots are {acfg.num_pages} pages; raise --pool-size or shorten "
        f"the lengths")
  # Widths from the distributions' bounds, not from the draws: every seed and share
  # probability of one config has the same shapes (and compiles once).
  prefix_hi = parse_dist(cfg.prefix_len).hi if cfg.num_prefixes > 0 else 0
  longest = parse_dist(cfg.prompt_len).hi + prefix_hi + parse_dist(cfg.output_len).hi
  lay = Layout(acfg=acfg, rows=bucket(cfg.max_running, 1), groups=max(cfg.num_prefixes, 1),
               batch=bucket(cfg.max_prefill_reqs, 1),
               tokens=bucket(cfg.max_prefill_tokens, 1), frees=cfg.max_frees,
               width=max(1, cdiv(max(longest, wl.max_context), page_size)),
               branch=branches(), plan_kernel=plan_kernel(cfg))
  if cfg.swa_window <= 0:
    return lay
  swa_pages = int(round(cfg.swa_ratio * cfg.pool_size / page_size))
  need = sstep.swa_need(wl.prompt, wl.output, cfg.swa_window, lay.tokens, page_size)
  most = int(need.max()) if need.size else 0
  if swa_pages < max(most, 1):
    raise SimConfigError(
        "--swa-ratio", f"{cfg.swa_ratio} gives an SWA pool of {swa_pages} pages at "
        f"page_size={page_size}, but one request's window (--swa-window "
        f"{cfg.swa_window} plus a prefill chunk) needs up to {most}; raise --swa-ratio")
  scfg = SWAConfig(size=cfg.pool_size, size_swa=swa_pages * page_size,
                   page_size=page_size, need_sort=cfg.need_sort, kernel=cfg.kernel,
                   guard=cfg.guard)
  return dataclasses.replace(lay, acfg=scfg.full, swa=scfg, window=int(cfg.swa_window))


# CPU: XLA's older loop emitters instead of its fusion emitters, and LLVM at -O1: the loop
# is hundreds of small fusions and most of its compile is LLVM generating them; both
# compile faster with steps as fast (benchmarks/results/2026-12-02-cpu-o1). GPU:
# the loops and every fusion in command buffers (CUDA graphs) whose kernels run as their
# data dependences allow (the next plan beside the table work: simulate_step.step).
# Options this jaxlib does not take fall back to the default
# (PageSizeResult.compile_options says which ran).
COMPILE_OPTIONS = {
    "cpu": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
    "gpu": {"xla_gpu_enable_command_buffer":
            "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
            "xla_gpu_graph_min_graph_size": 1,
            "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}}
_HITS = threading.local()
_LISTENING = []


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _HITS.n = getattr(_HITS, "n", 0) + 1


class Prepared(NamedTuple):
  """One page size's device arrays and compiled programs."""
  lay: Layout
  wl: sstep.Workload
  carry: sstep.Carry
  fn: Any            # the driver's compiled call: (wl, carry) -> (carry, records, stopped)
  census: Any        # host driver: the compiled free-list census
  compile_s: float   # wall seconds of the whole preparation
  cache_hit: bool
  options: str
  cpu_s: Tuple[float, float]  # process CPU seconds of the lowering and the XLA compile


def clear_compiled() -> None:
  """Forgets the programs traced and compiled in this process (after patching what
  they call)."""
  sstep.run_steps.clear_cache()
  sstep.host_step.clear_cache()


def branches() -> bool:
  """Layout.branch: skip a step's unneeded table phases in lax.cond (on the CPU), or run
  them with no rows (on accelerators, where a branch waits for the host)."""
  return jax.default_backend() == "cpu"


def plan_kernel(cfg: SimConfig) -> str:
  """Layout.plan_kernel: the scheduler's plan as one Triton program where the pool's
  kernels are Triton (or in its interpreter, with theirs) and its vectors have
  power-of-two sizes (--num-prefixes, --max-frees); else "" (XLA operations)."""
  base, interpret = kernels.family(kernels.resolve(cfg.kernel))
  pow2 = all(bucket(n, 1) == n for n in (max(cfg.num_prefixes, 1), cfg.max_frees))
  use = cfg.plan_kernel and base == "triton" and pow2
  return base + "_interpret" * interpret if use else ""


def prepare(cfg: SimConfig, wl: Workload, page_size: int,
            options: Optional[Dict[str, Any]] = None) -> Prepared:
  """Lays out and compiles one page size (thread-safe: the page sizes compile at once);
  a second run of the same shapes in this process reuses jax's traces and programs.
  options: XLA's compile options (default: COMPILE_OPTIONS of this backend)."""
  if not _LISTENING:
    _LISTENING.append(jax.monitoring.register_event_listener(_on_event))
  t0 = time.perf_counter()
  lay = make_layout(cfg, wl, page_size)
  group = np.full_like(wl.group, -1) if cfg.swa_window else wl.group  # SWA: no prefixes
  prefix = wl.prefix_len if wl.prefix_len.size else np.zeros(1, np.int64)
  dwl = sstep.Workload(*(jnp.asarray(a, jnp.int32) for a in (
      wl.arrival, group, wl.prompt, wl.output, prefix, cfg.max_steps)))
  carry = jax.jit(sstep.init_carry, static_argnums=0)(lay)
  c0 = time.process_time()
  if cfg.driver == "device":
    blocks = -(-cfg.steps_per_call // cfg.runs_every)
    lowered = sstep.run_steps.lower(lay, dwl, carry, blocks=blocks,
                                    runs_every=cfg.runs_every)
  else:
    lowered = sstep.host_step.lower(lay, dwl, carry)
  c1 = time.process_time()
  options = COMPILE_OPTIONS.get(jax.default_backend(), {}) if options is None else options
  hits = getattr(_HITS, "n", 0)
  try:
    fn = lowered.compile(options)
  except Exception:  # pylint: disable=broad-except
    options, fn = {}, lowered.compile()
  hit = getattr(_HITS, "n", 0) > hits
  cpu_s = (c1 - c0, time.process_time() - c1)
  census = sstep.census.lower(carry.state).compile() if cfg.driver == "host" else None
  used = ",".join(f"{k}={v}" for k, v in options.items()) or "default XLA options"
  return Prepared(lay, dwl, carry, fn, census, time.perf_counter() - t0, hit, used, cpu_s)


def compile_all(cfg: SimConfig, wl: Workload, progress: bool) -> Tuple[List[Prepared], float]:
  """Every page size's programs, compiled concurrently; (prepared, wall seconds). The
  progress line says "compiling" with the seconds so far."""
  t0 = time.perf_counter()
  label = "compiling page_size=" + ",".join(map(str, cfg.page_sizes))
  bar = _bar(None, label, progress, bar_format="{desc}")
  with concurrent.futures.ThreadPoolExecutor(len(cfg.page_sizes)) as pool:
    futures = [pool.submit(prepare, cfg, wl, int(p)) for p in cfg.page_sizes]
    while concurrent.futures.wait(futures, timeout=0.5).not_done:
      bar.set_description_str(f"{label}: {time.perf_counter() - t0:.0f} s", refresh=True)
    bar.close()
    return [f.result() for f in futures], time.perf_counter() - t0


def _bar(total: Optional[int], desc: str, progress: bool, **kw):
  import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(total=total, desc=desc, unit="req", disable=not progress,
                   file=sys.stderr, dynamic_ncols=True, leave=False, **kw)


# The drivers: generators of (i64[n, C] records of the steps that ran, host us per step);
# the final carry goes to `out`.
def _device_driver(cfg: SimConfig, prep: Prepared, res: PageSizeResult, out: list):
  carry, pending, t_prev = prep.carry, None, time.perf_counter()
  while True:
    carry, recs, stop = prep.fn(prep.wl, carry)
    if pending is not None:  # the previous call's records, read while this call runs
      block = np.asarray(pending[0]).astype(np.int64)
      block = block[block[:, COL["kind"]] > 0]
      now = time.perf_counter()
      res.calls += 1
      yield block, [(now - t_prev) * 1e6 / max(len(block), 1)] * len(block)
      t_prev = now
      if bool(pending[1]):
        break
    pending = (recs, stop)
  out.append(carry)


def _host_driver(cfg: SimConfig, prep: Prepared, res: PageSizeResult, out: list):
  carry, queue, i = prep.carry, collections.deque(), 0
  while True:
    t0 = time.perf_counter()
    carry, rec, stop = prep.fn(prep.wl, carry)
    us = (time.perf_counter() - t0) * 1e6
    i += 1
    runs = prep.census(carry.state) if i % cfg.runs_every == 0 else None
    queue.append((rec, runs, stop, us))
    res.calls += 1
    while len(queue) > STATUS_LAG:
      rec, runs, stop, us = queue.popleft()
      rec = np.asarray(rec).astype(np.int64)[None]
      if rec[0, COL["kind"]] == 0:
        rec = rec[:0]
      elif runs is not None:
        rec[0, COL["runs"]] = int(runs)
      yield rec, [us] * len(rec)
      if bool(stop):
        out.append(carry)
        return


def run_page_size(cfg: SimConfig, wl: Workload, prep: Prepared,
                  progress: bool) -> PageSizeResult:
  """One page size under cfg.driver; raises LeakCheckError at the first step whose
  device page count differs from the scheduler's."""
  lay = prep.lay
  ps = lay.acfg.page_size
  per_call = -(-cfg.steps_per_call // cfg.runs_every) * cfg.runs_every
  res = PageSizeResult(ps, lay.num_pages, cfg.kernel, driver=cfg.driver,
                       steps_per_call=per_call if cfg.driver == "device" else 1,
                       compile_s=prep.compile_s, cache_hit=prep.cache_hit,
                       compile_options=prep.options, swa_window=lay.window,
                       swa_num_pages=lay.swa_pages)
  bar = _bar(wl.num_requests, f"page_size={ps}", progress)
  driver = _device_driver if cfg.driver == "device" else _host_driver
  final: list = []
  chunks, times, t0 = [], [], time.perf_counter()
  for block, us in driver(cfg, prep, res, final):
    _check_records(lay, len(times) + 1, block)
    chunks.append(block)
    times.extend(us)
    bar.update(int(block[:, COL["finished"]].sum()))
  carry = final[0]
  jax.block_until_ready(carry)
  res.wall_s = time.perf_counter() - t0
  bar.close()
  sched = jax.device_get(carry.sched)
  steps = int(sched.steps)
  if int(sched.error) == sstep.ERR_STUCK:
    waiting = int(np.sum(wl.arrival <= int(sched.clock))) - int(sched.head)
    raise RuntimeError(f"scheduler stuck at step {steps} (page_size={ps}): {waiting} "
                       f"requests wait and none can be admitted")
  if int(sched.done) < wl.num_requests or np.any(sched.phase == sstep.FREEING):
    raise RuntimeError(f"no progress after {steps} steps (page_size={ps}): the step cap "
                       f"max_steps={cfg.max_steps} came with "
                       f"{wl.num_requests - int(sched.done)} requests unfinished")
  width = len(record_columns(lay.swa is not None))
  records = np.concatenate(chunks) if chunks else np.zeros((0, width), np.int64)
  res.requests_done, res.sim_time = int(sched.done), int(sched.clock)
  res.runs_final = int(jax.jit(sstep.free_list_runs)(carry.state))
  res.step_us = times
  finish_result(res, records)
  final_leak_check(res, lay, carry.state, carry.table, sched.cache_tokens)
  return res


def _check_records(lay: Layout, first_step: int, recs: np.ndarray) -> None:
  """Every step ok, and the device's page counts equal to the scheduler's."""
  ps = lay.acfg.page_size
  pools = [("", "used", "device_pages", lay.num_pages)]
  if lay.swa is not None:
    pools.append(("SWA ", "swa_used", "swa_device_pages", lay.swa_pages))
  for i, rec in enumerate(recs):
    if not rec[COL["ok"]]:
      raise LeakCheckError(
          f"allocation failed at step {first_step + i} (page_size={ps}) although "
          f"admission control had reserved its pages ({rec[COL['device_pages']]} free + "
          f"released on the device)")
    for pool, used, dev, n in pools:
      if rec[COL[dev]] != n - rec[COL[used]]:
        raise LeakCheckError(
            f"leak check failed at step {first_step + i} (page_size={ps}): the device "
            f"has {rec[COL[dev]]} free + released {pool}pages, the scheduler's accounting "
            f"expects {n - rec[COL[used]]} (difference {rec[COL[dev]] - n + rec[COL[used]]})")


def finish_result(res: PageSizeResult, records: np.ndarray) -> None:
  """Sets the metrics the step records give (METRICS' compute, in order); the result's
  runs_final, wall_s and step_us must be set."""
  res.records = records
  cols = dict(zip(record_columns(records.shape[1] > len(sstep.RECORD)), records.T))
  for m in METRICS:
    if m.compute is not None and ("swa" not in m.json or "swa_used" in cols):
      v = m.compute(cols, res)
      setattr(res, m.key, v if isinstance(v, list) else type(m.default)(v))


def check_partition(name: str, ps: int, n: int, parts: Sequence[np.ndarray]) -> int:
  """Checks that the parts hold pages 1..n exactly once; returns their total."""
  everything = np.concatenate(parts).astype(np.int64)
  uniq = np.unique(everything)
  if everything.size != n or not np.array_equal(uniq, np.arange(1, n + 1)):
    raise LeakCheckError(
        f"leak check failed (page_size={ps}{name}): free + released + in use "
        f"{everything.size} != total {n} pages; "
        f"{np.setdiff1d(np.arange(1, n + 1), uniq).size} pages missing, "
        f"{everything.size - uniq.size} held twice")
  return everything.size


def check_record(name: str, ps: int, n: int, pool: st.AllocatorState) -> None:
  """With an ownership record (SPEC 14): no free was refused, and the record holds
  exactly the pages in neither of the pool's lists."""
  err = guard.error(pool)
  if err is not None:
    raise LeakCheckError(f"the ownership record refused a free (page_size={ps}{name}): "
                         f"{err}")
  if pool.guard is None:
    return
  held = np.asarray(pool.guard.held)[1:] != 0
  want = guard.from_free(n, np.concatenate([st.live_free_pages(pool),
                                            st.live_release_pages(pool)]))[1:] != 0
  if np.any(held != want):
    raise LeakCheckError(
        f"leak check failed (page_size={ps}{name}): the ownership record holds "
        f"{np.sum(held & ~want)} free pages and misses {np.sum(want & ~held)} pages in use")


def final_leak_check(res: PageSizeResult, lay: Layout, state, table,
                     cache_tokens=None) -> None:
  """Every request row empty; free + released + held by the prefix cache is exactly
  pages 1..num_pages (SWA mode: in each pool, and no full slot still maps an SWA slot);
  the ownership record (where kept) refused nothing and holds exactly the pages in use."""
  ps, r = lay.acfg.page_size, lay.rows
  lens = np.asarray(table.lens)
  res.leak_check = "FAILED"
  if np.any(lens[:r]):
    raise LeakCheckError(f"request rows still hold tokens at the end (page_size={ps}): "
                         f"rows {np.flatnonzero(lens[:r]).tolist()}")
  full = state.full if lay.swa is not None else state
  free, release = st.live_free_pages(full), st.live_release_pages(full)
  res.free_list_final, res.release_list_final = free.tolist(), release.tolist()
  if lay.swa is not None:
    n_full = check_partition(", full pool", ps, lay.num_pages, [free, release])
    n_swa = check_partition(", SWA pool", ps, lay.swa_pages, [
        st.live_free_pages(state.swa), st.live_release_pages(state.swa)])
    check_record(", full pool", ps, lay.num_pages, full)
    check_record(", SWA pool", ps, lay.swa_pages, state.swa)
    mapped = np.flatnonzero(swa_core.live_mapping(state)[:-1])
    if mapped.size:
      raise LeakCheckError(f"leak check failed (page_size={ps}): {mapped.size} full "
                           f"slots still map to SWA slots, e.g. {mapped[:5].tolist()}")
    res.free_pages_final, res.in_use_final = n_full, 0
    res.leak_check = (f"ok: full free {n_full} == {lay.num_pages}, SWA free {n_swa} == "
                      f"{lay.swa_pages}")
    return
  pages, owned = np.asarray(table.pages), np.asarray(table.owned_from)
  held = []
  for g, want in enumerate(np.asarray(cache_tokens).tolist()):
    if int(lens[r + g]) != want or (want and int(owned[r + g]) != 0):
      raise LeakCheckError(f"cache entry {g} (page_size={ps}) holds {int(lens[r + g])} "
                           f"tokens from column {int(owned[r + g])}, the scheduler "
                           f"expects {want} from column 0")
    held.append(pages[r + g, :want // ps])
  check_partition("", ps, lay.num_pages, [free, release] + held)
  check_record("", ps, lay.num_pages, state)
  res.free_pages_final = int(free.size + release.size)
  res.in_use_final = lay.num_pages - res.free_pages_final
  res.leak_check = (f"ok: free {res.free_pages_final} + in use {res.in_use_final} "
                    f"== {lay.num_pages}")


def versions() -> Dict[str, str]:
  from jax_kvalloc.tools import bench  # pylint: disable=g-import-not-at-top
  return bench.versions(("jax", "jaxlib", "numpy", "jax_kvalloc"))


def device_name() -> str:
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d)} ({jax.device_count()} device(s))"


def run(cfg: SimConfig, *, progress: bool = True) -> SimResult:
  """Runs the workload once per page size. SimConfigError for a setting it cannot run,
  LeakCheckError on a leak, RuntimeError when the scheduler is stuck or hits max_steps."""
  check_config(cfg)
  notes = []
  if cfg.swa_window > 0 and 1 in cfg.page_sizes:
    notes.append("--swa-window leaves page_size=1 out (SGLang's SWA alloc_extend asserts "
                 "page_size > 1)")
    cfg = dataclasses.replace(cfg, page_sizes=tuple(p for p in cfg.page_sizes if p > 1))
  if cfg.swa_window > 0 and cfg.num_prefixes > 0 and cfg.share_prob > 0:
    notes.append("--swa-window turns prefix sharing off (the SWA request table has no "
                 "borrowed prefixes); shared prefixes are prefilled per request")
  wl = cfg.workload()
  for ps in cfg.page_sizes:  # a request too long for the pool: before any compile
    make_layout(cfg, wl, int(ps))
  for note in notes:
    print(f"jax-kvalloc simulate: {note}", file=sys.stderr)
  prepared, compile_s = compile_all(cfg, wl, progress)
  out = [run_page_size(cfg, wl, p, progress) for p in prepared]
  cache = jax.config.jax_compilation_cache_dir or ""
  return SimResult(dataclasses.asdict(cfg), device_name(), versions(), out,
                   compile_wall_s=compile_s, compile_cache=cache)


def summary_rows(result: SimResult) -> List[Tuple[str, List[str]]]:
  """(metric, one value per page size): the rows of METRICS that this run shows."""
  rs = result.results
  modes = {TRACE} if result.mode == TRACE else {SYN, rs[0].driver if rs else ""}
  modes |= {SWA} if rs and rs[0].swa_window else set()
  text = lambda m, fmt, r: fmt(r) if callable(fmt) else fmt.format(getattr(r, m.key), r=r)
  return [(label, [text(m, fmt, r) for r in rs]) for m in METRICS
          for label, fmt, *when in m.rows if not when or when[0] in modes]


def compile_line(result: SimResult) -> str:
  """One line: the compile's wall time for every page size together, and cache hits."""
  rs = result.results
  hits = sum(r.cache_hit for r in rs)
  cache = (f"{hits} of {len(rs)} from the persistent cache {result.compile_cache}"
           if result.compile_cache else "persistent cache off")
  return (f"compile: {result.compile_wall_s:.1f} s wall for {len(rs)} page size(s) "
          f"together ({cache})")


def to_json(result: SimResult, *, series: bool = True) -> Dict[str, Any]:
  """The result as JSON data: per page size the METRICS keys (SWA keys in SWA mode only,
  the per-step series only with `series`, the records as {"columns", "rows"})."""
  swa = bool(result.config.get("swa_window"))
  skip = ({""} if swa else {SWA}) | ({""} if series else {"series"})
  out = []
  for r in result.results:
    d = {m.key: getattr(r, m.key) for m in METRICS if not skip & set(m.json.split())}
    recs = d.pop("records", None)
    if recs is not None:
      d["records"] = {"columns": list(record_columns(swa)),
                      "rows": np.asarray(recs).tolist()}
    out.append(d)
  config = {k: v for k, v in result.config.items()
            if swa or k not in ("swa_window", "swa_ratio")}
  return dict(vars(result), config=config, results=out)


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
