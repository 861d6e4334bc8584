"""ActionPool: the pure reconcile (observed hosts + the planner's decision -> status and operations),
and the controller that gathers the observations and applies the operations.

The planner decides how many hosts a pool needs and which ones drain or go (it never removes a host
with running actions or pinned sessions); the reconcile adds what only it knows: failed and
unhealthy hosts are replaced, hosts built from an older template are rolled (idle ones first, and a
busy one only by draining it, so no running action is killed), and the status and conditions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.api.meta import ActStats
from arl_tangram.api.validation import invalid_spec
from arl_tangram.controllers.conditions import (
    ConditionReason,
    ConditionType,
    Event,
    condition_events,
    refused_spec,
    set_condition,
)
from arl_tangram.controllers.failures import (
    UNSCHEDULABLE_AFTER_S,
    FailureStreaks,
    Rejection,
    Rejections,
    Stalls,
    Waits,
    backoff_s,
    cannot_start,
    outage,
)
from arl_tangram.dispatch.dispatcher import ACT_WINDOW_S, Dispatcher, HostEndpoint, PoolStats
from arl_tangram.domain.actions import OUTAGE_RETRY_MIN_S, Outage
from arl_tangram.domain.batches import act_stats
from arl_tangram.domain.pools import HostRejected, PoolConfig, pool_config, pool_key
from arl_tangram.errors import InfrastructureError, InvalidSpec
from arl_tangram.planner.capacity_planner import CapacityPlanner
from arl_tangram.planner.plan import ScalingPlan
from arl_tangram.planner.snapshot import ClusterSnapshot, InstanceSnapshot, NodeSnapshot, PoolDemand
from arl_tangram.runtime.interface import HostObservation, Runtime
from arl_tangram.runtime.pods import POOL_LABEL, new_host_name

log = logging.getLogger(__name__)


# ---- operations -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CreateHost:
    node: str | None
    reason: str


@dataclass(frozen=True)
class DeleteHost:
    name: str
    reason: str


@dataclass(frozen=True)
class SetDraining:
    name: str
    draining: bool
    reason: str


Operation = CreateHost | DeleteHost | SetDraining | Event


@dataclass(frozen=True)
class PoolObservation:
    """What one round of the pool's reconcile sees."""

    hosts: Sequence[HostObservation]
    stats: PoolStats | None
    plan: ScalingPlan | None
    conditions: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    unschedulable_for_s: float = 0.0
    # How long the planner has found no node for a host of the pool, round after round.
    unplaceable_for_s: float = 0.0
    resize_refusal: str | None = None
    # Hosts that failed in a row and how long since the last: no new host is started until the
    # back-off has passed (5 s doubling to 5 min, as a kubelet's crash loop), so a template whose
    # agent cannot start does not churn pods.
    failures: int = 0
    since_failure_s: float = float("inf")
    last_failure: str | None = None
    # Languages of spec.languages the hosts' agents find no toolchain for (their /v1/health), each
    # with why (the binary missing).
    missing_languages: Mapping[str, str] = field(default_factory=dict)
    # The API server's refusals of the pool's host pods in a row, this generation (``Rejections``):
    # no host is created until the back-off after the last has passed.
    rejection: Rejection | None = None


def rejected_hosts(observed: PoolObservation) -> str | None:
    """The API server's refusal of the pool's host pods, as a message to act on; None without one."""
    r = observed.rejection
    if r is None:
        return None
    return (
        f"the API server refused {r.count} host pod(s) in a row, last: {r.message}; fix what it names "
        f"(spec.template, spec.isolation, or the namespace's quota or admission rules): another is "
        f"tried {backoff_s(r.count):g} s after the last, or at once when the spec changes"
    )


def _rejection_holds(observed: PoolObservation) -> bool:
    """Whether the back-off after the API server's last refusal keeps new hosts from being created."""
    r = observed.rejection
    return r is not None and r.since_s < backoff_s(r.count)


