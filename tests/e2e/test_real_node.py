# mypy: disable-error-code="arg-type,attr-defined"
# The kubernetes client's stubs type request bodies as models (these tests pass plain dicts) and know
# nothing of _preload_content=False (the raw response, read as JSON).
"""The test bed's real node (TESTBED_REAL_NODE=1, which CI sets): a kubelet with containerd and runc
next to the simulated nodes, running real OCI images, the project's own among them.

`make images` builds the images with Docker; real-node.sh imports the sandbox's and the operator's
into the node's containerd (no registry: `imagePullPolicy: Never`). Here the operator runs from its
image on that node, as manifests/deployment.yaml installs it, and an ActionPool whose host pods run the
sandbox image there serves a batch of real programs.

Without a real node or without the images (a local run that did not ask for them, another cluster)
these tests skip; TANGRAM_E2E_REAL_NODE=required makes each such skip a failure that
names what is missing.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import batch_manifest, install, pool_manifest
from testbed import REPO, Cluster, condition, pod_ready, wait_for, wait_for_gone, wait_for_pod

REAL_NODE = "tangram.arl.dev/real-node"
GROUP, VERSION = "tangram.arl.dev", "v1alpha1"
ON_REAL_NODE = {
    "nodeSelector": {REAL_NODE: "true"},
    "tolerations": [{"key": REAL_NODE, "operator": "Exists", "effect": "NoSchedule"}],
}
PACKAGE_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SANDBOX_IMAGE = f"arl-tangram-sandbox:{PACKAGE_VERSION}"
OPERATOR_IMAGE = f"arl-tangram-operator:{PACKAGE_VERSION}"
LANGUAGES = {"c", "cpp", "go", "java", "nodejs", "perl", "rust", "typescript"}


def _missing(reason: str) -> None:
    if os.environ.get("TANGRAM_E2E_REAL_NODE") == "required":
        pytest.fail(f"{reason} (TANGRAM_E2E_REAL_NODE=required)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def real_node(cluster: Cluster) -> dict[str, Any]:
    """The real node, Ready."""
    nodes = json.loads(
        cluster.core.list_node(label_selector=f"{REAL_NODE}=true", _preload_content=False).data
    )["items"]
    if not nodes:
        _missing("no real node in this cluster (TESTBED_REAL_NODE=1 adds one to the local test bed)")
    node: dict[str, Any] = nodes[0]
    assert condition(node, "Ready") == "True", node.get("status", {}).get("conditions")
    return node


def _require_image(node: dict[str, Any], image: str) -> None:
    """The kubelet lists the images its runtime holds in the node's status."""
    names = {n for i in node.get("status", {}).get("images") or [] for n in i.get("names", [])}
    if f"docker.io/library/{image}" not in names:
        _missing(
            f"{image} is not on the real node (make images builds it; cluster-up imports it, or "
            "hack/testbed/real-node.sh import-images on a running test bed)"
        )


