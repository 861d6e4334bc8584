"""The two pools the demo compares, from one template: they differ only in how cores are held."""

from __future__ import annotations

from typing import Any

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.api.meta import API_VERSION
from arl_tangram.domain.pools import PoolConfig, pool_config

NAMESPACE = "default"
SHARED_POOL = "humaneval"
DEDICATED_POOL = "humaneval-dedicated"
# A trajectory's sandbox in the pod-per-trajectory layout: one core, as trainers commonly size them.
CORES_PER_TRAJECTORY = 1
ACTION_TIMEOUT_S = 30


def pool_doc(name: str, host_cores: int, min_hosts: int, max_hosts: int) -> dict[str, Any]:
    """An ActionPool as YAML would give it; both demo pools come from here."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ActionPool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "mode": "shared",
            "template": {"image": "local", "resources": {"cpu": str(host_cores), "memory": "2Gi"}},
            "languages": ["python"],
            "limits": {
                "timeoutSeconds": ACTION_TIMEOUT_S,
                "memory": "512Mi",
                "maxCores": host_cores,
            },
            "scaling": {
                "minHosts": min_hosts,
                "maxHosts": max_hosts,
                "warmHosts": 0,
                "idleTimeoutSeconds": 300,
                "maxStarting": max_hosts,
            },
            "sessions": {"ttlSeconds": 600, "maxPerHost": 256},
        },
    }


def shared_pool_doc(machine_cores: int) -> dict[str, Any]:
    """ARL-Tangram's layout: one long-lived host holding the machine's cores, shared by every
    trajectory; each action gets its own cores only while it runs."""
    return pool_doc(SHARED_POOL, machine_cores, 1, 1)


def dedicated_pool(machine_cores: int) -> PoolConfig:
    """The pod-per-trajectory layout: a one-core host per trajectory, started on demand."""
    doc = pool_doc(DEDICATED_POOL, CORES_PER_TRAJECTORY, 0, machine_cores // CORES_PER_TRAJECTORY)
    doc["metadata"]["generation"] = 1
    return pool_config(ActionPool.model_validate(doc), uid="demo-dedicated")
