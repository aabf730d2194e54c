"""Picks the implementation of the extend/decode index computation by name.

"jnp" (jax_kvalloc.index_jnp) is always present and is the truth; "pallas" runs the
Pallas kernel for the default backend (Triton lowering on GPU, Mosaic on TPU);
"pallas_interpret" runs the same kernels in Pallas' interpreter (any backend, for
testing); "auto" is "pallas" on GPU and TPU and "jnp" on CPU, judged by the device that
holds the pool (`by_device`): a concrete state's arrays say where they live, and inside
jit the choice is made when the computation is lowered for its platform
(`lax.platform_dependent`; only the chosen branch is compiled), so a CPU pool on a GPU
host runs the jnp path. The name comes from `AllocatorConfig.kernel`, whose default is
the environment variable JAX_KVALLOC_KERNEL.

Which Pallas kernel: for "auto", "mosaic" on TPU and "triton" on GPU (the pool's device);
for an explicit "pallas"/"pallas_interpret", `pallas_kernels.default_backend()`, "mosaic"
on TPU and "triton" elsewhere (JAX_KVALLOC_PALLAS_BACKEND overrides it).

On the Triton backend the allocator does not call the index kernel alone: the whole
alloc_extend / alloc_decode (validity and capacity checks, prefix sums, reads of the free
ring, indices, new head and length) runs as one kernel launch, `alloc_extend_fused` /
`alloc_decode_fused`, because on a GPU every separate XLA op of the bookkeeping costs a
launch of its own; a decode step's free_page_ids and alloc_decode together run as one
launch too (`release_alloc_decode_fused`). They return None where they do not apply (the
jnp path, the Mosaic backend, debug mode, and extend batches so large that the fused
kernel's per-program row work would dominate); the caller then goes on with the index
kernel alone (or, for the release, with the two calls). A need_sort merge stays with the
caller, before the fused call.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp

from jax_kvalloc import index_jnp
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

Array = jax.Array
AllocResult = Tuple[AllocatorState, Array, Array]


T = TypeVar("T")


def resolve(kernel: str) -> str:
  """The concrete path ("jnp", "pallas" or "pallas_interpret") that `kernel` selects on
  the default backend (for "auto" the allocator itself uses `by_device`)."""
  if kernel == "auto":
    return _auto(jax.default_backend())[0]
  return kernel


def platform_of(x) -> Optional[str]:
  """The platform ("cpu", "gpu", "tpu", ...) of the device holding a concrete jax array;
  None for a tracer or anything else (inside jit the platform is known only when the
  computation is lowered)."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return None
  try:
    return next(iter(x.devices())).platform
  except Exception:  # pylint: disable=broad-except
    return None


def _auto(platform: str) -> Tuple[str, Optional[str]]:
  """(path, Pallas backend) that "auto" selects on `platform`."""
  if platform in ("gpu", "cuda", "rocm"):
    return "pallas", "triton"
  if platform == "tpu":
    return "pallas", "mosaic"
  return "jnp", None


def by_device(kernel: str, pool: Array, fn: Callable[[str, Optional[str]], T]) -> T:
  """fn(path, backend): the allocator's work after `kernel` is resolved for the device
  that holds `pool` (an array of the state).

  path is "jnp", "pallas" or "pallas_interpret"; backend is the Pallas backend
  ("triton", "mosaic") or None for `pallas_kernels.default_backend()`. Only "auto"
  depends on the device: from a concrete `pool` its device's platform, under tracing a
  `lax.platform_dependent` over the branches (resolved when lowering, so the compiled
  program holds the chosen branch alone).
  """
  if kernel != "auto":
    return fn(kernel, None)
  platform = platform_of(pool)
  if platform is not None:
    return fn(*_auto(platform))
  branch = lambda platform: (lambda: fn(*_auto(platform)))
  return jax.lax.platform_dependent(cpu=branch("cpu"), cuda=branch("cuda"),
                                    rocm=branch("rocm"), tpu=branch("tpu"),
                                    default=branch("cpu"))


def extend_indices(kernel: str, free_window: Array, prefix_lens: Array, seq_lens: Array,
                   last_loc: Array, tok_start: Array, page_start: Array, *,
                   page_size: int, out_len: int, backend: Optional[str] = None) -> Array:
  """`index_jnp.extend_indices` through the implementation `kernel` names (a path, or
  "auto" for the default backend's) on the Pallas `backend` (None: the default)."""
  path = resolve(kernel)
  args = (free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start)
  if path == "jnp":
    return index_jnp.extend_indices(*args, page_size=page_size, out_len=out_len)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  return pallas_kernels.extend_indices(*args, page_size=page_size, out_len=out_len,
                                       interpret=path == "pallas_interpret",
                                       backend=backend)


