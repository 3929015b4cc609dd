#!/usr/bin/env bash
# Issue 28's checks on the GPU machine in ONE command, from the checkout's root: installs the carried wheels (.whl/),
# runs the loop checks of issues 37 and 51 first (decode, the recipe cold and warm, publish and the weight delta, the
# main job's speed: the most valuable per second of GPU time), then tests/accelerator/ (golden logits and the update
# against the CPU's; then the main job for 60 steps), then the benchmarks (scripts.bench.gpu: Tether vs tunix at
# qwen2-0.5b; scripts.bench.lora: LoRA vs full fine-tuning at llama-1b; scripts.bench.gpu: MFU at llama-1b), then
# issue 41's partial rollouts side by side (scripts.bench.partial, then learner.tools.check_rollout_logprobs on its
# partial run), each step under its own timeout, with JAX_PLATFORMS=cuda
# so that a CPU fallback cannot pass. A failing or timed-out step does not stop the later ones. Everything is
# written under OUT_DIR (default: $OUT, the device tool's output folder, else ./gpu_check_out);
# the summary (each step's status, the tests' key numbers, the benchmark tables) is printed at the end.
# Time: each step's timeout is capped by what is left of BUDGET_S (default 520 s: the device tool allows 600 s a
# command), so the whole script ends within BUDGET_S + ~40 s (each timeout's 10 s kill grace). It exits 1 when a step
# failed. ONLY="bench_mfu ..." runs only the steps named.
# Issue 38's steps (after bench_mfu, which runs cuDNN and XLA attention side by side): bench_long (llama-1b B2 x T8192),
# bench_remat (rematerialisation policies), bench_passes (proximal-pass fusion, buffer donation, logprob chunk size);
# each writes bench_gpu.json / .md under its own folder, a row per variant, the baseline rerun in the same step. They
# do not all fit in one call's budget after the others: a kernel-only call is
#   ONLY="accelerator_tests bench_mfu bench_long bench_remat" scripts/gpu_check.sh   (then ONLY="bench_passes")
#
#   scripts/gpu_check.sh [OUT_DIR]                     # on the GPU machine
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --cpu [OUT_DIR]   # dry run on a CPU: no platform check, the
#                                                      # accelerator tests run on the CPU, tiny benchmark shapes
#
# .whl/ (one folder, so one `carry` path) holds what the image lacks (../shared/gpu/fetch-wheels.sh) plus, when the
# image has no pytest, pytest's own wheels (docs/accelerators.md):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pytest pluggy iniconfig packaging pytest-xdist execnet
set -uo pipefail

MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-520}"
FAILURES=0
[[ $MODE == cpu ]] && BUDGET_S=$((BUDGET_S * 4))  # a 2-core CPU compiles and runs far slower than the GPU
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
wanted() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
step() {  # step NAME SECONDS COMMAND...: under timeout (capped by the budget left), output to OUT_DIR/NAME.log
  local name=$1 seconds=$2; shift 2
  [[ $MODE == cpu ]] && seconds=$((seconds * 4))
  local left=$((BUDGET_S - SECONDS))
  (( seconds > left )) && seconds=$left
  if (( seconds < 10 )); then FAILURES=$((FAILURES + 1)); note "$name: SKIPPED (the ${BUDGET_S} s budget is spent)"; return 1; fi
  local start=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  (( rc != 0 )) && FAILURES=$((FAILURES + 1))
  local verdict=ok; [[ $rc -ne 0 ]] && verdict="FAILED (exit $rc$([[ $rc -eq 124 || $rc -eq 137 ]] && echo ", timed out after ${seconds} s"))"
  note "$name: $verdict in $((SECONDS - start)) s (log: $OUT_DIR/$name.log)"
  return $rc
}

export PYTHONPATH="$PWD"
if [[ $MODE == gpu ]]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    # pip when the image has it, else the wheels unpacked as they are (a wheel is a zip of its site-packages files)
    site=$(mktemp -d)  # the carried packages, first on the path
    step wheels 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
      || { step wheels_unzipped 60 bash -c 'for w in .whl/*.whl; do "$0" -m zipfile -e "$w" "$1" || exit 1; done' \
             "$PYTHON" "$site" && FAILURES=$((FAILURES - 1)); }  # unpacked: pip's failure does not count
    export PYTHONPATH="$site:$PWD"
  else
    note "wheels: none in .whl/ (the image must have every package)"
  fi
  export JAX_PLATFORMS=cuda
  BENCH_COMPARE=(--compare qwen2-0.5b --mfu "")
  BENCH_MFU=(--compare "" --mfu llama-1b --variants attention=xla)
  BENCH_LORA=(--model llama-1b --batch 8 --length 1024 --steps 5 --dtype bfloat16)
  BENCH_LONG=(--compare "" --mfu llama-1b --rows 2 --length 8192 --rounds 2 --calls 2
              --variants logprob_chunk_size=2048)
  BENCH_REMAT=(--compare "" --mfu llama-1b --variants remat=full remat=dots remat=qkv_attention)
  BENCH_PASSES=(--compare "" --mfu llama-1b --variants fuse_proximal=off donate=none donate=state+batch
                logprob_chunk_size=128)
  RECIPE=(--shape qwen2-0.5b --prompts 16 --samples 8 --new-tokens 512)  # issue 37: 16 x 8 x 512, bf16 compute
  PUBLISH=(--model qwen2-0.5b --dtype bfloat16 --repeats 4)
  DECODE=(--model qwen2-0.5b --dtype bfloat16 --rows 128 --new-tokens 512)
  WEIGHT_DELTA=(--model qwen2-0.5b --dtype bfloat16 --learning-rate 1e-6)  # the recipe's learning rate
  MAIN_JOB_STEPS=60
  # issue 41: the two runs share the GPU at once (learner 0.3 + server 0.15 of its memory each)
  PARTIAL=(--steps 60 --set mesh.device_memory_fraction=0.3 --set server.device_memory_fraction=0.15)
