"""The device backend: the state lives in jax arrays on one device, and each class call
is one cached jitted program launched without waiting.

The class keeps an exact host mirror of the list lengths (SGLang's `*_cpu` copies give
every page count; jax_kvalloc.sglang.pool), so it knows before launching whether a call
fits and whether need_sort must merge first. What is left for the device is the index
computation and the ring write:

  * inputs travel in one transfer: the per-request ints are packed into one i32 array
    that the program slices apart again; a `last_loc` that is already a device array
    (SGLang computes it on the device) is not read back but passed as a second input,
    padded to the row bucket on the device by a cached tiny program (`padded`); page ids
    that are a device array (free_page_ids, free_segment) are padded the same way;
  * each array in or out costs a launch ~0.5 us on a CPU, so the four list scalars
    (free_head, free_len, release_head, release_len) travel as one i32[4], `meta`,
    kept by the backend beside the state it returned (whose own scalars are then
    stale: `unpacked` reads them out, one launch, when the pool's `state` is read:
    views, snapshots, `state`); a snapshot keeps its meta too (`kept`), so a restore
    needs no `pack` launch; only a state from elsewhere (clear, set_state, a merge)
    is packed, at its first call;
  * an allocation takes only free_ring, meta and the ownership record's `held` (SPEC
    14), and returns the new meta, held and indices: it never writes a ring, so a
    snapshot that holds the rings stays valid for free; `held` is donated (snapshots
    do not keep it: a restore patches the live one, `restore`);
  * a free takes and returns only the ring it writes, donated unless a snapshot still
    holds it (then that one ring is copied: copy-on-write), and the record (donated);
    the entries it writes lie outside the live list until its new head and length take
    them in, so a refused free keeps the old head and length and changes nothing (the
    record refuses a free whole: its held is unchanged too); once the record holds a
    refusal, frees free nothing (as the host backend raises at once, and the class
    raises when it reads the status), so the backends end in the same state;
  * the merge runs as its own call, only when the host's mirror says it triggers, so the
    allocation programs carry no merge branch (config.need_sort is off inside them);
  * every program but the merge also returns a status (jax_kvalloc.sglang.backends.
    status): what it refused of what the mirror counted on; and takes the pool's
    running status (the first refusal since the last reset) and returns the new one
    with its own status as one i32[6] (running, then its own: `_jit_packed`), kept by
    the backend (`running`), the one status the class reads back (once landed);
  * alloc_extend's row counts, token and free counts pad to a power-of-two bucket
    (jax_kvalloc.buckets), alloc_decode's rows to `decode_rows`; an output
    longer than asked is cut by `exact`, a cached jitted slice (a second, tiny launch;
    no wait) compiled once per (bucket, length). An alloc_decode of up to EXACT_ROWS
    requests runs at its exact size (a program per size), so it is one launch whether
    last_loc comes from the host or the device; `warmup` compiles the programs ahead.

Programs are cached per (config, operation, shape) across instances and devices
(`Programs.for_config`) while a pool of that config lives, and for the RECENT configs
used last: a process that makes and drops pools of many configs keeps the programs of
the live ones and of RECENT others (SPEC 14; a live config's are never dropped).
jax_kvalloc.sglang.backends.device_swa adds the SWA pool's programs to the same
machinery.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import buckets
from jax_kvalloc import freeing
from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc import warmup as _warmup
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.guard import GuardState
from jax_kvalloc.sglang.backends import PagedStateReads
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import host
from jax_kvalloc.sglang.backends import resolve_device
from jax_kvalloc.sglang.backends import status as _status
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport

Array = jax.Array


def compiler_options() -> Dict[str, Any]:
  """XLA options for the device programs: on a GPU host, a CUDA graph for every
  program, however few its kernels (`xla_gpu_graph_min_graph_size=1`; XLA's default
  needs 5): these programs are 1-10 small kernels, and launching each one separately
  costs host time (measured: benchmarks/results/2026-11-30-h200-run6-probe). JAX_KVALLOC_GPU_GRAPHS=0 turns it
  off (to compare). Not passed where there is no GPU."""
  if os.environ.get("JAX_KVALLOC_GPU_GRAPHS", "1") == "0":
    return {}
  try:
    has_gpu = bool(jax.devices("gpu"))
  except RuntimeError:
    has_gpu = False
  return {"xla_gpu_graph_min_graph_size": 1} if has_gpu else {}


EXACT_ROWS = 64  # decode batches up to this many requests run at their exact size


def rows(bs: int) -> int:
  """The row count an alloc_extend batch of `bs` requests runs at: its bucket."""
  return buckets.bucket(bs, buckets.MIN_BATCH)


def decode_rows(bs: int) -> int:
  """The row count an alloc_decode batch of `bs` requests runs at: `bs` itself up to
  EXACT_ROWS (one program per size, whose output needs no slice: one launch a call),
  then its bucket."""
  return bs if 0 < bs <= EXACT_ROWS else rows(bs)


def pack(rows_: int, bs: int, *columns: Any) -> np.ndarray:
  """i32[len(columns) * rows_ + 1]: each column of `bs` host ints padded with 0 to rows_
  (padding rows are masked by the count; a None column stays 0: the program takes that
  one as a device array), then bs."""
  packed = np.zeros((len(columns) * rows_ + 1,), np.int32)
  for k, col in enumerate(columns):
    if col is not None:
      packed[k * rows_:k * rows_ + bs] = col
  packed[-1] = bs
  return packed


# Configs whose programs are kept after their last pool is dropped (a test suite, a
# server that resizes, come back to recent ones): each holds ~100-200 memory maps here.
RECENT = 32

_LIVE: "weakref.WeakValueDictionary[Tuple[type, Any], Programs]" = (
    weakref.WeakValueDictionary())  # (class, config) -> programs, while anything holds them
_RECENT: "collections.OrderedDict[Tuple[type, Any], Programs]" = collections.OrderedDict()
_LOCK = threading.Lock()


class Programs:
  """Jitted programs of one config, compiled once per shape: `fn((op, *shape))` builds
  with `_build(op, *shape)` (subclasses add operations) and caches. `init_state` is the
  functional core's init of the config (subclasses set it)."""

  init_state: Callable[..., Any] = staticmethod(st.init)

  def __init__(self, config: Any):
    self.config = config
    self._fns: Dict[Tuple[Any, ...], Callable[..., Any]] = {}
    self._jit = functools.partial(jax.jit, compiler_options=compiler_options())

  @classmethod
  def for_config(cls, config: Any) -> "Programs":
    """The (shared) programs of one config: the same object while any pool holds it
    (each backend keeps a reference), and kept for the RECENT configs asked for last;
    once neither holds it, it is dropped with its jitted functions, whose compiled
    programs jax then releases."""
    key = (cls, config)
    with _LOCK:
      programs = _LIVE.get(key)
      if programs is None:
        programs = _LIVE[key] = cls(config)
      _RECENT[key] = programs
      _RECENT.move_to_end(key)
      while len(_RECENT) > RECENT:
        _RECENT.popitem(last=False)
    return programs

  def fn(self, key: Tuple[Any, ...]) -> Callable[..., Any]:
    fn = self._fns.get(key)
    if fn is None:
      fn = self._fns[key] = self._build(*key)
    return fn

  def _jit_status(self, fn: Callable[..., Any],
                  donate: Tuple[int, ...] = ()) -> Callable[..., Any]:
    """fn(*args) -> (..., status) jitted as fn(prev, *args) -> (..., status, running),
    `prev` and `running` the pool's running status (i32[3]) before and after the call
    (status.running); `donate`: the indices of fn's donated arguments."""
    def run(prev, *args):
      *out, status = fn(*args)
      return (*out, status, _status.running(prev, status))
    return self._jit(run, donate_argnums=tuple(i + 1 for i in donate))

  def _build(self, op: str, *shape: Any) -> Callable[..., Any]:
    if op == "init":  # the config's initial state
      return self._jit(functools.partial(type(self).init_state, self.config))
    if op == "copy":  # a pytree copied (a record held outside)
      return self._jit(lambda x: jax.tree.map(jnp.copy, x))
    if op == "slice":
      n = shape[1]
      return self._jit(lambda x: x[:n])
    if op == "pad":
      n, rows_, fill = shape
      return self._jit(lambda x: jnp.pad(x.astype(jnp.int32), (0, rows_ - n),
                                         constant_values=fill))
    raise ValueError(f"unknown operation {op!r}")

  def padded(self, x: Any, rows_: int, fill: int) -> Any:
    """i32[n] padded with `fill` to i32[rows_]: host ints padded on the host; a device
    array padded on the device without waiting (itself when it has that length, else
    one launch of a cached jitted pad, compiled once per (n, rows_, fill))."""
    if not isinstance(x, jax.Array):
      return buckets.pad(np.asarray(x), rows_, fill)
    if x.shape[0] == rows_:
      return x
    return self.fn(("pad", x.shape[0], rows_, fill))(x)

  def with_counts(self, values: Any, m: int, *counts: int) -> Tuple[Any, ...]:
    """A free program's inputs: `values` padded with 0 to m, then the ints `counts`:
    one host i32[m + len(counts)] for host values (one transfer), or (the values padded
    on the device, the counts as a host i32 array) for a device array."""
    if isinstance(values, jax.Array):
      return self.padded(values, m, 0), np.array(counts, np.int32)
    packed = np.zeros((m + len(counts),), np.int32)
    packed[:values.shape[0]] = values
    packed[m:] = counts
    return (packed,)

  def exact(self, out: Array, n: int) -> Array:
    """out[:n] without waiting: `out` itself when it has that length, else one launch of
    a cached jitted slice."""
    if out.shape[0] == n:
      return out
    return self.fn(("slice", out.shape[0], n))(out)


