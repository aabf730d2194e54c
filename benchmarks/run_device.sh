#!/usr/bin/env bash
# The accelerator runs behind BENCHMARKS.md: `jax-kvalloc bench` then
# `jax-kvalloc simulate`, each with --json/--plot, plus the machine's versions.
# Writes into $OUT (default benchmarks/out). Run from the repository root:
#   bash benchmarks/run_device.sh
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch_ref
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $PY -c "import sys, jax, jaxlib, torch, triton; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, \
'triton', triton.__version__, jax.devices())" 2>&1
} > "$OUT/machine.txt"
timeout "${BENCH_TIMEOUT:-330}" $PY -m jax_kvalloc bench --no-progress \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
echo "bench exit $?" >> "$OUT/machine.txt"
timeout "${SIM_TIMEOUT:-100}" $PY -m jax_kvalloc simulate --no-progress \
  --json "$OUT/simulate.json" --plot "$OUT/simulate.png" > "$OUT/simulate.txt" 2>&1
echo "simulate exit $?" >> "$OUT/machine.txt"
cat "$OUT/machine.txt"
tail -n 60 "$OUT/bench.txt"
tail -n 26 "$OUT/simulate.txt"
