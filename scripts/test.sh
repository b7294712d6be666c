#!/usr/bin/env bash
# Set up (idempotent), build, and run every test but the `image` label's (docs/deployment.md).
# Extra arguments go to ctest (e.g. -L unit; -L image runs the image check).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
# Label `image` (scripts/image_check.sh: container images built with podman, ~40 min cold) does
# not fit CI's time; it runs only when asked for by label, e.g. scripts/test.sh -L image.
skip_image=(-LE '^image$')
for a in "$@"; do [[ "$a" == *image* ]] && skip_image=(); done
ctest --test-dir "$build" --output-on-failure --timeout 1800 -j "${DROPKV_TEST_JOBS:-2}" \
  "${skip_image[@]}" "$@"
