"""Debug mode: misuse checks that run inside jitted code.

Turned on by `AllocatorConfig(debug=True)` (the classes' `debug=` keyword; the default
comes from the environment variable JAX_KVALLOC_DEBUG=1). It finds what no eager check of
the arguments can: a double free (of a page in free_pages *or* parked in release_pages,
which SGLang's check misses), a request continuing a page it does not hold, and two
outputs of one call naming the same slot; and, for callers of the functional core under
jit, the argument errors the classes otherwise catch eagerly (misaligned last_loc, frees
of reserved or out-of-range slots, impossible lengths and sizes).

Design. The checks keep their bookkeeping in the state, `AllocatorState.debug`, a
`DebugState`::

  is_free  bool[num_pages + 1]  page p is in free_pages or release_pages (page 0: never)
  code, op, index, value  i32[]  the first error: what, which operation, the position of
                                 the first offending entry in its argument, its value

* No host sync: a check only computes an error code, so the hot path never waits on the
  device; the record is sticky (the first error wins) and the caller reads it when it
  likes: the classes after every call (they raise `AllocatorDebugError` at once), a
  jitted serving loop once per step or once at the end (`raise_if_error`), or through
  `jax.experimental.checkify` (`checkify_check` turns the record into a checkify error).
* It is a pytree of arrays, so it works unchanged under jit, vmap, scan and donation,
  and a snapshot (the old state) carries its own map: restore_state stays exact.
* O(work): alloc clears is_free at the pages it takes, free sets it at the pages it
  frees (scatters of the call's own size, in place when the state is donated); a merge
  leaves it alone (free + release is the same set). The per-call checks gather is_free
  at the call's own pages. Duplicate outputs cost a one-key sort of the call's outputs
  (O(T log T)); which entries repeat is worked out only when one does (lax.cond).
* An erroneous call is refused: an alloc returns ok=False and takes nothing, a free
  frees nothing; only the error record changes. Errors found in the arguments are known
  before the need_sort merge, so a refused call does not merge either; the output checks
  (duplicates, outputs outside the pool, a corrupted free list: defence in depth, they
  cannot fire on a state this module kept) run after it, so there, as for any failed
  alloc (SPEC 4.2), a merge that the shortfall triggered stays.
* Off means absent: with debug=False `state.debug` is None, no function here is traced
  and the jitted code is exactly the code without this module (tests/test_debug.py
  proves it), so the cost when off is zero.

Beside the ownership record (jax_kvalloc.guard, on by default, also with debug off): the
record refuses the same bad frees with debug off; debug mode adds everything else here
(argument checks of allocations under jit, output checks, the argument position of the
offending entry) and keeps its own map of free pages, so that it works with guard=False
too.

Alternative considered: `checkify.check` inside every operation. It needs every caller
to wrap its jitted functions in `checkify.checkify` and to thread the error out; the
record in the state needs neither, keeps the functions' signatures, and still offers
checkify to those who use it.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc.config import AllocatorConfig

Array = jax.Array
Err = Tuple[Array, Array, Array]  # (code, index, value), each i32[]

# Operations (DebugState.op).
OP_ALLOC, OP_ALLOC_EXTEND, OP_ALLOC_DECODE, OP_FREE = 1, 2, 3, 4
OP_FREE_PAGE_IDS, OP_FREE_SEGMENT = 5, 6
OP_NAMES = {OP_ALLOC: "alloc", OP_ALLOC_EXTEND: "alloc_extend",
            OP_ALLOC_DECODE: "alloc_decode", OP_FREE: "free",
            OP_FREE_PAGE_IDS: "free_page_ids", OP_FREE_SEGMENT: "free_segment"}

# Error codes (DebugState.code); 0 is no error.
BAD_SIZE = 1
NEGATIVE_PREFIX = 2
SEQ_TOO_SHORT = 3
MISALIGNED_LAST_LOC = 4
LAST_LOC_OUTSIDE_POOL = 5
LAST_LOC_IN_FREE_PAGE = 6
DOUBLE_FREE = 7
FREE_RESERVED = 8
FREE_OUT_OF_RANGE = 9
DUPLICATE_OUTPUT = 10
OUTPUT_OUTSIDE_POOL = 11
HANDED_OUT_IN_USE = 12
BAD_NUM_NEW_PAGES = 13
MISALIGNED_START_POS = 14
SEGMENT_NOT_CONTIGUOUS = 15

_ALLOCS = (OP_ALLOC, OP_ALLOC_EXTEND, OP_ALLOC_DECODE)
# (op, code) -> (argument that `index` points into, what is wrong).
MESSAGES: Dict[Tuple[int, int], Tuple[str, str]] = {
    (OP_ALLOC, BAD_SIZE): (
        "need_size", "must be >= 0, a multiple of page_size and <= max_size"),
    (OP_ALLOC_EXTEND, BAD_SIZE): (
        "extend_num_tokens", "sum(seq_lens - prefix_lens) exceeds max_tokens"),
    (OP_ALLOC_EXTEND, NEGATIVE_PREFIX): ("prefix_lens", "must be >= 0"),
    (OP_ALLOC_EXTEND, SEQ_TOO_SHORT): ("seq_lens", "is below prefix_lens of that request"),
    (OP_ALLOC_DECODE, SEQ_TOO_SHORT): ("seq_lens", "must be >= 1 (it counts the new token)"),
    (OP_ALLOC_EXTEND, MISALIGNED_LAST_LOC): (
        "last_loc", "breaks (last_loc + 1) % page_size == prefix_lens % page_size"),
    (OP_ALLOC_DECODE, MISALIGNED_LAST_LOC): (
        "last_loc", "breaks (last_loc + 2) % page_size == seq_lens % page_size"),
    (OP_FREE, DOUBLE_FREE): (
        "free_index", "double free: already in free_pages or release_pages (or, for "
        "the token allocator, repeated within the call)"),
    (OP_FREE, FREE_RESERVED): (
        "free_index", "lies in reserved page 0 (only 0 itself is padding)"),
    (OP_FREE, FREE_OUT_OF_RANGE): ("free_index", "is outside the pool"),
    (OP_ALLOC_EXTEND, BAD_NUM_NEW_PAGES): (
        "num_new_pages", "differs from the batch's true new-page count "
        "sum(ceil(seq_lens / page_size) - ceil(prefix_lens / page_size))"),
    (OP_FREE_PAGE_IDS, DOUBLE_FREE): (
        "page_ids", "double free: already in free_pages or release_pages, or repeated "
        "within the call"),
    (OP_FREE_PAGE_IDS, FREE_RESERVED): ("page_ids", "is the reserved page 0"),
    (OP_FREE_PAGE_IDS, FREE_OUT_OF_RANGE): (
        "page_ids", "is not a page of the pool (1..num_pages; 0 is padding)"),
    (OP_FREE_SEGMENT, MISALIGNED_START_POS): ("start_pos", "is not a multiple of page_size"),
    (OP_FREE_SEGMENT, SEGMENT_NOT_CONTIGUOUS): (
        "free_index", "lies in another page than the first token of its page "
        "(free_index[k - k % page_size]): not one request's contiguous slots"),
    (OP_FREE_SEGMENT, DOUBLE_FREE): (
        "free_index", "double free: its page is already in free_pages or release_pages, "
        "or repeated within the call"),
    (OP_FREE_SEGMENT, FREE_RESERVED): (
        "free_index", "lies in reserved page 0 (only 0 itself is padding)"),
    (OP_FREE_SEGMENT, FREE_OUT_OF_RANGE): ("free_index", "is outside the pool"),
}
for _op in (OP_ALLOC_EXTEND, OP_ALLOC_DECODE):
  MESSAGES[(_op, LAST_LOC_OUTSIDE_POOL)] = (
      "last_loc", "the request would continue in reserved page 0 or outside the pool")
  MESSAGES[(_op, LAST_LOC_IN_FREE_PAGE)] = (
      "last_loc", "lies in a free page: the request continues a page it does not hold")
for _op in _ALLOCS:
  MESSAGES[(_op, DUPLICATE_OUTPUT)] = ("output", "slot handed out twice by one call")
  MESSAGES[(_op, OUTPUT_OUTSIDE_POOL)] = (
      "output", "slot in reserved page 0 or outside the pool (corrupted state)")
  MESSAGES[(_op, HANDED_OUT_IN_USE)] = (
      "free_pages", "the free list holds a page that is in use (corrupted state)")


class DebugState(NamedTuple):
  """Debug-mode bookkeeping, `AllocatorState.debug` (None when debug mode is off)."""
  is_free: Array  # bool[num_pages + 1] page p is in free_pages or release_pages
  code: Array     # i32[] first error's code (0: none)
  op: Array       # i32[] operation that found it (OP_*)
  index: Array    # i32[] position of the first offending entry in that op's argument
  value: Array    # i32[] that entry's value


class AllocatorDebugError(ValueError):
  """A misuse that debug mode found: names the operation and the first offending entry."""

  def __init__(self, op: int, code: int, index: int, value: int):
    self.op, self.code, self.index, self.value = op, code, index, value
    self.op_name = OP_NAMES.get(op, f"op {op}")
    self.argument, self.reason = MESSAGES.get((op, code), ("?", f"error code {code}"))
    super().__init__(f"{self.op_name}: {self.argument}[{index}]={value}: {self.reason} "
                     f"(jax_kvalloc debug mode)")


def init(config: AllocatorConfig) -> DebugState:
  """Debug state of a fresh pool: every page 1..num_pages free, no error."""
  n = config.num_pages
  def zero():  # every leaf its own buffer, so that all of them can be donated
    return jnp.zeros((), jnp.int32)
  return DebugState(is_free=jnp.arange(n + 1) > 0, code=zero(), op=zero(), index=zero(),
                    value=zero())


# ---------------------------------------------------------------------------------------
# Reading the record (host side, syncs) and checkify.
# ---------------------------------------------------------------------------------------

def get_error(state) -> Optional[AllocatorDebugError]:
  """The recorded error as an exception (not raised), or None. Syncs; a single pool."""
  dbg = state.debug
  if dbg is None:
    return None
  code, op, index, value = (int(x) for x in jax.device_get(
      (dbg.code, dbg.op, dbg.index, dbg.value)))
  return AllocatorDebugError(op, code, index, value) if code else None


def raise_if_error(state) -> None:
  """Raises the recorded `AllocatorDebugError`, if any (syncs)."""
  err = get_error(state)
  if err is not None:
    raise err


def clear_error(state):
  """The state with its error record reset (the bookkeeping kept). No-op when off."""
  if state.debug is None:
    return state
  zero = lambda: jnp.zeros((), jnp.int32)  # pylint: disable=unnecessary-lambda-assignment
  return state._replace(debug=state.debug._replace(code=zero(), op=zero(), index=zero(),
                                                   value=zero()))


def checkify_check(state) -> None:
  """Inside a function transformed by `jax.experimental.checkify.checkify`: turns the
  recorded error into a checkify error whose message names the operation, the argument,
  the offending position and value. No-op when debug mode is off.

  Example:
    err, state = checkify.checkify(step)(state)  # step calls checkify_check(state)
    err.throw()
  """
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top
  dbg = state.debug
  if dbg is None:
    return
  for (op, code), (arg, reason) in MESSAGES.items():
    checkify.check((dbg.code != code) | (dbg.op != op),
                   f"{OP_NAMES[op]}: {arg}[{{index}}]={{value}}: {reason} "
                   "(jax_kvalloc debug mode)", index=dbg.index, value=dbg.value)


# ---------------------------------------------------------------------------------------
# Building blocks.
# ---------------------------------------------------------------------------------------

def _zero_err() -> Err:
  z = jnp.zeros((), jnp.int32)
  return z, z, z


def _first_error(checks: Sequence[Tuple[int, Array, Array]]) -> Err:
  """(code, index, value) of the first entry that fails any check; within one entry the
  earliest check listed wins. checks: (code, bool[N] failing, i32[N] values) triples."""
  n = checks[0][1].shape[0]
  if n == 0:
    return _zero_err()
  code = jnp.zeros((n,), jnp.int32)
  value = jnp.zeros((n,), jnp.int32)
  for c, bad, vals in reversed(checks):
    code = jnp.where(bad, c, code)
    value = jnp.where(bad, vals, value)
  i = jnp.argmax(code != 0).astype(jnp.int32)
  return code[i], i, value[i]


def _scalar_error(code: int, bad: Array, value: Array) -> Err:
  return (jnp.where(bad, code, 0).astype(jnp.int32), jnp.zeros((), jnp.int32),
          jnp.asarray(value, jnp.int32))


def _either(*errs: Err) -> Err:
  """The first of `errs` that holds an error (else no error)."""
  code, index, value = errs[-1]
  for c, i, v in reversed(errs[:-1]):
    take = c != 0
    code, index, value = (jnp.where(take, c, code), jnp.where(take, i, index),
                          jnp.where(take, v, value))
  return code, index, value


def _record(dbg: DebugState, op: int, err: Err) -> DebugState:
  """Keeps the first error ever recorded (sticky)."""
  code, index, value = err
  new = (dbg.code == 0) & (code != 0)
  return dbg._replace(code=jnp.where(new, code, dbg.code),
                      op=jnp.where(new, op, dbg.op),
                      index=jnp.where(new, index, dbg.index),
                      value=jnp.where(new, value, dbg.value))


def _repeats(values: Array, mask: Array) -> Array:
  """bool[N]: entry j is masked in and its value occurs at an earlier masked-in entry.

  A one-key sort finds whether any value repeats (O(N log N), the cheap part); only then
  (lax.cond) does a stable sort by (masked out, value, position) say which entries.
  """
  n = values.shape[0]
  if n < 2:
    return jnp.zeros((n,), bool)
  top = jnp.iinfo(jnp.int32).max  # fills masked-out entries; a real `top` is counted apart
  s = jnp.sort(jnp.where(mask, values, top))
  maybe = (jnp.any((s[1:] == s[:-1]) & (s[1:] != top))
           | (jnp.sum(mask & (values == top)) > 1))

  def which(values, mask):
    out_key = (~mask).astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    s_out, s_val, s_pos = jax.lax.sort((out_key, values, pos), num_keys=2, is_stable=True)
    rep = (s_out[1:] == 0) & (s_out[:-1] == 0) & (s_val[1:] == s_val[:-1])
    return jnp.zeros((n,), bool).at[s_pos[1:]].set(rep)

  return jax.lax.cond(maybe, which, lambda v, m: jnp.zeros((n,), bool), values, mask)


def _page_of(config: AllocatorConfig, slot: Array) -> Array:
  """Page of each slot, clipped into 0..num_pages (for gathers of is_free)."""
  return jnp.clip(slot // config.page_size, 0, config.num_pages)


def _continues(config: AllocatorConfig, dbg: DebugState, reads: Array,
               last_loc: Array) -> Tuple[Tuple[int, Array, Array], ...]:
  """Checks of rows whose new tokens continue last_loc's page (aligned rows only, so
  slot last_loc + 1 lies in that page): it must be a page of the pool, and held."""
  ps = config.page_size
  outside = reads & ((last_loc < ps - 1) | (last_loc > config.num_slots - 2))
  in_free = reads & ~outside & dbg.is_free[_page_of(config, last_loc)]
  return ((LAST_LOC_OUTSIDE_POOL, outside, last_loc),
          (LAST_LOC_IN_FREE_PAGE, in_free, last_loc))


# ---------------------------------------------------------------------------------------
# Hooks called by jax_kvalloc.allocation and jax_kvalloc.freeing when config.debug.
# ---------------------------------------------------------------------------------------

def alloc_args(bad_size: Array, need_size: Array) -> Err:
  """alloc: need_size negative, unaligned or beyond max_size (the core refuses it)."""
  return _scalar_error(BAD_SIZE, bad_size, need_size)


def extend_args(config: AllocatorConfig, state, real: Array, prefix_lens: Array,
                seq_lens: Array, last_loc: Array, total_tokens: Array,
                max_tokens: int) -> Err:
  """alloc_extend's argument errors (real rows only), found before any merge."""
  ps = config.page_size
  pre, seq, last = prefix_lens, seq_lens, last_loc
  negative = real & (pre < 0)
  short = real & ~negative & (seq < pre)
  misaligned = real & ~negative & ~short & ((last % ps + 1) % ps != pre % ps)
  reads = real & ~negative & ~short & ~misaligned & (pre % ps != 0) & (seq > pre)
  rows = _first_error(((NEGATIVE_PREFIX, negative, pre), (SEQ_TOO_SHORT, short, seq),
                       (MISALIGNED_LAST_LOC, misaligned, last))
                      + _continues(config, state.debug, reads, last))
  return _either(rows, _scalar_error(BAD_SIZE, total_tokens > max_tokens, total_tokens))


