"""SGLang's PagedTokenToKVPoolAllocator (whole pages, LIFO free) over the functional core."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jax_kvalloc import buckets
from jax_kvalloc import host_ops
from jax_kvalloc import validate
from jax_kvalloc.base import BaseAllocator, _ALLOC_DECODE, _ALLOC_EXTEND
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.data_parallel import DataParallel
from jax_kvalloc.newer_ops import NewerOperations


class PagedTokenToKVPoolAllocator(DataParallel, NewerOperations, BaseAllocator):
  """Hands out KV slots a page at a time; page 0 is reserved (SPEC 4).

  Args:
    size: number of usable slots; the pool has size // page_size pages.
    page_size: slots per page.
    dtype, device, kvcache: as in SGLang (see TokenToKVPoolAllocator).
    need_sort: park freed pages in release_pages until a shortfall merges them.
    kernel, debug: see AllocatorConfig (default from JAX_KVALLOC_KERNEL/JAX_KVALLOC_DEBUG).
    backend: "device" (jax arrays on `device`, calls launch without waiting) or "host"
      (NumPy state and results, for host schedulers); see jax_kvalloc.base.
    dp_size: data-parallel ranks (sglang-jax's dp_size), each a pool of size // dp_size
      slots with rank-local page ids; every method then takes `dp_rank=` (default 0).
      See jax_kvalloc.data_parallel.
  """

  def __init__(self, size: int, page_size: int, dtype: Any = None, device: Any = None,
               kvcache: Any = None, need_sort: bool = False, *,
               kernel: Optional[str] = None, debug: Optional[bool] = None,
               backend: str = "device", dp_size: int = 1):
    extra = {k: v for k, v in (("kernel", kernel), ("debug", debug)) if v is not None}
    config = AllocatorConfig(size=size, page_size=page_size, need_sort=need_sort,
                             kind="paged", **extra)
    super().__init__(config, dtype, device, kvcache, backend, dp_size=dp_size)

  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens: int, num_new_pages: Optional[int] = None,
                   dp_rank: int = 0):
    """Slots for a prefill batch (SPEC 4.2), or None if its new pages do not fit.

    Args:
      prefix_lens, seq_lens: [bs] integers (any array type or list); the *_cpu copies
        are used instead when given (SGLang passes both; either may be None).
      last_loc: [bs] slot of each request's last prefix token, -1 for an empty prefix.
        On the device backend a jax.Array is taken as it is, without reading it back
        (as SGLang passes it, computed on the device): only its shape and dtype are
        checked (debug mode checks its values).
      extend_num_tokens: sum(seq_lens - prefix_lens).
      num_new_pages: optional, the batch's new-page count as the caller computed it
        (SGLang 0.5.23); it must equal sum(ceil(seq/ps) - ceil(pre/ps)).
      dp_rank: the data-parallel rank (dp_size > 1) whose pool serves the batch.

    Returns:
      i32[extend_num_tokens] in batch order (a jax array, returned without waiting, on
      the device backend; numpy on the host backend), or None (nothing allocated).

    Raises:
      TypeError for non-integer arrays; ValueError (naming the request and value) for
      arrays of different lengths, values beyond int32, prefix_lens < 0,
      seq_lens < prefix_lens, a last_loc outside the pool or breaking SPEC's alignment
      (last_loc + 1) % page_size == prefix_lens % page_size, or a wrong extend_num_tokens
      or num_new_pages.
    """
    rank = self._rank_for(dp_rank)
    if rank is not None:
      return rank.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                               last_loc, extend_num_tokens, num_new_pages)
    pre_arg = prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu
    seq_arg = seq_lens if seq_lens_cpu is None else seq_lens_cpu
    if self._host:
      out = self._extend_host(pre_arg, seq_arg, last_loc, extend_num_tokens, num_new_pages)
      if out is not False:
        return out
    # The checks that name what is wrong (the host backend gets here only for input its
    # fast checks did not take: bad values, lists and tensors, empty batches).
    pre = validate.host_ints(pre_arg, "prefix_lens")
    seq = validate.host_ints(seq_arg, "seq_lens")
    dev_last = self._device_last_loc(last_loc, pre.shape[0])
    last = (validate.host_ints(last_loc, "last_loc") if dev_last is None
            else validate.aligned_last_loc(pre, self.page_size, 1))
    total, new_pages = validate.extend_args(pre, seq, last, extend_num_tokens,
                                            page_size=self.page_size,
                                            num_slots=self.config.num_slots)
    if num_new_pages is not None:
      validate.num_new_pages(num_new_pages, new_pages)
    bs = pre.shape[0]
    if bs == 0:  # SPEC 4.2's trigger still fires: 0 // ps + 0 + 1 > len(free_pages)
      self._merge_if(1 > self._free_len)
      return self._empty_out()
    if self._legacy:
      return self._legacy_extend(pre, seq, last, total, new_pages)
    if self._host:  # valid input that is not a numpy array: the arrays made above
      return self._extend_host(pre, seq, last, total, None)
    # need_sort merge trigger (SPEC 4.2), then capacity: decided on the host. A batch of
    # zero-extension rows still counts: the trigger counts bs.
    last = last if dev_last is None else dev_last
    return self._allocate(total // self.page_size + bs + 1 > self._free_len, new_pages,
                          lambda s: self._dev.alloc_extend(s, pre, seq, last, total))

  def _legacy_extend(self, pre, seq, last, total: int, new_pages: int):
    if new_pages > self.config.num_pages:
      self._merge_if(True)
      return None
    rows = buckets.bucket(pre.shape[0], buckets.MIN_BATCH)
    out, ok = self._call(
        _ALLOC_EXTEND, buckets.pad(pre, rows), buckets.pad(seq, rows),
        buckets.pad(last, rows, -1), max_tokens=buckets.bucket(total, buckets.MIN_TOKENS),
        num_reqs=np.int32(pre.shape[0]))
    return self._output(out, ok, total)

  def _device_last_loc(self, last_loc, bs: int):
    """last_loc as the device backend takes a jax.Array (validate.device_last_loc: as it
    is, never read back); None where the host checks apply (host data, the host backend,
    debug mode, an empty batch)."""
    if self._host or self._legacy or bs == 0:
      return None
    return validate.device_last_loc(last_loc, bs)

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, dp_rank: int = 0):
    """One slot per request for its new token (SPEC 4.3), or None if the pages needed
    do not fit.

    Args:
      seq_lens: [bs] lengths counting the new token (seq_lens_cpu used when given).
      last_loc: [bs] slot of each request's previous token (a jax.Array is taken as
        it is on the device backend, as in alloc_extend).
      dp_rank: the data-parallel rank (dp_size > 1) whose pool serves the batch.

    Returns:
      i32[bs] (jax array without waiting / numpy, as alloc_extend), or None (nothing
      allocated).

    Raises:
      TypeError for non-integer arrays; ValueError (naming the request and value) for
      arrays of different lengths, values beyond int32, seq_lens < 1, or a last_loc
      outside the pool or breaking (last_loc + 2) % page_size == seq_lens % page_size.
    """
    rank = self._rank_for(dp_rank)
    if rank is not None:
      return rank.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
    seq_arg = seq_lens if seq_lens_cpu is None else seq_lens_cpu
    if self._host:
      out = self._decode_host(seq_arg, last_loc)
      if out is not False:
        return out
    seq = validate.host_ints(seq_arg, "seq_lens")
    dev_last = self._device_last_loc(last_loc, seq.shape[0])
    last = (validate.host_ints(last_loc, "last_loc") if dev_last is None
            else validate.aligned_last_loc(seq, self.page_size, 2))
    validate.decode_args(seq, last, page_size=self.page_size,
                         num_slots=self.config.num_slots)
    bs = seq.shape[0]
    if bs == 0:
      return self._empty_out()
    if self._legacy:
      rows = buckets.bucket(bs, buckets.MIN_BATCH)
      out, ok = self._call(_ALLOC_DECODE, buckets.pad(seq, rows),
                           buckets.pad(last, rows, -1), num_reqs=np.int32(bs))
      return self._output(out, ok, bs)
    if self._host:  # valid input that is not a numpy array: the arrays made above
      return self._decode_host(seq, last)
    pages = int(np.count_nonzero((seq - 1) % self.page_size == 0))  # SPEC 4.3
    last = last if dev_last is None else dev_last
    return self._allocate(bs > self._free_len, pages,  # SPEC 4.3's need_sort trigger
                          lambda s: self._dev.alloc_decode(s, seq, last))

  # -- host backend ----------------------------------------------------------------------
  # Batches of up to host_ops.SMALL_BATCH requests run on Python ints, larger ones on
  # numpy arrays in a few whole-batch calls (host_ops says why). Both check the input
  # themselves and return False when a check fails or the input is of another kind
  # (lists, tensors, empty batches): the caller then runs jax_kvalloc.validate, which
  # raises naming the argument, or converts the input and calls again. Nothing has
  # changed when they return False.

  def _decode_host(self, seq_lens, last_loc):
    """alloc_decode on the host backend, or False (see above)."""
    seq = host_ops.small_ints(seq_lens)
    last = host_ops.small_ints(last_loc) if seq is not None else None
    if last is not None:
      pages = host_ops.decode_plan_small(self._hc, seq, last)
      if pages is None:
        return False
      return self._allocate(len(seq) > self._free_len, pages,  # SPEC 4.3's trigger
                            lambda s: host_ops.alloc_decode_small(self._hc, s, seq, last,
                                                                  pages))
    seq, last = host_ops.i64(seq_lens), host_ops.i64(last_loc)
    if seq is None or last is None:
      return False
    plan = host_ops.decode_plan(self._hc, seq, last)
    if plan is None:
      return False
    return self._allocate(seq.shape[0] > self._free_len, plan[2],  # SPEC 4.3's trigger
                          lambda s: host_ops.alloc_decode(self._hc, s, *plan))

  def _extend_host(self, prefix_lens, seq_lens, last_loc, extend_num_tokens,
                   num_new_pages):
    """alloc_extend on the host backend, or False (see above)."""
    pre = host_ops.small_ints(prefix_lens)
    seq = host_ops.small_ints(seq_lens) if pre is not None else None
    last = host_ops.small_ints(last_loc) if seq is not None else None
    if last is not None:
      plan = host_ops.extend_plan_small(self._hc, pre, seq, last, extend_num_tokens)
      if plan is not None:
        total, new_pages = plan
        if num_new_pages is not None:
          validate.num_new_pages(num_new_pages, new_pages)
        # SPEC 4.2's need_sort trigger counts every row, empty ones too.
        return self._allocate(total // self._hc.ps + len(pre) + 1 > self._free_len,
                              new_pages, lambda s: host_ops.alloc_extend_small(
                                  self._hc, s, pre, seq, last, total, new_pages))
      # Refused, or more new pages than the small path walks: the numpy path decides.
    pre, seq = host_ops.i64(prefix_lens), host_ops.i64(seq_lens)
    last = host_ops.i64(last_loc)
    if pre is None or seq is None or last is None:
      return False
    plan = host_ops.extend_plan(self._hc, pre, seq, last, extend_num_tokens)
    if plan is None:
      return False
    total, new_pages = plan[:2]
    if num_new_pages is not None:
      validate.num_new_pages(num_new_pages, new_pages)
    return self._allocate(total // self._hc.ps + pre.shape[0] + 1 > self._free_len,
                          new_pages, lambda s: host_ops.alloc_extend(self._hc, s, plan))
