"""`jax-kvalloc bench serving`: whole serving steps.

N decode steps of a full batch, each step freeing the requests that finished in
the previous one (one free group) and allocating one slot per request (alloc_decode),
with the token table (SGLang's req_to_token) on the device: last_loc is gathered from
it, new slots are written to it. A row that reaches its target length restarts as a new
request, so the batch stays full and the pool never runs out. Columns:

  jit, jit_sync  one jitted call per step (state and table donated), host time per step:
                 waiting only at the end, or reading each step's `ok` (as a scheduler
                 must before it trusts the indices); jit_none: the step with the
                 allocator calls replaced by stand-ins
  scan, scan_*   the step chained in timing.chain_time (device time per step): scan_none
                 the stand-in step (scan - scan_none: what the allocator adds per step),
                 scan_pages the release by free_page_ids (request order, no sort),
                 scan_fused release_and_alloc_decode (one launch on GPU)
  torch, torch_sync  torch_ref eager, as SGLang's scheduler calls it (free_group_begin,
                 free, free_group_end, last_loc gather, alloc_decode, table write)

jit and torch run the same steps from the same state and must end with identical
tables, lengths and free lists (their outputs).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc.buckets import bucket
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import bench_kernels


@dataclasses.dataclass(eq=False)
class ServingCase:
  bs: int
  page_size: int
  num_pages: int
  max_frees: int
  target: np.ndarray      # i32[bs] length at which each row's request finishes
  seq0: np.ndarray        # i32[bs] initial lengths
  table0: np.ndarray      # i32[bs, ctx] initial token table
  free0: np.ndarray       # i32[num_free] initial free list, in order


def make_case(bs: int, page_size: int, steps: int, seed: int, len_lo: int = 64,
              len_hi: int = 1024) -> ServingCase:
  """Rows at random points of their lives, holding exactly the pages their tokens need;
  the free group sized for the most rows that finish in one step over `steps`."""
  if page_size < 2:
    raise ValueError("the serving-loop benchmark needs page_size >= 2 (alloc_decode)")
  rng = np.random.default_rng([seed, bs, page_size])
  ps = page_size
  target = rng.integers(len_lo, len_hi + 1, bs)
  seq0 = rng.integers(1, target)
  per_row = -(-len_hi // ps)
  num_pages = bs * per_row + 1024
  perm = (rng.permutation(num_pages) + 1).astype(np.int64)
  k = -(-seq0 // ps)   # row r holds the next k[r] pages of perm
  j = np.arange(per_row * ps)
  page = perm[np.minimum((np.cumsum(k) - k)[:, None] + j // ps, num_pages - 1)]
  table = np.where(j < k[:, None] * ps, page * ps + j % ps, 0)
  at = int(k.sum())
  seq, pending, most = seq0.copy(), np.zeros(bs, bool), 1
  for _ in range(steps + 64):
    seq[pending] = 0
    seq += 1
    pending = seq >= target
    most = max(most, int(pending.sum()))
  return ServingCase(bs, ps, num_pages, bucket(most, 8), target.astype(np.int32),
                     seq0.astype(np.int32), table.astype(np.int32),
                     perm[at:].astype(np.int32))


def _config(case: ServingCase) -> AllocatorConfig:
  return AllocatorConfig(size=case.num_pages * case.page_size, page_size=case.page_size)


def initial_carry(case: ServingCase):
  """(state, table, seq, target, pending, ok_so_far) at step 0; the ownership record
  holds the rows' pages (every page not on the free list)."""
  config = _config(case)
  s = jax.jit(st.init, static_argnums=0)(config)
  ring = np.pad(case.free0, (0, case.num_pages - case.free0.size))
  s = st.with_record(config, s._replace(free_ring=jnp.asarray(ring),
                                        free_len=jnp.asarray(case.free0.size, jnp.int32)))
  return (s, jnp.asarray(case.table0), jnp.asarray(case.seq0), jnp.asarray(case.target),
          jnp.zeros(case.bs, bool), jnp.ones((), bool))


RELEASES = ("sorted", "pages", "fused")


def finished_rows(pending: jax.Array, max_frees: int, rows: jax.Array):
  """(picked i32[max_frees], sel bool[bs], n i32[]): the first max_frees of the rows
  whose request finished (`pending`), compacted (padding 0), which ones, how many."""
  rank = jnp.cumsum(pending) - pending
  sel = pending & (rank < max_frees)
  picked = jnp.zeros(max_frees, jnp.int32).at[jnp.where(sel, rank, max_frees)].set(
      rows, mode="drop")
  return picked, sel, jnp.sum(sel).astype(jnp.int32)