def decode_indices(kernel: str, free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int,
                   backend: Optional[str] = None) -> Array:
  """`index_jnp.decode_indices` through the implementation `kernel` names (as
  `extend_indices`)."""
  path = resolve(kernel)
  args = (free_window, seq_lens, last_loc, page_start)
  if path == "jnp":
    return index_jnp.decode_indices(*args, page_size=page_size)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  return pallas_kernels.decode_indices(*args, page_size=page_size,
                                       interpret=path == "pallas_interpret",
                                       backend=backend)


def _fused_path(config: AllocatorConfig, kernel: str,
                backend: Optional[str]) -> Optional[str]:
  """"pallas" or "pallas_interpret" when the one-launch Triton allocation applies."""
  path = resolve(kernel)
  if path == "jnp" or config.debug:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  if (backend or pallas_kernels.default_backend()) != "triton":
    return None
  return path


def _num_reqs(num_reqs: Optional[Array], num_rows: int) -> Array:
  if num_reqs is None:
    return jnp.full((), num_rows, jnp.int32)
  return jnp.asarray(num_reqs, jnp.int32)


def alloc_extend_fused(config: AllocatorConfig, state: AllocatorState, prefix_lens: Array,
                       seq_lens: Array, last_loc: Array, num_reqs: Optional[Array], *,
                       max_tokens: int, kernel: Optional[str] = None,
                       backend: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.alloc_extend after its need_sort merge, as one Triton kernel launch.

  Args: as allocation.alloc_extend (i32[B] rows, raw: padded rows are masked inside);
  `state` is the state after any merge; kernel/backend as `by_device` hands them out
  (default: config.kernel on the default backend). Returns (state, i32[max_tokens],
  bool[] ok), bit-identical to the jnp path, or None where the fused kernel does not
  apply.
  """
  path = _fused_path(config, kernel or config.kernel, backend)
  if path is None:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  num_rows = prefix_lens.shape[0]
  if not pallas_kernels.extend_fused_preferred(num_rows, max_tokens, config.num_pages):
    return None  # large batches: XLA prefix sums + the contract kernel scale better
  out, head, length, ok = pallas_kernels.alloc_extend_triton(
      state.free_ring, state.free_head, state.free_len, _num_reqs(num_reqs, num_rows),
      prefix_lens, seq_lens, last_loc, page_size=config.page_size, out_len=max_tokens,
      interpret=path == "pallas_interpret")
  return state._replace(free_head=head, free_len=length), out, ok


def alloc_decode_fused(config: AllocatorConfig, state: AllocatorState, seq_lens: Array,
                       last_loc: Array, num_reqs: Optional[Array], *,
                       kernel: Optional[str] = None,
                       backend: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.alloc_decode after its need_sort merge, as one Triton kernel launch.

  Args: as allocation.alloc_decode (i32[B] rows, raw); `state` is the state after any
  merge; kernel/backend as in `alloc_extend_fused`. Returns (state, i32[B], bool[] ok),
  bit-identical to the jnp path, or None where the fused kernel does not apply.
  """
  path = _fused_path(config, kernel or config.kernel, backend)
  if path is None:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  if not pallas_kernels.decode_fused_supported(seq_lens.shape[0], config.num_pages):
    return None
  out, head, length, ok = pallas_kernels.alloc_decode_triton(
      state.free_ring, state.free_head, state.free_len,
      _num_reqs(num_reqs, seq_lens.shape[0]), seq_lens, last_loc,
      page_size=config.page_size, interpret=path == "pallas_interpret")
  return state._replace(free_head=head, free_len=length), out, ok


def release_alloc_decode_fused(config: AllocatorConfig, state: AllocatorState,
                               page_ids: Array, num: Optional[Array], seq_lens: Array,
                               last_loc: Array, num_reqs: Optional[Array], *,
                               kernel: Optional[str] = None,
                               backend: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.release_and_alloc_decode (free_page_ids, then alloc_decode) as one Triton
  kernel launch.

  Args: as allocation.release_and_alloc_decode (page_ids i32[M], num i32[] or None, i32[B]
  rows, raw: the kernel masks padding itself); kernel/backend as in `alloc_extend_fused`.
  Returns (state, i32[B], bool[] ok), bit-identical to the composition on the jnp path,
  or None where the kernel does not apply: the jnp path, the Mosaic backend, debug mode,
  need_sort (its release goes to release_pages and its decode may merge first), the
  token allocator, and sizes `pallas_kernels.release_decode_supported` refuses.
  """
  if config.kind != "paged" or config.need_sort:
    return None
  path = _fused_path(config, kernel or config.kernel, backend)
  if path is None:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  m, b = page_ids.shape[0], seq_lens.shape[0]
  if not pallas_kernels.release_decode_supported(b, m, config.num_pages):
    return None
  ring, head, length, out, ok = pallas_kernels.release_alloc_decode_triton(
      state.free_ring, state.free_head, state.free_len, state.release_len, page_ids,
      jnp.full((), m, jnp.int32) if num is None else num, _num_reqs(num_reqs, b),
      seq_lens, last_loc, page_size=config.page_size,
      interpret=path == "pallas_interpret")
  return state._replace(free_ring=ring, free_head=head, free_len=length), out, ok
