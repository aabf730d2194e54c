"""Lowering checks without the hardware: `jax.export` for an abstract TPU v6e or H200.

Exporting a jitted function for `platforms=['tpu']` or `['cuda']` inside an abstract mesh
whose device is a TPU v6e or an NVIDIA H200 runs the Python side of the Mosaic or Triton
lowering on any machine (CPU CI included). That catches what those lowerings reject
(integer-array indexing and 64-bit types on TPU, block shapes that break the (8, 128)
rule, non-power-of-two Triton arrays, unsupported primitives), though not what libtpu,
XLA or ptxas reject later. Every Triton module is also run through MLIR's verifier (what
XLA does when it parses the module on a GPU: an op whose operand types disagree fails
there, not in Pallas' lowering nor in its interpreter). Works with jax 0.10.2 through 0.12 (see research/pallas.md 3).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import jax
from jax import export
from jax.sharding import AbstractMesh

try:  # jax >= 0.11 exports it from jax.sharding
  from jax.sharding import AbstractDevice  # type: ignore[attr-defined]
except ImportError:  # jax 0.10
  from jax._src.mesh import AbstractDevice  # type: ignore[no-redef]

TARGETS = {
    "tpu_v6e": (dict(device_kind="TPU v6e", num_cores=1, platform="tpu"), "tpu"),
    "h200": (dict(device_kind="NVIDIA H200", num_cores=132, platform="gpu"), "cuda"),
}

# XLA's custom-call target for Pallas-Triton kernels (a constant from jax 0.11 on).
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


@contextlib.contextmanager
def _verified_triton_modules() -> Iterator[None]:
  """Verifies each Triton module Pallas lowers (raises AssertionError naming the op)."""
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  lower = lowering.lower_jaxpr_to_triton_module

  def verified(*args, **kwargs):
    result = lower(*args, **kwargs)
    try:
      result.module.operation.verify()
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(f"the Triton module fails MLIR verification: {e}") from None
    return result

  lowering.lower_jaxpr_to_triton_module = verified
  try:
    yield
  finally:
    lowering.lower_jaxpr_to_triton_module = lower


def export_for(target: str, fn: Callable[..., Any], *arg_specs: Any) -> export.Exported:
  """jax.export of jax.jit(fn) for `target` ("tpu_v6e" or "h200"), on any machine.

  Args:
    target: a key of TARGETS.
    fn: the function to lower (static arguments already bound).
    arg_specs: jax.ShapeDtypeStruct (or arrays) for fn's arguments.

  Returns:
    The Exported module. Raises whatever the Mosaic or Triton lowering raises.
  """
  kwargs, platform = TARGETS[target]
  device = AbstractDevice(**kwargs)
  disabled: Sequence[export.DisabledSafetyCheck] = ()
  if platform == "cuda":
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    name = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", TRITON_CUSTOM_CALL)
    disabled = (export.DisabledSafetyCheck.custom_call(name),)
  verify = _verified_triton_modules() if platform == "cuda" else contextlib.nullcontext()
  with verify, jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
    return export.export(jax.jit(fn), platforms=[platform],
                         disabled_checks=disabled)(*arg_specs)


def custom_call_targets(exported: export.Exported) -> list[str]:
  """The custom-call targets in an exported module's text (to check a kernel is there)."""
  text = exported.mlir_module()
  out = []
  for part in text.split("stablehlo.custom_call @")[1:]:
    out.append(part.split("(", 1)[0].strip())
  return out
