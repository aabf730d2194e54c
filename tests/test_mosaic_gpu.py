"""The Mosaic GPU kernels (pallas_kernels.mosaic_gpu_*) and kernel="auto" on a GPU
without Pallas' Triton backend.

- CPU: each kernel in jax's Mosaic GPU interpreter against the jnp path, bit for bit on
  fresh random inputs (tests/test_pallas_alloc.check_alloc_decode, tests/
  test_table_kernels.check_table_ops: poisoned dead entries, refusals of every kind), the
  ownership record (SPEC 14: held, and the status of a refused release of a broken
  table) included, and
  lowered for an abstract H200 (jax.export) so that what Mosaic GPU's lowering rejects
  fails here. jax < 0.11 cannot build them (skipped; "auto" then never picks them).
- The selection: with Triton made unusable, "auto" on a GPU picks Mosaic GPU for
  alloc_decode, release_decode and the table, XLA for the rest, and says so once; the
  allocator, the request table and a class run that way (lowered for an abstract H200,
  and run on CPU under kernels.simulated_gpu with each kernel in its interpreter).
- GPU (pytest -m gpu, H100/H200 and newer): the compiled kernels against the jnp path.
"""
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs
import pallas_kernels
from jax_kvalloc import kernels
from jax_kvalloc import request_table as rt
from pallas_kernels import mosaic_gpu_common
from pallas_kernels import mosaic_gpu_decode
from pallas_kernels import mosaic_gpu_table
from gpu import has_gpu
import lowering_check
from model import ModelAllocator
from test_pallas_alloc import check_alloc_decode, check_classes_follow_the_model
import test_table_kernels as ttk

i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
MOSAIC = "mosaic_gpu_v2"           # the custom call of a Mosaic GPU kernel
TRITON = lowering_check.TRITON_CUSTOM_CALL
needs_mosaic_gpu = pytest.mark.skipif(
    not mosaic_gpu_common.available(),
    reason=f"jax {jax.__version__} cannot build the Mosaic GPU kernels (jax >= 0.11 can)")


def _interpreter_runs_warp_code() -> bool:
  """jax 0.11 and 0.12's interpreter runs plgpu.warp_map; 0.10's does not."""
  return mosaic_gpu_common.available()


needs_interpreter = pytest.mark.skipif(
    not _interpreter_runs_warp_code(),
    reason=f"jax {jax.__version__}'s Mosaic GPU interpreter cannot run these kernels")


@pytest.fixture
def no_triton(monkeypatch):
  """Pallas' Triton backend made unusable for kernels.usable (as if jax removed it)."""
  monkeypatch.setattr(kernels, "_triton_problem", lambda: "removed (test)")
  kernels._say_fallback.cache_clear()  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------
# alloc_decode.
# ---------------------------------------------------------------------------------------

def _decode_kernel_case(rng, b, ps, n):
  """Inputs of alloc_decode_mosaic_gpu with bad rows (seq 0) and short pools drawn."""
  ring = (rng.permutation(n) + 1).astype(np.int32)
  head = np.int32(rng.integers(0, n))
  flen = np.int32(n if rng.random() < 0.5 else rng.integers(0, n + 1))
  seq = rng.integers(1, 5 * ps + 3, b).astype(np.int32)
  if rng.random() < 0.2:
    seq[rng.integers(0, b)] = 0
  last = rng.integers(0, 10_000, b).astype(np.int32)
  return ring, head, flen, np.int32(rng.integers(0, b + 2)), seq, last


def _decode_reference(ps, ring, head, flen, nreq, seq, last, held=None):
  """alloc_decode on the jnp path: (slots, head, length, ok), and with `held` (the
  ownership record's held pages before the call) held after it."""
  cfg = kv.AllocatorConfig(size=ring.shape[0] * ps, page_size=ps, kernel="jnp", debug=False,
                           guard=held is not None)
  state = kv.init(cfg)._replace(free_ring=jnp.asarray(ring), free_head=jnp.asarray(head),
                                free_len=jnp.asarray(flen))
  if held is not None:
    state = state._replace(guard=state.guard._replace(held=jnp.asarray(held)))
  s, out, ok = kv.alloc_decode(cfg, state, seq, last, num_reqs=nreq)
  return (out, s.free_head, s.free_len, ok) + (() if held is None else (s.guard.held,))


