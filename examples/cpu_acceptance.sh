#!/usr/bin/env bash
# The CPU figures the verifier and first-token issues ask for, measured on this machine in one run: a session on
# a CPU not measured yet (a Zen 3 with AVX2 only, a Zen 4) runs it and has every figure with the flags beside it.
#
#   bash examples/cpu_acceptance.sh [STAGE ...]     (default: flags verifier bench ttft first yield; quality on request)
#
# stages (each writes OUT/STAGE*.txt or .json; OUT defaults to build/acceptance-DATE):
#   flags     CPU model, the flags that pick kernels, cores
#   verifier  t(1) … t(16) and prefill of 1,024 tokens against llama.cpp, each model (python -m ragspec.bench.verifier)
#   bench     Spec-Bench summarization + rag, LIMIT prompts each, 128 tokens, llama,vanilla,suffix,oracle (0.5B)
#   ttft      the 12 quickstart questions' time to first token, each model's pipeline (examples/source_stats.py),
#             and with the tree of earlier prompts, their rephrasings asked after them (examples/prompt_reuse_stats.py)
#   first     a fresh RAGSPEC_HOME's first ask against a warm one, each model, then two first asks at once
#   yield     a fresh home's first ask, then three more 20 s apart while the background job measures the machine,
#             against the same ask once it is measured (examples/first_asks.py, the default pipeline)
#   quality   NQ-open 200 retrieved and CLAP NQ 150 + 150, each model, dtype gguf and BASE_DTYPE (hours)
# Needs `make quickstart` done (the 1.5B installed, indexes/pydoc-topics built) and ../shared; the quality stage
# needs indexes/nq (`ragspec index` of the NQ haystack: docs/evaluation.md). DRY=1 prints the commands only.
# Run it alone on the machine: every stage times something.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-build/acceptance-$(date -u +%Y%m%d-%H%M)}
SHARED=${SHARED:-../shared}
LIMIT=${LIMIT:-40}
NQ_LIMIT=${NQ_LIMIT:-200}
CLAP_LIMIT=${CLAP_LIMIT:-150}
BASE_DTYPE=${BASE_DTYPE:-float32}  # the quality stage's other dtype (what auto ran on the machine before gguf)
SMALL=qwen2.5-coder-0.5b-instruct
LARGE=qwen2.5-coder-1.5b-instruct
PY=.venv/bin/python
RS=.venv/bin/ragspec
QUESTION="What does the global statement do?"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(flags verifier bench ttft first yield)

stop_jobs() {  # the background calibrations asks start (and the measurement each runs): left running, one waits 15
  # minutes for a quiet machine, then measures anyway, beside the next stage (a Zen 4 bench of 2026-11-28 ran beside one)
  pkill -f ragspec.machine.job 2>/dev/null || true
  pkill -f ragspec.machine.table 2>/dev/null || true
}

run() {  # run CMD… > FILE (DRY=1: print it)
  local file=$1; shift
  echo "+ $* > $file"
  [ -n "${DRY:-}" ] && return 0
  { echo "# $(date -u +%FT%TZ) $*"; "$@"; } > "$file" 2>&1 || echo "  failed: see $file"
  stop_jobs
}

pipeline_of() { [ "$1" = "$SMALL" ] && echo pipelines/fast.yaml || echo pipelines/default.yaml; }

with_dtype() {  # a copy of pipeline $1 with generator.dtype $2 under OUT
  local out="$OUT/$(basename "$1" .yaml)-$2.yaml"
  [ -z "${DRY:-}" ] && $PY - "$1" "$2" "$out" <<'EOF'
import sys, yaml
src, dtype, out = sys.argv[1:]
spec = yaml.safe_load(open(src))
spec.setdefault("generator", {}).update(dtype=dtype, backend="transformers")
yaml.safe_dump(spec, open(out, "w"), sort_keys=False)
EOF
  echo "$out"
}

