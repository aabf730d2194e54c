"""The device backend's class calls never wait on the device, and its host mirror of the
list lengths is exact.

Transfer guards do not fire for CPU arrays (the host copy is zero-copy), so on the CPU
`no_device_reads` makes every device-to-host path raise instead: a jax.Array's
__int__/__bool__/__index__/__float__/__array__/item/tolist/block_until_ready,
numpy.asarray/numpy.array of a jax.Array, jax.device_get and jax.block_until_ready. A
serving sequence of class calls (free groups, free_segment, free_page_ids, snapshots,
merges included) runs inside it, fed host data only (the slots to free
come from the model running in lock step); a negative control shows the guard trips. On a
GPU the same sequence runs under jax.transfer_guard_device_to_host("disallow") (marker
gpu; skipped without one).
"""
import contextlib

import jax
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import status as status_module
import jax.numpy as jnp
from model import ModelAllocator
from serving_driver import run_workload
from gpu import needs_gpu


ARRAY_TYPES = (type(jnp.zeros((1,))),)  # jax's ArrayImpl (its methods are patchable)
_READ_STATUS = lambda status, _asarray=np.asarray: _asarray(status)  # noqa: E731


class DeviceRead(AssertionError):
  """A device-to-host read inside `no_device_reads`."""


@contextlib.contextmanager
def no_device_reads():
  """Every device->host path of jax raises DeviceRead while this is open."""
  def refuse(what):
    def raiser(*args, **kwargs):
      raise DeviceRead(f"device read: {what}")
    return raiser

  mp = pytest.MonkeyPatch()
  try:
    for cls in ARRAY_TYPES:
      for name in ("__int__", "__bool__", "__index__", "__float__", "__array__", "item",
                   "tolist", "block_until_ready", "__dlpack__"):
        if hasattr(cls, name):
          mp.setattr(cls, name, refuse(f"jax.Array.{name}"), raising=False)
    for mod_name, fn_name in (("asarray", np.asarray), ("array", np.array)):
      def wrapped(x, *args, _fn=fn_name, _name=mod_name, **kwargs):
        if isinstance(x, jax.Array):
          raise DeviceRead(f"device read: numpy.{_name} of a jax.Array")
        return _fn(x, *args, **kwargs)
      mp.setattr(np, mod_name, wrapped)
    mp.setattr(jax, "device_get", refuse("jax.device_get"))
    mp.setattr(jax, "block_until_ready", refuse("jax.block_until_ready"))
    # The statuses of earlier calls (SPEC 14): read once landed, without a wait in a
    # steady loop (the classes count any wait in `status_waits`).
    mp.setattr(status_module, "read", _READ_STATUS)
    yield
  finally:
    mp.undo()


def decode_all(a, m, slot_lists, put, outputs, speculative=False):
  """One decode token for every request, the class `a` and the model `m` in lock step;
  `put` turns last_loc into the class's input. Appends (class output, model output) to
  `outputs` and each new slot to its list; `speculative` rolls both back instead
  (backup_state / restore_state)."""
  seq = np.array([len(r) + 1 for r in slot_lists])
  last = np.array([r[-1] for r in slot_lists])
  snap = a.backup_state() if speculative else None
  msnap = m.backup_state() if speculative else None
  out = a.alloc_decode(seq, seq, put(last))
  want = m.alloc_decode(seq.tolist(), last.tolist())
  assert (out is None) == (want is None)
  if speculative:
    a.restore_state(snap)
    m.restore_state(msnap)
  elif want is not None:
    outputs.append((out, want))
    for r, s in zip(slot_lists, want):
      r.append(s)


