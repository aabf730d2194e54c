"""Test helpers for trace replay: the independent model (tests/model.py) and jax_kvalloc
behind jax_kvalloc.traces' allocator-factory interface. No torch here."""
from __future__ import annotations

from jax_kvalloc.tools import traces
from model import ModelAllocator


class ModelAdapter(ModelAllocator):
  """ModelAllocator with SGLang's alloc_extend/alloc_decode signatures."""

  def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                   extend_num_tokens):
    del prefix_lens_cpu, seq_lens_cpu, extend_num_tokens
    return super().alloc_extend([int(x) for x in prefix_lens], [int(x) for x in seq_lens],
                                [int(x) for x in last_loc])

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
    del seq_lens_cpu
    return super().alloc_decode([int(x) for x in seq_lens], [int(x) for x in last_loc])


def model_factory(size, page_size, need_sort, kind):
  return ModelAdapter(size, page_size, need_sort, kind)


def model_replayer() -> traces.Replayer:
  return traces.Replayer(model_factory)


def jax_replayer(kernel: str = "jnp", backend: str = "device") -> traces.Replayer:
  return traces.Replayer(traces.jax_factory(kernel, backend=backend))
