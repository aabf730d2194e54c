# The XLA cost analysis' flop count of the device backend's programs (compiled.cost_analysis()['flops']):
# XLA's CPU client runs a program inline on the calling thread below 1000 flops, else on a worker thread.
# Run: PYTHONPATH=$PWD python profile_flops.py
import numpy as np, jax, jax.numpy as jnp
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import device as dm
from jax_kvalloc import state as st
a = kvs.PagedTokenToKVPoolAllocator(65536, 16, debug=False)
pool = a._pools[0]; b = pool.backend; ops = b.ops; s = pool.state
def flops(fn, *args):
  ca = fn.lower(*args).compile().cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return ca.get("flops")
put = lambda x: jnp.asarray(np.asarray(x, np.int32))
for r in (1, 2, 4, 8, 16, 24, 32, 48, 64):
  f = ops.fn(("decode_on_device", r))
  print("decode_on_device", r, flops(f, b.running, s.free_ring, s.free_head, s.free_len, s.guard.held, put(np.ones(r)), put(np.ones(r))))
r = dm.rows(4); from jax_kvalloc import buckets
t = buckets.bucket(4 * 64, buckets.MIN_TOKENS)
f = ops.fn(("extend", r, t))
print("extend", r, t, flops(f, b.running, s.free_ring, s.free_head, s.free_len, s.guard.held, np.zeros(3*r+1, np.int32), put(np.ones(r))))
m = buckets.bucket(64, buckets.MIN_FREE)
f = ops.fn(("free", m, True))
w = st.freed_list(ops.config.need_sort, s)
print("free", m, flops(f, b.running, *w[:4], s.guard.held, s.guard.status, *ops.with_counts(np.zeros(64, np.int32), m, 0, 0)))
print("x+1", flops(jax.jit(lambda x: x + 1), put(np.ones(8))))
