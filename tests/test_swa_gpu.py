"""The SWA allocator (SPEC 13) on a CUDA GPU: lock-step random traces of the functional
core (kernel="auto": the pools' Pallas paths) and of the device-backend class against the
SPEC 13 model, and against SGLang 0.5.23's released class on CUDA when it imports (from
the bundle of benchmarks/sglang_bundle.sh where sglang is not installed)."""
import pytest

from gpu import needs_gpu
from swa_impls import ClassImpl, CoreImpl, SGLangImpl
from swa_trace import run_trace

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("ps,need_sort", [(16, False), (16, True), (1, False)])
def test_swa_traces_on_gpu(ps, need_sort):
  from jax_kvalloc.tools import sglang_oracle  # pylint: disable=g-import-not-at-top
  c = dict(size=32 * ps, size_swa=14 * ps, ps=ps)
  core = CoreImpl(c["size"], c["size_swa"], ps, need_sort, kernel="auto")
  run_trace([core], need_sort=need_sort, steps=200, seed=ps, groups=False, **c)
  impls = [ClassImpl(c["size"], c["size_swa"], ps, need_sort, "device", device=None,
                     kernel_auto=True)]
  if sglang_oracle.import_error() is not None:
    sglang_oracle.use_bundle()
  if sglang_oracle.import_error() is None:
    impls.append(SGLangImpl(c["size"], c["size_swa"], ps, need_sort, device="cuda"))
  run_trace(impls, need_sort=need_sort, steps=200, seed=ps + 1, **c)
