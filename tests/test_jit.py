"""The functional core under jax transformations: no recompiles within a bucket, no host
transfer in a jitted serving step, vmap over pools, scan over steps, donation."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from model import ModelAllocator

CFG = kv.AllocatorConfig(size=256 * 4, page_size=4)


def _extend_inputs(rng, bs, rows, max_tokens, ps=4):
  """Fresh prefill batch padded to `rows`: prefix 0, total tokens <= max_tokens."""
  seq = rng.integers(1, max(2, max_tokens // bs), bs)
  pad = lambda x, fill=0: np.concatenate([x, np.full(rows - bs, fill)]).astype(np.int32)
  return pad(np.zeros(bs)), pad(seq), pad(np.full(bs, -1), -1), int(seq.sum())


def test_no_recompile_within_a_bucket():
  rng = np.random.default_rng(0)
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, pre, seq, last, num_reqs):
    return kv.alloc_extend(CFG, state, pre, seq, last, max_tokens=512, num_reqs=num_reqs)

  state = kv.init(CFG)
  for bs in (1, 3, 5, 8, 2, 7):         # batch sizes within the bucket of 8 rows
    pre, seq, last, n = _extend_inputs(rng, bs, 8, 512)
    state, out, ok = step(state, pre, seq, last, num_reqs=jnp.int32(bs))
    assert bool(ok)
    state = kv.free(CFG, state, out)
  chex.clear_trace_counter()


def test_class_compiles_once_per_bucket():
  rng = np.random.default_rng(1)
  a = kvs.PagedTokenToKVPoolAllocator(512 * 4, 4, debug=False)
  programs = a._pools[0].backend.ops._fns  # pylint: disable=protected-access  # the class's fast path

  def compiled():  # every program but the exact-length slices, with its compile count
    return {k: f._cache_size() for k, f in programs.items() if k[0] != "slice"}

  a.alloc_extend([0], None, [5], None, [-1], 5)
  a.free(np.array([4]))
  size = compiled()
  for bs in range(1, 9):     # 1..8 rows, 1..64 tokens: one bucket
    seq = rng.integers(1, 64 // bs + 1, bs)
    out = a.alloc_extend(np.zeros(bs, int), None, seq, None, np.full(bs, -1), int(seq.sum()))
    assert out is not None
    a.free(np.asarray(out))
  assert compiled() == size
  a.alloc_extend(np.zeros(9, int), None, np.ones(9, int), None, np.full(9, -1), 9)
  assert compiled() == {**size, ("extend", 16, 64): 1}  # 9 rows: the next bucket


def test_jitted_serving_step_needs_no_host_transfer():
  @functools.partial(jax.jit, donate_argnums=0)
  def serving_step(state, pre, seq, last, dseq, dlast, finished):
    state = kv.free(CFG, state, finished)
    state, ext_out, ok1 = kv.alloc_extend(CFG, state, pre, seq, last, max_tokens=256)
    state, dec_out, ok2 = kv.alloc_decode(CFG, state, dseq, dlast)
    return state, ext_out, dec_out, ok1 & ok2

  rng = np.random.default_rng(2)
  pre, seq, last, _ = _extend_inputs(rng, 5, 8, 256)
  args = [jnp.asarray(x) for x in (pre, seq, last, np.full(8, 2), np.arange(8) * 4 + 4,
                                   np.zeros(64, np.int32))]
  state = kv.init(CFG)
  serving_step(kv.init(CFG), *args)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    state, ext_out, dec_out, ok = serving_step(state, *args)
    state, ext_out, dec_out, ok = serving_step(state, *args)
  assert bool(ok)


def test_vmap_over_independent_pools():
  rng = np.random.default_rng(3)
  pools = 3
  states = [kv.init(CFG) for _ in range(pools)]
  # Give each pool a different history so their free lists differ.
  for i in range(pools):
    states[i], out, _ = kv.alloc(CFG, states[i], jnp.int32(4 * (i + 1)), max_size=64)
    states[i] = kv.free(CFG, states[i], out[:4])
  batch = [_extend_inputs(rng, 4, 8, 128) for _ in range(pools)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  pre, seq, last = (jnp.stack([b[k] for b in batch]) for k in range(3))
  vextend = jax.jit(jax.vmap(functools.partial(kv.alloc_extend, CFG, max_tokens=128)))
  new, out, ok = vextend(stacked, pre, seq, last)
  for i in range(pools):
    s_i, out_i, ok_i = kv.alloc_extend(CFG, states[i], pre[i], seq[i], last[i],
                                       max_tokens=128)
    np.testing.assert_array_equal(out[i], out_i)
    assert bool(ok[i]) == bool(ok_i)
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], new), s_i)


@pytest.mark.parametrize("need_sort", [False, True])
def test_scan_over_decode_steps_matches_model(need_sort):
  cfg = kv.AllocatorConfig(size=64 * 4, page_size=4, need_sort=need_sort)
  bs, steps = 8, 20
  model = ModelAllocator(cfg.size, 4, need_sort)
  first = model.alloc_extend([0] * bs, [1] * bs, [-1] * bs)
  state, out, _ = kv.alloc_extend(cfg, kv.init(cfg), jnp.zeros(bs, jnp.int32),
                                  jnp.ones(bs, jnp.int32), jnp.full(bs, -1, jnp.int32),
                                  max_tokens=bs)
  np.testing.assert_array_equal(out, first)

  def step(carry, t):
    state, last = carry
    seq = jnp.full((bs,), 1, jnp.int32) + t + 1
    state, slots, ok = kv.alloc_decode(cfg, state, seq, last)
    # Every 5th step the first request finishes and restarts: free its page.
    state = kv.free(cfg, state, jnp.where((t % 5 == 4) & (jnp.arange(bs) == 0), slots, 0))
    return (state, slots), (slots, ok)

  (state, _), (slots, oks) = jax.lax.scan(step, (state, out), jnp.arange(steps))
  last = list(first)
  for t in range(steps):
    want = model.alloc_decode([t + 2] * bs, last)
    np.testing.assert_array_equal(slots[t], want, err_msg=f"step {t}")
    if t % 5 == 4:
      model.free([want[0]])
    last = want
  assert bool(jnp.all(oks))
  np.testing.assert_array_equal(kv.live_free_pages(state), model.free_pages)
  np.testing.assert_array_equal(kv.live_release_pages(state), model.release_pages)


def test_donated_state_is_reused_in_place():
  free = jax.jit(kv.free, static_argnames=("config",), donate_argnames=("state",))
  state = kv.init(CFG)
  old = state.free_ring
  # The compiled program aliases every state buffer to an output (XLA updates in place)...
  hlo = free.lower(CFG, state, jnp.zeros(64, jnp.int32)).compile().as_text()
  assert hlo.count("input_output_alias") or "may-alias" in hlo or "must-alias" in hlo, hlo[:2000]
  new = free(CFG, state, jnp.zeros(64, jnp.int32))
  # ...and the donated input is consumed (every backend jax supports donates, CPU too).
  assert old.is_deleted()
  np.testing.assert_array_equal(kv.live_free_pages(new), np.arange(1, 257))


@pytest.mark.parametrize("bs", [1, 33])
def test_class_decode_is_one_launch(monkeypatch, bs):
  """A steady alloc_decode of up to 64 requests is one program launch (no slice of a
  bucket-sized output, no pad of a device last_loc), with host inputs and with device
  seq_lens / last_loc beside host copies (as SGLang passes them); same slots."""
  from jax_kvalloc.sglang.backends import device as device_ops  # pylint: disable=g-import-not-at-top
  launches = []
  orig = device_ops.Programs.fn
  monkeypatch.setattr(device_ops.Programs, "fn", lambda self, key: (
      launches.append(key), orig(self, key))[1])
  ps = 4
  outs = []
  for on_device in (False, True):
    a = kvs.PagedTokenToKVPoolAllocator(256 * ps, ps, kernel="jnp", debug=False)
    a.alloc(ps)                                           # page 1 held: slots 4..7
    seq = np.full(bs, 2 * ps + 1)                         # each row starts a page
    last = np.full(bs, 2 * ps - 1)
    args = ((jnp.asarray(seq, jnp.int32), seq, jnp.asarray(last, jnp.int32)) if on_device
            else (seq, seq, last))
    for _ in range(2):                                     # the first call compiles
      del launches[:]
      out = a.alloc_decode(*args)
      assert len(launches) == 1, launches
      outs.append(np.asarray(out))
      a.clear()
      a.alloc(ps)
  np.testing.assert_array_equal(outs[0], outs[2])
  np.testing.assert_array_equal(outs[0], ps * np.arange(2, bs + 2))
