"""Lower bounds for the rows of sgljax-replay.json where jax_kvalloc.sgl_jax (host backend,
guard on) stays slower than sglang-jax's allocator.

For each such row, two plain methods on plain objects, timed alike:
  unchecked  what sglang-jax's call does, written here from its description (a NumPy
             slice and copy, a concatenate, a list append, a flag): no checks;
  checked    the least work the checked call must do and nothing else (no class
             layers, pool or backend): the sticky refusal and dp_rank read (SPEC 14's
             "every call raises after a refusal"), the argument checks (a 1-D integer
             array, slots in page_size..num_slots-1), the ownership record (a free reads
             and clears one held flag per page, refuses a slot named twice; an
             allocation sets one per page), the queue's copy (SPEC 7: captured at queue
             time), the nesting check of a free group, and the ring write.
Each timed call is one perf_counter pair around one method call, as the replay times
them; a row's cell is the median [q1, q3] over 31 blocks of each block's mean over 1000
calls (state reset between calls, untimed). The replay's own cells for these rows are
in sgljax-replay.log (this folder). "implicit": the allocation with the page-1 record
kept implicit (`Implicit`), the least any record allows.

  /work/venv311/bin/python bound.py > bound.log    (numpy only; imports nothing of ours)
"""
import time

import numpy as np

CAP, PS = 192, 1        # the ps1 trace's pool (size 192, slots 1..192)
NDARRAY = np.ndarray


class Unchecked:
  """sglang-jax's calls, unchecked (token allocator, as its replay row runs them)."""

  def __init__(self):
    self.slots = np.arange(1, CAP + 1, dtype=np.int32)
    self.in_group = False
    self.group = []

  def alloc(self, k, dp_rank=0):
    if k > len(self.slots):
      return None
    out = self.slots[:k].copy()
    self.slots = self.slots[k:]
    return out

  def free(self, x, dp_rank=0):
    if x.size == 0:
      return
    if not self.in_group:
      self.slots = np.concatenate([self.slots, x])
    else:
      self.group.append(x)

  def begin(self):
    self.in_group = True


class Checked:
  """The least a checked call does (see the module docstring); token pool, FIFO ring."""

  def __init__(self):
    self.ring = np.arange(1, CAP + 1, dtype=np.int32)
    self.head, self.free_len = 0, CAP
    self.held = np.zeros((CAP + 1,), np.int32)
    self.refused = False          # a sticky refusal: every call raises
    self.rank0 = 0
    self.group = None
    self.spare = [[]]

  def _fits(self, k, dp_rank):
    """The allocation's checks: whether k slots fit (raises on bad input or a refusal)."""
    if self.refused or dp_rank is not self.rank0 or type(k) is not int:
      raise ValueError
    return 0 < k <= self.free_len

  def alloc(self, k, dp_rank=0):
    if not self._fits(k, dp_rank):
      return None
    h = self.head
    pages = self.ring[h:h + k]
    if k <= 16:
      held = memoryview(self.held)
      for p in pages.tolist():
        held[p] = 1
    else:
      self.held[pages.astype(np.intp)] = 1
    self.head, self.free_len = h + k, self.free_len - k
    return pages.copy()

  def _args(self, x, dp_rank):
    """The argument checks: None for an empty free, else the slots as ints."""
    if self.refused or dp_rank is not self.rank0:
      raise ValueError
    if x.__class__ is not NDARRAY or x.ndim != 1:
      raise TypeError
    if x.size == 0:
      return None
    if x.dtype.kind not in "iu":
      raise TypeError
    s = x.tolist()
    if min(s) < PS or max(s) > CAP:
      raise ValueError
    return s

  def free(self, x, dp_rank=0):
    s = self._args(x, dp_rank)
    if s is None:
      return
    if self.group is not None:
      self.group[0].append(x.copy())
      return
    held = memoryview(self.held)
    for p in s:
      if held[p] != 1:
        raise ValueError
    if len(set(s)) != len(s):
      raise ValueError
    for p in s:
      held[p] = 0
    at = (self.head + self.free_len) % CAP
    self.ring[at:at + len(s)] = x  # (here a window without wrap-around)
    self.free_len += len(s)

  def begin(self):
    if self.refused or self.group is not None:
      raise ValueError
    self.group = self.spare


