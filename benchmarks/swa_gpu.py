"""The SWA allocator (SPEC 13) on a GPU: a correctness run, then first timings.

    PYTHONPATH=$PWD python benchmarks/swa_gpu.py OUT.json [STEPS] [--no-timings]

1. Correctness: lock-step random traces (tests/swa_trace.py) of the functional core
   (kernel="auto": the pools' Pallas/Triton paths) and of the class on the device
   backend against the SPEC 13 model, and against SGLang 0.5.23's released class on CUDA
   when it imports (tests/swa_impls.py gives it a stand-in kvcache module; without sglang
   installed, from the bundle folder $JAX_KVALLOC_SGLANG_BUNDLE or .sglang_py312, built by
   benchmarks/sglang_bundle.sh and appended to sys.path).
2. Timings (plain wall-clock medians of `reps` calls with a block at the end, not the
   `jax-kvalloc bench` harness): one jitted decode step of the functional core
   (alloc_decode of B rows + a window free of B pages, free_swa_segment-style), and the
   class's eager alloc_decode beside SGLang's on the same inputs.
Writes a JSON with the results, the versions and the device.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from jax_kvalloc import swa as core  # noqa: E402
from jax_kvalloc.tools import sglang_oracle  # noqa: E402
from swa_impls import ClassImpl, CoreImpl, SGLangImpl  # noqa: E402
from swa_trace import run_trace  # noqa: E402


STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 200  # trace steps per config


def _median_us(fn, reps=50):
  fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t) * 1e6)
  return statistics.median(times)


def correctness(report):
  for ps, need_sort in ((16, False), (16, True), (1, False)):
    c = dict(size=32 * ps, size_swa=14 * ps, ps=ps)
    impl = CoreImpl(c["size"], c["size_swa"], ps, need_sort, kernel="auto")
    report[f"core_ps{ps}_sort{int(need_sort)}"] = run_trace(
        [impl], need_sort=need_sort, steps=STEPS, seed=ps, groups=False, **c)
    impls = [ClassImpl(c["size"], c["size_swa"], ps, need_sort, "device", device=None,
                       kernel_auto=True)]
    try:
      impls.append(SGLangImpl(c["size"], c["size_swa"], ps, need_sort, device="cuda"))
    except Exception as e:  # pylint: disable=broad-except
      report["sglang_error"] = f"{type(e).__name__}: {e}"
    report[f"class_ps{ps}_sort{int(need_sort)}_vs"] = [i.name for i in impls]
    report[f"class_ps{ps}_sort{int(need_sort)}"] = run_trace(
        impls, need_sort=need_sort, steps=STEPS, seed=ps + 1, **c)


def timings(report, bs=256, ps=16):
  cfg = core.SWAConfig(1 << 20, 1 << 18, ps, False, debug=False)
  s = core.init(cfg)
  pre = jnp.zeros((bs,), jnp.int32)
  seq = jnp.full((bs,), 4 * ps, jnp.int32)
  s, out, ok = jax.jit(core.alloc_extend, static_argnames=("config", "max_tokens"))(
      cfg, s, pre, seq, jnp.full((bs,), -1, jnp.int32), max_tokens=bs * 4 * ps)
  assert bool(ok)
  first_pages = out.reshape(bs, 4 * ps)[:, 0]  # each row's first page: leaves the window
  last = out.reshape(bs, 4 * ps)[:, -1]

  @jax.jit
  def step(state, seq, last, window_slots):
    state, slots, ok = core.alloc_decode(cfg, state, seq + 1, last)
    state = core.free_swa_segment(cfg, state, window_slots, jnp.int32(0))
    return state, slots, ok

  report["core_decode_plus_window_free_us"] = _median_us(
      lambda: step(s, seq, last, first_pages))
  report["core_decode_plus_window_free_rows"] = bs

  for name, make in (("ours_class_device", lambda: ClassImpl(1 << 16, 1 << 14, ps, False,
                                                             "device", device=None,
                                                             kernel_auto=True)),
                     ("sglang_0_5_23", lambda: SGLangImpl(1 << 16, 1 << 14, ps, False,
                                                          device="cuda"))):
    try:
      impl = make()
    except Exception as e:  # pylint: disable=broad-except
      report[f"{name}_error"] = f"{type(e).__name__}: {e}"
      continue
    rows = 64
    # Prefill 2ps + 1 tokens; the decode of token 2ps + 1 continues its page, so every
    # call takes no page and returns the same slots (no state drifts between calls).
    out = impl.alloc_extend([0] * rows, [2 * ps + 1] * rows, [-1] * rows)
    lasts = [out[i * (2 * ps + 1) + 2 * ps] for i in range(rows)]
    seqs = [2 * ps + 2] * rows
    call = lambda: impl.alloc_decode(seqs, lasts)
    report[f"{name}_alloc_decode_{rows}_rows_us"] = _median_us(
        lambda: np.asarray(call()), reps=30)
    report["note"] = ("class figures: host lists in, one eager call, result read back "
                      "(np.asarray), so they include the read; plain medians")


def main():
  out_path = sys.argv[1]
  report = {"device": str(jax.devices()[0]), "jax": jax.__version__}
  if sglang_oracle.import_error() is not None:
    try:
      report["sglang_bundle"] = sglang_oracle.use_bundle()
    except FileNotFoundError as e:
      report["sglang_bundle"] = str(e)
  report["sglang_import_error"] = sglang_oracle.import_error()
  correctness(report)
  if "--no-timings" not in sys.argv:
    timings(report)
  pathlib.Path(out_path).write_text(json.dumps(report, indent=1, default=str))
  print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
  main()
