"""What debug mode costs: time per jitted operation with debug off and on.

  PYTHONPATH=. python tests/bench_debug.py [--pages 4096] [--page-size 16] [--bs 64]
                                           [--tokens 1024] [--reps 200] [--rounds 5]

Two tables, both in microseconds:
  * per call: each operation jitted with the state donated, as the classes call it, in a
    steady state (each alloc is followed by the free of its slots, timed apart). Off and
    on alternate in `--rounds` rounds of `--reps` calls; a round's median, then the
    smallest over rounds (the least disturbed by other processes), is reported.
  * in lax.scan: the same pairs (and a whole serving step) inside one jitted scan of 64
    steps: the computation itself, without dispatch.
"""
import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

import jax_kvalloc as kv

SCAN_STEPS = 64


def _ops(cfg, bs, tokens):
  """name -> (alloc(state) -> (state, out, ok)); each out is then freed."""
  ps = cfg.page_size
  zeros = jnp.zeros(bs, jnp.int32)
  seq = jnp.full(bs, tokens // bs, jnp.int32)
  dseq = jnp.ones(bs, jnp.int32)  # every decode row starts a page
  return {
      f"alloc({4 * ps})": lambda s: kv.alloc(cfg, s, jnp.int32(4 * ps), max_size=4 * ps),
      f"alloc_extend(bs={bs}, {tokens} tokens)": lambda s: kv.alloc_extend(
          cfg, s, zeros, seq, zeros - 1, max_tokens=tokens),
      f"alloc_decode(bs={bs})": lambda s: kv.alloc_decode(cfg, s, dseq, zeros - 1),
  }


class PerCall:
  """Jitted, donated single calls; times each alloc and the free after it."""

  def __init__(self, cfg, bs, tokens):
    self.cfg = cfg
    self.state = kv.init(cfg)
    self.ops = {name: jax.jit(op, donate_argnums=0)
                for name, op in _ops(cfg, bs, tokens).items()}
    self.free = jax.jit(functools.partial(kv.free, cfg), donate_argnums=0)

  def round(self, name, reps):
    op, t_op, t_free = self.ops[name], [], []
    for i in range(reps + 3):  # 3 warm-up calls
      t = time.perf_counter()
      self.state, out, ok = op(self.state)
      ok.block_until_ready()
      t1 = time.perf_counter()
      self.state = self.free(self.state, out)
      self.state.free_len.block_until_ready()
      t2 = time.perf_counter()
      if i >= 3:
        t_op.append(t1 - t)
        t_free.append(t2 - t1)
    return statistics.median(t_op) * 1e6, statistics.median(t_free) * 1e6


def in_scan(cfg, bs, tokens, runs=15):
  """Per-step time of each alloc + free pair, and of a whole serving step, in lax.scan."""
  ops = _ops(cfg, bs, tokens)
  names = list(ops)
  pairs = {f"{name} + free": [name] for name in names}
  pairs["serving step: extend + decode + 2 frees"] = names[1:]
  result = {}
  for label, members in pairs.items():
    def step(s, _, members=members):
      outs = []
      for name in members:
        s, out, _ = ops[name](s)
        outs.append(out)
      for out in outs:
        s = kv.free(cfg, s, out)
      return s, ()
    run = jax.jit(lambda s, step=step: jax.lax.scan(step, s, length=SCAN_STEPS)[0],
                  donate_argnums=0)
    state = run(kv.init(cfg))
    times = []
    for _ in range(runs):
      t = time.perf_counter()
      state = run(state)
      state.free_len.block_until_ready()
      times.append(time.perf_counter() - t)
    result[label] = min(times) / SCAN_STEPS * 1e6
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pages", type=int, default=4096)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--bs", type=int, default=64)
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--reps", type=int, default=200)
  p.add_argument("--rounds", type=int, default=5)
  a = p.parse_args()
  off_cfg = kv.AllocatorConfig(a.pages * a.page_size, a.page_size, kernel="jnp",
                               debug=False)
  cfgs = {"off": off_cfg, "on": dataclasses.replace(off_cfg, debug=True)}
  runners = {k: PerCall(c, a.bs, a.tokens) for k, c in cfgs.items()}
  best = {}
  for _ in range(a.rounds):
    for name in runners["off"].ops:
      for mode, runner in runners.items():  # off and on alternate, sharing the noise
        t_op, t_free = runner.round(name, a.reps)
        for key, t in ((name, t_op), (f"free after {name.split('(')[0]}", t_free)):
          best[(key, mode)] = min(best.get((key, mode), float("inf")), t)
  scans = {k: in_scan(c, a.bs, a.tokens) for k, c in cfgs.items()}

  print(f"jax {jax.__version__}, {jax.default_backend()}, {a.pages} pages x "
        f"{a.page_size} slots, kernel jnp; microseconds\n")
  print(f"Per call (jitted, state donated; min over {a.rounds} rounds of the median "
        f"of {a.reps} calls):\n")
  print("| operation | debug off | debug on | on / off |")
  print("| --- | ---: | ---: | ---: |")
  for key in dict.fromkeys(k for k, _ in best):
    off, on = best[(key, "off")], best[(key, "on")]
    print(f"| {key} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
  print(f"\nPer step inside one jitted lax.scan of {SCAN_STEPS} steps (best of 15):\n")
  print("| step | debug off | debug on | on / off |")
  print("| --- | ---: | ---: | ---: |")
  for key in scans["off"]:
    off, on = scans["off"][key], scans["on"][key]
    print(f"| {key} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")


if __name__ == "__main__":
  main()
