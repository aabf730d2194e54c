"""The Pallas kernels compiled for a real GPU (Triton lowering), bit for bit against the jnp
path on the same device and against the model. Skipped without a CUDA GPU.

Run: pytest -m gpu tests/test_pallas_gpu.py   (benchmarks/run_device.sh runs it too)
JAX_KVALLOC_GPU_TEST_KERNEL=pallas_interpret runs the same tests on CPU (slowly), to
check the tests themselves.
"""
import functools
import os

import jax
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
import pallas_kernels
from model import ModelAllocator
import kernel_cases as testing
from test_pallas_alloc import _assert_same, _configs, _decode_cases, _extend_cases, _rng
from test_pallas_alloc import _state, check_alloc_decode, check_alloc_extend
from test_pallas_alloc import check_classes_follow_the_model
from test_pallas_kernels import _check_decode, _check_extend
from test_release_decode import check_release_decode
from gpu import has_gpu, needs_gpu



KERNEL = os.environ.get("JAX_KVALLOC_GPU_TEST_KERNEL", "pallas")
INTERPRET = KERNEL == "pallas_interpret"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (has_gpu() or INTERPRET),
                                 reason="needs a CUDA GPU (jax sees none)")]


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
def test_contract_kernels(ps):
  _check_extend(functools.partial(pallas_kernels.extend_indices, backend="triton",
                                  interpret=INTERPRET), ps, out_len=1024 + 96, seed=ps)
  _check_decode(functools.partial(pallas_kernels.decode_indices, backend="triton",
                                  interpret=INTERPRET), ps, seed=ps)


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
def test_fused_allocation(ps):
  check_alloc_extend(ps, KERNEL, num_cases=32, model_cases=8, seed=1)
  check_alloc_decode(ps, KERNEL, num_cases=32, model_cases=8, seed=1)


@pytest.mark.parametrize("ps", (1, 16))
def test_fused_allocation_large(ps):
  # Many rows and tokens: several extend tiles, a multi-program decode (rows > 2048).
  check_alloc_extend(ps, KERNEL, rows=1024, max_tokens=65536, num_pages=70000,
                     num_cases=4, model_cases=1, seed=2)
  check_alloc_extend(ps, KERNEL, rows=64, max_tokens=8192, num_pages=9000,
                     num_cases=8, model_cases=2, seed=3)
  check_alloc_decode(ps, KERNEL, rows=16384, num_pages=20000, num_cases=4,
                     model_cases=1, seed=4)
  check_alloc_decode(ps, KERNEL, rows=256, num_pages=300, num_cases=16,
                     model_cases=4, seed=5)


@pytest.mark.parametrize("tile,window,warps,rows", [
    (256, 256, 1, 256), (512, 256, 2, 16), (2048, 256, 8, 256), (1024, 16, 4, 256)])
def test_extend_tunings(tile, window, warps, rows):
  # Every tuning `bench kernels --impls fused[...]` can time computes the same thing.
  ps = 16
  (pre, seq, last, nreq), (ring, head, length) = _extend_cases(
      _rng("tune", tile, rows), ps, 8, rows=rows, max_tokens=16384, num_pages=2000)
  jnp_cfg, _ = _configs(ps, num_pages=2000)

  def ref(ring, head, length, pre, seq, last, nreq):
    s, out, ok = kv.alloc_extend(jnp_cfg, _state(jnp_cfg, ring, head, length), pre, seq,
                                 last, max_tokens=16384, num_reqs=nreq)
    return out, s.free_head, s.free_len, ok

  fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps, out_len=16384,
                         tile=tile, window=window, num_warps=warps, layout="tiles",
                         interpret=INTERPRET)
  got = jax.jit(jax.vmap(lambda r, h, l, p, s, la, n: fn(r, h, l, n, p, s, la)))(
      ring, head, length, pre, seq, last, nreq)
  _assert_same(got, jax.jit(jax.vmap(ref))(ring, head, length, pre, seq, last, nreq))


@pytest.mark.parametrize("rows,ps,kwargs", [
    (16, 1, {}), (1024, 64, {}), (256, 16, dict(num_warps=8)), (256, 64, dict(tile=256)),
    (64, 3, dict(tile=64, chunks=3, num_warps=2)), (1, 64, {})])
