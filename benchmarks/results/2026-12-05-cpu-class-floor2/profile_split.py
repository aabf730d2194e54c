# The split of one device-backend alloc_decode (bench class inputs: device seq_lens and last_loc
# beside host seq_lens), each part timed by a perf_counter wrapper; restore_state between calls.
# Run: PYTHONPATH=$PWD python profile_split.py ROWS
import sys, time, collections
import numpy as np, jax
import jax_kvalloc.sglang as kvs
from jax_kvalloc.tools import bench
from jax_kvalloc.sglang import base, pool as pm
from jax_kvalloc.sglang.backends import device as dm
ps, pool = 16, 65536
rows = int(sys.argv[1])
a = kvs.PagedTokenToKVPoolAllocator(pool, ps, debug=False)
rng = np.random.default_rng(0)
seq = bench.decode_lens(rows, ps, rng)
pages = np.asarray(a.alloc(rows * ps))[::ps] // ps
last = pages * ps + (seq - 2) % ps
dev = a._pools[0].backend.device
conv = lambda x: jax.device_put(np.asarray(x, np.int32), dev)
args = (conv(seq), np.asarray(seq, np.int64), conv(last))
acc = collections.defaultdict(list)
def wrap(obj, name, label):
  orig = getattr(obj, name)
  def w(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); acc[label].append(time.perf_counter() - t); return r
  setattr(obj, name, w)
ops = a._pools[0].backend.ops
p0 = a._pools[0]
wrap(a, "_poll", "poll")
wrap(a, "_decode_plan", "plan (checks, counts)")
wrap(ops, "fn", "fn lookup")
wrap(ops, "_allocate", "launch+unpack")
wrap(p0, "record", "record status")
snap = a.backup_state()
tot = []
for i in range(3000):
  a.alloc_decode(*args)  # sequential calls: the pool big enough? restore each time
  if i % 1 == 0:
    pass
  a.restore_state(snap)
acc.clear()
for i in range(2000):
  t = time.perf_counter(); o = a.alloc_decode(*args); tot.append(time.perf_counter() - t)
  a.restore_state(snap)
print(f"rows {rows}: total {np.median(tot)*1e6:.1f} us")
for k, v in acc.items(): print(f"  {k}: {np.median(v)*1e6:.1f}")
