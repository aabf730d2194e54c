"""Shared mechanics of the SGLang-compatible classes: state holding, free groups,
snapshots, input conversion and the jitted operations they call.

Each class holds one `AllocatorState`; every method is one call of a jitted function of
the functional core followed by a reassignment of the state. Inputs are padded to shape
buckets (jax_kvalloc.buckets) so that the class compiles once per bucket.

Bad input raises before anything changes (jax_kvalloc.validate: TypeError, ValueError or
RuntimeError naming the argument and value), so after an exception the allocator is as it
was. In debug mode (`debug=True`, default JAX_KVALLOC_DEBUG) each call also reads the
state's error record and raises `AllocatorDebugError` at the first misuse (a double free,
say); the call was refused inside, so the state is again as it was.

Donation: the state is donated to each call (the frees then scatter in place), except
right after `backup_state`/`restore_state`, when a snapshot may still refer to the
current arrays; that one call copies, and the arrays it returns are fresh again.
"""
from __future__ import annotations

import functools
from typing import Any, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation as _alloc
from jax_kvalloc import buckets
from jax_kvalloc import debug as _debug
from jax_kvalloc import freeing as _free
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState


def _jit_pair(fn, static_argnames):
  """(copying, donating) jitted versions of fn(config, state, ...)."""
  return (jax.jit(fn, static_argnames=static_argnames),
          jax.jit(fn, static_argnames=static_argnames, donate_argnames=("state",)))


_ALLOC = _jit_pair(_alloc.alloc, ("config", "max_size"))
_ALLOC_EXTEND = _jit_pair(_alloc.alloc_extend, ("config", "max_tokens"))
_ALLOC_DECODE = _jit_pair(_alloc.alloc_decode, ("config",))
_FREE = _jit_pair(_free.free, ("config",))
_MERGE = _jit_pair(_free.merge_and_sort_free, ("config",))
_INIT = jax.jit(st.init, static_argnames=("config",))


class AllocatorSnapshot(NamedTuple):
  """What `backup_state` returns: the (immutable) state and the config it belongs to."""
  config: AllocatorConfig
  state: AllocatorState


def resolve_device(device: Any) -> Optional[jax.Device]:
  """A jax.Device for SGLang-style device arguments ("cuda", "cuda:1", "cpu", "tpu",
  a jax.Device, or None for jax's default device)."""
  if device is None or isinstance(device, jax.Device):
    return device
  name = str(device)
  platform, _, index = name.partition(":")
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  try:
    devices = jax.devices(platform)
  except RuntimeError as e:
    raise ValueError(f"device={device!r}: no {platform!r} devices are available "
                     f"(jax sees {jax.devices()})") from e
  i = int(index) if index else 0
  if not 0 <= i < len(devices):
    raise ValueError(f"device={device!r}: only {len(devices)} {platform} device(s)")
  return devices[i]


