"""The paged `free`'s Triton kernels (pallas_kernels.triton_free), on CPU: in Pallas'
interpreter, bit for bit against freeing's sort (freeing.PAGED_FREE: states, need_sort on
and off, every kind of slot, the room cut, vmapped pools); `free` picks them only where
it should; and they lower for an abstract H200 (jax.export), alone and inside the jitted
`free`. On a GPU (marker gpu) the compiled kernels against the sort.

Small blocks (monkeypatched) make many programs over small pools, so the cross-block
ranks and the last partial block are exercised cheaply.
Interpret mode fills unwritten outputs with INT32_MIN, and the rings the kernel writes
into are random pages and -7 poison, so a missing or stray store shows.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig
import lowering_check
from pallas_kernels import triton_free
from test_free_methods import _slot_inputs, _taken_state
from gpu import needs_gpu

I32_MIN, I32_MAX = -2**31, 2**31 - 1
TRITON = "__gpu$xla.gpu.triton"
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)


SMALL, DEFAULT = (16, 8), (triton_free.SLOT_BLOCK, triton_free.PAGE_BLOCK)


@pytest.fixture
def blocks(request, monkeypatch):
  """(slot block, page block) of the kernels for this test: the test's `blocks`
  parameter (indirect), small blocks by default."""
  sb, pb = getattr(request, "param", SMALL)
  monkeypatch.setattr(triton_free, "SLOT_BLOCK", sb)
  monkeypatch.setattr(triton_free, "PAGE_BLOCK", pb)
  return sb, pb


def _both_blocks(cases, default_too):
  """Every case with small blocks, and `default_too` of them with the default ones."""
  out = [pytest.param(*c, SMALL, id="-".join(map(str, c)) + "-small") for c in cases]
  return out + [pytest.param(*c, DEFAULT, id="-".join(map(str, c)) + "-default")
                for c in default_too]


def _slot_vectors(rng, n: int, ps: int, m: int):
  """Slot vectors of length m: every slot kind `free` sees."""
  slot = lambda pages: pages * ps + rng.integers(0, ps, pages.shape)
  yield slot(rng.integers(-2, n + 3, m))                       # page 0, past the pool
  yield slot(rng.integers(1, min(n, 3) + 1, m))                # repeats of a few pages
  yield np.zeros(m)                                            # all padding
  yield rng.choice([I32_MIN, -1, -ps - 5, 0, (n + 1) * ps, I32_MAX], m)  # nothing valid
  yield slot(np.resize(rng.permutation(n) + 1, m))             # the whole pool if m >= n
  yield np.where(rng.random(m) < 0.5, slot(rng.integers(1, n + 1, m)),
                 rng.choice([I32_MIN, I32_MAX, 0, -7], m))


# (num_pages, M, page size): M = 1, tiny pools, pools not a multiple of the page block
# (8 small, 4096 default: n + 1 pages incl. page 0 over 1-3 blocks), M > num_pages.
CASES = [(1, 1, 1), (5, 1, 16), (7, 3, 64), (23, 40, 1), (24, 64, 16), (40, 300, 1),
         (90, 256, 16), (4095, 5000, 1), (4096, 700, 64)]


@pytest.mark.parametrize("n,m,ps,blocks",
                         _both_blocks(CASES, [(7, 3, 64), (4095, 5000, 1), (4096, 700, 64)]),
                         indirect=["blocks"])
def test_every_slot_kind_equals_the_sort(n, m, ps, blocks):
  # A pool with every page held (room for all), freed from every kind of slot vector.
  cfg = AllocatorConfig(size=n * ps, page_size=ps, debug=False)
  rng = np.random.default_rng([n, m, ps, blocks[1]])
  state = _taken_state(cfg, rng, n)
  for k, slots in enumerate(_slot_vectors(rng, n, ps, m)):
    free_index = jnp.asarray(np.asarray(slots, np.int64).astype(np.int32))
    s = _poisoned(state, rng)
    got = _free_fn(cfg, "triton_interpret", blocks)(s, free_index)
    want = _free_fn(cfg, "sort")(s, free_index)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(k))


@functools.lru_cache(maxsize=None)
def _free_fn(cfg: AllocatorConfig, method: str, blocks=None):
  """The jitted free; `blocks` keys the cache (a trace keeps the block sizes it saw)."""
  del blocks
  return jax.jit(functools.partial(freeing.PAGED_FREE[method], cfg))


def _poisoned(state, rng):
  """The state with the ring entries outside both lists set to -7 or random pages (the
  kernel must write exactly where ring_push_front does)."""
  n = state.free_ring.shape[0]
  def junk(ring, head, length):
    i = np.arange(n)
    live = ((i - int(head)) % n) < int(length)
    noise = np.where(rng.random(n) < 0.5, -7, rng.integers(1, n + 1, n))
    return jnp.asarray(np.where(live, np.asarray(ring), noise), jnp.int32)
  return state._replace(
      free_ring=junk(state.free_ring, state.free_head, state.free_len),
      release_ring=junk(state.release_ring, state.release_head, state.release_len))


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("ps,n,m,blocks", _both_blocks(
    [(1, 40, 1), (1, 300, 500), (16, 24, 64), (64, 20, 1280), (16, 4100, 96)],
    [(16, 4100, 96)]), indirect=["blocks"])
def test_free_states_equal_the_sort(ps, n, m, need_sort, blocks):
  cfg = AllocatorConfig(size=n * ps, page_size=ps, need_sort=need_sort, debug=False)
  rng = np.random.default_rng([ps, n, m, need_sort, blocks[1]])
  for taken in (n, n // 2, 0):  # full pool held, half, none
    state = _taken_state(cfg, rng, taken)
    held = st.live_free_pages(state._replace(free_head=jnp.int32(0),
                                             free_len=jnp.int32(taken)))
    inputs = list(_slot_inputs(rng, cfg, held, m))
    for k, slots in enumerate(inputs):
      state = _poisoned(state, rng)
      free_index = jnp.asarray(np.asarray(slots, np.int64).astype(np.int32))
      got = _free_fn(cfg, "triton_interpret", blocks)(state, free_index)
      want = _free_fn(cfg, "sort")(state, free_index)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=f"taken={taken} input {k}")
      state = want  # the next call starts from a nonempty release list (need_sort)


def test_room_cut_and_wrapping_head():
  """Double frees past the room left are cut as _give_back cuts them; the block wraps
  round the ring's end (head 3: the block's first pages go to the ring's last entries),
  or ends exactly at it (head 0)."""
  ps, n = 4, 50
  cfg = AllocatorConfig(size=n * ps, page_size=ps, debug=False)
  rng = np.random.default_rng(5)
  state = _taken_state(cfg, rng, 10)
  for head, length in [(3, 10), (3, 40), (0, 47), (3, 50), (0, 20)]:
    s = _poisoned(state._replace(free_head=jnp.int32(head), free_len=jnp.int32(length)),
                  rng)
    free_index = jnp.asarray(rng.integers(0, (n + 1) * ps, 400), jnp.int32)
    got = _free_fn(cfg, "triton_interpret")(s, free_index)
    want = _free_fn(cfg, "sort")(s, free_index)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert int(got.free_len) == n  # ~all 50 pages freed: always cut


def test_vmapped_pools():
  """Stacked pools (ranks.free vmaps `free`): each rank equals its own call."""
  ps, n, m = 16, 64, 40
  cfg = AllocatorConfig(size=n * ps, page_size=ps, debug=False)
  rng = np.random.default_rng(3)
  states = [_taken_state(cfg, rng, t) for t in (30, 64, 5)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *states)
  free_index = jnp.asarray(rng.integers(-5, (n + 6) * ps, (3, m)), jnp.int32)
  got = jax.jit(jax.vmap(functools.partial(freeing.PAGED_FREE["triton_interpret"], cfg)))(
      stacked, free_index)
  for r in range(3):
    one = _free_fn(cfg, "sort")(states[r], free_index[r])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[r], b), got, one)


def _jaxpr_has_pallas(fn, *args) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_auto_picks_the_kernels_only_on_the_triton_path():
  ps, n, m = 16, 64, 32
  state_of = lambda cfg: _taken_state(cfg, np.random.default_rng(0), 20)
  x = jnp.arange(m, dtype=jnp.int32) * 7
  for kernel, debug, want in [("triton_interpret", False, True), ("jnp", False, False),
                              ("triton_interpret", True, False),
                              ("mosaic_interpret", False, False),
                              ("pallas_interpret", False, True)]:
    cfg = AllocatorConfig(size=n * ps, page_size=ps, kernel=kernel, debug=debug)
    s = state_of(cfg)
    assert _jaxpr_has_pallas(functools.partial(freeing.free, cfg), s, x) == want, kernel
    got = jax.jit(functools.partial(freeing.free, cfg))(s, x)
    jax.tree.map(np.testing.assert_array_equal, got, _free_fn(cfg, "sort")(s, x))
  # "auto" on a CPU pool: a concrete state runs the XLA rule; under jit in a CPU-only
  # process the Triton branch is not even traced.
  cfg = AllocatorConfig(size=n * ps, page_size=ps, kernel="auto", debug=False)
  s = state_of(cfg)
  assert not _jaxpr_has_pallas(lambda x: freeing.free(cfg, s, x), x)
  if jax.default_backend() == "cpu":
    assert not _jaxpr_has_pallas(functools.partial(freeing.free, cfg), s, x)
  text = jax.jit(functools.partial(freeing.free, cfg)).lower(s, x).compile().as_text()
  assert TRITON not in text
  got = jax.jit(functools.partial(freeing.free, cfg))(s, x)
  jax.tree.map(np.testing.assert_array_equal, got, _free_fn(cfg, "sort")(s, x))


def test_auto_leaves_huge_pools_with_few_slots_to_xla():
  """Past 2**20 pages the kernels' O(num_pages) passes are taken only for M >= n / 128."""
  assert triton_free.preferred(2**20, 1) and not triton_free.preferred(2**20 + 1, 8192)
  assert triton_free.preferred(2**21, 2**14) and not triton_free.preferred(2**26, 2**20)
  cfg = AllocatorConfig(size=2**21, page_size=1, kernel="triton_interpret", debug=False)
  state = jax.eval_shape(functools.partial(st.init, cfg))
  for m, want in [(64, False), (2**14, True)]:
    x = jax.ShapeDtypeStruct((m,), jnp.int32)
    assert _jaxpr_has_pallas(functools.partial(freeing.free, cfg), state, x) == want, m


