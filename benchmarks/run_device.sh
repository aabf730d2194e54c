#!/usr/bin/env bash
# The one device runner (run it from the repository root): runs the chosen steps, one
# after the other on one GPU, and writes every output of the run into one result folder
# with a manifest.
#
#   bash benchmarks/run_device.sh NAME STEP [STEP ...]
#   bash benchmarks/run_device.sh --list            # the steps and what each runs
#   bash benchmarks/run_device.sh --dry-run NAME STEP ...   # print the commands only
#
# NAME is a short name of the run (letters, digits, '-'). The folder is
#   benchmarks/results/<YYYY-MM-DD>-<machine>-<NAME>/      (machine: h200, h200x2, cpu, ...)
# holding <step>.json (the step's data, where it writes any), <step>.log (its output) and
# manifest.json (benchmarks/manifest.py: command, git commit, date, machine, driver,
# python/jax/jaxlib/torch/triton versions, SGLang wheel and kernels file hash, and each
# step's command, exit status and seconds). With $OUT set (the device tool), the folder
# is also packed into $OUT/<folder>.tgz and its manifest copied to $OUT/manifest.json;
# unpack here with `tar xzf <folder>.tgz -C benchmarks/results`.
# Then `jax-kvalloc report` regenerates BENCHMARKS.md's and the README's tables from the
# folders their markers name.
#
# Settings (environment):
#   SGLANG_KERNELS  SGLang's sglang/kernels/ops/memory/allocator.py from the sglang wheel
#                   (default .sglang_kernels/allocator.py, an ignored folder carried to
#                   the device; a VERSION file beside it names the wheel and its sha256)
#   SGLJAX          sglang-jax's checkout for bench-class (default: left out)
#   SGLANG_BUNDLE   SGLang 0.5.23's allocator classes and their pure deps for swa and
#                   swa-bench (benchmarks/sglang_bundle.sh; default .sglang_py312, an
#                   ignored folder carried to the device; appended to sys.path)
#   COMMIT          the tree's commit, where the device copy has no .git
#   PYTHON          interpreter (default python3)
#   ARGS_<STEP>     extra arguments for one step ('-' in its name as '_': ARGS_bench_class);
#                   they come last, so they override a default (ARGS_decode='--paths
#                   pallas,jnp,torch' adds the jnp column)
#   TIMEOUT_<STEP>  its time limit in seconds (defaults below)
#   BUDGET          seconds for all steps together (default 560: the device tool's call
#                   has 10 minutes); a step gets at most what is left, and a step with
#                   under 20 s left is skipped (its manifest entry says so)
#
# Two GPUs: two runners at once, one per GPU, each with its own NAME, e.g.
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/run_device.sh a decode extend &
#   CUDA_VISIBLE_DEVICES=1 bash benchmarks/run_device.sh b gpu-tests serving; wait
# (linked figures then share the host's CPU; the bare ones do not notice).
#
# The headline (bare kernels with quartiles, in-step allocator share), one call:
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_device.sh headline \
#     decode extend serving gpu-tests
#
# Adding a step: write a function step_<name> (dashes as '_') that calls
#   run KIND TIMEOUT command...     (KIND: the step's name; $DIR/<name>.json is its data)
# and add one line for it to STEPS below.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
KV="$PY -m jax_kvalloc"
SGK=${SGLANG_KERNELS:-.sglang_kernels/allocator.py}
SGB=${SGLANG_BUNDLE:-.sglang_py312}
BENCH="bench --no-progress --bare --min-time 0.02 --reps 5"

