"""One capacity rule on every path (pallas_kernels.capacity), and "auto" by the pool's device.

- Lengths at and near 2**31 - 1, whose int32 sums wrap: the jnp path, the fused Triton
  kernels and the Triton contract kernel (Pallas interpreter), and the Mosaic kernel
  (Pallas interpreter behind the allocator, and the TPU interpreter on the contract),
  give the same (state, indices, ok); batches whose true totals exceed the limits are
  refused everywhere (the fused Triton extend once accepted seq_lens=[2**31-1, 1], ps 1).
- kernel="auto" follows the device that holds the pool, not the default backend: a CPU
  pool runs the jnp path while jax reports a GPU (monkeypatched), eagerly and under jit,
  and the compiled program holds one branch (no conditional).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
import pallas_kernels
from jax_kvalloc import index_jnp
from jax_kvalloc import kernels
from pallas_kernels import capacity

BIG = 2**31 - 1
NUM_PAGES = 64
MAX_TOKENS = 64

# (page_size, prefix_lens, seq_lens, fits): lengths whose sums wrap int32, and lengths
# near 2**31 - 1 that do fit (a few new tokens on a huge prefix).
EXTEND_CASES = [
    (1, [0, 0], [BIG, 1], False),          # the review's case: the sum wraps to -2**31
    (1, [0, 0], [BIG, BIG], False),
    (1, [0, 0, 0], [2**30, 2**30, 4], False),
    (16, [0, 0], [BIG, 1], False),
    (3, [0, 0], [2**31 - 3, 5], False),
    (1, [BIG - 3, 0], [BIG, 2], True),       # 3 + 2 tokens, 5 pages
    (16, [BIG - 40, 5], [BIG - 1, 9], True),
    (3, [BIG - 7, 0], [BIG - 1, 4], True),
    (16, [BIG - 1, 0], [BIG, 16 * NUM_PAGES + 16], False),  # too many pages
    # A prefix ending within the page that holds 2**31 - 1: ceil(pre / ps) * ps wraps,
    # and the new token still lies in the prefix's last page (part 1: last_loc + 1).
    (16, [BIG - 1, 0], [BIG, 3], True),
    (3, [BIG - 2, 4], [BIG, 9], True),
]


@pytest.mark.parametrize("kernel", ["jnp", "triton_interpret"])
def test_extend_part1_in_the_page_of_int32_max(kernel):
  """The new tokens of a prefix that ends within the last page below 2**31 fill that
  page (last_loc + 1, + 2, ...), on the jnp path too (its part-1 test once multiplied
  ceil(pre / ps) * ps, which wraps there, and took the next free page instead)."""
  for ps, pre, seq in ((16, [BIG - 1], [BIG]), (3, [BIG - 2], [BIG]), (16, [BIG - 3], [BIG])):
    _, out, ok = _extend(ps, kernel, pre, seq)
    n1 = min(seq[0] - pre[0], -pre[0] % ps)  # the new tokens in the prefix's last page
    assert bool(ok) and n1 >= 1
    np.testing.assert_array_equal(np.asarray(out)[:n1],
                                  _last(ps, pre)[0] + 1 + np.arange(n1))


DECODE_CASES = [
    (1, [BIG, BIG - 1], [BIG - 2, BIG - 3]),
    (16, [BIG, 2**31 - 16, 17], [BIG - 2, 2**31 - 18, 31]),
]


def _last(ps, pre):
  # A last_loc consistent with the prefix ((last + 1) % ps == pre % ps), or -1.
  pre = np.asarray(pre, np.int64)
  return np.where(pre > 0, 5 * ps + (pre - 1) % ps, -1).astype(np.int32)


def _cfg(ps, kernel):
  return kv.AllocatorConfig(size=NUM_PAGES * ps, page_size=ps, kernel=kernel, debug=False)


def _state(cfg):
  s = kv.init(cfg)
  ring = np.roll(np.arange(1, NUM_PAGES + 1, dtype=np.int32), 7)
  return s._replace(free_ring=jnp.asarray(ring), free_head=jnp.asarray(60, jnp.int32))


def _extend(ps, kernel, pre, seq):
  cfg = _cfg(ps, kernel)
  fn = jax.jit(functools.partial(kv.alloc_extend, cfg, max_tokens=MAX_TOKENS))
  return fn(_state(cfg), np.asarray(pre, np.int32), np.asarray(seq, np.int32),
            _last(ps, pre))


def _same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("case", range(len(EXTEND_CASES)))
def test_extend_near_int32_max_all_paths(case, monkeypatch):
  ps, pre, seq, fits = EXTEND_CASES[case]
  want = _extend(ps, "jnp", pre, seq)
  assert bool(want[2]) == fits
  if not fits:
    assert int(want[0].free_len) == NUM_PAGES and not np.asarray(want[1]).any()
  _same(_extend(ps, "triton_interpret", pre, seq), want)       # fused Triton kernel
  from pallas_kernels import triton_extend  # pylint: disable=g-import-not-at-top
  with monkeypatch.context() as m:                              # Triton contract kernel
    m.setattr(triton_extend, "MAX_FUSED_ROW_WORK", 0)
    _same(_extend(ps, "triton_interpret", pre, seq), want)
  _same(_extend(ps, "mosaic_interpret", pre, seq), want)       # Mosaic kernel


@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_near_int32_max_all_paths(case):
  ps, seq, last = DECODE_CASES[case]
  seq, last = np.asarray(seq, np.int32), np.asarray(last, np.int32)

  def run(kernel):
    cfg = _cfg(ps, kernel)
    return jax.jit(functools.partial(kv.alloc_decode, cfg))(_state(cfg), seq, last)

  want = run("jnp")
  assert bool(want[2])
  _same(run("triton_interpret"), want)
  _same(run("mosaic_interpret"), want)


def test_mosaic_contract_near_int32_max_under_tpu_interpreter():
  # The contract inputs the allocator builds for the batches that fit (prefix sums from
  # the shared rule), through the TPU interpreter, which raises on out-of-bounds reads.
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  params = pltpu.InterpretParams(out_of_bounds_reads="raise")
  for ps, pre, seq, fits in EXTEND_CASES:
    pre, seq = np.asarray(pre, np.int32), np.asarray(seq, np.int32)
    ext = seq - pre
    new_pages = index_jnp.cdiv(jnp.asarray(seq), ps) - index_jnp.cdiv(jnp.asarray(pre), ps)
    tok_start, total = capacity.saturating_prefix_sums(jnp.asarray(ext), MAX_TOKENS)
    page_start, pages = capacity.saturating_prefix_sums(new_pages, NUM_PAGES)
    assert (int(total) <= MAX_TOKENS and int(pages) <= NUM_PAGES) == fits
    if not fits:
      continue
    win = np.arange(1, 17, dtype=np.int32) * 3
    args = (win, pre, seq, _last(ps, pre), np.asarray(tok_start), np.asarray(page_start))
    want = index_jnp.extend_indices(*args, page_size=ps, out_len=MAX_TOKENS)
    got = pallas_kernels.extend_indices(*args, page_size=ps, out_len=MAX_TOKENS,
                                        interpret=params, backend="mosaic")
    np.testing.assert_array_equal(got, want)


def test_capacity_rule_exact_on_wrapping_sums():
  x = jnp.asarray([BIG, BIG, 1, 0], jnp.int32)
  assert bool(capacity.sum_exceeds(x, jnp.int32(BIG)))
  assert not bool(capacity.sum_exceeds(jnp.asarray([2**30, 2**30 - 1], jnp.int32),
                                       jnp.int32(BIG)))
  _, total = capacity.saturating_prefix_sums(jnp.asarray([2**30, 2**30, 7], jnp.int32),
                                             BIG - 1)
  assert int(total) == BIG  # saturated at cap + 1, never wrapped
  starts, total = capacity.saturating_prefix_sums(jnp.asarray([3, 0, 5], jnp.int32), 8)
  assert starts.tolist() == [0, 3, 3] and int(total) == 8
  assert capacity.sums_may_wrap(2, BIG) and not capacity.sums_may_wrap(2, 2**29)


# ---------------------------------------------------------------------------------------
# kernel="auto" follows the pool's device.
# ---------------------------------------------------------------------------------------

def _pretend_gpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert kernels.resolve("auto") == "triton"  # what the default backend alone would say


def test_auto_uses_the_pools_device_not_the_default_backend(monkeypatch):
  _pretend_gpu(monkeypatch)
  cpu = jax.devices("cpu")[0]
  ps = 4
  auto, ref = _cfg(ps, "auto"), _cfg(ps, "jnp")
  pre = np.asarray([0, 3, 8], np.int32)
  seq = np.asarray([5, 9, 8], np.int32)
  last = _last(ps, pre)
  state = jax.device_put(kv.init(auto), cpu)
  want = kv.alloc_extend(ref, kv.init(ref), pre, seq, last, max_tokens=32)
  # Under jit (the Triton kernel, lowered for CPU, would raise).
  got = jax.jit(functools.partial(kv.alloc_extend, auto, max_tokens=32))(state, pre, seq,
                                                                         last)
  _same(got, want)
  # Eagerly: the concrete state's device decides.
  _same(kv.alloc_extend(auto, state, pre, seq, last, max_tokens=32), want)
  dseq = seq + 1
  _same(jax.jit(functools.partial(kv.alloc_decode, auto))(state, dseq, seq - 1),
        kv.alloc_decode(ref, kv.init(ref), dseq, seq - 1))
  # The class with device="cpu", as in the README.
  a = kvs.PagedTokenToKVPoolAllocator(NUM_PAGES * ps, ps, None, "cpu", None, False,
                                     kernel="auto")
  total = int((seq - pre).sum())
  out = a.alloc_extend(pre, None, seq, None, last, total)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want[1])[:total])


def test_auto_compiles_one_branch(monkeypatch):
  _pretend_gpu(monkeypatch)
  cfg = _cfg(4, "auto")
  state = kv.init(cfg)
  rows = jnp.ones((4,), jnp.int32)
  lowered = jax.jit(functools.partial(kv.alloc_decode, cfg)).lower(state, rows + 1, rows)
  # No kernel launch of any kind (the word "triton" may appear in source-file metadata).
  assert "custom_call" not in lowered.as_text()
  hlo = lowered.compile().as_text()
  assert "conditional" not in hlo and "custom-call" not in hlo
  # The TPU lowering of the same call holds the Mosaic kernel (and no Triton).
  import lowering_check  # pylint: disable=g-import-not-at-top
  i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
  e = lowering_check.export_for("tpu_v6e", functools.partial(kv.alloc_decode, cfg),
                                jax.eval_shape(functools.partial(kv.init, cfg)), i32, i32)
  assert lowering_check.custom_call_targets(e).count("tpu_custom_call") == 1
  e = lowering_check.export_for("h200", functools.partial(kv.alloc_decode, cfg),
                                jax.eval_shape(functools.partial(kv.init, cfg)), i32, i32)
  assert lowering_check.custom_call_targets(e).count(
      lowering_check.TRITON_CUSTOM_CALL) == 1
