"""Shared mechanics of the SGLang-compatible classes: state holding, the host mirror of
the list lengths, free groups, snapshots, input conversion and the two backends.

Backends (`backend=` on both constructors):
  * "device" (default): the state is an `AllocatorState` of jax arrays on the class's
    device, ready to hand to jitted code. A call validates its arguments on host numpy
    copies, decides on the host whether it succeeds and whether need_sort merges first
    (from an exact host mirror of free_len and release_len: SGLang's *_cpu copies give
    every page count), then launches the work without waiting
    (jax_kvalloc.device_ops: one launch with one input transfer, plus a tiny cached
    slice when the output is shorter than its bucket) and returns jax arrays.
  * "host": the state is held in NumPy and every call runs on the host, vectorized
    (jax_kvalloc.host_ops, the same index arithmetic with xp=numpy); returns numpy.

Waits (device backend). None in the steady state: `available_size()` reads the mirror,
allocations and frees of host data launch and return. What still reads the device:
arguments that are device arrays (a jax or CUDA-torch `free_index`, say: validation and
the paged page count need their values on the host, so they are copied back); the
`free_pages`/`release_pages` views; `restore_state` of a snapshot not made by this class;
operations without a fast path (`_call`, which re-reads the lengths); and debug mode,
which reads the state's error record after every call (it raises at the first misuse).

Bad input raises before anything changes (jax_kvalloc.validate: TypeError, ValueError or
RuntimeError naming the argument and value), so after an exception the allocator is as it
was. In debug mode (`debug=True`, default JAX_KVALLOC_DEBUG) each call also reads the
state's error record and raises `AllocatorDebugError` at the first misuse (a double free,
say); the call was refused inside, so the state is again as it was.

Snapshots cost O(1): `backup_state` keeps references to the current (immutable or
copy-on-write) rings. Allocations never write a ring; a free or merge that writes a ring
a snapshot still holds copies that one ring first (device: the non-donating program;
host: `ndarray.copy`), and only then.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation as _alloc
from jax_kvalloc import buckets
from jax_kvalloc import debug as _debug
from jax_kvalloc import device_ops
from jax_kvalloc import freeing as _free
from jax_kvalloc import host_ops
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc import warmup as _warmup
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
_FREE_PAGE_IDS = _jit_pair(_free.free_page_ids, ("config",))
_INIT = jax.jit(st.init, static_argnames=("config",))


BACKENDS = ("device", "host")


class AllocatorSnapshot(NamedTuple):
  """What `backup_state` returns: the state, the config it belongs to and the lengths
  (free_len, release_len) as host ints, so that restoring it needs no device read."""
  config: AllocatorConfig
  state: AllocatorState
  lengths: Optional[Tuple[int, int]] = None


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
               kvcache: Any = None, backend: str = "device"):
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    self.config = config
    self.dtype = dtype
    self.device = device
    self.backend = backend
    # Debug mode keeps its checks in a jax state and reads them after every call, on
    # either backend (the host backend then keeps that state on the CPU device).
    self._legacy = config.debug
    self._host = backend == "host" and not self._legacy  # host_ops runs the calls
    self._hc = host_ops.host_config(config) if self._host else None
    self._jax_device = (resolve_device("cpu") if backend == "host" and self._legacy
                        else None if backend == "host" else resolve_device(device))
    self._kvcache = kvcache
    self._dev = device_ops.ops_for(config) if backend == "device" else None
    self._empty = None
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
    """The functional state (for handing the pool to jitted code). Its rings count as
    held from now on: the next write to one copies it instead of donating it."""
    self._free_shared = self._release_shared = True
    return self._state

  @property
  def free_pages(self) -> np.ndarray:
    """The free list in order (slot ids for the token allocator), i32[len]. Reads the
    device (device backend)."""
    return st.live_free_pages(self._state)

  @property
  def release_pages(self) -> np.ndarray:
    """The release list in order (need_sort), i32[len]. Reads the device (device
    backend)."""
    return st.live_release_pages(self._state)

  @property
  def is_not_in_free_group(self) -> bool:
    return self._free_group is None

  def get_kvcache(self) -> Any:
    return self._kvcache

  def available_size(self) -> int:
    """Free slots, released ones included. Never waits: read from the host mirror."""
    return (self._free_len + self._release_len) * self.config.page_size

  # -- state ---------------------------------------------------------------------------
  def clear(self) -> None:
    """Back to the initial state (SPEC 2); closes any open free group."""
    if self.backend == "host" and not self._legacy:
      state = host_ops.init(self.config)
    else:
      state = _INIT(self.config)
      if self._jax_device is not None:
        state = jax.device_put(state, self._jax_device)
    self._state = state
    self._free_shared = self._release_shared = False
    self._free_len, self._release_len = self.config.num_pages, 0  # the host mirror
    self._free_group: Optional[List[np.ndarray]] = None

  def backup_state(self) -> AllocatorSnapshot:
    """A snapshot that `restore_state` puts back exactly (SPEC 8). O(1): the snapshot
    holds the current rings, which are copied only if a later free writes them."""
    self._free_shared = self._release_shared = True
    return AllocatorSnapshot(self.config, self._state, (self._free_len, self._release_len))

  def restore_state(self, state: AllocatorSnapshot) -> None:
    """Puts a snapshot from `backup_state` of an allocator of the same config back. O(1);
    a snapshot without lengths (built by hand) has them read from its state (a wait)."""
    validate.snapshot(state, self.config, AllocatorSnapshot)
    snap = state.state
    on_host = not isinstance(snap.free_ring, jax.Array)
    if self.backend == "host" and not self._legacy and not on_host:
      snap = host_ops.from_jax(snap)  # a device-backend snapshot (a copy and a wait)
    elif (self.backend == "device" or self._legacy) and on_host:
      snap = jax.device_put(jax.tree.map(np.asarray, snap), self._jax_device)
    self._state = snap
    self._free_shared = self._release_shared = True
    if state.lengths is None:
      self._sync_mirror()
    else:
      self._free_len, self._release_len = state.lengths

  def _sync_mirror(self) -> None:
    """Re-reads the lengths from the state (a device read on the device backend)."""
    self._free_len = int(self._state.free_len)
    self._release_len = int(self._state.release_len)

  def _call(self, pair, *args, **kwargs):
    """Runs one jitted operation of the functional core on the whole state; returns its
    outputs after the state. The path of debug mode and of operations without a fast
    path: it waits (it re-reads the lengths into the host mirror, and in debug mode the
    error record). On the host backend outside debug mode the state makes a round trip
    through the CPU device (O(pool))."""
    to_host = self.backend == "host" and not self._legacy
    state = self._state
    if to_host:
      state = jax.tree.map(jnp.asarray, state)
    shared = self._free_shared or self._release_shared
    fn = pair[0] if (shared or to_host) else pair[1]
    result = fn(self.config, state, *args, **kwargs)
    self._free_shared = self._release_shared = False  # every leaf is a fresh buffer
    if isinstance(result, AllocatorState):
      state, rest = result, None
    else:
      state, *rest = result
    if to_host:
      state = host_ops.from_jax(state)
      rest = [np.asarray(r) for r in rest] if rest is not None else None
    self._state = state
    if self.config.debug:
      self._raise_debug_error()
    self._sync_mirror()
    return rest

  def _raise_debug_error(self) -> None:
    """Debug mode: raises the misuse the last call recorded (it was refused, so only the
    record changed; it is cleared so that the allocator stays usable). Syncs."""
    err = _debug.get_error(self._state)
    if err is not None:
      self._state = _debug.clear_error(self._state)
      self._sync_mirror()
      raise err

  def _output(self, out, ok, n: int):
    """The legacy path's result: None when refused, else out[:n] (numpy on the host
    backend). Waits for ok."""
    if not bool(ok):
      return None
    if self.backend == "host":
      return np.array(np.asarray(out)[:n], np.int32)
    return self._dev.exact(out, n)  # the instance's cached slice programs

  def _empty_out(self):
    """An empty index array of the backend's kind."""
    if self.backend == "host":
      return np.zeros((0,), np.int32)
    if self._empty is None:
      self._empty = jax.device_put(np.zeros((0,), np.int32), self._jax_device)
    return self._empty

  def _merge_if(self, shortfall: bool) -> None:
    """The need_sort merge that a shortfall triggers (SPEC 4.2), decided on the host."""
    if shortfall and self.config.need_sort and self._release_len > 0:
      self._merge_now()

  def _merge_now(self) -> None:
    if self._legacy:
      self._call(_MERGE)
      return
    if self.backend == "host":
      self._state = host_ops.merge_and_sort_free(self.config, self._state,
                                                 self._free_shared)
    else:
      self._state = self._dev.merge_and_sort_free(self._state, self._free_shared)
    self._free_shared = False
    self._free_len, self._release_len = self._free_len + self._release_len, 0

  # -- operations ----------------------------------------------------------------------
  def alloc(self, need_size: int):
    """`need_size` slots from the front of the free list, or None if they do not fit.

    Returns i32[need_size]: a jax array (device backend; returned without waiting) or a
    numpy array (host backend). Paged: need_size must be a multiple of page_size
    (ValueError otherwise; SGLang floors silently outside its debug mode). TypeError for
    non-ints, ValueError for negative sizes and sizes beyond int32.
    """
    need_size = validate.need_size(need_size, self.page_size)
    if need_size == 0:
      return self._empty_out()
    pages = need_size // self.page_size
    if self._legacy:
      if pages > self.config.num_pages:
        self._merge_if(True)
        return None
      out, ok = self._call(_ALLOC, np.int32(need_size),
                           max_size=buckets.bucket(need_size, buckets.MIN_TOKENS))
      return self._output(out, ok, need_size)
    if self._host:
      run = lambda s: host_ops.alloc(self.config, s, need_size)
    else:
      run = lambda s: self._dev.alloc(s, need_size)
    return self._allocate(pages > self._free_len, pages, run)

  def _allocate(self, trigger: bool, pages: int, run: Callable[[Any], Tuple[Any, Any]]):
    """What every allocation of the fast paths (both backends) ends with, decided on the
    host mirror: the need_sort merge when its SPEC trigger fired, None when `pages` do
    not fit the free list, else the slots of run(state) -> (state, slots), whose state
    is kept and whose pages leave the mirror."""
    self._merge_if(trigger)
    if pages > self._free_len:
      return None
    self._state, out = run(self._state)
    self._free_len -= pages
    return out

  def free(self, free_index) -> None:
    """Returns slots to the pool (queued while a free group is open).

    free_index: integer slots, each in page_size..num_slots-1 (ValueError otherwise:
    page 0 is reserved); TypeError for floats. Host data (numpy, lists) is freed without
    waiting; a device array is first copied to the host (validation and the paged
    allocator's count of distinct pages need its values there).
    """
    idx = validate.host_ints(free_index, "free_index")
    if idx.size == 0:
      return
    validate.free_index(idx, page_size=self.page_size, num_slots=self.config.num_slots)
    if self._free_group is not None:
      # A copy: later changes to the caller's buffer must not reach the queue (SPEC 7).
      self._free_group.append(np.array(idx, copy=True))
      return
    self._free_now(idx)

  def _free_now(self, idx: np.ndarray) -> None:
    if self._legacy:
      n = buckets.bucket(idx.shape[0], buckets.MIN_FREE)
      self._call(_FREE, buckets.pad(idx.astype(np.int32), n))
      return
    values, count = host_ops.free_count(self.config, idx)
    self._write("free", values if self.backend == "host" else idx, count)

  def _write(self, op: str, values: np.ndarray, count: int) -> None:
    """Frees `values` through the backend's `op` (the host backend gets what reaches the
    list, the device backend the argument itself); `count` entries reach the list, cut
    to the room left. A ring that a snapshot holds is copied first."""
    count = min(count, self.config.num_pages - self._free_len - self._release_len)
    if count == 0:
      return
    shared = self._release_shared if self.config.need_sort else self._free_shared
    if self.backend == "host":
      self._state = getattr(host_ops, op)(self.config, self._state, values, shared)
    else:
      self._state = getattr(self._dev, op)(self._state, values, shared)
    if self.config.need_sort:
      self._release_shared = False
      self._release_len += count
    else:
      self._free_shared = False
      self._free_len += count

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
    if self._legacy:
      self._call(_MERGE)
    elif self._release_len > 0:
      self._merge_now()

  def warmup(self, max_batch: int = 256, max_tokens: int = 8192,
             max_free: Optional[int] = None, exact_sizes: Sequence[int] = (),
             device_last_loc: bool = False,
             verbose: bool = False) -> _warmup.WarmupReport:
    """Compiles, before serving, every program a call within these maxima can need.

    Device backend: every shape bucket of alloc (up to max_tokens slots), alloc_decode
    (up to max_batch rows), alloc_extend (every rows x tokens bucket pair), free and
    free_page_ids (up to max_free indices, default max_tokens; donating and copying
    variants) and the need_sort merge, plus the exact-length output slices of
    `exact_sizes` (an output shorter than its bucket is cut by a tiny program compiled
    once per (bucket, length): list the lengths you expect, e.g. range(1, max_batch + 1)
    for decode). `device_last_loc=True` when last_loc will come as a device array: also
    the programs that take it so, and its pads from each of `exact_sizes` rows. The state
    is not changed. The host backend and debug mode compile nothing here (debug mode
    compiles its programs on first use).

    Returns WarmupReport(programs, seconds). With JAX's persistent compilation cache on
    (jax_kvalloc.warmup.enable_persistent_cache; README "Compile once") a second process
    loads these programs from disk instead of compiling them.
    """
    for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
      validate.count(value, name)
    max_free = max_tokens if max_free is None else validate.count(max_free, "max_free")
    if self.backend == "host" or self._legacy:
      report = _warmup.WarmupReport(0, 0.0)
    else:
      report = _warmup.warmup_device_ops(
          self._dev, self._state, max_batch=max(max_batch, 1),
          max_tokens=max(max_tokens, 1), max_free=max(max_free, 1),
          exact_sizes=[validate.count(n, "exact_sizes") for n in exact_sizes if n],
          extend=hasattr(self, "alloc_extend"), device_last_loc=device_last_loc)
    if verbose:
      print(f"{type(self).__name__}.warmup: {report.programs} programs in "
            f"{report.seconds:.2f} s")
    return report

  def __repr__(self) -> str:
    c = self.config
    return (f"{type(self).__name__}(size={c.size}, page_size={c.page_size}, "
            f"need_sort={c.need_sort}, kernel={c.kernel!r}, debug={c.debug}, "
            f"backend={self.backend!r})")
