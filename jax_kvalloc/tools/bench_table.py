"""`jax-kvalloc bench-table`: the serving loop through the request table
(jax_kvalloc.request_table), all steps inside one jit, and the allocator's share per step.

Every table row is a request with a fixed target length; a row that reached it restarts
as a new request. Two steps, as a JAX engine would run them inside its jitted step:

  decode    `release_rows` of the rows that finished last step (up to max_frees, one
            free_page_ids of their pages in row order, no sort), then `decode_rows` of
            every row (last_loc read from the table, a page appended where the token
            starts one); a released row restarts at length 0.
  extend    the same with `extend_rows` between them: the released rows again, with a
            fresh prompt (a prefill chunk of --prompt tokens each).

Each step runs in several variants, timed in the same harness (tools/timing.py,
`chain_time`: chained steps in one `fori_loop`, slope per step):

  calls     the table operations as separate calls (one launch each on a GPU pool)
  step      `step_rows`: the same work as one call (one launch on a GPU pool, two with
            extend)
  none      stand-ins that only move the lengths, as an engine's bookkeeping would
  floor     `none` plus one empty Pallas-Triton launch per step (GPU only): what one
            launch costs in this loop

At the page sizes after the first, only --other-batch-sizes run, and only `step` and
`none` (the run stays near 150 s on a GPU). "share" = variant - none: the allocator's
part of a step. On a GPU the run also records each variant's kernels from CUPTI
(timing.cuda_activities): "kernels us" is the sum of the jax_kvalloc kernels' own GPU
times per step (launch gaps excluded). SGLang has no
request table: its per-step cost for the same work is the eager class calls a scheduler
makes (free_group_begin, free_page_ids of each finished request, free_group_end,
alloc_extend of the restarted requests, alloc_decode of every row), timed from Python
(host time per step, and with a final wait) on the same pool size. SGLang 0.5.23's
PagedTokenToKVPoolAllocator is used when it imports; otherwise torch_ref's eager class
stands in, and the record says so. SCAN_ALLOC_TARGET_US is the issue's goal.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import timing

STEPS = ("decode", "extend")
VARIANTS = ("calls", "step", "none", "floor")
TARGET_US = {"decode": 3.0, "extend": 5.0}  # the GPU issue's goals for the share


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
  guard: bool = True      # the pool's ownership record (SPEC 14); False: its cost off

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
  state = st.init(cfg)
  table = rt.init_table(cfg, case.bs, case.max_pages_per_req)
  jnp_cfg = dataclasses.replace(cfg, kernel="jnp")  # a one-off, large extend
  state, table, _, ok = jax.jit(functools.partial(rt.extend_rows, jnp_cfg,
                                                  max_tokens=int(lens.sum())))(
      state, table, jnp.arange(case.bs, dtype=jnp.int32), jnp.asarray(lens))
  if not bool(ok):
    raise RuntimeError("could not build the initial table")
  return (state, table, jnp.asarray(target), jnp.zeros(case.bs, bool), jnp.ones((), bool))


def _empty_launch():
  """A call that adds one Pallas-Triton launch (a 1-element kernel) per step."""
  return timing.stand_in_pallas(jax.ShapeDtypeStruct((1,), jnp.int32))


def table_step(case: TableCase, carry, inputs, *, variant: str = "calls"):
  """One step of the loop (pure): carry -> (carry, outputs). `inputs` is an i32[] zero
  (the timing harness's link). variant: one of VARIANTS."""
  cfg = case.config
  state, table, target, pending, ok_all = carry
  bs, mf = case.bs, case.max_frees
  rows = jnp.arange(bs, dtype=jnp.int32) + inputs
  # The rows that finished last step, compacted (up to max_frees of them).
  rank = jnp.cumsum(pending) - pending
  sel = pending & (rank < mf)
  picked = jnp.zeros(mf, jnp.int32).at[jnp.where(sel, rank, mf)].set(rows, mode="drop")
  n_free = jnp.sum(sel).astype(jnp.int32)
  prompt = jnp.full((mf,), case.prompt, jnp.int32)
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
      _, one = _empty_launch()(jnp.zeros((), jnp.int32), n_free)
      dec = dec + jnp.minimum(one.reshape(-1)[0], 0)
  pending = (pending & ~sel) | (table.lens >= target)
  for ok in oks:
    ok_all = ok_all & ok
  # Outputs: what an engine would consume (slots for the K/V writes).
  outs = (dec,) + ((ext,) if ext is not None else ())
  return (state, table, target, pending, ok_all), outs


@functools.lru_cache(maxsize=8)
def _step_call(case: TableCase, variant: str):
  """table_step of one case and variant, one object per pair: the timed and the profiled
  run share its compiled loop (timing.chain_loop is memoized on the call)."""
  return functools.partial(table_step, case, variant=variant)


def _kernels_per_step(case: TableCase, variant: str, unroll: int, iters: int):
  """CUPTI: the sum of the jax_kvalloc kernels' GPU us per step, all kernels' GPU us per
  step, activities per step, and whether every step of the run succeeded ("ok")."""
  call = _step_call(case, variant)
  carry, inputs = initial_carry(case), jnp.zeros((), jnp.int32)
  run = timing.chain_loop(call, unroll)
  sink = timing.sink_init(call, carry, inputs)
  jax.block_until_ready(run(carry, inputs, sink, np.int32(2)))
  box = {}
  acts = timing.cuda_activities(lambda: box.setdefault("out", jax.block_until_ready(
      run(carry, inputs, sink, np.int32(iters)))))
  steps = iters * unroll
  ours = sum(d for _, d, cat, name in acts if cat == "kernel" and "jax_kvalloc" in name)
  total = sum(d for _, d, cat, _ in acts if cat == "kernel")
  names = sorted({name for _, _, cat, name in acts
                  if cat == "kernel" and "jax_kvalloc" in name})
  return {"kernels_us": ours / steps, "all_kernels_us": total / steps,
          "activities_per_step": len(acts) / steps, "kernel_names": names[:8],
          "ok": bool(box["out"][0][-1])}


def _check_loop(case: TableCase, variant: str) -> bool:
  call = functools.partial(table_step, case, variant=variant)
  run = jax.jit(lambda c: jax.lax.fori_loop(0, 200, lambda _, c: call(
      c, jnp.zeros((), jnp.int32))[0], c))
  return bool(run(initial_carry(case))[-1])


def run_case(case: TableCase, *, unroll: int, min_time: float, reps: int,
             variants=VARIANTS, profile: bool = True) -> Dict[str, Any]:
  """Per-step device time of each variant, the shares (variant - none), and on a GPU
  the kernels' own times."""
  gpu = jax.default_backend() == "gpu"
  out: Dict[str, Any] = {"step": "extend" if case.extend else "decode", "bs": case.bs,
                         "page_size": case.page_size, "prompt": case.prompt,
                         "max_frees": case.max_frees, "guard": case.guard}
  for variant in variants:
    if variant == "floor" and not gpu:
      continue
    call = _step_call(case, variant)
    res = timing.chain_time(call, initial_carry(case), jnp.zeros((), jnp.int32),
                            unroll=unroll, min_time=min_time, reps=reps)
    out[f"{variant}_us"] = res["s"] * 1e6
    out[f"{variant}_spread"] = res["spread"]
  for variant in ("calls", "step"):
    if f"{variant}_us" not in out:
      continue
    if "none_us" in out:
      out[f"{variant}_share_us"] = out[f"{variant}_us"] - out["none_us"]
    if gpu and profile:  # the profiled run (160 steps) also checks that none refused
      try:
        prof = _kernels_per_step(case, variant, unroll, 20)
        out.update({f"{variant}_{k}": v for k, v in prof.items()})
      except Exception as e:  # pylint: disable=broad-except
        out[f"{variant}_profile_error"] = f"{type(e).__name__}: {e}"[:300]
    if f"{variant}_ok" not in out:
      out[f"{variant}_ok"] = _check_loop(case, variant)
  if "floor_us" in out and "none_us" in out:
    out["floor_share_us"] = out["floor_us"] - out["none_us"]
  return out


# ---------------------------------------------------------------------------------------
# SGLang's eager class for the same work.
# ---------------------------------------------------------------------------------------

def sglang_class(pool_pages: int, ps: int):
  """(allocator, implementation name, note): SGLang 0.5.23's PagedTokenToKVPoolAllocator
  when it imports, else torch_ref's eager class. CUDA when torch sees a GPU."""
  import torch  # pylint: disable=g-import-not-at-top
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  size = pool_pages * ps
  try:
    from sglang.srt.mem_cache import allocator as sgl  # pylint: disable=g-import-not-at-top
    return (sgl.PagedTokenToKVPoolAllocator(size, ps, torch.float16, dev, None, False),
            "sglang", f"sglang's PagedTokenToKVPoolAllocator on {dev}")
  except Exception as e:  # pylint: disable=broad-except
    import torch_ref  # pylint: disable=g-import-not-at-top
    note = (f"SGLang's class did not import ({type(e).__name__}: {str(e)[:120]}); "
            f"torch_ref's eager class stands in, on {dev}")
    return torch_ref.PagedTokenToKVPoolAllocator(size, ps, device=dev), "torch_ref", note


def _restorer(alloc):
  """A function that puts the class's pool back as it is now: restore_state where the
  class has it (torch_ref); SGLang 0.5.23 has none, so its attributes are saved (tensors
  by reference: the class replaces them, never writes them; lists copied)."""
  if hasattr(alloc, "backup_state"):
    snap = alloc.backup_state()
    return lambda: alloc.restore_state(snap)
  saved = dict(vars(alloc))

  def restore():
    for k, v in saved.items():
      setattr(alloc, k, list(v) if isinstance(v, list) else v)
  return restore


def sglang_step(case: TableCase, *, min_time: float, reps: int) -> Dict[str, Any]:
  """Host time per step of the eager class calls doing the step's allocator work: a free
  group of free_page_ids (max_frees finished requests of about (len_lo + len_hi) / 2
  tokens each), alloc_extend of max_frees new requests (extend step), alloc_decode of bs
  rows (one row in page_size starting a page). Every step starts by putting back one
  snapshot of the pool (O(1): the class keeps its lists as tensors and replaces them
  rather than writing them), so every step sees the same pool; that is part of the
  figure."""
  import torch  # pylint: disable=g-import-not-at-top
  ps, bs, mf = case.page_size, case.bs, case.max_frees
  alloc, impl, note = sglang_class(case.config.num_pages, ps)
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  t64 = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)
  cpu64 = lambda a: torch.as_tensor(np.asarray(a, np.int64))
  rng = np.random.default_rng(case.seed)
  # The finished requests' pages: held pages of the pool (taken untimed, once).
  per_row = -(-((case.len_lo + case.len_hi) // 2) // ps)
  taken = alloc.alloc(mf * per_row * ps)
  pages = (taken[::ps] // ps).reshape(mf, per_row)
  frees = [pages[i].clone() for i in range(mf)]
  # Decode rows: seq % ps == 1 for one row in ps (a new page), last_loc inside a held page.
  held = alloc.alloc(bs * ps)
  seq = ps * rng.integers(1, 8, bs) + rng.integers(2, ps + 2, bs)
  seq[::ps] = ps * rng.integers(1, 8, len(seq[::ps])) + 1
  if ps == 1:
    seq = rng.integers(2, 512, bs)
  last = (held[::ps] // ps).cpu().numpy() * ps + (seq - 2) % ps
  d_seq, d_seq_cpu, d_last = t64(seq), cpu64(seq), t64(last)
  e_pre = t64(np.zeros(mf)); e_pre_cpu = cpu64(np.zeros(mf))
  e_seq = t64(np.full(mf, case.prompt)); e_seq_cpu = cpu64(np.full(mf, case.prompt))
  e_last = t64(np.full(mf, -1))
  restore = _restorer(alloc)
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

  def step():
    restore()
    alloc.free_group_begin()
    for ids in frees:
      alloc.free_page_ids(ids)
    alloc.free_group_end()
    if case.extend:
      alloc.alloc_extend(e_pre, e_pre_cpu, e_seq, e_seq_cpu, e_last, mf * case.prompt)
    return alloc.alloc_decode(d_seq, d_seq_cpu, d_last)

  out = step()
  if out is None:
    raise RuntimeError(f"{impl}: the pool ran short")
  res = timing.host_time(step, sync=sync, min_time=min_time, reps=reps)
  return {"impl": impl, "note": note, "us": res["s"] * 1e6, "spread": res["spread"]}


# ---------------------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------------------

def _f(x) -> str:
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  return report.fmt_us(x)


def table_rows(results: List[Dict[str, Any]]) -> List[List[str]]:
  rows = []
  for r in results:
    guard = "on" if r.get("guard", True) else "off"
    if r.get("skipped"):
      rows.append([r["step"], str(r["bs"]), str(r["page_size"]), guard] + ["skipped"] * 8)
      continue
    share = r.get("step_share_us")
    target = TARGET_US[r["step"]]
    ok = all(r.get(f"{v}_ok", True) for v in ("calls", "step"))
    rows.append([r["step"], str(r["bs"]), str(r["page_size"]), guard, _f(r.get("none_us")),
                 _f(r.get("calls_share_us")), _f(share), _f(r.get("floor_share_us")),
                 _f(r.get("calls_kernels_us")), _f(r.get("step_kernels_us")),
                 _f(r.get("sglang", {}).get("us")),
                 ("yes" if share is not None and share <= target else "no")
                 + ("" if ok else " REFUSED")])
  return rows


HEADER = ["step", "bs", "ps", "guard", "stand-ins (us)", "share: calls", "share: step_rows",
          "floor: 1 launch", "kernels: calls", "kernels: step_rows", "SGLang eager",
          "step_rows <= target"]


def add_parser(sub) -> argparse.ArgumentParser:
  from jax_kvalloc.tools.cli import int_list  # pylint: disable=g-import-not-at-top
  p = sub.add_parser(
      "bench-table", help="the serving loop through the request table, in one jit",
      description=__doc__.split("\n\n")[0].replace("`jax-kvalloc bench-table`: ", "")
      + ". Prints per-step device time of the allocator's share for the decode step "
      "and the release + extend + decode step.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--batch-sizes", type=int_list, default=[64, 256, 1024], help="table rows")
  a("--page-sizes", type=int_list, default=[64, 16])
  a("--page-size", type=int, default=None, help="one page size (overrides --page-sizes)")
  a("--other-batch-sizes", type=int_list, default=[256],
    help="table rows at the page sizes after the first (their cases time step_rows and "
    "the stand-ins only)")
  a("--steps", default="decode,extend", help="which steps: decode, extend")
  a("--prompt", type=int, default=256, help="prefill tokens of a restarted request")
  a("--max-frees", type=int, default=8, help="rows released and restarted per step")
  a("--unroll", type=int, default=None, help="steps per loop iteration (default 8)")
  a("--min-time", type=float, default=None,
    help="seconds per measurement (default 0.03 on GPU/TPU, 0.02 on CPU)")
  a("--reps", type=int, default=3)
  a("--seed", type=int, default=0)
  a("--kernel", default="auto", help="the AllocatorConfig kernel of the pool")
  a("--guard", choices=("on", "off", "both"), default="on",
    help="the pool's ownership record (SPEC 14): both times every case with it and "
    "without it (guard=False), one after the other")
  a("--no-sglang", action="store_true", help="skip the SGLang eager class rows")
  a("--no-profile", action="store_true", help="skip the CUPTI kernel times (GPU)")
  a("--budget-s", type=float, default=None,
    help="stop starting new cases after this many seconds (the rest are marked skipped)")
  a("--json", metavar="FILE", help="also write the results as JSON")
  return p


def run_cli(args) -> int:
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  accel = jax.default_backend() != "cpu"
  unroll = args.unroll or 8
  min_time = args.min_time or (0.03 if accel else 0.02)
  page_sizes = [args.page_size] if args.page_size else args.page_sizes
  steps = [s.strip() for s in args.steps.split(",") if s.strip()]
  for s in steps:
    if s not in STEPS:
      raise SystemExit(f"--steps: {s!r} is not one of {STEPS}")
  t0 = time.perf_counter()
  results = []
  for i, ps in enumerate(page_sizes):  # the first page size's cases first (--budget-s)
    first = i == 0
    for step in steps:
      for bs, guard in [(b, g) for b in (args.batch_sizes if first else
                                         args.other_batch_sizes)
                        for g in {"on": (True,), "off": (False,),
                                  "both": (True, False)}[args.guard]]:
        case = TableCase(bs=bs, page_size=ps, prompt=args.prompt,
                         max_frees=args.max_frees, seed=args.seed,
                         extend=step == "extend", kernel=args.kernel, guard=guard)
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
          results.append({"step": step, "bs": bs, "page_size": ps, "guard": guard,
                          "skipped": True})
          continue
        r = run_case(case, unroll=unroll, min_time=min_time, reps=args.reps,
                     profile=not args.no_profile,
                     variants=VARIANTS if first else ("step", "none"))
        if not args.no_sglang and (guard or args.guard == "off"):
          try:
            r["sglang"] = sglang_step(case, min_time=min_time, reps=args.reps)
          except Exception as e:  # pylint: disable=broad-except
            r["sglang"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        results.append(r)
        print(f"  {step} bs={bs} ps={ps} guard={'on' if guard else 'off'}: " + ", ".join(
            f"{k}={v:.2f}" for k, v in r.items() if k.endswith("_us")), flush=True)
  d = jax.devices()[0]
  print(f"jax-kvalloc bench-table on {d.platform}:{getattr(d, 'device_kind', d)} (jax "
        f"{jax.__version__}); per step: release <= {args.max_frees} finished rows, "
        f"(extend step: extend them by {args.prompt} tokens,) decode every row; device "
        f"time per step in one fori_loop ({unroll} steps per iteration, median of "
        f"{args.reps}); {time.perf_counter() - t0:.0f} s")
  print(report.table(HEADER, table_rows(results)))
  notes = {r["sglang"].get("note") for r in results if "sglang" in r} - {None}
  print("share = variant - stand-ins (every table op replaced by a length update); "
        "floor = one empty Triton launch in the same loop; kernels = the jax_kvalloc "
        "kernels' own GPU time per step (CUPTI); SGLang has no request table: its "
        "column is the host time per step of the same work as eager class calls. "
        + " ".join(sorted(notes)))
  if args.json:
    report.write_json(args.json, {"results": results, "device": str(d),
                                  "jax": jax.__version__, "targets_us": TARGET_US,
                                  "elapsed_s": time.perf_counter() - t0})
    print(f"wrote {args.json}")
  return 0 if all(r.get("skipped") or (r.get("calls_ok", True) and r.get("step_ok", True))
                  for r in results) else 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_kvalloc.tools.bench_table")
  sub = parser.add_subparsers(dest="command")
  add_parser(sub)
  return run_cli(parser.parse_args(["bench-table"] + list(argv or [])))


if __name__ == "__main__":
  raise SystemExit(main(__import__("sys").argv[1:]))
