"""What the planner is told: nodes, pools, the instances that run, and the demand (frozen inputs).

Units are integers wherever Kubernetes counts them exactly: CPU in millicores, memory in bytes,
GPUs as whole devices. Times are seconds on the caller's clock (simulated time in the simulator,
``time.monotonic()`` or wall time in the operator); the planner only ever subtracts them.

Every class validates itself on construction and raises :class:`~arl_tangram.errors.InvalidSpec`
naming the offending field, so a bad snapshot fails where it is built, not deep inside a solver.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from arl_tangram.api.actionpool import PoolScaling
from arl_tangram.errors import InvalidSpec

# The defaults of the scaling knobs live in the API models (what users write); the planner's own
# defaults are read from there so that a pool built in code and one built from YAML agree.
_API_SCALING = PoolScaling()

InstancePhase = Literal["starting", "ready", "draining", "failed"]
"""Lifecycle of one instance (a sandbox host or a reward replica), as the runtime reports it.

- ``starting``: created, not ready yet; the scheduler places no work on it, so it may be removed at once.
- ``ready``: serving; the scheduler may place actions and pin sessions on it.
- ``draining``: cordoned (the planner asked for it): no new actions or sessions go to it; it is
  *drained* once it reports no running actions and no pinned sessions, and only then removable.
