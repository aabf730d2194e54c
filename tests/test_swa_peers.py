"""The SWA class's device backend counts the SWA pages that free / free_swa of host slots
release from a host record (jax_kvalloc.sglang.swa_peers), without reading the device:
hypothesis drives both backends in lock step through random serving sequences (prefill,
continued prefill, decode, SWA tails aligned to the pages or not, free_swa of any
tokens, whole and window frees through every free method, free groups, snapshots,
merges, a mapping set by hand) at page sizes 1, 2 and 4, and checks after every step:
  - the outputs are equal, and so are both pools' available sizes (the device backend's
    from its host mirror);
  - the device backend's mirror equals its state's lengths;
  - its record, with every queued array applied, equals the one rebuilt from its state
    (unless the pairing is irregular: then the counts are read from the device).
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.swa_peers import PeerRecord

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
PROFILES = {  # (settings, steps per example)
    "ci": (settings(max_examples=6, derandomize=True, **_COMMON), 60),
    "thorough": (settings(max_examples=100, **_COMMON), 120),
}
SETTINGS, STEPS = PROFILES[os.environ.get("JAX_KVALLOC_HYPOTHESIS", "ci")]


class _Req:
  """One request: its full slots, the full pages whose SWA KV is gone, and whether its
  pairing is irregular (an SWA tail not aligned to the pages: freed whole only)."""

  def __init__(self, slots, dead=(), odd=False):
    self.slots, self.dead, self.odd = list(slots), set(dead), odd


class SWADriver:
  """Both backends of one SWA class config; requests as the host backend handed them.
  Each operation method takes hypothesis' `data` (what it draws) and does nothing when
  no request suits it."""
  # The operations, weighted by repetition.
  OPS = (["prefill", "decode", "free_swa_some"] * 3 + ["free_whole", "window"] * 2
         + ["swa_tail", "free_by_segments", "group_toggle", "backup", "restore", "merge",
            "mapping_by_hand"])

  def __init__(self, ps, need_sort):
    self.ps = ps
    self.a = [kvs.SWATokenToKVPoolAllocator(24 * ps, 12 * ps, ps, None, "cpu", None,
                                            need_sort, kernel="jnp", debug=False,
                                            backend=b) for b in ("host", "device")]
    self.reqs, self.group, self.snap = [], False, None

  # -- helpers ---------------------------------------------------------------------------
  def _both(self, name, *args, **kw):
    outs = [getattr(a, name)(*args, **kw) for a in self.a]
    got = [None if o is None else np.asarray(o).tolist() for o in outs]
    assert got[0] == got[1], f"{name}: host {got[0]} != device {got[1]}"
    return got[0]

  def _page(self, slot):
    return slot // self.ps

  def _alive(self, r, slot):
    return self._page(slot) not in r.dead

  def _pick(self, data, odd=None):
    reqs = [r for r in self.reqs if odd is None or r.odd == odd]
    return data.draw(st.sampled_from(reqs)) if reqs else None

  # -- allocation ------------------------------------------------------------------------
  def prefill(self, data):
    ps = self.ps
    if ps == 1:
      got = self._both("alloc", data.draw(st.integers(1, 6)))
      if got:
        self.reqs.append(_Req(got))
      return
    cont = [r for r in self.reqs if not r.odd and r.slots and (
        len(r.slots) % ps == 0 or self._alive(r, r.slots[-1]))]
    old = data.draw(st.lists(st.sampled_from(cont), max_size=2, unique_by=id)) if cont \
        else []
    new = data.draw(st.integers(0 if old else 1, 2))
    pre = [len(r.slots) for r in old] + [0] * new
    seq = [p + data.draw(st.integers(0, 2 * ps + 1)) for p in pre]
    last = [r.slots[-1] for r in old] + [-1] * new
    arr = lambda x: np.array(x, np.int64)  # noqa: E731
    got = self._both("alloc_extend", arr(pre), None, arr(seq), None, arr(last),
                     sum(seq) - sum(pre))
    if got is None:
      return
    at = 0
    for i, (p, s) in enumerate(zip(pre, seq)):
      part = got[at:at + s - p]
      at += s - p
      if i < len(old):
        old[i].slots += part
      elif part:
        self.reqs.append(_Req(part))

  def swa_tail(self, data):
    ps = self.ps
    if ps == 1:
      return
    ext = data.draw(st.integers(1, 3 * ps))
    tail = data.draw(st.integers(0, ext))
    one = np.ones(1, np.int64)
    got = self._both("alloc_extend_swa_tail", 0 * one, None, ext * one, None, -one, ext,
                     tail)
    if got is not None:
      head = ext - tail
      odd = head % ps != 0 and tail > 0
      dead = {self._page(s) for s in got[:head:ps]} if not odd else ()
      self.reqs.append(_Req(got, dead, odd))

  def decode(self, data):
    ps = self.ps
    rows = [r for r in self.reqs if not r.odd and r.slots and (
        len(r.slots) % ps == 0 or self._alive(r, r.slots[-1]))]
    if ps == 1 or not rows:
      return
    rows = data.draw(st.lists(st.sampled_from(rows), min_size=1, max_size=4, unique_by=id))
    seq = np.array([len(r.slots) + 1 for r in rows], np.int64)
    got = self._both("alloc_decode", seq, None,
                     np.array([r.slots[-1] for r in rows], np.int64))
    if got is not None:
      for r, s in zip(rows, got):
        r.slots.append(s)

  # -- freeing ---------------------------------------------------------------------------
  def _done(self, r):
    self.reqs.remove(r)

  def free_swa_some(self, data):
    r = self._pick(data, odd=False)
    if r is None or not r.slots:
      return
    picked = data.draw(st.lists(st.sampled_from(r.slots), min_size=1, max_size=4))
    if self.ps == 1:  # a token free: each slot once, with its peer (SPEC 13)
      picked = sorted({s for s in picked if self._alive(r, s)})
      if not picked:
        return
    self._both("free_swa", np.array(picked, np.int64))
    r.dead |= {self._page(s) for s in picked}

  def free_whole(self, data):
    r = self._pick(data)
    if r is None:
      return
    if self.ps == 1 and r.dead:  # free at page size 1 needs every peer: SWA first
      alive = [s for s in r.slots if self._alive(r, s)]
      if alive:
        self._both("free_swa", np.array(alive, np.int64))
      self._both("free_full", np.array(r.slots, np.int64))
    else:
      self._both("free", np.array(r.slots, np.int64))
    self._done(r)

  def window(self, data):
    """free_swa_segment of the whole pages from the first one with SWA KV on."""
    ps = self.ps
    r = self._pick(data, odd=False)
    if r is None:
      return
    start = 0
    while start < len(r.slots) and not self._alive(r, r.slots[start]):
      start += ps
    stop = start
    while stop + ps <= len(r.slots) and self._alive(r, r.slots[stop]):
      stop += ps
    if stop == start:
      return
    stop = start + ps * data.draw(st.integers(1, (stop - start) // ps))
    self._both("free_swa_segment", np.array(r.slots[start:stop], np.int64),
               start_pos=start)
    r.dead |= {self._page(s) for s in r.slots[start:stop]}

  def free_by_segments(self, data):
    """A finished request through the segment frees or free_full (no peer left)."""
    r = self._pick(data, odd=False)
    if r is None or not r.slots:
      return
    pages = {self._page(s) for s in r.slots}
    idx = np.array(r.slots, np.int64)
    if not pages & r.dead:
      self._both("free_segment", idx, start_pos=0)
    elif pages <= r.dead:
      if data.draw(st.booleans()):
        self._both("free_full_segment", idx, start_pos=0)
      else:
        self._both("free_full", idx)
    else:
      return
    self._done(r)

  # -- groups, snapshots, merges, the mapping by hand -----------------------------------
  def group_toggle(self, data):
    del data
    self._both("free_group_end" if self.group else "free_group_begin")
    self.group = not self.group

  def backup(self, data):
    del data
    if self.group:
      return
    self.snap = ([a.backup_state() for a in self.a],
                 [_Req(r.slots, r.dead, r.odd) for r in self.reqs])

  def restore(self, data):
    del data
    if self.group or self.snap is None:
      return
    for a, s in zip(self.a, self.snap[0]):
      a.restore_state(s)
    self.reqs = [_Req(r.slots, r.dead, r.odd) for r in self.snap[1]]

  def merge(self, data):
    del data
    self._both("merge_and_sort_free")

  def mapping_by_hand(self, data):
    """A slot's mapping set to what it is: nothing changes but the record's knowledge."""
    r = self._pick(data)
    if r is None or not r.slots:
      return
    slot = np.array([data.draw(st.sampled_from(r.slots))], np.int64)
    peer = np.asarray(self.a[0].translate_loc_from_full_to_swa(slot))
    for a in self.a:
      a.set_full_to_swa_mapping(slot, peer)

  # -- checks ----------------------------------------------------------------------------
  def check(self):
    host, dev = self.a
    assert (host.full_available_size(), host.swa_available_size()) == (
        dev.full_available_size(), dev.swa_available_size())
    pool = dev._pools[0]  # pylint: disable=protected-access
    assert pool.lengths() == pool.backend.lengths(pool.state), "mirror != state"
    peers = pool.peers
    if peers is None:
      return
    peers.resolve(block=True)
    if not peers.irregular:
      fresh = PeerRecord(peers.num_pages, peers.page_size)
      fresh.rebuild(pool.state)
      assert not fresh.irregular
      np.testing.assert_array_equal(peers.live, fresh.live)


@pytest.mark.parametrize("ps,need_sort", [(4, False), (2, True), (1, False), (4, True)])
def test_device_swa_counts_equal_the_host_backends(ps, need_sort):
  @SETTINGS
  @given(data=st.data())
  def run(data):
    driver = SWADriver(ps, need_sort)
    for _ in range(STEPS):
      op = data.draw(st.sampled_from(SWADriver.OPS))
      getattr(driver, op)(data)
      driver.check()
  run()


def test_record_queue_snapshots_and_a_deleted_array():
  """PeerRecord alone: device arrays wait in order in its queue (bounded: read once
  landed beyond QUEUE_READ), a snapshot is copied before the next write, and an array
  deleted before it was read leaves the pairing unknown (counts from the device)."""
  import jax.numpy as jnp
  from jax_kvalloc.sglang import swa_peers
  rec = PeerRecord(8, 4)
  rec.mark(np.array([1, 2]), False)          # host pages: at once
  snap = rec.snapshot()
  rec.mark(jnp.arange(12, 20, dtype=jnp.int32), False, 4, 8)  # slots of pages 3, 4
  rec.mark(np.array([3]), True)              # after it, in order: queued too
  assert len(rec.queue) == 2 and rec.live[3] and rec.live[4]
  assert rec.release(np.array([1, 3, 4, 5]), True) == 2   # pages 3 and 5 are live
  assert rec.live[[1, 3, 4, 5]].all() and not rec.live[2]
  assert not snap.live[1] and snap.live[3]   # the snapshot kept its array
  rec.restore(snap)
  assert not rec.live[1] and rec.live[4] and not rec.queue
  rec.release(np.array([1]), True)           # copied first
  assert rec.live[1] and not snap.live[1]
  for i in range(3 * swa_peers.QUEUE_READ):  # landed arrays do not pile up
    rec.mark(jnp.array([4 * (i % 8 + 1)], jnp.int32), bool(i % 2), 4, 1)
  assert len(rec.queue) <= swa_peers.QUEUE_READ + 1
  x = jnp.arange(4, 8, dtype=jnp.int32)
  rec.mark(x, False, 4, 4)
  x.delete()
  assert rec.release(np.array([2]), False) is None and rec.irregular


@pytest.mark.parametrize("ps", [2, 4])
def test_without_the_record_free_swa_of_a_free_page_frees_nothing_on_both_backends(ps):
  """guard=False: no ownership record, so no host record either (a free page could be
  named): free_swa of a request already freed frees nothing, as SGLang's, and the
  device backend's counts (read) equal the host backend's."""
  a = [kvs.SWATokenToKVPoolAllocator(16 * ps, 8 * ps, ps, None, "cpu", None, False,
                                     kernel="jnp", debug=False, guard=False, backend=b)
       for b in ("host", "device")]
  assert all(x._pools[0].peers is None for x in a)
  n = 3 * ps + 1
  outs = [np.asarray(x.alloc_extend(np.array([0]), np.array([0]), np.array([n]),
                                    np.array([n]), np.array([-1]), n)) for x in a]
  assert outs[0].tolist() == outs[1].tolist()
  for x, out in zip(a, outs):
    x.free(out)
    x.free_swa(out)  # the pages are free: nothing to free, no refusal
    x.free_swa(out[:ps])
  sizes = [(x.full_available_size(), x.swa_available_size()) for x in a]
  assert sizes[0] == sizes[1] == (16 * ps, 8 * ps), sizes
