#!/usr/bin/env bash
# The device runner (from the repository root): runs the named steps one after the other
# into benchmarks/results/<YYYY-MM-DD>-<machine>-<NAME>/ (machine: h200, h200x2, cpu, ...;
# NAME: letters, digits, '-'): <step>.json (the step's record), <step>.log (its output)
# and manifest.json (jax_kvalloc.tools.bench.manifest). With $OUT set (the device tool)
# the folder is also packed into $OUT/<folder>.tgz (tar xzf it -C benchmarks/results).
# Then `jax-kvalloc report --write` regenerates the tables that cite result folders.
#
#   bash benchmarks/run_device.sh NAME STEP [STEP ...]
#   bash benchmarks/run_device.sh --list                    # the steps and their commands
#   bash benchmarks/run_device.sh --dry-run NAME STEP ...   # print the commands only
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/run_device.sh a decode extend &   # two GPUs
#   CUDA_VISIBLE_DEVICES=1 bash benchmarks/run_device.sh b gpu-tests serving; wait
#
# Environment:
#   SGLANG_KERNELS  SGLang's sglang/kernels/ops/memory/allocator.py from the sglang wheel
#                   (default .sglang_kernels/allocator.py, an ignored folder carried to
#                   the device; a VERSION file beside it names the wheel)
#   SGLANG_BUNDLE   SGLang 0.5.23's classes for the class, table and swa steps and the
#                   GPU tests (benchmarks/sglang_bundle.sh; default .sglang_py312)
#   SGLJAX          sglang-jax's folder for the class step (default: left out)
#   SGLJAX_PY       for the sgljax-trace-* steps: a Python 3.12 with sglang-jax's packages
#                   (../shared/anchors/sglang-jax/PROVENANCE.txt) and jax_kvalloc's model
#                   extras (default python3.12); SGLJAX_SRC sglang-jax's python/ folder
#                   (default ../shared/anchors/sglang-jax/python); SGLJAX_MODEL the
#                   SmolLM2-135M folder `jax-kvalloc export-hf` wrote
#   COMMIT          the tree's commit, where the device copy has no .git
#   PYTHON          interpreter (default python3)
#   ARGS_<STEP>     extra arguments of one step, last ('-' as '_': ARGS_free_methods=...)
#   TIMEOUT_<STEP>  its time limit in seconds (defaults below)
#   BUDGET          seconds for all steps (default 560); a step gets at most what is left
#                   and one with under 20 s left is skipped (its manifest entry says so)
#
# Round 5's device runs (issue 46) are three lines of steps: benchmarks/round5.sh says
# which and runs one (`bash benchmarks/round5.sh a|b|c`, `--dry-run` first). Steps that
# hide Pallas' Triton backend (fallback-*) set JAX_KVALLOC_NO_TRITON=1 (jax_kvalloc.kernels).
# A test's time limit is pytest-timeout's ini option (-o timeout=S): where that plugin is
# missing, pytest warns and the step's own limit is the only one.
set -uf   # -f: no globbing of the commands (jnp[free=sort])
PY=${PYTHON:-python3}
KV="$PY -m jax_kvalloc"
B="$KV bench"
SGK=${SGLANG_KERNELS:-.sglang_kernels/allocator.py}
SGB=${SGLANG_BUNDLE:-.sglang_py312}
BARE="--bare --min-time 0.02 --sglang-kernels $SGK"
SGJ_PY=${SGLJAX_PY:-python3.12}
SGJ_SRC=${SGLJAX_SRC:-../shared/anchors/sglang-jax/python}
SGJ_MODEL=${SGLJAX_MODEL:-/tmp/smollm2-hf}
GUARD_EXTEND=16x8192,64x32768,256x65536,1024x65536,4096x262144   # issue 32: extend bs 16-4096