def decode_args(config: AllocatorConfig, state, real: Array, seq_lens: Array,
                last_loc: Array) -> Err:
  """alloc_decode's argument errors (real rows only), found before any merge."""
  ps = config.page_size
  seq, last = seq_lens, last_loc
  short = real & (seq < 1)
  misaligned = real & ~short & ((last % ps + 2) % ps != seq % ps)
  reads = real & ~short & ~misaligned & ((seq - 1) % ps != 0)
  return _first_error(((SEQ_TOO_SHORT, short, seq), (MISALIGNED_LAST_LOC, misaligned, last))
                      + _continues(config, state.debug, reads, last))


def finish_alloc(config: AllocatorConfig, state, op: int, err: Err, ok: Array,
                 window: Array, num_taken: Array, out: Array, out_mask: Array):
  """Last checks of an alloc, then the bookkeeping. Returns (state, ok).

  Args:
    err: the argument errors found before the merge (alloc_args/extend_args/decode_args).
    ok: bool[] the core's verdict (arguments valid, capacity available).
    window: i32[P] the front of the free list the call reads; it takes window[:num_taken].
    out: i32[T] the call's slots (before masking); out_mask: bool[T] its real entries.

  Returns the state with the error recorded and, when the call stands, its pages marked
  in use; and ok, now also False when any error was found (the caller then takes nothing).
  """
  dbg = state.debug
  ps = config.page_size
  i = jnp.arange(window.shape[0], dtype=jnp.int32)
  taken = ok & (i < num_taken)
  page = jnp.clip(window, 0, config.num_pages)
  in_use = taken & ~dbg.is_free[page]  # page 0 is never free: caught here too
  real = ok & out_mask
  outside = real & ((out < ps) | (out > config.num_slots - 1))
  err = _either(err,
                _first_error(((HANDED_OUT_IN_USE, in_use, window),)),
                _first_error(((OUTPUT_OUTSIDE_POOL, outside, out),
                              (DUPLICATE_OUTPUT, _repeats(out, real), out))))
  ok = ok & (err[0] == 0)
  drop = config.num_pages + 1  # out of range: not written
  is_free = dbg.is_free.at[jnp.where(ok & (i < num_taken), page, drop)].set(
      False, mode="drop")
  return state._replace(debug=_record(dbg._replace(is_free=is_free), op, err)), ok


