# Shared by hack/images.sh and hack/images/base.sh (sourced): the docker CLI to build with, and logging.
# shellcheck shell=bash

images_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
images_cache="${IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/arl-tangram/images}"

say() { echo "images: $*" >&2; }
die() { say "$*"; exit 1; }

# The docker CLI for the builder asked for (DOCKER_BUILDKIT=0: the legacy builder; anything else:
# BuildKit). A docker CLI from 23 on builds with BuildKit only through its buildx plugin, and fails
# ("BuildKit is enabled but the buildx component is missing") where that plugin is missing; an
# older CLI (Debian's docker.io is 20.10) has BuildKit built in. So the first CLI on PATH that can do
# it is taken. DOCKER names one explicitly.
pick_docker() {
  if [ -n "${DOCKER:-}" ]; then echo "$DOCKER"; return; fi
  local d major
  if [ "${DOCKER_BUILDKIT:-1}" = 0 ]; then
    command -v docker || die "no docker CLI (apt-get install docker.io)"
    return
  fi
  while read -r d; do
    [ -n "$d" ] || continue
    if "$d" buildx version >/dev/null 2>&1; then echo "$d"; return; fi
    major="$("$d" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)"
    if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then echo "$d"; return; fi
  done < <(type -ap docker)
  die "no docker CLI here builds with BuildKit: a CLI from 23 on needs the buildx plugin; install it, or Debian's docker.io (20.10, BuildKit built in), or build with the legacy builder (DOCKER_BUILDKIT=0)"
}