def test_bad_inputs():
  z = jnp.zeros((), jnp.int32)
  push = functools.partial(triton_free.free_push_front_triton, page_size=1, interpret=True)
  with pytest.raises(TypeError, match="slots"):
    push(jnp.zeros((4,), jnp.float32), jnp.zeros((8,), jnp.int32), z, z, z)
  with pytest.raises(TypeError, match="ring"):
    push(jnp.zeros((4,), jnp.int32), jnp.zeros((8,), jnp.float32), z, z, z)
  with pytest.raises(ValueError, match="num_pages"):
    jax.eval_shape(push, i32(4), i32(2**25), i32(), i32(), i32())
  limit = triton_free.MAX_BLOCKS * triton_free.PAGE_BLOCK  # 2**25
  assert not triton_free.supported(limit, 4) and triton_free.supported(limit - 1, 4)
  # An empty free_index: no kernel, the same state.
  cfg = AllocatorConfig(size=64, page_size=4, debug=False)
  s = st.init(cfg)
  out = freeing.PAGED_FREE["triton_interpret"](cfg, s, jnp.zeros((0,), jnp.int32))
  jax.tree.map(np.testing.assert_array_equal, out, s)


# ---------------------------------------------------------------------------------------
# Lowering for an abstract H200 (what the real Triton lowering rejects fails here).
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,m,ps", [(262144, 262144 * 64, 64), (262144, 8192, 64),
                                    (2**20, 8192, 1), (5, 1, 1), (300, 70000, 3)])