first_asks() {  # $1 model: a fresh home (models linked: weights converted, blocks packed) against a warm ask
  local home="$OUT/home-$1" pipe
  pipe=$(pipeline_of "$1")
  rm -rf "$home" && mkdir -p "$home" && ln -s "${RAGSPEC_HOME:-$HOME/.cache/ragspec}/models" "$home/models"
  for kind in first warm; do
    local t0=$SECONDS
    RAGSPEC_HOME=$home $RS ask "$QUESTION" --index indexes/pydoc-topics --pipeline "$pipe" --json > "$OUT/first-$1-$kind.json"
    echo "$kind ask: $((SECONDS - t0)) s (whole process)"
    stop_jobs
  done
  rm -rf "$home" && mkdir -p "$home" && ln -s "${RAGSPEC_HOME:-$HOME/.cache/ragspec}/models" "$home/models"
  for kind in first warm; do
    local t0=$SECONDS pids=()
    for n in 1 2; do
      RAGSPEC_HOME=$home $RS ask "$QUESTION" --index indexes/pydoc-topics --pipeline "$pipe" --json \
        > "$OUT/first-$1-two-$kind-$n.json" &
      pids+=($!)
    done
    local failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=$((failed + 1)); done
    echo "two $kind asks at once: $((SECONDS - t0)) s ($((2 - failed)) of 2 answered)"
    stop_jobs
  done
}

[ -z "${DRY:-}" ] && mkdir -p "$OUT"
echo "results in $OUT"
for stage in "${STAGES[@]}"; do
  case $stage in
    flags)
      run "$OUT/flags.txt" bash -c "grep -m1 'model name' /proc/cpuinfo; grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; nproc" ;;
    verifier)
      for m in $SMALL $LARGE; do
        run "$OUT/verifier-$m.txt" $PY -m ragspec.bench.verifier --model $m --rounds 1
        run "$OUT/verifier-$m-interleaved.txt" $PY -m ragspec.bench.verifier --model $m --interleave 30
      done ;;
    bench)
      run "$OUT/bench.txt" $RS bench --model $SMALL --prompts "$SHARED/data/spec_bench/question.jsonl" \
        --category summarization,rag --limit "$LIMIT" --methods llama,vanilla,suffix,oracle --max-new-tokens 128 \
        --json "$OUT/bench.json" ;;
    ttft)
      for m in $SMALL $LARGE; do
        run "$OUT/ttft-$m.txt" $PY examples/source_stats.py indexes/pydoc-topics --pipeline "$(pipeline_of $m)" \
          --budgets auto --ttft --json "$OUT/ttft-$m.json"
        run "$OUT/reuse-$m.txt" $PY examples/prompt_reuse_stats.py indexes/pydoc-topics --pipeline "$(pipeline_of $m)" \
          --json "$OUT/reuse-$m.json"
      done ;;
    first)
      for m in $SMALL $LARGE; do
        echo "+ first asks of $m > $OUT/first-$m.txt"
        [ -z "${DRY:-}" ] && first_asks $m > "$OUT/first-$m.txt" 2>&1
      done ;;
    yield)
      run "$OUT/yield.txt" $PY examples/first_asks.py indexes/pydoc-topics --gap 20 --json "$OUT/yield.json" ;;
    quality)
      for m in $SMALL $LARGE; do
        for dtype in gguf "$BASE_DTYPE"; do
          p=$(with_dtype "$(pipeline_of $m)" "$dtype")
          run "$OUT/nq-$m-$dtype.txt" $RS eval-answers --pipeline "$p" --max-new-tokens 48 \
            --data "$SHARED/data/nq_open_oracle/nq-open-oracle.jsonl.gz" --format nq --retrieve indexes/nq \
            --limit "$NQ_LIMIT" --json "$OUT/nq-$m-$dtype.json"
          run "$OUT/clap-$m-$dtype.txt" $RS eval-answers --pipeline "$p" --max-new-tokens 48 \
            --data "$SHARED/data/clapnq" --format clapnq --limit "$CLAP_LIMIT" --json "$OUT/clap-$m-$dtype.json"
        done
        run "$OUT/nq-$m-compare.txt" $RS eval-compare "$OUT/nq-$m-$BASE_DTYPE.json" "$OUT/nq-$m-gguf.json"
        run "$OUT/clap-$m-compare.txt" $RS eval-compare "$OUT/clap-$m-$BASE_DTYPE.json" "$OUT/clap-$m-gguf.json"
      done ;;
    *) echo "unknown stage '$stage' (flags verifier bench ttft first yield quality)" >&2; exit 2 ;;
  esac
done
echo "done: $OUT"
