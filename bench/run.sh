#!/usr/bin/env bash
# The one driver of the GPU benchmark suites, for one device call each:
#   bash bench/run.sh SUITE [ARGS...]     (bash bench/run.sh list: the suites)
# A suite is bench/suites/SUITE.sh, run from the repository root with this script's environment;
# its knobs (environment variables) and what to pack beforehand are in that file's header. $OUT
# defaults per suite as the file says. The exit status is the suite's.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# suite: what it measures
suites=(
  "e2e: the engine benchmark, Llama-3.1-8B geometry with the HF peer (graphs on and off, the full-memory batch), then Qwen2.5-7B and Gemma-7B; builds through scripts/gpu_check.sh unless BENCH=path"
  "fp8: FP8 weights: the FP8 GPU tests, the per-projection GEMV table, then FP8 weights, FP8 weights + FP8 KV and bf16 end to end (BENCHES: an A/B of builds)"
  "kv-fp8: the FP8 KV cache: its GPU tests, then bf16 / FP8 weights x bf16 / FP8 KV side by side (PACKDIR: the pack's folder)"
  "peer: our decode step beside the gpt-fast-style torch.compile peer (bench/e2e/compiled_peer.py), ratio table last"
  "decode-ab: decode A/B of engine variants or binaries (VARIANTS, ROUNDS), NCU=1: the step kernel by kernel"
  "fused-ops: the fused decode ops against the ATen ops (--fused-ops off / on), HF peer"
  "load: the gRPC server under load, steady-state concurrency points, none and DropKV keep 10% (SERVERS: an A/B of builds)"
  "multiturn: multi-turn chats against the server, TTFT per turn per server variant (VARIANTS: e.g. prefix cache off / on)"
  "quality: the trained models staged by scripts/gpu_stage_models.sh: their parity with HF on the GPU, then bench/quality/run_gpu.sh's task table (ours and kvpress)"
  "soak: a GPU soak of the whole server (mixed, deadline and cancelling loads), then the pool, RSS and GPU memory"
)

usage() {
  echo "usage: bash bench/run.sh SUITE [ARGS...]"
  echo "suites (bench/suites/SUITE.sh):"
  local s
  for s in "${suites[@]}"; do echo "  ${s%%:*}:${s#*:}"; done
}

suite=${1:-}
case "$suite" in
  "" | -h | --help | list) usage; exit 0 ;;
esac
shift
file="$root/bench/suites/$suite.sh"
if [[ ! -f "$file" ]]; then
  echo "bench/run.sh: unknown suite '$suite'" >&2
  usage >&2
  exit 2
fi
cd "$root" || exit 1
exec bash "$file" "$@"
