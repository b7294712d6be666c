#!/usr/bin/env bash
# The end-to-end engine benchmark on the GPU machine, in one call (carry .gpu; see DEVELOPERS.md):
# builds through scripts/gpu_check.sh (kernel GPU tests included), runs the model runtime's GPU
# tests (graph vs eager decode, HF parity on CUDA), then dropkv-bench-e2e on Llama-3.1-8B geometry
# with the HF transformers peer (decode with CUDA graphs on and off, decode throughput at the
# full-memory batch), then Qwen2.5-7B and Gemma-7B geometry, and prints the table last.
# At most 6 files land in $OUT (the device tool returns 8). Env: E2E_KV_GIB (KV pool in GiB,
# default 0 = all free memory after the weights and a reserve), SKIP_OTHERS=1, SKIP_TESTS=1,
# BENCH=path: that dropkv-bench-e2e (e.g. from a pack built here: `source scripts/gpu_pack.sh
# --unpack`, then BENCH=dropkv-bench-e2e; scripts/gpu_suite.sh runs that pack's tests), no build.
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export PATH="/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH"
if [[ -z "${BENCH:-}" ]]; then
  logs=/tmp/gpu_check_logs
  mkdir -p "$logs"
  OUT=$logs SKIP_BENCH=1 SKIP_MEMCHECK=1 bash scripts/gpu_check.sh kernels_gpu_test \
    dropkv-bench-e2e runner_cuda_graph_test model_gpu_parity_test model_parity_test \
    > "$OUT/gpu_check.txt" 2>&1
  tail -12 "$OUT/gpu_check.txt"
  export LD_LIBRARY_PATH="/opt/dropkv-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ -z "${SKIP_TESTS:-}${BENCH:-}" ]]; then
  ctest --test-dir build-gpu -R "runner_cuda_graph_test|model_gpu_parity_test|model_parity" \
    --output-on-failure > "$OUT/tests.log" 2>&1
  grep -E "Test +#|tests passed|graph vs eager|Failure|Expected|step" "$OUT/tests.log" | head -30
fi
bench=${BENCH:-build-gpu/bin/dropkv-bench-e2e}
kv=${E2E_KV_GIB:-0}
"$bench" --geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 8192,32768 \
  --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --kv-gib "$kv" --graphs both \
  --throughput-context 32768 --hf-python python3 --hf-script bench/e2e/hf_peer.py --json \
  > "$OUT/llama.json" 2> /tmp/llama.err
tail -14 /tmp/llama.err
if [[ -z "${SKIP_OTHERS:-}" ]]; then
  for g in qwen2.5-7b gemma-7b; do
    "$bench" --geometry "$g" --write-config "/tmp/geo/$g" --prefill 32768 --decode 1x8192 \
      --keep 1.0,0.1 --repeats 2 --kv-gib "$kv" --graphs on --json > "$OUT/$g.json" 2> "/tmp/$g.err"
    tail -5 "/tmp/$g.err"
  done
fi
echo "==================== dropkv-bench-e2e (H200) ===================="
python3 bench/e2e/summarize.py "$OUT"/llama.json "$OUT"/qwen2.5-7b.json "$OUT"/gemma-7b.json
