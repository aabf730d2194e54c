"""Serving a real model through the request table (`jax-kvalloc serve`).

Tooling beside the allocator: it uses the functional core (jax_kvalloc's public API) and
nothing imports it. Its modules::

  loader        a Llama-architecture GGUF: config from `llama.*` metadata, dequantized
                weights (Hugging Face's layout, q/k rows un-permuted), random weights
  tokenizer     the GGUF's own byte-level BPE tokenizer (the `tokenizers` package)
  llama         the decoder in JAX: RMSNorm, RoPE, grouped-query attention, SwiGLU;
                layers scanned or unrolled; the KV cache behind an attention callable
  kv_store      paged (slots and page lists from the request table) or contiguous KV,
                jnp gather attention or Pallas' GPU paged_attention for decode
  prefix_cache  whole pages keyed by their token ids, lent with borrow_pages, evicted
                LRU with free_page_ids
  engine        continuous batching, chunked prefill, multi-step device decode
  cli           `jax-kvalloc serve`
  bench         decode / prefill throughput, paged against contiguous, table share
"""
from jax_kvalloc.serve.engine import Engine
from jax_kvalloc.serve.engine import EngineConfig
from jax_kvalloc.serve.engine import Request
from jax_kvalloc.serve.engine import RequestError
from jax_kvalloc.serve.engine import Result
from jax_kvalloc.serve.loader import LlamaConfig
from jax_kvalloc.serve.loader import ModelFileError

__all__ = ["Engine", "EngineConfig", "LlamaConfig", "ModelFileError", "Request",
           "RequestError", "Result"]
