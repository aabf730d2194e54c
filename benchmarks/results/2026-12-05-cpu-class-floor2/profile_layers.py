# One device alloc_decode (bench class inputs: device seq_lens and last_loc beside host seq_lens) timed at each layer,
# each the median of 3000 calls with restore_state between (untimed): the class call, base._allocate after the plan,
# Pool.allocate, the backend's alloc_decode, DeviceOps.alloc_decode, the jitted program itself (+ the state update).
# Run: PYTHONPATH=$PWD python profile_layers.py ROWS
import time, numpy as np, jax, sys
import jax_kvalloc.sglang as kvs
from jax_kvalloc.tools import bench
ps=16; rows=int(sys.argv[1])
a = kvs.PagedTokenToKVPoolAllocator(65536, ps, debug=False)
rng = np.random.default_rng(0); seq = bench.decode_lens(rows, ps, rng)
pages = np.asarray(a.alloc(rows * ps))[::ps] // ps; last = pages * ps + (seq - 2) % ps
conv = lambda x: jax.device_put(np.asarray(x, np.int32))
sd, sc, ld = conv(seq), np.asarray(seq, np.int64), conv(last)
pool = a._pools[0]; b = pool.backend; ops = b.ops
snap = a.backup_state()
def med(f, n=3000, restore=True):
  ts=[]
  for _ in range(n):
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    if restore: a.restore_state(snap)
  return np.median(ts)*1e6
plan = a._decode_plan(pool, sd, sc, ld)
key = ("decode_on_device", rows)
g = ops.fn(key)
print("class alloc_decode", f"{med(lambda: a.alloc_decode(sd, sc, ld)):.1f}")
print("base _allocate (after plan)", f"{med(lambda: a._allocate(pool, 'alloc_decode', False, plan.pages, lambda s, fits: b.alloc_decode(s, plan, fits))):.1f}")
print("pool.allocate", f"{med(lambda: pool.allocate('alloc_decode', a._calls, (plan.pages,), lambda s, fits: b.alloc_decode(s, plan, True))):.1f}")
def f1(): pool.state = b.alloc_decode(pool.state, plan, True)[0]
print("backend.alloc_decode", f"{med(f1):.1f}")
def f2(): pool.state = ops.alloc_decode(b.running, pool.state, *plan.data, plan.seq_lens)[0]
print("ops.alloc_decode", f"{med(f2):.1f}")
from jax_kvalloc.guard import GuardState
def f3():
  st = pool.state
  o = g(b.running, st.free_ring, st.free_head, st.free_len, st.guard.held, sd, ld)
  pool.state = st._replace(free_head=o[0], free_len=o[1], guard=GuardState(o[2], st.guard.status))
print("raw program (+state update)", f"{med(f3):.1f}")