STEPS="gpu-tests     every -m gpu test (pytest)
decode        bench decode: pallas, jnp, torch_ref, SGLang, bare (CUPTI) columns
extend        bench extend: the same columns
free          bench free: jnp, torch_ref eager
serving       bench serving loop: jit step, scan, allocator share, torch_ref eager
free-methods  benchmarks/free_methods_gpu.py: sort / bitmap / Pallas free
bench-table   jax-kvalloc bench-table: the request table's step
bench-class   jax-kvalloc bench-class: device / host / torch_ref / SGLang classes
simulate      jax-kvalloc simulate (the main job)
demo          jax-kvalloc demo --attention pallas (Pallas' paged attention on GPU)
ranks         tools.bench_ranks over 1 and 2 devices (needs 2 GPUs)
profile       benchmarks/gpu_profile.py --serving: the serving step's GPU activities
decode-variants benchmarks/gpu_profile.py --decode-variants: decode kernel time per warps / prefix sum
scan-copies   benchmarks/scan_copies.py: the compiled serving loops' copies per step
simulate-host jax-kvalloc simulate --driver host (one jitted call per step)
demo-toy      jax-kvalloc demo --attention toy
swa           benchmarks/swa_gpu.py: SWA lock-step traces on GPU, then timings
swa-bench     jax-kvalloc bench-swa: SWA extend/decode/window free, ours vs SGLang's class
guard-decode  bench decode with and without the ownership record (pallas vs pallas-noguard, jnp vs jnp-noguard)
guard-extend  bench extend: the same columns
guard-free    bench free (XLA): jnp vs jnp-noguard
guard-table   jax-kvalloc bench-table --guard both: the request table's step with and without the record
guard-simulate jax-kvalloc simulate, with the record and without (--no-guard)"

step_gpu_tests()    { run gpu-tests 200 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests; }
step_decode()       { run decode 150 $KV $BENCH --no-serving --ops decode --paths pallas,torch --sglang-kernels "$SGK" --json "$DIR/decode.json"; }
step_extend()       { run extend 150 $KV $BENCH --no-serving --ops extend --paths pallas,torch --sglang-kernels "$SGK" --json "$DIR/extend.json"; }
step_free()         { run free 120 $KV bench --no-progress --min-time 0.02 --reps 5 --no-serving --ops free --paths jnp,torch --json "$DIR/free.json"; }
step_serving()      { run serving 150 $KV bench --no-progress --min-time 0.02 --reps 5 --no-micro --json "$DIR/serving.json"; }
step_free_methods() { run free-methods 150 $PY benchmarks/free_methods_gpu.py --json "$DIR/free-methods.json"; }
step_bench_table()  { run bench-table 200 $KV bench-table --budget-s 150 --min-time 0.02 --reps 3 --json "$DIR/bench-table.json"; }
step_bench_class()  { run bench-class 150 $KV bench-class --impls device,host,torch_ref,sglang${SGLJAX:+,sgljax} ${SGLJAX:+--sgljax $SGLJAX} --device cuda --pool 16777216 --page-size 64 --decode 1,8,64 --extend 4,64 --free 64,1024 --reps 200 --json "$DIR/bench-class.json"; }
step_simulate()     { run simulate 150 $KV simulate --no-progress --driver device --json "$DIR/simulate.json"; }
step_simulate_host() { run simulate-host 200 $KV simulate --no-progress --driver host --json "$DIR/simulate-host.json"; }
step_demo()         { run demo 120 $KV demo --attention pallas --repeat 3; }
step_demo_toy()     { run demo-toy 90 $KV demo --attention toy --repeat 3; }
step_ranks()        { run ranks 90 $PY -m jax_kvalloc.tools.bench_ranks --devices 1,2 --json "$DIR/ranks.json"; }
step_profile()      { run profile 120 $PY benchmarks/gpu_profile.py --serving 64,1024 --iters 20 --json "$DIR/profile.json"; }
step_decode_variants() { run decode-variants 90 $PY benchmarks/gpu_profile.py --decode-variants 1,2,4,8,16 --json "$DIR/decode-variants.json"; }
step_scan_copies()  { run scan-copies 90 $PY benchmarks/scan_copies.py --out "$DIR/scan-copies" --bs 256 --page-size 64 --steps old,calls,step,step_ext --harnesses chain,scan,scan_donated; }
step_swa()          { run swa 150 env JAX_KVALLOC_SGLANG_BUNDLE="$SGB" $PY benchmarks/swa_gpu.py "$DIR/swa.json"; }
GUARD_PATHS="--paths pallas,pallas-noguard,jnp,jnp-noguard"
step_guard_decode() { run guard-decode 200 $KV $BENCH --no-serving --ops decode $GUARD_PATHS --json "$DIR/guard-decode.json"; }
step_guard_extend() { run guard-extend 200 $KV $BENCH --no-serving --ops extend $GUARD_PATHS --json "$DIR/guard-extend.json"; }
step_guard_free()   { run guard-free 120 $KV bench --no-progress --min-time 0.02 --reps 5 --no-serving --ops free --paths jnp,jnp-noguard --json "$DIR/guard-free.json"; }
step_guard_table()  { run guard-table 240 $KV bench-table --guard both --page-sizes 64 --no-sglang --budget-s 200 --min-time 0.02 --reps 3 --json "$DIR/guard-table.json"; }
step_guard_simulate() { run guard-simulate 120 $KV simulate --no-progress --driver device --json "$DIR/guard-simulate.json"; run guard-simulate-off 120 $KV simulate --no-progress --driver device --no-guard --json "$DIR/guard-simulate-off.json"; }
step_swa_bench()    { run swa-bench 200 $KV bench-swa --device cuda --sglang-bundle "$SGB" --reps 100 --json "$DIR/swa-bench.json"; }

DRY=0
BUDGET=${BUDGET:-560}
case "${1:-}" in
  --list) echo "$STEPS"; exit 0 ;;
  --dry-run) DRY=1; shift ;;
  ""|-h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
