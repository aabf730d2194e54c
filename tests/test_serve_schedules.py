"""jax_kvalloc.serve's engine under drawn schedules, with a stand-in model whose next token
is an exact function of what its KV cache holds: every token's id and position are
written at the slot the request table gives it and read back through the row's page
list, so a wrong slot, page, table entry, borrowed prefix or recomputed token after a
retraction changes a token. The oracle is the same function over each request's true
token history.

Drawn: rows 1-16, pool pages from the fewest that hold one request up, page size 1, 4 or
16, chunk, prefill rows, decode steps per round trip, max_new_tokens 1-64, prompts that
share prefixes, end-of-sequence on and off, prefix cache on and off, paged or contiguous.
Every run also checks that the pool is whole at the end (Engine.run raises otherwise) and
that no step compiled twice.
"""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.serve import engine as eng
from jax_kvalloc.serve import kv_store
from jax_kvalloc.serve import loader

VOCAB, EOS, MOD = 61, 3, 1009
# One layer, one KV head of 2 values per token (its id and its position).
CFG = loader.LlamaConfig(vocab_size=VOCAB, hidden=2, intermediate=2, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=2, rope_theta=1.0, rope_dim=2,
                         rms_eps=1e-5, context_length=4096, eos_id=EOS)


def _term(tok, pos, j):
  return (((tok + 1) * 13 + (pos + 1) * 7) % MOD) * ((j * 31 + 17) % MOD)


def oracle_next(history):
  """The stand-in's next token after `history` (token ids at positions 0, 1, ...)."""
  return sum(_term(t, j, j) for j, t in enumerate(history)) % MOD % VOCAB


def standin(ecfg, caches, tokens, last, addr):
  """The engine's model hook (eng.StandIn): writes each token's (id, position) at its
  slot, reads the row back through the table and hashes tokens j <= the query's
  position (and < kv_len): oracle_next on the device."""
  kc, vc = caches
  kv = jnp.stack([tokens, addr.q_pos], -1).astype(kc.dtype)[:, :, None, :]
  layer, keys, _ = kv_store.write_and_gather(ecfg.layout, (kc[0], vc[0]), addr, kv, kv)
  caches = (kc.at[0].set(layer[0]), vc.at[0].set(layer[1]))
  tok = keys[:, :, 0, 0].astype(jnp.int32)
  pos = keys[:, :, 0, 1].astype(jnp.int32)
  q = jnp.take_along_axis(addr.q_pos, last[:, None], axis=1)
  j = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]
  mask = (j <= q) & (j < addr.kv_len[:, None])
  h = jnp.sum(jnp.where(mask, _term(tok, pos, j), 0), axis=1) % MOD
  return caches, (h % VOCAB).astype(jnp.int32), h.astype(jnp.float32)


def expected(req):
  gen = []
  history = list(req.prompt)
  for _ in range(req.max_new_tokens):
    gen.append(oracle_next(history + gen))
    if not req.ignore_eos and gen[-1] == EOS:
      break
  return gen


def serve(ecfg, reqs):
  res = eng.Engine(CFG, None, ecfg, model=standin).run(reqs)
  for i, (got, req) in enumerate(zip(res.new_ids, reqs)):
    assert got == expected(req), (i, req, got)
  assert res.stats["late_compiles"] == 0, res.stats
  return res


def _worst(req):
  return len(req.prompt) + req.max_new_tokens - 1


