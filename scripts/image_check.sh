#!/usr/bin/env bash
# Builds the container images with podman (no Docker engine, no daemon) and checks them for real:
#   1. apt: podman and debootstrap (only the missing ones);
#   2. the Debian base: `debootstrap --variant=minbase bookworm` from the Debian mirror, imported
#      once and tagged as the Dockerfiles' `FROM` (debian:<point release> and its -slim);
#   3. builds docker/Dockerfile.cpu (`podman build --isolation=chroot`), with a compiler cache
#      mounted at /ccache so that a second build recompiles only what changed;
#   4. exports the image's filesystem and, in a chroot of it (as the image's user, with its
#      environment), starts `dropkv-server` on the default model (SmolLM2-135M-Instruct, bind-mounted
#      read-only at /models as the volume would be, or copied in when its files are root-only) on
#      loopback ports; checks that every library resolves, the HEALTHCHECK
#      command, a completion over the OpenAI HTTP API, a generation over gRPC (dropkv-cli) and
#      /metrics; stops it with SIGTERM (exit 0 expected);
#   5. prints the build times, image sizes, largest layers (podman history) and largest files;
#   6. with --cuda, the same build for docker/Dockerfile.cuda (3.7 GB; ~30 min cold on 2 cores),
#      whose binaries must run --help and whose libraries must resolve in a chroot; no GPU is used.
# Measured numbers and what this cannot check: docs/deployment.md, "Building and checking the images".
# `podman run` is not used: it fails in this sandbox (rlimits, cgroups); a chroot of the exported
# filesystem runs the same files. Idempotent: the base, the image layers and the compiler cache
# are reused. Run as root (podman's root storage, chroot, bind mounts).
#
# Environment: DROPKV_CACHE (default ~/.cache/dropkv): the base, compiler caches and scratch go to
# $DROPKV_CACHE/images; DROPKV_MODELS (default $DROPKV_CACHE/models) holds smollm2-135m-instruct
# (scripts/setup.sh converts it); DROPKV_JOBS: compile jobs inside the build (default 2).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/image_check.sh [options]

Build docker/Dockerfile.cpu with podman, run its dropkv-server in a chroot of the image on the
default model, send requests, check /metrics, print the image size and largest layers.

Options:
  --cuda        also build docker/Dockerfile.cuda (Debian base, the torch wheel's CUDA libraries;
                3.7 GB, ~30 min cold on 2 cores, minutes with its ccache) and check that its
                binaries run --help and its libraries resolve in a chroot (no GPU needed)
  --cuda-only   build and check only the CUDA image
  --no-run      build the CPU image but do not start its server
  --tag PREFIX  image name (default dropkv-server): PREFIX:cpu and PREFIX:cuda
  -h, --help    this help

Environment: DROPKV_CACHE, DROPKV_MODELS, DROPKV_JOBS (compile jobs, default 2).
Needs root. Installs podman, debootstrap and curl with apt when missing. Cached between runs
under $DROPKV_CACHE/images (base, compiler caches) and in podman's storage (layers).
EOF
}

