#!/usr/bin/env bash
# The fused decode GEMV (kernels/fused_gemv.h) on the GPU machine in one call, from binaries built
# here and carried (scripts/gpu_pack.sh fused_gemv_gpu_test fused_ops_gpu_test
# runner_cuda_graph_test model_gpu_parity_test dropkv-bench-e2e): the GPU tests, memcheck on the
# GEMV test's quick shapes, the GEMV table (cuBLAS vs ours per projection, per launch variant),
# then dropkv-bench-e2e on Llama-3.1-8B geometry with --fused-gemv off and on in the same call; a
# short table last. Run from the repo root after `source scripts/gpu_pack.sh --unpack`.
# Env: SKIP_TESTS=1, SKIP_MEMCHECK=1, SKIP_TABLE=1, SKIP_E2E=1, GEOMETRY (default llama-3.1-8b),
# TESTS (default: the four), TEST_VARIANTS (fused_gemv_gpu_test again under each), VARIANTS
# (table) and E2E_VARIANTS (GEMV on), PREFILL (2048),
# T_TEST / T_TABLE / T_E2E / T_MEMCHECK (timeouts, s). A variant is a comma-joined list of
# environment settings ("default": none), e.g. "DROPKV_GEMV_KERNEL=ring" (the previous
# register-ring kernel), "DROPKV_PDL=0", "DROPKV_GEMV_FILL=bulk,DROPKV_GEMV_CTAS_PER_SM=2".
# E2E_VARIANTS=best: the table variant whose fused M = 1 qkv + o_proj + gate_up + down sum is
# least, then the same with DROPKV_PDL=0 (and the default, if another won).
set -uo pipefail
OUT=${OUT:-/tmp/gemv-out}
mkdir -p "$OUT"
export DROPKV_SOURCE_DIR=$PWD DROPKV_BUILD_DIR=${DROPKV_BUILD_DIR:-/tmp/dropkv-build}
geo=${GEOMETRY:-llama-3.1-8b}
tests=${TESTS:-fused_gemv_gpu_test fused_ops_gpu_test runner_cuda_graph_test model_gpu_parity_test}
if [[ -z "${SKIP_TESTS:-}" ]]; then
  : > "$OUT/tests.log"
  rm -f "$OUT/gemv_tables.md"
  if [[ "$tests" == *model_gpu_parity_test* ]]; then
    timeout 120 python3 tests/model/make_parity_models.py \
      "$DROPKV_BUILD_DIR/test-scratch/model_parity" >> "$OUT/tests.log" 2>&1
  fi
  for t in $tests; do
    echo "=== $t" >> "$OUT/tests.log"
    timeout "${T_TEST:-150}" "$t" >> "$OUT/tests.log" 2>&1
    echo "$t rc=$?" | tee -a "$OUT/tests.log"
  done
  # The GEMV test again under the other launch variants (TEST_VARIANTS, same syntax as VARIANTS).
  for v in ${TEST_VARIANTS:-DROPKV_GEMV_STAGE_K=1024 DROPKV_GEMV_FILL=bulk DROPKV_GEMV_KERNEL=ring}; do
    echo "=== fused_gemv_gpu_test $v" >> "$OUT/tests.log"
    env $(tr , ' ' <<< "$v") timeout "${T_TEST:-150}" fused_gemv_gpu_test >> "$OUT/tests.log" 2>&1
    echo "fused_gemv_gpu_test $v rc=$?" | tee -a "$OUT/tests.log"
  done
  grep -E "^\[  (FAILED|PASSED)|worst relative|max rows|Failure|Expected|max \|ours" "$OUT/tests.log" | head -40
fi
variants=${VARIANTS:-default DROPKV_PDL=0 DROPKV_GEMV_KERNEL=ring}
envs() { [[ "$1" == default ]] || tr , ' ' <<< "$1"; }
best=default best_us=
if [[ -z "${SKIP_TABLE:-}" ]]; then
  for v in $variants; do
    table="/tmp/gemv_table_${v//[^A-Za-z0-9_]/_}.md"
    env $(envs "$v") timeout "${T_TABLE:-90}" \
      dropkv-bench-e2e --geometry "$geo" --gemv-table > "$table" 2>&1
    echo "gemv table $v rc=$?"
    { echo "### $v"; cat "$table"; } >> "$OUT/gemv_tables.md"
    us=$(awk -F'|' '$4+0 == 1 && $2 !~ /lm_head/ {s += $11} END {print s + 0}' "$table")
    echo "  fused M=1 per layer: $us us"
    if [[ "$v" != *PDL=0* && "$v" != *ring* && "$us" != 0 ]] &&
       { [[ -z "$best_us" ]] || awk "BEGIN {exit !($us < $best_us)}"; }; then
      best=$v best_us=$us
    fi
  done
fi
e2e_variants=${E2E_VARIANTS:-default DROPKV_PDL=0}
if [[ "$e2e_variants" == best ]]; then
  e2e_variants="$best $([[ $best == default ]] && echo DROPKV_PDL=0 || echo "$best,DROPKV_PDL=0 default")"
  echo "e2e variants: $e2e_variants"
fi
if [[ -z "${SKIP_E2E:-}" ]]; then
  common=(--geometry "$geo" --write-config "/tmp/geo/$geo" --prefill "${PREFILL:-2048}"
          --decode 1x8192,16x2048 --keep 1.0,0.1 --repeats 3 --graphs on --json)
  # E2E_ROUNDS (default 1) rounds of off, then each variant on, to see the run-to-run spread.
  for round in $(seq 1 "${E2E_ROUNDS:-1}"); do
    timeout "${T_E2E:-120}" dropkv-bench-e2e "${common[@]}" --fused-gemv off \
      > "$OUT/e2e_r${round}_off.json" 2> /tmp/e2e_off.err
    echo "e2e round $round gemv off rc=$?"
    for v in $e2e_variants; do
      name=${v//[^A-Za-z0-9_]/_}
      env $(envs "$v") timeout "${T_E2E:-120}" \
        dropkv-bench-e2e "${common[@]}" --fused-gemv on > "$OUT/e2e_r${round}_on_$name.json" \
        2> "/tmp/e2e_on_$name.err"
      echo "e2e round $round gemv on $v rc=$?"
    done
  done
fi
if [[ -z "${SKIP_MEMCHECK:-}" ]]; then
  DROPKV_GEMV_TEST_QUICK=1 timeout "${T_MEMCHECK:-120}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    "$(command -v fused_gemv_gpu_test)" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
# The tables' M = 1 and 8 rows (all of them in $OUT/gemv_tables.md).
[[ -f "$OUT/gemv_tables.md" ]] &&
  grep -E "^(###|\| [^|]+ \| [0-9]+ x [0-9]+ \| (1|8) \|)" "$OUT/gemv_tables.md"
if [[ -z "${SKIP_E2E:-}" ]]; then
  for f in "$OUT"/e2e_r*.json; do
    echo "==================== $(basename "$f" .json) ===================="
    python3 bench/e2e/summarize.py "$f" | grep -E "decode"
  done
fi
