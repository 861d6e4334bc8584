# Shared by hack/cluster-up.sh and hack/cluster-down.sh (sourced, not run).
# The state directory holds everything one test bed owns: certificates, etcd data, component logs,
# the PIDs of the processes it started and the node runner's per-pod directories.

testbed_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER_DIR="${CLUSTER_DIR:-$testbed_root/.cluster}"
mkdir -p "$(dirname "$CLUSTER_DIR")"
CLUSTER_DIR="$(cd "$(dirname "$CLUSTER_DIR")" && pwd)/$(basename "$CLUSTER_DIR")"
# Written first by cluster-up; cluster-down removes a directory only when it carries this mark, so a
# mistyped CLUSTER_DIR can never make it delete somebody else's files.
TESTBED_MARK="$CLUSTER_DIR/.tangram-testbed"

log() { echo "testbed: $*" >&2; }

# The start time of a process in clock ticks since boot (field 22 of /proc/PID/stat), recorded next
# to its PID so that a PID reused by an unrelated process is never signalled.
proc_start_time() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  # The command name (field 2) may hold spaces; everything after its closing parenthesis is fixed.
  stat="${stat##*) }"
  echo "$stat" | awk '{print $20}'
}

# Records a process this test bed started: pids/<name> holds "PID STARTTIME".
record_pid() {
  local name="$1" pid="$2" st
  st="$(proc_start_time "$pid")" || st=0
  mkdir -p "$CLUSTER_DIR/pids"
  echo "$pid $st" >"$CLUSTER_DIR/pids/$name"
}

# True when the recorded process is still the one we started (same PID, same start time, not a zombie).
recorded_alive() {
  local file="$1" pid st now state
  read -r pid st <"$file" || return 1
  [ -n "$pid" ] || return 1
  now="$(proc_start_time "$pid")" || return 1
  [ "$now" = "$st" ] || return 1
  state="$(ps -o stat= -p "$pid" 2>/dev/null || true)"
  [ -n "$state" ] && [ "${state:0:1}" != Z ]
}

# Live (non-zombie) members of process group $1.
group_members() {
  ps -eo pgid=,pid=,stat= | awk -v g="$1" '$1 == g && $3 !~ /^Z/ {print $2}'
}

# One cluster-up or cluster-down at a time per state directory (two test sessions starting the same
# test bed would otherwise both build it). The lock file is outside the directory, which comes and goes.
lock_state_dir() {
  exec 9>"${TMPDIR:-/tmp}/tangram-testbed-$(echo "$CLUSTER_DIR" | md5sum | cut -c1-16).lock"
  if ! flock -n 9; then
    log "waiting for another cluster-up/cluster-down on $CLUSTER_DIR"
    flock 9
  fi
}

# pick_ports N [ADDR]: N distinct ports, free now on every address (and ADDR when given), from below the
# kernel's ephemeral range. A port the kernel picks (bind to port 0) is free only until it is closed:
# any outgoing connection may take it before the component binds it. The kernel never hands out a
# port below that range, so one picked there stays free unless another test bed picks it too, which
# the check at pick time makes unlikely. Where the range starts too low to leave room, the kernel picks.
pick_ports() {
  "$PYTHON" - "$@" <<'EOF'
import random, socket, sys
# "" (every address) first: that bind fails while anything listens on the port, on any address.
want, addrs = int(sys.argv[1]), ["", *sys.argv[2:]]
low, _ = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
picked = []
for _ in range(200 * want):
    if len(picked) == want:
        break
    # Above the well-known and the usual service ports, below the ephemeral range.
    port = random.randint(20000, low - 1) if low > 20100 else 0
    try:
        for addr in addrs:
            with socket.socket() as s:
                s.bind((addr, port))
                port = s.getsockname()[1]
    except OSError:
        continue
    if port not in picked:
        picked.append(port)
if len(picked) < want:
    sys.exit(f"no {want} free ports below the ephemeral range (it starts at {low})")
print(" ".join(map(str, picked)))
EOF
}