def _serving_sequence(a, m, need_sort, outputs, device_last=False):
  """A serving loop's class calls on `a` (device backend) with host inputs only (or,
  with device_last, last_loc and the free_segment / free_page_ids arguments as device
  arrays, as SGLang passes them); `m` (the model)
  runs alongside to know which slots each request holds. Appends every device output
  to `outputs` (checked afterwards, outside the guard)."""
  put = (lambda x: jnp.asarray(np.asarray(x, np.int32))) if device_last else (
      lambda x: x)
  ps = a.page_size
  reqs = []
  rng = np.random.default_rng(0)
  for step in range(40):
    if step % 7 == 3 and reqs:  # finish two requests inside a free group
      a.free_group_begin()
      m.free_group_begin()
      for _ in range(min(2, len(reqs))):
        slots = reqs.pop(0)
        a.free(np.asarray(slots, np.int64))
        m.free(slots)
      if device_last and reqs:  # a page-id free of a device array, queued in the group
        slots = reqs.pop(0)
        a.free_segment(put(slots), start_pos=0)
        m.free_segment(slots, 0)
      a.free_group_end()
      m.free_group_end()
    elif step % 7 == 5 and reqs:  # finish one through SGLang 0.5.23's unsorted frees
      slots = reqs.pop(0)
      a.free_segment(put(np.asarray(slots, np.int64)), start_pos=0)
      m.free_segment(slots, 0)
      if reqs:
        pages = sorted({s // ps for s in reqs.pop(0)}, reverse=True)
        a.free_page_ids(put(np.asarray(pages, np.int64)))
        m.free_page_ids(pages)
    if step % 5 == 0:  # prefill new requests
      seq = rng.integers(1, 3 * ps + 2, 3)
      zeros = np.zeros(3, np.int64)
      last = np.full(3, -1, np.int64)
      out = a.alloc_extend(zeros, zeros, seq, seq, put(last), int(seq.sum()))
      want = m.alloc_extend([0] * 3, seq.tolist(), [-1] * 3)
      assert (out is None) == (want is None)
      if want is not None:
        outputs.append((out, want))
        starts = np.concatenate([[0], np.cumsum(seq)])
        reqs += [list(want[starts[i]:starts[i + 1]]) for i in range(3)]
    elif reqs:  # decode every live request
      decode_all(a, m, reqs, put, outputs, speculative=step % 4 == 1)
    raw = a.alloc(2 * ps)
    want = m.alloc(2 * ps)
    if want is not None:
      outputs.append((raw, want))
      a.free(np.asarray(want, np.int64))
      m.free(want)
    assert a.available_size() == m.available_size()
  if need_sort:
    a.merge_and_sort_free()
    m.merge_and_sort_free()


@pytest.mark.parametrize("need_sort,device_last", [(False, False), (True, False),
                                                   (False, True), (True, True)])
def test_device_class_calls_do_not_wait(need_sort, device_last):
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(48 * ps, ps, need_sort=need_sort, kernel="jnp",
                                     debug=False)
  m = ModelAllocator(48 * ps, ps, need_sort)
  warm = []
  _serving_sequence(a, m, need_sort, warm, device_last)  # compiles every program needed
  a.clear()
  m = ModelAllocator(48 * ps, ps, need_sort)
  outputs = []
  with no_device_reads():
    _serving_sequence(a, m, need_sort, outputs, device_last)
  assert outputs
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(a.free_pages, m.free_pages)
  np.testing.assert_array_equal(a.release_pages, m.release_pages)


def test_negative_control_trips_the_guard():
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="jnp", debug=False)
  out = a.alloc(8)
  checks = [lambda: np.asarray(out), lambda: np.array(out), lambda: int(out[0]),
            lambda: bool(out[0]), lambda: out.tolist(), lambda: out.item(),
            lambda: out.block_until_ready(), lambda: jax.device_get(out),
            lambda: jax.block_until_ready(out), lambda: a.free_pages,
            lambda: range(10)[out[0]]]
  with no_device_reads():
    for check in checks:
      with pytest.raises(DeviceRead):
        check()
  assert np.asarray(out).tolist() == list(range(4, 12))  # restored afterwards


def test_debug_mode_waits_and_says_so():
  # Debug mode reads the error record after every call: the guard must see it.
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="jnp", debug=True)
  a.alloc(8)
  with no_device_reads(), pytest.raises(DeviceRead):
    a.alloc(8)



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("need_sort,device_last", [(False, False), (True, False),
                                                   (False, True), (True, True)])
def test_device_class_calls_do_not_wait_on_gpu(need_sort, device_last):
  ps = 16
  a = kvs.PagedTokenToKVPoolAllocator(48 * ps, ps, need_sort=need_sort, device="cuda",
                                     debug=False)
  _serving_sequence(a, ModelAllocator(48 * ps, ps, need_sort), need_sort, [], device_last)
  a.clear()
  m = ModelAllocator(48 * ps, ps, need_sort)
  outputs = []
  with jax.transfer_guard_device_to_host("disallow"):
    _serving_sequence(a, m, need_sort, outputs, device_last)
    # Negative control, before anything is read: the guard is live (once an array has
    # been read, jax keeps its host copy and a second read transfers nothing).
    with pytest.raises(Exception):
      np.asarray(outputs[0][0])
  for out, want in outputs:
    np.testing.assert_array_equal(np.asarray(out), want)


# -- the host mirror equals the device state after every operation ------------------------

class MirrorChecked:
  """Forwards to a class instance; after every method call asserts that the host mirror
  (available_size's source) equals the lengths in the device state."""

  def __init__(self, impl):
    self._impl = impl
    self.checks = 0

  def __getattr__(self, name):
    attr = getattr(self._impl, name)
    if not callable(attr):
      return attr

    def call(*args, **kwargs):
      result = attr(*args, **kwargs)
      a = self._impl
      st = a._pools[0].state  # pylint: disable=protected-access
      assert a._pools[0].lengths() == (int(st.free_len), int(st.release_len)), (
          f"after {name}: mirror {a._pools[0].lengths()} != state "
          f"{(int(st.free_len), int(st.release_len))}")
      self.checks += 1
      return result
    return call


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("kind,ps,num_pages", [("token", 1, 40), ("paged", 4, 24),
                                               ("paged", 16, 12)])
def test_host_mirror_is_exact_on_random_traces(kind, ps, num_pages, need_sort, backend):
  if kind == "token":
    impl = kvs.TokenToKVPoolAllocator(num_pages, need_sort=need_sort, debug=False,
                                     backend=backend)
  else:
    impl = kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                          debug=False, backend=backend)
  checked = MirrorChecked(impl)
  run_workload(checked, size=num_pages * ps, page_size=ps, need_sort=need_sort, kind=kind,
               steps=150, seed=3)
  assert checked.checks > 100