def _held_case(rng, n):
  """A held record (i32[n + 1] of 0 and 1) to be marked: any values the call must keep."""
  return rng.integers(0, 2, n + 1).astype(np.int32)


@needs_interpreter
@pytest.mark.parametrize("rows,ps", [(130, 3)] + [
    pytest.param(r, ps, marks=pytest.mark.slow) for r, ps in ((5, 1), (37, 16))])
def test_alloc_decode_kernel_in_interpreter(rows, ps):
  # One program below 128 rows; several (the vector counting pass) from 128 on. With the
  # ownership record (held marked in the same launch; guard.take), and without.
  rng = np.random.default_rng([rows, ps, np.random.SeedSequence().entropy % 2**32])
  for i in range(1 if rows == 130 else 3):
    args = _decode_kernel_case(rng, rows, ps, 3 * rows // 2 + 8)
    held = _held_case(rng, args[0].shape[0]) if i % 2 == 0 else None
    got = pallas_kernels.alloc_decode_mosaic_gpu(*args, page_size=ps, interpret=True,
                                                 held=held)
    want = _decode_reference(ps, *args, held=held)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_interpreter
@pytest.mark.slow  # the interpreter, vmapped over pools
def test_alloc_decode_behind_the_allocator_in_interpreter():
  check_alloc_decode(4, "mosaic_gpu_interpret", num_cases=4, model_cases=2, seed=21)


@needs_mosaic_gpu
@pytest.mark.parametrize("rows,ps", [(1, 64), (130, 3), pytest.param(16384, 1,
                                                                     marks=pytest.mark.slow)])
def test_alloc_decode_lowers_for_h200(rows, ps):
  # With the ownership record's held pages (written in place: one operand alias more,
  # no launch more) and without.
  n = 100_000
  for held in ((), (i32(n + 1),)):
    fn = lambda *a: pallas_kernels.alloc_decode_mosaic_gpu(
        *a[:6], page_size=ps, held=a[6] if held else None)
    e = lowering_check.export_for("h200", fn, i32(n), i32(), i32(), i32(), i32(rows),
                                  i32(rows), *held)
    assert lowering_check.custom_call_targets(e) == [MOSAIC]
    assert e.mlir_module().count("#stablehlo.output_operand_alias<") == len(held)
  q, g = mosaic_gpu_decode.layout(rows)
  assert 4 * q * g >= rows and (g == 1) == (rows < 128)


# ---------------------------------------------------------------------------------------
# The request table's step.
# ---------------------------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("ps,ops,count", [(4, ("step",), 2)] + [
    pytest.param(ps, ttk.ALL_OPS, 8, marks=pytest.mark.slow) for ps in (1, 3, 64)])
def test_table_kernel_in_interpreter(ps, ops, count):
  # The default case runs the whole step (release, extend, decode) on 2 random cases,
  # the first a release that the ownership record refuses (a broken table: SPEC 14);
  # both outcomes of every operation are drawn in the GPU test's 64 cases.
  records = {}
  ttk.check_table_ops(ps, 40, 8, 6, count, "mosaic", kernel="mosaic_gpu_interpret",
                      ops=ops, records=records, refused_first=True)
  assert all(records[op] >= 1 for op in ops if op in ttk.RELEASING), (ttk.SEED, records)


@needs_interpreter
@pytest.mark.slow  # two warpgroups: the barriers between the phases
def test_table_kernel_with_two_warpgroups_in_interpreter(monkeypatch):
  monkeypatch.setattr(mosaic_gpu_table, "warpgroups_for", lambda rows: 2)
  ttk.check_table_ops(16, 300, 37, 11, 4, "mosaic-wg2", kernel="mosaic_gpu_interpret",
                      ops=("step",), rel_b=9, ext_b=19, dec_b=37, max_tokens=700)