def finish_free(config: AllocatorConfig, state, free_index: Array, values: Array,
                count: Array, op: int = OP_FREE):
  """Checks a free, then the bookkeeping. Returns (state, count).

  Args:
    free_index: i32[M] the call's argument (0 entries are padding).
    values: i32[K] the pages (paged) or slots (token) the core is about to push;
      values[:count] are pushed.

  An entry outside the pool, in reserved page 0 (other than the padding 0), or naming a
  page that is already free (or, for the token allocator, a slot given twice) is an
  error; then the returned count is 0 and nothing is freed. Returns (state, count,
  bool[] error found).
  """
  dbg = state.debug
  ps, x = config.page_size, free_index
  given = x != 0
  outside = given & ((x < 0) | (x > config.num_slots - 1))
  reserved = given & ~outside & (x < ps)
  valid = given & ~outside & ~reserved
  double = valid & dbg.is_free[_page_of(config, x)]
  if config.kind == "token":  # FIFO without de-duplication: a repeat is a double free
    double = double | _repeats(x, valid)
  err = _first_error(((FREE_OUT_OF_RANGE, outside, x), (FREE_RESERVED, reserved, x),
                      (DOUBLE_FREE, double, x)))
  count = jnp.where(err[0] == 0, count, 0)
  j = jnp.arange(values.shape[0], dtype=jnp.int32)
  is_free = dbg.is_free.at[jnp.where(j < count, values, config.num_pages + 1)].set(
      True, mode="drop")
  return (state._replace(debug=_record(dbg._replace(is_free=is_free), op, err)), count,
          err[0] != 0)


