"""The runtime interface: sandbox hosts as the controllers see and change them, whatever runs them.

The Kubernetes backend runs each host as a pod it owns; the embedded mode runs each as a local
process. Both report hosts as :class:`HostObservation` and take the same three changes (create,
drain, delete); the operator, never a Deployment or ReplicaSet, picks which host goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from arl_tangram.domain.pools import PoolConfig

HostPhase = Literal["starting", "ready", "draining", "failed", "terminating"]

AGENT_PORT = 8080
"""The port the sandbox agent listens on inside a host."""


@dataclass(frozen=True)
class HostObservation:
    """One host as observed: ``address`` is ``ip:port`` of its agent once it has one; ``pending``
    says why a host that is not placed yet waits (e.g. the scheduler's Unschedulable message);
    ``stalled`` why a placed host's container is not running yet where that is not a normal step of
    its start (the kubelet's waiting reason and message: an image it cannot pull, a Secret it
    lacks), which it may wait on for ever; ``setting_up``: that is its volumes or sandbox not
    ready yet, normal for a moment of every start (``failures.Stalls`` times it per pod)."""

    name: str
    pool: str
    phase: HostPhase
    node: str
    address: str | None
    template_hash: str
    created_at: float
    cpu_millicores: int
    memory_bytes: int
    pending: str | None = None
    stalled: str | None = None
    setting_up: bool = False
    stalled_s: float = 0.0  # how long it has been stalled, as its controller has seen (Stalls)
    failure: str | None = None
    cpu_applied_millicores: int | None = None  # the agent container's CPU limit as enacted (resize)


class Resizer(Protocol):
    """A runtime that can change a running host's CPU in place (dedicated pools' per-action cores)."""

    async def resize_host(self, pool: PoolConfig, name: str, cpu_millicores: int) -> bool:
        """Set the host's CPU to ``cpu_millicores`` and wait until it is enacted; False when this
        cluster cannot resize pods in place (the pool's status says so and cores stay fixed)."""
        ...


class Runtime(Protocol):
    """Where sandbox hosts run."""

    def hosts(self, pool_key: str) -> list[HostObservation]:
        """The pool's hosts as last observed (never an API call: an index or a process table)."""
        ...

    async def create_host(self, pool: PoolConfig, name: str, node: str | None) -> None:
        """Start one host (``node``: where the planner would put it; a preference)."""
        ...

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        """Mark a host draining (durably: a restarted operator sees it) or back in service."""
        ...

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        """Stop and remove one host (gone already: nothing to do)."""
        ...
