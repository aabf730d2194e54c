#!/usr/bin/env bash
# The accelerator run behind BENCHMARKS.md, on a 2-GPU machine (one GPU each, in parallel;
# on one GPU set GPU1=0):
#   GPU 0: `jax-kvalloc bench` microbenchmarks of decode and extend: Pallas (linked and
#          bare), jnp, torch_ref and SGLang's released kernels side by side; JSON + plot;
#   GPU 1: the GPU tests (tests/test_pallas_gpu.py), a check that kernel="auto" compiles
#          to one branch on the GPU, then `bench --ops free --extra-consumer` and the
#          serving loop (`bench --no-micro`).
# EXTRA=--extra-consumer adds the one-more-consumer check to GPU 0's run (it then needs
# about 530 s). SGLang's kernels file is not in the repository: pass its path (an ignored
# folder that travels with the run), e.g. SGLANG_KERNELS=.sglang_kernels/allocator.py.
# Writes into $OUT (default benchmarks/out). Run from the repository root:
#   SGLANG_KERNELS=.sglang_kernels/allocator.py bash benchmarks/run_device.sh
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch
PY=${PYTHON:-python3}
SGL=${SGLANG_KERNELS:+--sglang-kernels $SGLANG_KERNELS}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $PY -c "import sys, jax, jaxlib, torch, triton; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, \
'triton', triton.__version__, jax.devices())" 2>&1
  [ -n "${SGLANG_KERNELS:-}" ] && cat "$(dirname "$SGLANG_KERNELS")/VERSION" 2>/dev/null
} > "$OUT/machine.txt"
( CUDA_VISIBLE_DEVICES=${GPU0:-0} timeout "${BENCH_TIMEOUT:-500}" $PY -m jax_kvalloc bench \
    --no-progress --ops decode,extend --no-serving --bare ${EXTRA:-} $SGL \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  echo "bench exit $?" >> "$OUT/bench.txt" ) &
BENCH=$!
(
  export CUDA_VISIBLE_DEVICES=${GPU1:-1}
  $PY - <<'PY' 2>&1
import functools, jax, jax.numpy as jnp
import jax_kvalloc as kv
cfg = kv.AllocatorConfig(size=64 * 16, page_size=16, kernel="auto", debug=False)
rows = jnp.ones((8,), jnp.int32)
hlo = jax.jit(functools.partial(kv.alloc_decode, cfg)).lower(
    kv.init(cfg), rows + 1, rows).compile().as_text()
print("auto on GPU: conditional in compiled HLO:", "conditional" in hlo,
      "| triton custom calls:", hlo.count("__gpu$xla.gpu.triton"))
PY
  timeout "${TESTS_TIMEOUT:-200}" $PY -m pytest -q -m gpu -x -p no:cacheprovider \
    tests/test_pallas_gpu.py 2>&1 | tail -n 15
  echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout "${FREE_TIMEOUT:-120}" $PY -m jax_kvalloc bench --no-progress --ops free \
    --paths jnp,torch --no-serving --extra-consumer --json "$OUT/bench_free.json" 2>&1 | \
    tail -n 16
  timeout "${SERVING_TIMEOUT:-150}" $PY -m jax_kvalloc bench --no-progress --no-micro \
    --json "$OUT/bench_serving.json" 2>&1 | tail -n 16
) > "$OUT/gpu1.txt" 2>&1
wait $BENCH
cat "$OUT/machine.txt"
cat "$OUT/gpu1.txt"
tail -n 60 "$OUT/bench.txt"