def finish_free_page_ids(config: AllocatorConfig, state, op: int, pages: Array,
                         given: Array, positions: Array, values: Array, count: Array,
                         err: Optional[Err] = None):
  """Checks a free of page ids (free_page_ids, paged free_segment), then the bookkeeping.

  Args:
    op: OP_FREE_PAGE_IDS or OP_FREE_SEGMENT (names the argument in the message).
    pages: i32[K] the page ids (free_segment: the pages of its representative slots,
      -1 for a negative slot); given: bool[K] the real (non-padding) entries.
    positions: i32[K] where each entry sits in the caller's argument (for the message).
    values, count: what the core is about to prepend (values[:count]).
    err: an error already found in the other arguments (it comes first).

  A given page outside 1..num_pages, page 0, a page already free or a page given twice
  is an error; then the returned count is 0 and nothing is freed. O(K log K) for the
  repeat check (a one-key sort), O(K) otherwise. Returns (state, count, bool[] error
  found).
  """
  dbg = state.debug
  n = config.num_pages
  outside = given & ((pages < 0) | (pages > n))
  reserved = given & (pages == 0)
  valid = given & ~outside & ~reserved
  double = valid & (dbg.is_free[jnp.clip(pages, 0, n)] | _repeats(pages, valid))
  code, index, value = _first_error(((FREE_OUT_OF_RANGE, outside, pages),
                                     (FREE_RESERVED, reserved, pages),
                                     (DOUBLE_FREE, double, pages)))
  if pages.shape[0]:
    index = positions[index]
  found = (code, index, value)
  if err is not None:
    found = _either(err, found)
  count = jnp.where(found[0] == 0, count, 0)
  j = jnp.arange(values.shape[0], dtype=jnp.int32)
  is_free = dbg.is_free.at[jnp.where(j < count, values, n + 1)].set(True, mode="drop")
  return (state._replace(debug=_record(dbg._replace(is_free=is_free), op, found)), count,
          found[0] != 0)


