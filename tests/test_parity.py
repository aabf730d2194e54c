"""torch_ref (torch + Triton) and cross-implementation parity with jax_kvalloc, the model
and, when installed, SGLang itself.

In-process tests use torch_ref's plain-torch path. Everything that runs Triton (its CPU
interpreter can kill the process on a bad load) goes through a subprocess: the parity
command, or tests/triton_kernel_check.py.
"""
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch_ref needs torch (pip install torch)")

import torch_ref  # noqa: E402  pylint: disable=g-import-not-at-top
from jax_kvalloc.tools import traces  # noqa: E402
from jax_kvalloc.tools import parity  # noqa: E402
from jax_kvalloc.tools import sglang_oracle  # noqa: E402
from trace_helpers import model_factory  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
try:
  import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  HAS_TRITON = True
except ImportError:
  HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
SGLANG_ERROR = sglang_oracle.import_error()


def _paged(size=64, ps=4, need_sort=False):
  return torch_ref.PagedTokenToKVPoolAllocator(size, ps, need_sort=need_sort, kernel="torch")


def _t(xs):
  return torch.tensor(xs, dtype=torch.int64)


def _extend(a, pre, seq, last):
  return a.alloc_extend(_t(pre), _t(pre), _t(seq), _t(seq), _t(last),
                        sum(s - p for p, s in zip(pre, seq)))


# -- torch_ref on SPEC's worked examples (plain-torch path) --------------------------------

def test_spec_examples():
  a = _paged()
  assert _extend(a, [2], [11], [1]).tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10]
  assert a.free_pages[:2].tolist() == [3, 4]
  assert _extend(_paged(), [0], [3], [-1]).tolist() == [4, 5, 6]
  a = _paged()
  a.alloc(8)
  assert a.alloc_decode(_t([12, 13]), _t([12, 13]), _t([10, 11])).tolist() == [11, 12]
  for need_sort, free, release in ((True, [3, 4], [1, 2]), (False, [1, 2, 3, 4], [])):
    a = _paged(16, 4, need_sort)
    a.free(a.alloc(8))
    assert (a.free_pages.tolist(), a.release_pages.tolist()) == (free, release)