def _fresh(held: Any) -> Any:
  """The ownership record the programs run on: `held` and a status of this call alone
  (None without a record)."""
  return None if held is None else GuardState(held, jnp.zeros((3,), jnp.int32))


def _alloc_state(ring: Array, head: Array, length: Array, held: Any) -> AllocatorState:
  """A state for the allocation functions: only the free list is read (need_sort off)."""
  zero = jnp.zeros((), jnp.int32)
  return AllocatorState(free_ring=ring, free_head=head, free_len=length, release_ring=ring,
                        release_head=zero, release_len=zero, guard=_fresh(held))


def _write_state(config: AllocatorConfig, ring: Array, head: Array, length: Array,
                 other_len: Array, held: Any) -> AllocatorState:
  """A state for the free functions: the list they write (release_pages when need_sort,
  else free_pages) and the other list's length (the room check reads it)."""
  dummy, zero = jnp.zeros((0,), jnp.int32), jnp.zeros((), jnp.int32)
  if config.need_sort:  # the other ring is never read: the free writes this list
    return AllocatorState(dummy, zero, other_len, ring, head, length, guard=_fresh(held))
  return AllocatorState(ring, head, length, dummy, zero, other_len, guard=_fresh(held))


def _held(s: AllocatorState) -> Any:
  return None if s.guard is None else s.guard.held