def segment_args(config: AllocatorConfig, free_index: Array, given: Array,
                 start_pos: Array) -> Err:
  """free_segment's argument errors: start_pos not a multiple of page_size (first), or a
  given slot outside the page of its page's first token (free_index[k - k % ps])."""
  ps = config.page_size
  m = free_index.shape[0]
  page = jnp.where(free_index >= 0, free_index // ps, -1)
  first = page[(jnp.arange(m) // ps) * ps] if m else page
  scattered = _first_error(((SEGMENT_NOT_CONTIGUOUS, given & (page != first), free_index),)
                           ) if m else _zero_err()
  return _either(_scalar_error(MISALIGNED_START_POS, start_pos % ps != 0, start_pos),
                 scattered)


def num_new_pages_arg(num_new_pages: Array, agree: Array) -> Err:
  """alloc_extend: a caller-given num_new_pages that differs from the true count
  (`agree`: the core's comparison)."""
  return _scalar_error(BAD_NUM_NEW_PAGES, ~agree, num_new_pages)


def either(*errs: Err) -> Err:
  """The first of `errs` that holds an error (else no error)."""
  return _either(*errs)


# ---------------------------------------------------------------------------------------
# Whole-state audit (host side, for tests and post-mortems).
# ---------------------------------------------------------------------------------------

def audit(config: AllocatorConfig, state) -> list:
  """Problems with one pool's lists, as strings (empty when consistent). Syncs; O(pool).

  Checks: lengths within 0..num_pages and free + release <= num_pages; every listed page
  in 1..num_pages; no page listed twice (within or across the two lists); in debug mode,
  is_free equal to the set of listed pages; with the ownership record (jax_kvalloc.guard),
  held equal to the pages in neither list.
  """
  from jax_kvalloc import state as st  # pylint: disable=g-import-not-at-top
  n = config.num_pages
  problems = []
  free_len, rel_len = int(state.free_len), int(state.release_len)
  if not (0 <= free_len <= n and 0 <= rel_len <= n and free_len + rel_len <= n):
    return [f"lengths free={free_len} release={rel_len} do not fit num_pages={n}"]
  listed = np.concatenate([st.live_free_pages(state), st.live_release_pages(state)])
  bad = listed[(listed < 1) | (listed > n)]
  if bad.size:
    problems.append(f"pages outside 1..{n} listed: {bad[:8].tolist()}")
  pages, counts = np.unique(listed, return_counts=True)
  if (counts > 1).any():
    problems.append(f"pages listed twice: {pages[counts > 1][:8].tolist()}")
  expect = np.zeros(n + 1, bool)
  expect[listed[(listed >= 1) & (listed <= n)]] = True
  if state.debug is not None:
    is_free = np.asarray(state.debug.is_free)
    if not np.array_equal(is_free, expect):
      diff = np.flatnonzero(is_free != expect)
      problems.append(f"debug is_free disagrees with the lists at pages {diff[:8].tolist()}")
  guard = getattr(state, "guard", None)
  if guard is not None:
    held = np.asarray(guard.held)
    want = (~expect).astype(np.int32)
    want[0] = 0
    if not np.array_equal(held, want):
      diff = np.flatnonzero(held != want)
      problems.append(f"the ownership record's held disagrees with the lists at pages "
                      f"{diff[:8].tolist()}")
  return problems
