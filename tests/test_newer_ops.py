"""SGLang 0.5.23's newer operations (SPEC 10) and the review findings of issue 11.

free_page_ids, free_segment(s), free_full*, get_all_free_pages, alloc_extend's
num_new_pages, debug_print, get_cpu_copy/load_cpu_copy: functional core and both classes
against the model (tests/model.py) on hand-worked vectors and random serving traces
(need_sort on and off, inside and outside free groups, page sizes 1-128), and against the
released sglang (0.5.23 on CPU, its need_sort pages compared as sets) when installed.
Findings: the `state` property and `set_state`; zero-row functional alloc_extend;
dtype checks of the Pallas wrappers.
"""
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import allocation
from jax_kvalloc import debug
from jax_kvalloc import freeing
from jax_kvalloc import state as st
from model import ModelAllocator

try:  # the adapter imports torch
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  SGLANG_ERROR = sglang_oracle.import_error()
except ImportError as e:
  sglang_oracle, SGLANG_ERROR = None, f"the sglang adapter needs torch ({e})"


def _paged(size=32, ps=4, need_sort=False, **kw):
  return kvs.PagedTokenToKVPoolAllocator(size, ps, need_sort=need_sort, **kw)


def _lists(a):
  return a.free_pages.tolist(), a.release_pages.tolist()


def _fn_lists(state):
  return st.live_free_pages(state).tolist(), st.live_release_pages(state).tolist()


# -- hand-worked vectors -------------------------------------------------------------------

@pytest.mark.parametrize("need_sort", [False, True])
def test_free_page_ids_prepends_in_given_order(need_sort):
  """Pages 1-6 held, 7-8 free: free_page_ids([5, 2, 3]) prepends 5, 2, 3 as given."""
  for impl in ("class", "functional"):
    if impl == "class":
      a = _paged(need_sort=need_sort)
      a.alloc(24)
      a.free_page_ids(np.array([5, 2, 3]))
      a.free_page_ids([])  # nothing
      got = _lists(a)
    else:
      config = kv.AllocatorConfig(32, 4, need_sort=need_sort)
      s, _, _ = allocation.alloc(config, st.init(config), 24, max_size=24)
      # padding: a 0 in the middle, and entries at index >= num
      s = jax.jit(freeing.free_page_ids, static_argnums=0)(
          config, s, jnp.array([5, 0, 2, 3, 6, 1], jnp.int32), 4)
      got = _fn_lists(s)
    want = ([7, 8], [5, 2, 3]) if need_sort else ([5, 2, 3, 7, 8], [])
    assert got == want, impl


@pytest.mark.parametrize("need_sort", [False, True])
def test_free_segment_frees_the_requests_pages_in_its_order(need_sort):
  """A request holding pages 6, 2, 5 (tokens 4..13 of it from start_pos=4: slots of
  pages 2 and 5, the last page partial) frees pages 2 and 5 in that order."""
  free_index = [8, 9, 10, 11, 20, 21]   # tokens 4..9: page 2 (whole), page 5 (2 tokens)
  want = ([2, 5, 7, 8], []) if not need_sort else ([7, 8], [2, 5])
  a = _paged(need_sort=need_sort)
  a.alloc(24)
  a.free_segment(free_index, start_pos=4)
  assert _lists(a) == want
  config = a.config
  s, _, _ = allocation.alloc(config, st.init(config), 24, max_size=24)
  s = freeing.free_segment(config, s, jnp.array(free_index + [0, 0], jnp.int32), 4, 6)
  assert _fn_lists(s) == want
  m = ModelAllocator(32, 4, need_sort)
  m.alloc(24)
  m.free_segment(free_index, 4)
  assert (m.free_pages, m.release_pages) == want


