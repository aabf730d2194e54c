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
requests are admitted (on the pages the running and new requests are planned to need,
see Engine.run), which running request is retracted when the pool cannot cover the next
step, which rows prefill, which cached pages are lent or evicted. The device never
over-commits: a table operation it refuses is an error. It sends one int32 array per
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
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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


def _pad(values: Sequence[int], size: int, name: str = "values") -> np.ndarray:
  """int32[size]: values, then zeros. RuntimeError naming the field when there are more
  than size values: a step's static capacity is never outgrown (that would change the
  batch's shape and compile the step again)."""
  if len(values) > size:
    raise RuntimeError(f"{name}: {len(values)} entries exceed the step's static capacity "
                       f"{size}")
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
  new_token_ratio: float = 0.5  # share of max_new_tokens expected until requests finish

  def __post_init__(self):
    for name in ("page_size", "num_pages", "max_reqs", "max_pages_per_req", "prefill_rows",
                 "chunk", "decode_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= self.new_token_ratio <= 1.0:
      raise ValueError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio!r}")
    if self.layout not in kv_store.LAYOUTS:
      raise ValueError(f"layout must be one of {kv_store.LAYOUTS}, got {self.layout!r}")
    if self.impl not in kv_store.IMPLS:
      raise ValueError(f"impl must be one of {kv_store.IMPLS}, got {self.impl!r}")
    if self.layers not in llama.LAYERS:
      raise ValueError(f"layers must be one of {llama.LAYERS}, got {self.layers!r}")
    if self.impl == "pallas" and self.paged and self.page_size & (self.page_size - 1):
      raise ValueError(f"page_size={self.page_size}: Pallas' GPU paged_attention needs a "
                       "power of two (1, 2, 4, ..., 64, ...); use impl='gather'")
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
  before = kv.available_size(acfg, state)
  state = kv.free_page_ids(acfg, state, ids)
  # A refused free (a page that is not held, given twice, or id 0) frees nothing.
  evict_ok = (kv.available_size(acfg, state) - before
              == jnp.sum(live).astype(jnp.int32) * ecfg.page_size) & jnp.all(
                  jnp.where(live, ids != 0, True))
  cache_pages = cache_pages.at[slot].set(0, mode="drop")
  # Lend: new rows start from cached pages.
  ids = cache_pages[x["borrow_slot"]]
  table, ok = kv.borrow_pages(acfg, state, table, x["borrow_row"], ids, x["borrow_n"],
                              num_rows=x["n_borrow"])
  return Carry(state, table, caches, cache_pages), ok & evict_ok


# A stand-in for the model (tests): model(ecfg, caches, tokens i32[B, C], last i32[B],
# addr) -> (caches, i32[B] next token, f32[B] its logit). Hashable: a jit cache key.
StandIn = Callable[..., Tuple[Any, Array, Array]]


def _model(cfg: LlamaConfig, ecfg: EngineConfig, params, caches, tokens, last,
           addr: kv_store.StepAddress, model: Any = True):
  if callable(model):
    return model(ecfg, caches, tokens, last, addr)
  attention = kv_store.attention_fn(ecfg.layout, ecfg.impl, addr)
  caches, logits = llama.forward(cfg, params, caches, tokens, addr.q_pos, last, attention,
                                 layers=ecfg.layers)
  nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  top = jnp.max(logits, axis=-1)
  return caches, nxt, top


def _bits(x: Array) -> Array:
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def prefill_step(cfg: LlamaConfig, ecfg: EngineConfig, layout: tuple, params, carry: Carry,
                 flat: Array, *, model: Any = True):
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
                              addr, model)
  else:
    nxt, top = jnp.zeros((bp,), jnp.int32), jnp.zeros((bp,), jnp.float32)
  out = jnp.concatenate([nxt, _bits(top), ok.astype(jnp.int32).reshape(1)])
  return Carry(state, table, caches, cache_pages), out


