"""`jax-kvalloc bench-table`: the serving loop through the request table
(jax_kvalloc.request_table), all steps inside one jit, and the allocator's share per step.

Every table row is a request with a fixed target length; a row that reached it restarts
as a new request. One step, as a JAX engine would run it inside its jitted step:

  release   `release_rows` of the rows that finished last step (up to max_frees, one
            free_page_ids of their pages in row order, no sort);
  extend    `extend_rows` of those rows again with a fresh prompt (a prefill chunk);
  decode    `decode_rows` of every row (last_loc read from the table, a page appended
            where the token starts one).

The loop is timed with tools/timing.py's harness (`chain_time`: chained calls in one
`fori_loop`, slope per step). The same loop with some operations replaced by stand-ins
(which only move the lengths, as the bookkeeping of an engine would) gives the
allocator's share: "allocator us" = all real - all stand-ins, and the same difference for
each operation alone. SCAN_ALLOC_TARGET_US (jax-kvalloc bench) is the goal on the H200.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import timing

OPS = ("release", "extend", "decode")
TARGET_US = 5.0  # the GPU issue's goal for the allocator's part of a step in a scan


@dataclasses.dataclass(frozen=True)
class TableCase:
  bs: int                 # table rows, all decoding every step
  page_size: int
  prompt: int             # tokens of a restarted request's prefill
  len_lo: int = 64        # target lengths (tokens) are uniform in [len_lo, len_hi]
  len_hi: int = 1024
  max_frees: int = 8      # rows released (and restarted) per step at most
  seed: int = 0

  @property
  def max_pages_per_req(self) -> int:
    return -(-(self.len_hi + self.prompt + 1) // self.page_size)

  @property
  def config(self) -> AllocatorConfig:
    # Room for every row at its longest: the loop never runs short.
    return AllocatorConfig(size=(self.bs * self.max_pages_per_req + 8) * self.page_size,
                           page_size=self.page_size)


def initial_carry(case: TableCase):
  """(state, table, target, pending, ok): rows at random points of their lives."""
  cfg = case.config
  rng = np.random.default_rng([case.seed, case.bs, case.page_size])
  target = rng.integers(case.len_lo, case.len_hi + 1, case.bs).astype(np.int32)
  lens = rng.integers(1, target).astype(np.int32)
  state = st.init(cfg)
  table = rt.init_table(cfg, case.bs, case.max_pages_per_req)
  state, table, _, ok = jax.jit(functools.partial(rt.extend_rows, cfg,
                                                  max_tokens=int(lens.sum())))(
      state, table, jnp.arange(case.bs, dtype=jnp.int32), jnp.asarray(lens))
  if not bool(ok):
    raise RuntimeError("could not build the initial table")
  return (state, table, jnp.asarray(target), jnp.zeros(case.bs, bool), jnp.ones((), bool))


def table_step(case: TableCase, carry, inputs, *, real: Sequence[str] = OPS):
  """One step of the loop (pure): carry -> (carry, outputs). `inputs` is an i32[] zero
  (the timing harness's link). Operations not in `real` are stand-ins that only move
  the lengths."""
  cfg = case.config
  state, table, target, pending, ok_all = carry
  bs, mf = case.bs, case.max_frees
  rows = jnp.arange(bs, dtype=jnp.int32) + inputs
  # The rows that finished last step, compacted (up to max_frees of them).
  rank = jnp.cumsum(pending) - pending
  sel = pending & (rank < mf)
  picked = jnp.zeros(mf, jnp.int32).at[jnp.where(sel, rank, mf)].set(rows, mode="drop")
  n_free = jnp.sum(sel).astype(jnp.int32)
  oks = []
  if "release" in real:
    state, table, ok = rt.release_rows(cfg, state, table, picked, num_rows=n_free)
    oks.append(ok)
  else:
    table = table._replace(lens=jnp.where(sel, 0, table.lens))
  prompt = jnp.full((mf,), case.prompt, jnp.int32)
  if "extend" in real:
    state, table, ext, ok = rt.extend_rows(cfg, state, table, picked, prompt,
                                           max_tokens=mf * case.prompt, num_rows=n_free)
    oks.append(ok)
  else:
    table = table._replace(lens=jnp.where(sel, case.prompt, table.lens))
    ext = jnp.zeros((mf * case.prompt,), jnp.int32)
  if "decode" in real:
    state, table, dec, ok = rt.decode_rows(cfg, state, table, rows)
    oks.append(ok)
  else:
    table = table._replace(lens=table.lens + 1)
    dec = table.lens
  pending = (pending & ~sel) | (table.lens >= target)
  for ok in oks:
    ok_all = ok_all & ok
  # Outputs: what an engine would consume (slots for the K/V writes).
  return (state, table, target, pending, ok_all), (ext, dec)


def run_case(case: TableCase, *, unroll: int, min_time: float, reps: int) -> Dict[str, Any]:
  """Per-step device time of the loop with every operation real, none real, and each one
  alone real; the allocator's share from their differences."""
  variants = {"all": OPS, "none": ()}
  variants.update({op: (op,) for op in OPS})
  out: Dict[str, Any] = {"bs": case.bs, "page_size": case.page_size, "prompt": case.prompt,
                         "max_frees": case.max_frees}
  for name, real in variants.items():
    carry = initial_carry(case)
    call = functools.partial(table_step, case, real=real)
    res = timing.chain_time(call, carry, jnp.zeros((), jnp.int32), unroll=unroll,
                            min_time=min_time, reps=reps)
    out[f"{name}_us"] = res["s"] * 1e6
    if name == "all":
      out["spread"] = res["spread"]
      # The loop must never have been refused: check one long run's final flag.
      run = jax.jit(lambda c: jax.lax.fori_loop(0, 200, lambda _, c: call(
          c, jnp.zeros((), jnp.int32))[0], c))
      out["ok"] = bool(run(initial_carry(case))[-1])
  out["alloc_us"] = out["all_us"] - out["none_us"]
  for op in OPS:
    out[f"{op}_alloc_us"] = out[f"{op}_us"] - out["none_us"]
  return out


def table_rows(results: List[Dict[str, Any]]) -> List[List[str]]:
  rows = []
  for r in results:
    rows.append([str(r["bs"]), str(r["page_size"]), f"{r['all_us']:.1f}",
                 f"{r['none_us']:.1f}", f"{r['alloc_us']:.1f}",
                 f"{r['release_alloc_us']:.1f}", f"{r['extend_alloc_us']:.1f}",
                 f"{r['decode_alloc_us']:.1f}",
                 "yes" if r["alloc_us"] <= TARGET_US else "no",
                 "ok" if r["ok"] else "REFUSED"])
  return rows


HEADER = ["bs", "page_size", "step (us)", "stand-ins (us)", "allocator (us)",
          "release (us)", "extend (us)", "decode (us)", f"<= {TARGET_US:g} us", "check"]


def add_parser(sub) -> argparse.ArgumentParser:
  from jax_kvalloc.tools.cli import int_list  # pylint: disable=g-import-not-at-top
  p = sub.add_parser(
      "bench-table", help="the serving loop through the request table, in one jit",
      description=__doc__.split("\n\n")[0].replace("`jax-kvalloc bench-table`: ", "")
      + ". Prints per-step device time with every table operation real and with "
      "stand-ins, and the difference (the allocator's share).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--batch-sizes", type=int_list, default=[64, 256, 1024], help="table rows")
  a("--page-size", type=int, default=64)
  a("--prompt", type=int, default=256, help="prefill tokens of a restarted request")
  a("--max-frees", type=int, default=8, help="rows released and restarted per step")
  a("--unroll", type=int, default=None, help="steps per loop iteration (default 8)")
  a("--min-time", type=float, default=None,
    help="seconds per measurement (default 0.05 on GPU/TPU, 0.02 on CPU)")
  a("--reps", type=int, default=5)
  a("--seed", type=int, default=0)
  a("--json", metavar="FILE", help="also write the results as JSON")
  return p


def run_cli(args) -> int:
  from jax_kvalloc.tools import report  # pylint: disable=g-import-not-at-top
  accel = jax.default_backend() != "cpu"
  unroll = args.unroll or 8
  min_time = args.min_time or (0.05 if accel else 0.02)
  results = []
  for bs in args.batch_sizes:
    case = TableCase(bs=bs, page_size=args.page_size, prompt=args.prompt,
                     max_frees=args.max_frees, seed=args.seed)
    results.append(run_case(case, unroll=unroll, min_time=min_time, reps=args.reps))
  d = jax.devices()[0]
  print(f"jax-kvalloc bench-table on {d.platform}:{getattr(d, 'device_kind', d)} (jax "
        f"{jax.__version__}); per step: release <= {args.max_frees} finished rows, extend "
        f"them by {args.prompt} tokens, decode every row; device time per step in one "
        f"fori_loop ({unroll} steps per iteration, median of {args.reps})")
  print(report.table(HEADER, table_rows(results)))
  print("allocator = step - stand-ins (every table op replaced by a length update); "
        "release/extend/decode = that op alone real - stand-ins")
  if args.json:
    report.write_json(args.json, {"results": results})
    print(f"wrote {args.json}")
  return 0 if all(r["ok"] for r in results) else 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_kvalloc.tools.bench_table")
  sub = parser.add_subparsers(dest="command")
  add_parser(sub)
  return run_cli(parser.parse_args(["bench-table"] + list(argv or [])))


if __name__ == "__main__":
  raise SystemExit(main(__import__("sys").argv[1:]))
