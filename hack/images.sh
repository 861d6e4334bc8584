#!/usr/bin/env bash
# Builds the container images with `docker build`: arl-tangram-sandbox and arl-tangram-operator,
# tagged with the package version. Needs a running Docker engine; says so plainly when there is none.
#   BASE_IMAGE=python:3.12-slim hack/images.sh     builds on another base image
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(sed -nE 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n1)"
version="${VERSION:-$version}"

if ! command -v docker >/dev/null 2>&1; then
  echo "images: the docker CLI is not installed; install Docker to build the images" >&2
  exit 1
fi
if ! docker info >/dev/null 2>&1; then
  echo "images: no Docker engine is running here (\`docker info\` failed); start one (dockerd) or build elsewhere" >&2
  exit 1
fi

args=()
if [ -n "${BASE_IMAGE:-}" ]; then
  args+=(--build-arg "BASE_IMAGE=${BASE_IMAGE}")
fi
export DOCKER_BUILDKIT=1
docker build "${args[@]}" -f sandbox-images/Dockerfile -t "arl-tangram-sandbox:${version}" .
docker build "${args[@]}" -f sandbox-images/operator.Dockerfile -t "arl-tangram-operator:${version}" .
echo "images: built arl-tangram-sandbox:${version} and arl-tangram-operator:${version}"
