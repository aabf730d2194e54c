"""The allocator with the Pallas kernels in place, on CPU (interpret mode).

On the Triton backend alloc_extend/alloc_decode run as one fused kernel launch
(jax_kvalloc.kernels); these tests check that the whole call (new state, indices, ok)
is bit-identical to the jnp path and agrees with the independent model, on random pools
(shuffled rings, any head, free lengths that are plenty, exact, one page short or 0),
for every page size; that the Mosaic backend works behind the same API; that the
kernel is chosen by config, environment and backend; and that vmap over several pools
and donation of the state work with the kernels in place.
"""
import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
import pallas_kernels
import lowering_check
from jax_kvalloc import kernels
from jax_kvalloc import state as st
from model import ModelAllocator
import kernel_cases as testing

NUM_PAGES = 96
ROWS = 8
MAX_TOKENS = 128
NUM_CASES = 16


def _rng(*key):
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _configs(ps, need_sort=False, kernel="triton_interpret", num_pages=NUM_PAGES):
  jnp_cfg = kv.AllocatorConfig(size=num_pages * ps, page_size=ps, need_sort=need_sort,
                               kernel="jnp", debug=False)
  return jnp_cfg, dataclasses.replace(jnp_cfg, kernel=kernel)


def _state(cfg, ring, head, length, release=None):
  s = kv.init(cfg)._replace(free_ring=jnp.asarray(ring), free_head=jnp.asarray(head),
                            free_len=jnp.asarray(length))
  if release is not None:
    s = s._replace(release_ring=jnp.asarray(release[0]), release_len=jnp.asarray(release[1]))
  return s


def _assert_same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _extend_cases(rng, ps, n, rows=ROWS, max_tokens=MAX_TOKENS, num_pages=NUM_PAGES):
  cases, states = [], []
  for _ in range(n):
    pre, seq, last, nreq = testing.extend_rows(rng, ps, rows, max_tokens)
    real = np.arange(rows) < nreq
    pages = int(np.sum(np.where(real, testing.cdiv(seq, ps) - testing.cdiv(pre, ps), 0)))
    cases.append((pre, seq, last, nreq))
    states.append(testing.pool(rng, num_pages, pages))
  return testing.stack(cases), testing.stack(states)


def _decode_cases(rng, ps, n, rows=ROWS, num_pages=NUM_PAGES):
  cases, states = [], []
  for _ in range(n):
    seq, last, nreq = testing.decode_rows(rng, ps, rows)
    real = np.arange(rows) < nreq
    pages = int(np.sum(real & (testing.cdiv(seq, ps) > testing.cdiv(seq - 1, ps))))
    cases.append((seq, last, nreq))
    states.append(testing.pool(rng, num_pages, pages))
  return testing.stack(cases), testing.stack(states)


def _model(ps, ring, head, length):
  m = ModelAllocator(size=ring.shape[0] * ps, page_size=ps, kind="paged")
  m.free_pages = testing.window(ring, head, length, int(length)).tolist()
  return m


def check_alloc_extend(ps, kernel="triton_interpret", *, rows=ROWS, max_tokens=MAX_TOKENS,
                       num_pages=NUM_PAGES, num_cases=NUM_CASES, model_cases=NUM_CASES,
                       seed=0):
  """alloc_extend with `kernel` == the jnp path (whole result, vmapped over random pools
  and batches), and == the model on the first model_cases cases."""
  jnp_cfg, pallas_cfg = _configs(ps, kernel=kernel, num_pages=num_pages)
  (pre, seq, last, nreq), (ring, head, length) = _extend_cases(
      _rng("extend", ps, seed), ps, num_cases, rows, max_tokens, num_pages)

  def run(cfg, ring, head, length, pre, seq, last, nreq):
    return kv.alloc_extend(cfg, _state(cfg, ring, head, length), pre, seq, last,
                           max_tokens=max_tokens, num_reqs=nreq)

  args = (ring, head, length, pre, seq, last, nreq)
  want = jax.jit(jax.vmap(functools.partial(run, jnp_cfg)))(*args)
  got = jax.jit(jax.vmap(functools.partial(run, pallas_cfg)))(*args)
  _assert_same(got, want)
  new_state, out, ok = jax.device_get(got)
  for i in range(model_cases):
    n = int(nreq[i])
    m = _model(ps, ring[i], head[i], length[i])
    expect = m.alloc_extend(pre[i, :n].tolist(), seq[i, :n].tolist(), last[i, :n].tolist())
    assert bool(ok[i]) == (expect is not None)
    if expect is None:
      assert not out[i].any()
      expect = []
    np.testing.assert_array_equal(out[i, :len(expect)], expect)
    assert not out[i, len(expect):].any()
    live = st.live_free_pages(jax.tree_util.tree_map(lambda x: x[i], new_state))
    assert live.tolist() == m.free_pages


