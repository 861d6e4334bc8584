# mypy: disable-error-code="arg-type,no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models and know nothing of _preload_content;
# this file passes plain dicts in the API's JSON shape and reads raw responses.
"""The node: registration, heartbeats (a Lease renewed every 10 s, the node status refreshed every
minute, as a kubelet does), and the pod watch that hands each pod bound to these nodes to a worker."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from .api import Json, now_micro, now_rfc3339
from .isolation import SANDBOX_OWN, hidden_in_sandbox
from .network import IpPool
from .resize import CoreMap, fit, pod_requests
from .worker import PodWorker

log = logging.getLogger("node-runner")
LEASE_SECONDS = 40
LEASE_RENEW_S = 10.0
STATUS_REFRESH_S = 60.0


def node_labels(spec: Json) -> dict[str, str]:
    """The labels a kubelet sets on its node, plus the test bed's mark and the node list's own."""
    labels = {
        "kubernetes.io/hostname": spec["name"],
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "tangram.arl.dev/testbed": "true",
    }
    labels.update({k: str(v) for k, v in (spec.get("labels") or {}).items()})
    return labels


def node_status(spec: Json, host_ip: str, kubelet_port: int, runtime: str) -> Json:
    """The status a healthy kubelet posts: capacity (= allocatable), conditions, addresses, node info."""
    now = now_rfc3339()
    capacity = {k: str(v) for k, v in spec["capacity"].items()}
    conds = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ("Ready", "True", "KubeletReady", "kubelet is posting ready status (test bed node runner)"),
    ]
    return {
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, s, r, m in conds
        ],
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": spec["name"]},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "ARL-Tangram test bed",
            "kernelVersion": os.uname().release,
            "kubeletVersion": os.environ.get("TESTBED_KUBE_VERSION", "v1.36.3"),
            "kubeProxyVersion": "",
            "containerRuntimeVersion": "testbed://" + runtime,
            "machineID": hashlib.md5(spec["name"].encode()).hexdigest(),
            "systemUUID": hashlib.md5(("uuid" + spec["name"]).encode()).hexdigest(),
            "bootID": hashlib.md5(f"{spec['name']}{time.time()}".encode()).hexdigest(),
        },
    }


class NodeRunner:
    """Registers and heartbeats the simulated nodes and runs one PodWorker per pod bound to them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.api = config.new_client_from_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.nodes: list[Json] = yaml.safe_load(Path(args.nodes).read_text())["nodes"]
        self.node_names = {n["name"] for n in self.nodes}
        self.state_dir = Path(args.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ip_pool = IpPool(args.pod_cidr, args.address_device or None)
        self.host_ip = "127.0.0.1"
        self.api_host = args.api_host
        self.api_port = args.api_port
        self.bwrap = "" if args.no_bwrap else (shutil.which("bwrap") or "")
        venv = os.path.dirname(sys.executable)
        hidden = hidden_in_sandbox(venv) if self.bwrap else None
        if hidden is not None:
            raise SystemExit(
                f"node runner: the project's virtual environment ({venv}) is under /{hidden}, which every"
                f" sandboxed container gets fresh, so no pod would find `tangram` or `python` there."
                f" Put the checkout elsewhere (not under /{', /'.join(sorted(SANDBOX_OWN))})."
            )
        self.entrypoints: dict[str, Json] = {}
        if args.entrypoints:
            self.entrypoints = yaml.safe_load(Path(args.entrypoints).read_text()) or {}
        # The project's virtual environment first, so that pods find `python`, `tangram` and the
        # project's dependencies as the images would have them.
        self.path_env = os.pathsep.join(
            [
                venv,
                "/usr/local/sbin",
                "/usr/local/bin",
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin",
            ]
        )
        self.stopping = threading.Event()
        self.kubelet_port = int(args.kubelet_port or 0)
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        # The cores the pods' processes are pinned to (resize.py): this runner's own CPU set.
        self.cores = CoreMap(os.sched_getaffinity(0))

    def node_capacity(self, name: str) -> dict[str, str]:
        for n in self.nodes:
            if n["name"] == name:
                return {k: str(v) for k, v in n["capacity"].items()}
        return {}

    def resize_fit(self, worker: PodWorker, containers: list[Json]) -> tuple[str, str] | None:
        """Whether a pod's resized containers fit its node next to the allocations of the other pods
        there: None, or (Deferred | Infeasible, message) as the kubelet's resize admission says."""
        node = worker.node_name
        with self.lock:
            others = [w for w in self.workers.values() if w is not worker and w.node_name == node]
        used: dict[str, float] = {}
        for w in others:
            if w.holds_resources:
                for k, v in w.allocated_requests().items():
                    used[k] = used.get(k, 0.0) + v
        wanted = pod_requests(containers, [c.allocated for c in worker.init_containers])
        return fit(wanted, used, self.node_capacity(node))

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    # -- nodes -------------------------------------------------------------------------------------------

    def _node_status(self, spec: Json) -> Json:
        return node_status(spec, self.host_ip, self.kubelet_port, "bwrap" if self.bwrap else "process")

    def register_nodes(self) -> None:
        for spec in self.nodes:
            name = spec["name"]
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": node_labels(spec)},
                "spec": {"taints": spec.get("taints") or []},
            }
            try:
                self.core.create_node(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.core.patch_node(name, {"metadata": {"labels": node_labels(spec)}})
            self.core.patch_node_status(name, {"status": self._node_status(spec)})
            log.info("node %s registered", name)

    def _lease(self, name: str, node_uid: str) -> None:
        body = {
            "metadata": {
                "name": name,
                "namespace": "kube-node-lease",
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}],
            },
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()},
        }
        try:
            self.coord.patch_namespaced_lease(name, "kube-node-lease", {"spec": body["spec"]})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", body)

    def heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.is_set():
            try:
                refresh = time.monotonic() - last_status >= STATUS_REFRESH_S
                for spec in self.nodes:
                    node = self.core.read_node(spec["name"])
                    self._lease(spec["name"], str(node.metadata.uid if node.metadata else ""))
                    if refresh:
                        self.core.patch_node_status(spec["name"], {"status": self._node_status(spec)})
                if refresh:
                    last_status = time.monotonic()
            except ApiException as exc:
                if exc.status == 404:
                    log.warning("a node was deleted: registering the nodes again")
                    with contextlib.suppress(ApiException):
                        self.register_nodes()
                else:
                    log.warning("heartbeat failed: %s", exc.reason)
            except Exception:
                log.exception("heartbeat failed")
            self.stopping.wait(LEASE_RENEW_S)

    # -- pods --------------------------------------------------------------------------------------------

    def _dispatch(self, kind: str, pod: Json) -> None:
        if (pod.get("spec") or {}).get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.deleted()
                return
            if worker is None:
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod)

    def watch_pods(self) -> None:
        """List, then watch from that version; on expiry, list again (pods that vanished are deleted)."""
        while not self.stopping.is_set():
            try:
                listed = self.core.list_pod_for_all_namespaces(_preload_content=False)
                data = json.loads(listed.data)
                seen = set()
                for pod in data["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self._dispatch("ADDED", pod)
                with self.lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in seen]
                for worker in vanished:
                    worker.deleted()
                rv = data["metadata"]["resourceVersion"]
                stream = watch.Watch()
                for event in stream.stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=rv,
                    timeout_seconds=300,
                    allow_watch_bookmarks=True,
                ):
                    if self.stopping.is_set():
                        stream.stop()
                        break
                    kind = event["type"]
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._dispatch(kind, event["raw_object"])
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch failed: %s", exc.reason)
                    self.stopping.wait(1.0)
            except Exception:
                if self.stopping.is_set():
                    break
                log.exception("pod watch failed")
                self.stopping.wait(1.0)

    def stop_pods(self) -> None:
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.changed.set()
        for w in workers:
            w.join(timeout=10)
