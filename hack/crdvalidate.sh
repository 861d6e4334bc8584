#!/usr/bin/env bash
# Builds crdvalidate (tests/unit/api/apiserver: the API server's own CRD and object validation code,
# run offline) and prints the path of the binary on stdout; progress and errors go to stderr.
#
# The binary is cached in a directory keyed by its sources and the Go version, so that every later run
# (any worktree, both pytest workers) reuses it at once. The first build fetches the k8s.io modules
# pinned in go.mod/go.sum into the Go module cache (checksums verified against go.sum) and compiles
# them: a minute or two on 2 cores.
# Environment: GO (the go command), CRDVALIDATE_CACHE (cache root; default
#              ${XDG_CACHE_HOME:-$HOME/.cache}/arl-tangram/crdvalidate).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$here/../tests/unit/api/apiserver"
GO="${GO:-go}"
need="$(sed -nE 's/^go[[:space:]]+([0-9.]+).*/\1/p' "$src/go.mod")"

command -v "$GO" >/dev/null 2>&1 || {
  echo "crdvalidate: no Go toolchain ('$GO' not found); the API-server validation tests need Go >= $need" \
    "(the 'go' line of tests/unit/api/apiserver/go.mod), as the local test bed does" >&2
  exit 1
}

key="$( (cat "$src/go.mod" "$src/go.sum" "$src/main.go"; "$GO" version) | sha256sum | cut -c1-16)"
cache_root="${CRDVALIDATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/arl-tangram/crdvalidate}"
out="$cache_root/$key/crdvalidate"
if [ -x "$out" ]; then
  echo "$out"
  exit 0
fi

echo "crdvalidate: building into $out (first time only)" >&2
mkdir -p "$cache_root/$key"
tmp="$(mktemp "$cache_root/$key/.build.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# -mod=readonly: go.mod and go.sum are the pins; nothing is upgraded behind the test's back.
(cd "$src" && CGO_ENABLED=0 GOFLAGS="-buildvcs=false -mod=readonly" "$GO" build -trimpath -o "$tmp" .)
# Publish with a rename: a concurrent build (the other pytest worker) sees a whole file or none.
mv -f "$tmp" "$out"
echo "$out"
