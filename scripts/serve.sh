#!/usr/bin/env bash
# Set up (idempotent), build, and start the server. With no --model it serves the built-in demo
# model (a tiny Llama-architecture model with deterministic random weights, created on first start).
# Extra arguments go to dropkv-server.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
bin=${BUILD_DIR:-$root/build}/bin
if [[ -x "$bin/dropkv-server" ]]; then
  exec "$bin/dropkv-server" "$@"
fi
# Before the gRPC server lands: load the demo model in the engine and generate a few tokens.
exec "$bin/dropkv-generate" --max-new-tokens 16 "$@"
