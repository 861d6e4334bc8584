"""Where a RewardModelService's replicas go, from the published inventories (pure; for the controller).

``place_service`` turns a RewardModelService and the GPU nodes' inventories into one placement per
replica: whole GPUs cut by the GPU manager's NVLink-aware buddy chunks (``managers.gpu``), or one MIG
instance of the asked profile with enough memory. Devices that other replicas already hold are passed
in as ``taken`` (UUIDs) and never handed out twice. ``device_request`` says how a pod asks the
cluster for a placement's devices.

How the controller is meant to call it, on each reconcile of a RewardModelService:
1. inventories = ``nodeinfo.inventory_from_annotations`` of every GPU node (the node agent's);
2. taken = the UUIDs in the status placements of every other RewardModelService (and of this one's
   replicas that stay);
3. new = ``place_service(rms, inventories, want - len(kept), taken)``; ``unplaced`` > 0 sets a
   condition (``Ready=False``, reason ``InsufficientGPUs``) naming what is missing;
4. each new placement becomes a reward runtime pod from ``device_request(p, strategy)`` (node name,
   resources, environment) whose services file holds ``rewards.runtime.service_entry(rms, ...)``, and
   ``to_status`` writes ``status.placements``;
5. for MIG nodes, ``migplan.plan_mig([mig_demand(rms, rate, t) ...], migplan.mig_gpus(inventories)[m])``
   gives the layouts to request through ``nodeinfo`` (``MigRequest``, ``mig_parted_config``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from arl_tangram.api.quantity import quantity_bytes
from arl_tangram.api.rewardmodelservice import Placement, PlacementState, RewardModelService
from arl_tangram.core.action import Action, EfficiencyCurve
from arl_tangram.core.pool import Grant
from arl_tangram.gpu.inventory import NodeInventory
from arl_tangram.gpu.migplan import ServiceDemand
from arl_tangram.managers.gpu import GpuManager, GpuNode

DeviceStrategy = Literal["device-plugin", "visible-devices"]
DEVICE_STRATEGIES: tuple[DeviceStrategy, ...] = ("device-plugin", "visible-devices")
GPU_UUIDS_ENV = "TANGRAM_GPU_UUIDS"  # the planned devices, in the runtime's environment and read back
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # the device plugin's resource per MIG profile (mixed strategy)


@dataclass(frozen=True)
class ReplicaPlacement:
    """One replica's devices: a node, its GPU indices, their UUIDs (``GPU-...``, or one ``MIG-...``)."""

    node: str
    gpus: tuple[int, ...]
    uuids: tuple[str, ...]
    mig_profile: str | None = None


@dataclass
class ServicePlacement:
    placements: list[ReplicaPlacement] = field(default_factory=list)
    unplaced: int = 0
    reason: str = ""


@dataclass(frozen=True)
class DeviceRequest:
    """What a replica's pod asks for: the node, extended resources and environment variables."""

    node: str
    resources: dict[str, str]
    env: dict[str, str]
    runtime_class: str | None = None


def _need_bytes(rms: RewardModelService) -> int:
    mem = rms.spec.gpu.memory
    return 0 if mem is None else quantity_bytes(str(mem))


def _without_taken(inv: NodeInventory, taken: Collection[str]) -> GpuNode:
    """The inventory as a GPU-manager node with taken whole GPUs out of the pool and taken MIG
    instances busy."""
    node = GpuNode.from_inventory(
        inv, reserved=[g.index for g in inv.gpus if not g.mig_enabled and g.uuid in taken]
    )
    for s in node.slices:
        if s.uuid in taken:
            s.busy = True
    return node


