"""`jax-kvalloc bench table`: the serving loop through the request table
(jax_kvalloc.request_table), all steps inside one jit, and the allocator's share per step.

Every table row is a request with a fixed target length; a row that reached it restarts
as a new request. Two steps, as a JAX engine runs them inside its jitted step:

  decode    `release_rows` of the rows that finished last step (up to max_frees, one
            free_page_ids of their pages in row order, no sort), then `decode_rows` of
            every row (last_loc read from the table, a page appended where the token
            starts one); a released row restarts at length 0.
  extend    the same with `extend_rows` between them: the released rows again, with a
            fresh prompt of --prompt tokens each.

Columns, each step chained in timing.chain_time (device time per step):

  calls     the table operations as separate calls (one launch each on a GPU pool)
  step      `step_rows`: the same work as one call (one launch on a GPU pool, two with
            extend)
  none      stand-ins that only move the lengths, as an engine's bookkeeping would
  floor     `none` plus one empty Pallas-Triton launch per step (GPU): one launch's cost
  sglang    SGLang has no request table: the eager class calls a scheduler makes for the
            same work (free_group_begin, free_page_ids of each finished request,
            free_group_end, alloc_extend of the restarted ones, alloc_decode of every
            row) on the same pool size, host time per step

"share" = column - none: the allocator's part of a step. On a GPU each chained column
also records the jax_kvalloc kernels' own GPU time per step from CUPTI ("kernels_us").
At the page sizes after the first, only --other-batch-sizes run, with step and none.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import bench_serving
from jax_kvalloc.tools import report
from jax_kvalloc.tools import timing

TARGET_US = {"decode": 3.0, "extend": 5.0}  # the allocator's share of a step, GPU
GUARD_TARGET_US = 1.0   # the ownership record's part of a step's share (issue 32)


@dataclasses.dataclass(frozen=True)
class TableCase:
  bs: int                 # table rows, all decoding every step
  page_size: int
  prompt: int             # tokens of a restarted request's prefill (extend step)
  len_lo: int = 64        # target lengths (tokens) are uniform in [len_lo, len_hi]
  len_hi: int = 1024
  max_frees: int = 8      # rows released (and restarted) per step at most
  seed: int = 0
  extend: bool = True     # the extend step (else the decode step)
  kernel: str = "auto"
  guard: bool = True      # the pool's ownership record (SPEC 14)

  @property
  def max_pages_per_req(self) -> int:
    return -(-(self.len_hi + self.prompt + 1) // self.page_size)

  @property
  def max_tokens(self) -> int:
    return self.max_frees * self.prompt

  @property
  def config(self) -> AllocatorConfig:
    # Room for every row at its longest: the loop never runs short.
    return AllocatorConfig(size=(self.bs * self.max_pages_per_req + 8) * self.page_size,
                           page_size=self.page_size, kernel=self.kernel, debug=False,
                           guard=self.guard)


@functools.lru_cache(maxsize=4)
def initial_carry(case: TableCase):
  """(state, table, target, pending, ok): rows at random points of their lives (cached:
  the arrays are never donated)."""
  cfg = case.config
  rng = np.random.default_rng([case.seed, case.bs, case.page_size])
  target = rng.integers(case.len_lo, case.len_hi + 1, case.bs).astype(np.int32)
  lens = rng.integers(1, target).astype(np.int32)
  table = rt.init_table(cfg, case.bs, case.max_pages_per_req)
  jnp_cfg = dataclasses.replace(cfg, kernel="jnp")  # a one-off, large extend
  state, table, _, ok = jax.jit(functools.partial(rt.extend_rows, jnp_cfg,
                                                  max_tokens=int(lens.sum())))(
      st.init(cfg), table, jnp.arange(case.bs, dtype=jnp.int32), jnp.asarray(lens))
  if not bool(ok):
    raise RuntimeError("could not build the initial table")
  return (state, table, jnp.asarray(target), jnp.zeros(case.bs, bool), jnp.ones((), bool))


def table_step(case: TableCase, carry, inputs, *, variant: str = "calls"):
  """One step of the loop (pure): carry -> (carry, outputs). `inputs` is an i32[] zero
  (the timing harness's link). variant: calls, step, none or floor."""
  cfg = case.config
  state, table, target, pending, ok_all = carry
  rows = jnp.arange(case.bs, dtype=jnp.int32) + inputs
  picked, sel, n_free = bench_serving.finished_rows(pending, case.max_frees, rows)
  prompt = jnp.full((case.max_frees,), case.prompt, jnp.int32)
  ext = jnp.zeros((case.max_tokens,), jnp.int32) if case.extend else None
  oks = []
  if variant == "step":
    kw = dict(extend=picked, n=prompt, num_extend=n_free,
              max_tokens=case.max_tokens) if case.extend else {}
    state, table, out = rt.step_rows(cfg, state, table, release=picked,
                                     num_release=n_free, decode=rows, **kw)
    oks += [out.release_ok, out.decode_ok] + ([out.extend_ok] if case.extend else [])
    dec = out.decode_slots
    ext = out.extend_slots if case.extend else None
  elif variant == "calls":
    state, table, ok = rt.release_rows(cfg, state, table, picked, num_rows=n_free)
    oks.append(ok)
    if case.extend:
      state, table, ext, ok = rt.extend_rows(cfg, state, table, picked, prompt,
                                             max_tokens=case.max_tokens, num_rows=n_free)
      oks.append(ok)
    state, table, dec, ok = rt.decode_rows(cfg, state, table, rows)
    oks.append(ok)
  else:  # stand-ins: the same length updates, no allocator
    table = table._replace(lens=jnp.where(sel, case.prompt if case.extend else 0,
                                          table.lens) + 1)
    dec = table.lens
    if variant == "floor":
      one = timing.stand_in_pallas(jax.ShapeDtypeStruct((1,), jnp.int32))
      dec = dec + jnp.minimum(one(jnp.zeros((), jnp.int32), n_free)[1].reshape(-1)[0], 0)
  pending = (pending & ~sel) | (table.lens >= target)
  ok_all = functools.reduce(jnp.logical_and, oks, ok_all)
  # Outputs: what an engine would consume (slots for the K/V writes).
  return (state, table, target, pending, ok_all), (dec,) + ((ext,) if ext is not None else ())


@functools.lru_cache(maxsize=8)
def step_call(case: TableCase, variant: str):
  """table_step of one case and variant, one object per pair: the timed and the profiled
  run share its compiled loop (timing.chain_loop is memoized on the call)."""
  return functools.partial(table_step, case, variant=variant)


CHECK_STEPS = 200


def loop_output(case: TableCase, variant: str, steps: int = CHECK_STEPS):
  """What `steps` steps of the variant leave from the case's initial table: every step's
  slots, then the final pool (its ownership record left out) and table (the leaves, as
  host arrays). A row's calls and step columns, on any kernel family, with the record or
  without, must all leave the same."""
  call = step_call(case, variant)
  run = jax.jit(lambda carry: jax.lax.scan(
      lambda c, _: call(c, jnp.zeros((), jnp.int32)), carry, None, length=steps))
  carry, outs = run(initial_carry(case))
  state, table = carry[0]._replace(guard=None), carry[1]
  return tuple(np.asarray(x) for x in jax.tree_util.tree_leaves((outs, state, table)))


def chained_timed(case: TableCase, variant: str) -> bench.Timed:
  """The chained step; whether 200 steps of it run without a refusal ("ok"); on a GPU the
  kernels' own GPU time per step over 20 loop iterations, from CUPTI. The calls and step
  columns' output: `loop_output`."""
  call, carry, zero = step_call(case, variant), initial_carry(case), jnp.zeros((), jnp.int32)
  timed = bench.chained(call, carry, zero)

  def measure(o) -> Dict[str, Any]:
    out = timed.measure(o)
    run = timing.chain_loop(call, o.unroll)
    sink = timing.sink_init(call, carry, zero)
    out["ok"] = bool(run(carry, zero, sink, np.int32(max(1, CHECK_STEPS // o.unroll)))[0][-1])
    if jax.default_backend() != "gpu":
      return out
    try:
      acts = timing.cuda_activities(lambda: jax.block_until_ready(
          run(carry, zero, sink, np.int32(20))))
    except ImportError as e:  # no torch: no CUPTI
      return dict(out, profile_error=bench.error(e)["error"])
    steps = 20 * o.unroll
    kernels = [(d, name) for _, d, cat, name in acts if cat == "kernel"]
    return dict(out, kernels_us=sum(d for d, n in kernels if "jax_kvalloc" in n) / steps,
                all_kernels_us=sum(d for d, _ in kernels) / steps,
                activities_per_step=len(acts) / steps)
  output = (functools.partial(loop_output, case, variant)
            if variant in ("calls", "step") else None)
  return bench.Timed(measure, output)


def sglang_timed(case: TableCase) -> bench.Timed:
  """Host time per step of SGLang's eager class doing the step's allocator work: a free
  group of free_page_ids (max_frees finished requests of about (len_lo + len_hi) / 2
  tokens), alloc_extend of max_frees new requests (extend step), alloc_decode of every
  row (one in page_size starting a page). Every step first puts back one snapshot of the
  pool, so every step sees the same pool; that is part of the figure."""
  sglang_oracle = bench.sglang()
  torch, dev = bench.torch_device()
  ps, bs, mf = case.page_size, case.bs, case.max_frees
  alloc = sglang_oracle.SGLangAllocator(case.config.num_pages * ps, ps, False, "paged", dev)
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)
  c64 = lambda a: torch.as_tensor(np.asarray(a, np.int64))
  rng = np.random.default_rng(case.seed)
  per_row = -(-((case.len_lo + case.len_hi) // 2) // ps)
  frees = list((alloc.alloc(mf * per_row * ps)[::ps] // ps).reshape(mf, per_row))
  held = alloc.alloc(bs * ps)
  seq = bench.decode_lens(bs, ps, rng)
  last = (held[::ps] // ps).cpu().numpy() * ps + (seq - 2) % ps
  d_seq, d_seq_cpu, d_last = t64(seq), c64(seq), t64(last)
  z, p = np.zeros(mf), np.full(mf, case.prompt)
  ext = (t64(z), c64(z), t64(p), c64(p), t64(np.full(mf, -1)), mf * case.prompt)
  snap = alloc.backup_state()

  def step():
    alloc.restore_state(snap)
    alloc.free_group_begin()
    for ids in frees:
      alloc.free_page_ids(ids.clone())
    alloc.free_group_end()
    if case.extend:
      alloc.alloc_extend(*ext)
    return alloc.alloc_decode(d_seq, d_seq_cpu, d_last)

  if step() is None:
    raise RuntimeError("SGLang: the pool ran short")
  return bench.host(step, torch.cuda.synchronize if dev == "cuda" else lambda: None)


def cases(o):
  for i, ps in enumerate(o.page_sizes):
    for step in o.steps:
      for bs in o.batch_sizes if i == 0 else o.other_batch_sizes:
        case = TableCase(bs=bs, page_size=ps, prompt=o.prompt, max_frees=o.max_frees,
                         seed=o.seed, extend=step == "extend", kernel=o.kernel)
        row = {"step": step, "bs": bs, "page_size": ps}
        # A column may name its pool's kernel family and record: step[kernel=mosaic_gpu],
        # calls[guard=False].
        for spec in o.impls:
          v, kw = bench.parse_impl(spec)
          if (i > 0 and v not in ("none", "step")) or (
              v == "floor" and jax.default_backend() != "gpu"):
            continue
          if v == "sglang":
            yield bench.Case(row, spec, functools.partial(sglang_timed, case))
            continue
          c = dataclasses.replace(case, kernel=kw.get("kernel", case.kernel),
                                  guard=kw.get("guard", True))
          yield bench.Case(row, spec, functools.partial(chained_timed, c, v))


def render(record: Dict[str, Any]) -> str:
  """The per-step shares (column - none) beside the plain table of every column."""
  f = report.fmt_us
  body = []
  for r in record["rows"]:
    c = {k: v.get("us") for k, v in r["cells"].items()}
    share = lambda v: c[v] - c["none"] if c.get(v) is not None and c.get("none") else None
    ok = all(x.get("ok", True) for x in r["cells"].values())
    s = share("step")
    body.append([r["step"], r["bs"], r["page_size"], f(c.get("none")), f(share("calls")),
                 f(s), f(share("floor")),
                 f(r["cells"].get("calls", {}).get("kernels_us")),
                 f(r["cells"].get("step", {}).get("kernels_us")), f(c.get("sglang")),
                 ("yes" if s is not None and s <= TARGET_US[r["step"]] else "no")
                 + ("" if ok else " REFUSED")])
  return (report.table(["step", "bs", "ps", "stand-ins (us)", "share: calls",
                        "share: step_rows", "floor: 1 launch", "kernels: calls",
                        "kernels: step_rows", "SGLang eager", "step_rows <= target"], body)
          + _shares(record)
          + "\n\nshare = column - stand-ins (us per step, device time); kernels = the "
          "jax_kvalloc kernels' own GPU time per step (CUPTI); SGLang has no request "
          "table: its column is the host time per step of the same work as eager class "
          "calls.\n\n" + bench.table(record, SUITE))


def _shares(record: Dict[str, Any]) -> str:
  """Where columns name kernel families (step[kernel=...]): each column's share, median
  [q1, q3] of the step less the stand-ins' median, and its kernels' GPU time."""
  names = [i for r in record["rows"] for i in r["cells"] if "[" in i]
  names = list(dict.fromkeys(names))
  if not names:
    return ""
  f = report.fmt_us

  def cell(r, name):
    c, none = r["cells"].get(name), r["cells"].get("none", {}).get("us")
    if not c or "us" not in c or none is None:
      return "-" if not c else c.get("error", "-")[:30]
    q = (f" [{f(c['q1_us'] - none)}, {f(c['q3_us'] - none)}]" if "q1_us" in c else "")
    return f"{f(c['us'] - none)}{q} / {f(c.get('kernels_us'))}"
  body = [[r["step"], r["bs"], r["page_size"]] + [cell(r, n) for n in names]
          for r in record["rows"]]
  return ("\n\nshare [q1, q3] / kernels (us per step) per column:\n"
          + report.table(["step", "bs", "ps"] + names, body))


SUITE = bench.Suite(
    name="table", help="the request table's serving step inside one jit (separate calls, "
    "step_rows, stand-ins) beside SGLang's eager class doing the same work",
    impls=("none", "calls", "step", "floor", "sglang"), cases=cases, render=render,
    guarded=("calls", "step"),
    guard_target=lambda row, col: (GUARD_TARGET_US, "us"),
    defaults=(("unroll", 8), ("reps", 3)),
    dims=(bench.Dim("--batch-sizes", [64, 256, 1024], "table rows", quick=[8]),
          bench.Dim("--page-sizes", [64, 16], "page sizes", quick=[4]),
          bench.Dim("--other-batch-sizes", [256], "table rows at the page sizes after the "
                    "first (step and none only)", quick=[8]),
          bench.Dim("--steps", ["decode", "extend"], "which steps",
                    bench.cli.name_list(("decode", "extend"))),
          bench.Dim("--prompt", 256, "prefill tokens of a restarted request", quick=16),
          bench.Dim("--max-frees", 8, "rows released and restarted per step", quick=4),
          bench.Dim("--kernel", "auto", "the pool's AllocatorConfig.kernel"),
          bench.Dim("--seed", 0, "seed of the initial lengths")))
