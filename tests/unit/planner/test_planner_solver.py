"""The placement solver: time limits, sol_status, the greedy fallback and reuse of the last good plan."""

from __future__ import annotations

import pytest
from planner_factories import (
    GiB,
    cpu_node,
    gpu_node,
    overcommitted_nodes,
    reward_service,
    sandbox_pool,
    snapshot,
)

from arl_tangram.errors import InvalidSpec
from arl_tangram.planner import (
    CapacityPlanner,
    InstanceShape,
    NodeCapacity,
    PlacementProblem,
    PlannerConfig,
    PoolDemand,
    PoolRequest,
    check_placement,
    make_solver,
    place_greedy,
    placement_cost,
    solve_placement,
)


def greedy_loses_snapshot():
    """Five GPUs wanted in one replica of 1/2/4/8 (model needs 2 GPUs): greedy takes 4 and stops one
    short; the MILP takes 8."""
    svc = reward_service(model_gib=140, max_starting=1)
    return snapshot(0, [gpu_node("g0"), gpu_node("g1")], services=[svc], demand=[PoolDemand("rm", 5, 5)])


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_each_solver_proves_optimality_and_beats_greedy_here(solver: str) -> None:
    plan = CapacityPlanner(PlannerConfig(solver=solver, time_limit_s=10)).plan(greedy_loses_snapshot())
    report = plan.placement
    assert report.method == "milp" and report.sol_status == "optimal"
    assert report.solver == {"highs": "HiGHS", "cbc": "CBC"}[solver]
    assert report.objective < report.greedy_objective
    assert [a.gpus for a in plan.adds] == [8]


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_impossible_time_budget_falls_back_to_greedy(solver: str) -> None:
    snap = greedy_loses_snapshot()
    plan = CapacityPlanner(PlannerConfig(solver=solver, time_limit_s=0)).plan(snap)
    report = plan.placement
    assert report.sol_status != "optimal"
    assert report.method == "greedy"
    assert report.objective == report.greedy_objective
    assert "greedy" in report.message
    assert [a.gpus for a in plan.adds] == [4]
    assert not overcommitted_nodes(snap, plan)


def test_a_solver_that_cannot_run_falls_back_and_says_why() -> None:
    config = PlannerConfig(solver="cbc", cbc_path="/nonexistent/cbc", time_limit_s=1)
    plan = CapacityPlanner(config).plan(greedy_loses_snapshot())
    assert plan.placement.sol_status == "error"
    assert plan.placement.method == "greedy"
    assert "cannot execute" in plan.placement.message
    assert len(plan.adds) == 1


def test_last_good_plan_is_reused_on_timeout_while_still_feasible() -> None:
    planner = CapacityPlanner(PlannerConfig(time_limit_s=10))
    snap = greedy_loses_snapshot()
    first = planner.plan(snap)
    assert first.placement.method == "milp"
    assert planner.last_good_placement is not None
    planner.config = PlannerConfig(time_limit_s=0)
    again = planner.plan(snap)
    assert again.placement.sol_status != "optimal"
    assert again.placement.method == "reused"
    assert [(a.node, a.gpus) for a in again.adds] == [(a.node, a.gpus) for a in first.adds]
    assert again.placement.objective < again.placement.greedy_objective


def test_last_good_plan_is_not_reused_once_infeasible() -> None:
    planner = CapacityPlanner(PlannerConfig(time_limit_s=10))
    first = planner.plan(greedy_loses_snapshot())
    used = {a.node for a in first.adds}
    svc = reward_service(model_gib=140, max_starting=1)
    # The node the last plan used is now cordoned: reusing it would be wrong.
    nodes = [gpu_node(n, schedulable=n not in used) for n in ("g0", "g1")]
    snap = snapshot(1, nodes, services=[svc], demand=[PoolDemand("rm", 5, 5)])
    planner.config = PlannerConfig(time_limit_s=0)
    plan = planner.plan(snap)
    assert plan.placement.method == "greedy"
    assert {a.node for a in plan.adds}.isdisjoint(used)


def test_solver_error_reuses_the_last_good_plan_too() -> None:
    planner = CapacityPlanner(PlannerConfig(solver="cbc", time_limit_s=10))
    first = planner.plan(greedy_loses_snapshot())
    planner.config = PlannerConfig(solver="cbc", cbc_path="/nonexistent/cbc")
    plan = planner.plan(greedy_loses_snapshot())
    assert plan.placement.sol_status == "error" and plan.placement.method == "reused"
    assert plan.adds == first.adds


