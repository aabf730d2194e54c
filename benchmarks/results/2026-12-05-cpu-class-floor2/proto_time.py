# The class's alloc_decode back to back (device seq_lens and last_loc beside host seq_lens), 5 rounds of 300 calls;
# median and IQR over the rounds' medians. PROTO_PACKED=1 with proto_packed.patch applied (a measurement-only
# prototype: head, length and running status in one donated i32[5], status and running one i32[6] output;
# the state it returns keeps stale head and length, so it is not correct and not merged).
# Run: PROTO_PACKED=0|1 PYTHONPATH=$PWD python proto_time.py
import time, numpy as np, jax, sys, os
import jax_kvalloc.sglang as kvs
from jax_kvalloc.tools import bench
ps=16
res = {}
for rows in (1, 8):
  a = kvs.PagedTokenToKVPoolAllocator(65536, ps, debug=False)
  rng = np.random.default_rng(0); seq = bench.decode_lens(rows, ps, rng)
  pages = np.asarray(a.alloc(rows * ps))[::ps] // ps; last = pages * ps + (seq - 2) % ps
  conv = lambda x: jax.device_put(np.asarray(x, np.int32))
  args = (conv(seq), np.asarray(seq, np.int64), conv(last))
  o0 = np.asarray(a.alloc_decode(*args))
  meds = []
  for rnd in range(5):
    ts = []
    for i in range(300):
      t = time.perf_counter(); o = a.alloc_decode(*args); ts.append(time.perf_counter() - t)
    jax.block_until_ready(o); meds.append(np.median(ts) * 1e6)
  q1, m, q3 = np.percentile(meds, [25, 50, 75])
  print(f"PROTO_PACKED={os.environ.get('PROTO_PACKED','0')} decode/{rows}: {m:.1f} us [{q1:.1f}, {q3:.1f}] waits {a.status_waits} first out {o0[:3]}")
