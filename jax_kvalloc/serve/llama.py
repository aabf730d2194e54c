"""The Llama decoder in JAX, over a batch of rows of C query tokens each, with its KV
cache behind a `KVStore` (jax_kvalloc.serve.kv_store: paged through the request table,
or contiguous), so that the model code does not know how the cache is addressed.

Math as Hugging Face's LlamaForCausalLM: RMSNorm (f32 statistics), rotate-half RoPE
(`inv_freq = theta ** -(2i / dh)`, cos/sin in f32), grouped-query attention
(`num_heads // num_kv_heads` query heads per KV head, scores scaled by dh ** -0.5), a
SwiGLU MLP, and logits through the tied embedding (or lm_head). In float32 every matmul
runs at full precision (no TF32 on a GPU).

Layers: `scan` (one traced layer, `lax.scan` over stacked weights and per-layer caches:
compile time does not grow with depth) or `unroll` (a Python loop over per-layer
weights and caches: each layer's cache is its own buffer, updated in place under
donation, which a custom-call attention kernel reads without a copy).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from jax_kvalloc.serve.loader import LAYER_KEYS
from jax_kvalloc.serve.loader import LlamaConfig

Array = jax.Array
# attention(layer_cache, q f[B, C, Hq, Dh], k, v f[B, C, Hkv, Dh]) -> (cache, o f[B, C, Hq, Dh])
Attention = Callable[[Any, Array, Array, Array], Tuple[Any, Array]]
LAYERS = ("scan", "unroll")


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _mm(x: Array, w: Array) -> Array:
  return jnp.matmul(x, w, precision=_precision(w.dtype))


def rms_norm(x: Array, w: Array, eps: float) -> Array:
  """x * rsqrt(mean(x^2) + eps) * w, the statistics in f32 (HF's LlamaRMSNorm)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w * y.astype(x.dtype)


def rope_tables(cfg: LlamaConfig, pos: Array) -> Tuple[Array, Array]:
  """cos, sin f32[..., head_dim] for integer positions pos (HF's default RoPE)."""
  half = jnp.arange(0, cfg.rope_dim, 2, dtype=jnp.int32).astype(jnp.float32) / cfg.rope_dim
  inv_freq = 1.0 / (cfg.rope_theta ** half)
  freqs = pos.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x f[B, C, H, Dh] rotated by cos/sin f32[B, C, Dh] (rotate-half form)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
  return x * c + rotated * s


def attend(q: Array, keys: Array, values: Array, q_pos: Array, kv_len: Array) -> Array:
  """Causal grouped-query attention of each row's C queries over its own keys.

  Args:
    q: f[B, C, Hq, Dh] queries (unscaled).
    keys, values: f[B, L, Hkv, Dh], row b's token j at [b, j].
    q_pos: i32[B, C] each query's position; keys j <= q_pos and j < kv_len count.
    kv_len: i32[B] tokens in each row's cache.

  Returns:
    f[B, C, Hq, Dh]; a query with no key (padding) gets zeros. Masked keys may hold any
    finite values: their weights are exact zeros.
  """
  b, c, hq, dh = q.shape
  hkv = keys.shape[2]
  prec = _precision(q.dtype)
  qg = (q * jnp.asarray(dh ** -0.5, q.dtype)).reshape(b, c, hkv, hq // hkv, dh)
  s = jnp.einsum("bckgd,blkd->bkgcl", qg, keys, precision=prec,
                 preferred_element_type=jnp.float32)
  j = jnp.arange(keys.shape[1], dtype=jnp.int32)
  mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
  mask = mask[:, None, None, :, :]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.where(mask, p, 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  o = jnp.einsum("bkgcl,blkd->bckgd", p.astype(values.dtype), values, precision=prec,
                 preferred_element_type=jnp.float32)
  return o.reshape(b, c, hq, dh).astype(q.dtype)


def layer(cfg: LlamaConfig, w: Dict[str, Array], x: Array, cos: Array, sin: Array,
          cache: Any, attention: Attention) -> Tuple[Array, Any]:
  """One decoder layer on x f[B, C, D]; returns (x, the layer's updated cache)."""
  b, c, _ = x.shape
  dh = cfg.head_dim
  h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
  q = apply_rope(_mm(h, w["wq"]).reshape(b, c, cfg.num_heads, dh), cos, sin)
  k = apply_rope(_mm(h, w["wk"]).reshape(b, c, cfg.num_kv_heads, dh), cos, sin)
  v = _mm(h, w["wv"]).reshape(b, c, cfg.num_kv_heads, dh)
  cache, o = attention(cache, q, k, v)
  x = x + _mm(o.reshape(b, c, cfg.num_heads * dh), w["wo"])
  h = rms_norm(x, w["ffn_norm"], cfg.rms_eps)
  x = x + _mm(jax.nn.silu(_mm(h, w["w_gate"])) * _mm(h, w["w_up"]), w["w_down"])
  return x, cache


def unstack_layers(params: Dict[str, Any]) -> Dict[str, Any]:
  """params with "layers" as a list of per-layer dicts (for layers='unroll')."""
  stacked = params["layers"]
  n = stacked[LAYER_KEYS[0]].shape[0]
  return dict(params, layers=[{k: stacked[k][i] for k in LAYER_KEYS} for i in range(n)])


def forward(cfg: LlamaConfig, params: Dict[str, Any], caches: Any, tokens: Array,
            pos: Array, last: Array, attention: Attention, *, layers: str = "scan"
            ) -> Tuple[Any, Array]:
  """Logits of each row's token `last[b]` after running every token through the model.

  Args:
    cfg: the model's config.
    params: jax_kvalloc.serve.loader's pytree; "layers" stacked (scan) or a list (unroll).
    caches: per-layer caches: stacked along a leading axis (scan) or a list (unroll).
    tokens, pos: i32[B, C] token ids and positions.
    last: i32[B] index into C of the token whose logits each row wants.
    attention: writes a layer's new K/V into its cache and attends (a KVStore's).
    layers: "scan" or "unroll".

  Returns:
    (caches, f32[B, vocab] logits).
  """
  x = params["embed"][tokens]
  cos, sin = rope_tables(cfg, pos)
  body = lambda x, w, cache: layer(cfg, w, x, cos, sin, cache, attention)
  if layers == "scan":
    x, caches = jax.lax.scan(lambda x, wc: body(x, *wc), x, (params["layers"], caches))
  elif layers == "unroll":
    out = []
    for w, cache in zip(params["layers"], caches):
      x, cache = body(x, w, cache)
      out.append(cache)
    caches = out
  else:
    raise ValueError(f"layers must be one of {LAYERS}, got {layers!r}")
  x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  x = rms_norm(x, params["norm"], cfg.rms_eps)
  head = params.get("lm_head")
  if head is None:
    logits = jnp.einsum("bd,vd->bv", x, params["embed"], precision=_precision(x.dtype),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.matmul(x, head, precision=_precision(x.dtype),
                        preferred_element_type=jnp.float32)
  return caches, logits.astype(jnp.float32)