def pinned_to_zero(cfg: PoolConfig) -> str | None:
    """Why the pool may run no host at all (``/scale``'s replicas 0 and ``minHosts: 0``: the bounds
    pin it to none, and no action starts one), as a message; None when a host may run."""
    if cfg.mode == "dedicated" or cfg.replicas != 0 or cfg.desired_bounds[1] > 0:
        return None
    return (
        f"pinned to 0 hosts by /scale (spec.replicas: 0): no host starts, so no action runs, until it "
        f"is scaled up (kubectl scale actionpool/{cfg.name} --replicas=N)"
    )


# The agent's own runtimes: every host runs them (its health lists the toolchains of the others).
_BUILT_IN_LANGUAGES = ("python", "bash")


def missing_languages(declared: Sequence[str], health: Mapping[str, Any]) -> dict[str, str]:
    """Of ``declared`` (spec.languages), those a host's agent runs no program of, by its
    ``/v1/health``, each with why (the binary it lacks). A pool declaring ``lean``, which the
    schema allows and no image here runs, showed Healthy and failed every lean action."""
    languages = health.get("languages")
    if not isinstance(languages, Mapping):
        return {}  # an agent that does not say
    found, missing = languages.get("found") or {}, languages.get("missing") or {}
    return {
        lang: str(missing.get(lang) or "the agent has no runner for it")
        for lang in declared
        if lang not in _BUILT_IN_LANGUAGES and lang not in found
    }


def pool_outage(cfg: PoolConfig, observed: PoolObservation, ops: Sequence[Operation]) -> Outage | None:
    """Why the pool can run nothing now and will not soon, or None (``failures.outage``): its
    waiting actions are then refused with this message, instead of waiting for a host that is not
    coming until their callers give up. ``ops``: this round's (a host added or brought back is
    coming; the planner places what fits and says "no room" for the rest in the same round)."""
    coming = any(
        isinstance(op, CreateHost) or (isinstance(op, SetDraining) and not op.draining) for op in ops
    )
    live = [h for h in observed.hosts if h.phase != "terminating"]
    pinned = pinned_to_zero(cfg)
    if pinned and not coming and not any(h.phase == "ready" for h in live):
        # Scaling up is a person's (or an autoscaler's, fed by the refused callers, who count as
        # queued) act that may come any moment: sent again soon.
        return Outage(f"pool {cfg.key} has no host: {pinned}", OUTAGE_RETRY_MIN_S)
    if cfg.mode == "dedicated":
        # A pod serves one session for its life: one a session holds is no host for a new one.
        used = _used(observed.stats)
        live = [dataclasses.replace(h, phase="draining") if h.name in used else h for h in live]
    return outage(
        f"pool {cfg.key} has no host",
        "host",
        live,
        coming=coming,
        unplaceable=_unplaceable(cfg, observed.plan),
        unplaceable_for_s=observed.unplaceable_for_s,
        unplaced_for_s=observed.unschedulable_for_s,
        failures=observed.failures,
        since_failure_s=observed.since_failure_s,
        last_failure=observed.last_failure,
        rejected=rejected_hosts(observed),
        rejected_retry_s=(
            backoff_s(observed.rejection.count) - observed.rejection.since_s if observed.rejection else 0.0
        ),
    )


