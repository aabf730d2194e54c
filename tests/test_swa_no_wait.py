"""The SWA class's steady serving calls do not wait on the device (device backend).

As tests/test_no_wait.py for the paged class: prefill (alloc_extend, and
alloc_extend_swa_tail with and without an SWA tail), decode (alloc_decode), speculative
snapshots (backup_state / restore_state), sizes, translate, window frees through
free_swa_segment, finishes through free_segment (the SWA part) and free_full_segment
(the part whose window KV is gone), and full-only frees (free_full, free_full_segment),
inside free groups and outside, all run inside `no_device_reads` with the SPEC 13 model in
lock step; with `device_inputs`, last_loc and every segment free's free_index are device
arrays (as SGLang passes them). Finishes also go through free_swa of a request's last
token and free of its host slots, whose SWA counts come from the host record
(jax_kvalloc.sglang.swa_peers), full-only requests through free. The last tests show
that free_swa and free of host slots read nothing, that a mapping set by hand makes
free_swa read the count (once: the record is rebuilt then), and that debug mode checks
device segments' peers.
"""
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from swa_model import ModelSWA
from test_no_wait import DeviceRead, decode_all, no_device_reads

PS = 4
WINDOW = PS + 1


def _new(ps, need_sort, debug=False):
  from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
  return SWATokenToKVPoolAllocator(48 * ps, 24 * ps, ps, None, "cpu", None, need_sort,
                                   backend="device", kernel="jnp", debug=debug)


class _Req:
  """One request's full slots and its first token that still has SWA KV."""

  def __init__(self, slots, swa_start=0):
    self.slots, self.swa_start = list(slots), swa_start


def _serve(a, m, outputs, guard, device_inputs, steps=24):
  """Serving steps, each inside `guard()`. Appends (device output, model output) pairs."""
  ps = a.page_size
  def landed(x):  # a device input computed before the call (as SGLang's table slices)
    while not x.is_ready():
      time.sleep(0)
    return x

  put = (lambda x: landed(jnp.asarray(np.asarray(x, np.int32)))) if device_inputs else (
      lambda x: np.asarray(x, np.int64))
  rng = np.random.default_rng(0)
  reqs, full_only = [], []

  def group(on):
    if on:
      a.free_group_begin()
      m.free_group_begin()
    return on

  def end(on):
    if on:
      a.free_group_end()
      m.free_group_end()

  tails = []
  for step in range(steps):
    # A caller that names a request's slots on the host has read them: the SWA tails
    # of the last step have landed (swa_peers reads their head pages once they have).
    jax.block_until_ready(tails)
    tails = []
    with guard():
      if step % 4 and reqs:
        decode_all(a, m, [r.slots for r in reqs], put, outputs, speculative=step % 3 == 1)
      if step % 2 == 1:  # the window: SWA KV of whole pages before len - WINDOW leaves
        on = group(step % 4 == 3)
        for r in reqs:
          start = max(0, (len(r.slots) - WINDOW) // ps * ps)
          if start > r.swa_start:
            a.free_swa_segment(put(r.slots[r.swa_start:start]), start_pos=r.swa_start)
            m.free_swa_segment(r.slots[r.swa_start:start], r.swa_start)
            r.swa_start = start
        end(on)
      if full_only and step % 3 == 2:  # tokens without SWA KV leave the full pool only
        on = group(step % 6 == 2)
        slots = full_only.pop(0)
        if step % 4 == 1:  # or through free: no SWA page to count (swa_peers)
          a.free(np.asarray(slots, np.int64))
          m.free(slots)
        else:
          a.free_full(np.asarray(slots[:ps], np.int64))
          m.free_full(slots[:ps])
          a.free_full_segment(put(slots[ps:]), start_pos=ps)
          m.free_full_segment(slots[ps:], ps)
        end(on)
      if len(reqs) > 4:  # finish the oldest: its window-freed head, then the rest
        on = group(step % 2 == 0)
        r = reqs.pop(0)
        if step % 3 == 0:  # host slots: free_swa of its last token, then free of all
          a.free_swa(np.asarray(r.slots[-1:], np.int64))
          m.free_swa(r.slots[-1:])
          a.free(np.asarray(r.slots, np.int64))
          m.free(r.slots)
        else:
          if r.swa_start:
            a.free_full_segment(put(r.slots[:r.swa_start]), start_pos=0)
            m.free_full_segment(r.slots[:r.swa_start], 0)
          a.free_segment(put(r.slots[r.swa_start:]), start_pos=r.swa_start)
          m.free_segment(r.slots[r.swa_start:], r.swa_start)
        end(on)
      if step % 4 == 0:  # prefill two requests, one SWA-tail request, one full-only
        # (after this step's frees, as a scheduler admits after it has retired)
        seq = rng.integers(1, 3 * ps + 2, 2)
        z = np.zeros(2, np.int64)
        out = a.alloc_extend(z, z, seq, seq, put(np.full(2, -1)), int(seq.sum()))
        want = m.alloc_extend([0, 0], seq.tolist(), [-1, -1])
        assert (out is None) == (want is None)
        if want is not None:
          outputs.append((out, want))
          reqs += [_Req(want[:seq[0]]), _Req(want[seq[0]:])]
        one = np.array([0], np.int64)
        for tail, into in ((ps, reqs), (0, full_only)):  # tail ps: SWA KV of page 3 only
          n = np.array([3 * ps], np.int64)
          out = a.alloc_extend_swa_tail(one, one, n, n, np.array([-1]), 3 * ps, tail)
          want = m.alloc_extend_swa_tail(0, 3 * ps, -1, tail)
          assert (out is None) == (want is None)
          if want is not None:
            outputs.append((out, want))
            tails.append(out)
            into.append(_Req(want, 2 * ps) if tail else want)
      assert a.available_size() == m.available_size()
      assert a.full_available_size() == m.full_available_size()
      assert a.swa_available_size() == m.swa_available_size()
      outputs.append((a.translate_loc_from_full_to_swa(np.array([-1])), [-1]))
      live = [s for r in reqs for s in r.slots]
      outputs.append((a.translate_loc_from_full_to_swa(np.asarray(live, np.int64)),
                      m.translate(live)))


@pytest.mark.parametrize("need_sort,device_inputs", [(False, False), (True, True)])
def test_swa_device_class_serving_does_not_wait(need_sort, device_inputs):
  ps = PS
  a = _new(ps, need_sort)
  _serve(a, ModelSWA(48 * ps, 24 * ps, ps, need_sort), [], contextlib.nullcontext,
         device_inputs)  # compiles every program the sequence needs
  a.clear()
  m = ModelSWA(48 * ps, 24 * ps, ps, need_sort)
  outputs = []
  _serve(a, m, outputs, no_device_reads, device_inputs)
  assert len(outputs) > 40
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)
  for mine, model in ((a.full_attn_allocator, m.full), (a.swa_attn_allocator, m.swa)):
    np.testing.assert_array_equal(mine.free_pages, model.free_pages)
    np.testing.assert_array_equal(mine.release_pages, model.release_pages)


