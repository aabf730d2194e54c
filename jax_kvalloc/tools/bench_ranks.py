"""Data-parallel ranks over devices: time per step at a fixed load per rank.

    python -m jax_kvalloc.tools.bench_ranks --devices 1,2 --json benchmarks/ranks.json

For each device count n (a mesh of the first n devices, axis "dp") and each number of
ranks per device, the ranked state (jax_kvalloc.ranks) holds n * ranks_per_device ranks,
sharded over the mesh, and one step runs every rank's alloc_decode (or alloc_extend) as
a jitted shard_map. Every rank carries the same load whatever n is, so with perfect
scaling the time per step does not change with n: each device works on its own ranks
and the compiled program has no cross-device communication (checked on the timed
program, reported as `collectives`).

Timing is jax_kvalloc.tools.timing's chain harness: the calls are chained inside one
jitted loop. The step's outputs feed the next step inside the carry (decode: each row's
new slot is its next last_loc, its length grows by one; extend: the prefix grows by the
extension, the slots' max goes into a checksum), so nothing is dead, and the harness's
link has no outputs left to reduce (a reduction over a sharded output would add an
all-reduce to every call). As in the microbenchmarks (bench_micro), each step keeps the
free-list head the previous one returned but resets the free length, so the pool never
runs out and every step does the same work.

The baseline rows ("pool") time the single-pool function on one device with one rank's
load (no rank axis, no vmap, no shard_map): the cost of the rank machinery is the
difference with the 1-device, 1-rank row. With --need-sort the ranks run need_sort pools
(the merge branch present but not taken); the time should match need_sort off, since
the merge (a sort of the pool) runs only on a shortfall, also under vmap. With
--compare-select those rows are timed again with the merge as a plain `lax.cond`, which
vmap turns into a select that sorts every rank's pool on every step (what the allocator
did before jax_kvalloc.gated). Chained need_sort calls in one loop iteration (--unroll > 1)
also pay a copy of the rings between XLA's conditionals; --unroll 1 avoids it.

On CPU, force host devices first (they share the CPU's cores, so expect no scaling):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m jax_kvalloc.tools.bench_ranks
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import ranks
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import timing


@dataclasses.dataclass(frozen=True)
class Load:
  """One rank's work per step."""
  pages_per_rank: int = 1 << 16
  page_size: int = 16
  decode_rows: int = 64           # alloc_decode: rows per rank
  extend_rows: int = 8            # alloc_extend: rows per rank ...
  extend_tokens: int = 64         # ... each extended by this many tokens (page-aligned)


def _config(load: Load, dp: int, need_sort: bool, kernel: str) -> AllocatorConfig:
  return AllocatorConfig(size=dp * load.pages_per_rank * load.page_size,
                         page_size=load.page_size, need_sort=need_sort, kind="paged",
                         kernel=kernel, debug=False)


@contextlib.contextmanager
def plain_cond_merge():
  """For comparison only: the need_sort merge as a plain lax.cond (a select under vmap)."""
  def merge(config, state, shortfall):
    if not config.need_sort:
      return state
    return jax.lax.cond(shortfall & (state.release_len > 0),
                        lambda s: freeing.merge_and_sort_free(config, s), lambda s: s, state)
  saved, allocation.maybe_merge = allocation.maybe_merge, merge
  try:
    yield
  finally:
    allocation.maybe_merge = saved


def _steady(state: st.AllocatorState, free_len: jax.Array) -> st.AllocatorState:
  """Keeps the head the step moved, restores the free length: the pool never runs dry."""
  return state._replace(free_len=free_len)


def _decode_step(config: AllocatorConfig, carry):
  state, seq, last, check = carry
  full = state.free_len
  state, out, ok = allocation.alloc_decode(config, state, seq, last)
  # The new slot is the row's next last_loc; a refused step would give 0 (never here).
  return (_steady(state, full), seq + 1, out, check + ok.astype(jnp.int32))


