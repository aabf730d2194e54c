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


def replay(records, replayer: traces.Replayer) -> int:
  """Replays one trace; returns the number of steps. Raises traces.TraceMismatch on the
  first step whose observed result/lists/available_size differ from the recorded ones."""
  for step, rec in enumerate(records):
    got = replayer.step(rec["op"], rec.get("args"))
    diff = traces.compare(rec, got, release_unordered=replayer.release_unordered)
    if diff:
      raise traces.TraceMismatch(f"trace {rec['trace']!r} step {step} ({rec['op']}): {diff}")
  return len(records)
