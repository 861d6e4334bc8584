#!/usr/bin/env bash
# Installs the Debian packages the project uses, only when one is missing, so that a second run is
# instant. Needs root (as on CI); without it, prints what to install and carries on.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# The sandbox zygote's fork loop is C (operator/arl_tangram/sandbox/_zygote.c), built at install.
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
# The sandbox's C++ actions (sandbox/languages.py; java, go, rust and node are found where installed).
command -v g++ >/dev/null 2>&1 || need+=(g++)
# The sandbox's PHP, Ruby, Lua and R actions (SandboxFusion's php, ruby, lua and R: MultiPL-E's
# languages; its Lua is 5.2, with luaunit, which every MultiPL-E Lua test requires).
command -v php >/dev/null 2>&1 || need+=(php-cli)
command -v ruby >/dev/null 2>&1 || need+=(ruby)
command -v lua >/dev/null 2>&1 || need+=(lua5.2)
[ -e /usr/share/lua/5.2/luaunit.lua ] || need+=(lua-unit)
command -v Rscript >/dev/null 2>&1 || need+=(r-base-core)
# D (SandboxFusion's D_ut: MultiPL-E's D tests are unittest blocks), by LDC's dmd-compatible driver.
command -v ldmd2 >/dev/null 2>&1 || need+=(ldc)
# Verilog (SandboxFusion's verilog, after VerilogEval): Icarus Verilog.
command -v iverilog >/dev/null 2>&1 || need+=(iverilog)
# Scala where Java is (SandboxFusion's image has Ubuntu's Scala 2.11.12, Debian's too).
if command -v javac >/dev/null 2>&1; then command -v scalac >/dev/null 2>&1 || need+=(scala); fi
# JUnit 5's console launcher where Java is (SandboxFusion's junit runs it).
if command -v javac >/dev/null 2>&1; then
  [ -e /usr/share/java/junit-platform-console-standalone.jar ] || need+=(junit5)
fi
# Where g++ is (or is about to be), OpenSSL's headers and libraries: C++ links -lcrypto -lssl where
# they link, as SandboxFusion's does (HumanEval-X's string_to_md5 calls MD5).
if command -v g++ >/dev/null 2>&1 || [[ " ${need[*]} " == *" g++ "* ]]; then
  [ -e /usr/include/openssl/md5.h ] || need+=(libssl-dev)
fi
# Where javac is, javatuples (SandboxFusion puts javatuples-1.2.jar on Java's class path; every
# MultiPL-E HumanEval-Java prompt imports org.javatuples).
if command -v javac >/dev/null 2>&1 && ! compgen -G '/usr/share/java/javatuples*.jar' >/dev/null; then
  need+=(libjavatuples-java)
fi
# Where perl is, the modules SandboxFusion's image adds (every MultiPL-E Perl test starts with
# `use Test::Deep;`).
if command -v perl >/dev/null 2>&1; then
  perl -MTest::Deep -e1 >/dev/null 2>&1 || need+=(libtest-deep-perl)
  perl -MData::Compare -e1 >/dev/null 2>&1 || need+=(libdata-compare-perl)
fi
# TypeScript actions are transpiled by esbuild (as SandboxFusion's tsx does), from npm where npm is.
if command -v npm >/dev/null 2>&1 && ! command -v esbuild >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "system-deps: installing esbuild (npm)"
    npm install -g --silent esbuild@0.28 >/dev/null || echo "system-deps: esbuild failed to install: no typescript" >&2
  else
    echo "system-deps: missing esbuild; install it as root (npm install -g esbuild@0.28)" >&2
  fi
fi
# The local test bed (hack/cluster-up.sh): certificates, readiness checks, process bookkeeping.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# The images (IMAGES=1: `make images`, hack/images.sh): Debian's Docker engine where none answers,
# and debootstrap for the base made where no registry is reachable (hack/images/base.sh).
if [ "${IMAGES:-0}" = 1 ]; then
  { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; } || command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
fi
# The real node (TESTBED_REAL_NODE=1, hack/testbed/real-node.sh; CI sets it): containerd, runc, CNI plugins.
if [ "${TESTBED_REAL_NODE:-0}" = 1 ]; then
  command -v containerd >/dev/null 2>&1 || need+=(containerd)
  command -v runc >/dev/null 2>&1 || need+=(runc)
  [ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
fi
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: missing ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
  exit 0
fi
echo "system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
