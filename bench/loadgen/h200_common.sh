# Sourced by the H200 load suites (bench/suites/load.sh, multiturn.sh, soak.sh): the packed
# binaries on PATH, the Llama-3.1-8B geometry folder, and the server's start, /metrics and idle
# wait. Expects $OUT to exist.
source scripts/gpu_pack.sh --unpack || exit 1

# Writes the Llama-3.1-8B geometry's config.json (the bench draws its weights once: a few
# seconds) and the Llama-3 tokenizer into $geo.
h200_geometry() {
  geo=/tmp/geo/llama-3.1-8b
  dropkv-bench-e2e --geometry llama-3.1-8b --write-config "$geo" --prefill 16 --decode "" \
    --keep 1.0 --repeats 1 --kv-gib 1 > /dev/null 2> "$OUT/geometry.log" || { tail "$OUT/geometry.log"; exit 1; }
  for f in tokenizer.json tokenizer_config.json; do zcat ".gpu-pack/tok/$f.gz" > "$geo/$f"; done
}

metrics() { python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:9400/metrics").read().decode())'; }

# h200_start_server LOG BINARY ARGS...: starts it in the background ($server = its pid) on gRPC
# port 50051 and metrics port 9400, and waits until it listens (exits the script if it does not).
h200_start_server() {
  local log=$1
  shift
  "$@" --port 50051 --metrics-port 9400 > "$log" 2>&1 &
  server=$!
  for _ in $(seq 240); do
    grep -q "listening on" "$log" && break
    kill -0 "$server" 2> /dev/null || break
    sleep 0.5
  done
  grep -q "listening on" "$log" || { echo "server did not start"; tail -20 "$log"; exit 1; }
}

# Waits (up to 30 s) until nothing runs: cancelled streams leave before the next point starts.
h200_wait_idle() {
  for _ in $(seq 60); do
    metrics | grep -qE '^dropkv_requests_running(\{[^}]*\})? 0(\.0+)?$' && break
    sleep 0.5
  done
}