else
  export JAX_PLATFORMS=cpu TETHER_ACCELERATOR_TESTS_ON_CPU=1
  BENCH_COMPARE=(--compare tiny --mfu "" --rows 2 --length 64 --rounds 1 --calls 1)
  TINY_MFU=(--compare "" --mfu tiny --rows 2 --length 64 --rounds 1 --calls 1 --peak-size 256)
  BENCH_MFU=("${TINY_MFU[@]}" --variants attention=xla)
  BENCH_LORA=(--model tiny --batch 2 --length 64 --steps 1)
  BENCH_LONG=(--compare "" --mfu tiny --rows 2 --length 256 --rounds 1 --calls 1 --peak-size 256
              --variants logprob_chunk_size=64)
  BENCH_REMAT=("${TINY_MFU[@]}" --variants remat=full)
  BENCH_PASSES=("${TINY_MFU[@]}" --variants fuse_proximal=off,donate=state+batch)
  RECIPE=(--shape 17m --prompts 2 --samples 2 --new-tokens 8 --set server.max_batch_size=8)
  PUBLISH=(--model tiny --repeats 3)
  DECODE=(--model tiny --rows 4 --prompt-tokens 8 --new-tokens 16 --steps-per-call 4)
  WEIGHT_DELTA=(--model tiny --length 16)
  MAIN_JOB_STEPS=4
  PARTIAL=(--steps 3 --set warmup.steps=5 --set checkpoints.every=1000)
fi
export JAX_ENABLE_COMPILATION_CACHE=false  # every compile is measured as a user's first one

(timeout 30 nvidia-smi || true) > "$OUT_DIR/machine.txt" 2>&1
step versions 60 "$PYTHON" -c "
import sys, importlib.metadata as m
def version(p):
    try: return m.version(p)
    except m.PackageNotFoundError: return 'missing'