def test_kernels_lower_for_h200(n, m, ps):
  push = functools.partial(triton_free.free_push_front_triton, page_size=ps)
  e = lowering_check.export_for("h200", push, i32(m), i32(n), i32(), i32(), i32())
  assert lowering_check.custom_call_targets(e).count(TRITON) == 3


@pytest.mark.parametrize("need_sort", [False, True])
def test_free_auto_lowers_for_h200(need_sort):
  """The jitted `free` with kernel "auto", as compiled for a GPU pool: the three kernels,
  and no sort; also vmapped over stacked pools."""
  cfg = AllocatorConfig(size=2**16 * 64, page_size=64, need_sort=need_sort, debug=False,
                        kernel="auto")
  state = jax.eval_shape(functools.partial(st.init, cfg))
  fn = functools.partial(freeing.free, cfg)
  e = lowering_check.export_for("h200", fn, state, i32(32768))
  assert lowering_check.custom_call_targets(e).count(TRITON) == 3
  assert "stablehlo.sort" not in e.mlir_module()
  pools = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2,) + x.shape, x.dtype), state)
  e = lowering_check.export_for("h200", jax.vmap(fn), pools, i32(2, 4096))
  assert lowering_check.custom_call_targets(e).count(TRITON) == 3


# ---------------------------------------------------------------------------------------
# On a GPU: the compiled kernels against the sort.
# ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ps,slots,m", [(64, 2**24, 8192), (64, 2**24, 262144),
                                        (1, 2**20, 8192), (16, 4100 * 16, 70000),
                                        (3, 3000, 1)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_gpu_kernels_equal_the_sort(ps, slots, m, need_sort):
  cfg = AllocatorConfig(size=slots, page_size=ps, need_sort=need_sort, debug=False,
                        kernel="triton")
  n = cfg.num_pages
  rng = np.random.default_rng([ps, m, need_sort])
  state = _taken_state(cfg, rng, min(n, m // ps + 7))
  held = st.live_free_pages(state._replace(free_head=jnp.int32(0),
                                           free_len=jnp.int32(min(n, m // ps + 7))))
  for k, x in enumerate(_slot_inputs(rng, cfg, held, m)):
    x = jnp.asarray(np.asarray(x, np.int64).astype(np.int32))
    got = _free_fn(cfg, "triton")(state, x)
    want = _free_fn(cfg, "sort")(state, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(k))
    auto = jax.jit(functools.partial(freeing.free, cfg))(state, x)  # free: the kernels
    jax.tree.map(np.testing.assert_array_equal, auto, want)
    state = want
