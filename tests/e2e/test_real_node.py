# mypy: disable-error-code="arg-type"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""The opt-in real node (TESTBED_REAL_NODE=1 make cluster-up): a kubelet with containerd and runc
running a real OCI image, next to the simulated nodes."""

from __future__ import annotations

import urllib.request

import pytest
from testbed import Cluster, pod_ready, wait_for_gone, wait_for_pod

REAL_NODE = "tangram.arl.dev/real-node"


def test_a_real_kubelet_runs_an_image_and_its_pod_answers_at_its_ip(cluster: Cluster, namespace: str) -> None:
    if not cluster.core.list_node(label_selector=f"{REAL_NODE}=true").items:
        pytest.skip("no real node in this cluster (opt-in: TESTBED_REAL_NODE=1 for the local test bed)")
    pod = {
        "metadata": {"name": "real-echo"},
        "spec": {
            "nodeSelector": {REAL_NODE: "true"},
            "tolerations": [{"key": REAL_NODE, "operator": "Exists", "effect": "NoSchedule"}],
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
