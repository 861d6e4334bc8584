"""How much capacity one pool should have: demand in, target units out (pure arithmetic).

The need is the largest of these estimates, all in the pool's units (cores or GPUs):
- the work present now: units held by running actions plus units the queued actions need;
- the steady state by Little's law: arrival rate x mean execution time x mean units per action,
  divided by the target utilisation;
- for sandbox pools, hosts enough to hold the live sessions' memory (a session is pinned to a host
  with room for its memory, so without it the session cannot start at all), and, when hosts cap
  their sessions (``sessions_per_host``), hosts enough for that many sessions.
While the recent ACT is above the pool's target and work is queued, the need grows to the active
capacity times (ACT / target), bounded by ``max_growth``. The target then adds the warm instances and
takes the floor of ``min_instances``, unless the pool scales to zero after its idle timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arl_tangram.planner.placement import InstanceShape
from arl_tangram.planner.plan import Reason, ReasonCode
from arl_tangram.planner.snapshot import PoolDemand, PoolSpec, SandboxPoolSpec


def pool_shapes(pool: PoolSpec) -> tuple[InstanceShape, ...]:
    """The sizes a new instance of the pool may take (one for a sandbox pool; one per TP size)."""
    if isinstance(pool, SandboxPoolSpec):
        return (InstanceShape(pool.host_cores, pool.host_cpu_millicores, pool.host_memory_bytes),)
    return tuple(
        InstanceShape(
            units=g,
            cpu_millicores=pool.replica_cpu_millicores,
            memory_bytes=pool.replica_memory_bytes,
            gpus=g,
            min_gpu_memory_bytes=math.ceil(pool.gpu_memory_bytes / g),
        )
        for g in pool.gpus_per_replica
    )


def instance_units(pool: PoolSpec, cpu_millicores: int, gpus: int) -> int:
    """Capacity an existing instance gives: its cores (sandbox host) or its GPUs (replica)."""
    if isinstance(pool, SandboxPoolSpec):
        return cpu_millicores // 1000
    return gpus


@dataclass(frozen=True)
class PoolSizing:
    """The sizing verdict for one pool.

    ``floor_instances`` is the fewest instances the pool keeps (0 once scaled to zero);
    ``may_shrink`` is False while the recent ACT is above target; ``scaled_to_zero`` is True when the
    idle timeout sent the pool to zero (which skips the surplus hysteresis: the idle wait was it).
    """

    need_units: int
    target_units: int
    floor_instances: int
    may_shrink: bool
    scaled_to_zero: bool
    reasons: tuple[Reason, ...]


def size_pool(
    pool: PoolSpec,
    demand: PoolDemand,
    active_units: int,
    idle_for_s: float,
    max_growth: float,
) -> PoolSizing:
    """Target capacity of one pool from its demand, its policy and how long it has been idle."""
    policy = pool.scaling
    shapes = pool_shapes(pool)
    unit = min(s.units for s in shapes)
    ceiling = policy.max_instances * max(s.units for s in shapes)
    reasons: list[Reason] = []

    present = demand.running_units + demand.queued_units
    steady = 0
    if demand.arrival_rate_per_s > 0 and demand.mean_action_s > 0:
        steady = math.ceil(
            demand.arrival_rate_per_s
            * demand.mean_action_s
            * demand.mean_units_per_action
            / policy.target_utilisation
            - 1e-9
        )
    memory = 0
    if isinstance(pool, SandboxPoolSpec) and demand.session_memory_bytes > 0 and pool.host_memory_bytes > 0:
        # Sessions are pinned where their memory fits: too few hosts and they cannot start at all.
        memory = math.ceil(demand.session_memory_bytes / pool.host_memory_bytes - 1e-9) * pool.host_cores
    if isinstance(pool, SandboxPoolSpec) and pool.sessions_per_host > 0 and demand.sessions > 0:
        # Hosts cap their sessions (each keeps cores for its sessions' parallel actions).
        hosts = math.ceil(demand.sessions / pool.sessions_per_host)
        memory = max(memory, hosts * pool.host_cores)
    need = max(present, steady, memory)
    if need > 0:
        reasons.append(
            Reason(
                "ScaleUp" if need > active_units else "Steady",
                f"{demand.queued_actions} actions queued ({demand.queued_units} units), "
                f"{demand.running_units} units busy, {demand.arrival_rate_per_s:.3g} arrivals/s"
                + (f", live sessions need {memory} units of hosts" if memory else "")
                + ": "
                f"need {need} units, {active_units} active",
            )
        )

    may_shrink = True
    act, act_target = demand.act_recent_s, policy.act_target_s
    if act is not None and act_target is not None and act > act_target:
        may_shrink = False
        message = f"recent ACT {act:.3g} s above target {act_target:.3g} s: no scale-down"
        code: ReasonCode = "DrainBlocked"
        if demand.queued_actions > 0 and active_units > 0:
            grown = math.ceil(active_units * min(act / act_target, max_growth) - 1e-9)
            if grown > need:
                need = grown
                code = "ScaleUp"
                message += f"; growing toward {grown} units"
        reasons.append(Reason(code, message))

    idle_expired = demand.is_idle and idle_for_s >= policy.idle_timeout_s
    if policy.scale_to_zero and idle_expired:
        budget = policy.cold_start_budget_s
        if budget is not None and policy.cold_start_s > budget:
            floor = max(policy.min_instances, 1)
            reasons.append(
                Reason(
                    "ColdStartBudget",
                    f"idle {idle_for_s:.0f} s, but a cold start ({policy.cold_start_s:.3g} s) exceeds the "
                    f"budget ({budget:.3g} s): keeping {floor} warm",
                )
            )
            target = min(ceiling, max(floor * unit, need))
            return PoolSizing(need, _round_up(target, unit, pool), floor, may_shrink, False, tuple(reasons))
        reasons.append(
            Reason(
                "ScaleToZero",
                f"nothing queued or running for {idle_for_s:.0f} s >= idle_timeout_s "
                f"{policy.idle_timeout_s:.0f}: scaling to zero",
            )
        )
        return PoolSizing(0, 0, 0, True, True, tuple(reasons))

    floor_units = policy.min_instances * unit
    warm_units = policy.warm_instances * unit
    target = min(ceiling, max(floor_units, need + warm_units))
    if need + warm_units > ceiling:
        reasons.append(
            Reason(
                "MaxInstances",
                f"{need + warm_units} units wanted, but max_instances={policy.max_instances} caps the pool "
                f"at {ceiling}",
            )
        )
    if target > need and (policy.min_instances or policy.warm_instances):
        reasons.append(
            Reason(
                "WarmMinimum",
                f"min_instances={policy.min_instances}, warm_instances={policy.warm_instances}: "
                f"keeping {target} units for a need of {need}",
            )
        )
    return PoolSizing(
        need, _round_up(target, unit, pool), policy.min_instances, may_shrink, False, tuple(reasons)
    )


def _round_up(units: int, unit: int, pool: PoolSpec) -> int:
    # Sandbox hosts come whole; a GPU service may mix replica sizes, so its target stays exact.
    if isinstance(pool, SandboxPoolSpec):
        return math.ceil(units / unit) * unit
    return units
