"""The SWA class's steady serving calls do not wait on the device (device backend).

As tests/test_no_wait.py for the paged class: prefill (alloc_extend, and
alloc_extend_swa_tail), decode (alloc_decode, host last_loc or a device last_loc),
speculative snapshots (backup_state / restore_state), sizes, translate, and full-pool
frees of tokens without SWA KV (free_full, free_full_segment, inside free groups too) run
inside `no_device_reads`, fed host data only, with the SPEC 13 model in lock step.
The SWA frees (free, free_swa, free_swa_segment, free_segment) read the freed slots'
mapping entries back, as SGLang's free_swa synchronizes; they run outside the guard here,
and the last test shows that they do read.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from swa_model import ModelSWA
from test_no_wait import DeviceRead, no_device_reads


def _new(ps, need_sort):
  from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
  return SWATokenToKVPoolAllocator(48 * ps, 24 * ps, ps, None, "cpu", None, need_sort,
                                   backend="device", kernel="jnp", debug=False)


def _serve(a, m, outputs, guard, device_last, steps=16):
  """Serving steps; allocation-side calls run inside `guard()`; each finished request's
  SWA free runs outside it. Appends (device output, model output) pairs."""
  ps = a.page_size
  put = (lambda x: jnp.asarray(np.asarray(x, np.int32))) if device_last else (lambda x: x)
  rng = np.random.default_rng(0)
  reqs, full_only = [], []
  for step in range(steps):
    with guard():
      if step % 4 == 0:  # prefill two requests, and one without SWA KV
        seq = rng.integers(1, 3 * ps + 2, 2)
        z = np.zeros(2, np.int64)
        out = a.alloc_extend(z, z, seq, seq, put(np.full(2, -1)), int(seq.sum()))
        want = m.alloc_extend([0, 0], seq.tolist(), [-1, -1])
        assert (out is None) == (want is None)
        if want is not None:
          outputs.append((out, want))
          reqs += [list(want[:seq[0]]), list(want[seq[0]:])]
        one = np.array([0], np.int64)
        n = np.array([2 * ps], np.int64)
        out = a.alloc_extend_swa_tail(one, one, n, n, np.array([-1]), 2 * ps, 0)
        want = m.alloc_extend_swa_tail(0, 2 * ps, -1, 0)
        if want is not None:
          outputs.append((out, want))
          full_only.append(want)
      elif reqs:
        seq = np.array([len(r) + 1 for r in reqs])
        last = np.array([r[-1] for r in reqs])
        snap = a.backup_state() if step % 3 == 1 else None
        msnap = m.backup_state() if snap is not None else None
        out = a.alloc_decode(seq, seq, put(last))
        want = m.alloc_decode(seq.tolist(), last.tolist())
        assert (out is None) == (want is None)
        if snap is not None:
          a.restore_state(snap)
          m.restore_state(msnap)
        elif want is not None:
          outputs.append((out, want))
          for r, s in zip(reqs, want):
            r.append(s)
      if full_only and step % 3 == 2:  # tokens without SWA KV leave the full pool only
        a.free_group_begin()
        m.free_group_begin()
        slots = full_only.pop(0)
        a.free_full(np.asarray(slots[:ps], np.int64))
        m.free_full(slots[:ps])
        a.free_full_segment(np.asarray(slots[ps:], np.int64), start_pos=ps)
        m.free_full_segment(slots[ps:], ps)
        a.free_group_end()
        m.free_group_end()
      assert a.available_size() == m.available_size()
      assert a.full_available_size() == m.full_available_size()
      outputs.append((a.translate_loc_from_full_to_swa(np.array([-1])), [-1]))
    if len(reqs) > 3:  # finish the oldest (reads the mapping: outside the guard)
      slots = reqs.pop(0)
      a.free(np.asarray(slots, np.int64))
      m.free(slots)


@pytest.mark.parametrize("need_sort,device_last", [(False, False), (True, True)])
def test_swa_device_class_allocations_do_not_wait(need_sort, device_last):
  import contextlib
  ps = 4
  a = _new(ps, need_sort)
  _serve(a, ModelSWA(48 * ps, 24 * ps, ps, need_sort), [], contextlib.nullcontext,
         device_last)  # compiles every program the sequence needs
  a.clear()
  m = ModelSWA(48 * ps, 24 * ps, ps, need_sort)
  outputs = []
  _serve(a, m, outputs, no_device_reads, device_last)
  assert len(outputs) > 20
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(a.full_attn_allocator.free_pages, m.full.free_pages)
  np.testing.assert_array_equal(a.swa_attn_allocator.free_pages, m.swa.free_pages)


def test_swa_frees_read_the_mapping():
  a = _new(4, False)
  z = np.zeros(1, np.int64)
  out = a.alloc_extend(z, z, np.array([8]), np.array([8]), np.array([-1]), 8)
  a.free_swa(np.arange(4, 8))  # compile outside the guard
  with no_device_reads(), pytest.raises(DeviceRead):
    a.free_swa_segment(np.arange(8, 12), start_pos=4)
  del out
