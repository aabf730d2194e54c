"""Allocator traces: the file format, a replay driver for any SGLang-style allocator object
(jax_kvalloc, torch_ref, SGLang itself) and a seeded serving-workload generator.

The format is the golden one (../shared/golden): JSON lines, one per allocator operation,
in order. A trace is the run of lines with one `trace` id (int or str), starting with an
`init` line; several may share a file.

  {"trace": 0, "op": "init", "args": {"size": 64, "page_size": 4, "need_sort": false},
   "result": null, "free_pages": [1, ..., 16], "release_pages": [], "available_size": 64}
  {"trace": 0, "op": "alloc_extend", "args": {"prefix_lens": [0, 2], "seq_lens": [3, 11],
   "last_loc": [-1, 9]}, "result": [4, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18], ...}

`op` is one of ARGS' keys, `args` the SGLang arguments ARGS names (lists of ints for
per-request arrays; omitted when there are none), plus: init's optional need_sort and kind
("token" or "paged"; default "token" iff page_size == 1), alloc_extend's optional
extend_num_tokens. restore_state restores the trace's latest backup_state (again and
again if repeated). The outcome is optional and every field given is checked: `result`
(slot ids; null for a failed allocation and for ops that return nothing), `free_pages`
and `release_pages` (the full lists after the op; slot ids for the token allocator) and
`available_size`.

`generate(random_config(seed), Replayer(make_allocator))` records a seeded serving workload
(`SchedulerSim`). This module never imports torch: array conversion is passed in.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from jax_kvalloc.tools import workload

_NO_ARGS = ("free_group_begin", "free_group_end", "merge_and_sort_free", "backup_state",
            "restore_state", "clear")
ARGS = {  # op -> the args it needs (free_page_ids, free_segment: SPEC 10)
    "init": ("size", "page_size"), "alloc": ("need_size",),
    "alloc_extend": ("prefix_lens", "seq_lens", "last_loc"),
    "alloc_decode": ("seq_lens", "last_loc"), "free": ("free_index",),
    "free_page_ids": ("page_ids",), "free_segment": ("free_index", "start_pos"),
    **dict.fromkeys(_NO_ARGS, ())}
OPS = tuple(ARGS)
STATE_FIELDS = ("result", "free_pages", "release_pages", "available_size")

Record = Dict[str, Any]
_INT64 = functools.partial(np.asarray, dtype=np.int64)  # Replayer's default array type


class TraceMismatch(AssertionError):
  """A replayed step disagreed with its record; the message names trace, step and index."""


def read(path: str) -> Dict[Any, List[Record]]:
  """A JSON-lines trace file as {trace id: [records]}, in order of first appearance.

  Raises ValueError naming the line for malformed JSON, unknown ops or missing fields,
  and naming the trace when one does not start with an `init` record.
  """
  traces: Dict[Any, List[Record]] = {}
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
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
  if rec["op"] not in ARGS:
    raise ValueError(f"{where}: unknown op {rec['op']!r}; ops are {OPS}")
  args = rec.get("args", {})
  if not isinstance(args, dict):
    raise ValueError(f"{where}: 'args' must be an object, got {args!r:.200}")
  missing = [k for k in ARGS[rec["op"]] if k not in args]
  if missing:
    raise ValueError(f"{where}: op {rec['op']!r} is missing args {missing}")


def write(path: str, records: Iterable[Record]) -> int:
  """Writes records as JSON lines; returns the number written."""
  lines = [json.dumps(rec, separators=(",", ":")) + "\n" for rec in records]
  with open(path, "w") as f:
    f.writelines(lines)
  return len(lines)


def as_int_list(x: Any) -> Optional[List[int]]:
  """None, or a flat list of ints from a list, numpy, jax or torch (any device) array."""
  if x is None:
    return None
  if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch, without importing it
    x = x.detach().cpu().numpy()
  return [int(v) for v in np.asarray(x).reshape(-1)]


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> Optional[str]:
  """None if equal, else where the two int lists first differ, in words."""
  i = next((i for i, (e, a) in enumerate(zip(expected, actual)) if e != a), None)
  if i is not None:
    return f"first differing index {i}: expected {expected[i]}, got {actual[i]}"
  if len(expected) == len(actual):
    return None
  i = min(len(expected), len(actual))
  extra = f"expected has {expected[i]}" if len(expected) > i else f"got {actual[i]}"
  return (f"lengths differ ({len(expected)} expected, {len(actual)} got); first differing "
          f"index {i}: {extra}")


def compare(expected: Record, actual: Record, *, release_unordered: bool = False
            ) -> Optional[str]:
  """None if `actual` agrees with every STATE_FIELDS entry `expected` has, else a message
  naming the field and the first differing index. release_unordered compares
  release_pages as sorted lists (SGLang 0.5.23 keeps need_sort's freed pages unordered)."""
  for field in (f for f in STATE_FIELDS if f in expected and f in actual):
    e, a = expected[field], actual[field]
    if field == "available_size":
      diff = None if int(e) == int(a) else f"expected {e}, got {a}"
    elif e is None or a is None:
      show = lambda v: "None (failure)" if v is None else f"{len(v)} slots"
      diff = None if e is a else f"expected {show(e)}, got {show(a)}"
    elif field == "release_pages" and release_unordered:
      diff = first_difference(sorted(e), sorted(a))
    else:
      diff = first_difference(list(e), list(a))
    if diff:
      return f"{field}: {diff}"
  return None


def init_args(args: Dict[str, Any]) -> Dict[str, Any]:
  """size, page_size, need_sort, kind of an init record, with defaults filled in."""
  ps = int(args["page_size"])
  return {"size": int(args["size"]), "page_size": ps,
          "need_sort": bool(args.get("need_sort", False)),
          "kind": args.get("kind") or ("token" if ps == 1 else "paged")}


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
               to_array: Callable[[List[int]], Any] = _INT64,
               to_cpu_array: Callable[[List[int]], Any] = _INT64,
               release_unordered: bool = False):
    self.make_allocator, self.to_array = make_allocator, to_array
    self.to_cpu_array, self.release_unordered = to_cpu_array, release_unordered
    self.allocator: Any = None
    self._snapshot: Any = None

  def apply(self, op: str, args: Optional[Dict[str, Any]] = None) -> Optional[List[int]]:
    """Runs one operation; returns its result as a list of ints (None on failure or for
    operations that return nothing). ValueError for an op before `init`, an unknown op
    or a restore before any backup."""
    args, a, arr, cpu = args or {}, self.allocator, self.to_array, self.to_cpu_array
    if op == "init":
      self.allocator, self._snapshot = self.make_allocator(**init_args(args)), None
    elif a is None:
      raise ValueError(f"op {op!r} before 'init'")
    elif op == "alloc":
      return as_int_list(a.alloc(int(args["need_size"])))
    elif op == "alloc_extend":
      pre, seq = list(args["prefix_lens"]), list(args["seq_lens"])
      n = int(args.get("extend_num_tokens", sum(seq) - sum(pre)))
      return as_int_list(a.alloc_extend(arr(pre), cpu(pre), arr(seq), cpu(seq),
                                        arr(list(args["last_loc"])), n))
    elif op == "alloc_decode":
      seq = list(args["seq_lens"])
      return as_int_list(a.alloc_decode(arr(seq), cpu(seq), arr(list(args["last_loc"]))))
    elif op in ("free", "free_page_ids"):
      getattr(a, op)(arr(list(args[ARGS[op][0]])))
    elif op == "free_segment":
      a.free_segment(arr(list(args["free_index"])), start_pos=int(args["start_pos"]))
    elif op == "backup_state":
      self._snapshot = a.backup_state()
    elif op == "restore_state":
      if self._snapshot is None:
        raise ValueError("restore_state before any backup_state")
      a.restore_state(self._snapshot)
    elif op in _NO_ARGS:
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
    """`apply` then `observe`: the record fields of STATE_FIELDS."""
    return {"result": self.apply(op, args), **self.observe()}


