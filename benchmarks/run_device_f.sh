#!/usr/bin/env bash
# Run 12 (2 x H200): GPU tests of the new kernels (release+decode, the extend "rows"
# layout, the decode/free changes); decode and extend side by side with torch_ref and
# SGLang 0.5.23's kernels (bare = CUDA-graph replay of 128 calls on both sides); the
# extend layouts; the serving loop with the fused release+decode; the GPU profile.
#   GPU 0: tests, decode side by side, serving loop.
#   GPU 1: extend layouts, extend side by side, gpu_profile.
# OUT=$OUT bash benchmarks/run_device_f.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
B="$PY -m jax_kvalloc bench --no-progress --no-serving --bare --min-time 0.02 --reps 3 --sglang-kernels $SGK"
write_machine
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 170 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_gpu.py \
    tests/test_triton_free.py tests/test_release_decode.py tests/test_extend_layouts.py 2>&1 \
    | tail -n 15; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 190 $B --ops decode --batch-sizes 1,16,64,256,1024,4096,16384 \
    --paths pallas,jnp,torch --json "$OUT/bench_decode.json"; echo "decode exit $?"
  timeout 190 $PY -m jax_kvalloc bench --no-progress --no-micro --min-time 0.02 --reps 3 \
    --json "$OUT/bench_serving.json"; echo "serving exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 110 $PY benchmarks/extend_layouts_gpu.py --json "$OUT/extend_layouts.json" \
    --budget 90; echo "layouts exit $?"
  timeout 250 $B --ops extend --paths pallas,jnp,torch \
    --extend-cases 1x8192,16x32768,64x32768,256x65536,1024x65536,4096x262144,16384x262144 \
    --json "$OUT/bench_extend.json"; echo "extend exit $?"
  timeout 170 $PY benchmarks/gpu_profile.py --sglang-kernels $SGK --tag run12 \
    --json "$OUT/profile.json"; echo "profile exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
pack_results
tar xzf "$DEST/results.tgz" -O ./gpu0.txt ./gpu1.txt | grep -v "Warning\|warn(\|_warn_once" \
  | grep -E "^\||exit|passed|failed|Error|==|ours:|sglang:|/call|bs=|total|wrote" | tail -n 170
