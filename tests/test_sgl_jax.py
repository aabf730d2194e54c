"""The sglang-jax flavour (SPEC 15, jax_kvalloc.sgl_jax) against sglang-jax's own
allocator, loaded by path from ../shared/anchors/sgljax (skipped where it is not), on
random serving-like operation sequences; its misuse refusals; and patch() / unpatch()
and the environment switch on a stand-in sgl_jax package whose allocator module runs
that same file (sglang-jax itself needs Python >= 3.12; its own tests run patched in
benchmarks/sgljax_tests.py)."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jax_kvalloc.sgl_jax as sj
from conftest import REPO
from jax_kvalloc.tools import bench
from jax_kvalloc.tools.bench_classes import DEFAULT_SGLJAX

ANCHOR = DEFAULT_SGLJAX / "sgljax_allocator.py"
needs_anchor = pytest.mark.skipif(not ANCHOR.exists(), reason=f"no {ANCHOR}")


@pytest.fixture(scope="module")
def ref():
  return bench.load_file(str(ANCHOR), "_sgljax_allocator_reference")


def _same(ours, theirs, what):
  assert (ours is None) == (theirs is None), what
  if theirs is not None:
    assert isinstance(ours, np.ndarray) and ours.dtype == np.int32, what
    np.testing.assert_array_equal(ours, theirs, err_msg=what)


class _Requests:
  """Requests of a random trace: each a list of full slots, in token order."""

  def __init__(self, rng):
    self.rng, self.held = rng, []

  def pick(self):
    return self.held.pop(self.rng.integers(len(self.held)))


def _paged_step(rng, ours, theirs, reqs, ps, dp_rank, misuse):
  """One random call on both; returns a label for messages."""
  op = rng.choice(["alloc", "extend", "extend", "decode", "free", "free", "group",
                   "merge", "snap"] + (["double"] if misuse else []))
  if op == "alloc":
    n = int(rng.integers(0, 4)) * ps
    got = (ours.alloc(n, dp_rank), theirs.alloc(n, dp_rank))
    _same(*got, f"alloc({n})")
    if got[1] is not None and n:
      reqs.held.append(list(got[1]))
  elif op in ("extend", "decode") and reqs.held and rng.random() < 0.6:
    req = reqs.pick()
    n = 1 if op == "decode" else int(rng.integers(1, 3 * ps))
    args = ([len(req) + n], [req[-1]]) if op == "decode" else (
        [len(req)], [len(req) + n], [req[-1]], n)
    got = (ours.alloc_decode(*args, dp_rank=dp_rank) if op == "decode"
           else ours.alloc_extend(*args, dp_rank=dp_rank),
           theirs.alloc_decode(*args, dp_rank=dp_rank) if op == "decode"
           else theirs.alloc_extend(*args, dp_rank=dp_rank))
    _same(*got, op)
    reqs.held.append(req + ([] if got[1] is None else list(got[1])))
  elif op == "extend":
    rows = int(rng.integers(1, 4))
    seq = [int(rng.integers(0, 3 * ps)) for _ in range(rows)]
    args = ([0] * rows, seq, [-1] * rows, sum(seq))
    got = (ours.alloc_extend(*args, dp_rank=dp_rank), theirs.alloc_extend(*args,
                                                                          dp_rank=dp_rank))
    _same(*got, "alloc_extend")
    if got[1] is not None:
      cut = np.cumsum(seq)[:-1]
      reqs.held.extend(list(p) for p in np.split(got[1], cut) if len(p))
  elif op == "free" and reqs.held:
    idx = np.asarray(reqs.pick(), np.int32)
    ours.free(idx, dp_rank), theirs.free(idx, dp_rank)
    return ("free", idx)
  elif op == "double" and reqs.held:  # guard=False only: sglang-jax's tolerance
    idx = np.asarray(reqs.pick(), np.int32)
    for _ in range(2):
      ours.free(idx, dp_rank), theirs.free(idx, dp_rank)
  elif op == "group":
    ours.free_group_begin(), theirs.free_group_begin()
    for _ in range(int(rng.integers(0, 3))):
      if reqs.held:
        idx = np.asarray(reqs.pick(), np.int32)
        ours.free(idx, dp_rank), theirs.free(idx, dp_rank)
    assert [len(q) for q in ours.free_group] == [len(q) for q in theirs.free_group]
    ours.free_group_end(), theirs.free_group_end()
  elif op == "merge":
    ours.merge_and_sort_free(dp_rank), theirs.merge_and_sort_free(dp_rank)
  elif op == "snap":  # an allocation undone by restore_state
    s = (ours.backup_state(), theirs.backup_state())
    n = ps * int(rng.integers(1, 3))
    _same(ours.alloc(n, dp_rank), theirs.alloc(n, dp_rank), "alloc before restore")
    ours.restore_state(s[0]), theirs.restore_state(s[1])
  return op


def _lists(a, token):
  if token:
    return [x.tolist() for x in a.free_slots]
  return [x.tolist() for x in a.free_pages] + [x.tolist() for x in a.release_pages]


@needs_anchor
@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("ps,dp_size,guard", [(1, 1, True), (1, 2, False), (4, 1, True),
                                              (4, 2, False), (2, 1, False)])
def test_token_and_paged_match_sglang_jax(ref, backend, ps, dp_size, guard):
  rng = np.random.default_rng(1000 * ps + 10 * dp_size + guard)
  size = 48 * ps * dp_size
  if ps == 1:
    ours = sj.TokenToKVPoolAllocator(size, None, dp_size, backend=backend, guard=guard)
    theirs = ref.TokenToKVPoolAllocator(size, None, dp_size)
  else:
    ours = sj.PagedTokenToKVPoolAllocator(size, ps, None, dp_size=dp_size,
                                          backend=backend, guard=guard)
    theirs = ref.PagedTokenToKVPoolAllocator(size, ps, None, dp_size=dp_size)
  assert ours.size_per_rank == theirs.size_per_rank
  if ps > 1:
    assert (ours.num_pages, ours.pages_per_rank) == (theirs.num_pages, theirs.pages_per_rank)
  reqs = [_Requests(rng) for _ in range(dp_size)]
  for step in range(120):
    r = int(rng.integers(dp_size))
    if ps == 1:  # the token allocator: alloc, free (FIFO), groups
      op = rng.choice(["alloc", "free", "group"])
      if op == "alloc":
        n = int(rng.integers(0, 9))
        got = (ours.alloc(n, r), theirs.alloc(n, r))
        _same(*got, f"step {step}: alloc({n})")
        if got[1] is not None and n:
          reqs[r].held.append(list(got[1]))
      elif reqs[r].held:
        idx = np.asarray(reqs[r].pick(), np.int32)
        if op == "group":
          ours.free_group_begin(), theirs.free_group_begin()
        ours.free(idx, r), theirs.free(idx, r)
        if op == "group":
          ours.free_group_end(), theirs.free_group_end()
    else:
      _paged_step(rng, ours, theirs, reqs[r], ps, r, misuse=not guard)
    assert _lists(ours, ps == 1) == _lists(theirs, ps == 1), f"step {step}"
    assert [ours.available_size(k) for k in range(dp_size)] == [
        theirs.available_size(k) for k in range(dp_size)], f"step {step}"
  ours.clear(), theirs.clear()
  assert _lists(ours, ps == 1) == _lists(theirs, ps == 1)


@needs_anchor
@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("ps,dp_size,guard", [(1, 1, True), (1, 2, False), (4, 1, True),
                                              (4, 2, True), (2, 1, False)])
def test_swa_matches_sglang_jax(ref, backend, ps, dp_size, guard):
  """Random requests through both SWA allocators: results, both pools' sizes and the
  mapping equal until an allocation the SWA pool cannot serve (sglang-jax then frees
  the full side back into release_pages, reordering it; ours takes neither)."""
  rng = np.random.default_rng(7 * ps + dp_size + 100 * guard)
  size, size_swa = 32 * ps * dp_size, 24 * ps * dp_size
  kv = ref.SWAKVPool()
  kv.full_kv_pool = kv.swa_kv_pool = None
  ours = sj.SWATokenToKVPoolAllocator(size, size_swa, None, ps, dp_size, backend=backend,
                                      guard=guard)
  theirs = ref.SWATokenToKVPoolAllocator(size, size_swa, kv, ps, dp_size)
  maps = lambda a: a.full_to_swa_index_mapping
  live = ours.full_to_swa_index_mapping  # the very array the KV pool would hold
  alive = [[] for _ in range(dp_size)]    # (full slots, SWA still mapped)
  for step in range(150):
    r = int(rng.integers(dp_size))
    op = rng.choice(["alloc", "extend", "decode", "free", "free_swa", "group"])
    reqs = alive[r]
    got = None
    if op == "alloc" or (op in ("extend", "decode") and ps == 1):
      n = int(rng.integers(0, 5)) * ps
      got = (ours.alloc(n, r), theirs.alloc(n, r))
      new = (got[1], True)
    elif op in ("extend", "decode"):
      cont = [i for i, (_, mapped) in enumerate(reqs) if mapped]
      if cont and rng.random() < 0.6:
        slots, _ = reqs.pop(cont[rng.integers(len(cont))])
        n = 1 if op == "decode" else int(rng.integers(1, 2 * ps))
        args = ([len(slots) + n], [int(slots[-1])]) if op == "decode" else (
            [len(slots)], [len(slots) + n], [int(slots[-1])], n)
      else:
        slots, n = np.zeros(0, np.int32), int(rng.integers(1, 3 * ps))
        if op == "decode":
          continue
        args = ([0], [n], [-1], n)
      call = "alloc_decode" if op == "decode" else "alloc_extend"
      got = (getattr(ours, call)(*args, dp_rank=r), getattr(theirs, call)(*args, dp_rank=r))
      new = (None if got[1] is None else np.concatenate([slots, got[1]]), True)
      if got[1] is None and len(slots):
        reqs.append((slots, True))
    elif op in ("free", "free_swa") and reqs:
      i = int(rng.integers(len(reqs)))
      slots, mapped = reqs.pop(i)
      if op == "free":
        ours.free(slots, r), theirs.free(slots, r)
      else:
        ours.free_swa(slots, r), theirs.free_swa(slots, r)
        reqs.append((slots, False))
    elif op == "group":
      ours.free_group_begin(), theirs.free_group_begin()
      for _ in range(min(len(reqs), int(rng.integers(0, 3)))):
        slots, _ = reqs.pop(0)
        ours.free(slots, r), theirs.free(slots, r)
      ours.free_group_end(), theirs.free_group_end()
    if got is not None:
      _same(*got, f"step {step}: {op}")
      if got[1] is None:
        break  # sglang-jax may have rolled its full side back out of order: stop here
      if len(new[0]):
        reqs.append(new)
    for k in range(dp_size):
      assert ours.full_available_size(k) == theirs.full_available_size(k), f"step {step}"
      assert ours.swa_available_size(k) == theirs.swa_available_size(k), f"step {step}"
      np.testing.assert_array_equal(
          maps(ours)[k] if dp_size > 1 else maps(ours),
          maps(theirs)[k] if dp_size > 1 else maps(theirs), err_msg=f"step {step}")
      held = [s for s, m in alive[k] if m]
      if held:
        cat = np.concatenate(held)
        assert ours.count_swa_mapped(cat, k) == theirs.count_swa_mapped(cat, k) == cat.size
  assert ours.full_to_swa_index_mapping is live
  assert kv.full_to_swa_index_mapping is theirs.full_to_swa_index_mapping


@pytest.mark.parametrize("backend", ["host", "device"])
def test_guard_refuses_frees_of_pages_not_held(backend):
  """Guard on: a page freed twice raises ValueError naming it, nothing freed (at once
  on the host; at check() or within 8 calls on the device); guard=False drops it."""
  a = sj.PagedTokenToKVPoolAllocator(64, 4, backend=backend)
  x = a.alloc(8)
  a.free(x)
  before = (a.free_pages[0].tolist(), a.release_pages[0].tolist())
  with pytest.raises(ValueError, match=r"free: page 1 is not held"):
    a.free(x[:1])
    a.check()
  a.clear()
  assert a.available_size() == 64
  t = sj.TokenToKVPoolAllocator(8, backend=backend)
  with pytest.raises(ValueError, match=r"page 3 is not held"):
    t.free(np.array([3], np.int32))
    t.check()
  loose = sj.PagedTokenToKVPoolAllocator(64, 4, backend=backend, guard=False)
  y = loose.alloc(8)
  loose.free(y), loose.free(y), loose.free(np.array([40], np.int32))  # 40: page 10, free
  assert (loose.free_pages[0].tolist(), loose.release_pages[0].tolist()) == before
  s = sj.SWATokenToKVPoolAllocator(16, 8, backend=backend)
  z = s.alloc(4)
  s.free_swa(z), s.free_swa(z)  # twice: the second finds no peer, a no-op
  s.free(z)  # the tombstone path: full slots whose SWA peers are gone
  s.check()
  assert (s.full_available_size(), s.swa_available_size()) == (16, 8)
  with pytest.raises(ValueError, match="not held"):
    s.free(z)
    s.check()


def test_bad_input_names_the_argument_and_changes_nothing():
  a = sj.PagedTokenToKVPoolAllocator(64, 4)
  with pytest.raises(ValueError, match="dp_rank"):
    a.alloc(4, dp_rank=1)
  with pytest.raises(ValueError, match="need_size"):
    a.alloc(3)
  s = sj.SWATokenToKVPoolAllocator(32, 16, page_size=4)
  full = s.alloc(4)
  snap = (s.full_available_size(), s.swa_available_size(),
          s.full_to_swa_index_mapping.copy())
  with pytest.raises(ValueError):
    s.alloc_extend([4], [6], [int(full[-1]) - 1], 2)  # last_loc out of line
  assert (s.full_available_size(), s.swa_available_size()) == snap[:2]
  np.testing.assert_array_equal(s.full_to_swa_index_mapping, snap[2])
  with pytest.raises(NotImplementedError):
    sj.SWATokenToKVPoolAllocator(8, 8).alloc_extend([0], [1], [-1], 1)


# -- patch() / unpatch() and the environment switch, on a stand-in sgl_jax ----------------
def _standin(root: pathlib.Path) -> pathlib.Path:
  """sgl_jax/srt/mem_cache/allocator.py running the anchor file, and a module that
  imported its classes by name before any patch (as schedule_batch.py does)."""
  mem = root / "sgl_jax" / "srt" / "mem_cache"
  mem.mkdir(parents=True)
  for d in (root / "sgl_jax", root / "sgl_jax" / "srt", mem):
    (d / "__init__.py").write_text("")
  (mem / "allocator.py").write_text(
      f"exec(compile(open({str(ANCHOR)!r}).read(), {str(ANCHOR)!r}, 'exec'))\n")
  (root / "sgl_jax" / "srt" / "user.py").write_text(
      "from sgl_jax.srt.mem_cache.allocator import SWATokenToKVPoolAllocator\n"
      "from sgl_jax.srt.mem_cache import allocator as alloc_mod\n"
      "def build(kv):\n"
      "  return SWATokenToKVPoolAllocator(16, 8, kv, page_size=4)\n")
  return root


@needs_anchor
def test_patch_replaces_every_name_and_unpatch_restores(tmp_path, monkeypatch):
  if sj.patched() is not None:
    pytest.skip("a patch is in force in this process")
  monkeypatch.syspath_prepend(str(_standin(tmp_path)))
  for name in list(sys.modules):
    if name == "sgl_jax" or name.startswith("sgl_jax."):
      monkeypatch.delitem(sys.modules, name)
  import sgl_jax.srt.user as user  # pylint: disable=g-import-not-at-top
  mod = user.alloc_mod
  originals = {n: getattr(mod, n) for n in ("TokenToKVPoolAllocator",
                                            "PagedTokenToKVPoolAllocator",
                                            "SWATokenToKVPoolAllocator")}
  try:
    assert sj.patch(backend="host", guard=False) is True
    assert sj.patch(backend="host", guard=False) is False  # the same again: a no-op
    with pytest.raises(RuntimeError, match="already patched"):
      sj.patch(backend="device")
    assert sj.patched() == ("host", False)
    kv = mod.SWAKVPool()
    kv.full_kv_pool = kv.swa_kv_pool = None
    built = user.build(kv)
    assert kv.full_to_swa_index_mapping is built.full_to_swa_index_mapping
    assert user.SWATokenToKVPoolAllocator is mod.SWATokenToKVPoolAllocator
    assert isinstance(built, originals["SWATokenToKVPoolAllocator"])
    assert isinstance(built, mod.BaseTokenToKVPoolAllocator)
    assert isinstance(built, sj.SWATokenToKVPoolAllocator)
    assert isinstance(built.full_attn_allocator, originals["PagedTokenToKVPoolAllocator"])
    assert built.full_attn_allocator.backend == "host"
    assert not built.full_attn_allocator.config.guard
    paged = mod.PagedTokenToKVPoolAllocator(64, 4, None)
    assert isinstance(paged.alloc(8), np.ndarray)
  finally:
    assert sj.unpatch() is True
  assert sj.unpatch() is False and sj.patched() is None
  for name in [n for n in sys.modules if n == "sgl_jax" or n.startswith("sgl_jax.")]:
    monkeypatch.delitem(sys.modules, name)  # the stand-in leaves with its path
  for n, cls in originals.items():
    assert getattr(mod, n) is cls
  assert user.SWATokenToKVPoolAllocator is originals["SWATokenToKVPoolAllocator"]


def test_patch_without_sgl_jax_changes_nothing(monkeypatch):
  if sj.patched() is not None:
    pytest.skip("a patch is in force in this process")
  for name in [n for n in sys.modules if n.startswith("sgl_jax.")] + ["sgl_jax"]:
    monkeypatch.setitem(sys.modules, name, None)  # importing sgl_jax fails
  with pytest.raises(ImportError, match="needs sglang-jax"):
    sj.patch()
  assert sj.patched() is None
  with pytest.raises(ValueError, match="backend"):
    sj.patch(backend="gpu")


@needs_anchor
def test_environment_switch(tmp_path):
  """The .pth: with JAX_KVALLOC_SGL_JAX unset it imports nothing (no jax); set, the
  interpreter starts patched."""
  site = tmp_path / "site"
  site.mkdir()
  from jax_kvalloc.sgl_jax.__main__ import install_pth  # pylint: disable=g-import-not-at-top
  install_pth(str(site))
  standin = _standin(tmp_path / "standin")
  code = ("import site, sys; site.addsitedir(sys.argv[1]); "
          "print('jax' in sys.modules, 'jax_kvalloc' in sys.modules); "
          "import jax_kvalloc.sgl_jax as s; print(s.patched())")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_KVALLOC_SGL_JAX")}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(standin)])
  run = lambda e: subprocess.run([sys.executable, "-c", code, str(site)], env=e,
                                 capture_output=True, text=True, check=True).stdout.split()
  assert run(env) == ["False", "False", "None"]
  got = run(dict(env, JAX_KVALLOC_SGL_JAX="device", JAX_KVALLOC_SGL_JAX_GUARD="0"))
  assert got == ["True", "True", "('device',", "False)"]


@needs_anchor
def test_pytest_plugin_fails_a_test_that_ends_with_a_pending_refusal(tmp_path):
  """On the device backend a double free is refused on the device and raised later; a
  test that ends before that fails through jax_kvalloc.sgl_jax.pytest_check."""
  standin = _standin(tmp_path / "standin")
  (tmp_path / "test_user.py").write_text(
      "from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator\n"
      "def _run(frees):\n"
      "  a = PagedTokenToKVPoolAllocator(64, 4, None)\n"
      "  x = a.alloc(4)\n"
      "  for _ in range(frees):\n"
      "    a.free(x)\n"
      "def test_double_free():\n"
      "  _run(2)\n"
      "def test_single_free():\n"
      "  _run(1)\n")
  code = ("import sys, jax_kvalloc.sgl_jax as s; s.patch(backend='device'); import pytest; "
          "sys.exit(pytest.main(sys.argv[1:]))")
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_KVALLOC_SGL_JAX")}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(standin)])
  out = subprocess.run([sys.executable, "-c", code, "test_user.py", "-q", "-p",
                        "no:cacheprovider", "-p", "jax_kvalloc.sgl_jax.pytest_check"],
                       cwd=tmp_path, env=env, capture_output=True, text=True).stdout
  assert "1 failed, 1 passed" in out, out
  assert "test_double_free" in out and "page 1 is not held" in out, out