def _taken(meta: Array, s: AllocatorState) -> Array:
  """meta (i32[4]: free head, free length, release head, release length) after an
  allocation left the free list at s.free_head, s.free_len."""
  return meta.at[0].set(s.free_head).at[1].set(s.free_len)


class DeviceOps(Programs):
  """Jitted programs of one pool config, compiled once per shape bucket."""

  def __init__(self, config: AllocatorConfig):
    super().__init__(config)
    # The host runs any merge as its own call first, so allocations need no merge branch.
    self._alloc_cfg = dataclasses.replace(config, need_sort=False)

  def _jit_packed(self, fn: Callable[..., Any],
                  donate: Tuple[int, ...] = ()) -> Callable[..., Any]:
    """fn(*args) -> (..., status) jitted as fn(prev, *args) -> (..., both), `prev` the
    running status before the call (i32[3], or i32[6] whose first three are it) and
    `both` i32[6]: the running status after the call, then the call's own status (the
    pool reads both[:3] and both[3:]); `donate`: the indices of fn's donated arguments.
    Fewer arrays in and out than `_jit_status`: each costs the launch ~0.5 us."""
    def run(prev, *args):
      *out, status = fn(*args)
      return (*out, jnp.concatenate([_status.running(prev[:3], status), status]))
    return self._jit(run, donate_argnums=tuple(i + 1 for i in donate))

  def _build(self, op: str, *shape: Any) -> Callable[..., Any]:
    acfg, cfg = self._alloc_cfg, self.config
    # Allocations and frees donate the record's held (argument 2): the class keeps it
    # owned (Pool.own_record). The list scalars (`meta`, argument 1) are not donated: a
    # snapshot may keep them (DeviceBackend.kept).
    held_arg = (2,) if cfg.guard else ()
    if op == "pack":  # the four list scalars as one meta i32[4]
      return self._jit(lambda *scalars: jnp.stack(
          [jnp.asarray(x, jnp.int32) for x in scalars]))
    if op == "unpack":  # meta i32[4] as its four scalars
      return self._jit(lambda meta: tuple(meta[i] for i in range(4)))
    if op == "decode_on_device":  # seq_lens and last_loc device arrays of `rows` rows
      def decode_fn(ring, meta, held, seq, last):
        s, out, ok = allocation.alloc_decode(
            acfg, _alloc_state(ring, meta[0], meta[1], held), seq, last)
        return (_taken(meta, s), _held(s), out, _status.make(_status.REFUSED, ~ok))
      return self._jit_packed(decode_fn, held_arg)
    if op in ("alloc", "extend", "decode"):
      def alloc_fn(ring, meta, held, packed, last=None):
        s = _alloc_state(ring, meta[0], meta[1], held)
        if op == "alloc":
          s, out, ok = allocation.alloc(acfg, s, packed[0], max_size=shape[0])
        elif op == "extend":
          r, tokens = shape
          last = packed[2 * r:3 * r] if last is None else last
          s, out, ok = allocation.alloc_extend(acfg, s, packed[:r], packed[r:2 * r], last,
                                               max_tokens=tokens, num_reqs=packed[3 * r])
        else:
          (r,) = shape
          last = packed[r:2 * r] if last is None else last
          s, out, ok = allocation.alloc_decode(acfg, s, packed[:r], last,
                                               num_reqs=packed[2 * r])
        return _taken(meta, s), _held(s), out, _status.make(_status.REFUSED, ~ok)
      return self._jit_packed(alloc_fn, held_arg)
    if op in ("free", "free_page_ids"):
      _, donate = shape
      body = freeing.free if op == "free" else freeing.free_page_ids
      mine_at = 2 if cfg.need_sort else 0  # meta's (head, length) of the written list

      def free_fn(ring, meta, held, sticky, values, count=None):
        head, length = meta[mine_at], meta[mine_at + 1]
        other_len = meta[3 - mine_at]
        if count is None:  # host values: the counts ride at their end (one transfer)
          values, count = values[:-2], values[-2:]
        lo = cfg.page_size if op == "free" else 1  # free: slots; else page ids
        listed = (values >= lo) & (values <= (cfg.num_pages + 1) * lo - 1)
        given = jnp.arange(values.shape[0]) < count[1]
        named = values
        if held is not None:  # a 0 the caller gave is no padding here: the record
          named = jnp.where(given & (values == 0), -1, values)  # refuses it whole;
          named = jnp.where(sticky[0] != 0, 0, named)  # after a refusal nothing is freed
        s = body(cfg, _write_state(cfg, ring, head, length, other_len, held), named)
        ring, new_head, new_len = st.freed_list(cfg.need_sort, s)[:3]
        short = count[0] - (new_len - length)
        bad = short != 0  # refused whole: the entries written lie outside the list
        status = _status.unlisted(values, given, listed, short)
        meta = meta.at[mine_at].set(jnp.where(bad, head, new_head)).at[mine_at + 1].set(
            jnp.where(bad, length, new_len))
        if held is None:
          return ring, meta, None, None, status
        mine = s.guard.status  # this call's refusal: named before a short count
        status = jnp.where((status[0] != 0) & (status[1] >= 0), status,
                           _status.first(_status.owned(mine), status))
        return (ring, meta, s.guard.held, guard.record_status(sticky, mine[0] != 0, mine),
                status)
      donated = ((0,) if donate else ()) + held_arg
      return self._jit_packed(free_fn, donated)
    if op == "patch":  # held[ring window] = 0: a restore's record (restore_record)
      (n,) = shape

      def patch_fn(held, ring, head, count):
        cap = ring.shape[0]
        i = jnp.arange(n, dtype=jnp.int32)
        at = jnp.where(i < count[0], ring[(head + i) % cap], held.shape[0])
        return held.at[at].set(0, mode="drop"), jnp.zeros((3,), jnp.int32)
      return self._jit(patch_fn, donate_argnums=(0,))
    if op == "rebuild":  # the record of a state's lists (a restore across pools)
      return self._jit(lambda s: (st.held_from_lists(s), jnp.zeros((3,), jnp.int32)))
    if op == "merge":
      (donate,) = shape

      def merge_fn(free_ring, free_head, free_len, release_ring, release_head, release_len):
        s = freeing.merge_and_sort_free(cfg, AllocatorState(
            free_ring, free_head, free_len, release_ring, release_head, release_len))
        return s.free_ring, s.free_head, s.free_len, s.release_head, s.release_len
      return self._jit(merge_fn, donate_argnums=(0,) if donate else ())
    return super()._build(op, *shape)

  # -- operations (the class has validated the input and decided that it fits) ---------
  # Each takes the running status `prev` (i32[3] or i32[6], see _jit_packed), the state
  # and its list scalars `meta` (i32[4], `pack`; the state's own scalars are not read),
  # and returns (state, meta, slots i32[n], both: i32[6] running status and the call's),
  # or a free's (state, meta, both). The state returned keeps the scalars it had: meta
  # holds the new ones (DeviceBackend keeps it beside the state; `unpack`).
  def pack(self, state: AllocatorState) -> Array:
    """The state's list scalars as one meta i32[4] (one launch)."""
    return self.fn(("pack",))(state.free_head, state.free_len, state.release_head,
                              state.release_len)

  def unpack(self, state: AllocatorState, meta: Array) -> AllocatorState:
    """The state with the list scalars of `meta` (one launch)."""
    head, length, rhead, rlen = self.fn(("unpack",))(meta)
    return state._replace(free_head=head, free_len=length, release_head=rhead,
                          release_len=rlen)

  def _allocate(self, key: Tuple[Any, ...], prev: Array, state: AllocatorState,
                meta: Array, packed: np.ndarray, extra: Tuple[Any, ...], n: int
                ) -> Tuple[AllocatorState, Array, Array, Array]:
    rec = state.guard
    meta, held, out, both = self.fn(key)(
        prev, state.free_ring, meta, None if rec is None else rec.held, packed, *extra)
    # A new state object either way: meta belongs to it alone (DeviceBackend._meta_of),
    # not to the one a snapshot may hold.
    state = state._replace(guard=None if rec is None else GuardState(held, rec.status))
    return state, meta, self.exact(out, n), both

  def alloc(self, prev: Array, state: AllocatorState, meta: Array, need_size: int):
    size = buckets.bucket(need_size, buckets.MIN_TOKENS)
    return self._allocate(("alloc", size), prev, state, meta,
                          np.array([need_size], np.int32), (), need_size)

  def alloc_extend(self, prev: Array, state: AllocatorState, meta: Array, pre: Any,
                   seq: Any, last: Any, total: int):
    """pre, seq: host ints[bs] (int64 arrays or lists); `last`: the same, or a device
    i32[bs] (jax.Array) taken as it is: padded on the device, never read back."""
    r = rows(len(pre))
    on_device = isinstance(last, jax.Array)
    packed = pack(r, len(pre), pre, seq, None if on_device else last)
    extra = (self.padded(last, r, -1),) if on_device else ()
    return self._allocate(("extend", r, buckets.bucket(total, buckets.MIN_TOKENS)), prev,
                          state, meta, packed, extra, total)

  def alloc_decode(self, prev: Array, state: AllocatorState, meta: Array, seq: Any,
                   last: Any, seq_dev: Any = None):
    """seq: host ints[bs] (an int64 array or a list); `last`: the same, or a device
    i32[bs] (jax.Array) taken as it is: padded on the device, never read back.
    `seq_dev`: seq as a device i32[bs], or None; with a device `last` at an exact row
    count the program takes both as they are (no transfer at all)."""
    bs = len(seq)
    r = decode_rows(bs)
    on_device = isinstance(last, jax.Array)
    if on_device and seq_dev is not None and r == bs:
      return self._allocate(("decode_on_device", r), prev, state, meta, seq_dev, (last,),
                            bs)
    packed = pack(r, bs, seq, None if on_device else last)
    extra = (self.padded(last, r, -1),) if on_device else ()
    return self._allocate(("decode", r), prev, state, meta, packed, extra, bs)

  def free(self, op: str, prev: Array, state: AllocatorState, meta: Array, values: Any,
           count: int, shared: bool) -> Tuple[AllocatorState, Array, Array]:
    """A free of validated values (host ints, or a device i32[n] padded with 0 on the
    device, never read): `free` slots or `free_page_ids` page ids. `count`: the entries
    that must reach the list (else the free is refused); `shared`: the ring it writes
    is held by a snapshot."""
    n = values.shape[0]
    m = buckets.bucket(n, buckets.MIN_FREE)
    rec = state.guard
    ring, meta, held, sticky, both = self.fn((op, m, not shared))(
        prev, st.freed_list(self.config.need_sort, state)[0], meta,
        *((None, None) if rec is None else rec), *self.with_counts(values, m, count, n))
    if self.config.need_sort:
      state = state._replace(release_ring=ring)
    else:
      state = state._replace(free_ring=ring)
    if rec is not None:
      state = state._replace(guard=GuardState(held, sticky))
    return state, meta, both

  def merge_and_sort_free(self, state: AllocatorState, shared: bool) -> AllocatorState:
    """The merge (SPEC 6); `shared`: the free ring is held by a snapshot."""
    ring, head, length, rhead, rlen = self.fn(("merge", not shared))(*state[:6])
    return state._replace(free_ring=ring, free_head=head, free_len=length,
                          release_head=rhead, release_len=rlen)

  def restore_record(self, live: AllocatorState, snap: AllocatorState, lengths,
                     snap_lengths, same_lineage: bool,
                     clean: Callable[[], Array]) -> AllocatorState:
    """A detached snapshot's state with its ownership record: the live held patched
    (one launch, donated: O(pages taken between them), host.patch says when), else
    rebuilt from the snapshot's lists (one launch, O(num_pages)); each launch also
    gives the record's status, zeros; `clean()` gives it where nothing is launched."""
    how = (host.patch(live, snap, lengths, snap_lengths)
           if same_lineage and live.guard is not None else None)
    if how is None:
      record = self.fn(("rebuild",))(snap)
    elif how[1] == 0:
      record = GuardState(live.guard.held, clean())
    else:
      head, count = how
      n = min(buckets.bucket(count, buckets.MIN_FREE), self.config.num_pages)
      record = self.fn(("patch", n))(live.guard.held, snap.free_ring, head,
                                     np.array([count], np.int32))
    return snap._replace(guard=GuardState(*record))


