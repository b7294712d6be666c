#!/usr/bin/env bash
# Build and check the CUDA kernels on the GPU machine (run THERE, from the repo root, with the
# folder made by scripts/gpu_deps.sh carried as .gpu):
#   scripts/gpu_check.sh [TARGET ...]     default: kernels_gpu_test dropkv-bench-score
# Env: BENCH_ARGS (extra args of dropkv-bench-score), SKIP_MEMCHECK=1, SKIP_BENCH=1,
#   SKIP_BENCH_JSON=1, MEMCHECK_FILTER (gtest filter of the memcheck run, default '-*Bf16*'),
#   PREBUILT=DIR: skip unpack/configure/build and run DIR/bin/{kernels_gpu_test,dropkv-bench-score}
#     with DIR/lib first on LD_LIBRARY_PATH (built here, same torch wheel; carry DIR, e.g.
#     .gpu/kern made by `scripts/gpu_check.sh --pack BUILD_DIR` on the dev machine),
#   NCU=1: hardware counters (ncu --clock-control none) of one launch of each hot kernel at 128K
#     and of the paged decode kernel at 8K, into ncu.txt (NCU=score: the scoring kernels only).
# `scripts/gpu_check.sh --pack BUILD_DIR` (dev machine): strips kernels_gpu_test and
#   dropkv-bench-score of BUILD_DIR (configured for sm_90) with their non-system, non-torch
#   libraries into .gpu/kern (git-ignored).
# Unpacks the .debs into a prefix (never into /), configures with DROPKV_SERVER=OFF and sm_90,
# builds only the named targets, runs the gpu-labelled test binaries, compute-sanitizer memcheck
# on the kernel test, the benchmarks, writes logs to $OUT and prints a short table last.
set -uo pipefail
if [[ "${1:-}" == "--pack" ]]; then
  build=${2:?usage: scripts/gpu_check.sh --pack BUILD_DIR}
  rm -rf .gpu/kern && mkdir -p .gpu/kern/bin .gpu/kern/lib
  for b in "$build/tests/kernels_gpu_test" "$build/bin/dropkv-bench-score"; do
    strip -o ".gpu/kern/bin/$(basename "$b")" "$b" || exit 1
    ldd "$b" | awk '$3 ~ /^\// {print $3}' |
      grep -v -E '/torch/lib/|/nvidia/|/(libc|libm|libdl|libpthread|librt|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' |
      while read -r lib; do cp -Lu "$lib" .gpu/kern/lib/; done
  done
  du -sh .gpu/kern
  exit 0
fi
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(kernels_gpu_test dropkv-bench-score)
export PATH="/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH"
prefix=/opt/dropkv-prefix
declare -A result

step() {  # step NAME LOGFILE CMD...: run, record ok/FAIL, keep the log
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  if "$@" > "$OUT/$log" 2>&1; then result[$name]="ok ($((SECONDS - t0)) s)"
  else result[$name]="FAIL rc=$? ($((SECONDS - t0)) s, see $log)"; tail -40 "$OUT/$log"; fi
}

