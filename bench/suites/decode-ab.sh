#!/usr/bin/env bash
# The decode step on the GPU machine in one call, from binaries built here and carried
# (scripts/gpu_pack.sh bin/dropkv-bench-e2e): variants of the engine A/B'd in one call (one
# process each, ROUNDS rounds in order), then where a step's time goes, kernel by kernel (ncu on
# the CUDA graph's nodes: kernels timed one at a time, so without the overlap PDL gives them in
# the stream). Run from the repo root after `source scripts/gpu_pack.sh --unpack`.
# Env: VARIANTS: space-separated; a variant is a comma-joined list of bench flags ("--x=y") and
#        environment settings ("NAME=value"; BENCH=path: another dropkv-bench-e2e, e.g. the
#        previous commit's, unpacked by hand); "default" is none. Default: "default".
#      ROUNDS (2), GEOMETRY (llama-3.1-8b), DECODE (1x8192), KEEP (1.0,0.1),
#      NCU=1: the breakdown of the default variant's bs1 8K full-cache step (ncu.csv, ncu.md).
set -uo pipefail
OUT=${OUT:-/tmp/decode-out}
mkdir -p "$OUT"
geo=${GEOMETRY:-llama-3.1-8b}
base=(--geometry "$geo" --write-config "/tmp/geo/$geo" --prefill 512 --decode "${DECODE:-1x8192}"
      --keep "${KEEP:-1.0,0.1}" --repeats 3 --graphs on)
split_variant() {  # variant -> the arrays flags / envs and the binary
  flags=() envs=() bench=dropkv-bench-e2e
  [[ "$1" == default ]] && return
  local item
  for item in ${1//,/ }; do
    if [[ "$item" == --* ]]; then flags+=("$item")
    elif [[ "$item" == BENCH=* ]]; then bench=${item#BENCH=}
    else envs+=("$item"); fi
  done
}
: > "$OUT/ab.md"
for round in $(seq "${ROUNDS:-2}"); do
  for v in ${VARIANTS:-default}; do
    split_variant "$v"
    log="$OUT/ab_${round}_${v//[^A-Za-z0-9_]/_}.txt"
    env "${envs[@]}" timeout 150 "$bench" "${base[@]}" "${flags[@]}" > "$log" 2>&1
    echo "rc=$? round $round: $v" >> "$OUT/ab.md"
    grep -E "^decode .*ms/step" "$log" >> "$OUT/ab.md"
  done
done

if [[ -n "${NCU:-}" ]]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # Graph nodes from the 3000th on: past the prefill and the warm-up replays, inside the timed
  # replays of the first (full-cache) decode case; 700 nodes cover two steps.
  timeout 300 "$ncu" --graph-profiling node --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 700 --csv \
    dropkv-bench-e2e --geometry "$geo" --write-config "/tmp/geo/$geo" --prefill 512 \
    --decode 1x8192 --keep 1.0 --repeats 1 --graphs on > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$?" >> "$OUT/ab.md"
  python3 - "$OUT/ncu.csv" > "$OUT/ncu.md" <<'EOF'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; name_i = head.index("Kernel Name"); val_i = head.index("Metric Value")
unit_i = head.index("Metric Unit")
by = collections.defaultdict(list)
for r in rows[1:]:
    v = float(r[val_i].replace(",", ""))
    v = v / 1000 if r[unit_i] in ("nsecond", "ns") else v * (1000 if r[unit_i] in ("msecond", "ms") else 1)
    by[r[name_i][:90]].append(v)
total = sum(sum(v) for v in by.values())
print(f"{'kernel':90} {'count':>5} {'mean us':>8} {'sum us':>9}")
for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"{k:90} {len(v):5d} {sum(v)/len(v):8.2f} {sum(v):9.1f}")
print(f"{'all':90} {sum(len(v) for v in by.values()):5d} {'':8} {total:9.1f}")
EOF
fi
echo "==================== decode A/B (ms per step)"
cat "$OUT/ab.md"
[[ -s "$OUT/ncu.md" ]] && { echo "==================== ncu, per kernel"; head -40 "$OUT/ncu.md"; }
exit 0