def jax_factory(kernel: str = "jnp", device: Any = None,
                backend: str = "device") -> Callable[..., Any]:
  """The allocator factory of a `Replayer` for jax_kvalloc's SGLang-compatible classes:
  make(size, page_size, need_sort, kind) -> TokenToKVPoolAllocator (kind "token") or
  PagedTokenToKVPoolAllocator, with the given index kernel, device and backend
  ("device": jax arrays, "host": numpy state and results)."""
  import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top

  def make(size, page_size, need_sort, kind):
    kw = dict(device=device, need_sort=need_sort, kernel=kernel, backend=backend)
    if kind == "token":
      return kvs.TokenToKVPoolAllocator(size, **kw)
    return kvs.PagedTokenToKVPoolAllocator(size, page_size, **kw)
  return make


ALLOC_OPS = ("alloc", "alloc_extend", "alloc_decode")


class PageTracker:
  """The pages in use as a trace's operations and results say, without reading the
  allocator (a leak check): `held` maps each page in use to the slots handed out in it,
  `waste` counts the unused slots inside those pages. Frees return whole pages (single
  slots at page size 1), inside a free group at its end; restore_state puts back the
  latest backup_state's."""

  def __init__(self, page_size: int):
    self.ps, self.held, self.waste = page_size, {}, 0
    self.group: Optional[List[int]] = None   # slots queued in an open free group
    self.snapshot: Any = None

  def apply(self, op: str, args: Dict[str, Any], result: Optional[Sequence[int]]) -> None:
    """Books one operation; `result` is what it returned (None for a failure)."""
    if op in ALLOC_OPS and result is not None:
      for s in result:
        got = self.held.setdefault(s // self.ps, set())
        if s not in got:
          self.waste += -1 if got else self.ps - 1
          got.add(s)
    elif op in ("free", "free_segment", "free_page_ids"):
      slots = ([int(p) * self.ps for p in args["page_ids"]] if op == "free_page_ids"
               else args["free_index"])
      if self.group is not None:
        return self.group.extend(slots)
      for page in {int(s) // self.ps for s in slots}:
        got = self.held.pop(page, None)
        if got is not None:
          self.waste -= self.ps - len(got)
    elif op == "free_group_begin":
      self.group = []
    elif op == "free_group_end":
      queued, self.group = self.group or [], None
      self.apply("free", {"free_index": queued}, None)
    elif op == "backup_state":
      self.snapshot = ({p: set(s) for p, s in self.held.items()}, self.waste)
    elif op == "restore_state" and self.snapshot is not None:
      self.held, self.waste = {p: set(s) for p, s in self.snapshot[0].items()}, self.snapshot[1]
    elif op in ("clear", "init"):
      self.held, self.waste, self.group = {}, 0, None


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  """One generated trace: the pool (kind "token" or "paged") and its traffic's shape."""
  seed: int                     # the requests' draws (workload) and the scheduler's choices
  size: int
  page_size: int = 1
  need_sort: bool = False
  kind: str = "token"
  steps: int = 200              # allocator operations before the drain that frees all
  max_prefill_batch: int = 4    # requests per alloc_extend
  max_decode_batch: int = 8     # requests per alloc_decode
  arrival_rate: float = 0.7     # mean new requests per scheduler iteration (Poisson)
  share_prob: float = 0.5       # chance of one of PREFIX_GROUPS shared prefixes
  cache_prob: float = 0.4       # chance that a finished request caches its group's prefix
  spec_prob: float = 0.25       # chance that a decode iteration is speculative
  oom_prob: float = 0.15        # chance of an allocation known not to fit (else fewer
                                # requests are admitted, or one retracted before a decode)
  segment_prob: float = 0.0     # chance that a finished request frees through SPEC 10's
                                # free_segment or free_page_ids instead of free

  def init_args(self) -> Dict[str, Any]:
    return {"size": self.size, "page_size": self.page_size, "need_sort": self.need_sort,
            "kind": self.kind}


PREFIX_GROUPS = 2
EVICT_PROB = 0.8   # chance that the scheduler evicts cached prefixes before a short alloc
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
  count). ValueError for an unknown scale."""
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
      cache_prob=rng.uniform(0.3, 1.0), spec_prob=rng.uniform(0.0, 0.5),
      oom_prob=rng.uniform(0.1, 0.6), segment_prob=segment_prob)


class _Req:
  """A request: `slots[i]` is the slot of token i; the first `shared` are its group's
  cached prefix (borrowed from its first prefill on), `extra` are slots past its last
  token that it holds (the rest of a speculative or preallocated page)."""

  def __init__(self, group: int, prompt: int, output: int, started: bool = False):
    self.group, self.prompt, self.output, self.started = group, prompt, output, started
    self.shared = 0
    self.slots: List[int] = []
    self.extra: List[int] = []

  @property
  def owned(self) -> List[int]:
    return self.slots[self.shared:] + self.extra


class SchedulerSim:
  """A seeded serving scheduler that issues allocator operations: Poisson arrivals whose
  prompts may start with a group's shared prefix (a prefix cache of whole pages, one
  entry per group, refcounted, evicted oldest first when an allocation would not fit),
  chunked prefills, decodes, speculative steps (snapshot and rollback, or rejected drafts
  freed; rows that extend by zero), preallocation through alloc(n), free groups (with a
  slot freed twice, as the overlap scheduler does), allocations known not to fit,
  retractions, and SPEC 10's frees when asked. Drive it with `run(execute)`, where
  execute(op, args) applies the op and returns its result (a list of ints, or None)."""

  def __init__(self, config: WorkloadConfig):
    self.cfg, self.ps, self.paged = config, config.page_size, config.kind == "paged"
    self.rng = random.Random(f"workload-{config.seed}")
    self.num_pages = config.size // config.page_size
    cap = self.num_pages * self.ps
    self.requests = workload.make_workload(
        num_requests=2 * config.steps + 8, arrival="poisson", rate=config.arrival_rate,
        prompt_len=f"lognormal:{cap / 20}:1:{max(1, cap // 3)}",
        output_len=f"uniform:1:{max(2, min(cap // 12, 600))}", num_prefixes=PREFIX_GROUPS,
        prefix_len=f"uniform:1:{max(1, cap // 4)}", share_prob=config.share_prob,
        seed=config.seed)
    self.arrived = self.ops = self.iteration = 0
    self.waiting: List[_Req] = []
    self.running: List[_Req] = []
    self.cache: Dict[int, List[int]] = {}   # group -> its prefix's slots, oldest first
    self.refs: Dict[int, int] = {}          # group -> requests borrowing its prefix
    self.pages = PageTracker(self.ps)   # what a request, the cache or a draft holds
    self._exec: Callable[[str, Dict[str, Any]], Optional[List[int]]] = lambda op, args: None

  def expected_available(self) -> int:
    """available_size that a correct allocator reports now."""
    return (self.num_pages - len(self.pages.held)) * self.ps

  def _fits(self, pre: Sequence[int], seq: Sequence[int]) -> bool:
    pages = sum(-(-s // self.ps) - (-(-p // self.ps)) for p, s in zip(pre, seq))
    return pages * self.ps <= self.expected_available()

  def run(self, execute: Callable[[str, Dict[str, Any]], Optional[List[int]]]) -> None:
    """Issues `config.steps` operations (a scheduler iteration is never cut short), then
    frees everything that is still held, so a correct allocator ends full."""
    self._exec = execute
    while self.ops < self.cfg.steps:
      self._iteration()
    for r in self.running + self.waiting:
      self._finish(r, cache=False)
    while self.cache:
      self._free(self.cache.pop(next(iter(self.cache))))

  def _do(self, op: str, args: Optional[Dict[str, Any]] = None) -> Optional[List[int]]:
    self.ops += 1
    out = self._exec(op, args or {})
    self.pages.apply(op, args or {}, out)
    return out

  def _free(self, slots: List[int]) -> None:
    if slots:
      self._do("free", {"free_index": list(slots)})

  def _extend(self, pre: List[int], seq: List[int], last: List[int]) -> Optional[List[int]]:
    """alloc_extend, or alloc of the new tokens on the token allocator ([] for none)."""
    if self.paged:
      return self._do("alloc_extend", {"prefix_lens": pre, "seq_lens": seq, "last_loc": last})
    total = sum(seq) - sum(pre)
    return self._do("alloc", {"need_size": total}) if total else []

  def _iteration(self) -> None:
    self.iteration += 1
    rng, wl = self.rng, self.requests
    while self.arrived < wl.num_requests and wl.arrival[self.arrived] < self.iteration:
      i, self.arrived = self.arrived, self.arrived + 1
      self.waiting.append(_Req(int(wl.group[i]), int(wl.prompt[i]), int(wl.output[i])))
    r = rng.random()
    if r < 0.02:
      self._do("merge_and_sort_free")
    elif r < 0.06 and self.paged:
      self._prealloc()
    elif self.waiting and (not self.running or rng.random() < 0.45):
      self._prefill()
    elif self.running:
      (self._spec_decode if rng.random() < self.cfg.spec_prob else self._decode)()
    self._finish_some()

  def _evict_for(self, need_slots: int) -> None:
    """Evicts unborrowed cached prefixes (oldest first) until need_slots fit."""
    if self.rng.random() < EVICT_PROB:
      while self.expected_available() < need_slots:
        idle = next((g for g in self.cache if not self.refs.get(g)), None)
        if idle is None:
          return
        self._free(self.cache.pop(idle))

  def _prefill(self) -> None:
    rng, ps = self.rng, self.ps
    batch = self.waiting[: rng.randint(1, self.cfg.max_prefill_batch)]
    for r in batch:
      if not r.started:   # first scheduled: borrow its group's cached prefix
        r.started = True
        if r.group in self.cache:
          r.slots = list(self.cache[r.group])
          r.shared, self.refs[r.group] = len(r.slots), self.refs.get(r.group, 0) + 1
    chunk = rng.randint(max(1, self.num_pages * ps // 16), max(2, self.num_pages * ps // 4))
    pre = [len(r.slots) for r in batch]
    seq = [min(r.prompt, p + chunk) for r, p in zip(batch, pre)]
    self._evict_for(sum(seq) - sum(pre) + len(batch) * ps)
    if rng.random() >= self.cfg.oom_prob:   # admission control: only what fits
      while batch and not self._fits(pre, seq):
        batch, pre, seq = batch[:-1], pre[:-1], seq[:-1]
      if not batch:
        return self._stalled()
    out = self._extend(pre, seq, [r.slots[-1] if r.slots else -1 for r in batch])
    if out is None:
      return self._stalled()
    for r, p, s in zip(batch, pre, seq):
      r.slots, out = r.slots + out[: s - p], out[s - p:]
      if s == r.prompt:
        self.waiting.remove(r)
        self.running.append(r)

  def _stalled(self) -> None:
    """An allocation failed or was not tried: now and then a request is aborted to make
    room (a retraction)."""
    holders = self.running + [r for r in self.waiting if r.started]
    if holders and self.rng.random() < 0.3:
      self._finish(self.rng.choice(holders), cache=False)

  def _prealloc(self) -> None:
    """PD disaggregation: whole pages for a transferred prompt, via alloc(n)."""
    tokens = self.rng.randint(1, max(1, self.num_pages * self.ps // 6))
    need = -(-tokens // self.ps) * self.ps
    self._evict_for(need)
    out = self._do("alloc", {"need_size": need})
    if out is None:
      return self._stalled()
    req = _Req(-1, tokens, self.rng.randint(1, max(2, self.num_pages)), started=True)
    req.slots, req.extra = out[:tokens], out[tokens:]
    self.running.append(req)

  def _decode(self) -> None:
    batch = self.running[: self.cfg.max_decode_batch]
    self._evict_for(len(batch) * self.ps)
    if self.rng.random() >= self.cfg.oom_prob:   # retract requests until the batch fits
      while batch and not self._fits([len(r.slots) for r in batch],
                                     [len(r.slots) + 1 for r in batch]):
        self._finish(batch[-1], cache=False)
        batch = self.running[: self.cfg.max_decode_batch]
      if not batch:
        return
    if self.paged:   # a request holding slack slots (extra) reuses them: last_loc + 1
      out = self._do("alloc_decode", {"seq_lens": [len(r.slots) + 1 for r in batch],
                                      "last_loc": [r.slots[-1] for r in batch]})
    else:
      out = self._do("alloc", {"need_size": len(batch)})
    if out is None:
      return self._stalled()
    for r, s in zip(batch, out):
      if r.extra and r.extra[0] == s:
        r.extra.pop(0)
      r.slots.append(s)

  def _spec_decode(self) -> None:
    """EAGLE-style draft (backup, allocate, restore) or over-allocation then release of
    the rejected draft slots. Rows may extend by zero."""
    rng, ps = self.rng, self.ps
    batch = self.running[: self.cfg.max_decode_batch]
    k = [rng.choice((0, 1, 2, 3, 4)) if rng.random() < 0.8 else 0 for _ in batch]
    pre = [len(r.slots) + len(r.extra) for r in batch]
    seq = [p + x for p, x in zip(pre, k)]
    self._evict_for(sum(k) + len(batch) * ps)   # before the snapshot, which would undo it
    if not self._fits(pre, seq) and rng.random() >= self.cfg.oom_prob:
      return self._decode()
    rollback = rng.random() < 0.5
    if rollback:
      self._do("backup_state")
    out = self._extend(pre, seq, [(r.extra or r.slots)[-1] for r in batch])
    if rollback:
      self._do("restore_state")
      return
    if out is None:
      return self._stalled()
    rejected = []
    for r, x in zip(batch, k):
      # Accepted drafts become tokens; the rest of the last page stays as slack (extra).
      row, out, accept = r.extra + out[:x], out[x:], rng.randint(0, x)
      r.slots += row[:accept]
      keep_to = accept + (-len(r.slots)) % ps   # to the end of the last page
      r.extra, rejected = row[accept: keep_to], rejected + row[keep_to:]
    self._free(rejected)

  def _finish(self, r: _Req, cache: bool) -> None:
    """Frees a request's slots (leaving its group's prefix, whole pages, in the cache)."""
    (self.running if r in self.running else self.waiting).remove(r)
    owned, rng = r.owned, self.rng
    if r.shared:
      self.refs[r.group] -= 1
    aligned = int(self.requests.prefix_len[r.group]) // self.ps * self.ps
    if (cache and not r.shared and r.group >= 0 and r.group not in self.cache
        and 0 < aligned <= len(r.slots)):
      self.cache[r.group], owned = r.slots[:aligned], owned[aligned:]
    if not owned:
      return
    op, args = "free", {"free_index": owned}
    if self.paged and self.pages.group is not None and rng.random() < 0.3:
      args["free_index"] = owned + owned[-1:]   # overlap scheduler: a slot freed twice
    elif self.cfg.segment_prob and rng.random() < self.cfg.segment_prob:
      # The request's own tokens from a page boundary on (its borrowed or cached prefix
      # ends on one), in token order: a segment (SPEC 10).
      if self.paged and rng.random() < 0.5:
        op, args = "free_page_ids", {"page_ids": [s // self.ps for s in owned[::self.ps]]}
      else:
        op, args = "free_segment", dict(args, start_pos=len(r.slots) + len(r.extra) - len(owned))
    self._do(op, args)

  def _finish_some(self) -> None:
    rng = self.rng
    done = [r for r in self.running
            if len(r.slots) - r.prompt >= r.output or rng.random() < 0.02]
    group = bool(done) and rng.random() < 0.5
    if group:
      self._do("free_group_begin")
    for r in done:
      self._finish(r, cache=rng.random() < self.cfg.cache_prob)
    if group:
      self._do("free_group_end")


def generate(config: WorkloadConfig, replayer: Replayer, trace_id: Any = 0,
             on_step: Optional[Callable[[int, Record], None]] = None) -> List[Record]:
  """Runs the workload of `config` against the allocator of `replayer` and records it:
  the init record, then one record per operation with the observed STATE_FIELDS.
  on_step(step, record), if given, runs after every step (for lock-step comparison; it
  may raise to stop the run). TraceMismatch when a step's available_size is not what a
  PageTracker of the operations and results predicts (a leak or a double allocation)."""
  records: List[Record] = []
  sim = SchedulerSim(config)

  def check_leak() -> None:
    # The tracker books an op after it returns: check before the next.
    if records and records[-1]["available_size"] != sim.expected_available():
      rec = records[-1]
      raise TraceMismatch(
          f"trace {trace_id!r} step {len(records) - 1} ({rec['op']}): available_size "
          f"{rec['available_size']}, but the trace holds pages for "
          f"{sim.expected_available()} free slots (a leak or a double allocation)")

  def execute(op: str, args: Dict[str, Any]) -> Optional[List[int]]:
    check_leak()
    records.append({"trace": trace_id, "op": op, "args": args, **replayer.step(op, args)})
    if on_step:
      on_step(len(records) - 1, records[-1])
    return records[-1]["result"]

  execute("init", config.init_args())
  sim.run(execute)
  check_leak()
  return records
