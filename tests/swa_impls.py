"""SWA implementations behind swa_trace's interface: the functional core (jitted, padded
to shape buckets), our class, and SGLang 0.5.23's released class (torch, CPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvalloc import state as st
from jax_kvalloc import swa as core


def _bucket(n: int, lo: int = 8) -> int:
  b = lo
  while b < n:
    b *= 2
  return b


def _pad(x, n, fill=0):
  out = np.full((n,), fill, np.int32)
  out[:len(x)] = x
  return out


_J = dict(
    alloc=jax.jit(core.alloc, static_argnames=("config", "max_size")),
    alloc_extend=jax.jit(core.alloc_extend, static_argnames=("config", "max_tokens")),
    alloc_extend_swa_tail=jax.jit(core.alloc_extend_swa_tail,
                                  static_argnames=("config", "max_tokens")),
    alloc_decode=jax.jit(core.alloc_decode, static_argnames=("config",)),
    free=jax.jit(core.free, static_argnames=("config",)),
    free_swa=jax.jit(core.free_swa, static_argnames=("config",)),
    free_swa_segment=jax.jit(core.free_swa_segment, static_argnames=("config",)),
    free_full=jax.jit(core.free_full, static_argnames=("config",)),
    free_full_segment=jax.jit(core.free_full_segment, static_argnames=("config",)),
    free_segment=jax.jit(core.free_segment, static_argnames=("config",)),
)


class CoreImpl:
  """The functional core, jitted and padded to shape buckets. It has no free groups
  (the classes keep them): run it with run_trace(..., groups=False)."""
  name = "core"
  release_unordered = False

  def __init__(self, size, size_swa, ps, need_sort, kernel="jnp", fixed=True):
    self.config = core.SWAConfig(size, size_swa, ps, need_sort, kernel=kernel, debug=False)
    self.state = core.init(self.config)
    # fixed: one shape per operation (rows 32, tokens 64 * ps, frees `size`), so a trace
    # compiles each operation once.
    self.fixed = (32, 64 * ps, size) if fixed else None

  def _rows(self, n):
    return self.fixed[0] if self.fixed else _bucket(n, 4)

  def _tokens(self, n):
    return self.fixed[1] if self.fixed else _bucket(n, 16)

  def _frees(self, n):
    return self.fixed[2] if self.fixed else _bucket(n, 16)

  def _out(self, out, ok, n):
    return list(np.asarray(out)[:n]) if bool(ok) else None

  def alloc(self, n):
    self.state, out, ok = _J["alloc"](self.config, self.state, np.int32(n),
                                      max_size=self._tokens(n))
    return self._out(out, ok, n)

  def alloc_extend(self, pre, seq, last):
    b = self._rows(len(pre))
    total = sum(seq) - sum(pre)
    self.state, out, ok = _J["alloc_extend"](
        self.config, self.state, _pad(pre, b), _pad(seq, b), _pad(last, b, -1),
        max_tokens=self._tokens(total), num_reqs=np.int32(len(pre)))
    return self._out(out, ok, total)

  def alloc_extend_swa_tail(self, pre, seq, last, tail):
    self.state, out, ok = _J["alloc_extend_swa_tail"](
        self.config, self.state, np.array([pre], np.int32), np.array([seq], np.int32),
        np.array([last], np.int32), np.int32(tail), max_tokens=self._tokens(seq - pre))
    return self._out(out, ok, seq - pre)

  def alloc_decode(self, seq, last):
    b = self._rows(len(seq))
    self.state, out, ok = _J["alloc_decode"](self.config, self.state, _pad(seq, b, 1),
                                             _pad(last, b, -1), num_reqs=np.int32(len(seq)))
    return self._out(out, ok, len(seq))

  def _free(self, op, idx, *start):
    n = self._frees(len(idx))
    self.state = _J[op](self.config, self.state, _pad(idx, n), *map(np.int32, start),
                        np.int32(len(idx)))

  def free(self, idx):
    self._free("free", idx)

  def free_swa(self, idx):
    self._free("free_swa", idx)

  def free_swa_segment(self, idx, start):
    self._free("free_swa_segment", idx, start)

  def free_full(self, idx):
    n = self._frees(len(idx))
    self.state = _J["free_full"](self.config, self.state, _pad(idx, n))

  def free_full_segment(self, idx, start):
    self._free("free_full_segment", idx, start)

  def free_segment(self, idx, start):
    self._free("free_segment", idx, start)

  def lists(self):
    s = self.state
    return (st.live_free_pages(s.full), st.live_release_pages(s.full),
            st.live_free_pages(s.swa), st.live_release_pages(s.swa))

  def peers(self, slots):
    return np.asarray(core.translate(self.state.mapping, np.asarray(slots, np.int32)))


class ClassImpl:
  """Our SWATokenToKVPoolAllocator."""
  release_unordered = False

  def __init__(self, size, size_swa, ps, need_sort, backend="device", device="cpu", **kw):
    from jax_kvalloc.sglang.swa import SWATokenToKVPoolAllocator
    self.name = f"class[{backend}]"
    kernel = None if kw.pop("kernel_auto", False) else "jnp"
    self.a = SWATokenToKVPoolAllocator(size, size_swa, ps, None, device, None, need_sort,
                                       backend=backend, kernel=kernel, **kw)
    self.ps = ps

  def _res(self, out):
    return None if out is None else list(np.asarray(out))

  def alloc(self, n):
    return self._res(self.a.alloc(n))

  def alloc_extend(self, pre, seq, last):
    pre, seq = np.array(pre, np.int64), np.array(seq, np.int64)
    return self._res(self.a.alloc_extend(pre, pre, seq, seq, np.array(last, np.int64),
                                         int((seq - pre).sum())))

  def alloc_extend_swa_tail(self, pre, seq, last, tail):
    p, s = np.array([pre], np.int64), np.array([seq], np.int64)
    return self._res(self.a.alloc_extend_swa_tail(p, p, s, s, np.array([last], np.int64),
                                                  seq - pre, tail))

  def alloc_decode(self, seq, last):
    seq = np.array(seq, np.int64)
    return self._res(self.a.alloc_decode(seq, seq, np.array(last, np.int64)))

  def free(self, idx):
    self.a.free(np.array(idx, np.int64))

  def free_swa(self, idx):
    self.a.free_swa(np.array(idx, np.int64))

  def free_swa_segment(self, idx, start):
    self.a.free_swa_segment(np.array(idx, np.int64), start_pos=start)

  def free_full(self, idx):
    self.a.free_full(np.array(idx, np.int64))

  def free_full_segment(self, idx, start):
    self.a.free_full_segment(np.array(idx, np.int64), start_pos=start)

  def free_segment(self, idx, start):
    self.a.free_segment(np.array(idx, np.int64), start_pos=start)

  def free_group_begin(self):
    self.a.free_group_begin()

  def free_group_end(self):
    self.a.free_group_end()

  def lists(self):
    f, s = self.a.full_attn_allocator, self.a.swa_attn_allocator
    return f.free_pages, f.release_pages, s.free_pages, s.release_pages

  def peers(self, slots):
    return np.asarray(self.a.translate_loc_from_full_to_swa(np.asarray(slots, np.int64)))


# -- SGLang 0.5.23 ------------------------------------------------------------------------

def sglang_swa_class():
  """SGLang 0.5.23's SWATokenToKVPoolAllocator and a kvcache stand-in class, or raises
  ImportError (jax_kvalloc.tools.sglang_oracle; the stand-in module for
  base_swa_memory_pool when the real one needs transformers)."""
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  return sglang_oracle.sglang_swa_class()


class SGLangImpl:
  """SGLang 0.5.23's released SWA class on CPU torch."""
  name = "sglang"
  release_unordered = True

  def __init__(self, size, size_swa, ps, need_sort, device="cpu"):
    import torch
    self.torch, self.device = torch, device
    cls, standin = sglang_swa_class()
    self.a = cls(size, size_swa, ps, torch.float16, device, standin(), need_sort)

  def _t(self, x):
    return self.torch.tensor(list(x), dtype=self.torch.int64, device=self.device)

  def _cpu(self, x):
    """The *_cpu arguments: host tensors whatever the device (SGLang 0.5.23's SWA
    get_num_new_pages asserts seq_lens.device == cpu on CUDA)."""
    return self.torch.tensor(list(x), dtype=self.torch.int64)

  def _res(self, out):
    return None if out is None else [int(v) for v in out]

  def alloc(self, n):
    return self._res(self.a.alloc(n))

  def alloc_extend(self, pre, seq, last):
    return self._res(self.a.alloc_extend(self._t(pre), self._cpu(pre), self._t(seq),
                                         self._cpu(seq), self._t(last),
                                         int(sum(seq) - sum(pre))))

  def alloc_extend_swa_tail(self, pre, seq, last, tail):
    return self._res(self.a.alloc_extend_swa_tail(
        self._t([pre]), self._cpu([pre]), self._t([seq]), self._cpu([seq]),
        self._t([last]), seq - pre, tail))

  def alloc_decode(self, seq, last):
    return self._res(self.a.alloc_decode(self._t(seq), self._cpu(seq), self._t(last)))

  def free(self, idx):
    self.a.free(self._t(idx))

  def free_swa(self, idx):
    self.a.free_swa(self._t(idx))

  def free_swa_segment(self, idx, start):
    self.a.free_swa_segment(self._t(idx), start_pos=start)

  def free_full(self, idx):
    self.a.free_full(self._t(idx))

  def free_full_segment(self, idx, start):
    self.a.free_full_segment(self._t(idx), start_pos=start)

  def free_segment(self, idx, start):
    self.a.free_segment(self._t(idx), start_pos=start)

  def free_group_begin(self):
    self.a.free_group_begin()

  def free_group_end(self):
    self.a.free_group_end()

  @staticmethod
  def _pool_lists(p):
    staged = getattr(p, "staged_pages", None)
    if staged is not None:
      rel = [int(v) for t in staged for v in t.reshape(-1)]
    else:
      rel = [int(v) for v in p.release_pages]
    return [int(v) for v in p.free_pages], rel

  def lists(self):
    ff, fr = self._pool_lists(self.a.full_attn_allocator)
    sf, sr = self._pool_lists(self.a.swa_attn_allocator)
    return ff, fr, sf, sr

  def peers(self, slots):
    return [int(v) for v in self.a.full_to_swa_index_mapping[self._t(slots)]]
