#!/usr/bin/env bash
# Issue 10's GPU load sweep, the full gRPC server on the H200, in one device call:
#   here:  scripts/gpu_pack.sh bin/dropkv-server bin/dropkv-loadgen bin/dropkv-bench-e2e
#          mkdir -p .gpu-pack/tok && cp ../shared/tokenizers/llama3/tokenizer*.json.gz .gpu-pack/tok/
#   there: run with carry [".gpu-pack"], command `bash bench/loadgen/run_h200.sh`
# Llama-3.1-8B geometry with random weights (bf16) and the Llama-3 tokenizer; 8K-token prompts,
# 256 output tokens; a closed-loop concurrency sweep at keep 100% and at DropKV keep 10%.
# Env: SWEEP (default 1,16,64,256), DURATION (s per point, 20), WARMUP (5), KV_MEMORY (100GiB),
# PROMPT_LEN (fixed:8192), OUTPUT_LEN (fixed:256), MODES ("none dropkv:0.1").
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
source scripts/gpu_pack.sh --unpack || exit 1
geo=/tmp/geo/llama-3.1-8b
# The bench writes the geometry's config.json (and draws weights once: a few seconds).
dropkv-bench-e2e --geometry llama-3.1-8b --write-config "$geo" --prefill 16 --decode "" \
  --keep 1.0 --repeats 1 --kv-gib 1 > /dev/null 2> "$OUT/geometry.log" || { tail "$OUT/geometry.log"; exit 1; }
for f in tokenizer.json tokenizer_config.json; do zcat ".gpu-pack/tok/$f.gz" > "$geo/$f"; done

dropkv-server --model "$geo" --random-weights --device cuda --port 50051 --metrics-port 9400 \
  --kv-memory "${KV_MEMORY:-100GiB}" --max-batch 256 --max-queue-requests 4096 \
  --max-queue-prompt-tokens 0 --max-prompt-tokens 16384 > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do
  grep -q "listening on" "$OUT/server.log" && break
  kill -0 "$server" 2> /dev/null || break
  sleep 0.5
done
grep -q "listening on" "$OUT/server.log" || { echo "server did not start"; tail -20 "$OUT/server.log"; exit 1; }
grep -E "KV pool|listening" "$OUT/server.log"

for mode in ${MODES:-none dropkv:0.1}; do
  name=${mode//[:.]/_}
  dropkv-loadgen --address 127.0.0.1:50051 --sweep "${SWEEP:-1,16,64,256}" \
    --duration "${DURATION:-20}" --warmup "${WARMUP:-5}" --timeout 300 \
    --prompt-len "${PROMPT_LEN:-fixed:8192}" --output-len "${OUTPUT_LEN:-fixed:256}" \
    --compression "$mode" --metrics-url http://127.0.0.1:9400/metrics --no-progress \
    --out-md "$OUT/load_$name.md" --out-json "$OUT/load_$name.json" > /dev/null 2> "$OUT/loadgen_$name.log"
  echo "loadgen $mode: rc=$?"
done
kill -TERM "$server"
wait "$server"
echo "==================== dropkv-loadgen (H200, Llama-3.1-8B geometry) ===================="
for mode in ${MODES:-none dropkv:0.1}; do
  echo "## compression $mode"
  cat "$OUT/load_${mode//[:.]/_}.md"
done