def decode_step(cfg: LlamaConfig, ecfg: EngineConfig, layout: tuple, params, carry: Carry,
                flat: Array, *, model: Any = True):
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
                                    jnp.zeros((r,), jnp.int32), addr, model)
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


# Bounded: each compiled step holds ~100-200 memory maps on XLA:CPU, and a process that
# builds engines of many configs (a test suite, a server that resizes) must not exhaust
# them (vm.max_map_count); one engine uses far fewer than this many step programs.
@functools.lru_cache(maxsize=48)
def jitted_step(cfg: LlamaConfig, ecfg: EngineConfig, kind: str, layout: tuple,
                model: Any = True):
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
class _Seq:
  """A request's host-side state, waiting or on a table row."""
  index: int                  # position in the input
  req: Request
  eos: int
  gen: List[int] = dataclasses.field(default_factory=list)
  tops: List[float] = dataclasses.field(default_factory=list)
  first_token_s: Optional[float] = None
  computed: int = 0           # KV tokens it held when last retracted (0: never)
  # On a row (set at admission):
  row: int = -1
  fill: Tuple[int, ...] = ()  # tokens to prefill: the prompt, then what it generated
  done: int = 0               # tokens in its KV cache (table.lens)
  owned_from: int = 0         # page columns the prefix cache holds (borrowed or adopted)
  chain: List[Node] = dataclasses.field(default_factory=list)
  adopting: bool = True       # False once a page it computed was cached already

  @property
  def prefilling(self) -> bool:
    return self.done < len(self.fill)

  @property
  def tokens(self) -> List[int]:
    return list(self.req.prompt) + self.gen

  @property
  def finished(self) -> bool:
    if self.prefilling or not self.gen:
      return False
    eos_hit = not self.req.ignore_eos and self.gen[-1] == self.eos
    return len(self.gen) >= self.req.max_new_tokens or eos_hit

  def worst_kv(self) -> int:
    """KV tokens it holds at most: its prompt and every new token but the last."""
    return len(self.req.prompt) + self.req.max_new_tokens - 1

  def next_tokens(self, ecfg: EngineConfig) -> int:
    """KV tokens its next step of its kind adds (a chunk, or a decode round trip)."""
    if self.prefilling:
      return min(ecfg.chunk, len(self.fill) - self.done)
    return min(ecfg.decode_steps, self.req.max_new_tokens - len(self.gen))

  def planned_pages(self, ecfg: EngineConfig, ratio: float) -> int:
    """Pages it may still allocate under the estimate: the rest of its prefill, then its
    next decode round trip or `ratio` of its remaining new tokens, whichever is more."""
    ps = ecfg.page_size
    base = len(self.fill) if self.prefilling else self.done
    rest = self.worst_kv() - base
    est = min(rest, max(ecfg.decode_steps, int(np.ceil(ratio * rest))))
    return _cdiv(base + est, ps) - _cdiv(self.done, ps)


@dataclasses.dataclass
class Result:
  """What a run produced, in input order, and how it went."""
  new_ids: List[List[int]]
  tops: List[List[float]]        # each new token's logit
  stats: Dict[str, Any]


