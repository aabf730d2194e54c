#!/usr/bin/env bash
# Issue 20 (2 x H200, or 1: then one after the other): the request table's one-launch
# kernels (pallas_kernels.triton_table) and the serving steps through them.
#   GPU 0: their GPU tests (compiled kernel vs the jnp path, a scan vs the loop model),
#          then the compiled serving loops' copies (benchmarks/scan_copies.py).
#   GPU 1: `jax-kvalloc bench-table`: decode step and release + extend + decode step at
#          bs 64 / 256 / 1024 at page size 64 (calls vs step_rows vs stand-ins vs one
#          empty launch, the kernels' own GPU times (CUPTI), SGLang's eager class per
#          step), then bs 256 at page size 16 (step_rows and stand-ins); --budget-s stops
#          starting new cases after 140 s. About 4.5 minutes on one GPU.
# OUT=$OUT bash benchmarks/run_device_i.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
write_machine
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
tests_and_copies() {
  timeout 100 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_table_kernels.py \
    2>&1 | tail -n 12; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 60 $PY benchmarks/scan_copies.py --out "$OUT/copies" --bs 256 --page-size 64 \
    --steps old,calls,step,step_ext --harnesses chain,scan,scan_donated
  echo "copies exit $?"
}
bench() {
  timeout 220 $PY -m jax_kvalloc bench-table --budget-s 140 --min-time 0.02 --reps 3 \
    --json "$OUT/bench_table.json"; echo "bench-table exit $?"
}
if [ "$GPUS" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; tests_and_copies ) > "$OUT/gpu0.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1; bench ) > "$OUT/gpu1.txt" 2>&1 &
  wait
else
  ( tests_and_copies; bench ) > "$OUT/gpu0.txt" 2>&1
fi
cat "$OUT"/gpu*.txt | grep -v "Warning\|warn(\|_warn_once" \
  | grep -E "^\||exit|passed|failed|Error|==|body copy|wrote|bs=" | tail -n 120
pack_results