def test_swa_free_swa_and_free_of_host_slots_read_nothing():
  a = _new(PS, False)
  z = np.zeros(1, np.int64)
  a.alloc_extend(z, z, np.array([16]), np.array([16]), np.array([-1]), 16)  # pages 1-4
  a.free_swa(np.arange(4, 8))  # compile outside the guard
  a.free(np.arange(4, 8))
  with no_device_reads():
    a.free_swa(np.arange(9, 10))   # part of page 2: its SWA KV
    a.free_swa(np.arange(8, 12))   # none left there: nothing
    assert a.swa_available_size() == 24 * PS - 8
    a.free(np.arange(8, 16))       # page 2 (no SWA KV left) and page 3 (SWA KV)
    assert (a.full_available_size(), a.swa_available_size()) == (48 * PS - 4,
                                                                 24 * PS - 4)
  peer = np.asarray(a.translate_loc_from_full_to_swa(np.array([17])))
  a.set_full_to_swa_mapping(np.array([17]), peer)  # by hand: the record cannot count
  with no_device_reads(), pytest.raises(DeviceRead):
    a.free_swa(np.arange(16, 20))


def test_swa_debug_mode_checks_device_segments():
  from jax_kvalloc.sglang.swa import SWADebugError
  a = _new(PS, False, debug=True)
  z = np.zeros(1, np.int64)
  out = a.alloc_extend(z, z, np.array([12]), np.array([12]), np.array([-1]), 12)
  a.free_swa_segment(out[:4], start_pos=0)
  before = a.swa_available_size()
  with pytest.raises(SWADebugError, match="no SWA peer"):
    a.free_swa_segment(out[:8], start_pos=0)  # page 1's SWA KV is already gone
  with pytest.raises(SWADebugError, match="still has SWA peer"):
    a.free_full_segment(out[4:12], start_pos=4)
  assert a.swa_available_size() == before
  a.free_full_segment(out[:4], start_pos=0)
  a.free_segment(out[4:], start_pos=4)
  assert a.swa_available_size() == a.size_swa
  assert a.full_available_size() == a.size_full