- ``failed``: lost or crashed; it serves nothing and is removed.
"""

INSTANCE_PHASES: tuple[InstancePhase, ...] = ("starting", "ready", "draining", "failed")


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise InvalidSpec(field_name, message)


def _non_negative_int(value: int, field_name: str) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        field_name,
        f"must be a non-negative integer, got {value!r}",
    )


def _finite_non_negative(value: float, field_name: str) -> None:
    _require(
        isinstance(value, int | float) and math.isfinite(value) and value >= 0,
        field_name,
        f"must be a finite number >= 0, got {value!r}",
    )


def _frozen_labels(value: Mapping[str, str], field_name: str) -> Mapping[str, str]:
    _require(isinstance(value, Mapping), field_name, f"must be a mapping of strings, got {value!r}")
    for key, item in value.items():
        _require(
            isinstance(key, str) and isinstance(item, str),
            field_name,
            f"keys and values must be strings, got {key!r}: {item!r}",
        )
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class NodeSnapshot:
    """One node: its allocatable resources, labels, and what pods the planner does not own hold.

    ``reserved_*`` is what other pods (not sandbox hosts or reward replicas) request on the node; the
    planner's own instances are counted from :class:`InstanceSnapshot` and must not be included here.
    ``gpu_memory_bytes`` is the memory of one GPU (all GPUs of a node are alike).
    """

    name: str
    cpu_millicores: int
    memory_bytes: int
    gpus: int = 0
    gpu_memory_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    schedulable: bool = True
    reserved_cpu_millicores: int = 0
    reserved_memory_bytes: int = 0
    reserved_gpus: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name != "", "node.name", "must be a non-empty string")
        where = f"nodes[{self.name}]"
        for attr in (
            "cpu_millicores",
            "memory_bytes",
            "gpus",
            "gpu_memory_bytes",
            "reserved_cpu_millicores",
            "reserved_memory_bytes",
            "reserved_gpus",
        ):
            _non_negative_int(getattr(self, attr), f"{where}.{attr}")
        _require(
            self.gpus == 0 or self.gpu_memory_bytes > 0,
            f"{where}.gpu_memory_bytes",
            "must be > 0 on a node with GPUs",
        )
        object.__setattr__(self, "labels", _frozen_labels(self.labels, f"{where}.labels"))


@dataclass(frozen=True)
class ScalingPolicy:
    """How one pool may scale; the same knobs serve sandbox pools and reward services.

    - ``min_instances``/``max_instances``: floor and ceiling on instances (starting, ready and
      draining ones all count against the ceiling).
    - ``warm_instances``: idle instances kept on top of the demand while the pool is active, so that
      a burst does not wait for a cold start.
    - ``max_starting``: at most this many instances of the pool in ``starting`` at once.
    - ``idle_timeout_s``: two things. Surplus capacity is drained only after it has been surplus this
      long (hysteresis, no flapping); and with ``scale_to_zero`` a pool with nothing queued and
      nothing running for this long goes to zero instances, below ``min_instances``.
    - ``cold_start_s`` (estimate of the time a new instance needs to become ready) and
      ``cold_start_budget_s`` (the longest cold start a caller accepts): when the estimate exceeds the
      budget, scale-to-zero is refused and one instance stays warm.
    - ``act_target_s``: target mean action completion time; while the recent ACT is above it the
      pool is not scaled down, and with work queued it grows in proportion (bounded by the planner's
      ``max_growth``).
    - ``target_utilisation``: the share of capacity the arrival-rate term aims to keep busy.
    """

    max_instances: int
    min_instances: int = _API_SCALING.min_hosts
    warm_instances: int = _API_SCALING.warm_hosts
    max_starting: int = _API_SCALING.max_starting
    idle_timeout_s: float = float(_API_SCALING.idle_timeout_seconds)
    scale_to_zero: bool = False
    cold_start_s: float = 0.0
    cold_start_budget_s: float | None = None
    act_target_s: float | None = None
    target_utilisation: float = 0.8

    def __post_init__(self) -> None:
        for attr in ("max_instances", "min_instances", "warm_instances", "max_starting"):
            _non_negative_int(getattr(self, attr), f"scaling.{attr}")
        _require(
            self.min_instances <= self.max_instances,
            "scaling.min_instances",
            f"must be <= max_instances ({self.min_instances} > {self.max_instances})",
        )
        _require(self.max_starting >= 1, "scaling.max_starting", "must be >= 1")
        _finite_non_negative(self.idle_timeout_s, "scaling.idle_timeout_s")
        _finite_non_negative(self.cold_start_s, "scaling.cold_start_s")
        if self.cold_start_budget_s is not None:
            _finite_non_negative(self.cold_start_budget_s, "scaling.cold_start_budget_s")
        if self.act_target_s is not None:
            _require(
                math.isfinite(self.act_target_s) and self.act_target_s > 0,
                "scaling.act_target_s",
                f"must be a finite number > 0, got {self.act_target_s!r}",
            )
        _require(
            math.isfinite(self.target_utilisation) and 0 < self.target_utilisation <= 1,
            "scaling.target_utilisation",
            f"must be in (0, 1], got {self.target_utilisation!r}",
        )


@dataclass(frozen=True)
class SandboxPoolSpec:
    """A CPU pool of sandbox hosts; every host has the same size. Its units are cores."""

    name: str
    host_cores: int
    host_memory_bytes: int
    scaling: ScalingPolicy
    node_selector: Mapping[str, str] = field(default_factory=dict, hash=False)
    sessions_per_host: int = 0  # sessions one host takes at most (0: as many as its memory holds)

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name != "", "pool.name", "must be a non-empty string")
        _non_negative_int(self.sessions_per_host, f"pools[{self.name}].sessions_per_host")
        _require(
            isinstance(self.host_cores, int) and self.host_cores >= 1,
            f"pools[{self.name}].host_cores",
            f"must be an integer >= 1, got {self.host_cores!r}",
        )
        _non_negative_int(self.host_memory_bytes, f"pools[{self.name}].host_memory_bytes")
        object.__setattr__(
            self, "node_selector", _frozen_labels(self.node_selector, f"pools[{self.name}].node_selector")
        )

    @property
    def host_cpu_millicores(self) -> int:
        """CPU one host requests on its node."""
        return self.host_cores * 1000


@dataclass(frozen=True)
class RewardServiceSpec:
    """A GPU reward-model service; each replica takes one size from ``gpus_per_replica``. Units are GPUs.

    A replica of ``g`` GPUs fits a node only if ``g * node.gpu_memory_bytes >= gpu_memory_bytes``
    (the model's weights and working memory, split across its tensor-parallel GPUs).
    ``replica_cpu_millicores`` and ``replica_memory_bytes`` are what one replica requests besides GPUs.
    """

    name: str
    gpus_per_replica: tuple[int, ...]
    gpu_memory_bytes: int
    scaling: ScalingPolicy
    replica_cpu_millicores: int = 0
    replica_memory_bytes: int = 0
    node_selector: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name != "", "service.name", "must be a non-empty string")
        where = f"services[{self.name}]"
        sizes = tuple(self.gpus_per_replica)
        _require(len(sizes) > 0, f"{where}.gpus_per_replica", "must list at least one size")
        for size in sizes:
            _require(
                isinstance(size, int) and not isinstance(size, bool) and size >= 1,
                f"{where}.gpus_per_replica",
                f"sizes must be integers >= 1, got {size!r}",
            )
        object.__setattr__(self, "gpus_per_replica", tuple(sorted(set(sizes))))
        _non_negative_int(self.gpu_memory_bytes, f"{where}.gpu_memory_bytes")
        _non_negative_int(self.replica_cpu_millicores, f"{where}.replica_cpu_millicores")
        _non_negative_int(self.replica_memory_bytes, f"{where}.replica_memory_bytes")
        object.__setattr__(
            self, "node_selector", _frozen_labels(self.node_selector, f"{where}.node_selector")
        )


PoolSpec = SandboxPoolSpec | RewardServiceSpec


@dataclass(frozen=True)
class InstanceSnapshot:
    """One instance that exists now: a sandbox host of a pool, or a replica of a reward service.

    ``cpu_millicores``/``memory_bytes``/``gpus`` are what it requests on its node (it may predate a
    change of the pool's size). ``started_at`` orders instances by age (larger is newer).
    ``running_actions`` and ``pinned_sessions`` are what holds it: an instance with either is never
    removed before it is drained.
    """

    name: str
    pool: str
    node: str
    phase: InstancePhase
    cpu_millicores: int
    memory_bytes: int
    gpus: int = 0
    running_actions: int = 0
    pinned_sessions: int = 0
    started_at: float = 0.0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.name, str) and self.name != "", "instance.name", "must be a non-empty string"
        )
        where = f"instances[{self.name}]"
        _require(
            self.phase in INSTANCE_PHASES,
            f"{where}.phase",
            f"must be one of {', '.join(INSTANCE_PHASES)}; got {self.phase!r}",
        )
        for attr in ("cpu_millicores", "memory_bytes", "gpus", "running_actions", "pinned_sessions"):
            _non_negative_int(getattr(self, attr), f"{where}.{attr}")
        _require(math.isfinite(self.started_at), f"{where}.started_at", "must be finite")

    @property
    def is_drained(self) -> bool:
        """Cordoned and empty: no running action and no pinned session holds it any more."""
        return self.phase == "draining" and self.running_actions == 0 and self.pinned_sessions == 0


@dataclass(frozen=True)
class PoolDemand:
    """Recent demand on one pool, in the pool's units (cores for sandbox pools, GPUs for services).

    - ``queued_units``: the key-resource units the queued actions need at their minimum.
    - ``running_units``: units held by running actions now.
    - ``arrival_rate_per_s``, ``mean_action_s``, ``mean_units_per_action``: recent arrival rate,
      execution time and size, for the steady-state (Little's law) term.
    - ``act_recent_s``: recent mean action completion time (None: unknown).
    - ``last_active_at``: last time any action of the pool was queued or running (None: the planner
      tracks idleness itself from the snapshots it sees).
    - ``session_memory_bytes`` (sandbox pools): memory the live sessions hold for their whole life,
      pinned or not yet; a session can only start on a host with room for it, so hosts for that
      much memory are needed whatever the cores say.
    - ``sessions`` (sandbox pools): live sessions, for pools whose hosts cap their sessions
      (``SandboxPoolSpec.sessions_per_host``).
    """

    pool: str
    queued_actions: int = 0
    queued_units: int = 0
    running_actions: int = 0
    running_units: int = 0
    arrival_rate_per_s: float = 0.0
    mean_action_s: float = 0.0
    mean_units_per_action: float = 1.0
    act_recent_s: float | None = None
    last_active_at: float | None = None
    session_memory_bytes: int = 0
    sessions: int = 0

    def __post_init__(self) -> None:
        where = f"demand[{self.pool}]"
        for attr in (
            "queued_actions",
            "queued_units",
            "running_actions",
            "running_units",
            "session_memory_bytes",
            "sessions",
        ):
            _non_negative_int(getattr(self, attr), f"{where}.{attr}")
        for fattr in ("arrival_rate_per_s", "mean_action_s", "mean_units_per_action"):
            _finite_non_negative(getattr(self, fattr), f"{where}.{fattr}")
        if self.act_recent_s is not None:
            _finite_non_negative(self.act_recent_s, f"{where}.act_recent_s")

    @property
    def is_idle(self) -> bool:
        """Nothing queued and nothing running."""
        return self.queued_actions == 0 and self.running_actions == 0


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything one planning round sees. Pool names are keys shared by sandbox pools and services.

    A pool with no entry in ``demand`` has no demand. Cross-references are checked here: every
    instance names a known pool and node, names are unique.
    """

    now: float
    nodes: tuple[NodeSnapshot, ...]
    sandbox_pools: tuple[SandboxPoolSpec, ...] = ()
    reward_services: tuple[RewardServiceSpec, ...] = ()
    instances: tuple[InstanceSnapshot, ...] = ()
    demand: tuple[PoolDemand, ...] = ()

    def __post_init__(self) -> None:
        _require(math.isfinite(self.now), "snapshot.now", "must be finite")
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "sandbox_pools", tuple(self.sandbox_pools))
        object.__setattr__(self, "reward_services", tuple(self.reward_services))
        object.__setattr__(self, "instances", tuple(self.instances))
        object.__setattr__(self, "demand", tuple(self.demand))
        _unique([n.name for n in self.nodes], "nodes")
        pool_names = [p.name for p in self.sandbox_pools] + [s.name for s in self.reward_services]
        _unique(pool_names, "pools")
        _unique([i.name for i in self.instances], "instances")
        _unique([d.pool for d in self.demand], "demand")
        known_pools = set(pool_names)
        known_nodes = {n.name for n in self.nodes}
        for inst in self.instances:
            _require(inst.pool in known_pools, f"instances[{inst.name}].pool", f"unknown pool {inst.pool!r}")
            _require(inst.node in known_nodes, f"instances[{inst.name}].node", f"unknown node {inst.node!r}")
        for dem in self.demand:
            _require(dem.pool in known_pools, f"demand[{dem.pool}].pool", f"unknown pool {dem.pool!r}")

    def pools(self) -> tuple[PoolSpec, ...]:
        """Sandbox pools then reward services, in the order given."""
        return (*self.sandbox_pools, *self.reward_services)

    def demand_of(self, pool: str) -> PoolDemand:
        """The pool's demand, or an empty one when the snapshot has none for it."""
        for dem in self.demand:
            if dem.pool == pool:
                return dem
        return PoolDemand(pool=pool)


def _unique(names: list[str], field_name: str) -> None:
    seen: set[str] = set()
    for name in names:
        _require(name not in seen, field_name, f"duplicate name {name!r}")
        seen.add(name)
