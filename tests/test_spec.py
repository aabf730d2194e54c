"""SPEC.md sections 2-8, case by case, through the SGLang-compatible classes and through
the functional core (jitted and not, as chex variants). The model in tests/model.py is
first checked against the hand-worked SPEC 5 vectors, then used as the oracle."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from model import ModelAllocator

PS = 4


def _paged(num_pages=16, ps=PS, need_sort=False):
  return kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort)


def _np(x):
  return None if x is None else np.asarray(x).tolist()


# --- the model against SPEC 5's hand-worked vectors -------------------------------------

def test_model_spec5_vectors():
  m = ModelAllocator(64, 4)
  assert m.alloc_extend([2], [11], [1]) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
  assert m.free_pages[:2] == [3, 4]  # pages 1 and 2 taken
  m = ModelAllocator(64, 4)
  assert m.alloc_extend([0], [3], [-1]) == [4, 5, 6]
  m = ModelAllocator(64, 4)
  m.free_pages = m.free_pages[2:]  # free_pages = [3, ...]
  assert m.alloc_decode([12, 13], [10, 11]) == [11, 12]
  assert m.free_pages[0] == 4
  for need_sort, free, release in ((True, [3, 4], [1, 2]), (False, [1, 2, 3, 4], [])):
    m = ModelAllocator(16, 4, need_sort)
    m.free(m.alloc(8))
    assert (m.free_pages, m.release_pages) == (free, release)


# --- SPEC 5 through the classes -----------------------------------------------------------

def test_spec5_extend_mid_page_prefix():
  a = _paged()
  assert _np(a.alloc_extend([2], None, [11], None, [1], 9)) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
  assert a.free_pages[:2].tolist() == [3, 4]


def test_spec5_extend_empty_prefix_never_hands_out_page0():
  a = _paged()
  assert _np(a.alloc_extend([0], None, [3], None, [-1], 3)) == [4, 5, 6]


def test_spec5_decode_only_page_crossing_row_takes_a_page():
  a = _paged()
  a.alloc(8)  # free_pages = [3, ...]
  assert _np(a.alloc_decode([12, 13], None, [10, 11])) == [11, 12]
  assert a.free_pages[0] == 4


@pytest.mark.parametrize("need_sort,free,release", [(True, [3, 4], [1, 2]),
                                                    (False, [1, 2, 3, 4], [])])
def test_spec5_free_order(need_sort, free, release):
  a = _paged(4, need_sort=need_sort)
  a.free(a.alloc(8))
  assert a.free_pages.tolist() == free and a.release_pages.tolist() == release


# --- alloc_extend Part 1/2/3 combinations (ps = 4) ---------------------------------------
# (prefix, seq, last_loc) -> the parts it exercises; last_loc is in page 1 (slots 4..7).
EXTEND_CASES = {
    "part1_only": (2, 4, 5),            # fill slots 6, 7 of the current page
    "part1_short": (1, 3, 4),           # stays inside the current page
    "part2_only": (4, 12, 7),           # aligned prefix, two whole pages
    "part3_only": (4, 6, 7),            # aligned prefix, one partial page
    "part1_part2": (2, 8, 5),
    "part1_part3": (3, 6, 6),
    "part2_part3": (0, 10, -1),
    "part1_part2_part3": (2, 11, 5),
    "zero_extension": (6, 6, 9),
    "empty_prefix_exact_page": (0, 4, -1),
    "seq_ps_minus_1": (0, 3, -1),
    "seq_ps_plus_1": (0, 5, -1),
}


@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_extend_parts_match_model(case):
  pre, seq, last = EXTEND_CASES[case]
  a, m = _paged(), ModelAllocator(16 * PS, PS)
  a.alloc(4), m.alloc(4)  # page 1 in use: last_loc points into it
  want = m.alloc_extend([pre], [seq], [last])
  got = a.alloc_extend([pre], None, [seq], None, [last], seq - pre)
  assert _np(got) == want
  assert a.free_pages.tolist() == m.free_pages


def test_extend_batch_mixing_every_part_and_zero_rows():
  pre = [2, 0, 4, 6, 3, 0, 9]
  seq = [11, 3, 12, 6, 6, 0, 9]
  last = [5, -1, 7, 9, 6, -1, 8]
  a, m = _paged(32), ModelAllocator(32 * PS, PS)
  a.alloc(4), m.alloc(4)
  want = m.alloc_extend(pre, seq, last)
  got = a.alloc_extend(pre, None, seq, None, last, sum(seq) - sum(pre))
  assert _np(got) == want and a.free_pages.tolist() == m.free_pages


def test_decode_inside_and_across_pages():
  a, m = _paged(), ModelAllocator(16 * PS, PS)
  seq = [5, 6, 8, 9, 13, 2]   # 5, 9, 13 start a page; the others stay in theirs
  last = [7, 8, 10, 11, 15, 4]
  a.alloc(12), m.alloc(12)
  assert _np(a.alloc_decode(seq, None, last)) == m.alloc_decode(seq, last)
  assert a.free_pages.tolist() == m.free_pages


def test_token_allocator_fifo_and_no_dedup():
  # SGLang's free appends as given, without de-duplication: guard=False keeps its trust
  # (the ownership record, on by default, refuses a slot named twice: test_refusals.py).
  a = kvs.TokenToKVPoolAllocator(10, guard=False)
  m = ModelAllocator(10, 1, kind="token")
  assert _np(a.alloc(4)) == m.alloc(4) == [1, 2, 3, 4]
  a.free([3, 1, 3]), m.free([3, 1, 3])
  assert a.free_pages.tolist() == m.free_pages == [5, 6, 7, 8, 9, 10, 3, 1, 3]
  assert a.alloc(0).shape == (0,)
  with pytest.raises(NotImplementedError):
    a.alloc_extend([0], None, [1], None, [-1], 1)


def test_paged_free_partial_page_frees_whole_page_and_dedups():
  a = _paged(8)
  out = np.asarray(a.alloc(12))           # pages 1, 2, 3
  a.free(np.array([out[1], out[0], out[9]]))  # two slots of page 1, one of page 3
  assert a.free_pages[:2].tolist() == [1, 3]
  assert a.available_size() == (8 - 3 + 2) * PS


# --- capacity ------------------------------------------------------------------------------

@pytest.mark.parametrize("need_sort", [False, True])
def test_exact_capacity_succeeds_and_one_page_short_fails_unchanged(need_sort):
  a = _paged(8, need_sort=need_sort)
  a.alloc(8)                                 # 6 pages left
  before = (a.free_pages.tolist(), a.release_pages.tolist())
  assert a.alloc_extend([0, 0], None, [13, 12], None, [-1, -1], 25) is None  # 7 pages
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == before
  assert a.alloc_decode([1] * 7, None, [-1] * 7) is None
  assert a.alloc(28) is None
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == before
  out = a.alloc_extend([0, 0], None, [12, 12], None, [-1, -1], 24)  # exactly 6 pages
  assert out is not None and len(set(_np(out))) == 24
  assert a.available_size() == 0 and a.free_pages.size == 0
  assert a.alloc_decode([2], None, [int(out[0])]) is not None  # needs no page: fine
  assert a.alloc_decode([5], None, [int(out[3])]) is None


def test_need_sort_merge_only_on_shortfall():
  a, m = _paged(6, need_sort=True), ModelAllocator(6 * PS, PS, True)
  for impl in (a, m):
    x = impl.alloc(16)
    impl.free(x[:8])
  assert a.release_pages.tolist() == m.release_pages == [1, 2]
  # extend trigger: ext // ps + bs + 1 > len(free) = 2 -> merge, then allocate.
  want = m.alloc_extend([0], [4], [-1])
  assert _np(a.alloc_extend([0], None, [4], None, [-1], 4)) == want
  assert a.free_pages.tolist() == m.free_pages and a.release_pages.size == 0
  # alloc: merges only when short.
  for impl in (a, m):
    impl.free(impl.alloc(4) if impl is m else np.asarray(impl.alloc(4)))
  assert a.release_pages.tolist() == m.release_pages
  assert _np(a.alloc(4)) == m.alloc(4) and a.release_pages.tolist() == m.release_pages


def test_failed_alloc_keeps_the_merge_it_triggered():
  a, m = _paged(4, need_sort=True), ModelAllocator(4 * PS, PS, True)
  for impl in (a, m):
    x = impl.alloc(12)
    impl.free(x[:4])
  assert a.alloc(12) is None and m.alloc(12) is None  # merge ran, still short
  assert a.free_pages.tolist() == m.free_pages == [1, 4]
  assert a.release_pages.size == 0


# --- free groups, snapshots, clear ----------------------------------------------------

def test_free_group_dedups_across_group_and_captures_buffers():
  a = _paged(8)
  out = np.asarray(a.alloc(16)).copy()     # pages 1..4
  buf = out.copy()
  a.free_group_begin()
  a.free(buf[:2])
  a.free(buf[2:6])                         # pages 1 (again) and 2
  buf[:] = 0                               # the caller reuses its buffer before end
  assert a.free_pages.tolist() == [5, 6, 7, 8]  # nothing freed yet
  a.free_group_end()
  assert a.free_pages.tolist() == [1, 2, 5, 6, 7, 8]
  with pytest.raises(RuntimeError):
    a.free_group_end()


def test_snapshot_restores_across_alloc_free_merge():
  a = _paged(8, need_sort=True)
  x = np.asarray(a.alloc(16))
  a.free(x[:4])
  snap = a.backup_state()
  lists = (a.free_pages.tolist(), a.release_pages.tolist())
  a.alloc(12)                     # triggers a merge
  a.free(x[4:])
  a.merge_and_sort_free()
  a.alloc_extend([0], None, [9], None, [-1], 9)
  assert (a.free_pages.tolist(), a.release_pages.tolist()) != lists
  a.restore_state(snap)
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == lists
  a.alloc(4)                      # the snapshot survives use of the restored state
  a.restore_state(snap)
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == lists


def test_clear_resets_everything():
  a = _paged(8, need_sort=True)
  a.free(np.asarray(a.alloc(16))[:4])
  a.free_group_begin()
  a.clear()
  assert a.free_pages.tolist() == list(range(1, 9)) and a.release_pages.size == 0
  assert a.is_not_in_free_group and a.available_size() == 8 * PS


# --- the functional core, jitted and not ---------------------------------------------------

class FunctionalTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(1, 4, 16)
  def test_extend_decode_free_match_model(self, ps):
    cfg = kv.AllocatorConfig(size=32 * ps, page_size=ps)
    model = ModelAllocator(32 * ps, ps, kind="paged")
    extend = self.variant(kv.alloc_extend, static_argnames=("config", "max_tokens"))
    decode = self.variant(kv.alloc_decode, static_argnames=("config",))
    free = self.variant(kv.free, static_argnames=("config",))
    state = kv.init(cfg)
    pre = np.array([0, 0, 0, 0], np.int32)
    seq = np.array([3 * ps - 1, ps, 1, 0], np.int32)  # the last row is padding
    state, out, ok = extend(cfg, state, pre, seq, np.full(4, -1, np.int32),
                            max_tokens=64 * ps, num_reqs=np.int32(3))
    want = model.alloc_extend([0, 0, 0], seq[:3].tolist(), [-1] * 3)
    assert bool(ok)
    np.testing.assert_array_equal(out[:len(want)], want)
    np.testing.assert_array_equal(out[len(want):], 0)  # padding is 0
    lasts = [want[int(seq[0]) - 1], want[int(seq[:2].sum()) - 1], want[-1]]
    state, out, ok = decode(cfg, state, seq[:3] + 1, np.array(lasts, np.int32))
    assert bool(ok)
    np.testing.assert_array_equal(out, model.alloc_decode((seq[:3] + 1).tolist(), lasts))
    state = free(cfg, state, np.pad(np.asarray(out), (0, 5)))  # zeros are padding
    model.free(np.asarray(out).tolist())
    np.testing.assert_array_equal(kv.live_free_pages(state), model.free_pages)

  @chex.variants(with_jit=True, without_jit=True)
  def test_failure_returns_zeros_and_same_state(self):
    cfg = kv.AllocatorConfig(size=16, page_size=4)
    alloc = self.variant(kv.alloc, static_argnames=("config", "max_size"))
    state = kv.init(cfg)
    new, out, ok = alloc(cfg, state, jnp.int32(20), max_size=32)
    assert not bool(ok)
    np.testing.assert_array_equal(out, 0)
    chex.assert_trees_all_equal(new, state)
    for bad in (-4, 6, 40):  # negative, unaligned, larger than max_size: refused
      new, out, ok = alloc(cfg, state, jnp.int32(bad), max_size=32)
      assert not bool(ok)
      chex.assert_trees_all_equal(new, state)


@pytest.mark.parametrize("convert", [list, np.asarray, jnp.asarray], ids=["list", "numpy", "jax"])
def test_classes_accept_lists_numpy_and_jax_arrays(convert):
  a = _paged()
  first = a.alloc_extend(convert([0, 0]), None, convert([6, 3]), None, convert([-1, -1]), 9)
  assert _np(first) == [4, 5, 6, 7, 8, 9, 12, 13, 14]
  out = a.alloc_decode(convert([7, 4]), convert([7, 4]), convert([9, 14]))
  assert _np(out) == [10, 15]
  a.free(convert(np.asarray(first)))
  assert a.free_pages[:3].tolist() == [1, 2, 3]
