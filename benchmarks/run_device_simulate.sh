#!/usr/bin/env bash
# Run 17 (1 x H200): the main job, `jax-kvalloc simulate` (default run, --json), with the
# device driver (the scheduler in a jitted loop, 256 steps per call: default XLA
# conditionals with command buffers, then the branch-free loop) and the host driver (one
# jitted call per step), one run each; then the drivers-agree test on the GPU.
# OUT=$OUT bash benchmarks/run_device_simulate.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
write_machine
for d in device host; do
  timeout 200 $PY -m jax_kvalloc simulate --no-progress --driver $d \
    --json "$OUT/simulate_$d.json" > "$OUT/simulate_$d.txt" 2>&1; echo "simulate $d exit $?"
done
JAX_KVALLOC_SIM_BRANCHES=masked timeout 150 $PY -m jax_kvalloc simulate --no-progress \
  --json "$OUT/simulate_device_masked.json" > "$OUT/simulate_device_masked.txt" 2>&1
echo "simulate device (branch-free) exit $?"
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_simulate_drivers.py \
  -k "ps16-sort1-share1" 2>&1 | tail -n 5
for f in "$OUT"/simulate_*.txt; do echo "== $f"; grep -v "^\*\|slow_operation" "$f" | tail -n 26; done
pack_results