NAME=${1:?usage: run_device.sh NAME STEP...}; shift
[[ "$NAME" =~ ^[A-Za-z0-9-]+$ ]] || { echo "NAME must be letters, digits and '-': $NAME" >&2; exit 2; }
[ $# -gt 0 ] || { echo "no steps given; --list shows them" >&2; exit 2; }
for s in "$@"; do
  echo "$STEPS" | grep -q "^$s " || { echo "unknown step: $s (--list shows them)" >&2; exit 2; }
done

export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch
MACHINE=$($PY "$HERE/manifest.py" --machine-tag 2>/dev/null || echo unknown)
FOLDER="$(date -u +%F)-$MACHINE-$NAME"
DIR=benchmarks/results/$FOLDER
STEPLOG=$(mktemp)

run() {  # run NAME TIMEOUT CMD...: CMD (+ ARGS_<NAME>) under timeout, output to $DIR/NAME.log
  local name=$1 limit=$2; shift 2
  local var=${name//-/_}; local extra="ARGS_$var" tvar="TIMEOUT_$var"
  limit=${!tvar:-$limit}
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$DRY" = 1 ]; then echo "timeout $limit $* ${!extra:-}"; return; fi
  if [ "$limit" -lt 20 ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" -1 0 "skipped: $left s of BUDGET left" >> "$STEPLOG"
    echo "== $name: skipped ($left s of BUDGET left)"; return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" ${!extra:-} > "$DIR/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$* ${!extra:-}" >> "$STEPLOG"
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  tail -n 15 "$DIR/$name.log"
}

[ "$DRY" = 1 ] || mkdir -p "$DIR"
for s in "$@"; do "step_${s//-/_}"; done
[ "$DRY" = 1 ] && exit 0
$PY "$HERE/manifest.py" --dir "$DIR" --steps "$STEPLOG" --sglang-kernels "$SGK" \
  --command "bash benchmarks/run_device.sh $NAME $*"
rm -f "$STEPLOG"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/$FOLDER.tgz" -C benchmarks/results "$FOLDER" && cp "$DIR/manifest.json" "$OUT/"
  echo "packed $OUT/$FOLDER.tgz"
fi
echo "wrote $DIR"
