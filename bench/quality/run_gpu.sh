#!/usr/bin/env bash
# The long-context task table on the GPU machine: tasks.py's prompts, our presses
# (dropkv-quality-tasks --device cuda) and kvpress's (kvpress_tasks.py --device cuda) on the same
# prompts and token ids, the same GPU and dtype, then score.py's tables, one per model.
#
# Here, once:
#   bash bench/quality/run_gpu.sh --wheels     # kvpress and its pinned transformers into .whl/kvpress
#   bash scripts/gpu_stage_models.sh --split   # the models' pieces (their own device calls)
#   cmake -S . -B build-gpu-local -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build-gpu-local
#   bash scripts/gpu_pack.sh bin/dropkv-quality-tasks bin/dropkv-quality tests/model_gpu_real_models_test
# There, after the staging calls, with carry [".gpu-pack", ".whl/kvpress"]:
#   bash bench/quality/run_gpu.sh
# Env (defaults in brackets; the defaults take ~3-4 minutes there, an estimate):
#   RUNS       model:length pairs ["smollm2-135m-instruct:4096 gemma-3-270m:8192"]; SmolLM2 has
#              8,192 positions (prompt + answer), so its "8K" is 8000
#   NUM [3]    prompts per task and length      TASKS [niah_number,mk_niah,mv_niah,vt,qa]
#   KEEPS [0.05,0.1,0.25]    DTYPE [bfloat16]   SEED [0]   WINDOW [8] (ours and kvpress's own W)
#   FORMAT [raw]: tasks.py's prompt format (chat: the model's chat template around the task)
#   METHODS    ours [full,dropkv,snapkv,h2o,streaming_llm,knorm]
#   ALLOCATORS ours [uniform], e.g. uniform,pyramid (a method an allocator refuses is skipped)
#   PRESSES    kvpress, one prefill for all [full,snapkv,snapkv:w64,pyramidkv,pyramidkv:w64,tova,
#              expected_attention,criticalkv,knorm,streaming_llm] (`:w64`: kvpress's default window)
#   SEPARATE   kvpress presses that need a prefill each [adakv,critical_adakv]; "" = none
#   SKIP_OURS=1 / SKIP_KVPRESS=1    BUDGET [480]: seconds, shared equally by the runs; a step past its run's share is cut
#   DROPKV_GPU_MODELS [/tmp/dropkv-stage/models]   DEVICE [cuda] (cpu: a check of this script here,
#   with DROPKV_PYTHON, DROPKV_KVPRESS_PYTHON and build/bin on PATH)
# $OUT gets ours.jsonl, kvpress.jsonl, tables.md and run.log (4 files; the limit is 8).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

if [[ "${1:-}" == "--wheels" ]]; then
  # The versions of scripts/setup.sh's venv-kvpress (kvpress pins transformers < 5.3; the GPU
  # machine has 5.17), for Python 3.12 on x86-64. What the GPU machine already has (torch, numpy,
  # pandas, pyarrow, accelerate, peft, huggingface-hub, safetensors, requests, six, ...) is not
  # carried. fire 0.6.0 is an sdist only: built here into a pure-Python wheel.
  set -e
  kpy=${DROPKV_KVPRESS_PYTHON:-$HOME/.cache/dropkv/venv-kvpress/bin/python}
  dest="$root/.whl/kvpress"
  rm -rf "$dest" && mkdir -p "$dest"
  ver() { "$kpy" -c "import importlib.metadata as m; print(m.version('$1'))"; }
  pkgs=()
  for p in kvpress transformers tokenizers cachetools datasets dill multiprocess termcolor; do
    pkgs+=("$p==$(ver $p)")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "${pkgs[@]}"
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "fire==$(ver fire)"
  echo "run_gpu: $(ls "$dest" | wc -l) wheels in .whl/kvpress ($(du -sh "$dest" | cut -f1)): $(ls "$dest" | tr '\n' ' ')"
  exit 0
fi

OUT=${OUT:-/tmp/dropkv-quality-out}
mkdir -p "$OUT"
work=/tmp/dropkv-quality
mkdir -p "$work"
log="$OUT/run.log"
: > "$log"
say() { echo "$@" | tee -a "$log"; }
t0=$SECONDS
budget=${BUDGET:-480}
models_dir=${DROPKV_GPU_MODELS:-/tmp/dropkv-stage/models}
runs=${RUNS:-"smollm2-135m-instruct:4096 gemma-3-270m:8192"}
num=${NUM:-3}
tasks=${TASKS:-niah_number,mk_niah,mv_niah,vt,qa}
keeps=${KEEPS:-0.05,0.1,0.25}
dtype=${DTYPE:-bfloat16}
seed=${SEED:-0}
format=${FORMAT:-raw}
window=${WINDOW:-8}
methods=${METHODS:-full,dropkv,snapkv,h2o,streaming_llm,knorm}
allocators=${ALLOCATORS:-uniform}
presses=${PRESSES:-full,snapkv,snapkv:w64,pyramidkv,pyramidkv:w64,tova,expected_attention,criticalkv,knorm,streaming_llm}
separate=${SEPARATE-adakv,critical_adakv}
py=${DROPKV_PYTHON:-python3}

# Our binary: from the pack, or already on PATH (a build here: PATH=build/bin:$PATH).
if [[ -f "$root/.gpu-pack/pack.tar.xz" ]] && ! command -v dropkv-quality-tasks > /dev/null; then
  source "$root/scripts/gpu_pack.sh" --unpack >> "$log" 2>&1 || say "run_gpu: cannot unpack .gpu-pack"
