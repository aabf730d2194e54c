"""The environment switch: imported at interpreter start by jax_kvalloc_sgl_jax.pth
when JAX_KVALLOC_SGL_JAX is set, so processes sglang-jax spawns are patched too.

  JAX_KVALLOC_SGL_JAX=host|device    patch(backend=...)
  JAX_KVALLOC_SGL_JAX_GUARD=0|1      guard (default 1)

A bad value raises ValueError (Python prints it and goes on, unpatched).
"""
import os

from jax_kvalloc.sgl_jax.patching import patch


def from_environment() -> bool:
  """patch() as the environment says; False when JAX_KVALLOC_SGL_JAX is unset."""
  backend = os.environ.get("JAX_KVALLOC_SGL_JAX", "")
  if not backend:
    return False
  guard = os.environ.get("JAX_KVALLOC_SGL_JAX_GUARD", "1")
  if guard not in ("0", "1"):
    raise ValueError(f"JAX_KVALLOC_SGL_JAX_GUARD must be 0 or 1, got {guard!r}")
  patch(backend=backend, guard=guard == "1")
  return True


from_environment()