def check_alloc_decode(ps, kernel="triton_interpret", *, rows=ROWS, num_pages=NUM_PAGES,
                       num_cases=NUM_CASES, model_cases=NUM_CASES, seed=0):
  """alloc_decode with `kernel` == the jnp path and the model, as check_alloc_extend."""
  jnp_cfg, pallas_cfg = _configs(ps, kernel=kernel, num_pages=num_pages)
  (seq, last, nreq), (ring, head, length) = _decode_cases(
      _rng("decode", ps, seed), ps, num_cases, rows, num_pages)

  def run(cfg, ring, head, length, seq, last, nreq):
    return kv.alloc_decode(cfg, _state(cfg, ring, head, length), seq, last, num_reqs=nreq)

  args = (ring, head, length, seq, last, nreq)
  want = jax.jit(jax.vmap(functools.partial(run, jnp_cfg)))(*args)
  got = jax.jit(jax.vmap(functools.partial(run, pallas_cfg)))(*args)
  _assert_same(got, want)
  new_state, out, ok = jax.device_get(got)
  for i in range(model_cases):
    n = int(nreq[i])
    m = _model(ps, ring[i], head[i], length[i])
    expect = m.alloc_decode(seq[i, :n].tolist(), last[i, :n].tolist())
    assert bool(ok[i]) == (expect is not None)
    np.testing.assert_array_equal(out[i, :n], expect if expect is not None else 0)
    assert not out[i, n:].any()
    live = st.live_free_pages(jax.tree_util.tree_map(lambda x: x[i], new_state))
    assert live.tolist() == m.free_pages


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
def test_alloc_extend_matches_jnp_and_model(ps):
  check_alloc_extend(ps)


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
def test_alloc_decode_matches_jnp_and_model(ps):
  check_alloc_decode(ps)


@pytest.mark.parametrize("ps,row_block", [(1, 2048), (16, 2048), (64, 4), (16, 4)])
def test_alloc_decode_masked_prefix(ps, row_block, monkeypatch):
  """The fused decode with the rows' page offsets from the masked [RB, RB] sum
  (tuning.DECODE_MASKED_PREFIX_MAX_ROWS), in one program and in several (row_block 4 of
  13 rows: each program adds the pages of the blocks before it)."""
  from pallas_kernels import tuning  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tuning, "DECODE_MASKED_PREFIX_MAX_ROWS", 4096)
  monkeypatch.setattr(tuning, "DECODE_ROW_BLOCK", row_block)
  check_alloc_decode(ps, rows=13, seed=row_block)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  e = lowering_check.export_for(   # the Triton lowering takes the [RB, RB] reduction
      "h200", functools.partial(pallas_kernels.alloc_decode_triton, page_size=ps),
      i32(64), i32(), i32(), i32(), i32(13), i32(13))
  assert lowering_check.TRITON_CUSTOM_CALL in lowering_check.custom_call_targets(e)


def test_refusals_match_jnp():
  # A row with seq < prefix, more tokens than max_tokens, an empty pool: all refused,
  # indices 0, state unchanged; the same on both paths.
  ps = 4
  ring = np.arange(1, NUM_PAGES + 1, dtype=np.int32)
  head = np.int32([12, 0, 3])
  length = np.int32([NUM_PAGES, NUM_PAGES, 0])
  pre = np.int32([[0, 5], [0, 0], [0, 0]])
  seq = np.int32([[9, 4], [40, 40], [1, 0]])
  last = np.int32([[-1, 20], [-1, -1], [-1, -1]])
  dseq = np.int32([[3, 0], [3, 4], [1, 5]])
  dlast = np.int32([[1, 2], [1, 2], [-1, 2]])

  def run(cfg, head, length, pre, seq, last, dseq, dlast):
    s0 = _state(cfg, ring, head, length)
    s1, out, ok = kv.alloc_extend(cfg, s0, pre, seq, last, max_tokens=64)
    d1, dout, dok = kv.alloc_decode(cfg, s0, dseq, dlast)
    return s0, s1, out, ok, d1, dout, dok

  args = (head, length, pre, seq, last, dseq, dlast)
  for cfg in _configs(ps):
    s0, s1, out, ok, d1, dout, dok = jax.jit(jax.vmap(functools.partial(run, cfg)))(*args)
    assert not np.asarray(ok).any() and not np.asarray(out).any()
    _assert_same(s1, s0)
    np.testing.assert_array_equal(dok, [False, True, False])
    assert not np.asarray(dout[0]).any() and not np.asarray(dout[2]).any()
    _assert_same(jax.tree_util.tree_map(lambda x: x[::2], d1),
                 jax.tree_util.tree_map(lambda x: x[::2], s0))


