"""Bad input: a clear exception naming the argument and the offending value, and the
allocator exactly as it was (the very same state object: nothing ran)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from model import ModelAllocator

I32_MAX = 2**31 - 1


def _paged():
  """A paged pool (ps 4, 16 pages, need_sort) with requests live and pages released."""
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, need_sort=True)
  out = a.alloc_extend([0, 0], None, [6, 3], None, [-1, -1], 9)  # slots 4..9, 12..14
  a.free(out[6:])  # page 3 released
  return a


def _token():
  a = kvs.TokenToKVPoolAllocator(16, need_sort=False)
  a.alloc(5)
  a.free(np.array([2, 4]))
  return a


def _extend(pre, seq, last, n=None, pre_cpu=None, seq_cpu=None):
  def call(a):
    total = n if n is not None else int(np.sum(seq) - np.sum(pre))
    return a.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, total)
  return call


def _decode(seq, last):
  return lambda a: a.alloc_decode(seq, None, last)


@dataclasses.dataclass
class Bad:
  name: str
  make: object   # () -> allocator (its state is what must not change)
  call: object   # allocator -> raises
  exc: type
  match: str


def _group_open(make):
  """`make`, then a free group opened with one free queued: the queue must not change."""
  def made():
    a = make()
    a.free_group_begin()
    a.free([8])
    return a
  return made


# The live request after _paged(): slots 4..9 (pages 1, 2; prefix 6 ends mid-page 2 at 9).
BAD = [
    # Negative lengths and seq_lens < prefix_lens.
    Bad("extend_negative_prefix", _paged, _extend([6, -1], [7, 2], [9, -1]),
        ValueError, r"prefix_lens\[1\]=-1 must be >= 0"),
    Bad("extend_negative_seq", _paged, _extend([0], [-3], [-1], n=-3),
        ValueError, r"seq_lens\[0\]=-3 < prefix_lens\[0\]=0"),
    Bad("extend_seq_below_prefix", _paged, _extend([6], [5], [9], n=1),
        ValueError, r"seq_lens\[0\]=5 < prefix_lens\[0\]=6"),
    Bad("decode_zero_seq", _paged, _decode([7, 0], [9, -1]),
        ValueError, r"seq_lens\[1\]=0 must be >= 1"),
    Bad("decode_negative_seq", _paged, _decode([-2], [9]),
        ValueError, r"seq_lens\[0\]=-2 must be >= 1"),
    Bad("alloc_negative", _paged, lambda a: a.alloc(-4), ValueError, r"need_size must be >= 0"),
    Bad("token_alloc_negative", _token, lambda a: a.alloc(-1), ValueError,
        r"need_size must be >= 0, got -1"),
    # Arrays of different lengths.
    Bad("extend_lengths_differ", _paged, _extend([0, 0], [1, 1, 1], [-1, -1], n=3),
        ValueError, r"differ in length.*'seq_lens': 3"),
    Bad("extend_last_loc_length", _paged, _extend([0, 0], [1, 1], [-1], n=2),
        ValueError, r"differ in length.*'last_loc': 1"),
    Bad("decode_lengths_differ", _paged, _decode([7, 1], [9]),
        ValueError, r"differ in length"),
    Bad("extend_2d", _paged, _extend(np.zeros((2, 1), int), np.ones((2, 1), int),
                                     -np.ones((2, 1), int), n=2),
        ValueError, r"prefix_lens must be 1-D"),
    # last_loc breaking SPEC's alignment rule, or outside the pool.
    Bad("extend_misaligned", _paged, _extend([0, 6], [1, 8], [-1, 8]),
        ValueError, r"last_loc\[1\]=8 breaks \(last_loc \+ 1\) % page_size == prefix_lens"),
    Bad("extend_misaligned_empty_prefix", _paged, _extend([0], [3], [4]),
        ValueError, r"last_loc\[0\]=4 breaks"),
    Bad("decode_misaligned", _paged, _decode([7], [8]),
        ValueError, r"last_loc\[0\]=8 breaks \(last_loc \+ 2\) % page_size == seq_lens"),
    Bad("extend_last_loc_below_pool", _paged, _extend([6], [7], [-3]),
        ValueError, r"last_loc\[0\]=-3 is not a slot of the pool"),
    Bad("decode_last_loc_past_pool", _paged, _decode([7], [69]),
        ValueError, r"last_loc\[0\]=69 is not a slot of the pool \(-1 or 0..67\)"),
    # Unaligned paged alloc (SGLang floors silently).
    Bad("alloc_unaligned", _paged, lambda a: a.alloc(6),
        ValueError, r"need_size=6 must be a multiple of page_size=4"),
    # free of reserved (page 0) or out-of-range slots, eager and inside a free group.
    Bad("free_slot_0", _paged, lambda a: a.free([8, 0]),
        ValueError, r"free_index\[1\]=0 is not an allocatable slot.*page 0 is reserved"),
    Bad("free_page_0", _paged, lambda a: a.free(np.array([3])),
        ValueError, r"free_index\[0\]=3 is not an allocatable slot: valid slots are 4..67"),
    Bad("free_past_pool", _paged, lambda a: a.free(np.array([8, 68])),
        ValueError, r"free_index\[1\]=68 is not an allocatable slot"),
    Bad("free_negative", _paged, lambda a: a.free([-1]),
        ValueError, r"free_index\[0\]=-1 is not an allocatable slot"),
    Bad("token_free_past_pool", _token, lambda a: a.free([1, 17]),
        ValueError, r"free_index\[1\]=17 is not an allocatable slot: valid slots are 1..16"),
    Bad("token_free_slot_0", _token, lambda a: a.free(np.int64(0)),
        ValueError, r"free_index\[0\]=0"),
    Bad("free_in_group_past_pool", _group_open(_paged), lambda a: a.free([100]),
        ValueError, r"free_index\[0\]=100"),
    Bad("free_in_group_floats", _group_open(_paged), lambda a: a.free([8.5]),
        TypeError, r"free_index must hold integers"),
    # Free groups out of sequence.
    Bad("nested_free_group_begin", _group_open(_paged), lambda a: a.free_group_begin(),
        RuntimeError, r"free_group_begin\(\) called while a free group is already open"),
    Bad("free_group_end_without_begin", _token, lambda a: a.free_group_end(),
        RuntimeError, r"free_group_end\(\) called without free_group_begin\(\)"),
    # Snapshots of another configuration, or not snapshots.
    Bad("restore_other_size", _paged,
        lambda a: a.restore_state(kvs.PagedTokenToKVPoolAllocator(128, 4).backup_state()),
        ValueError, r"state was taken from an allocator with config .*size=128"),
    Bad("restore_other_page_size", _paged,
        lambda a: a.restore_state(kvs.PagedTokenToKVPoolAllocator(64, 8, need_sort=True)
                                  .backup_state()), ValueError, r"page_size=8"),
    Bad("restore_other_need_sort", _paged,
        lambda a: a.restore_state(kvs.PagedTokenToKVPoolAllocator(64, 4).backup_state()),
        ValueError, r"need_sort=False"),
    Bad("restore_other_debug", _paged,
        lambda a: a.restore_state(kvs.PagedTokenToKVPoolAllocator(64, 4, need_sort=True,
                                                                 debug=True)
                                  .backup_state()), ValueError, r"debug=True"),
    Bad("restore_token_into_paged", _paged,
        lambda a: a.restore_state(kvs.TokenToKVPoolAllocator(64).backup_state()),
        ValueError, r"kind='token'"),
    Bad("restore_raw_state", _paged, lambda a: a.restore_state(a.state),
        TypeError, r"state must be an AllocatorSnapshot from backup_state\(\), got "
                   r"AllocatorState"),
    # Values that do not fit int32, rejected before any cast.
    Bad("token_alloc_beyond_int32", _token, lambda a: a.alloc(2**31),
        ValueError, r"need_size=2147483648 does not fit int32"),
    Bad("alloc_beyond_int32", _paged, lambda a: a.alloc(2**33),
        ValueError, r"need_size=8589934592 does not fit int32"),
    Bad("extend_seq_beyond_int32", _paged, _extend([0], [2**31], [-1]),
        ValueError, r"seq_lens\[0\]=2147483648 does not fit int32"),
    Bad("extend_total_beyond_int32", _paged,
        _extend([0, 0], [I32_MAX, I32_MAX], [-1, -1]),
        ValueError, r"extend_num_tokens=4294967294 does not fit int32"),
    Bad("extend_cpu_copy_beyond_int32", _paged,
        _extend([0], [3], [-1], n=3, seq_cpu=np.array([2**40])),
        ValueError, r"seq_lens\[0\]=1099511627776 does not fit int32"),
    Bad("decode_last_loc_beyond_int32", _paged, _decode([7], [-2**31 - 1]),
        ValueError, r"last_loc\[0\]=-2147483649 does not fit int32"),
    Bad("free_uint64_beyond_int64", _paged, lambda a: a.free(np.array([2**64 - 1], np.uint64)),
        ValueError, r"free_index\[0\]=18446744073709551615 does not fit int32"),
    Bad("free_python_int_beyond_int64", _token, lambda a: a.free([1, 2**70]),
        ValueError, r"free_index\[1\]=1180591620717411303424 does not fit int32"),
    Bad("free_beyond_int32", _token, lambda a: a.free(np.array([2**40])),
        ValueError, r"free_index\[0\]=1099511627776 is not an allocatable slot"),
    # Wrong dtypes: floats (and bools) are not indices.
    Bad("free_floats", _paged, lambda a: a.free(np.array([8.0])),
        TypeError, r"free_index must hold integers, got dtype float64"),
    Bad("free_jax_floats", _token, lambda a: a.free(jnp.ones(2)),
        TypeError, r"free_index must hold integers, got dtype float32"),
    Bad("free_bools", _token, lambda a: a.free(np.array([True])),
        TypeError, r"free_index must hold integers, got dtype bool"),
    Bad("free_list_of_floats", _token, lambda a: a.free([1.0, 2.0]),
        TypeError, r"free_index must hold integers"),
    Bad("extend_float_lengths", _paged, _extend(np.zeros(1), np.ones(1), [-1], n=1),
        TypeError, r"prefix_lens must hold integers, got dtype float64"),
    Bad("extend_float_last_loc", _paged, _extend([6], [7], np.array([9.0])),
        TypeError, r"last_loc must hold integers"),
    Bad("decode_float_seq", _paged, _decode(np.array([7.0]), [9]),
        TypeError, r"seq_lens must hold integers"),
    Bad("alloc_float", _paged, lambda a: a.alloc(4.0),
        TypeError, r"need_size must be an int, got float 4.0"),
    Bad("alloc_bool", _token, lambda a: a.alloc(True), TypeError, r"need_size must be an int"),
    Bad("extend_num_tokens_float", _paged, _extend([0], [3], [-1], n=3.0),
        TypeError, r"extend_num_tokens must be an int"),
    Bad("extend_num_tokens_wrong", _paged, _extend([0], [3], [-1], n=4),
        ValueError, r"extend_num_tokens=4 != sum\(seq_lens - prefix_lens\)=3"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_bad_input_raises_and_changes_nothing(bad):
  a = bad.make()
  def seen():
    group = a._group  # pylint: disable=protected-access
    return (a.free_pages.tolist(), a.release_pages.tolist(), a.available_size(),
            None if group is None else [[q.tolist() for q in queue] for rank in group
                                        for queue in rank])
  state, before = a.state, seen()
  with pytest.raises(bad.exc, match=bad.match):
    bad.call(a)
  assert a.state is state  # no operation ran
  assert seen() == before  # lists, available size and an open group's queue


def test_torch_float_tensor_is_refused():
  torch = pytest.importorskip("torch")
  a = _paged()
  before = a.state
  with pytest.raises(TypeError, match=r"free_index must hold integers, got dtype float32"):
    a.free(torch.tensor([8.0]))
  with pytest.raises(TypeError, match=r"last_loc must hold integers"):
    a.alloc_decode(torch.tensor([7]), None, torch.tensor([9.0]))
  assert a.state is before


def test_config_rejects_pools_beyond_int32():
  assert kv.AllocatorConfig(2**30, kind="token").num_pages == 2**30  # the most pages
  assert kv.AllocatorConfig(2047 * 2**20, 2**20).num_slots == 2**31  # slots 0..2**31-1
  with pytest.raises(ValueError, match=r"1073741825 pages; at most 1073741824"):
    kv.AllocatorConfig(2**30 + 1, kind="token")
  with pytest.raises(ValueError, match=r"slot indices up to 2148532223, which do not fit"):
    kv.AllocatorConfig(2048 * 2**20, 2**20)
  with pytest.raises(ValueError, match=r"slot indices up to 2147483648"):
    kv.AllocatorConfig(2**31)
  with pytest.raises(TypeError, match=r"size must be an int, got float"):
    kv.AllocatorConfig(64.0)


@pytest.mark.parametrize("need_sort", [False, True])
def test_requests_larger_than_the_pool_return_none_without_huge_outputs(need_sort):
  """alloc/alloc_extend far beyond the pool (but within int32) fail like any shortfall
  (a need_sort merge included) without building outputs of that size."""
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, need_sort=need_sort)
  m = ModelAllocator(64, 4, need_sort)
  def same():
    return a.free_pages.tolist() == m.free_pages and a.release_pages.tolist() == m.release_pages
  a.free(a.alloc(8)), m.free(m.alloc(8))
  assert a.alloc(2**31 - 4) is None and m.alloc(2**31 - 4) is None and same()
  a.free(a.alloc(8)), m.free(m.alloc(8))
  assert a.alloc_extend([0, 5], None, [2**30, 6], None, [-1, 8], 2**30 + 1) is None
  assert m.alloc_extend([0, 5], [2**30, 6], [-1, 8]) is None and same()


# ---------------------------------------------------------------------------------------
# The functional core: static checks at trace time, and no int32 wrap under jit.
# ---------------------------------------------------------------------------------------

CFG = kv.AllocatorConfig(64, 4)


def test_core_rejects_float_indices_and_mismatched_rows():
  s = kv.init(CFG)
  with pytest.raises(TypeError, match=r"free_index must hold integers, got dtype float32"):
    kv.free(CFG, s, jnp.zeros(4))
  with pytest.raises(TypeError, match=r"seq_lens must hold integers"):
    kv.alloc_decode(CFG, s, jnp.ones(4), jnp.zeros(4, jnp.int32))
  with pytest.raises(TypeError, match=r"need_size must hold integers"):
    kv.alloc(CFG, s, 4.0, max_size=8)
  rows = jnp.zeros(4, jnp.int32)
  with pytest.raises(ValueError, match=r"per-request arrays differ in length.*'last_loc': \(3,\)"):
    jax.jit(kv.alloc_extend, static_argnames=("config", "max_tokens"))(
        CFG, s, rows, rows, rows[:3], max_tokens=8)
  with pytest.raises(ValueError, match=r"seq_lens must be 1-D"):
    kv.alloc_decode(CFG, s, rows.reshape(2, 2), rows.reshape(2, 2))


def _same_lists(a, b):
  return (kv.live_free_pages(a).tolist() == kv.live_free_pages(b).tolist()
          and kv.live_release_pages(a).tolist() == kv.live_release_pages(b).tolist())


@pytest.mark.parametrize("rows,max_tokens,seq", [
    (2, 64, [I32_MAX, 1]),           # plain prefix sums: would wrap to -2**31
    (4096, 2**20, [2**20] * 4096),   # saturating scan: 2**32 tokens would wrap to 0
])
def test_core_lengths_never_wrap_int32(rows, max_tokens, seq):
  cfg = kv.AllocatorConfig(64, 1)  # paged, ps 1: pages == tokens, so both sums matter
  s0 = kv.init(cfg)
  fn = jax.jit(kv.alloc_extend, static_argnames=("config", "max_tokens"))
  seq = jnp.asarray(seq, jnp.int32)
  s, out, ok = fn(cfg, s0, jnp.zeros(rows, jnp.int32), seq, jnp.full(rows, -1, jnp.int32),
                  max_tokens=max_tokens)
  assert not bool(ok) and not bool(out.any())
  assert _same_lists(s, s0) and int(s.free_len) == 64
  # The same batch, made to fit, still works: the bounds cost no valid batch.
  s, out, ok = fn(cfg, s0, jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.int32).at[0].set(3)
                  if rows == 2 else (jnp.arange(rows) < 60).astype(jnp.int32),
                  jnp.full(rows, -1, jnp.int32), max_tokens=max_tokens)
  assert bool(ok)
  want = 4 if rows == 2 else 60
  np.testing.assert_array_equal(out[:want], np.arange(1, want + 1))
