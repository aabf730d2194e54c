"""What debug mode costs: time per jitted operation with debug off and on.

  PYTHONPATH=. python tests/bench_debug.py [--pages 4096] [--page-size 16] [--reps 300]

Each operation runs jitted with the state donated, as the classes run it, in a steady
state (every alloc is undone by a free, so the pool never runs dry); the median of
`--reps` timed calls is reported, after a warm-up. A second table times a whole serving
step (free + extend + decode) inside one jitted `lax.scan` of 64 steps, which shows the
device-side cost without dispatch overhead. Prints markdown.
"""
import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv


def _median_us(fn, reps):
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e6


def bench(cfg, reps, bs, tokens):
  ps = cfg.page_size
  jit = functools.partial(jax.jit, donate_argnames=("state",))
  alloc = jit(kv.alloc, static_argnames=("config", "max_size"))
  extend = jit(kv.alloc_extend, static_argnames=("config", "max_tokens"))
  decode = jit(kv.alloc_decode, static_argnames=("config",))
  free = jit(kv.free, static_argnames=("config",))
  box = {"state": kv.init(cfg)}
  zeros = jnp.zeros(bs, jnp.int32)
  seq = jnp.full(bs, tokens // bs, jnp.int32)
  dseq = jnp.ones(bs, jnp.int32)  # each decode row starts a page
  results = {}

  def run(op_fn):
    box["state"], *rest = op_fn(box["state"])
    return rest

  cases = {
      f"alloc({4 * ps})": lambda s: alloc(cfg, s, jnp.int32(4 * ps), max_size=4 * ps),
      f"alloc_extend(bs={bs}, {tokens} tokens)": lambda s: extend(
          cfg, s, zeros, seq, zeros - 1, max_tokens=tokens),
      f"alloc_decode(bs={bs})": lambda s: decode(cfg, s, dseq, zeros - 1),
  }
  for name, op in cases.items():
    outs = []
    def alloc_then_free(op=op, outs=outs):
      out, ok = run(op)
      outs.append(out)
      return ok
    def free_last(outs=outs):
      return run(lambda s: (free(cfg, s, outs.pop()),))
    for _ in range(3):  # warm up both
      alloc_then_free(), free_last()
    t_alloc, t_free = [], []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(alloc_then_free())
      t_alloc.append(time.perf_counter() - t)
      t = time.perf_counter()
      jax.block_until_ready(free_last())
      t_free.append(time.perf_counter() - t)
    results[name] = statistics.median(t_alloc) * 1e6
    results[f"free (after {name.split('(')[0]})"] = statistics.median(t_free) * 1e6

  def step(s, _):
    s, out, _ = kv.alloc_extend(cfg, s, zeros, seq, zeros - 1, max_tokens=tokens)
    s, dout, _ = kv.alloc_decode(cfg, s, dseq, zeros - 1)
    s = kv.free(cfg, s, out)
    s = kv.free(cfg, s, dout)
    return s, ()
  steps = 64
  scan = jax.jit(lambda s: jax.lax.scan(step, s, length=steps)[0], donate_argnums=0)
  box["state"] = scan(box["state"])
  results[f"serving step in lax.scan (x{steps})"] = _median_us(
      lambda: box.__setitem__("state", scan(box["state"])) or box["state"],
      max(reps // 10, 5)) / steps
  return results


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pages", type=int, default=4096)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--bs", type=int, default=64)
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--reps", type=int, default=300)
  a = p.parse_args()
  base = kv.AllocatorConfig(a.pages * a.page_size, a.page_size, kernel="jnp", debug=False)
  off = bench(base, a.reps, a.bs, a.tokens)
  on = bench(dataclasses.replace(base, debug=True), a.reps, a.bs, a.tokens)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {a.pages} pages of "
        f"{a.page_size} slots, median of {a.reps} calls (us)\n")
  print("| operation | debug off | debug on | ratio |")
  print("| --- | ---: | ---: | ---: |")
  for name in off:
    print(f"| {name} | {off[name]:.1f} | {on[name]:.1f} | {on[name] / off[name]:.2f}x |")


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
