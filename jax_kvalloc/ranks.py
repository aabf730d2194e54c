"""Data-parallel ranks (SPEC 12): `dp_size` independent pools as one state.

Serving engines that run data-parallel attention give each rank its own slice of the KV
cache and its own free list (sglang-jax's `dp_size`). Here the ranks are one
`AllocatorState` whose every leaf has a leading rank axis: `free_ring` is
i32[dp_size, pages_per_rank], `free_len` is i32[dp_size], and so on. Rank r is exactly a
single pool of `size // dp_size` slots (`pages_per_rank = num_pages // dp_size` pages,
ids local to the rank, 1..pages_per_rank, page 0 of each rank reserved), and one rank
running short never changes another.

Every operation acts on all ranks at once, each rank with its own inputs along the
leading axis, and returns per-rank results (`ok` is bool[dp_size]). A rank with nothing
to do passes empty input (num_reqs 0, need_size 0, all-padding frees). The operations
are the single-pool ones under `jax.vmap`; the need_sort merge stays a branch there
(jax_kvalloc.gated), so a call in which no rank merges does no work proportional to the
pool, and one in which some rank merges sorts, masked, once per rank.

The config passed to every function is the whole pool's (`size` counts every rank's
slots, as in sglang-jax); the rank count comes from the state's leading axis.

Placement: `ranks_allocator(config, dp_size, mesh=mesh, axis_name="dp")` shards the rank
axis over a `jax.sharding.Mesh` axis and runs every operation under `shard_map`: each
device holds `dp_size // mesh.shape[axis_name]` whole ranks, and since ranks share
nothing, the compiled program contains no cross-device communication.

Several processes (hosts). The mesh may span processes (after
`jax.distributed.initialize()`, a mesh over `jax.devices()`): every process then builds
the same RankedAllocator and makes the same calls in the same order, each process's
devices hold and compute only its own ranks, and no step sends anything between
processes. `init` and `init_table` build each process's ranks from local data; every
array input must be a global array that each process builds from its own ranks' rows
(`jax_kvalloc.multiprocess.put_ranks`), and each process reads its ranks' outputs with
`multiprocess.get_ranks` (addressable shards only). `multiprocess.process_ranks` says
which ranks a process holds.

The request table (SPEC 11) gets the same rank axis: `init_tables` stacks one table per
rank, and `extend_rows`, `decode_rows`, `release_rows`, `borrow_pages`,
`borrow_from_rows`, `admit_rows` and `attention_inputs` act on every rank's table and
pool at once.

    ranks = jax_kvalloc.ranks_allocator(AllocatorConfig(size=8192, page_size=16), 4)
    state = ranks.init()                              # 4 pools of 2048 slots
    state, slots, ok = jax.jit(ranks.alloc_decode)(state, seq_lens, last_loc)
    # seq_lens, last_loc: i32[4, B]; slots: i32[4, B]; ok: bool[4]
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import multiprocess
from jax_kvalloc import request_table
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

Array = jax.Array
RankedResult = Tuple[AllocatorState, Array, Array]
TableResult = Tuple[AllocatorState, "request_table.RequestTable", Array, Array]

# What the compiled program of a sharded operation must not contain (see
# `collectives_in`): every kind of cross-device communication XLA emits.
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter", "collective-broadcast", "send", "recv")


# ---------------------------------------------------------------------------------------
# Configuration and state.
# ---------------------------------------------------------------------------------------

def rank_config(config: AllocatorConfig, dp_size: int) -> AllocatorConfig:
  """The config of one rank: `size // dp_size` slots, everything else as `config`.

  Raises:
    TypeError if dp_size is not an int; ValueError if dp_size < 1 or a rank would not
    hold one page (size // dp_size < page_size).
  """
  if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)):
    raise TypeError(f"dp_size must be an int, got {type(dp_size).__name__} {dp_size!r}")
  dp_size = int(dp_size)
  if dp_size < 1:
    raise ValueError(f"dp_size must be >= 1, got {dp_size}")
  if dp_size == 1:
    return config
  if config.size // dp_size < config.page_size:
    raise ValueError(
        f"dp_size={dp_size} leaves each rank size // dp_size = {config.size // dp_size} "
        f"slots, less than one page (page_size={config.page_size}); size={config.size}")
  return dataclasses.replace(config, size=config.size // dp_size)


def num_ranks(state: AllocatorState) -> int:
  """dp_size of a ranked state (static: the leading axis of its arrays)."""
  if state.free_ring.ndim != 2:
    raise ValueError(f"expected a ranked state (free_ring i32[dp_size, pages_per_rank]), "
                     f"got free_ring of shape {state.free_ring.shape}")
  return state.free_ring.shape[0]


def _config_of(config: AllocatorConfig, state: AllocatorState) -> AllocatorConfig:
  """The rank config for `state`, checked against its shapes (a clear error when a rank's
  config, rather than the whole pool's, is passed)."""
  dp = num_ranks(state)
  rc = rank_config(config, dp)
  if state.free_ring.shape[1] != rc.num_pages:
    raise ValueError(
        f"state has {state.free_ring.shape[1]} pages per rank, but config (size="
        f"{config.size}, page_size={config.page_size}) over {dp} ranks gives "
        f"{rc.num_pages}; pass the whole pool's config, as to init_ranks")
  return rc


def init_ranks(config: AllocatorConfig, dp_size: int) -> AllocatorState:
  """`dp_size` pools, each in the initial state of SPEC 2 (free_pages = [1 ..
  pages_per_rank], release_pages = []), stacked along a leading axis.

  Args:
    config: the whole pool's config (size counts all ranks' slots).
    dp_size: number of ranks.

  Returns:
    An AllocatorState whose leaves have a leading axis of length dp_size, each leaf its
    own buffer (so the state can be donated).
  """
  rc = rank_config(config, dp_size)
  return jax.vmap(lambda _: st.init(rc))(jnp.arange(dp_size))


def rank_state(state: AllocatorState, dp_rank: int) -> AllocatorState:
  """Rank `dp_rank` of a ranked state as a single-pool state (for st.live_free_pages,
  debug.get_error and the like). A copy of that rank's arrays."""
  dp = num_ranks(state)
  if not 0 <= int(dp_rank) < dp:
    raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp}")
  return jax.tree.map(lambda x: x[dp_rank], state)


def stack_ranks(states: Sequence[AllocatorState]) -> AllocatorState:
  """Single-pool states of equal shapes stacked into a ranked state (rank r = states[r])."""
  if not states:
    raise ValueError("stack_ranks needs at least one state")
  return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def _leading(dp: int, **arrays: Any) -> None:
  """Checks that every given array has the leading rank axis (ValueError naming it)."""
  for name, x in arrays.items():
    if x is None:
      continue
    shape = np.shape(x)
    if not shape or shape[0] != dp:
      raise ValueError(f"{name} must have a leading rank axis of length dp_size={dp}, "
                       f"got shape {shape}")


def _mask(dp: int, ranks: Optional[Array]) -> Array:
  """bool[dp]: the ranks an operation touches (all when None)."""
  if ranks is None:
    return jnp.ones((dp,), bool)
  ranks = jnp.asarray(ranks)
  if ranks.shape != (dp,) or ranks.dtype != jnp.bool_:
    raise ValueError(f"ranks must be bool[{dp}] (dp_size={dp}), got "
                     f"{ranks.dtype}{list(ranks.shape)}")
  return ranks


# ---------------------------------------------------------------------------------------
# Operations over every rank. Each rank's inputs along the leading axis; see the
# single-pool functions (jax_kvalloc.allocation, jax_kvalloc.freeing) for what a rank
# does with them and what ok=False means for it.
# ---------------------------------------------------------------------------------------

def available_size(config: AllocatorConfig, state: AllocatorState) -> Array:
  """Free slots of each rank, released ones included: i32[dp_size]."""
  rc = _config_of(config, state)
  return jax.vmap(functools.partial(st.available_size, rc))(state)


def alloc(config: AllocatorConfig, state: AllocatorState, need_size: Array, *,
          max_size: int) -> RankedResult:
  """`allocation.alloc` on every rank. need_size: i32[dp_size] (0: the rank takes nothing).

  Returns (state, i32[dp_size, max_size] slots, bool[dp_size] ok); a rank whose ok is
  False allocated nothing (only a merge its shortfall triggered is kept), and the other
  ranks are as if it had not been asked.
  """
  rc = _config_of(config, state)
  _leading(num_ranks(state), need_size=need_size)
  fn = functools.partial(allocation.alloc, rc, max_size=max_size)
  return jax.vmap(fn)(state, need_size)


def alloc_extend(config: AllocatorConfig, state: AllocatorState, prefix_lens: Array,
                 seq_lens: Array, last_loc: Array, *, max_tokens: int,
                 num_reqs: Optional[Array] = None,
                 num_new_pages: Optional[Array] = None) -> RankedResult:
  """`allocation.alloc_extend` on every rank.

  Args:
    prefix_lens, seq_lens, last_loc: i32[dp_size, B], each rank's rows (slots local to
      the rank).
    max_tokens: static; per rank.
    num_reqs: optional i32[dp_size], each rank's real rows (0: the rank does nothing).
    num_new_pages: optional i32[dp_size], each rank's new-page count as the caller knows
      it (SPEC 10); a rank whose count is wrong is refused.

  Returns:
    (state, i32[dp_size, max_tokens] slots, bool[dp_size] ok).
  """
  rc = _config_of(config, state)
  _leading(num_ranks(state), prefix_lens=prefix_lens, seq_lens=seq_lens,
           last_loc=last_loc, num_reqs=num_reqs, num_new_pages=num_new_pages)
  fn = functools.partial(allocation.alloc_extend, rc, max_tokens=max_tokens)
  # A None num_reqs is an empty pytree: vmap passes it through unchanged.
  return jax.vmap(lambda s, p, q, l, n, k: fn(s, p, q, l, num_reqs=n, num_new_pages=k))(
      state, prefix_lens, seq_lens, last_loc, num_reqs, num_new_pages)


def alloc_decode(config: AllocatorConfig, state: AllocatorState, seq_lens: Array,
                 last_loc: Array, *, num_reqs: Optional[Array] = None) -> RankedResult:
  """`allocation.alloc_decode` on every rank.

  Args:
    seq_lens, last_loc: i32[dp_size, B].
    num_reqs: optional i32[dp_size], each rank's real rows (0: the rank does nothing).

  Returns:
    (state, i32[dp_size, B] slots, bool[dp_size] ok).
  """
  rc = _config_of(config, state)
  _leading(num_ranks(state), seq_lens=seq_lens, last_loc=last_loc, num_reqs=num_reqs)
  fn = functools.partial(allocation.alloc_decode, rc)
  return jax.vmap(lambda s, q, l, n: fn(s, q, l, num_reqs=n))(state, seq_lens, last_loc,
                                                              num_reqs)


def release_and_alloc_decode(config: AllocatorConfig, state: AllocatorState,
                             page_ids: Array, seq_lens: Array, last_loc: Array, *,
                             num: Optional[Array] = None,
                             num_reqs: Optional[Array] = None) -> RankedResult:
  """`allocation.release_and_alloc_decode` on every rank: each rank frees its page_ids
  (free_page_ids), then allocates its decode rows.

  Args:
    page_ids: i32[dp_size, M] rank-local page ids (0 and index >= num: padding).
    seq_lens, last_loc: i32[dp_size, B].
    num: optional i32[dp_size], each rank's leading page_ids to free.
    num_reqs: optional i32[dp_size], each rank's real rows.

  Returns:
    (state, i32[dp_size, B] slots, bool[dp_size] ok); every rank's release is done
    whatever its ok.
  """
  rc = _config_of(config, state)
  _leading(num_ranks(state), page_ids=page_ids, seq_lens=seq_lens, last_loc=last_loc,
           num=num, num_reqs=num_reqs)
  fn = functools.partial(allocation.release_and_alloc_decode, rc)
  return jax.vmap(lambda s, p, q, l, m, n: fn(s, p, q, l, num=m, num_reqs=n))(
      state, page_ids, seq_lens, last_loc, num, num_reqs)


def free(config: AllocatorConfig, state: AllocatorState, free_index: Array) -> AllocatorState:
  """`freeing.free` on every rank. free_index: i32[dp_size, M], rank-local slots; 0 is
  padding (an all-zero row frees nothing)."""
  rc = _config_of(config, state)
  _leading(num_ranks(state), free_index=free_index)
  return jax.vmap(functools.partial(freeing.free, rc))(state, free_index)


def free_page_ids(config: AllocatorConfig, state: AllocatorState, page_ids: Array,
                  num: Optional[Array] = None) -> AllocatorState:
  """`freeing.free_page_ids` on every rank. page_ids: i32[dp_size, M]; num: optional
  i32[dp_size] (entries at index >= num, and zeros, are padding)."""
  rc = _config_of(config, state)
  _leading(num_ranks(state), page_ids=page_ids, num=num)
  return jax.vmap(functools.partial(freeing.free_page_ids, rc))(state, page_ids, num)


def free_segment(config: AllocatorConfig, state: AllocatorState, free_index: Array,
                 start_pos: Array, num: Optional[Array] = None) -> AllocatorState:
  """`freeing.free_segment` on every rank. free_index: i32[dp_size, M]; start_pos and the
  optional num: i32[dp_size]."""
  rc = _config_of(config, state)
  _leading(num_ranks(state), free_index=free_index, start_pos=start_pos, num=num)
  return jax.vmap(functools.partial(freeing.free_segment, rc))(state, free_index,
                                                                start_pos, num)


def merge_and_sort_free(config: AllocatorConfig, state: AllocatorState,
                        ranks: Optional[Array] = None) -> AllocatorState:
  """`freeing.merge_and_sort_free` on the ranks `ranks` (bool[dp_size]; None: all).

  Sorts only when some chosen rank has released pages (the others stay as they are).
  """
  rc = _config_of(config, state)
  mask = _mask(num_ranks(state), ranks)
  if not rc.need_sort:
    return state  # release_pages is always empty: every merge is a no-op
  return jax.vmap(functools.partial(freeing.maybe_merge, rc))(state, mask)


def clear(config: AllocatorConfig, state: AllocatorState,
          ranks: Optional[Array] = None) -> AllocatorState:
  """The ranks `ranks` (bool[dp_size]; None: all) back to SPEC 2's initial state; the
  others unchanged. O(pool): it rewrites the chosen ranks' lists."""
  dp = num_ranks(state)
  fresh = init_ranks(config, dp)
  if ranks is None:
    return fresh
  mask = _mask(dp, ranks)
  return jax.tree.map(
      lambda new, old: jnp.where(mask.reshape((dp,) + (1,) * (old.ndim - 1)), new, old),
      fresh, state)


def get_all_free_pages(config: AllocatorConfig, state: AllocatorState) -> Tuple[Array, Array]:
  """`freeing.get_all_free_pages` of every rank: (i32[dp_size, pages_per_rank],
  i32[dp_size] counts)."""
  rc = _config_of(config, state)
  return jax.vmap(functools.partial(freeing.get_all_free_pages, rc))(state)


# ---------------------------------------------------------------------------------------
# The request table with a rank axis (SPEC 11 per rank): every leaf of the RequestTable
# (and of AttentionInputs) gains a leading axis of length dp_size, rank r's table holds
# rank r's requests and rank-local page ids. Each function is the single-table one of
# jax_kvalloc.request_table under jax.vmap, with per-rank inputs along the leading axis
# (num_rows: i32[dp_size]); see there for what a rank does and what its ok=False means.
# ---------------------------------------------------------------------------------------

def init_tables(config: AllocatorConfig, dp_size: int, max_reqs: int,
                max_pages_per_req: int) -> request_table.RequestTable:
  """`dp_size` empty request tables stacked: pages i32[dp_size, max_reqs,
  max_pages_per_req], lens and owned_from i32[dp_size, max_reqs]."""
  rank_config(config, dp_size)  # validates dp_size
  one = request_table.init_table(config, max_reqs, max_pages_per_req)
  return jax.tree.map(lambda x: jnp.zeros((dp_size,) + x.shape, x.dtype), one)


def _table_config(config: AllocatorConfig, table: request_table.RequestTable,
                  state: Optional[AllocatorState] = None) -> AllocatorConfig:
  if not isinstance(table, request_table.RequestTable) or table.pages.ndim != 3:
    raise ValueError("expected a ranked RequestTable (pages i32[dp_size, max_reqs, "
                     f"max_pages_per_req]), got {type(table).__name__}"
                     + (f" with pages of shape {table.pages.shape}"
                        if isinstance(table, request_table.RequestTable) else ""))
  dp = table.pages.shape[0]
  if state is not None:
    rc = _config_of(config, state)
    if num_ranks(state) != dp:
      raise ValueError(f"table has {dp} ranks, state has {num_ranks(state)}")
    return rc
  return rank_config(config, dp)


def extend_rows(config: AllocatorConfig, state: AllocatorState,
                table: request_table.RequestTable, rows: Array, n: Array, *,
                max_tokens: int, num_rows: Optional[Array] = None) -> TableResult:
  """`request_table.extend_rows` on every rank. rows, n: i32[dp_size, B]; num_rows:
  optional i32[dp_size]. Returns (state, table, i32[dp_size, max_tokens] slots,
  bool[dp_size] ok)."""
  rc = _table_config(config, table, state)
  _leading(num_ranks(state), rows=rows, n=n, num_rows=num_rows)
  fn = functools.partial(request_table.extend_rows, rc, max_tokens=max_tokens)
  return jax.vmap(lambda s, t, r, k, m: fn(s, t, r, k, num_rows=m))(
      state, table, rows, n, num_rows)


def decode_rows(config: AllocatorConfig, state: AllocatorState,
                table: request_table.RequestTable, rows: Array, *,
                num_rows: Optional[Array] = None) -> TableResult:
  """`request_table.decode_rows` on every rank. rows: i32[dp_size, B]. Returns (state,
  table, i32[dp_size, B] slots, bool[dp_size] ok)."""
  rc = _table_config(config, table, state)
  _leading(num_ranks(state), rows=rows, num_rows=num_rows)
  fn = functools.partial(request_table.decode_rows, rc)
  return jax.vmap(lambda s, t, r, m: fn(s, t, r, num_rows=m))(state, table, rows, num_rows)


def release_rows(config: AllocatorConfig, state: AllocatorState,
                 table: request_table.RequestTable, rows: Array, *,
                 num_rows: Optional[Array] = None
                 ) -> Tuple[AllocatorState, request_table.RequestTable, Array]:
  """`request_table.release_rows` on every rank. rows: i32[dp_size, B]. Returns (state,
  table, bool[dp_size] ok)."""
  rc = _table_config(config, table, state)
  _leading(num_ranks(state), rows=rows, num_rows=num_rows)
  fn = functools.partial(request_table.release_rows, rc)
  return jax.vmap(lambda s, t, r, m: fn(s, t, r, num_rows=m))(state, table, rows, num_rows)


def borrow_pages(config: AllocatorConfig, state: AllocatorState,
                 table: request_table.RequestTable, rows: Array, page_ids: Array,
                 num_pages: Array, *, num_rows: Optional[Array] = None
                 ) -> Tuple[request_table.RequestTable, Array]:
  """`request_table.borrow_pages` on every rank. rows, num_pages: i32[dp_size, B];
  page_ids: i32[dp_size, B, W] rank-local ids. Returns (table, bool[dp_size] ok)."""
  rc = _table_config(config, table)
  _leading(table.pages.shape[0], rows=rows, page_ids=page_ids, num_pages=num_pages,
           num_rows=num_rows)
  fn = functools.partial(request_table.borrow_pages, rc)
  return jax.vmap(lambda s, t, r, p, k, m: fn(s, t, r, p, k, num_rows=m))(
      state, table, rows, page_ids, num_pages, num_rows)


def borrow_from_rows(config: AllocatorConfig, state: AllocatorState,
                     table: request_table.RequestTable, rows: Array, src: Array,
                     num_pages: Array, *,
                     num_rows: Optional[Array] = None, hand_over: bool = False
                     ) -> Tuple[request_table.RequestTable, Array]:
  """`request_table.borrow_from_rows` on every rank. rows, src, num_pages: i32[dp_size,
  B], src a rank's own rows; hand_over static. Returns (table, bool[dp_size] ok)."""
  rc = _table_config(config, table)
  _leading(table.pages.shape[0], rows=rows, src=src, num_pages=num_pages,
           num_rows=num_rows)
  fn = functools.partial(request_table.borrow_from_rows, rc, hand_over=hand_over)
  return jax.vmap(lambda s, t, r, c, k, m: fn(s, t, r, c, k, num_rows=m))(
      state, table, rows, src, num_pages, num_rows)


def admit_rows(config: AllocatorConfig, state: AllocatorState,
               table: request_table.RequestTable, rows: Array, n: Array, *,
               num_rows: Optional[Array] = None, max_tokens: Optional[int] = None) -> Array:
  """`request_table.admit_rows` on every rank. rows, n: i32[dp_size, B]. Returns
  i32[dp_size]: each rank's count of queued requests that fit."""
  rc = _table_config(config, table, state)
  _leading(num_ranks(state), rows=rows, n=n, num_rows=num_rows)
  fn = functools.partial(request_table.admit_rows, rc, max_tokens=max_tokens)
  return jax.vmap(lambda s, t, r, k, m: fn(s, t, r, k, num_rows=m))(
      state, table, rows, n, num_rows)


def attention_inputs(config: AllocatorConfig, table: request_table.RequestTable,
                     rows: Array, q_lens: Array, *,
                     num_rows: Optional[Array] = None) -> request_table.AttentionInputs:
  """`request_table.attention_inputs` on every rank. rows, q_lens: i32[dp_size, B].
  Returns AttentionInputs with a leading rank axis on every field (page_indices
  i32[dp_size, B, max_pages_per_req], kv_lens i32[dp_size, B], cu_q_lens
  i32[dp_size, B + 1], num_seqs i32[dp_size, 1]); page ids are rank-local."""
  rc = _table_config(config, table)
  _leading(table.pages.shape[0], rows=rows, q_lens=q_lens, num_rows=num_rows)
  fn = functools.partial(request_table.attention_inputs, rc)
  return jax.vmap(lambda t, r, q, m: fn(t, r, q, num_rows=m))(table, rows, q_lens, num_rows)


# ---------------------------------------------------------------------------------------
# Placement over a mesh.
# ---------------------------------------------------------------------------------------

def _shard_map(fn: Callable, mesh: jax.sharding.Mesh, spec: Any) -> Callable:
  """shard_map with the same spec for every input and output: `jax.shard_map` where it
  exists (jax >= 0.6, including 0.10 and 0.12), else jax.experimental.shard_map.

  The varying-across-devices type check is off (check_vma / check_rep): every value is
  per device here, and Pallas calls (the GPU kernels) cannot declare their outputs'
  device variance, so with the check on they would not trace inside shard_map.
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  from jax.experimental.shard_map import shard_map  # pylint: disable=g-import-not-at-top
  return shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_rep=False)


def rank_sharding(mesh: jax.sharding.Mesh, axis_name: str) -> jax.sharding.NamedSharding:
  """The sharding of every leaf of a ranked state: the rank axis over `axis_name`."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def check_mesh(mesh: jax.sharding.Mesh, axis_name: str, dp_size: int) -> None:
  """ValueError unless `axis_name` is an axis of `mesh` whose size divides dp_size."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  multiprocess.check_axis(mesh, axis_name, dp_size)


def shard(fn: Callable[..., Any], mesh: jax.sharding.Mesh, axis_name: str) -> Callable:
  """`fn(*arrays)`, every input and output with a leading rank axis, run under shard_map
  with that axis split over `axis_name`: each device runs `fn` on its own ranks.

  `fn` must treat ranks independently (the operations of this module do), which is what
  makes the compiled program free of cross-device communication.
  """
  return _shard_map(fn, mesh, jax.sharding.PartitionSpec(axis_name))


def collectives_in(hlo_text: str) -> Dict[str, int]:
  """Occurrences of each cross-device operation (COLLECTIVES) in compiled HLO text, e.g.
  `jax.jit(f).lower(*args).compile().as_text()`; {} when there are none."""
  found = {}
  for name in COLLECTIVES:
    # As an op: "= s32[4]{0} all-reduce(" or "all-reduce-start(".
    count = sum(line.count(f" {name}(") + line.count(f" {name}-start(")
                for line in hlo_text.splitlines())
    if count:
      found[name] = count
  return found


class RankedAllocator(NamedTuple):
  """The operations of this module with the config (and placement) bound.

  Every function takes the ranked state first and returns it first; see the module
  functions for shapes. With a mesh, `init` places the state on it and every operation
  is a jitted shard_map over the mesh axis.
  """
  config: AllocatorConfig      # the whole pool's
  dp_size: int
  mesh: Optional[jax.sharding.Mesh]
  axis_name: Optional[str]
  init: Callable[[], AllocatorState]
  alloc: Callable[..., Any]               # (state, need_size, *, max_size)
  alloc_extend: Callable[..., Any]        # (state, prefix_lens, seq_lens, last_loc, *, max_tokens, num_reqs=None)
  alloc_decode: Callable[..., Any]        # (state, seq_lens, last_loc, *, num_reqs=None)
  free: Callable[..., Any]                # (state, free_index)
  free_page_ids: Callable[..., Any]       # (state, page_ids, num=None)
  free_segment: Callable[..., Any]        # (state, free_index, start_pos, num=None)
  merge_and_sort_free: Callable[..., Any]  # (state, ranks=None)
  clear: Callable[..., Any]               # (state, ranks=None)
  available_size: Callable[..., Any]      # (state) -> i32[dp_size]
  get_all_free_pages: Callable[..., Any]  # (state) -> (i32[dp_size, P], i32[dp_size])
  release_and_alloc_decode: Callable[..., Any]  # (state, page_ids, seq_lens, last_loc, *, num=None, num_reqs=None)
  # The request table with a rank axis (SPEC 11 per rank).
  init_table: Callable[..., Any]          # (max_reqs, max_pages_per_req) -> RequestTable
  extend_rows: Callable[..., Any]         # (state, table, rows, n, *, max_tokens, num_rows=None)
  decode_rows: Callable[..., Any]         # (state, table, rows, *, num_rows=None)
  release_rows: Callable[..., Any]        # (state, table, rows, *, num_rows=None)
  borrow_pages: Callable[..., Any]        # (state, table, rows, page_ids, num_pages, *, num_rows=None)
  borrow_from_rows: Callable[..., Any]    # (state, table, rows, src, num_pages, *, num_rows=None, hand_over=False)
  admit_rows: Callable[..., Any]          # (state, table, rows, n, *, num_rows=None, max_tokens=None)
  attention_inputs: Callable[..., Any]    # (table, rows, q_lens, *, num_rows=None)


def _placed(config: AllocatorConfig, dp_size: int, mesh: jax.sharding.Mesh,
            axis_name: str):
  """Binds an operation of this module under a jitted shard_map, one compiled function
  per set of static keyword arguments and of optional arrays given."""
  # Inside shard_map each device sees only its own ranks; its share of the pool keeps
  # every rank at size // dp_size slots.
  local = dp_size // mesh.shape[axis_name]
  local_config = dataclasses.replace(config, size=(config.size // dp_size) * local)
  cache: Dict[Any, Callable] = {}

  def bind(op: Callable, static_names: Tuple[str, ...] = ()):
    def jitted(state, *args, **kwargs):
      """(the jitted shard_map for this call's static arguments, its array inputs)."""
      static = tuple(sorted((k, kwargs.pop(k)) for k in static_names if k in kwargs))
      names = tuple(k for k, v in sorted(kwargs.items()) if v is not None)
      arrays = args + tuple(kwargs[k] for k in names)
      key = (op, static, len(args), names)
      if key not in cache:
        def body(s, *a):
          return op(local_config, s, *a[:len(args)], **dict(zip(names, a[len(args):])),
                    **dict(static))
        cache[key] = jax.jit(shard(body, mesh, axis_name))
      return cache[key], (state,) + arrays

    def call(state, *args, **kwargs):
      fn, arrays = jitted(state, *args, **kwargs)
      return fn(*arrays)

    def lower(state, *args, **kwargs):
      fn, arrays = jitted(state, *args, **kwargs)
      return fn.lower(*arrays)

    call.lower = lower  # e.g. collectives_in(r.alloc_decode.lower(...).compile().as_text())
    return call

  return bind


def _local_copies(one: Any, mesh: jax.sharding.Mesh, axis_name: str, dp_size: int) -> Any:
  """Every rank a copy of the single-rank pytree `one`, placed over the mesh from this
  process's rows only (multiprocess.put_ranks: no data crosses processes)."""
  k = len(multiprocess.process_ranks(mesh, axis_name, dp_size))
  return multiprocess.put_ranks(
      jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], k, axis=0), one),
      mesh, axis_name, dp_size)