def serve_step(config: AllocatorConfig, max_frees: int, carry, *, allocator: bool = True,
               release: str = "sorted"):
  """One decode step of the loop (pure). carry = (state, table, seq, target, pending,
  ok_so_far).

  allocator=False replaces the free and alloc_decode by stand-ins (slot = last_loc + 1,
  state unchanged). release: "sorted" (`free` of the finished rows' slots), "pages"
  (free_page_ids of their pages, request order, no sort), "fused" (the same pages through
  release_and_alloc_decode, one launch on GPU).
  """
  if release not in RELEASES:
    raise ValueError(f"release must be one of {RELEASES}, got {release!r}")
  state, table, seq, target, pending, ok_all = carry
  bs, ctx = table.shape
  ps = config.page_size
  rows = jnp.arange(bs, dtype=jnp.int32)
  picked, sel, n_free = finished_rows(pending, max_frees, rows)   # the free group
  if allocator:
    k = jnp.arange(-(-ctx // ps), dtype=jnp.int32)[None, :] * ps
    live = (jnp.arange(max_frees)[:, None] < n_free) & (k < seq[picked][:, None])
    idx = jnp.where(live, table[picked[:, None], jnp.minimum(k, ctx - 1)], 0).reshape(-1)
    page_ids = jnp.where(live.reshape(-1), idx // ps, 0)
    # Unconditional (an all-padding group frees nothing): a lax.cond may cost a
    # device-to-host read of its predicate on GPU, more than the free itself.
    if release == "pages":
      state = freeing.free_page_ids(config, state, page_ids)
    elif release == "sorted":
      state = freeing.free(config, state, idx)
  seq = jnp.where(sel, 0, seq)
  pending = pending & ~sel
  active = ~pending
  seq_new = jnp.where(active, seq + 1, 2)       # 2: needs no page (ps >= 2)
  last = table[rows, jnp.maximum(seq - 1, 0)]
  if not allocator:
    out, ok = last + 1, jnp.ones((), bool)
  elif release == "fused":  # the finished rows' pages freed in the same call
    state, out, ok = allocation.release_and_alloc_decode(config, state, page_ids,
                                                         seq_new, last)
  else:
    state, out, ok = allocation.alloc_decode(config, state, seq_new, last)
  table = table.at[jnp.where(active, rows, bs), seq_new - 1].set(out, mode="drop")
  seq = jnp.where(active, seq_new, seq)
  pending = pending | (active & (seq >= target))
  return state, table, seq, target, pending, ok_all & ok


def step_call(step, carry, x):
  """A serving step as a chained call of timing.chain_time: x (i32[], 0) is added to the
  lengths, so the link of the previous step's outputs reaches this step's inputs."""
  state, table, seq, *rest = carry
  carry = step((state, table, seq + x, *rest))
  state, table, seq, target, pending, ok = carry
  return carry, (seq, pending, ok, state.free_len, state.free_head)


VARIANTS = {"scan": {}, "scan_none": dict(allocator=False),
            "scan_pages": dict(release="pages"), "scan_fused": dict(release="fused")}


def _final(carry) -> tuple:
  """The parity point: table, lengths and free list (host copies)."""
  c = jax.device_get(carry)
  return (np.asarray(c[1]), np.asarray(c[2]), np.asarray(st.live_free_pages(c[0])))


@functools.lru_cache(maxsize=4)
def _jit_step(case: ServingCase, none: bool):
  return jax.jit(functools.partial(serve_step, _config(case), case.max_frees,
                                   allocator=not none), donate_argnums=0)


def jit_timed(case: ServingCase, o, *, sync: bool = False, none: bool = False) -> bench.Timed:
  """One jitted call per step; the output: the state after warmup + steps steps."""
  step = _jit_step(case, none)
  box = {"carry": step(initial_carry(case))}
  for _ in range(o.warmup + o.steps - 1):
    box["carry"] = step(box["carry"])
  guard.raise_if_refused(box["carry"][0])   # a refused release would time no work
  final = _final(box["carry"])

  def one():
    box["carry"] = step(box["carry"])
    if sync and not bool(box["carry"][5]):
      raise RuntimeError("the serving loop ran out of pages")
  return bench.host(one, lambda: jax.block_until_ready(box["carry"]), n=o.steps,
                    output=None if none else lambda: final)


def scan_timed(case: ServingCase, o, *, variant: str) -> bench.Timed:
  """The step chained; first run warmup + steps times in one loop, which must end with
  no refused release and no failed allocation (the chain times valid work)."""
  step = functools.partial(serve_step, _config(case), case.max_frees, **VARIANTS[variant])
  final = jax.jit(lambda c: jax.lax.fori_loop(0, o.warmup + o.steps, lambda _, c: step(c),
                                               c))(initial_carry(case))
  guard.raise_if_refused(final[0])
  if not bool(final[5]):
    raise RuntimeError("the serving loop ran out of pages")
  return bench.chained(lambda c, x: step_call(step, c, x), initial_carry(case),
                       jnp.zeros((), jnp.int32))


def torch_timed(case: ServingCase, o, *, sync: bool) -> bench.Timed:
  """The same loop through torch_ref's eager class, as SGLang's scheduler drives it."""
  torch, dev = bench.torch_device()
  import torch_ref  # pylint: disable=g-import-not-at-top
  ps = case.page_size
  alloc = torch_ref.PagedTokenToKVPoolAllocator(case.num_pages * ps, ps, None, dev, None,
                                                False)
  alloc.free_pages = torch.as_tensor(case.free0.astype(np.int64), device=dev)
  table = torch.tensor(case.table0, device=dev)  # a copy: the steps write it
  seq_cpu = torch.as_tensor(case.seq0.astype(np.int64))
  box = {"seq": seq_cpu.to(dev, copy=True), "pending": np.zeros(case.bs, bool)}
  rows = torch.arange(case.bs, device=dev)
  wait = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

  def step():
    done = np.flatnonzero(box["pending"])
    if done.size:
      alloc.free_group_begin()
      alloc.free(torch.cat([table[int(r), :int(seq_cpu[r])] for r in done]))
      alloc.free_group_end()
      seq_cpu[done] = 0
      box["seq"] = seq_cpu.to(dev, copy=True)
    seq_cpu.add_(1)
    seq = box["seq"].add_(1)
    out = alloc.alloc_decode(seq, seq_cpu, table[rows, (seq - 2).clamp_(min=0)])
    if out is None:
      raise RuntimeError("torch_ref alloc_decode failed in the serving loop")
    table[rows, seq - 1] = out.to(torch.int32)
    box["pending"] = seq_cpu.numpy() >= case.target
    if sync:
      wait()

  for _ in range(o.warmup + o.steps):
    step()
  final = (table.cpu().numpy().copy(), seq_cpu.numpy().astype(np.int32),
           alloc.free_pages.cpu().numpy().copy())
  return bench.host(step, wait, n=o.steps, output=lambda: final)


COLUMNS = {"jit": (jit_timed, {}), "jit_sync": (jit_timed, dict(sync=True)),
           "jit_none": (jit_timed, dict(none=True)),
           **{v: (scan_timed, dict(variant=v)) for v in VARIANTS},
           "torch": (torch_timed, dict(sync=False)),
           "torch_sync": (torch_timed, dict(sync=True))}


def cases(o):
  for bs in o.batch_sizes:
    case = functools.lru_cache(1)(lambda bs=bs: make_case(bs, o.page_size,
                                                          o.steps + o.warmup, o.seed))
    row = {"bs": bs, "page_size": o.page_size, "steps": o.steps}
    for impl, (timed, kw) in COLUMNS.items():
      yield bench.Case(row, impl, lambda c=case, t=timed, kw=kw: t(c(), o, **kw))


SERVING = bench.Suite(
    name="serving", help="a serving loop of decode steps (free group, alloc_decode, token "
    "table): jitted per step, chained in one loop, torch_ref eager",
    impls=tuple(COLUMNS),
    cases=cases, defaults=(("unroll", 8),),
    dims=(bench.Dim("--batch-sizes", [64, 256, 1024], "batch sizes", quick=[16]),
          bench.Dim("--page-size", 64, "page size (>= 2)"),
          bench.Dim("--steps", 1000, "timed steps per run", quick=50),
          bench.Dim("--warmup", 20, "steps before the parity point", quick=5),
          bench.Dim("--seed", 0, "seed of the initial lengths and pool")),
    render=bench_kernels.render)
