"""RewardModelService: the pure reconcile (replicas and demand in; status and operations out) and
the controller that applies it.

Replicas are reward-runtime pods the operator owns, each with the service's GPUs as the device
plugin's resources (``nvidia.com/gpu`` or the MIG profile's). The service scales to zero after
``idleTimeoutSeconds`` without requests when ``minReplicas`` is 0 (its weights stay in host memory
only in the sense that the next replica restores them: a scaled-to-zero service pays a cold start),
comes back on the first request, and grows by a replica while more requests wait than its ready
replicas batch at once.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.api.validation import invalid_spec
from arl_tangram.controllers.conditions import ConditionReason, ConditionType, set_condition
from arl_tangram.controllers.failures import FailureStreaks, backoff_s
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.rewards import RewardRouter, ServiceStats
from arl_tangram.domain.batches import act_stats
from arl_tangram.domain.services import ServiceConfig, service_config
from arl_tangram.errors import InfrastructureError, InvalidSpec
from arl_tangram.runtime.interface import HostObservation
from arl_tangram.runtime.pods import SERVICE_LABEL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CreateReplica:
    reason: str


@dataclass(frozen=True)
class DeleteReplica:
    name: str
    reason: str


ServiceOperation = CreateReplica | DeleteReplica


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


def reconcile_rewardmodelservice(
    cfg: ServiceConfig, observed: ServiceObservation, now: datetime
) -> tuple[dict[str, Any], list[ServiceOperation]]:
    """Status and operations for one service (pure)."""
    live = [r for r in observed.replicas if r.phase != "terminating"]
    ops: list[ServiceOperation] = []
    failed = [r for r in live if r.phase == "failed"]
    for r in failed:
        ops.append(DeleteReplica(r.name, f"replica failed: {r.failure}"))
    serving = [r for r in live if r.phase != "failed"]
    ready = [r for r in serving if r.phase == "ready"]
    stats = observed.stats
    queued = stats.queued if stats else 0
    running = stats.running if stats else 0
    last = stats.last_active if stats else None
    recent = last is not None and observed.now_mono - last < cfg.idle_timeout_s
    active = queued + running > 0 or recent
    desired = max(cfg.min_replicas, 1 if active else 0)
    if queued > cfg.max_batch * max(1, len(ready)) and len(serving) == len(ready):
        desired = max(desired, len(serving) + 1)
    desired = min(desired, cfg.max_replicas)
    holding = observed.since_failure_s < backoff_s(observed.failures)
    for _ in range(0 if holding else desired - len(serving)):
        ops.append(CreateReplica(f"{queued} request(s) waiting" if queued else "minReplicas"))
    if len(serving) > desired:
        inflight = stats.inflight if stats else {}
        idle = [r for r in reversed(serving) if not inflight.get(r.name)]
        why = "idle for idleTimeoutSeconds" if desired < cfg.min_replicas + 1 else "surplus"
        for r in idle[: len(serving) - desired]:
            ops.append(DeleteReplica(r.name, why))
    gen = cfg.generation
    conds = [dict(c) for c in observed.conditions]
    pending = [r for r in serving if r.pending]
    if ready:
        conds = set_condition(
            conds,
            ConditionType.READY,
            True,
            ConditionReason.HOSTS_READY,
            f"{len(ready)} replica(s) serving",
            gen,
            now,
        )
    elif not serving and desired == 0:
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
    else:
        conds = set_condition(
            conds,
            ConditionType.READY,
            False,
            ConditionReason.HOSTS_STARTING,
            f"{len(serving) + sum(isinstance(o, CreateReplica) for o in ops)} replica(s) starting",
            gen,
            now,
        )
    scaling = any(isinstance(o, CreateReplica) for o in ops) or len(ready) < len(serving)
    conds = set_condition(
        conds,
        ConditionType.SCALING,
        scaling,
        ConditionReason.SCALING_UP if scaling else ConditionReason.STEADY,
        f"{len(serving)} replica(s), {desired} wanted",
        gen,
        now,
    )
    if failed or holding:
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
    else:
        conds = set_condition(
            conds, ConditionType.DEGRADED, False, ConditionReason.HEALTHY, "no failed replicas", gen, now
        )
    placements = []
    for r in serving:
        if not r.node:
            continue
        state = "Resident" if observed.resident.get(r.name, r.phase == "ready") else "Evicted"
        placements.append({"node": r.node, "gpus": [], "state": state, "pod": r.name})
    act = act_stats(stats.act_recent_s, 300) if stats else None
    status = {
        "observedGeneration": gen,
        "conditions": conds,
        "replicas": len(serving),
        "readyReplicas": len(ready),
        "selector": f"{SERVICE_LABEL}={cfg.name}",
        "placements": placements,
        "queueDepth": queued,
        "act": act.model_dump(by_alias=True) if act else None,
    }
    return status, ops


class ServiceController:
    """Gathers one service's observations, runs the reconcile and applies it."""

    def __init__(self, router: RewardRouter, runtime: Any, client: AgentClient, device: str) -> None:
        self.router = router
        self.runtime = runtime
        self.client = client
        self.device = device
        # Replicas that failed in a row: the reconcile's crash-loop back-off (it was never fed, so a
        # replica that could not start was recreated at once, every time).
        self._failures = FailureStreaks()

    async def reconcile(self, body: Mapping[str, Any]) -> dict[str, Any]:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        now = datetime.now(UTC)
        conditions = status.get("conditions") or ()
        try:
            model = RewardModelService.model_validate(
                {"metadata": dict(meta), "spec": body.get("spec") or {}}
            )
            cfg = service_config(model, uid=str(meta.get("uid", "")))
        except ValidationError as exc:
            return _invalid(meta.get("generation"), conditions, str(invalid_spec(exc)), now)
        except InvalidSpec as exc:
            return _invalid(meta.get("generation"), conditions, str(exc), now)
        self.router.upsert(cfg)
        await self.runtime.ensure_services_file(cfg)
        replicas = self.runtime.replicas(cfg.key)
        self.router.sync(cfg.key, [(r.name, r.address) for r in replicas if r.phase == "ready" and r.address])
        resident = await self._residency(cfg, replicas)
        streak = self._failures.observe(cfg.key, replicas)
        observed = ServiceObservation(
            replicas,
            self.router.stats(cfg.key),
            self.router.clock(),
            conditions,
            resident,
            failures=streak.count,
            since_failure_s=streak.since_s,
            last_failure=streak.last,
        )
        new_status, ops = reconcile_rewardmodelservice(cfg, observed, now)
        for op in ops:
            if isinstance(op, CreateReplica):
                await self.runtime.create_replica(cfg, f"{cfg.name}-{secrets.token_hex(3)}", self.device)
            else:
                await self.runtime.delete_replica(cfg, op.name)
        return new_status

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