print(sys.version.split()[0], *(f'{p}=={version(p)}' for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grpcio', 'pytest')))
import jax
print('backend', jax.default_backend(), jax.devices())
assert '$MODE' == 'cpu' or jax.default_backend() == 'gpu', 'no GPU: JAX_PLATFORMS=cuda found none'
" || note "versions: JAX does not see the accelerator, or the budget is spent; the later steps will fail fast"
[[ -f $OUT_DIR/versions.log ]] && note "$(head -2 "$OUT_DIR/versions.log" | tr '\n' ' ')"

# Issues 37 and 51, first (by value: decode, recipe, publish, warm start, then the kernel below): the loop at
# accelerator speed. Decode against its floor, as the recipe samples (no top-k/top-p: the vocabulary sort skipped)
# and with top-p 0.9 (the sort on); the GSM8K recipe on a random checkpoint of Qwen2.5-0.5B's shape, cold (its own
# empty compilation cache) then warm (the same cache, 2 steps; "learner so far" splits trace / lower / compile or
# load); the publish against a memcpy, and the bf16 words one Adam step changes (the case for a delta publish); the
# README's main job's steps/s and per-phase split.
RECIPE_CACHE="$OUT_DIR/recipe_jax_cache"
summary_lines() { grep -E "$2" "$OUT_DIR/$1.log" | tee -a "$SUMMARY"; }
wanted bench_decode && step bench_decode 120 "$PYTHON" -m scripts.bench.decode "${DECODE[@]}" \
  --out "$OUT_DIR/bench_decode.json" && summary_lines bench_decode "tokens/s"
wanted bench_decode_cut && step bench_decode_cut 90 "$PYTHON" -m scripts.bench.decode "${DECODE[@]}" --top-p 0.9 \
  --out "$OUT_DIR/bench_decode_cut.json" && summary_lines bench_decode_cut "tokens/s"
wanted recipe && JAX_ENABLE_COMPILATION_CACHE=true JAX_COMPILATION_CACHE_DIR="$RECIPE_CACHE" \
  step recipe 300 "$PYTHON" -m scripts.bench.recipe "${RECIPE[@]}" --steps 3 --out "$OUT_DIR/recipe" \
  && summary_lines recipe "^(step |steady|start-up|  learner so far)"
wanted recipe_warm && JAX_ENABLE_COMPILATION_CACHE=true JAX_COMPILATION_CACHE_DIR="$RECIPE_CACHE" \
  step recipe_warm 150 "$PYTHON" -m scripts.bench.recipe "${RECIPE[@]}" --steps 2 --out "$OUT_DIR/recipe_warm" \
  && summary_lines recipe_warm "^(step |start-up|  learner so far)"
wanted bench_publish && step bench_publish 120 "$PYTHON" -m scripts.bench.publish "${PUBLISH[@]}" \
  --out "$OUT_DIR/bench_publish.json" && summary_lines bench_publish "memcpy|shared|streamed"
wanted bench_weight_delta && step bench_weight_delta 90 "$PYTHON" -m scripts.bench.weight_delta "${WEIGHT_DELTA[@]}" \
  --out "$OUT_DIR/bench_weight_delta.json" && summary_lines bench_weight_delta "changed"
wanted main_job_speed && step main_job_speed 150 "$PYTHON" -m learner.train --config configs/default.toml \
  --run-dir "$OUT_DIR/main_job_speed" --set loop.steps=$MAIN_JOB_STEPS --set checkpoints.every=1000 \
  && step main_job_summary 30 "$PYTHON" -m scripts.bench.recipe --summarize "$OUT_DIR/main_job_speed" \
  && summary_lines main_job_summary "^(steady|start-up)"


tests() {  # tests NAME SECONDS FILES...: pytest on the accelerator-marked tests of FILES, their numbers to the summary
  local name=$1 seconds=$2; shift 2
  wanted "$name" || return 0
  if ! "$PYTHON" -c "import pytest" 2> /dev/null; then
    FAILURES=$((FAILURES + 1))
    note "$name: SKIPPED (pytest is not importable: carry its wheels in .whl/, see this script's header)"; return 1
  fi
  step "$name" "$seconds" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -m accelerator -s -rA \
    --junitxml="$OUT_DIR/$name.xml" "$@"
  [[ -f $OUT_DIR/$name.log ]] && grep -E "max \||main job:|passed|failed|error" "$OUT_DIR/$name.log" | tail -12 | tee -a "$SUMMARY"
}
# the main job alone, so that its time cannot cut the others short
tests accelerator_tests 150 tests/accelerator/test_golden_logits.py tests/accelerator/test_update_matches_cpu.py \
  tests/accelerator/test_attention_cudnn.py
tests main_job 200 tests/accelerator/test_main_job.py  # main at staleness 1: 108 s for 60 steps

wanted bench_compare && step bench_compare 120 "$PYTHON" -m scripts.bench.gpu "${BENCH_COMPARE[@]}" --out "$OUT_DIR/bench_compare"
wanted bench_lora && step bench_lora 240 "$PYTHON" -m scripts.bench.lora "${BENCH_LORA[@]}" --out "$OUT_DIR/bench_lora.json" \
  && grep -E "^LoRA / full" "$OUT_DIR/bench_lora.log" | tee -a "$SUMMARY"
wanted bench_mfu && step bench_mfu 240 "$PYTHON" -m scripts.bench.gpu "${BENCH_MFU[@]}" --out "$OUT_DIR/bench_mfu"
wanted bench_long && step bench_long 240 "$PYTHON" -m scripts.bench.gpu "${BENCH_LONG[@]}" --out "$OUT_DIR/bench_long"
wanted bench_remat && step bench_remat 360 "$PYTHON" -m scripts.bench.gpu "${BENCH_REMAT[@]}" \
  --out "$OUT_DIR/bench_remat"
wanted bench_passes && step bench_passes 420 "$PYTHON" -m scripts.bench.gpu "${BENCH_PASSES[@]}" \
  --out "$OUT_DIR/bench_passes"
# Issue 41: partial rollouts side by side with rollout.partial = false, where generation, not the update, is the
# bottleneck (on a CPU the update is: docs/benchmarks.md); then the partial run's logged tokens against the checkpoint
# of the version that drew them (learner.tools.check_rollout_logprobs: the versions with a checkpoint; --max-diff
# 0.05 leaves room for TF32 rounding and catches a wrong version or cache, ~0.1 and up)
# (the two run directories stay out of OUT_DIR: their checkpoints and logs are many files; the tables are the result)
PARTIAL_RUNS=$(mktemp -d)
wanted bench_partial && step bench_partial 300 "$PYTHON" -m scripts.bench.partial "${PARTIAL[@]}" \
  --out "$PARTIAL_RUNS" && summary_lines bench_partial "run|partial=" \
  && step partial_logprobs 60 "$PYTHON" -m learner.tools.check_rollout_logprobs "$PARTIAL_RUNS/partial=true-0" \
  --max-diff 0.05 \
  && summary_lines partial_logprobs "checked|version"
for table in "$OUT_DIR"/bench_{compare,mfu,long,remat,passes}/bench_gpu.md; do
  [[ -f $table ]] && tee -a "$SUMMARY" < "$table"
done
note "all output: $OUT_DIR ($((SECONDS)) s in all)"
echo; echo "=== summary ($SUMMARY) ==="; cat "$SUMMARY"
(( FAILURES == 0 ))