def test_failure_leaves_state_and_exact_capacity_fits():
  a = _paged(16, 4)
  a.alloc(4)
  before = a.free_pages.tolist()
  assert _extend(a, [0, 0], [8, 5], [-1, -1]) is None        # 4 pages, 3 free
  assert a.free_pages.tolist() == before
  assert _extend(a, [0, 0], [8, 4], [-1, -1]).tolist() == (
      [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
  assert a.available_size() == 0
  assert a.alloc_decode(_t([5]), None, _t([19])) is None
  assert a.alloc_decode(_t([3]), None, _t([13])).tolist() == [14]   # no page needed


def test_need_sort_merges_only_on_shortfall():
  a = _paged(32, 4, need_sort=True)
  x = a.alloc(16)
  a.free(x[4:8])
  a.free(x[:4])
  assert a.release_pages.tolist() == [1, 2] and len(a.free_pages) == 4
  assert a.alloc(16).tolist() == list(range(20, 36))                  # no merge needed
  assert a.alloc(4).tolist() == [4, 5, 6, 7]                          # merge, sorted
  assert a.release_pages.tolist() == [] and a.free_pages.tolist() == [2]


def test_token_allocator_is_fifo_without_dedup():
  a = torch_ref.TokenToKVPoolAllocator(8)
  a.alloc(5)
  a.free(_t([3, 1, 3]))
  assert a.free_pages.tolist() == [6, 7, 8, 3, 1, 3]
  with pytest.raises(NotImplementedError):
    a.alloc_extend()


def test_free_group_dedups_and_copies_queued_indices():
  a = _paged(32, 4)
  x = a.alloc(12)
  buf = x[:6].clone()
  a.free_group_begin()
  a.free(buf)
  a.free(x[4:5])
  buf[:] = 28           # a later write to the caller's buffer must not change the free
  assert a.free_pages.tolist() == [4, 5, 6, 7, 8]
  with pytest.raises(RuntimeError, match="already open"):
    a.free_group_begin()
  a.free_group_end()
  assert a.free_pages.tolist() == [1, 2, 4, 5, 6, 7, 8]


def test_snapshot_survives_allocs_frees_and_merges():
  a = _paged(32, 4, need_sort=True)
  a.free(a.alloc(8))
  snap = a.backup_state()
  want = (a.free_pages.tolist(), a.release_pages.tolist())
  a.alloc(24)
  a.free(_t([4, 30]))
  a.merge_and_sort_free()
  a.restore_state(snap)
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == want


def test_paged_decode_at_page_size_one_takes_a_page_per_request():
  a = torch_ref.PagedTokenToKVPoolAllocator(8, 1, kernel="torch")
  assert a.alloc_decode(_t([4, 9]), None, _t([0, 0])).tolist() == [1, 2]
  assert a.free_pages.tolist() == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("call, message", [
    (lambda a: a.alloc(3), "multiple of page_size=4"),
    (lambda a: a.free(_t([2])), "not an allocatable slot"),
    (lambda a: a.free(_t([68])), "not an allocatable slot"),
    (lambda a: _extend(a, [5], [4], [4]), "prefix_lens <= seq_lens"),
    (lambda a: a.alloc_extend(_t([0]), None, _t([4]), None, _t([-1]), 3),
     "extend_num_tokens=3"),
    (lambda a: a.alloc_decode(_t([0]), None, _t([3])), "must be >= 1"),
    (lambda a: a.alloc_decode(_t([2, 3]), None, _t([3])), "differ in length"),
    (lambda a: a.free(torch.tensor([4.0])), "must hold integers"),
])
def test_bad_input_raises_and_keeps_state(call, message):
  a = _paged()
  before = (a.free_pages.tolist(), a.release_pages.tolist())
  with pytest.raises((ValueError, TypeError), match=message):
    call(a)
  assert (a.free_pages.tolist(), a.release_pages.tolist()) == before


def test_kernel_choice():
  assert _paged().kernel == "torch"
  auto = torch_ref.PagedTokenToKVPoolAllocator(16, 4)
  assert auto.kernel == ("triton" if os.environ.get("TRITON_INTERPRET") == "1"
                         and HAS_TRITON else "torch")
  with pytest.raises(ValueError, match="kernel must be one of"):
    torch_ref.PagedTokenToKVPoolAllocator(16, 4, kernel="cuda")


# -- replay and lock step in process (torch path, the model, SGLang) -----------------------

def _torch_impl():
  return parity.torch_impl("torch", "cpu")


def _model_impl():
  return parity.Impl("model", traces.Replayer(model_factory))


def test_torch_ref_replays_golden_traces(golden_path):
  by_id = traces.read(str(golden_path))
  stats = parity.Stats()
  for records in by_id.values():
    parity.replay_trace(records, [_torch_impl(), _model_impl()], stats)
  assert stats.traces == 40 and stats.recorded == stats.steps > 2000


def test_lock_step_torch_model_sglang():
  impls = [_torch_impl(), _model_impl()]
  if SGLANG_ERROR is None:
    impls.append(parity.sglang_impl("cpu"))
  stats = parity.Stats()
  for seed in range(200, 224):
    parity.run_generated(traces.random_config(seed, steps=150), impls, stats)
  assert stats.steps > 3500 and stats.failed_allocs > 50 and stats.shortfall_merges > 50
  assert stats.compared["model"] == stats.steps


class _OffByOne(torch_ref.PagedTokenToKVPoolAllocator):
  """Hands out last_loc + 2 instead of last_loc + 1 for a decode inside a page."""

  def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
    out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
    if out is not None:
      out = torch.where(out == torch.as_tensor(last_loc) + 1, out + 1, out)
    return out


def test_lock_step_reports_a_broken_implementation():
  def make(size, page_size, need_sort, kind):
    return _OffByOne(size, page_size, need_sort=need_sort, kernel="torch")
  broken = parity.Impl("broken", traces.Replayer(make, parity._torch_array("cpu")))
  with pytest.raises(parity.ParityMismatch) as e:
    for seed in (1, 2, 3):   # paged traces
      parity.run_generated(traces.random_config(seed, steps=150), [_model_impl(), broken])
  msg = str(e.value)
  assert "step" in msg and "(alloc_decode" in msg and "broken vs model" in msg
  assert "result: first differing index" in msg
  assert e.value.records[-1]["op"] == "alloc_decode"


# -- the parity command, in subprocesses ----------------------------------------------------

def _run(args, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TRITON_INTERPRET", None)
  proc = subprocess.run([sys.executable, "-m", "jax_kvalloc", "parity", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout + proc.stderr


def _ok(rc, out, min_steps):
  assert rc == 0, out[-3000:]
  summary = next(line for line in out.splitlines() if line.startswith("parity OK"))
  steps = int(summary.split(" traces, ")[1].split(" steps")[0])
  assert steps >= min_steps, summary
  return summary


# Seeds 300.. draw every page size (1 token and paged, 4, 16, 64), need_sort on and off.
GEN = ["--generate", "6", "--seed", "300", "--steps", "48", "--quiet"]


def test_cli_lock_step_parity():
  """~290 steps of jax_kvalloc (jnp) against torch_ref with its Triton kernels in
  Triton's interpreter (when triton is installed) and its plain-torch path, and against
  SGLang (when installed), in one lock-step run."""
  kernels = "triton,torch" if HAS_TRITON else "torch"
  rc, out = _run(GEN + ["--torch-kernel", kernels])
  summary = _ok(rc, out, 270)
  assert "torch_ref[torch, cpu]" in summary
  assert HAS_TRITON == ("torch_ref[triton, cpu]" in summary)
  assert (SGLANG_ERROR is None) == ("sglang" in summary)


@needs_triton
def test_cli_triton_interpreter_replays_golden(golden_path):
  rc, out = _run([str(golden_path), "--impls", "torch", "--torch-kernel", "triton",
                  "--quiet"] + (["--sglang", "on"] if SGLANG_ERROR is None else []))
  summary = _ok(rc, out, 2600)
  assert "matched the recorded results of 2656 steps" in summary


@needs_triton
def test_triton_kernels_against_torch_path():
  """Random batches (long extends over several loop blocks, large batches, exact and
  short free lists) through the Triton kernels in the interpreter, in a subprocess."""
  env = dict(os.environ, TRITON_INTERPRET="1",
             PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, str(REPO / "tests" / "triton_kernel_check.py")],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_cli_reports_first_mismatch_and_saves_trace(tmp_path):
  """A trace whose recorded result is off by 4 at one index: exit 1, the report names
  the step and the index, and --write keeps the trace up to the mismatch."""
  recs = traces.generate(traces.random_config(1, steps=60), traces.Replayer(model_factory),
                         trace_id=1)
  step = next(i for i, r in enumerate(recs) if r["op"] == "alloc_extend" and r["result"])
  recs[step]["result"][1] += 4
  path = tmp_path / "bad.jsonl"
  traces.write(str(path), recs)
  out_path = tmp_path / "so_far.jsonl"
  rc, out = _run([str(path), "--impls", "torch", "--torch-kernel", "torch", "--sglang",
                  "off", "--write", str(out_path)])
  assert rc == 1, out
  assert f"MISMATCH trace 1 step {step} (alloc_extend" in out
  assert "vs the trace: result: first differing index 1" in out
  assert len(traces.read(str(out_path))[1]) == step + 1


def test_cli_rejects_bad_trace_file(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"trace": 0, "op": "alloc"}\n')
  rc, out = _run([str(path), "--impls", "torch", "--sglang", "off"])
  assert rc == 2 and "missing args ['need_size']" in out


@pytest.mark.skipif(SGLANG_ERROR is not None, reason=f"SGLang oracle: {SGLANG_ERROR}")
def test_sglang_oracle_emulates_snapshots():
  a = sglang_oracle.SGLangAllocator(32, 4, True, "paged")
  a.free(a.alloc(8))
  snap = a.backup_state()
  want = (a.free_pages.tolist(), sorted(a.release_pages.tolist()))
  a.alloc(24)
  a.merge_and_sort_free()
  a.restore_state(snap)
  assert (a.free_pages.tolist(), sorted(a.release_pages.tolist())) == want


# -- GPU ------------------------------------------------------------------------------------

def _gpu_kernel():
  try:
    import pallas_kernels  # pylint: disable=g-import-not-at-top
    return "pallas" if hasattr(pallas_kernels, "extend_indices") else "jnp"
  except ImportError:
    return "jnp"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_parity_long_traces():
  """Real Triton on CUDA, jax_kvalloc's Pallas kernel on the GPU, long traces."""
  rc, out = _run(["--generate", "4", "--seed", "1000", "--steps", "2500", "--device",
                  "cuda", "--kernel", _gpu_kernel(), "--torch-kernel", "triton,torch",
                  "--scale", "long", "--quiet"], timeout=3000)
  assert "torch_ref[triton, cuda" in _ok(rc, out, 10000)
