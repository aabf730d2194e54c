"""jax_kvalloc.serve's engine on a small random Llama (jax only; the real model is in
tests/test_serve_model.py): the paged run, with continuous batching, chunked prefill and
the prefix cache, generates exactly what each prompt alone generates, equals a
contiguous-cache run bit for bit (tokens and logits), returns every page, and compiles
each step kind once."""
import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.serve import engine as eng
from jax_kvalloc.serve import kv_store
from jax_kvalloc.serve import llama
from jax_kvalloc.serve import loader
from jax_kvalloc.serve.prefix_cache import PrefixCache
from gpu import needs_gpu

CFG = loader.LlamaConfig(vocab_size=97, hidden=32, intermediate=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rope_dim=16, rms_eps=1e-5, context_length=256, eos_id=5)
# 7 requests over 3 rows (rows are reused), a pool of 24 pages (admission waits for
# pages), chunks of 8 tokens (prompts of up to 33 are chunked), 3 decode steps a trip.
ECFG = eng.EngineConfig(page_size=4, num_pages=24, max_reqs=3, max_pages_per_req=16,
                        prefill_rows=2, chunk=8, decode_steps=3)


@functools.lru_cache(maxsize=None)
def _params():
  # Weights scaled up so that logits spread out (no near ties between the runs).
  p = loader.random_params(CFG, jax.random.PRNGKey(0), jnp.float32)
  return jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, p)


def _requests(seed=0, n=7, ignore_eos=True):
  rng = np.random.default_rng(seed)
  prefix = rng.integers(6, CFG.vocab_size, 13).tolist()   # 3 whole pages of 4 shared
  out = []
  for i in range(n):
    own = rng.integers(6, CFG.vocab_size, int(rng.integers(1, 21))).tolist()
    out.append(eng.Request(tuple((prefix if i % 2 == 0 else []) + own),
                           int(rng.integers(1, 12)), ignore_eos=ignore_eos))
  return out


def _run(ecfg=ECFG, reqs=None):
  e = eng.Engine(CFG, _params(), ecfg)
  return e.run(reqs or _requests()), e


@functools.lru_cache(maxsize=None)
def _paged():
  return _run()


def test_paged_run_batches_chunks_shares_and_returns_every_page():
  res, e = _paged()
  s = res.stats
  assert [len(g) for g in res.new_ids] == [r.max_new_tokens for r in _requests()]
  assert s["prefix_cache"]["hit_pages"] > 0                 # prefixes were borrowed
  assert s["steps"]["prefill"] > len(_requests()) / ECFG.prefill_rows   # chunked
  assert s["late_compiles"] == 0                            # one compile per kind
  rows = collections.Counter()
  for entry in e.log:
    rows[entry["kind"]] += 1
  assert rows["decode"] > 1
  # Engine.run raised if the pool or the host mirror lost a page; the default set also
  # needs requests to have waited for rows or pages (continuous batching).
  assert max(s["ttft_s"]) > min(s["ttft_s"])


def test_paged_equals_contiguous_bit_for_bit_and_each_prompt_alone():
  res, _ = _paged()
  contiguous, _ = _run(dataclasses.replace(ECFG, layout="contiguous"))
  assert contiguous.new_ids == res.new_ids
  # Every logit to the bit, although the paged run borrowed its shared prefixes (so its
  # prefill batches differ): each row's math is its own, wherever its K/V live.
  np.testing.assert_array_equal(np.concatenate(res.tops), np.concatenate(contiguous.tops))
  for i, req in enumerate(_requests()[:3]):     # each prompt alone, nothing batched
    alone, _ = _run(dataclasses.replace(ECFG, layout="contiguous"), [req])
    assert alone.new_ids[0] == res.new_ids[i], i


def test_paged_without_prefix_cache_equals_contiguous_bit_for_bit():
  nocache, _ = _run(dataclasses.replace(ECFG, prefix_cache=False))
  contiguous, _ = _run(dataclasses.replace(ECFG, layout="contiguous"))
  assert nocache.new_ids == contiguous.new_ids
  np.testing.assert_array_equal(np.concatenate(nocache.tops), np.concatenate(contiguous.tops))


def test_unrolled_layers_equal_scanned_ones():
  res, _ = _paged()
  unrolled, _ = _run(dataclasses.replace(ECFG, layers="unroll"))
  assert unrolled.new_ids == res.new_ids


