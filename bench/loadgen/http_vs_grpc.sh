#!/usr/bin/env bash
# HTTP against gRPC for the same load on one server (the HTTP path's overhead): alternating rounds
# of dropkv-loadgen (--steady: tokens streamed inside the window) with the same token-id prompts,
# streamed /v1/completions on one path and GenerateStream on the other. Prints a Markdown table;
# the JSON reports stay in $OUT.
#   bench/loadgen/http_vs_grpc.sh MODEL_DIR [server flags...]
# Env: ROUNDS (3), DURATION (30 s), CONCURRENCY (8), PROMPT (fixed:128), OUTPUT (fixed:64),
#      OUT (a folder for the reports; default a temporary one).
set -euo pipefail
model=$1
shift
rounds=${ROUNDS:-3}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
dropkv-server --model-dir "$model" --port 50091 --metrics-port 0 --http-port 18091 "$@" \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:18091/health", timeout=1)' \
    > /dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { cat "$out/server.log"; exit 1; }
  sleep 0.5
done
load=(--concurrency "${CONCURRENCY:-8}" --duration "${DURATION:-30}" --warmup 3
      --prompt-len "${PROMPT:-fixed:128}" --output-len "${OUTPUT:-fixed:64}" --steady --no-progress
      --json)
echo "| round | path | requests ok | errors | out tok/s | TTFT p50 ms | ITL p50 ms | E2E p50 ms |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for r in $(seq 1 "$rounds"); do
  for path in http grpc; do
    address=127.0.0.1:50091
    [[ $path == http ]] && address=http://127.0.0.1:18091
    dropkv-loadgen --address "$address" --seed "$r" "${load[@]}" > "$out/$path-$r.json"
    python3 - "$out/$path-$r.json" "$r" "$path" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d = d[0] if isinstance(d, list) else d.get("runs", [d])[0] if "runs" in d else d
e = d["errors"]
e = sum(e.values()) if isinstance(e, dict) else len(e) if isinstance(e, list) else e
print(f"| {sys.argv[2]} | {sys.argv[3]} | {d['requests_ok']} | {e} | "
      f"{d['output_tokens_per_s']:.1f} | {d['ttft_ms']['p50']:.1f} | {d['itl_ms']['p50']:.2f} | "
      f"{d['e2e_ms']['p50']:.1f} |")
PY
  done
done
