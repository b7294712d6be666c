#!/usr/bin/env bash
# The fused decode GEMV (kernels/fused_gemv.h) on the GPU machine in one call, from binaries built
# here and carried (scripts/gpu_pack.sh fused_gemv_gpu_test fused_ops_gpu_test
# runner_cuda_graph_test model_gpu_parity_test dropkv-bench-e2e): the GPU tests, memcheck on the
# GEMV test's quick shapes, the GEMV table (cuBLAS vs ours per projection, per launch variant),
# then dropkv-bench-e2e on Llama-3.1-8B geometry with --fused-gemv off and on in the same call; a
# short table last. Run from the repo root after `source scripts/gpu_pack.sh --unpack`.
# Env: SKIP_TESTS=1, SKIP_MEMCHECK=1, SKIP_TABLE=1, SKIP_E2E=1, GEOMETRY (default llama-3.1-8b),
# TESTS (default: the four), VARIANTS (table; default "stream:1 stream:0 ring:1"), E2E_VARIANTS
# ("stream:1 stream:0 ring:1"), PREFILL (2048), T_TEST / T_TABLE / T_E2E / T_MEMCHECK (timeouts,
# s). A variant is "KERNEL:PDL": DROPKV_GEMV_KERNEL (stream, the default, or ring, the previous
# register-ring kernel) and DROPKV_PDL (1 or 0).
set -uo pipefail
OUT=${OUT:-/tmp/gemv-out}
mkdir -p "$OUT"
export DROPKV_SOURCE_DIR=$PWD DROPKV_BUILD_DIR=${DROPKV_BUILD_DIR:-/tmp/dropkv-build}
geo=${GEOMETRY:-llama-3.1-8b}
tests=${TESTS:-fused_gemv_gpu_test fused_ops_gpu_test runner_cuda_graph_test model_gpu_parity_test}
if [[ -z "${SKIP_TESTS:-}" ]]; then
  : > "$OUT/tests.log"
  rm -f "$OUT/gemv_tables.md"
  if [[ "$tests" == *model_gpu_parity_test* ]]; then
    timeout 120 python3 tests/model/make_parity_models.py \
      "$DROPKV_BUILD_DIR/test-scratch/model_parity" >> "$OUT/tests.log" 2>&1
  fi
  for t in $tests; do
    echo "=== $t" >> "$OUT/tests.log"
    timeout "${T_TEST:-150}" "$t" >> "$OUT/tests.log" 2>&1
    echo "$t rc=$?" | tee -a "$OUT/tests.log"
  done
  grep -E "^\[  (FAILED|PASSED)|worst relative|max rows|Failure|Expected|max \|ours" "$OUT/tests.log" | head -40
fi
# Launch variants "KERNEL:PDL" (DROPKV_GEMV_KERNEL, DROPKV_PDL); the first is the default build's.
variants=${VARIANTS:-stream:1 stream:0 ring:1}
if [[ -z "${SKIP_TABLE:-}" ]]; then
  for v in $variants; do
    DROPKV_GEMV_KERNEL=${v%:*} DROPKV_PDL=${v#*:} timeout "${T_TABLE:-90}" \
      dropkv-bench-e2e --geometry "$geo" --gemv-table > "/tmp/gemv_table_${v/:/-}.md" 2>&1
    echo "gemv table $v rc=$?"
    { echo "### kernel:pdl $v"; cat "/tmp/gemv_table_${v/:/-}.md"; } >> "$OUT/gemv_tables.md"
  done
fi
if [[ -z "${SKIP_E2E:-}" ]]; then
  common=(--geometry "$geo" --write-config "/tmp/geo/$geo" --prefill "${PREFILL:-2048}"
          --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --graphs on --json)
  timeout "${T_E2E:-120}" dropkv-bench-e2e "${common[@]}" --fused-gemv off > "$OUT/e2e_off.json" \
    2> /tmp/e2e_off.err
  echo "e2e gemv off rc=$?"
  for v in ${E2E_VARIANTS:-stream:1 stream:0 ring:1}; do
    DROPKV_GEMV_KERNEL=${v%:*} DROPKV_PDL=${v#*:} timeout "${T_E2E:-120}" \
      dropkv-bench-e2e "${common[@]}" --fused-gemv on > "$OUT/e2e_on_${v/:/-}.json" \
      2> "/tmp/e2e_on_${v/:/-}.err"
    echo "e2e gemv on $v rc=$?"
  done
fi
if [[ -z "${SKIP_MEMCHECK:-}" ]]; then
  DROPKV_GEMV_TEST_QUICK=1 timeout "${T_MEMCHECK:-120}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    "$(command -v fused_gemv_gpu_test)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
[[ -f "$OUT/gemv_tables.md" ]] && grep -E "^(\||###)" "$OUT/gemv_tables.md" | grep -v -- "---"
if [[ -z "${SKIP_E2E:-}" ]]; then
  for f in "$OUT"/e2e_off.json "$OUT"/e2e_on_*.json; do
    echo "==================== $(basename "$f" .json) ===================="
    python3 bench/e2e/summarize.py "$f" | grep -E "decode|prefill"
  done
fi
