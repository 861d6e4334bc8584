"""The capacity planner: one call per period turns a :class:`ClusterSnapshot` into a :class:`ScalingPlan`.

The planner keeps three small pieces of memory between rounds, all keyed by pool name:
- when each pool became idle (used only when the demand does not carry ``last_active_at``);
- since when each pool has had surplus capacity (the hysteresis before a scale-down);
- the last placement the solver proved optimal (reused on a timeout when still feasible and no worse).

The drain state machine (``ready -> draining -> drained -> removed``) is *not* kept here: the runtime
owns it and reports each instance's ``phase``, ``running_actions`` and ``pinned_sessions`` in the
snapshot. The cluster is the source of truth, so a restarted operator resumes every drain where it
was. The planner only emits transitions: drain (ready -> draining), undrain (draining -> ready) and
removal, which it emits only for a drained instance (draining, no running action, no pinned session),
one still ``starting`` (no work is ever placed on it) or a ``failed`` one. A drain and the removal it
leads to are always two rounds apart, so a cordon reaches the scheduler before the instance is deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from arl_tangram.errors import InvalidSpec
from arl_tangram.planner.milp import MilpOutcome, make_solver, solve_placement
from arl_tangram.planner.placement import (
    NodeCapacity,
    Placement,
    PlacementProblem,
    PoolRequest,
    check_placement,
    place_greedy,
    placement_cost,
)
from arl_tangram.planner.plan import (
    InstanceAdd,
    InstanceDrain,
    InstanceRemoval,
    InstanceUndrain,
    PlacementMethod,
    PlacementReport,
    PoolDecision,
    Reason,
    ReasonCode,
    ScalingPlan,
)
from arl_tangram.planner.sizing import PoolSizing, instance_units, pool_shapes, size_pool
from arl_tangram.planner.snapshot import (
    ClusterSnapshot,
    InstanceSnapshot,
    NodeSnapshot,
    PoolSpec,
    SandboxPoolSpec,
)

PlannerSolver = Literal["auto", "highs", "cbc", "greedy"]


@dataclass(frozen=True)
class PlannerConfig:
    """Settings of a :class:`CapacityPlanner`, fixed for its life.

    ``solver``: ``auto`` (HiGHS when highspy is importable, else CBC), ``highs``, ``cbc``, or
    ``greedy`` (no MILP at all). ``time_limit_s``: the solver's wall-clock limit per round; always
    applied. ``cbc_path``: a CBC binary to use instead of the one bundled with pulp.
    ``max_growth``: the most one round multiplies a pool's capacity for ACT pressure.
    """

    solver: PlannerSolver = "auto"
    time_limit_s: float = 1.0
    cbc_path: str | None = None
    max_growth: float = 2.0

    def __post_init__(self) -> None:
        if self.solver not in ("auto", "highs", "cbc", "greedy"):
            raise InvalidSpec("planner.solver", f"must be auto, highs, cbc or greedy; got {self.solver!r}")
        if not (self.time_limit_s >= 0 and self.time_limit_s < float("inf")):
            raise InvalidSpec(
                "planner.time_limit_s", f"must be a finite number >= 0, got {self.time_limit_s}"
            )
        if not (self.max_growth >= 1 and self.max_growth < float("inf")):
            raise InvalidSpec("planner.max_growth", f"must be a finite number >= 1, got {self.max_growth}")


@dataclass
class _PoolRound:
    """Working state of one pool during one round."""

    pool: PoolSpec
    sizing: PoolSizing
    active_units: int
    idle_for_s: float
    planned_units: int
    reasons: list[Reason] = field(default_factory=list)
    request: PoolRequest | None = None
    add_reason: Reason | None = None


class CapacityPlanner:
    """Decides which instances to add (and where), drain, undrain and remove, once per period.

    Not thread-safe: one planner per operator (or simulator), called from one place.
    """

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self._idle_since: dict[str, float] = {}
        self._surplus_since: dict[str, float] = {}
        self._last_good: Placement | None = None

    @property
    def last_good_placement(self) -> Placement | None:
        """The last placement the solver proved optimal (None before the first)."""
        return self._last_good

    def plan(self, snapshot: ClusterSnapshot) -> ScalingPlan:
        """One planning round. Deterministic for a given snapshot and planner memory."""
        started = time.perf_counter()
        now = snapshot.now
        drains: list[InstanceDrain] = []
        undrains: list[InstanceUndrain] = []
        removals: list[InstanceRemoval] = []
        rounds: list[_PoolRound] = []

        known = {p.name for p in snapshot.pools()}
        for stale in set(self._idle_since) - known:
            del self._idle_since[stale]
        for stale in set(self._surplus_since) - known:
            del self._surplus_since[stale]

        for pool in snapshot.pools():
            mine = [i for i in snapshot.instances if i.pool == pool.name]
            rounds.append(self._plan_pool(pool, mine, snapshot, now, drains, undrains, removals))

        problem = _placement_problem(snapshot, rounds)
        placement, report = self._place(problem)

        adds: list[InstanceAdd] = []
        by_pool = {r.pool.name: r for r in rounds}
        for (pool_name, node, units), count in placement.items():
            rnd = by_pool[pool_name]
            assert rnd.request is not None and rnd.add_reason is not None
            shape = rnd.request.shape(units)
            for _ in range(count):
                adds.append(
                    InstanceAdd(
                        pool=pool_name,
                        node=node,
                        units=units,
                        cpu_millicores=shape.cpu_millicores,
                        memory_bytes=shape.memory_bytes,
                        gpus=shape.gpus,
                        reason=rnd.add_reason,
                    )
                )

        decisions: list[PoolDecision] = []
        for rnd in rounds:
            added = placement.units_of(rnd.pool.name)
            unmet = 0
            if rnd.request is not None:
                unmet = max(0, rnd.request.units - added)
                if unmet and placement.count_of(rnd.pool.name) < rnd.request.max_count:
                    rnd.reasons.append(
                        Reason(
                            "Unplaceable",
                            f"no node has room for {unmet} more units of {rnd.pool.name!r}",
                        )
                    )
            if not rnd.reasons:
                rnd.reasons.append(Reason("Steady", f"{rnd.active_units} units active, as targeted"))
            decisions.append(
                PoolDecision(
                    pool=rnd.pool.name,
                    kind="sandbox" if isinstance(rnd.pool, SandboxPoolSpec) else "reward",
                    need_units=rnd.sizing.need_units,
                    target_units=rnd.sizing.target_units,
                    active_units=rnd.active_units,
                    planned_units=rnd.planned_units + added,
                    unmet_units=unmet,
                    idle_for_s=rnd.idle_for_s,
                    reasons=tuple(rnd.reasons),
                )
            )

        return ScalingPlan(
            at=now,
            adds=tuple(adds),
            drains=tuple(drains),
            undrains=tuple(undrains),
            removals=tuple(removals),
            pools=tuple(decisions),
            placement=report,
            planning_seconds=time.perf_counter() - started,
        )

    # ---- one pool ------------------------------------------------------------------------------------

    def _plan_pool(
        self,
        pool: PoolSpec,
        mine: list[InstanceSnapshot],
        snapshot: ClusterSnapshot,
        now: float,
        drains: list[InstanceDrain],
        undrains: list[InstanceUndrain],
        removals: list[InstanceRemoval],
    ) -> _PoolRound:
        demand = snapshot.demand_of(pool.name)

        def units(inst: InstanceSnapshot) -> int:
            return instance_units(pool, inst.cpu_millicores, inst.gpus)

        starting = [i for i in mine if i.phase == "starting"]
        ready = [i for i in mine if i.phase == "ready"]
        draining = [i for i in mine if i.phase == "draining"]
        reasons: list[Reason] = []
        for inst in mine:
            if inst.phase == "failed":
                removals.append(
                    InstanceRemoval(
                        inst.name, pool.name, inst.node, Reason("InstanceFailed", "instance failed")
                    )
                )

        active_units = sum(units(i) for i in starting + ready)
        busy = not demand.is_idle or any(i.running_actions for i in mine)
        idle_for = self._idle_for(pool.name, busy, demand.last_active_at, now)
        sizing = size_pool(pool, demand, active_units, idle_for, self.config.max_growth)
        reasons.extend(sizing.reasons)
        target = sizing.target_units
        planned = active_units
        rnd = _PoolRound(pool, sizing, active_units, idle_for, planned, reasons)

        undrained: set[str] = set()
        if target > active_units:
            self._surplus_since.pop(pool.name, None)
            deficit = target - active_units
            # A cordoned instance is warm: bring it back before paying for a cold start. Those holding
            # the most state (sessions, running work) first, then the oldest.
            for inst in sorted(
                draining, key=lambda i: (-i.pinned_sessions, -i.running_actions, i.started_at, i.name)
            ):
                if deficit <= 0:
                    break
                undrains.append(
                    InstanceUndrain(
                        inst.name,
                        pool.name,
                        inst.node,
                        Reason("Undrain", f"demand needs {target} units, {planned} active: back in service"),
                    )
                )
                undrained.add(inst.name)
                deficit -= units(inst)
                planned += units(inst)
            if deficit > 0:
                rnd.request, rnd.add_reason = self._request(
                    pool, snapshot, mine, undrained, starting, deficit, sizing, reasons
                )
        elif target < active_units:
            planned -= self._shrink(pool, sizing, starting, ready, now, drains, removals, reasons, units)
        else:
            self._surplus_since.pop(pool.name, None)

        for inst in draining:
            if inst.name in undrained:
                continue
            if inst.is_drained:
                removals.append(
                    InstanceRemoval(
                        inst.name,
                        pool.name,
                        inst.node,
                        Reason("Drained", "cordoned with no running action and no pinned session"),
                    )
                )
        rnd.planned_units = planned
        return rnd

    def _idle_for(self, pool: str, busy: bool, last_active_at: float | None, now: float) -> float:
        if busy:
            self._idle_since.pop(pool, None)
            return 0.0
        if last_active_at is not None:
            self._idle_since.pop(pool, None)
            return max(0.0, now - last_active_at)
        since = self._idle_since.setdefault(pool, now)
        return max(0.0, now - since)

    def _request(
        self,
        pool: PoolSpec,
        snapshot: ClusterSnapshot,
        mine: list[InstanceSnapshot],
        undrained: set[str],
        starting: list[InstanceSnapshot],
        deficit: int,
        sizing: PoolSizing,
        reasons: list[Reason],
    ) -> tuple[PoolRequest | None, Reason]:
        policy = pool.scaling
        shapes = pool_shapes(pool)
        # Every instance that is not on its way out counts against max_instances.
        staying = [i for i in mine if i.phase != "failed" and not (i.is_drained and i.name not in undrained)]
        room_total = policy.max_instances - len(staying)
        room_starting = policy.max_starting - len(starting)
        max_count = max(0, min(room_total, room_starting))
        wanted_count = -(-deficit // max(s.units for s in shapes))
        if room_starting < wanted_count:
            reasons.append(
                Reason(
                    "MaxStarting",
                    f"{len(starting)} starting, max_starting={policy.max_starting}: "
                    f"at most {max(0, room_starting)} more this round",
                )
            )
        if room_total < wanted_count:
            reasons.append(
                Reason(
                    "MaxInstances",
                    f"{len(staying)} instances, max_instances={policy.max_instances}: "
                    f"at most {max(0, room_total)} more",
                )
            )
        eligible = frozenset(n.name for n in snapshot.nodes if _eligible(n, pool))
        kind: ReasonCode = "ScaleUp" if sizing.need_units > sizing.target_units - deficit else "WarmMinimum"
        add_reason = Reason(
            kind,
            f"target {sizing.target_units} units (need {sizing.need_units}), "
            f"{sizing.target_units - deficit} active or returning: adding up to {deficit} units",
        )
        request = PoolRequest(pool.name, shapes, deficit, max_count, eligible)
        return request, add_reason

    def _shrink(
        self,
        pool: PoolSpec,
        sizing: PoolSizing,
        starting: list[InstanceSnapshot],
        ready: list[InstanceSnapshot],
        now: float,
        drains: list[InstanceDrain],
        removals: list[InstanceRemoval],
        reasons: list[Reason],
        units: Callable[[InstanceSnapshot], int],
    ) -> int:
        """Drain or cancel surplus instances once allowed; returns the units taken out of service."""
        policy = pool.scaling
        target = sizing.target_units
        if not sizing.may_shrink:
            self._surplus_since.pop(pool.name, None)
            return 0
        since = self._surplus_since.setdefault(pool.name, now)
        waited = now - since
        if not sizing.scaled_to_zero and waited < policy.idle_timeout_s:
            reasons.append(
                Reason(
                    "DrainBlocked",
                    f"surplus for {waited:.0f} s of the {policy.idle_timeout_s:.0f} s idle_timeout_s "
                    "before draining",
                )
            )
            return 0
        active = sum(units(i) for i in starting + ready)
        count = len(starting) + len(ready)
        removed = 0
        # Starting instances hold no work: cancelling them is free. Newest first. One that somehow
        # reports work is left alone (it is never removed busy; it can be drained once ready).
        for inst in sorted(starting, key=lambda i: (-i.started_at, i.name)):
            if inst.running_actions or inst.pinned_sessions:
                continue
            size = units(inst)
            if active - size < target or count - 1 < sizing.floor_instances:
                continue
            removals.append(
                InstanceRemoval(
                    inst.name,
                    pool.name,
                    inst.node,
                    Reason("CancelStart", f"surplus: target {target} units, {active} active"),
                )
            )
            active -= size
            count -= 1
            removed += size
        # Then the ready instance that costs least to give up: fewest pinned sessions, least loaded,
        # newest (the oldest have the warmest caches), name as the last tie-break.
        code: ReasonCode = "ScaleToZero" if sizing.scaled_to_zero else "ScaleDown"
        for inst in sorted(
            ready, key=lambda i: (i.pinned_sessions, i.running_actions, -i.started_at, i.name)
        ):
            size = units(inst)
            if active - size < target or count - 1 < sizing.floor_instances:
                continue
            drains.append(
                InstanceDrain(
                    inst.name,
                    pool.name,
                    inst.node,
                    Reason(code, f"surplus: target {target} units, {active} active; draining first"),
                )
            )
            active -= size
            count -= 1
            removed += size
        return removed

    # ---- placement ------------------------------------------------------------------------------------

    def _place(self, problem: PlacementProblem) -> tuple[Placement, PlacementReport]:
        limit = self.config.time_limit_s
        if problem.is_trivial:  # most rounds of a steady cluster: no packing to compute
            return Placement(), PlacementReport(
                "none", None, "", "not-run", 0.0, 0.0, 0.0, limit, "nothing to place"
            )
        greedy = place_greedy(problem)
        greedy_cost = placement_cost(problem, greedy).total
        if self.config.solver == "greedy":
            return greedy, PlacementReport(
                "greedy", None, "", "not-run", greedy_cost, greedy_cost, 0.0, limit, "solver=greedy"
            )
        if not any(True for _ in problem.candidates()):
            return greedy, PlacementReport(
                "greedy", None, "", "not-run", greedy_cost, greedy_cost, 0.0, limit, "no node can take any"
            )
        solver = make_solver(self.config.solver, limit, self.config.cbc_path)
        # HiGHS starts from the greedy packing, so whatever it holds when time runs out is no worse.
        outcome = solve_placement(problem, solver, start=greedy)
        if outcome.sol_status == "optimal" and outcome.placement is not None:
            cost = placement_cost(problem, outcome.placement).total
            if cost <= greedy_cost:
                self._last_good = outcome.placement
                return outcome.placement, _report("milp", outcome, cost, greedy_cost, limit, "proven optimal")
        return self._fallback(problem, outcome, greedy, greedy_cost, limit)

    def _fallback(
        self,
        problem: PlacementProblem,
        outcome: MilpOutcome,
        greedy: Placement,
        greedy_cost: int,
        limit: float,
    ) -> tuple[Placement, PlacementReport]:
        why = outcome.message or f"solver stopped without proof of optimality ({outcome.sol_status})"
        # Ties go to the earlier entry: the last good plan (stable decisions), then greedy (an
        # incumbent that only ties greedy is usually the greedy start handed to the solver).
        candidates: list[tuple[PlacementMethod, Placement]] = []
        if self._last_good is not None and check_placement(problem, self._last_good).feasible:
            candidates.append(("reused", self._last_good))
        candidates.append(("greedy", greedy))
        if outcome.placement is not None:
            candidates.append(("milp-incumbent", outcome.placement))
        scored = [
            (placement_cost(problem, p).total, i, method, p) for i, (method, p) in enumerate(candidates)
        ]
        cost, _, method, chosen = min(scored, key=lambda item: (item[0], item[1]))
        return chosen, _report(method, outcome, cost, greedy_cost, limit, f"{why}; {_FALLBACK_TEXT[method]}")


_FALLBACK_TEXT: dict[PlacementMethod, str] = {
    "reused": "reused the last optimal placement (still feasible, cheapest)",
    "milp-incumbent": "kept the solver's unproven incumbent (cheapest)",
    "greedy": "used the greedy best-fit packing",
    "milp": "",
    "none": "",
}


def _report(
    method: PlacementMethod, outcome: MilpOutcome, cost: int, greedy_cost: int, limit: float, message: str
) -> PlacementReport:
    return PlacementReport(
        method=method,
        solver=outcome.solver,
        status=outcome.status,
        sol_status=outcome.sol_status,
        objective=float(cost),
        greedy_objective=float(greedy_cost),
        solve_seconds=outcome.seconds,
        time_limit_s=limit,
        message=message,
    )


def _eligible(node: NodeSnapshot, pool: PoolSpec) -> bool:
    if not node.schedulable:
        return False
    return all(node.labels.get(key) == value for key, value in pool.node_selector.items())


def _placement_problem(snapshot: ClusterSnapshot, rounds: list[_PoolRound]) -> PlacementProblem:
    """Free capacity per node counts every instance that exists, leaving ones included: their pods
    still hold their requests until they are gone."""
    used: dict[str, list[int]] = {n.name: [0, 0, 0] for n in snapshot.nodes}
    opened: set[str] = set()
    for inst in snapshot.instances:
        acc = used[inst.node]
        acc[0] += inst.cpu_millicores
        acc[1] += inst.memory_bytes
        acc[2] += inst.gpus
        if inst.phase != "failed":
            opened.add(inst.node)
    nodes = tuple(
        NodeCapacity(
            name=n.name,
            free_cpu_millicores=n.cpu_millicores - n.reserved_cpu_millicores - used[n.name][0],
            free_memory_bytes=n.memory_bytes - n.reserved_memory_bytes - used[n.name][1],
            free_gpus=n.gpus - n.reserved_gpus - used[n.name][2],
            gpu_memory_bytes=n.gpu_memory_bytes,
            opened=n.name in opened,
        )
        for n in snapshot.nodes
    )
    requests = tuple(r.request for r in rounds if r.request is not None)
    return PlacementProblem(requests, nodes)
