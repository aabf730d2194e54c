"""Where a class's pool lives and how its calls run: one `Backend` interface, three
implementations, for the single pools (token and paged) and the SWA pool pair.

  device  (device.py, device_swa.py) the state is jax arrays; each call is one cached
          jitted program launched without waiting (the class has already decided on its
          host mirror that the call fits); its status is read back later.
  host    (host.py, host_swa.py) the state is held in NumPy; every call runs on the
          host, vectorized, and raises at once what it refuses.
  debug   (debug.py) debug mode on either placement: the functional core's own jitted
          operations with their checks in the state, read after every call
          (AllocatorDebugError at the first misuse).

A backend holds no allocator state: every method takes the state and returns the new one,
as the functional core does. The class (jax_kvalloc.sglang.base) keeps the state, the
host mirror of the list lengths, copy-on-write flags, free groups, snapshots and the
statuses of recent calls (jax_kvalloc.sglang.pool), validates input, and decides success
and the need_sort merge before it calls a backend; each call returns (state, output,
status) where status says what the backend refused (jax_kvalloc.sglang.backends.status;
None: nothing to read). Every backend keeps the ownership record of SPEC 14 when the
config has guard=True (the classes' default): the device and debug backends run the
functional core's record (jax_kvalloc.guard), the host backends the same rules in
NumPy (a held bitmap per pool, checked before a free changes anything).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence, Tuple

import jax

from jax_kvalloc import guard
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport


class Plan(NamedTuple):
  """A checked allocation batch: what the class decides on, plus the backend's own data.

  rows: requests in the batch (bs); pages: new pages it takes; tokens: slots it returns
  (alloc_extend's extend_num_tokens; bs for alloc_decode); data: the backend's inputs;
  seq_lens: alloc_decode's seq_lens as a device array, where the caller passed one
  beside its host copy (a backend that keeps device arrays takes it as it is).
  """
  rows: int
  pages: int
  tokens: int
  data: Any
  seq_lens: Any = None


Counts = Tuple[Optional[int], ...]  # per allocator of the pool: entries a free puts on
                                    # its list (None: the backend counts them)


class Backend(Protocol):
  """The operations a class runs on one pool (see the module docstring).

  Allocations take `fits` (the class's decision from its mirror, after any merge the
  shortfall triggered) and return (state, slots, status), slots None when refused.
  Frees take `counts`, the entries that reach each list (cut to the room left), and
  `shared`, whether a snapshot still holds a ring they write (copy it first).
  """
  config: Any
  pools: Tuple[AllocatorConfig, ...]  # the allocators the state holds (SWA: full, swa)
  keeps_device_arrays: bool  # a device last_loc / page-id array is taken as it is
  defers_status: bool        # statuses are read back later (else at once)
  writes_whole_state: bool   # every call returns all of the state anew (SWA pools)
  patches_record: bool       # writes the ownership record in place: snapshots are
                             # detached, restores patch it (detach, restore, own_record)

  def init(self) -> Any: ...
  def adopt(self, state: Any) -> Any: ...
  def lengths(self, state: Any) -> Tuple[int, ...]: ...
  def check_state(self, state: Any, current: Any) -> Tuple[int, ...]: ...
  def empty(self) -> Any: ...
  def alloc(self, state: Any, need_size: int, fits: bool) -> Tuple[Any, Any, Any]: ...
  def extend_plan(self, pre: Any, seq: Any, last: Any, extend_num_tokens: Any,
                  checked: Any) -> Optional[Plan]: ...
  def alloc_extend(self, state: Any, plan: Plan, fits: bool) -> Tuple[Any, Any, Any]: ...
  def decode_plan(self, seq: Any, last: Any, checked: bool) -> Optional[Plan]: ...
  def alloc_decode(self, state: Any, plan: Plan, fits: bool) -> Tuple[Any, Any, Any]: ...
  def free(self, state: Any, idx: Any, values: Any, counts: Counts,
           shared: bool) -> Tuple[Any, Any, Any]: ...
  def free_page_ids(self, state: Any, ids: Any, counts: Counts,
                    shared: bool) -> Tuple[Any, Any, Any]: ...
  def merge_and_sort_free(self, state: Any, side: int, shared: bool) -> Any: ...
  # patches_record only:
  def detach(self, state: Any) -> Any: ...
  def restore(self, live: Any, snap: Any, lengths: Any, snap_lengths: Any,
              same_lineage: bool) -> Any: ...
  def own_record(self, state: Any) -> Any: ...
  # defers_status only: `running`, the running status after the last call (i32[3] on
  # the device, or i32[6]: it, then that call's own status, which the call returns as
  # its status too; jax_kvalloc.sglang.backends.status), whether its copy to the host is
  # started at each launch (`copies_status`), and its reset
  running: Any
  copies_status: bool
  def reset_running(self) -> None: ...
  def warmup(self, state: Any, *, max_batch: int, max_tokens: int, max_free: int,
             exact_sizes: Sequence[int], extend: bool,
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


def make_backend(name: str, config: Any, device: Any) -> Backend:
  """The backend a class runs on: `name` "device" or "host", debug mode (config.debug)
  on either. `config`: an AllocatorConfig (one pool) or a jax_kvalloc.swa.SWAConfig (the
  SWA pool pair). `device`: where a device or debug state lives (resolve_device's
  forms)."""
  # pylint: disable=g-import-not-at-top
  if name not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
  swa = not isinstance(config, AllocatorConfig)
  if config.debug:
    if swa:
      from jax_kvalloc.sglang.backends.device_swa import DebugSWABackend
      return DebugSWABackend(config, "cpu" if name == "host" else device,
                             host_results=name == "host")
    from jax_kvalloc.sglang.backends.debug import DebugBackend
    return DebugBackend(config, "cpu" if name == "host" else device,
                        host_results=name == "host")
  if name == "host":
    if swa:
      from jax_kvalloc.sglang.backends.host_swa import HostSWABackend
      return HostSWABackend(config)
    from jax_kvalloc.sglang.backends.host import HostBackend
    return HostBackend(config)
  if swa:
    from jax_kvalloc.sglang.backends.device_swa import DeviceSWABackend
    return DeviceSWABackend(config, device)
  from jax_kvalloc.sglang.backends.device import DeviceBackend
  return DeviceBackend(config, device)


class PagedStateReads:
  """`lengths` and `check_state` of the backends whose state is one AllocatorState
  (device, host, debug)."""
  config: AllocatorConfig

  def lengths(self, state: AllocatorState) -> Tuple[int, int]:
    """(free_len, release_len) read from the state (a device state: a wait)."""
    return int(state.free_len), int(state.release_len)

  def check_state(self, state: AllocatorState, current: AllocatorState) -> Tuple[int, int]:
    """set_state's checks (ValueError/TypeError naming what is wrong) and a refusal the
    state's ownership record holds (guard.FreeRefusedError); the lengths."""
    validate.state_like(state, current, AllocatorState)
    lengths = validate.state_lengths(state, self.config.num_pages)
    guard.raise_if_refused(state)
    return lengths
