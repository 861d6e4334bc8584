"""Property tests: plans never over-commit a node, the MILP never loses to the greedy packer, and a
time-limited planner always returns a checked plan."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import NamedTuple

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from planner_factories import GiB, overcommitted_nodes

from arl_tangram.planner import (
    CapacityPlanner,
    ClusterSnapshot,
    InstanceShape,
    InstanceSnapshot,
    NodeCapacity,
    NodeSnapshot,
    PlacementProblem,
    PlacementReport,
    PlannerConfig,
    PoolDemand,
    PoolRequest,
    RewardServiceSpec,
    SandboxPoolSpec,
    ScalingPlan,
    ScalingPolicy,
    check_placement,
    make_solver,
    place_greedy,
    placement_cost,
    solve_placement,
)
from arl_tangram.planner.milp import highs_available

MiB = 2**20

# PLANNER_PROPERTY_EXAMPLES raises the example count for a deeper run by hand; 100 take about 4 s.
PROPS = settings(
    max_examples=int(os.environ.get("PLANNER_PROPERTY_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def placement_problems(draw: st.DrawFn) -> PlacementProblem:
    n_nodes = draw(st.integers(1, 4))
    nodes = tuple(
        NodeCapacity(
            name=f"n{j}",
            free_cpu_millicores=draw(st.integers(0, 32)) * 1000,
            # Free memory as a node reports it: whole MiB, not whole GiB.
            free_memory_bytes=draw(st.integers(0, 128 * 1024)) * MiB,
            free_gpus=draw(st.integers(0, 8)),
            gpu_memory_bytes=draw(st.sampled_from([40, 80])) * GiB,
            opened=draw(st.booleans()),
        )
        for j in range(n_nodes)
    )
    requests = []
    for i in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            cores = draw(st.sampled_from([2, 4, 8]))
            # Now and then a host of an odd size (2 GiB per core plus some MiB), as pod templates say.
            memory = cores * 2 * GiB + draw(st.sampled_from([0, 0, 1, 300])) * MiB
            shapes: tuple[InstanceShape, ...] = (InstanceShape(cores, cores * 1000, memory),)
        else:
            sizes = draw(st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1))
            need = draw(st.sampled_from([20, 60, 140])) * GiB
            shapes = tuple(InstanceShape(g, 2000, 16 * GiB, g, -(-need // g)) for g in sorted(sizes))
        # Mostly eligible, mostly wanting something: trivial problems teach nothing.
        eligible = frozenset(n.name for n in nodes if draw(st.integers(0, 3)))
        units = draw(st.integers(0, 30) | st.integers(1, 30))
        count = draw(st.integers(0, 5) | st.integers(1, 5))
        requests.append(PoolRequest(f"p{i}", shapes, units, count, eligible))
    return PlacementProblem(tuple(requests), nodes)


@PROPS
@given(problem=placement_problems(), solver=st.sampled_from(["highs", "cbc"]), started=st.booleans())
def test_milp_placement_equals_or_beats_greedy(problem: PlacementProblem, solver: str, started: bool) -> None:
    greedy = place_greedy(problem)
    assert check_placement(problem, greedy).feasible
    event("trivial" if problem.is_trivial else "something to place")
    # Started from greedy or not, the proven optimum must be as good: a start must never mislead.
    outcome = solve_placement(problem, make_solver(solver, 20), start=greedy if started else None)  # type: ignore[arg-type]
    assert outcome.sol_status == "optimal", outcome
    assert outcome.placement is not None
    assert check_placement(problem, outcome.placement).feasible
    milp_cost = placement_cost(problem, outcome.placement)
    greedy_cost = placement_cost(problem, greedy)
    assert milp_cost.total <= greedy_cost.total
    # Lexicographic: never leaves more wanted capacity unplaced than greedy does.
    assert milp_cost.unplaced_units <= greedy_cost.unplaced_units


LABELS = st.sampled_from([{}, {"tier": "a"}, {"tier": "b"}])


class Case(NamedTuple):
    """A snapshot, and the sandbox pool it was built to have in surplus (None: no such pool)."""

    snap: ClusterSnapshot
    must_drain: str | None


@st.composite
def snapshots(draw: st.DrawFn) -> Case:
    """Random clusters. Two in three hold a sandbox pool built to be in surplus: idle, no
    hysteresis (idle_timeout_s 0), and more ready hosts than its floor, warm hosts and a kept-warm host
    together, so that its plan must drain one (random clusters alone drained in under 5% of cases)."""
    nodes = tuple(
        NodeSnapshot(
            f"n{j}",
            draw(st.integers(0, 64)) * 1000,
            draw(st.integers(0, 256)) * GiB,
            gpus=(gpus := draw(st.sampled_from([0, 2, 4, 8]))),
            gpu_memory_bytes=draw(st.sampled_from([40, 80])) * GiB if gpus else 0,
            labels=draw(LABELS),
            schedulable=draw(st.booleans()) or j == 0,
            reserved_cpu_millicores=draw(st.integers(0, 8)) * 1000,
        )
        for j in range(draw(st.integers(1, 4)))
    )

    def policy() -> ScalingPolicy:
        max_instances = draw(st.integers(1, 6))
        return ScalingPolicy(
            max_instances=max_instances,
            min_instances=draw(st.integers(0, max_instances)),
            warm_instances=draw(st.integers(0, 2)),
            max_starting=draw(st.integers(1, 3)),
            idle_timeout_s=draw(st.sampled_from([0.0, 10.0, 1000.0])),
            scale_to_zero=draw(st.booleans()),
        )

    # Surplus first, so that the pool it needs is there: two cases in three, one sandbox pool at least.
    wants_surplus = draw(st.integers(0, 2)) > 0
    pools = tuple(
        SandboxPoolSpec(
            f"cpu{i}",
            draw(st.sampled_from([2, 4, 8])),
            draw(st.integers(1, 16)) * GiB,
            policy(),
            draw(LABELS),
        )
        for i in range(draw(st.integers(1 if wants_surplus else 0, 2)))
    )
    services = tuple(
        RewardServiceSpec(
            f"gpu{i}",
            tuple(draw(st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1))),
            draw(st.sampled_from([20, 100, 300])) * GiB,
            policy(),
            1000,
            8 * GiB,
        )
        for i in range(draw(st.integers(0, 1)))
    )
    instances = []
    surplus = pools[0] if wants_surplus else None
    if surplus is not None:
        surplus = replace(surplus, scaling=replace(surplus.scaling, idle_timeout_s=0.0))
        pools = (surplus, *pools[1:])
        policy_ = surplus.scaling
        keep = max(policy_.min_instances, policy_.warm_instances, 1)
        for k in range(keep + draw(st.integers(1, 2))):
            instances.append(
                InstanceSnapshot(
                    f"s{k}",
                    surplus.name,
                    draw(st.sampled_from(nodes)).name,
                    "ready",
                    surplus.host_cpu_millicores,
                    surplus.host_memory_bytes,
                    running_actions=draw(st.integers(0, 1)),
                    pinned_sessions=draw(st.integers(0, 1)),
                    started_at=draw(st.integers(0, 100)),
                )
            )
    for k in range(draw(st.integers(0, 6))):
        spec = draw(st.sampled_from([*pools, *services])) if pools or services else None
        if spec is None:
            break
        node = draw(st.sampled_from(nodes))
        if isinstance(spec, SandboxPoolSpec):
            cpu, mem, gpus = spec.host_cpu_millicores, spec.host_memory_bytes, 0
        else:
            cpu, mem, gpus = (
                spec.replica_cpu_millicores,
                spec.replica_memory_bytes,
                draw(st.sampled_from(spec.gpus_per_replica)),
            )
        instances.append(
            InstanceSnapshot(
                f"i{k}",
                spec.name,
                node.name,
                draw(st.sampled_from(["starting", "ready", "draining", "failed"])),
                cpu,
                mem,
                gpus,
                running_actions=draw(st.integers(0, 2)),
                pinned_sessions=draw(st.integers(0, 2)),
                started_at=draw(st.integers(0, 100)),
            )
        )
    demand = tuple(
        PoolDemand(
            p.name,
            queued_actions=(q := draw(st.integers(0, 20))),
            queued_units=q * draw(st.integers(1, 2)),
            running_actions=(r := draw(st.integers(0, 4))),
            running_units=r,
        )
        for p in [*pools, *services]
        if p is not surplus and draw(st.booleans())
    )
    snap = ClusterSnapshot(draw(st.integers(0, 5000)), nodes, pools, services, tuple(instances), demand)
    return Case(snap, surplus.name if surplus is not None else None)


def check_drains(case: Case, plan: ScalingPlan) -> None:
    """The pool built to be in surplus drains; event() shows how often plans drain at all."""
    if case.must_drain is not None:
        assert any(d.pool == case.must_drain for d in plan.drains), plan.pools
    event("plan drains" if plan.drains else "plan drains nothing")


def check_plan_invariants(snap: ClusterSnapshot, plan) -> None:
    assert not overcommitted_nodes(snap, plan)
    by_name = {i.name: i for i in snap.instances}
    for removal in plan.removals:
        inst = by_name[removal.name]
        assert inst.phase in ("failed", "starting") or inst.is_drained, (inst, removal)
        assert not (inst.phase != "failed" and (inst.running_actions or inst.pinned_sessions))
    assert all(by_name[d.name].phase == "ready" for d in plan.drains)
    assert all(by_name[u.name].phase == "draining" for u in plan.undrains)
    touched = [
        *(r.name for r in plan.removals),
        *(d.name for d in plan.drains),
        *(u.name for u in plan.undrains),
    ]
    assert len(touched) == len(set(touched))
    nodes = {n.name: n for n in snap.nodes}
    for spec in snap.pools():
        adds = [a for a in plan.adds if a.pool == spec.name]
        mine = [i for i in snap.instances if i.pool == spec.name]
        starting = sum(1 for i in mine if i.phase == "starting")
        assert len(adds) <= max(0, spec.scaling.max_starting - starting)
        staying = sum(1 for i in mine if i.phase != "failed" and not i.is_drained)
        assert len(adds) <= max(0, spec.scaling.max_instances - staying)
        for add in adds:
            node = nodes[add.node]
            assert node.schedulable
            assert all(node.labels.get(k) == v for k, v in spec.node_selector.items())
            if isinstance(spec, RewardServiceSpec):
                assert add.gpus in spec.gpus_per_replica
                assert add.gpus * node.gpu_memory_bytes >= spec.gpu_memory_bytes


@PROPS
@given(case=snapshots())
def test_a_plan_never_over_commits_a_node_and_never_removes_busy_instances(case: Case) -> None:
    snap = case.snap
    plan = CapacityPlanner(PlannerConfig(solver="highs", time_limit_s=10)).plan(snap)
    for kind in ("adds", "undrains", "removals"):
        if getattr(plan, kind):
            event(f"plan has {kind}")
    check_drains(case, plan)
    check_plan_invariants(snap, plan)
    assert plan.placement.method in ("milp", "none", "greedy")
    if plan.placement.method == "milp":
        assert plan.placement.sol_status == "optimal"


@PROPS
@given(
    case=snapshots(),
    solver=st.sampled_from(["auto", "highs", "cbc", "greedy"]),
    limit=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_a_time_limited_planner_always_returns_a_checked_plan(case: Case, solver: str, limit: float) -> None:
    snap = case.snap
    planner = CapacityPlanner(PlannerConfig(solver=solver, time_limit_s=limit))  # type: ignore[arg-type]
    for step in range(2):
        later = ClusterSnapshot(
            snap.now + step * 50,
            snap.nodes,
            snap.sandbox_pools,
            snap.reward_services,
            snap.instances,
            snap.demand,
        )
        plan = planner.plan(later)
        report = plan.placement
        check_plan_invariants(later, plan)
        if step == 0:
            check_drains(case, plan)
        assert report.time_limit_s == limit
        check_report(report, solver)
        assert report.objective <= report.greedy_objective


def check_report(report: PlacementReport, solver: str) -> None:
    """What the report says follows from what ran: only the outcomes possible for each path."""
    if report.method == "none" or solver == "greedy" or report.sol_status == "not-run":
        # Nothing to place, no MILP asked for, or no node could take anything: no solver ran.
        assert report.sol_status == "not-run" and report.solver is None, report
        assert report.method == ("none" if report.message == "nothing to place" else "greedy"), report
        return
    auto = "HiGHS" if highs_available() else "CBC"
    assert report.solver == {"highs": "HiGHS", "cbc": "CBC", "auto": auto}[solver], report
    # Placing nothing satisfies the model and every variable is bounded: never infeasible or unbounded;
    # both solvers are installed: never an error.
    methods = {
        "optimal": {"milp"},
        "feasible": {"reused", "greedy", "milp-incumbent"},
        "no-solution": {"reused", "greedy"},
    }
    assert report.sol_status in methods, report
    assert report.method in methods[report.sol_status], report
