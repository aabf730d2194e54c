"""The serving engine: continuous batching over the request table, chunked prefill, a
prefix cache of whole pages, and several greedy decode steps per host round trip.

Two jitted step kinds, each compiled once (static shapes, the carry donated):

  prefill  up to `prefill_rows` rows, each with a chunk of up to `chunk` prompt tokens.
           Inside: the prefix cache's housekeeping (adopt a row's whole pages, evict,
           lend pages to new rows with `borrow_pages`), then `step_rows` (release the
           rows that finished, extend these rows), the attention inputs from the table,
           the model (K/V written at the table's slots, read through its page lists),
           and each row's next token where its prompt ended.
  decode   every decoding row, `decode_steps` greedy steps in a `lax.while_loop` on the
           device: each step's table work is one `step_rows` call, the model runs one
           token per live row, argmax picks the next token, and a row stops on its token
           budget or the end-of-sequence token, all without the host. The loop ends
           early when no row is live.

The host (this module's Engine) decides what it already knows (habit 14): which
requests are admitted (never over-committing the pool: every running request's worst
case, prompt plus max_new_tokens, is reserved, counting evictable cached pages as free),
which rows prefill, which cached pages are lent or evicted. It sends one int32 array per
step and reads one back (tokens, each token's logit, and the table's ok flags, which
must all be True).

`layout="contiguous"` runs the same schedule and model over a contiguous cache (no pool,
no table, no prefix cache): the baseline that the paged run must equal, bit for bit.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
# Importing Pallas defines jax config options that are part of the jit cache key (jax
# 0.12): imported lazily inside the first step's trace, they would make the second step
# compile again.
import jax.experimental.pallas  # pylint: disable=unused-import
import jax.numpy as jnp
import numpy as np

import jax_kvalloc as kv
from jax_kvalloc.serve import kv_store
from jax_kvalloc.serve import llama
from jax_kvalloc.serve.loader import LlamaConfig
from jax_kvalloc.serve.prefix_cache import Node
from jax_kvalloc.serve.prefix_cache import PrefixCache

Array = jax.Array


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _shared_pages(a: Sequence[int], b: Sequence[int], limit: int) -> int:
  """Tokens (at most limit) that a and b start with in common."""
  n = 0
  for x, y in zip(a[:limit], b):
    if x != y:
      break
    n += 1
  return n


def _pad(values: Sequence[int], size: int) -> np.ndarray:
  """int32[size]: values, then zeros."""
  return np.array(list(values) + [0] * (size - len(values)), np.int32)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of one engine (every shape its steps compile for)."""
  page_size: int = 16
  num_pages: int = 256          # pool pages (page 0 is reserved on top)
  max_reqs: int = 8             # table rows: requests running at once
  max_pages_per_req: int = 16   # a row holds at most this * page_size tokens
  prefill_rows: int = 4         # rows per prefill step
  chunk: int = 64               # prompt tokens per row per prefill step
  decode_steps: int = 8         # decode steps per host round trip
  layout: str = "paged"         # or "contiguous"
  impl: str = "gather"          # or "pallas" (decode through Pallas' GPU kernel)
  layers: str = "scan"          # or "unroll"
  prefix_cache: bool = True

  def __post_init__(self):
    for name in ("page_size", "num_pages", "max_reqs", "max_pages_per_req", "prefill_rows",
                 "chunk", "decode_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.layout not in kv_store.LAYOUTS:
      raise ValueError(f"layout must be one of {kv_store.LAYOUTS}, got {self.layout!r}")
    if self.impl not in kv_store.IMPLS:
      raise ValueError(f"impl must be one of {kv_store.IMPLS}, got {self.impl!r}")
    if self.layers not in llama.LAYERS:
      raise ValueError(f"layers must be one of {llama.LAYERS}, got {self.layers!r}")
    if self.prefill_rows > self.max_reqs:
      raise ValueError(f"prefill_rows={self.prefill_rows} exceeds max_reqs={self.max_reqs}")

  @property
  def paged(self) -> bool:
    return self.layout == "paged"

  @property
  def cached(self) -> bool:
    return self.paged and self.prefix_cache

  @property
  def max_len(self) -> int:
    """Tokens a row's KV can hold."""
    return self.max_pages_per_req * self.page_size

  @property
  def prefill_tokens(self) -> int:
    return self.prefill_rows * self.chunk

  @property
  def evict_cap(self) -> int:
    """Evictions one step may need: the most pages a step can allocate."""
    ps = self.page_size
    return min(self.num_pages, max(self.prefill_rows * (self.chunk // ps + 2),
                                   self.max_reqs * (self.decode_steps // ps + 2)))

  @property
  def adopt_cap(self) -> int:
    return self.max_reqs * self.max_pages_per_req

  def alloc_config(self) -> kv.AllocatorConfig:
    return kv.AllocatorConfig(size=self.num_pages * self.page_size, page_size=self.page_size)


class RequestError(ValueError):
  """A request this engine cannot serve; `index` is its position in the input."""

  def __init__(self, index: int, reason: str):
    super().__init__(f"request {index}: {reason}")
    self.index, self.reason = index, reason


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request: prompt token ids and its budget."""
  prompt: Tuple[int, ...]
  max_new_tokens: int
  ignore_eos: bool = False


class Carry(NamedTuple):
  """What the steps thread through (donated): pool, table, KV caches, cached pages."""
  state: Any            # AllocatorState (paged) or None
  table: Any            # RequestTable (paged) or None
  caches: Any           # per-layer (k, v)
  cache_pages: Any      # i32[num_pages] page id of each prefix-cache slot (paged) or None


# ---------------------------------------------------------------------------------------
# Device side: batches in one flat int32 array, the two step kinds.
# ---------------------------------------------------------------------------------------

def pack(x: Dict[str, Any]) -> Tuple[np.ndarray, tuple]:
  """The batch's int32 arrays as one flat array and the static layout to unpack it."""
  layout = tuple((k, tuple(np.shape(v))) for k, v in x.items())
  flat = np.concatenate([np.ravel(np.asarray(v, np.int32)) for v in x.values()])
  return flat, layout


def unpack(flat: Array, layout: tuple) -> Dict[str, Array]:
  out, at = {}, 0
  for key, shape in layout:
    size = int(np.prod(shape, dtype=np.int64))
    out[key] = flat[at:at + size].reshape(shape)
    at += size
  return out


def _housekeeping(ecfg: EngineConfig, carry: Carry, x: Dict[str, Array]):
  """Prefix-cache work before the step's table call: adopt rows' whole pages into the
  cache, evict cached pages (free_page_ids), and lend pages to new rows (borrow_pages).
  Returns (carry, ok)."""
  if not ecfg.cached:
    return carry, jnp.bool_(True)
  acfg = ecfg.alloc_config()
  state, table, caches, cache_pages = carry
  width = table.pages.shape[1]
  # Adopt: cache slot s takes pages[row, col]; the row's owned_from moves past col, so
  # its release leaves the page to the cache.
  live = jnp.arange(x["adopt_row"].shape[0]) < x["n_adopt"]
  rows = jnp.where(live, x["adopt_row"], table.pages.shape[0])
  page = table.pages[jnp.clip(x["adopt_row"], 0, table.pages.shape[0] - 1),
                     jnp.clip(x["adopt_col"], 0, width - 1)]
  cache_pages = cache_pages.at[jnp.where(live, x["adopt_slot"], cache_pages.shape[0])].set(
      page, mode="drop")
  owned = table.owned_from.at[rows].max(x["adopt_col"] + 1, mode="drop")
  table = table._replace(owned_from=owned)
  # Evict: free the slots' pages (zeros are padding) and forget them.
  live = jnp.arange(x["evict_slot"].shape[0]) < x["n_evict"]
  slot = jnp.where(live, x["evict_slot"], cache_pages.shape[0])
  ids = jnp.where(live, cache_pages[jnp.clip(slot, 0, cache_pages.shape[0] - 1)], 0)
  state = kv.free_page_ids(acfg, state, ids)
  cache_pages = cache_pages.at[slot].set(0, mode="drop")
  # Lend: new rows start from cached pages.
  ids = cache_pages[x["borrow_slot"]]
  table, ok = kv.borrow_pages(acfg, state, table, x["borrow_row"], ids, x["borrow_n"],
                              num_rows=x["n_borrow"])
  return Carry(state, table, caches, cache_pages), ok


def _model(cfg: LlamaConfig, ecfg: EngineConfig, params, caches, tokens, last,
           addr: kv_store.StepAddress):
  attention = kv_store.attention_fn(ecfg.layout, ecfg.impl, addr)
  caches, logits = llama.forward(cfg, params, caches, tokens, addr.q_pos, last, attention,
                                 layers=ecfg.layers)
  nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  top = jnp.max(logits, axis=-1)
  return caches, nxt, top


def _bits(x: Array) -> Array:
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def prefill_step(cfg: LlamaConfig, ecfg: EngineConfig, layout: tuple, params, carry: Carry,
                 flat: Array, *, model: bool = True):
  """One prefill step. Returns (carry, i32[2 * prefill_rows + 1]: next token and its
  logit's bits per row, then ok)."""
  x = unpack(flat, layout)
  bp, c = ecfg.prefill_rows, ecfg.chunk
  carry, ok = _housekeeping(ecfg, carry, x)
  state, table, caches, cache_pages = carry
  rows, n, count = x["rows"], x["n"], x["n_rows"]
  entry = jnp.arange(bp)
  real = entry < count
  n = jnp.where(real, n, 0)
  i = jnp.arange(c, dtype=jnp.int32)[None, :]
  valid = i < n[:, None]
  if ecfg.paged:
    acfg = ecfg.alloc_config()
    state, table, out = kv.step_rows(acfg, state, table, release=x["release"],
                                     num_release=x["n_release"], extend=rows, n=n,
                                     num_extend=count, max_tokens=ecfg.prefill_tokens)
    ok = ok & out.release_ok & out.extend_ok
    att = kv.attention_inputs(acfg, table, rows, n, num_rows=count)
    ok = ok & jnp.all(jnp.where(real, att.kv_lens - n == x["start"], True))
    start = att.kv_lens - n
    cu = att.cu_q_lens[:-1]
    slots = out.extend_slots[jnp.clip(cu[:, None] + i, 0, ecfg.prefill_tokens - 1)]
    addr = kv_store.StepAddress(q_pos=start[:, None] + i, valid=valid, kv_len=att.kv_lens,
                                slots=slots, page_indices=att.page_indices, rows=rows)
  else:
    start = x["start"]
    addr = kv_store.StepAddress(q_pos=start[:, None] + i, valid=valid,
                                kv_len=jnp.where(real, start + n, 0),
                                slots=jnp.zeros((bp, c), jnp.int32),
                                page_indices=jnp.zeros((bp, 1), jnp.int32), rows=rows)
  if model:
    caches, nxt, top = _model(cfg, ecfg, params, caches, x["tokens"], jnp.maximum(n - 1, 0),
                              addr)
  else:
    nxt, top = jnp.zeros((bp,), jnp.int32), jnp.zeros((bp,), jnp.float32)
  out = jnp.concatenate([nxt, _bits(top), ok.astype(jnp.int32).reshape(1)])
  return Carry(state, table, caches, cache_pages), out


def decode_step(cfg: LlamaConfig, ecfg: EngineConfig, layout: tuple, params, carry: Carry,
                flat: Array, *, model: bool = True):
  """Up to decode_steps greedy steps of every live row. Returns (carry,
  i32[2 * decode_steps * max_reqs + 1]: the tokens [K, R] (-1 where a row was not
  live), their logits' bits [K, R], then ok)."""
  x = unpack(flat, layout)
  r, k_steps = ecfg.max_reqs, ecfg.decode_steps
  carry, ok = _housekeeping(ecfg, carry, x)
  state, table, caches, cache_pages = carry
  acfg = ecfg.alloc_config() if ecfg.paged else None
  if ecfg.paged:
    state, table, out = kv.step_rows(acfg, state, table, release=x["release"],
                                     num_release=x["n_release"])
    ok = ok & out.release_ok
  rows = x["rows"]
  entry = jnp.arange(r)
  alive0 = (entry < x["n_rows"]) & (x["remaining"] > 0)
  eos = jnp.int32(cfg.eos_id)

  def body(loop):
    step, state, table, caches, tok, pos, remaining, alive, toks, tops, ok = loop
    order = jnp.argsort(~alive, stable=True)        # live entries first (padding last)
    srows, n_live = rows[order], jnp.sum(alive).astype(jnp.int32)
    live = entry < n_live
    if ecfg.paged:
      state, table, out = kv.step_rows(acfg, state, table, decode=srows, num_decode=n_live)
      ok = ok & out.decode_ok
      att = kv.attention_inputs(acfg, table, srows, jnp.ones((r,), jnp.int32),
                                num_rows=n_live)
      ok = ok & jnp.all(jnp.where(live, att.kv_lens - 1 == pos[order], True))
      addr = kv_store.StepAddress(q_pos=(att.kv_lens - 1)[:, None], valid=live[:, None],
                                  kv_len=att.kv_lens, slots=out.decode_slots[:, None],
                                  page_indices=att.page_indices, rows=srows)
    else:
      addr = kv_store.StepAddress(q_pos=pos[order][:, None], valid=live[:, None],
                                  kv_len=jnp.where(live, pos[order] + 1, 0),
                                  slots=jnp.zeros((r, 1), jnp.int32),
                                  page_indices=jnp.zeros((r, 1), jnp.int32), rows=srows)
    if model:
      caches, nxt_s, top_s = _model(cfg, ecfg, params, caches, tok[order][:, None],
                                    jnp.zeros((r,), jnp.int32), addr)
    else:
      nxt_s, top_s = jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.float32)
    nxt = jnp.zeros((r,), jnp.int32).at[order].set(nxt_s)
    top = jnp.zeros((r,), jnp.float32).at[order].set(top_s)
    toks = toks.at[step].set(jnp.where(alive, nxt, -1))
    tops = tops.at[step].set(jnp.where(alive, top, 0.0))
    remaining = jnp.where(alive, remaining - 1, remaining)
    stop = alive & (nxt == eos) & (x["ignore_eos"] == 0)
    remaining = jnp.where(stop, 0, remaining)
    tok = jnp.where(alive, nxt, tok)
    pos = jnp.where(alive, pos + 1, pos)
    return (step + 1, state, table, caches, tok, pos, remaining, remaining > 0, toks, tops,
            ok)

  def cond(loop):
    return (loop[0] < k_steps) & jnp.any(loop[7])

  loop = (jnp.int32(0), state, table, caches, x["tokens"], x["start"], x["remaining"],
          alive0, jnp.full((k_steps, r), -1, jnp.int32), jnp.zeros((k_steps, r), jnp.float32),
          ok)
  loop = jax.lax.while_loop(cond, body, loop)
  _, state, table, caches, _, _, _, _, toks, tops, ok = loop
  out = jnp.concatenate([toks.reshape(-1), _bits(tops).reshape(-1),
                         ok.astype(jnp.int32).reshape(1)])
  return Carry(state, table, caches, cache_pages), out


@functools.lru_cache(maxsize=None)
def jitted_step(cfg: LlamaConfig, ecfg: EngineConfig, kind: str, layout: tuple,
                model: bool = True):
  """step(params, carry, flat) -> (carry, out), compiled once per config, kind and batch
  layout (the carry is donated)."""
  fn = prefill_step if kind == "prefill" else decode_step
  return jax.jit(functools.partial(fn, cfg, ecfg, layout, model=model), donate_argnums=1)


# ---------------------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------------------

_COMPILES = [0]
_LISTENING = [False]


def compile_count() -> int:
  """Backend compiles so far in this process (XLA programs, Pallas kernels too)."""
  if not _LISTENING[0]:
    def on_event(event: str, duration: float, **kwargs) -> None:
      del duration, kwargs
      if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1
    jax.monitoring.register_event_duration_secs_listener(on_event)
    _LISTENING[0] = True
  return _COMPILES[0]


@dataclasses.dataclass
class _Running:
  """A request on a table row (host mirror)."""
  index: int                  # position in the input
  req: Request
  row: int
  done: int = 0               # tokens in its KV cache (table.lens)
  owned_from: int = 0         # page columns the cache holds (borrowed or adopted)
  chain: List[Node] = dataclasses.field(default_factory=list)
  adopting: bool = True       # False once a page it computed was cached already
  gen: List[int] = dataclasses.field(default_factory=list)
  tops: List[float] = dataclasses.field(default_factory=list)
  first_token_s: float = float("nan")

  @property
  def prefilling(self) -> bool:
    return self.done < len(self.req.prompt)

  @property
  def finished(self) -> bool:
    if self.prefilling or not self.gen:
      return False
    eos_hit = not self.req.ignore_eos and self.gen[-1] == self._eos
    return len(self.gen) >= self.req.max_new_tokens or eos_hit

  _eos: int = 2

  def worst_pages(self, ps: int) -> int:
    """Pages this row may still allocate (its tokens' worst case minus what it has)."""
    worst = len(self.req.prompt) + self.req.max_new_tokens - 1
    return _cdiv(worst, ps) - _cdiv(self.done, ps)


@dataclasses.dataclass
class Result:
  """What a run produced, in input order, and how it went."""
  new_ids: List[List[int]]
  tops: List[List[float]]        # each new token's logit
  stats: Dict[str, Any]


class Engine:
  """Serves requests through the jitted steps (see the module docstring)."""

  def __init__(self, cfg: LlamaConfig, params, ecfg: EngineConfig, dtype=jnp.float32):
    self.cfg, self.ecfg, self.dtype = cfg, ecfg, dtype
    if params is not None and ecfg.layers == "unroll":
      params = llama.unstack_layers(params)
    self.params = params
    self.log: List[Dict[str, Any]] = []

  # -- device state --
  def _fresh_carry(self) -> Carry:
    e = self.ecfg
    if e.paged:
      acfg = e.alloc_config()
      caches = kv_store.init_caches(self.cfg, "paged", dtype=self.dtype, layers=e.layers,
                                    num_pages=e.num_pages, page_size=e.page_size)
      return Carry(kv.init(acfg), kv.init_table(acfg, e.max_reqs, e.max_pages_per_req),
                   caches, jnp.zeros((e.num_pages,), jnp.int32))
    caches = kv_store.init_caches(self.cfg, "contiguous", dtype=self.dtype, layers=e.layers,
                                  rows=e.max_reqs, max_len=e.max_len)
    return Carry(None, None, caches, None)

  def check(self, requests: Sequence[Request]) -> None:
    """RequestError naming the request when one cannot be served by this engine."""
    e = self.ecfg
    limit = min(e.max_len, self.cfg.context_length, e.num_pages * e.page_size)
    for i, r in enumerate(requests):
      if not r.prompt:
        raise RequestError(i, "empty prompt")
      if r.max_new_tokens < 1:
        raise RequestError(i, f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
      bad = [t for t in r.prompt if not 0 <= int(t) < self.cfg.vocab_size]
      if bad:
        raise RequestError(i, f"token id {bad[0]} outside the vocabulary "
                              f"(0..{self.cfg.vocab_size - 1})")
      need = len(r.prompt) + r.max_new_tokens - 1
      if need > limit:
        raise RequestError(i,
            f"{len(r.prompt)} prompt tokens + {r.max_new_tokens} new tokens "
            f"need {need} KV tokens, more than this engine holds per request ({limit}: "
            f"the model's context {self.cfg.context_length}, a row's {e.max_len} "
            f"(--max-len), the pool's {e.num_pages * e.page_size} (--pool-pages))")

  # -- the batch of one step --
  def _base(self, hk: Dict[str, list]) -> Dict[str, np.ndarray]:
    """The housekeeping part of a step's batch (both kinds): releases, and the prefix
    cache's adoptions, evictions and loans."""
    e = self.ecfg
    x = {"release": _pad(hk["release"], e.max_reqs), "n_release": len(hk["release"])}
    if e.cached:
      slots = np.zeros((e.max_reqs, e.max_pages_per_req), np.int32)
      for b, r in enumerate(hk["borrow"]):
        slots[b, :r.owned_from] = [node.slot for node in r.chain[:r.owned_from]]
      x.update(adopt_row=_pad([a[0] for a in hk["adopt"]], e.adopt_cap),
               adopt_col=_pad([a[1] for a in hk["adopt"]], e.adopt_cap),
               adopt_slot=_pad([a[2] for a in hk["adopt"]], e.adopt_cap),
               n_adopt=len(hk["adopt"]), evict_slot=_pad(hk["evict"], e.evict_cap),
               n_evict=len(hk["evict"]),
               borrow_row=_pad([r.row for r in hk["borrow"]], e.max_reqs),
               borrow_slot=slots,
               borrow_n=_pad([r.owned_from for r in hk["borrow"]], e.max_reqs),
               n_borrow=len(hk["borrow"]))
    return x

  def _run_step(self, kind: str, x: Dict[str, Any]) -> np.ndarray:
    flat, layout = pack(x)
    fn = jitted_step(self.cfg, self.ecfg, kind, layout)
    before = compile_count()
    t0 = time.perf_counter()
    self.carry, out = fn(self.params, self.carry, jax.device_put(flat))
    out = np.asarray(jax.device_get(out))
    seconds = time.perf_counter() - t0
    self.log.append(dict(kind=kind, x=flat, layout=layout, s=seconds,
                         compiles=compile_count() - before))
    if not out[-1]:
      raise RuntimeError(f"the {kind} step's table work was refused (the host's admission "
                         "and the device disagree)")
    return out

  def run(self, requests: Sequence[Request]) -> Result:
    """Serves every request; returns their new tokens in input order."""
    self.check(requests)
    e, ps = self.ecfg, self.ecfg.page_size
    self.carry = self._fresh_carry()
    self.log = []
    cache = PrefixCache(ps, e.num_pages) if e.cached else None
    waiting = collections.deque(enumerate(requests))
    running: List[_Running] = []
    free_rows = list(range(e.max_reqs))
    free_pages = e.num_pages            # host mirror of the pool's free pages
    fresh = lambda: dict(adopt=[], evict=[], release=[], borrow=[])
    hk = fresh()
    finished: Dict[int, _Running] = {}
    prefer_decode = False
    t_start = time.perf_counter()

    def adopt(run: _Running, upto_tokens: int, tokens: Sequence[int]):
      """Offers run's whole pages below upto_tokens to the cache (contiguous from its
      owned_from; stops at a page that is cached already)."""
      while run.adopting and run.owned_from < min(upto_tokens // ps, e.max_pages_per_req):
        k = run.owned_from
        node = cache.insert(run.chain[-1] if run.chain else None, tokens, k)
        if node is None:
          run.adopting = False
          break
        hk["adopt"].append((run.row, k, node.slot))
        run.chain.append(node)
        run.owned_from = k + 1

    def reserved() -> int:
      return sum(r.worst_pages(ps) for r in running)

    while waiting or running:
      # Admission, in arrival order: a free row, and the pool's worst case still covered.
      # A new row borrows its cached prefix in the next step's housekeeping.
      while waiting and free_rows:
        index, req = waiting[0]
        limit = (len(req.prompt) - 1) // ps
        chain = cache.match(req.prompt, limit) if cache is not None else []
        if cache is not None and any(
            min(_shared_pages(req.prompt, r.req.prompt, limit * ps) // ps, limit) > len(chain)
            for r in running if r.prefilling):
          break  # a running row is computing more of this prompt's pages: wait for them
        if cache is not None:
          cache.acquire(chain)
        run = _Running(index=index, req=req, row=free_rows[0], done=len(chain) * ps,
                       owned_from=len(chain), chain=list(chain), _eos=self.cfg.eos_id)
        spare = free_pages + (cache.evictable() if cache is not None else 0)
        if reserved() + run.worst_pages(ps) > spare:
          if cache is not None:
            cache.let_go(chain)
          break
        waiting.popleft()
        free_rows.pop(0)
        running.append(run)
        if chain:
          hk["borrow"].append(run)
          cache.hits += len(chain)
      prefilling = [r for r in running if r.prefilling][:e.prefill_rows]
      decoding = [r for r in running if not r.prefilling]
      kind = "prefill" if prefilling and not (decoding and prefer_decode) else "decode"
      if not prefilling and not decoding:
        raise RuntimeError("nothing can run: the pool cannot hold the next request")
      # Pages this step may allocate; evict cached pages until they are free.
      if kind == "prefill":
        chunks = [min(e.chunk, len(r.req.prompt) - r.done) for r in prefilling]
        need = sum(_cdiv(r.done + n, ps) - _cdiv(r.done, ps) for r, n in zip(prefilling, chunks))
      else:
        need = sum(_cdiv(r.done + min(e.decode_steps, r.req.max_new_tokens - len(r.gen)), ps)
                   - _cdiv(r.done, ps) for r in decoding)
      if need > free_pages and cache is not None:
        slots = cache.evict(need - free_pages)
        hk["evict"] += slots
        free_pages += len(slots)
      if need > free_pages:
        raise RuntimeError(f"the pool is short ({free_pages} free pages, {need} needed): "
                           "admission should have prevented this")
      x = self._base(hk)
      released = list(hk["release"])
      hk = fresh()
      pad = _pad
      if kind == "prefill":
        toks = np.zeros((e.prefill_rows, e.chunk), np.int32)
        for b, (r, n) in enumerate(zip(prefilling, chunks)):
          toks[b, :n] = r.req.prompt[r.done:r.done + n]
        x.update(rows=pad([r.row for r in prefilling], e.prefill_rows),
                 n=pad(chunks, e.prefill_rows), n_rows=len(prefilling), tokens=toks,
                 start=pad([r.done for r in prefilling], e.prefill_rows))
        out = self._run_step("prefill", x)
        now = time.perf_counter()
        self.log[-1]["tokens"] = sum(chunks)
        bp = e.prefill_rows
        for b, (r, n) in enumerate(zip(prefilling, chunks)):
          free_pages -= _cdiv(r.done + n, ps) - _cdiv(r.done, ps)
          r.done += n
          if not r.prefilling:
            r.gen.append(int(out[b]))
            r.tops.append(float(out[bp + b:bp + b + 1].view(np.float32)[0]))
            r.first_token_s = now - t_start
          if cache is not None:
            adopt(r, r.done, r.req.prompt)
        prefer_decode = True
      else:
        r_, k_ = e.max_reqs, e.decode_steps
        x.update(rows=pad([r.row for r in decoding], r_), n_rows=len(decoding),
                 tokens=pad([r.gen[-1] for r in decoding], r_),
                 start=pad([r.done for r in decoding], r_),
                 remaining=pad([r.req.max_new_tokens - len(r.gen) for r in decoding], r_),
                 ignore_eos=pad([int(r.req.ignore_eos) for r in decoding], r_))
        out = self._run_step("decode", x)
        toks = out[:k_ * r_].reshape(k_, r_)
        tops = out[k_ * r_:2 * k_ * r_].reshape(k_, r_).view(np.float32)
        emitted = 0
        for b, r in enumerate(decoding):
          got = [int(t) for t in toks[:, b] if t >= 0]
          emitted += len(got)
          free_pages -= _cdiv(r.done + len(got), ps) - _cdiv(r.done, ps)
          r.done += len(got)
          r.gen += got
          r.tops += [float(v) for v in tops[:len(got), b]]
        self.log[-1]["tokens"] = emitted
        self.log[-1]["rows"] = len(decoding)
        prefer_decode = False
      # Finished requests: their whole pages go to the cache, their rows are released
      # in the next step (and free after it).
      for r in list(running):
        if r.finished:
          if cache is not None:
            adopt(r, r.done, list(r.req.prompt) + r.gen)
            cache.let_go(r.chain)
          hk["release"].append(r.row)
          free_pages += _cdiv(r.done, ps) - r.owned_from
          running.remove(r)
          finished[r.index] = r
      free_rows += released
    # Release the last rows, then empty the cache: the pool must be whole again.
    if self.ecfg.paged:
      if cache is not None:
        slots = cache.evict(len(cache))
        hk["evict"] += slots
        free_pages += len(slots)
      x = self._base(hk)
      r_ = e.max_reqs
      pad = _pad
      x.update(rows=pad([], r_), n_rows=0, tokens=pad([], r_), start=pad([], r_),
               remaining=pad([], r_), ignore_eos=pad([], r_))
      self._run_step("decode", x)
      self.log.pop()
      avail = int(kv.available_size(e.alloc_config(), self.carry.state)) // ps
      if avail != e.num_pages or free_pages != e.num_pages:
        raise RuntimeError(f"pages leaked: {e.num_pages - avail} held on the device, host "
                           f"mirror {e.num_pages - free_pages}")
    wall = time.perf_counter() - t_start
    order = [finished[i] for i in range(len(requests))]
    return Result(new_ids=[r.gen for r in order], tops=[r.tops for r in order],
                  stats=self._stats(order, wall, cache))

  def _stats(self, runs: List[_Running], wall: float, cache) -> Dict[str, Any]:
    late = {}
    seen = set()
    for entry in self.log:
      if entry["kind"] in seen:
        late[entry["kind"]] = late.get(entry["kind"], 0) + entry["compiles"]
      seen.add(entry["kind"])
    by = {k: [x for x in self.log if x["kind"] == k] for k in ("prefill", "decode")}
    warm = {k: v[1:] for k, v in by.items()}
    secs = lambda v: sum(x["s"] for x in v)
    toks = lambda v: sum(x.get("tokens", 0) for x in v)
    rate = lambda v: toks(v) / secs(v) if v and secs(v) > 0 else float("nan")
    return dict(
        requests=len(runs), generated=sum(len(r.gen) for r in runs),
        prompt_tokens=sum(len(r.req.prompt) for r in runs), wall_s=wall,
        steps={k: len(v) for k, v in by.items()},
        prefill_tokens=toks(by["prefill"]), decode_tokens=toks(by["decode"]),
        prefill_tokens_per_s_warm=rate(warm["prefill"]),
        decode_tokens_per_s_warm=rate(warm["decode"]),
        first_step_s={k: v[0]["s"] for k, v in by.items() if v},
        ttft_s=[r.first_token_s for r in runs],
        late_compiles=sum(late.values()),
        prefix_cache=(dict(hit_pages=cache.hits, inserted=cache.inserted,
                           evicted=cache.evicted) if cache is not None else None),
        layout=self.ecfg.layout, impl=self.ecfg.impl, layers=self.ecfg.layers,
        device=str(jax.devices()[0]))