def test_free_segments_each_in_turn_and_disjoint():
  a, m = _paged(), ModelAllocator(32, 4)
  a.alloc(24), m.alloc(24)
  segs = [([4, 5, 6, 7, 8], 0), ([], 100), ([16, 17], 8), ([24], 12)]
  a.free_segments(segs)
  m.free_segments(segs)
  # page 1 (then 2), then 4, then 6: each prepended in turn
  assert _lists(a) == (m.free_pages, []) == ([6, 4, 1, 2, 7, 8], [])
  before = _lists(a)
  with pytest.raises(ValueError, match=r"segments\[1\] \(start_pos=4\) shares a page"):
    a.free_segments([([12, 13, 14, 15, 20], 0), ([21], 4)])  # token 4 twice
  assert _lists(a) == before  # nothing freed
  with pytest.raises(ValueError, match=r"concatenated\)\[1\]=3 names a page twice"):
    a.free_segments([([12, 13], 0), ([14], 4)])  # slot 14 lies in page 3 as well
  assert _lists(a) == before
  with pytest.raises(ValueError, match=r"segments\[1\]: start_pos=2 must be a multiple"):
    a.free_segments([([12], 0), ([13], 2)])
  assert _lists(a) == before


def test_free_full_aliases_and_census():
  a, m = _paged(need_sort=True), ModelAllocator(32, 4, True)
  a.alloc(24), m.alloc(24)
  a.free_full([4, 5]), m.free([4, 5])
  a.free_full_segment([8], start_pos=0), m.free_segment([8], 0)
  a.free_full_segments([([12, 13], 4)]), m.free_segments([([12, 13], 4)])
  assert _lists(a) == (m.free_pages, m.release_pages)
  assert a.get_all_free_pages().tolist() == m.get_all_free_pages() == [7, 8, 3, 2, 1]
  pages, count = freeing.get_all_free_pages(a.config, a.state)
  assert pages.tolist() == [7, 8, 3, 2, 1, 0, 0, 0] and int(count) == 5
  line = a.debug_print()
  assert "\n" not in line and "free=2" in line and "released=3" in line and "in_use=3" in line


@pytest.mark.parametrize("need_sort", [False, True])
def test_free_group_queues_page_ids_after_slots(need_sort):
  """Inside a group: slot frees are one `free` (sorted, unique), then the page-id frees,
  concatenated in call order, go in front (SPEC 10). Queued ids are captured."""
  a, m = _paged(need_sort=need_sort), ModelAllocator(32, 4, need_sort)
  a.alloc(24), m.alloc(24)
  buf = np.array([6])
  a.free_group_begin(), m.free_group_begin()
  a.free([13, 4]), m.free([13, 4])                                # pages 3, 1
  a.free_page_ids(buf), m.free_page_ids([6])
  buf[0] = 1  # a later change to the caller's buffer does not reach the queue
  a.free_segment([8, 9, 10, 11, 20], start_pos=0), m.free_segment([8, 9, 10, 11, 20], 0)
  a.free([5]), m.free([5])                                        # page 1 again
  assert a.debug_print().endswith("(3 slots and 3 page ids queued)")
  a.free_group_end(), m.free_group_end()
  front = [6, 2, 5, 1, 3]
  want = ([7, 8], front) if need_sort else (front + [7, 8], [])
  assert _lists(a) == (m.free_pages, m.release_pages) == want


def test_token_allocator_new_ops_are_free():
  a, m = kvs.TokenToKVPoolAllocator(8), ModelAllocator(8, 1)
  a.alloc(6), m.alloc(6)
  a.free_page_ids([3, 1]), m.free_page_ids([3, 1])
  a.free_segment([5, 2], start_pos=3), m.free_segment([5, 2], 3)
  a.free_group_begin(), m.free_group_begin()
  a.free_page_ids([4]), m.free_page_ids([4])
  a.free([6]), m.free([6])
  a.free_group_end(), m.free_group_end()
  assert _lists(a) == (m.free_pages, []) == ([7, 8, 3, 1, 5, 2, 4, 6], [])
  config = kv.AllocatorConfig(8, kind="token")
  s, _, _ = allocation.alloc(config, st.init(config), 6, max_size=8)
  s = freeing.free_page_ids(config, s, jnp.array([3, 1, 0, 2], jnp.int32), 2)
  s = freeing.free_segment(config, s, jnp.array([5, 2, 4]), 7, 2)
  assert _fn_lists(s) == ([7, 8, 3, 1, 5, 2], [])


