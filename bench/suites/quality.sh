#!/usr/bin/env bash
# The GPU quality suite on the trained models, in one device call after the staging calls
# (scripts/gpu_stage_models.sh's header: 6 calls that carry the GGUF pieces, back to back):
#   here:  bash bench/quality/run_gpu.sh --wheels
#          scripts/gpu_pack.sh -B build bin/dropkv-quality-tasks bin/dropkv-quality \
#            tests/model_gpu_real_models_test
#   there: carry [".gpu-pack", ".whl/kvpress"], command `bash bench/run.sh quality`
# Reports what is staged, runs the trained-model parity test (ours against HF transformers on the
# same GPU, PARITY=0 skips it; at most PARITY_S seconds [210]), then bench/quality/run_gpu.sh's
# task table with this script's environment (its header: RUNS, NUM, TASKS, KEEPS, METHODS,
# PRESSES, SEED, SKIP_KVPRESS, ...) in the time left of END seconds [560] since the call began,
# and prints the tables last. $OUT gets gpu_real_models.log, tables.md, run.log and the
# per-prompt results gzipped (ours.jsonl.gz, kvpress.jsonl.gz).
set -uo pipefail
OUT=${OUT:-/tmp/dropkv-quality-suite}
mkdir -p "$OUT"
bash scripts/gpu_stage_models.sh 2>&1 | tail -1
source scripts/gpu_pack.sh --unpack > /dev/null || exit 1
export DROPKV_GPU_MODELS=${DROPKV_GPU_MODELS:-/tmp/dropkv-stage/models}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ "${PARITY:-1}" != 0 ]]; then
  s=$SECONDS
  timeout "${PARITY_S:-210}" model_gpu_real_models_test > "$OUT/gpu_real_models.log" 2>&1
  echo "quality: parity rc=$? in $((SECONDS - s)) s"
  grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure' "$OUT/gpu_real_models.log" | head -30
fi
work=/tmp/dropkv-quality-suite-run
BUDGET=$((${END:-560} - SECONDS)) OUT=$work bash bench/quality/run_gpu.sh > /dev/null 2>&1
cp "$work/tables.md" "$work/run.log" "$OUT/" 2>/dev/null
for f in ours kvpress; do [[ -s "$work/$f.jsonl" ]] && gzip -c "$work/$f.jsonl" > "$OUT/$f.jsonl.gz"; done
grep 'run_gpu:' "$work/run.log"
cat "$work/tables.md"