class Implicit(Checked):
  """`Checked` with the ownership record implicit at page size 1 (a slot is held when
  its position in the ring is behind the head: an allocation writes only the head; a
  free still reads and writes one entry per slot, so only `alloc` changes)."""

  def alloc(self, k, dp_rank=0):
    if not self._fits(k, dp_rank):
      return None
    h = self.head
    self.head, self.free_len = h + k, self.free_len - k
    return self.ring[h:h + k].copy()


def timed(make, setup, call, blocks=31, per=1000):
  """median [q1, q3] over blocks of each block's mean us per call."""
  clock, means = time.perf_counter, []
  for _ in range(blocks):
    obj = make()
    total = 0.0
    for _ in range(per):
      args = setup(obj)
      t0 = clock()
      call(obj, *args)
      total += clock() - t0
    means.append(total / per * 1e6)
  q1, med, q3 = np.percentile(means, [25, 50, 75])
  return med, q1, q3


def held_slots(obj, m):
  """Resets obj to m slots handed out (untimed); returns them."""
  obj.__init__()
  return obj.alloc(m)


def reset(obj):
  obj.__init__()
  return ()


def cases():
  """(row, unchecked, checked): each a (setup, call) pair."""
  empty = np.zeros((0,), np.int32)
  out = []
  for row, k in (("alloc/4-7", 4), ("alloc/8-15", 9), ("alloc/16-31", 17),
                 ("alloc/32-63", 32)):
    call = lambda o, k=k: o.alloc(k, dp_rank=0)
    out.append(("ps1/" + row, f"alloc({k})", (reset, call), (reset, call)))
  call = lambda o: o.alloc(4, dp_rank=0)
  out.append(("ps1/alloc/4-7", "alloc(4), implicit", (reset, call), (reset, call),
              Implicit))
  for row, m in (("free/1", 1), ("free/2-3", 2), ("free/4-7", 5), ("free/8-15", 11)):
    setup = lambda o, m=m: (held_slots(o, m),)
    call = lambda o, x: o.free(x, dp_rank=0)
    out.append(("ps1/" + row, f"free of {m}", (setup, call), (setup, call)))
  call = lambda o: o.free(empty, dp_rank=0)
  out.append(("ps1/free/1, ps4/free/1", "free of nothing", (reset, call), (reset, call)))
  call = lambda o: o.begin()
  out.append(("ps1+ps4/free_group_begin", "begin", (reset, call), (reset, call)))
  for row, m in (("ps4/free in group/1", 1), ("ps4/free in group/2-3", 2),
                 ("ps1+ps4/free in group/8-15", 12)):
    def setup(o, m=m):
      x = held_slots(o, m)
      o.begin()
      return (x,)
    call = lambda o, x: o.free(x, dp_rank=0)
    out.append((row, f"free of {m} in a group", (setup, call), (setup, call)))
  return out


def main():
  print(__doc__.strip().split("\n\n")[0])
  print(f"numpy {np.__version__}; pool of {CAP} slots at page size {PS}; us: median "
        "[q1, q3]\n")
  head = (f"{'row':27} {'call':21} {'unchecked us':>20} {'checked floor us':>20} "
          f"{'floor/unchecked':>15}")
  print(head)
  print("-" * len(head))
  for row, what, (su, cu), (sc, cc), *cls in cases():
    u = timed(Unchecked, su, cu)
    c = timed(cls[0] if cls else Checked, sc, cc)
    cell = lambda v: f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"
    print(f"{row:27} {what:21} {cell(u):>20} {cell(c):>20} {c[0] / u[0]:>14.2f}x")


if __name__ == "__main__":
  main()
