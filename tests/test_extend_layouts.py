"""The fused Triton extend kernel's layouts ("rows", "tiles"), on CPU (interpreter).

`alloc_extend_triton(layout=...)` (pallas_kernels/triton_extend.py) must equal the jnp
path bit for bit, whole result (indices, new head and length, ok), in either layout:

- through the allocator with the layout forced (tuning.EXTEND_ROWS_*): every page size,
  random pools (shuffled rings, any head so reads wrap, free lengths that are plenty,
  exact, one page short or 0), against the jnp path and the model. The default rule
  sends the other allocator tests (test_pallas_alloc.py, test_capacity.py) through the
  rows layout; the tiles layout runs here for every page size;
- the kernel alone, rows layout, with blocks and chunks that force long
  loops, strided chunks, a zero tail spread over programs, one row, and rows not a power
  of two;
- lengths at and near 2**31 - 1 (tests/test_capacity.py's cases), also with the exact
  (16-bit halves) total check forced on; Part 1 ending past 2**31 - 1 (against the
  model); refusals (invalid rows, too many tokens or pages); num_reqs 0 or past B.

Pallas' interpreter fills outputs with INT32_MIN before the kernel runs (checked below),
so an index the kernel never writes shows up as a mismatch. The H200 lowering of both
layouts is in test_pallas_lowering.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jax_kvalloc as kv
import pallas_kernels
from pallas_kernels import triton_extend
from pallas_kernels import tuning
from model import ModelAllocator
import kernel_cases as testing
import test_capacity as cap
from test_pallas_alloc import _assert_same, _configs, _extend_cases, _rng, _state
from test_pallas_alloc import check_alloc_extend

LAYOUTS = triton_extend.LAYOUTS


def force_layout(monkeypatch, layout: str) -> None:
  """Makes tuning.extend_layout (the default of alloc_extend_triton) return `layout`."""
  per_row = layout == "rows"
  monkeypatch.setattr(tuning, "EXTEND_ROWS_MIN_ROWS", 1 if per_row else 2**16)
  monkeypatch.setattr(tuning, "EXTEND_ROWS_MAX_ROWS", 2**16 if per_row else 0)


def _check_kernel(ps, *, rows, max_tokens, num_pages, seed, num_cases=8, interpret=True,
                  **kwargs):
  """alloc_extend_triton(**kwargs) == the jnp allocator on num_cases random pools and
  batches (vmapped: one compile). interpret=False: compiled for the GPU
  (test_pallas_gpu.py)."""
  (pre, seq, last, nreq), (ring, head, length) = _extend_cases(
      _rng("layouts", ps, seed), ps, num_cases, rows, max_tokens, num_pages)
  jnp_cfg, _ = _configs(ps, num_pages=num_pages)

  def ref(ring, head, length, pre, seq, last, nreq):
    s, out, ok = kv.alloc_extend(jnp_cfg, _state(jnp_cfg, ring, head, length), pre, seq,
                                 last, max_tokens=max_tokens, num_reqs=nreq)
    return out, s.free_head, s.free_len, ok

  fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=ps,
                         out_len=max_tokens, interpret=interpret, **kwargs)
  args = (ring, head, length, pre, seq, last, nreq)
  got = jax.jit(jax.vmap(lambda r, h, l, p, s, la, n: fn(r, h, l, n, p, s, la)))(*args)
  want = jax.jit(jax.vmap(ref))(*args)
  _assert_same(got, want)
  return want


def test_interpreter_poisons_unwritten_outputs():
  # What makes a missing store visible in every comparison of this file.
  def writes_nothing(x_ref, o_ref):
    del x_ref, o_ref

  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32),
                       interpret=True)(jnp.zeros((8,), jnp.int32))
  assert (np.asarray(out) == np.iinfo(np.int32).min).all()


@pytest.mark.parametrize("ps", (1, 16, 64))  # every page size: test_layouts_exhaustive
def test_tiles_layout_through_the_allocator(ps, monkeypatch):
  force_layout(monkeypatch, "tiles")
  check_alloc_extend(ps, seed=21)


@pytest.mark.parametrize("ps,rows,max_tokens,tile,chunks", [
    (1, 8, 128, 8, 1),       # rows of many blocks: long loops; a tail of many blocks
    (3, 8, 128, 8, 3),       # strided chunks (not a power of two), ps not one either
    (16, 5, 200, 16, 2),     # 5 rows (grid 10, rows_pad 8), out_len not a power of two
    (64, 1, 300, 32, 2),     # one row
    (128, 33, 512, None, None),   # the defaults (tuning.extend_rows_block)
    (2, 8, 64, 256, None),   # a block longer than out_len
])
def test_rows_layout_blocks_and_chunks(ps, rows, max_tokens, tile, chunks):
  _check_kernel(ps, rows=rows, max_tokens=max_tokens, num_pages=3 * max_tokens // ps + 40,
                seed=rows, layout="rows", tile=tile, chunks=chunks)


@functools.lru_cache(maxsize=None)
def _near_int32_max_cases(ps):
  """test_capacity's cases of page size ps, padded to 3 rows and stacked: (state
  arrays, batch arrays, jnp path's (out, head, length, ok))."""
  cases = [(pre, seq) for p, pre, seq, _ in cap.EXTEND_CASES if p == ps]
  cfg = cap._cfg(ps, "jnp")
  s = cap._state(cfg)
  pad = lambda x, v: np.asarray(list(x) + [v] * (3 - len(x)), np.int32)
  pre = np.stack([pad(c[0], 0) for c in cases])
  seq = np.stack([pad(c[1], 0) for c in cases])
  last = cap._last(ps, pre)
  nreq = np.asarray([len(c[0]) for c in cases], np.int32)

  def ref(pre, seq, last, nreq):
    t, out, ok = kv.alloc_extend(cfg, s, pre, seq, last, max_tokens=cap.MAX_TOKENS,
                                 num_reqs=nreq)
    return out, t.free_head, t.free_len, ok

  want = jax.jit(jax.vmap(ref))(pre, seq, last, nreq)
  return (s.free_ring, s.free_head, s.free_len), (pre, seq, last, nreq), want


