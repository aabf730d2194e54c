"""Whether jax sees a CUDA GPU, and the skip mark of the tests that need one."""
import jax
import pytest


def has_gpu() -> bool:
  """True when jax has a GPU backend with at least one device."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


# For tests marked `gpu` (`pytest -m gpu`) that need the compiled kernels on a GPU.
needs_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU (jax sees none)")
