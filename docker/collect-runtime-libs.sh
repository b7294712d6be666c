#!/bin/sh
# Copies the shared libraries that the given binaries load (ldd, transitive) into DEST, except
# glibc's own and the NVIDIA driver's (the runtime image and the container toolkit provide those).
# Used in the Dockerfiles' build stage so the runtime stage needs no -dev packages, no pip, no venv.
set -eu
dest=$1
shift
mkdir -p "$dest"
for bin in "$@"; do
  ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*|ld-linux*|libresolv.so.*) ;;
    libcuda.so.*|libnvidia-*) ;;
    *) cp -L "$lib" "$dest/" ;;
  esac
  # Libraries that these load with dlopen, which ldd does not list: cuDNN's engine and op
  # libraries beside libcudnn.so.9, NVRTC's builtins beside libnvrtc.so (torch's fused kernels).
  case "$(basename "$lib")" in
    libcudnn.so.*) for extra in "$(dirname "$lib")"/libcudnn_*.so.*; do cp -L "$extra" "$dest/"; done ;;
    libnvrtc.so.*) for extra in "$(dirname "$lib")"/libnvrtc-builtins.so.*; do cp -L "$extra" "$dest/"; done ;;
  esac
done
echo "collected $(ls "$dest" | wc -l) libraries into $dest"
