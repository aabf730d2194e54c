"""The benchmark harness cannot lose work, checked on the compiled program.

For every timed operation (alloc_decode, alloc_extend, free on the jnp path and, for the
allocations, the fused Triton kernel in Pallas' interpreter; and the serving step with
its release variants), the loop of jax_kvalloc.tools.timing is compiled at unroll 1
and 2, and the compiled HLO's count of the call's characteristic ops (gathers, scatters,
sorts, custom calls) must double: XLA kept every call's work, none was deleted because
an output went unused, merged with a neighbour's, or hoisted out of the loop. The loop
the benchmarks used before (one output kept per iteration) fails this for decode and
extend: the counts stay flat (2 -> 2 gathers for jnp decode, 7 -> 7 for jnp extend).
"""
import argparse
import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from jax_kvalloc.tools import bench_kernels
from jax_kvalloc.tools import bench_serving
from jax_kvalloc.tools import timing

_OPS = re.compile(r"= [^=]*? (gather|scatter|sort|custom-call)\(")


def characteristic_ops(call, carry, inputs, unroll: int) -> int:
  """Gathers, scatters, sorts and custom calls in the compiled chain loop."""
  run = timing.chain_loop(call, unroll)
  sink = timing.sink_init(call, carry, inputs)
  text = run.lower(carry, inputs, sink, np.int32(2)).compile().as_text()
  return len(_OPS.findall(text))


def _check_doubles(call, carry, inputs):
  one = characteristic_ops(call, carry, inputs, 1)
  two = characteristic_ops(call, carry, inputs, 2)
  assert one > 0
  # At most one op shared between calls (a constant gather XLA may hoist as a whole).
  assert two >= 2 * one - 1, (one, two)


@pytest.mark.parametrize("op,path", [
    ("decode", "jnp"), ("extend", "jnp"), ("free", "jnp"), ("free", "jnp[guard=False]"),
    ("decode", "pallas_interpret"), ("extend", "pallas_interpret")])
def test_micro_loops_keep_every_call(op, path):
  case = bench_kernels.make_case(op, 16, 16 if op == "decode" else 512, 16, seed=0)
  _, call, carry, inputs = bench_kernels.jax_call(case, path)
  _check_doubles(call, carry, inputs)


@pytest.mark.parametrize("variant", ["", "pages", "fused", "fused_interpret"])
def test_serving_scan_keeps_every_step(variant):
  case = bench_serving.make_case(16, 16, 40, seed=0)
  cfg = bench_serving._config(case)  # pylint: disable=protected-access
  if variant == "fused_interpret":  # the one-launch kernel, in Pallas' interpreter
    cfg = dataclasses.replace(cfg, kernel="pallas_interpret")
  flags = {"release": variant.split("_")[0]} if variant else {}
  step = functools.partial(bench_serving.serve_step, cfg, case.max_frees, **flags)
  call = lambda c, x: bench_serving.step_call(step, c, x)
  _check_doubles(call, bench_serving.initial_carry(case), jax.numpy.zeros((), jax.numpy.int32))


def test_link_is_zero_and_reads_every_output():
  outs = (np.array([3, 0, 7], np.int32), np.array(True), np.array(5, np.int32))
  assert int(timing.link(outs)) == 0
  assert int(timing.link((np.array([-3, -2], np.int32),))) == -2  # reads the max


