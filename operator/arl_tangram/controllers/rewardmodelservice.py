"""RewardModelService: the pure reconcile (replicas, demand and GPU inventories in; status and
operations out) and the controller that gathers its inputs and applies it.

Replicas are reward-runtime pods the operator owns. Where GPU nodes publish inventories (the node
agent's annotation, docs/gpu.md), each new replica is placed by ``gpu.placement.place_service`` on a
chunk of whole GPUs or one MIG instance that no other replica holds, and its pod is pinned to that
node with the device request of the operator's strategy (``TANGRAM_GPU_DEVICES``: the device
plugin's resources, or the exact UUIDs for GPUs the reward pool owns). A replica's devices are read
back from its pod on every round, so they survive an operator restart. When no node has published
an inventory (a cluster without the node agent), replicas ask the device plugin for the service's
GPUs as before and the plugin picks which; the Ready condition says so. The service scales to zero after
``idleTimeoutSeconds`` without requests when ``minReplicas`` is 0 (its weights stay in host memory
only in the sense that the next replica restores them: a scaled-to-zero service pays a cold start),
comes back on the first request, and grows by a replica while more requests wait than its ready
replicas batch at once. An edit of what a replica is built from (its template hash) is rolled out:
new replicas beside the old ones where GPUs are free, else one old replica at a time drained and
replaced in its place (``_rollout``); a drained replica finishes its calls before it goes, and one
whose spec an edit brings back serves again (``UndrainReplica``). A spec no node could hold even
with every GPU free (``never_fits``: a tensor-parallel size over any node's GPUs, more memory than
they hold, a MIG profile no node has, more minReplicas than fit) is ``Unschedulable`` (Ready and
Degraded), naming the field; ``InsufficientGPUs`` is for GPUs other replicas hold now.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from arl_tangram.api.rewardmodelservice import PlacementState, RewardModelService
from arl_tangram.api.validation import invalid_spec
from arl_tangram.controllers.conditions import (
    ConditionReason,
    ConditionType,
    Event,
    condition_events,
    refused_spec,
    set_condition,
)
from arl_tangram.controllers.failures import FailureStreaks, Stalls, Waits, backoff_s, cannot_start, outage
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.rewards import ACT_WINDOW_S, RewardRouter, ServiceStats
from arl_tangram.domain.actions import Outage
from arl_tangram.domain.batches import act_stats
from arl_tangram.domain.services import BUILTIN_SERVER_FLAGS, ServiceConfig, service_config
from arl_tangram.errors import InfrastructureError, InvalidSpec
from arl_tangram.gpu.inventory import InventoryError, NodeInventory
from arl_tangram.gpu.nodeinfo import ANNOTATION_INVENTORY, schedulable_inventory
from arl_tangram.gpu.placement import (
    DeviceStrategy,
    ReplicaPlacement,
    device_request,
    place_service,
    to_status,
)
from arl_tangram.runtime.interface import HostObservation
from arl_tangram.runtime.pods import SERVICE_LABEL, pinned, replica_devices

log = logging.getLogger(__name__)


PLACING_TTL_S = 60.0  # how long a created pod's devices stay taken before the watch shows the pod
# How long a drained replica's calls may run before it is deleted under them: its router then
# retries them on another replica (scoring has no side effect), so none is lost, and a call that
# hangs cannot hold a rollout for ever.
DRAIN_TIMEOUT_S = 120.0
DEVICE_PLUGIN_CHOICE = (
    "no node has published a GPU inventory (tangram node-agent, manifests/node-agent.yaml), so the "
    "device plugin chose the replicas' GPUs"
)


@dataclass(frozen=True)
class CreateReplica:
    reason: str
    # The devices chosen for it; None: no inventory was published, the device plugin chooses.
    placement: ReplicaPlacement | None = None


@dataclass(frozen=True)
class DeleteReplica:
    name: str
    reason: str


@dataclass(frozen=True)
class DrainReplica:
    """Route no new request to the replica; it is deleted once its calls are done (or after
    ``DRAIN_TIMEOUT_S``)."""

    name: str
    reason: str


@dataclass(frozen=True)
class UndrainReplica:
    """Route requests to a drained replica again: the spec it was drained for was edited back to the
    one it runs (its GPUs and warm weights serve at once; a new replica would pay a cold start)."""

    name: str
    reason: str


ServiceOperation = CreateReplica | DeleteReplica | DrainReplica | UndrainReplica
EventSink = Callable[[Mapping[str, Any], Event], None]
"""(the service's object, the Event) -> posted on that object (kopf's event queue, in the operator)."""


@dataclass(frozen=True)
class GpuView:
    """What placing replicas needs: the inventories of the GPU nodes that take new pods, the devices
    each replica pod of this service holds (read back from the pod, by pod name), the devices the
    replica pods of every other service hold (UUIDs), inventories that could not be read, and how
    many nodes published one at all (cordoned and NotReady ones too: 0 means no node agent runs)."""

    inventories: Sequence[NodeInventory] = ()
    held: Mapping[str, ReplicaPlacement] = field(default_factory=dict)
    taken: frozenset[str] = frozenset()
    problems: Sequence[str] = ()
    published: int = -1  # -1: as many as ``inventories``

    @property
    def any_published(self) -> bool:
        return self.published > 0 or (self.published < 0 and bool(self.inventories))


def gpu_view(
    key: str,
    nodes: Iterable[Mapping[str, Any]],
    replica_pods: Mapping[str, Iterable[Mapping[str, Any]]],
    tolerations: Sequence[Mapping[str, Any]] = (),
) -> GpuView:
    """The GPU view of service ``key`` from Node objects and every service's replica pods (plain
    dicts, as the API returns them; ``replica_pods`` by service key). Nodes whose taints the
    service's pods do not tolerate (``tolerations`` of its pod spec) take none of its replicas."""
    inventories, problems, published = [], [], 0
    for node in nodes:
        published += ANNOTATION_INVENTORY in ((node.get("metadata") or {}).get("annotations") or {})
        try:
            inv = schedulable_inventory(node, tolerations)
        except InventoryError as exc:
            problems.append(f"node {(node.get('metadata') or {}).get('name')}: {exc}")
            continue
        if inv is not None:
            inventories.append(inv)
    held: dict[str, ReplicaPlacement] = {}
    taken: set[str] = set()
    for service, pods in replica_pods.items():
        for pod in pods:
            devices = replica_devices(pod)
            if devices is None:
                continue
            if service == key:
                held[str((pod.get("metadata") or {}).get("name"))] = devices
            else:
                taken.update(devices.uuids)
    inventories.sort(key=lambda inv: inv.node)
    return GpuView(tuple(inventories), held, frozenset(taken), tuple(problems), published)


