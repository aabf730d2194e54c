"""The sliding-window allocator (SPEC 13): hand-worked vectors (model, functional core,
class on both backends), random lock-step traces against the model and against SGLang
0.5.23's released SWATokenToKVPoolAllocator, refusals, snapshots, debug mode, and the
functional core under jit / vmap / scan / donation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc import state as st
from jax_kvalloc import swa as core
from swa_impls import ClassImpl, CoreImpl, SGLangImpl, sglang_swa_class
from swa_model import ModelSWA
from swa_trace import run_trace


def _sglang_error():
  try:
    sglang_swa_class()
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


SGLANG_ERROR = _sglang_error()
needs_sglang = pytest.mark.skipif(SGLANG_ERROR is not None,
                                  reason=f"sglang 0.5.23 not importable: {SGLANG_ERROR}")


def _impls(size, size_swa, ps, need_sort, which):
  make = {"model": lambda: _ModelImpl(size, size_swa, ps, need_sort),
          "core": lambda: CoreImpl(size, size_swa, ps, need_sort),
          "device": lambda: ClassImpl(size, size_swa, ps, need_sort, "device"),
          "host": lambda: ClassImpl(size, size_swa, ps, need_sort, "host")}
  return make[which]()


class _ModelImpl:
  """The model behind the impl interface (for the hand vectors)."""
  name = "model"

  def __init__(self, size, size_swa, ps, need_sort):
    self.m = ModelSWA(size, size_swa, ps, need_sort)

  def __getattr__(self, name):
    return getattr(self.m, name)

  def lists(self):
    m = self.m
    return m.full.free_pages, m.full.release_pages, m.swa.free_pages, m.swa.release_pages

  def peers(self, slots):
    return self.m.translate(slots)


IMPLS = ["model", "core", "device", "host"]


def _lists(impl):
  return tuple(list(map(int, x)) for x in impl.lists())


# -- hand-worked vectors (ps = 4: full 8 pages, SWA 4 pages) -------------------------------

@pytest.mark.parametrize("which", IMPLS)
def test_paged_vector(which):
  a = _impls(32, 16, 4, False, which)
  # A 10-token prefill whose SWA KV covers only its last 6 tokens: full pages 1, 2, 3
  # (slots 4..13); SWA as a fresh 6-token request: pages 1, 2 (slots 4..9) for tokens
  # 4..9, i.e. full slots 8..13; tokens 0..3 (full slots 4..7) get no peer.
  assert list(map(int, a.alloc_extend_swa_tail(0, 10, -1, 6))) == list(range(4, 14))
  assert list(map(int, a.peers(list(range(4, 14))))) == [0] * 4 + list(range(4, 10))
  # Extend by 3 (pre 10, last token at full slot 13, SWA peer 9): full Part 1 = 14, 15,
  # then page 4 -> 16; SWA Part 1 from translate(13) = 9: 10, 11, then page 3 -> 12.
  assert list(map(int, a.alloc_extend([10], [13], [13]))) == [14, 15, 16]
  assert list(map(int, a.peers([14, 15, 16]))) == [10, 11, 12]
  assert _lists(a) == ([5, 6, 7, 8], [], [4], [])
  # Decode token 13: seq 14 continues page 4 (full 17) and SWA page 3 (13).
  assert list(map(int, a.alloc_decode([14], [16]))) == [17]
  assert list(map(int, a.peers([17]))) == [13]
  # The window: tokens 4..7 (full slots 8..11, one page) leave it. Their SWA page
  # mapping[8] // 4 = 1 is freed by free_page_ids, in front; the page's mapping is 0.
  a.free_swa_segment([8, 9, 10, 11], 4)
  assert _lists(a) == ([5, 6, 7, 8], [], [1, 4], [])
  assert list(map(int, a.peers([8, 9, 10, 11, 12]))) == [0, 0, 0, 0, 8]
  # Finish: free_swa widens to full pages 1..4; peers found on SWA pages 2 and 3 go back
  # sorted in front; then the full pool frees pages 1..4 in front.
  a.free(list(range(4, 18)))
  assert _lists(a) == ([1, 2, 3, 4, 5, 6, 7, 8], [], [2, 3, 1, 4], [])
  assert list(map(int, a.peers(list(range(4, 18))))) == [0] * 14


@pytest.mark.parametrize("which", IMPLS)
def test_token_vector(which):
  a = _impls(8, 4, 1, False, which)
  assert list(map(int, a.alloc(3))) == [1, 2, 3]
  assert a.alloc(2) is None  # the SWA pool has one slot left
  a.free_swa([2])  # SWA slot 2 appended (FIFO), full slot 2 keeps its KV
  assert _lists(a) == ([4, 5, 6, 7, 8], [], [4, 2], [])
  assert list(map(int, a.alloc(2))) == [4, 5]
  assert list(map(int, a.peers([1, 2, 3, 4, 5]))) == [1, 0, 3, 4, 2]
  a.free([1, 4])  # SWA peers 1, 4 appended, then full slots 1, 4
  assert _lists(a) == ([6, 7, 8, 1, 4], [], [1, 4], [])
  a.free_full([2])
  a.free_segment([3, 5], 0)  # SWA slots 3, 2 (in order), then full 3, 5
  assert _lists(a) == ([6, 7, 8, 1, 4, 2, 3, 5], [], [1, 4, 3, 2], [])


@pytest.mark.parametrize("which", IMPLS)
def test_decode_refused_unless_both_pools_fit(which):
  # Full 8 pages, SWA 2 pages: two 4-token prefills fill the SWA pool.
  a = _impls(32, 8, 4, False, which)
  assert list(map(int, a.alloc_extend([0, 0], [4, 4], [-1, -1]))) == list(range(4, 12))
  before = _lists(a)
  assert a.alloc_decode([5, 3 + 1], [7, 10]) is None  # the first needs a page
  assert _lists(a) == before == ([3, 4, 5, 6, 7, 8], [], [], [])
  # Without a new page both pools fit: slots continue the pages.
  assert a.alloc_extend([0], [3], [-1]) is None  # SWA short: refused, no change
  assert _lists(a) == before


@pytest.mark.parametrize("which", IMPLS)
def test_decode_refusal_keeps_each_pools_merge(which):
  # need_sort; full 3 pages, SWA 2. Two 4-token requests take full pages 1, 2 and SWA
  # pages 1, 2; a third gets full page 3 and no SWA KV (tail 0) and is freed from the
  # full pool alone, so full: free [], released [3]; SWA: nothing free.
  a = _impls(12, 8, 4, True, which)
  assert list(map(int, a.alloc_extend([0, 0], [4, 4], [-1, -1]))) == list(range(4, 12))
  assert list(map(int, a.alloc_extend_swa_tail(0, 4, -1, 0))) == [12, 13, 14, 15]
  a.free_full([12, 13, 14, 15])
  assert _lists(a) == ([], [3], [], [])
  # A decode that starts a page: the full pool's trigger (bs 1 > 0 free) merges page 3
  # back, the SWA pool is short, so neither allocates (SGLang would take full page 3).
  assert a.alloc_decode([5], [7]) is None
  assert _lists(a) == ([3], [], [], [])


# -- random lock-step traces ---------------------------------------------------------------

def _cfg(ps):
  return dict(size=32 * ps, size_swa=14 * ps, ps=ps)


@pytest.mark.parametrize("ps,need_sort,steps", [(4, True, 80), (1, False, 60)])
def test_core_matches_model(ps, need_sort, steps):
  c = _cfg(ps)
  impl = CoreImpl(c["size"], c["size_swa"], ps, need_sort)
  stats = run_trace([impl], need_sort=need_sort, steps=steps, seed=ps, groups=False, **c)
  assert stats["refused"] > 0 and stats["ops"] > steps // 2


@needs_sglang
@pytest.mark.parametrize("ps,need_sort,seed", [(4, True, 0), (4, False, 1), (1, True, 2),
                                               (2, False, 3)])
def test_host_class_matches_sglang_0_5_23(ps, need_sort, seed):
  c = _cfg(ps)
  impls = [ClassImpl(c["size"], c["size_swa"], ps, need_sort, "host"),
           SGLangImpl(c["size"], c["size_swa"], ps, need_sort)]
  stats = run_trace(impls, need_sort=need_sort, steps=150, seed=seed, **c)
  assert stats["refused"] > 0


@needs_sglang
@pytest.mark.parametrize("ps,need_sort,seed", [(4, True, 10)])
def test_device_class_matches_sglang_0_5_23(ps, need_sort, seed):
  c = _cfg(ps)
  impls = [ClassImpl(c["size"], c["size_swa"], ps, need_sort, "device"),
           SGLangImpl(c["size"], c["size_swa"], ps, need_sort)]
  run_trace(impls, need_sort=need_sort, steps=40, seed=seed, **c)


@needs_sglang
@pytest.mark.parametrize("ps,need_sort", [(1, False), (1, True), (4, False), (4, True),
                                          (16, True)])
def test_long_traces_all_impls_match_sglang(ps, need_sort):
  c = _cfg(ps)
  impls = [ClassImpl(c["size"], c["size_swa"], ps, need_sort, "device"),
           ClassImpl(c["size"], c["size_swa"], ps, need_sort, "host"),
           SGLangImpl(c["size"], c["size_swa"], ps, need_sort)]
  for seed in range(2):
    for impl in impls:
      impl.a.clear()
    run_trace(impls, need_sort=need_sort, steps=200, seed=100 + seed, **c)
  core_impl = CoreImpl(c["size"], c["size_swa"], ps, need_sort)
  run_trace([core_impl], need_sort=need_sort, steps=300, seed=7, groups=False, **c)


# -- the functional core: composition, failure, bad input ----------------------------------

CFG = core.SWAConfig(32, 16, 4, False, kernel="jnp", debug=False)


def test_init_and_sizes():
  s = core.init(CFG)
  assert s.mapping.shape == (32 + 4 + 1,) and int(s.mapping[-1]) == -1
  assert int(core.available_size(CFG, s)) == 16
  assert int(core.full_available_size(CFG, s)) == 32
  assert int(core.translate(s.mapping, jnp.array([-1, 5]))[0]) == -1
  with pytest.raises(ValueError, match="alloc needs page_size 1"):
    core.alloc(CFG, s, 4, max_size=8)
  with pytest.raises(ValueError, match="size_swa pool: size must hold at least one page"):
    core.SWAConfig(32, 2, 4)  # an SWA pool smaller than a page


def test_failure_returns_the_old_state_and_vmap_scan_compose():
  ext = jax.jit(core.alloc_extend, static_argnames=("config", "max_tokens"),
                donate_argnames=("state",))
  s = jax.jit(core.init, static_argnames=("config",))(CFG)
  s, out, ok = ext(CFG, s, jnp.array([0]), jnp.array([16]), jnp.array([-1]), max_tokens=32)
  assert bool(ok)
  kept = jax.tree.map(np.asarray, s)
  s2, out, ok = ext(CFG, s, jnp.array([0]), jnp.array([4]), jnp.array([-1]), max_tokens=32)
  assert not bool(ok) and not np.asarray(out).any()  # the SWA pool is full
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, s2), kept)

  @jax.jit
  def program():
    # vmap over two independent SWA allocators, then a scan of decode steps on one.
    states = jax.vmap(lambda _: core.init(CFG))(jnp.arange(2))
    states, outs, oks = jax.vmap(
        lambda st_, n: core.alloc_extend(CFG, st_, jnp.array([0]), n[None],
                                         jnp.array([-1]), max_tokens=16))(
                                             states, jnp.array([3, 6]))

    def step(carry, _):
      st_, seq, last = carry
      st_, slot, ok_ = core.alloc_decode(CFG, st_, seq[None], last[None])
      return (st_, seq + 1, slot[0]), (slot[0], ok_)

    one = jax.tree.map(lambda x: x[1], states)
    (one, _, _), (slots, doks) = jax.lax.scan(step, (one, jnp.int32(7), jnp.int32(9)),
                                              None, length=5)
    return outs, oks, one, slots, doks

  outs, oks, one, slots, doks = program()
  assert oks.tolist() == [True, True]
  np.testing.assert_array_equal(outs[:, :6], [[4, 5, 6, 0, 0, 0], [4, 5, 6, 7, 8, 9]])
  assert slots.tolist() == [10, 11, 12, 13, 14] and doks.all()
  np.testing.assert_array_equal(core.translate(one.mapping, slots), [10, 11, 12, 13, 14])
  assert st.live_free_pages(one.swa).tolist() == [4]


def test_free_swa_segment_misaligned_start_frees_nothing():
  @jax.jit
  def program():
    s = core.init(CFG)
    s, out, _ = core.alloc_extend(CFG, s, jnp.array([0]), jnp.array([8]), jnp.array([-1]),
                                  max_tokens=8)
    return (s, core.free_swa_segment(CFG, s, out[2:], jnp.int32(2)),
            core.free_segment(CFG, s, out, jnp.int32(0)))

  s, s2, s3 = program()
  jax.tree.map(np.testing.assert_array_equal, s2, s)
  assert st.live_free_pages(s3.swa).tolist() == [1, 2, 3, 4]
  assert st.live_free_pages(s3.full).tolist() == list(range(1, 9))
  assert not np.asarray(s3.mapping[:-1]).any()


# -- the class ------------------------------------------------------------------------------

def _cls(backend, ps=4, **kw):
  from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
  return SWATokenToKVPoolAllocator(32 * ps, 16 * ps, ps, None, "cpu", None, kw.pop(
      "need_sort", False), backend=backend, kernel="jnp", **kw)


@pytest.mark.parametrize("backend", ["device", "host"])
def test_class_surface_snapshots_and_groups(backend):
  a = _cls(backend)
  assert (a.size, a.size_full, a.size_swa) == (64, 128, 64)
  assert a.full_attn_allocator.page_size == a.swa_attn_allocator.page_size == 4
  z = np.zeros(1, np.int64)
  out = a.alloc_extend(z, z, np.array([9]), np.array([9]), np.array([-1]), 9)
  assert np.asarray(out).tolist() == list(range(4, 13))
  snap = a.backup_state()
  assert np.asarray(a.alloc_decode(np.array([10]), None, np.array([12]))).tolist() == [13]
  a.free_group_begin()
  a.free_swa_segment(np.asarray(out)[:4], start_pos=0)
  a.free(np.asarray(out)[4:])
  assert a.swa_available_size() == 64 - 12  # queued
  a.free_group_end()
  assert list(a.swa_attn_allocator.free_pages[:3]) == [2, 3, 1]
  a.free_full(np.asarray(out)[:4])
  assert a.available_size() == 64 and a.full_available_size() == 128
  a.restore_state(snap)
  assert a.swa_available_size() == 64 - 12
  assert np.asarray(a.translate_loc_from_full_to_swa(np.array([-1, 4, 12]))).tolist() == \
      [-1, 4, 12]
  assert "swa-available-size: 52" in a.debug_print()
  with pytest.raises(ValueError, match="start_pos"):
    a.free_swa_segment(np.array([5]), start_pos=1)
  with pytest.raises(ValueError, match="page_size 1"):
    a.alloc(4)
  with pytest.raises(RuntimeError, match="without free_group_begin"):
    a.free_group_end()
  a.clear()
  assert a.available_size() == 64


@pytest.mark.parametrize("backend", ["device", "host"])
def test_class_debug_mode_checks_peers(backend):
  from jax_kvalloc.sglang.swa import SWADebugError
  a = _cls(backend, debug=True)
  z = np.zeros(1, np.int64)
  out = np.asarray(a.alloc_extend(z, z, np.array([8]), np.array([8]), np.array([-1]), 8))
  with pytest.raises(SWADebugError, match="still has SWA peer"):
    a.free_full(out)
  a.free_swa_segment(out[:4], start_pos=0)
  with pytest.raises(SWADebugError, match="has no SWA peer"):
    a.free_swa(out[:4])
  a.free_swa(out[4:])
  a.free_full(out)
  assert a.available_size() == 64


def test_class_dp_ranks_are_independent():
  a = _cls("host", dp_size=2)
  z = np.zeros(1, np.int64)
  out = a.alloc_extend(z, z, np.array([8]), np.array([8]), np.array([-1]), 8, dp_rank=1)
  assert out.tolist() == list(range(4, 12))
  assert a.available_size(dp_rank=0) == 32 and a.available_size(dp_rank=1) == 24
  a.free(out, dp_rank=1)
  assert a.available_size(dp_rank=1) == 32


def test_bound_swa_allocator_under_jit():
  import jax_kvalloc as kv
  a = kv.swa_allocator(size=32, size_swa=16, page_size=4, kernel="jnp", debug=False)
  s = a.init()
  s, out, ok = jax.jit(lambda s: a.alloc_extend(s, jnp.array([0]), jnp.array([6]),
                                                jnp.array([-1]), max_tokens=8))(s)
  assert bool(ok) and out.tolist() == [4, 5, 6, 7, 8, 9, 0, 0]
  assert int(a.available_size(s)) == 8 and a.translate(s, out[:2]).tolist() == [4, 5]
  s = jax.jit(a.free)(s, out)
  assert int(a.swa_available_size(s)) == 16 and int(a.full_available_size(s)) == 32


@pytest.mark.parametrize("backend", ["device", "host", "core"])
def test_tail_zero_sets_the_head_mapping_to_zero(backend):
  # SPEC 13: the head's mapping is 0, also when the tail is empty (the head is all of the
  # extend). SGLang writes nothing there, which is the same in valid use (those entries are
  # 0 already); stale entries, put here on purpose, show the write.
  slots = np.arange(4, 12)
  if backend == "core":
    cfg = core.SWAConfig(64, 32, 4, False, kernel="jnp")
    s = core.init(cfg)
    s = s._replace(mapping=core.set_mapping(s.mapping, jnp.asarray(slots),
                                            jnp.asarray(slots)))
    one = jnp.ones((1,), jnp.int32)
    s, out, ok = jax.jit(lambda s: core.alloc_extend_swa_tail(
        cfg, s, 0 * one, 8 * one, -one, 0, max_tokens=8))(s)  # one compile, not op by op
    assert bool(ok)
    peers = np.asarray(core.translate(s.mapping, jnp.asarray(slots)))
  else:
    from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
    a = SWATokenToKVPoolAllocator(64, 32, 4, None, "cpu", None, False, kernel="jnp",
                                  debug=False, backend=backend)
    a.set_full_to_swa_mapping(slots, slots)
    z, n = np.zeros(1, np.int64), np.array([8])
    out = a.alloc_extend_swa_tail(z, z, n, n, np.array([-1]), 8, 0)
    peers = np.asarray(a.translate_loc_from_full_to_swa(slots))
    assert a.swa_available_size() == 32
  np.testing.assert_array_equal(np.asarray(out), slots)
  np.testing.assert_array_equal(peers, 0)