@needs_mosaic_gpu
@pytest.mark.slow  # test_allocator_and_table_lower_for_h200_without_triton runs by default
@pytest.mark.parametrize("ps,sizes", [
    (3, (37, 11, 9, 19, 700, 37)),
    pytest.param(64, (1024, 21, 8, 8, 2048, 1024), marks=pytest.mark.slow),
    pytest.param(1, (2048, 8, 2048, 256, 2**16, 2048), marks=pytest.mark.slow)])
def test_table_kernel_lowers_for_h200(ps, sizes):
  r, w, rel, ext, tok, dec = sizes
  assert mosaic_gpu_table.supported(max_reqs=r, width=w, num_pages=70000, page_size=ps,
                                    release=rel, extend=ext, max_tokens=tok, decode=dec)

  def fn(ring, scalars, pages, lens, owned, rel_rows, ext_rows, n, dec_rows, num, held,
         status):
    return pallas_kernels.table_step_mosaic_gpu(
        ring, scalars[0], scalars[1], scalars[2], pages, lens, owned, page_size=ps,
        release=(rel_rows, num), extend=(ext_rows, n, num), max_tokens=tok,
        decode=(dec_rows, num), record=(held, status), op=8)

  e = lowering_check.export_for("h200", fn, i32(70000), i32(3), i32(r, w), i32(r), i32(r),
                                i32(rel), i32(ext), i32(ext), i32(dec), i32(), i32(70001),
                                i32(3))
  assert lowering_check.custom_call_targets(e) == [MOSAIC, MOSAIC]  # table work, slots
  # The ring, head, length, pages, lens, owned_from and the record's held and status are
  # written in place (jax.new_ref operands).
  assert e.mlir_module().count("#stablehlo.output_operand_alias<") == 8


# ---------------------------------------------------------------------------------------
# "auto" on a GPU: the best usable family per operation.
# ---------------------------------------------------------------------------------------

def test_auto_on_a_gpu_takes_the_first_usable_family(monkeypatch, caplog):
  monkeypatch.setattr(kernels, "_mosaic_gpu_problem", lambda: None)
  kernels._note_triton.cache_clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.INFO, logger="jax_kvalloc"):
    for op, prefs in kernels.GPU_PREFERENCE.items():
      assert kernels.for_platform("auto", "gpu", op) == prefs[0]
    assert kernels.for_platform("auto", "gpu") == "triton"
  # Our use of the deprecated backend: one note, however often "auto" picks it.
  notes = [r for r in caplog.records if r.name == "jax_kvalloc"]
  assert len(notes) == 1 and notes[0].levelno == logging.INFO, notes
  assert "deprecates that backend" in notes[0].getMessage()
  caplog.clear()
  kernels._say_fallback.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setattr(kernels, "_triton_problem", lambda: "removed (test)")
  with caplog.at_level(logging.INFO, logger="jax_kvalloc"):
    for _ in range(3):  # said once, however often "auto" resolves
      got = {op: kernels.for_platform("auto", "cuda", op) for op in kernels.GPU_PREFERENCE}
  assert got == {op: "mosaic_gpu" if "mosaic_gpu" in prefs else "jnp"
                 for op, prefs in kernels.GPU_PREFERENCE.items()}
  assert got["table"] == "mosaic_gpu"
  said = [r.getMessage() for r in caplog.records if r.name == "jax_kvalloc"]
  assert len(said) == 1 and "Triton backend is not usable here (removed (test))" in said[0]
  assert "table with Mosaic GPU" in said[0] and "alloc_decode" in said[0]
  monkeypatch.setattr(kernels, "_mosaic_gpu_problem", lambda: "old GPU (test)")
  assert {kernels.for_platform("auto", "gpu", op) for op in kernels.GPU_PREFERENCE} == {
      "jnp"}
  kernels._say_fallback.cache_clear()  # pylint: disable=protected-access
  # Explicit names are not second-guessed; the TPU and CPU choices are unchanged.
  assert kernels.for_platform("triton", "gpu") == "triton"
  assert kernels.for_platform("auto", "tpu") == "mosaic"
  assert kernels.for_platform("auto", "cpu") == "jnp"
  assert kernels.family("mosaic_gpu_interpret") == ("mosaic_gpu", True)


