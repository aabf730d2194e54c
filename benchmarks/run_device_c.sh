#!/usr/bin/env bash
# Run 8 (2 x H200): two lanes, one GPU each; everything lands in $OUT/results.tgz.
#   GPU 0: GPU tests, bench-class (device/host/sgljax/torch_ref, compile stalls cold and
#          warm), the device rows again with JAX_KVALLOC_GPU_GRAPHS=0, simulate, the
#          serving loop.
#   GPU 1: free_methods_gpu.py (sort/bitmap/pallas), the +1 consumer check of every
#          decode and extend figure (pallas and jnp, interleaved), the free table.
# SGLJAX=.sgljax OUT=$OUT bash benchmarks/run_device_c.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
KV="$PY -m jax_kvalloc"
write_machine
B="$KV bench --no-progress --no-serving --extra-consumer --min-time 0.02 --reps 5"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 130 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_free.py \
    tests/test_no_wait.py tests/test_pallas_gpu.py 2>&1 | tail -n 15; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 210 $KV bench-class --impls device,host,sgljax,torch_ref ${SGLJAX:+--sgljax $SGLJAX} \
    --pool 16777216 --page-size 64 --stalls 150 --stall-max-batch 256 \
    --json "$OUT/bench_class.json"; echo "bench-class exit $?"
  JAX_KVALLOC_GPU_GRAPHS=0 timeout 40 $KV bench-class --impls device --pool 16777216 \
    --page-size 64 --free 64,1024 --json "$OUT/bench_class_nographs.json"; echo "nographs exit $?"
  timeout 70 $KV simulate --no-progress --json "$OUT/simulate.json"; echo "simulate exit $?"
  timeout 120 $KV bench --no-progress --no-micro --min-time 0.02 --reps 3 \
    --json "$OUT/bench_serving.json"; echo "serving exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 110 $PY benchmarks/free_methods_gpu.py --json "$OUT/free_methods.json"; echo "free_methods exit $?"
  timeout 140 $B --ops decode --batch-sizes 1,16,64,256,1024,4096,16384 --paths pallas,jnp \
    --json "$OUT/check_decode.json"; echo "decode exit $?"
  timeout 160 $B --ops extend --paths pallas,jnp \
    --extend-cases 1x8192,16x32768,64x32768,256x65536,1024x65536,4096x262144,16384x262144 \
    --json "$OUT/check_extend.json"; echo "extend exit $?"
  timeout 80 $B --ops free --paths jnp,torch --json "$OUT/bench_free.json"; echo "free exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
pack_results
tar xzf "$DEST/results.tgz" -O ./machine.txt ./gpu0.txt | grep -v "Warning\|warn(" | tail -n 120
tar xzf "$DEST/results.tgz" -O ./gpu1.txt | grep -v "Warning\|warn(" | tail -n 150
