"""What the dispatcher's and the gateway's tests share: a pool of namespace ``team-a``, and a real
agent as a host."""

from __future__ import annotations

import requests
from sandbox_agent_harness import Agent

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.dispatch.dispatcher import HostEndpoint
from arl_tangram.domain.pools import PoolConfig, pool_config

NS = "team-a"


def pool_for_tests(name: str = "py", namespace: str = NS, **scaling: object) -> PoolConfig:
    """A pool of hosts of 2 cores and 4Gi, actions of at most 2 cores, 30 s and 1Gi."""
    model = ActionPool.model_validate(
        {
            "metadata": {"name": name, "namespace": namespace, "generation": 1},
            "spec": {
                "template": {"image": "sandbox:test", "resources": {"cpu": "2", "memory": "4Gi"}},
                "languages": ["python", "bash"],
                "limits": {"timeoutSeconds": 30, "memory": "1Gi", "maxCores": 2},
                "scaling": scaling,
            },
        }
    )
    return pool_config(model, uid=f"uid-{namespace}-{name}")


def endpoint(agent: Agent, name: str, draining: bool = False) -> HostEndpoint:
    """The running ``agent`` as host ``name``, with the cores its health reports."""
    health = requests.get(agent.url + "/v1/health", timeout=10).json()
    return HostEndpoint(name, f"127.0.0.1:{agent.port}", tuple(health["cores"]["ids"]), 4 << 30, draining)