def test_triton_is_usable_where_it_lowers():
  # This process's jax ships the backend: the probe lowers a kernel of ours.
  assert kernels._triton_problem() is None  # pylint: disable=protected-access
  assert kernels.usable("mosaic_gpu") == mosaic_gpu_common.available()


def test_no_triton_in_the_environment_makes_auto_fall_back(monkeypatch):
  # JAX_KVALLOC_NO_TRITON=1: Triton unusable whatever jax has (benchmarks/run_device.sh's
  # fallback steps measure that path on a GPU); "0" or unset: the probe decides.
  monkeypatch.setattr(kernels, "_mosaic_gpu_problem", lambda: None)
  try:
    for value, hidden in (("1", True), ("0", False), ("yes", True)):
      monkeypatch.setenv("JAX_KVALLOC_NO_TRITON", value)
      kernels._triton_problem.cache_clear()  # pylint: disable=protected-access
      kernels._say_fallback.cache_clear()  # pylint: disable=protected-access
      assert kernels.usable("triton") is not hidden
      got = {op: kernels.for_platform("auto", "cuda", op) for op in kernels.GPU_PREFERENCE}
      assert got == {op: prefs[0] if not hidden else
                     "mosaic_gpu" if "mosaic_gpu" in prefs else "jnp"
                     for op, prefs in kernels.GPU_PREFERENCE.items()}
      if hidden:
        assert "JAX_KVALLOC_NO_TRITON" in kernels.unavailable("triton", "cuda")
  finally:
    kernels._triton_problem.cache_clear()  # pylint: disable=protected-access
    kernels._say_fallback.cache_clear()  # pylint: disable=protected-access


def _serve(cfg, state, pre, seq, last, dseq, dlast, ids, n):
  state, out, ok = kv.alloc_extend(cfg, state, pre, seq, last, max_tokens=1024, num_reqs=n)
  state, dout, dok = kv.alloc_decode(cfg, state, dseq, dlast, num_reqs=n)
  state, rout, rok = kv.release_and_alloc_decode(cfg, state, ids, dseq, dlast, num_reqs=n)
  state = kv.free(cfg, state, out)
  return state, out, ok, dout, dok, rout, rok


@needs_mosaic_gpu
def test_allocator_and_table_lower_for_h200_without_triton(no_triton):
  cfg = kv.AllocatorConfig(size=4096 * 16, page_size=16, kernel="auto", debug=False)
  state = jax.eval_shape(functools.partial(kv.init, cfg))
  e = lowering_check.export_for("h200", functools.partial(_serve, cfg), state,
                                *[i32(64)] * 5, i32(8), i32())
  targets = lowering_check.custom_call_targets(e)
  mosaic_ops = [op for op in ("alloc_decode", "release_decode")
                if "mosaic_gpu" in kernels.GPU_PREFERENCE[op]]
  assert TRITON not in targets and targets.count(MOSAIC) == len(mosaic_ops)
  table = jax.eval_shape(lambda: rt.init_table(cfg, 64, 20))

  def step(state, table, rel, n, dec):
    return rt.step_rows(cfg, state, table, release=rel, extend=rel, n=n,
                        max_tokens=1024, decode=dec)

  e = lowering_check.export_for("h200", step, state, table, i32(8), i32(8), i32(64))
  assert lowering_check.custom_call_targets(e) == [MOSAIC, MOSAIC]


