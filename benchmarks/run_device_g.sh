#!/usr/bin/env bash
# Run 13 (2 x H200): decode and extend side by side with torch_ref and SGLang 0.5.23's
# kernels, the bare columns now each kernel's own GPU time (CUPTI); the extend layouts
# with SGLang's kernel in the same run; the decode kernel's warps; the serving scan's
# GPU activities per step (what the allocator's share is made of).
#   GPU 0: extend-layout GPU tests, decode side by side, decode warps.
#   GPU 1: extend layouts, extend side by side, serving profile.
# OUT=$OUT bash benchmarks/run_device_g.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
B="$PY -m jax_kvalloc bench --no-progress --no-serving --bare --min-time 0.02 --reps 3 --sglang-kernels $SGK"
write_machine
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_extend_layouts.py \
    tests/test_pallas_gpu.py -k "extend or layout" 2>&1 | tail -n 8; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 180 $B --ops decode --batch-sizes 1,16,64,256,1024,4096,16384 \
    --paths pallas,jnp,torch --json "$OUT/bench_decode.json"; echo "decode exit $?"
  timeout 60 $PY benchmarks/gpu_profile.py --decode-warps 1,16,64,256 \
    --json "$OUT/decode_warps.json"; echo "warps exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 100 $PY benchmarks/extend_layouts_gpu.py --sglang-kernels $SGK --budget 80 \
    --json "$OUT/extend_layouts.json"; echo "layouts exit $?"
  timeout 220 $B --ops extend --paths pallas,jnp,torch \
    --extend-cases 1x8192,16x32768,64x32768,256x65536,1024x65536,4096x262144,16384x262144 \
    --json "$OUT/bench_extend.json"; echo "extend exit $?"
  timeout 80 $PY benchmarks/gpu_profile.py --serving 64,1024 --iters 20 \
    --json "$OUT/serving_profile.json"; echo "serving profile exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
pack_results
tar xzf "$DEST/results.tgz" -O ./gpu0.txt ./gpu1.txt | grep -v "Warning\|warn(\|_warn_once" \
  | grep -E "^\||exit|passed|failed|Error|==|/step|decode bs=|^ +[0-9]+ +[0-9]+ |total|wrote" | tail -n 190