class Engine:
  """Serves requests through the jitted steps (see the module docstring).

  `model` replaces the Llama forward pass (tests: a stand-in, see StandIn)."""

  def __init__(self, cfg: LlamaConfig, params, ecfg: EngineConfig, dtype=jnp.float32,
               model: Optional[StandIn] = None):
    self.cfg, self.ecfg, self.dtype = cfg, ecfg, dtype
    if params is not None and ecfg.layers == "unroll":
      params = llama.unstack_layers(params)
    self.params = params
    self.model = True if model is None else model
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
    x = {"release": _pad(hk["release"], e.max_reqs, "release"),
         "n_release": len(hk["release"])}
    if e.cached:
      slots = np.zeros((e.max_reqs, e.max_pages_per_req), np.int32)
      for b, r in enumerate(hk["borrow"]):
        slots[b, :r.owned_from] = [node.slot for node in r.chain[:r.owned_from]]
      adopt = hk["adopt"]
      x.update(adopt_row=_pad([a[0] for a in adopt], e.adopt_cap, "adopt"),
               adopt_col=_pad([a[1] for a in adopt], e.adopt_cap, "adopt"),
               adopt_slot=_pad([a[2] for a in adopt], e.adopt_cap, "adopt"),
               n_adopt=len(adopt), evict_slot=_pad(hk["evict"], e.evict_cap, "evict"),
               n_evict=len(hk["evict"]),
               borrow_row=_pad([r.row for r in hk["borrow"]], e.max_reqs, "borrow"),
               borrow_slot=slots,
               borrow_n=_pad([r.owned_from for r in hk["borrow"]], e.max_reqs, "borrow"),
               n_borrow=len(hk["borrow"]))
    return x

  def _run_step(self, kind: str, x: Dict[str, Any], flush: bool = False) -> np.ndarray:
    flat, layout = pack(x)
    fn = jitted_step(self.cfg, self.ecfg, kind, layout, self.model)
    before = compile_count()
    t0 = time.perf_counter()
    self.carry, out = fn(self.params, self.carry, jax.device_put(flat))
    out = np.asarray(jax.device_get(out))
    seconds = time.perf_counter() - t0
    self.log.append(dict(kind=kind, x=flat, layout=layout, s=seconds, flush=flush,
                         compiles=compile_count() - before))
    if not out[-1]:
      raise RuntimeError(f"the {kind} step's table work was refused (the host's admission "
                         "and the device disagree)")
    return out

  def _flush(self, hk: Dict[str, list]) -> None:
    """A decode step with no rows: only the housekeeping (releases, adoptions,
    evictions) runs."""
    r_ = self.ecfg.max_reqs
    x = self._base(hk)
    x.update(rows=_pad([], r_), n_rows=0, tokens=_pad([], r_), start=_pad([], r_),
             remaining=_pad([], r_), ignore_eos=_pad([], r_))
    self._run_step("decode", x, flush=True)

  def run(self, requests: Sequence[Request]) -> Result:
    """Serves every request; returns their new tokens in input order.

    Admission (paged), in queue order: a request joins while the pages that the running
    requests and it are planned to allocate (`_Seq.planned_pages`: the rest of each
    prefill, then a decode round trip or the estimated share of the remaining new
    tokens) fit the free and evictable pages. The estimate is the mean share of their
    budget that finished requests produced (before any finished: new_token_ratio). Before each step,
    while the pool cannot cover the step, the running request with the least progress
    (fewest new tokens, then most KV) is retracted: its whole pages go to the prefix
    cache, its row and other pages are released, and it waits first in line; readmitted,
    it prefills its prompt and new tokens again (through its cached pages)."""
    self.check(requests)
    e, ps = self.ecfg, self.ecfg.page_size
    self.carry = self._fresh_carry()
    self.log = []
    cache = PrefixCache(ps, e.num_pages) if e.cached else None
    waiting = collections.deque(_Seq(i, r, self.cfg.eos_id) for i, r in enumerate(requests))
    running: List[_Seq] = []
    free_rows = list(range(e.max_reqs))
    free_pages = e.num_pages            # host mirror of the pool's free pages
    fresh = lambda: dict(adopt=[], evict=[], release=[], borrow=[])
    hk = fresh()
    finished: Dict[int, _Seq] = {}
    shares: List[float] = []            # finished requests' new tokens / their budget
    counts = dict(retractions=0, recomputed_tokens=0, flushes=0)
    prefer_decode = False
    t_start = time.perf_counter()

    def adopt(run: _Seq, upto_tokens: int, tokens: Sequence[int]):
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

    def spare() -> int:
      return free_pages + (cache.evictable() if cache is not None else 0)

    def leave(run: _Seq) -> None:
      """run's row and pages go (next step's housekeeping); whole pages to the cache."""
      nonlocal free_pages
      if cache is not None:
        adopt(run, run.done, run.tokens)
        cache.let_go(run.chain)
      hk["release"].append(run.row)
      free_pages += _cdiv(run.done, ps) - run.owned_from
      running.remove(run)

    def waits_for_a_row(seq: _Seq, limit: int, cached: int) -> bool:
      """A running row is prefilling more of seq's leading pages than the cache holds
      (and will cache them): seq waits for them rather than computing them again."""
      return any(r.prefilling and r.adopting and min(
          _shared_pages(seq.fill, r.fill, limit * ps) // ps, limit) > cached
                 for r in running)

    while waiting or running:
      ratio = float(np.mean(shares)) if shares else e.new_token_ratio
      # Admission, in queue order; a request whose prefix a running row is computing is
      # passed over (the next ones may go); one that does not fit stops admission.
      passed: List[_Seq] = []
      while waiting and free_rows:
        seq = waiting.popleft()
        seq.fill = tuple(seq.tokens)
        limit = (len(seq.fill) - 1) // ps
        chain = cache.match(seq.fill, limit) if cache is not None else []
        if cache is not None and waits_for_a_row(seq, limit, len(chain)):
          passed.append(seq)
          continue
        seq.row, seq.done, seq.owned_from = free_rows[0], len(chain) * ps, len(chain)
        seq.chain, seq.adopting = list(chain), True
        if e.paged:
          if cache is not None:
            cache.acquire(chain)
          planned = sum(r.planned_pages(e, ratio) for r in running + [seq])
          if planned > spare():
            if cache is not None:
              cache.let_go(chain)
            waiting.appendleft(seq)
            break
        free_rows.pop(0)
        running.append(seq)
        if seq.computed:
          counts["recomputed_tokens"] += max(0, seq.computed - seq.done)
          seq.computed = 0
        if chain:
          hk["borrow"].append(seq)
          cache.hits += len(chain)
      waiting.extendleft(reversed(passed))

      def plan():
        prefilling = [r for r in running if r.prefilling][:e.prefill_rows]
        decoding = [r for r in running if not r.prefilling]
        kind = "prefill" if prefilling and not (decoding and prefer_decode) else "decode"
        rows = prefilling if kind == "prefill" else decoding
        need = sum(_cdiv(r.done + r.next_tokens(e), ps) - _cdiv(r.done, ps) for r in rows)
        return kind, rows, need

      kind, rows, need = plan()
      # Retraction: the pool cannot cover this step.
      retracted: List[_Seq] = []
      while e.paged and rows and need > spare():
        victim = min(running, key=lambda r: (len(r.gen), -r.done, -r.index))
        leave(victim)
        victim.computed = victim.done
        retracted.append(victim)
        counts["retractions"] += 1
        kind, rows, need = plan()
      waiting.extendleft(sorted(retracted, key=lambda r: r.index, reverse=True))
      if not rows:
        if not (hk["release"] or hk["adopt"] or hk["evict"]):
          raise RuntimeError("nothing can run and nothing is pending: an engine bug")
        # Every running request left in the last step: release their rows, then admit.
        self._flush(hk)
        free_rows += hk["release"]
        hk = fresh()
        counts["flushes"] += 1
        continue
      # Pages this step may allocate; evict cached pages until they are free.
      if need > free_pages and cache is not None:
        slots = cache.evict(need - free_pages)
        hk["evict"] += slots
        free_pages += len(slots)
      if e.paged and need > free_pages:
        raise RuntimeError(f"the pool is short ({free_pages} free pages, {need} needed): "
                           "admission and retraction should have prevented this")
      x = self._base(hk)
      released = list(hk["release"])
      hk = fresh()
      if kind == "prefill":
        chunks = [r.next_tokens(e) for r in rows]
        bp = e.prefill_rows
        toks = np.zeros((bp, e.chunk), np.int32)
        for b, (r, n) in enumerate(zip(rows, chunks)):
          toks[b, :n] = r.fill[r.done:r.done + n]
        x.update(rows=_pad([r.row for r in rows], bp), n=_pad(chunks, bp), n_rows=len(rows),
                 tokens=toks, start=_pad([r.done for r in rows], bp))
        out = self._run_step("prefill", x)
        now = time.perf_counter()
        self.log[-1]["tokens"] = sum(chunks)
        for b, (r, n) in enumerate(zip(rows, chunks)):
          if e.paged:
            free_pages -= _cdiv(r.done + n, ps) - _cdiv(r.done, ps)
          r.done += n
          if not r.prefilling:
            r.gen.append(int(out[b]))
            r.tops.append(float(out[bp + b:bp + b + 1].view(np.float32)[0]))
            if r.first_token_s is None:
              r.first_token_s = now - t_start
          if cache is not None:
            adopt(r, r.done, r.fill)
        prefer_decode = True
      else:
        r_, k_ = e.max_reqs, e.decode_steps
        x.update(rows=_pad([r.row for r in rows], r_), n_rows=len(rows),
                 tokens=_pad([r.gen[-1] for r in rows], r_),
                 start=_pad([r.done for r in rows], r_),
                 remaining=_pad([r.req.max_new_tokens - len(r.gen) for r in rows], r_),
                 ignore_eos=_pad([int(r.req.ignore_eos) for r in rows], r_))
        out = self._run_step("decode", x)
        toks = out[:k_ * r_].reshape(k_, r_)
        tops = out[k_ * r_:2 * k_ * r_].reshape(k_, r_).view(np.float32)
        emitted = 0
        for b, r in enumerate(rows):
          got = [int(t) for t in toks[:, b] if t >= 0]
          emitted += len(got)
          if e.paged:
            free_pages -= _cdiv(r.done + len(got), ps) - _cdiv(r.done, ps)
          r.done += len(got)
          r.gen += got
          r.tops += [float(v) for v in tops[:len(got), b]]
        self.log[-1]["tokens"] = emitted
        self.log[-1]["rows"] = len(rows)
        prefer_decode = False
      # Finished requests: their whole pages go to the cache, their rows are released
      # in the next step (and free after it).
      for r in list(running):
        if r.finished:
          leave(r)
          finished[r.index] = r
          shares.append(len(r.gen) / r.req.max_new_tokens)
      free_rows += released
    # Release the last rows, then empty the cache (at most evict_cap pages a step): the
    # pool must be whole again.
    if self.ecfg.paged:
      while True:
        if cache is not None:
          slots = cache.evict(min(len(cache), e.evict_cap))
          hk["evict"] += slots
          free_pages += len(slots)
          if len(cache) and not slots:
            raise RuntimeError("cached pages are still held after the run")
        self._flush(hk)
        self.log.pop()
        hk = fresh()
        if cache is None or not len(cache):
          break
      avail = int(kv.available_size(e.alloc_config(), self.carry.state)) // ps
      if avail != e.num_pages or free_pages != e.num_pages:
        raise RuntimeError(f"pages leaked: {e.num_pages - avail} held on the device, host "
                           f"mirror {e.num_pages - free_pages}")
    wall = time.perf_counter() - t_start
    order = [finished[i] for i in range(len(requests))]
    stats = self._stats(order, wall, cache)
    stats.update(counts)
    return Result(new_ids=[r.gen for r in order], tops=[r.tops for r in order], stats=stats)

  def _stats(self, runs: List[_Seq], wall: float, cache) -> Dict[str, Any]:
    """The run's figures; None where one does not exist (e.g. a rate with no warm step)."""
    late = {}
    seen = set()
    for entry in self.log:
      if entry["kind"] in seen:
        late[entry["kind"]] = late.get(entry["kind"], 0) + entry["compiles"]
      seen.add(entry["kind"])
    steps = [x for x in self.log if not x["flush"]]
    by = {k: [x for x in steps if x["kind"] == k] for k in ("prefill", "decode")}
    warm = {k: v[1:] for k, v in by.items()}
    secs = lambda v: sum(x["s"] for x in v)
    toks = lambda v: sum(x.get("tokens", 0) for x in v)
    rate = lambda v: toks(v) / secs(v) if v and secs(v) > 0 else None
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
