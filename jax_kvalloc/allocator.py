"""The optax-style entry point: a NamedTuple of pure functions with the config bound::

    alloc = jax_kvalloc.paged_allocator(jax_kvalloc.AllocatorConfig(size=4096, page_size=16))
    state = alloc.init()

    @jax.jit
    def step(state, seq_lens, last_loc):
      state, slots, ok = alloc.alloc_decode(state, seq_lens, last_loc)
      return state, slots, ok

No `static_argnames` are needed: the config (sizes, page size, need_sort, kernel, debug)
is captured once, outside the state, as optax captures its hyperparameters. The bound
functions are the config-threaded ones of the functional core with `config` removed;
their docstrings (jax_kvalloc.allocation, jax_kvalloc.freeing) give shapes, dtypes and
what `ok=False` means. Static sizes (`max_size`, `max_tokens`) stay keyword arguments:
inside a jitted step they are Python ints.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

from jax_kvalloc import allocation
from jax_kvalloc import freeing
from jax_kvalloc import request_table
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig


class Allocator(NamedTuple):
  """Pure functions over an `AllocatorState`, with one pool's config bound.

  Every operation takes a state first and returns the new state first; nothing is
  mutated, so a snapshot is the old state.
  """
  config: AllocatorConfig
  init: Callable[[], st.AllocatorState]
  alloc: Callable[..., Any]               # (state, need_size, *, max_size) -> (state, i32[max_size], ok)
  alloc_extend: Callable[..., Any]        # (state, prefix_lens, seq_lens, last_loc, *, max_tokens, num_reqs=None)
  alloc_decode: Callable[..., Any]        # (state, seq_lens, last_loc, *, num_reqs=None)
  free: Callable[..., Any]                # (state, free_index) -> state
  merge_and_sort_free: Callable[..., Any]  # (state) -> state
  available_size: Callable[..., Any]      # (state) -> i32[]
  # SPEC 10 (SGLang 0.5.23's newer operations); appended so positional unpacking of the
  # fields above keeps working.
  free_page_ids: Callable[..., Any]       # (state, page_ids, num=None) -> state
  free_segment: Callable[..., Any]        # (state, free_index, start_pos, num=None) -> state
  free_full: Callable[..., Any]           # (state, free_index) -> state
  free_full_segment: Callable[..., Any]   # (state, free_index, start_pos, num=None) -> state
  get_all_free_pages: Callable[..., Any]  # (state) -> (i32[num_pages], i32[] count)
  # SPEC 11, the request table (jax_kvalloc.request_table): the table goes beside the state.
  init_table: Callable[..., Any]          # (max_reqs, max_pages_per_req) -> RequestTable
  extend_rows: Callable[..., Any]         # (state, table, rows, n, *, max_tokens, num_rows=None) -> (state, table, slots, ok)
  decode_rows: Callable[..., Any]         # (state, table, rows, *, num_rows=None) -> (state, table, slots, ok)
  release_rows: Callable[..., Any]        # (state, table, rows, *, num_rows=None) -> (state, table, ok)
  borrow_pages: Callable[..., Any]        # (state, table, rows, page_ids, num_pages, *, num_rows=None) -> (table, ok)
  admit_rows: Callable[..., Any]          # (state, table, rows, n, *, num_rows=None, max_tokens=None) -> i32[]
  attention_inputs: Callable[..., Any]    # (table, rows, q_lens, *, num_rows=None) -> AttentionInputs
  # A decode step's free_page_ids then alloc_decode (one kernel launch on GPU).
  release_and_alloc_decode: Callable[..., Any]  # (state, page_ids, seq_lens, last_loc, *, num=None, num_reqs=None)
  # A serving step's table work, release + extend + decode (one kernel launch on GPU).
  step_rows: Callable[..., Any]           # (state, table, *, release=, extend=, n=, decode=, max_tokens=, num_*=) -> (state, table, StepOutputs)
  borrow_from_rows: Callable[..., Any]    # (state, table, rows, src, num_pages, *, num_rows=None, hand_over=False) -> (table, ok)


def _bind(config: AllocatorConfig) -> Allocator:
  bind = lambda fn: functools.partial(fn, config)
  return Allocator(
      config=config,
      init=bind(st.init),
      alloc=bind(allocation.alloc),
      alloc_extend=bind(allocation.alloc_extend),
      alloc_decode=bind(allocation.alloc_decode),
      free=bind(freeing.free),
      merge_and_sort_free=bind(freeing.merge_and_sort_free),
      available_size=bind(st.available_size),
      free_page_ids=bind(freeing.free_page_ids),
      free_segment=bind(freeing.free_segment),
      free_full=bind(freeing.free_full),
      free_full_segment=bind(freeing.free_full_segment),
      get_all_free_pages=bind(freeing.get_all_free_pages),
      init_table=bind(request_table.init_table),
      extend_rows=bind(request_table.extend_rows),
      decode_rows=bind(request_table.decode_rows),
      release_rows=bind(request_table.release_rows),
      borrow_pages=bind(request_table.borrow_pages),
      admit_rows=bind(request_table.admit_rows),
      attention_inputs=bind(request_table.attention_inputs),
      release_and_alloc_decode=bind(allocation.release_and_alloc_decode),
      step_rows=bind(request_table.step_rows),
      borrow_from_rows=bind(request_table.borrow_from_rows),
  )


def _config(config: Optional[AllocatorConfig], kind: str, kwargs: dict) -> AllocatorConfig:
  if config is None:
    return AllocatorConfig(kind=kind, **kwargs)
  if kwargs:
    raise TypeError(f"pass either config or keyword arguments, not both (got {sorted(kwargs)})")
  if not isinstance(config, AllocatorConfig):
    raise TypeError(f"config must be an AllocatorConfig, got {type(config).__name__}")
  if config.kind != kind:
    raise ValueError(f"config.kind={config.kind!r}, but this factory builds a {kind!r} allocator")
  return config


def paged_allocator(config: Optional[AllocatorConfig] = None, **kwargs) -> Allocator:
  """SGLang's paged allocator (SPEC 4) as pure functions.

  Args:
    config: an AllocatorConfig with kind="paged"; or leave it out and pass its fields as
      keyword arguments (`paged_allocator(size=4096, page_size=16)`).

  Returns:
    An `Allocator` NamedTuple; see the module docstring.

  Raises:
    TypeError / ValueError for a bad config (naming the field), or a token config.
  """
  return _bind(_config(config, "paged", kwargs))


def token_allocator(config: Optional[AllocatorConfig] = None, **kwargs) -> Allocator:
  """SGLang's token allocator (SPEC 3: page_size 1, FIFO free) as pure functions.

  Args:
    config: an AllocatorConfig with kind="token"; or its fields as keyword arguments
      (`token_allocator(size=4096)`).

  Returns:
    An `Allocator` NamedTuple (its alloc_extend / alloc_decode work at page size 1, which
    SGLang's token class does not offer).
  """
  kwargs.setdefault("page_size", 1) if config is None else None
  return _bind(_config(config, "token", kwargs))
