"""MIG planner: serves the demand, never over a GPU's layout rules, on as few GPUs as a pulp optimum."""

from __future__ import annotations

import pulp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.gpu import mig
from arl_tangram.gpu.fake import fake_inventory
from arl_tangram.gpu.migplan import MigGpu, ServiceDemand, chain, mig_gpus, plan_mig


def _gpus(n: int, model: str = "A100-80GB") -> list[MigGpu]:
    return [MigGpu(f"GPU-{i}", model) for i in range(n)]


def _check_serves(
    plan_layouts: dict[str, tuple[str, ...]],
    demands: list[ServiceDemand],
    model: str,
    assignment: dict[str, list[str]],
) -> None:
    table = mig.model_of(model)
    for lay in plan_layouts.values():
        assert mig.valid_layout(table, lay)
    pool = sorted(p for lay in plan_layouts.values() for p in lay)
    used = sorted(p for ps in assignment.values() for p in ps)
    # Every replica got an instance that exists and fits it, no instance twice.
    for p in used:
        pool.remove(p)
    for d in demands:
        assert len(assignment[d.name]) == d.replicas()
        for p in assignment[d.name]:
            prof = table.profile(p)
            assert prof.compute >= d.compute_slices and prof.memory_gb >= d.memory_gb


def test_replicas_follow_load_and_headroom() -> None:
    assert ServiceDemand("a", 5, rate_per_s=10, service_s=0.2, max_utilization=0.5).replicas() == 4
    assert ServiceDemand("b", 5, rate_per_s=0.001, service_s=0.01).replicas() == 1
    assert ServiceDemand("c", 5, min_replicas=3).replicas() == 3
    assert ServiceDemand("d", 5).replicas() == 0


def test_small_services_pack_onto_one_gpu() -> None:
    demands = [ServiceDemand(f"s{i}", 8, min_replicas=1) for i in range(7)]
    plan = plan_mig(demands, _gpus(4))
    assert plan.gpus_used == 1 and plan.optimal
    (layout,) = plan.layouts.values()
    assert len(layout) == 7 and all(p.startswith("1g.") for p in layout)
    _check_serves(plan.layouts, demands, "A100-80GB", plan.assignment)


def test_a_big_and_small_mix() -> None:
    demands = [
        ServiceDemand("judge", 35, compute_slices=3, min_replicas=2),
        ServiceDemand("rm", 15, min_replicas=3),
    ]
    plan = plan_mig(demands, _gpus(4))
    # Two 3g.40gb need a GPU's eight memory slices; three 1g.20gb need a second GPU.
    assert plan.gpus_used == 2
    _check_serves(plan.layouts, demands, "A100-80GB", plan.assignment)


def test_current_layouts_are_kept_where_the_plan_has_them() -> None:
    gpus = [MigGpu("GPU-0", "H100-80GB"), MigGpu("GPU-1", "H100-80GB", ("3g.40gb", "3g.40gb"))]
    plan = plan_mig([ServiceDemand("j", 30, compute_slices=3, min_replicas=2)], gpus)
    assert plan.layouts == {"GPU-1": ("3g.40gb", "3g.40gb")} and plan.unused == ["GPU-0"]


def test_demand_that_fits_no_profile_is_named() -> None:
    with pytest.raises(mig.MigError, match="service huge"):
        plan_mig([ServiceDemand("huge", 90, min_replicas=1)], _gpus(2))


def test_demand_beyond_the_gpus_is_a_clear_error() -> None:
    with pytest.raises(mig.MigError, match="cannot hold"):
        plan_mig([ServiceDemand("s", 8, min_replicas=15)], _gpus(2))


def test_one_model_at_a_time() -> None:
    with pytest.raises(mig.MigError, match="one GPU model"):
        plan_mig([], [MigGpu("a", "A100-80GB"), MigGpu("b", "H100-80GB")])


def test_inventory_groups_by_model() -> None:
    groups = mig_gpus(
        [fake_inventory("mig-a100", "a"), fake_inventory("mig-h100", "b"), fake_inventory("ring4")]
    )
    assert sorted(groups) == ["A100-40GB", "A100-80GB", "H100-80GB"]
    assert groups["A100-80GB"][1].current == ("1g.10gb",) * 7
    assert groups["A100-80GB"][3].current is None


