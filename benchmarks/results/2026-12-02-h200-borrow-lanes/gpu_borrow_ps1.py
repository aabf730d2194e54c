"""The request table's borrow kernel at the simulator's page-size-1 shapes on a GPU:
table 136 x 3392, 16 entries from 8 source rows (hand_over False: 16 entries; True: 8
distinct sources), for tile (columns per pass) x num_warps; CUPTI kernel time, median
[q1, q3] over 200 launches; every variant's output checked against the jnp path."""
import itertools, os, sys
sys.path.insert(0, os.getcwd())
import numpy as np
import jax, jax.numpy as jnp
import pallas_kernels
from pallas_kernels import triton_borrow
from jax_kvalloc import request_table as rt
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.tools import timing

R, W, PS, POOL = 136, 3392, 1, 32768
rng = np.random.default_rng(0)
pages = np.zeros((R, W), np.int32); lens = np.zeros(R, np.int32); owned = np.zeros(R, np.int32)
perm = rng.permutation(np.arange(1, POOL + 1)).astype(np.int32); at = 0
for g in range(128, 136):
  n = int(rng.integers(64, 1025)); pages[g, :n] = perm[at:at + n]; at += n; lens[g] = n
CFG = AllocatorConfig(size=POOL * PS, page_size=PS, kernel="jnp")
CPU = jax.default_backend() == "cpu"   # a dry run: Pallas' interpreter, no timing

def inputs(hand_over):
  dest = rng.choice(128, 16, replace=False).astype(np.int32)
  if hand_over:
    src = np.concatenate([np.arange(128, 136), np.full(8, 128)]).astype(np.int32); n_rows = 8
  else:
    src = rng.integers(128, 136, 16).astype(np.int32); n_rows = 16
  k = np.array([int(rng.integers(1, lens[s] + 1)) for s in src], np.int32)
  return dest, np.int32(n_rows), k, src

def variant(hand_over, tile, warps):
  dest, n_rows, k, src = inputs(hand_over)
  f = jax.jit(lambda p, l, o: triton_borrow.borrow_triton(
      p, l, o, jnp.asarray(dest), jnp.asarray(n_rows), jnp.asarray(k), page_size=PS,
      pool_pages=POOL, src=jnp.asarray(src), hand_over=hand_over, num_warps=warps, tile=tile,
      interpret=CPU))
  args = (jnp.asarray(pages), jnp.asarray(lens), jnp.asarray(owned))
  out = jax.block_until_ready(f(*args))
  return f, args, out, (dest, n_rows, k, src)

print(jax.devices()[0], flush=True)
for hand_over in (False, True):
  ref = None
  for tile, warps in itertools.product(*(((256, 4096), (4,)) if CPU else ((256, 512, 1024, 2048, 4096), (4, 8, 16, 32)))):
    rng = np.random.default_rng(1)   # the same inputs for every variant
    try:
      f, args, out, inp = variant(hand_over, tile, warps)
    except Exception as e:
      print(f"hand_over={hand_over} tile={tile} warps={warps}: {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    if ref is None:
      dest, n_rows, k, src = inp
      t, go = rt._borrow_jnp(CFG, rt.RequestTable(*args), jnp.asarray(dest), jnp.asarray(k),
                             jnp.asarray(n_rows), None, jnp.asarray(src), hand_over)
      ref = (t.pages, t.lens, t.owned_from, go)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, ref))
    if CPU:
      print(f"hand_over={hand_over} tile={tile} ok={bool(out[3])} same_as_jnp={same}")
      continue
    def run(f=f, args=args):
      for _ in range(200):
        o = f(*args)
      jax.block_until_ready(o)
    acts = timing.cuda_activities(run)
    t = timing.kernel_time(acts, "jax_kvalloc_borrow_triton", min_count=150)
    print(f"hand_over={hand_over} tile={tile:5d} warps={warps:2d} lanes={16*tile:6d}: "
          f"{t['s']*1e6:6.2f} us [{t['q1_s']*1e6:.2f}, {t['q3_s']*1e6:.2f}] ok={bool(out[3])} "
          f"same_as_jnp={same}", flush=True)
