#!/usr/bin/env bash
# Run 14 (2 x H200): the GPU tests of the final kernels; decode side by side at bs 1-1024
# with the prefix scan and with the masked prefix sum (tuning.DECODE_MASKED_PREFIX_MAX_ROWS
# = 64); the decode kernel's variants; the serving loop again; the serving scan's profile
# and copies.
#   GPU 0: GPU tests, decode side by side (scan, then masked).
#   GPU 1: decode variants, serving loop, serving profile.
# OUT=$OUT bash benchmarks/run_device_h.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
ARGS="bench --no-progress --no-serving --bare --min-time 0.02 --reps 3 --sglang-kernels $SGK --ops decode --batch-sizes 1,16,64,256,1024 --paths pallas,torch"
write_machine
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 250 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_gpu.py \
    tests/test_release_decode.py tests/test_extend_layouts.py tests/test_triton_free.py \
    tests/test_no_wait.py 2>&1 | tail -n 8; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 110 $PY -m jax_kvalloc $ARGS --json "$OUT/bench_decode_scan.json"; echo "decode scan exit $?"
  timeout 110 $PY -c "import sys; from pallas_kernels import tuning; tuning.DECODE_MASKED_PREFIX_MAX_ROWS = 64; from jax_kvalloc.tools.cli import main; sys.exit(main(sys.argv[1:]))" \
    $ARGS --json "$OUT/bench_decode_masked.json"; echo "decode masked exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 110 $PY benchmarks/gpu_profile.py --decode-variants 1,16,64,256 \
    --json "$OUT/decode_variants.json"; echo "variants exit $?"
  timeout 200 $PY -m jax_kvalloc bench --no-progress --no-micro --min-time 0.02 --reps 3 \
    --json "$OUT/bench_serving.json"; echo "serving exit $?"
  timeout 80 $PY benchmarks/gpu_profile.py --serving 64,1024 --iters 20 \
    --json "$OUT/serving_profile.json"; echo "serving profile exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
pack_results
tar xzf "$DEST/results.tgz" -O ./gpu0.txt ./gpu1.txt | grep -v "Warning\|warn(\|_warn_once" \
  | grep -E "^\||exit|passed|failed|Error|==|/step|copy:|decode bs|wrote" | tail -n 150
