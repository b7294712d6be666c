#!/bin/sh
# Copies the shared libraries that the given binaries load (ldd, transitive) into DEST, except
# glibc's own and the NVIDIA driver's (the runtime image and the container toolkit provide those).
# Used in the Dockerfiles' build stage so the runtime stage needs no -dev packages, no pip, no venv.
# Also the libraries torch and CUDA load with dlopen, which ldd cannot see: beside libtorch_cuda.so
# libcaffe2_nvrtc.so (NVRTC, for torch's runtime-compiled kernels) and libtorch_cuda_linalg.so
# (cuSOLVER), with their own dependencies; beside libcudnn.so.9 its engine and op libraries; beside
# libnvrtc.so its builtins.
set -eu
dest=$1
shift
mkdir -p "$dest"
list=$(mktemp)
ldd_libs() {
  for f in "$@"; do ldd "$f" | awk '/=> \// {print $3}'; done
}
ldd_libs "$@" | sort -u >"$list"
extras=""
while read -r lib; do
  if [ "$(basename "$lib")" = libtorch_cuda.so ]; then
    for x in libcaffe2_nvrtc.so libtorch_cuda_linalg.so; do
      if [ -f "$(dirname "$lib")/$x" ]; then extras="$extras $(dirname "$lib")/$x"; fi
    done
  fi
done <"$list"
if [ -n "$extras" ]; then
  # shellcheck disable=SC2086 # paths without spaces, one per word
  { cat "$list"; printf '%s\n' $extras; ldd_libs $extras; } | sort -u >"$list.all"
  mv "$list.all" "$list"
fi
while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*|ld-linux*|libresolv.so.*) ;;
    libcuda.so.*|libnvidia-*) ;;
    *) cp -L "$lib" "$dest/" ;;
  esac
  case "$(basename "$lib")" in
    libcudnn.so.*) for x in "$(dirname "$lib")"/libcudnn_*.so.*; do cp -L "$x" "$dest/"; done ;;
    libnvrtc.so.*) for x in "$(dirname "$lib")"/libnvrtc-builtins.so.*; do cp -L "$x" "$dest/"; done ;;
  esac
done <"$list"
rm -f "$list"
echo "collected $(find "$dest" -maxdepth 1 -type f | wc -l) libraries into $dest"
