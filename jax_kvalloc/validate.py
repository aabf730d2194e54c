"""Input checks: static ones (dtype, rank, matching lengths) that the functional core runs
at trace time, and eager value checks that the SGLang-compatible classes run on host
copies of their arguments before they touch any state.

Every check raises before anything changes, so after an exception the allocator is
exactly as it was. Messages name the argument, the offending position and its value.
Values are compared as Python/int64 integers before any cast to int32, so a length or an
index that does not fit int32 is reported, never wrapped.

Exceptions: TypeError for a wrong type or dtype (floats, bools, objects); ValueError for a
wrong shape or value; RuntimeError for a call out of sequence (free groups).

The eager checks read only host arrays: the classes pass the `*_cpu` copies of the lengths
when the caller has them, so these checks add no device sync of their own. Values that
live only inside jitted code (traced) cannot be checked here; debug mode
(jax_kvalloc.debug) checks those, and the double frees no eager check can see.
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc.config import INT32_MAX

INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------
# Static checks (trace time, free): used by the functional core.
# ---------------------------------------------------------------------------------------

def as_i32(x: Any, name: str) -> jax.Array:
  """`x` as an int32 array; TypeError naming `name` unless its dtype is an integer type.

  Floats and bools are refused rather than truncated. (Traced values cannot be range
  checked here: an int64 or uint32 value beyond int32 wraps, as any jnp cast does.)
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
  return x.astype(jnp.int32)


def static_rows(**arrays: jax.Array) -> int:
  """Per-request arrays must be 1-D and of one length; returns that length.

  ValueError naming each argument's shape otherwise (trace time, no cost).
  """
  shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items()}
  for name, shape in shapes.items():
    if len(shape) != 1:
      raise ValueError(f"{name} must be 1-D (one entry per request), got shape {shape}")
  if len(set(shapes.values())) > 1:
    raise ValueError(f"per-request arrays differ in length: {shapes}")
  return next(iter(shapes.values()))[0]


# ---------------------------------------------------------------------------------------
# Eager checks on host values: used by the SGLang-compatible classes.
# ---------------------------------------------------------------------------------------

def host_ints(x: Any, name: str) -> np.ndarray:
  """A 1-D int64 numpy copy of an index argument (list, numpy, jax or torch array).

  A scalar becomes one entry; an empty list is accepted whatever numpy guesses its dtype.
  Raises TypeError naming `name` for non-integer dtypes (floats, bools), ValueError for
  other ranks and for values beyond int64 (uint64, Python ints), which cannot be indices.
  """
  if type(x) is np.ndarray and x.ndim == 1 and x.dtype.kind == "i" and x.size:
    return x.astype(np.int64)  # the common case, fast: no further checks apply
  if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
    x = x.detach().cpu().numpy()
  try:
    arr = np.asarray(x)
  except OverflowError as e:
    raise ValueError(f"{name} holds a value that does not fit int32: {e}") from e
  if arr.ndim == 0:
    arr = arr.reshape(1)
  if arr.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
  if arr.size == 0:
    return np.zeros((0,), np.int64)
  if arr.dtype == object:  # Python ints too large for int64 (or anything else)
    for i, v in enumerate(arr):
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise TypeError(f"{name} must hold integers, got {name}[{i}]={v!r}")
    big = [i for i, v in enumerate(arr) if not INT32_MIN <= int(v) <= INT32_MAX]
    raise ValueError(f"{name}[{big[0]}]={int(arr[big[0]])} does not fit int32")
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
  if arr.dtype == np.uint64 and arr.max() > INT64_MAX:
    i = int(np.argmax(arr > INT64_MAX))
    raise ValueError(f"{name}[{i}]={int(arr[i])} does not fit int32")
  return arr.astype(np.int64)


def fits_int32(arr: np.ndarray, name: str) -> None:
  """ValueError naming the first entry of `arr` (int64) outside int32."""
  bad = (arr < INT32_MIN) | (arr > INT32_MAX)
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"{name}[{i}]={int(arr[i])} does not fit int32")