def test_need_sort_merge_then_fused_kernel():
  # need_sort: a shortfall merges release_pages first (in XLA), then the kernel runs on
  # the merged list.
  ps = 2
  rng = _rng("need_sort")
  cases = []
  for _ in range(4):
    ring = (rng.permutation(NUM_PAGES) + 1).astype(np.int32)
    cases.append((ring, np.int32(rng.integers(0, 10)), np.roll(ring, -10),
                  np.int32(rng.integers(1, 40)))
                 + testing.extend_rows(rng, ps, ROWS, MAX_TOKENS)
                 + testing.decode_rows(rng, ps, ROWS))

  def run(cfg, ring, free_len, release, release_len, pre, seq, last, nreq, dseq, dlast,
          dnreq):
    s = _state(cfg, ring, np.int32(0), free_len, (release, release_len))
    s, out, ok = kv.alloc_extend(cfg, s, pre, seq, last, max_tokens=MAX_TOKENS,
                                 num_reqs=nreq)
    return (s, out, ok) + kv.alloc_decode(cfg, s, dseq, dlast, num_reqs=dnreq)

  args = testing.stack(cases)
  want, got = (jax.jit(jax.vmap(functools.partial(run, cfg)))(*args)
               for cfg in _configs(ps, need_sort=True))
  _assert_same(got, want)
  assert np.asarray(want[0].release_len == 0).any()  # some merged


def test_large_batches_take_the_contract_kernel(monkeypatch):
  # Past fused_preferred the allocator computes the prefix sums in XLA and calls the
  # contract kernel; force that path at small sizes.
  from pallas_kernels import triton_extend  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(triton_extend, "MAX_FUSED_ROW_WORK", 0)
  jnp_cfg, pallas_cfg = _configs(16)
  assert "jax_kvalloc_extend_indices_triton" in _kernel_names(pallas_cfg)
  check_alloc_extend(16, seed=9)


def test_vmap_over_pools_and_donation():
  ps = 16
  jnp_cfg, pallas_cfg = _configs(ps)
  (pre, seq, last, nreq), (ring, head, length) = _extend_cases(_rng("vmap"), ps, 4)

  def step(cfg, state, pre, seq, last, nreq):
    state, out, ok = kv.alloc_extend(cfg, state, pre, seq, last, max_tokens=MAX_TOKENS,
                                     num_reqs=nreq)
    state, dout, dok = kv.alloc_decode(cfg, state, seq + 1, out[:ROWS], num_reqs=nreq)
    return state, out, ok, dout, dok

  results = []
  for cfg in (jnp_cfg, pallas_cfg):
    states = jax.vmap(functools.partial(_state, cfg))(ring, head, length)
    states = jax.tree_util.tree_map(jnp.array, states)  # fresh device arrays to donate
    fn = jax.jit(jax.vmap(functools.partial(step, cfg)), donate_argnums=0)
    leaves = jax.tree_util.tree_leaves(states)
    results.append(fn(states, pre, seq, last, nreq))
    assert all(x.is_deleted() for x in leaves)  # donated
  _assert_same(results[1], results[0])


def test_mosaic_backend_behind_the_allocator():
  # The TPU kernel serves the allocator through the contract path (no fused kernel).
  ps = 4
  jnp_cfg, pallas_cfg = _configs(ps, kernel="mosaic_interpret")
  (pre, seq, last, nreq), (ring, head, length) = _extend_cases(_rng("mosaic"), ps, 4)
  (dseq, dlast, dnreq), _ = _decode_cases(_rng("mosaic-d"), ps, 4)

  def run(cfg, ring, head, length, pre, seq, last, nreq, dseq, dlast, dnreq):
    s = _state(cfg, ring, head, length)
    s, out, ok = kv.alloc_extend(cfg, s, pre, seq, last, max_tokens=MAX_TOKENS,
                                 num_reqs=nreq)
    return (s, out, ok) + kv.alloc_decode(cfg, s, dseq, dlast, num_reqs=dnreq)

  args = (ring, head, length, pre, seq, last, nreq, dseq, dlast, dnreq)
  jaxpr = str(jax.make_jaxpr(functools.partial(run, pallas_cfg))(*[a[0] for a in args]))
  assert "jax_kvalloc_extend_indices_mosaic" in jaxpr and "triton" not in jaxpr
  want = jax.jit(jax.vmap(functools.partial(run, jnp_cfg)))(*args)
  got = jax.jit(jax.vmap(functools.partial(run, pallas_cfg)))(*args)
  _assert_same(got, want)


