"""Allocator traces: the file format, a seeded serving-workload generator, and a replay
driver for any SGLang-style allocator object (jax_kvalloc, torch_ref, SGLang itself).

Trace format (the golden format of ../shared/golden, JSON lines)
-----------------------------------------------------------------
One JSON object per line, one line per allocator operation, in order. Lines of several
traces may share a file; a trace is the run of lines with the same `trace` id and starts
with an `init` line.

  {"trace": 0, "op": "init", "args": {"size": 64, "page_size": 4, "need_sort": false},
   "result": null, "free_pages": [1, ..., 16], "release_pages": [], "available_size": 64}
  {"trace": 0, "op": "alloc_extend",
   "args": {"prefix_lens": [0, 2], "seq_lens": [3, 11], "last_loc": [-1, 9]},
   "result": [4, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18], ...}

- `trace`: trace id (int or str).
- `op` and `args` (SGLang's argument names; lists of ints for per-request arrays):
    init                size, page_size, need_sort, and optionally kind ("token" or
                        "paged"; default "token" iff page_size == 1)
    alloc               need_size (a multiple of page_size for the paged allocator)
    alloc_extend        prefix_lens, seq_lens, last_loc (same length; last_loc[i] = -1
                        when prefix_lens[i] == 0); extend_num_tokens optional (it is
                        sum(seq_lens - prefix_lens))
    alloc_decode        seq_lens (counting the new token), last_loc
    free                free_index (slot ids)
    free_page_ids       page_ids (SPEC 10: pages prepended in the given order, no sort)
    free_segment        free_index, start_pos (SPEC 10: one request's slots of tokens
                        start_pos.., start_pos a multiple of page_size)
    free_group_begin, free_group_end, merge_and_sort_free, backup_state, clear: no args
    restore_state       no args: restores the snapshot of the latest backup_state of the
                        same trace (one snapshot may be restored several times)
  `args` may be omitted for ops without arguments.
- Expected outcome, optional (a user's own trace may give only op and args; every field
  given is checked): `result` (the returned slot ids, or null for a failed allocation and
  for ops that return nothing), `free_pages` and `release_pages` (the full lists after the
  op, in order; slot ids for the token allocator) and `available_size`.

Generator and replay
--------------------
`generate(random_config(seed), Replayer(make_allocator))` records a seeded serving
workload (`SchedulerSim`) in the format above, driving the allocator that
make_allocator(size=, page_size=, need_sort=, kind=) builds. `Replayer` applies trace
operations to an allocator object with SGLang's methods and reads back its observable
state; `compare` names the field and first differing index of a step.

This module never imports torch: array conversion for other frameworks is passed in.
"""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

import numpy as np

OPS = ("init", "alloc", "alloc_extend", "alloc_decode", "free", "free_group_begin",
       "free_group_end", "merge_and_sort_free", "backup_state", "restore_state", "clear",
       "free_page_ids", "free_segment")
STATE_FIELDS = ("result", "free_pages", "release_pages", "available_size")

Record = Dict[str, Any]


# ---------------------------------------------------------------------------------------
# Reading and writing.
# ---------------------------------------------------------------------------------------

def read(path: str) -> Dict[Any, List[Record]]:
  """A JSON-lines trace file as {trace id: [records]}, in order of first appearance.

  Raises ValueError naming the line for malformed JSON, unknown ops or missing fields,
  and naming the trace when one does not start with an `init` record.
  """
  traces: Dict[Any, List[Record]] = {}
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
      check_record(rec, where=f"{path}:{lineno}")
      traces.setdefault(rec["trace"], []).append(rec)
  for tid, recs in traces.items():
    if recs[0]["op"] != "init":
      raise ValueError(f"trace {tid!r} starts with {recs[0]['op']!r}, not 'init'")
  return traces