def _extend_step(config: AllocatorConfig, load: Load, carry):
  state, pre, check = carry
  full = state.free_len
  seq = pre + load.extend_tokens
  last = jnp.full_like(pre, -1)  # prefixes stay page-aligned: last_loc is not read
  state, out, ok = allocation.alloc_extend(
      config, state, pre, seq, last, max_tokens=load.extend_rows * load.extend_tokens)
  return (_steady(state, full), seq, check + jnp.max(out) + ok.astype(jnp.int32))


def _rank_carry(load: Load, op: str, rank_state: st.AllocatorState):
  """The carry of one rank (or of a stack of ranks, via vmap) at step 0."""
  if op == "decode":
    # Row r holds 1 + r % ps tokens in page r + 1: rows reach a new page at staggered steps.
    r = jnp.arange(load.decode_rows, dtype=jnp.int32)
    seq = 2 + r % load.page_size
    last = (r + 1) * load.page_size + seq - 2
    return (rank_state, seq, last, jnp.zeros((), jnp.int32))
  pre = jnp.zeros((load.extend_rows,), jnp.int32)
  return (rank_state, pre, jnp.zeros((), jnp.int32))


def _step_fn(config: AllocatorConfig, load: Load, op: str):
  if op == "decode":
    return lambda c: _decode_step(config, c)
  return lambda c: _extend_step(config, load, c)


def time_ranks(load: Load, op: str, devices: Sequence[jax.Device], ranks_per_device: int,
               *, need_sort: bool, kernel: str, unroll: int, min_time: float,
               reps: int, select: bool = False) -> Dict[str, Any]:
  """µs per step of `op` on every rank, the ranks sharded over `devices` (select: the
  merge as a plain lax.cond, see plain_cond_merge)."""
  if select:
    with plain_cond_merge():
      row = time_ranks(load, op, devices, ranks_per_device, need_sort=need_sort,
                       kernel=kernel, unroll=unroll, min_time=min_time, reps=reps)
    return dict(row, select=True)
  n = len(devices)
  dp = n * ranks_per_device
  config = _config(load, dp, need_sort, kernel)
  rc = ranks.rank_config(config, dp)
  mesh = Mesh(np.array(devices), ("dp",))
  step = jax.vmap(_step_fn(rc, load, op))  # each device: its own ranks, one vmap
  sharded = ranks.shard(lambda *c: step(c), mesh, "dp")
  init = jax.vmap(lambda s: _rank_carry(load, op, s))(ranks.init_ranks(config, dp))
  carry = jax.device_put(init, ranks.rank_sharding(mesh, "dp"))
  call = lambda c, inputs: (tuple(sharded(*c)), ())
  res = timing.chain_time(call, carry, (), unroll=unroll, min_time=min_time, reps=reps)
  hlo = timing.chain_loop(call, unroll).lower(
      carry, (), timing.sink_init(call, carry, ()), np.int32(1)).compile().as_text()
  return {"op": op, "devices": n, "ranks_per_device": ranks_per_device, "ranks": dp,
          "need_sort": need_sort, "select": select, "us": res["s"] * 1e6, "spread": res["spread"],
          "collectives": ranks.collectives_in(hlo)}


def time_pool(load: Load, op: str, *, kernel: str, unroll: int, min_time: float,
              reps: int) -> Dict[str, Any]:
  """µs per step of one rank's load on a plain single pool (no rank axis)."""
  config = _config(load, 1, False, kernel)
  step = _step_fn(config, load, op)
  carry = _rank_carry(load, op, st.init(config))
  res = timing.chain_time(lambda c, i: (step(c), ()), carry, (), unroll=unroll,
                          min_time=min_time, reps=reps)
  return {"op": op, "devices": 1, "ranks_per_device": 0, "ranks": 0, "need_sort": False,
          "select": False, "us": res["s"] * 1e6, "spread": res["spread"], "collectives": {}}


