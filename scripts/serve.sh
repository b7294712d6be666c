#!/usr/bin/env bash
# Set up (idempotent), build, and start the server: gRPC on 50051, the OpenAI-compatible HTTP API
# on 8000 (--http-port or DROPKV_HTTP_PORT override it), Prometheus /metrics on 9400. Extra arguments go to
# dropkv-server.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
bin=${BUILD_DIR:-$root/build}/bin
if [[ -x "$bin/dropkv-server" ]]; then
  http=(--http-port 8000)  # the HTTP API is on unless the caller chose its port
  for a in "$@"; do [[ "$a" == --http-port* ]] && http=(); done
  exec "$bin/dropkv-server" "${http[@]}" "$@"
fi
# Before the gRPC server lands: load the demo model in the engine and generate a few tokens.
exec "$bin/dropkv-generate" --max-new-tokens 16 "$@"