def _init_placed(config: AllocatorConfig, dp_size: int, mesh: jax.sharding.Mesh,
                 axis_name: str) -> AllocatorState:
  # Every rank starts in the same state: one rank's, copied.
  return _local_copies(st.init(rank_config(config, dp_size)), mesh, axis_name, dp_size)


def _init_table_placed(config: AllocatorConfig, dp_size: int, mesh: jax.sharding.Mesh,
                       axis_name: str, max_reqs: int,
                       max_pages_per_req: int) -> request_table.RequestTable:
  return _local_copies(request_table.init_table(config, max_reqs, max_pages_per_req),
                       mesh, axis_name, dp_size)


def ranks_allocator(config: AllocatorConfig, dp_size: int, *,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    axis_name: Optional[str] = None) -> RankedAllocator:
  """`dp_size` data-parallel pools as pure functions, optionally placed on a mesh.

  Args:
    config: the whole pool's AllocatorConfig (each rank gets size // dp_size slots).
    dp_size: number of ranks.
    mesh: optional jax.sharding.Mesh; the rank axis is sharded over its `axis_name`
      axis, whose size must divide dp_size, and every operation runs under shard_map
      with no cross-device communication. It may span processes: then pass inputs
      built by multiprocess.put_ranks and read outputs with multiprocess.get_ranks.
    axis_name: the mesh axis (required with mesh).

  Returns:
    A RankedAllocator. Without a mesh its functions are plain (compose them under your
    own jit, vmap, scan); with one, they are jitted shard_maps (callable inside jit too),
    and each operation `op` also has `op.lower(same arguments)`, the jax.stages.Lowered
    of the program a call with those arguments runs (after such a call, `.compile()`
    returns the compiled one from JAX's cache; `collectives_in` reads its text).

  Raises:
    TypeError / ValueError for a bad dp_size, mesh or axis_name, naming it.
  """
  rank_config(config, dp_size)  # validates
  if mesh is None:
    if axis_name is not None:
      raise ValueError("axis_name needs a mesh")
    bind = lambda op, static_names=(): functools.partial(op, config)
    init = functools.partial(init_ranks, config, dp_size)
    init_table = functools.partial(init_tables, config, dp_size)
  else:
    if axis_name is None:
      raise ValueError("a mesh needs axis_name, the mesh axis to shard the ranks over")
    check_mesh(mesh, axis_name, dp_size)
    bind = _placed(config, dp_size, mesh, axis_name)
    init = functools.partial(_init_placed, config, dp_size, mesh, axis_name)
    init_table = functools.partial(_init_table_placed, config, dp_size, mesh, axis_name)
  return RankedAllocator(
      config=config, dp_size=dp_size, mesh=mesh, axis_name=axis_name, init=init,
      alloc=bind(alloc, ("max_size",)),
      alloc_extend=bind(alloc_extend, ("max_tokens",)),
      alloc_decode=bind(alloc_decode),
      free=bind(free),
      free_page_ids=bind(free_page_ids),
      free_segment=bind(free_segment),
      merge_and_sort_free=bind(merge_and_sort_free),
      clear=bind(clear),
      available_size=bind(available_size),
      get_all_free_pages=bind(get_all_free_pages),
      release_and_alloc_decode=bind(release_and_alloc_decode),
      init_table=init_table,
      extend_rows=bind(extend_rows, ("max_tokens",)),
      decode_rows=bind(decode_rows),
      release_rows=bind(release_rows),
      borrow_pages=bind(borrow_pages),
      borrow_from_rows=bind(borrow_from_rows, ("hand_over",)),
      admit_rows=bind(admit_rows, ("max_tokens",)),
      attention_inputs=bind(attention_inputs),
  )