def _kernel_names(cfg):
  s = kv.init(cfg)
  rows = jnp.ones((ROWS,), jnp.int32)
  text = str(jax.make_jaxpr(lambda s: (
      kv.alloc_extend(cfg, s, rows, rows + 3, rows, max_tokens=64),
      kv.alloc_decode(cfg, s, rows + 1, rows)))(s))
  return {name for name in ("jax_kvalloc_alloc_extend_triton", "jax_kvalloc_alloc_decode_triton",
                            "jax_kvalloc_extend_indices_triton",
                            "jax_kvalloc_decode_indices_triton",
                            "jax_kvalloc_extend_indices_mosaic") if name in text}


def _lowered_kernel_names(cfg, platform=None):
  s = kv.init(cfg)
  rows = jnp.zeros((8,), jnp.int32)
  step = lambda s: (kv.alloc_extend(cfg, s, rows, rows + 3, rows, max_tokens=64),
                    kv.alloc_decode(cfg, s, rows + 1, rows))
  if platform is None:
    text = jax.jit(step).lower(s).as_text()
  else:  # an abstract H200 (jax.export), on any machine
    text = lowering_check.export_for(platform, step, s).mlir_module()
  return {name for name in ("jax_kvalloc_alloc_extend_triton", "jax_kvalloc_alloc_decode_triton",
                            "jax_kvalloc_extend_indices_triton",
                            "jax_kvalloc_decode_indices_triton",
                            "jax_kvalloc_extend_indices_mosaic") if name in text}


def test_kernel_choice():
  base = kv.AllocatorConfig(size=64, page_size=4, kernel="jnp", debug=False)
  fused = {"jax_kvalloc_alloc_extend_triton", "jax_kvalloc_alloc_decode_triton"}
  accelerator = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
  auto = dataclasses.replace(base, kernel="auto")
  if not accelerator:
    # "auto" on a CPU-only process traces the CPU's branch alone: no kernel in the
    # jaxpr (the platform is known at trace time), none lowered.
    assert _kernel_names(auto) == set() and _lowered_kernel_names(auto) == set()
    assert kernels.resolve("auto") == "jnp"
    # Exported for an abstract H200 or TPU, it picks that platform's kernels.
    assert _lowered_kernel_names(auto, "h200") == fused
    assert _lowered_kernel_names(auto, "tpu_v6e") == {"jax_kvalloc_extend_indices_mosaic"}
  elif jax.default_backend() != "tpu":
    assert _lowered_kernel_names(auto) == fused and kernels.resolve("auto") == "triton"
  assert _kernel_names(base) == set()
  for name in ("triton_interpret", "triton"):
    assert kernels.resolve(name) == name
    assert _kernel_names(dataclasses.replace(base, kernel=name)) == fused
  # Debug mode keeps the jnp bookkeeping and calls the index kernels alone.
  debug = dataclasses.replace(base, kernel="triton_interpret", debug=True)
  assert _kernel_names(debug) == {"jax_kvalloc_extend_indices_triton",
                                  "jax_kvalloc_decode_indices_triton"}
  for name in ("mosaic_interpret", "mosaic"):
    assert _kernel_names(dataclasses.replace(base, kernel=name)) == {
        "jax_kvalloc_extend_indices_mosaic"}
  # The older names: the platform's Pallas kernels.
  if jax.default_backend() != "tpu":
    assert kernels.resolve("pallas_interpret") == "triton_interpret"
    assert kernels.resolve("pallas") == "triton"
    assert _kernel_names(dataclasses.replace(base, kernel="triton_interpret")) == fused
    assert _kernel_names(dataclasses.replace(base, kernel="pallas")) == fused
  assert kernels.for_platform("pallas", "tpu") == "mosaic"
  assert kernels.for_platform("pallas_interpret", "tpu") == "mosaic_interpret"
  assert kernels.for_platform("auto", "gpu") == "triton"
  # One list of names: the config accepts exactly what kernels resolves, and the free's
  # registry holds the implementations kernels.REGISTRY names (and their interpreters).
  assert set(kv.config.KERNELS) == set(kernels.CONCRETE + kernels.BY_PLATFORM)
  for name in kernels.CONCRETE:
    assert kernels.family(name)[0] in kernels.REGISTRY["alloc_decode"]
  for op, prefs in kernels.GPU_PREFERENCE.items():
    assert set(prefs) <= set(kernels.REGISTRY[op]) | {"jnp"} and prefs[-1] == "jnp"
  from jax_kvalloc import freeing  # pylint: disable=g-import-not-at-top
  assert set(freeing.PAGED_FREE) == set(kernels.REGISTRY["free"]) | {"triton_interpret"}


