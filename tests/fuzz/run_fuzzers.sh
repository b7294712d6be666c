#!/usr/bin/env bash
# CI runner for the libFuzzer targets (ctest `fuzz_targets`, label fuzz). Configures + builds the
# clang fuzz tree (ccache keeps rebuilds cheap), replays every saved input under
# tests/fuzz/regressions/<target>/, then fuzzes each target for --seconds from its seed corpus
# (tests/fuzz/corpus/<target>/, read-only; new inputs go to the scratch dir). ASan + UBSan, UBSan
# halts on the first error. Exit 0 only when nothing crashed.
#   run_fuzzers.sh --source DIR --build DIR --scratch DIR [--seconds N] [--targets "a b"] [--no-build]
set -u -o pipefail

SOURCE="" BUILD="" SCRATCH="" SECONDS_PER_TARGET=30 NO_BUILD=0
TARGETS="tokenizer_fuzz chat_template_fuzz model_config_fuzz safetensors_fuzz server_config_fuzz validation_fuzz openai_request_fuzz"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) SOURCE="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --scratch) SCRATCH="$2"; shift 2 ;;
    --seconds) SECONDS_PER_TARGET="$2"; shift 2 ;;
    --targets) TARGETS="$2"; shift 2 ;;
    --no-build) NO_BUILD=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "run_fuzzers.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [[ -z "$SOURCE" || -z "$BUILD" || -z "$SCRATCH" ]]; then
  echo "run_fuzzers.sh: --source, --build and --scratch are required" >&2
  exit 2
fi
if ! [[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]] || (( SECONDS_PER_TARGET < 1 || SECONDS_PER_TARGET > 3600 )); then
  echo "run_fuzzers.sh: --seconds must be 1..3600" >&2
  exit 2
fi
FUZZ_DIR="$SOURCE/tests/fuzz"

if (( ! NO_BUILD )); then
  # (Re)configure when the tree is new or was configured without the fuzz targets or the server.
  if ! grep -q "^DROPKV_FUZZ:BOOL=ON" "$BUILD/CMakeCache.txt" 2>/dev/null ||
     ! grep -q "^DROPKV_SERVER:BOOL=ON" "$BUILD/CMakeCache.txt" 2>/dev/null; then
    echo "== configuring the clang fuzz tree in $BUILD"
    # TORCH_CUDA_ARCH_LIST: torch's CMake would otherwise try_run a GPU probe, which fails under clang.
    TORCH_CUDA_ARCH_LIST="8.0;9.0" cmake -S "$SOURCE" -B "$BUILD" -G Ninja \
      -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DDROPKV_FUZZ=ON -DDROPKV_CUDA=OFF \
      -DDROPKV_SERVER=ON -DDROPKV_BENCH=OFF -DDROPKV_TESTS=ON \
      ${DROPKV_PYTHON:+-DDROPKV_PYTHON="$DROPKV_PYTHON"} \
      ${DROPKV_SHARED:+-DDROPKV_SHARED_DIR="$DROPKV_SHARED"} >"$BUILD.configure.log" 2>&1 \
      || { echo "FAIL: configure (log: $BUILD.configure.log)"; tail -30 "$BUILD.configure.log"; exit 1; }
  fi
  echo "== building $TARGETS"
  # shellcheck disable=SC2086
  TORCH_CUDA_ARCH_LIST="8.0;9.0" ninja -C "$BUILD" -j2 $TARGETS || { echo "FAIL: build"; exit 1; }
fi

export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:allocator_may_return_null=1:handle_abort=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
failed=()

for target in $TARGETS; do
  bin="$BUILD/tests/$target"
  if [[ ! -x "$bin" ]]; then echo "FAIL: $bin missing"; failed+=("$target(missing)"); continue; fi
  # 1. Saved crashers of fixed bugs must stay fixed.
  reg="$FUZZ_DIR/regressions/$target"
  if [[ -d "$reg" ]] && compgen -G "$reg/*" >/dev/null; then
    echo "== $target: replaying $(ls "$reg" | wc -l) regression inputs"
    if ! "$bin" -runs=0 "$reg"/* >"$SCRATCH/$target.regressions.log" 2>&1; then
      echo "FAIL: $target crashes on a regression input"; tail -40 "$SCRATCH/$target.regressions.log"
      failed+=("$target(regression)")
      continue
    fi
  fi
  # 2. Fuzz from the seed corpus.
  mkdir -p "$SCRATCH/$target/corpus" "$SCRATCH/$target/artifacts"
  seeds=()
  [[ -d "$FUZZ_DIR/corpus/${target%_fuzz}" ]] && seeds+=("$FUZZ_DIR/corpus/${target%_fuzz}")
  echo "== $target: fuzzing ${SECONDS_PER_TARGET}s (seeds: ${seeds[*]:-none})"
  log="$SCRATCH/$target.log"
  "$bin" -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=3072 -max_len=8192 \
    -print_final_stats=1 -artifact_prefix="$SCRATCH/$target/artifacts/" \
    "$SCRATCH/$target/corpus" "${seeds[@]}" >"$log" 2>&1
  rc=$?
  grep -E "^(stat::number_of_executed_units|stat::new_units_added)" "$log" | sed "s/^/   /"
  if (( rc != 0 )); then
    echo "FAIL: $target exited $rc; crashing input(s):"
    ls -l "$SCRATCH/$target/artifacts/"
    grep -m3 -E "ERROR: |runtime error|==ERROR|deadly signal|invariant" "$log"
    tail -60 "$log"
    failed+=("$target")
  fi
done

if (( ${#failed[@]} )); then
  echo "fuzz: FAILED: ${failed[*]} (logs and artifacts under $SCRATCH)"
  exit 1
fi
echo "fuzz: all targets clean ($TARGETS)"
