# The class's host-side plan of one device alloc_decode (bench class inputs), each piece timed alone (median of 20000 calls, us).
# Run: PYTHONPATH=$PWD python profile_plan.py ROWS
import time, numpy as np, jax, sys
import jax_kvalloc.sglang as kvs
from jax_kvalloc.tools import bench
from jax_kvalloc import validate
ps=16; rows=int(sys.argv[1])
a = kvs.PagedTokenToKVPoolAllocator(65536, ps, debug=False)
rng = np.random.default_rng(0); seq = bench.decode_lens(rows, ps, rng)
pages = np.asarray(a.alloc(rows * ps))[::ps] // ps; last = pages * ps + (seq - 2) % ps
dev = a._pools[0].backend.device; conv = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
sd, sc, ld = conv(seq), np.asarray(seq, np.int64), conv(last)
pool = a._pools[0]; b = pool.backend
def med(f, n=20000):
  ts=[]
  for _ in range(n):
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
  return np.median(ts)*1e6
print("empty", med(lambda: None))
print("_decode_plan", med(lambda: a._decode_plan(pool, sd, sc, ld)))
print("backend.decode_plan", med(lambda: b.decode_plan(sc, ld, False)))
print("device_last_decode_plan", med(lambda: b._device_last_decode_plan(sc, ld)))
print("device_ints", med(lambda: validate.device_ints(sd, "seq_lens")))
p = b.decode_plan(sc, ld, False)
print("_replace", med(lambda: p._replace(seq_lens=sd)))
print("tolist+minmax", med(lambda: (lambda i: (min(i), max(i)))(sc.tolist())))
print("isinstance jax.Array", med(lambda: isinstance(ld, jax.Array)))
print("ld.dtype", med(lambda: ld.dtype)); print("ld.shape", med(lambda: ld.shape))
print("_poll", med(lambda: a._poll()))
print("pool_index", med(lambda: a._pool_index(0)))