def test_auto_on_several_backends_decides_when_lowering(monkeypatch):
  # A process with a GPU backend has a CPU one too: under jit the pool's platform is not
  # known at trace time, so "auto" traces both branches (lax.platform_dependent) and
  # the CPU lowering keeps the jnp one alone.
  monkeypatch.setattr(kernels, "_backend_platforms", lambda: ("cpu", "cuda"))
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel="auto", debug=False)
  fused = {"jax_kvalloc_alloc_extend_triton", "jax_kvalloc_alloc_decode_triton"}
  assert _kernel_names(cfg) == fused                       # traced...
  if jax.default_backend() == "cpu":
    assert _lowered_kernel_names(cfg) == set()             # ...not lowered for the CPU
  assert _lowered_kernel_names(cfg, "h200") == fused       # the abstract device decides


def test_kernel_from_environment_and_keyword(monkeypatch):
  monkeypatch.setenv("JAX_KVALLOC_KERNEL", "triton_interpret")
  assert kv.AllocatorConfig(size=64, page_size=4).kernel == "triton_interpret"
  assert kvs.PagedTokenToKVPoolAllocator(64, 4).config.kernel == "triton_interpret"
  assert kvs.TokenToKVPoolAllocator(64, None, None).config.kernel == "triton_interpret"
  monkeypatch.setenv("JAX_KVALLOC_KERNEL", "jnp")
  assert kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="mosaic").config.kernel == "mosaic"
  assert kvs.TokenToKVPoolAllocator(64, None, None, kernel="pallas").config.kernel == "pallas"
  monkeypatch.setenv("JAX_KVALLOC_KERNEL", "cuda")
  with pytest.raises(ValueError, match="JAX_KVALLOC_KERNEL"):
    kv.AllocatorConfig(size=64, page_size=4)
  with pytest.raises(ValueError, match="kernel must be one of"):
    kv.AllocatorConfig(size=64, page_size=4, kernel="sort")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU message")
@pytest.mark.parametrize("kernel", ("triton", "pallas"))
def test_triton_without_interpreter_on_cpu_says_what_to_do(kernel):
  cfg = kv.AllocatorConfig(size=64, page_size=4, kernel=kernel, debug=False)
  with pytest.raises(ValueError, match="triton_interpret"):
    jax.jit(functools.partial(kv.alloc_decode, cfg))(kv.init(cfg), jnp.ones(8, jnp.int32),
                                                     jnp.ones(8, jnp.int32))


def check_classes_follow_the_model(a, m, rng, *, steps, max_bs, max_ext, max_page):
  """Random extend (page-aligned prefixes) / decode / free steps of the class `a` and the
  model `m` side by side: every output and the free list must agree after each step."""
  ps = a.page_size
  held = []
  for step in range(steps):
    bs = int(rng.integers(1, max_bs))
    if step % 3 == 2 and held:
      idx = held.pop(int(rng.integers(len(held))))
      a.free(idx)
      m.free(idx.tolist())
    # Page-aligned prefixes: every slot returned is in a page this call took, so freeing
    # an output later frees exactly those pages.
    pre = rng.integers(0, 3, bs) * ps
    seq = pre + rng.integers(0, max_ext, bs)
    last = np.where(pre > 0, rng.integers(1, max_page, bs) * ps + ps - 1, -1)
    out = a.alloc_extend(pre, None, seq, None, last, int((seq - pre).sum()))
    want = m.alloc_extend(pre.tolist(), seq.tolist(), last.tolist())
    assert (out is None) == (want is None)
    if out is not None:
      assert np.asarray(out).tolist() == want
      held.append(np.asarray(out))
    dseq = rng.integers(1, 3 * max_ext // 2, bs)
    dlast = np.where(dseq > 1, rng.integers(1, max_page, bs) * ps + (dseq - 2) % ps, -1)
    out = a.alloc_decode(dseq, None, dlast)
    want = m.alloc_decode(dseq.tolist(), dlast.tolist())
    assert (out is None) == (want is None)
    if out is not None:
      assert np.asarray(out).tolist() == want
    assert a.free_pages.tolist() == m.free_pages


def test_classes_with_pallas_interpret_follow_the_model():
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(64 * ps, ps, kernel="triton_interpret")
  m = ModelAllocator(size=64 * ps, page_size=ps, kind="paged")
  check_classes_follow_the_model(a, m, _rng("classes"), steps=12, max_bs=5, max_ext=20,
                                 max_page=60)
