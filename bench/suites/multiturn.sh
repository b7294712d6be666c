#!/usr/bin/env bash
# Multi-turn chat load (prefix cache), the full gRPC server on the H200, in one device call:
#   here:  scripts/gpu_pack.sh bin/dropkv-server bin/dropkv-loadgen bin/dropkv-bench-e2e
#          mkdir -p .gpu-pack/tok && cp ../shared/tokenizers/llama3/tokenizer*.json.gz .gpu-pack/tok/
#   there: carry [".gpu-pack"], command `bash bench/run.sh multiturn`
# Llama-3.1-8B geometry with random weights (bf16) as in the load suite (its context is 131072).
# Each closed-loop stream runs TURNS-turn conversations (dropkv-loadgen --turns): turn 1 is
# PROMPT_LEN fresh tokens, each later turn is the previous prompt + the ids the server streamed
# for it (OUTPUT_LEN) + TURN_GROWTH new tokens, so turn 8 is 2048 + 7 x 2176 = 17280 tokens with
# the defaults (--max-prompt-tokens is raised to MAX_PROMPT_TOKENS for it). For each server
# variant, each mode (MODES: full cache, DropKV keep 10%) and each point: TTFT p50/p90/p99 and the
# mean prompt length per turn, and the deltas of the server's dropkv_prefix_cache* counters over
# the point when /metrics has any (their values after each point go to prefix_cache_*.txt).
# Env: VARIANTS: ';'-separated NAME=SERVER_FLAGS, one server start each (default "default=": the
#        server as it is), e.g. VARIANTS="off=--prefix-cache=false;on=" (the flag's name is the
#        prefix cache's); SERVER_ARGS: flags for every variant;
#      POINTS ("1:45 16:90", STREAMS:SECONDS: new turns start for SECONDS, the last ones finish);
#      MODES ("none dropkv:0.1"), TURNS (8), PROMPT_LEN (fixed:2048), TURN_GROWTH (fixed:2048),
#      OUTPUT_LEN (fixed:128), KV_MEMORY (100GiB), MAX_PROMPT_TOKENS (32768).
# Time: one variant with the defaults is ~5 minutes of load plus the server start; a device
# command may run 10, so two variants want shorter POINTS (e.g. "1:30 16:60") or a call each.
# Every loadgen run against one server gets a seed of its own, because a cache kept from an
# earlier run would hit its conversations otherwise; every variant gets the same seeds, so the
# variants see the same prompts.
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
source bench/loadgen/h200_common.sh
h200_geometry

IFS=';' read -r -a variants <<< "${VARIANTS:-default=}"
dirs=()
for variant in "${variants[@]}"; do
  name=${variant%%=*}
  flags=${variant#*=}
  [[ $variant == *=* ]] || flags=""
  out="$OUT/multiturn/$name"
  mkdir -p "$out"
  dirs+=("$out")
  echo "== variant $name: ${SERVER_ARGS:-} $flags"
  # shellcheck disable=SC2086  # the flags are lists of words
  h200_start_server "$out/server.log" dropkv-server --model "$geo" --random-weights --device cuda \
    --kv-memory "${KV_MEMORY:-100GiB}" --max-batch 256 --max-queue-requests 4096 \
    --max-queue-prompt-tokens 0 --max-prompt-tokens "${MAX_PROMPT_TOKENS:-32768}" \
    ${SERVER_ARGS:-} $flags
  grep -E "KV pool|listening" "$out/server.log"
  # Warm-up (CUDA graphs, allocator) so that the first point's turn 1 does not pay for it.
  dropkv-loadgen --address 127.0.0.1:50051 --concurrency 4 --requests 8 --duration 60 \
    --prompt-len fixed:2048 --output-len fixed:16 --seed 999999 --no-progress > /dev/null 2>&1

  seed=1000
  for mode in ${MODES:-none dropkv:0.1}; do
    mode_name=${mode//[:.]/_}
    for point in ${POINTS:-1:45 16:90}; do
      IFS=: read -r conc seconds <<< "$point"
      seed=$((seed + 1))
      dropkv-loadgen --address 127.0.0.1:50051 --concurrency "$conc" --duration "$seconds" \
        --timeout 600 --turns "${TURNS:-8}" --turn-growth "${TURN_GROWTH:-fixed:2048}" \
        --prompt-len "${PROMPT_LEN:-fixed:2048}" --output-len "${OUTPUT_LEN:-fixed:128}" \
        --compression "$mode" --seed "$seed" --metrics-url http://127.0.0.1:9400/metrics \
        --no-progress --json > "$out/turns_${mode_name}_c$conc.json" 2>> "$out/loadgen_$mode_name.log"
      echo "loadgen $name $mode streams $conc: rc=$? ($(date +%T))"
      h200_wait_idle
      metrics | grep -E '^dropkv_prefix_cache' > "$out/prefix_cache_${mode_name}_c$conc.txt"
    done
  done
  metrics | grep -E '^dropkv_(kv_blocks_(used|total)|requests_(running|waiting)|preemptions_total|prefix_cache[a-z_]*)[{ ]'
  kill -TERM "$server"
  wait "$server"
done
echo "==================== dropkv-loadgen --turns ${TURNS:-8} (H200, Llama-3.1-8B geometry) ===================="
python3 bench/loadgen/multiturn_table.py "${dirs[@]}"
