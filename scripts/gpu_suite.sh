#!/usr/bin/env bash
# Every GPU test and the headline benchmarks in one device call, from binaries built HERE for sm_90
# and carried (no build there; the GPU machine has no gRPC, and a call then spends no time
# compiling). On the dev machine:
#   cmake -S . -B build-gpu-local -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DDROPKV_CUDA=ON \
#         -DDROPKV_TESTS=ON -DDROPKV_BENCH=ON && cmake --build build-gpu-local -j2
#   bash scripts/gpu_suite.sh --pack
# then the device call, with carry [".gpu-pack"], from the repo root:
#   bash scripts/gpu_suite.sh
# Env: SKIP_HF=1 (no HF transformers peer), SKIP_SCORE=1, SKIP_E2E=1, E2E_REPEATS (default 3),
#   BASELINE=1: dropkv-bench-e2e first with DROPKV_PREFILL_ATTENTION=sdpa
#   (at::scaled_dot_product_attention prefill, DropKV's three passes; kernels/tuning.h), so the
#   two prefill paths are compared in one call.
# Logs and JSON go to $OUT; a short table is printed last.
# (scripts/gpu_check.sh is the other route: it builds the kernel targets on the GPU machine.)
set -uo pipefail
tests=(kernels_gpu_test fused_ops_gpu_test fused_gemv_gpu_test prefill_attention_gpu_test
       compression_press_gpu_test compression_decode_gpu_test runner_cuda_graph_test
       model_gpu_parity_test fp8_gpu_test kv_fp8_gpu_test)
if [[ "${1:-}" == "--pack" ]]; then
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  exec bash "$root/scripts/gpu_pack.sh" -B "${2:-$root/build-gpu-local}" \
    bin/dropkv-bench-e2e bin/dropkv-bench-score "${tests[@]/#/tests/}"
fi

OUT=${OUT:-/tmp/gpu-suite}
mkdir -p "$OUT"
source scripts/gpu_pack.sh --unpack || exit 1
export DROPKV_SOURCE_DIR=$PWD DROPKV_BUILD_DIR=/tmp/dropkv-build
declare -A result
t_start=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader

timeout 120 python3 tests/model/make_parity_models.py "$DROPKV_BUILD_DIR/test-scratch/model_parity" \
  > "$OUT/parity_models.log" 2>&1 || echo "make_parity_models failed (see parity_models.log)"
for t in "${tests[@]}"; do
  t0=$SECONDS
  timeout 240 "$t" > "$OUT/$t.log" 2>&1
  rc=$?
  passed=$(grep -c '^\[       OK \]' "$OUT/$t.log")
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$OUT/$t.log")
  result[$t]="rc=$rc, $passed passed, $failed failed, $((SECONDS - t0)) s"
  [[ $rc -ne 0 ]] && grep -E "Failure|Expected|Which is|FAILED" "$OUT/$t.log" | head -20
done

if [[ -z "${SKIP_SCORE:-}" ]]; then
  timeout 150 dropkv-bench-score --n 4096 131072 524288 > "$OUT/bench_score.txt" 2>&1
  result[bench_score]="rc=$?"
  timeout 60 dropkv-bench-score --h2o --runs 10 > "$OUT/bench_h2o.txt" 2>&1
  result[bench_h2o]="rc=$?"
fi

e2e=(--geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 32768
     --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats "${E2E_REPEATS:-3}" --graphs on --json)
[[ -n "${SKIP_E2E:-}" ]] && BASELINE=
if [[ -n "${BASELINE:-}" ]]; then
  DROPKV_PREFILL_ATTENTION=sdpa timeout 200 dropkv-bench-e2e "${e2e[@]}" \
    > "$OUT/e2e_llama_baseline.json" 2> "$OUT/e2e_llama_baseline.err"
  result[bench_e2e_baseline]="rc=$?"
fi
hf=(--hf-python python3 --hf-script bench/e2e/hf_peer.py)
[[ -n "${SKIP_HF:-}" ]] && hf=()
if [[ -z "${SKIP_E2E:-}" ]]; then
  timeout 300 dropkv-bench-e2e "${e2e[@]}" "${hf[@]}" > "$OUT/e2e_llama.json" 2> "$OUT/e2e_llama.err"
  result[bench_e2e]="rc=$?"
fi

echo "==================== dropkv-bench-score (one layer, Llama-3.1-8B geometry)"
grep -v '^\s*$' "$OUT/bench_score.txt" 2>/dev/null | tail -40
grep -v '^\s*$' "$OUT/bench_h2o.txt" 2>/dev/null | tail -12
if [[ -n "${BASELINE:-}" ]]; then
  echo "==================== dropkv-bench-e2e, previous kernels (v7 decode, SDPA prefill)"
  python3 bench/e2e/summarize.py "$OUT/e2e_llama_baseline.json" || tail -20 "$OUT/e2e_llama_baseline.err"
fi
if [[ -z "${SKIP_E2E:-}" ]]; then
  echo "==================== dropkv-bench-e2e (Llama-3.1-8B geometry)"
  python3 bench/e2e/summarize.py "$OUT/e2e_llama.json" || tail -20 "$OUT/e2e_llama.err"
fi
echo "==================== GPU tests ($((SECONDS - t_start)) s in all)"
for k in "${tests[@]}" bench_score bench_h2o bench_e2e_baseline bench_e2e; do
  [[ -n "${result[$k]:-}" ]] && printf '%-28s %s\n' "$k" "${result[$k]}"
done
