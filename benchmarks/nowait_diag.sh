#!/usr/bin/env bash
# On a GPU (one device call): which class call, if any, waits for a model step queued on
# the GPU (tests/test_no_wait.py's step test hung there in 2026-12-05-h200-r5a), and why
# the CPU form of the no-read test fails there. Each case in its own process: a call that
# waits never returns, so faulthandler prints every thread's stack after 20 s and
# `timeout` ends the process. Logs go to $OUT/nowait-diag/.
cd "$(dirname "$0")/.." || exit 2
export JAX_KVALLOC_SGLANG_BUNDLE=.sglang_py312
O=${OUT:-/tmp}/nowait-diag; mkdir -p "$O"
git rev-parse HEAD > "$O/commit.txt" 2>&1; nvidia-smi -L >> "$O/commit.txt" 2>&1
P=(python3 -m pytest -o addopts= -p no:cacheprovider -v -rA -o faulthandler_timeout=20)
for case in ${DIAG_CASES:-paged-1-device swa-1-device}; do
  timeout 40 "${P[@]}" "tests/test_no_wait.py::test_no_call_waits_with_a_model_step_queued[$case]" \
    > "$O/step-$case.log" 2>&1; echo "step $case: exit $?" | tee -a "$O/summary.txt"
done
# Where a device-backend decode call's ~600 us go on this machine (r5a: 630 us against a
# 55 us trivial jitted call): cProfile of 300 calls, 1 row, page 64, as `bench class`.
timeout 60 python3 - > "$O/class-profile.log" 2>&1 <<'PY'
import cProfile, pstats, time
import jax, jax.numpy as jnp, numpy as np
import jax_kvalloc.sglang as kvs
a = kvs.PagedTokenToKVPoolAllocator(1 << 24, 64, device=jax.devices()[0], debug=False)
first = a.alloc(64 * 4)
seq_cpu = np.array([65], np.int64)
def call():
  out = a.alloc_decode(jnp.asarray(seq_cpu), seq_cpu, last_dev)
  return out
last_dev = jax.device_put(np.asarray(first)[64:65].astype(np.int32) * 0 + 64, jax.devices()[0])
seq_dev = jax.device_put(seq_cpu.astype(np.int32), jax.devices()[0])
for _ in range(50):
  a.alloc_decode(seq_dev, seq_cpu, last_dev)
jax.block_until_ready(a.state)
t = []
for _ in range(200):
  s = time.perf_counter(); a.alloc_decode(seq_dev, seq_cpu, last_dev); t.append(time.perf_counter() - s)
print("decode/1 per call us median", 1e6 * float(np.median(t)))
pr = cProfile.Profile(); pr.enable()
for _ in range(300):
  a.alloc_decode(seq_dev, seq_cpu, last_dev)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
pstats.Stats(pr).sort_stats("cumtime").print_stats(40)
PY
echo "class-profile: exit $?" | tee -a "$O/summary.txt"
timeout 60 "${P[@]}" -x tests/test_no_wait.py -k "test_device_class_calls_do_not_wait and not gpu" \
  > "$O/cpu-form.log" 2>&1; echo "cpu-form: exit $?" | tee -a "$O/summary.txt"
timeout 60 "${P[@]}" tests/test_no_wait.py -k "read_of_an_output or swa_count" \
  > "$O/controls.log" 2>&1; echo "controls: exit $?" | tee -a "$O/summary.txt"
timeout 90 "${P[@]}" tests/test_swa_no_wait.py > "$O/swa.log" 2>&1
echo "swa: exit $?" | tee -a "$O/summary.txt"