unpack() {
  mkdir -p "$prefix"
  for deb in .gpu/debs/*.deb; do dpkg -x "$deb" "$prefix"; done
  local pc="$prefix/usr/lib/x86_64-linux-gnu/pkgconfig" pc2="$prefix/usr/share/pkgconfig"
  sed -i -e "s#^prefix=/usr\$#prefix=$prefix/usr#" -e "s#=/usr/include#=$prefix/usr/include#" \
         -e "s#=/usr/lib/#=$prefix/usr/lib/#" "$pc"/*.pc 2>/dev/null || true
  # server/metrics (configured even with DROPKV_SERVER=OFF) wants prometheus-cpp, whose config
  # pulls civetweb and CURL: none exist there. The targets built here never link it, so a
  # configure-only stub of its imported targets is enough.
  local stub="$prefix/usr/lib/cmake/prometheus-cpp"
  mkdir -p "$stub"
  cat > "$stub/prometheus-cpp-config.cmake" <<'CMAKE'
# Configure-only stub written by scripts/gpu_check.sh: linking any of these targets fails.
foreach(_c core pull push)
  if(NOT TARGET prometheus-cpp::${_c})
    add_library(prometheus-cpp::${_c} INTERFACE IMPORTED)
    set_target_properties(prometheus-cpp::${_c} PROPERTIES INTERFACE_LINK_LIBRARIES dropkv-no-prometheus-here)
  endif()
endforeach()
set(prometheus-cpp_FOUND TRUE)
CMAKE
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -2
}
if [[ -n "${PREBUILT:-}" ]]; then
  torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$PWD/$PREBUILT/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p build-gpu/tests build-gpu/bin
  cp "$PREBUILT/bin/kernels_gpu_test" build-gpu/tests/ && cp "$PREBUILT/bin/dropkv-bench-score" build-gpu/bin/
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
fi
[[ -z "${PREBUILT:-}" ]] && { step unpack unpack.log unpack; cat "$OUT/unpack.log"; }

export PKG_CONFIG_PATH="$prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$prefix/usr/share/pkgconfig"
pkgcfg=$(command -v pkg-config || echo "$prefix/usr/bin/pkgconf")
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TORCH_CUDA_ARCH_LIST=9.0
torch_prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')

[[ -z "${PREBUILT:-}" ]] && step configure configure.log cmake -S . -B build-gpu -G Ninja -DDROPKV_SERVER=OFF -DDROPKV_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DDROPKV_PYTHON="$(command -v python3)" \
  -DPKG_CONFIG_EXECUTABLE="$pkgcfg" -DCMAKE_PREFIX_PATH="$prefix/usr;$torch_prefix" \
  -DDROPKV_SHARED_DIR="$PWD/../shared"
if [[ -z "${PREBUILT:-}" ]]; then
  step build build.log ninja -C build-gpu -j16 "${targets[@]}"
  grep -E "error|warning" "$OUT/build.log" | head -20
fi

if [[ -x build-gpu/tests/kernels_gpu_test ]]; then
  step gpu_test gpu_test.log build-gpu/tests/kernels_gpu_test --gtest_color=no
  grep -E "^\[  |overlap|Failure|Expected|which is|max \|diff" "$OUT/gpu_test.log" | head -60
  if [[ -z "${SKIP_MEMCHECK:-}" ]]; then
    # Memcheck on the kernel tests (smaller cases: the bf16 8K overlap test is skipped for time).
    step memcheck memcheck.log timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      build-gpu/tests/kernels_gpu_test --gtest_color=no --gtest_filter="${MEMCHECK_FILTER:--*Bf16*}"
    grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | head -20
  fi
fi
if [[ -x build-gpu/bin/dropkv-bench-score && -z "${SKIP_BENCH:-}" ]]; then
  step bench bench.txt build-gpu/bin/dropkv-bench-score ${BENCH_ARGS:-}
  [[ -z "${SKIP_BENCH_JSON:-}" ]] &&
    step bench_json bench.json build-gpu/bin/dropkv-bench-score --json --n 4096 --runs 5
fi

if [[ -n "${NCU:-}" && -x build-gpu/bin/dropkv-bench-score ]]; then
  ncu_run() {
    timeout 200 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy "$@" build-gpu/bin/dropkv-bench-score \
      --n 131072 --runs 1 ${NCU_BENCH_ARGS:-}
  }
  # The first launches of the fused call are warm-up; the score pass is ScoreWarpKernel (v9) or
  # ScoreTcKernel (rows > 64).
  ncu_cmd="ncu_run --kernel-name regex:'PartialAttnTcKernel|PartialAttnWarpKernel|ScoreWarpKernel|ScoreTcKernel' --launch-skip 2 --launch-count 2"
  [[ "$NCU" == score ]] && export NCU_BENCH_ARGS=--no-decode
  [[ "$NCU" != score ]] && ncu_cmd+=" && ncu_run --kernel-name regex:PagedDecodeKernel --launch-skip 40 --launch-count 1"
  step ncu ncu.txt bash -c "$(declare -f ncu_run); $ncu_cmd"
fi

echo "==================== gpu_check summary ===================="
for k in unpack configure build gpu_test memcheck bench bench_json ncu; do
  [[ -n "${result[$k]:-}" ]] && printf "%-12s %s\n" "$k" "${result[$k]}"
done
[[ -f "$OUT/bench.txt" ]] && cat "$OUT/bench.txt"
exit 0
