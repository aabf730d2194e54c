#!/bin/bash
# Issue 21: the device backend's per-call cost beside the host's trivial-jit floor, on one
# GPU, in one command (the lead runs it on the H200):
#   bash benchmarks/run_device_class.sh          (results in $OUT/results.tgz)
# bench-class: device and host backends, torch_ref and SGLang's class where importable,
# decode bs 1/8/64 (the target range), extend, free, and the trivial-jit floor.
# Then the GPU no-wait tests (device-array page-id frees under the transfer guard).
set -u
source benchmarks/device_run_lib.sh
write_machine
KV="$PY -m jax_kvalloc"
timeout 200 $KV bench-class --impls device,host,torch_ref,sglang --device cuda \
  --pool 16777216 --page-size 64 --decode 1,8,64 --extend 4,64 --free 64,1024 \
  --restore-decode 64 --restore-free 1024 --reps 200 \
  --json "$OUT/bench_class.json" > "$OUT/bench_class.txt" 2>&1; echo "bench-class exit $?"
timeout 200 $PY -m pytest -q -m gpu tests/test_no_wait.py > "$OUT/no_wait_gpu.txt" 2>&1
echo "no-wait gpu tests exit $?"
pack_results
