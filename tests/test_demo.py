"""`jax-kvalloc demo`: the toy decoder served through the request table generates exactly
the tokens of the same model with a contiguous per-request KV cache (fast settings)."""
import collections
import jax
import pytest

from jax_kvalloc.tools import cli
from jax_kvalloc.tools import demo
from gpu import needs_gpu

# Small enough for CI: 8 requests over 5 serving rows, so that rows are reused, prompts
# are chunked (chunk 8 < prompts of up to 12 + 24 tokens) and admission defers chunks
# past the 24-token budget. The CLI run below uses the same settings (and compiles).
FAST = dict(num_requests=8, d_model=32, max_reqs=6, max_pages_per_req=12, pool_pages=64,
            max_tokens=24, chunk=8, prefix_len=12, prompt_len=(2, 24), new_tokens=(3, 8))
FAST_ARGS = ["--num-requests", "8", "--d-model", "32", "--max-reqs", "6",
             "--max-pages-per-req", "12", "--pool-pages", "64", "--max-tokens", "24",
             "--chunk", "8", "--prefix-len", "12", "--prompt-len", "2,24",
             "--new-tokens", "3,8"]


def test_paged_tokens_equal_contiguous(monkeypatch):
  cfg = demo.DemoConfig(**FAST)
  placed = []   # (request id, table row) each time a request takes a row
  running = demo._Running  # pylint: disable=protected-access

  def record(req, row):
    placed.append((req["id"], row))
    return running(req, row)
  monkeypatch.setattr(demo, "_Running", record)
  res = demo.run(cfg)
  assert res["identical"], (res["paged"], res["reference"])
  reqs = res["requests"]
  assert any(r["shared"] for r in reqs) and not all(r["shared"] for r in reqs)
  assert any(len(r["prompt"]) > cfg.chunk for r in reqs)         # chunked prefill
  rows = collections.Counter(row for rid, row in placed if rid >= 0)
  assert sorted(rid for rid, _ in placed if rid >= 0) == list(range(cfg.num_requests))
  assert max(rows.values()) > 1 and demo.PREFIX_ROW not in rows  # rows reused
  assert res["deferred"] > 0                                       # admission at work
  assert res["decode_steps"] > 0
  # The allocator's share of a step is a timing (replayed steps against whole steps): it
  # is reported, never asserted beyond being measured (under load it can exceed 1).
  assert res["share"]["share"] > 0
  assert res["late_compiles"] == 0          # one compile per step kind, then none


def test_pallas_decode_kernel_tokens_equal_contiguous():
  # Decode steps attend through Pallas' GPU paged_attention (its interpreter here) over
  # pages written by attention.write_kv_split.
  res = demo.run(demo.DemoConfig(**FAST, attention="pallas"))
  assert res["identical"], (res["paged"], res["reference"])
  assert res["decode_steps"] > 0 and res["late_compiles"] == 0


def test_cli_demo_prints_identical(capsys):
  assert cli.main(["demo"] + FAST_ARGS) == 0
  out = capsys.readouterr().out
  assert "tokens identical to the contiguous-cache run: YES" in out
  assert "tokens/s" in out and f"on {jax.devices()[0]}" in out


def test_cli_demo_bad_setting_is_a_clear_error(capsys):
  assert cli.main(["demo", "--prefix-len", "5"]) == 2   # not whole pages of 4
  assert "prefix_len=5 must be a multiple of page_size=4" in capsys.readouterr().err


def test_rpa_reference_tokens_equal_contiguous():
  # Every step through JAX's ref_ragged_paged_attention (one compile per step: a few
  # requests only) over pages written by attention.write_kv_combined.
  cfg = demo.DemoConfig(**dict(FAST, num_requests=3, new_tokens=(2, 3)), attention="rpa-ref")
  res = demo.run(cfg)
  assert res["identical"], (res["paged"], res["reference"])
  assert res["decode_steps"] > 0


def test_pallas_decode_kernel_lowers_for_h200_at_demo_shapes():
  # The default demo's decode-kernel call, lowered through Pallas' Triton path for an
  # abstract H200 (Python-side lowering: block shapes, powers of two).
  import functools  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import lowering_check  # pylint: disable=g-import-not-at-top
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    import pytest  # pylint: disable=g-import-not-at-top
    pytest.skip(f"jax {jax.__version__} has no pallas.ops.gpu.paged_attention ({e})")
  cfg = demo.DemoConfig()
  width, block, splits = demo._decode_blocks(cfg)  # pylint: disable=protected-access
  assert width % splits == 0 and block * cfg.page_size >= 16
  heads, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
  pages = demo.alloc_config(cfg).num_slots // cfg.page_size
  spec = jax.ShapeDtypeStruct
  kv = spec((heads, pages, cfg.page_size, dh), jnp.float32)
  ex = lowering_check.export_for(
      "h200", functools.partial(gpu_pa.paged_attention, pages_per_compute_block=block,
                                k_splits=splits),
      spec((cfg.max_reqs, heads, dh), jnp.float32), kv, kv,
      spec((cfg.max_reqs, width), jnp.int32), spec((cfg.max_reqs,), jnp.int32))
  assert lowering_check.custom_call_targets(ex)


def test_tpu_ragged_kernel_lowers_at_demo_shapes():
  # What `--attention pallas` runs on a TPU (head dim 128: --d-model 512), lowered for an
  # abstract TPU with the dense attention inputs' shapes, prefill and decode batches.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc import request_table as rt  # pylint: disable=g-import-not-at-top
  import lowering_check  # pylint: disable=g-import-not-at-top
  try:
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    import pytest  # pylint: disable=g-import-not-at-top
    pytest.skip(f"jax {jax.__version__} has no pallas.ops.tpu.ragged_paged_attention ({e})")
  cfg = demo.DemoConfig(d_model=512)
  heads, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
  spec = jax.ShapeDtypeStruct
  b = cfg.max_reqs
  att = rt.AttentionInputs(page_indices=spec((b, cfg.max_pages_per_req), jnp.int32),
                           kv_lens=spec((b,), jnp.int32), cu_q_lens=spec((b + 1,), jnp.int32),
                           num_seqs=spec((1,), jnp.int32))
  pages = spec((demo.alloc_config(cfg).num_slots // cfg.page_size, cfg.page_size,
                2 * heads, dh), jnp.float32)
  for tokens in (cfg.max_tokens, b):
    ex = lowering_check.export_for(
        "tpu_v6e", lambda q, p, a: demo._rpa_kernel(q, p, a, dh ** -0.5),  # pylint: disable=protected-access
        spec((tokens, heads, dh), jnp.float32), pages, att)
    assert "tpu_custom_call" in lowering_check.custom_call_targets(ex)


@pytest.mark.gpu
@needs_gpu
def test_pallas_demo_on_gpu_is_identical_and_compiles_once():
  # Triton's paged_attention for decode on the GPU; a second, warm run compiles nothing.
  res = demo.run(demo.DemoConfig(attention="pallas"), repeat=2)
  assert res["identical"], (res["paged"], res["reference"])
  assert res["late_compiles"] == 0
