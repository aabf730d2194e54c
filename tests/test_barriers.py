"""The CTA barriers of the Triton kernels survive into the H200 lowering.

Pallas' interpreter runs one program after another, so the kernels leave their
`debug_barrier`s out in interpret mode (`barrier=not interpret`) and no CPU test of the
values can see one go missing. Here each kernel is lowered for an abstract H200
(`lowering_check.export_for`), the Triton module inside the custom call is parsed, and
its `gpu.barrier` ops (what `pltriton.debug_barrier` lowers to) are counted:

- release + decode (`triton_decode.release_alloc_decode_triton`): 1, between the
  program's ring writes of the released pages and its reads of the free window;
- the extend "tiles" layout without the one-hot search (`triton_extend`): 2 per pass,
  after the scratch of row ends is written and after it has been read.

`test_a_dropped_barrier_fails` drops one barrier (the first `debug_barrier` call of a
trace becomes a no-op) and shows that the count check then fails.
"""
import functools
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.interpreters import mlir as jax_mlir

import lowering_check
from pallas_kernels import triton_decode, triton_extend

try:
  from jax._src.lib import triton as _triton_lib  # the Triton dialect's Python bindings
  from jax._src.lib.mlir import ir
  from jax.experimental.pallas import triton as pltriton
  _WHY_NOT = None if hasattr(_triton_lib, "dialect") else "jaxlib has no Triton dialect"
except ImportError as e:  # pragma: no cover - depends on the jaxlib build
  _WHY_NOT = f"jaxlib without the Triton MLIR bindings ({e})"

pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))

I32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
BARRIER = "gpu.barrier"


def triton_kernels(exported) -> list:
  """The text of every Triton module inside an exported program's custom calls."""
  ctx = jax_mlir.make_ir_context()
  _triton_lib.dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  out = []
  with ctx:
    def visit(op):
      op = getattr(op, "operation", op)
      if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
        cfg = op.attributes["mhlo.backend_config"]
        if isinstance(cfg, ir.DictAttr) and "ir" in cfg:
          out.append(str(ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)))
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            visit(child)
    visit(ir.Module.parse(exported.mlir_module()).operation)
  return out


def release_decode_barriers() -> list:
  fn = functools.partial(triton_decode.release_alloc_decode_triton, page_size=16)
  e = lowering_check.export_for("h200", fn, I32(64), I32(), I32(), I32(), I32(8), I32(),
                                I32(), I32(8), I32(8))
  return [k.count(BARRIER) for k in triton_kernels(e)]


def tiles_extend_barriers() -> list:
  fn = functools.partial(triton_extend.alloc_extend_triton, page_size=16, out_len=512,
                         layout="tiles")
  e = lowering_check.export_for("h200", fn, I32(256), I32(), I32(), I32(), I32(8), I32(8),
                                I32(8))
  return [k.count(BARRIER) for k in triton_kernels(e)]


@functools.lru_cache(maxsize=None)
def unmutated(count) -> tuple:
  return tuple(count())


def test_release_decode_keeps_its_barrier():
  assert unmutated(release_decode_barriers) == (1,)


def test_tiles_extend_keeps_its_barriers():
  assert unmutated(tiles_extend_barriers) == (2,)


def test_interpret_mode_leaves_them_out():
  """The reason for this file: the interpreter's kernels have no barrier at all."""
  p = triton_decode._Params  # pylint: disable=protected-access
  assert "barrier" in p.__dataclass_fields__
  fn = functools.partial(triton_decode.release_alloc_decode_triton, page_size=16,
                         interpret=True)
  jaxpr = str(jax.make_jaxpr(fn)(*[jnp.zeros(s.shape, jnp.int32) for s in (
      I32(64), I32(), I32(), I32(), I32(8), I32(), I32(), I32(8), I32(8))]))
  assert "debug_barrier" not in jaxpr


@pytest.mark.parametrize("count", [release_decode_barriers, tiles_extend_barriers])
def test_a_dropped_barrier_fails(monkeypatch, count):
  """The mutation: every call of `debug_barrier` from the first call site seen (a line of
  the kernel; each trace calls it again) does nothing."""
  expected = list(unmutated(count))
  real = pltriton.debug_barrier
  sites = []

  def drop_one_site():
    caller = sys._getframe(1)  # pylint: disable=protected-access
    site = (caller.f_code.co_filename, caller.f_lineno)
    sites.append(site)
    if site != sites[0]:
      real()
  monkeypatch.setattr(pltriton, "debug_barrier", drop_one_site)
  mutated = count()
  assert sites, "the kernel no longer calls pltriton.debug_barrier"
  assert sum(mutated) == sum(expected) - 1
  with pytest.raises(AssertionError):
    assert mutated == expected, "what the keep-its-barrier tests assert"
