"""`jax-kvalloc demo`: a toy decoder served end to end with its KV cache in a paged pool
that only the request table (jax_kvalloc.request_table) addresses.

The model is a few pre-norm transformer layers with random weights in plain jnp (learned
positions, multi-head attention, a ReLU MLP), decoded greedily. Two ways to run it:

  paged       one jitted step per scheduler iteration, SGLang-style: a prefill batch
              (chunks of several requests' prompts, packed) or a decode batch. Inside the
              step: release the rows that finished, borrow the shared prefix's pages for
              new rows, admit the longest prefix of the batch that fits, extend/decode the
              admitted rows, build the ragged attention inputs from the table, write K/V
              to the slots and attend through the rows' page lists. Requests finish and
              new ones join as rows free up; a shared prefix is prefilled once (by a row
              that stands for a prefix cache) and borrowed as whole pages.
  contiguous  the same model per request with its own contiguous KV cache: the whole
              prompt (shared prefix included, recomputed) at once, then one token at a
              time. This is the reference.

The generated tokens must be identical. How the paged run attends (--attention):

  toy      every token gathers its keys (max_pages_per_req * page_size of them, in token
           order) and attends in jnp, the same function as the contiguous run: only the
           addressing differs.
  rpa-ref  K/V in JAX's ragged paged attention layout [P, ps, 2H, Dh], written with
           jax_kvalloc.attention.write_kv_combined; every step attends through JAX's
           jnp ref_ragged_paged_attention fed attention.dense_inputs. It slices by the
           lengths in Python, so the model part is traced once per step (a check, not
           a speed).
  pallas   GPU (and CPU, in the interpreter): K/V split [H, P, ps, Dh] written with
           attention.write_kv_split; decode steps attend through Pallas' GPU
           paged_attention, prefill steps gather from the same pages. TPU: the combined
           layout and ragged_paged_attention for every step (head dim 128).

Also printed: tokens/s of the paged run, the allocator's share of its steps (the same
steps replayed with only the request-table and allocator work) and the compiles after
the first step of each kind (the paged step compiles once per kind; rpa-ref once a step).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import jax
# Importing Pallas defines jax config options, and (on jax 0.12, not 0.10.2) they are part of
# each jit cache key: imported lazily inside the first step's trace (where the allocator's
# kernels pull them in), they change that key and the second step compiles again. Import
# them before any step.
import jax.experimental.pallas  # pylint: disable=unused-import
import jax.experimental.pallas.tpu  # pylint: disable=unused-import
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import attention as attn
from jax_kvalloc import index_jnp
from jax_kvalloc import request_table as rt
from jax_kvalloc import state as st
from jax_kvalloc.config import AllocatorConfig

PREFIX_ROW = 0  # the row that holds the shared prefix (a stand-in for a prefix cache)
ATTENTION = ("toy", "rpa-ref", "pallas")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Sizes of the toy model, the pool and the workload (all static)."""
  num_requests: int = 16
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  vocab: int = 128
  page_size: int = 4
  max_reqs: int = 7           # table rows; row 0 holds the shared prefix
  max_pages_per_req: int = 24
  pool_pages: int = 96
  max_tokens: int = 48        # packed tokens per prefill step (static)
  chunk: int = 16             # prefill chunk per request per step
  prefix_len: int = 12        # shared prefix tokens (a multiple of page_size)
  share_prob: float = 0.5
  prompt_len: tuple = (2, 40)  # suffix tokens after the (optional) shared prefix
  new_tokens: tuple = (3, 12)  # generated tokens per request
  seed: int = 0
  attention: str = "toy"      # "toy" (jnp gather), "rpa-ref" or "pallas" (real kernels)

  def __post_init__(self):
    if self.attention not in ATTENTION:
      raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION}")
    if (self.attention == "pallas" and jax.default_backend() == "tpu"
        and (self.d_model // self.num_heads) % 128):
      raise ValueError(f"--attention pallas on a TPU runs ragged_paged_attention, whose "
                       f"head dim must be a multiple of 128: d_model={self.d_model} with "
                       f"{self.num_heads} heads gives {self.d_model // self.num_heads} "
                       f"(try --d-model {128 * self.num_heads})")
    if self.prefix_len % self.page_size:
      raise ValueError(f"prefix_len={self.prefix_len} must be a multiple of page_size="
                       f"{self.page_size} (a borrowed prefix is whole pages)")
    longest = self.prefix_len + self.prompt_len[1] + self.new_tokens[1]
    if longest > self.max_pages_per_req * self.page_size:
      raise ValueError(f"requests of up to {longest} tokens do not fit max_pages_per_req="
                       f"{self.max_pages_per_req} pages of {self.page_size}")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads")
    if self.max_reqs < 2:
      raise ValueError("max_reqs must be >= 2 (row 0 holds the shared prefix)")
    if not 1 <= self.chunk <= self.max_tokens:
      raise ValueError(f"chunk={self.chunk} must be in 1..max_tokens={self.max_tokens}")

  @property
  def max_len(self) -> int:
    return self.max_pages_per_req * self.page_size


# ---------------------------------------------------------------------------------------
# The toy model: parameters and one forward pass over packed tokens.
# ---------------------------------------------------------------------------------------

def init_params(cfg: DemoConfig, key: jax.Array) -> Dict[str, Any]:
  """Random weights, scaled so that activations stay O(1)."""
  d, v = cfg.d_model, cfg.vocab
  keys = iter(jax.random.split(key, 4 + 6 * cfg.num_layers))
  dense = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])
  layers = [dict(wq=dense((d, d)), wk=dense((d, d)), wv=dense((d, d)), wo=dense((d, d)),
                 w1=dense((d, 4 * d)), w2=dense((4 * d, d))) for _ in range(cfg.num_layers)]
  return dict(embed=jax.random.normal(next(keys), (v, d), jnp.float32),
              pos=jax.random.normal(next(keys), (cfg.max_len, d), jnp.float32) * 0.5,
              unembed=dense((d, v)) * 4.0, layers=layers)


