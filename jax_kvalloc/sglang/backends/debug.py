"""The debug backend: debug mode (`debug=True`, default JAX_KVALLOC_DEBUG) on either
placement.

The state carries jax_kvalloc.debug's bookkeeping beside the ownership record (SPEC 14,
when guard is on), and every call runs the functional core's own jitted operation on the
whole state (its checks included), then reads both records. A free the ownership record
refused comes back as its OWNED status (the class raises ValueError naming the operation
and the page, as on the other backends, and refuses every call until clear() or
restore_state()); any other misuse debug mode finds (a last_loc in a page the request
does not hold, two outputs naming one slot, a double free with guard=False, ...) raises
`AllocatorDebugError` naming the argument and entry. Either way the call was refused
inside and the class keeps the state it had. These calls wait (they read the records),
and they never donate (the copying programs only).

`backend="host"` in debug mode keeps the state on the CPU device and returns numpy.
"""
from __future__ import annotations

from typing import Any, Tuple

import jax
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import buckets
from jax_kvalloc import debug as _debug
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.sglang.backends import PagedStateReads
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import resolve_device
from jax_kvalloc.sglang.backends import status as _status
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport

_ALLOC = jax.jit(allocation.alloc, static_argnames=("config", "max_size"))
_ALLOC_EXTEND = jax.jit(allocation.alloc_extend, static_argnames=("config", "max_tokens"))
_ALLOC_DECODE = jax.jit(allocation.alloc_decode, static_argnames=("config",))
_FREE = jax.jit(freeing.free, static_argnames=("config",))
_FREE_PAGE_IDS = jax.jit(freeing.free_page_ids, static_argnames=("config",))
_MERGE = jax.jit(freeing.merge_and_sort_free, static_argnames=("config",))
_INIT = jax.jit(st.init, static_argnames=("config",))


def owned_status(old: Any, new: Any) -> Any:
  """The OWNED status (host i32[3]) of the first ownership-record refusal that `new`
  recorded and `old` had not (each an AllocatorState, or an SWAState: its full pool,
  then its SWA pool), or None. Reads the device."""
  parts = ((0, old, new),) if isinstance(new, AllocatorState) else (
      (1, old.full, new.full), (2, old.swa, new.swa))
  for pool, o, n in parts:
    if n.guard is None:
      continue
    before, after = jax.device_get((o.guard.status, n.guard.status))
    if after[0] and not before[0]:
      return _status.owned_host(int(after[1]), int(after[2]), pool)
  return None


