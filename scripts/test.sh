#!/usr/bin/env bash
# Set up (idempotent), build, and run every test but the `image` label's (docs/deployment.md).
# Extra arguments go to ctest (e.g. -L unit; -L image runs the image check).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
# Label `image` (scripts/image_check.sh: the container images built with podman; ~15 min cold,
# root, ~650 MB of downloads) is not part of CI; it runs only when asked for by label, e.g.
# scripts/test.sh -L image (docs/deployment.md).
skip_image=(-LE '^image$')
for a in "$@"; do [[ "$a" == *image* ]] && skip_image=(); done
ctest --test-dir "$build" --output-on-failure --timeout 1800 -j "${DROPKV_TEST_JOBS:-2}" \
  "${skip_image[@]}" "$@"