def _ecfg(reqs, **kw):
  ps = kw.setdefault("page_size", 4)
  width = -(-max(map(_worst, reqs)) // ps)
  kw.setdefault("max_pages_per_req", width)
  kw.setdefault("num_pages", width)
  return eng.EngineConfig(**kw)


@st.composite
def schedules(draw, pressure=False):
  """(EngineConfig, requests); pressure: several rows, long budgets, a small paged pool
  and no reserve (retractions are likely)."""
  ps = draw(st.sampled_from([1, 4, 16]))
  max_reqs = draw(st.integers(2 if pressure else 1, 16))
  n = draw(st.integers(1, 2 * max_reqs + 2))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  prefixes = [rng.integers(4, VOCAB, int(rng.integers(1, 48))).tolist() for _ in range(2)]
  eos = draw(st.booleans())
  reqs = []
  for _ in range(n):
    which = int(rng.integers(0, 3))
    own = rng.integers(4, VOCAB, int(rng.integers(0 if which < 2 else 1, 24))).tolist()
    prompt = (prefixes[which] if which < 2 else []) + own
    reqs.append(eng.Request(tuple(prompt), draw(st.integers(16 if pressure else 1, 64)),
                            ignore_eos=not eos or draw(st.booleans())))
  width = -(-max(map(_worst, reqs)) // ps)
  total = sum(-(-_worst(r) // ps) for r in reqs)
  # Half the pools hold at most 1.5 requests' worst cases (retractions are likely).
  pages = draw(st.one_of(st.integers(width, width + width // 2),
                         st.integers(width, width if pressure else max(width, total))))
  prefill_rows = draw(st.integers(1, max_reqs))
  ecfg = eng.EngineConfig(
      page_size=ps, num_pages=pages, max_reqs=max_reqs,
      max_pages_per_req=width + draw(st.integers(0, 2)), prefill_rows=prefill_rows,
      chunk=draw(st.integers(1, 40)), decode_steps=draw(st.integers(1, 8)),
      layout=draw(st.sampled_from(["paged"] * 4 + ["contiguous"] * (not pressure))),
      prefix_cache=draw(st.sampled_from([True, True, True, False])),
      new_token_ratio=draw(st.sampled_from([0.0] if pressure else [0.0, 0.1, 0.5, 1.0])))
  return ecfg, reqs


@hypothesis.settings(max_examples=4, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(schedules())
def test_drawn_schedules_give_the_oracles_tokens(case):
  _drawn(*case)


@pytest.mark.slow   # 40 engine configurations, two compiles each
@hypothesis.settings(max_examples=40, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(schedules())
def test_drawn_schedules_give_the_oracles_tokens_slow(case):
  _drawn(*case)


@pytest.mark.slow   # 20 engine configurations, two compiles each
@hypothesis.settings(max_examples=20, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(schedules(pressure=True))
def test_drawn_small_pools_give_the_oracles_tokens_slow(case):
  _drawn(*case)


def _drawn(ecfg, reqs):
  s = serve(ecfg, reqs).stats
  hypothesis.event("retracted" if s["retractions"] else "no retraction")
  hypothesis.event("prefix pages reused" if (s["prefix_cache"] or {}).get("hit_pages")
                   else "no prefix reuse")


def _reqs(seed, n, new, prompt_len=(5, 30), ignore_eos=True, prefix=0):
  rng = np.random.default_rng(seed)
  shared = rng.integers(4, VOCAB, prefix).tolist()
  return [eng.Request(tuple(shared + rng.integers(4, VOCAB, int(rng.integers(*prompt_len))
                                                  ).tolist()), new, ignore_eos=ignore_eos)
          for _ in range(n)]


@pytest.mark.parametrize("cached", [True, False])
def test_a_small_pool_retracts_and_recomputes_the_same_tokens(cached):
  # 8 requests of up to 29 + 40 tokens over 6 rows and a pool of 40 pages of 4 (one
  # request needs up to 18): admitted on their next round trips, they outgrow the pool.
  reqs = _reqs(1, 8, 40, prefix=8)
  ecfg = _ecfg(reqs, page_size=4, num_pages=40, max_reqs=6, prefill_rows=2, chunk=8,
               decode_steps=4, prefix_cache=cached)
  s = serve(ecfg, reqs).stats
  assert s["retractions"] > 0 and s["recomputed_tokens"] > 0, s
  if cached:   # readmitted requests borrowed their own pages back
    assert s["prefix_cache"]["hit_pages"] > 0


@pytest.mark.parametrize("layout,rows", [("paged", 1), ("paged", 2), ("contiguous", 1),
                                         ("contiguous", 2)])
def test_rows_that_all_finish_together_while_others_wait(layout, rows):
  # Each step's finished rows are released in the next step: when every running request
  # finishes at once, a step with only that housekeeping runs before the next admission.
  reqs = _reqs(2, 5, 3, prompt_len=(6, 7))
  res = serve(_ecfg(reqs, max_reqs=rows, prefill_rows=rows, num_pages=20, layout=layout),
              reqs)
  assert res.stats["flushes"] == -(-len(reqs) // rows) - 1


def test_emptying_a_large_prefix_cache_takes_several_steps_of_the_same_shape():
  # 30 cached pages of 1 token, 4 evictions a step (evict_cap): no step outgrows its
  # capacity and nothing compiles again.
  reqs = _reqs(3, 2, 2, prompt_len=(30, 31))
  ecfg = _ecfg(reqs, page_size=1, num_pages=64, max_reqs=1, prefill_rows=1, chunk=2,
               decode_steps=1)
  assert ecfg.evict_cap == 4
  serve(ecfg, reqs)


def test_a_step_input_beyond_its_capacity_fails_loudly():
  with pytest.raises(RuntimeError, match="evict: 5 entries exceed the step's static capacity 4"):
    eng._pad([1, 2, 3, 4, 5], 4, "evict")   # pylint: disable=protected-access


def test_a_refused_eviction_is_not_ok():
  # Evicting a cache slot that holds no page (or a page that is free) is refused by the
  # pool: the step's ok is False, and Engine._run_step raises.
  # (The engine of test_rows_that_all_finish_together_while_others_wait[paged-1].)
  ecfg = _ecfg(_reqs(2, 5, 3, prompt_len=(6, 7)), max_reqs=1, prefill_rows=1, num_pages=20)
  e = eng.Engine(CFG, None, ecfg, model=standin)
  e.carry = e._fresh_carry()   # pylint: disable=protected-access
  hk = dict(adopt=[], evict=[0], release=[], borrow=[])
  with pytest.raises(RuntimeError, match="refused"):
    e._flush(hk)               # pylint: disable=protected-access


def test_a_request_waiting_for_a_prefix_does_not_block_the_others():
  # Request 1 shares request 0's 24-token prefix, which request 0 is still prefilling
  # (chunks of 4): it waits; request 2 shares nothing and is admitted meanwhile.
  rng = np.random.default_rng(5)
  prefix = rng.integers(4, VOCAB, 24).tolist()
  reqs = [eng.Request(tuple(prefix + [7]), 4, ignore_eos=True),
          eng.Request(tuple(prefix + [8, 9]), 4, ignore_eos=True),
          eng.Request(tuple(rng.integers(4, VOCAB, 10).tolist()), 4, ignore_eos=True)]
  ecfg = _ecfg(reqs, max_reqs=3, prefill_rows=3, chunk=4, num_pages=30)
  res = serve(ecfg, reqs)
  ttft = res.stats["ttft_s"]
  assert ttft[2] < ttft[1]                          # 2 went first
  assert res.stats["prefix_cache"]["hit_pages"] >= 6   # 1 borrowed 0's prefix
