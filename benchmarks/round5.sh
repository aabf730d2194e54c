#!/usr/bin/env bash
# Round 5's device runs (issue 46) as three lines of benchmarks/run_device.sh steps, each
# one device call of at most 600 s (each line's BUDGET: 540, 460, 520 s; a step that no
# longer fits is skipped and its manifest entry says so). The three, back to back on one
# warm machine, need about 27 of a session's 30 device minutes (a start of 1-2 minutes
# included): with less left, run a and c, and b in a later session. From the repository root:
#
#   bash benchmarks/round5.sh prepare        # here, once: the ignored folders to carry
#   bash benchmarks/round5.sh --dry-run a    # the commands only (works anywhere)
#   bash benchmarks/round5.sh a              # on the device: one line, one result folder
#   bash benchmarks/round5.sh --cpu a        # here: each step's CPU form (tiny sizes,
#                                            # interpreter kernels), to check that it runs;
#                                            # its folder goes to $TMPDIR, not results/
#
# The device call (the device tool's `run`), one per line, in this order:
#   command: bash benchmarks/round5.sh a     timeout_s: 600
#   carry:   [".sglang_kernels", ".sglang_py312"]
# Each writes benchmarks/results/<date>-<machine>-r5<line>/ and packs it into
# $OUT/<folder>.tgz (tar xzf it -C benchmarks/results here).
#
# Lines (seconds: round 4's H200 manifests, or an estimate where the step is new):
#   a  the class call floor and the GPU suite
#      class       the class calls against SGLang's class and the trivial jitted call
#                  (the "floor" row) at 1/8/64 rows (22-26 s)
#      gpu-tests   -m gpu (slow included), -v: every test named as it finishes
#                  (226-384 s at -n 4 in round 4; -n 8 now)
#      no-wait     tests/test_no_wait.py and test_swa_no_wait.py, every case, on the GPU
#                  (with issue 42's branch: every class call with a model step queued)
#   b  the ownership record's cost (guard on/off, same run)
#      r5-guard-decode   decode 64-16384 rows (round 4: 134 s for 1-16384)
#      r5-guard-extend   extend 64x32768, 256x65536, 4096x262144 (151 s for five cases)
#      r5-guard-free     paged free by method: auto (Triton), eager, XLA sort and bitmap
#      guard-class       the classes (13 s)
#      r5-guard-table    the table step, decode and extend at 64/256/1024 rows; its release
#                        is free_page_ids of the rows' pages (52 s for two rows)
#      serve-ps24        serve at page size 24 with the Pallas kernel: an error or figures
#   c  serve, and the Mosaic GPU table kernel against Triton, with and without Triton
#      serve             paged and contiguous at 64 and 256 running requests (~110 s)
#      serve-retract     the same (paged) with half the pool: admission and retraction
#      r5-mosaic-gpu-table  step[kernel=triton] vs step[kernel=mosaic_gpu], 64-1024 rows
#      auto-kernels      decode, extend, free through "auto" (Triton)
#      fallback-kernels  the same with JAX_KVALLOC_NO_TRITON=1 (Mosaic GPU decode, XLA
#                        extend and free)
#      fallback-table    the table step with Triton hidden (Mosaic GPU table kernel)
set -uf
{   # parsed whole before it runs: an edit of this file during a run changes nothing
cd "$(dirname "$0")/.." || exit 2
DRY=()
CPU=0
[ "${1:-}" = "--dry-run" ] && { DRY=(--dry-run); shift; }
[ "${1:-}" = "--cpu" ] && { CPU=1; shift; }
if [ "$CPU" = 1 ]; then   # the CPU forms: each step's arguments last (they win)
  export PYTHON=${PYTHON:-/work/venv311/bin/python} BUDGET=${BUDGET:-3000}
  # No bundle: the installed sglang serves (an empty folder for the variable to name).
  [ -n "${SGLANG_BUNDLE:-}" ] || SGLANG_BUNDLE=$([ ${#DRY[@]} = 0 ] && mktemp -d || echo /tmp)
  export SGLANG_BUNDLE
  T="--tiny --prompt-len 12 --new-tokens 6 --decode-steps 2 --prefill-rows 2"
  K="--quick --batch-sizes 1,64 --extend-cases 4x512"
  export ARGS_gpu_tests="-n 2" ARGS_class="--device cpu --quick --pool 65536" \
    ARGS_r5_guard_decode="$K" ARGS_r5_guard_extend="$K" ARGS_r5_guard_free="$K" \
    ARGS_guard_class="--quick --pool 65536" ARGS_r5_guard_table="--quick --batch-sizes 8" \
    ARGS_serve_ps24="$T --batches 3 --attention pallas" ARGS_serve="$T --batches 3,8" \
    ARGS_serve_retract="$T --batches 8" ARGS_auto_kernels="$K" ARGS_fallback_kernels="$K" \
    ARGS_r5_mosaic_gpu_table="--quick --batch-sizes 8 --impls none,step[kernel=triton_interpret],step[kernel=mosaic_gpu_interpret]" \
    ARGS_fallback_table="--quick --batch-sizes 8"
fi
case "${1:-}" in
  prepare)
    # SGLang's released Triton kernels (the decode/extend steps' sglang column) from an
    # installed sglang (PYTHON, default /work/venv311/bin/python), and SGLang 0.5.23's
    # classes for the GPU image (benchmarks/sglang_bundle.sh; needs the package index).
    py=${PYTHON:-/work/venv311/bin/python}
    if [ ! -f .sglang_kernels/allocator.py ]; then
      src=$("$py" -c "import os, sglang; print(os.path.dirname(sglang.__file__))") || exit 1
      mkdir -p .sglang_kernels
      cp "$src/kernels/ops/memory/allocator.py" .sglang_kernels/ || exit 1
      "$py" -c "import sglang; print('sglang', sglang.__version__)" > .sglang_kernels/VERSION
      ex=$(git rev-parse --git-path info/exclude)
      grep -qx '/.sglang_kernels/' "$ex" 2>/dev/null || echo /.sglang_kernels/ >> "$ex"
    fi
    [ -d .sglang_py312 ] || bash benchmarks/sglang_bundle.sh .sglang_py312 3.12 || exit 1
    du -sh .sglang_kernels .sglang_py312
    exit 0 ;;
  a) STEPS="class gpu-tests no-wait"; LINE_BUDGET=540 ;;
  b) STEPS="r5-guard-decode r5-guard-extend r5-guard-free guard-class r5-guard-table serve-ps24"
     LINE_BUDGET=460 ;;
  c) STEPS="serve serve-retract r5-mosaic-gpu-table auto-kernels fallback-kernels fallback-table"
     LINE_BUDGET=520 ;;
  *) sed -n '2,/^set -uf/p' "$0" | sed '$d'; exit 2 ;;
esac
NAME=r5$1$([ "$CPU" = 1 ] && echo -cpu-check)
if [ "$CPU" = 1 ]; then   # this CPU is slower than the device's: 15 minutes a step
  for s in $STEPS; do export "TIMEOUT_${s//-/_}=900"; done
fi
# shellcheck disable=SC2086  # the step names split
BUDGET=${BUDGET:-$LINE_BUDGET} bash benchmarks/run_device.sh "${DRY[@]}" "$NAME" $STEPS
rc=$?
if [ "$CPU" = 1 ] && [ ${#DRY[@]} = 0 ]; then   # not figures: out of benchmarks/results
  for d in $(find benchmarks/results -maxdepth 1 -name "*-$NAME"); do
    rm -rf "${TMPDIR:-/tmp}/${d##*/}" && mv "$d" "${TMPDIR:-/tmp}/" && echo "moved $d to ${TMPDIR:-/tmp}/"
  done
fi
exit $rc
}