def test_extra_consumer_check_nets_out_the_consumers_own_cost(monkeypatch):
  """The +1 consumer check times the call and a stand-in of its outputs at 2 and 3
  consumers, interleaved, and reports (t3 - t2 - (f3 - f2)) / t2 as the net change: a
  consumer that costs 1 us on the stand-in as on the call is not counted as missing
  work; work the call gains under the consumer is. The jnp path's stand-in is an XLA
  one, the Pallas paths' a Pallas kernel."""
  seen = {}

  def fake(variants, **kw):
    seen["n"] = [v["consumers"] for v in variants]
    seen["stand"] = variants[2]["call"]
    return [{"s": s * 1e-6, "min_s": s * 1e-6, "spread": 0.0, "iters": 2,
             "compile_s": 0.0} for s in (5.0, 8.0, 2.0, 3.0)]
  monkeypatch.setattr(timing, "chain_time_interleaved", fake)
  case = bench_kernels.make_case("decode", 4, 4, 16, seed=0)
  opts = argparse.Namespace(unroll=2, min_time=0.0, reps=1, extra_consumer=True, bare=False)
  res = bench_kernels.time_jax(case, "jnp", opts)
  assert seen["n"] == [2, 3, 2, 3]
  assert res["us"] == pytest.approx(5.0) and res["floor_us"] == pytest.approx(2.0)
  assert res["extra_consumer_change"] == pytest.approx(0.6)
  assert res["extra_consumer_net_change"] == pytest.approx(0.4)
  assert bench_kernels.consumer_cell(res) == "+60% (+40%)"
  assert bench_kernels.consumer_change(res) == pytest.approx(0.4)
  assert bench_kernels.consumer_change({"extra_consumer_change": 0.3}) == 0.3
  bench_kernels.time_jax(case, "pallas_interpret", opts)
  assert seen["stand"].__qualname__.startswith("stand_in_pallas")


def test_pallas_stand_in_writes_the_outputs():
  outs = (jax.ShapeDtypeStruct((1500,), np.int32), jax.ShapeDtypeStruct((), np.bool_),
          jax.ShapeDtypeStruct((), np.int32))
  call = timing.stand_in_pallas(outs, interpret=True)
  c, (arr, flag, scalar) = jax.jit(call)(np.int32(4), (np.array([10, 0], np.int32),))
  assert int(c) == 5 and arr.shape == (1500,) and flag.shape == () and scalar.shape == ()
  np.testing.assert_array_equal(arr, np.arange(1500) + 14)
  assert int(scalar) == 14 and bool(flag)


def test_interleaved_timing_returns_one_result_per_variant():
  # A call with real work (a 2**20-element cumsum of a chained value), so that the
  # n-iteration run is slower than the 1-iteration one well beyond a loaded machine's noise.
  call = lambda c, x: (c + jax.numpy.cumsum(jax.numpy.full((1 << 20,), x))[-1] % 3, c)
  zero, one = jax.numpy.zeros((), np.int32), jax.numpy.ones((), np.int32)
  res = timing.chain_time_interleaved(
      [dict(call=call, carry=zero, inputs=one, consumers=2),
       dict(call=call, carry=zero, inputs=one, consumers=3)],
      unroll=2, min_time=0.001, reps=2)
  assert len(res) == 2 and all(r["s"] > 0 and r["iters"] >= 2 for r in res)


def test_interleaved_timing_lengthens_noisy_runs(monkeypatch):
  # A variant whose long run is not slower than its short one (noise) is timed again
  # with longer runs, as chain_time does, instead of failing; the other keeps its length.
  noisy = lambda k: 1.0 if k == 1 else (0.5 if k < 100 else 1.0 + k * 1e-6)
  clean = lambda k: k * 1e-6
  timers = iter([(noisy, 0.0), (clean, 0.0)])
  monkeypatch.setattr(timing, "_loop_timer", lambda *a: next(timers))
  monkeypatch.setattr(timing, "_grow", lambda timed, min_time: 2)
  a, b = timing.chain_time_interleaved([dict(call=None, carry=None, inputs=None)] * 2,
                                       unroll=1, min_time=0.0, reps=3)
  assert (a["iters"], b["iters"]) == (128, 2) and a["s"] > 0 and b["s"] > 0