def reconcile_actionpool(
    cfg: PoolConfig, observed: PoolObservation, now: datetime
) -> tuple[dict[str, Any], list[Operation]]:
    """Status and operations for one pool (pure: same inputs, same answer)."""
    ops: list[Operation] = []
    stats = observed.stats
    live = [h for h in observed.hosts if h.phase != "terminating"]
    unhealthy = stats.unhealthy if stats else frozenset()
    gone: set[str] = set()
    for h in live:
        if h.phase == "failed":
            ops.append(DeleteHost(h.name, f"host failed: {h.failure}"))
            gone.add(h.name)
        elif h.name in unhealthy:
            ops.append(DeleteHost(h.name, "host unhealthy: its agent failed repeated calls"))
            gone.add(h.name)
    plan = observed.plan
    outdated = {h.name for h in live if h.template_hash != cfg.template_hash}
    if plan is not None:
        for r in plan.removals:
            if r.pool == cfg.key and r.name not in gone:
                ops.append(DeleteHost(r.name, r.reason.message))
                gone.add(r.name)
        for d in plan.drains:
            if d.pool == cfg.key and d.name not in gone:
                ops.append(SetDraining(d.name, True, d.reason.message))
        for u in plan.undrains:
            if u.pool == cfg.key and u.name not in gone and u.name not in outdated:
                ops.append(SetDraining(u.name, False, u.reason.message))
        for a in plan.adds:
            if a.pool == cfg.key:
                ops.append(CreateHost(a.node, a.reason.message))
    if cfg.mode == "dedicated":
        ops += _dedicated(cfg, live, gone, stats)
    ops += _rollout(cfg, live, outdated, gone, stats)
    if observed.since_failure_s < backoff_s(observed.failures) or _rejection_holds(observed):
        ops = [op for op in ops if not isinstance(op, CreateHost)]
    for op in ops:
        if isinstance(op, CreateHost):
            ops.append(Event("Normal", "ScalingUp", f"adding a host: {op.reason}"))
            break
    for op in list(ops):
        if isinstance(op, DeleteHost):
            kind = "Warning" if op.reason.startswith("host ") else "Normal"
            ops.append(Event(kind, "HostRemoved", f"removing host {op.name}: {op.reason}"))
    return _status(cfg, live, observed, ops, now), ops


def _used(stats: PoolStats | None) -> set[str]:
    """Hosts that run an action or hold a session (a dedicated pod's: its one trajectory)."""
    loads = stats.hosts if stats else {}
    return {h for h, load in loads.items() if load.running or load.sessions}


def _dedicated(
    cfg: PoolConfig, live: Sequence[HostObservation], gone: set[str], stats: PoolStats | None
) -> list[Operation]:
    """One pod per session, created for a session that waits for one and deleted when its session
    has ended (a pod is never handed to a second trajectory: that is the layout this mode keeps)."""
    ops: list[Operation] = []
    used = _used(stats)
    for h in live:
        if h.name in gone:
            continue
        retired = h.phase == "draining" or (stats is not None and h.name in stats.retired)
        if retired and h.name not in used:
            ops.append(DeleteHost(h.name, "its session ended"))
            gone.add(h.name)
    fresh = [
        h for h in live if h.name not in gone and h.name not in used and h.phase in ("starting", "ready")
    ]
    waiting = stats.waiting_trajectories if stats else 0
    room = (cfg.max_sessions or cfg.max_hosts) - sum(1 for h in live if h.name not in gone)
    for _ in range(max(0, min(waiting - len(fresh), room))):
        ops.append(CreateHost(None, "a session waits for its pod"))
    return ops


def _rollout(
    cfg: PoolConfig,
    live: Sequence[HostObservation],
    outdated: set[str],
    gone: set[str],
    stats: PoolStats | None,
) -> list[Operation]:
    """Replace hosts built from an older template. The planner never sees them (see
    :func:`snapshot`), so it adds hosts of the new template as if they were not there (a surge);
    meanwhile an outdated host is deleted once it holds nothing (a starting or idle one at once,
    a busy one is drained first and deleted when its running actions and sessions are done). No
    running action is killed, and capacity never drops below what the new hosts give."""
    ops: list[Operation] = []
    loads = stats.hosts if stats else {}
    for h in live:
        if h.name not in outdated or h.name in gone:
            continue
        load = loads.get(h.name)
        busy = load is not None and (load.running > 0 or load.sessions > 0)
        if h.phase == "starting" or not busy:
            ops.append(DeleteHost(h.name, "built from an older template: replaced by the new one"))
        elif h.phase == "ready":
            ops.append(SetDraining(h.name, True, "built from an older template: draining before replacement"))
    return ops


