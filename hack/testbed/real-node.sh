#!/usr/bin/env bash
# One real node for the test bed: a kubelet (built from the same release as the control plane) with
# containerd, runc and a CNI bridge, running real OCI images. `TESTBED_REAL_NODE=1 make
# cluster-up` (opt-in; CI does not set it yet) calls `real-node.sh up`; cluster-down calls `real-node.sh down` first.
#
# The node is tb-real-0, labelled tangram.arl.dev/real-node=true and tainted with it (NoSchedule), so
# only pods that ask for it land there. There is no registry: its images are
# imported from OCI archives made by mkimage.py (the pause image, and tangram.test/tb-echo:0.1,
# an HTTP server on :8080 for tests) and from the Docker engine that `make images` built the
# project's images with; use imagePullPolicy: Never or IfNotPresent.
# Needs root and Debian's containerd, runc and containernetworking-plugins (hack/system-deps.sh with
# TESTBED_REAL_NODE=1). What this machine needed: cgroup v1 (failCgroupV1: false), no
# CAP_SYS_RESOURCE (containerd's restrict_oom_score_adj; the kubelet logs that it cannot lower its
# own OOM score or raise its file limit, and carries on).
set -euo pipefail
# shellcheck source=hack/testbed/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

node=tb-real-0
# A unix socket path holds at most 107 bytes and containerd and the kubelet make sockets deep inside
# their directories: a long state directory (CI checkouts, pytest's tmp_path) keeps the node's files
# in a short one, linked from it.
link="$CLUSTER_DIR/real-node"
D="$link"
if [ ${#D} -gt 40 ]; then D="${TMPDIR:-/tmp}/tangram-testbed-$(echo "$CLUSTER_DIR" | md5sum | cut -c1-12)"; fi
pki="$CLUSTER_DIR/pki"
sock="$D/containerd/containerd.sock"
export PATH="$testbed_root/.venv/bin:$PATH"
PYTHON="${PYTHON:-$testbed_root/.venv/bin/python}"
k() { kubectl --kubeconfig "$CLUSTER_DIR/kubeconfig" "$@"; }
ctr_() { ctr -a "$sock" -n k8s.io "$@"; }
bridge="tb$(echo "$CLUSTER_DIR" | md5sum | cut -c1-8)"
timeout_s="${TESTBED_START_TIMEOUT:-180}"

# fail COMPONENT MESSAGE: says what did not come up, with the end of its log, and exits.
fail() {
  log "real node: $2; last lines of $CLUSTER_DIR/logs/$1.log:"
  tail -n 25 "$CLUSTER_DIR/logs/$1.log" >&2 2>/dev/null || true
  exit 1
}

# start_kubelet BIN NODE_IP: starts the kubelet on a fresh port; fails when it exits within its
# first seconds (when it binds its port and meets the CRI), so that the caller may start it again.
start_kubelet() {
  local bin="$1" node_ip="$2" port
  port="$(pick_ports 1 "$node_ip")"
  cat >"$D/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}, x509: {clientCAFile: "$pki/ca.crt"}}
authorization: {mode: AlwaysAllow}
address: $node_ip
port: $port
readOnlyPort: 0
healthzPort: 0
tlsCertFile: $D/node.crt
tlsPrivateKeyFile: $D/node.key
# cgroups v1 here; no QoS cgroup tree and no node-allocatable enforcement on a shared host.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
localStorageCapacityIsolation: false
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://$sock
# No evictions and no image garbage collection: the host's disk is shared with everything else.
evictionHard: {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%", "nodefs.inodesFree": "0%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: /etc/resolv.conf
EOF
  setsid "$bin/kubelet" --config "$D/kubelet.yaml" --kubeconfig "$D/kubelet.kubeconfig" --root-dir "$D/kubelet" \
    --hostname-override "$node" --node-ip "$node_ip" \
    --node-labels "tangram.arl.dev/testbed=true,tangram.arl.dev/real-node=true,topology.kubernetes.io/region=testbed,topology.kubernetes.io/zone=testbed-real" \
    --register-with-taints "tangram.arl.dev/real-node=true:NoSchedule" \
    >"$CLUSTER_DIR/logs/kubelet.log" 2>&1 </dev/null 9>&- &
  record_pid 7-kubelet "$!"
  # The kubelet's port answers (TLS) once it has bound it, after its CRI checks: running then, or gone.
  for _ in $(seq 1 100); do
    recorded_alive "$CLUSTER_DIR/pids/7-kubelet" || return 1
    curl -sk -o /dev/null --max-time 2 "https://$node_ip:$port/healthz" && return 0
    sleep 0.3
  done
  recorded_alive "$CLUSTER_DIR/pids/7-kubelet"
}

# The reason of a kubelet exit that a restart cures, from its log (its port taken; the CRI not
# answering yet: "failed to run Kubelet: validate service connection: ..."); fails for any other.
transient_kubelet_exit() {
  grep -m1 -oE 'bind: address already in use|validate service connection: .*' "$CLUSTER_DIR/logs/kubelet.log" 2>/dev/null
}

# What a test bed that was not taken down left of the node here: its bridge (named after the state
# directory) and a short directory outside the state directory with no containerd of ours running.
clean_leftovers() {
  ip link del "$bridge" 2>/dev/null && log "real node: removed the bridge $bridge a previous test bed left"
  if [ "$D" != "$link" ] && [ -d "$D" ] && ! recorded_alive "$CLUSTER_DIR/pids/6-containerd" 2>/dev/null; then
    findmnt -rn -o TARGET | grep "^$D/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf "$D"
    log "real node: removed $D, which a previous test bed left"
  fi
  return 0
}

up() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  [ ${#missing[@]} -eq 0 ] || { log "the real node needs: apt-get install ${missing[*]}"; exit 1; }
  local bin
  bin="$(bash "$testbed_root/hack/testbed/build.sh" kubelet)"
  clean_leftovers
  mkdir -p "$D"/{containerd,cni,kubelet,images,logs}
  [ "$D" = "$link" ] || ln -sfn "$D" "$link"

  # Images: the sandbox's pause process and a test server, from Go sources, as OCI archives.
  local img
  for img in pause echo; do
    (cd "$testbed_root/hack/testbed/images" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$D/images/$img" "./$img")
  done
  "$PYTHON" "$testbed_root/hack/testbed/mkimage.py" "$D/images/pause" /pause tangram.test/pause:3.10 "$D/images/pause.tar"
  "$PYTHON" "$testbed_root/hack/testbed/mkimage.py" "$D/images/echo" /echo tangram.test/tb-echo:0.1 "$D/images/echo.tar"

  # A /24 of 10.88.0.0/16 that no interface and no route of this host uses yet (another test bed's
  # bridge, a leftover), so that two bridges never claim the same addresses.
  local subnet="" used x
  used="$(ip -o -4 addr show; ip -4 route show table all 2>/dev/null)"
  for _ in $(seq 1 100); do
    x=$((RANDOM % 250))
    grep -qE "(^|[^0-9])10\.88\.$x\.[0-9]" <<<"$used" || { subnet="10.88.$x.0/24"; break; }
  done
  [ -n "$subnet" ] || { log "real node: no free /24 in 10.88.0.0/16 for the CNI bridge (ip -4 route)"; exit 1; }
  cat >"$D/cni/10-testbed.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "testbed", "plugins": [
  {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "dataDir": "$D/cni-ipam", "ranges": [[{"subnet": "$subnet"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  cat >"$D/containerd/config.toml" <<EOF
version = 2
root = "$D/containerd/root"
state = "$D/containerd/state"
[grpc]
  address = "$sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "tangram.test/pause:3.10"
  # Root here lacks CAP_SYS_RESOURCE: never ask runc for an OOM score below containerd's own.
  restrict_oom_score_adj = true
  # Network namespaces under the state directory, so that down finds and unmounts them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$D/cni"
EOF
  setsid containerd --config "$D/containerd/config.toml" >"$CLUSTER_DIR/logs/containerd.log" 2>&1 </dev/null 9>&- &
  record_pid 6-containerd "$!"
  # Ready when its API answers and its CRI plugin (what the kubelet talks to) loaded: a CRI plugin
  # that failed to load leaves containerd up and the kubelet unable to start.
  local deadline=$((SECONDS + timeout_s))
  until ctr_ plugins ls 2>/dev/null | awk '$1 == "io.containerd.grpc.v1" && $2 == "cri" && $NF == "ok" {f = 1} END {exit !f}'; do
    recorded_alive "$CLUSTER_DIR/pids/6-containerd" || fail containerd "containerd exited before its CRI plugin was up"
    [ "$SECONDS" -lt "$deadline" ] || fail containerd "containerd: no CRI plugin loaded (ctr plugins ls) after ${timeout_s} s"
    sleep 0.3
  done
  ctr_ images import "$D/images/pause.tar" >/dev/null
  ctr_ images import "$D/images/echo.tar" >/dev/null
  import_project_images

  # The node's identity: a client (and serving) certificate from the test bed's CA, bound to the
  # system:node role (the API server runs RBAC only, without the Node authorizer).
  openssl ecparam -name prime256v1 -genkey -noout -out "$D/node.key" 2>/dev/null
  openssl req -new -key "$D/node.key" -subj "/O=system:nodes/CN=system:node:$node" -out "$D/node.csr" 2>/dev/null
  local node_ip
  node_ip="$(ip -o -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')"
  node_ip="${node_ip:-127.0.0.1}"
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth,serverAuth\nsubjectAltName=IP:%s,DNS:%s\n' \
    "$node_ip" "$node" >"$D/node.ext"
  openssl x509 -req -in "$D/node.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -days 3650 -sha256 -extfile "$D/node.ext" -out "$D/node.crt" 2>/dev/null
  local server
  server="$(sed -n 's/^ *server: //p' "$CLUSTER_DIR/kubeconfig")"
  cat >"$D/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: testbed, cluster: {server: "$server", certificate-authority: "$pki/ca.crt"}}]
users: [{name: $node, user: {client-certificate: "$D/node.crt", client-key: "$D/node.key"}}]
contexts: [{name: testbed, context: {cluster: testbed, user: $node}}]
current-context: testbed
EOF
  k create clusterrolebinding testbed-nodes --clusterrole=system:node --group=system:nodes \
    --dry-run=client -o yaml | k apply -f - >/dev/null
  # The kubelet binds its port after this script picks it. A port of the kernel's ephemeral range
  # (the one bind(0) and every outgoing connection draw from) could be taken in between, so the port
  # comes from below that range, where the kernel never hands one out by itself; and should it be
  # taken all the same (another program binding that very port), the kubelet is started again on
  # another one. So are the other early exits a restart cures (the CRI not initialized yet).
  local attempt
  for attempt in 1 2 3; do
    start_kubelet "$bin" "$node_ip" && break
    [ "$attempt" -lt 3 ] && transient_kubelet_exit >/dev/null ||
      fail kubelet "the kubelet exited before node $node was Ready (attempt $attempt)"
    mv "$CLUSTER_DIR/logs/kubelet.log" "$CLUSTER_DIR/logs/kubelet-attempt$attempt.log"
    log "real node: the kubelet exited at start ($(transient_kubelet_exit)); starting it again (its log: logs/kubelet-attempt$attempt.log)"
  done
  local deadline=$((SECONDS + timeout_s))
  until k wait --for=condition=Ready "node/$node" --timeout=5s >/dev/null 2>&1; do
    recorded_alive "$CLUSTER_DIR/pids/7-kubelet" || fail kubelet "the kubelet exited before node $node was Ready"
    [ "$SECONDS" -lt "$deadline" ] ||
      fail kubelet "node $node not Ready after ${timeout_s} s: $(k get node "$node" -o jsonpath='{range .status.conditions[?(@.type=="Ready")]}{.reason}: {.message}{end}' 2>&1)"
    sleep 0.5
  done
  log "real node $node Ready (kubelet $(basename "$bin"), containerd $(containerd --version | awk '{print $3}'))"
}

# The project's images (`make images`), from the Docker engine that built them, so that sandbox host
# pods and the operator run from them here (imagePullPolicy Never or IfNotPresent). Which ones:
# TESTBED_NODE_IMAGES (default the sandbox's and the operator's, at the package version). One not
# built, or no engine, is named and left out: the tests that need it say so.
import_project_images() {
  local version images img t0
  version="$(sed -nE 's/^version = "([^"]+)"/\1/p' "$testbed_root/pyproject.toml" | head -n1)"
  images="${TESTBED_NODE_IMAGES:-arl-tangram-sandbox:$version arl-tangram-operator:$version}"
  if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    log "real node: no Docker engine answers: $images not imported (make images builds them)"
    return 0
  fi
  for img in $images; do
    if ! docker image inspect "$img" >/dev/null 2>&1; then
      log "real node: $img is not built (make images): not imported"
      continue
    fi
    t0=$SECONDS
    # `docker save` names it arl-tangram-sandbox:0.1.0; containerd stores it as docker.io/library/...,
    # which is the name the kubelet resolves a pod's short image name to.
    docker save "$img" | ctr_ images import - >/dev/null
    log "real node: imported $img ($((SECONDS - t0)) s)"
  done
}

stop_recorded() { # NAME
  local f="$CLUSTER_DIR/pids/$1" pid deadline=$((SECONDS + 15))
  [ -f "$f" ] || return 0
  if recorded_alive "$f"; then
    read -r pid _ <"$f"
    kill -TERM -- "-$pid" 2>/dev/null || true
    while [ -n "$(group_members "$pid")" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

down() {
  [ -d "$D" ] || return 0
  # The kubelet stops the node's pods when their objects go; then the kubelet itself.
  if recorded_alive "$CLUSTER_DIR/pids/7-kubelet" 2>/dev/null; then
    k delete pods -A --field-selector "spec.nodeName=$node" --wait=true --timeout=60s >/dev/null 2>&1 || true
  fi
  stop_recorded 7-kubelet
  # Whatever still runs in containerd (pause sandboxes, pods the API server had lost), then containerd.
  if recorded_alive "$CLUSTER_DIR/pids/6-containerd" 2>/dev/null; then
    local id
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$id" >/dev/null 2>&1 || true; done
  fi
  stop_recorded 6-containerd
  # The shims (one per pod sandbox) outlive containerd by design; each left its PID in its bundle.
  local f pid
  for f in "$D"/containerd/state/io.containerd.runtime.v2.task/k8s.io/*/shim.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    # Only if it still is a shim of this containerd (the PID may have been reused).
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$sock"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  findmnt -rn -o TARGET | grep "^$D/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ip link del "$bridge" 2>/dev/null || true
  # cluster-down removes the state directory; a short directory outside it goes here.
  [ "$D" = "$link" ] || rm -rf "$D" "$link"
  log "real node $node stopped"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  # After `make images` on a running test bed: the new images, without restarting the node.
  import-images) import_project_images ;;
  *) echo "usage: real-node.sh up|down|import-images" >&2; exit 2 ;;
esac
