"""`jax-kvalloc demo`: the toy decoder served through the request table generates exactly
the tokens of the same model with a contiguous per-request KV cache (fast settings)."""
import collections
import jax

from jax_kvalloc.tools import cli
from jax_kvalloc.tools import demo

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


def test_cli_demo_prints_identical(capsys):
  assert cli.main(["demo"] + FAST_ARGS) == 0
  out = capsys.readouterr().out
  assert "tokens identical to the contiguous-cache run: YES" in out
  assert "tokens/s" in out and f"on {jax.devices()[0]}" in out


def test_cli_demo_bad_setting_is_a_clear_error(capsys):
  assert cli.main(["demo", "--prefix-len", "5"]) == 2   # not whole pages of 4
  assert "prefix_len=5 must be a multiple of page_size=4" in capsys.readouterr().err