def _status(
    cfg: PoolConfig,
    live: Sequence[HostObservation],
    observed: PoolObservation,
    ops: Sequence[Operation],
    now: datetime,
) -> dict[str, Any]:
    stats = observed.stats
    ready = [h for h in live if h.phase == "ready"]
    starting = [h for h in live if h.phase == "starting"]
    failed = [h for h in live if h.phase == "failed"]
    pending = [h for h in starting if h.pending]
    gen = cfg.generation
    conds: list[dict[str, Any]] = [dict(c) for c in observed.conditions]
    act: ActStats | None = act_stats(stats.act_recent_s, ACT_WINDOW_S) if stats else None
    queue = stats.queued_actions if stats else 0
    lo, _ = cfg.desired_bounds
    stuck = bool(pending) and observed.unschedulable_for_s >= UNSCHEDULABLE_AFTER_S
    stalled = cannot_start("host", starting)
    unplaceable = _unplaceable(cfg, observed.plan)
    rejected = rejected_hosts(observed)
    pinned = pinned_to_zero(cfg)
    if ready:
        conds = set_condition(
            conds,
            ConditionType.READY,
            True,
            ConditionReason.HOSTS_READY,
            f"{len(ready)} host(s) ready",
            gen,
            now,
        )
    elif rejected and not starting:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.HOSTS_REJECTED, rejected, gen, now
        )
    elif pinned and not starting:
        # Not Ready: an action sent to it does not run (idle or not), unlike a pool scaled to zero.
        waiting = f", while {queue} action(s) wait" if queue else ""
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.PINNED_TO_ZERO, pinned + waiting, gen, now
        )
    elif unplaceable and not starting:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.UNSCHEDULABLE, unplaceable, gen, now
        )
    elif stuck:
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.UNSCHEDULABLE,
            f"no node can hold a host of this pool: {pending[0].pending}",
            gen,
            now,
        )
    elif stalled:
        conds = set_condition(
            conds, ConditionType.READY, False, ConditionReason.HOSTS_CANNOT_START, stalled, gen, now
        )
    elif lo == 0 and not starting:
        conds = set_condition(
            conds,
            ConditionType.READY,
            True,
            ConditionReason.SCALED_TO_ZERO,
            "no hosts while idle; the first action starts one",
            gen,
            now,
        )
    else:
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.HOSTS_STARTING,
            f"{len(starting)} host(s) starting, none ready yet",
            gen,
            now,
        )
    creates = sum(1 for op in ops if isinstance(op, CreateHost))
    drains = sum(1 for op in ops if isinstance(op, SetDraining) and op.draining)
    outdated = sum(1 for h in live if h.template_hash != cfg.template_hash)
    if outdated:
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            True,
            ConditionReason.ROLLING_OUT,
            f"{outdated} host(s) built from an older template are being replaced",
            gen,
            now,
        )
    elif creates or starting:
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            True,
            ConditionReason.SCALING_UP,
            f"{len(starting) + creates} host(s) starting, {queue} action(s) waiting",
            gen,
            now,
        )
    elif over_max := _over_max(cfg, live, ops):
        conds = set_condition(
            conds, ConditionType.SCALING, True, ConditionReason.SCALING_DOWN, over_max, gen, now
        )
    elif drains or any(h.phase == "draining" for h in live):
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            True,
            ConditionReason.SCALING_DOWN,
            "draining surplus hosts",
            gen,
            now,
        )
    else:
        conds = set_condition(
            conds,
            ConditionType.SCALING,
            False,
            ConditionReason.STEADY,
            f"{len(ready)} host(s), as wanted",
            gen,
            now,
        )
    unhealthy = sorted(stats.unhealthy) if stats else []
    if rejected:
        conds = set_condition(
            conds, ConditionType.DEGRADED, True, ConditionReason.HOSTS_REJECTED, rejected, gen, now
        )
    elif unplaceable:
        conds = set_condition(
            conds, ConditionType.DEGRADED, True, ConditionReason.UNSCHEDULABLE, unplaceable, gen, now
        )
    elif stuck:
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.UNSCHEDULABLE,
            f"host {pending[0].name} cannot be placed: {pending[0].pending}",
            gen,
            now,
        )
    elif stalled:
        conds = set_condition(
            conds, ConditionType.DEGRADED, True, ConditionReason.HOSTS_CANNOT_START, stalled, gen, now
        )
    elif failed or observed.since_failure_s < backoff_s(observed.failures):
        cause = failed[0].failure if failed else observed.last_failure
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.HOSTS_FAILED,
            f"{max(1, observed.failures)} host(s) failed in a row, last: {cause}; replaced, the next "
            f"start after {backoff_s(observed.failures):g} s",
            gen,
            now,
        )
    elif observed.resize_refusal:
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.RESIZE_UNSUPPORTED,
            f"{observed.resize_refusal}: dedicated pods keep the cores of spec.template.resources.cpu",
            gen,
            now,
        )
    elif observed.missing_languages:
        named = "; ".join(f"{lang} ({why})" for lang, why in sorted(observed.missing_languages.items()))
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.LANGUAGES_MISSING,
            f"spec.languages names languages the hosts' image cannot run: {named}; its actions in "
            "them fail (SandboxError). Use an image with them, or take them out of spec.languages",
            gen,
            now,
        )
    elif unhealthy:
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            True,
            ConditionReason.HOSTS_UNHEALTHY,
            f"host(s) {', '.join(unhealthy)} failed repeated calls; replaced",
            gen,
            now,
        )
    else:
        conds = set_condition(
            conds,
            ConditionType.DEGRADED,
            False,
            ConditionReason.HEALTHY,
            "no failed or unplaceable hosts",
            gen,
            now,
        )
    return {
        "observedGeneration": gen,
        "conditions": conds,
        "replicas": len(live),
        "selector": f"{POOL_LABEL}={cfg.name}",
        "hostsReady": len(ready),
        "hostsStarting": len(starting),
        "coresTotal": stats.cores_total if stats else 0,
        "coresBusy": stats.running_units if stats else 0,
        "sessions": stats.sessions if stats else 0,
        "queueDepth": queue,
        "act": act.model_dump(by_alias=True) if act else None,
    }


