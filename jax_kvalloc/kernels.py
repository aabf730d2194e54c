"""Picks the implementation of the extend/decode index computation by name.

"jnp" (jax_kvalloc.index_jnp) is always present and is the truth; "pallas" runs the
Pallas kernel for the default backend (Triton lowering on GPU, Mosaic on TPU);
"pallas_interpret" runs the same kernels in Pallas' interpreter (any backend, for
testing); "auto" is "pallas" on GPU and TPU and "jnp" on CPU. The name comes from
`AllocatorConfig.kernel`, whose default is the environment variable JAX_KVALLOC_KERNEL.
"""
from __future__ import annotations

import jax

from jax_kvalloc import index_jnp

Array = jax.Array


def resolve(kernel: str) -> str:
  """The concrete path ("jnp", "pallas" or "pallas_interpret") that `kernel` selects."""
  if kernel == "auto":
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "jnp"
  return kernel


def extend_indices(kernel: str, free_window: Array, prefix_lens: Array, seq_lens: Array,
                   last_loc: Array, tok_start: Array, page_start: Array, *,
                   page_size: int, out_len: int) -> Array:
  """`index_jnp.extend_indices` through the implementation `kernel` names."""
  path = resolve(kernel)
  args = (free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start)
  if path == "jnp":
    return index_jnp.extend_indices(*args, page_size=page_size, out_len=out_len)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  return pallas_kernels.extend_indices(*args, page_size=page_size, out_len=out_len,
                                       interpret=path == "pallas_interpret")


def decode_indices(kernel: str, free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int) -> Array:
  """`index_jnp.decode_indices` through the implementation `kernel` names."""
  path = resolve(kernel)
  args = (free_window, seq_lens, last_loc, page_start)
  if path == "jnp":
    return index_jnp.decode_indices(*args, page_size=page_size)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  return pallas_kernels.decode_indices(*args, page_size=page_size,
                                       interpret=path == "pallas_interpret")
