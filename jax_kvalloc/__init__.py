"""jax_kvalloc: SGLang's KV-cache slot allocators as pure, jit-compiled JAX functions.

Functional core (no host sync; composes with jit, vmap, scan and donation):
  paged_allocator(config) / token_allocator(config): a NamedTuple of pure functions with
  the config bound (optax style), over an `AllocatorState` pytree; the same functions
  with the static `AllocatorConfig` as first argument: init, alloc, alloc_extend,
  alloc_decode, free, merge_and_sort_free, available_size, and SGLang 0.5.23's newer
  free_page_ids, free_segment, free_full, free_full_segment, get_all_free_pages; and
  release_and_alloc_decode (a decode step's free_page_ids + alloc_decode, one launch on
  GPU).

Request table (SPEC 11; a `RequestTable` pytree beside the state, for one jitted step):
  init_table, extend_rows, decode_rows, release_rows, borrow_pages, admit_rows,
  attention_inputs (also bound on the Allocator NamedTuple), borrow_from_rows (pages
  taken from, or handed over by, other rows), and step_rows (release + extend + decode
  of one serving step; each of these, and each borrow, is one launch on GPU).

Data-parallel ranks (SPEC 12; jax_kvalloc.ranks): init_ranks(config, dp_size) and
  ranks_allocator(config, dp_size, mesh=, axis_name=), every rank's pool (and request
  table) along a leading axis, optionally sharded over a mesh (shard_map, no
  collectives) that may span processes (jax_kvalloc.multiprocess: each process's ranks
  in and out).

Compiling ahead: warmup_calls (functional API) and enable_persistent_cache.

SGLang-compatible classes on top, in their own package: jax_kvalloc.sglang
  (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator; this package never imports it).

Where each thing lives (the allocator core; the tooling is jax_kvalloc.tools)::

  config.py       AllocatorConfig              state.py      AllocatorState, ring buffers
  allocator.py    paged_/token_allocator       allocation.py alloc, alloc_extend, alloc_decode,
                                                             release_and_alloc_decode
  freeing.py      free, free_page_ids, free_segment, merge_and_sort_free
  gated.py        a merge branch that stays a branch under vmap
  index_jnp.py    the index arithmetic (jnp / numpy): the reference the kernels match
  kernels.py      the one selector: each operation's implementation (config.kernel)
  buckets.py      shape buckets               validate.py   input checks, clear errors
  guard.py        the ownership record (SPEC 14): held pages, refused frees, on by default
  debug.py        debug-mode checks under jit request_table.py  SPEC 11
  ranks.py        SPEC 12, functional          warmup.py     compile ahead of serving
  multiprocess.py ranks over processes: which a process holds, its inputs, its outputs
  swa.py          SPEC 13, the sliding-window allocator (two pools and a mapping), functional;
                  its SGLang class is jax_kvalloc.sglang.swa.SWATokenToKVPoolAllocator
  swa_table.py    the request table of an SWA pool pair (window frees, attention inputs)
"""
from jax_kvalloc.allocation import alloc
from jax_kvalloc.allocator import Allocator
from jax_kvalloc.allocator import paged_allocator
from jax_kvalloc.allocator import token_allocator
from jax_kvalloc.allocation import alloc_decode
from jax_kvalloc.allocation import alloc_extend
from jax_kvalloc.allocation import release_and_alloc_decode
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.debug import AllocatorDebugError
from jax_kvalloc.freeing import free
from jax_kvalloc.freeing import free_full
from jax_kvalloc.freeing import free_full_segment
from jax_kvalloc.freeing import free_page_ids
from jax_kvalloc.freeing import free_segment
from jax_kvalloc.freeing import get_all_free_pages
from jax_kvalloc.freeing import merge_and_sort_free
from jax_kvalloc.guard import FreeRefusedError
from jax_kvalloc.ranks import RankedAllocator
from jax_kvalloc.ranks import init_ranks
from jax_kvalloc.ranks import ranks_allocator
from jax_kvalloc.request_table import AttentionInputs
from jax_kvalloc.request_table import RequestTable
from jax_kvalloc.request_table import admit_rows
from jax_kvalloc.request_table import attention_inputs
from jax_kvalloc.request_table import borrow_from_rows
from jax_kvalloc.request_table import borrow_pages
from jax_kvalloc.request_table import decode_rows
from jax_kvalloc.request_table import extend_rows
from jax_kvalloc.request_table import init_table
from jax_kvalloc.request_table import release_rows
from jax_kvalloc.request_table import step_rows
from jax_kvalloc.state import AllocatorState
from jax_kvalloc.state import available_size
from jax_kvalloc.state import init
from jax_kvalloc.state import live_free_pages
from jax_kvalloc.state import live_release_pages
from jax_kvalloc.swa import SWAAllocator
from jax_kvalloc.swa import SWAConfig
from jax_kvalloc.swa import SWAState
from jax_kvalloc.swa import swa_allocator
from jax_kvalloc.warmup import WarmupReport
from jax_kvalloc.warmup import enable_persistent_cache
from jax_kvalloc.warmup import warmup_calls

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "AllocatorConfig",
    "AllocatorDebugError",
    "AllocatorState",
    "AttentionInputs",
    "FreeRefusedError",
    "RankedAllocator",
    "RequestTable",
    "SWAAllocator",
    "SWAConfig",
    "SWAState",
    "WarmupReport",
    "admit_rows",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "attention_inputs",
    "available_size",
    "borrow_from_rows",
    "borrow_pages",
    "decode_rows",
    "enable_persistent_cache",
    "extend_rows",
    "free",
    "free_full",
    "free_full_segment",
    "free_page_ids",
    "free_segment",
    "get_all_free_pages",
    "init",
    "init_ranks",
    "init_table",
    "live_free_pages",
    "live_release_pages",
    "merge_and_sort_free",
    "paged_allocator",
    "ranks_allocator",
    "release_and_alloc_decode",
    "release_rows",
    "step_rows",
    "swa_allocator",
    "token_allocator",
    "warmup_calls",
]