# name | seconds | command (the step's record: $DIR/<name>.json)
STEPS="gpu-tests|420|env JAX_KVALLOC_SGLANG_BUNDLE=$SGB $PY -m pytest -m gpu -p no:cacheprovider -v -rA -n 8 --dist load -o timeout=300 --durations=30 tests
decode|240|$B kernels --ops decode --impls pallas,torch_ref,sglang $BARE --json \$DIR/decode.json
extend|150|$B kernels --ops extend --impls pallas,torch_ref,sglang $BARE --json \$DIR/extend.json
free|150|$B kernels --ops free --impls jnp,pallas,eager,torch_ref --min-time 0.02 --json \$DIR/free.json
free-methods|150|$B kernels --ops free --impls jnp[free=sort],jnp[free=bitmap],jnp[free=triton] --extend-cases 128x8192,512x32768,1024x65536,4096x262144 --min-time 0.02 --json \$DIR/free-methods.json
extend-layouts|120|$B kernels --ops extend --impls fused[layout=rows],fused[layout=tiles],sglang $BARE --json \$DIR/extend-layouts.json
serving|150|$B serving --min-time 0.02 --json \$DIR/serving.json
table|200|$B table --budget-s 150 --min-time 0.02 --json \$DIR/table.json
class|150|env JAX_KVALLOC_SGLANG_BUNDLE=$SGB $B class --impls device,host,torch_ref,sglang${SGLJAX:+,sgljax} ${SGLJAX:+--sgljax $SGLJAX} --device cuda --pool 16777216 --page-size 64 --decode 1,8,64 --extend 4,64 --free 64,1024 --reps 200 --json \$DIR/class.json
swa|200|$B swa --device cuda --sglang-bundle $SGB --reps 100 --json \$DIR/swa.json
simulate|150|$KV simulate --no-progress --driver device --json \$DIR/simulate.json
simulate-host|200|$KV simulate --no-progress --driver host --json \$DIR/simulate-host.json
ranks|90|$B ranks --devices 1,2 --json \$DIR/ranks.json
simulate-profile|150|$B simulate --impls device,profile --page-sizes 16,64 --num-requests 200 --json \$DIR/simulate-profile.json
mosaic-gpu-decode|300|$B kernels --ops decode --impls jnp,triton,mosaic_gpu --bare --min-time 0.02 --reps 7 --json \$DIR/mosaic-gpu-decode.json
mosaic-gpu-table|420|$B table --impls step[kernel=jnp],none,step[kernel=triton],step[kernel=mosaic_gpu] --page-sizes 64 --min-time 0.02 --reps 7 --json \$DIR/mosaic-gpu-table.json
mosaic-gpu-tests|300|$PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_mosaic_gpu.py
serve|240|$PY -m jax_kvalloc.serve.bench --json \$DIR/serve.json
serve-retract|150|$PY -m jax_kvalloc.serve.bench --batches 64,256 --layouts paged --pool-fraction 0.5 --json \$DIR/serve-retract.json
serve-ps24|90|$PY -m jax_kvalloc.serve.bench --batches 64 --layouts paged --page-size 24 --json \$DIR/serve-ps24.json
no-wait|150|env JAX_KVALLOC_SGLANG_BUNDLE=$SGB $PY -m pytest -o addopts= -p no:cacheprovider -v -rA -o timeout=120 tests/test_no_wait.py tests/test_swa_no_wait.py
r5-guard-decode|150|$B kernels --ops decode --impls auto --guard on,off --batch-sizes 64,256,1024,4096,16384 --bare --min-time 0.02 --json \$DIR/r5-guard-decode.json
r5-guard-extend|120|$B kernels --ops extend --impls auto --guard on,off --extend-cases 64x32768,256x65536,4096x262144 --bare --min-time 0.02 --json \$DIR/r5-guard-extend.json
r5-guard-free|100|$B kernels --ops free --impls auto,eager,jnp[free=sort],jnp[free=bitmap] --guard on,off --extend-cases $GUARD_EXTEND --min-time 0.02 --json \$DIR/r5-guard-free.json
r5-guard-table|170|$B table --impls none,calls,step --guard on,off --page-sizes 64 --batch-sizes 64,256,1024 --budget-s 150 --min-time 0.02 --json \$DIR/r5-guard-table.json
r5-mosaic-gpu-table|150|$B table --impls none,step[kernel=triton],step[kernel=mosaic_gpu] --page-sizes 64 --batch-sizes 64,256,1024 --budget-s 130 --min-time 0.02 --reps 5 --json \$DIR/r5-mosaic-gpu-table.json
auto-kernels|90|$B kernels --ops decode,extend,free --impls auto --batch-sizes 1,64,1024,16384 --extend-cases 16x8192,256x65536,4096x262144 --min-time 0.02 --json \$DIR/auto-kernels.json
fallback-kernels|90|env JAX_KVALLOC_NO_TRITON=1 $B kernels --ops decode,extend,free --impls auto --batch-sizes 1,64,1024,16384 --extend-cases 16x8192,256x65536,4096x262144 --min-time 0.02 --json \$DIR/fallback-kernels.json
fallback-table|90|env JAX_KVALLOC_NO_TRITON=1 $B table --impls none,step,calls --page-sizes 64 --batch-sizes 64,256 --budget-s 70 --min-time 0.02 --json \$DIR/fallback-table.json
guard-decode|220|$B kernels --ops decode --impls auto --guard on,off --bare --min-time 0.02 --json \$DIR/guard-decode.json
guard-extend|180|$B kernels --ops extend --impls auto --guard on,off --extend-cases $GUARD_EXTEND --bare --min-time 0.02 --json \$DIR/guard-extend.json
guard-free|150|$B kernels --ops free --impls auto,eager --guard on,off --extend-cases $GUARD_EXTEND --min-time 0.02 --json \$DIR/guard-free.json
guard-table|300|$B table --impls none,calls,step --guard on,off --page-sizes 64 --budget-s 240 --min-time 0.02 --json \$DIR/guard-table.json
guard-simulate|240|$B simulate --impls device,host --guard on,off --page-sizes 16,64 --json \$DIR/guard-simulate.json
guard-class|240|$B class --impls device,host --guard on,off --pool 16777216 --page-size 64 --decode 1,8,64 --extend 4,64 --free 64,1024 --reps 200 --json \$DIR/guard-class.json
guard-swa|200|$B swa --impls class,core --guard on,off --reps 100 --json \$DIR/guard-swa.json
sgljax-trace-ps1|300|env PYTHONPATH=$PWD:$SGJ_SRC JAX_PLATFORMS=cpu $SGJ_PY tests/sgljax_engine.py $SGJ_MODEL --page-size 1 --max-running 4 --out \$DIR/trace-ps1.json
sgljax-trace-ps4|300|env PYTHONPATH=$PWD:$SGJ_SRC JAX_PLATFORMS=cpu $SGJ_PY tests/sgljax_engine.py $SGJ_MODEL --page-size 4 --max-running 1 --out \$DIR/trace-ps4.json
sgljax-replay|200|$B sgljax-replay --traces \$DIR --guard on,off --reps 51 --json \$DIR/sgljax-replay.json"