def _over_max(cfg: PoolConfig, live: Sequence[HostObservation], ops: Sequence[Operation]) -> str | None:
    """What the pool does about more hosts than its maximum (maxHosts, or /scale's replicas, lowered
    under the hosts it has), or None. The planner drains surplus hosts only after idleTimeoutSeconds
    and removes none that runs an action or holds a session: meanwhile the status said Steady, "as
    wanted", with more hosts than the spec allows."""
    _, hi = cfg.desired_bounds
    # (Failed hosts and those deleted this round are on their way out already.)
    gone = {op.name for op in ops if isinstance(op, DeleteHost)}
    kept = [h for h in live if h.phase != "failed" and h.name not in gone]
    if cfg.mode == "dedicated" or len(kept) <= hi:
        return None  # (a dedicated pool's pods go with their sessions: maxSessions bounds new ones)
    bound = "maxHosts" if cfg.replicas is None or hi == cfg.max_hosts else "/scale replicas"
    return (
        f"{len(kept)} host(s), over the maximum of {hi} ({bound}): the {len(kept) - hi} over it are "
        f"drained once the surplus has lasted idleTimeoutSeconds ({cfg.idle_timeout_s:g} s), and "
        "removed when they run no action and hold no session"
    )


def _unplaceable(cfg: PoolConfig, plan: ScalingPlan | None) -> str | None:
    """The planner's word that no node has room for a host of this pool, as a message to act on."""
    if plan is None:
        return None
    try:
        decision = plan.pool(cfg.key)
    except KeyError:
        return None
    for reason in decision.reasons:
        if reason.code == "Unplaceable":
            gib = cfg.host_memory_bytes / (1 << 30)
            return (
                f"no node can hold a host of {cfg.host_cores} cores and {gib:g}Gi "
                f"(spec.template.resources): {reason.message}"
            )
    return None


def config_of(body: Mapping[str, Any]) -> PoolConfig:
    """The pool of ``body`` (a watch's copy, or the API server's) as the operator works with it;
    ``InvalidSpec`` naming the field when its spec cannot be used (what the schema could not express,
    or an older CRD let in). Only what the user wrote is validated: status is ours and may lag."""
    meta = body.get("metadata") or {}
    try:
        model = ActionPool.model_validate({"metadata": dict(meta), "spec": body.get("spec") or {}})
    except ValidationError as exc:
        raise invalid_spec(exc) from exc
    return pool_config(model, uid=str(meta.get("uid", "")))


