"""The paged `free`'s two ways to the sorted unique pages, timed (issue 13 item 2).

    python benchmarks/free_methods_gpu.py --json $OUT/free_methods.json   # the H200
    python benchmarks/free_methods_gpu.py --small                         # CPU, < 1 min

For each case (page size, pool slots, M slots freed; free_index = every slot of M / ps
random held pages, shuffled, like `jax-kvalloc bench`'s free case) it times, per call,
in the project's harness (jax_kvalloc.tools.timing.chain_time: calls chained in one jit,
every output consumed, linked to the next call's inputs):

  free sort / free bitmap / free pallas / free auto
                                        freeing.PAGED_FREE[...](cfg, state, free_index),
                                        auto: freeing.free
                                        (the carry keeps the new ring and head, the free
                                        length stays fixed, as bench_micro's free case);
                                        pallas: the Triton kernels of
                                        pallas_kernels.triton_free, which also write the
                                        ring (in Pallas' interpreter on CPU); auto: the
                                        kernels on a GPU, the sort/bitmap rule on CPU
  pages sort / pages bitmap
                                        the page computation alone: free_index // ps,
                                        then freeing.free_pages_sorted_unique
  free bitmap/blocked, pages bitmap/blocked
                                        the bitmap with its prefix sum over the u32 words
                                        (jnp.cumsum: a reduce-window tree in jax <= 0.11,
                                        chlo.scan in 0.12) replaced by `blocked_prefix`
                                        (three reductions, exact int32, the same kernels
                                        on every jax version): which one `freeing` should
                                        keep
  floor                                 the harness's own cost at free's output shapes

Before timing, both methods' (values, count) and states are checked to be equal. It also
prints the kernels of the compiled programs (fusions, custom calls, sorts, scatters, ...
of the ENTRY computation) of each method at the kernel-count case (M = 32768; with
--small, the largest small M), and writes everything to --json.
"""
import argparse
import contextlib
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import freeing
from jax_kvalloc import kernels as kernel_paths
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import timing

# (page_size, pool slots, M): page size 64 over 2**24 slots (262144 pages); page size 1
# over 2**20 slots.
CASES = [(64, 2**24, m) for m in (8192, 32768, 65536, 262144)] + [(1, 2**20, 8192)]
SMALL_CASES = [(64, 2**16, 512), (64, 2**16, 4096), (1, 2**12, 512)]
KERNEL_M = 32768
METHODS = ("sort", "bitmap")

LAUNCH = re.compile(r"= [^=]*? (fusion|custom-call|gather|scatter|sort|reduce|copy|"
                    r"dynamic-update-slice|dynamic-slice|while|conditional|call)\(")