fi
ours_bin=$(command -v dropkv-quality-tasks)
[[ -n "$ours_bin" || -n "${SKIP_OURS:-}" ]] || { say "run_gpu: no dropkv-quality-tasks (carry .gpu-pack)"; exit 1; }

# kvpress: DROPKV_KVPRESS_PYTHON (here: set-up's venv-kvpress), else the carried wheels on top of
# the machine's packages, installed once per machine.
site=/tmp/dropkv-kvpress-site
if [[ -n "${DROPKV_KVPRESS_PYTHON:-}" ]]; then
  kvpy=("$DROPKV_KVPRESS_PYTHON")
else
  if [[ -z "${SKIP_KVPRESS:-}" && ! -f "$site/.installed" ]]; then
    if ls "$root"/.whl/kvpress/*.whl > /dev/null 2>&1; then
      rm -rf "$site"
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$root"/.whl/kvpress/*.whl >> "$log" 2>&1 && touch "$site/.installed"
    else
      say "run_gpu: no .whl/kvpress carried and none installed: kvpress_tasks.py may not import"
    fi
  fi
  kvpy=(env "PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}" "$py")
fi
device=${DEVICE:-cuda}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/run_gpu: GPU /' | tee -a "$log"

# Each model:length run gets an equal share of what is left when it starts, so a slow first run
# cannot starve the later ones (tasks.py writes prompts prompt-major: a cut run keeps every task).
run_end=0
left() {
  local all=$((budget - (SECONDS - t0))) run=$((run_end - SECONDS))
  echo $((run < all ? run : all))
}
step() {  # step NAME CMD...: runs CMD with the time left, unless none is
  local name=$1; shift
  local l; l=$(left)
  if [[ $l -le 10 ]]; then say "run_gpu: $name skipped (its share of the ${budget}s budget is spent)"; return 1; fi
  local s=$SECONDS
  timeout "$l" "$@" >> "$log" 2>&1
  local rc=$?
  say "run_gpu: $name rc=$rc $((SECONDS - s)) s"
  return $rc
}

rm -f "$work"/*.jsonl
runs_left=$(wc -w <<< "$runs")
for run in $runs; do
  model=${run%%:*} length=${run##*:}
  run_end=$((SECONDS + (budget - (SECONDS - t0)) / runs_left))
  runs_left=$((runs_left - 1))
  dir="$models_dir/$model"
  [[ -f "$dir/config.json" ]] || { say "run_gpu: no $dir (stage it: scripts/gpu_stage_models.sh)"; continue; }
  tag="${model}_${length}"
  prompts="$work/prompts_$tag.jsonl"
  step "prompts $tag" "$py" "$root/bench/quality/tasks.py" --model "$dir" --lengths "$length" \
    --num "$num" --tasks "$tasks" --format "$format" --seed "$seed" --out "$prompts" || continue
  if [[ -z "${SKIP_OURS:-}" ]]; then
    # With kvpress to follow, ours (the faster) gets 40% of the run's share.
    end=$run_end
    [[ -z "${SKIP_KVPRESS:-}" ]] && run_end=$((SECONDS + (run_end - SECONDS) * 2 / 5))
    step "ours $tag" "$ours_bin" --model "$dir" --prompts "$prompts" --methods "$methods" \
      --keeps "$keeps" --allocators "$allocators" --window "$window" --device "$device" \
      --dtype "$dtype" --out "$work/ours_$tag.jsonl"
    run_end=$end
  fi
  if [[ -z "${SKIP_KVPRESS:-}" ]]; then
    step "kvpress $tag" "${kvpy[@]}" "$root/bench/quality/kvpress_tasks.py" --model "$dir" \
      --prompts "$prompts" --presses "$presses" --keeps "$keeps" --window "$window" \
      --device "$device" --dtype "$dtype" --out "$work/kvpress_$tag.jsonl"
    if [[ -n "$separate" ]]; then
      step "kvpress --separate $tag" "${kvpy[@]}" "$root/bench/quality/kvpress_tasks.py" \
        --model "$dir" --prompts "$prompts" --presses "$separate" --keeps "$keeps" \
        --window "$window" --device "$device" --dtype "$dtype" --separate \
        --out "$work/kvpress_sep_$tag.jsonl"
    fi
  fi
done

cat "$work"/ours_*.jsonl > "$OUT/ours.jsonl" 2>/dev/null
cat "$work"/kvpress_*.jsonl > "$OUT/kvpress.jsonl" 2>/dev/null
: > "$OUT/tables.md"
for run in $runs; do
  model=${run%%:*}
  files=$(ls "$work"/ours_"$model"_*.jsonl "$work"/kvpress_"$model"_*.jsonl \
             "$work"/kvpress_sep_"$model"_*.jsonl 2>/dev/null | sort -u)
  [[ -n "$files" ]] || continue
  # One table set per model (score.py pairs rows by task, length and prompt idx).
  grep -q "^## $model\$" "$OUT/tables.md" && continue
  { echo "## $model"; echo; echo "$dtype on $device, $num $format prompts per task and length, seed $seed"
    "$py" "$root/bench/quality/score.py" $files; echo; } >> "$OUT/tables.md" 2>&1
done
cat "$OUT/tables.md"
say "run_gpu: $((SECONDS - t0)) s in all; logs in $OUT/run.log"