def never_fits(rms: RewardModelService, inventories: Sequence[NodeInventory]) -> str | None:
    """Why the service's spec cannot be served on these nodes even with every GPU free, naming the
    field to change; None when it can (then a shortage is only GPUs other replicas hold now, which
    may be given back). Pure: placement over the empty nodes, and again with one need relaxed."""
    if not inventories:
        return None
    gpu = rms.spec.gpu
    one = place_service(rms, inventories, 1, ())
    # (Node by node too: the GPU manager checks a replica's memory against every node's GPUs at
    # once, so beside smaller GPUs it places none where one node alone holds it. Not the spec's fault.)
    if not one.placements and not any(place_service(rms, [inv], 1, ()).placements for inv in inventories):
        whole = {inv.node: sum(not g.mig_enabled for g in inv.gpus) for inv in inventories}
        node, most = max(sorted(whole.items()), key=lambda kv: kv[1])
        need = gpu.memory
        if gpu.mig_profile is not None:
            offered = sorted({m.profile for inv in inventories for g in inv.gpus for m in g.mig_instances})
            if gpu.mig_profile not in offered:
                return (
                    f"spec.gpu.migProfile: no node has a MIG instance of profile {gpu.mig_profile} "
                    f"(profiles the nodes have: {', '.join(offered) or 'none'})"
                )
        elif min(gpu.count) > most:
            return (
                f"spec.gpu.count: a replica needs {min(gpu.count)} GPUs on one node (tensor parallel), "
                f"and the largest GPU node, {node}, has {most} whole GPUs"
            )
        relaxed = rms.model_copy(deep=True)
        relaxed.spec.gpu.memory = None
        if need is not None and place_service(relaxed, inventories, 1, ()).placements:
            if gpu.mig_profile is not None:
                mib = [m.memory_mib for i in inventories for g in i.gpus for m in g.mig_instances]
                holds = f"one {gpu.mig_profile} instance of any node (the largest holds"
                fix = "a larger spec.gpu.migProfile holds more"
            else:
                mib = [g.memory_mib for i in inventories for g in i.gpus]
                holds = f"{sorted(gpu.count)} GPUs of any node (the largest GPU holds"
                fix = "a larger spec.gpu.count spreads it over more GPUs"
            return (
                f"spec.gpu.memory: {need} per replica does not fit in {holds} {max(mib) / 1024:.0f} GiB); "
                + fix
            )
        relaxed.spec.gpu.nvlink = "Preferred"
        if gpu.nvlink == "Required" and place_service(relaxed, inventories, 1, ()).placements:
            return (
                f"spec.gpu.nvlink: Required, and no node has {sorted(gpu.count)} GPUs joined by NVLink "
                "(Preferred takes GPUs across PCIe)"
            )
        return f"spec.gpu: no node can hold one replica even with all its GPUs free ({one.reason})"
    least = rms.spec.scaling.min_replicas
    if least > 1:
        fits = place_service(rms, inventories, least, ())
        if fits.unplaced:
            return (
                f"spec.scaling.minReplicas: {least} replicas do not fit on the GPU nodes even with "
                f"every GPU free (they hold {len(fits.placements)})"
            )
    return None


