"""The SWA request table (jax_kvalloc.swa_table) against the SPEC 13 model, in lock step:
extend / decode / window / release of random rows inside jitted steps, and the
attention inputs of full and sliding-window layers."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc import state as st
from jax_kvalloc import swa as core
from jax_kvalloc import swa_table as tb
from swa_model import ModelSWA

PS, ROWS, COLS, B, TOK = 4, 6, 8, 4, 64
CFG = core.SWAConfig(32 * PS, 7 * PS, PS, True, kernel="jnp", debug=False)

_extend = jax.jit(functools.partial(tb.extend_rows, CFG, max_tokens=TOK))
_decode = jax.jit(functools.partial(tb.decode_rows, CFG))
_window = jax.jit(functools.partial(tb.window_rows, CFG))
_release = jax.jit(functools.partial(tb.release_rows, CFG))
_attn = jax.jit(functools.partial(tb.attention_inputs, CFG))


def _pad(x, fill=0):
  out = np.full((B,), fill, np.int32)
  out[:len(x)] = x
  return out


def _check(state, table, m, slots, swa_from, window):
  np.testing.assert_array_equal(st.live_free_pages(state.full), m.full.free_pages)
  np.testing.assert_array_equal(sorted(st.live_release_pages(state.full)),
                                sorted(m.full.release_pages))
  np.testing.assert_array_equal(st.live_free_pages(state.swa), m.swa.free_pages)
  np.testing.assert_array_equal(st.live_release_pages(state.swa), m.swa.release_pages)
  live = [r for r in range(ROWS) if slots[r]]
  for r in live:
    assert int(table.lens[r]) == len(slots[r])
    assert int(table.swa_from[r]) == swa_from[r]
    np.testing.assert_array_equal(np.asarray(table.pages[r, :-(-len(slots[r]) // PS)]),
                                  [s // PS for s in slots[r][::PS]])
    np.testing.assert_array_equal(np.asarray(core.translate(state.mapping,
                                                            np.array(slots[r]))),
                                  m.translate(slots[r]))
  rows = live[:B]
  if rows:
    q = np.ones(len(rows), np.int32)
    a = _attn(state, table, _pad(rows), _pad(q), np.int32(window),
              num_rows=np.int32(len(rows)))
    for i, r in enumerate(rows):
      n = len(slots[r])
      full_pages = [s // PS for s in slots[r][::PS]]
      np.testing.assert_array_equal(np.asarray(a.page_indices[i, :len(full_pages)]),
                                    full_pages)
      first = max(swa_from[r], max(n - window, 0) // PS)
      want = [m.translate([slots[r][j * PS]])[0] // PS for j in range(first, len(full_pages))]
      got = np.asarray(a.swa_page_indices[i])
      np.testing.assert_array_equal(got[:len(want)], want)
      assert not got[len(want):].any()
      assert int(a.swa_start[i]) == first * PS and int(a.swa_kv_lens[i]) == n - first * PS
    assert int(a.num_seqs[0]) == len(rows)


@pytest.mark.parametrize("seed", [0])
def test_table_matches_model(seed):
  rng = np.random.default_rng(seed)
  state, table = core.init(CFG), tb.init_table(CFG, ROWS, COLS)
  m = ModelSWA(CFG.size, CFG.size_swa, PS, True)
  slots = [[] for _ in range(ROWS)]
  swa_from = [0] * ROWS
  window = 2 * PS + 1
  refused = 0
  for _ in range(60):
    op = rng.integers(0, 4)
    k = int(rng.integers(1, B + 1))
    rows = sorted(rng.choice(ROWS, k, replace=False).tolist())
    if op == 0:  # extend
      n = rng.integers(0, 2 * PS + 2, k)
      state, table, out, ok = _extend(state, table, _pad(rows), _pad(n),
                                      num_rows=np.int32(k))
      pre = [len(slots[r]) for r in rows]
      fits = all(-(-(p + int(x)) // PS) <= COLS for p, x in zip(pre, n))
      want = m.alloc_extend(pre, [p + int(x) for p, x in zip(pre, n)],
                            [slots[r][-1] if slots[r] else -1 for r in rows]) \
          if fits else None
      assert bool(ok) == (want is not None)
      if want is None:
        refused += 1
        continue
      np.testing.assert_array_equal(np.asarray(out[:len(want)]), want)
      at = 0
      for r, x in zip(rows, n):
        slots[r] += want[at:at + int(x)]
        at += int(x)
    elif op == 1:  # decode
      rows = [r for r in rows if slots[r]]
      if not rows or any(-(-(len(slots[r]) + 1) // PS) > COLS for r in rows):
        continue
      state, table, out, ok = _decode(state, table, _pad(rows), num_rows=np.int32(len(rows)))
      want = m.alloc_decode([len(slots[r]) + 1 for r in rows], [slots[r][-1] for r in rows])
      assert bool(ok) == (want is not None)
      if want is None:
        refused += 1
        continue
      np.testing.assert_array_equal(np.asarray(out[:len(rows)]), want)
      for r, s in zip(rows, want):
        slots[r].append(s)
    elif op == 2:  # the window
      state, table, ok = _window(state, table, _pad(rows), np.int32(window),
                                 num_rows=np.int32(k))
      assert bool(ok)
      m.free_group_begin()
      for r in rows:
        end = max(len(slots[r]) - window, 0) // PS
        if end > swa_from[r]:
          m.free_swa_segment(slots[r][swa_from[r] * PS:end * PS], swa_from[r] * PS)
          swa_from[r] = end
      m.free_group_end()
    else:  # release
      state, table, ok = _release(state, table, _pad(rows), num_rows=np.int32(k))
      assert bool(ok)
      m.free_group_begin()
      for r in rows:
        m.free_segment(slots[r], 0)
        slots[r], swa_from[r] = [], 0
      m.free_group_end()
    _check(state, table, m, slots, swa_from, window)
  assert refused > 0


def test_bad_rows_are_refused():
  state, table = core.init(CFG), tb.init_table(CFG, ROWS, COLS)
  s2, t2, out, ok = _extend(state, table, _pad([1, 1]), _pad([2, 2]), num_rows=np.int32(2))
  assert not bool(ok) and not np.asarray(out).any()
  jax.tree.map(np.testing.assert_array_equal, (s2, t2), (state, table))
  s2, t2, out, ok = _extend(state, table, _pad([0]), _pad([COLS * PS + 1]),
                            num_rows=np.int32(1))
  assert not bool(ok)  # more pages than the row has columns
