#!/usr/bin/env bash
# Makes sure a Docker engine answers, starting Debian's dockerd by hand where none runs (no systemd
# here, nor on CI). Idempotent: with an engine up it only checks it, so `.ci/run`, `make images` and
# the e2e fixtures may all call it. Needs root to start one; without it, says what to do.
#
#   hack/images/engine.sh          start (or find) the engine; exit 0 once `docker info` answers
#   hack/images/engine.sh stop     stop an engine this script started (the PID it recorded)
#
# Environment: DOCKER_ENGINE_LOG (default /var/log/arl-tangram-dockerd.log),
#              DOCKER_ENGINE_TIMEOUT (seconds to wait for `docker info`, default 60).
set -euo pipefail

log_file="${DOCKER_ENGINE_LOG:-/var/log/arl-tangram-dockerd.log}"
pid_file="/run/arl-tangram-dockerd.pid"
timeout_s="${DOCKER_ENGINE_TIMEOUT:-60}"

say() { echo "engine: $*" >&2; }

docker_cli() {
  # The docker CLI that talks to the engine: any on PATH works for `docker info`.
  command -v docker >/dev/null 2>&1 || { say "no docker CLI (apt-get install docker.io)"; exit 1; }
  docker "$@"
}

answers() { docker_cli info >/dev/null 2>&1; }

recorded_pid() {
  # The PID this script recorded, if that process still is a dockerd.
  local pid
  [ -f "$pid_file" ] || return 1
  read -r pid <"$pid_file" || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] && echo "$pid"
}

start() {
  # Checked here, not only in docker_cli: answers() silences docker_cli, message included.
  command -v docker >/dev/null 2>&1 || { say "no docker CLI (apt-get install docker.io)"; exit 1; }
  if answers; then return 0; fi
  if [ -n "$(recorded_pid || true)" ]; then
    say "dockerd (pid $(recorded_pid)) is starting; waiting"
  else
    command -v dockerd >/dev/null 2>&1 || { say "no dockerd: apt-get install docker.io (hack/system-deps.sh with IMAGES=1)"; exit 1; }
    [ "$(id -u)" -eq 0 ] || { say "no Docker engine answers and starting dockerd needs root"; exit 1; }
    mkdir -p "$(dirname "$log_file")"
    # Its own session, stdin closed and no inherited descriptors beyond the log: it must outlive the
    # caller (a make recipe, a pytest fixture) without holding the caller's pipes open.
    setsid dockerd >>"$log_file" 2>&1 </dev/null &
    echo "$!" >"$pid_file"
    say "started dockerd (pid $!, log $log_file)"
  fi
  local deadline=$((SECONDS + timeout_s))
  until answers; do
    if [ -z "$(recorded_pid || true)" ]; then
      say "dockerd exited; the end of its log:"
      tail -n 20 "$log_file" >&2 || true
      exit 1
    fi
    [ "$SECONDS" -lt "$deadline" ] || { say "dockerd did not answer in ${timeout_s} s (log $log_file)"; exit 1; }
    sleep 0.3
  done
}

stop() {
  local pid deadline=$((SECONDS + 30))
  pid="$(recorded_pid || true)"
  [ -n "$pid" ] || { rm -f "$pid_file"; return 0; }
  kill -TERM "$pid"
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  rm -f "$pid_file"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: engine.sh [start|stop]" >&2; exit 2 ;;
esac
