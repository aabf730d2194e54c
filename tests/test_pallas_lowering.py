"""What the real compilers would see, checked on CPU.

- Both kernels lowered with jax.export for an abstract TPU v6e (Mosaic) and an abstract
  NVIDIA H200 (Triton), alone and inside the whole jitted allocator call
  (research/pallas.md section 3). The Python side of each lowering rejects what the
  hardware cannot do (int indexing or 64-bit on TPU, non-power-of-two Triton arrays...).
- The TPU kernel under the TPU interpreter (pltpu.InterpretParams), which simulates SMEM,
  VMEM and DMAs and raises on any out-of-bounds read, on small cases including pools
  used up exactly and one page short.
- jax's Pallas-Triton deprecation warning is silenced for our kernels only.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

import jax_kvalloc as kv
import pallas_kernels
from jax_kvalloc import index_jnp
import lowering_check
import kernel_cases as testing

i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
TRITON = "__gpu$xla.gpu.triton"


def _targets(exported):
  return lowering_check.custom_call_targets(exported)


@pytest.mark.parametrize("ps", (1, 16, 3))
def test_mosaic_kernels_lower_for_tpu_v6e(ps):
  ext = functools.partial(pallas_kernels.extend_indices, page_size=ps, out_len=5000,
                          backend="mosaic")
  dec = functools.partial(pallas_kernels.decode_indices, page_size=ps, backend="mosaic")
  e = lowering_check.export_for("tpu_v6e", ext, i32(700), *[i32(24)] * 5)
  assert "tpu_custom_call" in _targets(e)
  e = lowering_check.export_for("tpu_v6e", dec, i32(40), *[i32(37)] * 3)
  assert "tpu_custom_call" in _targets(e)


@pytest.mark.parametrize("ps", (1, 16, 3))
def test_triton_kernels_lower_for_h200(ps):
  ext = functools.partial(pallas_kernels.extend_indices, page_size=ps, out_len=5000,
                          backend="triton")
  dec = functools.partial(pallas_kernels.decode_indices, page_size=ps, backend="triton")
  assert TRITON in _targets(lowering_check.export_for("h200", ext, i32(700),
                                                      *[i32(24)] * 5))
  assert TRITON in _targets(lowering_check.export_for("h200", dec, i32(40), *[i32(37)] * 3))
  fused_ext = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps,
                                out_len=65536)
  fused_dec = functools.partial(pallas_kernels.alloc_decode_triton, page_size=ps)
  scalars = [i32()] * 3
  # 1024 rows x 65536 tokens: the exact (16-bit halves) total check is in this one.
  assert TRITON in _targets(lowering_check.export_for(
      "h200", fused_ext, i32(3_000_000), *scalars, *[i32(1024)] * 3))
  assert TRITON in _targets(lowering_check.export_for(
      "h200", fused_dec, i32(100_000), *scalars, *[i32(16384)] * 2))


@pytest.mark.parametrize("layout", ("rows", "tiles"))
def test_fused_extend_layouts_lower_for_h200(layout):
  # Every layout of the one-launch extend kernel: the bench's batch shapes (the exact
  # total check where B * ring length passes int32), one row, rows not a power of two,
  # page sizes 1, 64 and 3, blocks and chunks set by hand; and vmapped over 3 pools.
  scalars = [i32()] * 3
  shapes = [(1024, 65536, 64, {}), (16, 32768, 64, {}), (1, 9000, 1, {}),
            (37, 5000, 3, {}), (200, 4096, 16, dict(tile=64, chunks=3, num_warps=2))]
  for rows, out_len, ps, kwargs in shapes:
    if layout != "rows":
      kwargs = {k: v for k, v in kwargs.items() if k != "chunks"}
    fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps,
                           out_len=out_len, layout=layout, **kwargs)
    e = lowering_check.export_for("h200", fn, i32(3_000_000), *scalars, *[i32(rows)] * 3)
    assert _targets(e).count(TRITON) == 1, (rows, out_len, ps)
  fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=16, out_len=8192,
                         layout=layout)
  e = lowering_check.export_for("h200", jax.vmap(fn), i32(3, 9000), *[i32(3)] * 3,
                                *[i32(3, 64)] * 3)
  assert _targets(e).count(TRITON) == 1


@pytest.mark.parametrize("target,backend", [("h200", "triton"), ("tpu_v6e", "mosaic")])
@pytest.mark.parametrize("kernel", ("auto", "pallas", "named"))
def test_whole_allocator_lowers(target, backend, kernel):
  # The jitted calls a server makes, as they would be compiled for each accelerator:
  # "auto" and "pallas" pick the target's kernel from the abstract device at trace time.
  kernel = backend if kernel == "named" else kernel
  cfg = kv.AllocatorConfig(size=4096 * 16, page_size=16, kernel=kernel, debug=False)
  state = jax.eval_shape(functools.partial(kv.init, cfg))

  def serve(state, pre, seq, last, dseq, dlast, n):
    state, out, ok = kv.alloc_extend(cfg, state, pre, seq, last, max_tokens=4096,
                                     num_reqs=n)
    state, dout, dok = kv.alloc_decode(cfg, state, dseq, dlast, num_reqs=n)
    return state, out, ok, dout, dok

  e = lowering_check.export_for(target, serve, state, *[i32(64)] * 5, i32())
  want = TRITON if backend == "triton" else "tpu_custom_call"
  assert _targets(e).count(want) == 2
  # vmapped over 3 pools (the batching rules of the kernels' wrappers).
  pools = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((3,) + x.shape, x.dtype),
                                 state)
  e = lowering_check.export_for(target, jax.vmap(serve), pools, *[i32(3, 64)] * 5, i32(3))
  assert _targets(e).count(want) == 2


def test_lowering_checks_have_teeth():
  # Code the real compilers reject fails here too.
  def bad_triton(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1  # a 12-element array: Triton needs powers of two

  f = lambda x: pl.pallas_call(bad_triton, out_shape=i32(12),
                               compiler_params=pltriton.CompilerParams(num_warps=4))(x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with pytest.raises(Exception, match="power of 2"):
      lowering_check.export_for("h200", f, i32(12))

  def bad_mosaic(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[idx_ref[...]]  # vector gather: no integer-array indexing on TPU

  g = lambda i, x: pl.pallas_call(
      bad_mosaic, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.int32))(i, x)
  with pytest.raises(Exception):
    lowering_check.export_for("tpu_v6e", g, jax.ShapeDtypeStruct((8, 128), jnp.int32),
                              jax.ShapeDtypeStruct((8, 128), jnp.int32))


def test_triton_deprecation_is_silenced_for_our_kernels_only():
  fused = functools.partial(pallas_kernels.alloc_decode_triton, page_size=4)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lowering_check.export_for("h200", fused, i32(64), *[i32()] * 3, *[i32(8)] * 2)
  assert not [w for w in caught if "Pallas Triton" in str(w.message)]

  def plain(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  f = lambda x: pl.pallas_call(plain, out_shape=i32(8),
                               compiler_params=pltriton.CompilerParams(num_warps=4))(x)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lowering_check.export_for("h200", f, i32(8))
  if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11):  # warns from 0.11
    assert [w for w in caught if "Pallas Triton backend is deprecated" in str(w.message)]


def _tpu_interpret_cases():
  """Small contract cases for the TPU interpreter: the pool exactly used up and one page
  short (window entries past the free length are 0), ps 1 and 4, two output tiles."""
  rng = np.random.default_rng(5)
  cases = []
  while len(cases) < 4:
    ps = (1, 4)[len(cases) % 2]
    args, info = testing.extend_contract_case(rng, ps, 4, 1100, 1100 // ps + 5)
    want = "exact" if len(cases) < 2 else "short"
    if info["tokens"] > 1024 and info["pages"] >= 1:
      free = info["pages"] - (want == "short")
      win = args[0].copy()
      win[free:] = 0
      cases.append((ps, (win,) + args[1:]))
  return cases


@pytest.mark.parametrize("case", range(4))
def test_mosaic_kernel_under_tpu_interpreter(case):
  ps, args = _tpu_interpret_cases()[case]
  params = pltpu.InterpretParams(out_of_bounds_reads="raise")
  want = index_jnp.extend_indices(*args, page_size=ps, out_len=1100)
  got = pallas_kernels.extend_indices(*args, page_size=ps, out_len=1100,
                                      interpret=params, backend="mosaic")
  np.testing.assert_array_equal(got, want)
  win, _, seq, last, _, _ = args
  needs = (testing.cdiv(seq, ps) > testing.cdiv(seq - 1, ps)).astype(np.int32)
  pst = np.cumsum(needs) - needs
  want = index_jnp.decode_indices(win[:3], seq, last, pst, page_size=ps)
  got = pallas_kernels.decode_indices(win[:3], seq, last, pst, page_size=ps,
                                      interpret=params, backend="mosaic")
  np.testing.assert_array_equal(got, want)


def test_one_program_runs_a_function_whole():
  from pallas_kernels import one_program  # pylint: disable=g-import-not-at-top
  def fn(x, pair):
    a, s = pair
    m = x[:, None] < x[None, :]
    return {"rank": jnp.sum(m.astype(jnp.int32), axis=0), "top": jnp.max(x) + s,
            "big": a > s}
  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.permutation(16), jnp.int32),
          (jnp.asarray(rng.integers(0, 9, 8), jnp.int32), jnp.int32(4)))
  want = fn(*args)
  got = one_program.run(fn, *args, interpret=True, name="t")
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(
      lambda a, b: a.dtype == b.dtype and bool(jnp.all(a == b)), want, got))
  exported = lowering_check.export_for(
      "h200", lambda *a: one_program.run(fn, *a, name="t"), *args)
  assert _targets(exported) == [TRITON]
  with pytest.raises(ValueError, match=r"argument \[0\] is int32\(12,\)"):
    one_program.run(fn, jnp.zeros(12, jnp.int32), args[1], interpret=True)
  with pytest.raises(ValueError, match=r"argument \[1\]\[1\] is float32"):
    one_program.run(fn, args[0], (args[1][0], jnp.float32(1)), interpret=True)
  # A select between two scalar constants lowers to i1 constants (3 would come back as
  # 1): refused, naming the line; arithmetic, or an array case, is fine.
  with pytest.raises(ValueError, match=r"two constants at .*test_pallas_lowering"):
    one_program.run(lambda s: jnp.where(s > 0, 3, 0), args[1][1], interpret=True)
  one_program.run(lambda s: jnp.where(s > 0, s, 0), args[1][1], interpret=True)
  # A Gather argument (any length) is read by index only, clipped into it.
  table = jnp.asarray(rng.integers(-50, 50, 600), jnp.int32)
  pick = lambda t, head: t.take(head + jnp.arange(8, dtype=jnp.int32)) * 2
  for head in (0, 300, 596):
    got = one_program.run(pick, one_program.Gather(table), jnp.int32(head), interpret=True)
    np.testing.assert_array_equal(got, table[np.minimum(head + np.arange(8), 599)] * 2)
  exported = lowering_check.export_for(
      "h200", lambda t, h: one_program.run(pick, one_program.Gather(t), h), table,
      jnp.int32(0))
  assert _targets(exported) == [TRITON]
  # update=((0, 0),): the result is written over the argument's buffers.
  step = lambda pair: ((pair[0] + 1, pair[1] * 2), pair[0])  # (new pair, old first)
  exported = lowering_check.export_for(
      "h200", lambda p: one_program.run(step, p, update=((0, 0),)), args[1])
  assert exported.mlir_module().count("#stablehlo.output_operand_alias<") == 2
  with pytest.raises(ValueError, match=r"update \(0, 1\)"):
    one_program.run(step, args[1], update=((0, 1),), interpret=True)
