"""What a backend call refused (SPEC 14): one status value per call, and its message.

A device program returns, beside its results, `status: i32[3] = (reason, index,
value)`, all 0 when it did exactly what the class's host mirror counted on: an
allocation the mirror said fits was not refused, a free put on its list every entry the
mirror counted, and an SWA call found the peers it needs. Otherwise `reason` is:

  REFUSED       an allocation was refused (ok False): the device state was short of the
                pages the mirror counted, or a device last_loc broke SPEC 4's rules.
                Its slots are all 0.
  NOT_LISTED    a free named an entry, its argument's [index] = value, that does not
                reach the list (page 0 or a page outside the pool); index -1 when the
                list took fewer entries than counted for another reason (value: how
                many fewer).
  NO_PEER       an SWA free named a full slot, free_index[index] = value, whose SWA KV
                was freed already (the caller wants free_full / free_full_segment).
  LAST_NO_PEER  an SWA allocation continues the page of last_loc[index] = value, whose
                SWA KV was freed already, so the SWA pool cannot continue it.
  OWNED         the ownership record (SPEC 14, jax_kvalloc.guard) refused a free: page
                `value` is not held (guard.WHY[index % 8] says why: page 0, outside the
                pool, not held, named twice); index // 8 names the pool (0: the pool;
                1, 2: an SWA pair's full and SWA pool).

A refused call changes nothing (each program keeps the old state when it refuses). The
host backend finds the same cases on the host, before anything changes, and returns the
same status as a host array (the class raises at once). A device program also takes the
pool's running status, `prev: i32[3]`, and returns the new one, `running(prev, status)`:
the first refusal since the pool's last reset (clear, restore), all 0 while there is
none. The device backend's class reads only that running status, once it has landed
(`start_copy` at the launch off the CPU, `read`; jax_kvalloc.sglang.pool), and
reads the per-call statuses it kept only when the running one shows a refusal, to name
the call. An OWNED refusal is sticky on every backend (as the record's own status is):
every later call raises until `clear()` or `restore_state()`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import jax
from jax._src import config as _config
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import guard as _guard

REFUSED, NOT_LISTED, NO_PEER, LAST_NO_PEER, OWNED = 1, 2, 3, 4, 5
_GUARD = getattr(_config, "transfer_guard_device_to_host", None)  # its current value
POOLS = ("", " in the full pool", " in the SWA pool")  # OWNED's index // 8

# The argument whose entries a free's NOT_LISTED index points into, by operation.
_LISTED_ARG = {"free_page_ids": "page_ids",
               "free_segment": "free_index[::page_size] // page_size",
               "free_segments": "the segments' pages",
               "free_group_end": "the queued page ids"}


def _own_transfer() -> Any:
  """The class's own status transfers: a transfer guard the caller set
  (jax.transfer_guard_device_to_host) does not apply to them."""
  if _GUARD is None or _GUARD.value in (None, "allow"):
    return contextlib.nullcontext()
  return jax.transfer_guard_device_to_host("allow")


def start_copy(status: jax.Array) -> None:
  """Starts a device status's copy to the host (no wait)."""
  with _own_transfer():
    status.copy_to_host_async()


def read(status: Any) -> np.ndarray:
  """A status as host ints (a device one: its host copy once landed, else a wait)."""
  if _GUARD is None or _GUARD.value in (None, "allow"):
    return np.asarray(status)
  with _own_transfer():
    return np.asarray(status)


def make(reason: int, bad: jax.Array, index: jax.Array = 0,
         value: jax.Array = 0) -> jax.Array:
  """i32[3] status (traced): (reason, index, value) where `bad`, else 0."""
  got = jnp.stack([jnp.int32(reason), jnp.asarray(index, jnp.int32),
                   jnp.asarray(value, jnp.int32)])
  return jnp.where(bad, got, 0)


def running(prev: jax.Array, status: jax.Array) -> jax.Array:
  """The running status (traced i32[3]) after a call whose status is `status`: `prev`
  if it holds a refusal (the first one wins), else `status`."""
  return jnp.where(prev[0] != 0, prev, status)


def first(*statuses: jax.Array) -> jax.Array:
  """The first refusal among `statuses` (traced i32[3] each), 0 if none."""
  out = statuses[-1]
  for s in statuses[-2::-1]:
    out = jnp.where(s[0] != 0, s, out)
  return out


def owned(record_status: jax.Array, pool: int = 0) -> jax.Array:
  """OWNED status (traced i32[3]) of a call whose ownership record recorded
  `record_status` = (op, why, page) (guard.GuardState.status of a fresh record; op 0:
  no refusal), in pool `pool` (0: a single pool; 1, 2: an SWA pair's full, SWA)."""
  return make(OWNED, record_status[0] != 0, record_status[1] + 8 * pool, record_status[2])


def owned_host(why: int, page: int, pool: int = 0) -> np.ndarray:
  """The same OWNED status as a host array (the host backend's refusals)."""
  return np.array([OWNED, why + 8 * pool, page], np.int32)


def unlisted(values: jax.Array, given: jax.Array, listed: jax.Array,
             short: jax.Array) -> jax.Array:
  """NOT_LISTED status of a free of `values` (i32[M]): the first given entry that is
  not `listed` (bool[M]), or index -1 and `short` when the list took `short` fewer
  entries than counted and every entry was listable."""
  bad = given & ~listed
  i = jnp.argmax(bad)
  return jnp.where(bad[i], make(NOT_LISTED, True, i, values[i]),
                   make(NOT_LISTED, short != 0, -1, short))


def message(op: str, values: Sequence[int]) -> Optional[str]:
  """The ValueError message of `op`'s status read back to the host (None: no refusal)."""
  reason, index, value = (int(v) for v in values)
  return None if reason == 0 else error_message(op, reason, index, value)


def error_message(op: str, reason: int, index: int = 0, value: int = 0) -> str:
  """The message the classes raise (ValueError) for a refusal of `op`."""
  if reason == REFUSED:
    return (f"{op} was refused: the pool did not hold the free pages the host mirror "
            f"counted (an earlier free named pages the device did not take), or a "
            f"device last_loc broke SPEC 4's alignment; its slots are all 0")
  if reason == NOT_LISTED:
    if index < 0:
      return (f"{op}: {value} of the entries it named did not reach the free list; "
              f"nothing was freed")
    arg = _LISTED_ARG.get(op, "free_index")
    return (f"{op}: {arg}[{index}]={value} is not a page of the pool (page 0 or "
            f"outside it); nothing was freed")
  if reason == NO_PEER:
    return (f"{op}: free_index[{index}]={value} has no SWA peer (its sliding-window KV "
            f"was freed already: free it with free_full / free_full_segment); nothing "
            f"was freed")
  if reason == OWNED:
    return (f"{op}: page {value} {_guard.WHY.get(index % 8, 'is refused')}"
            f"{POOLS[index // 8] if 0 <= index // 8 < len(POOLS) else ''}; nothing was "
            f"freed (the ownership record, SPEC 14)")
  if reason == LAST_NO_PEER:
    return (f"{op}: last_loc[{index}]={value} has no SWA peer (its sliding-window KV was "
            f"freed), so the SWA pool cannot continue its page; nothing was allocated")
  raise ValueError(f"unknown status reason {reason}")