def test_a_real_kubelet_runs_an_image_and_its_pod_answers_at_its_ip(
    cluster: Cluster, namespace: str, real_node: dict[str, Any]
) -> None:
    pod = {
        "metadata": {"name": "real-echo"},
        "spec": {
            **ON_REAL_NODE,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "echo",
                    "image": "tangram.test/tb-echo:0.1",
                    "imagePullPolicy": "Never",  # imported into containerd, never pulled
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                }
            ],
        },
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    ready = wait_for_pod(cluster, namespace, "real-echo", pod_ready, "Ready", timeout=120)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{ready['status']['podIP']}:8080/", timeout=5) as resp:
        assert resp.read().decode() == "hello from real-echo\n"
    assert ready["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    # kubectl logs goes API server -> kubelet (TLS both ways, certificates from the test bed's CA).
    assert "listening on :8080" in cluster.kubectl("logs", "real-echo", "-n", namespace).stdout
    cluster.core.delete_namespaced_pod("real-echo", namespace)
    wait_for_gone(
        cluster.core.list_namespaced_pod, "real-echo", namespace=namespace, description="pod real-echo"
    )


# ---- the operator from its image, sandbox hosts from theirs ----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def _operator_deployment(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """manifests/deployment.yaml in ``namespace``, on the real node, one replica.

    The test bed's API server listens on loopback only (no kube-proxy routes the `kubernetes`
    Service), so the operator pod shares the node's network (hostNetwork) and is told the API
    server's address; that is also why it runs here and not in tangram-system, whose restricted Pod
    Security level forbids hostNetwork. Everything else (image, user, read-only root, probes,
    capabilities) is the manifest's own.
    """
    deployment: dict[str, Any] = yaml.safe_load((REPO / "manifests" / "deployment.yaml").read_text())
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig_env).read_text())
    server = kubeconfig["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    deployment["metadata"]["namespace"] = namespace
    deployment["spec"]["replicas"] = 1
    pod = deployment["spec"]["template"]["spec"]
    pod.update(copy.deepcopy(ON_REAL_NODE))
    pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet", terminationGracePeriodSeconds=5)
    (container,) = pod["containers"]
    assert container["image"] == OPERATOR_IMAGE, "the manifest's operator image is the one make images builds"
    container["imagePullPolicy"] = "Never"
    gateway = _free_port()  # the node's network is the host's: a port nobody else holds
    container["ports"] = [{"name": "gateway", "containerPort": gateway, "protocol": "TCP"}]
    container["env"] += [
        {"name": "KUBERNETES_SERVICE_HOST", "value": host},
        {"name": "KUBERNETES_SERVICE_PORT", "value": port},
        {"name": "TANGRAM_LISTEN_PORT", "value": str(gateway)},
        # The test bed has no GPUs for reward runtimes: they would score on the CPU.
        {"name": "TANGRAM_REWARD_DEVICE", "value": "cpu"},
    ]
    # The node has 2 cores: leave one for the sandbox host.
    container["resources"]["requests"]["cpu"] = "250m"
    return deployment


@pytest.fixture
def operator_from_image(
    cluster: Cluster, namespace: str, real_node: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The operator running from its image on the real node, leading; its pod."""
    _require_image(real_node, OPERATOR_IMAGE)
    install(cluster)  # the operator's ClusterRole (and tangram-system's RBAC) from manifests/rbac.yaml
    binding = f"tangram-operator-{namespace}"
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "tangram-operator"}})
    cluster.kubectl(
        "create", "clusterrolebinding", binding, "--clusterrole=tangram-operator",
        f"--serviceaccount={namespace}:tangram-operator",
    )  # fmt: skip
    # The leader-election Role of manifests/rbac.yaml, in this namespace (the operator's Lease is in
    # its own namespace, POD_NAMESPACE).
    for doc in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()):
        if doc and doc["kind"] in ("Role", "RoleBinding"):
            doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects", []):
                subject["namespace"] = namespace
            cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(_operator_deployment(cluster, namespace)))
    selector = "app.kubernetes.io/name=arl-tangram-operator"
    try:
        try:
            pod = wait_for(
                cluster.core.list_namespaced_pod,
                pod_ready,  # its readiness probe is /readyz, which answers 200 only when it leads
                namespace=namespace,
                label_selector=selector,
                description="the operator pod Ready (leading)",
                timeout=240,
            )
        except AssertionError as exc:
            # Its own words (kubectl logs: API server -> the real kubelet), the last run's if it restarted.
            logs = [
                cluster.kubectl("logs", "-n", namespace, "-l", selector, f, "--tail=40", check=False).stdout
                for f in ("--previous", "--timestamps")
            ]
            raise AssertionError(f"{exc}\noperator logs:\n" + "\n".join(logs)) from exc
        yield pod
    finally:
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found")


def _agent_health(ip: str) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{ip}:8080/v1/health", timeout=10) as resp:
        health: dict[str, Any] = json.loads(resp.read())
        return health


CPP = """#include <iostream>
int main() { long s = 0; for (int i = 1; i <= 100; ++i) s += i; std::cout << s << "\\n"; }
"""
# From inside an action: who it runs as, whether the network is there, and the scientific set.
PROBE = """
import os, socket
import numpy, pandas, scipy, sklearn, sympy, networkx
try:
    socket.create_connection(("10.96.0.1", 443), timeout=2)
    net = "reachable"
except OSError:
    net = "unreachable"
print(os.getuid() != 0, net, int(numpy.arange(10).sum()), sympy.factorint(360))
"""


