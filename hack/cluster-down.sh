#!/usr/bin/env bash
# Stops the local test bed in CLUSTER_DIR (default .cluster): only the processes cluster-up started,
# found by the PIDs it recorded (and checked against their start times), each with its process group;
# then the pods' process groups the node runner recorded; then removes the state directory.
# --keep-logs keeps CLUSTER_DIR/logs (cluster-up uses it when a start fails, so the logs can be read).
set -euo pipefail
# shellcheck source=hack/testbed/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbed/lib.sh"

keep_logs=0
[ "${1:-}" = "--keep-logs" ] && keep_logs=1

# cluster-up holds the lock already when it calls cluster-down (stale state, failed start).
[ -n "${TESTBED_LOCKED:-}" ] || lock_state_dir

if [ ! -e "$TESTBED_MARK" ]; then
  log "nothing to stop in $CLUSTER_DIR"
  exit 0
fi

# stop_group PGID NAME: SIGTERM to the group, up to 15 s to exit, then SIGKILL.
stop_group() {
  local pgid="$1" name="$2" deadline=$((SECONDS + 15))
  kill -TERM -- "-$pgid" 2>/dev/null || true
  while [ -n "$(group_members "$pgid")" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$name (group $pgid) ignored SIGTERM for 15 s: SIGKILL"
      kill -KILL -- "-$pgid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
}

# The real node (opt-in) first, while the API server can still tell its kubelet to stop the pods.
if [ -d "$CLUSTER_DIR/real-node" ]; then
  bash "$testbed_root/hack/testbed/real-node.sh" down || log "real node: teardown reported errors"
fi

# Reverse start order: the node runner first (it stops its pods), the API server before etcd.
if [ -d "$CLUSTER_DIR/pids" ]; then
  while read -r f; do
    name="$(basename "$f")"
    if recorded_alive "$f"; then
      read -r pid _ <"$f"
      stop_group "$pid" "${name#*-}"
      log "stopped ${name#*-} (pid $pid)"
    fi
    rm -f "$f"
  done < <(find "$CLUSTER_DIR/pids" -type f | sort -r)
fi

# Pods the node runner did not get to stop (it was killed, say). Each pod process group leader
# left "PID STARTTIME" in its pod directory.
if [ -d "$CLUSTER_DIR/pods" ]; then
  while read -r f; do
    if recorded_alive "$f"; then
      read -r pid _ <"$f"
      stop_group "$pid" "pod process $(basename "$(dirname "$f")")"
    fi
  done < <(find "$CLUSTER_DIR/pods" -name '*.pid' -type f)
fi

# Pod addresses a runner that died left on lo (only those inside this test bed's pod CIDR).
if [ -f "$CLUSTER_DIR/env" ]; then
  pod_cidr="$(sed -n 's/^POD_CIDR=//p' "$CLUSTER_DIR/env")"
  device="$(sed -n 's/^ADDRESS_DEVICE=//p' "$CLUSTER_DIR/env")"
  if [ -n "$device" ] && [ -n "$pod_cidr" ]; then
    prefix="${pod_cidr%.0/24}."
    for addr in $(ip -o -4 addr show dev "$device" | awk '{print $4}'); do
      case "$addr" in "$prefix"*/32) ip addr del "$addr" dev "$device" && log "removed pod address $addr" ;; esac
    done
  fi
fi

if [ "$keep_logs" = 1 ]; then
  find "$CLUSTER_DIR" -mindepth 1 -maxdepth 1 ! -name logs ! -name .tangram-testbed -exec rm -rf {} +
  log "stopped; logs kept in $CLUSTER_DIR/logs"
else
  rm -rf "$CLUSTER_DIR"
  log "stopped and removed $CLUSTER_DIR"
fi
