"""Stress: thousands of fill/drain cycles at exact capacity without a leak, the largest
pools the API allows, requests far longer than a page, and bursts where every request
finishes in the same step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import debug
from model import ModelAllocator

CYCLES = 3000


def _partition(key, total, parts):
  """i32[parts] >= 0 summing to `total`: gaps between sorted random cut points."""
  cuts = jnp.sort(jax.random.randint(key, (parts - 1,), 0, total + 1))
  return jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts.astype(jnp.int32),
                                   jnp.full(1, total, jnp.int32)]))


@pytest.mark.parametrize("kind,ps,n,need_sort,dbg", [
    ("paged", 4, 64, False, False),
    ("paged", 4, 64, True, True),
    ("paged", 16, 32, True, False),
    ("token", 1, 128, True, True),
])
def test_fill_and_drain_to_exact_capacity_thousands_of_times(kind, ps, n, need_sort, dbg):
  """Each cycle: a prefill batch (8 requests, random lengths, partial last pages) takes
  exactly every page; one more page must fail; the requests are freed in two calls (the
  first four, then the rest: a page's slots in two frees would be a double free). After
  CYCLES cycles in one jitted scan, every page is back exactly once."""
  cfg = kv.AllocatorConfig(n * ps, ps, need_sort=need_sort, kind=kind, debug=dbg)
  rows = 8

  def cycle(state, key):
    k1, k2 = jax.random.split(key)
    pages = _partition(k1, n, rows)
    trim = jax.random.randint(k2, (rows,), 0, ps)  # leave part of the last page empty
    seq = jnp.where(pages > 0, pages * ps - trim, 0)
    zeros = jnp.zeros(rows, jnp.int32)
    state, out, filled = kv.alloc_extend(cfg, state, zeros, seq, zeros - 1,
                                         max_tokens=n * ps)
    state, _, overfilled = kv.alloc(cfg, state, jnp.int32(ps), max_size=ps)
    held = kv.available_size(cfg, state)
    first = jnp.arange(n * ps) < jnp.sum(seq[:rows // 2])
    state = kv.free(cfg, state, jnp.where(first, out, 0))
    state = kv.free(cfg, state, jnp.where(first, 0, out))
    return state, (filled, overfilled, held, state.free_len + state.release_len)

  run = jax.jit(lambda s, keys: jax.lax.scan(cycle, s, keys))
  state, (filled, overfilled, held, back) = run(
      kv.init(cfg), jax.random.split(jax.random.PRNGKey(0), CYCLES))
  assert bool(filled.all()) and not bool(overfilled.any())
  assert not np.asarray(held).any()          # exactly full after each fill
  assert (np.asarray(back) == n).all()       # every page back after each drain
  pages = np.concatenate([kv.live_free_pages(state), kv.live_release_pages(state)])
  assert sorted(pages.tolist()) == list(range(1, n + 1))
  assert debug.audit(cfg, state) == [] and debug.get_error(state) is None


@pytest.mark.parametrize("need_sort", [False, True])
def test_class_fill_and_drain_matches_the_model(need_sort):
  """The same through the SGLang-compatible class, against the model, 300 cycles of
  exact-capacity allocs (paged) with frees in varying order."""
  a = kvs.PagedTokenToKVPoolAllocator(32 * 4, 4, need_sort=need_sort)
  m = ModelAllocator(32 * 4, 4, need_sort)
  rng = np.random.default_rng(0)
  for _ in range(300):
    chunks = np.diff(np.concatenate([[0], np.sort(rng.integers(0, 33, 3)), [32]])) * 4
    held = []
    for c in chunks:
      got, want = a.alloc(int(c)), m.alloc(int(c))
      assert np.asarray(got).tolist() == want
      held.append(want)
    assert a.alloc(4) is None and m.alloc(4) is None and a.available_size() == 0
    for i in rng.permutation(len(held)):
      a.free(np.array(held[i], np.int64)), m.free(held[i])
    assert a.free_pages.tolist() == m.free_pages
    assert a.release_pages.tolist() == m.release_pages and a.available_size() == 128


def test_largest_paged_pool_reaches_slot_2_31_minus_1():
  """2047 pages of 2**20 slots: slot indices up to 2**31 - 1, the most int32 holds. The
  top page is put at the front of the free list (a state any free order can produce)."""
  ps, n = 2**20, 2047
  cfg = kv.AllocatorConfig(n * ps, ps, debug=True)
  state = kv.init(cfg)
  state = state._replace(free_ring=jnp.roll(state.free_ring, 1))  # [2047, 1, 2, ...]
  extend = jax.jit(kv.alloc_extend, static_argnames=("config", "max_tokens"))
  one = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
  state, out, ok = extend(cfg, state, one(0), one(ps - 1), one(-1), max_tokens=ps)
  assert bool(ok)
  out = np.asarray(out, np.int64)
  np.testing.assert_array_equal(out[:ps - 1], n * ps + np.arange(ps - 1))
  # Decode the last slot of the pool: last_loc = 2**31 - 2, new slot 2**31 - 1.
  state, dec, ok = jax.jit(kv.alloc_decode, static_argnames=("config",))(
      cfg, state, one(ps), one(2**31 - 2))
  assert bool(ok) and int(dec[0]) == 2**31 - 1 and debug.get_error(state) is None
  # Free it (any slot frees the page), get the same page back (LIFO), and catch a
  # double free of it at the top of the range.
  free = jax.jit(kv.free, static_argnames=("config",))
  state = free(cfg, state, one(2**31 - 1))
  assert kv.live_free_pages(state)[0] == n and debug.get_error(state) is None
  state = free(cfg, state, one(2**31 - 1))
  assert debug.get_error(state).value == 2**31 - 1
  state = debug.clear_error(state)
  state, out, ok = jax.jit(kv.alloc, static_argnames=("config", "max_size"))(
      cfg, state, jnp.int32(ps), max_size=ps)
  assert bool(ok) and int(out[-1]) == 2**31 - 1 and int(out.min()) == n * ps


def test_large_token_pool_fill_drain_and_merge():
  """A 2**22-slot token pool with need_sort: fill it, free everything (released), then a
  shortfall merges 4M entries back into sorted order."""
  size = 2**22
  a = kvs.TokenToKVPoolAllocator(size, need_sort=True)
  out = a.alloc(size)
  np.testing.assert_array_equal(np.asarray(out[:3]), [1, 2, 3])
  assert int(out[-1]) == size and a.alloc(1) is None
  a.free(np.asarray(out)[::-1])
  assert a.release_pages.shape == (size,) and a.free_pages.shape == (0,)
  got = np.asarray(a.alloc(2))
  np.testing.assert_array_equal(got, [1, 2])  # merged and sorted on the shortfall
  assert a.available_size() == size - 2 and a.free_pages[-1] == size


@pytest.mark.parametrize("ps", [16, 128])
def test_requests_far_longer_than_a_page(ps):
  """Prefixes ending mid-page extended by ~50-100 pages, then decoded across page ends,
  against the model."""
  n = 400
  a = kvs.PagedTokenToKVPoolAllocator(n * ps, ps)
  m = ModelAllocator(n * ps, ps)
  pre = [5, 0, ps + 3]
  first = [m.alloc_extend([0], [p], [-1]) if p else [] for p in pre]
  for p in pre:
    if p:
      a.alloc_extend([0], None, [p], None, [-1], p)
  last = [f[-1] if f else -1 for f in first]
  seq = [pre[0] + 100 * ps + 7, 60 * ps, pre[2] + 50 * ps - 1]
  want = m.alloc_extend(pre, seq, last)
  got = a.alloc_extend(pre, None, seq, None, last, sum(seq) - sum(pre))
  np.testing.assert_array_equal(np.asarray(got), want)
  assert len(set(want)) == len(want) and min(want) >= ps
  # Decode each long request past a page end (ps + 1 steps).
  tails = [want[sum(s - p for s, p in zip(seq[:i], pre[:i])) + seq[i] - pre[i] - 1]
           for i in range(3)]
  for _ in range(ps + 1):
    seq = [s + 1 for s in seq]
    want = m.alloc_decode(seq, tails)
    got = a.alloc_decode(np.array(seq), None, np.array(tails))
    np.testing.assert_array_equal(np.asarray(got), want)
    tails = list(want)
  assert a.free_pages.tolist() == m.free_pages


@pytest.mark.parametrize("need_sort", [False, True])
def test_burst_where_every_request_finishes_in_the_same_step(need_sort):
  """256 requests prefill and decode together, then all finish in one free group: one
  free call of every slot; the pool is whole again and in the model's order."""
  ps, n, bs = 4, 1024, 256
  a = kvs.PagedTokenToKVPoolAllocator(n * ps, ps, need_sort=need_sort)
  m = ModelAllocator(n * ps, ps, need_sort)
  rng = np.random.default_rng(1)
  seq = rng.integers(1, 3 * ps + 2, bs).tolist()
  want = m.alloc_extend([0] * bs, seq, [-1] * bs)
  got = a.alloc_extend(np.zeros(bs, np.int64), None, seq, None, np.full(bs, -1), sum(seq))
  np.testing.assert_array_equal(np.asarray(got), want)
  reqs, at = [], 0
  for s in seq:
    reqs.append(list(want[at:at + s]))
    at += s
  for _ in range(3):  # three decode steps of the whole batch
    lens = [len(r) + 1 for r in reqs]
    last = [r[-1] for r in reqs]
    want = m.alloc_decode(lens, last)
    np.testing.assert_array_equal(np.asarray(a.alloc_decode(lens, None, last)), want)
    for r, s in zip(reqs, want):
      r.append(s)
  a.free_group_begin(), m.free_group_begin()
  for r in rng.permutation(bs):
    a.free(np.array(reqs[r], np.int64)), m.free(reqs[r])
  a.free_group_end(), m.free_group_end()
  assert a.available_size() == n * ps
  assert a.free_pages.tolist() == m.free_pages
  assert a.release_pages.tolist() == m.release_pages


def test_token_burst_of_single_slot_requests():
  """512 one-slot requests on a token pool finish in one group (FIFO order kept)."""
  a = kvs.TokenToKVPoolAllocator(512, debug=True)
  m = ModelAllocator(512, 1)
  slots = [int(a.alloc(1)[0]) for _ in range(512)]
  assert slots == [m.alloc(1)[0] for _ in range(512)] and a.alloc(1) is None
  order = np.random.default_rng(2).permutation(512)
  a.free_group_begin(), m.free_group_begin()
  for i in order:
    a.free([slots[i]]), m.free([slots[i]])
  a.free_group_end(), m.free_group_end()
  assert a.free_pages.tolist() == m.free_pages == [slots[i] for i in order]