def place_service(
    rms: RewardModelService,
    inventories: Sequence[NodeInventory],
    replicas: int,
    taken: Collection[str] = (),
) -> ServicePlacement:
    """Placements for ``replicas`` new replicas of ``rms`` on the nodes of ``inventories``."""
    gpu = rms.spec.gpu
    name = rms.metadata.name or "service"
    need = _need_bytes(rms)
    out = ServicePlacement()
    if replicas <= 0:
        return out
    nodes = {inv.node: _without_taken(inv, taken) for inv in inventories if inv.gpus}
    invs = {inv.node: inv for inv in inventories}
    if not nodes:
        out.unplaced, out.reason = replicas, "no GPU node has published an inventory"
        return out
    mgr = GpuManager(list(nodes.values()), memory_headroom=1.0)
    curve = EfficiencyCurve(1.0, tuple((k, 1.0) for k in (1, 2, 4, 8)))
    for i in range(replicas):
        action = Action(
            f"{name}-{i}",
            name,
            "gpu",
            tuple(gpu.count),
            curve,
            service=name,
            service_gb=need / 2**30,  # the manager counts GPU memory in GiB
            mig_profile=gpu.mig_profile,
        )
        grant = None
        if gpu.mig_profile is not None:
            grant = _place_mig(mgr, invs, action, need)
        else:
            # NVLink cliques first at every size; a service that does not require NVLink then takes
            # GPUs across PCIe rather than wait.
            passes = (False,) if gpu.nvlink == "Required" else (False, True)
            for across in passes:
                for k in sorted(gpu.count):
                    grant = mgr.place(action, k, 0.0, across_pcie=across)
                    if grant is not None:
                        break
                if grant is not None:
                    break
        if grant is None:
            out.unplaced = replicas - i
            joined = "NVLink-joined " if gpu.nvlink == "Required" else ""
            kind = f"MIG {gpu.mig_profile}" if gpu.mig_profile else f"{sorted(gpu.count)} {joined}GPUs"
            out.reason = (
                f"{out.unplaced} of {replicas} replicas found no free {kind} with {need / 2**30:.1f} GiB"
            )
            break
        uuids = tuple(grant.extra["uuids"].split(","))
        out.placements.append(ReplicaPlacement(grant.host, tuple(grant.unit_ids), uuids, gpu.mig_profile))
    return out


def _place_mig(mgr: GpuManager, invs: Mapping[str, NodeInventory], action: Action, need: int) -> Grant | None:
    """One free MIG instance of the profile with at least ``need`` bytes (the manager's slices carry
    no memory, so instances too small are taken out first and given back after)."""
    held: list[Grant] = []
    try:
        while True:
            grant = mgr.place(action, 1, 0.0)
            if grant is None:
                return None
            inv = invs[grant.host]
            mem = next(
                m.memory_mib for g in inv.gpus for m in g.mig_instances if m.uuid == grant.extra["uuids"]
            )
            if mem * 2**20 >= need:
                return grant
            held.append(grant)
    finally:
        for g in held:
            mgr.release(g, 0.0)


def mig_demand(rms: RewardModelService, rate_per_s: float, service_s: float) -> ServiceDemand:
    """The MIG planner's demand of a service from its spec and its observed load (arrivals per second
    and mean execution on its profile): memory from ``gpu.memory`` (else the profile's size), compute
    slices from ``gpu.migProfile`` (else 1), ``minReplicas`` kept."""
    gpu = rms.spec.gpu
    need = _need_bytes(rms)
    slices = 1
    if gpu.mig_profile is not None:
        slices = int(gpu.mig_profile.split("g.")[0])
        if not need:
            need = int(float(gpu.mig_profile.split(".")[1].removesuffix("+me").removesuffix("gb")) * 1e9)
    if not need:
        raise ValueError(f"{rms.metadata.name}: MIG planning needs gpu.memory or gpu.migProfile")
    return ServiceDemand(
        rms.metadata.name or "service",
        need / 1e9,
        slices,
        rate_per_s,
        service_s,
        min_replicas=rms.spec.scaling.min_replicas,
    )


def device_request(p: ReplicaPlacement, strategy: DeviceStrategy = "device-plugin") -> DeviceRequest:
    """How the replica's pod gets its devices.

    ``device-plugin``: the NVIDIA device plugin's resources (``nvidia.com/gpu: N``, or
    ``nvidia.com/mig-<profile>: 1`` with the mixed MIG strategy) on the chosen node; the plugin picks
    which of the node's free devices, so the runtime reports the UUIDs it got. ``visible-devices``: the
    exact UUIDs in ``NVIDIA_VISIBLE_DEVICES`` with the ``nvidia`` runtime class and no resource
    request: only for GPUs the reward pool owns outright (kept out of the device plugin), since the
    scheduler then does not count them."""
    env = {GPU_UUIDS_ENV: ",".join(p.uuids)}
    if strategy == "visible-devices":
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(p.uuids)
        return DeviceRequest(p.node, {}, env, runtime_class="nvidia")
    if p.mig_profile is not None:
        return DeviceRequest(p.node, {f"{MIG_RESOURCE_PREFIX}{p.mig_profile}": "1"}, env)
    return DeviceRequest(p.node, {"nvidia.com/gpu": str(len(p.uuids))}, env)


def to_status(p: ReplicaPlacement, state: PlacementState, pod: str | None = None) -> Placement:
    """The placement as the RewardModelService status writes it."""
    return Placement(node=p.node, gpus=list(p.uuids), state=state, pod=pod)
