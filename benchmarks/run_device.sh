#!/usr/bin/env bash
# The accelerator run behind BENCHMARKS.md, on a 2-GPU machine: two lanes in parallel,
# one GPU each, then the data-parallel scaling run over both GPUs.
#   GPU 0: `jax-kvalloc bench` decode/extend microbenchmarks (Pallas linked and bare,
#          jnp, torch_ref and SGLang's released kernels side by side, --extra-consumer
#          check), then the free table.
#   GPU 1: the GPU tests (every `-m gpu` test), `demo`, `bench-class` (device backend vs
#          torch_ref's eager class, SGLang's class when importable, host backend and
#          sglang-jax), `bench-table`, `simulate`.
#   Both:  `bench_ranks` at 1 and 2 devices.
# SGLang's kernels file and sglang-jax's allocator are not in the repository: pass their
# paths (ignored folders that travel with the run):
#   SGLANG_KERNELS=.sglang_kernels/allocator.py SGLJAX=.sgljax OUT=$OUT bash benchmarks/run_device.sh
# Each step has its own time limit (the whole run fits in 10 minutes). Writes into $OUT.
set -u
DEST=${OUT:-benchmarks/out}
OUT=$DEST/run   # everything lands here, then one results.tgz in $DEST (few files travel back)
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch
PY=${PYTHON:-python3}
KV="$PY -m jax_kvalloc"
SGL=${SGLANG_KERNELS:+--sglang-kernels $SGLANG_KERNELS}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $PY -c "import sys, jax, jaxlib, torch, triton; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, \
'triton', triton.__version__, jax.devices())" 2>&1
  [ -n "${SGLANG_KERNELS:-}" ] && cat "$(dirname "$SGLANG_KERNELS")/VERSION" 2>/dev/null
  lscpu | grep -E "Model name|^CPU\(s\)" 2>&1
} > "$OUT/machine.txt"
(
  export CUDA_VISIBLE_DEVICES=${GPU0:-0}
  timeout "${BENCH_TIMEOUT:-330}" $KV bench --no-progress --ops decode,extend --no-serving \
    --bare --extra-consumer --min-time 0.03 --reps 3 $SGL --json "$OUT/bench.json" \
    --plot "$OUT/bench.png" ${BENCH_ARGS:-}
  echo "bench exit $?"
  timeout "${FREE_TIMEOUT:-90}" $KV bench --no-progress --ops free --paths jnp,torch \
    --no-serving --extra-consumer --min-time 0.03 --reps 3 --json "$OUT/bench_free.json"
  echo "free exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
LANE0=$!
(
  export CUDA_VISIBLE_DEVICES=${GPU1:-1}
  $PY - <<'PY'
import functools, jax, jax.numpy as jnp
import jax_kvalloc as kv
cfg = kv.AllocatorConfig(size=64 * 16, page_size=16, kernel="auto", debug=False)
rows = jnp.ones((8,), jnp.int32)
hlo = jax.jit(functools.partial(kv.alloc_decode, cfg)).lower(
    kv.init(cfg), rows + 1, rows).compile().as_text()
print("auto on GPU: conditional in compiled HLO:", "conditional" in hlo,
      "| triton custom calls:", hlo.count("__gpu$xla.gpu.triton"))
PY
  timeout "${TESTS_TIMEOUT:-170}" $PY -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 25
  echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 60 $KV demo; echo "demo exit $?"
  timeout 110 $KV bench-class --impls device,host,sgljax,torch_ref,sglang \
    ${SGLJAX:+--sgljax $SGLJAX} --pool 16777216 --page-size 64 --stalls 200 \
    --stall-max-batch 256 --json "$OUT/bench_class.json"; echo "bench-class exit $?"
  timeout 60 $KV bench-table --json "$OUT/bench_table.json"; echo "bench-table exit $?"
  timeout 90 $KV simulate --no-progress --json "$OUT/simulate.json"; echo "simulate exit $?"
) > "$OUT/gpu1.txt" 2>&1
wait $LANE0
timeout "${RANKS_TIMEOUT:-70}" $PY -m jax_kvalloc.tools.bench_ranks --devices 1,2 \
  --json "$OUT/ranks.json" > "$OUT/ranks.txt" 2>&1; echo "ranks exit $?" >> "$OUT/ranks.txt"
tar czf "$DEST/results.tgz" -C "$OUT" . && rm -rf "$OUT"
tar xzf "$DEST/results.tgz" -O ./machine.txt ./gpu1.txt ./ranks.txt
tar xzf "$DEST/results.tgz" -O ./gpu0.txt | tail -n 60
