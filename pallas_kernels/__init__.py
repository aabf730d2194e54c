"""Pallas kernels for jax_kvalloc's extend/decode slot indices (SPEC 4.2, 4.3).

Contract (jax_kvalloc.index_jnp, bit for bit)::

  extend_indices(free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start, *,
                 page_size, out_len, interpret=False, backend=None) -> i32[out_len]
  decode_indices(free_window, seq_lens, last_loc, page_start, *, page_size,
                 interpret=False, backend=None) -> i32[B]

`backend` picks the kernel: "triton" (GPU, Pallas' Triton lowering: triton_extend,
triton_decode) or "mosaic" (TPU, Mosaic: mosaic_extend); None means `default_backend()`.

The GPU allocator runs a whole allocation in one launch: `alloc_extend_triton`,
`alloc_decode_triton` (free ring in, indices and new head/length out), and the paged
`free` in one memset and three launches: `free_push_front_triton`. A decode step's
free_page_ids and alloc_decode run as one launch: `release_alloc_decode_triton`. The
request table's release, extend and decode (each, or all three together) run as one
launch that also writes the table (two with extend: the slots by a program per row):
`table_step_triton`; its borrows (empty rows start from given pages or other rows' first
pages) one more: `borrow_triton`.

The same on Pallas' Mosaic GPU backend (Hopper and newer, jax >= 0.11;
mosaic_gpu_common says what it can express): `alloc_decode_mosaic_gpu` and
`table_step_mosaic_gpu`, each the same contract as its Triton twin.
jax_kvalloc.kernels chooses among them.

`one_program.run(fn, *args)` runs a chain of small array operations (elementwise ops and
reductions over vectors of a few hundred entries) as one Triton program: the simulator's
scheduler plans each step with it.

tests/lowering_check.py lowers any of them for an abstract TPU v6e or H200 on CPU.
"""
from __future__ import annotations

import importlib

import jax

from pallas_kernels import capacity

# The kernels load on first use (PEP 562), so that `pallas_kernels.capacity`, which the
# jnp path imports, does not pull in the Pallas TPU and Triton modules.
_LAZY = {
    "decode_indices_mosaic": ("mosaic_extend", "decode_indices_mosaic"),
    "extend_indices_mosaic": ("mosaic_extend", "extend_indices_mosaic"),
    "alloc_decode_triton": ("triton_decode", "alloc_decode_triton"),
    "decode_indices_triton": ("triton_decode", "decode_indices_triton"),
    "decode_fused_supported": ("triton_decode", "fused_supported"),
    "alloc_extend_triton": ("triton_extend", "alloc_extend_triton"),
    "extend_indices_triton": ("triton_extend", "extend_indices_triton"),
    "release_alloc_decode_triton": ("triton_decode", "release_alloc_decode_triton"),
    "release_decode_supported": ("triton_decode", "release_supported"),
    "extend_fused_preferred": ("triton_extend", "fused_preferred"),
    "extend_fused_supported": ("triton_extend", "fused_supported"),
    "free_preferred": ("triton_free", "preferred"),
    "free_push_front_triton": ("triton_free", "free_push_front_triton"),
    "free_supported": ("triton_free", "supported"),
    "table_step_triton": ("triton_table", "table_step_triton"),
    "table_supported": ("triton_table", "supported"),
    "borrow_triton": ("triton_borrow", "borrow_triton"),
    "borrow_supported": ("triton_borrow", "supported"),
    "alloc_decode_mosaic_gpu": ("mosaic_gpu_decode", "alloc_decode_mosaic_gpu"),
    "decode_mosaic_gpu_supported": ("mosaic_gpu_decode", "supported"),
    "table_step_mosaic_gpu": ("mosaic_gpu_table", "table_step_mosaic_gpu"),
    "table_mosaic_gpu_supported": ("mosaic_gpu_table", "supported"),
}


def __getattr__(name: str):
  if name in _LAZY:
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(f"pallas_kernels.{module}"), attr)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")


Array = jax.Array

BACKENDS = ("triton", "mosaic")


def default_backend() -> str:
  """"mosaic" on TPU, "triton" elsewhere (GPU; on CPU the Triton kernel is the one
  interpret mode runs, as it is the GPU allocator's)."""
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
  args = (free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start)
  if _backend(backend) == "mosaic":
    return __getattr__("extend_indices_mosaic")(*args, page_size=page_size,
                                                out_len=out_len, interpret=interpret)
  return __getattr__("extend_indices_triton")(*args, page_size=page_size, out_len=out_len,
                                              interpret=bool(interpret))


def decode_indices(free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int, interpret=False,
                   backend: str | None = None) -> Array:
  """jax_kvalloc.index_jnp.decode_indices through a Pallas kernel (same arguments and
  i32[B] result). interpret: bool, or for "mosaic" a pltpu.InterpretParams."""
  args = (free_window, seq_lens, last_loc, page_start)
  if _backend(backend) == "mosaic":
    return __getattr__("decode_indices_mosaic")(*args, page_size=page_size,
                                                interpret=interpret)
  return __getattr__("decode_indices_triton")(*args, page_size=page_size,
                                              interpret=bool(interpret))


__all__ = [
    "BACKENDS",
    "alloc_decode_mosaic_gpu",
    "alloc_decode_triton",
    "alloc_extend_triton",
    "borrow_supported",
    "borrow_triton",
    "capacity",
    "decode_fused_supported",
    "decode_indices",
    "decode_indices_mosaic",
    "decode_indices_triton",
    "decode_mosaic_gpu_supported",
    "default_backend",
    "extend_fused_preferred",
    "extend_fused_supported",
    "extend_indices",
    "extend_indices_mosaic",
    "extend_indices_triton",
    "free_preferred",
    "free_push_front_triton",
    "free_supported",
    "release_alloc_decode_triton",
    "release_decode_supported",
    "table_mosaic_gpu_supported",
    "table_step_mosaic_gpu",
    "table_step_triton",
    "table_supported",
]