cpu=1 cuda=0 run_server=1 name=dropkv-server
while (($#)); do
  case "$1" in
    --cuda) cuda=1 ;;
    --cuda-only) cuda=1 cpu=0 ;;
    --no-run) run_server=0 ;;
    --tag) [[ $# -ge 2 ]] || { echo "image_check: --tag needs a value" >&2; exit 2; }; name=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "image_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${DROPKV_CACHE:-$HOME/.cache/dropkv}
images=$cache/images
models=${DROPKV_MODELS:-$cache/models}
model_name=smollm2-135m-instruct
jobs=${DROPKV_JOBS:-2}

say() { printf '[image] %s\n' "$*"; }
die() { printf '[image] FAIL: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (podman's root storage, chroot and bind mounts need it)"

# --- 1. apt -----------------------------------------------------------------------------------------
apt_packages=(podman debootstrap curl)
missing=()
for p in "${apt_packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  say "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
mkdir -p "$images"

# Scratch (exported root filesystems) and the mounts in them are removed on every exit.
scratch=$(mktemp -d "$images/scratch.XXXXXX")
server_pid=""
mounts=()
cleanup() {
  local rc=$?
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null || true
  done
  # Never delete through a mount that is still there (the models folder is bind-mounted).
  if grep -qF " $scratch/" /proc/mounts; then
    printf '[image] left %s in place: something is still mounted under it\n' "$scratch" >&2
  else
    rm -rf --one-file-system "$scratch"
  fi
  exit "$rc"
}
trap cleanup EXIT

# --- 2. the Debian base -----------------------------------------------------------------------------
# minbase is what debian:<tag>-slim holds (apt, dpkg, coreutils, no docs); the same image is tagged
# as both debian:<tag> and debian:<tag>-slim. The tag is the point release debootstrap installed.
base_tar=$images/debian-bookworm-minbase.tar
if [[ ! -s "$base_tar" || ! -s "$images/debian-version" ]]; then
  say "bootstrapping Debian bookworm (minbase) from deb.debian.org"
  rootfs=$scratch/base
  start=$(date +%s)
  nice -n 19 debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian \
    >"$images/debootstrap.log" 2>&1 || die "debootstrap failed; see $images/debootstrap.log"
  # As Docker Hub's debian images: bookworm, -updates and -security; no package lists or .debs.
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$base_tar.tmp" .
  cp "$rootfs/etc/debian_version" "$images/debian-version.tmp"
  mv "$base_tar.tmp" "$base_tar"
  mv "$images/debian-version.tmp" "$images/debian-version"
  rm -rf --one-file-system "$rootfs"
  say "base bootstrapped in $(($(date +%s) - start)) s"
fi
debian_tag=$(cat "$images/debian-version")
if ! podman image exists "docker.io/library/debian:$debian_tag"; then
  say "importing the base as debian:$debian_tag and debian:$debian_tag-slim"
  podman import --quiet "$base_tar" "docker.io/library/debian:$debian_tag" >/dev/null
fi
podman image exists "docker.io/library/debian:$debian_tag-slim" ||
  podman tag "docker.io/library/debian:$debian_tag" "docker.io/library/debian:$debian_tag-slim"
say "base: debian:$debian_tag (debootstrap minbase; $base_tar)"

# --- 3. build -----------------------------------------------------------------------------------------
version=$(sed -n 's/^project(dropkv_server VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"

build_image() {  # flavour (cpu|cuda); sets build_seconds
  local flavour=$1 ccache=$images/ccache-$1 log=$images/build-$1.log
  local ca_args=()
  # The host's CA bundle, for pip behind a TLS-intercepting proxy (harmless otherwise).
  if [[ -s /etc/ssl/certs/ca-certificates.crt ]]; then
    ca_args=(-v /etc/ssl/certs/ca-certificates.crt:/run/dropkv-build-ca.crt:ro
             --build-arg BUILD_CA_BUNDLE=/run/dropkv-build-ca.crt)
  fi
  local base_args=(--build-arg DEBIAN_TAG="$debian_tag")
  [[ $flavour == cuda ]] && base_args=(--build-arg BUILD_IMAGE="debian:$debian_tag"
                                       --build-arg RUNTIME_IMAGE="debian:$debian_tag-slim")
  local old_ids=()
  old_ids+=("$(podman image inspect --format '{{.Id}}' "$name:$flavour" 2>/dev/null || true)")
  old_ids+=("$(podman image inspect --format '{{.Id}}' "$name:$flavour-build" 2>/dev/null || true)")
  mkdir -p "$ccache"
  say "building $name:$flavour from docker/Dockerfile.$flavour ($jobs compile jobs; log $log)"
  local start created; start=$(date +%s)
  created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  # Buildah reuses a cached LABEL step whatever its ARG values are: --label sets the OCI labels
  # that change on every build (the Dockerfile's LABEL is for `docker build`).
  # --format docker: OCI image configs have no HEALTHCHECK. Layers are cached between runs.
  if ! nice -n 19 podman build --isolation=chroot --pull=never --layers --format docker \
      -f "$root/docker/Dockerfile.$flavour" --ignorefile "$root/docker/Dockerfile.$flavour.dockerignore" \
      "${base_args[@]}" --build-arg BUILD_JOBS="$jobs" \
      --build-arg VERSION="$version" --build-arg REVISION="$revision" \
      --build-arg CREATED="$created" \
      --label org.opencontainers.image.version="$version" \
      --label org.opencontainers.image.revision="$revision" \
      --label org.opencontainers.image.created="$created" \
      -v "$ccache:/ccache" "${ca_args[@]}" \
      -t "$name:$flavour" "$root" >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "podman build of docker/Dockerfile.$flavour failed; full log: $log"
  fi
  build_seconds=$(($(date +%s) - start))
  say "built $name:$flavour in ${build_seconds} s"
  # Keep the build stage's layers (the apt and pip layers are the next build's cache) under a tag,
  # and drop what earlier builds left behind: each rebuild of the compile layer leaves GBs.
  nice -n 19 podman build --isolation=chroot --pull=never --layers --format docker --target build \
    -f "$root/docker/Dockerfile.$flavour" --ignorefile "$root/docker/Dockerfile.$flavour.dockerignore" \
    "${base_args[@]}" --build-arg BUILD_JOBS="$jobs" -v "$ccache:/ccache" "${ca_args[@]}" \
    -t "$name:$flavour-build" "$root" >>"$log" 2>&1 || die "tagging the build stage failed; see $log"
  # The previous image and build stage, now untagged (podman rmi also removes their untagged
  # parent layers that nothing else uses). Only this script's own images are touched.
  local old
  for old in "${old_ids[@]}"; do
    [[ -n "$old" ]] || continue
    if [[ -z "$(podman image inspect --format '{{join .RepoTags ","}}' "$old" 2>/dev/null)" ]]; then
      podman rmi "$old" >/dev/null 2>&1 || true
    fi
  done
}

# The image's size and its largest layers (podman history, sizes in bytes).
report_image() {  # flavour
  local ref=$name:$1 size
  size=$(podman image inspect --format '{{.Size}}' "$ref")
  say "image $ref: $((size / 1000000)) MB uncompressed ($size bytes)"
  say "largest layers of $ref:"
  podman history --format json "$ref" | python3 -c '
import json, sys
layers = sorted((l for l in json.load(sys.stdin) if l["size"] > 0), key=lambda l: -l["size"])[:5]
for l in layers:
    what = l["CreatedBy"].replace("/bin/sh -c ", "").replace("#(nop) ", "")
    print("[image]   %8.1f MB  %s" % (l["size"] / 1e6, " ".join(what.split())[:100]))'
  local dir=$scratch/rootfs-$1
  if [[ -d "$dir/opt/dropkv" ]]; then
    say "largest files in $ref:"
    find "$dir/opt/dropkv" -type f -printf '%s %P\n' | sort -nr | head -5 |
      awk '{printf "[image]   %8.1f MB  /opt/dropkv/%s\n", $1 / 1e6, $2}'
  fi
}

# The image's filesystem, exported into $scratch/rootfs-FLAVOUR (sets rootfs).
export_image() {  # flavour
  local dir=$scratch/rootfs-$1 cid
  mkdir -p "$dir"
  # (podman create/rm complain that without systemd they cannot set up the HEALTHCHECK timer.)
  cid=$(podman create "$name:$1" 2>>"$scratch/podman.log")
  podman export "$cid" | tar -x -C "$dir"
  podman rm "$cid" >/dev/null 2>>"$scratch/podman.log"
  # The chroot needs /dev and /proc; the container runtime would provide both.
  mount --bind /dev "$dir/dev" && mounts+=("$dir/dev")
  mount -t proc proc "$dir/proc" && mounts+=("$dir/proc")
  rootfs=$dir
}

# The image's user, working directory and environment, as `podman run` would apply them.
image_env() {  # flavour -> one VAR=value per line
  podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$name:$1" | sed '/^$/d'
}
# Sets image_cmd: chroot into ROOTFS as the image's user, with its environment, running COMMAND
# (chroot and env exec it: the command keeps chroot's pid).
image_command() {  # rootfs flavour command...
  local dir=$1 flavour=$2; shift 2
  local user workdir env_lines=()
  user=$(podman image inspect --format '{{.Config.User}}' "$name:$flavour")
  workdir=$(podman image inspect --format '{{.Config.WorkingDir}}' "$name:$flavour")
  mapfile -t env_lines < <(image_env "$flavour")
  # USER dropkv:dropkv -> numeric ids from the image's own passwd/group files.
  local u=${user%%:*} g=${user#*:} uid gid
  uid=$(awk -F: -v n="$u" '$1 == n {print $3}' "$dir/etc/passwd")
  gid=$(awk -F: -v n="$g" '$1 == n {print $3}' "$dir/etc/group")
  [[ -n "$uid" && -n "$gid" ]] || die "user $user not found in the image"
  image_cmd=(chroot --userspec="$uid:$gid" "$dir" /usr/bin/env -i --chdir="$workdir"
             HOME=/opt/dropkv "${env_lines[@]}" "$@")
}
in_image() {  # rootfs flavour command...
  image_command "$@"
  "${image_cmd[@]}"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

check_cpu_image() {
  local dir=$1
  local model_dir=$models/$model_name
  [[ -f "$model_dir/config.json" ]] ||
    die "no default model at $model_dir (scripts/setup.sh converts it)"
  # The volume: the models folder, read-only, where the image's DROPKV_MODELS points. The image's
  # user (uid 10001) must be able to read the files, as from any volume; a model saved with mode
  # 0600 (setup.sh's conversion writes model.safetensors so) is copied in with a+r instead.
  mkdir -p "$dir/models"
  if [[ -n "$(find "$model_dir" -type f ! -perm -o=r -print -quit)" ]]; then
    say "$model_dir has files only root can read: copying it into the image's /models (a+r) instead of bind-mounting $models"
    cp -r "$model_dir" "$dir/models/"
    chmod -R a+rX "$dir/models/$model_name"
  else
    mount --bind "$models" "$dir/models" && mounts+=("$dir/models")
    mount -o remount,bind,ro "$dir/models"
  fi

  local grpc http metrics log=$scratch/server.log
  grpc=$(free_port); http=$(free_port); metrics=$(free_port)
  while [[ $http == "$grpc" ]]; do http=$(free_port); done
  while [[ $metrics == "$grpc" || $metrics == "$http" ]]; do metrics=$(free_port); done
  say "starting dropkv-server in a chroot of $name:cpu (user $(podman image inspect --format '{{.Config.User}}' "$name:cpu"), model /models/$model_name, gRPC $grpc, HTTP $http, metrics $metrics)"
  # ENTRYPOINT + flags, as `docker run IMAGE --host ...` would run it; loopback only here.
  local entrypoint
  entrypoint=$(podman image inspect --format '{{index .Config.Entrypoint 0}}' "$name:cpu")
  local start; start=$(date +%s)
  image_command "$dir" cpu "$entrypoint" --host 127.0.0.1 --port "$grpc" --http-port "$http" \
    --metrics-port "$metrics"
  "${image_cmd[@]}" >"$log" 2>&1 &
  server_pid=$!

  # The image's HEALTHCHECK command, pointed at this port, until it reports SERVING.
  local healthy=0
  for _ in $(seq 1 180); do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      tail -20 "$log" >&2
      die "dropkv-server exited during start-up"
    fi
    if in_image "$dir" cpu /opt/dropkv/bin/dropkv-cli --address "127.0.0.1:$grpc" health >/dev/null 2>&1; then
      healthy=1
      break
    fi
    sleep 1
  done
  ((healthy)) || { tail -20 "$log" >&2; die "the health check did not pass within 180 s"; }
  say "healthy after $(($(date +%s) - start)) s (dropkv-cli health, the image's HEALTHCHECK)"

  # OpenAI HTTP API.
  local body text
  body=$(curl -sS --max-time 120 "http://127.0.0.1:$http/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model_name\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}") ||
    die "HTTP request failed"
  text=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["choices"][0]["text"])' "$body" 2>/dev/null) ||
    die "unexpected HTTP answer: $body"
  say "HTTP /v1/completions 'The capital of France is' ->$(printf '%q' "$text")"
  [[ "$text" == *Paris* ]] || die "the answer does not say Paris: $body"

  # gRPC, with the image's own client.
  local cli_out
  cli_out=$(in_image "$dir" cpu /opt/dropkv/bin/dropkv-cli --address "127.0.0.1:$grpc" generate \
    --prompt "The capital of France is" --max-new-tokens 8 2>&1) || die "dropkv-cli generate failed: $cli_out"
  say "gRPC dropkv-cli generate ->$(printf '%q' "$cli_out")"
  [[ "$cli_out" == *Paris* ]] || die "the gRPC answer does not say Paris: $cli_out"

  # /metrics counts both requests.
  local scrape requests
  scrape=$(curl -sS --max-time 10 "http://127.0.0.1:$metrics/metrics") || die "/metrics did not answer"
  requests=$(awk '/^dropkv_requests_total/ {s += $NF} END {print s + 0}' <<<"$scrape")
  say "/metrics: dropkv_requests_total = $requests, $(grep -c '^dropkv_' <<<"$scrape") dropkv_ samples"
  ((${requests%.*} >= 2)) || die "/metrics counts $requests requests, expected >= 2"

  # SIGTERM = docker stop: drain, exit 0.
  kill -TERM "$server_pid"
  local rc=0
  wait "$server_pid" || rc=$?
  server_pid=""
  ((rc == 0)) || { tail -20 "$log" >&2; die "dropkv-server exited $rc after SIGTERM"; }
  say "stopped with SIGTERM, exit 0"
}

check_binaries_load() {  # rootfs flavour
  local dir=$1 flavour=$2 b
  for b in dropkv-server dropkv-cli; do
    in_image "$dir" "$flavour" "/opt/dropkv/bin/$b" --help >/dev/null ||
      die "$b --help failed in a chroot of $name:$flavour"
  done
  # Every collected library (also those only loaded with dlopen) resolves inside the image; only
  # the driver's libcuda.so.1 may be missing (the NVIDIA container toolkit mounts it).
  local missing_libs n
  # shellcheck disable=SC2016 # expanded by the image's shell
  missing_libs=$(in_image "$dir" "$flavour" /bin/sh -c \
    'for l in /opt/dropkv/lib/*; do ldd "$l" | sed -n "s|^[[:space:]]*\([^ ]*\) => not found|$l: \1|p"; done' |
    grep -v ': libcuda\.so\.1$' || true)
  [[ -z "$missing_libs" ]] || die "libraries in $name:$flavour do not resolve:"$'\n'"$missing_libs"
  n=$(find "$dir/opt/dropkv/lib" -maxdepth 1 -type f | wc -l)
  say "dropkv-server --help and dropkv-cli --help run in a chroot of $name:$flavour; its $n libraries in /opt/dropkv/lib all resolve (ldd)"
}

cpu_seconds="" cuda_seconds=""
if ((cpu)); then
  build_image cpu
  cpu_seconds=$build_seconds
  if ((run_server)); then
    export_image cpu
    check_binaries_load "$rootfs" cpu
    check_cpu_image "$rootfs"
  fi
fi
if ((cuda)); then
  build_image cuda
  cuda_seconds=$build_seconds
  export_image cuda
  check_binaries_load "$rootfs" cuda
fi

say "---- summary ----"
if ((cpu)); then
  say "CPU image build: ${cpu_seconds} s"
  report_image cpu
fi
if ((cuda)); then
  say "CUDA image build: ${cuda_seconds} s"
  report_image cuda
fi
say "OK"
