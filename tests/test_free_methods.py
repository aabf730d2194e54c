"""`free`'s sorted unique pages two ways (freeing.free_pages_sorted_unique): the sort and
the bitmap give the same bits as each other and as numpy's unique, on the page ids alone
and through the paged free's implementations (freeing.PAGED_FREE; need_sort on and off,
debug on and off); `free` follows free_method's rule."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig

METHODS = ("sort", "bitmap")
I32_MIN, I32_MAX = -2**31, 2**31 - 1


def _unique_model(pages: np.ndarray, n: int, m: int):
  """numpy: the valid pages, unique and ascending, padded with 0 to m; and their count."""
  pages = np.asarray(pages, np.int64)
  want = np.unique(pages[(pages >= 1) & (pages <= n)])
  out = np.zeros(m, np.int32)
  out[:want.size] = want
  return out, want.size


@functools.lru_cache(maxsize=None)
def _unique_fn(n: int, method: str):
  return jax.jit(functools.partial(freeing.free_pages_sorted_unique, num_pages=n,
                                   method=method))


def _page_inputs(rng: np.random.Generator, n: int, m: int):
  """Page-id vectors of length m: uniform with out-of-range on both sides, many repeats,
  all padding, all invalid, the whole pool, int32 extremes."""
  yield rng.integers(-3, n + 4, m)
  yield rng.integers(1, min(n, 3) + 1, m)                  # repeats of a few pages
  yield np.zeros(m)                                         # all padding
  yield rng.choice([I32_MIN, -1, 0, n + 1, I32_MAX], m)     # nothing valid
  yield np.resize(rng.permutation(n) + 1, m)                # the whole pool (if m >= n)
  yield np.where(rng.random(m) < 0.5, rng.integers(1, n + 1, m),
                 rng.choice([I32_MIN, I32_MAX, 0, -7], m))


# (num_pages, M): tiny, word edges (31/32/33 pages), M > num_pages, a big M, a pool much
# larger than M (auto picks the sort there).
SIZES = [(1, 1), (5, 1), (7, 3), (31, 40), (32, 64), (33, 100), (200, 16), (1000, 2000),
         (4096, 64), (50000, 64), (5000, 20000)]


@pytest.mark.parametrize("n,m", SIZES)
def test_methods_match_numpy_unique(n, m):
  rng = np.random.default_rng([n, m])
  for k, pages in enumerate(_page_inputs(rng, n, m)):
    pages = np.asarray(pages, np.int64).astype(np.int32)
    want, count = _unique_model(pages, n, m)
    for method in METHODS:
      values, got = _unique_fn(n, method)(jnp.asarray(pages))
      assert values.dtype == jnp.int32 and values.shape == (m,), (method, values.dtype)
      np.testing.assert_array_equal(np.asarray(values), want, err_msg=f"{method} input {k}")
      assert int(got) == count, (method, k)


def test_empty_input():
  for method in METHODS:
    values, count = freeing.free_pages_sorted_unique(jnp.zeros((0,), jnp.int32), 10,
                                                     method)
    assert values.shape == (0,) and int(count) == 0


def test_auto_rule():
  r = freeing.BITMAP_RATIO
  assert freeing.free_method(262144, 8192) == "bitmap"       # the H200 free cases
  assert freeing.free_method(262144, 262144) == "bitmap"
  assert freeing.free_method(2**20, 8192) == "sort"           # ratio 128: the CPU's sort wins
  assert freeing.free_method(2**24, 64) == "sort"             # a big pool freed a little
  assert freeing.free_method(r * 100, 100) == "bitmap"
  assert freeing.free_method(r * 100 + 1, 100) == "sort"
  assert freeing.free_method(10, 0) == "sort"
  assert freeing.free_method(2**30 + 1, 2**30) == "sort"     # the map's size cap
  with pytest.raises(ValueError, match="method"):
    freeing.free_pages_sorted_unique(jnp.zeros((4,), jnp.int32), 10, "radix")


def test_auto_runs_the_method_its_rule_names():
  """The compiled auto call has a sort exactly when the rule says sort."""
  for n, m in [(4096, 64), (50000, 64)]:
    text = jax.jit(functools.partial(freeing.free_pages_sorted_unique, num_pages=n)).lower(
        jnp.zeros((m,), jnp.int32)).as_text()
    assert ("stablehlo.sort" in text) == (freeing.free_method(n, m) == "sort"), (n, m)


# ---------------------------------------------------------------------------------------
# Through `free`: bit-identical states, and the prepend SPEC 4.4 describes.
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _free_fn(cfg: AllocatorConfig, method: str):
  return jax.jit(functools.partial(freeing.PAGED_FREE[method], cfg))


def _taken_state(cfg: AllocatorConfig, rng: np.random.Generator, taken: int):
  """The pool with its free list shuffled and `taken` pages handed out from the front."""
  n = cfg.num_pages
  s = st.init(cfg)
  ring = rng.permutation(n) + 1
  if s.debug is not None:  # debug mode's map agrees: the taken pages are not free
    is_free = np.ones(n + 1, bool)
    is_free[0] = False
    is_free[ring[:taken]] = False
    s = s._replace(debug=s.debug._replace(is_free=jnp.asarray(is_free)))
  s = s._replace(free_ring=jnp.asarray(ring, jnp.int32),
                 free_head=jnp.asarray(taken % n, jnp.int32),
                 free_len=jnp.asarray(n - taken, jnp.int32))
  return st.with_record(cfg, s)  # the ownership record agrees: the taken pages are held


def _slot_inputs(rng: np.random.Generator, cfg: AllocatorConfig, held: np.ndarray, m: int):
  """Slot vectors: slots of held pages (shuffled, repeats), with page 0, negatives and
  slots past the pool mixed in; all padding; every slot of every held page."""
  ps, n = cfg.page_size, cfg.num_pages
  slots = lambda pages: pages * ps + rng.integers(0, ps, pages.shape)
  yield slots(rng.choice(held, m)) if held.size else np.zeros(m)
  junk = rng.choice([-1, -ps - 5, I32_MIN, 0, 3 % ps, (n + 1) * ps, I32_MAX], m)
  yield np.where(rng.random(m) < 0.6, slots(rng.choice(held, m)), junk) if held.size \
      else junk
  yield np.zeros(m)
  every = (held[:, None] * ps + np.arange(ps)).reshape(-1)
  yield rng.permutation(np.resize(every, m)) if every.size else np.zeros(m)
  yield slots(rng.integers(1, n + 1, m))  # double frees too: the room clamp cuts them


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("ps,n,m", [(1, 40, 1), (1, 300, 500), (16, 24, 64), (16, 90, 256),
                                    (64, 20, 1280), (64, 8, 3)])
def test_free_states_are_identical_and_match_the_model(ps, n, m, need_sort):
  # guard=False: the model ignores junk and cuts double frees to the room left, the
  # unguarded contract (tests/test_guard.py: the same inputs with the ownership record).
  cfg = AllocatorConfig(size=n * ps, page_size=ps, need_sort=need_sort, debug=False,
                        guard=False)
  rng = np.random.default_rng([ps, n, m, need_sort])
  for taken in (n, n // 2, 0):  # full pool held, half, none
    state = _taken_state(cfg, rng, taken)
    held = st.live_free_pages(state._replace(free_head=jnp.int32(0),
                                             free_len=jnp.int32(taken)))
    for k, slots in enumerate(_slot_inputs(rng, cfg, held, m)):
      free_index = jnp.asarray(np.asarray(slots, np.int64).astype(np.int32))
      outs = [_free_fn(cfg, method)(state, free_index) for method in METHODS]
      for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=f"taken={taken} input {k}")
      # The model: the valid pages, unique and ascending, cut to the room left (only
      # double frees can overflow), prepended as one block.
      f = np.asarray(free_index, np.int64)
      pages = np.where(f >= 0, f // ps, 0)
      want, count = _unique_model(pages, n, m)
      room = n - int(state.free_len) - int(state.release_len)
      block = list(want[:min(count, room)])
      new = outs[0]
      if need_sort:
        assert list(st.live_release_pages(new)) == block + list(
            st.live_release_pages(state)), (taken, k)
        assert list(st.live_free_pages(new)) == list(st.live_free_pages(state))
      else:
        assert list(st.live_free_pages(new)) == block + list(st.live_free_pages(state)), \
            (taken, k)
        assert int(new.release_len) == 0


@pytest.mark.parametrize("need_sort", [False, True])
def test_debug_mode_states_are_identical(need_sort):
  """Debug mode sees the same (values, count): the same states and error records, for
  valid frees, double frees and reserved or out-of-range entries."""
  ps, n, m = 4, 30, 48
  cfg = AllocatorConfig(size=n * ps, page_size=ps, need_sort=need_sort, debug=True)
  rng = np.random.default_rng([7, need_sort])
  state = _taken_state(cfg, rng, 20)
  held = st.live_free_pages(state._replace(free_head=jnp.int32(0), free_len=jnp.int32(20)))
  errors = []
  for k, slots in enumerate(_slot_inputs(rng, cfg, held, m)):
    free_index = jnp.asarray(np.asarray(slots, np.int64).astype(np.int32))
    outs = [_free_fn(cfg, method)(state, free_index) for method in METHODS]
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"input {k}")
    errors.append(int(outs[0].debug.code))
  # Held pages only (repeats are one free): no error; junk and double frees: an error.
  assert errors[0] == 0 and errors[1] != 0 and errors[4] != 0, errors


def test_default_free_takes_auto():
  """`free` equals the implementation free_method names, for both outcomes, also in
  debug mode."""
  for ps, n, m, dbg in [(16, 64, 64, False), (1, 50000, 64, False), (4, 64, 64, True)]:
    cfg = AllocatorConfig(size=n * ps, page_size=ps, debug=dbg, guard=False)
    rng = np.random.default_rng([ps, n, m])
    state = _taken_state(cfg, rng, n // 2)
    free_index = jnp.asarray(rng.integers(-2, (n + 2) * ps, m), jnp.int32)
    auto = jax.jit(functools.partial(freeing.free, cfg))(state, free_index)
    named = _free_fn(cfg, freeing.free_method(n, m))(state, free_index)
    jax.tree.map(np.testing.assert_array_equal, auto, named)


def test_methods_agree_under_vmap():
  """Stacked pools (jax_kvalloc.ranks vmaps `free`): the bitmap's scatters batch too."""
  ps, n, m = 16, 64, 40
  cfg = AllocatorConfig(size=n * ps, page_size=ps, debug=False, guard=False)
  rng = np.random.default_rng(3)
  states = [_taken_state(cfg, rng, t) for t in (30, 64)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *states)
  free_index = jnp.asarray(rng.integers(-5, (n + 6) * ps, (2, m)), jnp.int32)
  outs = [jax.vmap(functools.partial(freeing.PAGED_FREE[method], cfg))(stacked, free_index)
          for method in METHODS]
  jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])
  for r in range(2):  # and each rank equals its own unbatched call
    one = _free_fn(cfg, "bitmap")(states[r], free_index[r])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[r], b), outs[1], one)