_ZEROS = jax.jit(lambda: jnp.zeros((3,), jnp.int32))


class RunningStatus:
  """A device backend's running status (status.running): i32[3] on its device, the
  first refusal of the calls launched since `reset_running` (0 if none), passed to and
  returned by each status-returning program; `_start_running(device, 6)`: i32[6], the
  running status then the last call's own (DeviceOps._jit_packed)."""
  running: Array

  def _start_running(self, device: Any, size: int = 3) -> None:
    self._zero = zero_status(device, size)
    # Off the CPU (where the host reads the device's own buffer), each running status's
    # copy to the host starts at its launch, so reading it once landed costs no transfer.
    self.copies_status = (device or jax.devices()[0]).platform != "cpu"
    self.running = self._zero

  def reset_running(self) -> None:
    """The running status back to no refusal (the pool's clear and restore)."""
    self.running = self._zero


class DeviceBackend(PagedStateReads, RunningStatus):
  """The Backend (jax_kvalloc.sglang.backends) of jax arrays on `device`: each call one
  launch of `DeviceOps.for_config(config)`'s programs, never a wait."""

  keeps_device_arrays = True
  defers_status = True
  writes_whole_state = False
  patches_record = True  # snapshots are detached: restore patches the live record

  def __init__(self, config: AllocatorConfig, device: Any):
    self.config = config
    self.pools = (config,)
    self.device = resolve_device(device)
    self.ops = DeviceOps.for_config(config)
    self._hc = host.host_config(config)
    self._empty = None
    self._start_running(self.device, 6)
    # The list scalars of the state last returned, as one i32[4] that the programs
    # take and return (DeviceOps.pack); that state's own scalars are stale until
    # `unpacked` reads them out (the pool's `state`).
    self._meta_state: Any = None
    self._meta: Any = None
    self._stale = False

  def _meta_of(self, state: AllocatorState) -> Array:
    """The list scalars of `state` the programs take: the kept ones, else packed."""
    if state is self._meta_state:
      return self._meta
    return self.ops.pack(state)

  def _landing(self, state: AllocatorState, meta: Array, out: Any,
               both: Array) -> Tuple[Any, Any, Array]:
    """A call's results: keeps meta beside the (stale) state and the running status,
    returns (state, output, status)."""
    self._meta_state, self._meta, self._stale = state, meta, True
    self.running = both
    return state, out, both

  def kept(self, state: AllocatorState) -> Any:
    """The list scalars kept beside `state` (an i32[4] no program writes), or None: a
    snapshot of `state` keeps them, so that its restore needs no `pack` launch."""
    return self._meta if state is self._meta_state and not self._stale else None

  def keep(self, state: AllocatorState, meta: Any) -> None:
    """`meta` (`kept`'s, or None: nothing) describes `state`, the pool's new state."""
    if meta is not None:
      self._meta_state, self._meta, self._stale = state, meta, False

  def unpacked(self, state: AllocatorState) -> AllocatorState:
    """The state with its own list scalars: those kept in meta read out (one launch)
    when it is the stale state last returned; else itself."""
    if state is not self._meta_state or not self._stale:
      return state
    state = self.ops.unpack(state, self._meta)
    self._meta_state, self._stale = state, False  # (meta still describes it)
    return state

  def init(self) -> AllocatorState:
    state = self.ops.fn(("init",))()
    return state if self.device is None else jax.device_put(state, self.device)

  def adopt(self, state: AllocatorState) -> AllocatorState:
    """A state from elsewhere (a snapshot, set_state) as this backend holds it; one
    without its ownership record (a detached snapshot) gets it rebuilt from its lists."""
    if not isinstance(state.free_ring, jax.Array):
      state = jax.device_put(jax.tree.map(np.asarray, state), self.device)
    if self.config.guard and state.guard is None:
      state = state._replace(guard=GuardState(*self.ops.fn(("rebuild",))(state)))
    return state

  def detach(self, state: AllocatorState) -> AllocatorState:
    return host.detach(state)

  def restore(self, live: AllocatorState, snap: AllocatorState, lengths, snap_lengths,
              same_lineage: bool) -> AllocatorState:
    """A detached snapshot's state with its record (DeviceOps.restore_record); others
    as `adopt`."""
    if (not self.config.guard or snap.guard is not None
        or not isinstance(snap.free_ring, jax.Array)):
      return self.adopt(snap)
    return self.ops.restore_record(live, snap, lengths, snap_lengths, same_lineage,
                                   functools.partial(zero_status, self.device))

  def own_record(self, state: AllocatorState) -> AllocatorState:
    """The state with a record of its own (the old one is held outside: the programs
    donate it); the list scalars kept beside it stay with it."""
    if state.guard is None:
      return state
    new = state._replace(guard=self.ops.fn(("copy",))(state.guard))
    if state is self._meta_state:
      self._meta_state = new
    return new

  def empty(self) -> Array:
    if self._empty is None:
      self._empty = jax.device_put(np.zeros((0,), np.int32), self.device)
    return self._empty

  def alloc(self, state, need_size, fits):
    if not fits:
      return state, None, None
    return self._landing(*self.ops.alloc(self.running, state, self._meta_of(state),
                                         need_size))

  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    """Checked input (`checked`: validate.extend_args' result), or host data the host
    backend's plans check and count (host.extend_plan_small / extend_plan: the same
    checks in fewer numpy calls); None otherwise (the class then checks it)."""
    if checked is not None:
      return Plan(pre.shape[0], checked.new_pages, checked.total_tokens, (pre, seq, last))
    hc = self._hc
    last, dev = self._stand_in(last, pre, 1)
    spre = host.small_ints(pre)
    sseq = host.small_ints(seq) if spre is not None else None
    slast = host.small_ints(last) if sseq is not None else None
    if slast is not None:
      plan = host.extend_plan_small(hc, spre, sseq, slast, extend_num_tokens)
      if plan is not None:
        return Plan(len(spre), plan[1], plan[0], (spre, sseq, slast if dev is None else dev))
    pre, seq, last = host.i64(pre), host.i64(seq), host.i64(last)
    if pre is None or seq is None or last is None:
      return None
    plan = host.extend_plan(hc, pre, seq, last, extend_num_tokens)
    if plan is None:
      return None
    return Plan(pre.shape[0], plan[1], plan[0], (pre, seq, last if dev is None else dev))

  def _stand_in(self, last: Any, lens: Any, offset: int) -> Tuple[Any, Any]:
    """(last_loc as the host plans check it, the device last_loc or None). A device
    int32 last_loc of len(lens) rows is taken as it is, checked by its aligned stand-in
    (validate.aligned_last_loc of lens); host data, and what the class must check
    itself (None), as given."""
    if not isinstance(last, jax.Array):
      return last, None
    if last.dtype != jnp.int32 or last.shape != (len(lens),):
      return None, None
    small = host.small_ints(lens)
    if small is not None:
      ps = self.config.page_size
      return [(n - offset) % ps if n >= offset else -1 for n in small], last
    if type(lens) is np.ndarray:
      return validate.aligned_last_loc(lens, self.config.page_size, offset), last
    return None, None

  def alloc_extend(self, state, plan, fits):
    if not fits:
      return state, None, None
    pre, seq, last = plan.data
    return self._landing(*self.ops.alloc_extend(self.running, state, self._meta_of(state),
                                                pre, seq, last, plan.tokens))

  def decode_plan(self, seq, last, checked):
    """Checked input (host int64 seq_lens; last_loc host int64 or device i32), or host
    data the host backend's plans check and count; None otherwise."""
    if checked:
      pages = int(np.count_nonzero((seq - 1) % self.config.page_size == 0))  # SPEC 4.3
      return Plan(seq.shape[0], pages, seq.shape[0], (seq, last))
    if isinstance(last, jax.Array):
      plan = self._device_last_decode_plan(seq, last)
      if plan is not None:
        return plan
    last, dev = self._stand_in(last, seq, 2)
    sseq = host.small_ints(seq)
    slast = host.small_ints(last) if sseq is not None else None
    if slast is not None:
      pages = host.decode_plan_small(self._hc, sseq, slast)
      if pages is None:
        return None
      return Plan(len(sseq), pages, len(sseq), (sseq, slast if dev is None else dev))
    seq, last = host.i64(seq), host.i64(last)
    if seq is None or last is None:
      return None
    plan = host.decode_plan(self._hc, seq, last)
    if plan is None:
      return None
    return Plan(seq.shape[0], plan[2], seq.shape[0], (seq, last if dev is None else dev))

  def _device_last_decode_plan(self, seq: Any, last: Array) -> Any:
    """The plan of a device int32 last_loc of len(seq) rows beside host seq_lens (a 1-D
    integer numpy array), as SGLang passes them: only seq_lens is checked here (in
    1..INT32_MAX) and counted; last_loc's alignment is the device's to check (a
    refusal). None for any other input (the general plans then check it)."""
    if (type(seq) is not np.ndarray or seq.ndim != 1 or seq.dtype.kind not in "iu"
        or not seq.shape[0] or last.dtype != jnp.int32 or last.shape != seq.shape):
      return None
    n, ps = seq.shape[0], self.config.page_size
    if n <= host.SMALL_BATCH:  # Python ints beat numpy's per-call costs here
      ints = seq.tolist()
      if min(ints) < 1 or max(ints) > host.INT32_MAX:
        return None
      return Plan(n, sum((v - 1) % ps == 0 for v in ints), n, (ints, last))  # SPEC 4.3
    if seq.min() < 1 or seq.max() > host.INT32_MAX:
      return None
    pages = int(np.count_nonzero(seq % ps == 1 % ps))  # (seq - 1) % ps == 0: SPEC 4.3
    return Plan(n, pages, n, (seq.astype(np.int64), last))

  def alloc_decode(self, state, plan, fits):
    if not fits:
      return state, None, None
    return self._landing(*self.ops.alloc_decode(self.running, state, self._meta_of(state),
                                                *plan.data, plan.seq_lens))

  def free(self, state, idx, values, counts, shared):
    del values  # the program finds the sorted unique pages itself
    return self._free("free", state, idx, counts, shared)

  def free_page_ids(self, state, ids, counts, shared):
    return self._free("free_page_ids", state, ids, counts, shared)

  def _free(self, op, state, values, counts, shared):
    if counts[0] == 0 and state.guard is None:  # no room: every page is listed already
      return state, None, None  # (only a double free; with a record, it refuses it)
    state, meta, both = self.ops.free(op, self.running, state, self._meta_of(state),
                                      values, counts[0], shared)
    return self._landing(state, meta, None, both)

  def merge_and_sort_free(self, state, side, shared):
    del side  # one allocator
    return self.ops.merge_and_sort_free(state, shared)

  def warmup(self, state, *, max_batch, max_tokens, max_free, exact_sizes, extend,
             device_last_loc) -> WarmupReport:
    return warmup_programs(self.ops, state, max_batch=max_batch, max_tokens=max_tokens,
                           max_free=max_free, exact_sizes=exact_sizes, extend=extend,
                           device_last_loc=device_last_loc, device=self.device)


