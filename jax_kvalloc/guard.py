"""Ownership (SPEC 14): the record of held pages that makes a bad free a refusal.

SGLang trusts its callers: a free of a page that is not held (page 0, a page freed
already, one never handed out) goes on the free list, and the page is later handed to two
requests. With `AllocatorConfig(guard=True)` (the default) the state carries a record,
`AllocatorState.guard`, a `GuardState`::

  held    i32[num_pages + 1]  1 where page p is handed out, else 0 (page 0: always 0)
  status  i32[3]              the first refused free: (op, why, page); op 0 = none

and every path (the jnp functions here, the Triton and Mosaic GPU kernels of
pallas_kernels, the XLA around the TPU's Mosaic kernels) keeps it by the rules below. The functions of this module are
those rules in jnp: the jnp path runs them, and every kernel is checked against them bit
for bit (held and status included).

What each operation does to the record::

  alloc, alloc_extend,     `take`: held[p] = 1 for every page p the call takes from the
  alloc_decode             free list (its first k pages, k = the pages it needs; none when
                           ok is False). A refused or short allocation takes nothing and
                           returns slot 0 in every output entry (it always did).
  free (paged)             `free(..., distinct=False)` of the pages slot // ps of the
                           non-zero slots: two slots of one page are one page (SGLang's
                           sorted-unique free), not a misuse. On CPU and TPU the XLA
                           free runs `free_by_page`: the same bits, the record read and
                           cleared once per distinct page.
  free (token),            `free(..., distinct=True)`: a page named twice by one call is a
  free_page_ids,           misuse (these do not de-duplicate). free_segment's pages are
  free_segment             those of the slots that start a page (free_index[::ps] // ps).
                           On CPU and TPU they run `free_distinct`: the same bits.
  release_and_alloc_decode free_page_ids (op RELEASE_AND_ALLOC_DECODE), then alloc_decode;
                           a refused release refuses the decode too (ok False, slots 0).
  release_rows (table)     free_page_ids of the rows' owned pages (op RELEASE_ROWS); a
                           refused release leaves the rows as they were (ok False).
  window_rows (SWA table)  the SWA pool's free_page_ids (op WINDOW_ROWS), likewise.
  merge_and_sort_free      nothing (free and released pages are both not held).
  init, clear              held all 0, status (0, 0, 0).

A free is refused whole when any of its entries names a page that is not held: page 0
(PAGE_ZERO), a page outside 1..num_pages (OUT_OF_RANGE), a free, released or never
handed-out page (NOT_HELD), or a page named twice in a distinct free (REPEATED). Refused:
the lists and held are exactly as before; only `status` changes, and only if it was
empty (sticky: the first refusal stays until `init`/clear or a restore of an earlier
snapshot). The status names the operation, the reason of the first offending entry (in
argument order; for REPEATED every entry naming the page offends) and its page.

Padding: 0 is the padding value of every index argument (SPEC 9), so an entry equal to 0
is skipped, never refused (free_page_ids' entries at index >= num likewise). Page 0
misuse is therefore a non-zero slot of page 0 (1..ps-1) in `free`/`free_segment`; a
caller whose arrays carry no padding (an SGLang-compatible class) refuses a 0 itself, or
passes it as -1 (OUT_OF_RANGE).

Reading the status never blocks a step: it is part of the state pytree, so it comes back
with the state from jit, vmap, scan, shard_map and donation; `error(state)` reads it on
the host (one sync, when the caller chooses), `checkify_check` turns it into a checkify
error. With `guard=False` the record is None, none of this is traced, and every
operation is exactly the unguarded program (SGLang's costs and trust).

Cost: O(work) per call, no scan of the pool, in place under donation: an allocation
scatters to its pages; `free` reads and writes each entry's page (distinct: a
scatter-add, a gather and a scatter). Where a branch is cheap (CPU, TPU) the frees
find the first offending entry in one, taken only by a refused call, and do less
otherwise: `free_by_page` reads and clears the paged free's distinct pages (no pass
over its slots), `free_distinct` is one scatter-add and one gather of the entries.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import gated

Array = jax.Array

# Operations that can be refused (status[0]); the first three as debug.OP_*.
OP_FREE = 4
OP_FREE_PAGE_IDS = 5
OP_FREE_SEGMENT = 6
OP_RELEASE_AND_ALLOC_DECODE = 7
OP_RELEASE_ROWS = 8
OP_WINDOW_ROWS = 9
OP_NAMES = {OP_FREE: "free", OP_FREE_PAGE_IDS: "free_page_ids",
            OP_FREE_SEGMENT: "free_segment",
            OP_RELEASE_AND_ALLOC_DECODE: "release_and_alloc_decode",
            OP_RELEASE_ROWS: "release_rows", OP_WINDOW_ROWS: "window_rows"}

# Why an entry was refused (status[1]).
PAGE_ZERO = 1
OUT_OF_RANGE = 2
NOT_HELD = 3
REPEATED = 4
WHY = {PAGE_ZERO: "is reserved (the padding sink)",
       OUT_OF_RANGE: "is outside the pool",
       NOT_HELD: "is not held (free, released, or never handed out)",
       REPEATED: "is named twice by one call that does not de-duplicate"}


class GuardState(NamedTuple):
  """The ownership record, `AllocatorState.guard` (None when the config has guard=False)."""
  held: Array    # i32[num_pages + 1] 1 where page p is handed out (page 0: always 0)
  status: Array  # i32[3] first refused free: (op, why, page); (0, 0, 0) when none


class FreeRefusedError(ValueError):
  """A refused free, read from the record: names the operation, the reason and the page."""

  def __init__(self, op: int, why: int, page: int, where: str = ""):
    self.op, self.why, self.page = op, why, page
    self.op_name = OP_NAMES.get(op, f"op {op}")
    self.reason = WHY.get(why, f"reason {why}")
    super().__init__(f"{self.op_name}: page {page} {self.reason}; the call freed nothing"
                     f"{where} (jax_kvalloc ownership record, SPEC 14)")


def init(num_pages: int) -> GuardState:
  """The record of a fresh pool: nothing held, no refusal. Every leaf its own buffer."""
  return GuardState(held=jnp.zeros((num_pages + 1,), jnp.int32),
                    status=jnp.zeros((3,), jnp.int32))


def from_free(num_pages: int, free: np.ndarray) -> np.ndarray:
  """Host helper: held (i32[num_pages + 1]) of a pool whose free and released pages are
  `free` (any order): every other page 1..num_pages is held."""
  held = np.ones((num_pages + 1,), np.int32)
  held[0] = 0
  free = np.asarray(free).reshape(-1)
  held[free[(free >= 1) & (free <= num_pages)]] = 0
  return held


# ---------------------------------------------------------------------------------------
# The rules, in jnp (the reference every kernel matches).
# ---------------------------------------------------------------------------------------

# take and free are jitted: under an outer jit they inline; called eagerly (op by op,
# as tests and tools do) they run as one compiled program instead of a dozen small ones.
@jax.jit
def take(record: GuardState, pages: Array, count: Array) -> GuardState:
  """An allocation: held[pages[:count]] = 1.

  Args:
    record: the pool's record.
    pages: i32[K] the front of the free list the call read (its window); entries at
      index < count are pages 1..num_pages.
    count: i32[] pages the call takes (0 when it fails).
  """
  drop = record.held.shape[0]
  i = jnp.arange(pages.shape[0], dtype=jnp.int32)
  at = jnp.where(i < count, pages, drop)
  return record._replace(held=record.held.at[at].set(1, mode="drop"))


def reasons(held: Array, pages: Array, given: Array, *, distinct: bool
            ) -> Tuple[Array, Array, Array]:
  """Why each entry of a free offends (0: it does not).

  Args:
    held: i32[num_pages + 1].
    pages: i32[M] the page each entry names (floor(slot / ps) for slot arguments).
    given: bool[M] the entries that are not padding.
    distinct: a page named by two given entries is a misuse (every such entry offends).

  Returns:
    (i32[M] why: PAGE_ZERO / OUT_OF_RANGE / NOT_HELD / REPEATED / 0, in that order of
    precedence; i32[M] each entry's held value before the call (0 outside the pool);
    i32[num_pages + 1] held with scratch written at the given pages (distinct: a count),
    which the caller's last scatter overwrites at exactly those pages).
  """
  n = held.shape[0] - 1
  inside = given & (pages >= 1) & (pages <= n)
  at = jnp.where(inside, pages, n + 1)
  if distinct:
    # Each entry adds 2 at its page: a page named k times reads held + 2k, so one gather
    # gives both the old value (its parity: held is 0 or 1) and the count. O(M), no
    # sort; chained on `held` (not beside it) so that XLA keeps one buffer, in place.
    held = held.at[at].add(2, mode="drop")
    counted = held.at[at].get(mode="fill", fill_value=0)
    h0 = counted & 1
    repeated = counted - h0 > 2
  else:
    h0 = held.at[at].get(mode="fill", fill_value=0)
    repeated = False
  why = jnp.where(~given, 0, jnp.where(
      pages == 0, PAGE_ZERO, jnp.where(~inside, OUT_OF_RANGE, jnp.where(
          h0 != 1, NOT_HELD, jnp.where(repeated, REPEATED, 0)))))
  return why.astype(jnp.int32), h0, held


def first_offence(op: int, why: Array, pages: Array) -> Tuple[Array, Array]:
  """(bool[] any entry offends, i32[3] the status it would record: (op, why, page) of the
  first offending entry)."""
  m = why.shape[0]
  if m == 0:
    return jnp.zeros((), bool), jnp.zeros((3,), jnp.int32)
  # One min finds the first offending entry and its reason (key: position * 8 + reason;
  # when no entry offends, every key is the largest); its page is read at that position.
  none = jnp.int32(m * 8)
  key = jnp.min(jnp.where(why != 0, jnp.arange(m, dtype=jnp.int32) * 8 + why, none))
  page = jax.lax.dynamic_index_in_dim(pages, jnp.minimum(key // 8, m - 1), keepdims=False)
  return key < none, jnp.stack([jnp.int32(op), key % 8, page]).astype(jnp.int32)


def record_status(status: Array, found: Array, new: Array) -> Array:
  """The sticky status: `new` when `found` and nothing was recorded yet, else `status`."""
  return jnp.where(found & (status[0] == 0), new, status)


@functools.partial(jax.jit, static_argnames=("op", "distinct"))
def free(record: GuardState, op: int, pages: Array, given: Array, *, distinct: bool,
         also_refuse: Optional[Array] = None) -> Tuple[GuardState, Array]:
  """A free: checks every given entry, then clears held at their pages, or refuses whole.

  Args:
    record: the pool's record.
    op: the operation to name in the status (OP_*).
    pages: i32[M] the page each entry names (floor(slot / ps) for slot arguments).
    given: bool[M] the entries that are not padding (slot or id != 0, index < num).
    distinct: whether a page named twice is a misuse (free_page_ids, free_segment, the
      token allocator's free) or one page (the paged free).
    also_refuse: optional bool[]: refuse for another reason (debug mode's checks, a
      misaligned start_pos); the status is not set for it.

  Returns:
    (record, bool[] refused). Refused: held unchanged, status set if it was empty and
    an entry offended. Else held[p] = 0 for every given page.
  """
  why, h0, work = reasons(record.held, pages, given, distinct=distinct)
  found, new = first_offence(op, why, pages)
  refused = found if also_refuse is None else found | also_refuse
  n = record.held.shape[0] - 1
  # Every given page in the pool: 0 (freed), or, when refused, as it was (distinct: its
  # old value back, which also undoes the scratch of `reasons`).
  at = jnp.where(given & (pages >= 1) & (pages <= n), pages, n + 1)
  if distinct:
    held = work.at[at].set(jnp.where(refused, h0, 0), mode="drop")
  else:
    held = work.at[jnp.where(refused, n + 1, at)].set(0, mode="drop")
  return GuardState(held, record_status(record.status, found, new)), refused


# x.at[idx] for idx >= 0, without jnp's wrap of negative indices: that wrap is a pass of
# its own over an index array that several operations read (past x: dropped, read as 0).
_GATHER = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,),
                                         start_index_map=(0,))
_SCATTER = jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                           scatter_dims_to_operand_dims=(0,))
_DROP = jax.lax.GatherScatterMode.FILL_OR_DROP


def _read(x: Array, idx: Array) -> Array:
  return jax.lax.gather(x, idx[:, None], _GATHER, (1,), mode=_DROP, fill_value=0)


def _write(x: Array, idx: Array, value: int, *, add: bool = False) -> Array:
  update = jnp.full(idx.shape, value, x.dtype)
  scatter = jax.lax.scatter_add if add else jax.lax.scatter
  return scatter(x, idx[:, None], update, _SCATTER, mode=_DROP)


@functools.partial(jax.jit, static_argnames=("op", "page_size"))
def free_by_page(record: GuardState, op: int, slots: Array, unique: Array, ids: Array,
                 stray: Array, marks: Optional[Array] = None, *, page_size: int,
                 also_refuse: Optional[Array] = None) -> Tuple[GuardState, Array]:
  """The paged free: `free(record, op, slots // page_size, slots != 0, distinct=False,
  also_refuse=...)` bit for bit, with the record read and cleared once per distinct
  page the call names, not once per slot.

  Args:
    record: the pool's record.
    op: the operation to name in the status (OP_*).
    slots: i32[M] the free's slots (0: padding).
    unique: i32[M] the distinct pages in 1..num_pages that the non-zero slots name,
      first (any order), 0 after them (freeing.free_pages_sorted_unique's values).
    ids: i32[M] each slot's page where in 1..num_pages; 0 for a non-zero slot whose
      page is outside (page 0 included); above num_pages for padding.
    stray: bool[] whether any id is 0.
    marks: optional bool[>= num_pages + 1], True at each id in 0..num_pages (the
      bitmap method's map): the record is then read through it, a vectorized pass over
      the pool instead of a gather.
    page_size: the pool's page size.
    also_refuse: as `free`.

  Returns:
    As `free`.

  Cost: a scatter of K = min(M, num_pages) pages, a gather of them (or a pass over the
  marks) and no pass over the slots. Which slot offends first (the status) is looked up
  in `ids` only in a call that is refused with an empty status, in a branch (`gated`:
  one under vmap too), so this suits platforms where a branch does not wait for the
  host (CPU, TPU; the paged free runs `free` on a GPU).
  """
  n, m = record.held.shape[0] - 1, slots.shape[0]
  if m == 0:
    return record, jnp.zeros((), bool) if also_refuse is None else also_refuse
  at = unique[:min(m, n)]
  if marks is None:
    not_held = (at != 0) & (_read(record.held, at) != 1)
    found = stray | jnp.any(not_held)
    first = functools.partial(_first_offender_of, n)
    bad = (at, not_held)
  else:  # page 0 is in the map where a slot strayed; it is never held
    page = jnp.arange(n + 1, dtype=jnp.int32)
    bad = (marks[:n + 1] & ((record.held != 1) | (page == 0)),)
    found = jnp.any(bad[0])
    first = _first_offender
  refused = found if also_refuse is None else found | also_refuse
  held = _write(record.held, jnp.where(refused | (at == 0), n + 1, at), 0)
  # The first offending slot, in a branch whose operands are arrays the free made
  # anyway: neither held (the next write to it would wait on the branch: a copy of held
  # per call) nor the slots (which XLA could otherwise fuse into their readers).
  pos = gated.gated(first)(jnp.zeros((), jnp.int32), found & (record.status[0] == 0),
                           ids, *bad)
  page = jnp.floor_divide(slots[pos], page_size)
  why = jnp.where(page == 0, PAGE_ZERO,
                  jnp.where((page < 1) | (page > n), OUT_OF_RANGE, NOT_HELD))
  new = jnp.stack([jnp.int32(op), why, page]).astype(jnp.int32)
  return GuardState(held, record_status(record.status, found, new)), refused


@functools.partial(jax.jit, static_argnames=("op",))
def free_distinct(record: GuardState, op: int, pages: Array, given: Array,
                  also_refuse: Optional[Array] = None) -> Tuple[GuardState, Array]:
  """`free(record, op, pages, given, distinct=True, also_refuse=...)` bit for bit, in
  one scatter and one gather of the entries where the call is not refused.

  Each given entry takes 1 from its page's held value: a held page named once reads 0
  (freed), a page not held or named again reads below 0 (its entries offend). A refused
  call puts the values back (a scatter adding 1) and finds its first offending entry in
  a branch (`gated`), so this suits platforms where a branch does not wait for the host
  (CPU, TPU); the args and result are `free`'s.
  """
  n, m = record.held.shape[0] - 1, pages.shape[0]
  if m == 0:
    return record, jnp.zeros((), bool) if also_refuse is None else also_refuse
  inside = given & (pages >= 1) & (pages <= n)
  at = jnp.where(inside, pages, n + 1)
  work = _write(record.held, at, -1, add=True)
  offends = given & (~inside | (_read(work, at) != 0))
  found = jnp.any(offends)
  refused = found if also_refuse is None else found | also_refuse
  held, status = gated.gated(functools.partial(_put_back, op))(
      (work, record.status), refused, found, pages, at, offends)
  return GuardState(held, status), refused


def _put_back(op: int, x: Tuple[Array, Array], pred: Array, found: Array, pages: Array,
              at: Array, offends: Array) -> Tuple[Array, Array]:
  """Where pred: held with 1 added back at the pages `at` (i32[M]; past held: none),
  and the status naming the first offending entry of bool[M] offends where found;
  else x."""
  held, status = x
  n = held.shape[0] - 1
  held = _write(held, jnp.where(pred, at, n + 1), 1, add=True)
  pos = jnp.argmax(offends)
  page = pages[pos]
  h0 = held.at[page].get(mode="fill", fill_value=0)
  why = jnp.where(page == 0, PAGE_ZERO, jnp.where(
      (page < 1) | (page > n), OUT_OF_RANGE, jnp.where(h0 != 1, NOT_HELD, REPEATED)))
  new = jnp.stack([jnp.int32(op), why, page]).astype(jnp.int32)
  return held, record_status(status, pred & found, new)


def _first_offender(pos: Array, pred: Array, ids: Array, bad: Array) -> Array:
  """i32[]: the first entry whose id (ids, i32[M]) is a page where bad (bool[n + 1];
  page 0: a named entry outside the pool; ids above n: none), where pred; else pos."""
  n = bad.shape[0] - 1
  hit = jnp.concatenate([bad, jnp.zeros((1,), bool)])[jnp.minimum(ids, n + 1)]
  return jnp.where(pred, jnp.argmax(hit).astype(jnp.int32), pos)


def _first_offender_of(n: int, pos: Array, pred: Array, ids: Array, pages: Array,
                       not_held: Array) -> Array:
  """`_first_offender` with bad = the pages (i32[K]) where not_held (bool[K]), and 0."""
  bad = jnp.zeros((n + 1,), bool).at[jnp.where(not_held, pages, n + 1)].set(
      True, mode="drop")
  return _first_offender(pos, pred, ids, bad.at[0].set(True))


# ---------------------------------------------------------------------------------------
# Reading the status (host side, syncs), checkify.
# ---------------------------------------------------------------------------------------

def _record_of(state: Any) -> Optional[GuardState]:
  return getattr(state, "guard", None)


def error(state: Any) -> Optional[FreeRefusedError]:
  """The first refused free recorded in `state`, as an exception (not raised), or None.

  `state`: an AllocatorState (a single pool or ranks: the first rank with a refusal is
  named), or an SWAState (its full pool, then its SWA pool). Syncs. None when the state
  has no record (guard=False).
  """
  if hasattr(state, "full") and hasattr(state, "swa"):
    for name in ("full", "swa"):
      err = _error_of(getattr(state, name), f" in the {name} pool")
      if err is not None:
        return err
    return None
  return _error_of(state, "")


def _error_of(state: Any, where: str) -> Optional[FreeRefusedError]:
  record = _record_of(state)
  if record is None:
    return None
  status = np.asarray(jax.device_get(record.status)).reshape(-1, 3)
  hit = np.flatnonzero(status[:, 0])
  if not hit.size:
    return None
  r = int(hit[0])
  if status.shape[0] > 1:
    where = f" of rank {r}" + where
  op, why, page = (int(x) for x in status[r])
  return FreeRefusedError(op, why, page, where)


def raise_if_refused(state: Any) -> None:
  """Raises the recorded `FreeRefusedError`, if any (syncs)."""
  err = error(state)
  if err is not None:
    raise err


def checkify_check(state: Any) -> None:
  """Inside a function transformed by `jax.experimental.checkify.checkify`: a checkify
  error when the record holds a refusal (the message gives op, why and page as codes:
  `OP_NAMES`, `WHY`). No-op without a record."""
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top
  record = _record_of(state)
  if record is None:
    return
  status = record.status.reshape(-1, 3)
  first = status[jnp.argmax(status[:, 0] != 0)]
  checkify.check(jnp.all(status[:, 0] == 0),
                 "jax_kvalloc refused a free: op {op}, why {why}, page {page} (guard."
                 "OP_NAMES / guard.WHY)", op=first[0], why=first[1], page=first[2])
