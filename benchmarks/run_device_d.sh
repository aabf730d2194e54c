#!/usr/bin/env bash
# Run 9 (2 x H200): the +1 consumer check of every decode, extend and free figure (run 8
# cut it by its time limits; each case is now saved as soon as it is measured).
#   GPU 0: decode (pallas, jnp), then free (jnp, torch_ref eager).  GPU 1: extend.
# OUT=$OUT bash benchmarks/run_device_d.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
B="python3 -m jax_kvalloc bench --no-progress --no-serving --extra-consumer --min-time 0.02 --reps 5"
date -u > "$OUT/machine.txt"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 290 $B --ops decode --batch-sizes 1,16,64,256,1024,4096,16384 --paths pallas,jnp \
    --json "$OUT/check_decode.json"; echo "decode exit $?"
  timeout 100 $B --ops free --paths jnp,torch --json "$OUT/bench_free.json"; echo "free exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 395 $B --ops extend --paths pallas,jnp \
    --extend-cases 1x8192,16x32768,64x32768,256x65536,1024x65536,4096x262144,16384x262144 \
    --json "$OUT/check_extend.json"; echo "extend exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
pack_results
tar xzf "$DEST/results.tgz" -O ./gpu0.txt ./gpu1.txt | grep -v "Warning\|warn(" | grep -E "^\||exit|wrote" | tail -n 80
