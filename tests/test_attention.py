"""jax_kvalloc.attention's adapters fed to JAX's real paged-attention kernels agree with a
plain causal attention over a contiguous cache (within 1e-5), and the TPU kernels lower
for an abstract TPU with the adapters' shapes.

Which jax carries which kernel (checked on 0.10.2 and 0.12; a missing one skips with
the reason):
  ops.tpu.ragged_paged_attention (ref_ragged_paged_attention, ragged_paged_attention):
    jax >= 0.6. The kernel itself runs on TPU only (both CPU interpreters reject it), so
    on CPU it is lowered for an abstract TPU; its jnp reference runs here, eagerly (it
    loops over num_seqs in Python).
  ops.tpu.paged_attention (decode): runs here in TPU interpret mode, and is lowered.
  ops.gpu.paged_attention (decode, Pallas-Triton; deprecated from 0.11.2): interpret=True.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc import attention
import lowering_check
import attention_cases as ac

TOL = 1e-5


def _kernel(module: str, name: str):
  """module.name, or a skip that names the jax version and what was missing."""
  try:
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"jax {jax.__version__} has no {module}.{name} ({e})")


RPA = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"
TPU_PA = "jax.experimental.pallas.ops.tpu.paged_attention"
GPU_PA = "jax.experimental.pallas.ops.gpu.paged_attention"


@functools.lru_cache(maxsize=None)
def _case(page_size, seed):
  case = ac.make_case(page_size, seed)
  return case, ac.reference(case)


def _run_ref(ref_rpa, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
  """ref_ragged_paged_attention with its index arrays as host constants: it slices with
  them in a Python loop, so this way it traces into one program (one compile) instead
  of running op by op."""
  ints = [np.asarray(a, np.int32) for a in (kv_lens, page_indices, cu_q_lens, num_seqs)]
  return jax.jit(lambda q, kv: ref_rpa(q, kv, *ints))(q, kv_pages)


# Jitted adapters (one compile each): eager op-by-op dispatch would dominate the tests.
_dense = jax.jit(attention.dense_inputs, static_argnums=0, static_argnames="width")
_ragged = jax.jit(attention.ragged_inputs, static_argnums=0, static_argnames="max_pages")
_flat = jax.jit(attention.flat_inputs, static_argnums=0, static_argnames="max_tokens")


def _args(case):
  return (case.config, case.table, case.rows, case.q_lens)


def _check_ragged_kernel_forms(page_size, seed):
  ref_rpa = _kernel(RPA, "ref_ragged_paged_attention")
  case, want = _case(page_size, seed)
  total = int(case.q_lens.sum())
  q = jnp.asarray(case.q)

  # Dense: as the kernel takes it.
  d = _dense(*_args(case), num_rows=case.num_rows)
  got = _run_ref(ref_rpa, q, case.kv_pages, d.kv_lens, d.page_indices, d.cu_q_lens,
                 d.num_seqs)
  np.testing.assert_allclose(got[:total], want[:total], atol=TOL, rtol=0)

  # Flat (v3): its page list viewed [S, W] (a reshape), queries in kernel order.
  f = _flat(*_args(case), max_tokens=case.max_tokens,
                            num_rows=case.num_rows)
  dist = np.asarray(f.distribution)
  q_len_k = np.diff(np.asarray(f.cu_q_lens))
  assert dist[0] == dist[1] == np.sum(q_len_k[:dist[2]] == 1)
  assert np.all(q_len_k[:dist[0]] == 1) and not np.any(q_len_k[dist[0]:dist[2]] == 1)
  assert sorted(np.asarray(f.token_order).tolist()) == list(range(case.max_tokens))
  got = _run_ref(ref_rpa, q[f.token_order], case.kv_pages, f.kv_lens,
                 f.page_indices.reshape(len(case.rows), -1), f.cu_q_lens, dist[2:])
  out = jnp.zeros((case.max_tokens,) + got.shape[1:]).at[f.token_order[:total]].set(got)
  np.testing.assert_allclose(out[:total], want[:total], atol=TOL, rtol=0)

  # Ragged: each sequence reads its pages from its offset in the packed list.
  width = case.table.pages.shape[1]
  r = _ragged(*_args(case), max_pages=6 * width,
                              num_rows=case.num_rows)
  assert bool(r.ok)
  starts = np.asarray(r.page_starts)
  np.testing.assert_array_equal(np.diff(starts),
                                -(-np.asarray(r.kv_lens) // page_size))
  assert np.all(np.asarray(r.page_indices)[starts[-1]:] == 0)
  packed = np.pad(np.asarray(r.page_indices), (0, width))
  cu = np.asarray(r.cu_q_lens)
  lens = np.asarray(r.kv_lens)

  def per_sequence(q, kv):
    return [ref_rpa(q[cu[s]:cu[s + 1]], kv, lens[s:s + 1],
                    packed[None, starts[s]:starts[s] + width],
                    np.int32([0, cu[s + 1] - cu[s]]), np.int32([1]))
            for s in range(case.num_rows) if cu[s + 1] > cu[s]]
  got = jnp.concatenate(jax.jit(per_sequence)(q, case.kv_pages))
  np.testing.assert_allclose(got, want[:total], atol=TOL, rtol=0)


def _decode_queries(case, want):
  last = ac.last_tokens(case)
  b = np.int32([i for i, _ in last])
  t = np.int32([j for _, j in last])
  return b, case.q[t], want[t]


def _check_tpu_decode(page_size, seed, block=2):
  tpu_pa = _kernel(TPU_PA, "paged_attention")
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  case, want = _case(page_size, seed)
  w = case.table.pages.shape[1]
  d = _dense(*_args(case), num_rows=case.num_rows,
                             width=-(-w // block) * block)
  b, q, expect = _decode_queries(case, want)
  with pltpu.force_tpu_interpret_mode():
    got = tpu_pa(jnp.asarray(q), case.k_pages, case.v_pages, d.kv_lens[b],
                 d.page_indices[b], pages_per_compute_block=block)
  np.testing.assert_allclose(got, expect, atol=TOL, rtol=0)


def _check_gpu_decode(page_size, seed, k_splits=2, block=2):
  gpu_pa = _kernel(GPU_PA, "paged_attention")
  case, want = _case(page_size, seed)
  w = case.table.pages.shape[1]
  m = k_splits * block
  d = _dense(*_args(case), num_rows=case.num_rows, width=-(-w // m) * m)
  b, q, expect = _decode_queries(case, want)
  got = gpu_pa(jnp.asarray(q), case.k_pages, case.v_pages, d.page_indices[b],
               d.kv_lens[b], pages_per_compute_block=block, k_splits=k_splits,
               interpret=True)
  np.testing.assert_allclose(got, expect, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------
# The default set: one page size, every kernel. Bigger sweeps: the slow set.
# ---------------------------------------------------------------------------------------

def test_ragged_reference_reads_every_form():
  _check_ragged_kernel_forms(16, 0)


def test_tpu_decode_kernel_reads_dense_form():
  _check_tpu_decode(16, 0)


def test_gpu_decode_kernel_reads_dense_form():
  _check_gpu_decode(16, 0)


@pytest.mark.parametrize("page_size,seed", [(1, 1), (16, 2), (64, 3)])
def test_every_kernel_page_sizes_slow(page_size, seed):
  _check_ragged_kernel_forms(page_size, seed)
  _check_tpu_decode(page_size, seed, block=1 if page_size == 64 else 2)
  _check_gpu_decode(page_size, seed)


def test_case_covers_the_edges():
  case, _ = _case(16, 0)
  lens = np.asarray(case.table.lens)
  real = case.rows[:case.num_rows]
  assert 0 in case.q_lens[:case.num_rows] and 1 in case.q_lens[:case.num_rows]
  assert np.any(case.q_lens > 1) and np.any(lens[real] == 0)
  assert int(case.table.owned_from[2]) > 0                        # a borrowed prefix
  pages = np.asarray(case.table.pages)
  n = case.config.num_pages
  held = pages[pages > 0]
  assert held.max() > n - 8 and held.min() < 8                    # shuffled, wrapped


# ---------------------------------------------------------------------------------------
# Lowering for an abstract TPU / H200 with the adapters' shapes.
# ---------------------------------------------------------------------------------------

def _spec(x):
  return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype)


def test_tpu_ragged_kernel_lowers_with_dense_form():
  rpa = _kernel(RPA, "ragged_paged_attention")
  case, _ = _case(16, 0)
  d = _dense(*_args(case), num_rows=case.num_rows)
  fn = functools.partial(rpa, num_kv_pages_per_block=2, num_queries_per_block=16)
  ex = lowering_check.export_for(
      "tpu_v6e", fn, _spec(case.q), _spec(case.kv_pages),
      *[_spec(a) for a in (d.kv_lens, d.page_indices, d.cu_q_lens, d.num_seqs)])
  assert "tpu_custom_call" in lowering_check.custom_call_targets(ex)


def test_tpu_decode_kernel_lowers_with_dense_form():
  tpu_pa = _kernel(TPU_PA, "paged_attention")
  case, _ = _case(16, 0)
  d = _dense(*_args(case), num_rows=case.num_rows, width=8)
  fn = functools.partial(tpu_pa, pages_per_compute_block=2)
  ex = lowering_check.export_for(
      "tpu_v6e", fn, _spec(case.q[:len(case.rows)]), _spec(case.k_pages),
      _spec(case.v_pages), _spec(d.kv_lens), _spec(d.page_indices))
  assert "tpu_custom_call" in lowering_check.custom_call_targets(ex)


def test_gpu_decode_kernel_lowers_for_h200_with_dense_form():
  gpu_pa = _kernel(GPU_PA, "paged_attention")
  case, _ = _case(16, 0)
  d = _dense(*_args(case), num_rows=case.num_rows, width=8)
  fn = functools.partial(gpu_pa, pages_per_compute_block=2, k_splits=2)
  ex = lowering_check.export_for(
      "h200", fn, _spec(case.q[:len(case.rows)]), _spec(case.k_pages),
      _spec(case.v_pages), _spec(d.page_indices), _spec(d.kv_lens))
  assert lowering_check.custom_call_targets(ex)


# ---------------------------------------------------------------------------------------
# The adapters themselves: jittable, bad input, capacity.
# ---------------------------------------------------------------------------------------

def test_adapters_jit_without_host_work():
  case, _ = _case(16, 0)
  width = case.table.pages.shape[1]

  @jax.jit
  def step(table, rows, q_lens, num_rows):
    cfg = case.config
    return (attention.dense_inputs(cfg, table, rows, q_lens, num_rows=num_rows),
            attention.ragged_inputs(cfg, table, rows, q_lens, max_pages=2,
                                    num_rows=num_rows),
            attention.flat_inputs(cfg, table, rows, q_lens, max_tokens=case.max_tokens,
                                  num_rows=num_rows))
  d, r, f = step(case.table, case.rows, case.q_lens, np.int32(case.num_rows))
  assert not bool(r.ok)                  # more than 2 pages in use: the tail is cut off
  assert np.asarray(r.page_starts)[-1] > 2
  np.testing.assert_array_equal(f.page_indices.reshape(len(case.rows), width),
                                np.asarray(d.page_indices)[np.asarray(f.row_order)])


def test_bad_arguments_name_themselves():
  case, _ = _case(16, 0)
  with pytest.raises(ValueError, match="max_pages"):
    attention.ragged_inputs(*_args(case), max_pages=0)
  with pytest.raises(ValueError, match="width"):
    attention.dense_inputs(*_args(case), width=1)
  with pytest.raises(ValueError, match="k and v"):
    attention.write_kv_combined(case.kv_pages, np.int32([1]), np.zeros((1, 3, 128)),
                                np.zeros((1, 3, 128)))
  with pytest.raises(ValueError, match="k_pages and v_pages"):
    attention.write_kv_split(case.k_pages, case.v_pages[:1], np.int32([1]),
                             np.zeros((1, 2, 128)), np.zeros((1, 2, 128)))


def test_kv_writes_land_at_slots_and_skip_padding():
  write_combined = jax.jit(attention.write_kv_combined)
  kv = jnp.full((3, 4, 4, 2), -1.0)
  k = jnp.arange(3 * 2 * 2, dtype=jnp.float32).reshape(3, 2, 2)
  out = write_combined(kv, np.int32([5, 11, 6]), k, -k, num_tokens=np.int32(2))
  np.testing.assert_array_equal(out[1, 1], jnp.stack([k[0], -k[0]], 1).reshape(4, 2))
  np.testing.assert_array_equal(out[2, 3], jnp.stack([k[1], -k[1]], 1).reshape(4, 2))
  assert float(out[1, 2].max()) == -1.0          # the third token is padding
  kp, vp = jax.jit(attention.write_kv_split)(jnp.zeros((2, 3, 4, 2)), jnp.zeros((2, 3, 4, 2)),
                                    np.int32([5, -1]), k[:2], -k[:2])
  np.testing.assert_array_equal(kp[:, 1, 1], k[0])
  np.testing.assert_array_equal(vp[:, 1, 1], -k[0])
  assert float(jnp.abs(kp).sum()) == float(jnp.abs(k[0]).sum())  # slot -1: not written