DRY=0
BUDGET=${BUDGET:-560}
case "${1:-}" in
  --list) echo "$STEPS" | sed 's/|[0-9]*|/  /'; exit 0 ;;
  --dry-run) DRY=1; shift ;;
  ""|-h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2 ;;
esac
NAME=${1:?usage: run_device.sh NAME STEP...}; shift
[[ "$NAME" =~ ^[A-Za-z0-9-]+$ ]] || { echo "NAME must be letters, digits and '-': $NAME" >&2; exit 2; }
[ $# -gt 0 ] || { echo "no steps given; --list shows them" >&2; exit 2; }
for s in "$@"; do
  echo "$STEPS" | grep -q "^$s|" || { echo "unknown step: $s (--list shows them)" >&2; exit 2; }
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # leave GPU memory for torch
MANIFEST="from jax_kvalloc.tools import bench"
MACHINE=$($PY -c "$MANIFEST; print(bench.machine_tag())" 2>/dev/null || echo unknown)
FOLDER="$(date -u +%F)-$MACHINE-$NAME"
DIR=benchmarks/results/$FOLDER
STEPLOG=$(mktemp)
[ "$DRY" = 1 ] || mkdir -p "$DIR"

for name in "$@"; do   # one command per step, under its time limit, output to <step>.log
  IFS='|' read -r _ limit cmd <<< "$(echo "$STEPS" | grep "^$name|")"
  var=${name//-/_}; extra="ARGS_$var"; tvar="TIMEOUT_$var"
  limit=${!tvar:-$limit}
  cmd="$(eval echo "\"$cmd\"") ${!extra:-}"
  left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$DRY" = 1 ]; then echo "timeout $limit $cmd"; continue; fi
  if [ "$limit" -lt 20 ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" -1 0 "skipped: $left s of BUDGET left" >> "$STEPLOG"
    echo "== $name: skipped ($left s of BUDGET left)"; continue
  fi
  t0=$SECONDS
  timeout "$limit" $cmd > "$DIR/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$cmd" >> "$STEPLOG"
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  tail -n 15 "$DIR/$name.log"
done
[ "$DRY" = 1 ] && { rm -f "$STEPLOG"; exit 0; }
$PY -c "import json, sys; $MANIFEST
json.dump(bench.manifest(*sys.argv[1:]), open(sys.argv[1] + '/manifest.json', 'w'), indent=1)" \
  "$DIR" "bash benchmarks/run_device.sh $NAME $*" "$STEPLOG" "$SGK"
rm -f "$STEPLOG"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/$FOLDER.tgz" -C benchmarks/results "$FOLDER" && cp "$DIR/manifest.json" "$OUT/"
  echo "packed $OUT/$FOLDER.tgz"
fi
echo "wrote $DIR"