def invalid_status(
    generation: int | None, conditions: Sequence[Mapping[str, Any]], message: str, now: datetime
) -> dict[str, Any]:
    """The status of a pool whose spec cannot be used: Ready=False with the reason and message."""
    conds = set_condition(
        conditions, ConditionType.READY, False, ConditionReason.INVALID_SPEC, message, generation, now
    )
    return {"observedGeneration": generation, "conditions": conds}


# ---- the planner's snapshot -----------------------------------------------------------------------
def snapshot(
    now: float,
    cfg: PoolConfig,
    hosts: Sequence[HostObservation],
    others: Iterable[HostObservation],
    nodes: Sequence[NodeSnapshot],
    stats: PoolStats | None,
) -> ClusterSnapshot:
    """One pool's planning round: its hosts, the nodes less what other pools' hosts hold, its demand."""
    reserved_cpu: dict[str, int] = {}
    reserved_mem: dict[str, int] = {}
    for h in others:
        reserved_cpu[h.node] = reserved_cpu.get(h.node, 0) + h.cpu_millicores
        reserved_mem[h.node] = reserved_mem.get(h.node, 0) + h.memory_bytes
    node_names = {n.name for n in nodes}
    adjusted = tuple(
        NodeSnapshot(
            name=n.name,
            cpu_millicores=n.cpu_millicores,
            memory_bytes=n.memory_bytes,
            labels=n.labels,
            schedulable=n.schedulable,
            reserved_cpu_millicores=min(n.cpu_millicores, reserved_cpu.get(n.name, 0)),
            reserved_memory_bytes=min(n.memory_bytes, reserved_mem.get(n.name, 0)),
        )
        for n in nodes
    )
    loads = stats.hosts if stats else {}
    instances = []
    pending_node = "(unscheduled)"
    for h in hosts:
        if h.phase == "terminating" or h.template_hash != cfg.template_hash:
            continue  # outdated hosts are the rollout's to remove (see _rollout)
        load = loads.get(h.name)
        instances.append(
            InstanceSnapshot(
                name=h.name,
                pool=cfg.key,
                node=h.node if h.node in node_names else pending_node,
                phase=h.phase,
                cpu_millicores=h.cpu_millicores,
                memory_bytes=h.memory_bytes,
                running_actions=load.running if load else 0,
                pinned_sessions=load.sessions if load else 0,
                started_at=h.created_at,
            )
        )
    if any(i.node == pending_node for i in instances):
        adjusted += (NodeSnapshot(pending_node, 0, 0, schedulable=False),)
    demand = PoolDemand(
        pool=cfg.key,
        queued_actions=stats.queued_actions if stats else 0,
        queued_units=stats.queued_units if stats else 0,
        running_actions=stats.running_actions if stats else 0,
        running_units=stats.running_units if stats else 0,
        arrival_rate_per_s=stats.arrival_rate_per_s if stats else 0.0,
        mean_action_s=stats.mean_action_s if stats else 0.0,
        last_active_at=stats.last_active if stats else None,
        sessions=stats.sessions if stats else 0,
    )
    return ClusterSnapshot(
        now=now,
        nodes=adjusted,
        sandbox_pools=(cfg.planner_spec(),),
        instances=tuple(instances),
        demand=(demand,),
    )


def node_snapshot(body: Mapping[str, Any]) -> NodeSnapshot | None:
    """A Node object as the planner sees it (None when it has no usable capacity)."""
    from arl_tangram.api.quantity import parse_quantity

    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    try:
        cpu = int(parse_quantity(str(alloc.get("cpu", "0"))) * 1000)
        mem = int(parse_quantity(str(alloc.get("memory", "0"))))
    except ValueError:
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    return NodeSnapshot(
        name=str(meta.get("name")),
        cpu_millicores=cpu,
        memory_bytes=mem,
        labels=dict(meta.get("labels") or {}),
        schedulable=ready and not spec.get("unschedulable", False),
    )