def test_alloc_extend_num_new_pages():
  a = _paged()
  with pytest.raises(ValueError, match=r"num_new_pages=1 != .*=2"):
    a.alloc_extend([0], None, [5], None, [-1], 5, num_new_pages=1)
  assert a.free_pages.tolist() == list(range(1, 9))
  assert a.alloc_extend([0], None, [5], None, [-1], 5, num_new_pages=2).tolist() == [
      4, 5, 6, 7, 8]
  assert a.alloc_extend([5], None, [6], None, [8], 1, 0).tolist() == [9]  # positional
  fn = jax.jit(allocation.alloc_extend, static_argnames=("config", "max_tokens"))
  args = (jnp.array([0, 0]), jnp.array([5, 11]), jnp.array([-1, -1]))  # 2 + 3 pages
  # pallas_interpret runs the fused Triton allocation (in interpret mode) on CPU: its
  # take is undone when the count disagrees.
  for kernel in ("jnp", "pallas_interpret"):
    config = kv.AllocatorConfig(32, 4, kernel=kernel)
    for given, ok in ((None, True), (5, True), (4, False), (-1, False), (99, False)):
      s, out, got = fn(config, st.init(config), *args, max_tokens=16, num_new_pages=given)
      assert bool(got) == ok, (kernel, given)
      assert int(s.free_len) == (3 if ok else 8) and (ok or not out.any())
      assert int(s.free_head) == (5 if ok else 0)
  dconfig = kv.AllocatorConfig(32, 4, debug=True)
  s, _, ok = allocation.alloc_extend(dconfig, st.init(dconfig), *args, max_tokens=16,
                                     num_new_pages=4)
  err = debug.get_error(s)
  assert not bool(ok) and err is not None and err.argument == "num_new_pages"


# -- errors: named argument, state unchanged -------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda a: a.free_page_ids([0]), r"page_ids\[0\]=0 is not a page .*reserved"),
    (lambda a: a.free_page_ids([9]), r"page_ids\[0\]=9 is not a page of the pool"),
    (lambda a: a.free_page_ids([2, 3, 2]), r"page_ids\[2\]=2 is given twice"),
    (lambda a: a.free_page_ids([1.0]), r"page_ids must hold integers"),
    (lambda a: a.free_segment([8], start_pos=2), r"start_pos=2 must be a multiple"),
    (lambda a: a.free_segment([8], start_pos=-4), r"start_pos must be >= 0"),
    (lambda a: a.free_segment([8, 12], start_pos=0), r"free_index\[1\]=12 lies in page 3"),
    (lambda a: a.free_segment([8, 9, 10, 11, 8], start_pos=0), r"names a page twice"),
    (lambda a: a.free_segment([2], start_pos=0), r"free_index\[0\]=2 is not an allocatable"),
    (lambda a: a.free_segments([([8], 0), 5]), r"segments\[1\] must be a"),
    (lambda a: a.free_segments([([4, 5, 6, 7, 8], 0), ([9], 4)]), r"shares a page"),
    (lambda a: a.get_cpu_copy([4]), r"kvcache=None"),
])
def test_bad_input_names_the_argument_and_changes_nothing(call, match):
  a = _paged(need_sort=True)
  a.alloc(24)
  a.free([4])
  before = _lists(a)
  with pytest.raises((TypeError, ValueError, RuntimeError), match=match):
    call(a)
  assert _lists(a) == before


def test_cpu_copy_delegates_to_kvcache():
  class KV:
    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
      return ("get", list(indices), mamba_indices, req_pool_index)

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
      return ("load", kv_cache_cpu, list(indices), mamba_indices, req_pool_index)

  for a in (_paged(kvcache=KV()), kvs.TokenToKVPoolAllocator(8, kvcache=KV())):
    assert a.get_cpu_copy([4, 5], req_pool_index=2) == ("get", [4, 5], None, 2)
    assert a.load_cpu_copy("c", [4], mamba_indices=[1]) == ("load", "c", [4], [1], None)


# -- debug mode ------------------------------------------------------------------------------