@pytest.mark.parametrize("layout,exact", [("rows", True), ("tiles", False)])
def test_near_int32_max(layout, exact, monkeypatch):
  # test_capacity's cases (sums that wrap int32, lengths near 2**31 - 1 that fit),
  # also with the exact total check forced on (it runs where B * (limit + 1) passes
  # int32: rows or lengths too large for the interpreter). test_capacity itself runs
  # the plain check in the default layout (rows, for its 2 and 3 rows); it is the same
  # code (_batch) in every layout.
  if exact:
    monkeypatch.setattr(triton_extend, "_may_wrap", lambda *args: True)
  for ps in sorted({c[0] for c in cap.EXTEND_CASES}):
    (ring, head, length), (pre, seq, last, nreq), want = _near_int32_max_cases(ps)
    fn = functools.partial(pallas_kernels.alloc_extend_triton, ring, head, length,
                           page_size=ps, out_len=cap.MAX_TOKENS, interpret=True,
                           layout=layout)
    got = jax.jit(jax.vmap(lambda n, p, s, la: fn(n, p, s, la)))(nreq, pre, seq, last)
    _assert_same(got, want)
  assert np.asarray(want[3]).any() and not np.asarray(want[3]).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_part1_end_past_int32_max_follows_the_model(layout):
  # A prefix within a page of 2**31 - 1: ceil(pre / ps) * ps (Part 1's end) passes int32.
  # The kernel takes it modulo 2**32, which is exact since Part 1 is shorter than a
  # page; the model works in Python integers.
  ps, n = 16, cap.NUM_PAGES
  ring = np.roll(np.arange(1, n + 1, dtype=np.int32), 7)
  pre = np.asarray([2**31 - 2, 0, 2**31 - 9], np.int32)
  seq = np.asarray([2**31 - 1, 20, 2**31 - 1], np.int32)
  last = cap._last(ps, pre)
  out, head, length, ok = pallas_kernels.alloc_extend_triton(
      ring, 60, n, 3, pre, seq, last, page_size=ps, out_len=32, interpret=True,
      layout=layout)
  m = ModelAllocator(size=n * ps, page_size=ps, kind="paged")
  m.free_pages = testing.window(ring, 60, n, n).tolist()
  want = m.alloc_extend(pre.tolist(), seq.tolist(), last.tolist())
  assert bool(ok) and int(length) == len(m.free_pages) == n - 2
  assert int(head) == (60 + 2) % n
  assert np.asarray(out).tolist() == want + [0] * (32 - len(want))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refusals(layout):
  # Each batch is refused: indices 0, head and length unchanged, ok False.
  ps = 4
  ring = np.arange(1, 33, dtype=np.int32)
  batches = [  # (free_len, num_reqs, prefix_lens, seq_lens)
      (32, 2, [0, 5, 0], [9, 4, 0]),      # seq < prefix
      (32, 2, [-4, 0, 0], [3, 4, 0]),     # negative prefix
      (32, 3, [0, 0, 0], [30, 30, 5]),    # 65 tokens > out_len 64
      (3, 2, [0, 2, 0], [8, 9, 0]),       # 4 new pages, 3 free
      (0, 1, [0, 0, 0], [1, 0, 0]),       # no free page
  ]
  flen, nreq, pre, seq = (np.asarray(x, np.int32) for x in zip(*batches))
  fn = functools.partial(pallas_kernels.alloc_extend_triton, ring, 30, page_size=ps,
                         out_len=64, interpret=True, layout=layout)
  out, head, length, ok = jax.jit(jax.vmap(fn))(flen, nreq, pre, seq,
                                                cap._last(ps, np.maximum(pre, 0)))
  assert not np.asarray(ok).any() and not np.asarray(out).any()
  assert (np.asarray(head) == 30).all() and np.asarray(length).tolist() == flen.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_num_reqs_zero_and_past_the_rows(layout):
  # num_reqs 0: nothing to do (ok, no pages); past B: clipped to B.
  ps = 2
  ring = np.arange(1, 17, dtype=np.int32)
  pre, seq = np.int32([0, 3]), np.int32([3, 6])
  last = cap._last(ps, pre)
  call = functools.partial(pallas_kernels.alloc_extend_triton, ring, 15, 16,
                           page_size=ps, out_len=8, interpret=True, layout=layout)
  out, head, length, ok = call(0, pre, seq, last)
  assert bool(ok) and (int(head), int(length)) == (15, 16) and not np.asarray(out).any()
  out, head, length, ok = call(5, pre, seq, last)
  # Row 0: pages 16, 1 (the ring wraps); row 1: Part 1 slot last + 1, then page 2.
  assert np.asarray(out).tolist() == [32, 33, 2, int(last[1]) + 1, 4, 5, 0, 0]
  assert bool(ok) and (int(head), int(length)) == (2, 13)


