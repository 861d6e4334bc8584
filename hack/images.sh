#!/usr/bin/env bash
# Builds the container images with Docker from the repository root, tagged with the package version:
# arl-tangram-sandbox (sandbox-images/Dockerfile), arl-tangram-operator (sandbox-images/operator.Dockerfile)
# and arl-tangram-reward (sandbox-images/reward/Dockerfile). Prints each image's size and build time.
# docs/images.md says more.
#
#   hack/images.sh          build them (starts a Docker engine first where none runs and this is root)
#   hack/images.sh base     print the base image a build would use (making it when it is the made one)
#   hack/images.sh docker   print the docker CLI a build would use
#   hack/images.sh ca       print the extra CA certificates a build would be given (PEM)
#
# Environment:
#   IMAGES_BASE     auto (default): the official base when the engine has it or can pull it, else the
#                   base made without a registry (hack/images/base.sh); official; debootstrap
#   BASE_IMAGE      a base image to use as it is (overrides IMAGES_BASE)
#   DOCKER_BUILDKIT 0: the legacy builder; anything else (default): BuildKit
#   EXTRA_CA_CERTS_FILE  PEM file of CA certificates the builds' pip and npm must trust (a
#                   TLS-intercepting proxy); default: the certificates added to this host's trust store
#                   (/usr/local/share/ca-certificates/*.crt); `none`: no extra ones. Passed as the
#                   build argument EXTRA_CA_CERTS, read in the build stages only: no image keeps it.
#   BUILD_IMAGES    which to build, of: sandbox operator reward (default: all three)
#   VERSION         the tag (default: pyproject.toml's version); FORK_LOOP, TORCH_SPEC: build arguments
#   IMAGES_LOG_DIR  where each build's full log goes (default artifacts/images)
#   IMAGES_KEEP_CACHE  after the builds, trim the engine's BuildKit cache to this size (`docker builder
#                   prune --keep-storage`, e.g. 12GB); default: the cache is left alone. .ci/run sets
#                   it: each commit's builds add gigabytes of cache, and a CI machine keeps its engine.
#
# An image a build replaces under its tag (the one the tag named before) is removed when nothing
# else names it: left dangling, each rebuild kept gigabytes until the disk filled.
set -euo pipefail
# shellcheck source=hack/images/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/images/lib.sh"
cd "$images_root"

version="$(sed -nE 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n1)"
version="${VERSION:-$version}"
log_dir="${IMAGES_LOG_DIR:-$images_root/artifacts/images}"

# name -> Dockerfile; the image is arl-tangram-<name>:<version>.
declare -A dockerfiles=(
  [sandbox]=sandbox-images/Dockerfile
  [operator]=sandbox-images/operator.Dockerfile
  [reward]=sandbox-images/reward/Dockerfile
)
order=(sandbox operator reward)

# The official base: the Dockerfiles' own default (one place: the sandbox's ARG line; a test checks
# that the other Dockerfiles say the same).
official_base() { sed -nE 's/^ARG BASE_IMAGE=(.+)$/\1/p' sandbox-images/Dockerfile | head -n1; }

choose_base() {
  if [ -n "${BASE_IMAGE:-}" ]; then echo "$BASE_IMAGE"; return; fi
  local official
  official="$(official_base)"
  case "${IMAGES_BASE:-auto}" in
    official) echo "$official" ;;
    debootstrap) bash "$images_root/hack/images/base.sh" ;;
    auto)
      if "$DOCKER" image inspect "$official" >/dev/null 2>&1 || "$DOCKER" pull -q "$official" >/dev/null 2>&1; then
        echo "$official"
      else
        say "$official cannot be pulled here (no registry reachable): building on a base made with debootstrap"
        bash "$images_root/hack/images/base.sh"
      fi
      ;;
    *) die "IMAGES_BASE must be auto, official or debootstrap, not '${IMAGES_BASE}'" ;;
  esac
}