def test_stops_at_eos_on_the_device():
  reqs = [dataclasses.replace(r, ignore_eos=False, max_new_tokens=11) for r in _requests()]
  res, _ = _run(reqs=reqs)
  full, _ = _run(reqs=[dataclasses.replace(r, ignore_eos=True) for r in reqs])
  stopped = 0
  for got, want in zip(res.new_ids, full.new_ids):
    if CFG.eos_id in want:
      stopped += 1
      assert got == want[:want.index(CFG.eos_id) + 1]
    else:
      assert got == want
  assert stopped  # this seed's tokens do hit eos


def test_requests_that_cannot_fit_are_refused_by_name():
  e = eng.Engine(CFG, _params(), ECFG)
  with pytest.raises(eng.RequestError, match="request 1: .* more than this engine holds"):
    e.check([eng.Request((7,), 3), eng.Request(tuple(range(6, 66)), 10)])
  with pytest.raises(eng.RequestError, match="request 0: max_new_tokens"):
    e.check([eng.Request((7,), 0)])
  with pytest.raises(eng.RequestError, match="outside the vocabulary"):
    e.check([eng.Request((97,), 2)])
  with pytest.raises(ValueError, match="layout"):
    eng.EngineConfig(layout="ring")


def test_prefix_cache_lends_chains_and_evicts_lru_leaves_only():
  cache = PrefixCache(page_size=2, capacity=3)
  a = cache.insert(None, [1, 2, 3, 4], 0)
  b = cache.insert(a, [1, 2, 3, 4], 1)
  assert cache.insert(None, [1, 2, 9, 9], 0) is None        # page 0 is cached already
  c = cache.insert(None, [5, 6], 0)
  assert cache.insert(None, [7, 8], 0) is None               # no slot left
  assert [n.slot for n in cache.match([1, 2, 3, 4, 5], 2)] == [a.slot, b.slot]
  assert cache.match([1, 2, 3, 4, 5], 1) == [a]
  cache.let_go([a, b])                                       # the inserting row finished
  cache.let_go([c])
  cache.acquire([c])                                         # a new row borrows c
  assert cache.evictable() == 2
  assert cache.evict(1) == [b.slot]                          # a leaf first, never c
  assert cache.evict(5) == [a.slot] and len(cache) == 1
  cache.let_go([c])
  assert cache.evict(1) == [c.slot] and cache.evicted == 3