def check_record(rec: Any, where: str = "record") -> None:
  """Raises ValueError if `rec` is not a valid trace record (see the module docstring)."""
  if not isinstance(rec, dict) or "op" not in rec or "trace" not in rec:
    raise ValueError(f"{where}: a record needs 'trace' and 'op', got {rec!r:.200}")
  if rec["op"] not in OPS:
    raise ValueError(f"{where}: unknown op {rec['op']!r}; ops are {OPS}")
  if not isinstance(rec.get("args", {}), dict):
    raise ValueError(f"{where}: 'args' must be an object, got {rec['args']!r:.200}")
  needed = {"init": ("size", "page_size"), "alloc": ("need_size",),
            "alloc_extend": ("prefix_lens", "seq_lens", "last_loc"),
            "alloc_decode": ("seq_lens", "last_loc"), "free": ("free_index",),
            "free_page_ids": ("page_ids",), "free_segment": ("free_index", "start_pos")}
  missing = [k for k in needed.get(rec["op"], ()) if k not in rec.get("args", {})]
  if missing:
    raise ValueError(f"{where}: op {rec['op']!r} is missing args {missing}")


def write(path: str, records: Iterable[Record]) -> int:
  """Writes records as JSON lines; returns the number written."""
  n = 0
  with open(path, "w") as f:
    for rec in records:
      f.write(json.dumps(rec, separators=(",", ":")) + "\n")
      n += 1
  return n


# ---------------------------------------------------------------------------------------
# Comparison.
# ---------------------------------------------------------------------------------------

def as_int_list(x: Any) -> Optional[List[int]]:
  """None, or a flat list of ints from a list, numpy, jax or torch (any device) array."""
  if x is None:
    return None
  if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch, without importing it
    x = x.detach().cpu().numpy()
  return [int(v) for v in np.asarray(x).reshape(-1)]


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> Optional[str]:
  """None if equal, else where the two int lists first differ, in words."""
  for i, (e, a) in enumerate(zip(expected, actual)):
    if e != a:
      return f"first differing index {i}: expected {e}, got {a}"
  if len(expected) != len(actual):
    i = min(len(expected), len(actual))
    extra = (f"expected has {expected[i]}" if len(expected) > i else f"got {actual[i]}")
    return (f"lengths differ ({len(expected)} expected, {len(actual)} got); first "
            f"differing index {i}: {extra}")
  return None


def compare(expected: Record, actual: Record, *, release_unordered: bool = False
            ) -> Optional[str]:
  """None if `actual` agrees with every STATE_FIELDS entry `expected` has, else a message
  naming the field and the first differing index.

  release_unordered compares release_pages as sorted lists (for SGLang >= 0.5.2x, whose
  paged allocator keeps need_sort's freed pages unordered).
  """
  for field in STATE_FIELDS:
    if field not in expected or field not in actual:
      continue
    e, a = expected[field], actual[field]
    if field == "available_size":
      if int(e) != int(a):
        return f"available_size: expected {e}, got {a}"
      continue
    if e is None or a is None:
      if e is not None or a is not None:
        show = lambda v: "None (failure)" if v is None else f"{len(v)} slots"
        return f"{field}: expected {show(e)}, got {show(a)}"
      continue
    if field == "release_pages" and release_unordered:
      e, a = sorted(e), sorted(a)
    diff = first_difference(list(e), list(a))
    if diff:
      return f"{field}: {diff}"
  return None


# ---------------------------------------------------------------------------------------
# Replay.
# ---------------------------------------------------------------------------------------

def _default_array(values: List[int]) -> np.ndarray:
  return np.asarray(values, dtype=np.int64)


