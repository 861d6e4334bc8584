#!/usr/bin/env bash
# The kind lane, for anyone with a Docker engine (kind runs Kubernetes nodes as Docker containers):
#   hack/kind.sh up      create the cluster (hack/kind/config.yaml); installs kind when missing
#   hack/kind.sh deploy  load the images `make images` built and apply hack/kind/overlay
#   hack/kind.sh e2e     run tests/e2e against the cluster (the same suite as on the local test bed)
#   hack/kind.sh down    delete the cluster
# Environment: KIND_CLUSTER_NAME (default tangram), KIND_NODE_IMAGE (default: the pinned kind's own),
# KIND_KUBECONFIG (default .cache/kind/kubeconfig), IMAGES (the images to load), PYTHON.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIND_VERSION=v0.33.0
name="${KIND_CLUSTER_NAME:-tangram}"
kubeconfig="${KIND_KUBECONFIG:-$root/.cache/kind/kubeconfig}"
images="${IMAGES:-arl-tangram-operator:0.1.0 arl-tangram-sandbox:0.1.0}"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
export PATH="$root/.venv/bin:$PATH"

die() { echo "kind.sh: $*" >&2; exit 1; }

need_docker() {
  command -v docker >/dev/null 2>&1 || die "the kind lane needs Docker (no 'docker' command); the local test bed (make cluster-up) does not"
  docker info >/dev/null 2>&1 || die "the kind lane needs a running Docker engine ('docker info' failed)"
}

kind_bin() {
  if command -v kind >/dev/null 2>&1; then
    command -v kind
    return
  fi
  local gobin
  gobin="$(go env GOBIN 2>/dev/null || true)"
  [ -n "$gobin" ] || gobin="$(go env GOPATH 2>/dev/null || echo "$HOME/go")/bin"
  if [ ! -x "$gobin/kind" ]; then
    command -v go >/dev/null 2>&1 || die "kind is not installed and there is no Go to install it with"
    echo "kind.sh: installing kind $KIND_VERSION with go install" >&2
    go install "sigs.k8s.io/kind@$KIND_VERSION"
  fi
  echo "$gobin/kind"
}

exists() { "$1" get clusters 2>/dev/null | grep -qx "$name"; }

case "${1:-}" in
  up)
    need_docker
    kind="$(kind_bin)"
    mkdir -p "$(dirname "$kubeconfig")"
    if exists "$kind"; then
      echo "kind.sh: cluster $name exists" >&2
      "$kind" get kubeconfig --name "$name" >"$kubeconfig"
    else
      "$kind" create cluster --name "$name" --config "$root/hack/kind/config.yaml" --kubeconfig "$kubeconfig" \
        --wait 180s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
    fi
    echo "$kubeconfig"
    ;;
  down)
    need_docker
    kind="$(kind_bin)"
    "$kind" delete cluster --name "$name" --kubeconfig "$kubeconfig"
    rm -f "$kubeconfig"
    ;;
  deploy)
    need_docker
    kind="$(kind_bin)"
    exists "$kind" || die "no kind cluster $name: run 'make kind-up' first"
    for image in $images; do
      docker image inspect "$image" >/dev/null 2>&1 || die "image $image is not built: run 'make images'"
      "$kind" load docker-image "$image" --name "$name"
    done
    kubectl --kubeconfig "$kubeconfig" apply --server-side -k "$root/hack/kind/overlay"
    kubectl --kubeconfig "$kubeconfig" -n tangram-system rollout status deployment/tangram-operator --timeout=300s
    ;;
  e2e)
    [ -f "$kubeconfig" ] || die "no kubeconfig at $kubeconfig: run 'make kind-up' first"
    KUBECONFIG="$kubeconfig" "$PYTHON" -m pytest -q tests/e2e "${@:2}"
    ;;
  *)
    die "usage: hack/kind.sh up|down|deploy|e2e [pytest args]"
    ;;
esac
