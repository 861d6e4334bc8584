"""ActionPool -> the operator's view of a pool: what its host pods run and how it scales (pure).

Every default a pool has is the API model's (:mod:`arl_tangram.api.actionpool`); this module only
reads the validated model and converts units (quantities to bytes and whole cores), so the planner,
the dispatcher, the runtime and the simulator all see the same numbers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from arl_tangram.api.actionpool import MAX_SESSION_TTL_S, ActionPool
from arl_tangram.api.quantity import parse_quantity, quantity_bytes
from arl_tangram.errors import InvalidSpec, TangramError
from arl_tangram.planner.snapshot import SandboxPoolSpec, ScalingPolicy


class HostRejected(TangramError):
    """The platform refused to create a host of a pool (the API server's admission or validation:
    a RuntimeClass that does not exist, a ``podSpec`` it finds invalid, a quota), with its answer,
    which names the field. Raised by a runtime's ``create_host``; retrying the same pod at once
    would get the same answer."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status} {message}" if status else message)
        self.status = status
        self.message = message


def pool_key(namespace: str, name: str) -> str:
    """The one name of a pool inside the operator (queue, scheduler, metrics): ``namespace/name``."""
    return f"{namespace}/{name}"


# How far behind the operator's clock an agent's runs for an idle session (``agent_ttl_s``).
AGENT_TTL_FACTOR, AGENT_TTL_MARGIN_S = 2, 60.0
# The longest TTL whose agent TTL is still within the agents' bound, not cut to it.
LONGEST_BACKSTOPPED_TTL_S = (MAX_SESSION_TTL_S - AGENT_TTL_MARGIN_S) / AGENT_TTL_FACTOR


def agent_ttl_s(session_ttl_s: float) -> float:
    """The TTL an agent keeps an idle session for, when the operator closes it at ``session_ttl_s``:
    the agents' own clock only cleans up after an operator that is gone, so it runs well behind (an
    agent must never drop a session the operator still counts as open), up to the agents' bound."""
    return min(AGENT_TTL_FACTOR * session_ttl_s + AGENT_TTL_MARGIN_S, MAX_SESSION_TTL_S)


@dataclass(frozen=True)
class PoolLimits:
    """Per-action limits the pool's agents enforce."""

    timeout_s: float
    memory_bytes: int
    workdir_bytes: int
    max_output_bytes: int
    max_processes: int
    max_cores: int

    @property
    def memory_mb(self) -> int:
        """The memory an action may have, in MB, as the agents are told it (``--max-memory-mb``; 16
        at least, the agent's floor) and as the dispatcher holds requests to it."""
        return max(16, self.memory_bytes >> 20)

    @property
    def workdir_mb(self) -> int:
        """An action's workdir limit in MB as the agents are told it (``--workdir-mb``; 1 at least:
        0 would mean none)."""
        return max(1, self.workdir_bytes >> 20)


@dataclass(frozen=True)
class PoolConfig:
    """One ActionPool as the operator works with it.

    ``template_hash`` changes exactly when what a host pod is built from changes (image, resources,
    env, languages, limits, isolation, pod spec overlay, sessions but their TTL, which applies live):
    hosts carrying another hash are rolled.
    """

    namespace: str
    name: str
    uid: str
    generation: int
    mode: str
    image: str
    image_pull_policy: str
    host_cores: int
    host_memory_bytes: int
    ephemeral_storage_bytes: int | None
    env: tuple[tuple[str, str], ...]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    pod_spec: Mapping[str, Any] | None
    languages: tuple[str, ...]
    limits: PoolLimits
    network: bool
    runtime_class_name: str | None
    min_hosts: int
    max_hosts: int
    warm_hosts: int
    idle_timeout_s: float
    max_starting: int
    replicas: int | None
    session_ttl_s: float
    persistent_interpreter: bool
    sessions_per_host: int
    max_sessions: int | None
    idle_cpu_millicores: int | None
    allowed_image_prefixes: tuple[str, ...] = field(default=())
    template_hash: str = ""

    @property
    def key(self) -> str:
        return pool_key(self.namespace, self.name)

    @property
    def agent_session_ttl_s(self) -> float:
        """The TTL agents keep an idle session of the pool's own TTL for (``agent_ttl_s``)."""
        return agent_ttl_s(self.session_ttl_s)

    @property
    def desired_bounds(self) -> tuple[int, int]:
        """``[min, max]`` hosts, with ``/scale``'s replicas (when set) pinning both, clamped."""
        if self.replicas is None:
            return self.min_hosts, self.max_hosts
        pinned = min(max(self.replicas, self.min_hosts), self.max_hosts)
        return pinned, pinned

    def scaling_policy(self) -> ScalingPolicy:
        """The planner's view of this pool's scaling knobs."""
        lo, hi = self.desired_bounds
        return ScalingPolicy(
            max_instances=hi,
            min_instances=lo,
            warm_instances=min(self.warm_hosts, hi),
            max_starting=self.max_starting,
            idle_timeout_s=self.idle_timeout_s,
            # minHosts 0 means what it says: an idle pool goes to zero hosts after idleTimeoutSeconds.
            scale_to_zero=lo == 0,
        )

    def planner_spec(self, node_selector: Mapping[str, str] | None = None) -> SandboxPoolSpec:
        """The pool as the capacity planner sees it (its units are cores)."""
        return SandboxPoolSpec(
            name=self.key,
            host_cores=self.host_cores,
            host_memory_bytes=self.host_memory_bytes,
            scaling=self.scaling_policy(),
            node_selector=dict(node_selector or {}),
            sessions_per_host=self.sessions_per_host,
        )


