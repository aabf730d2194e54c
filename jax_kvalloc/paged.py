"""SGLang's PagedTokenToKVPoolAllocator (whole pages, LIFO free) over the functional core."""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jax_kvalloc import buckets
from jax_kvalloc.base import BaseAllocator, _ALLOC_DECODE, _ALLOC_EXTEND, host_ints
from jax_kvalloc.config import AllocatorConfig


class PagedTokenToKVPoolAllocator(BaseAllocator):
  """Hands out KV slots a page at a time; page 0 is reserved (SPEC 4).

  Args:
    size: number of usable slots; the pool has size // page_size pages.
    page_size: slots per page.
    dtype, device, kvcache: as in SGLang (see TokenToKVPoolAllocator).
    need_sort: park freed pages in release_pages until a shortfall merges them.
    kernel, debug: see AllocatorConfig (default from JAX_KVALLOC_KERNEL/JAX_KVALLOC_DEBUG).
  """

  def __init__(self, size: int, page_size: int, dtype: Any = None, device: Any = None,
               kvcache: Any = None, need_sort: bool = False, *,
               kernel: Optional[str] = None, debug: Optional[bool] = None):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = AllocatorConfig(size=size, page_size=page_size, need_sort=need_sort,
                             kind="paged", **extra)
    super().__init__(config, dtype, device, kvcache)

  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens: int):
    """Slots for a prefill batch (SPEC 4.2), or None if its new pages do not fit.

    Args:
      prefix_lens, seq_lens: [bs] integers (any array type or list); the *_cpu copies
        are used instead when given (SGLang passes both; either may be None).
      last_loc: [bs] slot of each request's last prefix token, -1 for an empty prefix.
      extend_num_tokens: sum(seq_lens - prefix_lens).

    Returns:
      i32[extend_num_tokens] jax array, in batch order, or None (nothing allocated).
    """
    pre = host_ints(prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu,
                    "prefix_lens")
    seq = host_ints(seq_lens if seq_lens_cpu is None else seq_lens_cpu, "seq_lens")
    last = host_ints(last_loc, "last_loc")
    self._check_batch(prefix_lens=pre, seq_lens=seq, last_loc=last)
    bad = (pre < 0) | (seq < pre)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got "
                       f"prefix_lens[{i}]={int(pre[i])}, seq_lens[{i}]={int(seq[i])}")
    total = int((seq - pre).sum())
    if int(extend_num_tokens) != total:
      raise ValueError(f"extend_num_tokens={int(extend_num_tokens)} != "
                       f"sum(seq_lens - prefix_lens)={total}")
    bs = pre.shape[0]
    if bs == 0:
      return jnp.zeros((0,), jnp.int32)
    # A batch of zero-extension rows still runs: its need_sort merge trigger counts bs.
    rows = buckets.bucket(bs, buckets.MIN_BATCH)
    out, ok = self._call(
        _ALLOC_EXTEND, buckets.pad(pre, rows), buckets.pad(seq, rows),
        buckets.pad(last, rows, -1), max_tokens=buckets.bucket(total, buckets.MIN_TOKENS),
        num_reqs=np.int32(bs))
    if not bool(ok):
      return None
    return out[:total]

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
    """One slot per request for its new token (SPEC 4.3), or None if the pages needed
    do not fit.

    Args:
      seq_lens: [bs] lengths counting the new token (seq_lens_cpu used when given).
      last_loc: [bs] slot of each request's previous token.

    Returns:
      i32[bs] jax array, or None (nothing allocated).
    """
    seq = host_ints(seq_lens if seq_lens_cpu is None else seq_lens_cpu, "seq_lens")
    last = host_ints(last_loc, "last_loc")
    self._check_batch(seq_lens=seq, last_loc=last)
    if (seq < 1).any():
      i = int(np.argmax(seq < 1))
      raise ValueError(f"seq_lens[{i}]={int(seq[i])} must be >= 1 (it counts the new token)")
    bs = seq.shape[0]
    if bs == 0:
      return jnp.zeros((0,), jnp.int32)
    rows = buckets.bucket(bs, buckets.MIN_BATCH)
    out, ok = self._call(_ALLOC_DECODE, buckets.pad(seq, rows), buckets.pad(last, rows, -1),
                         num_reqs=np.int32(bs))
    if not bool(ok):
      return None
    return out[:bs]

  def _check_batch(self, **arrays: np.ndarray) -> None:
    """All per-request arrays must have the same length."""
    lengths = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
      raise ValueError(f"per-request arrays differ in length: {lengths}")
