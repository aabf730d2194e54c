#!/usr/bin/env bash
# Run 11 (2 x H200): the GPU tests after the refactors of 08f1630/366f140, where a bare
# call's time goes (benchmarks/gpu_profile.py, with XLA's default command buffers and with
# WHILE/CONDITIONAL added), the Triton free's block sizes, the request table again.
#   GPU 0: gpu_profile.py (default XLA_FLAGS, then the command-buffer variant).
#   GPU 1: GPU tests, free_methods_gpu.py --sweep-blocks, bench-table.
# OUT=$OUT bash benchmarks/run_device_e.sh
set -u
source "$(dirname "$0")/device_run_lib.sh"
mkdir -p "$OUT/hlo"
write_machine
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 $PY benchmarks/gpu_profile.py --sglang-kernels $SGK --tag default \
    --json "$OUT/profile_default.json" --hlo-dir "$OUT/hlo"; echo "profile default exit $?"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
    timeout 150 $PY benchmarks/gpu_profile.py --sglang-kernels $SGK --tag cmdbuf \
    --json "$OUT/profile_cmdbuf.json" --hlo-dir "$OUT/hlo"; echo "profile cmdbuf exit $?"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_free.py \
    tests/test_no_wait.py tests/test_pallas_gpu.py 2>&1 | tail -n 15; echo "gpu tests exit ${PIPESTATUS[0]}"
  timeout 120 $PY benchmarks/free_methods_gpu.py --sweep-blocks 8192,65536,262144 \
    --json "$OUT/free_blocks.json"; echo "free sweep exit $?"
  timeout 90 $PY -m jax_kvalloc bench-table --batch-sizes 64,256,1024 \
    --json "$OUT/bench_table.json"; echo "bench-table exit $?"
) > "$OUT/gpu1.txt" 2>&1 &
wait
(cd "$OUT" && tar czf hlo.tgz hlo && rm -rf hlo)
pack_results
tar xzf "$DEST/results.tgz" -O ./gpu0.txt ./gpu1.txt | grep -v "Warning\|warn(" | tail -n 150
