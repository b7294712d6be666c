#!/usr/bin/env bash
# Set up (idempotent), build, and run every test. Extra arguments go to ctest (e.g. -L unit;
# -LE image leaves out the container-image check, docs/deployment.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
ctest --test-dir "$build" --output-on-failure --timeout 1800 -j "${DROPKV_TEST_JOBS:-2}" "$@"