def test_debug_mode_refuses_bad_page_id_frees():
  config = kv.AllocatorConfig(32, 4, debug=True)
  s0, _, _ = allocation.alloc(config, st.init(config), 16, max_size=16)  # pages 1-4 held
  cases = [
      (freeing.free_page_ids, (jnp.array([2, 6], jnp.int32),), "page_ids", 1, 6),    # free
      (freeing.free_page_ids, (jnp.array([2, 3, 2], jnp.int32),), "page_ids", 2, 2),  # twice
      (freeing.free_page_ids, (jnp.array([9], jnp.int32),), "page_ids", 0, 9),       # range
      (freeing.free_segment, (jnp.array([8, 13], jnp.int32), 0), "free_index", 1, 13),
      (freeing.free_segment, (jnp.array([8], jnp.int32), 2), "start_pos", 0, 2),
      (freeing.free_segment, (jnp.array([4, 5, 6, 7, 24], jnp.int32), 0), "free_index",
       4, 6),
  ]
  for fn, args, arg, index, value in cases:
    s = fn(config, s0, *args)
    err = debug.get_error(s)
    assert err is not None and (err.argument, err.index, err.value) == (arg, index, value)
    assert _fn_lists(s) == _fn_lists(s0) and debug.audit(config, s) == []
  a = _paged(debug=True, guard=False)  # debug's own checks (with the record, it refuses
  a.alloc(16)                          # these first: tests/test_refusals.py)
  a.free_page_ids([2])
  with pytest.raises(kv.AllocatorDebugError, match=r"free_page_ids: page_ids\[0\]=2: double"):
    a.free_page_ids([2])
  assert _lists(a) == ([2, 5, 6, 7, 8], [])
  # (the class frees a segment's pages through free_page_ids)
  with pytest.raises(kv.AllocatorDebugError, match=r"page_ids\[1\]=2: double free"):
    a.free_segment([4, 5, 6, 7, 8], start_pos=0)  # page 1 held, page 2 already free
  assert _lists(a) == ([2, 5, 6, 7, 8], [])


# -- jit / vmap / scan -----------------------------------------------------------------------

def test_functional_ops_under_vmap_and_scan():
  alloc = kv.paged_allocator(size=32, page_size=4, need_sort=False, kernel="jnp")

  def step(state, x):
    state, slots, ok = alloc.alloc(state, 8, max_size=8)
    state = alloc.free_segment(state, slots, 0)
    state = alloc.free_page_ids(state, x)
    return state, ok

  states = jax.vmap(lambda _: alloc.init())(jnp.arange(3))
  xs = jnp.zeros((3, 5, 2), jnp.int32)
  out, oks = jax.jit(jax.vmap(lambda s, x: jax.lax.scan(step, s, x)))(states, xs)
  assert bool(oks.all())
  one = jax.tree_util.tree_map(lambda x: x[1], out)
  assert st.live_free_pages(one).tolist() == list(range(1, 9))


# -- review findings -----------------------------------------------------------------------

def test_state_property_is_safe_to_hand_to_jitted_code():
  """Finding: the next class call donated the arrays `state` had handed out ("Array has
  been deleted"). Now they stay readable, and set_state takes a new state back."""
  a = _paged()
  handed = a.state
  a.alloc(8)
  a.free(a.alloc(4))
  assert handed.free_ring.tolist() == list(range(1, 9))  # still readable
  alloc = kv.paged_allocator(a.config)

  @jax.jit
  def step(state):
    state, slots, ok = alloc.alloc(state, 4, max_size=4)
    return state, slots, ok

  new, slots, ok = step(a.state)
  a.set_state(new)
  assert bool(ok) and _lists(a) == ([4, 5, 6, 7, 8], [])
  assert a.available_size() == 20
  a.free(slots)
  assert new.free_ring.shape == (8,) and int(new.free_len) == 5  # still readable
  assert _lists(a) == ([3, 4, 5, 6, 7, 8], [])
  before = _lists(a)
  with pytest.raises(TypeError, match=r"state must be an AllocatorState"):
    a.set_state((1, 2))
  other = kv.paged_allocator(size=64, page_size=4).init()
  with pytest.raises(ValueError, match=r"state\.free_ring has shape \(16,\)"):
    a.set_state(other)
  assert _lists(a) == before


def test_functional_alloc_extend_with_zero_rows():
  """Finding: zero rows raised TypeError on the jnp path."""
  z = jnp.zeros((0,), jnp.int32)
  for kernel in ("jnp", "pallas_interpret"):
    for need_sort in (False, True):
      config = kv.AllocatorConfig(32, 4, need_sort=need_sort, kernel=kernel)
      s, out, ok = allocation.alloc_extend(config, st.init(config), z, z, z, max_tokens=8)
      assert bool(ok) and out.tolist() == [0] * 8 and int(s.free_len) == 8
      s, out, ok = jax.jit(allocation.alloc_extend, static_argnames=(
          "config", "max_tokens"))(config, st.init(config), z, z, z, max_tokens=4)
      assert bool(ok) and out.tolist() == [0] * 4