class Replayer:
  """Applies trace operations to one SGLang-style allocator and reads its state back.

  Args:
    make_allocator: called with size=, page_size=, need_sort=, kind= on every `init`.
    to_array: turns a list of ints into the array type the allocator takes (default
      numpy int64); `to_cpu_array` likewise for SGLang's *_cpu arguments.
    release_unordered: this allocator's release_pages order is not meaningful (passed on
      to `compare` by callers).
  """

  def __init__(self, make_allocator: Callable[..., Any],
               to_array: Callable[[List[int]], Any] = _default_array,
               to_cpu_array: Callable[[List[int]], Any] = _default_array,
               release_unordered: bool = False):
    self.make_allocator = make_allocator
    self.to_array = to_array
    self.to_cpu_array = to_cpu_array
    self.release_unordered = release_unordered
    self.allocator: Any = None
    self._snapshot: Any = None

  def apply(self, op: str, args: Optional[Dict[str, Any]] = None) -> Optional[List[int]]:
    """Runs one operation; returns its result as a list of ints (None on failure or for
    operations that return nothing)."""
    args = args or {}
    if op == "init":
      self.allocator = self.make_allocator(**init_args(args))
      self._snapshot = None
      return None
    a = self.allocator
    if a is None:
      raise ValueError(f"op {op!r} before 'init'")
    if op == "alloc":
      return as_int_list(a.alloc(int(args["need_size"])))
    if op == "alloc_extend":
      pre, seq = list(args["prefix_lens"]), list(args["seq_lens"])
      total = int(args.get("extend_num_tokens", sum(s - p for p, s in zip(pre, seq))))
      return as_int_list(a.alloc_extend(
          self.to_array(pre), self.to_cpu_array(pre), self.to_array(seq),
          self.to_cpu_array(seq), self.to_array(list(args["last_loc"])), total))
    if op == "alloc_decode":
      seq = list(args["seq_lens"])
      return as_int_list(a.alloc_decode(self.to_array(seq), self.to_cpu_array(seq),
                                        self.to_array(list(args["last_loc"]))))
    if op == "free":
      a.free(self.to_array(list(args["free_index"])))
    elif op == "free_page_ids":
      a.free_page_ids(self.to_array(list(args["page_ids"])))
    elif op == "free_segment":
      a.free_segment(self.to_array(list(args["free_index"])),
                     start_pos=int(args["start_pos"]))
    elif op == "backup_state":
      self._snapshot = a.backup_state()
    elif op == "restore_state":
      if self._snapshot is None:
        raise ValueError("restore_state before any backup_state")
      a.restore_state(self._snapshot)
    elif op in ("free_group_begin", "free_group_end", "merge_and_sort_free", "clear"):
      getattr(a, op)()
    else:
      raise ValueError(f"unknown op {op!r}")
    return None

  def observe(self) -> Record:
    """free_pages, release_pages (lists) and available_size of the allocator now."""
    a = self.allocator
    return {"free_pages": as_int_list(a.free_pages) or [],
            "release_pages": as_int_list(a.release_pages) or [],
            "available_size": int(a.available_size())}

  def step(self, op: str, args: Optional[Dict[str, Any]] = None) -> Record:
    """`apply` then `observe`: the record fields result, free_pages, release_pages and
    available_size."""
    out = {"result": self.apply(op, args)}
    out.update(self.observe())
    return out


def jax_factory(kernel: str = "jnp", device: Any = None,
                backend: str = "device") -> Callable[..., Any]:
  """The allocator factory of a `Replayer` for jax_kvalloc's SGLang-compatible classes:
  make(size, page_size, need_sort, kind) -> TokenToKVPoolAllocator (kind "token") or
  PagedTokenToKVPoolAllocator, with the given index kernel, device and backend
  ("device": jax arrays, "host": numpy state and results)."""
  import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top

  def make(size, page_size, need_sort, kind):
    if kind == "token":
      return kvs.TokenToKVPoolAllocator(size, device=device, need_sort=need_sort,
                                       kernel=kernel, backend=backend)
    return kvs.PagedTokenToKVPoolAllocator(size, page_size, device=device,
                                          need_sort=need_sort, kernel=kernel,
                                          backend=backend)
  return make