@dataclass(frozen=True)
class ServiceObservation:
    replicas: Sequence[HostObservation]
    stats: ServiceStats | None
    now_mono: float
    conditions: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    resident: Mapping[str, bool] = field(default_factory=dict)
    # Replicas that failed in a row, and how long since the last: a replica that cannot start is not
    # recreated in a tight loop (back-off 5 s doubling to 5 min, as a kubelet's crash loop).
    failures: int = 0
    since_failure_s: float = float("inf")
    last_failure: str | None = None
    gpu: GpuView = field(default_factory=GpuView)
    # How long some replica has waited for a node: past ``UNSCHEDULABLE_AFTER_S`` its requests are
    # refused (as they are once a placed one has been stalled as long: ``HostObservation.stalled_s``).
    unschedulable_for_s: float = 0.0
    # How long, round after round, no GPU has been free for a replica the service wants.
    short_for_s: float = 0.0
    # Replicas the controller routes no new request to (``DrainReplica``), and for how long (s).
    draining: Mapping[str, float] = field(default_factory=dict)
    # Replicas the controller created that the pod watch does not show yet.
    coming: int = 0
    # Replicas the controller deleted that the pod watch still shows (it may show one ready until
    # its pod is marked terminating): never undrained (``UndrainReplica``), their runtime stopping.
    deleted: frozenset[str] = frozenset()


