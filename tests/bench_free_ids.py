"""free (sort + unique, SPEC 4.4) against free_segment (SPEC 10, no sort) in a jitted
scan: one alloc of M pages and one free of them per step, the state donated.

    python tests/bench_free_ids.py            # default device; about 30 s on a 2-core CPU

Prints microseconds per step (best of 3 runs of 200 steps) for each page size.
"""
import time

import jax

import jax_kvalloc as kv

CASES = ((16, 65536, 64), (64, 16384, 256), (64, 262144, 1024))  # (ps, pages, M)


def per_step(alloc, pages_freed: int, ps: int, segment: bool, steps: int = 200) -> float:
  def step(s, _):
    s, slots, ok = alloc.alloc(s, pages_freed * ps, max_size=pages_freed * ps)
    s = alloc.free_segment(s, slots, 0) if segment else alloc.free(s, slots)
    return s, ok

  run = jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps), donate_argnums=0)
  state, oks = run(alloc.init())
  jax.block_until_ready(state)
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    state, oks = run(state)
    jax.block_until_ready(state)
    best = min(best, time.perf_counter() - t)
  assert bool(oks.all())
  return best / steps * 1e6


def main() -> None:
  print(f"device {jax.devices()[0]}; jax {jax.__version__}")
  print("| page_size | pool pages | pages freed/step | free (us/step) | free_segment (us/step) |")
  print("|---:|---:|---:|---:|---:|")
  for ps, pages, m in CASES:
    alloc = kv.paged_allocator(size=pages * ps, page_size=ps)
    print(f"| {ps} | {pages} | {m} | {per_step(alloc, m, ps, False):.1f} | "
          f"{per_step(alloc, m, ps, True):.1f} |")


if __name__ == "__main__":
  main()
