"""Small builders for planner tests: nodes, pools, instances and a resource audit of a plan."""

from __future__ import annotations

from collections.abc import Iterable

from arl_tangram.planner import (
    ClusterSnapshot,
    InstanceSnapshot,
    NodeSnapshot,
    PoolDemand,
    RewardServiceSpec,
    SandboxPoolSpec,
    ScalingPlan,
    ScalingPolicy,
)

GiB = 2**30


def cpu_node(name: str, cores: int = 64, memory_gib: int = 256, **kw: object) -> NodeSnapshot:
    return NodeSnapshot(name, cores * 1000, memory_gib * GiB, **kw)


def gpu_node(name: str, gpus: int = 8, gpu_gib: int = 80, cores: int = 96, **kw: object) -> NodeSnapshot:
    return NodeSnapshot(name, cores * 1000, 1024 * GiB, gpus=gpus, gpu_memory_bytes=gpu_gib * GiB, **kw)


def sandbox_pool(
    name: str = "code",
    host_cores: int = 8,
    host_memory_gib: int = 16,
    node_selector: dict[str, str] | None = None,
    **policy: object,
) -> SandboxPoolSpec:
    policy.setdefault("max_instances", 20)
    policy.setdefault("max_starting", 20)
    return SandboxPoolSpec(
        name, host_cores, host_memory_gib * GiB, ScalingPolicy(**policy), node_selector or {}
    )


def reward_service(
    name: str = "rm", sizes: tuple[int, ...] = (1, 2, 4, 8), model_gib: int = 40, **policy: object
) -> RewardServiceSpec:
    policy.setdefault("max_instances", 8)
    policy.setdefault("max_starting", 8)
    return RewardServiceSpec(name, sizes, model_gib * GiB, ScalingPolicy(**policy), 2000, 32 * GiB)


def host(
    name: str,
    pool: SandboxPoolSpec,
    node: str,
    phase: str = "ready",
    running: int = 0,
    pinned: int = 0,
    started_at: float = 0.0,
) -> InstanceSnapshot:
    return InstanceSnapshot(
        name,
        pool.name,
        node,
        phase,
        pool.host_cpu_millicores,
        pool.host_memory_bytes,
        running_actions=running,
        pinned_sessions=pinned,
        started_at=started_at,
    )


def replica(
    name: str, svc: RewardServiceSpec, node: str, gpus: int, phase: str = "ready", running: int = 0
) -> InstanceSnapshot:
    return InstanceSnapshot(
        name,
        svc.name,
        node,
        phase,
        svc.replica_cpu_millicores,
        svc.replica_memory_bytes,
        gpus=gpus,
        running_actions=running,
    )


def snapshot(
    now: float,
    nodes: Iterable[NodeSnapshot],
    pools: Iterable[SandboxPoolSpec] = (),
    services: Iterable[RewardServiceSpec] = (),
    instances: Iterable[InstanceSnapshot] = (),
    demand: Iterable[PoolDemand] = (),
) -> ClusterSnapshot:
    return ClusterSnapshot(now, tuple(nodes), tuple(pools), tuple(services), tuple(instances), tuple(demand))


def overcommitted_nodes(snap: ClusterSnapshot, plan: ScalingPlan) -> list[str]:
    """Nodes where the plan's adds ask for a resource (cpu, memory or GPUs) beyond what is allocatable
    once other pods and every existing instance are counted. A dimension the adds do not use is not
    judged: a node already over-committed on GPUs may still take a CPU-only host if its CPUs allow."""
    bad = []
    for node in snap.nodes:
        used = [node.reserved_cpu_millicores, node.reserved_memory_bytes, node.reserved_gpus]
        for inst in snap.instances:
            if inst.node == node.name:
                used = [used[0] + inst.cpu_millicores, used[1] + inst.memory_bytes, used[2] + inst.gpus]
        added = [a for a in plan.adds if a.node == node.name]
        extra = [
            sum(a.cpu_millicores for a in added),
            sum(a.memory_bytes for a in added),
            sum(a.gpus for a in added),
        ]
        limit = [node.cpu_millicores, node.memory_bytes, node.gpus]
        if any(e > 0 and u + e > cap for u, e, cap in zip(used, extra, limit, strict=True)):
            bad.append(node.name)
    return bad
