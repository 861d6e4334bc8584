#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler from the k8s.io/kubernetes module
# pinned in hack/testbed/kube/go.mod and caches them in a directory keyed by that version, so that
# every later run (any worktree, any CLUSTER_DIR) reuses them in well under a second.
#
# Prints the directory holding the three binaries on stdout; progress goes to stderr.
# `build.sh kubelet` builds (once) the kubelet of the same release into the same directory instead:
# only the real node (real-node.sh, opt-in) needs it.
# Environment: KUBE_BIN_DIR (use prebuilt binaries from there and build nothing),
#              TESTBED_CACHE (cache root; default ${XDG_CACHE_HOME:-$HOME/.cache}/arl-tangram/kube),
#              GO (the go command), TESTBED_BUILD_JOBS (go build -p; default 2: the CI machines are small).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mod="$here/kube"
components=(kube-apiserver kube-controller-manager kube-scheduler)
[ "${1:-}" = kubelet ] && components=(kubelet)

have_all() {
  local dir="$1" c
  for c in "${components[@]}"; do [ -x "$dir/$c" ] || return 1; done
}

if [ -n "${KUBE_BIN_DIR:-}" ]; then
  have_all "$KUBE_BIN_DIR" || { echo "build: KUBE_BIN_DIR=$KUBE_BIN_DIR lacks one of ${components[*]}" >&2; exit 1; }
  echo "$KUBE_BIN_DIR"
  exit 0
fi

version="$(sed -nE 's#^[[:space:]]*(require[[:space:]]+)?k8s\.io/kubernetes[[:space:]]+(v[0-9][^[:space:]]*).*#\2#p' "$mod/go.mod" | head -n1)"
[ -n "$version" ] || { echo "build: $mod/go.mod requires no k8s.io/kubernetes version" >&2; exit 1; }
cache_root="${TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/arl-tangram/kube}"
out="$cache_root/$version"

if have_all "$out"; then
  echo "$out"
  exit 0
fi

GO="${GO:-go}"
command -v "$GO" >/dev/null 2>&1 || {
  echo "build: no Go toolchain ('$GO' not found); the test bed builds the control plane from source and needs Go >= the 'go' line of $mod/go.mod" >&2
  exit 1
}

# The binaries report the release they were built from (kubectl version, /version, user agents).
minor="$(echo "$version" | cut -d. -f2)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done

echo "build: compiling ${components[*]} $version into $out (first time only; minutes on 2 cores)" >&2
mkdir -p "$cache_root"
tmp="$(mktemp -d "$cache_root/.build-$version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
pkgs=()
for c in "${components[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
# -mod=mod lets a checkout whose go.sum predates a Go upgrade still build; the module proxy's
# checksums are verified against the sum database either way.
(cd "$mod" && CGO_ENABLED=0 "$GO" build -mod=mod -trimpath -p "${TESTBED_BUILD_JOBS:-2}" \
  -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}")
# Publish each binary with a rename: a concurrent run (another worktree) sees a whole file or none.
mkdir -p "$out"
for c in "${components[@]}"; do mv -f "$tmp/$c" "$out/$c"; done
echo "build: done in $((SECONDS - start)) s" >&2
echo "$out"
