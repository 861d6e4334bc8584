# mypy: disable-error-code="arg-type,union-attr,index,operator,no-untyped-call"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""The simulated nodes of the local test bed: capacity and labels the scheduler acts on."""

from __future__ import annotations

import pytest
from testbed import Cluster, condition, pod_manifest, pod_phase, shell_container, wait_for_pod


@pytest.fixture(autouse=True)
def _local_only(cluster: Cluster) -> None:
    if not cluster.is_local_testbed:
        pytest.skip("the simulated GPU and MIG nodes exist only on the local test bed")


def _gpu_pod(name: str, resource: str, count: int) -> dict[str, object]:
    limits = {resource: str(count)}
    return pod_manifest(name, [shell_container("sleep 3600", resources={"limits": limits})])


def test_nodes_advertise_gpus_mig_slices_and_topology(cluster: Cluster) -> None:
    nodes = {
        n.metadata.name: n
        for n in cluster.core.list_node(
            label_selector="tangram.arl.dev/testbed=true,!tangram.arl.dev/real-node"
        ).items
    }
    assert {"tb-cpu-0", "tb-cpu-1", "tb-gpu-0", "tb-mig-0", "tb-reserved-0"} <= set(nodes)
    reserved = nodes["tb-reserved-0"].spec.taints
    assert ("tangram.arl.dev/testbed-reserved", "NoSchedule") in [(t.key, t.effect) for t in reserved]
    assert nodes["tb-gpu-0"].status.allocatable["nvidia.com/gpu"] == "8"
    assert nodes["tb-mig-0"].status.allocatable["nvidia.com/mig-1g.5gb"] == "7"
    assert nodes["tb-gpu-0"].metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert all("topology.kubernetes.io/zone" in n.metadata.labels for n in nodes.values())
    assert all(
        condition(cluster.api.sanitize_for_serialization(n), "Ready") == "True" for n in nodes.values()
    )


def test_gpu_and_mig_pods_land_on_the_nodes_that_have_them(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespaced_pod(namespace, _gpu_pod("gpus", "nvidia.com/gpu", 4))
    cluster.core.create_namespaced_pod(namespace, _gpu_pod("slice", "nvidia.com/mig-3g.20gb", 1))
    gpus = wait_for_pod(cluster, namespace, "gpus", pod_phase("Running"), "Running")
    mig = wait_for_pod(cluster, namespace, "slice", pod_phase("Running"), "Running")
    assert gpus["spec"]["nodeName"] == "tb-gpu-0"
    assert mig["spec"]["nodeName"] == "tb-mig-0"


def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_pending(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespaced_pod(namespace, _gpu_pod("greedy", "nvidia.com/gpu", 9))
    pending = wait_for_pod(
        cluster, namespace, "greedy", lambda p: condition(p, "PodScheduled") == "False", "found unschedulable"
    )
    assert pending["status"]["phase"] == "Pending"
    scheduled = next(c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled")
    assert scheduled["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in scheduled["message"]
