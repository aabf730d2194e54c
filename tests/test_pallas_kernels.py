"""The Pallas index kernels against the jnp contract and the independent model, on CPU.

Both backends (Triton-style GPU kernel, Mosaic TPU kernel) run in Pallas' HLO
interpreter (`interpret=True`), many fresh random batches per page size, vmapped so that
each configuration compiles once. Every page size of {1, 2, 4, 16, 64, 128}; the case
generator (tests/kernel_cases.py) mixes zero-extension rows, prefix 0, aligned and
mid-page prefixes, one row holding all tokens, padded rows, and pools that are exactly
used up or one page short.
"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jax_kvalloc import index_jnp
from model import ModelAllocator
import kernel_cases as testing
from pallas_kernels.triton_extend import extend_indices_triton

ROWS = 8
NUM_CASES = 24


def _seed(*key) -> int:
  return zlib.crc32(repr(key).encode())


def _model_extend(args, info, ps):
  """The model's slots for a contract case, or None if its pages do not fit."""
  win, pre, seq, last, _, _ = args
  m = ModelAllocator(size=len(win) * ps, page_size=ps, kind="paged")
  m.free_pages = [int(p) for p in win[:info["free"]]]
  return m.alloc_extend(pre.tolist(), seq.tolist(), last.tolist())


def _model_decode(args, info, ps):
  win, seq, last, _ = args
  n = info["num_reqs"]
  m = ModelAllocator(size=len(win) * ps, page_size=ps, kind="paged")
  m.free_pages = [int(p) for p in win[:info["free"]]]
  return m.alloc_decode(seq[:n].tolist(), last[:n].tolist())


def _check_extend(kernel, ps: int, out_len: int, seed: int):
  """kernel (contract signature) == index_jnp on NUM_CASES batches, and == the model on
  every batch whose pages fit; the entries past the batch's tokens are 0."""
  rng = np.random.default_rng(seed)
  window_len = out_len // ps + ROWS + 1
  cases = [testing.extend_contract_case(rng, ps, ROWS, out_len, window_len)
           for _ in range(NUM_CASES)]
  args = testing.stack([c[0] for c in cases])
  ref = jax.jit(jax.vmap(functools.partial(index_jnp.extend_indices, page_size=ps,
                                           out_len=out_len)))(*args)
  got = jax.jit(jax.vmap(functools.partial(kernel, page_size=ps, out_len=out_len)))(*args)
  ref, got = np.asarray(ref), np.asarray(got)
  np.testing.assert_array_equal(got, ref)
  fitting = 0
  for i, (case_args, info) in enumerate(cases):
    want = _model_extend(case_args, info, ps)
    assert (want is None) == (info["pages"] > info["free"])
    if want is not None:
      fitting += 1
      np.testing.assert_array_equal(got[i, :info["tokens"]], want)
      assert not got[i, info["tokens"]:].any()
  assert fitting >= NUM_CASES // 4


def _check_decode(kernel, ps: int, seed: int):
  rng = np.random.default_rng(seed)
  cases = [testing.decode_contract_case(rng, ps, ROWS, ROWS) for _ in range(NUM_CASES)]
  args = testing.stack([c[0] for c in cases])
  ref = jax.vmap(functools.partial(index_jnp.decode_indices, page_size=ps))(*args)
  got = jax.jit(jax.vmap(functools.partial(kernel, page_size=ps)))(*args)
  ref, got = np.asarray(ref), np.asarray(got)
  np.testing.assert_array_equal(got, ref)
  for i, (case_args, info) in enumerate(cases):
    want = _model_decode(case_args, info, ps)
    assert (want is None) == (info["pages"] > info["free"])
    if want is not None:
      np.testing.assert_array_equal(got[i, :info["num_reqs"]], want)


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
@pytest.mark.parametrize("backend", pallas_kernels.BACKENDS)
def test_extend_indices(backend, ps):
  # Two output tiles (1024 tokens each), the second partial.
  kernel = functools.partial(pallas_kernels.extend_indices, interpret=True, backend=backend)
  _check_extend(kernel, ps, out_len=1024 + 96, seed=_seed("extend", backend, ps))


@pytest.mark.parametrize("ps", (1, 4, 64))
def test_extend_indices_triton_small_tiles(ps):
  # Tiles of 32 tokens and search windows of 2 rows: many programs, rows spanning tiles,
  # tiles covering several passes of rows.
  kernel = functools.partial(extend_indices_triton, interpret=True, tile=32, window=2)
  _check_extend(kernel, ps, out_len=200, seed=_seed("small", ps))


@pytest.mark.parametrize("ps", testing.PAGE_SIZES)
@pytest.mark.parametrize("backend", pallas_kernels.BACKENDS)
def test_decode_indices(backend, ps):
  kernel = functools.partial(pallas_kernels.decode_indices, interpret=True, backend=backend)
  _check_decode(kernel, ps, seed=_seed("decode", backend, ps))


def test_hand_worked_vectors():
  # SPEC 5, ps = 4: pre 2, seq 11, last_loc 1 -> [2,3 | 4,5,6,7 | 8,9,10] from pages 1, 2.
  win = jnp.arange(1, 9, dtype=jnp.int32)
  args = (win, jnp.array([2], jnp.int32), jnp.array([11], jnp.int32),
          jnp.array([1], jnp.int32), jnp.array([0], jnp.int32), jnp.array([0], jnp.int32))
  # SPEC 5: seq [12, 13], last_loc [10, 11], free pages [3, ...] -> [11, 12].
  dec = (jnp.arange(3, 9, dtype=jnp.int32), jnp.array([12, 13], jnp.int32),
         jnp.array([10, 11], jnp.int32), jnp.array([0, 0], jnp.int32))
  for backend in pallas_kernels.BACKENDS:
    out = pallas_kernels.extend_indices(*args, page_size=4, out_len=12, interpret=True,
                                        backend=backend)
    assert out.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0]
    out = pallas_kernels.decode_indices(*dec, page_size=4, interpret=True, backend=backend)
    assert out.tolist() == [11, 12]


def test_empty_shapes():
  z = jnp.zeros((0,), jnp.int32)
  win = jnp.arange(1, 5, dtype=jnp.int32)
  for backend in pallas_kernels.BACKENDS:
    out = pallas_kernels.extend_indices(win, z, z, z, z, z, page_size=2, out_len=5,
                                        interpret=True, backend=backend)
    assert out.tolist() == [0] * 5
    assert pallas_kernels.decode_indices(win, z, z, z, page_size=2, interpret=True,
                                         backend=backend).shape == (0,)


def test_backend_choice():
  expected = "mosaic" if jax.default_backend() == "tpu" else "triton"
  assert pallas_kernels.default_backend() == expected
  with pytest.raises(ValueError, match="backend must be one of"):
    pallas_kernels.decode_indices(jnp.ones(4, jnp.int32), *([jnp.ones(2, jnp.int32)] * 3),
                                  page_size=1, backend="mgpu")
