import os, sys
sys.path.insert(0, os.getcwd())
import numpy as np
from pallas_kernels import tuning
from jax_kvalloc.tools import simulate
base = tuning.decode_warps
for w in [int(x) for x in sys.argv[1:]]:
  tuning.decode_warps = (lambda n, w=w: w if n >= 1024 else base(n)) if w else base
  simulate.clear_compiled()
  res = simulate.run(simulate.SimConfig(num_requests=600, page_sizes=(16,)), progress=False)
  for r in res.results:
    q = np.percentile(r.step_us, [25, 50, 75])
    print(f"warps {w or 'default'} ps{r.page_size}: median {q[1]:.1f} us [{q[0]:.1f}, {q[2]:.1f}] steps {r.steps} compile {r.compile_s:.1f}s leak {r.leak_check[:8]}", flush=True)
