"""The host backend: SGLang's operations on an `AllocatorState` held in NumPy.

For schedulers that live on the host (sglang-jax's setting) the classes accept
`backend="host"`: the state is an `AllocatorState` whose rings are numpy int32 arrays and
whose heads and lengths are Python ints, and every operation runs here, vectorized and
O(work) (no Python loop over requests or pages; nothing pool-sized except a merge).

The ring reads and writes are `jax_kvalloc.state`'s, called with `xp=numpy`, the same
functions the jitted device path calls with jax.numpy. The slot indices follow
`jax_kvalloc.index_jnp`'s rules but are computed in host forms written for few numpy
calls (a numpy call has a fixed cost whatever the size, which dominates a serving step's
batch): the table gather of `alloc_extend`, the mask assignment of `alloc_decode`, and
for batches of up to SMALL_BATCH requests the same rules on Python ints. tests/test_host_backend.py checks them against index_jnp and
tests/test_host_paths.py against the independent model.

Contract: alloc_extend / alloc_decode take the plan of `extend_plan` / `decode_plan`
(their `_small` variants: of `*_plan_small`), which check the input themselves and return
None when a check fails (the class then runs jax_kvalloc.validate, which raises naming
the argument); the other functions take arguments the class validated. The class has
decided that the call fits (it keeps the lengths) and run any need_sort merge the
shortfall triggers. Outputs are fresh numpy int32 arrays. Rings are written in place; a
ring that a snapshot still holds (`shared`) is copied first (copy-on-write), so
`backup_state` and an allocation never copy anything. `HostBackend` (at the end) is the
Backend interface over these functions.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Tuple

import numpy as np

from jax_kvalloc import guard
from jax_kvalloc import state as st
from jax_kvalloc import validate
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.guard import GuardState
from jax_kvalloc.sglang.backends import PagedStateReads
from jax_kvalloc.sglang.backends import Plan
from jax_kvalloc.sglang.backends import status as _status
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.warmup import WarmupReport

_STATE_NEW = tuple.__new__  # AllocatorState without its Python-level __new__
_GUARD = AllocatorState._fields.index("guard")
_SCALAR_TAKE = 16  # up to this many pages, `_take` writes the record page by page


def init(config: AllocatorConfig) -> AllocatorState:
  """The initial state (SPEC 2) in numpy: free_pages = [1..num_pages], nothing released,
  and (config.guard) an ownership record with nothing held."""
  n = config.num_pages
  return AllocatorState(free_ring=np.arange(1, n + 1, dtype=np.int32), free_head=0,
                        free_len=n, release_ring=np.zeros((n,), np.int32), release_head=0,
                        release_len=0, debug=None, guard=record(n) if config.guard else None)


def record(num_pages: int, held: "np.ndarray | None" = None) -> GuardState:
  """A host ownership record (jax_kvalloc.guard's GuardState in numpy: held
  i32[num_pages + 1], status i32[3]): nothing held unless `held` is given (copied)."""
  held = (np.zeros((num_pages + 1,), np.int32) if held is None
          else np.array(held, np.int32))
  return GuardState(held=held, status=np.zeros((3,), np.int32))


def _take(state: AllocatorState, k: int) -> Tuple[AllocatorState, np.ndarray]:
  """(state without the first k free pages, those pages: a view or copy, i32[k]); the
  pages are marked held in the ownership record (in place)."""
  ring, head, length = state[:3]
  cap = ring.shape[0]
  if head + k <= cap:  # st.ring_window's host case, inlined: the hot path of every call
    pages = ring[head:head + k]
  else:
    pages = st.ring_window(ring, head, length, k, xp=np)
  rec = state[_GUARD]
  if rec is not None:
    if k <= _SCALAR_TAKE:  # scalar writes: a fraction of a fancy-indexed store's cost
      held = memoryview(rec.held)
      for p in pages.tolist():
        held[p] = 1
    else:
      rec.held[_intp(pages)] = 1
  # The state rebuilt without namedtuple's _replace (a Python-level call).
  return _STATE_NEW(AllocatorState, (ring, (head + k) % cap, length - k) + state[3:]), pages


def alloc(config: AllocatorConfig, state: AllocatorState,
          need_size: int) -> Tuple[AllocatorState, np.ndarray]:
  """`need_size` slots (a multiple of page_size) off the front of the free list (SPEC 3,
  4.1). Returns (state, i32[need_size])."""
  ps = config.page_size
  state, pages = _take(state, need_size // ps)
  if ps == 1:
    return state, pages.copy()  # (a view of the ring, or a fresh int32 array)
  out = pages[:, None] * ps + np.arange(ps, dtype=np.int32)
  return state, out.reshape(-1)


# ---------------------------------------------------------------------------------------
# alloc_extend / alloc_decode on numpy arrays. A numpy call has a fixed cost whatever the
# array size, so these are written for few calls: a plan (the checks
# and the page counts, on which the class decides success and the need_sort merge) and
# the slots. A plan returns None when any check fails; the class then runs the checks of
# jax_kvalloc.validate, which raise naming the argument (nothing has changed by then).
# ---------------------------------------------------------------------------------------

_U64 = np.uint64


class HostConfig(NamedTuple):
  """A config's numbers as the host paths read them, built once per allocator
  (`host_config`): Python ints, and constants as 0-d numpy arrays (an array op with a
  0-d array operand is cheaper than one with a Python int, which numpy converts on every
  call)."""
  config: AllocatorConfig
  ps: int              # page_size
  slots: int           # num_slots
  rem: Any             # ufunc: rem(x, by) == x % ps (bitwise_and for a power of two)
  rem_by: np.ndarray   # i64[] ps, or ps - 1 for a power of two
  div: Any             # ufunc: div(x, by) == x // ps (right_shift for a power of two)
  div_by: np.ndarray   # i64[] ps, or log2(ps) for a power of two
  ps64: np.ndarray     # i64[] ps
  ps32: np.ndarray     # i32[] ps
  one: np.ndarray      # i64[] 1
  head: np.ndarray     # i64[] 2 * ps - 1
  lanes: np.ndarray    # i32[ps] 0..ps-1
  paged: bool          # config.kind == "paged"


def host_config(config: AllocatorConfig) -> HostConfig:
  """The HostConfig of `config` (arrays read-only: they are shared by every call)."""
  ps = config.page_size
  pow2 = ps & (ps - 1) == 0
  consts = [np.array(v, np.int64) for v in (
      ps - 1 if pow2 else ps, ps.bit_length() - 1 if pow2 else ps, ps, 1, 2 * ps - 1)]
  ps32, lanes = np.array(ps, np.int32), np.arange(ps, dtype=np.int32)
  for arr in consts + [ps32, lanes]:
    arr.flags.writeable = False
  rem_by, div_by, ps64, one, head = consts
  return HostConfig(config, ps, config.num_slots, np.bitwise_and if pow2 else np.remainder,
                    rem_by, np.right_shift if pow2 else np.floor_divide, div_by, ps64,
                    ps32, one, head, lanes, config.kind == "paged")


def i64(x: Any) -> "np.ndarray | None":
  """x as a 1-D int64 array (x itself when it is one: the plans never write their
  inputs), or None when x is not a non-empty 1-D integer numpy array. Unsigned values
  beyond int64 wrap negative here, which the plans refuse."""
  if type(x) is np.ndarray and x.ndim == 1 and x.dtype.kind in "iu" and x.shape[0]:
    return x if x.dtype == np.int64 else x.astype(np.int64)
  return None


def extend_plan(hc: HostConfig, pre: np.ndarray, seq: np.ndarray, last: np.ndarray,
                extend_num_tokens) -> "tuple | None":
  """Checks an alloc_extend batch (int64 host arrays of one length bs >= 1) as
  validate.extend_args does and counts its tokens and new pages.

  Returns None when a check fails, else the plan `alloc_extend` takes, a tuple
  (total, new_pages, ext, ends, head, rows, row_ends, base): the batch's tokens
  (== extend_num_tokens) and new pages as ints, and i64[bs] arrays: ext = seq - pre,
  ends = cumsum(ext), head = ext - gap + 2 * ps - 1 where gap = -pre % ps is the room
  left in the page the prefix ends in (Part 1's length when ext allows), rows = 1 + the
  request's new pages, row_ends = cumsum(rows), base = last_loc + 1 + gap (where the
  prefix's page ends). Every value is range checked before it is used (as uint64 views,
  in which negatives are huge), so int64 wrap-around cannot pass a bad value. TypeError
  (validate.count) for an extend_num_tokens that is not an integer.
  """
  bs = pre.shape[0]
  if seq.shape[0] != bs or last.shape[0] != bs:
    return None
  ext = seq - pre
  lp1 = last + hc.one
  # pre, seq, ext in 0..INT32_MAX (so pre <= seq) and last_loc in -1..num_slots-1.
  top = np.maximum(pre.view(_U64), seq.view(_U64))
  np.maximum(top, ext.view(_U64), out=top)
  if top.max() > _INT32_MAX or lp1.view(_U64).max() > hc.slots:
    return None
  gap = hc.rem(np.negative(pre), hc.rem_by)
  base = lp1 + gap
  if hc.ps > 1 and np.count_nonzero(hc.rem(base, hc.rem_by)):
    return None  # (last_loc + 1) % ps != pre % ps
  ends = ext.cumsum()
  total = int(ends[-1])
  if type(extend_num_tokens) is not int:
    extend_num_tokens = validate.count(extend_num_tokens, "extend_num_tokens")
  if extend_num_tokens != total:
    return None
  head = ext - gap
  head += hc.head
  # 1 + ceil(seq/ps) - ceil(pre/ps) = ceil((ext - gap + ps) / ps) (ext - gap + ps >= 1).
  rows = hc.div(head, hc.div_by)
  row_ends = rows.cumsum()
  return total, int(row_ends[-1]) - bs, ext, ends, head, rows, row_ends, base


def alloc_extend(hc: HostConfig, state: AllocatorState,
                 plan: tuple) -> Tuple[AllocatorState, np.ndarray]:
  """A prefill batch's slots (SPEC 4.2) from its `extend_plan`, which the class found to
  fit. Returns (state, i32[total]).

  index_jnp.extend_indices' rule written for few numpy calls. Each request gets
  consecutive rows of a table of pages: first the page its prefix ends in (its Part 1
  is that page's tail, from last_loc + 1), then its new pages in free-list order (Parts
  2 and 3). Row by row the table holds every slot, so a request's tokens are a
  contiguous range of the flattened table, and the output is one gather:
  table[repeat(offset, ext) + arange(total)]. The table has (bs + new_pages) * ps
  entries. tests/test_host_backend.py checks it against extend_indices.
  """
  total, new_pages, ext, ends, head, rows, row_ends, base = plan
  state, window = _take(state, new_pages)
  if total == 0:
    return state, np.zeros((0,), np.int32)
  first_row = row_ends - rows
  # Table position of each request's first token minus its output position, plus
  # ps - 1: first_row * ps + (ps - gap) - (ends - ext) + ps - 1.
  offset = first_row * hc.ps64
  offset += head
  offset -= ends
  at = offset.repeat(ext)
  at += np.arange(1 - hc.ps, total + 1 - hc.ps)
  table = np.empty((rows.shape[0] + new_pages,), np.int32)
  new = np.empty(table.shape, bool)
  new.fill(True)
  new[first_row] = False
  table[new] = window * hc.ps32
  table[first_row] = base - hc.ps64  # the first slot of the page the prefix ends in
  if hc.ps > 1:
    table = (table[:, None] + hc.lanes).reshape(-1)
  return state, table[at]


def decode_plan(hc: HostConfig, seq: np.ndarray,
                last: np.ndarray) -> "Tuple[np.ndarray, np.ndarray, int] | None":
  """Checks an alloc_decode batch (int64 host arrays of one length >= 1) as
  validate.decode_args does. Returns (last_loc + 1, bool[bs] rows whose new token starts
  a page or None when all do, their count), or None when a check fails."""
  if seq.shape[0] != last.shape[0]:
    return None
  lp1 = last + hc.one
  sm1 = seq - hc.one
  # seq_lens in 1..INT32_MAX, last_loc in -1..num_slots-1 (uint64 views: negatives huge).
  if sm1.view(_U64).max() > _INT32_MAX - 1 or lp1.view(_U64).max() > hc.slots:
    return None
  if hc.ps == 1:
    return lp1, None, seq.shape[0]  # every token starts a page
  off = hc.rem(lp1, hc.rem_by)
  if np.count_nonzero(off != hc.rem(sm1, hc.rem_by)):
    return None  # (last_loc + 2) % ps != seq_lens % ps
  # ceil(seq/ps) > ceil((seq-1)/ps) (SPEC 4.3) is (seq - 1) % ps == 0, here off == 0.
  needs = np.logical_not(off)
  return lp1, needs, int(np.count_nonzero(needs))


def alloc_decode(hc: HostConfig, state: AllocatorState, lp1: np.ndarray,
                 needs: "np.ndarray | None", k: int) -> Tuple[AllocatorState, np.ndarray]:
  """One slot per request (SPEC 4.3) from its `decode_plan`, which the class found to
  fit. Returns (state, i32[bs]).

  index_jnp.decode_indices' rule in its host form: the rows that need a page take the
  first k free pages in batch order, one boolean-mask assignment on the host.
  """
  if k == lp1.shape[0]:
    state, window = _take(state, k)
    return state, window * hc.ps32
  out = lp1.astype(np.int32)
  if k:
    state, window = _take(state, k)
    out[needs] = window * hc.ps32
  return state, out


def _push(config: AllocatorConfig, state: AllocatorState, values: np.ndarray,
          shared: bool, front: bool) -> AllocatorState:
  """Prepends (front) or appends values to release_pages (need_sort) or free_pages,
  cut to the room left (as the device path does; only double frees can overflow)."""
  room = config.num_pages - state.free_len - state.release_len
  count = min(values.shape[0], room)
  if count == 0:
    return state
  values = values[:count]
  ring, head, length, _ = st.freed_list(config.need_sort, state)
  if shared:
    ring = ring.copy()
  if front:
    ring, head = st.ring_push_front(ring, head, values, count, xp=np)
    head = int(head)
  else:
    ring = st.ring_push_back(ring, head, length, values, count, xp=np)
  return st.with_freed_list(config.need_sort, state, ring, head, length + count)


def free(config: AllocatorConfig, state: AllocatorState, values: np.ndarray,
         shared: bool) -> AllocatorState:
  """`free` of validated values: the sorted unique pages (paged, SPEC 4.4: prepended,
  LIFO) or the slots as given (token, SPEC 3: appended, FIFO). `shared`: the ring
  written is held by a snapshot (copy it first). The ownership record (checked by the
  caller: `refusal`) no longer holds them."""
  _release(state, values)
  return _push(config, state, values.astype(np.int32), shared,
               front=config.kind == "paged")


def free_page_ids(config: AllocatorConfig, state: AllocatorState, page_ids: np.ndarray,
                  shared: bool) -> AllocatorState:
  """SPEC 10: these pages, order kept, prepended as one block (token: appended); the
  record (checked by the caller) no longer holds them."""
  _release(state, page_ids)
  return _push(config, state, page_ids.astype(np.int32), shared,
               front=config.kind == "paged")


_SCALAR_PAGES = 8  # up to this many pages, the record is read and written page by page


def _intp(pages: np.ndarray) -> np.ndarray:
  """Pages as numpy's index type: fancy indexing with another dtype costs several
  times more."""
  return pages if pages.dtype == np.intp else pages.astype(np.intp)


def _release(state: AllocatorState, pages: np.ndarray) -> None:
  """held[pages] = 0 in the ownership record (in place; none without one). The
  pages fit the list (a free only the record would refuse can overflow it)."""
  if state.guard is None:
    return
  held = state.guard.held
  if pages.shape[0] <= _SCALAR_TAKE:
    view = memoryview(held)
    for p in pages.tolist():
      view[p] = 0
  else:
    held[_intp(pages)] = 0


def merge_and_sort_free(config: AllocatorConfig, state: AllocatorState,
                        shared: bool) -> AllocatorState:
  """free_pages = sort(free_pages ++ release_pages), release_pages = [] (SPEC 6); the
  caller runs it only when release_pages is non-empty. `shared`: the free ring is held
  by a snapshot (a new one is built either way, so nothing is copied twice)."""
  del shared  # the merged list goes into a fresh array
  n = config.num_pages
  both = np.concatenate([
      st.ring_window(state.free_ring, state.free_head, state.free_len, state.free_len,
                     xp=np),
      st.ring_window(state.release_ring, state.release_head, state.release_len,
                     state.release_len, xp=np)])
  both.sort()
  ring = np.zeros((n,), np.int32)
  ring[:both.shape[0]] = both
  return state._replace(free_ring=ring, free_head=0, free_len=both.shape[0],
                        release_head=0, release_len=0)


def from_jax(state: AllocatorState) -> AllocatorState:
  """A host-backend state (writable numpy rings, int heads and lengths, the ownership
  record as writable numpy arrays) from a jax one (reads the device). Debug bookkeeping
  is dropped: the host backend keeps none."""
  rec = state.guard
  if rec is not None:
    rec = GuardState(np.array(rec.held, np.int32), np.array(rec.status, np.int32))
  return AllocatorState(
      free_ring=np.array(state.free_ring, np.int32), free_head=int(state.free_head),
      free_len=int(state.free_len), release_ring=np.array(state.release_ring, np.int32),
      release_head=int(state.release_head), release_len=int(state.release_len), debug=None,
      guard=rec)


# ---------------------------------------------------------------------------------------
# The ownership record (SPEC 14) in numpy: jax_kvalloc.guard's rules, checked before a
# free changes anything. `_take` marks the pages an allocation takes, `_push` clears the
# pages a free lists; `refusal` says whether a free may run. Snapshots do not keep the
# record (`detach`): `restore_record` patches the live one instead (O(pages taken since
# the snapshot)), so neither a snapshot nor the allocation after a restore copies it.
# ---------------------------------------------------------------------------------------

def refusal(held: np.ndarray, pages: np.ndarray, distinct: bool,
            argument: Any = None, pool: int = 0) -> "np.ndarray | None":
  """None when a free of `pages` may run: each a held page (and, `distinct`, none twice);
  else the OWNED status (i32[3], status.owned_host) of the first refused entry of the
  argument, by guard.reasons' rules and precedence.

  Args:
    held: i32[num_pages + 1] the record.
    pages: integer[M] >= 0, the pages the free lists (the classes checked the range).
    distinct: a page named twice is a misuse (token free, free_page_ids, free_segment).
    argument: optional callable returning the page of each argument entry in argument
      order (e.g. a paged free's slots // page_size), when `pages` is not that; read
      only on a refusal.
    pool: the pool the status names (status.owned).
  """
  m = pages.shape[0]
  if m == 0:
    return None
  if m <= _SCALAR_PAGES:  # scalar reads: a fraction of an array call's fixed cost
    got, top, ok = pages.tolist(), held.shape[0], True
    for p in got:
      if not 0 < p < top or held.item(p) != 1:
        ok = False
        break
    if ok and distinct and m > 1:
      ok = len(set(got)) == m
  else:  # count_nonzero, not .all() / .any(): a third of their fixed cost
    try:
      ok = np.count_nonzero(held[_intp(pages)]) == m
    except IndexError:  # a page past the pool
      ok = False
    if ok and distinct:
      s = np.sort(pages)
      ok = not np.count_nonzero(s[1:] == s[:-1])
  if ok:
    return None
  return first_refused(held, pages if argument is None else argument(), distinct, pool)


def first_refused(held: np.ndarray, pages: Any, distinct: bool,
                  pool: int = 0) -> "np.ndarray | None":
  """guard.reasons + first_offence in numpy: the OWNED status of the first entry of
  `pages` (integer[M], argument order) that the record refuses, or None."""
  pages = np.asarray(pages, np.int64).reshape(-1)
  n = held.shape[0] - 1
  inside = (pages >= 1) & (pages <= n)
  h = np.zeros(pages.shape, np.int32)
  h[inside] = held[pages[inside]]
  why = np.where(pages == 0, guard.PAGE_ZERO, np.where(
      ~inside, guard.OUT_OF_RANGE, np.where(h != 1, guard.NOT_HELD, 0)))
  if distinct and pages.shape[0] > 1:
    _, inverse, counts = np.unique(pages, return_inverse=True, return_counts=True)
    why = np.where((why == 0) & (counts[inverse.reshape(-1)] > 1), guard.REPEATED, why)
  bad = np.flatnonzero(why)
  if not bad.size:
    return None
  i = int(bad[0])
  return _status.owned_host(int(why[i]), int(pages[i]), pool)


def detach(state: AllocatorState) -> AllocatorState:
  """A snapshot's form of the state: the lists without the ownership record (the pool
  keeps writing its record in place; `restore_record` puts the snapshot's back)."""
  return state if state.guard is None else state._replace(guard=None)


def patch(live: AllocatorState, snap: AllocatorState, lengths: Tuple[int, ...],
          snap_lengths: Tuple[int, ...]) -> "Tuple[Any, int] | None":
  """How the live record becomes a detached snapshot's when only allocations lie between
  them: (head, count), clear held at the `count` free-list pages from the snapshot's
  `head` (the pages taken since); None otherwise (rebuild it).

  Both states hold the same rings (so nothing was freed or merged between them: their
  free lists share an end, and the live one is the snapshot's without its first pages)
  and the snapshot has at least as many free pages. `lengths`: (free_len, release_len)
  of each, from the host mirror (which may count pages a refused device allocation did
  not take: those are free in both states, so clearing them changes nothing). The
  caller guarantees that both states come from one pool since its last clear or
  foreign state (`Pool`'s lineage)."""
  if (live.free_ring is not snap.free_ring or live.release_ring is not snap.release_ring
      or lengths[1] != snap_lengths[1] or snap_lengths[0] < lengths[0]):
    return None
  return snap.free_head, snap_lengths[0] - lengths[0]


def restore_record(config: AllocatorConfig, live: AllocatorState, snap: AllocatorState,
                   lengths: Tuple[int, ...], snap_lengths: Tuple[int, ...],
                   same_lineage: bool) -> AllocatorState:
  """`snap` (a detached host snapshot state) with its ownership record: the live one
  (which the caller owns) patched in place (see `patch`), or rebuilt in place from the
  snapshot's lists (O(num_pages)); `live` may be `snap` itself (adopt: a new record)."""
  how = patch(live, snap, lengths, snap_lengths) if same_lineage and live.guard else None
  if how is None:  # rebuilt, into the live record where there is one (no allocation)
    held = live.guard.held if live.guard is not None else np.empty(
        (config.num_pages + 1,), np.int32)
    held.fill(1)
    held[0] = 0
    for ring, head, length in ((snap.free_ring, snap.free_head, snap.free_len),
                               (snap.release_ring, snap.release_head, snap.release_len)):
      held[_intp(st.ring_window(ring, head, length, length, xp=np))] = 0
    return snap._replace(guard=GuardState(held, np.zeros((3,), np.int32)))
  head, count = how
  held = live.guard.held
  if count:
    held[st.ring_window(snap.free_ring, head, count, count, xp=np)] = 0
  return snap._replace(guard=GuardState(held, np.zeros((3,), np.int32)))


# ---------------------------------------------------------------------------------------
# Small batches as Python ints. A numpy call has a fixed cost whatever the array size,
# so a batch of a few requests spends most of its time in call overhead; up
# to SMALL_BATCH requests the same rules run on Python ints instead (slots are written
# as runs of numpy slices, never token by token). Any argument these do not accept
# (wrong type, a value the checks refuse) returns None and the caller takes the general
# path, which validates and raises with the usual message (and takes batches of more
# than SMALL_PAGES new pages, whose pages the small path would walk one by one). tests/test_host_backend.py
# checks both paths against each other.
# ---------------------------------------------------------------------------------------

SMALL_BATCH = 8
SMALL_PAGES = 64  # alloc_extend_small walks the new pages in Python: keep them few
_ARANGE_RUNS = 5  # alloc_extend_small: up to this many runs, an arange per run
INT32_MAX = _INT32_MAX = 2**31 - 1


def small_ints(x) -> "list | None":
  """x as a list of Python ints when it is a 1-D integer numpy array or list of ints of
  1..SMALL_BATCH entries; None otherwise."""
  if type(x) is np.ndarray:
    if x.ndim == 1 and x.dtype.kind in "iu" and 0 < x.shape[0] <= SMALL_BATCH:
      return x.tolist()
    return None
  if type(x) is list and 0 < len(x) <= SMALL_BATCH and all(type(v) is int for v in x):
    return x
  return None


def decode_plan_small(hc: HostConfig, seq: list, last: list) -> "int | None":
  """Pages a small alloc_decode batch needs, or None if an argument fails a check."""
  ps, slots = hc.ps, hc.slots
  if len(seq) != len(last):
    return None
  k = 0
  for s, l in zip(seq, last):
    if not (0 < s <= _INT32_MAX and -1 <= l < slots and (l + 2 - s) % ps == 0):
      return None
    k += (s - 1) % ps == 0  # the request's new token starts a page (SPEC 4.3)
  return k


def alloc_decode_small(hc: HostConfig, state: AllocatorState, seq: list,
                       last: list, k: int) -> Tuple[AllocatorState, np.ndarray]:
  """alloc_decode of a batch `decode_plan_small` accepted (k pages, known to fit)."""
  ps = hc.ps
  pages = []
  if k:
    state, pages = _take_list(state, k)
  out, j = [], 0
  for s, l in zip(seq, last):
    if (s - 1) % ps == 0:
      out.append(pages[j] * ps)
      j += 1
    else:
      out.append(l + 1)
  return state, np.array(out, np.int32)


def extend_plan_small(hc: HostConfig, pre: list, seq: list, last: list,
                      extend_num_tokens) -> "Tuple[int, int] | None":
  """(total tokens, new pages) of a small alloc_extend batch, or None if an argument
  fails a check (extend_num_tokens included)."""
  ps, slots = hc.ps, hc.slots
  if not len(pre) == len(seq) == len(last) or type(extend_num_tokens) is not int:
    return None
  total = pages = 0
  for p, s, l in zip(pre, seq, last):
    if not (0 <= p <= s <= _INT32_MAX and -1 <= l < slots and (l + 1 - p) % ps == 0):
      return None
    total += s - p
    pages += -(-s // ps) + (-p // ps)
  if total != extend_num_tokens or pages > SMALL_PAGES:
    return None
  return total, pages


def _take_list(state: AllocatorState, k: int) -> Tuple[AllocatorState, list]:
  """_take for the small paths: the pages as a list, the state rebuilt without the
  namedtuple's (slow) _replace."""
  ring, head, length = state.free_ring, state.free_head, state.free_len
  cap = ring.shape[0]
  if head + k <= cap:
    pages = ring[head:head + k].tolist()
  else:
    pages = ring[head:].tolist() + ring[:head + k - cap].tolist()
  rec = state[_GUARD]
  if rec is not None:
    held = rec.held
    if k <= _SCALAR_TAKE:  # scalar stores: a fraction of a fancy-indexed one
      view = memoryview(held)
      for p in pages:
        view[p] = 1
    elif head + k <= cap:
      held[_intp(ring[head:head + k])] = 1
    else:
      held[pages] = 1
  return _STATE_NEW(AllocatorState, (ring, (head + k) % cap, length - k) + state[3:]), pages


def alloc_extend_small(hc: HostConfig, state: AllocatorState, pre: list,
                       seq: list, last: list, total: int,
                       new_pages: int) -> Tuple[AllocatorState, np.ndarray]:
  """alloc_extend (SPEC 4.2) of a batch `extend_plan_small` accepted, known to fit.

  The output is runs of consecutive slots: each request's Part 1 (from last_loc + 1),
  then its new pages (one run when they are consecutive page ids, as a fresh or
  LIFO-recycled free list mostly gives; else a run per page). Few runs are joined
  aranges; many are arange(total) plus each run's shift repeated over it (one repeat):
  numpy calls per run at most, never per token.
  """
  ps = hc.ps
  state, pages = _take_list(state, new_pages)
  runs = []  # (output position, first slot, length)
  pos = page = 0
  for p, s, l in zip(pre, seq, last):
    ext = s - p
    if ext == 0:
      continue
    part1 = min(ext, -(-p // ps) * ps - p)
    if part1:
      runs.append((pos, l + 1, part1))
    rest = ext - part1
    if rest:
      n = -(-rest // ps)  # the request's new pages (Parts 2 and 3)
      mine = pages[page:page + n]
      at = pos + part1
      if mine[-1] - mine[0] == n - 1 and mine == list(range(mine[0], mine[0] + n)):
        runs.append((at, mine[0] * ps, rest))
      else:
        for q, pg in enumerate(mine):
          runs.append((at + q * ps, pg * ps, min(ps, rest - q * ps)))
      page += n
    pos += ext
  if len(runs) == 1:
    at, start, n = runs[0]
    return state, np.arange(start, start + n, dtype=np.int32)
  if not runs:  # every row empty
    return state, np.zeros((0,), np.int32)
  if len(runs) <= _ARANGE_RUNS:  # an arange per run, joined
    return state, np.concatenate([np.arange(start, start + n, dtype=np.int32)
                                  for _, start, n in runs])
  # Many runs: one repeat of each run's shift, plus arange(total).
  shift = np.array([start - at for at, start, _ in runs], np.int32)
  out = np.repeat(shift, [n for _, _, n in runs])
  out += np.arange(total, dtype=np.int32)
  return state, out


# ---------------------------------------------------------------------------------------
# Small frees and allocations as Python ints: a serving loop frees and allocates a few
# slots per call, where numpy's fixed cost per call is most of the time. `small_slots`
# checks a free's argument (as validate.host_ints and validate.free_index do),
# and `free_small` runs a free that needs no decision the general path makes (a
# refusal, a cut to the room left). Each returns None where the general path must run,
# before anything has changed. tests/test_host_backend.py
# checks them against the general path.
# ---------------------------------------------------------------------------------------

SMALL_FREE = 64  # frees of up to this many slots run on Python ints


def small_slots(hc: HostConfig, x: Any) -> "list | None":
  """x as a list of Python ints when it is a 1-D integer numpy array of 1..SMALL_FREE
  allocatable slots (page_size..num_slots-1), [] when it is an empty 1-D numpy array (of
  any dtype, as validate.host_ints takes it: a free of nothing); None otherwise (the
  general path's checks raise or convert)."""
  if x.__class__ is not np.ndarray or x.ndim != 1:
    return None
  m = x.shape[0]
  if m == 0:
    return []
  if x.dtype.kind not in "iu" or m > SMALL_FREE:
    return None
  slots = x.tolist()
  if m == 1:
    s = slots[0]
    return slots if hc.ps <= s < hc.slots else None
  if min(slots) < hc.ps or max(slots) >= hc.slots:
    return None
  return slots


def free_small(hc: HostConfig, state: AllocatorState, x: np.ndarray, slots: list,
               room: int, shared: bool) -> "Tuple[AllocatorState, int] | None":
  """`free` of checked small slots (`small_slots` of x; a token free writes x, a paged
  one reads `slots` only), as `HostBackend.free` would run it: the sorted unique pages prepended (paged) or the slots appended (token), to
  release_pages (need_sort) or free_pages, and cleared in the ownership record. Returns
  (state, entries that reached the list), or None, with nothing changed, when the record
  would refuse it (a page not held; a token free naming a slot twice) or the entries
  exceed `room` (the general path refuses or cuts)."""
  paged = hc.paged
  m = len(slots)
  if paged:
    ps = hc.ps
    pages = [slots[0] // ps] if m == 1 else sorted({s // ps for s in slots})
  else:
    pages = slots
  n = len(pages)
  if n > room:
    return None
  rec = state[_GUARD]
  if rec is not None:
    held = memoryview(rec.held)  # scalar reads and writes at a fraction of numpy's cost
    for p in pages:
      if held[p] != 1:
        return None
    if not paged and m > 1 and len(set(slots)) != m:
      return None
    for p in pages:
      held[p] = 0
  sort = hc.config.need_sort  # release_pages (need_sort) or free_pages
  ring, head, length = state[3:6] if sort else state[:3]
  if shared:
    ring = ring.copy()
  cap = ring.shape[0]
  if paged:  # prepended (LIFO, SPEC 4.4)
    head = (head - n) % cap
    at = head
  else:      # appended (FIFO, SPEC 3)
    at = (head + length) % cap
  end = at + n
  if n == 1:
    ring[at] = pages[0]
  elif end <= cap:
    ring[at:end] = x if pages is slots else pages
  else:
    ring[at:] = pages[:cap - at]
    ring[:end - cap] = pages[cap - at:]
  lists = (ring, head, length + n)
  fields = state[:3] + lists + state[6:] if sort else lists + state[3:]
  return _STATE_NEW(AllocatorState, fields), n


class HostBackend(PagedStateReads):
  """The Backend (jax_kvalloc.sglang.backends) of a NumPy state: every call on the host.

  Batches of up to SMALL_BATCH requests run on Python ints, larger ones on numpy arrays
  in a few whole-batch calls. The plans check the input themselves and return None when
  a check fails or the input is of another kind (lists of more than SMALL_BATCH,
  tensors, empty batches): the class then runs jax_kvalloc.validate, which raises
  naming the argument, or converts the input and asks again (`checked`). The class has
  checked everything else a call could refuse; a free the ownership record refuses
  returns its OWNED status (host i32[3]) and the state unchanged.
  """

  keeps_device_arrays = False
  defers_status = False
  writes_whole_state = False
  patches_record = True  # snapshots are detached: restore patches the live record
  small = True           # small_slots / free_small / alloc take Python-int paths

  def __init__(self, config: AllocatorConfig):
    self.config = config
    self.pools = (config,)
    self.hc = host_config(config)
    # small_slots(x) and free_small(state, x, slots, room, shared) of this config, bound
    # as partials (no method call on the hot path of every small free)
    self.small_slots = functools.partial(small_slots, self.hc)
    self.free_small = functools.partial(free_small, self.hc)
    self.alloc_now = functools.partial(alloc, config)  # (state, need) -> (state, slots)

  def init(self) -> AllocatorState:
    return init(self.config)

  def adopt(self, state: AllocatorState) -> AllocatorState:
    """A host-backend state from any AllocatorState (a device one is read: a wait); a
    state without its ownership record (a detached snapshot) gets it rebuilt from its
    lists."""
    if not (isinstance(state.free_ring, np.ndarray) and type(state.free_len) is int):
      state = from_jax(state)
    if self.config.guard and state.guard is None:  # (`state` has no record to reuse)
      state = restore_record(self.config, state, state, (0, 0), (0, 0), False)
    return state

  def detach(self, state: AllocatorState) -> AllocatorState:
    return detach(state)

  def restore(self, live: AllocatorState, snap: AllocatorState, lengths, snap_lengths,
              same_lineage: bool) -> AllocatorState:
    """A detached snapshot's state with its record (patched from the live one, which the
    caller owns, when they share their rings; else rebuilt); others as `adopt`."""
    if (not self.config.guard or snap.guard is not None
        or not isinstance(snap.free_ring, np.ndarray)):
      return self.adopt(snap)
    return restore_record(self.config, live, snap, lengths, snap_lengths, same_lineage)

  def own_record(self, state: AllocatorState) -> AllocatorState:
    """The state with a record of its own (the old one is held outside)."""
    rec = state.guard
    if rec is None:
      return state
    return state._replace(guard=GuardState(rec.held.copy(), rec.status.copy()))

  def empty(self) -> np.ndarray:
    return np.zeros((0,), np.int32)

  def alloc(self, state, need_size, fits):
    if not fits:
      return state, None, None
    return alloc(self.config, state, need_size) + (None,)


  def extend_plan(self, pre, seq, last, extend_num_tokens, checked):
    del checked  # the host plans check everything themselves
    hc = self.hc
    spre = small_ints(pre)
    sseq = small_ints(seq) if spre is not None else None
    slast = small_ints(last) if sseq is not None else None
    if slast is not None:
      plan = extend_plan_small(hc, spre, sseq, slast, extend_num_tokens)
      if plan is not None:
        total, new_pages = plan
        return Plan(len(spre), new_pages, total, ("small", spre, sseq, slast))
      # Refused, or more new pages than the small path walks: the numpy path decides.
    pre, seq, last = i64(pre), i64(seq), i64(last)
    if pre is None or seq is None or last is None:
      return None
    plan = extend_plan(hc, pre, seq, last, extend_num_tokens)
    if plan is None:
      return None
    return Plan(pre.shape[0], plan[1], plan[0], ("numpy", plan))

  def alloc_extend(self, state, plan, fits):
    if not fits:
      return state, None, None
    if plan.data[0] == "small":
      _, pre, seq, last = plan.data
      return alloc_extend_small(self.hc, state, pre, seq, last, plan.tokens,
                                plan.pages) + (None,)
    return alloc_extend(self.hc, state, plan.data[1]) + (None,)

  def decode_plan(self, seq, last, checked):
    del checked
    hc = self.hc
    sseq = small_ints(seq)
    slast = small_ints(last) if sseq is not None else None
    if slast is not None:
      pages = decode_plan_small(hc, sseq, slast)
      if pages is None:
        return None
      return Plan(len(sseq), pages, len(sseq), ("small", sseq, slast))
    seq, last = i64(seq), i64(last)
    if seq is None or last is None:
      return None
    plan = decode_plan(hc, seq, last)
    if plan is None:
      return None
    return Plan(seq.shape[0], plan[2], seq.shape[0], ("numpy", plan))

  def alloc_decode(self, state, plan, fits):
    if not fits:
      return state, None, None
    if plan.data[0] == "small":
      return alloc_decode_small(self.hc, state, plan.data[1], plan.data[2],
                                plan.pages) + (None,)
    return alloc_decode(self.hc, state, *plan.data[1]) + (None,)

  def free(self, state, idx, values, counts, shared):
    """`values`: the pages (paged: sorted unique) or slots (token) that reach the list;
    the record checks them (token: none twice), naming the first refused slot's page."""
    rec = state.guard
    if rec is not None:
      paged = self.config.kind == "paged"
      refused = refusal(rec.held, values, not paged,
                        (lambda: idx // self.config.page_size) if paged else None)
      if refused is not None:
        return state, None, refused
    if counts[0]:
      state = free(self.config, state, values, shared)
    return state, None, None

  def free_page_ids(self, state, ids, counts, shared):
    if state.guard is not None:
      refused = refusal(state.guard.held, ids, True)
      if refused is not None:
        return state, None, refused
    if counts[0]:
      state = free_page_ids(self.config, state, ids, shared)
    return state, None, None

  def merge_and_sort_free(self, state, side, shared):
    del side  # one allocator
    return merge_and_sort_free(self.config, state, shared)

  def warmup(self, state, **kwargs) -> WarmupReport:
    del state, kwargs  # nothing to compile
    return WarmupReport(0, 0.0)