def test_layout_argument_and_default_rule():
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)

  def name(rows, **kwargs):
    fn = functools.partial(pallas_kernels.alloc_extend_triton, page_size=4, out_len=64,
                           interpret=True, **kwargs)
    text = str(jax.make_jaxpr(fn)(i32(16), 0, 16, rows, i32(rows), i32(rows), i32(rows)))
    return "rows" if "jax_kvalloc_alloc_extend_triton_rows" in text else "tiles"

  seen = set()   # the kernel takes the layout the rule names
  for rows in (1, 2, 7, 1024, 1025):
    want = tuning.extend_layout(triton_extend._util.next_pow2(rows), 64)
    assert name(rows) == want
    seen.add(want)
  assert seen == {"rows", "tiles"}   # both sides of the rule were taken
  assert name(8, layout="tiles") == "tiles" and name(1, layout="rows") == "rows"
  with pytest.raises(ValueError, match="layout must be one of"):
    name(8, layout="blocks")
  with pytest.raises(ValueError, match="chunks"):
    name(8, layout="rows", chunks=0)
  # The rows layout's blocks: a row of up to twice the mean (capped at out_len) is
  # covered by its C programs of T tokens each, T a power of two within the tuned bounds.
  lo, hi = tuning.EXTEND_ROWS_BLOCK
  for rows, out_len in ((1, 8), (1, 8192), (3, 100), (16, 32768), (256, 65536),
                        (1024, 65536), (1000, 7)):
    tile, chunks, warps = tuning.extend_rows_block(rows, out_len)
    span = min(2 * -(-out_len // rows), out_len)
    assert triton_extend._util.is_pow2(tile) and tile <= max(hi, 1)
    assert tile >= min(lo, triton_extend._util.next_pow2(out_len))
    assert chunks * tile >= span and (chunks - 1) * tile < span, (rows, out_len)
    assert 1 <= warps <= 8


@pytest.mark.parametrize("ps,layout", [(ps, "rows") for ps in testing.PAGE_SIZES + (3,)]
                         + [(ps, "tiles") for ps in (1, 64)])
def test_layouts_exhaustive(ps, layout, monkeypatch):
  # Slow (SLOW_TESTS): more random pools per page size through the allocator (against
  # the model too), and the rows layout at small blocks: the default layout ("rows") at
  # every page size, "tiles" at page sizes 1 and 64 (CI's time).
  force_layout(monkeypatch, layout)
  check_alloc_extend(ps, num_cases=32, model_cases=12, seed=31)
  check_alloc_extend(ps, rows=40, max_tokens=600, num_pages=700, num_cases=8,
                     model_cases=2, seed=32)
  if layout == "rows":
    for tile, chunks in ((4, 1), (8, 5), (64, 2)):
      _check_kernel(ps, rows=12, max_tokens=300, num_pages=800, seed=tile, num_cases=16,
                    layout="rows", tile=tile, chunks=chunks)