def test_pallas_wrappers_refuse_float_inputs():
  """Finding: the public Pallas wrappers cast floats to int32 silently."""
  from pallas_kernels import mosaic_extend, triton_decode, triton_extend  # pylint: disable=g-import-not-at-top
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  w, i, f = jnp.arange(1, 9, dtype=jnp.int32), jnp.array([0], jnp.int32), jnp.array([0.0])
  calls = [
      ("seq_lens", triton_extend.extend_indices_triton, (w, i, f + 5, i - 1, i, i),
       dict(page_size=4, out_len=8, interpret=True)),
      ("free_window", pallas_kernels.extend_indices, (w * 1.0, i, i + 5, i - 1, i, i),
       dict(page_size=4, out_len=8, interpret=True, backend="triton")),
      ("seq_lens", triton_decode.decode_indices_triton, (w, f + 1, i, i),
       dict(page_size=4, interpret=True)),
      ("free_len", triton_extend.alloc_extend_triton, (w, 0, 8.0, 1, i, i + 5, i - 1),
       dict(page_size=4, out_len=8, interpret=True)),
      ("last_loc", triton_decode.alloc_decode_triton,
       (w, 0, 8, 1, i + 1, jnp.array([True])), dict(page_size=4, interpret=True)),
      ("page_start", mosaic_extend.decode_indices_mosaic, (w, i + 1, i, f),
       dict(page_size=4, interpret=True)),
      ("tok_start", mosaic_extend.extend_indices_mosaic, (w, i, i + 5, i - 1, f, i),
       dict(page_size=4, out_len=8, interpret=True)),
  ]
  for name, fn, args, kwargs in calls:
    with pytest.raises(TypeError, match=rf"^{name} must hold integers, got dtype"):
      fn(*args, **kwargs)
  out = triton_extend.extend_indices_triton(w, i, i + 5, i - 1, i, i, page_size=4,
                                            out_len=8, interpret=True)
  assert out.tolist() == [4, 5, 6, 7, 8, 0, 0, 0]


# -- random serving traces against the model (and sglang 0.5.23) ----------------------------

class _Functional:
  """The functional core's new frees on the class's state (handed out and taken back),
  so that one trace exercises both APIs and the state/set_state round trip."""

  def __init__(self, a):
    self.a = a
    self.config = a.config
    self._ids = jax.jit(freeing.free_page_ids, static_argnums=0)
    self._seg = jax.jit(freeing.free_segment, static_argnums=0)

  def _pad(self, xs):
    n = max(8, 1 << (max(len(xs), 1) - 1).bit_length())
    return jnp.asarray(list(xs) + [0] * (n - len(xs)), jnp.int32), np.int32(len(xs))

  def free_page_ids(self, ids):
    x, n = self._pad(ids)
    self.a.set_state(self._ids(self.config, self.a.state, x, n))

  def free_segment(self, idx, start):
    x, n = self._pad(idx)
    self.a.set_state(self._seg(self.config, self.a.state, x, np.int32(start), n))


