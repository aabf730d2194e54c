# Sourced by the benchmarks/run_device_*.sh scripts: where a run writes, and how it packs.
# Everything goes to $OUT/run (or benchmarks/out/run without OUT), then into one
# results.tgz (the device tool brings back few files) by `pack_results`.
DEST=${OUT:-benchmarks/out}
OUT=$DEST/run
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch
PY=${PYTHON:-python3}
SGK=.sglang_kernels/allocator.py   # SGLang's kernels file (ignored folder, carried)

pack_results() {  # pack_results: $OUT -> $DEST/results.tgz (and $OUT removed)
  tar czf "$DEST/results.tgz" -C "$OUT" . && rm -rf "$OUT"
}

write_machine() {  # write_machine: date, GPU, driver and versions -> $OUT/machine.txt
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
    $PY -c "import sys, jax, torch, triton; print(sys.version.split()[0], jax.__version__, torch.__version__, triton.__version__)"
  } > "$OUT/machine.txt" 2>&1
}
