"""Pallas kernels for jax_kvalloc's extend/decode slot indices (SPEC 4.2, 4.3).

Contract (jax_kvalloc.index_jnp, bit for bit):
  extend_indices(free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start, *,
                 page_size, out_len, interpret=False, backend=None) -> i32[out_len]
  decode_indices(free_window, seq_lens, last_loc, page_start, *, page_size,
                 interpret=False, backend=None) -> i32[B]
backend picks the kernel: "triton" (GPU, Pallas' Triton lowering: triton_extend,
triton_decode) or "mosaic" (TPU, Mosaic: mosaic_extend); None means `default_backend()`.

The GPU allocator runs a whole allocation in one launch: `alloc_extend_triton`,
`alloc_decode_triton` (free ring in, indices and new head/length out).

`lowering_check.export_for` lowers any of them for an abstract TPU v6e or H200 on CPU.
"""
from __future__ import annotations

import os

import jax

from pallas_kernels.mosaic_extend import decode_indices_mosaic
from pallas_kernels.mosaic_extend import extend_indices_mosaic
from pallas_kernels.triton_decode import alloc_decode_triton
from pallas_kernels.triton_decode import decode_indices_triton
from pallas_kernels.triton_extend import alloc_extend_triton
from pallas_kernels.triton_extend import extend_indices_triton
from pallas_kernels.triton_decode import fused_supported as decode_fused_supported
from pallas_kernels.triton_extend import fused_preferred as extend_fused_preferred
from pallas_kernels.triton_extend import fused_supported as extend_fused_supported

Array = jax.Array

BACKENDS = ("triton", "mosaic")
ENV_BACKEND = "JAX_KVALLOC_PALLAS_BACKEND"


def default_backend() -> str:
  """"mosaic" on TPU, "triton" elsewhere (GPU; on CPU the Triton-style kernel is the one
  interpret mode runs, as it is the GPU allocator's). The environment variable
  JAX_KVALLOC_PALLAS_BACKEND overrides it (e.g. to test the TPU kernel on CPU)."""
  env = os.environ.get(ENV_BACKEND, "").strip()
  if env:
    if env not in BACKENDS:
      raise ValueError(f"{ENV_BACKEND}={env!r} must be one of {BACKENDS}")
    return env
  return "mosaic" if jax.default_backend() == "tpu" else "triton"


def _backend(backend: str | None) -> str:
  backend = backend or default_backend()
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
  return backend


def extend_indices(free_window: Array, prefix_lens: Array, seq_lens: Array,
                   last_loc: Array, tok_start: Array, page_start: Array, *,
                   page_size: int, out_len: int, interpret=False,
                   backend: str | None = None) -> Array:
  """jax_kvalloc.index_jnp.extend_indices through a Pallas kernel (same arguments and
  i32[out_len] result). interpret: bool, or for "mosaic" a pltpu.InterpretParams."""
  if _backend(backend) == "mosaic":
    return extend_indices_mosaic(free_window, prefix_lens, seq_lens, last_loc, tok_start,
                                 page_start, page_size=page_size, out_len=out_len,
                                 interpret=interpret)
  return extend_indices_triton(free_window, prefix_lens, seq_lens, last_loc, tok_start,
                               page_start, page_size=page_size, out_len=out_len,
                               interpret=bool(interpret))


def decode_indices(free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int, interpret=False,
                   backend: str | None = None) -> Array:
  """jax_kvalloc.index_jnp.decode_indices through a Pallas kernel (same arguments and
  i32[B] result). interpret: bool, or for "mosaic" a pltpu.InterpretParams."""
  if _backend(backend) == "mosaic":
    return decode_indices_mosaic(free_window, seq_lens, last_loc, page_start,
                                 page_size=page_size, interpret=interpret)
  return decode_indices_triton(free_window, seq_lens, last_loc, page_start,
                               page_size=page_size, interpret=bool(interpret))


__all__ = [
    "BACKENDS",
    "alloc_decode_triton",
    "alloc_extend_triton",
    "decode_fused_supported",
    "decode_indices",
    "decode_indices_mosaic",
    "decode_indices_triton",
    "default_backend",
    "extend_fused_preferred",
    "extend_fused_supported",
    "extend_indices",
    "extend_indices_mosaic",
    "extend_indices_triton",
]
