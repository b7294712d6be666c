#!/usr/bin/env bash
# The fused decode ops (kernels/fused_ops.h) on the GPU machine in one call, from binaries built
# here and carried (scripts/gpu_pack.sh fused_ops_gpu_test runner_cuda_graph_test
# model_gpu_parity_test dropkv-bench-e2e): the GPU tests, then dropkv-bench-e2e on Llama-3.1-8B
# geometry twice in one call, ATen ops (--fused-ops off) then fused with the HF transformers peer,
# and a short table last. Run from the repo root after `source scripts/gpu_pack.sh --unpack`.
# Env: SKIP_TESTS=1, SKIP_HF=1.
set -uo pipefail
OUT=${OUT:-/tmp/fused-out}
mkdir -p "$OUT"
export DROPKV_SOURCE_DIR=$PWD DROPKV_BUILD_DIR=/tmp/dropkv-build
if [[ -z "${SKIP_TESTS:-}" ]]; then
  timeout 120 python3 tests/model/make_parity_models.py "$DROPKV_BUILD_DIR/test-scratch/model_parity" \
    > "$OUT/tests.log" 2>&1
  for t in fused_ops_gpu_test runner_cuda_graph_test model_gpu_parity_test; do
    echo "=== $t" >> "$OUT/tests.log"
    timeout 150 "$t" >> "$OUT/tests.log" 2>&1
    echo "$t rc=$?" | tee -a "$OUT/tests.log"
  done
  grep -E "^\[  (FAILED|PASSED)|worst relative|Failure|Expected|max \|diff" "$OUT/tests.log" | head -30
fi
common=(--geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 32768
        --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --graphs on --json)
timeout 120 dropkv-bench-e2e "${common[@]}" --fused-ops off > "$OUT/llama_aten.json" 2> "$OUT/aten.err"
tail -6 "$OUT/aten.err"
hf=(--hf-python python3 --hf-script bench/e2e/hf_peer.py)
[[ -n "${SKIP_HF:-}" ]] && hf=()
timeout 200 dropkv-bench-e2e "${common[@]}" --fused-ops on "${hf[@]}" > "$OUT/llama_fused.json" \
  2> "$OUT/fused.err"
tail -10 "$OUT/fused.err"
echo "==================== ATen ops (--fused-ops off) ===================="
python3 bench/e2e/summarize.py "$OUT/llama_aten.json"
echo "==================== fused (--fused-ops on) + HF peer ===================="
python3 bench/e2e/summarize.py "$OUT/llama_fused.json"