@needs_interpreter
@pytest.mark.slow  # the interpreters, op by op
def test_allocator_table_and_class_run_on_the_gpu_selection_without_triton(no_triton):
  # "auto" as on a GPU (kernels.simulated_gpu), Triton unusable: the Mosaic GPU kernels
  # (in their interpreter) where they exist, XLA elsewhere; every result as the jnp path.
  ps = 4
  rng = np.random.default_rng(3)
  with kernels.simulated_gpu():
    assert kernels.for_platform("auto", "cpu", "table") == "mosaic_gpu_interpret"
    check_alloc_decode(ps, "auto", num_cases=2, model_cases=2, seed=4)
    refused = ttk.check_table_ops(ps, 40, 8, 6, 4, "auto", kernel="auto",
                                  ops=("decode_step",))
    assert set(refused) == {"decode_step"}
    a = kvs.PagedTokenToKVPoolAllocator(96 * ps, ps, kernel="auto")
    m = ModelAllocator(size=96 * ps, page_size=ps, kind="paged")
    check_classes_follow_the_model(a, m, rng, steps=4, max_bs=6, max_ext=20,
                                   max_page=90)


# ---------------------------------------------------------------------------------------
# The compiled kernels on a GPU (pytest -m gpu; Hopper or newer).
# ---------------------------------------------------------------------------------------

def _hopper() -> bool:
  return has_gpu() and mosaic_gpu_common.available() and kernels.usable("mosaic_gpu")


def on_hopper(fn):
  """Marks a test `gpu` and skips it without a Hopper (or newer) GPU and jax >= 0.11."""
  skip = pytest.mark.skipif(not _hopper(), reason="needs a Hopper or newer GPU and "
                            "jax >= 0.11")
  return pytest.mark.gpu(skip(fn))


@on_hopper
@pytest.mark.parametrize("ps", (3, 64))
def test_compiled_table_kernel_equals_jnp_path(ps):
  records = {}
  refused = ttk.check_table_ops(ps, 40, 8, 6, 64, "mosaic-gpu", kernel="mosaic_gpu",
                                ops=ttk.ALL_OPS, records=records, refused_first=True)
  assert all(0 < k < 64 for k in refused.values()), (ttk.SEED, refused)
  assert all(0 < records[op] < 64 for op in ttk.RELEASING), (ttk.SEED, records)
  # Serving-sized: 1024 decode rows (eight warpgroups), 8 released and extended.
  ttk.check_table_ops(ps, 30000, 1024, 21, 4, "mosaic-gpu-large", kernel="mosaic_gpu",
                      ops=("step", "decode_step"), rel_b=8, ext_b=8, dec_b=1024,
                      max_tokens=8 * 3 * ps + 64)


@on_hopper
@pytest.mark.parametrize("ps", (3, 64))
@pytest.mark.parametrize("rows", (1, 100, 1024, 16384))
def test_compiled_alloc_decode_equals_jnp_path(ps, rows):
  check_alloc_decode(ps, "mosaic_gpu", rows=rows, num_pages=max(96, 2 * rows),
                     num_cases=16, model_cases=2, seed=rows)
  rng = np.random.default_rng([rows, ps, 7])
  fn = jax.jit(functools.partial(pallas_kernels.alloc_decode_mosaic_gpu, page_size=ps))
  for i in range(4):
    args = _decode_kernel_case(rng, rows, ps, 3 * rows // 2 + 8)
    held = _held_case(rng, args[0].shape[0]) if i % 2 == 0 else None
    got, want = fn(*args, held=held), _decode_reference(ps, *args, held=held)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@on_hopper
def test_compiled_scan_of_steps_matches_model():
  ttk.check_scan_of_steps("mosaic_gpu", 60, "scan-mosaic-gpu")



@on_hopper
def test_auto_without_triton_on_gpu(no_triton):
  # The GPU's own selection with Triton gone: Mosaic GPU kernels in the compiled step.
  check_alloc_decode(16, "auto", rows=256, num_pages=600, num_cases=8, model_cases=2,
                     seed=9)
  ttk.check_table_ops(16, 300, 37, 11, 8, "auto-gpu", kernel="auto",
                      ops=("step", "decode_step"), rel_b=9, ext_b=19, dec_b=37,
                      max_tokens=700)
  a = kvs.PagedTokenToKVPoolAllocator(512 * 16, 16, device="cuda", kernel="auto")
  m = ModelAllocator(size=512 * 16, page_size=16, kind="paged")
  check_classes_follow_the_model(a, m, np.random.default_rng(7), steps=30, max_bs=40,
                                 max_ext=200, max_page=500)

