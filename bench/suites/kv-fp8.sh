#!/usr/bin/env bash
# The FP8 KV cache on the H200 in one call, from a pack built here (DEVELOPERS.md, "Several people
# at once"): the GPU tests it touches, then dropkv-bench-e2e on Llama-3.1-8B geometry with bf16
# weights + bf16 KV, bf16 weights + FP8 KV, FP8 weights + bf16 KV and FP8 weights + FP8 KV side by
# side (decode bs1 8K and bs16 2K at keep 1.0 / 0.1 with CUDA graphs, the 32K sequences that fit,
# the decode throughput at that full-memory batch). Logs and tables go to $OUT (5 files);
# the rows are printed last; the exit status is the tests'. About 1 minute (2026-12-02).
#   there: PACKDIR=DIR bash bench/run.sh kv-fp8   (DIR holds scripts/gpu_pack.sh and .gpu-pack/;
#   without PACKDIR: this file's own folder, so a copy of it in DIR runs as `bash DIR/kv-fp8.sh`)
set -uo pipefail
here=${PACKDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
OUT=${OUT:-/tmp/kv_fp8_out}
mkdir -p "$OUT"
source "$here/scripts/gpu_pack.sh" --unpack || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
{
  kv_fp8_gpu_test
  kernels_gpu_test --gtest_filter='*PagedDecode*'
  fused_ops_gpu_test --gtest_filter='*Rope*'
  fused_gemv_gpu_test --gtest_filter='*RopeEpilogue*'
  runner_cuda_graph_test
} > "$OUT/tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED) |^\[fp8|Failure|Expected|Which is|differs" "$OUT/tests.log" | head -40
rc=0
grep -q -E "^\[  FAILED  \]" "$OUT/tests.log" && rc=1
run() {  # name, extra flags
  local name=$1
  shift
  dropkv-bench-e2e --geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 8192 \
    --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 2 --graphs on --synthetic-context \
    --throughput-context 32768 "$@" > "$OUT/$name.txt" 2> "/tmp/$name.err"
  echo "=== $name ($*): exit $?"
  grep -v -E "^\[" "$OUT/$name.txt"
  grep -i -E "error|fail" "/tmp/$name.err" | head -5 || true
}
run bf16
run bf16w_fp8kv --kv-cache-dtype fp8
run fp8w --quantization fp8
run fp8w_fp8kv --quantization fp8 --kv-cache-dtype fp8
exit $rc
