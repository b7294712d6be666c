#!/usr/bin/env bash
# A GPU soak of the whole server on the H200, in one device call (docs/reliability.md, "GPU soak"):
#   here:  scripts/gpu_pack.sh -B build bin/dropkv-server bin/dropkv-loadgen bin/dropkv-cli
#   there: carry [".gpu-pack"], command `bash bench/run.sh soak`
# SmolLM2-135M geometry with random weights (bf16, .gpu-pack/smollm2) for DURATION seconds (300)
# under three loads at once: a closed loop of 32 streams with a mix of compression methods and
# prompt/output lengths; 16 streams whose 0.3 s deadline expires mid-generation; and back-to-back
# 5 s steady-state windows of 32 streams that cancel whatever is in flight when they close.
# Afterwards: the KV pool must be all free with nothing running or waiting, and the server's RSS
# and GPU memory after the first 30 s and at the end are printed with the request counts by status.
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
DURATION=${DURATION:-300}
mkdir -p "$OUT"
source bench/loadgen/h200_common.sh
model=.gpu-pack/smollm2

h200_start_server "$OUT/soak_server.log" dropkv-server --model "$model" --random-weights \
  --device cuda --kv-memory 16GiB --max-batch 128 --max-queue-requests 4096 \
  --max-queue-prompt-tokens 0

rss_mib() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$server/status"; }
gpu_mib() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits |
  awk -F', ' -v pid="$server" '$1 == pid {print $2}'; }
metric_sum() {  # sum of a metric's samples whose labels contain $2
  python3 -c 'import sys, urllib.request as u
text = u.urlopen("http://127.0.0.1:9400/metrics").read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines()
              if l.startswith(sys.argv[1]) and sys.argv[2] in l)))' "$1" "$2"
}

common=(--address 127.0.0.1:50051 --no-progress --json)
dropkv-loadgen "${common[@]}" --concurrency 32 --duration "$DURATION" --timeout 120 \
  --prompt-len uniform:64:4096 --output-len uniform:16:512 \
  --compression none --compression dropkv:0.1 --compression snapkv:0.2 \
  --compression h2o:0.25 --compression streaming_llm:0.1 --seed 1 \
  > "$OUT/soak_mixed.json" 2> "$OUT/soak_mixed.log" &
mixed=$!
dropkv-loadgen "${common[@]}" --concurrency 16 --duration "$DURATION" --timeout 0.3 \
  --prompt-len uniform:512:2048 --output-len fixed:512 --compression dropkv:0.1 --seed 2 \
  > "$OUT/soak_deadlines.json" 2> "$OUT/soak_deadlines.log" &
deadlines=$!
(
  end=$((SECONDS + DURATION))
  i=0
  while ((SECONDS + 6 < end)); do
    dropkv-loadgen "${common[@]}" --concurrency 32 --steady --warmup 1 --duration 5 \
      --prompt-len uniform:16:1024 --output-len fixed:256 --seed $((100 + i)) > /dev/null 2>&1
    i=$((i + 1))
  done
  echo "$i" > "$OUT/soak_windows.txt"
) &
windows=$!

sleep 30
rss_start=$(rss_mib) gpu_start=$(gpu_mib)
wait "$mixed" "$deadlines" "$windows"
# The engine reaps the last cancellations at its next steps (proto3 text omits zero fields).
for _ in $(seq 60); do
  dropkv-cli stats > "$OUT/soak_stats.txt"
  used=$(awk '/kv_blocks_used/ {print $2}' "$OUT/soak_stats.txt")
  running=$(awk '/num_running/ {print $2}' "$OUT/soak_stats.txt")
  waiting=$(awk '/num_waiting:/ {print $2}' "$OUT/soak_stats.txt")
  [[ -z "$used$running$waiting" ]] && break
  sleep 1
done
rss_end=$(rss_mib) gpu_end=$(gpu_mib)
alive=yes
kill -0 "$server" 2> /dev/null || alive=no

echo "| GPU soak ${DURATION} s | value |"
echo "|---|---|"
for status in ok cancelled deadline_exceeded resource_exhausted internal; do
  echo "| requests status=$status | $(metric_sum dropkv_requests_total "status=\"$status\"") |"
done
echo "| steady windows (each cancels its streams) | $(cat "$OUT/soak_windows.txt") |"
echo "| preemptions | $(metric_sum dropkv_preemptions_total '') |"
echo "| KV blocks used after / running / waiting | ${used:-0} / ${running:-0} / ${waiting:-0} |"
echo "| server RSS at 30 s -> end (MiB) | $rss_start -> $rss_end |"
echo "| server GPU memory at 30 s -> end (MiB) | $gpu_start -> $gpu_end |"
echo "| server alive | $alive |"
kill -TERM "$server"
wait "$server"
echo "| server exit code after SIGTERM | $? |"
[[ -z "$used" || "$used" == 0 ]] && [[ -z "$running" || "$running" == 0 ]] && [[ $alive == yes ]]
