#!/usr/bin/env bash
# Fetch the Debian 12 packages the GPU machine lacks (it has torch, cmake, ninja, gtest, spdlog,
# fmt, protobuf; no network). Run HERE, from the repo root:
#   scripts/gpu_deps.sh download [DIR]     (default DIR .gpu, git-ignored; about 40 MB)
# Then pass `carry: [".gpu"]` to the device call and run scripts/gpu_check.sh there.
set -euo pipefail
cmd=${1:-}
dir=${2:-.gpu}
case "$cmd" in
  download)
    mkdir -p "$dir/debs" "$dir/grpc"
    # What DropkvDeps.cmake finds with DROPKV_SERVER=OFF, plus ICU for the tokenizer and
    # pkg-config (pkgconf) in case the image lacks it.
    pkgs="libabsl-dev libabsl20220623 nlohmann-json3-dev libcli11-dev libyaml-cpp-dev
          libyaml-cpp0.7 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
          libicu-dev libicu72 icu-devtools pkgconf pkgconf-bin libpkgconf3"
    (cd "$dir/debs" && apt-get download $pkgs)
    # gRPC for a later server build there (../shared does not travel: copy the helper too).
    shared=$(cd "$(dirname "$0")/../../shared/gpu" 2>/dev/null && pwd || true)
    if [[ -n "$shared" && -x "$shared/grpc-prefix.sh" ]]; then
      "$shared/grpc-prefix.sh" download "$dir/grpc" > /dev/null
      cp "$shared/grpc-prefix.sh" "$shared/GrpcPrefixCompat.cmake" "$dir/grpc/"
    else
      echo "note: ../shared/gpu/grpc-prefix.sh not found; gRPC debs skipped" >&2
    fi
    du -sh "$dir" ;;
  *) sed -n 2,5p "$0"; exit 2 ;;
esac
