"""patch() / unpatch(): sglang-jax allocating through jax_kvalloc's flavour.

patch() imports sgl_jax.srt.mem_cache.allocator and, for each of its three allocator
classes, makes a class that subclasses both ours (first in the MRO: every method is
ours) and sglang-jax's, so `isinstance` against either name, and against
sglang-jax's BaseTokenToKVPoolAllocator, holds for what the engine builds. That class
is then put in place of sglang-jax's under every name that held it in an already
imported sgl_jax module (its allocator module first; modules imported later take it
from there), all names at once. unpatch() puts every name back.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Dict, List, NamedTuple, Tuple

from jax_kvalloc.sgl_jax import allocators as ours

NAMES = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator",
         "SWATokenToKVPoolAllocator")
ALLOCATOR_MODULE = "sgl_jax.srt.mem_cache.allocator"
BACKENDS = ("host", "device")


class _Patch(NamedTuple):
  backend: str
  guard: bool
  classes: Dict[str, type]
  replaced: List[Tuple[Any, str, type]]  # (module, attribute, sglang-jax's class)


_ACTIVE: List[_Patch] = []        # the patch in force (at most one)
_BUILT: List[Any] = []            # allocators built while tracking (strong references)
_TRACKING = [False]


def track_allocators(on: bool) -> List[Any]:
  """Starts (on) or stops keeping every allocator the patched classes build (held
  alive, so a test's allocators can be checked after its locals are gone); returns
  and forgets those kept so far."""
  kept = list(_BUILT)
  _BUILT.clear()
  _TRACKING[0] = on
  return kept


def _patched_class(name: str, theirs: type, backend: str, guard: bool,
                   extra: Dict[str, Any]) -> type:
  """A subclass of our flavour class and sglang-jax's, defaulting backend and guard."""
  mine = getattr(ours, name)

  def __init__(self, *args, **kwargs):  # pylint: disable=invalid-name
    kwargs.setdefault("backend", backend)
    kwargs.setdefault("guard", guard)
    mine.__init__(self, *args, **kwargs)
    if _TRACKING[0]:
      _BUILT.append(self)

  def body(ns: Dict[str, Any]) -> None:
    ns.update(extra, __init__=__init__, __module__=__name__, __qualname__=name,
              __doc__=mine.__doc__)

  return types.new_class(name, (mine, theirs), exec_body=body)


def patch(backend: str = "host", guard: bool = True) -> bool:
  """Makes sglang-jax allocate through jax_kvalloc (see the module docstring).

  backend: "host" (NumPy, default) or "device"; guard: the ownership record (True:
  frees of pages not held raise ValueError; False: sglang-jax's tolerance). These are
  the defaults of the patched constructors (a caller may still pass either).

  Returns True when it patched; False, changing nothing, when the same patch is already
  in force (a no-op). Raises, changing nothing: ValueError for an unknown backend,
  RuntimeError when a patch with other arguments is in force (unpatch() first),
  ImportError when sgl_jax cannot be imported.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  guard = bool(guard)
  if _ACTIVE:
    now = _ACTIVE[0]
    if (now.backend, now.guard) == (backend, guard):
      return False
    raise RuntimeError(f"jax_kvalloc.sgl_jax is already patched with backend="
                       f"{now.backend!r}, guard={now.guard}; unpatch() before patching "
                       f"with backend={backend!r}, guard={guard}")
  try:
    import importlib  # pylint: disable=g-import-not-at-top
    module = importlib.import_module(ALLOCATOR_MODULE)
  except ImportError as e:
    raise ImportError(f"jax_kvalloc.sgl_jax.patch() needs sglang-jax: importing "
                      f"{ALLOCATOR_MODULE} failed ({e}); nothing was patched") from e
  theirs = {name: getattr(module, name) for name in NAMES}
  classes: Dict[str, type] = {}
  for name in NAMES[:2]:
    classes[name] = _patched_class(name, theirs[name], backend, guard, {})
  classes[NAMES[2]] = _patched_class(
      NAMES[2], theirs[NAMES[2]], backend, guard,
      {"_token_cls": classes[NAMES[0]], "_paged_cls": classes[NAMES[1]]})
  by_id = {id(cls): name for name, cls in theirs.items()}
  replaced = []
  for mod_name, mod in list(sys.modules.items()):
    if not (mod_name == "sgl_jax" or mod_name.startswith("sgl_jax.")) or mod is None:
      continue
    for attr, value in list(vars(mod).items()):
      name = by_id.get(id(value))
      if name is not None and value is theirs[name]:
        replaced.append((mod, attr, value))
  for mod, attr, value in replaced:
    setattr(mod, attr, classes[by_id[id(value)]])
  _ACTIVE.append(_Patch(backend, guard, classes, replaced))
  return True


def unpatch() -> bool:
  """Puts sglang-jax's classes back under every name patch() replaced. Returns True;
  False (a no-op) when no patch is in force. Allocators built meanwhile stay ours."""
  if not _ACTIVE:
    return False
  done = _ACTIVE.pop()
  for mod, attr, value in reversed(done.replaced):
    setattr(mod, attr, value)
  return True


def patched() -> Any:
  """(backend, guard) of the patch in force, or None."""
  return (_ACTIVE[0].backend, _ACTIVE[0].guard) if _ACTIVE else None
