#!/usr/bin/env bash
# Our decode step beside a gpt-fast-style torch.compile peer (bench/e2e/compiled_peer.py: a plain
# PyTorch Llama, static dense KV cache, mode="reduce-overhead" CUDA graphs) on the H200 in one call:
# dropkv-bench-e2e on Llama-3.1-8B geometry (random weights, bf16, CUDA graphs, random K/V as the
# context, keep 1.0), then the peer on the same geometry and cases, then a ratio table last.
# From the repo root, with carry [".gpu-pack"] (scripts/gpu_pack.sh bin/dropkv-bench-e2e, built
# here for sm_90):  bash bench/run.sh peer
# Our figure is the median step (ids read back every step); the peer's the best round's mean step,
# with ids read back every step (sync step) or fed on the device (sync round, gpt-fast's loop).
# The peer compiles one graph per case and attention mode, about a minute each for 32 layers
# (its "first call s" column says), so the default (3 cases, masked) takes ~3-5 minutes.
# Env: DECODE (1x8192,4x4096,16x2048): both sides' cases; DROPKV_PEER_SHAPES: the peer's only
#      (trims its compiles); PEER_ATTENTION (masked): masked, sliced or masked,sliced (twice the
#      compiles); PEER_ARGS: more peer flags (e.g. "--gqa repeat", "--max-autotune");
#      PEER_TIMEOUT (420 s; its results so far survive a cut); SKIP_OURS=1; BENCH=path: that
#      dropkv-bench-e2e, no unpacking. Logs to $OUT (ours.json/.err, peer.txt/.err).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
OUT=${OUT:-/tmp/peer-out}
mkdir -p "$OUT"
decode=${DECODE:-1x8192,4x4096,16x2048}
if [[ -n "${BENCH:-}" ]]; then
  bench=$BENCH
elif [[ -z "${SKIP_OURS:-}" ]]; then
  source scripts/gpu_pack.sh --unpack || exit 1
  bench=dropkv-bench-e2e
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
start=$SECONDS
: > "$OUT/ours.json"
if [[ -z "${SKIP_OURS:-}" ]]; then
  timeout 240 "$bench" --geometry llama-3.1-8b --write-config /tmp/geo/llama-3.1-8b --prefill 512 \
    --decode "$decode" --keep 1.0 --repeats 2 --graphs on --synthetic-context --decode-steps 128 \
    --json > "$OUT/ours.json" 2> "$OUT/ours.err"
  echo "==================== dropkv-bench-e2e: exit $?, $((SECONDS - start)) s"
  grep -E "^decode |error|fail" "$OUT/ours.err" | head -20
fi
t_peer=$SECONDS
# shellcheck disable=SC2086  # PEER_ARGS is a list of flags
timeout "${PEER_TIMEOUT:-420}" python3 bench/e2e/compiled_peer.py --geometry llama-3.1-8b \
  --decode "${DROPKV_PEER_SHAPES:-$decode}" --repeats 2 --attention "${PEER_ATTENTION:-masked}" \
  ${PEER_ARGS:-} > "$OUT/peer.txt" 2> "$OUT/peer.err"
echo "==================== compiled_peer.py: exit $?, $((SECONDS - t_peer)) s"
grep -v "^RESULT " "$OUT/peer.txt"
grep -E "^decode |^prefill |Error|error" "$OUT/peer.err" | tail -20
echo "==================== decode ms/step, ours vs the compiled peer ($((SECONDS - start)) s in all)"
python3 - "$OUT/ours.json" "$OUT/peer.txt" <<'EOF'
import json
import sys

ours = {}
try:
    text = open(sys.argv[1]).read()
    for d in json.loads(text[text.index("{"):])["decode"]:  # tolerate log lines before the object
        if d["keep"] == 1.0 and d.get("graphs", True):
            ours[(d["batch"], d["context"])] = d["ms_per_step"]
except (OSError, ValueError, KeyError) as e:
    print(f"ours: unreadable ({e})")
peer, columns = {}, []
for line in open(sys.argv[2]):
    if line.startswith("RESULT "):
        r = json.loads(line[len("RESULT "):])
        if r["kind"] != "decode":
            continue
        col = f"{r['attention']}/{r['sync']}"
        columns += [col] if col not in columns else []
        peer[(r["batch"], r["context"], col)] = r["ms_per_step"]
cases = sorted(set(ours) | {k[:2] for k in peer}, key=lambda c: (c[0], -c[1]))
print("| decode | ours | " + " | ".join(f"peer {c} | peer/ours" for c in columns) + " |")
print("|" + "---|" * (2 + 2 * len(columns)))
for b, c in cases:
    row = f"| bs{b} ctx{c} | " + (f"{ours[(b, c)]:.3f}" if (b, c) in ours else "-")
    for col in columns:
        p = peer.get((b, c, col))
        row += f" | {p:.3f}" if p else " | -"
        row += f" | {p / ours[(b, c)]:.2f}" if p and (b, c) in ours else " | -"
    print(row + " |")
EOF
