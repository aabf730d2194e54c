"""Pools of many configs in one process (SPEC 14's last bullet): the compiled programs of
a config no live pool uses are released (beyond the RECENT configs kept), so memory maps
stay bounded as pools are made and dropped; a config in use keeps its programs."""
import gc
import os

import numpy as np
import pytest

import jax_kvalloc.sglang as kvs
from jax_kvalloc.sglang.backends import device as device_module

MAPS = "/proc/self/maps"


def _maps() -> int:
  if not os.path.exists(MAPS):
    return 0
  with open(MAPS) as f:
    return sum(1 for _ in f)


def _use(size: int) -> None:
  """A pool of its own config: made, used (init, alloc, free, a size), dropped."""
  a = kvs.TokenToKVPoolAllocator(size, kernel="jnp", debug=False)
  out = a.alloc(3)
  a.free(np.asarray(out))
  assert a.available_size() == size


@pytest.mark.slow  # each config compiles its own programs
def test_programs_of_dropped_configs_are_released_and_live_ones_kept(monkeypatch):
  monkeypatch.setattr(device_module, "RECENT", 4)  # fewer configs to make and drop
  kept = kvs.PagedTokenToKVPoolAllocator(64, 4, kernel="jnp", debug=False)
  kept.alloc(8)
  ops = kept._pools[0].backend.ops  # pylint: disable=protected-access
  compiled = dict(ops._fns)         # pylint: disable=protected-access
  recent = device_module.RECENT
  counts = []
  for i in range(3 * recent):
    _use(200 + i)
    if i % recent == recent - 1:
      gc.collect()
      counts.append(_maps())
  # What is kept: the live config's programs and the RECENT configs asked for last.
  assert len(device_module._LIVE) <= recent + 1  # pylint: disable=protected-access
  assert device_module.DeviceOps.for_config(kept.config) is ops
  assert all(ops._fns[k] is fn for k, fn in compiled.items())  # pylint: disable=protected-access
  kept.alloc(8)
  assert kept.available_size() == 64 - 16
  # Memory maps (XLA maps memory for each compiled program): once the first RECENT
  # configs fill what is kept, more configs add (almost) nothing; without the release
  # each config added ~100-200 maps (8 configs: ~1,000 or more).
  if os.path.exists(MAPS):
    assert counts[-1] - counts[1] < 100, counts
