# The decode program's own run time against its dispatch: the device backend's
# decode_on_device program (bench class inputs: one request in page_size starts a page)
# launched 300 times on one state chain (head, length, held of each call fed to the
# next), without waiting ("dispatch") and waiting after each launch ("dispatch + run").
# Median of calls 50..299, us.  Run: PYTHONPATH=$PWD python profile_compute.py
import time, numpy as np, jax, jax.numpy as jnp
import jax_kvalloc.sglang as kvs
from jax_kvalloc.tools import bench
ps = 16
for rows in (1, 8, 64):
  a = kvs.PagedTokenToKVPoolAllocator(65536, ps, debug=False)
  rng = np.random.default_rng(0); seq = bench.decode_lens(rows, ps, rng)
  pages = np.asarray(a.alloc(rows * ps))[::ps] // ps; last = pages * ps + (seq - 2) % ps
  conv = lambda x: jax.device_put(np.asarray(x, np.int32))
  sd, ld = conv(seq), conv(last)
  pool = a._pools[0]; s = pool.state
  g = pool.backend.ops.fn(("decode_on_device", rows)); run = pool.backend.running
  res = {}
  for mode in ("dispatch", "dispatch + run"):
    head, ln, held = s.free_head, s.free_len, jnp.copy(s.guard.held)
    ts = []
    for i in range(300):
      t = time.perf_counter()
      o = g(run, s.free_ring, head, ln, held, sd, ld)
      if mode != "dispatch":
        jax.block_until_ready(o)
      ts.append(time.perf_counter() - t)
      head, ln, held = o[0], o[1], o[2]
    jax.block_until_ready(o)
    res[mode] = np.median(ts[50:]) * 1e6
  print(f"decode/{rows} ({int(np.count_nonzero((seq - 1) % ps == 0))} new pages a call): "
        + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()))
