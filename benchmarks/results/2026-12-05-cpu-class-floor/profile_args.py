# A jitted call of k arguments / k outputs on this CPU (the launch cost per argument).
import time, numpy as np, jax, jax.numpy as jnp
def med(f, n=2000):
  ts=[]
  for _ in range(n):
    t=time.perf_counter(); o=f(); ts.append(time.perf_counter()-t); jax.block_until_ready(o)
  return np.median(ts)*1e6
big = jnp.zeros(4097, jnp.int32); s = jnp.zeros((), jnp.int32); v = jnp.zeros(3, jnp.int32)
for k in (1, 2, 3, 5, 7):
  f = jax.jit(lambda *x: tuple(a + 1 for a in x))
  xs = [big] + [s] * (k - 1)
  print(k, "args/outs", f"{med(lambda: f(*xs)):.1f}")
f1 = jax.jit(lambda x: x + 1)
print("x+1 i32[8]", f"{med(lambda: f1(jnp.zeros(8, jnp.int32))):.1f}")
g = jax.jit(lambda x: x + 1, donate_argnums=0)
bs = [jnp.zeros(4097, jnp.int32) for _ in range(2100)]; it = iter(bs)
print("donated 1", f"{med(lambda: g(next(it))):.1f}")
h = jax.jit(lambda x: x + 1)
print("np input 1", f"{med(lambda: h(np.zeros(8, np.int32))):.1f}")