def hard_packing_snapshot():
    """16 pools of 3/5/7/11-core hosts, six hosts each, onto 30 nodes of 23 cores: symmetric enough that
    the root node does not prove the optimum (CBC has not proven it after 20 s of branching), so a
    solver stopped before it branches has at best an incumbent."""
    pools = [sandbox_pool(f"p{i}", host_cores=(3, 5, 7, 11)[i % 4], host_memory_gib=1) for i in range(16)]
    nodes = [cpu_node(f"n{j:02d}", cores=23) for j in range(30)]
    demand = [PoolDemand(p.name, 6 * p.host_cores, 6 * p.host_cores) for p in pools]
    return snapshot(0, nodes, pools, demand=demand)


def hard_packing_problem() -> PlacementProblem:
    """The placement problem the planner builds from :func:`hard_packing_snapshot` (up to 20 hosts
    per pool: the factories' max_instances), for the solver alone."""
    nodes = tuple(NodeCapacity(f"n{j:02d}", 23_000, 256 * GiB, 0, 0, False) for j in range(30))
    names = frozenset(n.name for n in nodes)
    requests = tuple(
        PoolRequest(f"p{i}", (InstanceShape(cores, cores * 1000, GiB),), 6 * cores, 20, names)
        for i, cores in enumerate((3, 5, 7, 11)[i % 4] for i in range(16))
    )
    return PlacementProblem(requests, nodes)


def test_a_solver_stopped_with_an_incumbent_is_judged_by_sol_status_not_status() -> None:
    """CBC stopped by a limit reports pulp status "Optimal" for an unproven incumbent. A node limit
    (not the planner's time limit) stops it here, so the outcome does not hang on the machine's speed:
    the root node alone cannot prove this optimum."""
    problem = hard_packing_problem()
    solver = make_solver("cbc", 600)
    solver.optionsDict["maxNodes"] = 0  # the planner's CBC, stopped at the root node
    outcome = solve_placement(problem, solver)
    assert outcome.status == "Optimal"  # what pulp says
    assert outcome.sol_status == "feasible"  # what is true
    assert outcome.placement is not None and check_placement(problem, outcome.placement).feasible


@pytest.mark.parametrize(
    ("solver", "status", "sol_status"),
    [("highs", "Optimal", "feasible"), ("cbc", "Not Solved", "no-solution")],
)
def test_time_limited_run_is_judged_by_sol_status_not_status(
    solver: str, status: str, sol_status: str
) -> None:
    """A zero time limit stops either solver before it branches, on any machine: HiGHS holds only the
    greedy start it was handed (and pulp calls that "Optimal"), CBC (no start) holds nothing."""
    snap = hard_packing_snapshot()
    plan = CapacityPlanner(PlannerConfig(solver=solver, time_limit_s=0)).plan(snap)  # type: ignore[arg-type]
    report = plan.placement
    assert (report.status, report.sol_status) == (status, sol_status)
    assert report.method == "greedy" and report.objective == report.greedy_objective
    assert f"({sol_status}); used the greedy best-fit packing" in report.message
    assert not overcommitted_nodes(snap, plan)
    for pool in snap.sandbox_pools:
        assert sum(1 for a in plan.adds if a.pool == pool.name) <= 6


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_byte_sized_memory_does_not_mislead_the_solver(solver: str) -> None:
    """Memory counts in bytes (16 GiB = 1.7e10): CBC once called a placement "optimal" that left a
    GPU replica unplaced where greedy placed everything. The optimum places both pools."""
    problem = PlacementProblem(
        (
            PoolRequest("p0", (InstanceShape(8, 8000, 16 * GiB),), 10, 2, frozenset({"n0", "n1"})),
            PoolRequest(
                "p1", (InstanceShape(1, 2000, 16 * GiB, 1, 20 * GiB),), 1, 1, frozenset({"n1", "n2"})
            ),
        ),
        (
            NodeCapacity("n0", 16_000, 32 * GiB, 0, 40 * GiB, False),
            NodeCapacity("n1", 17_000, 34 * GiB, 1, 40 * GiB, True),
            NodeCapacity("n2", 2_000, 16 * GiB, 1, 40 * GiB, False),
        ),
    )
    greedy = placement_cost(problem, place_greedy(problem))
    outcome = solve_placement(problem, make_solver(solver, 20))  # type: ignore[arg-type]
    assert outcome.sol_status == "optimal" and outcome.placement is not None
    best = placement_cost(problem, outcome.placement)
    assert best.unplaced_units == 0 and best.total <= greedy.total
    assert outcome.placement.units_of("p1") == 1


def test_bad_planner_settings_are_named() -> None:
    with pytest.raises(InvalidSpec) as err:
        PlannerConfig(solver="gurobi")  # type: ignore[arg-type]
    assert err.value.field == "planner.solver"
    with pytest.raises(InvalidSpec) as err:
        PlannerConfig(time_limit_s=-1)
    assert err.value.field == "planner.time_limit_s"
    with pytest.raises(InvalidSpec) as err:
        make_solver("highs", -1)
    assert err.value.field == "time_limit_s"
