"""Random ragged batches served through the request table, their K/V written with the
jax_kvalloc.attention helpers, and a plain contiguous-cache attention to check kernels by.

A case: a pool whose free ring starts shuffled and wrapping (its head near the end), a
source row whose whole pages a second row borrows (a shared prefix), rows that already
hold tokens (filled in chunks), then one step that extends every batch entry by its
q_len in one extend_rows call: prefill chunks, decode rows (q_len 1), a real row with
nothing new (q_len 0), an empty row (kv_len 0) and a padding entry. Every value is a
bfloat16 number stored as f32: JAX's TPU interpreter rounds matmul inputs to bf16, so
only such inputs let an interpreted TPU kernel agree to 1e-5.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import attention
from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig

HKV, GROUP, DIM = 2, 2, 128  # KV heads, query heads per KV head, head dim (TPU lanes)
POISON = 64.0                # pages start as garbage of this size: unwritten reads show


def bf16_exact(x: np.ndarray) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@dataclasses.dataclass
class Case:
  config: AllocatorConfig
  table: rt.RequestTable
  rows: np.ndarray          # i32[B] batch entries (the last is padding)
  q_lens: np.ndarray        # i32[B]
  num_rows: int
  max_tokens: int
  q: np.ndarray             # f32[max_tokens, HKV * GROUP, DIM] packed queries (scaled)
  kv_pages: jax.Array       # f32[P, ps, 2 * HKV, DIM] combined layout
  k_pages: jax.Array        # f32[HKV, P, ps, DIM] split layout
  v_pages: jax.Array
  keys: Dict[int, np.ndarray]    # row -> f32[kv_len, HKV, DIM] contiguous cache
  values: Dict[int, np.ndarray]


# Jitted once per shape: op-by-op eager dispatch of the allocator would dominate the test.
_extend = jax.jit(rt.extend_rows, static_argnums=0, static_argnames="max_tokens")
_borrow = jax.jit(rt.borrow_pages, static_argnums=0)
_write_combined = jax.jit(attention.write_kv_combined)
_write_split = jax.jit(attention.write_kv_split)


def _shuffled_wrapping_state(config: AllocatorConfig, rng) -> st.AllocatorState:
  n = config.num_pages
  head = n - 3                                   # the next allocation crosses the ring end
  order = rng.permutation(np.arange(1, n + 1, dtype=np.int32))
  ring = np.zeros(n, np.int32)
  ring[(head + np.arange(n)) % n] = order
  s = st.init(config)
  return s._replace(free_ring=jnp.asarray(ring), free_head=jnp.int32(head))


def make_case(page_size: int, seed: int) -> Case:
  """A random batch as described in the module docstring."""
  rng = np.random.default_rng(seed)
  ps = page_size
  width = max(4, -(-96 // ps))                   # pages per row: up to 96 tokens
  num_pages = 6 * width
  config = AllocatorConfig(size=num_pages * ps, page_size=ps)
  state = _shuffled_wrapping_state(config, rng)
  table = rt.init_table(config, 8, width)
  kv_pages = jnp.asarray(bf16_exact(rng.uniform(-POISON, POISON,
                                                (num_pages + 1, ps, 2 * HKV, DIM))))
  k_pages = jnp.asarray(bf16_exact(rng.uniform(-POISON, POISON,
                                               (HKV, num_pages + 1, ps, DIM))))
  v_pages = jnp.asarray(bf16_exact(rng.uniform(-POISON, POISON, k_pages.shape)))
  keys: Dict[int, np.ndarray] = {r: np.zeros((0, HKV, DIM), np.float32) for r in range(8)}
  values = {r: np.zeros((0, HKV, DIM), np.float32) for r in range(8)}

  def extend(rows: List[int], n: List[int]):
    # One shape for every call (6 entries, 64 tokens): one compile of each jitted piece.
    nonlocal state, table, kv_pages, k_pages, v_pages
    total = int(sum(n))
    pad = lambda a: np.int32(list(a) + [0] * (6 - len(a)))
    state, table, slots, ok = _extend(config, state, table, pad(rows), pad(n),
                                      max_tokens=64, num_rows=np.int32(len(rows)))
    assert bool(ok), (rows, n)
    k = bf16_exact(rng.normal(size=(64, HKV, DIM)))
    v = bf16_exact(rng.normal(size=k.shape))
    kv_pages = _write_combined(kv_pages, slots, k, v, num_tokens=np.int32(total))
    k_pages, v_pages = _write_split(k_pages, v_pages, slots, k, v,
                                    num_tokens=np.int32(total))
    at = 0
    for r, c in zip(rows, n):
      keys[r] = np.concatenate([keys[r], k[at:at + c]])
      values[r] = np.concatenate([values[r], v[at:at + c]])
      at += c

  # History: row 1 is a prefix source, row 3 a running request (filled in chunks).
  src_len = ps * int(rng.integers(1, 3)) + int(rng.integers(0, ps))
  for chunk in np.array_split(np.arange(src_len), 4):            # <= 48 tokens each
    extend([1, 3], [len(chunk), int(rng.integers(1, 8))])
  # Row 2 borrows row 1's whole pages.
  w = src_len // ps
  table, ok = _borrow(config, state, table, np.int32([2]),
                      np.asarray(table.pages[1:2, :w]), np.int32([w]))
  assert bool(ok)
  keys[2], values[2] = keys[1][:w * ps].copy(), values[1][:w * ps].copy()
  extend([6], [int(rng.integers(1, 12))])      # row 6: real, but idle this step

  # The step: prefill from scratch (5), decode (3), empty (4), borrowed prefix + chunk
  # (2), decode of the prefix source (1), idle (6); one padding entry.
  entries = [(5, int(rng.integers(2, 24))), (3, 1), (4, 0), (2, int(rng.integers(1, 17))),
             (1, 1), (6, 0)]
  order = rng.permutation(len(entries))
  entries = [entries[i] for i in order]
  rows = [r for r, _ in entries]
  q_lens = [n for _, n in entries]
  extend(rows, q_lens)
  max_tokens = 64
  q = np.zeros((max_tokens, HKV * GROUP, DIM), np.float32)
  q[:] = bf16_exact(rng.uniform(-POISON, POISON, q.shape))   # padding queries: garbage
  total = sum(q_lens)
  q[:total] = bf16_exact(rng.normal(size=(total, HKV * GROUP, DIM))) * 0.125
  return Case(config=config, table=table, rows=np.int32(rows + [0]),
              q_lens=np.int32(q_lens + [0]), num_rows=len(rows), max_tokens=max_tokens,
              q=q, kv_pages=kv_pages, k_pages=k_pages, v_pages=v_pages, keys=keys,
              values=values)


def reference(case: Case) -> np.ndarray:
  """Causal attention of each packed query token over its row's contiguous cache:
  f32[max_tokens, Hq, DIM], zeros past the real tokens."""
  out = np.zeros_like(case.q)
  at = 0
  for r, n in zip(case.rows[:case.num_rows], case.q_lens[:case.num_rows]):
    k, v = case.keys[int(r)], case.values[int(r)]
    kv_len = k.shape[0]
    for i in range(int(n)):
      pos = kv_len - n + i
      qt = case.q[at + i].reshape(HKV, GROUP, DIM).astype(np.float64)
      s = np.einsum("hgd,khd->hgk", qt, k[:pos + 1].astype(np.float64))
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[at + i] = np.einsum("hgk,khd->hgd", p, v[:pos + 1]).reshape(-1, DIM)
    at += int(n)
  return out


def last_tokens(case: Case):
  """(entry index, packed index of its last query token) of entries with q_len >= 1:
  what a decode kernel's one query per row computes."""
  cu = np.concatenate([[0], np.cumsum(case.q_lens)])
  return [(b, int(cu[b + 1]) - 1) for b in range(case.num_rows) if case.q_lens[b] >= 1]