def init_args(args: Dict[str, Any]) -> Dict[str, Any]:
  """size, page_size, need_sort, kind of an init record, with defaults filled in."""
  ps = int(args["page_size"])
  kind = args.get("kind") or ("token" if ps == 1 else "paged")
  return {"size": int(args["size"]), "page_size": ps,
          "need_sort": bool(args.get("need_sort", False)), "kind": kind}


class TraceMismatch(AssertionError):
  """A replayed step disagreed with its record; the message names trace, step and index."""


# ---------------------------------------------------------------------------------------
# The workload generator.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  """One generated trace: the pool and the shape of its traffic.

  Attributes:
    seed: seeds everything random (Python's `random.Random`, stable across versions).
    size, page_size, need_sort, kind: the pool (kind "token" or "paged").
    steps: allocator operations before the final drain (which frees everything).
    max_prefill_batch, max_decode_batch: requests per alloc_extend / alloc_decode.
    arrival_rate: mean new requests per scheduler iteration.
    share_prob: chance that a new request reuses a cached prefix.
    cache_prob: chance that a finished request's tokens go into the prefix cache.
    spec_prob: chance that a decode iteration is speculative.
    evict_prob: chance that the scheduler evicts cached prefixes before an allocation
      that would not fit.
    oom_prob: chance that the scheduler issues an allocation it knows will not fit
      (otherwise it admits fewer requests, or retracts one before a decode).
    segment_prob: chance that a finished request's own slots go back through SPEC 10's
      free_segment or free_page_ids (no sort) instead of free. 0 (the default) draws no
      random number for it, so traces of older configs stay as they were.
  """

  seed: int
  size: int
  page_size: int = 1
  need_sort: bool = False
  kind: str = "token"
  steps: int = 200
  max_prefill_batch: int = 4
  max_decode_batch: int = 8
  arrival_rate: float = 0.7
  share_prob: float = 0.5
  cache_prob: float = 0.4
  spec_prob: float = 0.25
  evict_prob: float = 0.8
  oom_prob: float = 0.15
  segment_prob: float = 0.0

  def init_args(self) -> Dict[str, Any]:
    return {"size": self.size, "page_size": self.page_size, "need_sort": self.need_sort,
            "kind": self.kind}


SCALES = {
    # pool sizes in pages (few, so jitted code compiles once per size), max prefill
    # batch, max decode batch
    "ci": ((16, 40), 4, 8),
    "long": ((256, 512, 1024, 2048), 32, 96),
}


def random_config(seed: int, *, steps: int = 200, page_sizes: Sequence[int] = (1, 4, 16, 64),
                  scale: str = "ci", need_sort: Optional[bool] = None,
                  segment_prob: float = 0.0) -> WorkloadConfig:
  """A WorkloadConfig drawn from `seed`: a page size from `page_sizes`, need_sort on or
  off (unless given), a small pool for `scale` "ci" (16 or 40 pages) or a large one for
  "long" (256 to 2048 pages), plus half a page that the pool cannot use. At page size 1
  a quarter of the configs use the paged allocator (SPEC 4.3's general decode page
  count)."""
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {sorted(SCALES)}, got {scale!r}")
  rng = random.Random(f"config-{seed}")
  pages_choices, prefill_bs, decode_bs = SCALES[scale]
  ps = rng.choice(list(page_sizes))
  pages = rng.choice(pages_choices)
  kind = "paged" if ps > 1 or rng.random() < 0.25 else "token"
  return WorkloadConfig(
      seed=seed, size=pages * ps + ps // 2, page_size=ps,
      need_sort=rng.random() < 0.5 if need_sort is None else need_sort, kind=kind,
      steps=steps, max_prefill_batch=rng.randint(1, prefill_bs),
      max_decode_batch=rng.randint(2, decode_bs),
      arrival_rate=rng.uniform(0.3, 1.2), share_prob=rng.uniform(0.2, 0.8),
      cache_prob=rng.uniform(0.1, 0.7), spec_prob=rng.uniform(0.0, 0.5),
      oom_prob=rng.uniform(0.1, 0.6), segment_prob=segment_prob)


class _Node:
  """A cached prefix: tokens [start, start + len(slots)) whose slots it owns; tokens
  before start belong to its ancestors."""

  def __init__(self, parent: Optional["_Node"], start: int, slots: List[int], born: int):
    self.parent, self.start, self.slots, self.born = parent, start, slots, born
    self.refs = 0       # requests and child nodes that read through it

  @property
  def end(self) -> int:
    return self.start + len(self.slots)

  def prefix_slots(self, n: int) -> List[int]:
    """Slots of tokens [0, n), n <= end."""
    head = self.parent.prefix_slots(min(n, self.start)) if self.parent else []
    return head + self.slots[: max(0, n - self.start)]


class _Req:
  """A request: `slots[i]` is the slot of token i; the first `shared` come from `node`,
  which it holds a reference on from its first prefill on (`started`)."""

  def __init__(self, rid: int, node: Optional[_Node], shared: int, prompt: int,
               output: int):
    self.rid, self.node, self.shared = rid, node, shared
    self.prompt, self.output = prompt, output
    self.started = False
    self.slots: List[int] = []
    self.extra: List[int] = []   # slots past the last token in its last page (spec)

  def start(self, cache: List[_Node]) -> None:
    """Scheduled for the first time: match the prefix cache (the node may be gone)."""
    self.started = True
    if self.node is not None and self.node in cache:
      self.node.refs += 1
      self.slots = self.node.prefix_slots(self.shared)
    else:
      self.node, self.shared = None, 0

  @property
  def owned(self) -> List[int]:
    return self.slots[self.shared:] + self.extra


class SchedulerSim:
  """A seeded serving scheduler that issues allocator operations (see the module
  docstring). Drive it with `run(execute)`, where execute(op, args) applies the op and
  returns its result (a list of ints, or None)."""

  def __init__(self, config: WorkloadConfig):
    self.cfg = config
    self.rng = random.Random(f"workload-{config.seed}")
    self.ps = config.page_size
    self.num_pages = config.size // config.page_size
    self.paged = config.kind == "paged"
    self.waiting: List[_Req] = []
    self.running: List[_Req] = []
    self.cache: List[_Node] = []
    self.in_use: Set[int] = set()   # pages that a request, a cached prefix or a draft holds
    self.ops = 0
    self.iteration = 0
    self._next_rid = 0
    self._group: Optional[List[int]] = None   # slots queued in an open free group
    self._stall = 0
    self._exec: Callable[[str, Dict[str, Any]], Optional[List[int]]] = lambda op, args: None

  # -- bookkeeping ---------------------------------------------------------------------
  def expected_available(self) -> int:
    """available_size that a correct allocator reports now."""
    return (self.num_pages - len(self.in_use)) * self.ps

  def _take(self, slots: Iterable[int]) -> None:
    self.in_use.update(s // self.ps for s in slots)

  def _release(self, slots: Iterable[int]) -> None:
    self.in_use.difference_update(s // self.ps for s in slots)

  def _pages_needed(self, pre: int, seq: int) -> int:
    return -(-seq // self.ps) - (-(-pre // self.ps))

  # -- the op stream -------------------------------------------------------------------
  def run(self, execute: Callable[[str, Dict[str, Any]], Optional[List[int]]]) -> None:
    """Issues `config.steps` operations (a scheduler iteration is never cut short), then
    frees everything that is still held, so a correct allocator ends full."""
    self._exec = execute
    while self.ops < self.cfg.steps:
      self._iteration()
    self._drain()

  def _do(self, op: str, args: Optional[Dict[str, Any]] = None) -> Optional[List[int]]:
    self.ops += 1
    return self._exec(op, args or {})

  def _free(self, slots: List[int], op: str = "free", args: Optional[Dict] = None) -> None:
    """Frees `slots` through `op` (free, or free_segment / free_page_ids with `args`);
    inside a free group their pages return at its end."""
    if not slots:
      return
    self._do(op, args or {"free_index": list(slots)})
    if self._group is not None:
      self._group.extend(slots)
    else:
      self._release(slots)

  def _iteration(self) -> None:
    self.iteration += 1
    rng = self.rng
    self._arrivals()
    r = rng.random()
    if r < 0.02:
      self._do("merge_and_sort_free")
    elif r < 0.06 and self.paged:
      self._prealloc()
    elif self.waiting and (not self.running or rng.random() < 0.45):
      self._prefill()
    elif self.running:
      if rng.random() < self.cfg.spec_prob:
        self._spec_decode()
      else:
        self._decode()
    self._finish_some()

  def _arrivals(self) -> None:
    rng = self.rng
    n = 0
    while rng.random() < self.cfg.arrival_rate / (1 + self.cfg.arrival_rate) and n < 4:
      n += 1
    cap = self.num_pages * self.ps
    for _ in range(n):
      node, shared = None, 0
      if self.cache and rng.random() < self.cfg.share_prob:
        node = rng.choice(self.cache)
        lo = node.start // self.ps + 1
        hi = node.end // self.ps
        if hi >= lo:
          shared = rng.randint(lo, hi) * self.ps
        else:
          node = None
      new = int(min(max(1, rng.lognormvariate(0, 1.0) * cap / 20), cap / 3))
      output = rng.randint(1, max(2, min(cap // 12, 600)))
      self.waiting.append(_Req(self._next_rid, node, shared, shared + new, output))
      self._next_rid += 1

  def _evict_for(self, need_slots: int) -> None:
    """Evicts unreferenced cached prefixes (oldest first) until need_slots fit."""
    if self.rng.random() >= self.cfg.evict_prob:
      return
    while self.expected_available() < need_slots:
      leaves = [n for n in self.cache if n.refs == 0]
      if not leaves:
        return
      self._evict(min(leaves, key=lambda n: n.born))

  def _evict(self, node: _Node) -> None:
    self.cache.remove(node)
    if node.parent:
      node.parent.refs -= 1
    self._free(node.slots)

  def _prefill(self) -> None:
    rng, ps = self.rng, self.ps
    batch = self.waiting[: rng.randint(1, self.cfg.max_prefill_batch)]
    for r in batch:
      if not r.started:
        r.start(self.cache)
    cap = self.num_pages * ps
    chunk = rng.randint(max(1, cap // 16), max(2, cap // 4))
    pre = [len(r.slots) for r in batch]
    seq = [min(r.prompt, p + chunk) for r, p in zip(batch, pre)]
    last = [r.slots[-1] if r.slots else -1 for r in batch]
    total = sum(s - p for p, s in zip(pre, seq))
    self._evict_for(total + len(batch) * ps)
    if rng.random() >= self.cfg.oom_prob:   # admission control: only what fits
      while batch and not self._fits(sum(map(self._pages_needed, pre, seq))):
        batch, pre, seq, last = batch[:-1], pre[:-1], seq[:-1], last[:-1]
      total = sum(s - p for p, s in zip(pre, seq))
      if not batch:
        self._stalled()
        return
    if self.paged:
      out = self._do("alloc_extend", {"prefix_lens": pre, "seq_lens": seq, "last_loc": last})
    else:
      out = self._do("alloc", {"need_size": total})
    if out is None:
      self._stalled()
      return
    self._stall = 0
    self._take(out)
    at = 0
    for r, p, s in zip(batch, pre, seq):
      r.slots += out[at: at + s - p]
      at += s - p
      if s == r.prompt:
        self.waiting.remove(r)
        self.running.append(r)

  def _fits(self, pages: int) -> bool:
    return pages * self.ps <= self.expected_available()

  def _stalled(self) -> None:
    """An allocation failed or was not tried. After a few in a row, abort a request to
    make room (a retraction)."""
    self._stall += 1
    if self._stall < 3:
      return
    self._stall = 0
    holders = self.running + [r for r in self.waiting if r.started]
    if holders:
      self._finish(self.rng.choice(holders), cache=False)

  def _prealloc(self) -> None:
    """PD disaggregation: whole pages for a transferred prompt, via alloc(n)."""
    rng, ps = self.rng, self.ps
    tokens = rng.randint(1, max(1, self.num_pages * ps // 6))
    need = -(-tokens // ps) * ps
    self._evict_for(need)
    out = self._do("alloc", {"need_size": need})
    if out is None:
      self._stalled()
      return
    self._take(out)
    req = _Req(self._next_rid, None, 0, tokens, rng.randint(1, max(2, self.num_pages)))
    req.started = True
    self._next_rid += 1
    req.slots, req.extra = out[:tokens], out[tokens:]
    self.running.append(req)

  def _decode_batch(self) -> List[_Req]:
    return self.running[: self.cfg.max_decode_batch]

  def _decode(self) -> None:
    batch = self._decode_batch()
    self._evict_for(len(batch) * self.ps)
    if self.rng.random() >= self.cfg.oom_prob:   # retract requests until the batch fits
      while batch and not self._fits(
          sum(self._pages_needed(len(r.slots), len(r.slots) + 1) for r in batch)):
        self._finish(batch[-1], cache=False)
        batch = self._decode_batch()
      if not batch:
        return
    if self.paged:
      # A request holding slack slots (spec, prealloc) reuses them: its last_loc + 1.
      out = self._do("alloc_decode", {"seq_lens": [len(r.slots) + 1 for r in batch],
                                      "last_loc": [r.slots[-1] for r in batch]})
    else:
      out = self._do("alloc", {"need_size": len(batch)})
    if out is None:
      self._stalled()
      return
    self._stall = 0
    for r, s in zip(batch, out):
      if r.extra and r.extra[0] == s:
        r.extra.pop(0)
      else:
        self._take([s])
      r.slots.append(s)

  def _spec_decode(self) -> None:
    """EAGLE-style draft (backup, allocate, restore) or over-allocation then release of
    the rejected draft slots. Rows may extend by zero."""
    rng, ps = self.rng, self.ps
    batch = self._decode_batch()
    k = [rng.choice((0, 1, 2, 3, 4)) if rng.random() < 0.8 else 0 for _ in batch]
    pre = [len(r.slots) + len(r.extra) for r in batch]
    seq = [p + x for p, x in zip(pre, k)]
    last = [(r.extra or r.slots)[-1] for r in batch]
    total = sum(k)
    self._evict_for(total + len(batch) * ps)   # before the snapshot, which would undo it
    if (not self._fits(sum(map(self._pages_needed, pre, seq)))
        and rng.random() >= self.cfg.oom_prob):
      self._decode()
      return
    rollback = rng.random() < 0.5
    if rollback:
      saved = set(self.in_use)
      self._do("backup_state")
    if self.paged:
      out = self._do("alloc_extend", {"prefix_lens": pre, "seq_lens": seq, "last_loc": last})
    elif total:
      out = self._do("alloc", {"need_size": total})
    else:
      out = []
    if out is not None:
      self._take(out)
    if rollback:
      self._do("restore_state")
      self.in_use = saved
      return
    if out is None:
      self._stalled()
      return
    at, rejected = 0, []
    for r, x in zip(batch, k):
      mine, at = out[at: at + x], at + x
      accept = rng.randint(0, x)
      # Accepted drafts become tokens; slack slots (extra) come first in the row's slots.
      row = r.extra + mine
      r.extra = []
      r.slots += row[:accept]
      keep_to = -(-len(r.slots) // ps) * ps - len(r.slots)   # rest of the last page
      r.extra = row[accept: accept + keep_to]
      rejected += row[accept + keep_to:]
    self._free(rejected)

  def _finish(self, r: _Req, cache: bool) -> None:
    """Frees a request's slots (or moves its page-aligned tokens into the cache)."""
    (self.running if r in self.running else self.waiting).remove(r)
    owned = r.owned
    if cache:
      aligned = len(r.slots) // self.ps * self.ps
      if aligned > r.shared:
        node = _Node(r.node, r.shared, r.slots[r.shared: aligned], self.iteration)
        if r.node:
          r.node.refs += 1
        self.cache.append(node)
        owned = r.slots[aligned:] + r.extra
    if r.node and r.started:
      r.node.refs -= 1
    if self.paged and owned and self._group is not None and self.rng.random() < 0.3:
      owned = owned + [owned[-1]]   # overlap scheduler: a slot freed twice in one group
    elif owned and self.cfg.segment_prob and self.rng.random() < self.cfg.segment_prob:
      # The request's own tokens from a page boundary on (its shared prefix, or what
      # went into the cache, ends on one), in token order: a segment (SPEC 10).
      if self.paged and self.rng.random() < 0.5:
        return self._free(owned, "free_page_ids", {"page_ids": [
            s // self.ps for s in owned[::self.ps]]})
      start = len(r.slots) + len(r.extra) - len(owned)
      return self._free(owned, "free_segment", {"free_index": list(owned), "start_pos": start})
    self._free(owned)

  def _finish_some(self) -> None:
    rng = self.rng
    done = [r for r in self.running if len(r.slots) - r.prompt >= r.output
            or rng.random() < 0.02]
    if not done:
      return
    group = rng.random() < 0.5
    if group:
      self._group = []
      self._do("free_group_begin")
    for r in done:
      self._finish(r, cache=rng.random() < self.cfg.cache_prob)
    if group:
      queued, self._group = self._group, None
      self._do("free_group_end")
      self._release(queued)

  def _drain(self) -> None:
    for r in list(self.running) + list(self.waiting):
      self._finish(r, cache=False)
    while self.cache:
      self._evict(next(n for n in self.cache if n.refs == 0))


def generate(config: WorkloadConfig, replayer: Replayer, trace_id: Any = 0,
             on_step: Optional[Callable[[int, Record], None]] = None) -> List[Record]:
  """Runs the workload of `config` against the allocator of `replayer` and records it;
  TraceMismatch when a step's available_size is not what the workload's own bookkeeping
  of pages in use predicts (a leak or a double allocation).

  Args:
    config: the workload.
    replayer: drives the allocator whose results steer the workload.
    trace_id: the `trace` field of the records.
    on_step: on_step(step, record), if given, runs after every step (for lock-step
      comparison with other implementations); it may raise to stop the run.

  Returns:
    The trace: its init record, then one record per operation with the observed result,
    free_pages, release_pages and available_size.
  """
  records: List[Record] = []
  workload = SchedulerSim(config)

  def check_leak() -> None:
    # The workload books the outcome of an op after it returns: check before the next.
    if records:
      rec, want = records[-1], workload.expected_available()
      if rec["available_size"] != want:
        raise TraceMismatch(
            f"trace {trace_id!r} step {len(records) - 1} ({rec['op']}): available_size "
            f"{rec['available_size']}, but the workload holds pages for {want} free slots "
            f"(a leak or a double allocation)")

  def execute(op: str, args: Dict[str, Any]) -> Optional[List[int]]:
    check_leak()
    rec = {"trace": trace_id, "op": op, "args": args}
    rec.update(replayer.step(op, args))
    records.append(rec)
    if on_step:
      on_step(len(records) - 1, rec)
    return rec["result"]

  execute("init", config.init_args())
  workload.run(execute)
  check_leak()
  return records