def test_attention_masks_padding_and_matches_a_dense_softmax():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
  pos = jnp.asarray([[2, 3, 4], [0, 0, 0]], jnp.int32)
  out = np.asarray(llama.attend(q, k, v, pos, jnp.asarray([5, 1], jnp.int32)))
  for b in range(2):
    for c in range(3):
      for h in range(4):
        n = min(int(pos[b, c]) + 1, [5, 1][b])
        s = np.asarray(k[b, :n, h // 2]) @ np.asarray(q[b, c, h]) / np.sqrt(8)
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(out[b, c, h], p @ np.asarray(v[b, :n, h // 2]),
                                   rtol=1e-5, atol=1e-5)


def test_pallas_decode_lowers_for_h200_at_smollm2_shapes():
  # The engine's decode-kernel call (Pallas' GPU paged_attention, Triton), lowered for an
  # abstract H200 at SmolLM2's heads with 256 rows of 1024 tokens in pages of 16.
  import lowering_check  # pylint: disable=g-import-not-at-top
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    pytest.skip(f"jax {jax.__version__} has no pallas.ops.gpu.paged_attention ({e})")
  cfg, rows, width, ps = loader.SMOLLM2_135M, 256, 64, 16
  spec = jax.ShapeDtypeStruct
  pages = spec((cfg.num_kv_heads, rows * width + 1, ps, cfg.head_dim), jnp.bfloat16)
  fn = functools.partial(kv_store.pallas_decode, interpret=False)
  ex = lowering_check.export_for(
      "h200", fn, spec((rows, 1, cfg.num_heads, cfg.head_dim), jnp.bfloat16), pages, pages,
      spec((rows, width), jnp.int32), spec((rows,), jnp.int32))
  assert lowering_check.custom_call_targets(ex)


def test_pallas_decode_in_the_interpreter_equals_gather():
  # Paged, and contiguous rows viewed as consecutive pages (the benchmark's baseline).
  res, _ = _paged()
  pallas, _ = _run(dataclasses.replace(ECFG, impl="pallas"))
  assert pallas.new_ids == res.new_ids
  contiguous, _ = _run(dataclasses.replace(ECFG, impl="pallas", layout="contiguous"))
  assert contiguous.new_ids == res.new_ids


@pytest.mark.gpu
@needs_gpu
def test_gpu_pallas_decode_equals_gather_and_compiles_once():
  cfg = dataclasses.replace(ECFG, impl="pallas", layers="unroll")
  res, _ = _run(cfg)
  ref, _ = _run(dataclasses.replace(ECFG, layers="unroll"))
  assert res.new_ids == ref.new_ids
  assert res.stats["late_compiles"] == 0


def test_bench_writes_a_result_folder(tmp_path):
  from jax_kvalloc.serve import bench  # pylint: disable=g-import-not-at-top
  out = tmp_path / "2026-01-01-cpu-serve"
  assert bench.main(["--tiny", "--out", str(out), "--batches", "3", "--prompt-len", "12",
                     "--new-tokens", "6", "--decode-steps", "2", "--prefill-rows", "2"]) == 0
  doc = __import__("json").loads((out / "serve.json").read_text())
  paged, contiguous = doc["cases"]
  assert (paged["layout"], contiguous["layout"]) == ("paged", "contiguous")
  assert paged["same_tokens"] and paged["late_compiles_cold"] == 0
  assert paged["compiles_warm_run"] == 0 and paged["table"]["share"] > 0
  assert paged["decode_tokens_per_s"] > 0 and contiguous["prefill_tokens_per_s"] > 0
  assert "| 3 | paged |" in bench.table(doc)
  assert (out / "manifest.json").exists()


def test_bench_figures_from_any_log():
  # Decode figures come from the round trips with the most rows (no trip had every
  # request decoding at batch 256 on the H200: a division by zero); a log without a
  # decode trip gives null rates, not an exception; housekeeping-only steps are no trips.
  from jax_kvalloc.serve import bench  # pylint: disable=g-import-not-at-top
  pre = dict(kind="prefill", s=0.5, tokens=100)
  log = [pre, dict(kind="decode", s=0.01, tokens=8, rows=2),
         dict(kind="decode", s=0.02, tokens=12, rows=3),
         dict(kind="decode", s=0.04, tokens=12, rows=3),
         dict(kind="decode", s=9.0, flush=True)]
  f = bench.step_figures(log)
  assert (f["decode_rows"], f["decode_trips"], f["decode_trips_all"]) == (3, 2, 3)
  assert f["decode_tokens_per_s"] == pytest.approx(24 / 0.06)
  assert f["decode_step_median_s"] == pytest.approx(0.03 / 4)
  assert f["prefill_tokens_per_s"] == pytest.approx(200) and f["prefill_steps"] == 1
  none = bench.step_figures([pre])
  assert none["decode_tokens_per_s"] is None and none["decode_trips"] == 0
  assert bench.step_figures([])["prefill_tokens_per_s"] is None
  case = dict(batch=4, layout="paged", page_size=16, prefill_rows=2, **none,
              ttft_median_s=0.1, ttft_max_s=0.2, late_compiles_cold=0, compiles_warm_run=0)
  doc = dict(model="tiny", dtype="float32", device="cpu", cases=[case],
             paged_over_contiguous_decode={})
  assert "| 4 | paged | 0 | - | - ms | 200 |" in bench.table(doc)


def test_bench_records_a_refused_configuration():
  # An EngineConfig that refuses its arguments (e.g. a page size the Pallas kernel cannot
  # run) is a case with its error, before any weights or compiles are needed.
  from jax_kvalloc.serve import bench  # pylint: disable=g-import-not-at-top
  case = bench.run_case(bench.TINY, None, batch=4, layout="paged", prompt_len=12,
                        new_tokens=6, decode_steps=2, page_size=16, prefill_rows=2,
                        impl="nosuch", layers="scan", seed=0, pool_fraction=0.5)
  assert case["error"].startswith("ValueError: impl must be one of")
  assert case["num_pages"] == 4 and case["pool_fraction"] == 0.5   # half of 4 rows x 2 pages
  doc = dict(model="tiny", dtype="float32", device="cpu", cases=[case],
             paged_over_contiguous_decode={})
  assert "refused: ValueError: impl must be one of" in bench.table(doc)
  assert "refused" in bench.summary(case)