# ---- the controller ------------------------------------------------------------------------------
class PoolController:
    """Gathers one pool's observations, runs the pure reconcile and applies what it says."""

    def __init__(self, dispatcher: Dispatcher, runtime: Runtime, planner: CapacityPlanner) -> None:
        self.dispatcher = dispatcher
        self.runtime = runtime
        self.planner = planner
        self._cores: dict[str, tuple[int, ...]] = {}  # host -> the core ids its agent grants
        # pool -> what its hosts' agents said of their languages (the last health read)
        self._offered: dict[str, Mapping[str, Any]] = {}
        self._unplaced = Waits()  # hosts with no node yet
        self._stalled = Stalls()  # placed hosts whose container cannot start
        self._unplaceable = Waits()  # the planner finding no node for a host
        self._failures = FailureStreaks()
        self._rejections = Rejections()
        self._refused: dict[str, Any] = {}  # pool -> the generation of its spec last refused

    async def reconcile(
        self,
        body: Mapping[str, Any],
        nodes: Sequence[NodeSnapshot],
        all_hosts: Iterable[HostObservation],
    ) -> tuple[dict[str, Any], list[Operation]]:
        """One round for the pool in ``body``; returns the status to write and what was done."""
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        now_dt = datetime.now(UTC)
        generation, conditions = meta.get("generation"), status.get("conditions") or ()
        refusal: str | None = None
        try:
            cfg = config_of(body)
        except InvalidSpec as exc:
            # The last spec accepted for this very pool (not one of an earlier pool of its name) keeps
            # serving, and the pool keeps being looked after by it (failed hosts replaced, scaled to
            # its queue), as a Deployment keeps its last good ReplicaSet: an edit with a typo must
            # not stop a pool's running work. Only with none (the operator started since) does the
            # pool run nothing until it is fixed: its actions wait (``PoolSpecInvalid``).
            kept = self.dispatcher.pool_config(str(meta.get("namespace")), str(meta.get("name")))
            if kept is None or kept.uid != str(meta.get("uid", "")):
                return invalid_status(generation, conditions, str(exc), now_dt), []
            cfg, refusal = kept, str(exc)
        else:
            self._refused.pop(cfg.key, None)
            self.dispatcher.upsert_pool(cfg)
        hosts = self.runtime.hosts(cfg.key)
        await self._sync(cfg, hosts)
        stats = self.dispatcher.stats(cfg.key)
        others = [h for h in all_hosts if h.pool != cfg.key]
        now = self.dispatcher.clock()
        plan = self.planner.plan(snapshot(now, cfg, hosts, others, nodes, stats))
        streak = self._failures.observe(cfg.key, hosts)
        # Stalled only once a host has been for long enough (Stalls says why).
        observed = PoolObservation(
            hosts=self._stalled.observe(cfg.key, hosts),
            stats=stats,
            plan=plan,
            conditions=status.get("conditions") or (),
            unschedulable_for_s=self._unplaced.observe(cfg.key, any(h.pending for h in hosts)),
            unplaceable_for_s=self._unplaceable.observe(cfg.key, _unplaceable(cfg, plan) is not None),
            failures=streak.count,
            since_failure_s=streak.since_s,
            last_failure=streak.last,
            missing_languages=missing_languages(cfg.languages, self._offered.get(cfg.key, {})),
            rejection=self._rejections.observe(cfg.key, cfg.generation),
        )
        if cfg.mode == "dedicated":  # pods follow sessions one to one; there is nothing to plan
            refusal = getattr(self.runtime, "resize_refusal", None)
            observed = dataclasses.replace(
                observed, plan=None, resize_refusal=refusal(cfg.key) if callable(refusal) else None
            )
        new_status, ops = reconcile_actionpool(cfg, observed, now_dt)
        self.dispatcher.set_outage(cfg.key, pool_outage(cfg, observed, ops))
        done, refused = await self._apply(cfg, ops)
        if refused is not None:
            # Said in this round's status, and to the actions waiting now (the outage), not only in
            # the next round's: the hosts this round meant to add are not coming.
            rejection = self._rejections.rejected(cfg.key, cfg.generation, str(refused))
            observed = dataclasses.replace(observed, rejection=rejection)
            new_status, after = reconcile_actionpool(cfg, observed, now_dt)
            self.dispatcher.set_outage(cfg.key, pool_outage(cfg, observed, after))
            message = rejected_hosts(observed) or str(refused)
            log.warning("pool %s: %s", cfg.key, message)
            done.append(Event("Warning", ConditionReason.HOSTS_REJECTED.value, message))
        if refusal is not None:
            new_status = refused_spec(
                new_status, conditions, generation, cfg.generation, refusal, now_dt, "pool"
            )
            if self._refused.get(cfg.key) != generation:  # one Event per refused generation
                self._refused[cfg.key] = generation
                done.append(Event("Warning", ConditionReason.INVALID_SPEC.value, refusal))
        done += condition_events(conditions, new_status["conditions"])
        return new_status, done

    async def _sync(self, cfg: PoolConfig, hosts: Sequence[HostObservation]) -> None:
        """Tell the dispatcher which hosts take work: ready ones (and draining ones, which finish
        what they hold), each with the core ids its agent reports. A host that was ready and is not
        now (its readiness probe fails: the agent hung, or the node cannot reach it) is kept as a
        draining one: it takes no new work, but what it runs is not given up for lost while its pod
        lives (it may still be running, and finish; see the dispatcher's ``_settle``)."""
        endpoints = []
        for h in hosts:
            was_ready = h.phase == "starting" and h.name in self._cores
            if not (h.phase in ("ready", "draining") or was_ready) or h.address is None:
                continue
            cores = self._cores.get(h.name)
            if cores is None:
                try:
                    health = await self.dispatcher.agent.health(h.address)
                    ids = health.get("cores", {}).get("ids")
                    cores = tuple(int(c) for c in ids) if ids else tuple(range(cfg.host_cores))
                    self._offered[cfg.key] = {"languages": health.get("languages")}
                except (InfrastructureError, ValueError, TypeError, AttributeError) as exc:
                    log.info("host %s of %s is not answering health yet: %s", h.name, cfg.key, exc)
                    continue
                self._cores[h.name] = cores
            draining = h.phase != "ready"
            endpoints.append(HostEndpoint(h.name, h.address, cores, h.memory_bytes, draining))
        live = {h.name for h in hosts}
        for name in [n for n in self._cores if n not in live]:
            del self._cores[name]
        await self.dispatcher.sync_hosts(cfg.key, endpoints)

    async def _apply(
        self, cfg: PoolConfig, ops: Sequence[Operation]
    ) -> tuple[list[Operation], HostRejected | None]:
        """Apply ``ops``; returns those done and the API server's refusal of a host pod, if any.
        One that fails leaves the others to be applied (a refused create must not keep a failed
        host from being deleted), and the round's status to be written: it is tried again in a
        later round, as the reconcile asks for it again."""
        done: list[Operation] = []
        refused: HostRejected | None = None
        for op in ops:
            try:
                if isinstance(op, CreateHost):
                    if refused is not None:
                        continue  # the same pod would be refused again
                    await self.runtime.create_host(cfg, new_host_name(cfg), op.node)
                    self._rejections.forget(cfg.key)
                elif isinstance(op, DeleteHost):
                    self.dispatcher.drain(cfg.key, op.name)
                    await self.runtime.delete_host(cfg, op.name)
                elif isinstance(op, SetDraining):
                    self.dispatcher.drain(cfg.key, op.name, op.draining)
                    await self.runtime.set_draining(cfg, op.name, op.draining)
            except HostRejected as exc:
                refused = exc
                continue
            except Exception as exc:  # the platform's (a 5xx, a timeout): said, and retried
                log.warning("pool %s: %s failed (%s); tried again in a later round", cfg.key, op, exc)
                continue
            done.append(op)
        return done, refused

    async def deleted(self, namespace: str, name: str, uid: str = "") -> None:
        """The pool (of ``uid``) is gone: its actions fail, its pods go with it (ownerReferences)."""
        key = pool_key(namespace, name)
        for waits in (self._unplaced, self._stalled, self._unplaceable, self._rejections):
            waits.forget(key)
        # A pool made again under the name must not wait out this one's crash-loop back-off.
        self._failures.forget(key)
        self._offered.pop(key, None)
        self._refused.pop(key, None)
        await self.dispatcher.remove_pool(key, uid)