def test_floor_stand_in_outputs_are_not_broadcasts():
  """The stand-in's array outputs vary along their first axis (iota + a loop-variant
  scalar), so XLA cannot fold them into the consumers' reductions as a broadcast."""
  outs = (jax.ShapeDtypeStruct((8,), np.int32), jax.ShapeDtypeStruct((), np.bool_))
  c, (arr, flag) = timing.stand_in(outs)(np.int32(4), (np.array([10, 0], np.int32),))
  assert int(c) == 5 and arr.shape == (8,) and flag.dtype == np.bool_
  np.testing.assert_array_equal(arr, np.arange(8) + 14)


def test_pallas_stand_in_lowers_for_h200():
  """The Pallas stand-in of the +1 consumer check lowers through Triton for an abstract
  H200 (the real compiler's Python side), not only in the interpreter."""
  import lowering_check  # pylint: disable=g-import-not-at-top
  outs = (jax.ShapeDtypeStruct((1500,), np.int32), jax.ShapeDtypeStruct((), np.bool_),
          jax.ShapeDtypeStruct((), np.int32))
  call = timing.stand_in_pallas(outs)
  exported = lowering_check.export_for(
      "h200", call, jax.ShapeDtypeStruct((), np.int32),
      (jax.ShapeDtypeStruct((2,), np.int32),))
  assert lowering_check.TRITON_CUSTOM_CALL in lowering_check.custom_call_targets(exported)


def test_kernel_time_reads_the_named_kernels_of_a_trace():
  """The bare columns' statistic (timing.kernel_time over timing.activities_of): the
  median duration of the kernels named, nothing else; too few of them is an error."""
  ev = lambda name, ts, dur, cat="kernel", ph="X": dict(name=name, ts=ts, dur=dur, cat=cat,
                                                        ph=ph)
  trace = [ev("jax_kvalloc_alloc_decode_triton", 10, 1.0),
           ev("loop_add_fusion", 11.5, 0.9),
           ev("jax_kvalloc_alloc_decode_triton", 13, 3.0),
           ev("Memcpy DtoH", 16, 2.0, cat="gpu_memcpy"),
           ev("jax_kvalloc_alloc_decode_triton", 20, 2.0),
           ev("cudaLaunchKernel", 9, 5.0, cat="cuda_runtime"),
           ev("jax_kvalloc_alloc_decode_triton", 30, 9.0, ph="i")]
  acts = timing.activities_of(trace)
  assert [a[3] for a in acts] == ["jax_kvalloc_alloc_decode_triton", "loop_add_fusion",
                                  "jax_kvalloc_alloc_decode_triton", "Memcpy DtoH",
                                  "jax_kvalloc_alloc_decode_triton"]
  res = timing.kernel_time(acts, "jax_kvalloc_alloc_", min_count=3)
  assert res["count"] == 3 and res["s"] == pytest.approx(2e-6)
  assert res["min_s"] == pytest.approx(1e-6) and res["spread"] == pytest.approx(1.0)
  with pytest.raises(timing.TimingError, match="alloc_extend"):
    timing.kernel_time(acts, "alloc_extend_kernel", min_count=1)


def test_bare_chain_launches_every_kernel_on_h200():
  """Lowered for an abstract H200, the bare chain (timing.chain_loop, linked=False) of
  `unroll` fused decode calls holds `unroll` Triton launches, each taking the previous
  one's head (a custom call runs whole, so XLA cannot drop one whose head is used)."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  import lowering_check  # pylint: disable=g-import-not-at-top

  def call(c, x):
    ring, head, flen = c
    out, head, _, ok = pallas_kernels.alloc_decode_triton(
        ring, head, flen, jax.numpy.int32(16), x[0], x[1], page_size=16)
    return (ring, head, flen), (out, ok)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  carry, inputs = (i32(64), i32(), i32()), (i32(16), i32(16))
  sink = jax.eval_shape(lambda c, x: timing.sink_init(call, c, x), carry, inputs)
  exported = lowering_check.export_for(
      "h200", timing.chain_loop(call, 5, linked=False), carry, inputs, sink, i32())
  targets = lowering_check.custom_call_targets(exported)
  assert targets.count(lowering_check.TRITON_CUSTOM_CALL) == 5, targets