def reconcile_rewardmodelservice(
    rms: RewardModelService, cfg: ServiceConfig, observed: ServiceObservation, now: datetime
) -> tuple[dict[str, Any], list[ServiceOperation]]:
    """Status and operations for one service (pure). ``rms`` is the validated object ``cfg`` was made
    from (placement reads its ``spec.gpu``).

    Replicas built from an older spec (another template hash) are rolled out (``_rollout``): the
    service is sized on replicas of the current spec, so new ones start beside the old ones where
    GPUs are free (a surge), and an old one is drained, then deleted, once new ones are ready in its
    stead; where no GPU is free, one old replica at a time is drained and deleted to make room."""
    live = [r for r in observed.replicas if r.phase != "terminating"]
    ops: list[ServiceOperation] = []
    # An edit back to the spec a drained replica runs (A -> B -> A within a rollout): it serves again,
    # and the rollout goes on from there (the replica of B is now the old one). Left drained, it was
    # deleted and a new replica of A started from cold, while B's served.
    back = [
        r.name
        for r in live
        if r.name in observed.draining
        and r.name not in observed.deleted
        and r.phase == "ready"
        and r.template_hash == cfg.template_hash
    ]
    if back:
        ops += [UndrainReplica(name, "it runs the current spec again") for name in back]
        observed = replace(observed, draining={n: s for n, s in observed.draining.items() if n not in back})
    failed = [r for r in live if r.phase == "failed"]
    for r in failed:
        ops.append(DeleteReplica(r.name, f"replica failed: {r.failure}"))
    serving = [r for r in live if r.phase != "failed"]
    # Drained replicas still hold their GPUs and finish their calls, but take no new request.
    active = [r for r in serving if r.name not in observed.draining]
    ready = [r for r in active if r.phase == "ready"]
    current = [r for r in active if r.template_hash == cfg.template_hash]
    stats = observed.stats
    queued = stats.queued if stats else 0
    running = stats.running if stats else 0
    inflight = stats.inflight if stats else {}
    last = stats.last_active if stats else None
    recent = last is not None and observed.now_mono - last < cfg.idle_timeout_s
    busy = queued + running > 0 or recent
    desired = max(cfg.min_replicas, 1 if busy else 0)
    if queued > cfg.max_batch * max(1, len(ready)):
        # One more once every replica is ready; meanwhile the ones starting are kept (wanted no
        # more, they were deleted as surplus the round after they were made, and never served).
        desired = max(desired, len(active) + 1 if len(active) == len(ready) else len(current))
    desired = min(desired, cfg.max_replicas)
    holding = observed.since_failure_s < backoff_s(observed.failures)
    # Only replicas of the current spec count towards ``desired``: the older ones are replaced.
    wanted = 0 if holding else max(0, desired - len(current))
    why = f"{queued} request(s) waiting" if queued else "minReplicas"
    if wanted and len(current) < len(active):
        why = "rolling out the current spec"
    gpu = observed.gpu
    by_plugin = not gpu.any_published  # no inventory anywhere: the device plugin picks the devices
    short = ""  # what placement could not find
    unplaced = 0
    # Devices of this service's pods (even failed or terminating ones: held until the pod is gone)
    # and of every other service's are not handed out again.
    own = {u for r in observed.replicas if r.name in gpu.held for u in gpu.held[r.name].uuids}
    # A replica stopping or draining gives its GPUs back soon: no GPU free meanwhile is not a shortage.
    # (Only in a rollout: a pod that stays terminating otherwise must not hide a real shortage.)
    freeing = [
        r.name
        for r in observed.replicas
        if r.name in observed.draining or (r.phase == "terminating" and r.template_hash != cfg.template_hash)
    ]
    if by_plugin:
        ops.extend(CreateReplica(why) for _ in range(wanted))
    elif wanted:
        placed = place_service(rms, gpu.inventories, wanted, gpu.taken | own)
        ops.extend(CreateReplica(why, p) for p in placed.placements)
        unplaced = placed.unplaced
        if placed.unplaced and not freeing:
            short = placed.reason
            if not gpu.inventories:
                short = (
                    f"{wanted} replica(s) wait: none of the {gpu.published} node(s) with a GPU "
                    "inventory takes new pods (cordoned, not Ready, or tainted against the service's pods)"
                )
            if gpu.problems:
                short += "; unreadable inventories: " + "; ".join(gpu.problems)
    # A replica no node could hold even with every GPU free is no shortage that ends when other
    # replicas go: it says which field asks for the impossible (as a pool's Unschedulable does).
    impossible = never_fits(rms, gpu.inventories) if unplaced else None
    if impossible:
        short = impossible
    coming = observed.coming + sum(isinstance(o, CreateReplica) for o in ops)
    roll = _rollout(rms, cfg, observed, active, desired, unplaced, coming, own, by_plugin)
    ops += roll.ops
    if len(current) > desired:
        # Newest first, but those not serving yet before those that serve (sorted is stable): a
        # newer ready replica went before an older one still waiting for a node, leaving none ready.
        idle = sorted(
            (r for r in reversed(current) if not inflight.get(r.name)), key=lambda r: r.phase == "ready"
        )
        why = "idle for idleTimeoutSeconds" if desired < cfg.min_replicas + 1 else "surplus"
        for r in idle[: len(current) - desired]:
            ops.append(DeleteReplica(r.name, why))
    gen = cfg.generation
    conds = [dict(c) for c in observed.conditions]
    pending = [r for r in active if r.pending]
    stalled = cannot_start("replica", active)
    creating = sum(isinstance(o, CreateReplica) for o in ops)
    chosen_by = f"; {DEVICE_PLUGIN_CHOICE}" if by_plugin and (serving or creating) else ""
    if ready:
        conds = set_condition(
            conds,
            ConditionType.READY,
            True,
            ConditionReason.HOSTS_READY,
            f"{len(ready)} replica(s) serving{chosen_by}",
            gen,
            now,
        )
    elif not active and desired == 0:  # (drained replicas are on their way out)
        conds = set_condition(
            conds,
            ConditionType.READY,
            True,
            ConditionReason.SCALED_TO_ZERO,
            "no replicas while idle; the first request starts one "
            f"(cold-start budget {cfg.cold_start_budget_s:g} s)",
            gen,
            now,
        )
    elif impossible and not creating:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.UNSCHEDULABLE, impossible, gen, now
        )
    elif (
        freeing
        and roll.outdated
        and not creating
        and not any(r.phase == "starting" and not r.pending for r in active)
    ):
        # (desired > 0 here: a service scaling to zero is ScaledToZero above.)
        # The one replica (or the last ones) of an older spec makes room for its replacement (which,
        # where the device plugin places, waits for a node, its GPUs, meanwhile).
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.ROLLING_OUT,
            f"replacing {', '.join(freeing)} (an older spec) with a replica of the current spec, which "
            "starts once its GPUs are free; requests wait for it",
            gen,
            now,
        )
    elif short and not serving and not creating:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.INSUFFICIENT_GPUS, short, gen, now
        )
    elif pending:
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.UNSCHEDULABLE,
            f"replica {pending[0].name} cannot be placed: {pending[0].pending}",
            gen,
            now,
        )
    elif stalled:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.HOSTS_CANNOT_START, stalled, gen, now
        )
    else:
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.HOSTS_STARTING,
            f"{len(active) + creating} replica(s) starting{chosen_by}",
            gen,
            now,
        )
    if cfg.ignored_args:
        cur = next(c for c in conds if c.get("type") == ConditionType.READY.value)
        conds = set_condition(
            conds,
            ConditionType.READY,
            cur["status"] == "True",
            ConditionReason(cur["reason"]),
            f"{cur['message']}; server.args ignored: {' '.join(cfg.ignored_args)} (the builtin runtime "
            f"takes {', '.join(BUILTIN_SERVER_FLAGS)}; the operator sets the rest)",
            gen,
            now,
        )
    updated = sum(r.template_hash == cfg.template_hash for r in serving)
    if roll.outdated:
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            True,
            ConditionReason.ROLLING_OUT,
            f"{updated} of {len(serving)} replica(s) run the current spec (generation {gen}); "
            f"{roll.outdated} of an older spec are being replaced: {roll.how}"
            + (f"; {short}" if short else ""),
            gen,
            now,
        )
    else:
        scaling = wanted > 0 or len(ready) < len(active)
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            scaling,
            ConditionReason.SCALING_UP if scaling else ConditionReason.STEADY,
            f"{len(serving)} replica(s), {desired} wanted" + (f"; {short}" if short else ""),
            gen,
            now,
        )
    if impossible:
        conds = set_condition(
            conds, ConditionType.DEGRADED, True, ConditionReason.UNSCHEDULABLE, impossible, gen, now
        )
    elif failed or holding:
        cause = failed[0].failure if failed else observed.last_failure
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.HOSTS_FAILED,
            f"{max(1, observed.failures)} replica(s) failed in a row, last: {cause}; next try after "
            f"{backoff_s(observed.failures):g} s",
            gen,
            now,
        )
    elif stalled:
        conds = set_condition(
            conds, ConditionType.DEGRADED, True, ConditionReason.HOSTS_CANNOT_START, stalled, gen, now
        )
    else:
        conds = set_condition(
            conds, ConditionType.DEGRADED, False, ConditionReason.HEALTHY, "no failed replicas", gen, now
        )
    placements = []
    for r in serving:
        held = gpu.held.get(r.name)
        node = r.node or (held.node if held else "")
        if not node:
            continue
        state: PlacementState = "Resident" if observed.resident.get(r.name, r.phase == "ready") else "Evicted"
        uuids = held.uuids if held else ()  # none where the device plugin chose
        placement = to_status(ReplicaPlacement(node, (), uuids), state, r.name)
        # gpus always written, [] included: a merge patch leaves out what is not in it.
        placements.append({**placement.model_dump(mode="json", exclude_none=True), "gpus": list(uuids)})
    act = act_stats(stats.act_recent_s, ACT_WINDOW_S) if stats else None
    status = {
        "observedGeneration": gen,
        "conditions": conds,
        "replicas": len(serving),
        "readyReplicas": len(ready),
        "updatedReplicas": updated,
        "selector": f"{SERVICE_LABEL}={cfg.name}",
        "placements": placements,
        "queueDepth": queued,
        "act": act.model_dump(by_alias=True) if act else None,
    }
    return status, ops