class BaseAllocator:
  """SGLang's allocator interface over one functional state (see TokenToKVPoolAllocator
  and PagedTokenToKVPoolAllocator)."""

  def __init__(self, config: AllocatorConfig, dtype: Any = None, device: Any = None,
               kvcache: Any = None):
    self.config = config
    self.dtype = dtype
    self.device = device
    self._jax_device = resolve_device(device)
    self._kvcache = kvcache
    self.clear()

  # -- attributes SGLang exposes -----------------------------------------------------
  @property
  def size(self) -> int:
    return self.config.size

  @property
  def page_size(self) -> int:
    return self.config.page_size

  @property
  def need_sort(self) -> bool:
    return self.config.need_sort

  @property
  def state(self) -> AllocatorState:
    """The functional state, for handing the pool to jitted code (`set_state` takes the
    new one back). Reading it marks the state shared, as `backup_state` does: the next
    class call copies instead of donating, so the arrays handed out stay readable."""
    self._shared = True
    return self._state

  @property
  def free_pages(self) -> np.ndarray:
    """The free list in order (slot ids for the token allocator), i32[len]."""
    return st.live_free_pages(self._state)

  @property
  def release_pages(self) -> np.ndarray:
    """The release list in order (need_sort), i32[len]."""
    return st.live_release_pages(self._state)

  @property
  def is_not_in_free_group(self) -> bool:
    return self._free_group is None

  def get_kvcache(self) -> Any:
    return self._kvcache

  def available_size(self) -> int:
    """Free slots, released ones included (syncs)."""
    return int(st.available_size(self.config, self._state))

  # -- state ---------------------------------------------------------------------------
  def clear(self) -> None:
    """Back to the initial state (SPEC 2); closes any open free group."""
    state = _INIT(self.config)
    if self._jax_device is not None:
      state = jax.device_put(state, self._jax_device)
    self._state = state
    self._shared = False
    self._free_group: Optional[List[np.ndarray]] = None

  def backup_state(self) -> AllocatorSnapshot:
    """A snapshot that `restore_state` puts back exactly (SPEC 8). Free: states are
    immutable, so the snapshot is the current state."""
    self._shared = True
    return AllocatorSnapshot(self.config, self._state)

  def restore_state(self, state: AllocatorSnapshot) -> None:
    """Puts a snapshot from `backup_state` of an allocator of the same config back."""
    validate.snapshot(state, self.config, AllocatorSnapshot)
    self._state = state.state
    self._shared = True

  def _call(self, pair, *args, **kwargs):
    """Runs one jitted operation on the state; returns its outputs after the state."""
    fn = pair[0] if self._shared else pair[1]
    result = fn(self.config, self._state, *args, **kwargs)
    self._shared = False
    if isinstance(result, AllocatorState):
      self._state, rest = result, None
    else:
      self._state, *rest = result
    if self.config.debug:
      self._raise_debug_error()
    return rest

  def _raise_debug_error(self) -> None:
    """Debug mode: raises the misuse the last call recorded (it was refused, so only the
    record changed; it is cleared so that the allocator stays usable). Syncs."""
    err = _debug.get_error(self._state)
    if err is not None:
      self._state = _debug.clear_error(self._state)
      raise err

  # -- operations ----------------------------------------------------------------------
  def alloc(self, need_size: int):
    """`need_size` slots from the front of the free list, or None if they do not fit.

    Returns i32[need_size] (a jax array). Paged: need_size must be a multiple of
    page_size (ValueError otherwise; SGLang floors silently outside its debug mode).
    TypeError for non-ints, ValueError for negative sizes and sizes beyond int32.
    """
    need_size = validate.need_size(need_size, self.page_size)
    if need_size == 0:
      return jnp.zeros((0,), jnp.int32)
    if need_size > self.config.num_pages * self.page_size:
      return self._never_fits()
    out, ok = self._call(_ALLOC, np.int32(need_size),
                         max_size=buckets.bucket(need_size, buckets.MIN_TOKENS))
    if not bool(ok):
      return None
    return out[:need_size]

  def _never_fits(self) -> None:
    """A request larger than the whole pool: the shortfall's need_sort merge, then None
    (what the jitted call would do, without building outputs the size of the request)."""
    if self.need_sort:
      self.merge_and_sort_free()
    return None

  def free(self, free_index) -> None:
    """Returns slots to the pool (queued while a free group is open).

    free_index: integer slots, each in page_size..num_slots-1 (ValueError otherwise:
    page 0 is reserved); TypeError for floats.
    """
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return
    validate.free_index(idx, page_size=self.page_size, num_slots=self.config.num_slots)
    if self._free_group is not None:
      self._free_group.append(idx)  # host_ints copied it: later changes to the caller's
      return                        # buffer do not reach the queue
    self._free_now(idx)

  def _free_now(self, idx: np.ndarray) -> None:
    n = buckets.bucket(idx.shape[0], buckets.MIN_FREE)
    self._call(_FREE, buckets.pad(idx.astype(np.int32), n))

  def free_group_begin(self) -> None:
    """Opens a free group: frees are queued until free_group_end (SPEC 7)."""
    validate.group_begin(self._free_group)
    self._free_group = []

  def free_group_end(self) -> None:
    """Closes the free group and frees everything queued in one call (SPEC 7)."""
    validate.group_end(self._free_group)
    queued, self._free_group = self._free_group, None
    if queued:
      self._free_now(np.concatenate(queued))

  def merge_and_sort_free(self) -> None:
    """release_pages merged, sorted, into free_pages (SPEC 6)."""
    self._call(_MERGE)

  def __repr__(self) -> str:
    c = self.config
    return (f"{type(self).__name__}(size={c.size}, page_size={c.page_size}, "
            f"need_sort={c.need_sort}, kernel={c.kernel!r}, debug={c.debug})")
