"""Static allocator configuration: everything that fixes array shapes or code paths.

An `AllocatorConfig` is frozen and hashable, so it is passed to jitted functions as a
static argument; a new config means a new compile, a new state means none.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

INT32_MAX = 2**31 - 1
# Ring-buffer positions are head + i with both below num_pages; they must fit int32.
MAX_PAGES = 2**30

KINDS = ("token", "paged")
# jax_kvalloc.kernels says what each selects; "pallas" and "pallas_interpret" are the
# older names of the platform's Pallas kernels.
KERNELS = ("auto", "jnp", "triton", "mosaic_gpu", "mosaic", "triton_interpret",
           "mosaic_gpu_interpret", "mosaic_interpret", "pallas", "pallas_interpret")


def _env_kernel() -> str:
  value = os.environ.get("JAX_KVALLOC_KERNEL", "auto")
  if value not in KERNELS:
    raise ValueError(f"JAX_KVALLOC_KERNEL={value!r} must be one of {KERNELS}")
  return value


def _env_debug() -> bool:
  value = os.environ.get("JAX_KVALLOC_DEBUG", "0").strip().lower()
  return value not in ("", "0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
  """Static configuration of one KV-slot pool.

  Attributes:
    size: usable KV slots (SGLang's `size`). The pool has `num_pages = size // page_size`
      pages, numbered 1..num_pages; page 0 is reserved as the padding sink.
    page_size: slots per page. 1 for SGLang's token allocator.
    need_sort: park freed pages in `release_pages` and merge them, sorted, into
      `free_pages` only on a shortfall (SGLang's disaggregation mode).
    kind: "paged" (SGLang's PagedTokenToKVPoolAllocator: `free` prepends the sorted,
      unique pages, LIFO) or "token" (SGLang's TokenToKVPoolAllocator: page_size must be 1,
      `free` appends the slots as given, FIFO, without de-duplication).
    kernel: the implementations the operations run (jax_kvalloc.kernels): "auto" (on a
      GPU pool the best usable kernels per operation: Triton, else Mosaic GPU, else XLA;
      Mosaic on a TPU pool; XLA on CPU), "jnp", "triton", "mosaic_gpu", "mosaic",
      "triton_interpret", "mosaic_gpu_interpret", "mosaic_interpret", or the older
      "pallas" / "pallas_interpret". Default from the environment variable
      JAX_KVALLOC_KERNEL, else "auto".
    debug: carry misuse checks (double free, duplicate outputs, misaligned last_loc,
      reserved or out-of-range frees) through jitted code. Default from JAX_KVALLOC_DEBUG.
  """

  size: int
  page_size: int = 1
  need_sort: bool = False
  kind: Literal["token", "paged"] = "paged"
  kernel: str = dataclasses.field(default_factory=_env_kernel)
  debug: bool = dataclasses.field(default_factory=_env_debug)

  def __post_init__(self):
    for name in ("size", "page_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if self.page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {self.page_size}")
    if self.size < self.page_size:
      raise ValueError(
          f"size must hold at least one page: size={self.size} < page_size={self.page_size}")
    # The largest slot index is num_pages * ps + ps - 1; it must fit in int32.
    if (self.num_pages + 1) * self.page_size - 1 > INT32_MAX:
      raise ValueError(
          f"size={self.size} with page_size={self.page_size} gives slot indices up to "
          f"{(self.num_pages + 1) * self.page_size - 1}, which do not fit in int32")
    if self.num_pages > MAX_PAGES:
      raise ValueError(
          f"size={self.size} with page_size={self.page_size} gives {self.num_pages} pages; "
          f"at most {MAX_PAGES} (2**30) are supported (free-list positions are int32)")
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    if self.kind == "token" and self.page_size != 1:
      raise ValueError(f"kind='token' needs page_size=1, got page_size={self.page_size}")
    if self.kernel not in KERNELS:
      raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
    if not isinstance(self.need_sort, bool):
      raise TypeError(f"need_sort must be a bool, got {self.need_sort!r}")
    if not isinstance(self.debug, bool):
      raise TypeError(f"debug must be a bool, got {self.debug!r}")

  @property
  def num_pages(self) -> int:
    """Usable pages (1..num_pages); page 0 is reserved."""
    return self.size // self.page_size

  @property
  def num_slots(self) -> int:
    """Slots a KV buffer needs: (num_pages + 1) * page_size, page 0 included."""
    return (self.num_pages + 1) * self.page_size