# Full f32 matmuls on every backend (no TF32 on GPU), so that the two runs can only differ
# in how the cache is addressed, not in which matmul algorithm a shape happens to get.
HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
  return jnp.matmul(a, b, precision=HIGHEST)


def _rms(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def attend(q, keys, values, pos, kv_len):
  """Causal attention of T query tokens over their own key rows.

  q: f32[T, H, Dh]; keys, values: f32[T, L, H, Dh], key j of token t is the token at
  position j of t's request; pos: i32[T] each token's position; kv_len: i32[T] tokens in
  its request's cache. Keys j <= pos and j < kv_len count; the rest are masked out.
  """
  s = jnp.einsum("thd,tjhd->thj", q, keys, precision=HIGHEST) / np.sqrt(q.shape[-1])
  j = jnp.arange(keys.shape[1])
  mask = (j[None, :] <= pos[:, None]) & (j[None, :] < kv_len[:, None])
  s = jnp.where(mask[:, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(mask[:, None, :], p, 0.0)  # masked keys may hold anything: exact zeros
  return jnp.einsum("thj,tjhd->thd", p, values, precision=HIGHEST)


def forward(cfg: DemoConfig, params, kv, tokens, pos, write, read, kv_len):
  """Logits of T packed tokens, writing their K/V into `kv` first.

  kv: (f32[layers, S, H, Dh], same) the cache, S slots; tokens, pos: i32[T];
  write: i32[T] slot of each token's K/V (padding tokens write a dummy slot);
  read: i32[T, L] the slots of keys 0..L-1 of each token's request; kv_len: i32[T].
  Returns (kv, f32[T, vocab]).
  """
  h_, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
  k_cache, v_cache = kv
  x = params["embed"][tokens] + params["pos"][jnp.clip(pos, 0, cfg.max_len - 1)]
  for i, w in enumerate(params["layers"]):
    h = _rms(x)
    q = _mm(h, w["wq"]).reshape(-1, h_, dh)
    k_cache = k_cache.at[i, write].set(_mm(h, w["wk"]).reshape(-1, h_, dh), mode="drop")
    v_cache = v_cache.at[i, write].set(_mm(h, w["wv"]).reshape(-1, h_, dh), mode="drop")
    o = attend(q, k_cache[i][read], v_cache[i][read], pos, kv_len)
    x = x + _mm(o.reshape(-1, cfg.d_model), w["wo"])
    x = x + _mm(jax.nn.relu(_mm(_rms(x), w["w1"])), w["w2"])
  return (k_cache, v_cache), _mm(_rms(x), params["unembed"])


def _decode_blocks(cfg: DemoConfig) -> Tuple[int, int, int]:
  """(table width, pages per compute block, k_splits) for Pallas' GPU paged_attention:
  Triton wants power-of-two blocks and a dot of at least 16 keys, so the width is the
  next power of two of max_pages_per_req and a block holds >= 16 tokens where it can."""
  width = 1 << (cfg.max_pages_per_req - 1).bit_length()
  block = min(width, 1 << (max(1, -(-16 // cfg.page_size)) - 1).bit_length())
  return width, block, width // block


def _kernel_decode(cfg: DemoConfig, q, k_pages, v_pages, att):
  """Decode attention through jax.experimental.pallas.ops.gpu.paged_attention (Triton on
  a GPU, its interpreter elsewhere): q f32[B, H, Dh] one token per entry, pages
  f32[H, P, ps, Dh]. Entries of length 0 come out as NaN; nothing reads them."""
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa  # pylint: disable=g-import-not-at-top
  width, block, splits = _decode_blocks(cfg)
  tables = jnp.pad(att.page_indices, ((0, 0), (0, width - att.page_indices.shape[1])))
  # 1/sqrt(Dh) folded into q (exact when Dh is a power of 4, as in the defaults).
  return gpu_pa.paged_attention(q / np.sqrt(q.shape[-1]), k_pages, v_pages, tables,
                                att.kv_lens, pages_per_compute_block=block,
                                k_splits=splits, interpret=jax.default_backend() != "gpu")


def forward_pages(cfg: DemoConfig, params, kv, tokens, pos, slots, num_tokens, att, b,
                  kv_len, *, decode: bool):
  """Logits of T packed tokens over a paged cache in the Pallas decode kernels' layout.

  kv: (f32[layers, H, P, ps, Dh], same); the step's K/V go in with
  attention.write_kv_split at `slots` (i32[T], the first num_tokens real). Decode steps
  attend through the Pallas kernel (one query per batch entry, b = arange); prefill
  steps gather each token's keys from the same pages in jnp.
  """
  h_, dh, ps = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.page_size
  k_all, v_all = kv
  x = params["embed"][tokens] + params["pos"][jnp.clip(pos, 0, cfg.max_len - 1)]
  j = jnp.arange(cfg.max_len, dtype=jnp.int32)
  key_pages = att.page_indices[:, j // ps][b]                   # i32[T, L]
  for i, w in enumerate(params["layers"]):
    h = _rms(x)
    q = _mm(h, w["wq"]).reshape(-1, h_, dh)
    kp, vp = attn.write_kv_split(k_all[i], v_all[i], slots,
                                 _mm(h, w["wk"]).reshape(-1, h_, dh),
                                 _mm(h, w["wv"]).reshape(-1, h_, dh), num_tokens=num_tokens)
    k_all, v_all = k_all.at[i].set(kp), v_all.at[i].set(vp)
    if decode and cfg.attention == "pallas":
      o = _kernel_decode(cfg, q, kp, vp, att)
    else:
      keys = jnp.moveaxis(kp[:, key_pages, j % ps], 0, 2)       # f32[T, L, H, Dh]
      values = jnp.moveaxis(vp[:, key_pages, j % ps], 0, 2)
      o = attend(q, keys, values, pos, kv_len)
    x = x + _mm(o.reshape(-1, cfg.d_model), w["wo"])
    x = x + _mm(jax.nn.relu(_mm(_rms(x), w["w1"])), w["w2"])
  return (k_all, v_all), _mm(_rms(x), params["unembed"])


def combined_layout(cfg: DemoConfig) -> bool:
  """Whether the run keeps K/V in JAX's ragged paged attention layout [P, ps, 2H, Dh]
  (rpa-ref everywhere, pallas on TPU) rather than split [H, P, ps, Dh] pages."""
  return cfg.attention == "rpa-ref" or (cfg.attention == "pallas"
                                        and jax.default_backend() == "tpu")


def _rpa_reference(host_att, q, pages, att, sm_scale):
  """JAX's jnp ref_ragged_paged_attention. It loops over num_seqs in Python and slices by
  the lengths, so it reads them from `host_att` (numpy copies of att): traced with them
  as constants, one program per step."""
  del att
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention  # pylint: disable=g-import-not-at-top
  kv_lens, page_indices, cu_q_lens, num_seqs = host_att
  if num_seqs[0] == 0:      # a step that only releases rows: nothing to attend
    return jnp.zeros_like(q)
  out = ref_ragged_paged_attention(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                   sm_scale=sm_scale)
  return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))


def _rpa_kernel(q, pages, att, sm_scale):
  """jax.experimental.pallas.ops.tpu.ragged_paged_attention (TPU; jittable)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention  # pylint: disable=g-import-not-at-top
  return ragged_paged_attention(
      q, pages, att.kv_lens, att.page_indices, att.cu_q_lens, att.num_seqs,
      sm_scale=sm_scale, num_kv_pages_per_block=min(8, att.page_indices.shape[1]),
      num_queries_per_block=min(16, q.shape[0]))


def forward_combined(cfg: DemoConfig, params, kv, tokens, pos, slots, att, attend_fn):
  """Logits of T packed tokens over pages in JAX's ragged paged attention layout.

  kv: f32[layers, P, ps, 2H, Dh]; the step's K/V go in with attention.write_kv_combined
  at `slots` (the first cu_q_lens[-1] real), then every token attends through attend_fn
  (the ragged kernel or its jnp reference) with the dense attention inputs `att`.
  """
  h_, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
  x = params["embed"][tokens] + params["pos"][jnp.clip(pos, 0, cfg.max_len - 1)]
  for i, w in enumerate(params["layers"]):
    h = _rms(x)
    q = _mm(h, w["wq"]).reshape(-1, h_, dh)
    pages = attn.write_kv_combined(kv[i], slots, _mm(h, w["wk"]).reshape(-1, h_, dh),
                                   _mm(h, w["wv"]).reshape(-1, h_, dh),
                                   num_tokens=att.cu_q_lens[-1])
    kv = kv.at[i].set(pages)
    o = attend_fn(q, pages, att, 1.0 / np.sqrt(dh))
    x = x + _mm(o.reshape(-1, cfg.d_model), w["wo"])
    x = x + _mm(jax.nn.relu(_mm(_rms(x), w["w1"])), w["w2"])
  return kv, _mm(_rms(x), params["unembed"])


# ---------------------------------------------------------------------------------------
# The paged way: one jitted step, everything addressed through the request table.
# ---------------------------------------------------------------------------------------

def alloc_config(cfg: DemoConfig) -> AllocatorConfig:
  return AllocatorConfig(size=cfg.pool_pages * cfg.page_size, page_size=cfg.page_size)


def _table_work(acfg: AllocatorConfig, cfg: DemoConfig, state, table, x, *, decode: bool):
  """The step's allocator part: release, borrow, admit, extend or decode, attention inputs.

  Returns (state, table, slots i32[T], AttentionInputs, k admitted, ok)."""
  state, table, _ = rt.release_rows(acfg, state, table, x["release"],
                                    num_rows=x["num_release"])
  if not decode:
    w = cfg.prefix_len // cfg.page_size
    src = jnp.broadcast_to(table.pages[PREFIX_ROW, :max(w, 1)], (x["borrow"].shape[0],
                                                                   max(w, 1)))
    table, _ = rt.borrow_pages(acfg, table, x["borrow"], src,
                               jnp.full(x["borrow"].shape, w, jnp.int32),
                               num_rows=x["num_borrow"])
  n = jnp.ones_like(x["rows"]) if decode else x["n"]
  k = rt.admit_rows(acfg, state, table, x["rows"], n, num_rows=x["num_rows"],
                    max_tokens=None if decode else cfg.max_tokens)
  if decode:
    state, table, slots, ok = rt.decode_rows(acfg, state, table, x["rows"], num_rows=k)
  else:
    state, table, slots, ok = rt.extend_rows(acfg, state, table, x["rows"], n,
                                             max_tokens=cfg.max_tokens, num_rows=k)
  att = rt.attention_inputs(acfg, table, x["rows"], n, num_rows=k)
  return state, table, slots, att, k, ok


def serve_step(cfg: DemoConfig, params, carry, x, *, decode: bool, model: bool = True):
  """One scheduler iteration (pure). carry = (alloc state, table, kv); x = the batch.

  Returns (carry, (next token per batch entry i32[B], k admitted i32[], ok bool[])).
  model=False runs only the allocator part (kv untouched, tokens 0): the replay that
  measures the allocator's share.
  """
  acfg = alloc_config(cfg)
  state, table, kv = carry
  state, table, slots, att, k, ok = _table_work(acfg, cfg, state, table, x, decode=decode)
  if not model:
    return (state, table, kv), (jnp.zeros((x["rows"].shape[0],), jnp.int32), k, ok)
  kv, nxt = _model_part(cfg, params, kv, x, slots, att, decode=decode)
  return (state, table, kv), (nxt, k, ok)


def _model_part(cfg: DemoConfig, params, kv, x, slots, att, *, decode: bool,
                attend_fn=None):
  num_entries = x["rows"].shape[0]
  ps, tokens = cfg.page_size, x["tokens"]
  t = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  cu = att.cu_q_lens
  b = jnp.clip(index_jnp.searchsorted_right(cu[1:], t).astype(jnp.int32), 0,
               num_entries - 1)
  real = t < cu[-1]
  q_len = cu[b + 1] - cu[b]
  pos = jnp.where(real, att.kv_lens[b] - q_len + (t - cu[b]), 0)
  # Key j of entry b sits at slot page_indices[b, j // ps] * ps + j % ps.
  j = jnp.arange(cfg.max_len, dtype=jnp.int32)
  read = att.page_indices[:, j // ps] * ps + j % ps              # i32[B, L]
  write = jnp.where(real, slots, 0)                              # padding: dummy slot 0
  kv_len = jnp.where(real, att.kv_lens[b], 0)
  if cfg.attention == "toy":
    kv, logits = forward(cfg, params, kv, tokens, pos, write, read[b], kv_len)
  elif combined_layout(cfg):
    kv, logits = forward_combined(cfg, params, kv, tokens, pos, slots, att,
                                  attend_fn or _rpa_kernel)
  else:
    kv, logits = forward_pages(cfg, params, kv, tokens, pos, slots, cu[-1], att, b, kv_len,
                               decode=decode)
  last = jnp.clip(cu[1:] - 1, 0, tokens.shape[0] - 1)            # each entry's last token
  nxt = jnp.argmax(logits[last], axis=-1).astype(jnp.int32)
  return kv, nxt


def _table_step(cfg: DemoConfig, carry, x, *, decode: bool):
  state, table, kv = carry
  state, table, slots, att, k, ok = _table_work(alloc_config(cfg), cfg, state, table, x,
                                                decode=decode)
  return (state, table, kv), slots, att, k, ok


class _EagerReferenceStep:
  """rpa-ref: the allocator part jitted once; the model part jitted per step around JAX's
  jnp reference, whose Python loop slices by the step's lengths (read back to the host):
  one compile per step, so this mode is for checking, not for timing."""

  def __init__(self, cfg: DemoConfig, decode: bool):
    self.cfg, self.decode = cfg, decode
    self.table_step = jax.jit(functools.partial(_table_step, cfg, decode=decode),
                              donate_argnums=0)

  def __call__(self, params, carry, x):
    (state, table, kv), slots, att, k, ok = self.table_step(carry, x)
    host_att = jax.device_get((att.kv_lens, att.page_indices, att.cu_q_lens, att.num_seqs))
    model = jax.jit(functools.partial(
        _model_part, self.cfg, decode=self.decode,
        attend_fn=functools.partial(_rpa_reference, host_att)), donate_argnums=1)
    kv, nxt = model(params, kv, x, slots, att)
    return (state, table, kv), (nxt, k, ok)


def pack_batch(x: Dict[str, Any]) -> Tuple[np.ndarray, tuple]:
  """The batch's int32 arrays in one flat array (one host-to-device transfer a step) and
  the static layout that `unpack_batch` reads them back with."""
  layout = tuple((k, tuple(np.shape(v))) for k, v in x.items())
  return np.concatenate([np.ravel(np.asarray(v, np.int32)) for v in x.values()]), layout


def unpack_batch(flat, layout: tuple) -> Dict[str, Any]:
  out, at = {}, 0
  for key, shape in layout:
    size = int(np.prod(shape, dtype=np.int64))
    out[key] = flat[at:at + size].reshape(shape)
    at += size
  return out


def _pack_out(nxt, k, ok):
  """Next tokens, k and ok in one i32 array: one device-to-host read-back a step."""
  return jnp.concatenate([nxt, k.reshape(1), ok.reshape(1).astype(jnp.int32)])


def _packed_step(cfg: DemoConfig, decode: bool, model: bool, layout: tuple, params, carry,
                 flat):
  carry, out = serve_step(cfg, params, carry, unpack_batch(flat, layout), decode=decode,
                          model=model)
  return carry, _pack_out(*out)


@functools.lru_cache(maxsize=None)
def _jitted_step(cfg: DemoConfig, decode: bool, model: bool, layout: tuple):
  """step(params, carry, flat batch) -> (carry, i32[B + 2] next tokens, k, ok). One
  compile per config and kind, shared by every run (the carry is donated)."""
  if model and cfg.attention == "rpa-ref":
    inner = _EagerReferenceStep(cfg, decode)

    def call(params, carry, flat):
      carry, out = inner(params, carry, unpack_batch(flat, layout))
      return carry, _pack_out(*out)
    return call
  return jax.jit(functools.partial(_packed_step, cfg, decode, model, layout),
                 donate_argnums=1)


# ---------------------------------------------------------------------------------------
# The contiguous reference.
# ---------------------------------------------------------------------------------------

def _contiguous_call(cfg: DemoConfig, params, kv, tokens, start, count):
  """Tokens start .. start + count - 1 of one request (tokens padded to a static length)
  into its own cache kv (f32[layers, max_len, H, Dh] x 2). Returns (kv, next token)."""
  t = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  pos = start + t
  real = t < count
  write = jnp.where(real, pos, cfg.max_len)                      # out of range: dropped
  read = jnp.broadcast_to(jnp.arange(cfg.max_len, dtype=jnp.int32),
                          (tokens.shape[0], cfg.max_len))
  kv, logits = forward(cfg, params, kv, tokens, pos, write, read,
                       jnp.full(tokens.shape, start + count, jnp.int32))
  return kv, jnp.argmax(logits[count - 1]).astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def _jitted_contiguous(cfg: DemoConfig):
  return jax.jit(functools.partial(_contiguous_call, cfg))


def run_contiguous(cfg: DemoConfig, params, requests) -> List[List[int]]:
  """Greedy generation per request with a contiguous cache: the whole prompt, then one
  token at a time."""
  h_, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
  longest = max(len(r["prompt"]) for r in requests)
  call = _jitted_contiguous(cfg)
  out = []
  for req in requests:
    kv = tuple(jnp.zeros((cfg.num_layers, cfg.max_len, h_, dh), jnp.float32)
               for _ in range(2))
    prompt = np.zeros(longest, np.int32)
    prompt[:len(req["prompt"])] = req["prompt"]
    kv, tok = call(params, kv, prompt, np.int32(0), np.int32(len(req["prompt"])))
    gen = [int(tok)]
    while len(gen) < req["new_tokens"]:
      kv, tok = call(params, kv, np.array([gen[-1]], np.int32),
                     np.int32(len(req["prompt"]) + len(gen) - 1), np.int32(1))
      gen.append(int(tok))
    out.append(gen)
  return out


# ---------------------------------------------------------------------------------------
# The host scheduler of the paged run.
# ---------------------------------------------------------------------------------------

def make_requests(cfg: DemoConfig) -> Tuple[List[Dict[str, Any]], List[int]]:
  """Ragged prompts; about share_prob of them start with the shared prefix."""
  rng = np.random.default_rng(cfg.seed)
  prefix = rng.integers(0, cfg.vocab, cfg.prefix_len).tolist()
  reqs = []
  for i in range(cfg.num_requests):
    shared = cfg.prefix_len > 0 and bool(rng.random() < cfg.share_prob)
    own = rng.integers(0, cfg.vocab, int(rng.integers(*cfg.prompt_len, endpoint=True)))
    reqs.append(dict(id=i, shared=shared, prompt=(prefix if shared else []) + own.tolist(),
                     new_tokens=int(rng.integers(*cfg.new_tokens, endpoint=True))))
  return reqs, prefix


_COMPILES = [0]          # backend compiles seen since the listener was installed
_LISTENING = [False]


def compile_count() -> int:
  """Backend compiles so far in this process (XLA programs built, Pallas kernels too)."""
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
  req: Dict[str, Any]
  row: int
  done: int = 0                     # tokens in the KV cache (host mirror of table.lens)
  gen: List[int] = dataclasses.field(default_factory=list)

  @property
  def prefilling(self) -> bool:
    return self.done < len(self.req["prompt"])


class PagedServer:
  """Drives serve_step from the host: picks each step's batch, reads back the admitted
  count and the next tokens. Rows, lengths and pages live only in the device table."""

  def __init__(self, cfg: DemoConfig, params):
    self.cfg, self.params = cfg, params
    acfg = alloc_config(cfg)
    h_, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
    pages = acfg.num_slots // cfg.page_size
    if cfg.attention == "toy":
      shape = (cfg.num_layers, acfg.num_slots, h_, dh)
    elif combined_layout(cfg):  # JAX's ragged paged attention: K, V interleaved on heads
      shape = (cfg.num_layers, pages, cfg.page_size, 2 * h_, dh)
    else:  # the Pallas decode kernels' split layout, pages of the whole pool
      shape = (cfg.num_layers, h_, acfg.num_slots // cfg.page_size, cfg.page_size, dh)
    kv = jnp.zeros(shape, jnp.float32)
    if not combined_layout(cfg):
      kv = (kv, jnp.zeros(shape, jnp.float32))
    self.carry = (st.init(acfg), rt.init_table(acfg, cfg.max_reqs, cfg.max_pages_per_req),
                  kv)
    self.initial = jax.tree.map(jnp.copy, self.carry[:2])
    self.log: List[Dict[str, Any]] = []    # per step: decode flag, inputs, seconds
    self.to_release: List[int] = []
    self.deferred = 0                      # batch entries that admission held back

  def _step(self, decode: bool, layout: tuple, model: bool = True):
    return _jitted_step(self.cfg, decode, model, layout)

  def _batch(self, decode: bool, entries, borrow: Sequence[int]):
    cfg, b = self.cfg, self.cfg.max_reqs
    pad = lambda v, size: np.array(list(v) + [0] * (size - len(v)), np.int32)
    x = dict(release=pad(self.to_release, b), num_release=np.int32(len(self.to_release)),
             rows=pad([r.row for r, _ in entries], b), num_rows=np.int32(len(entries)))
    if decode:
      x["tokens"] = pad([r.gen[-1] for r, _ in entries], b)
    else:
      x["n"] = pad([n for _, n in entries], b)
      x["borrow"], x["num_borrow"] = pad(borrow, b), np.int32(len(borrow))
      toks = [t for r, n in entries for t in r.req["prompt"][r.done:r.done + n]]
      # Entries past the budget cannot be admitted: their tokens need no room.
      x["tokens"] = pad(toks[:cfg.max_tokens], cfg.max_tokens)
    return x

  def run_step(self, decode: bool, entries, borrow=()):
    """Runs one step; returns how many entries were admitted (they advance)."""
    x = self._batch(decode, entries, borrow)
    self.to_release = []
    compiles = compile_count()
    t0 = time.perf_counter()
    # One transfer of the whole batch, one step, one read-back (the scheduler needs k
    # and the next tokens before it can pick the next batch).
    flat, layout = pack_batch(x)
    self.carry, out = self._step(decode, layout)(self.params, self.carry,
                                                 jax.device_put(flat))
    out = np.asarray(jax.device_get(out))
    nxt, k, ok = out[:-2], int(out[-2]), bool(out[-1])
    admitted = entries[:k]
    self.deferred += len(entries) - k
    self.log.append(dict(decode=decode, x=flat, layout=layout, s=time.perf_counter() - t0,
                         tokens=sum(n for _, n in admitted),
                         compiles=compile_count() - compiles))
    if not ok:
      raise RuntimeError("the admitted batch was refused (admission and extend disagree)")
    for i, (r, n) in enumerate(admitted):
      r.done += n
      if r.row != PREFIX_ROW and not r.prefilling:   # a decode, or the prompt's last chunk
        r.gen.append(int(nxt[i]))
    return k


def run_paged(cfg: DemoConfig, params, requests, prefix) -> Dict[str, Any]:
  """Serves every request through the request table. Returns the generated tokens per
  request, step counts and timings."""
  srv = PagedServer(cfg, params)
  waiting = list(requests)
  free_rows = list(range(1, cfg.max_reqs))
  running: List[_Running] = []
  # The prefix holder (row 0) is prefilled first, in chunks like any prompt.
  holder = _Running(dict(id=-1, shared=False, prompt=list(prefix), new_tokens=0),
                     PREFIX_ROW)
  while holder.prefilling:
    srv.run_step(False, [(holder, min(cfg.chunk, len(prefix) - holder.done))])
  outputs: Dict[int, List[int]] = {}
  prefer_decode, stalled = False, 0
  while waiting or running:
    while waiting and free_rows:       # new requests take free rows
      running.append(_Running(waiting.pop(0), free_rows.pop(0)))
    decoding = [(r, 1) for r in running if not r.prefilling]
    if any(r.prefilling for r in running) and not (decoding and prefer_decode):
      # A prefill step. New rows that share the prefix borrow its pages first (inside
      # the step, before admission).
      borrow = [r.row for r in running if r.done == 0 and r.req["shared"]]
      for r in running:
        if r.done == 0 and r.req["shared"]:
          r.done = cfg.prefix_len
      # Every prefilling row offers its next chunk; admission inside the step takes the
      # longest prefix of them that fits the pool and the max_tokens budget.
      prefill = [(r, min(cfg.chunk, len(r.req["prompt"]) - r.done))
                 for r in running if r.prefilling]
      k = srv.run_step(False, prefill, borrow)
      prefer_decode = True
    else:
      k = srv.run_step(True, decoding)
      prefer_decode = False
    stalled = stalled + 1 if k == 0 else 0
    if stalled > 2:  # neither a prefill nor a decode step could admit anything
      raise RuntimeError("the running requests no longer fit the pool: raise --pool-pages")
    for r in list(running):
      if len(r.gen) >= r.req["new_tokens"]:
        outputs[r.req["id"]] = r.gen
        running.remove(r)
        srv.to_release.append(r.row)
        free_rows.append(r.row)
  # Last, release what is left and the prefix holder: the whole pool must be free again.
  srv.to_release.append(PREFIX_ROW)
  srv.run_step(True, [])
  state = srv.carry[0]
  leaked = cfg.pool_pages - int(state.free_len) - int(state.release_len)
  if leaked:
    raise RuntimeError(f"{leaked} pages still held after every request was released")
  return dict(outputs=[outputs[r["id"]] for r in requests], server=srv)


def allocator_share(srv: PagedServer) -> Dict[str, float]:
  """Replays the logged steps with only the allocator part (the same inputs give the same
  table and pool states) and compares their time with the full steps'. The first step of
  each kind (compilation) is left out of both sums."""
  carry = srv.initial + (srv.carry[2],)
  seen, full_s, alloc_s, full_n, tokens = set(), 0.0, 0.0, 0, 0
  per = {True: [], False: []}   # warm full-step times by kind (decode or not)
  allocs = []
  for entry in srv.log:
    fn = srv._step(entry["decode"], entry["layout"],  # pylint: disable=protected-access
                   model=False)
    if entry["decode"] not in seen:
      seen.add(entry["decode"])
      jax.block_until_ready(fn(srv.params, jax.tree.map(jnp.copy, carry), entry["x"]))
      carry, _ = fn(srv.params, carry, entry["x"])
      continue
    t0 = time.perf_counter()
    carry, out = fn(srv.params, carry, entry["x"])
    jax.block_until_ready(out)
    allocs.append(time.perf_counter() - t0)
    alloc_s += allocs[-1]
    per[entry["decode"]].append(entry["s"])
    full_s += entry["s"]
    full_n += 1
    tokens += entry["tokens"]
  med = lambda v: float(np.median(v)) if v else float("nan")
  return dict(step_s=full_s / max(full_n, 1), alloc_s=alloc_s / max(full_n, 1),
              step_median_s=med(per[True] + per[False]), alloc_median_s=med(allocs),
              decode_median_s=med(per[True]), prefill_median_s=med(per[False]),
              share=alloc_s / full_s if full_s > 0 else float("nan"), steps=full_n,
              tokens_per_s=tokens / full_s if full_s > 0 else float("nan"))


def run(cfg: DemoConfig, repeat: int = 1) -> Dict[str, Any]:
  """Both runs; returns their outputs, whether they are identical and the timings.

  repeat > 1 serves the requests that many times (every run's tokens are checked); the
  timings are the last run's, whose steps are all warm."""
  params = init_params(cfg, jax.random.PRNGKey(cfg.seed))
  requests, prefix = make_requests(cfg)
  runs, late = [], 0
  for i in range(max(1, repeat)):
    t0 = time.perf_counter()
    runs.append(run_paged(cfg, params, requests, prefix))
    paged_s = time.perf_counter() - t0
    seen = set() if i == 0 else {True, False}
    for e in runs[-1]["server"].log:
      if e["decode"] in seen:
        late += e["compiles"]
      seen.add(e["decode"])
  paged = runs[-1]
  reference = run_contiguous(cfg, params, requests)
  srv = paged["server"]
  share = allocator_share(srv)
  processed = sum(e["tokens"] for e in srv.log)
  return dict(late_compiles=late, attention=cfg.attention, requests=requests,
              paged=paged["outputs"], reference=reference,
              identical=all(r["outputs"] == reference for r in runs), steps=len(srv.log),
              decode_steps=sum(e["decode"] for e in srv.log), wall_s=paged_s,
              generated=sum(len(g) for g in paged["outputs"]), processed=processed,
              deferred=srv.deferred, share=share, device=str(jax.devices()[0]))


def _range(text: str) -> tuple:
  from jax_kvalloc.tools.cli import int_list  # pylint: disable=g-import-not-at-top
  values = int_list(text)
  if len(values) != 2 or values[0] > values[1]:
    raise argparse.ArgumentTypeError(f"expected LO,HI with LO <= HI, got {text!r}")
  return tuple(values)


def add_parser(sub) -> argparse.ArgumentParser:
  d = DemoConfig()
  p = sub.add_parser(
      "demo", help="a toy decoder served through the request table (paged == contiguous)",
      description=__doc__.split("\n\n")[0].replace("`jax-kvalloc demo`: ", "") + ".",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  a = p.add_argument
  a("--num-requests", type=int, default=d.num_requests)
  a("--num-layers", type=int, default=d.num_layers)
  a("--d-model", type=int, default=d.d_model)
  a("--page-size", type=int, default=d.page_size)
  a("--max-reqs", type=int, default=d.max_reqs, help="table rows (row 0: shared prefix)")
  a("--max-pages-per-req", type=int, default=d.max_pages_per_req)
  a("--pool-pages", type=int, default=d.pool_pages)
  a("--max-tokens", type=int, default=d.max_tokens, help="packed tokens per prefill step")
  a("--chunk", type=int, default=d.chunk, help="prefill chunk per request")
  a("--prefix-len", type=int, default=d.prefix_len, help="shared prefix tokens")
  a("--prompt-len", type=_range, default=d.prompt_len, metavar="LO,HI",
    help="prompt tokens after the shared prefix")
  a("--new-tokens", type=_range, default=d.new_tokens, metavar="LO,HI",
    help="generated tokens per request")
  a("--seed", type=int, default=d.seed)
  a("--repeat", type=int, default=1,
    help="serve the requests this many times; timings from the last (all steps warm)")
  a("--attention", choices=ATTENTION, default=d.attention,
    help="toy: a jnp gather of each token's keys; rpa-ref: every step through JAX's "
         "ref_ragged_paged_attention (eager) over pages written with "
         "attention.write_kv_combined; pallas: on a GPU (or off one, in the interpreter) "
         "decode steps through jax.experimental.pallas.ops.gpu.paged_attention over "
         "pages written with attention.write_kv_split, on a TPU every step through "
         "ragged_paged_attention")
  return p


def run_cli(args) -> int:
  try:
    cfg = DemoConfig(num_requests=args.num_requests, num_layers=args.num_layers,
                     d_model=args.d_model, page_size=args.page_size, max_reqs=args.max_reqs,
                     max_pages_per_req=args.max_pages_per_req, pool_pages=args.pool_pages,
                     max_tokens=args.max_tokens, chunk=args.chunk,
                     prefix_len=args.prefix_len, prompt_len=tuple(args.prompt_len),
                     new_tokens=tuple(args.new_tokens), seed=args.seed,
                     attention=args.attention)
    res = run(cfg, repeat=args.repeat)
  except (ValueError, RuntimeError) as e:  # a bad setting, or a pool too small to finish
    print(f"jax-kvalloc demo: {e}", file=sys.stderr)
    return 2
  print(f"jax-kvalloc demo on {res['device']}: {cfg.num_layers}-layer toy decoder "
        f"(d_model {cfg.d_model}, vocab {cfg.vocab}), {cfg.num_requests} requests, page "
        f"size {cfg.page_size}, pool {cfg.pool_pages} pages, {cfg.max_reqs} rows")
  for req, got, want in zip(res["requests"], res["paged"], res["reference"]):
    mark = "==" if got == want else "!="
    print(f"  req {req['id']:2d}: prompt {len(req['prompt']):3d}"
          f"{' (shared prefix)' if req['shared'] else '                '} -> {got} "
          f"{mark} contiguous")
  sh = res["share"]
  print(f"steps: {res['steps']} ({res['decode_steps']} decode); tokens processed "
        f"{res['processed']}, generated {res['generated']}; batch entries deferred by "
        f"admission: {res['deferred']}")
  print(f"paged run: {sh['tokens_per_s']:.0f} tokens/s processed over {sh['steps']} warm "
        f"steps ({res['wall_s']:.1f} s wall, "
        f"{'compilation included' if args.repeat <= 1 else 'a warm run'}); per step "
        f"{sh['step_s'] * 1e6:.0f} us, allocator part {sh['alloc_s'] * 1e6:.0f} us = "
        f"{100 * sh['share']:.0f}% of the step (the same steps replayed with only the "
        f"request-table and allocator work)")
  print(f"median warm step {sh['step_median_s'] * 1e6:.0f} us (decode "
        f"{sh['decode_median_s'] * 1e6:.0f} us, prefill {sh['prefill_median_s'] * 1e6:.0f} "
        f"us), allocator part {sh['alloc_median_s'] * 1e6:.0f} us; each step is one batch "
        f"transfer, one jitted call and one read-back of k and the next tokens")
  print(f"attention: {res['attention']}; compiles after the first step of each kind: "
        f"{res['late_compiles']}")
  print("tokens identical to the contiguous-cache run: "
        + ("YES" if res["identical"] else "NO"))
  return 0 if res["identical"] else 1
