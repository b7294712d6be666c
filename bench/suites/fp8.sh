#!/usr/bin/env bash
# FP8 weights on the H200 in one call, from a pack built here (DEVELOPERS.md): the GPU tests of
# the FP8 paths, dropkv-bench-e2e --gemv-table (bf16 / FP8 GEMV and FP8 GEMM per projection), then
# Llama-3.1-8B geometry end to end (prefill 8K / 32K; decode bs1 8K, bs4 4K, bs8 4K, bs16 2K; keep
# 1.0 / 0.1; CUDA graphs) with FP8 weights, FP8 weights + FP8 KV and bf16, for each binary of
# BENCHES in turn, ROUNDS times (an A/B of two builds alternates them in one call; the table
# runs the last). The tests' log and the table go to $OUT, the runs' logs to /tmp/fp8_runs;
# everything is printed; the exit status is the tests'.
#   there: source scripts/gpu_pack.sh --unpack; bash bench/run.sh fp8
#   BENCHES (default dropkv-bench-e2e), ROUNDS (1), SKIP_TESTS=1, SKIP_TABLE=1,
#   RUNS (default "fp8w fp8w_fp8kv bf16"), PREFILL (8192,32768), DECODE (1x8192,4x4096,8x4096,16x2048)
set -uo pipefail
OUT=${OUT:-/tmp/fp8_out}
BENCHES=${BENCHES:-dropkv-bench-e2e}
ROUNDS=${ROUNDS:-1}
RUNS=${RUNS:-fp8w fp8w_fp8kv bf16}
PREFILL=${PREFILL:-8192,32768}
DECODE=${DECODE:-1x8192,4x4096,8x4096,16x2048}
RUNS_DIR=/tmp/fp8_runs
mkdir -p "$OUT" "$RUNS_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
rc=0
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  {
    fp8_gpu_test
    fused_gemv_gpu_test
    fused_ops_gpu_test
    kv_fp8_gpu_test
    runner_cuda_graph_test
  } > "$OUT/tests.log" 2>&1
  grep -E "^\[  (PASSED|FAILED) |^\[fp8|Failure|Expected|Which is|differs" "$OUT/tests.log" | head -40
  grep -q -E "^\[  FAILED  \]" "$OUT/tests.log" && rc=1
fi
last=${BENCHES##* }
if [[ "${SKIP_TABLE:-0}" != 1 ]]; then
  "$last" --geometry llama-3.1-8b --gemv-table > "$OUT/gemv_table.txt" 2>&1
  echo "=== gemv table ($last): exit $?"
  grep -E "^\||PDL" "$OUT/gemv_table.txt"
fi
flags_of() {
  case $1 in
    fp8w) echo "--quantization fp8" ;;
    fp8w_fp8kv) echo "--quantization fp8 --kv-cache-dtype fp8" ;;
    bf16) echo "" ;;
  esac
}
for round in $(seq 1 "$ROUNDS"); do
  for bench in $BENCHES; do
    for run in $RUNS; do
      name="${bench}_${run}_r${round}"
      # shellcheck disable=SC2046
      "$bench" --geometry llama-3.1-8b --prefill "$PREFILL" --decode "$DECODE" \
        --keep 1.0,0.1 --repeats 2 --graphs on --synthetic-context $(flags_of "$run") \
        > "$RUNS_DIR/$name.txt" 2> "$RUNS_DIR/$name.err"
      echo "=== $name ($(flags_of "$run")): exit $?"
      grep -v -E "^$|^\[" "$RUNS_DIR/$name.txt"
      grep -i -E "error|fail" "$RUNS_DIR/$name.err" | head -5 || true
    done
  done
done
exit $rc
