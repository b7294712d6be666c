#!/usr/bin/env bash
# Carry binaries built HERE to the GPU machine instead of building there (the full server needs
# gRPC, which that machine lacks; and a device call then spends no time compiling).
#
#   scripts/gpu_pack.sh [-B BUILD_DIR] ARTIFACT...   (here; ARTIFACT relative to BUILD_DIR,
#                                                     e.g. bin/dropkv-server tests/kernels_gpu_test)
#   source scripts/gpu_pack.sh --unpack              (there, from the repo root, with carry: [".gpu-pack"])
#
# Pack: strips the artifacts and copies every shared library they need except glibc, libstdc++ /
# libgcc_s (the GPU machine's are newer) and LibTorch's own (the same torch 2.11.0+cu130 wheel is
# installed there) into .gpu-pack/pack.tar.xz (git-ignored; carry .gpu-pack, not .gpu too: both
# together pass the device call's 64 MiB limit). BUILD_DIR must be built for sm_90 (README's
# build/ is, with 80;90; default build-gpu-local, configured with -DCMAKE_CUDA_ARCHITECTURES=90).
# Unpack: extracts into /opt/dropkv-pack and exports PATH (its bin/ and tests/) and LD_LIBRARY_PATH
# (its lib/, then the torch wheel's lib/), plus DROPKV_PYTHON for tests that call python3.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pack="$root/.gpu-pack/pack.tar.xz"

if [[ "${1:-}" == "--unpack" ]]; then
  dest=/opt/dropkv-pack
  mkdir -p "$dest" && tar -xJf "$pack" -C "$dest" || { echo "gpu_pack: cannot unpack $pack" >&2; return 1 2>/dev/null || exit 1; }
  torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export PATH="$dest/bin:$dest/tests:$PATH"
  export LD_LIBRARY_PATH="$dest/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DROPKV_PYTHON=$(command -v python3)
  echo "gpu_pack: $(ls "$dest/bin" "$dest/tests" 2>/dev/null | grep -v : | tr '\n' ' ')"
  return 0 2>/dev/null || exit 0
fi

set -e
build="$root/build-gpu-local"
if [[ "${1:-}" == "-B" ]]; then build=$2; shift 2; fi
[[ $# -gt 0 ]] || { echo "usage: scripts/gpu_pack.sh [-B BUILD_DIR] ARTIFACT..." >&2; exit 2; }
if ! grep -q -E '^CMAKE_CUDA_ARCHITECTURES:[A-Z]+=(.*;)?90' "$build/CMakeCache.txt"; then
  echo "gpu_pack: $build is not configured for sm_90 (-DCMAKE_CUDA_ARCHITECTURES=90)" >&2
  exit 1
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/tests" "$stage/lib"
for artifact in "$@"; do
  src="$build/$artifact"
  [[ -x "$src" ]] || { echo "gpu_pack: $src is not built" >&2; exit 1; }
  sub=bin
  [[ "$artifact" == tests/* ]] && sub=tests
  strip -o "$stage/$sub/$(basename "$artifact")" "$src"
  # ldd lines: "libX.so => /path/libX.so (0x...)". Skip the C runtime and LibTorch's libraries.
  ldd "$src" | awk '$3 ~ /^\// {print $3}' |
    grep -v -E '/torch/lib/|/nvidia/|/(libc|libm|libdl|libpthread|librt|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' |
    while read -r lib; do cp -Lu "$lib" "$stage/lib/"; done
done
mkdir -p "$(dirname "$pack")"
# xz: a pack of the bench and the GPU tests is ~17 MB against gzip's ~64 MB (the call's limit).
XZ_OPT=-6T2 tar -cJf "$pack" -C "$stage" .
echo "gpu_pack: $pack ($(du -h "$pack" | cut -f1)): $* + $(ls "$stage/lib" | wc -l) libraries"