class DebugBackend(PagedStateReads):
  """The Backend (jax_kvalloc.sglang.backends) of debug mode (see the module docstring).

  Allocations run even when the class found that they do not fit, so that their checks
  still see the input (the functional core refuses them itself); only a batch that needs
  more pages than the whole pool returns None without a call (its output bucket would be
  as large as the request).
  """

  keeps_device_arrays = False
  defers_status = False
  writes_whole_state = False
  patches_record = False  # never donates: snapshots keep the whole state

  def __init__(self, config: AllocatorConfig, device: Any, host_results: bool):
    self.config = config
    self.pools = (config,)
    self.device = resolve_device(device)
    self.host_results = host_results

  def init(self) -> AllocatorState:
    return jax.device_put(_INIT(self.config), self.device)

  def adopt(self, state: AllocatorState) -> AllocatorState:
    if isinstance(state.free_ring, jax.Array):
      return state
    return jax.device_put(jax.tree.map(np.asarray, state), self.device)

  def check_state(self, state: AllocatorState, current: AllocatorState) -> Tuple[int, int]:
    """set_state's checks, and a misuse the caller's code recorded raises
    guard.FreeRefusedError / AllocatorDebugError (the state is not taken)."""
    lengths = super().check_state(state, current)
    err = _debug.get_error(state)
    if err is not None:
      raise err
    return lengths

  def empty(self) -> Any:
    return np.zeros((0,), np.int32) if self.host_results else jax.device_put(
        np.zeros((0,), np.int32), self.device)

  def _run(self, fn, state, *args, **kwargs):
    """fn(config, state, ...) -> (state, *rest, status): status the OWNED status of a
    refusal the ownership record recorded in this call (None if none); raises any other
    misuse debug mode recorded."""
    result = fn(self.config, state, *args, **kwargs)
    new, rest = (result, ()) if isinstance(result, AllocatorState) else (result[0],
                                                                        result[1:])
    refused = owned_status(state, new)
    if refused is not None:
      return new, rest, refused
    err = _debug.get_error(new)
    if err is not None:
      raise err
    return new, rest, None

  def _output(self, state, rest, n: int):
    out, ok = rest[:2]
    if not bool(ok):
      return state, None, None
    if self.host_results:
      return state, np.array(np.asarray(out)[:n], np.int32), None
    return state, out[:n], None

  def alloc(self, state, need_size, fits):
    if need_size // self.config.page_size > self.config.num_pages:
      return state, None, None
    del fits  # the core decides again, after its checks
    new, rest, _ = self._run(_ALLOC, state, np.int32(need_size),
                             max_size=buckets.bucket(need_size, buckets.MIN_TOKENS))
    return self._output(new, rest, need_size)

  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    if checked is None:
      return None
    return Plan(pre.shape[0], checked.new_pages, checked.total_tokens, (pre, seq, last))

  def alloc_extend(self, state, plan, fits):
    del fits
    if plan.pages > self.config.num_pages:
      return state, None, None
    pre, seq, last = plan.data
    rows = buckets.bucket(plan.rows, buckets.MIN_BATCH)
    new, rest, _ = self._run(
        _ALLOC_EXTEND, state, buckets.pad(pre, rows), buckets.pad(seq, rows),
        buckets.pad(last, rows, -1), max_tokens=buckets.bucket(plan.tokens,
                                                               buckets.MIN_TOKENS),
        num_reqs=np.int32(plan.rows))
    return self._output(new, rest, plan.tokens)

  def decode_plan(self, seq, last, checked):
    if not checked:
      return None
    pages = int(np.count_nonzero((seq - 1) % self.config.page_size == 0))
    return Plan(seq.shape[0], pages, seq.shape[0], (seq, last))

  def alloc_decode(self, state, plan, fits):
    del fits
    seq, last = plan.data
    rows = buckets.bucket(plan.rows, buckets.MIN_BATCH)
    new, rest, _ = self._run(_ALLOC_DECODE, state, buckets.pad(seq, rows),
                             buckets.pad(last, rows, -1), num_reqs=np.int32(plan.rows))
    return self._output(new, rest, plan.rows)

  def free(self, state, idx, values, counts, shared):
    """Runs even when nothing reaches the list: a double free must still be found."""
    del values, counts, shared
    n = buckets.bucket(idx.shape[0], buckets.MIN_FREE)
    return self._freed(state, self._run(_FREE, state,
                                        buckets.pad(idx.astype(np.int32), n)))

  def free_page_ids(self, state, ids, counts, shared):
    del counts, shared
    ids = np.asarray(ids).astype(np.int32)
    n = buckets.bucket(ids.shape[0], buckets.MIN_FREE)
    return self._freed(state, self._run(_FREE_PAGE_IDS, state, buckets.pad(ids, n),
                                        np.int32(ids.shape[0])))

  @staticmethod
  def _freed(state, run):
    """A free's (state, None, status): the old state when the record refused it."""
    new, _, refused = run
    return (state if refused is not None else new), None, refused

  def merge_and_sort_free(self, state, side, shared):
    del side, shared
    return self._run(_MERGE, state)[0]

  def warmup(self, state, **kwargs) -> WarmupReport:
    del state, kwargs  # debug mode compiles its programs on first use
    return WarmupReport(0, 0.0)
