"""`warmup` compiles every program a serving loop within the maxima needs, and JAX's
persistent compilation cache lets a second process skip those compiles."""
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
from jax_kvalloc import warmup

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bucket_sizes():
  assert warmup.bucket_sizes(1, 8) == [8]
  assert warmup.bucket_sizes(9, 8) == [8, 16]
  assert warmup.bucket_sizes(1000, 64) == [64, 128, 256, 512, 1024]


def _cache_sizes(a):
  return {k: f._cache_size() for k, f in a._pools[0].backend.ops._fns.items()}  # pylint: disable=protected-access


def test_no_compile_after_warmup():
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(256 * ps, ps, need_sort=True, kernel="jnp",
                                     debug=False)
  # Small maxima keep the bucket count (and the compiles) low; the property is the same.
  report = a.warmup(max_batch=8, max_tokens=32, exact_sizes=range(1, 33))
  assert report.programs > 0 and report.seconds > 0
  before = _cache_sizes(a)
  assert all(n == 1 for n in before.values())
  rng = np.random.default_rng(0)
  for _ in range(30):  # random serving calls within the maxima
    bs = int(rng.integers(1, 9))
    seq = rng.integers(1, 32 // bs + 1, bs)
    z = np.zeros(bs, np.int64)
    out = a.alloc_extend(z, z, seq, seq, np.full(bs, -1), int(seq.sum()))
    if out is None:
      a.clear()
      continue
    a.free(np.asarray(out)[: int(rng.integers(1, out.shape[0] + 1))])
    a.merge_and_sort_free()
    dec = a.alloc_decode(np.full(bs, 4 * ps + 1), None, np.full(bs, 4 * ps - 1 + ps))
    del dec
  assert _cache_sizes(a) == before  # no new program, no recompile


def test_host_backend_compiles_nothing():
  a = kvs.PagedTokenToKVPoolAllocator(64, 4, backend="host")
  assert a.warmup(max_batch=8, max_tokens=64) == warmup.WarmupReport(0, 0.0)


_CHILD = textwrap.dedent("""
    import sys
    import jax
    from jax._src import monitoring
    import jax_kvalloc.sglang as kvs
    from jax_kvalloc import warmup
    warmup.enable_persistent_cache(sys.argv[1])
    counts = {}
    monitoring.register_event_listener(
        lambda event, **kw: counts.__setitem__(event, counts.get(event, 0) + 1))
    a = kvs.PagedTokenToKVPoolAllocator(512, 4, kernel="jnp", debug=False)
    a.warmup(max_batch=8, max_tokens=64)
    print(counts.get("/jax/compilation_cache/cache_hits", 0),
          counts.get("/jax/compilation_cache/cache_misses", 0))
""")


def test_persistent_cache_second_process_compiles_nothing(tmp_path):
  # Two subprocesses, 3-10 s in all (slow set: SLOW_TESTS).
  cache = tmp_path / "jax_cache"
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def child():
    out = subprocess.run([sys.executable, "-c", _CHILD, str(cache)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=600, check=True)
    hits, misses = (int(x) for x in out.stdout.split()[-2:])
    return hits, misses

  hits1, misses1 = child()
  assert misses1 > 0 and any(cache.iterdir())
  hits2, misses2 = child()
  assert misses2 == 0, f"the second process compiled {misses2} programs"
  assert hits2 >= misses1


def test_device_last_loc_after_warmup_compiles_nothing():
  """last_loc as a device array (as SGLang passes it) takes its own program variants and
  pads: warmup(device_last_loc=True) compiles them, so serving with it compiles none."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ps = 4
  a = kvs.PagedTokenToKVPoolAllocator(256 * ps, ps, kernel="jnp", debug=False)
  a.warmup(max_batch=8, max_tokens=32, exact_sizes=range(1, 33), device_last_loc=True)
  before = _cache_sizes(a)
  rng = np.random.default_rng(1)
  for _ in range(20):
    bs = int(rng.integers(1, 9))
    seq = rng.integers(1, 32 // bs + 1, bs)
    z = np.zeros(bs, np.int64)
    out = a.alloc_extend(z, z, seq, seq, jnp.full((bs,), -1, jnp.int32), int(seq.sum()))
    if out is None:
      a.clear()
      continue
    dec = a.alloc_decode(np.full(bs, 4 * ps + 1), None,
                         jnp.full((bs,), 4 * ps - 1 + ps, jnp.int32))
    assert dec is not None and dec.shape == (bs,)
    a.clear()
  assert _cache_sizes(a) == before


def test_device_last_loc_is_checked_by_shape_and_dtype():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  a = kvs.PagedTokenToKVPoolAllocator(64 * 4, 4, kernel="jnp", debug=False)
  size = a.available_size()
  seq = np.array([5, 9])
  with pytest.raises(ValueError, match="last_loc must have shape"):
    a.alloc_decode(seq, None, jnp.zeros((3,), jnp.int32))
  with pytest.raises(TypeError, match="last_loc must hold integers"):
    a.alloc_decode(seq, None, jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match="seq_lens"):  # the host checks still run
    a.alloc_decode(np.array([0, 9]), None, jnp.zeros((2,), jnp.int32))
  assert a.available_size() == size
  # Same slots as with a host last_loc: row 0 continues its page (last_loc + 1), row 1
  # starts one.
  seq = np.array([6, 9])
  host = np.asarray(a.alloc_decode(seq, None, np.array([4, 7])))
  a.clear()
  dev = np.asarray(a.alloc_decode(seq, None, jnp.asarray([4, 7], jnp.int32)))
  assert host[0] == 5
  np.testing.assert_array_equal(host, dev)


def test_gpu_graph_option_only_with_a_gpu(monkeypatch):
  """The fast-path programs ask XLA for CUDA graphs only on a GPU host, and
  JAX_KVALLOC_GPU_GRAPHS=0 turns that off."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.sglang.backends import device as device_ops  # pylint: disable=g-import-not-at-top
  real = jax.devices

  def devices(backend=None):
    if backend == "gpu":
      return ["fake-gpu"]
    return real(backend)
  monkeypatch.delenv("JAX_KVALLOC_GPU_GRAPHS", raising=False)
  if not any(d.platform == "gpu" for d in real()):
    assert device_ops.compiler_options() == {}
  monkeypatch.setattr(jax, "devices", devices)
  assert device_ops.compiler_options() == {"xla_gpu_graph_min_graph_size": 1}
  monkeypatch.setenv("JAX_KVALLOC_GPU_GRAPHS", "0")
  assert device_ops.compiler_options() == {}