def _pulp_optimum(demands: list[ServiceDemand], n_gpus: int, model: str) -> int | None:
    """The fewest GPUs, from a MILP over every valid layout with explicit instance assignment (not
    the planner's chain reasoning)."""
    table = mig.model_of(model)
    lays = [lay for lay in mig.layouts(model) if not any(p.endswith("+me") for p in lay)]
    names = [p.name for p in chain(model)]
    prob = pulp.LpProblem("mig", pulp.LpMinimize)
    y = {(g, i): pulp.LpVariable(f"y_{g}_{i}", cat="Binary") for g in range(n_gpus) for i in range(len(lays))}
    a = {
        (d.name, p): pulp.LpVariable(f"a_{d.name}_{p.replace('.', '_')}", lowBound=0, cat="Integer")
        for d in demands
        for p in names
        if table.profile(p).compute >= d.compute_slices and table.profile(p).memory_gb >= d.memory_gb
    }
    prob += pulp.lpSum(y.values())
    for g in range(n_gpus):
        prob += pulp.lpSum(y[g, i] for i in range(len(lays))) <= 1
    for p in names:
        have = pulp.lpSum(y[g, i] * lays[i].count(p) for g in range(n_gpus) for i in range(len(lays)))
        prob += pulp.lpSum(v for (s, q), v in a.items() if q == p) <= have
    for d in demands:
        prob += pulp.lpSum(v for (s, q), v in a.items() if s == d.name) >= d.replicas()
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=60))
    if pulp.LpStatus[status] != "Optimal" or prob.sol_status != pulp.LpSolutionOptimal:
        return None
    return round(pulp.value(prob.objective) or 0)


demand_sets = st.lists(
    st.builds(
        ServiceDemand,
        name=st.just(""),
        memory_gb=st.sampled_from([4.0, 9.0, 15.0, 19.0, 30.0, 39.0, 60.0]),
        compute_slices=st.sampled_from([1, 1, 2, 3, 4]),
        min_replicas=st.integers(0, 4),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pulp 3.3 announces its 4.0 API
@settings(max_examples=40, derandomize=True, deadline=None)
@given(demand_sets, st.sampled_from(["A100-80GB", "H200-141GB", "A30-24GB"]))
def test_planner_matches_the_pulp_optimum(raw: list[ServiceDemand], model: str) -> None:
    demands = [
        ServiceDemand(f"s{i}", d.memory_gb, d.compute_slices, min_replicas=d.min_replicas)
        for i, d in enumerate(raw)
    ]
    n_gpus = 4
    try:
        plan = plan_mig(demands, _gpus(n_gpus, model))
    except mig.MigError:
        plan = None
    best = _pulp_optimum(
        [
            d
            for d in demands
            if any(p.compute >= d.compute_slices and p.memory_gb >= d.memory_gb for p in chain(model))
        ],
        n_gpus,
        model,
    )
    fits_all = all(
        any(p.compute >= d.compute_slices and p.memory_gb >= d.memory_gb for p in chain(model))
        for d in demands
    )
    if plan is None:
        assert not fits_all or best is None
        return
    assert plan.optimal and best is not None
    assert plan.gpus_used == best
    _check_serves(plan.layouts, demands, model, plan.assignment)


def test_a_fleet_plan_is_valid_and_within_one_gpu_of_the_bound() -> None:
    demands = [
        ServiceDemand(f"rm{i}", 9, rate_per_s=20 + 7 * i, service_s=0.05 + 0.01 * i) for i in range(6)
    ] + [ServiceDemand(f"judge{i}", 38, compute_slices=3, rate_per_s=2, service_s=0.8) for i in range(3)]
    plan = plan_mig(demands, _gpus(32, "H100-80GB"))
    _check_serves(plan.layouts, demands, "H100-80GB", plan.assignment)
    slices = sum(mig.model_of("H100-80GB").profile(p).compute for ps in plan.assignment.values() for p in ps)
    assert plan.optimal and plan.gpus_used >= -(-slices // 7)
