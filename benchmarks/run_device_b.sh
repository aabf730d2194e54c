export PYTHONPATH=$PWD:$PWD/tests XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
SGL="--sglang-kernels .sglang_kernels/allocator.py"
B="python3 -m jax_kvalloc bench --no-progress --no-serving --bare --extra-consumer --min-time 0.02 --reps 3 $SGL"
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/machine.txt; date -u >> $OUT/machine.txt
( export CUDA_VISIBLE_DEVICES=0
  timeout 200 $B --ops decode --batch-sizes 1,16,64,256 --json $OUT/bench_decode_a.json > $OUT/decode_a.txt 2>&1
  timeout 200 $B --ops decode --batch-sizes 1024,4096,16384 --json $OUT/bench_decode_b.json > $OUT/decode_b.txt 2>&1
  timeout 150 python3 benchmarks/free_methods_gpu.py --json $OUT/free_methods.json > $OUT/free_methods.txt 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 170 $B --ops extend --extend-cases 1x8192,16x32768,64x32768 --json $OUT/bench_extend_a.json > $OUT/extend_a.txt 2>&1
  timeout 170 $B --ops extend --extend-cases 256x65536,1024x65536,4096x262144,16384x262144 --json $OUT/bench_extend_b.json > $OUT/extend_b.txt 2>&1
  timeout 90 python3 -m jax_kvalloc bench --no-progress --ops free --paths jnp,torch --no-serving --extra-consumer --min-time 0.02 --reps 3 --json $OUT/bench_free.json > $OUT/free.txt 2>&1
  timeout 130 python3 -m jax_kvalloc bench --no-progress --no-micro --min-time 0.02 --reps 3 --json $OUT/bench_serving.json > $OUT/serving.txt 2>&1 ) &
wait
for f in $OUT/*.txt; do echo "=== $f"; grep -v "Warning\|warn(" $f | tail -n 30; done
