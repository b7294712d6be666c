#!/usr/bin/env bash
# The GPU load sweep, the full gRPC server on the H200, in one device call:
#   here:  scripts/gpu_pack.sh bin/dropkv-server bin/dropkv-loadgen bin/dropkv-bench-e2e
#          mkdir -p .gpu-pack/tok && cp ../shared/tokenizers/llama3/tokenizer*.json.gz .gpu-pack/tok/
#   there: run with carry [".gpu-pack"], command `bash bench/run.sh load`
# Llama-3.1-8B geometry with random weights (bf16) and the Llama-3 tokenizer; 8K-token prompts,
# 256 output tokens; a closed-loop concurrency sweep at keep 100% and at DropKV keep 10%.
# Steady-state points (`--steady`): each point warms up, measures a window (tokens streamed in it,
# requests completing in it) and cancels what is in flight; the warm-up grows with the
# concurrency, because the first wave of 8K prefills takes ~0.3 s per stream.
# Env: POINTS (default "1:10:20 16:15:25 64:30:30 256:90:45", CONCURRENCY:WARMUP_S:WINDOW_S),
# KV_MEMORY (100GiB), PROMPT_LEN (fixed:8192), OUTPUT_LEN (fixed:256), MODES ("none dropkv:0.1"),
# SERVERS (default "dropkv-server"): server executables on PATH swept one after the other in the
# same call (an A/B of two builds: pack the other as e.g. bin/dropkv-server-prev); each one's
# reports go to $OUT/<server>/ and get a table of their own. SERVER_ARGS: more server flags
# (e.g. "--prefill-tokens-per-step 512").
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
source bench/loadgen/h200_common.sh
h200_geometry

for server_bin in ${SERVERS:-dropkv-server}; do
  out="$OUT/$server_bin"
  mkdir -p "$out"
  h200_start_server "$out/server.log" "$server_bin" --model "$geo" --random-weights \
    --device cuda --kv-memory "${KV_MEMORY:-100GiB}" --max-batch 256 --max-queue-requests 4096 \
    --max-queue-prompt-tokens 0 --max-prompt-tokens 16384 ${SERVER_ARGS:-}
grep -E "KV pool|listening" "$out/server.log"

for mode in ${MODES:-none dropkv:0.1}; do
  name=${mode//[:.]/_}
  for point in ${POINTS:-1:10:20 16:15:25 64:30:30 256:90:45}; do
    IFS=: read -r conc warmup window <<< "$point"
    dropkv-loadgen --address 127.0.0.1:50051 --concurrency "$conc" --steady \
      --warmup "$warmup" --duration "$window" --timeout 600 \
      --prompt-len "${PROMPT_LEN:-fixed:8192}" --output-len "${OUTPUT_LEN:-fixed:256}" \
      --compression "$mode" --metrics-url http://127.0.0.1:9400/metrics --no-progress \
      --json > "$out/load_${name}_c$conc.json" 2>> "$out/loadgen_$name.log"
    echo "loadgen $mode concurrency $conc: rc=$? ($(date +%T))"
    h200_wait_idle
  done
done
# Every block is back after thousands of requests and hundreds of client cancellations.
metrics | grep -E '^dropkv_(kv_blocks_(used|total)|requests_(running|waiting)|preemptions_total)[{ ]'
kill -TERM "$server"
wait "$server"
done
for server_bin in ${SERVERS:-dropkv-server}; do
  echo "==================== $server_bin: dropkv-loadgen steady state (H200, Llama-3.1-8B geometry) ===================="
  python3 bench/loadgen/steady_table.py "$OUT/$server_bin"/load_*_c*.json
done