def blocked_prefix(x: jax.Array) -> jax.Array:
  """i32[W] -> i32[W] exclusive prefix sum in three reductions, no scan: blocks of k
  entries; each block's total (a reduction), the totals before each block (a masked
  [B, B] reduction), the entries before each one within its block (a masked [B, k, k]
  reduction). k balances B**2 against W * k (B = W / k ~ (W**2 / 2) ** (1/3))."""
  w = x.shape[0]
  b = max(1, round((w * w / 2) ** (1 / 3)))
  k = -(-w // b)
  b = -(-w // k)
  xb = jnp.pad(x, (0, b * k - w)).reshape(b, k)
  tot = jnp.sum(xb, axis=1)
  j = jnp.arange(b)
  blk = jnp.sum(jnp.where(j[None, :] < j[:, None], tot[None, :], 0), axis=1)
  i = jnp.arange(k)
  within = jnp.sum(jnp.where(i[None, None, :] < i[None, :, None], xb[:, None, :], 0),
                   axis=2)
  return (blk[:, None] + within).reshape(-1)[:w]


@contextlib.contextmanager
def prefix(kind: str):
  """Traces inside use freeing's own prefix sum ("cumsum") or `blocked_prefix`."""
  saved = freeing._exclusive_prefix  # pylint: disable=protected-access
  if kind == "blocked":
    freeing._exclusive_prefix = blocked_prefix  # pylint: disable=protected-access
  try:
    yield
  finally:
    freeing._exclusive_prefix = saved  # pylint: disable=protected-access


def kernels(compiled_text: str):
  """(count, {op: count}, the launching lines) of a compiled program's ENTRY."""
  body = compiled_text[compiled_text.index("ENTRY"):]
  lines = [l.strip() for l in body.splitlines() if LAUNCH.search(l)]
  ops = [LAUNCH.search(l).group(1) for l in lines]
  return len(ops), {k: ops.count(k) for k in sorted(set(ops))}, lines


def make_case(ps: int, slots: int, m: int, seed: int = 0):
  """(config, state, free_index): a shuffled pool whose first m // ps pages are held,
  and every slot of those pages, shuffled."""
  cfg = AllocatorConfig(size=slots, page_size=ps, debug=False)
  n = cfg.num_pages
  if m % ps or m // ps > n:
    raise ValueError(f"M={m} is not a whole number of pages of {ps} within {n} pages")
  rng = np.random.default_rng([seed, ps, slots, m])
  ring = (rng.permutation(n) + 1).astype(np.int32)
  held = m // ps
  state = st.init(cfg)._replace(free_ring=jnp.asarray(ring),
                                free_head=jnp.asarray(held % n, jnp.int32),
                                free_len=jnp.asarray(n - held, jnp.int32))
  free_index = (ring[:held, None].astype(np.int64) * ps + np.arange(ps)).reshape(-1)
  return cfg, state, jnp.asarray(rng.permutation(free_index).astype(np.int32))


def concrete(method: str) -> str:
  """The key of freeing.PAGED_FREE to run: "pallas" is the Triton kernels, in Pallas'
  interpreter on CPU (they compile for a GPU only)."""
  if method == "pallas":
    return "triton_interpret" if jax.default_backend() == "cpu" else "triton"
  return method


def free_fn(cfg: AllocatorConfig, method: str):
  """free(state, free_index) of one implementation; "auto": freeing.free itself."""
  if method == "auto":
    return functools.partial(freeing.free, cfg)
  return functools.partial(freeing.PAGED_FREE[concrete(method)], cfg)


def auto_runs(cfg: AllocatorConfig, m: int) -> str:
  """The implementation freeing.free runs for a pool on the default device."""
  return kernel_paths.by_device(
      cfg.kernel, jnp.zeros((1,), jnp.int32),
      lambda name: freeing.paged_free_implementation(cfg, name, m))


def free_call(cfg: AllocatorConfig, method: str):
  """bench_micro's chained free: the carry keeps the new ring and head, not the length."""
  fn = free_fn(cfg, method)

  def call(state, free_index):
    res = fn(state, free_index)
    return (state._replace(free_ring=res.free_ring, free_head=res.free_head),
            (res.free_head, res.free_len))
  return call


def pages_fn(cfg: AllocatorConfig, method: str):
  """The page computation of the paged XLA `free` alone (free_index // ps included)."""

  def fn(free_index):
    pages = jnp.where(free_index >= 0, free_index // cfg.page_size, 0)
    return freeing.free_pages_sorted_unique(pages, cfg.num_pages, method)
  return fn


VARIANTS = (("sort", "cumsum"), ("bitmap", "cumsum"), ("bitmap", "blocked"),
            ("pallas", "cumsum"))


def check(cfg, state, free_index):
  """Every variant gives the same (values, count) and the same state; raises otherwise."""
  got, states = [], []
  for meth, kind in VARIANTS:
    with prefix(kind):
      if meth != "pallas":  # the kernels write the ring: no pages alone
        got.append(jax.jit(pages_fn(cfg, meth))(free_index))
      states.append(jax.jit(free_fn(cfg, meth))(state, free_index))
  want = np.unique(np.asarray(free_index) // cfg.page_size)
  count = int(got[0][1])
  if count != want.size or not np.array_equal(np.asarray(got[0][0])[:count], want):
    raise AssertionError("the sorted unique pages differ from numpy's")
  for other in got[1:]:
    for a, b in zip(got[0], other):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for other_state in states[1:]:
    jax.tree.map(np.testing.assert_array_equal, states[0], other_state)


def variant_name(what: str, meth: str, kind: str) -> str:
  return f"{what} {meth}" + ("/blocked" if kind == "blocked" else "")


def time_case(ps, slots, m, *, unroll, min_time, reps, log):
  cfg, state, free_index = make_case(ps, slots, m)
  n = cfg.num_pages
  check(cfg, state, free_index)
  rec = {"page_size": ps, "pool_slots": slots, "num_pages": n, "M": m,
         "pages_freed": m // ps, "auto": auto_runs(cfg, m), "us": {},
         "spread": {}, "min_us": {}}
  runs = [(variant_name("free", meth, kind), kind, free_call(cfg, meth), state)
          for meth, kind in VARIANTS]
  runs.append(("free auto", "cumsum", free_call(cfg, "auto"), state))
  for meth, kind in VARIANTS:
    if meth == "pallas":
      continue
    fn = pages_fn(cfg, meth)
    runs.append((variant_name("pages", meth, kind), kind, lambda c, x, fn=fn: (c, fn(x)),
                 jnp.zeros((), jnp.int32)))
  for name, kind, call, carry in runs:
    with prefix(kind):
      res = timing.chain_time(call, carry, free_index, unroll=unroll, min_time=min_time,
                              reps=reps)
    rec["us"][name] = res["s"] * 1e6
    rec["spread"][name] = res["spread"]
    rec["min_us"][name] = res["min_s"] * 1e6
    log(f"  {name:22s} {res['s'] * 1e6:9.2f} us  (spread {res['spread']:.2f}, "
        f"compile {res['compile_s']:.1f} s)")
  outs = jax.eval_shape(free_call(cfg, "sort"), state, free_index)[1]
  res = timing.floor_time(outs, free_index, unroll=unroll, min_time=min_time, reps=reps)
  rec["us"]["floor"] = res["s"] * 1e6
  rec["spread"]["floor"] = res["spread"]
  return rec


def kernel_counts(ps, slots, m, log):
  cfg, state, free_index = make_case(ps, slots, m)
  out = {"page_size": ps, "pool_slots": slots, "M": m}
  for meth, kind in VARIANTS:
    for what, fn, args in (
        ("free", free_fn(cfg, meth), (state, free_index)),
        ("pages", pages_fn(cfg, meth), (free_index,))):
      if what == "pages" and meth == "pallas":
        continue
      with prefix(kind):
        count, by_op, lines = kernels(jax.jit(fn).lower(*args).compile().as_text())
      name = variant_name(what, meth, kind)
      out[name] = {"kernels": count, "by_op": by_op, "lines": lines}
      log(f"  {name:22s} {count:3d} kernels {by_op}")
  return out


# (SLOT_BLOCK, PAGE_BLOCK, NUM_WARPS) of pallas_kernels.triton_free tried by --sweep-blocks
# (the module's defaults first).
BLOCK_CONFIGS = ((2048, 4096, 4), (1024, 4096, 4), (4096, 4096, 8), (8192, 4096, 8),
                 (2048, 2048, 4), (2048, 8192, 8), (2048, 4096, 8), (4096, 8192, 8))


def sweep_blocks(ms, *, unroll, min_time, reps, log):
  """'free pallas' at each block configuration (checked against the sort first): the
  tuning of pallas_kernels.triton_free's block sizes and warps."""
  from pallas_kernels import triton_free  # pylint: disable=g-import-not-at-top
  saved = (triton_free.SLOT_BLOCK, triton_free.PAGE_BLOCK, triton_free.NUM_WARPS)
  out = []
  try:
    for m in ms:
      cfg, state, free_index = make_case(64, 2**24, m)
      want = jax.jit(free_fn(cfg, "sort"))(state, free_index)
      for sb, pb, warps in BLOCK_CONFIGS:
        triton_free.SLOT_BLOCK, triton_free.PAGE_BLOCK, triton_free.NUM_WARPS = sb, pb, warps
        rec = {"M": m, "num_pages": cfg.num_pages, "slot_block": sb, "page_block": pb,
               "num_warps": warps}
        try:
          got = jax.jit(free_fn(cfg, "pallas"))(state, free_index)
          jax.tree.map(np.testing.assert_array_equal, want, got)
          res = timing.chain_time(free_call(cfg, "pallas"), state, free_index,
                                  unroll=unroll, min_time=min_time, reps=reps)
          rec.update(us=res["s"] * 1e6, spread=res["spread"])
          log(f"  M={m:7d} slot_block {sb:5d} page_block {pb:5d} warps {warps}: "
              f"{rec['us']:8.2f} us (spread {res['spread']:.2f})")
        except Exception as e:  # pylint: disable=broad-except
          rec["error"] = f"{type(e).__name__}: {e}"[:300]
          log(f"  M={m} {sb}/{pb}/{warps}: {rec['error']}")
        out.append(rec)
  finally:
    triton_free.SLOT_BLOCK, triton_free.PAGE_BLOCK, triton_free.NUM_WARPS = saved
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", help="write the results here")
  p.add_argument("--small", action="store_true", help="small sizes (CPU, < 1 min)")
  p.add_argument("--unroll", type=int, default=None)
  p.add_argument("--min-time", type=float, default=None)
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--only-m", type=int, default=None,
                 help="time only the cases freeing this many slots (and skip the kernel "
                 "counts)")
  p.add_argument("--sweep-blocks", default=None, metavar="M,M,...",
                 help="only time the Pallas free at each of BLOCK_CONFIGS for these M "
                 "(page size 64, 262144 pages)")
  args = p.parse_args(argv)
  accel = jax.default_backend() != "cpu"
  unroll = args.unroll or (4 if args.small else 32 if accel else 8)
  min_time = args.min_time or (0.01 if args.small else 0.05 if accel else 0.02)
  reps = args.reps or (3 if args.small else 5)
  if args.sweep_blocks:
    log = functools.partial(print, flush=True)
    rec = {"device": str(jax.devices()[0]), "jax": jax.__version__, "unroll": unroll,
           "min_time": min_time, "reps": reps,
           "sweep": sweep_blocks([int(x) for x in args.sweep_blocks.split(",")],
                                 unroll=unroll, min_time=min_time, reps=reps, log=log)}
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rec, f, indent=1)
    return rec
  cases = SMALL_CASES if args.small else CASES
  if args.only_m:
    cases = [c for c in cases if c[2] == args.only_m]
  log = functools.partial(print, flush=True)
  t0 = time.perf_counter()
  log(f"{jax.devices()[0]} jax {jax.__version__}; unroll {unroll}, min_time {min_time}, "
      f"reps {reps}; auto: bitmap when num_pages <= {freeing.BITMAP_RATIO} * M")
  rec = {"device": str(jax.devices()[0]), "backend": jax.default_backend(),
         "jax": jax.__version__, "unroll": unroll, "min_time": min_time, "reps": reps,
         "bitmap_ratio": freeing.BITMAP_RATIO, "cases": []}
  for ps, slots, m in cases:
    log(f"page size {ps}, {slots} slots, M = {m} (auto: "
        f"{auto_runs(AllocatorConfig(size=slots, page_size=ps, debug=False), m)})")
    rec["cases"].append(time_case(ps, slots, m, unroll=unroll, min_time=min_time,
                                  reps=reps, log=log))
  if not args.only_m:
    km = max(c[2] for c in cases) if args.small else KERNEL_M
    kps, kslots = (cases[0][0], cases[0][1])
    log(f"kernels of the compiled programs at page size {kps}, {kslots} slots, M = {km}:")
    rec["kernels"] = kernel_counts(kps, kslots, km, log)

  cols = ["free sort", "free bitmap", "free bitmap/blocked", "free pallas", "free auto",
          "pages sort", "pages bitmap", "pages bitmap/blocked", "floor"]
  log("\nus per call (median; the floor is the harness's own cost at free's outputs; "
      "/blocked: the bitmap with blocked_prefix)")
  log(f"{'ps':>3} {'pages':>7} {'M':>7} {'auto':>6} " +
      " ".join(f"{c.replace('bitmap/blocked', 'blocked'):>12}" for c in cols) +
      f" {'sort/bitmap':>11} {'bitmap/pallas':>13}")
  for c in rec["cases"]:
    u = c["us"]
    log(f"{c['page_size']:3d} {c['num_pages']:7d} {c['M']:7d} {c['auto']:>6} " +
        " ".join(f"{u[k]:12.2f}" for k in cols) +
        f" {u['free sort'] / u['free bitmap']:10.2f}x"
        f" {u['free bitmap'] / u['free pallas']:12.2f}x")
  rec["wall_s"] = time.perf_counter() - t0
  log(f"wall {rec['wall_s']:.1f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rec, f, indent=1)
  return rec


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
