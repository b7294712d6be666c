#!/usr/bin/env bash
# The issue-8 benchmark on the GPU machine, in one call (carry .gpu; see DEVELOPERS.md):
# builds through scripts/gpu_check.sh (kernel GPU tests included), runs dropkv-bench-e2e on
# Llama-3.1-8B geometry with the HF transformers peer, then Qwen2.5-7B and Gemma-7B geometry,
# and prints the table last. Env: E2E_KV_GIB (KV pool, default 60), SKIP_OTHERS=1.
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
export PATH="/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH"
SKIP_BENCH=1 SKIP_MEMCHECK=1 bash scripts/gpu_check.sh kernels_gpu_test dropkv-bench-e2e \
  > "$OUT/gpu_check.txt" 2>&1
tail -12 "$OUT/gpu_check.txt"
export LD_LIBRARY_PATH="/opt/dropkv-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bench=build-gpu/bin/dropkv-bench-e2e
kv=${E2E_KV_GIB:-60}
"$bench" --geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 8192,32768 \
  --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --kv-gib "$kv" \
  --hf-python python3 --hf-script bench/e2e/hf_peer.py --json > "$OUT/llama.json" 2> "$OUT/llama.err"
tail -4 "$OUT/llama.err"
if [[ -z "${SKIP_OTHERS:-}" ]]; then
  for g in qwen2.5-7b gemma-7b; do
    "$bench" --geometry "$g" --write-config "/tmp/geo/$g" --prefill 32768 --decode 1x8192 \
      --keep 1.0,0.1 --repeats 2 --kv-gib "$kv" --json > "$OUT/$g.json" 2> "$OUT/$g.err"
    tail -2 "$OUT/$g.err"
  done
fi
echo "==================== dropkv-bench-e2e (H200) ===================="
python3 bench/e2e/summarize.py "$OUT"/llama.json "$OUT"/qwen2.5-7b.json "$OUT"/gemma-7b.json
