#!/usr/bin/env bash
# The fused decode GEMV (kernels/fused_gemv.h) on the GPU machine in one call, from binaries built
# here and carried (scripts/gpu_pack.sh fused_gemv_gpu_test fused_ops_gpu_test
# runner_cuda_graph_test model_gpu_parity_test dropkv-bench-e2e): the GPU tests, memcheck on the
# GEMV test's quick shapes, the GEMV table (cuBLAS vs ours per projection, both unrolls), then
# dropkv-bench-e2e on Llama-3.1-8B geometry with --fused-gemv off and on in the same call; a short
# table last. Run from the repo root after `source scripts/gpu_pack.sh --unpack`.
# Env: SKIP_TESTS=1, SKIP_MEMCHECK=1, SKIP_TABLE=1, SKIP_E2E=1, GEOMETRY (default llama-3.1-8b),
# TESTS (default: the four), UNROLLS (default "8 4"), PREFILL (2048), T_TEST / T_TABLE / T_E2E /
# T_MEMCHECK (timeouts, s).
set -uo pipefail
OUT=${OUT:-/tmp/gemv-out}
mkdir -p "$OUT"
export DROPKV_SOURCE_DIR=$PWD DROPKV_BUILD_DIR=${DROPKV_BUILD_DIR:-/tmp/dropkv-build}
geo=${GEOMETRY:-llama-3.1-8b}
tests=${TESTS:-fused_gemv_gpu_test fused_ops_gpu_test runner_cuda_graph_test model_gpu_parity_test}
if [[ -z "${SKIP_TESTS:-}" ]]; then
  : > "$OUT/tests.log"
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
if [[ -z "${SKIP_TABLE:-}" ]]; then
  for u in ${UNROLLS:-8 4}; do
    DROPKV_GEMV_UNROLL=$u timeout "${T_TABLE:-90}" dropkv-bench-e2e --geometry "$geo" --gemv-table \
      > "$OUT/gemv_table_u$u.md" 2> "$OUT/gemv_table_u$u.err"
    echo "gemv table unroll $u rc=$?"
  done
fi
if [[ -z "${SKIP_E2E:-}" ]]; then
  common=(--geometry "$geo" --write-config "/tmp/geo/$geo" --prefill "${PREFILL:-2048}"
          --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --graphs on --json)
  timeout "${T_E2E:-120}" dropkv-bench-e2e "${common[@]}" --fused-gemv off > "$OUT/e2e_gemv_off.json" \
    2> "$OUT/e2e_gemv_off.err"
  echo "e2e gemv off rc=$?"
  timeout "${T_E2E:-120}" dropkv-bench-e2e "${common[@]}" --fused-gemv on > "$OUT/e2e_gemv_on.json" \
    2> "$OUT/e2e_gemv_on.err"
  echo "e2e gemv on rc=$?"
fi
if [[ -z "${SKIP_MEMCHECK:-}" ]]; then
  DROPKV_GEMV_TEST_QUICK=1 timeout "${T_MEMCHECK:-120}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    "$(command -v fused_gemv_gpu_test)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
for u in ${UNROLLS:-8 4}; do
  [[ -f "$OUT/gemv_table_u$u.md" ]] && { echo "==== GEMV table, unroll $u"; cat "$OUT/gemv_table_u$u.md"; }
done
if [[ -z "${SKIP_E2E:-}" ]]; then
  echo "==================== --fused-gemv off ===================="
  python3 bench/e2e/summarize.py "$OUT/e2e_gemv_off.json" | grep -v "peak GiB"
  echo "==================== --fused-gemv on ===================="
  python3 bench/e2e/summarize.py "$OUT/e2e_gemv_on.json" | grep -v "peak GiB"
fi