def test_extend_rows_layout(rows, ps, kwargs):
  # The rows layout (one program per row and chunk) at the defaults and at tunings;
  # tiles in test_extend_tunings.
  from test_extend_layouts import _check_kernel  # pylint: disable=g-import-not-at-top
  _check_kernel(ps, rows=rows, max_tokens=16384, num_pages=20000, seed=rows,
                layout="rows", interpret=INTERPRET, **kwargs)


@pytest.mark.parametrize("layout", ("rows", "tiles"))
def test_fused_allocation_each_layout(layout, monkeypatch):
  # The allocator with each layout forced (the default rule picks one per batch size).
  from test_extend_layouts import force_layout  # pylint: disable=g-import-not-at-top
  force_layout(monkeypatch, layout)
  check_alloc_extend(3, KERNEL, num_cases=16, model_cases=4, seed=12)
  check_alloc_extend(64, KERNEL, rows=1024, max_tokens=65536, num_pages=70000,
                     num_cases=2, model_cases=1, seed=13)


@pytest.mark.parametrize("rows,row_block,warps", [(16384, 4096, 8), (256, 256, 4)])
def test_decode_tunings(rows, row_block, warps):
  ps = 16
  (seq, last, nreq), (ring, head, length) = _decode_cases(
      _rng("tune-d", row_block, rows), ps, 4, rows=rows, num_pages=20000)
  jnp_cfg, _ = _configs(ps, num_pages=20000)

  def ref(ring, head, length, seq, last, nreq):
    s, out, ok = kv.alloc_decode(jnp_cfg, _state(jnp_cfg, ring, head, length), seq, last,
                                 num_reqs=nreq)
    return out, s.free_head, s.free_len, ok

  fn = functools.partial(pallas_kernels.alloc_decode_triton, page_size=ps,
                         row_block=row_block, num_warps=warps, interpret=INTERPRET)
  got = jax.jit(jax.vmap(lambda r, h, l, s, la, n: fn(r, h, l, n, s, la)))(
      ring, head, length, seq, last, nreq)
  _assert_same(got, jax.jit(jax.vmap(ref))(ring, head, length, seq, last, nreq))


def test_large_extend_takes_the_contract_kernel():
  # Past fused_preferred the allocator runs XLA prefix sums + the contract kernel.
  assert not pallas_kernels.extend_fused_preferred(4096, 262144, 30000)
  check_alloc_extend(16, KERNEL, rows=4096, max_tokens=262144, num_pages=30000,
                     num_cases=2, model_cases=1, seed=6)


def test_classes_on_gpu_follow_the_model():
  ps = 16
  a = kvs.PagedTokenToKVPoolAllocator(512 * ps, ps, device=None if INTERPRET else "cuda",
                                     kernel=KERNEL)
  m = ModelAllocator(size=512 * ps, page_size=ps, kind="paged")
  check_classes_follow_the_model(a, m, np.random.default_rng(7), steps=40, max_bs=40,
                                 max_ext=200, max_page=500)


def test_capacity_edges_on_gpu():
  # Lengths at and near 2**31 - 1 (tests/test_capacity.py) through the compiled kernels.
  from test_capacity import EXTEND_CASES, _extend, _same  # pylint: disable=g-import-not-at-top
  for ps, pre, seq, fits in EXTEND_CASES:
    want = _extend(ps, "jnp", pre, seq)
    assert bool(want[2]) == fits
    _same(_extend(ps, KERNEL, pre, seq), want)


@pytest.mark.parametrize("ps,num_pages,rows,m,count", [
    (1, 64, 8, 16, 64), (16, 64, 8, 16, 64), (64, 300, 37, 100, 32),
    (64, 100_000, 1024, 512, 8), (16, 20_000, 2048, 8192, 4), (128, 5000, 2000, 3000, 4)])
def test_release_and_alloc_decode(ps, num_pages, rows, m, count):
  # free_page_ids + alloc_decode in one launch == the jnp composition and the model.
  check_release_decode(ps, num_pages, rows, m, count, "gpu", kernel=KERNEL)
