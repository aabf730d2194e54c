"""The installed SGLang allocator (`pip install sglang==0.5.23`) as a second oracle.

Nothing of SGLang is copied here: `SGLangAllocator` imports the installed package and
wraps its TokenToKVPoolAllocator / PagedTokenToKVPoolAllocator behind the interface trace
replay uses:
- The paged allocator keeps need_sort's freed pages in `staged_pages`, a list of tensors
  in no meaningful order, not in `release_pages`: `release_pages` here is their
  concatenation, to be compared as a sorted set (`release_unordered`).
- There is no backup_state/restore_state: a snapshot saves the list attributes (SGLang
  never writes them in place).
SGLang builds the paged allocator only for page sizes > 1, and its decode page count is
wrong at page size 1 (SPEC 4.3's fix), so `unsupported_reason` declines that config.
"""
from __future__ import annotations

import copy
import os
import pathlib
import sys
import types
from typing import Any, Dict, Optional, Tuple

import torch

BUNDLE_ENV = "JAX_KVALLOC_SGLANG_BUNDLE"
DEFAULT_BUNDLE = pathlib.Path(__file__).resolve().parents[2] / ".sglang_py312"


def use_bundle(path: Optional[str] = None) -> Optional[str]:
  """Appends an SGLang bundle folder (benchmarks/sglang_bundle.sh) to sys.path, LAST, so
  that installed packages (numpy, torch, typing_extensions ...) win over the bundle's.

  path: the folder; default $JAX_KVALLOC_SGLANG_BUNDLE, else <repo>/.sglang_py312. Returns
  the folder (now on sys.path), or None when the default folder does not exist. Raises
  FileNotFoundError when a folder given (or named by the variable) does not exist."""
  given = path or os.environ.get(BUNDLE_ENV)
  folder = pathlib.Path(given or DEFAULT_BUNDLE).resolve()
  if not folder.is_dir():
    if given:
      raise FileNotFoundError(f"SGLang bundle folder {given!r} does not exist (build it "
                              f"with benchmarks/sglang_bundle.sh)")
    return None
  if str(folder) not in sys.path:
    sys.path.append(str(folder))
  return str(folder)


_STATE_ATTRS = ("free_pages", "release_pages", "staged_pages", "num_staged_pages",
                "free_page_ids_group")


def import_error() -> Optional[str]:
  """None when sglang's allocator module imports, else why not (one line)."""
  try:
    import sglang.srt.mem_cache.allocator  # noqa: F401  pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return f"sglang is not importable ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
  return None


def version() -> str:
  import sglang  # pylint: disable=g-import-not-at-top
  return getattr(sglang, "__version__", "?")


def unsupported_reason(size: int, page_size: int, need_sort: bool, kind: str
                       ) -> Optional[str]:
  """None if SGLang can serve as an oracle for this pool, else why not."""
  del size, need_sort
  if kind == "paged" and page_size == 1:
    return ("SGLang never builds the paged allocator at page size 1 and its decode page "
            "count is 0 there (SPEC 4.3 fix)")
  return None


_STANDIN = "sglang.srt.mem_cache.base_swa_memory_pool"


class StandInSWAKVPool:
  """What SGLang 0.5.23's SWA allocator asks of its kvcache (the real module needs
  transformers): no per-request ring, no KV pools, the mapping registered."""
  full_kv_pool = None
  swa_kv_pool = None
  swa_req_ring_size = None
  full_to_swa_index_mapping = None

  def register_mapping(self, mapping):
    self.full_to_swa_index_mapping = mapping

  def translate_loc_from_full_to_swa(self, idx):
    return self.full_to_swa_index_mapping[idx]


def sglang_swa_class() -> Tuple[type, type]:
  """(SGLang's SWATokenToKVPoolAllocator, a kvcache class to instantiate for it), or
  raises ImportError. Installs a stand-in module for base_swa_memory_pool when the real
  one does not import (it needs transformers)."""
  try:
    import sglang.srt.mem_cache.base_swa_memory_pool as real  # pylint: disable=g-import-not-at-top
    standin = type("StandIn", (real.BaseSWAKVPool, StandInSWAKVPool), {})
  except Exception:  # pylint: disable=broad-except
    mod = sys.modules.get(_STANDIN)
    if mod is None or not hasattr(mod, "BaseSWAKVPool"):
      mod = types.ModuleType(_STANDIN)
      mod.BaseSWAKVPool = StandInSWAKVPool
      sys.modules[_STANDIN] = mod
    standin = mod.BaseSWAKVPool
  from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # pylint: disable=g-import-not-at-top
  return SWATokenToKVPoolAllocator, standin


class SGLangAllocator:
  """One SGLang allocator behind the interface trace replay uses."""

  def __init__(self, size: int, page_size: int, need_sort: bool, kind: str,
               device: Any = "cpu"):
    from sglang.srt.mem_cache import allocator as sgl  # pylint: disable=g-import-not-at-top
    dev = str(device)
    if kind == "token":
      self._a = sgl.TokenToKVPoolAllocator(size, torch.float16, dev, None, need_sort)
    else:
      self._a = sgl.PagedTokenToKVPoolAllocator(size, page_size, torch.float16, dev, None,
                                                need_sort)
    self.release_unordered = hasattr(self._a, "staged_pages")

  @property
  def release_pages(self) -> torch.Tensor:
    if not self.release_unordered:  # the token allocator
      return self._a.release_pages
    staged = self._a.staged_pages
    return (torch.cat([t.reshape(-1).cpu() for t in staged]) if staged
            else torch.zeros((0,), dtype=torch.int64))

  def __getattr__(self, name: str) -> Any:
    """free_pages, page_size, available_size, alloc, alloc_extend, alloc_decode, free,
    free_page_ids, free_segment(s), the free groups, merge_and_sort_free and clear:
    SGLang's own."""
    return getattr(self.__dict__["_a"], name)

  def backup_state(self) -> Dict[str, Any]:
    return {name: copy.copy(getattr(self._a, name)) for name in _STATE_ATTRS
            if hasattr(self._a, name)}

  def restore_state(self, snapshot: Dict[str, Any]) -> None:
    for name, value in snapshot.items():
      setattr(self._a, name, copy.copy(value))