def run(load: Load, device_counts: Sequence[int], ranks_per_device: Sequence[int],
        ops: Sequence[str], *, need_sort: bool, kernel: str, unroll: int, min_time: float,
        reps: int, compare_select: bool = False,
        on_row: Optional[Callable[[List[Dict[str, Any]]], None]] = None
        ) -> List[Dict[str, Any]]:
  """Every row; `on_row(rows so far)` after each (partial results survive a time limit)."""
  devices = jax.devices()
  rows = []

  def add(row):
    rows.append(row)
    print(_line(row), file=sys.stderr)
    if on_row is not None:
      on_row(rows)

  for op in ops:
    add(time_pool(load, op, kernel=kernel, unroll=unroll, min_time=min_time, reps=reps))
    for n in device_counts:
      if n > len(devices):
        print(f"skipping {n} devices: only {len(devices)} ({devices[0].platform})",
              file=sys.stderr)
        continue
      for r in ranks_per_device:
        variants = [(False, False)] + ([(True, False)] if need_sort else [])
        variants += [(True, True)] if compare_select else []
        for ns, select in variants:
          add(time_ranks(load, op, devices[:n], r, need_sort=ns, kernel=kernel,
                         unroll=unroll, min_time=min_time, reps=reps, select=select))
  return rows


def _line(row: Dict[str, Any]) -> str:
  who = ("pool (no ranks)" if not row["ranks"] else
         f"{row['devices']} dev x {row['ranks_per_device']} rank(s)")
  coll = ", ".join(f"{k} x{v}" for k, v in row["collectives"].items()) or "none"
  sort = ("on, plain cond" if row.get("select") else "on") if row["need_sort"] else "off"
  return (f"| {row['op']} | {who} | {sort} | "
          f"{row['us']:.1f} | {row['spread']:.2f} | {coll} |")


def table(rows: Sequence[Dict[str, Any]], load: Load, platform: str) -> str:
  """A markdown table of the rows."""
  head = (f"{platform}: {load.pages_per_rank} pages of {load.page_size} per rank; decode "
          f"{load.decode_rows} rows/rank, extend {load.extend_rows} rows x "
          f"{load.extend_tokens} tokens/rank\n\n"
          "| op | placement | need_sort | us/step | spread | collectives |\n"
          "|---|---|---|---|---|---|")
  return "\n".join([head] + [_line(r) for r in rows])


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", default="1,2", help="device counts, e.g. 1,2")
  p.add_argument("--ranks-per-device", default="1,4")
  p.add_argument("--ops", default="decode,extend")
  p.add_argument("--pages-per-rank", type=int, default=Load.pages_per_rank)
  p.add_argument("--page-size", type=int, default=Load.page_size)
  p.add_argument("--decode-rows", type=int, default=Load.decode_rows)
  p.add_argument("--extend-rows", type=int, default=Load.extend_rows)
  p.add_argument("--extend-tokens", type=int, default=Load.extend_tokens)
  p.add_argument("--need-sort", action="store_true",
                 help="also time need_sort pools (the merge branch, never taken)")
  p.add_argument("--compare-select", action="store_true",
                 help="also time need_sort ranks with the merge as a plain lax.cond")
  p.add_argument("--kernel", default="auto")
  p.add_argument("--unroll", type=int, default=8)
  p.add_argument("--min-time", type=float, default=0.05)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", help="write the rows (and the load) to this file")
  a = p.parse_args(argv)
  if a.extend_tokens % a.page_size:
    p.error("--extend-tokens must be a multiple of --page-size (page-aligned prefixes)")
  load = Load(a.pages_per_rank, a.page_size, a.decode_rows, a.extend_rows, a.extend_tokens)
  ints = lambda s: [int(x) for x in s.split(",") if x]
  platform = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, jax {jax.__version__})"

  def save(rows):
    if a.json:
      with open(a.json, "w") as f:
        json.dump({"platform": platform, "load": dataclasses.asdict(load), "rows": rows}, f,
                  indent=1)

  rows = run(load, ints(a.devices), ints(a.ranks_per_device), a.ops.split(","),
             need_sort=a.need_sort, kernel=a.kernel, unroll=a.unroll,
             min_time=a.min_time, reps=a.reps, compare_select=a.compare_select,
             on_row=save)
  print(table(rows, load, platform))
  return 0


if __name__ == "__main__":
  sys.exit(main())
