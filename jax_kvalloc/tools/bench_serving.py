"""The serving-loop benchmark of `jax-kvalloc bench`: N decode steps of a running batch,
each step freeing the requests that finished in the previous one (one free group) and
allocating one slot per request (alloc_decode), with the token table (SGLang's
req_to_token) on the device: last_loc is gathered from it, new slots are written to it,
and finished rows are freed from it.

Every row is a request with a fixed target length that restarts (as a new request)
after it finishes, so the batch stays full and the pool never runs out. Three ways:

  jit/step   one jitted call per step (state and table donated), as a scheduler would
             call it; per-step wall time, async (synchronizing only at the end) and
             synchronizing once per step (reading the step's `ok` on the host, as a
             scheduler must before it trusts the indices);
  scan       all steps inside one `fori_loop` (device time per step, the harness of
             jax_kvalloc.tools.timing), and the same loop with the allocator calls
             replaced by stand-ins: the difference is what the allocator adds per step;
  torch_ref  eager, the way SGLang calls it: host seq_lens, free_group_begin, free of the
             finished rows' slots, free_group_end, last_loc gather, alloc_decode, write;
             async and synchronizing once per step (torch.cuda.synchronize).

Every per-step wall time is the median over runs, for JAX and torch alike; the headline
ratio is the synchronizing one.

Both sides run the same steps from the same state; their final tables, lengths and free
lists must be identical (a parity check of the whole loop).
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc.tools import timing as bt
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc.buckets import bucket
from jax_kvalloc.config import AllocatorConfig


@dataclasses.dataclass
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
  """Rows at random points of their lives, holding exactly the pages their tokens need."""
  if page_size < 2:
    raise ValueError("the serving-loop benchmark needs page_size >= 2 (alloc_decode)")
  rng = np.random.default_rng([seed, bs, page_size])
  ps = page_size
  target = rng.integers(len_lo, len_hi + 1, bs)
  seq0 = rng.integers(1, target)
  per_row = -(-len_hi // ps)
  num_pages = bs * per_row + 1024
  perm = (rng.permutation(num_pages) + 1).astype(np.int64)
  ctx = per_row * ps
  table = np.zeros((bs, ctx), np.int64)
  at = 0
  j = np.arange(ctx)
  for r in range(bs):
    k = -(-int(seq0[r]) // ps)
    pages = perm[at:at + k]
    at += k
    table[r, :k * ps] = pages[j[:k * ps] // ps] * ps + j[:k * ps] % ps
  # The most rows that finish in one step over the run sizes the free group.
  seq, pending, most = seq0.copy(), np.zeros(bs, bool), 1
  for _ in range(steps + 64):
    seq[pending] = 0
    pending[:] = False
    seq += 1
    pending = seq >= target
    most = max(most, int(pending.sum()))
  return ServingCase(bs, ps, num_pages, bucket(most, 8), target.astype(np.int32),
                     seq0.astype(np.int32), table.astype(np.int32),
                     perm[at:].astype(np.int32))


def _config(case: ServingCase) -> AllocatorConfig:
  return AllocatorConfig(size=case.num_pages * case.page_size, page_size=case.page_size)


def initial_carry(case: ServingCase):
  cfg = _config(case)
  s = jax.jit(st.init, static_argnums=0)(cfg)
  n = case.num_pages
  ring = np.zeros(n, np.int32)
  ring[:case.free0.size] = case.free0
  s = s._replace(free_ring=jnp.asarray(ring), free_len=jnp.asarray(case.free0.size,
                                                                  jnp.int32))
  s = st.with_record(cfg, s)  # the table's pages are held: their frees are valid
  return (s, jnp.asarray(case.table0), jnp.asarray(case.seq0), jnp.asarray(case.target),
          jnp.zeros(case.bs, bool), jnp.ones((), bool))


RELEASES = ("sorted", "pages", "fused")


def serve_step(config: AllocatorConfig, max_frees: int, carry, *, alloc: bool = True,
               free: bool = True, extra: str = "", release: str = "sorted"):
  """One decode step of the loop (pure). carry = (state, table, seq, target, pending,
  ok_so_far).

  alloc=False / free=False replace alloc_decode / free by stand-ins (slot = last_loc + 1,
  state unchanged): the bookkeeping-only baseline. release: how the finished rows go
  back: "sorted" (`free` of their slots: sorted unique pages), "pages" (free_page_ids of
  their pages, in request order, no sort), "fused" (the same pages through
  release_and_alloc_decode: the release and the alloc_decode in one call, one kernel
  launch on GPU). extra="alloc" / "free" runs one more
  alloc_decode / free per step on the same inputs against a dummy state carried as a 7th
  carry element (see `extra_carry`), so the difference from the plain step is what one
  call of it costs in this loop; its inputs get the harness link of the dummy state
  (timing.link: 0, but unknown to XLA) so that XLA cannot share work between the two
  calls, and its outputs stay in the carry.
  """
  if release not in RELEASES:
    raise ValueError(f"release must be one of {RELEASES}, got {release!r}")
  dummy = None
  if extra:
    *carry, dummy = carry
  state, table, seq, target, pending, ok_all = carry
  bs, ctx = table.shape
  ps = config.page_size
  rows = jnp.arange(bs, dtype=jnp.int32)
  dep = lambda: bt.link((dummy[0].free_head, dummy[0].free_len, dummy[1]))
  # Free group: up to max_frees rows that finished last step, one slot per page.
  rank = jnp.cumsum(pending) - pending
  sel = pending & (rank < max_frees)
  picked = jnp.zeros(max_frees, jnp.int32).at[jnp.where(sel, rank, max_frees)].set(
      rows, mode="drop")
  n_free = jnp.sum(sel)
  page_ids = None  # release="fused": freed together with the alloc_decode below
  if free:
    k = jnp.arange(-(-ctx // ps), dtype=jnp.int32)[None, :] * ps
    live = (jnp.arange(max_frees)[:, None] < n_free) & (k < seq[picked][:, None])
    idx = jnp.where(live, table[picked[:, None], jnp.minimum(k, ctx - 1)], 0).reshape(-1)
    if extra == "free":
      d = freeing.free(config, dummy[0], idx + dep())
      dummy = (dummy[0]._replace(free_ring=d.free_ring, free_head=d.free_head),
               (d.free_len,))
    # Unconditional (an all-padding group frees nothing): a lax.cond may cost a
    # device-to-host read of its predicate on GPU, more than the free itself.
    if release in ("pages", "fused"):
      page_ids = jnp.where(live.reshape(-1), idx // ps, 0)
      if release == "pages" or not alloc:
        state = freeing.free_page_ids(config, state, page_ids)
    else:
      state = freeing.free(config, state, idx)
  seq = jnp.where(sel, 0, seq)
  pending = pending & ~sel
  active = ~pending
  seq_new = jnp.where(active, seq + 1, 2)       # 2: needs no page (ps >= 2)
  last = table[rows, jnp.maximum(seq - 1, 0)]
  if alloc:
    if extra == "alloc":
      d, out2, ok2 = allocation.alloc_decode(config, dummy[0], seq_new + dep(), last)
      dummy = (dummy[0]._replace(free_head=d.free_head), (out2, ok2, d.free_len))
    if release == "fused" and page_ids is not None:
      state, out, ok = allocation.release_and_alloc_decode(config, state, page_ids,
                                                           seq_new, last)
    else:
      state, out, ok = allocation.alloc_decode(config, state, seq_new, last)
  else:
    out, ok = last + 1, jnp.ones((), bool)
  table = table.at[jnp.where(active, rows, bs), seq_new - 1].set(out, mode="drop")
  seq = jnp.where(active, seq_new, seq)
  pending = pending | (active & (seq >= target))
  out_carry = (state, table, seq, target, pending, ok_all & ok)
  return out_carry + ((dummy,) if extra else ())


def extra_carry(case: ServingCase, extra: str):
  """The 7th carry element for serve_step(extra=...): a dummy pool that never runs out
  (its free length stays fixed: full for alloc, empty for free) and the extra indices."""
  s = jax.jit(st.init, static_argnums=0)(_config(case))
  zero = jnp.zeros((), jnp.int32)
  if extra == "free":
    full = st.with_record(_config(case), s._replace(free_len=zero))  # every page held
    return initial_carry(case) + ((full, (zero,)),)
  return initial_carry(case) + ((s, (jnp.zeros(case.bs, jnp.int32), jnp.ones((), bool),
                                     zero)),)


def _per_step_host(jit_step, carry, steps: int, *, sync: bool):
  """(seconds per step, final carry) of `steps` calls from Python, reading each step's
  ok on the host (sync) or synchronizing only at the end. The carry is donated: use the
  one returned."""
  t0 = time.perf_counter()
  for _ in range(steps):
    carry = jit_step(carry)
    if sync and not bool(carry[5]):
      raise RuntimeError("the serving loop ran out of pages")
  jax.block_until_ready(carry)
  return (time.perf_counter() - t0) / steps, carry


def _median_per_step(jit_step, carry, steps: int, *, sync: bool, runs: int = 3):
  """(median seconds per step over `runs` runs, final carry)."""
  times = []
  for _ in range(runs):
    t, carry = _per_step_host(jit_step, carry, steps, sync=sync)
    times.append(t)
  return statistics.median(times), carry


def _step_call(step, carry, x):
  """A serving step as a chained call of timing.chain_time: x (i32[], 0) is added to the
  lengths, so the link of the previous step's outputs reaches this step's inputs."""
  state, table, seq, *rest = carry
  carry = step((state, table, seq + x, *rest))
  state, table, seq, target, pending, ok, *extra = carry
  return carry, (seq, pending, ok, state.free_len, state.free_head) + tuple(
      jax.tree_util.tree_leaves(extra))


def run_jax(case: ServingCase, steps: int, warmup: int, *, unroll: int, min_time: float,
            reps: int) -> Dict[str, Any]:
  """jit/step (async, syncing once per step, bookkeeping-only) and the scan variants;
  also the final table, lengths and free list after warmup + steps steps (parity)."""
  cfg = _config(case)
  jit_step = jax.jit(functools.partial(serve_step, cfg, case.max_frees), donate_argnums=0)
  t0 = time.perf_counter()
  carry = jax.block_until_ready(jit_step(initial_carry(case)))
  compile_s = time.perf_counter() - t0
  for _ in range(warmup - 1):
    carry = jit_step(carry)
  _, carry = _per_step_host(jit_step, carry, steps, sync=False)
  final = jax.device_get(carry)   # after warmup + steps steps: the parity point
  async_s, carry = _median_per_step(jit_step, carry, steps, sync=False)
  sync_s, carry = _median_per_step(jit_step, carry, steps, sync=True)
  jit_base = jax.jit(functools.partial(serve_step, cfg, case.max_frees, alloc=False,
                                       free=False), donate_argnums=0)
  base_s, _ = _median_per_step(jit_base, jit_base(initial_carry(case)), steps, sync=False)
  out = {"jit_step_us": async_s * 1e6, "jit_step_sync_us": sync_s * 1e6,
         "jit_step_baseline_us": base_s * 1e6, "compile_s": compile_s,
         "ok": bool(final[5]), "table": final[1], "seq": final[2],
         "free_pages": st.live_free_pages(final[0])}
  variants = {"": {}, "_baseline": dict(alloc=False, free=False),
              "_extra_alloc": dict(extra="alloc"), "_extra_free": dict(extra="free"),
              "_pages": dict(release="pages"), "_fused": dict(release="fused")}
  for name, flags in variants.items():
    carry0 = extra_carry(case, flags["extra"]) if "extra" in flags else initial_carry(case)
    step = functools.partial(serve_step, cfg, case.max_frees, **flags)
    # The whole step is the chained call; its carry is its output (all consumed: the
    # link reduces the new lengths, table and flags into the next step's inputs).
    res = bt.chain_time(lambda c, x: _step_call(step, c, x), carry0, jnp.zeros((), jnp.int32),
                        unroll=unroll, min_time=min_time, reps=reps)
    out[f"scan{name}_us"] = res["s"] * 1e6
    if not name:
      out["scan_spread"] = res["spread"]
  out["scan_alloc_us"] = out["scan_us"] - out["scan_baseline_us"]
  out["scan_alloc_pages_us"] = out["scan_pages_us"] - out["scan_baseline_us"]
  out["scan_alloc_fused_us"] = out["scan_fused_us"] - out["scan_baseline_us"]
  return out


def run_torch(case: ServingCase, steps: int, warmup: int) -> Dict[str, Any]:
  """The same loop through torch_ref, eager, as SGLang's scheduler drives its allocator."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch_ref  # pylint: disable=g-import-not-at-top
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  ps = case.page_size
  alloc = torch_ref.PagedTokenToKVPoolAllocator(case.num_pages * ps, ps, None, dev, None,
                                                False)
  alloc.free_pages = torch.as_tensor(case.free0.astype(np.int64), device=dev)
  table = torch.as_tensor(case.table0, device=dev)
  seq_cpu = torch.as_tensor(case.seq0.astype(np.int64))
  seq = seq_cpu.to(dev, copy=True)
  target = case.target.astype(np.int64)
  pending = np.zeros(case.bs, bool)
  rows = torch.arange(case.bs, device=dev)
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  def step():
    nonlocal seq, pending
    done = np.flatnonzero(pending)
    if done.size:
      alloc.free_group_begin()
      alloc.free(torch.cat([table[int(r), :int(seq_cpu[r])] for r in done]))
      alloc.free_group_end()
      seq_cpu[done] = 0
      seq = seq_cpu.to(dev, copy=True)
      pending[done] = False
    seq_cpu.add_(1)
    seq.add_(1)
    last = table[rows, (seq - 2).clamp_(min=0)]
    out = alloc.alloc_decode(seq, seq_cpu, last)
    if out is None:
      raise RuntimeError("torch_ref alloc_decode failed in the serving loop")
    table[rows, seq - 1] = out.to(torch.int32)
    pending = seq_cpu.numpy() >= target

  def per_step(n: int, sync_each: bool) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
      step()
      if sync_each:
        sync()
    sync()
    return (time.perf_counter() - t0) / n

  for _ in range(warmup):
    step()
  sync()
  per_step(steps, False)
  # The parity point (copies: on CPU .cpu() is the tensor itself, which later steps change).
  result = {"table": table.cpu().numpy().copy(), "seq": seq_cpu.numpy().astype(np.int32),
            "free_pages": alloc.free_pages.cpu().numpy().copy()}
  result["torch_step_us"] = statistics.median(per_step(steps, False)
                                              for _ in range(3)) * 1e6
  result["torch_step_sync_us"] = statistics.median(per_step(steps, True)
                                                   for _ in range(3)) * 1e6
  result["method"] = "eager torch_ref calls" + (" (Triton kernels)" if cuda else " (CPU)")
  return result


