"""Where a class's pool lives and how its calls run: one `Backend` interface, three
implementations.

  device  (device.py) the state is an `AllocatorState` of jax arrays; each call is one
          cached jitted program launched without waiting (the class has already decided
          on its host mirror that the call fits).
  host    (host.py)   the state is held in NumPy; every call runs on the host, vectorized.
  debug   (debug.py)  debug mode on either placement: the functional core's own jitted
                      operations with their checks in the state, read after every call
                      (AllocatorDebugError at the first misuse).

A backend holds no allocator state: every method takes the state and returns the new one
(`AllocatorState`), as the functional core does. The class (jax_kvalloc.sglang.base)
keeps the state, the host mirror of the list lengths, copy-on-write flags, free groups
and snapshots, validates input, and decides success and the need_sort merge before it
calls a backend.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence, Tuple

import jax

from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport


class Plan(NamedTuple):
  """A checked allocation batch: what the class decides on, plus the backend's own data.

  rows: requests in the batch (bs); pages: new pages it takes; tokens: slots it returns
  (alloc_extend's extend_num_tokens; bs for alloc_decode); data: the backend's inputs.
  """
  rows: int
  pages: int
  tokens: int
  data: Any


class Backend(Protocol):
  """The operations a class runs on one pool (see the module docstring).

  Allocations take `fits` (the class's decision from its mirror, after any merge the
  shortfall triggered) and return (state, slots), slots None when refused. Frees take
  `count`, the entries that reach the list (cut to the room left), and `shared`, whether
  a snapshot still holds the ring they write (copy it first).
  """
  config: AllocatorConfig
  keeps_device_arrays: bool  # a device last_loc / page-id array is taken as it is

  def init(self) -> AllocatorState: ...
  def adopt(self, state: AllocatorState) -> AllocatorState: ...
  def empty(self) -> Any: ...
  def alloc(self, state: AllocatorState, need_size: int,
            fits: bool) -> Tuple[AllocatorState, Any]: ...
  def extend_plan(self, pre: Any, seq: Any, last: Any, extend_num_tokens: Any,
                  checked: bool) -> Optional[Plan]: ...
  def alloc_extend(self, state: AllocatorState, plan: Plan,
                   fits: bool) -> Tuple[AllocatorState, Any]: ...
  def decode_plan(self, seq: Any, last: Any, checked: bool) -> Optional[Plan]: ...
  def alloc_decode(self, state: AllocatorState, plan: Plan,
                   fits: bool) -> Tuple[AllocatorState, Any]: ...
  def free(self, state: AllocatorState, idx: Any, values: Any, count: int,
           shared: bool) -> AllocatorState: ...
  def free_page_ids(self, state: AllocatorState, ids: Any, count: int,
                    shared: bool) -> AllocatorState: ...
  def merge_and_sort_free(self, state: AllocatorState, shared: bool) -> AllocatorState: ...
  def warmup(self, state: AllocatorState, *, max_batch: int, max_tokens: int,
             max_free: int, exact_sizes: Sequence[int], extend: bool,
             device_last_loc: bool) -> WarmupReport: ...


BACKENDS = ("device", "host")


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


def make_backend(name: str, config: AllocatorConfig, device: Any) -> Backend:
  """The backend a class runs on: `name` "device" or "host", debug mode (config.debug)
  on either. `device`: where a device or debug state lives (jax_kvalloc.sglang.base's
  resolve_device forms)."""
  # pylint: disable=g-import-not-at-top
  if name not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
  if config.debug:
    from jax_kvalloc.sglang.backends.debug import DebugBackend
    return DebugBackend(config, "cpu" if name == "host" else device,
                        host_results=name == "host")
  if name == "host":
    from jax_kvalloc.sglang.backends.host import HostBackend
    return HostBackend(config)
  from jax_kvalloc.sglang.backends.device import DeviceBackend
  return DeviceBackend(config, device)
