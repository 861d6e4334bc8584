#!/usr/bin/env bash
# Makes the base image the images build on where no registry is reachable, and prints its name:
# `debootstrap --variant=minbase` of a Debian release from Debian's own packages, imported with
# `docker import`, plus the Python layer of python.Dockerfile (shaped like the official
# python:3.11-slim). Cached: the root filesystem as a tarball under
# ${XDG_CACHE_HOME:-~/.cache}/arl-tangram/images/ (so a new engine imports it in seconds), and both
# images in the engine, tagged with a key of everything they are made from.
#
# Environment: DEBIAN_SUITE (default bookworm: its Python is 3.11, the official base's version),
#   DEBIAN_MIRROR (default: the mirror this host's apt uses for that suite, else debootstrap's own),
#   IMAGES_CACHE (the cache directory), DOCKER / DOCKER_BUILDKIT (as for hack/images.sh).
# Needs root and debootstrap (hack/system-deps.sh with IMAGES=1 installs it) on a first run only.
set -euo pipefail
# shellcheck source=hack/images/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

suite="${DEBIAN_SUITE:-bookworm}"

host_mirror() {
  # The URI this host's apt sources give for "$suite" (one-line and deb822 formats), if any.
  python3 - "$suite" <<'PY'
import glob, re, sys
suite = sys.argv[1]
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
            print(words[1]); sys.exit()
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(
            (k.strip().lower(), v.split()) for k, _, v in
            (l.partition(":") for l in stanza.splitlines() if l and not l.startswith("#") and ":" in l)
        )
        if "deb" in fields.get("types", []) and suite in fields.get("suites", []) and fields.get("uris"):
            if fields.get("enabled", ["yes"])[0].lower() != "no":
                print(fields["uris"][0]); sys.exit()
PY
}

mirror="${DEBIAN_MIRROR:-$(host_mirror || true)}"
arch="$(dpkg --print-architecture 2>/dev/null || uname -m)"
# The key covers this script too: a change to how the root is made makes a new one.
key="$( (printf '%s\n' "$suite" minbase "$mirror" "$arch"; cat "${BASH_SOURCE[0]}") | sha256sum | cut -c1-12)"
rootfs_image="arl-tangram-base/debian:$suite-minbase-$key"
python_key="$( (echo "$key"; cat "$images_root/hack/images/python.Dockerfile") | sha256sum | cut -c1-12)"
python_image="arl-tangram-base/python:$suite-$python_key"
DOCKER="$(pick_docker)"

if "$DOCKER" image inspect "$python_image" >/dev/null 2>&1; then
  echo "$python_image"
  exit 0
fi

if ! "$DOCKER" image inspect "$rootfs_image" >/dev/null 2>&1; then
  tarball="$images_cache/debian-$suite-minbase-$key.tar"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null 2>&1 || die "no debootstrap to make the base image: apt-get install debootstrap"
    [ "$(id -u)" -eq 0 ] || die "debootstrap needs root to make the base image"
    mkdir -p "$images_cache"
    work="$(mktemp -d "$images_cache/rootfs.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    say "debootstrap --variant=minbase $suite ${mirror:-(the default mirror of debootstrap)} (first run only; cached in $images_cache)"
    debootstrap --variant=minbase "$suite" "$work/rootfs" ${mirror:+"$mirror"} >"$work/debootstrap.log" 2>&1 \
      || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    # Slim as debian:bookworm-slim (the official Python image's base) is: no documentation, manual
    # pages or translations, now or from packages installed later; no downloaded packages, indexes or
    # apt caches (apt removes them after every run, as there).
    cat >"$work/rootfs/etc/dpkg/dpkg.cfg.d/01-slim-image" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
CFG
    cat >"$work/rootfs/etc/apt/apt.conf.d/docker-clean" <<'CFG'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CFG
    # Files only: the directories stay, as there (openjdk's postinst links into /usr/share/man/man1).
    find "$work/rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
    find "$work/rootfs/usr/share/"{man,groff,info,lintian,locale} ! -type d -delete 2>/dev/null || true
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
    mv "$work/rootfs.tar" "$tarball"
    # Roots made by an earlier version of this script are of no further use.
    find "$images_cache" -maxdepth 1 -name "debian-$suite-minbase-*.tar" ! -name "$(basename "$tarball")" -delete
  fi
  "$DOCKER" import --message "debootstrap --variant=minbase $suite" "$tarball" "$rootfs_image" >/dev/null
  say "imported $rootfs_image from $tarball"
fi

# No build context: the Dockerfile comes on stdin.
"$DOCKER" build --quiet --build-arg "ROOTFS_IMAGE=$rootfs_image" -t "$python_image" - \
  <"$images_root/hack/images/python.Dockerfile" >&2
say "made $python_image"
# The base images an earlier version of this script made (an image still in use stays).
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}' \
  | grep -E "^arl-tangram-base/(debian|python):$suite-" \
  | grep -vxF -e "$rootfs_image" -e "$python_image" \
  | xargs -r "$DOCKER" image rm >/dev/null 2>&1 || true
echo "$python_image"