def whole_cores(quantity: str, where: str) -> int:
    """A CPU quantity as whole cores: actions get exclusive cores, so a host must have whole ones."""
    value = parse_quantity(quantity)
    if value != value.to_integral_value() or value < 1:
        raise InvalidSpec(
            where, f"must be a whole number of cores >= 1 (actions get whole cores), got {quantity}"
        )
    return int(value)


def millicores(quantity: str) -> int:
    return int(parse_quantity(quantity) * Decimal(1000))


def _template_hash(pool: ActionPool) -> str:
    spec = pool.spec
    relevant = {
        "mode": spec.mode,
        "template": spec.template.model_dump(mode="json", by_alias=True, exclude_none=True),
        "languages": list(spec.languages),
        "limits": spec.limits.model_dump(mode="json", by_alias=True),
        "isolation": spec.isolation.model_dump(mode="json", by_alias=True, exclude_none=True),
        # Not ttlSeconds: the dispatcher applies it live (it closes idle sessions on the pool's
        # current TTL and gives each agent session its own TTL when it opens it), so an edit of it
        # replaced every host for nothing: a surge of new hosts, and the old ones kept, drained,
        # until their open sessions ended. The hosts' ``--session-ttl`` is a default that no session
        # the operator opens uses.
        "sessions": spec.sessions.model_dump(mode="json", by_alias=True, exclude={"ttl_seconds"}),
    }
    digest = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()
    return digest[:16]


def pool_config(pool: ActionPool, uid: str = "") -> PoolConfig:
    """Translate a validated ActionPool; raises :class:`InvalidSpec` for what only units can reveal."""
    meta, spec = pool.metadata, pool.spec
    if not meta.name or not meta.namespace:
        raise InvalidSpec("metadata", "an ActionPool needs a name and a namespace")
    res = spec.template.resources
    dedicated = spec.dedicated
    return PoolConfig(
        namespace=meta.namespace,
        name=meta.name,
        uid=uid,
        generation=meta.generation or 0,
        mode=spec.mode,
        image=spec.template.image,
        image_pull_policy=spec.template.image_pull_policy,
        host_cores=whole_cores(res.cpu, "spec.template.resources.cpu"),
        host_memory_bytes=quantity_bytes(res.memory),
        ephemeral_storage_bytes=quantity_bytes(res.ephemeral_storage) if res.ephemeral_storage else None,
        env=tuple((e.name, e.value) for e in spec.template.env),
        labels=dict(spec.template.labels),
        annotations=dict(spec.template.annotations),
        pod_spec=spec.template.pod_spec,
        languages=tuple(spec.languages),
        limits=PoolLimits(
            timeout_s=float(spec.limits.timeout_seconds),
            memory_bytes=quantity_bytes(spec.limits.memory),
            workdir_bytes=quantity_bytes(spec.limits.workdir),
            max_output_bytes=spec.limits.max_output_bytes,
            max_processes=spec.limits.max_processes,
            max_cores=min(spec.limits.max_cores, whole_cores(res.cpu, "spec.template.resources.cpu")),
        ),
        network=spec.isolation.network == "Enabled",
        runtime_class_name=spec.isolation.runtime_class_name,
        min_hosts=spec.scaling.min_hosts,
        max_hosts=spec.scaling.max_hosts,
        warm_hosts=spec.scaling.warm_hosts,
        idle_timeout_s=float(spec.scaling.idle_timeout_seconds),
        max_starting=spec.scaling.max_starting,
        replicas=spec.replicas,
        session_ttl_s=float(spec.sessions.ttl_seconds),
        persistent_interpreter=spec.sessions.persistent_interpreter,
        # Dedicated mode is one pod per session (the pod-per-trajectory layout).
        sessions_per_host=1 if spec.mode == "dedicated" else spec.sessions.max_per_host,
        max_sessions=dedicated.max_sessions if dedicated else None,
        idle_cpu_millicores=millicores(dedicated.idle_cpu) if dedicated else None,
        allowed_image_prefixes=tuple(dedicated.allowed_image_prefixes) if dedicated else (),
        template_hash=_template_hash(pool),
    )
