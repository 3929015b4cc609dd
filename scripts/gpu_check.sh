#!/usr/bin/env bash
# Issue 28's checks on the GPU machine in ONE command, from the checkout's root: installs the carried wheels (.whl/),
# runs tests/accelerator/ (golden logits, the update against the CPU's, the main job for 60 steps), then the
# benchmark (scripts/bench_gpu.py: Tether vs tunix at qwen2-0.5b, MFU at llama-1b), each step under its own timeout,
# with JAX_PLATFORMS=cuda so that a CPU fallback cannot pass. Everything is written under OUT_DIR (default: $OUT, the
# device tool's output folder, else ./gpu_check_out); a short summary is printed at the end. At most ~9.5 minutes
# (timeouts 270 + 150 + 150 s, plus versions and wheels); ONLY="bench_mfu ..." runs only the steps named.
#
#   scripts/gpu_check.sh [OUT_DIR]                     # on the GPU machine
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --cpu [OUT_DIR]   # dry run on a CPU: no platform check, the
#                                                      # accelerator tests run on the CPU, tiny benchmark shapes
#
# .whl/ holds what the image lacks (../shared/gpu/fetch-wheels.sh) plus pytest's own wheels, if the image has no
# pytest: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl pytest pluggy iniconfig
set -uo pipefail

MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS COMMAND...: runs under timeout, output to OUT_DIR/NAME.log, one summary line
  local name=$1 seconds=$2; shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* && $name != versions && $name != wheels ]]; then return 0; fi
  local start=$SECONDS
  [[ $MODE == cpu ]] && seconds=$((seconds * 4))  # a 2-core CPU compiles and runs far slower than the GPU
  timeout --kill-after=10 "$seconds" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  local verdict=ok; [[ $rc -ne 0 ]] && verdict="FAILED (exit $rc$([[ $rc -eq 124 || $rc -eq 137 ]] && echo ", timed out after ${seconds} s"))"
  note "$name: $verdict in $((SECONDS - start)) s (log: $OUT_DIR/$name.log)"
  return $rc
}

export PYTHONPATH="$PWD"
if [[ $MODE == gpu ]]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    step wheels 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
  else
    note "wheels: none in .whl/ (the image must have every package)"
  fi
  export JAX_PLATFORMS=cuda
  BENCH_COMPARE=(--compare qwen2-0.5b --mfu "")
  BENCH_MFU=(--compare "" --mfu llama-1b)
else
  export JAX_PLATFORMS=cpu TETHER_ACCELERATOR_TESTS_ON_CPU=1
  BENCH_COMPARE=(--compare tiny --mfu "" --rows 2 --length 64 --rounds 1 --calls 1)
  BENCH_MFU=(--compare "" --mfu tiny --rows 2 --length 64 --rounds 1 --calls 1 --peak-size 256)
fi
export JAX_ENABLE_COMPILATION_CACHE=false  # every compile is measured as a user's first one

(nvidia-smi || true) > "$OUT_DIR/machine.txt" 2>&1
step versions 120 "$PYTHON" -c "
import sys, importlib.metadata as m, jax
print(sys.version.split()[0], *(f'{p}=={m.version(p)}' for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint')))
print('backend', jax.default_backend(), jax.devices())
assert '$MODE' == 'cpu' or jax.default_backend() == 'gpu', 'no GPU: JAX_PLATFORMS=cuda found none'
" || { cat "$OUT_DIR/versions.log"; note "stopping: JAX does not see the accelerator"; exit 1; }
note "$(head -2 "$OUT_DIR/versions.log" | tr '\n' ' ')"

step accelerator_tests 270 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -m accelerator -s -rA \
  --junitxml="$OUT_DIR/accelerator_tests.xml" tests/accelerator
[[ -f $OUT_DIR/accelerator_tests.log ]] && grep -E "max \||main job:|passed|failed|error" "$OUT_DIR/accelerator_tests.log" | tail -20 | tee -a "$SUMMARY"

step bench_compare 150 "$PYTHON" scripts/bench_gpu.py "${BENCH_COMPARE[@]}" --out "$OUT_DIR/bench_compare"
step bench_mfu 150 "$PYTHON" scripts/bench_gpu.py "${BENCH_MFU[@]}" --out "$OUT_DIR/bench_mfu"
for table in "$OUT_DIR"/bench_compare/bench_gpu.md "$OUT_DIR"/bench_mfu/bench_gpu.md; do
  [[ -f $table ]] && tee -a "$SUMMARY" < "$table"
done
note "all output: $OUT_DIR"