def zero_status(device: Any, size: int = 3) -> Array:
  """A running status of no refusal, i32[size] zeros (3; 6: with a call's own status,
  DeviceOps._jit_packed), placed as a backend's state on `device` (None: jax's
  default device)."""
  zero = _ZEROS() if size == 3 else jnp.zeros((size,), jnp.int32)
  return zero if device is None else jax.device_put(zero, device)


def decode_row_sizes(max_batch: int) -> List[int]:
  """Every row count an alloc_decode of 1..max_batch requests runs at."""
  return sorted({decode_rows(b) for b in range(1, min(max_batch, EXACT_ROWS) + 1)} |
                set(_warmup.bucket_sizes(max_batch, buckets.MIN_BATCH)) - set(
                    range(EXACT_ROWS + 1)))


def placer(device: Any) -> Callable[[Any], Array]:
  """Host ints to an i32 device array placed as the backend places its arrays (on
  `device`; None: jax's default, uncommitted), so that warm-up compiles what serving
  runs."""
  if device is None:
    return lambda x: jnp.asarray(np.asarray(x, np.int32))
  return lambda x: jax.device_put(np.asarray(x, np.int32), device)


def warmup_programs(ops: DeviceOps, state: AllocatorState, *, max_batch: int,
                    max_tokens: int, max_free: int, exact_sizes: Iterable[int] = (),
                    extend: bool = True, device_last_loc: bool = False,
                    device: Any = None) -> WarmupReport:
  """Runs every program of this module up to the maxima on throwaway inputs (the state
  is not changed: allocation programs are pure and the donating ones get copies).
  `device_last_loc`: also the variants that take last_loc, seq_lens and page ids as
  device arrays, and the pads of a last_loc from each of `exact_sizes` rows; `device`:
  the backend's. Waits at the end."""
  cfg = ops.config
  t0 = time.perf_counter()
  outs: List[Any] = []
  ring, head, length = state.free_ring, state.free_head, state.free_len
  rec = state.guard
  # The programs donate the record's held and the list scalars: each run gets its own.
  held = lambda: None if rec is None else jnp.copy(rec.held)
  meta = lambda: ops.pack(state)
  outs.append(ops.unpack(state, meta()))
  token_list = _warmup.bucket_sizes(max_tokens, buckets.MIN_TOKENS)
  prev = zero_status(device, 6)  # the running status, placed as the backend's
  for size in token_list:
    outs.append(ops.fn(("alloc", size))(prev, ring, meta(), held(),
                                        np.zeros((1,), np.int32)))
  # Extra arguments of each variant: none (last_loc packed), or a device last_loc.
  put = placer(device)
  lasts = lambda r: [()] + ([(put(np.zeros(r)),)] if device_last_loc else [])
  for r in decode_row_sizes(max_batch):
    for last in lasts(r):
      outs.append(ops.fn(("decode", r))(prev, ring, meta(), held(),
                                        np.zeros((2 * r + 1,), np.int32), *last))
    if device_last_loc and r <= EXACT_ROWS:  # seq_lens on the device too
      outs.append(ops.fn(("decode_on_device", r))(
          prev, ring, meta(), held(), put(np.ones(r)), put(np.full(r, -1))))
  for r in _warmup.bucket_sizes(max_batch, buckets.MIN_BATCH):
    for last in lasts(r) if extend and cfg.kind == "paged" else ():
      for tokens in token_list:
        outs.append(ops.fn(("extend", r, tokens))(
            prev, ring, meta(), held(), np.zeros((3 * r + 1,), np.int32), *last))
  w_ring = st.freed_list(cfg.need_sort, state)[0]
  names = ["free"] + (["free_page_ids"] if cfg.kind == "paged" else [])
  for m in _warmup.bucket_sizes(max_free, buckets.MIN_FREE):
    for name in names:  # host values; device page ids (free_page_ids, free_segment)
      inputs = [ops.with_counts(np.zeros(m, np.int32), m, 0, 0)]
      if name == "free_page_ids" and device_last_loc:
        inputs.append(ops.with_counts(put(np.zeros(m)), m, 0, 0))
      for args in inputs:
        for donate in (True, False):
          target = jnp.copy(w_ring) if donate else w_ring
          outs.append(ops.fn((name, m, donate))(
              prev, target, meta(), held(), None if rec is None else rec.status, *args))
  if cfg.need_sort:
    for donate in (True, False):
      target = jnp.copy(ring) if donate else ring
      outs.append(ops.fn(("merge", donate))(target, head, length, state.release_ring,
                                            state.release_head, state.release_len))
  if rec is not None:  # a restore's record patches (the pages taken since a snapshot)
    for m in _warmup.bucket_sizes(max_tokens // cfg.page_size or 1, buckets.MIN_FREE):
      n = min(m, cfg.num_pages)
      outs.append(ops.fn(("patch", n))(held(), ring, head, np.zeros((1,), np.int32)))
  outs += warmup_exact(ops, exact_sizes, device_last_loc, put)
  jax.block_until_ready(outs)
  return WarmupReport(len(outs), time.perf_counter() - t0)


def warmup_exact(ops: Programs, exact_sizes: Iterable[int], device_last_loc: bool,
                 put: Callable[[np.ndarray], Array]) -> List[Any]:
  """The exact-length slices of `exact_sizes` (decode outputs pad to row counts, the
  others to token buckets) and, with device_last_loc, the pads of a device last_loc of
  each size to its row count. `put`: host ints to a device array placed as the state."""
  outs = []
  for size in exact_sizes:
    for length in {decode_rows(size), buckets.bucket(size, buckets.MIN_TOKENS)}:
      if length != size:
        outs.append(ops.exact(put(np.zeros(length)), size))
    for r in {rows(size), decode_rows(size)} if device_last_loc else ():
      if r != size:
        outs.append(ops.padded(put(np.zeros(size)), r, -1))
  return outs
