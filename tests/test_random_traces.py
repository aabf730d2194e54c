"""Random serving traces, step by step against the independent model: the SGLang-
compatible classes, and the functional core directly (jitted and not, chex variants)."""
import chex
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import buckets
from serving_driver import run_workload

CASES = [  # (kind, page_size, num_pages)
    ("token", 1, 40),
    ("paged", 1, 40),
    ("paged", 4, 24),
    ("paged", 16, 20),
    ("paged", 64, 16),
]


def _make_class(kind, ps, num_pages, need_sort, backend="device"):
  if kind == "token":
    return kvs.TokenToKVPoolAllocator(num_pages, need_sort=need_sort, backend=backend)
  return kvs.PagedTokenToKVPoolAllocator(num_pages * ps, ps, need_sort=need_sort,
                                        backend=backend)


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("kind,ps,num_pages", CASES)
def test_classes_match_model_on_random_traces(kind, ps, num_pages, need_sort, backend):
  for seed in range(3):
    impl = _make_class(kind, ps, num_pages, need_sort, backend)
    counts = run_workload(impl, size=num_pages * ps, page_size=ps, need_sort=need_sort,
                          kind=kind, steps=120, seed=seed)
    assert sum(counts.values()) > 60, counts


class FunctionalImpl:
  """The SGLang method set over the functional core, each op through `wrap` (a chex
  variant: jitted or not). Pads inputs like the classes do."""

  def __init__(self, config, wrap):
    self.config = config
    self.state = kv.init(config)
    self._group = None
    self._alloc = wrap(kv.alloc, static_argnames=("config", "max_size"))
    self._extend = wrap(kv.alloc_extend, static_argnames=("config", "max_tokens"))
    self._decode = wrap(kv.alloc_decode, static_argnames=("config",))
    self._free = wrap(kv.free, static_argnames=("config",))
    self._merge = wrap(kv.merge_and_sort_free, static_argnames=("config",))

  free_pages = property(lambda self: kv.live_free_pages(self.state))
  release_pages = property(lambda self: kv.live_release_pages(self.state))

  def available_size(self):
    return int(kv.available_size(self.config, self.state))

  def alloc(self, n):
    self.state, out, ok = self._alloc(self.config, self.state, jnp.int32(n),
                                      max_size=buckets.bucket(n, 64))
    return np.asarray(out)[:n] if bool(ok) else None

  def alloc_extend(self, pre, _, seq, __, last, n):
    rows = buckets.bucket(len(pre), 8)
    self.state, out, ok = self._extend(
        self.config, self.state, buckets.pad(pre, rows), buckets.pad(seq, rows),
        buckets.pad(last, rows, -1), max_tokens=buckets.bucket(n, 64),
        num_reqs=jnp.int32(len(pre)))
    return np.asarray(out)[:n] if bool(ok) else None

  def alloc_decode(self, seq, _, last):
    rows = buckets.bucket(len(seq), 8)
    self.state, out, ok = self._decode(self.config, self.state, buckets.pad(seq, rows),
                                       buckets.pad(last, rows, -1),
                                       num_reqs=jnp.int32(len(seq)))
    return np.asarray(out)[:len(seq)] if bool(ok) else None

  def free(self, idx):
    if self._group is not None:
      self._group.append(np.array(idx))
    elif len(idx):
      self.state = self._free(self.config, self.state,
                              buckets.pad(np.asarray(idx), buckets.bucket(len(idx), 64)))

  def free_group_begin(self):
    self._group = []

  def free_group_end(self):
    group, self._group = self._group, None
    if group:
      self.free(np.concatenate(group))

  def merge_and_sort_free(self):
    self.state = self._merge(self.config, self.state)

  def backup_state(self):
    return self.state

  def restore_state(self, state):
    self.state = state


class FunctionalTracesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(case=[("token", 1, 40), ("paged", 4, 24), ("paged", 16, 20)],
                         need_sort=[False, True])
  def test_functional_matches_model(self, case, need_sort):
    kind, ps, num_pages = case
    cfg = kv.AllocatorConfig(size=num_pages * ps, page_size=ps, need_sort=need_sort,
                             kind=kind)
    run_workload(FunctionalImpl(cfg, self.variant), size=num_pages * ps, page_size=ps,
                 need_sort=need_sort, kind=kind, steps=40, seed=7)