extra_ca() {
  # The PEM text of the extra CA certificates (empty for none).
  local file="${EXTRA_CA_CERTS_FILE:-}"
  if [ "$file" = none ]; then return; fi
  if [ -n "$file" ]; then
    [ -r "$file" ] || die "EXTRA_CA_CERTS_FILE=$file is not a readable file"
    grep -q "BEGIN CERTIFICATE" "$file" || die "EXTRA_CA_CERTS_FILE=$file holds no PEM certificate"
    cat "$file"
    return
  fi
  local f
  for f in /usr/local/share/ca-certificates/*.crt; do
    [ -r "$f" ] && grep -q "BEGIN CERTIFICATE" "$f" && cat "$f"
  done
  return 0
}

human_size() { awk -v b="$1" 'BEGIN { printf "%.0f MB", b / 1000000 }'; }

build() {
  local name="$1" base="$2" ca="$3" image="arl-tangram-$1:$version" log t0 elapsed size before
  local -a args=(--build-arg "BASE_IMAGE=$base" -f "${dockerfiles[$name]}" -t "$image")
  [ -z "$ca" ] || args+=(--build-arg "EXTRA_CA_CERTS=$ca")
  [ -z "${FORK_LOOP:-}" ] || args+=(--build-arg "FORK_LOOP=$FORK_LOOP")
  [ -z "${TORCH_SPEC:-}" ] || args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
  [ "$builder" = legacy ] || args+=(--progress=plain)
  log="$log_dir/$name.log"
  before="$("$DOCKER" image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
  t0=$(date +%s.%N)
  if ! "$DOCKER" build "${args[@]}" . >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    die "building $image failed (${dockerfiles[$name]}; full log: $log)"
  fi
  elapsed="$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
  size="$("$DOCKER" image inspect -f '{{.Size}}' "$image")"
  say "$image: $(human_size "$size"), built in ${elapsed} s ($builder builder, base $base)"
  remove_if_unnamed "$before" "$("$DOCKER" image inspect -f '{{.Id}}' "$image")"
}

remove_if_unnamed() {
  # The image the tag named before this build ($1), where the build made another ($2) and no tag
  # names the old one any more; a container still using it keeps it (the removal just fails).
  local old="$1" new="$2"
  [ -n "$old" ] && [ "$old" != "$new" ] || return 0
  [ "$("$DOCKER" image inspect -f '{{len .RepoTags}}' "$old" 2>/dev/null)" = 0 ] || return 0
  if "$DOCKER" image rm "$old" >/dev/null 2>&1; then
    say "removed the image this build replaced (${old:7:12})"
  fi
}

DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-1}"
export DOCKER_BUILDKIT
builder=BuildKit
[ "$DOCKER_BUILDKIT" != 0 ] || builder=legacy

bash "$images_root/hack/images/engine.sh" || die "no Docker engine: the images cannot be built here"
DOCKER="$(pick_docker)"

case "${1:-build}" in
  docker) echo "$DOCKER"; exit 0 ;;
  base) choose_base; exit 0 ;;
  ca) extra_ca; exit 0 ;;
  build) ;;
  *) die "usage: hack/images.sh [build|base|docker|ca]" ;;
esac

wanted=(${BUILD_IMAGES:-${order[*]}})
for name in "${wanted[@]}"; do
  [ -n "${dockerfiles[$name]:-}" ] || die "BUILD_IMAGES: unknown image '$name' (known: ${order[*]})"
done
mkdir -p "$log_dir"
t_all=$SECONDS
base="$(choose_base)"
ca="$(extra_ca)"
[ -z "$ca" ] || say "extra CA certificates for the builds: $(grep -c 'BEGIN CERTIFICATE' <<<"$ca") (build argument EXTRA_CA_CERTS, build stages only)"
for name in "${wanted[@]}"; do build "$name" "$base" "$ca"; done
say "built ${wanted[*]} in $((SECONDS - t_all)) s (base image included)"
if [ -n "${IMAGES_KEEP_CACHE:-}" ] && [ "$builder" = BuildKit ]; then
  "$DOCKER" builder prune -f --keep-storage "$IMAGES_KEEP_CACHE" >/dev/null \
    || die "IMAGES_KEEP_CACHE=$IMAGES_KEEP_CACHE: docker builder prune --keep-storage refused it"
  say "BuildKit cache trimmed to at most $IMAGES_KEEP_CACHE (IMAGES_KEEP_CACHE)"
fi
say "disk: $(df -h --output=avail . | tail -n1 | tr -d ' ') free where the repository is"
