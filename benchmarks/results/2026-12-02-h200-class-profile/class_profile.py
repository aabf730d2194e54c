"""Where the device class's host time per call goes (H200): per-call medians of the
class calls with and without the status copy, cProfile's top rows, and the primitives."""
import cProfile, pstats, sys, time, io
import numpy as np, jax, jax.numpy as jnp
from jax_kvalloc.tools import bench_classes, bench

dev = sys.argv[1] if len(sys.argv) > 1 else None
class O: pass
o = O(); o.page_size = 64; o.pool = 16777216; o.device = dev; o.extend_tokens = 16; o.sgljax = None

def med(fn, before=None, after=None, reps=300):
  ts = []
  for _ in range(reps):
    if before: before()
    t = time.perf_counter(); out = fn(); ts.append(time.perf_counter() - t)
    if after: after(out)
  return np.median(ts) * 1e6

def case(op, n, guard=True):
  impl = bench_classes.ClassImpl("device" if guard else "device[guard=False]", o)
  rng = np.random.default_rng(0); ps = 64; before = None
  if op == "decode":
    seq = bench.decode_lens(n, ps, rng)
    call = impl.decode(seq, impl.pages(n) * ps + (seq - 2) % ps)
  elif op == "extend":
    pre = rng.integers(0, 4 * ps, n)
    last = np.where(pre > 0, impl.pages(n) * ps + (pre - 1) % ps, -1)
    call = impl.extend(pre, pre + 16, last, n * 16)
  else:
    need = -(-n // ps) * ps
    held = impl.a.alloc(need); idx = held[:n]
    call = lambda: impl.a.free(idx); before = lambda: impl.a.alloc(need)
  return impl, call, before

for op, n in (("decode", 1), ("decode", 64), ("free", 64), ("extend", 4)):
  for guard in (True, False):
    impl, call, before = case(op, n, guard)
    pool = impl.a._pools[0]
    settle = lambda out: jax.block_until_ready((out, pool.state))
    med(call, before, settle, 50)
    a = med(call, before, settle)
    pool.backend._copy_status = False
    b = med(call, before, settle)
    pool.backend._copy_status = True
    print(f"{op}/{n} guard={guard}: {a:.1f} us; without the status copy {b:.1f} us; "
          f"state leaves {len(jax.tree_util.tree_leaves(pool.state))}", flush=True)
    if guard and n in (1, 64) and op in ("decode", "free"):
      pr = cProfile.Profile()
      def prof():
        pr.enable(); out = call(); pr.disable(); return out
      med(prof, before, settle, 200)
      s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
      print(s.getvalue()[s.getvalue().index("ncalls"):], flush=True)

d = jax.devices()[0] if dev is None else jax.devices(dev)[0]
x = jax.device_put(jnp.int32(1), d)
f = jax.jit(lambda x: x + 1)
g = jax.jit(lambda a, b, c, d_, e: (a.at[0].set(e[0]), b + 1, c + 1, d_.at[1].set(e[1]), e.sum()),
            donate_argnums=(0, 3))
arrs = [jax.device_put(np.zeros(k, np.int32), d) for k in (1 << 18, 1, 1, 1 << 18)]
pk = np.array([1, 2, 3], np.int32)
med(lambda: f(x), after=jax.block_until_ready, reps=50)
print(f"jit x+1: {med(lambda: f(x), after=jax.block_until_ready):.1f} us")
state = {"v": arrs}
def gcall():
  out = g(*state["v"], pk); state["v"] = list(out[:4]); return out
med(gcall, after=jax.block_until_ready, reps=50)
print(f"jit of 4 device args (2 donated, in-place) + a numpy arg: {med(gcall, after=jax.block_until_ready):.1f} us")
pe = jax.device_put(pk, d)
def gcall2():
  out = g(*state["v"], pe); state["v"] = list(out[:4]); return out
med(gcall2, after=jax.block_until_ready, reps=50)
print(f"same, the 5th arg on the device: {med(gcall2, after=jax.block_until_ready):.1f} us")
print(f"device_put of i32[3]: {med(lambda: jax.device_put(pk, d), after=jax.block_until_ready):.1f} us")
ys = []
def mk():
  ys.append(f(x)); jax.block_until_ready(ys[-1])
print(f"copy_to_host_async of i32[]: {med(lambda: ys[-1].copy_to_host_async(), before=mk):.1f} us")
big = jax.device_put(np.zeros(64, np.int32), d)
print(f"eager slice [:3] of i32[64]: {med(lambda: big[:3], after=jax.block_until_ready):.1f} us")
sl = jax.jit(lambda a: a[:3])
print(f"jitted slice [:3]: {med(lambda: sl(big), after=jax.block_until_ready):.1f} us")
print(f"is_ready: {med(lambda: big.is_ready()):.2f} us")
