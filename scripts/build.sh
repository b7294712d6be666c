#!/usr/bin/env bash
# Configure (once) and build everything into build/bin. Extra arguments go to CMake's configure
# step, e.g. scripts/build.sh -DDROPKV_CUDA=OFF. BUILD_DIR overrides build/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${DROPKV_JOBS:-$(nproc)}
if [[ ! -f "$build/build.ninja" || $# -gt 0 ]]; then
  cmake -S "$root" -B "$build" -G Ninja "$@"
fi
start=$(date +%s)
cmake --build "$build" -j "$jobs"
echo "[build] done in $(( $(date +%s) - start )) s; executables in $build/bin"