def count(value: Any, name: str) -> int:
  """A non-negative count that fits int32, as a Python int.

  TypeError for bools, floats and other non-integers (an integer numpy/jax/torch scalar
  is fine); ValueError for negative values and values beyond 2**31 - 1.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be an int, got {value!r}")
  try:
    value = operator.index(value)
  except TypeError as e:
    raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from e
  if value < 0:
    raise ValueError(f"{name} must be >= 0, got {value}")
  if value > INT32_MAX:
    raise ValueError(f"{name}={value} does not fit int32 (max {INT32_MAX})")
  return value


def need_size(value: Any, page_size: int) -> int:
  """`alloc`'s need_size: a count that is a multiple of page_size (SPEC 4.1 **fix**)."""
  value = count(value, "need_size")
  if value % page_size:
    raise ValueError(f"need_size={value} must be a multiple of page_size={page_size}")
  return value


def same_length(**arrays: np.ndarray) -> int:
  """All per-request arrays must have one length; returns it."""
  lengths = {name: a.shape[0] for name, a in arrays.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError(f"per-request arrays differ in length: {lengths}")
  return next(iter(lengths.values()))


def _raise_first(bad: np.ndarray, message) -> None:
  if bad.any():
    raise ValueError(message(int(np.argmax(bad))))


def _last_loc_in_pool(last: np.ndarray, num_slots: int) -> None:
  _raise_first((last < -1) | (last > num_slots - 1), lambda i: (
      f"last_loc[{i}]={int(last[i])} is not a slot of the pool (-1 or 0..{num_slots - 1})"))


class ExtendArgs(NamedTuple):
  """What `extend_args` found: the batch's extend_num_tokens and new pages."""
  total_tokens: int
  new_pages: int


def extend_args(pre: np.ndarray, seq: np.ndarray, last: np.ndarray, extend_num_tokens: Any,
                *, page_size: int, num_slots: int) -> ExtendArgs:
  """Checks an `alloc_extend` batch (int64 host arrays, SPEC 4.2).

  Raises ValueError (naming the request and value) for: values beyond int32, different
  lengths, prefix_lens < 0, seq_lens < prefix_lens, last_loc outside -1..num_slots-1,
  last_loc breaking (last_loc + 1) % page_size == prefix_lens % page_size, an
  extend_num_tokens other than sum(seq - pre) or beyond int32. Returns the batch's
  (total tokens, new pages) as Python ints.

  A request that continues in page 0 (SPEC 5's first vector, from SGLang's tests) passes
  here; debug mode refuses it, and a last_loc in a page the request does not hold.
  """
  ps = page_size
  if pre.shape == seq.shape == last.shape:
    # One combined mask first (few numpy ops, no per-check reductions); the checks below
    # that name the offending request run only when it finds something.
    ext = seq - pre
    lp1 = last + 1
    bad = ((pre.view(np.uint64) > INT32_MAX) | (seq.view(np.uint64) > INT32_MAX)
           | (ext.view(np.uint64) > INT32_MAX) | (lp1.view(np.uint64) > num_slots))
    if ps > 1:
      bad |= ((lp1 - pre) % ps) != 0
    if not bad.any():
      total = int(ext.sum())
      given = count(extend_num_tokens, "extend_num_tokens")
      if given != total:
        raise ValueError(
            f"extend_num_tokens={given} != sum(seq_lens - prefix_lens)={total}")
      new_pages = int(((seq + (ps - 1)) // ps - (pre + (ps - 1)) // ps).sum())
      return ExtendArgs(total, new_pages)
  for name, a in (("prefix_lens", pre), ("seq_lens", seq), ("last_loc", last)):
    fits_int32(a, name)
  same_length(prefix_lens=pre, seq_lens=seq, last_loc=last)
  _raise_first(pre < 0, lambda i: f"prefix_lens[{i}]={int(pre[i])} must be >= 0")
  _raise_first(seq < pre, lambda i: (
      f"seq_lens[{i}]={int(seq[i])} < prefix_lens[{i}]={int(pre[i])}: a request cannot "
      f"shrink"))
  _last_loc_in_pool(last, num_slots)
  _raise_first((last + 1) % ps != pre % ps, lambda i: (
      f"last_loc[{i}]={int(last[i])} breaks (last_loc + 1) % page_size == prefix_lens % "
      f"page_size (page_size={ps}, prefix_lens[{i}]={int(pre[i])})"))
  total = int((seq - pre).sum())
  given = count(extend_num_tokens, "extend_num_tokens")
  if given != total:
    raise ValueError(f"extend_num_tokens={given} != sum(seq_lens - prefix_lens)={total}")
  new_pages = int((-(-seq // ps) - (-(-pre // ps))).sum())
  return ExtendArgs(total, new_pages)


def num_new_pages(value: Any, true_count: int) -> None:
  """`alloc_extend`'s optional num_new_pages must equal the batch's true page count."""
  value = count(value, "num_new_pages")
  if value != true_count:
    raise ValueError(f"num_new_pages={value} != the batch's new pages "
                     f"sum(ceil(seq_lens / page_size) - ceil(prefix_lens / page_size))="
                     f"{true_count}")


def decode_args(seq: np.ndarray, last: np.ndarray, *, page_size: int,
                num_slots: int) -> None:
  """Checks an `alloc_decode` batch (int64 host arrays, SPEC 4.3).

  Raises ValueError (naming the request and value) for: values beyond int32, different
  lengths, seq_lens < 1, last_loc outside -1..num_slots-1, or last_loc breaking
  (last_loc + 2) % page_size == seq_lens % page_size.
  """
  ps = page_size
  if seq.shape == last.shape:  # one combined mask first, as in extend_args
    sm1 = seq - 1
    lp1 = last + 1
    bad = (sm1.view(np.uint64) > INT32_MAX - 1) | (lp1.view(np.uint64) > num_slots)
    if ps > 1:
      bad |= ((lp1 - sm1) % ps) != 0
    if not bad.any():
      return
  fits_int32(seq, "seq_lens")
  fits_int32(last, "last_loc")
  same_length(seq_lens=seq, last_loc=last)
  _raise_first(seq < 1, lambda i: (
      f"seq_lens[{i}]={int(seq[i])} must be >= 1 (it counts the new token)"))
  _last_loc_in_pool(last, num_slots)
  _raise_first((last + 2) % ps != seq % ps, lambda i: (
      f"last_loc[{i}]={int(last[i])} breaks (last_loc + 2) % page_size == seq_lens % "
      f"page_size (page_size={ps}, seq_lens[{i}]={int(seq[i])})"))


def free_index(idx: np.ndarray, *, page_size: int, num_slots: int) -> None:
  """Every entry must be an allocatable slot: page_size..num_slots-1 (page 0 is reserved).

  ValueError naming the first offending entry otherwise.
  """
  if idx.shape[0] > 0 and (idx - page_size).view(np.uint64).max() <= num_slots - 1 - page_size:
    return  # one reduction; the message below is worked out only on failure
  bad = (idx < page_size) | (idx > num_slots - 1)
  _raise_first(bad, lambda i: (
      f"free_index[{i}]={int(idx[i])} is not an allocatable slot: valid slots are "
      f"{page_size}..{num_slots - 1}" + (" (page 0 is reserved)" if
                                         0 <= idx[i] < page_size else "")))


def page_ids(ids: np.ndarray, *, num_pages: int, name: str = "page_ids") -> None:
  """`free_page_ids`: every entry a page of the pool (1..num_pages), none given twice
  (the core prepends them as given, without de-duplication). ValueError naming the first
  offending entry otherwise. O(M log M) on the host (M entries), no device work."""
  bad = (ids < 1) | (ids > num_pages)
  _raise_first(bad, lambda i: (
      f"{name}[{i}]={int(ids[i])} is not a page of the pool: valid pages are "
      f"1..{num_pages}" + (" (page 0 is reserved)" if ids[i] == 0 else "")))
  repeated_at(ids, name, "is given twice (free_page_ids frees exactly the pages given, "
              "without de-duplication)")


def repeated_at(values: np.ndarray, name: str, reason: str) -> None:
  """ValueError naming the first entry of `values` equal to an earlier one."""
  if values.shape[0] < 2:
    return
  order = np.argsort(values, kind="stable")
  s = values[order]
  same = s[1:] == s[:-1]
  if same.any():
    i = int(order[1:][same].min())
    raise ValueError(f"{name}[{i}]={int(values[i])} {reason}")


def start_pos(value: Any, page_size: int) -> int:
  """`free_segment`'s start_pos: a count that is a multiple of page_size."""
  value = count(value, "start_pos")
  if value % page_size:
    raise ValueError(f"start_pos={value} must be a multiple of page_size={page_size} "
                     f"(a segment starts on a page boundary)")
  return value


def segment(idx: np.ndarray, *, page_size: int) -> np.ndarray:
  """`free_segment`'s free_index (slots already range checked): token k must lie in the
  page of its page's first token, idx[k - k % page_size], and the pages must be
  distinct. Returns the pages, idx[::page_size] // page_size (int64). O(M) plus a sort
  of the M / page_size pages."""
  ps = page_size
  page = idx // ps
  first = page[(np.arange(idx.shape[0]) // ps) * ps]
  _raise_first(page != first, lambda i: (
      f"free_index[{i}]={int(idx[i])} lies in page {int(page[i])}, but the page of its "
      f"segment position starts at free_index[{i - i % ps}]={int(idx[i - i % ps])} "
      f"(page {int(first[i])}): free_index must hold one request's consecutive tokens"))
  pages = page[::ps]
  repeated_at(pages, "free_index[::page_size] // page_size", "names a page twice")
  return pages


def segments_disjoint(lengths_and_starts, page_size: int) -> None:
  """`free_segments`: consecutive non-empty segments must not share a page (SGLang's
  rule: each start page lies beyond the previous segment's last page)."""
  prev_end, prev_i = None, None
  for i, (n, start) in enumerate(lengths_and_starts):
    if n == 0:
      continue
    if prev_end is not None and start // page_size <= (prev_end - 1) // page_size:
      raise ValueError(f"segments[{i}] (start_pos={start}) shares a page with segments"
                       f"[{prev_i}], which ends at token {prev_end} (page_size="
                       f"{page_size}); nothing was freed")
    prev_end, prev_i = start + n, i


def snapshot(snap: Any, config: Any, snapshot_type: type) -> None:
  """`restore_state` argument: a snapshot taken from an allocator of the same config."""
  if not isinstance(snap, snapshot_type):
    raise TypeError(f"state must be an {snapshot_type.__name__} from backup_state(), "
                    f"got {type(snap).__name__}")
  if snap.config != config:
    raise ValueError(f"state was taken from an allocator with config {snap.config}, "
                     f"this one has {config}")


def state_like(state: Any, current: Any, state_type: type) -> None:
  """`set_state`: an AllocatorState whose leaves match the current one's shapes and
  dtypes (same pool, same debug mode). TypeError / ValueError naming the field."""
  if not isinstance(state, state_type):
    raise TypeError(f"state must be an {state_type.__name__}, got {type(state).__name__}")
  if (state.debug is None) != (current.debug is None):
    raise ValueError("state.debug must be " + ("None (debug mode is off)" if
                     current.debug is None else "a DebugState (debug mode is on)"))
  if (getattr(state, "guard", None) is None) != (getattr(current, "guard", None) is None):
    raise ValueError("state.guard must be " + (
        "None (the ownership record is off: guard=False)" if current.guard is None else
        "a GuardState (the ownership record is on: build states with init(config))"))
  new_leaves = jax.tree_util.tree_leaves_with_path(state)
  old_leaves = jax.tree_util.tree_leaves_with_path(current)
  for (path, new), (_, old) in zip(new_leaves, old_leaves):
    name = "state" + jax.tree_util.keystr(path)
    if isinstance(new, jax.core.Tracer):
      raise TypeError(f"{name} is a tracer: return the state from the jitted function "
                      "before handing it back")
    if jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != jnp.result_type(old):
      raise ValueError(f"{name} has shape {jnp.shape(new)} and dtype "
                       f"{jnp.result_type(new)}; this pool's has {jnp.shape(old)} and "
                       f"{jnp.result_type(old)}")


def group_begin(open_group: Any) -> None:
  """A free group must not be open already (SGLang asserts no nesting)."""
  if open_group is not None:
    raise RuntimeError("free_group_begin() called while a free group is already open "
                       "(free groups do not nest)")


def group_end(open_group: Any) -> None:
  """A free group must be open."""
  if open_group is None:
    raise RuntimeError("free_group_end() called without free_group_begin()")


def device_last_loc(x: Any, bs: int) -> Any:
  """`last_loc` as the device backend takes it when it is a jax.Array: as it is, never
  read back (a read would wait for every launch queued before it, the forward pass
  included). Returns the i32[bs] array, or None when `x` is host data (then the host
  checks apply).

  Only what the array's metadata shows is checked: TypeError naming last_loc for a
  non-integer dtype, ValueError for a shape other than [bs]. Its values are not checked
  (SGLang checks none either; debug mode reads and checks them): a wrong last_loc gives
  wrong slots for the rows that continue a page, and never touches the free list.
  """
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return None
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"last_loc must hold integers, got dtype {x.dtype}")
  if x.shape != (bs,):
    raise ValueError(f"last_loc must have shape ({bs},) (one entry per request), got "
                     f"{x.shape}")
  return x if x.dtype == jnp.int32 else x.astype(jnp.int32)


def aligned_last_loc(lens: np.ndarray, page_size: int, offset: int) -> np.ndarray:
  """A host stand-in for a device `last_loc` that passes its alignment and range checks,
  so that `decode_args` (offset 2, lens = seq_lens) and `extend_args` (offset 1, lens =
  prefix_lens) check the other arguments unchanged: -1 where lens < offset, else
  (lens - offset) % page_size."""
  return np.where(lens >= offset, (lens - offset) % page_size, -1)


def host_last_loc(last_loc: Any, dev_last: Any, lens: np.ndarray, page_size: int,
                  offset: int) -> np.ndarray:
  """The host last_loc the argument checks see: `last_loc`'s ints, or, where it is a
  device array taken as it is (`dev_last`, from device_last_loc), aligned_last_loc's
  stand-in."""
  if dev_last is None:
    return host_ints(last_loc, "last_loc")
  return aligned_last_loc(lens, page_size, offset)


def state_lengths(state: Any, num_pages: int) -> "tuple[int, int]":
  """`set_state`: the lengths and heads of a state must describe lists of this pool
  (0 <= free_len, release_len; free_len + release_len <= num_pages; heads in
  0..num_pages-1). Reads them (a wait on the device). Returns (free_len, release_len);
  ValueError naming the field otherwise."""
  values = {name: int(getattr(state, name)) for name in (
      "free_head", "free_len", "release_head", "release_len")}
  for name, value in values.items():
    top = num_pages if name.endswith("len") else num_pages - 1
    if not 0 <= value <= max(top, 0):
      raise ValueError(f"state.{name}={value} is outside 0..{top} (num_pages={num_pages})")
  if values["free_len"] + values["release_len"] > num_pages:
    raise ValueError(f"state.free_len + state.release_len = {values['free_len']} + "
                     f"{values['release_len']} exceeds num_pages={num_pages}")
  return values["free_len"], values["release_len"]


def device_ints(x: Any, name: str) -> Any:
  """An index argument that is a device array (jax.Array, not a tracer) as the device
  backend takes it: as it is, never read back. Returns it as i32[n], or None when `x`
  is host data (then the host checks apply). Only its metadata is checked: TypeError
  naming `name` for a non-integer dtype, ValueError for a rank other than 1."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return None
  if x.dtype == jnp.int32 and x.ndim == 1:  # the common case, without the checks below
    return x
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
  if x.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
  return x.astype(jnp.int32)