def test_the_operator_from_its_image_serves_a_batch_on_hosts_of_the_sandbox_image(
    cluster: Cluster, namespace: str, real_node: dict[str, Any], operator_from_image: dict[str, Any]
) -> None:
    _require_image(real_node, SANDBOX_IMAGE)
    node = real_node["metadata"]["name"]
    op_status = operator_from_image["status"]["containerStatuses"][0]
    assert operator_from_image["spec"]["nodeName"] == node
    assert op_status["containerID"].startswith("containerd://")
    assert op_status["image"].endswith(OPERATOR_IMAGE)

    pool = pool_manifest(
        "py",
        template={
            "image": SANDBOX_IMAGE,
            "imagePullPolicy": "Never",
            "resources": {"cpu": "1", "memory": "2Gi"},
            "podSpec": copy.deepcopy(ON_REAL_NODE),
        },
        languages=["python", "bash", "cpp"],
        limits={"timeoutSeconds": 120, "memory": "1Gi", "maxCores": 1},
        scaling={"minHosts": 1, "maxHosts": 1, "maxStarting": 1, "idleTimeoutSeconds": 600},
    )
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "actionpools", pool)
    actions = [
        {"id": "sum", "type": "code", "target": "py",
         "payload": {"language": "python", "code": "print(sum(range(10**6)))"}},
        {"id": "fails", "type": "code", "target": "py",
         "payload": {"language": "python", "code": "import sys; print('no'); sys.exit(3)"}},
        {"id": "probe", "type": "code", "target": "py", "payload": {"language": "python", "code": PROBE}},
        {"id": "cpp", "type": "code", "target": "py", "payload": {"language": "cpp", "code": CPP}},
        {"id": "bash", "type": "code", "target": "py",
         "payload": {"language": "bash", "code": "echo $((6 * 7))"}},
    ]  # fmt: skip
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "actionbatches", batch_manifest("step", actions)
    )
    batch = wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: condition(o, "Complete") == "True",
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        plural="actionbatches",
        field_selector="metadata.name=step",
        description="ActionBatch step Complete",
        timeout=420,  # a first host pod on the real node unpacks the sandbox image's layers
    )
    results = {r["id"]: r for r in batch["status"]["results"]}
    assert results["sum"]["state"] == "Succeeded" and results["sum"]["output"].strip() == "499999500000"
    assert results["fails"]["state"] == "Failed" and results["fails"]["exitCode"] == 3
    assert results["probe"]["state"] == "Succeeded", results["probe"]
    assert results["probe"]["output"].split()[:3] == ["True", "unreachable", "45"], results["probe"]
    assert results["cpp"]["state"] == "Succeeded" and results["cpp"]["output"].strip() == "5050", results[
        "cpp"
    ]
    assert results["bash"]["output"].strip() == "42"

    hosts = json.loads(
        cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{GROUP}/pool=py", _preload_content=False
        ).data
    )["items"]
    assert hosts, "the pool's host pods"
    for host in hosts:
        status = host["status"]["containerStatuses"][0]
        assert host["spec"]["nodeName"] == node
        assert status["containerID"].startswith("containerd://") and status["image"].endswith(SANDBOX_IMAGE)
        health = _agent_health(host["status"]["podIP"])
        # The full set (the pod template's capabilities), the C fork loop, every language of the image.
        iso = health["isolation"]
        assert (iso["per_action_uid"], iso["pid_namespace"], iso["private_tmp"], iso["fork_loop"]) == (
            True,
            True,
            True,
            "c",
        ), iso
        assert iso["network_allowed"] is False
        assert set(health["languages"]["found"]) >= LANGUAGES, health["languages"]
        assert sum(health["outcomes"].values()) == len(actions)

    # Deleted while the operator still runs, so that its finalizer goes with it.
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionpools", "py")
    wait_for_gone(
        cluster.custom.list_namespaced_custom_object,
        "py",
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        plural="actionpools",
        description="ActionPool py",
        timeout=120,
    )