def _run_trace(seed, page_size, need_sort, *, steps, make_oracle=None, functional=True,
               backend="device"):
  """A random serving loop: requests arrive (alloc_extend, chunked), decode
  (alloc_decode), and finish or shrink; their slots go back through every free operation
  in turn, inside and outside free groups. The class (and the functional core on its
  state) and `oracle` (sglang) are checked against the model after every step."""
  rng = random.Random(seed)
  ps = page_size
  token = ps == 1
  size = ps * rng.choice([16, 24, 40])
  m = ModelAllocator(size, ps, need_sort)
  oracle = make_oracle(size) if make_oracle else None
  if token:
    a = kvs.TokenToKVPoolAllocator(size, need_sort=need_sort, backend=backend)
  else:
    a = kvs.PagedTokenToKVPoolAllocator(size, ps, need_sort=need_sort, backend=backend)
  fn = _Functional(a) if functional else None
  reqs = []  # each: list of slots, token order (token k at index k)

  def check(where):
    free, release = _lists(a)
    assert (free, release) == (m.free_pages, m.release_pages), where
    if oracle is not None:  # sglang 0.5.23 stages need_sort's pages unordered
      assert oracle.free_pages.tolist() == m.free_pages, where
      assert sorted(oracle.release_pages.tolist()) == sorted(m.release_pages), where

  def alloc_tokens(r, n):
    """Extends request r (a list, maybe empty) by n tokens; returns ok."""
    pre = len(r)
    if token:
      got = m.alloc(n)
      mine = a.alloc(n)
      theirs = oracle.alloc(n) if oracle else None
    else:
      last = r[-1] if r else -1
      got = m.alloc_extend([pre], [pre + n], [last])
      mine = a.alloc_extend([pre], None, [pre + n], None, [last], n)
      if oracle:
        theirs = oracle.alloc_extend(_torch([pre]), _torch([pre]), _torch([pre + n]),
                                     _torch([pre + n]), _torch([last]), n)
    assert (mine is None) == (got is None)
    if oracle:
      assert (theirs is None) == (got is None)
      if got is not None:
        assert theirs.tolist() == got
    if got is None:
      return False
    assert np.asarray(mine).tolist() == got
    r.extend(got)
    return True

  def release(slots, start):
    """Frees slots of tokens start.. of one request through a random operation."""
    how = rng.choice(["free", "free_page_ids", "free_segment", "free_segments",
                      "functional"] if functional else
                     ["free", "free_page_ids", "free_segment", "free_segments"])
    if how == "free":
      a.free(np.array(slots)), m.free(slots)
      if oracle:
        oracle.free(_torch(slots))
      return
    pages = [slots[k] // ps for k in range(0, len(slots), ps)]
    if how == "free_page_ids":
      a.free_page_ids(pages), m.free_page_ids(pages)
      if oracle:
        oracle.free_page_ids(_torch(pages))
    elif how == "free_segment" or (how == "functional" and m.group is not None):
      a.free_segment(slots, start_pos=start), m.free_segment(slots, start)
      if oracle:
        oracle.free_segment(_torch(slots), start_pos=start)
    elif how == "free_segments":
      cut = ps * rng.randint(0, len(pages))
      segs = [(slots[:cut], start), (slots[cut:], start + cut)]
      a.free_segments(segs), m.free_segments(segs)
      if oracle:
        oracle.free_segments([(_torch(x), s) for x, s in segs])
    else:  # the functional core outside a group
      if rng.random() < 0.5:
        fn.free_page_ids(pages)
      else:
        fn.free_segment(slots, start)
      m.free_segment(slots, start)

  for step in range(steps):
    roll = rng.random()
    if roll < 0.35 or not reqs:
      r = []
      if alloc_tokens(r, rng.randint(1, 3 * ps + 2)):
        reqs.append(r)
    elif roll < 0.6:
      r = rng.choice(reqs)
      if token:
        alloc_tokens(r, 1)
      else:
        seq = len(r) + 1
        got = m.alloc_decode([seq], [r[-1]])
        mine = a.alloc_decode([seq], None, [r[-1]])
        if oracle:
          theirs = oracle.alloc_decode(_torch([seq]), _torch([seq]), _torch([r[-1]]))
          assert (theirs is None) == (got is None) and (got is None or
                                                      theirs.tolist() == got)
        assert (mine is None) == (got is None)
        if got is not None:
          assert np.asarray(mine).tolist() == got
          r.extend(got)
    else:
      group = rng.random() < 0.3
      if group:
        a.free_group_begin(), m.free_group_begin()
        if oracle:
          oracle.free_group_begin()
      for _ in range(rng.randint(1, 2 if group else 1)):
        if not reqs:
          break
        r = reqs.pop(rng.randrange(len(reqs)))
        if rng.random() < 0.4 and len(r) > ps:  # shrink: free a page-aligned tail
          keep = ps * rng.randint(1, (len(r) - 1) // ps)
          release(r[keep:], keep)
          reqs.append(r[:keep])
        else:
          release(r, 0)
      if group:
        a.free_group_end(), m.free_group_end()
        if oracle:
          oracle.free_group_end()
    check(f"seed {seed} step {step}")
    if rng.random() < 0.05:
      a.merge_and_sort_free(), m.merge_and_sort_free()
      if oracle:
        oracle.merge_and_sort_free()
  assert a.available_size() == m.available_size()
  held = {s // ps for r in reqs for s in r}
  assert sorted(a.get_all_free_pages().tolist() + sorted(held)) == list(
      range(1, m.num_pages + 1))


def _torch(xs):
  import torch  # pylint: disable=g-import-not-at-top
  return torch.tensor(list(xs), dtype=torch.int64)


_SLOW = pytest.mark.slow  # each compiles many shape buckets: ~10-30 s on a shared CPU


@pytest.mark.parametrize("page_size", [4, pytest.param(1, marks=_SLOW),
                                       pytest.param(2, marks=_SLOW),
                                       pytest.param(16, marks=_SLOW),
                                       pytest.param(128, marks=_SLOW)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_random_traces_against_model(page_size, need_sort):
  for seed in range(2):
    _run_trace(seed * 100 + page_size, page_size, need_sort, steps=30)


@pytest.mark.parametrize("page_size", [1, 4, 128])
@pytest.mark.parametrize("need_sort", [False, True])
def test_random_traces_against_model_host_backend(page_size, need_sort):
  for seed in range(2):
    _run_trace(seed * 100 + page_size + 5, page_size, need_sort, steps=40, backend="host")


@pytest.mark.skipif(SGLANG_ERROR is not None, reason=str(SGLANG_ERROR))
@pytest.mark.parametrize("page_size", [4, pytest.param(1, marks=_SLOW),
                                       pytest.param(64, marks=_SLOW)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_random_traces_against_sglang(page_size, need_sort):
  """Lock-step with the released sglang (0.5.23 in CI) on CPU: every output and the free
  list exactly, need_sort's staged pages as a set."""
  kind = "token" if page_size == 1 else "paged"
  for seed in range(2):
    _run_trace(1000 + seed + page_size, page_size, need_sort, steps=30, functional=False,
               make_oracle=lambda size: sglang_oracle.SGLangAllocator(
                   size, page_size, need_sort, kind))


# -- generated traces with the SPEC 10 frees (jax_kvalloc.tools.traces) ---------------------

@functools.lru_cache(maxsize=None)
def _segment_traces():
  """Two model-recorded traces whose finished requests are freed through free_segment /
  free_page_ids (the generator's segment_prob): [(config, records)]."""
  from jax_kvalloc.tools import traces  # pylint: disable=g-import-not-at-top
  from trace_helpers import model_replayer  # pylint: disable=g-import-not-at-top
  out = []
  for seed in (3, 4):
    config = traces.random_config(seed, steps=80, page_sizes=(1, 4), segment_prob=0.6)
    out.append((config, traces.generate(config, model_replayer(), trace_id=seed)))
  return tuple(out)


def test_generated_traces_with_segment_frees_replay_on_the_class():
  """The workload generator frees finished requests through free_segment/free_page_ids
  when asked (segment_prob); its model-recorded traces replay exactly on the class."""
  from trace_helpers import jax_replayer, replay  # pylint: disable=g-import-not-at-top
  seen = set()
  for _, recs in _segment_traces():
    seen.update(r["op"] for r in recs)
    replay(recs, jax_replayer())
  assert {"free_segment", "free_page_ids"} <= seen


@pytest.mark.skipif(sglang_oracle is None, reason=str(SGLANG_ERROR))
def test_generated_traces_with_segment_frees_replay_on_torch_ref():
  from jax_kvalloc.tools import parity  # pylint: disable=g-import-not-at-top
  from trace_helpers import replay  # pylint: disable=g-import-not-at-top
  for _, recs in _segment_traces():
    replay(recs, parity.torch_impl("torch").replayer)


@pytest.mark.skipif(SGLANG_ERROR is not None, reason=str(SGLANG_ERROR))
def test_generated_traces_with_segment_frees_replay_on_sglang():
  """On the released sglang (release lists as sets), every trace whose configuration it
  supports; a configuration it does not is named in the skip reason."""
  from jax_kvalloc.tools import parity  # pylint: disable=g-import-not-at-top
  from trace_helpers import replay  # pylint: disable=g-import-not-at-top
  unsupported = []
  for config, recs in _segment_traces():
    why = sglang_oracle.unsupported_reason(config.size, config.page_size, config.need_sort,
                                           config.kind)
    if why is None:
      replay(recs, parity.sglang_impl().replayer)
    else:
      unsupported.append(f"{config}: {why}")
  if len(unsupported) == len(_segment_traces()):
    pytest.skip("sglang supports none of these traces' configurations: "
                + "; ".join(unsupported))