def run(*, batch_sizes, page_size: int, steps: int, warmup: int, unroll: int,
        min_time: float, reps: int, seed: int, torch_on: bool, progress=None):
  rows = []
  for bs in batch_sizes:
    case = make_case(bs, page_size, steps + warmup, seed)
    if progress:
      progress(f"serving bs={bs} jax")
    row: Dict[str, Any] = {"bs": bs, "page_size": page_size, "steps": steps,
                           "max_frees": case.max_frees, "num_pages": case.num_pages}
    jx = run_jax(case, steps, warmup, unroll=unroll, min_time=min_time, reps=reps)
    row.update({k: v for k, v in jx.items() if k not in ("table", "seq", "free_pages")})
    row["parity"] = "jax only"
    if torch_on:
      if progress:
        progress(f"serving bs={bs} torch_ref")
      try:
        tr = run_torch(case, steps, warmup)
        row["torch_step_us"] = tr["torch_step_us"]
        row["torch_step_sync_us"] = tr["torch_step_sync_us"]
        row["torch_method"] = tr["method"]
        same = (np.array_equal(jx["table"], tr["table"]) and
                np.array_equal(jx["seq"], tr["seq"]) and
                np.array_equal(np.asarray(jx["free_pages"], np.int64),
                               np.asarray(tr["free_pages"], np.int64)))
        row["parity"] = "identical" if same else "MISMATCH"
      except Exception as e:  # pylint: disable=broad-except
        row["torch_error"] = f"{type(e).__name__}: {e}"[:300]
    rows.append(row)
  return rows