def service_events(
    ops: Sequence[ServiceOperation],
    before: Sequence[Mapping[str, Any]],
    after: Sequence[Mapping[str, Any]],
    generation: int | None,
) -> list[Event]:
    """The Events of one round (pure), as a pool's: replicas added and removed, a replica drained,
    and a rollout's start and end (``before`` and ``after``: the conditions the service's status
    held, and those of this round). ``kubectl describe`` showed nothing of a rollout but its
    current condition, and nothing at all once it was over."""
    out: list[Event] = []

    def rolling(conds: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        return next(
            (
                c
                for c in conds
                if c.get("type") == ConditionType.SCALING.value
                and c.get("reason") == ConditionReason.ROLLING_OUT.value
            ),
            None,
        )

    was, now_rolling = rolling(before), rolling(after)
    if now_rolling is not None and was is None:
        out.append(
            Event("Normal", ConditionReason.ROLLING_OUT.value, f"rolling out: {now_rolling.get('message')}")
        )
    creates = [op for op in ops if isinstance(op, CreateReplica)]
    if creates:
        out.append(
            Event(
                "Normal",
                ConditionReason.SCALING_UP.value,
                f"adding {len(creates)} replica(s): {creates[0].reason}",
            )
        )
    for op in ops:
        if isinstance(op, DrainReplica):
            out.append(Event("Normal", "ReplicaDraining", f"draining replica {op.name}: {op.reason}"))
        elif isinstance(op, UndrainReplica):
            out.append(Event("Normal", "ReplicaUndrained", f"replica {op.name} serves again: {op.reason}"))
        elif isinstance(op, DeleteReplica):
            kind = "Warning" if op.reason.startswith("replica failed") else "Normal"
            out.append(Event(kind, "ReplicaRemoved", f"removing replica {op.name}: {op.reason}"))
    if was is not None and now_rolling is None:
        out.append(
            Event("Normal", "RolledOut", f"every replica runs the current spec (generation {generation})")
        )
    return out


@dataclass(frozen=True)
class _Rollout:
    ops: list[ServiceOperation]
    outdated: int  # replicas of an older spec still there (draining ones included)
    how: str  # what the rollout does now, for the Scaling condition


def _rollout(
    rms: RewardModelService,
    cfg: ServiceConfig,
    observed: ServiceObservation,
    active: Sequence[HostObservation],
    desired: int,
    unplaced: int,
    coming: int,
    own: set[str],
    by_plugin: bool,
) -> _Rollout:
    """Replace replicas of an older spec (the reward runtime reads its services file only at
    start, so a replica serves the spec it was made with for as long as it lives).

    - A drained replica is deleted once its calls are done (the router keeps counting them after
      it stops routing to it), or after ``DRAIN_TIMEOUT_S`` (its calls are then retried elsewhere).
    - An old replica that is not ready serves nothing: deleted at once, freeing its GPUs.
    - Surge: the new replicas the reconcile created beside the old ones take over as they get
      ready; as many old ones are drained as leave ``desired`` ready replicas.
    - Replace: when no GPU is free for a new replica (placement found none, or, where the device
      plugin places, the new pod waits for a node) and nothing is under way (no replica draining
      or stopping, no new one starting), one old ready replica is drained to make room: one whose
      GPUs would hold a new replica, where inventories say; never the last ready one of a service
      that wants more than one, nor while a new one is coming (only a service of one replica has a
      gap, its cold start).
    """
    ops: list[ServiceOperation] = []
    stats = observed.stats
    inflight = stats.inflight if stats else {}
    draining = [r for r in observed.replicas if r.name in observed.draining and r.phase != "terminating"]
    old = [r for r in active if r.template_hash != cfg.template_hash]
    outdated = sum(r.phase != "failed" and r.template_hash != cfg.template_hash for r in observed.replicas)
    stopping = [r for r in observed.replicas if r.phase == "terminating"]
    for r in draining:
        calls = inflight.get(r.name, 0)
        if r.phase == "failed":
            continue  # the failed path deletes it
        if not calls:
            ops.append(DeleteReplica(r.name, "drained: its calls are done"))
        elif observed.draining[r.name] >= DRAIN_TIMEOUT_S:
            ops.append(
                DeleteReplica(
                    r.name, f"drained for {DRAIN_TIMEOUT_S:g} s; its {calls} call(s) are retried elsewhere"
                )
            )
    if not old:
        names = ", ".join(r.name for r in (*draining, *stopping) if r.template_hash != cfg.template_hash)
        return _Rollout(ops, outdated, f"{names} making room for a replica of the current spec")
    for r in old:
        if r.phase != "ready":
            ops.append(
                DeleteReplica(r.name, "built from an older spec, not serving: replaced by the new one")
            )
    old_ready = sorted(
        (r for r in old if r.phase == "ready"), key=lambda r: (inflight.get(r.name, 0), r.created_at, r.name)
    )
    new_ready = [r for r in active if r.template_hash == cfg.template_hash and r.phase == "ready"]
    surplus = max(0, len(new_ready) + len(old_ready) - desired)
    for r in old_ready[:surplus]:
        ops.append(
            DrainReplica(r.name, "built from an older spec: replaced by a ready replica of the new one")
        )
    if surplus:
        return _Rollout(ops, outdated, f"draining {', '.join(r.name for r in old_ready[:surplus])}")
    starting = [r for r in active if r.template_hash == cfg.template_hash and r.phase == "starting"]
    no_room = unplaced > 0 or (by_plugin and any(r.pending for r in starting))
    if draining or stopping:
        names = ", ".join(r.name for r in (*draining, *stopping))
        return _Rollout(ops, outdated, f"{names} making room for a replica of the current spec")
    if not no_room or coming or any(not r.pending for r in starting):
        # (``coming``: created this round, or earlier and not in the pod watch yet.)
        return _Rollout(ops, outdated, "new replicas start beside the old ones; they take over once ready")
    gpu = observed.gpu
    for r in old_ready:
        others = [o for o in active if o is not r]
        if not any(o.phase == "ready" for o in others) and (
            desired > 1 or any(not o.pending for o in others)
        ):
            # It would leave no replica ready: never in a service that wants more than one (the
            # replica replaced in place before it has not got ready: its new pod may never fit, and
            # the service would be left with none), nor while a new one is on its way.
            continue
        held = gpu.held.get(r.name)
        if not by_plugin and held is not None:
            room = place_service(rms, gpu.inventories, 1, (gpu.taken | own) - set(held.uuids))
            if not room.placements:
                continue  # its GPUs would not hold a replica of the new spec
        ops.append(
            DrainReplica(
                r.name, "built from an older spec; no GPU free for the new one: replaced in its place"
            )
        )
        return _Rollout(ops, outdated, f"no GPU free for a new replica: replacing {r.name} in its place")
    return _Rollout(
        ops,
        outdated,
        "no GPU free for a replica of the new spec, even in place of one old replica; the old ones "
        "keep serving (free GPUs, or scale the service down, to let it go on)",
    )


def unplaceable(conditions: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the service's status says no GPU takes a replica (none free now: Ready ``InsufficientGPUs``;
    none ever on these nodes: Degraded ``Unschedulable``, naming the field), or None."""
    found = {c.get("type"): c for c in conditions}
    ready, degraded = found.get(ConditionType.READY.value, {}), found.get(ConditionType.DEGRADED.value, {})
    if degraded.get("status") == "True" and degraded.get("reason") == ConditionReason.UNSCHEDULABLE.value:
        return str(degraded.get("message"))
    if ready.get("reason") == ConditionReason.INSUFFICIENT_GPUS.value:
        return str(ready.get("message"))
    return None


def service_outage(
    cfg: ServiceConfig,
    observed: ServiceObservation,
    conditions: Sequence[Mapping[str, Any]],
    ops: Sequence[ServiceOperation],
) -> Outage | None:
    """Why the service can score nothing now and will not soon, or None (``failures.outage``; no
    GPU free for a replica counts where the new ``conditions`` say ``InsufficientGPUs``, for
    ``observed.short_for_s``): its waiting requests are then refused with this message, not held
    for the cold-start budget. ``ops``: this round's (a replica created is coming)."""
    ready = next((c for c in conditions if c.get("type") == ConditionType.READY.value), {})
    if ready.get("reason") == ConditionReason.ROLLING_OUT.value:
        # An old replica makes room for its replacement: its requests wait for it (the new pod
        # waiting for a node meanwhile, for the old one's GPUs, is no sign that none can start).
        return None
    short = unplaceable(conditions)
    return outage(
        f"RewardModelService {cfg.key} has no replica",
        "replica",
        [r for r in observed.replicas if r.phase != "terminating"],
        coming=any(isinstance(op, CreateReplica) for op in ops),
        unplaceable=short,
        unplaceable_for_s=observed.short_for_s,
        unplaced_for_s=observed.unschedulable_for_s,
        failures=observed.failures,
        since_failure_s=observed.since_failure_s,
        last_failure=observed.last_failure,
    )


class ServiceController:
    """Gathers one service's observations, runs the reconcile and applies it."""

    def __init__(
        self,
        router: RewardRouter,
        runtime: Any,
        client: AgentClient,
        device: str,
        strategy: DeviceStrategy = "device-plugin",
        emit: EventSink | None = None,
    ) -> None:
        self.router = router
        self.emit: EventSink = emit or (lambda body, event: None)
        # Service -> the generation whose refusal was posted as an Event (once per generation).
        self._refused: dict[str, Any] = {}
        self.runtime = runtime
        self.client = client
        self.device = device
        self.strategy = strategy
        # Replicas that failed in a row: the reconcile's crash-loop back-off (it was never fed, so a
        # replica that could not start was recreated at once, every time).
        self._failures = FailureStreaks()
        self._unplaced = Waits()  # replicas with no node yet
        self._stalled = Stalls()  # placed replicas whose container cannot start
        self._short = Waits()  # no GPU free for a replica
        # Devices of pods created but not yet seen in the pod watch (pod name -> devices, when): taken
        # for every service meanwhile, so that two services reconciled back to back are not given the
        # same devices. Only for that gap: the pods themselves are the record.
        self._placing: dict[str, tuple[ReplicaPlacement, float]] = {}
        # Service -> its last accepted spec (the validated object and its config): what keeps running
        # while an edit makes its spec invalid.
        self._accepted: dict[str, tuple[RewardModelService, ServiceConfig]] = {}
        # Service -> its replicas drained for a rollout (pod name -> since when): routed no new
        # request until they are deleted. In memory, as the router's calls are: a new leader has
        # none of the old one's calls in flight, and drains again what its reconcile picks.
        self._draining: dict[str, dict[str, float]] = {}
        # Service -> replicas created and not yet in the pod watch (pod name -> when): on their way,
        # so that a rollout does not drain an old replica for room a new one already has.
        self._created: dict[str, dict[str, float]] = {}
        # Service -> replicas deleted whose pods the watch still lists: never undrained.
        self._deleted: dict[str, set[str]] = {}
        self.clock: Callable[[], float] = time.monotonic

    async def reconcile(
        self,
        body: Mapping[str, Any],
        nodes: Iterable[Mapping[str, Any]] = (),
        replica_pods: Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """One round: ``nodes`` are the cluster's Node objects and ``replica_pods`` every service's
        replica pods by service key (both from the operator's watches)."""
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        now = datetime.now(UTC)
        conditions = status.get("conditions") or ()
        refusal: str | None = None
        try:
            model = RewardModelService.model_validate(
                {"metadata": dict(meta), "spec": body.get("spec") or {}}
            )
            cfg = service_config(model, uid=str(meta.get("uid", "")))
        except (ValidationError, InvalidSpec) as exc:
            refusal = str(invalid_spec(exc) if isinstance(exc, ValidationError) else exc)
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            if self._refused.get(key) != (meta.get("uid"), meta.get("generation")):
                self._refused[key] = (meta.get("uid"), meta.get("generation"))
                self.emit(body, Event("Warning", ConditionReason.INVALID_SPEC.value, refusal))
            # As a pool's (``PoolController.reconcile``): the last spec accepted for this very
            # service keeps serving, and the service keeps being looked after by it; with none
            # (the operator started since), it serves nothing until it is fixed.
            kept = self._accepted.get(f"{meta.get('namespace')}/{meta.get('name')}")
            if kept is None or kept[1].uid != str(meta.get("uid", "")) or not self.router.has(kept[1].key):
                return _invalid(meta.get("generation"), conditions, refusal, now)
            model, cfg = kept
        else:
            self._accepted[cfg.key] = (model, cfg)
            self._refused.pop(cfg.key, None)
            self.router.upsert(cfg)
        await self.runtime.ensure_services_file(cfg)
        replicas = self.runtime.replicas(cfg.key)
        clock = self.clock()
        listed = {r.name for r in replicas}
        draining = self._draining.setdefault(cfg.key, {})
        for name in [n for n in draining if n not in listed]:
            del draining[name]  # its pod is gone
        deleted = self._deleted.setdefault(cfg.key, set())
        deleted &= listed
        created = self._created.setdefault(cfg.key, {})
        for name, since in list(created.items()):
            if name in listed or clock - since > PLACING_TTL_S:
                del created[name]
        self._sync(cfg, replicas)
        resident = await self._residency(cfg, replicas)
        streak = self._failures.observe(cfg.key, replicas)
        gpu = gpu_view(cfg.key, nodes, replica_pods or {}, (cfg.pod_spec or {}).get("tolerations") or ())
        gpu = replace(gpu, taken=gpu.taken | self._in_flight(replica_pods or {}))
        for problem in gpu.problems:
            log.warning("service %s: %s", cfg.key, problem)
        # Stalled only once a replica has been for long enough (Stalls says why).
        observed = ServiceObservation(
            self._stalled.observe(cfg.key, replicas),
            self.router.stats(cfg.key),
            self.router.clock(),
            conditions,
            resident,
            failures=streak.count,
            since_failure_s=streak.since_s,
            last_failure=streak.last,
            gpu=gpu,
            unschedulable_for_s=self._unplaced.observe(cfg.key, any(r.pending for r in replicas)),
            draining={name: clock - since for name, since in draining.items()},
            coming=len(created),
            deleted=frozenset(deleted),
        )
        new_status, ops = reconcile_rewardmodelservice(model, cfg, observed, now)
        short = unplaceable(new_status["conditions"]) is not None
        observed = replace(observed, short_for_s=self._short.observe(cfg.key, short))
        self.router.set_outage(cfg.key, service_outage(cfg, observed, new_status["conditions"], ops))
        for op in ops:
            if isinstance(op, CreateReplica):
                # A placed replica's pod carries its node and devices (read back next round).
                name = f"{cfg.name}-{secrets.token_hex(3)}"
                replica = cfg
                if op.placement is not None:
                    replica = pinned(cfg, device_request(op.placement, self.strategy))
                    self._placing[name] = (op.placement, self.clock())
                await self.runtime.create_replica(replica, name, self.device)
                created[name] = self.clock()
            elif isinstance(op, DrainReplica):
                log.info("service %s: draining replica %s: %s", cfg.key, op.name, op.reason)
                draining[op.name] = self.clock()
            elif isinstance(op, UndrainReplica):
                log.info("service %s: replica %s serves again: %s", cfg.key, op.name, op.reason)
                draining.pop(op.name, None)
            else:
                if op.name in draining:
                    log.info("service %s: deleting replica %s: %s", cfg.key, op.name, op.reason)
                # (A drained one stays drained until its pod is gone from the watch: until the
                # watch shows it terminating, it may still look ready there.)
                deleted.add(op.name)
                await self.runtime.delete_replica(cfg, op.name)
        # At once, not next round: a drained replica gets no new call from now on, and a deleted one
        # none while its pod stops.
        gone = {op.name for op in ops if isinstance(op, DeleteReplica)}
        self._sync(cfg, [r for r in replicas if r.name not in gone])
        live = self.router.has(cfg.key)
        if not live:
            self._forget(cfg.key)  # deleted during the round, which put some of its state back
        events = service_events(ops, conditions, new_status["conditions"], cfg.generation) if live else []
        if refusal is not None:
            new_status = refused_spec(
                new_status, conditions, meta.get("generation"), cfg.generation, refusal, now, "service"
            )
        if live:  # a deleted service's Events would be posted on an object that is gone
            events += condition_events(conditions, new_status["conditions"])
        for event in events:
            self.emit(body, event)
        return new_status

    def _sync(self, cfg: ServiceConfig, replicas: Sequence[HostObservation]) -> None:
        """Route the service's requests to its ready replicas that are not drained."""
        draining = self._draining.get(cfg.key, {})
        self.router.sync(
            cfg.key,
            [
                (r.name, r.address)
                for r in replicas
                if r.phase == "ready" and r.address and r.name not in draining
            ],
        )

    def deleted(self, key: str) -> None:
        """The service is gone: the router and the waits forget it."""
        self.router.remove(key)
        self._forget(key)

    def _forget(self, key: str) -> None:
        # (The failure streak too: a service made again under the name, fixed, would otherwise wait
        # out the back-off of the deleted one's crash loop before its first replica.)
        self._accepted.pop(key, None)
        self._refused.pop(key, None)
        self._draining.pop(key, None)
        self._created.pop(key, None)
        self._deleted.pop(key, None)
        self._failures.forget(key)
        for waits in (self._unplaced, self._stalled, self._short):
            waits.forget(key)

    def _in_flight(self, replica_pods: Mapping[str, Iterable[Mapping[str, Any]]]) -> frozenset[str]:
        """UUIDs of the pods this controller created that the watch has not shown yet (forgotten once
        it has, or after ``PLACING_TTL_S`` for a create that failed)."""
        seen = {str((p.get("metadata") or {}).get("name")) for pods in replica_pods.values() for p in pods}
        now = self.clock()
        for name, (_, since) in list(self._placing.items()):
            if name in seen or now - since > PLACING_TTL_S:
                del self._placing[name]
        return frozenset(u for placement, _ in self._placing.values() for u in placement.uuids)

    async def _residency(self, cfg: ServiceConfig, replicas: Sequence[HostObservation]) -> dict[str, bool]:
        """Whether each ready replica holds the weights on its device (its runtime's own word)."""
        out: dict[str, bool] = {}
        for r in replicas:
            if r.phase != "ready" or not r.address:
                continue
            try:
                health = await self.client.health(r.address)
            except InfrastructureError:
                continue
            out[r.name] = cfg.name in (health.get("resident") or [])
        return out


def _invalid(
    generation: Any, conditions: Sequence[Mapping[str, Any]], message: str, now: datetime
) -> dict[str, Any]:
    conds = set_condition(
        conditions, ConditionType.READY, False, ConditionReason.INVALID_SPEC, message, generation, now
    )
    return {"observedGeneration": generation, "conditions": conds}
