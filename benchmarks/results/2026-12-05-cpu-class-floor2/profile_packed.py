# What a packed state could save: jitted calls of each interface shape on this CPU,
# interleaved in one process (ROUNDS rounds of N calls each; a row's median and IQR are
# over its rounds' medians).
#  - no-op programs: the launch floor of an interface (the trivial call x+1 of an i32[8];
#    a packed state i32[8198] donated + host args -> state (+ slots) (+ status));
#  - the real alloc_decode program of a 65536-slot, page-size-16 pool (guard on) at
#    1/8/64 rows: A as the device backend runs it (running status, ring, head, length,
#    held, host args in; head, length, held, slots, status, running out); D with head,
#    length and running status packed in one donated i32[5] and status+running one
#    output (ring, held, meta, args in; held, meta, slots, status6 out); E with held and
#    meta packed in one donated buffer (ring, held+meta, args in; held+meta, slots,
#    status6 out).  Every variant is checked to return A's slots.
# Run: PYTHONPATH=$PWD python profile_packed.py
import time
import numpy as np, jax, jax.numpy as jnp
from jax_kvalloc import allocation
from jax_kvalloc.sglang.backends import device as dm, status as S
import jax_kvalloc.sglang as kvs

ROUNDS, N = 7, 1500
a = kvs.PagedTokenToKVPoolAllocator(65536, 16, debug=False)
ops = a._pools[0].backend.ops
state = a._pools[0].state
acfg, ring, H = ops._alloc_cfg, state.free_ring, state.guard.held.shape[0]
cases = {}

def timed(fn):
  ts = []
  for _ in range(N):
    t = time.perf_counter(); o = fn(); ts.append(time.perf_counter() - t)
  jax.block_until_ready(o)
  return np.median(ts) * 1e6

f1 = jax.jit(lambda x: x + 1); z8 = jnp.zeros(8, jnp.int32)
cases["floor/jit x+1 i32[8]"] = lambda: f1(z8)
NB = ring.shape[0] + H + 5
pk1 = dm.pack(1, 1, [5], [3])

def noop(name, body, nout):
  f = jax.jit(body, donate_argnums=0); h = [jnp.zeros(NB, jnp.int32)]
  def call():
    r = f(h[0], pk1); h[0] = r[0] if nout > 1 else r; return h[0]
  cases[name] = call
noop("noop: state+args -> state", lambda b, p: b.at[NB - 1].set(p[0]), 1)
noop("noop: state+args -> state, slots", lambda b, p: (b.at[NB - 1].set(p[0]), p[:1] + 1), 2)
noop("noop: state+args -> state, slots, status", lambda b, p: (
    b.at[NB - 1].set(p[0]), p[:1] + 1, jnp.zeros(6, jnp.int32) + p[1]), 3)
f7 = jax.jit(lambda r, b, h, l, d, p: (h + 1, l + 1, d.at[0].set(p[0]), p[:1] + 1, r + 1, r + 2),
             donate_argnums=4)
sc, s3 = jnp.zeros((), jnp.int32), jnp.zeros(3, jnp.int32)
hd = [jnp.zeros(H, jnp.int32)]
def call7():
  o = f7(s3, ring, sc, sc, hd[0], pk1); hd[0] = o[2]; return o[3]
cases["noop: decode's interface (6 in, 6 out)"] = call7

for rows in (1, 8, 64):
  seq = np.full(rows, 5); last = np.arange(rows) * 16 + 3
  pk = dm.pack(rows, rows, seq, last)
  g = ops.fn(("decode", rows)); run0 = a._pools[0].backend.running
  hA = [jnp.copy(state.guard.held)]
  def callA(g=g, pk=pk, hA=hA, run0=run0):
    o = g(run0, ring, state.free_head, state.free_len, hA[0], pk); hA[0] = o[2]; return o[3]

  def progD(ring, held, meta, packed, rows=rows):
    s, out, ok = allocation.alloc_decode(acfg, dm._alloc_state(ring, meta[0], meta[1], held),
                                         packed[:rows], packed[rows:2 * rows],
                                         num_reqs=packed[2 * rows])
    status = S.make(S.REFUSED, ~ok); run = S.running(meta[2:5], status)
    return (s.guard.held, jnp.concatenate([s.free_head[None], s.free_len[None], run]), out,
            jnp.concatenate([status, run]))
  fD = jax.jit(progD, donate_argnums=(1, 2))
  meta0 = jnp.zeros(5, jnp.int32).at[1].set(state.free_len)
  hD = [jnp.copy(state.guard.held), meta0]
  def callD(fD=fD, hD=hD, pk=pk):
    hD[0], hD[1], out, sr = fD(ring, hD[0], hD[1], pk); return out

  def progE(ring, hm, packed, rows=rows):
    held, meta = hm[:H], hm[H:]
    s, out, ok = allocation.alloc_decode(acfg, dm._alloc_state(ring, meta[0], meta[1], held),
                                         packed[:rows], packed[rows:2 * rows],
                                         num_reqs=packed[2 * rows])
    status = S.make(S.REFUSED, ~ok); run = S.running(meta[2:5], status)
    return (jnp.concatenate([s.guard.held, s.free_head[None], s.free_len[None], run]), out,
            jnp.concatenate([status, run]))
  fE = jax.jit(progE, donate_argnums=(1,))
  hm0 = jnp.concatenate([state.guard.held, meta0])
  hE = [jnp.copy(hm0)]
  def callE(fE=fE, hE=hE, pk=pk):
    hE[0], out, sr = fE(ring, hE[0], pk); return out
  # Same slots from each (the held record of each variant is fresh: no page held).
  ref = np.asarray(g(run0, ring, state.free_head, state.free_len, jnp.copy(state.guard.held), pk)[3])
  assert (np.asarray(fD(ring, jnp.copy(state.guard.held), jnp.copy(meta0), pk)[2]) == ref).all()
  assert (np.asarray(fE(ring, jnp.copy(hm0), pk)[1]) == ref).all()
  cases[f"decode/{rows} A (as run: 6 in, 6 out)"] = callA
  cases[f"decode/{rows} D (held, meta: 4 in, 4 out)"] = callD
  cases[f"decode/{rows} E (held+meta: 3 in, 3 out)"] = callE

for fn in cases.values():
  timed(fn)  # warm
res = {k: [] for k in cases}
for _ in range(ROUNDS):
  for k, fn in cases.items():
    res[k].append(timed(fn))
fl = np.median(res["floor/jit x+1 i32[8]"])
for k, v in res.items():
  q1, m, q3 = np.percentile(v, [25, 50, 75])
  print(f"{k:48s} {m:5.1f} us [{q1:.1f}, {q3:.1f}]  {m / fl:4.2f}x floor")
