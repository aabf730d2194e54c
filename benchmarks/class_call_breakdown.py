"""Where one device-backend class call spends its host time (issue 12's H200 rows).

    python benchmarks/class_call_breakdown.py

Times, on the default device, host microseconds per call (median of consecutive calls,
no wait inside the loop, one wait at the end), for alloc_decode with 64 requests:
  1. a trivial jitted call (x + 1) on a device array: jax's dispatch floor;
  2. the class's jitted decode program alone, packed inputs already on the device;
  3. the same program with the packed inputs as a numpy array (one host-to-device copy);
  4. the whole class call (validation, host mirror, packing, dispatch), consecutive
     calls (the pool is large enough not to run out);
  5. the same with backup_state before and restore_state after each call (what
     `jax-kvalloc bench-class` and speculative decoding do);
  6. the class call inside a cProfile run: the top entries by own time.
"""
import cProfile
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import device as device_ops


def per_call_us(fn, n=2000):
  for _ in range(50):
    out = fn()
  jax.block_until_ready(out)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  jax.block_until_ready(out)
  return statistics.median(times) * 1e6


def main():
  ps, bs = 64, 64
  cfg = kv.AllocatorConfig(size=1 << 24, page_size=ps)
  a = kvs.PagedTokenToKVPoolAllocator(1 << 24, ps)
  seq = np.full(bs, ps + 1, np.int64)                        # every row starts a page
  last = np.arange(bs, dtype=np.int64) * 4 * ps + 2 * ps + ps - 1
  rows = bs
  packed = np.zeros(2 * rows + 1, np.int32)
  packed[:bs], packed[rows:rows + bs], packed[2 * rows] = seq, last, bs
  dpacked = jax.device_put(packed)
  st = kv.init(cfg)
  fn = device_ops.ops_for(a.config)._fn(("decode", rows))
  trivial = jax.jit(lambda x: x + 1)

  def class_call():
    snap = a.backup_state()
    out = a.alloc_decode(seq, seq, last)
    a.restore_state(snap)
    return out

  print(jax.devices()[0], "jax", jax.__version__, "kernel", a.config.kernel)
  print(f"1. trivial jit                 {per_call_us(lambda: trivial(dpacked)):8.1f} us")
  print(f"2. decode program, device args {per_call_us(lambda: fn(st.free_ring, st.free_head, st.free_len, dpacked)):8.1f} us")
  print(f"3. decode program, numpy packed{per_call_us(lambda: fn(st.free_ring, st.free_head, st.free_len, packed)):8.1f} us")
  print(f"4. class call                  {per_call_us(lambda: a.alloc_decode(seq, seq, last), n=1000):8.1f} us")
  a.clear()
  print(f"5. class call + backup/restore {per_call_us(class_call):8.1f} us")
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(2000):
    out = class_call()
  prof.disable()
  jax.block_until_ready(out)
  pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
  main()
