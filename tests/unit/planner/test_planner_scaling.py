"""Scaling decisions of the capacity planner: up under a queue, limits, warm floors, idle, drains."""

from __future__ import annotations

from planner_factories import (
    cpu_node,
    gpu_node,
    host,
    overcommitted_nodes,
    replica,
    reward_service,
    sandbox_pool,
    snapshot,
)

from arl_tangram.planner import CapacityPlanner, PlannerConfig, PoolDemand


def codes(plan, pool: str) -> list[str]:
    return [r.code for r in plan.pool(pool).reasons]


def test_queue_scales_a_sandbox_pool_up_to_cover_the_queued_units() -> None:
    pool = sandbox_pool(host_cores=8)
    snap = snapshot(0, [cpu_node("a"), cpu_node("b")], [pool], demand=[PoolDemand("code", 40, 40)])
    plan = CapacityPlanner().plan(snap)
    assert len(plan.adds) == 5  # 40 cores of work in 8-core hosts
    assert all(a.pool == "code" and a.units == 8 and a.cpu_millicores == 8000 for a in plan.adds)
    assert plan.pool("code").planned_units == 40
    assert plan.pool("code").unmet_units == 0
    assert "ScaleUp" in codes(plan, "code")
    assert plan.adds[0].reason.code == "ScaleUp"
    assert plan.placement.method == "milp" and plan.placement.sol_status == "optimal"
    assert not overcommitted_nodes(snap, plan)


def test_arrival_rate_alone_sizes_the_pool_by_littles_law() -> None:
    pool = sandbox_pool(host_cores=4, target_utilisation=0.5)
    # 10 actions/s x 0.6 s x 2 cores / 0.5 utilisation = 24 cores = 6 hosts
    demand = PoolDemand("code", arrival_rate_per_s=10, mean_action_s=0.6, mean_units_per_action=2)
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], demand=[demand]))
    assert plan.pool("code").need_units == 24
    assert len(plan.adds) == 6


def test_adds_never_exceed_max_starting_counting_those_already_starting() -> None:
    pool = sandbox_pool(host_cores=8, max_starting=3)
    starting = [host(f"h{i}", pool, "a", phase="starting") for i in range(2)]
    snap = snapshot(0, [cpu_node("a")], [pool], instances=starting, demand=[PoolDemand("code", 200, 200)])
    plan = CapacityPlanner().plan(snap)
    assert len(plan.adds) == 1
    assert "MaxStarting" in codes(plan, "code")
    assert plan.pool("code").unmet_units > 0


def test_adds_never_exceed_max_instances() -> None:
    pool = sandbox_pool(host_cores=8, max_instances=4)
    ready = [host(f"h{i}", pool, "a") for i in range(3)]
    snap = snapshot(
        0, [cpu_node("a", cores=128)], [pool], instances=ready, demand=[PoolDemand("code", 100, 100)]
    )
    plan = CapacityPlanner().plan(snap)
    assert len(plan.adds) == 1
    assert "MaxInstances" in codes(plan, "code")


def test_warm_minimum_is_started_and_then_kept_through_long_idleness() -> None:
    pool = sandbox_pool(host_cores=8, min_instances=2, warm_instances=1, idle_timeout_s=10)
    planner = CapacityPlanner()
    plan = planner.plan(snapshot(0, [cpu_node("a")], [pool]))
    # With no demand the floor (2) is above demand + warm (0 + 1).
    assert len(plan.adds) == 2
    assert all(a.reason.code == "WarmMinimum" for a in plan.adds)
    ready = [host(f"h{i}", pool, "a") for i in range(2)]
    for t in (100, 1000, 10_000):
        plan = planner.plan(snapshot(t, [cpu_node("a")], [pool], instances=ready))
        assert plan.is_empty, plan
    # Warm capacity rides on top of demand: 16 busy cores -> 2 hosts of need + 1 warm.
    busy = [PoolDemand("code", 0, 0, 2, 16)]
    plan = planner.plan(snapshot(10_001, [cpu_node("a")], [pool], instances=ready, demand=busy))
    assert plan.pool("code").target_units == 24
    assert len(plan.adds) == 1 and plan.adds[0].reason.code == "WarmMinimum"


def test_reward_service_scales_to_zero_after_idle_timeout_and_only_then() -> None:
    svc = reward_service(min_instances=1, scale_to_zero=True, idle_timeout_s=60)
    nodes = [gpu_node("g")]
    rep = [replica("r0", svc, "g", 2)]
    planner = CapacityPlanner()
    for t in (0, 30, 59.9):
        plan = planner.plan(snapshot(t, nodes, services=[svc], instances=rep))
        assert not plan.drains and not plan.removals, t
        assert plan.pool("rm").target_units >= 1
    plan = planner.plan(snapshot(60, nodes, services=[svc], instances=rep))
    assert [d.name for d in plan.drains] == ["r0"]
    assert plan.drains[0].reason.code == "ScaleToZero"
    assert plan.pool("rm").planned_units == 0
    # Drained on the next round, then removed; nothing new is started.
    rep = [replica("r0", svc, "g", 2, phase="draining")]
    plan = planner.plan(snapshot(61, nodes, services=[svc], instances=rep))
    assert [r.name for r in plan.removals] == ["r0"] and not plan.adds


def test_activity_resets_the_idle_clock() -> None:
    svc = reward_service(min_instances=1, scale_to_zero=True, idle_timeout_s=60)
    nodes = [gpu_node("g")]
    rep = [replica("r0", svc, "g", 2)]
    planner = CapacityPlanner()
    planner.plan(snapshot(0, nodes, services=[svc], instances=rep))
    busy = [replica("r0", svc, "g", 2, running=1)]
    planner.plan(snapshot(50, nodes, services=[svc], instances=busy, demand=[PoolDemand("rm", 0, 0, 1, 2)]))
    plan = planner.plan(snapshot(100, nodes, services=[svc], instances=rep))
    assert not plan.drains  # idle for 50 s only
    assert plan.pool("rm").idle_for_s == 0
    plan = planner.plan(snapshot(160, nodes, services=[svc], instances=rep))
    assert [d.name for d in plan.drains] == ["r0"]


def test_last_active_at_from_the_caller_drives_scale_to_zero() -> None:
    svc = reward_service(min_instances=1, scale_to_zero=True, idle_timeout_s=60)
    rep = [replica("r0", svc, "g", 2)]
    planner = CapacityPlanner()
    early = PoolDemand("rm", last_active_at=950)
    plan = planner.plan(snapshot(1000, [gpu_node("g")], services=[svc], instances=rep, demand=[early]))
    assert not plan.drains and plan.pool("rm").idle_for_s == 50
    late = PoolDemand("rm", last_active_at=900)
    plan = planner.plan(snapshot(1000, [gpu_node("g")], services=[svc], instances=rep, demand=[late]))
    assert [d.reason.code for d in plan.drains] == ["ScaleToZero"]


def test_cold_start_over_budget_refuses_scale_to_zero() -> None:
    svc = reward_service(scale_to_zero=True, idle_timeout_s=10, cold_start_s=90, cold_start_budget_s=30)
    rep = [replica("r0", svc, "g", 2), replica("r1", svc, "g", 2)]
    planner = CapacityPlanner()
    planner.plan(snapshot(0, [gpu_node("g")], services=[svc], instances=rep))
    plan = planner.plan(snapshot(100, [gpu_node("g")], services=[svc], instances=rep))
    assert "ColdStartBudget" in codes(plan, "rm")
    assert len(plan.drains) == 1  # one of two goes, one stays warm
    assert plan.pool("rm").planned_units == 2


def test_scale_to_zero_pool_restarts_when_demand_returns() -> None:
    svc = reward_service(scale_to_zero=True, idle_timeout_s=10)
    plan = CapacityPlanner().plan(
        snapshot(0, [gpu_node("g")], services=[svc], demand=[PoolDemand("rm", 3, 3)])
    )
    assert sum(a.gpus for a in plan.adds) == 3
    assert {a.gpus for a in plan.adds} <= {1, 2, 4, 8}


def test_surplus_is_drained_only_after_it_lasted_idle_timeout() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=30)
    ready = [host(f"h{i}", pool, "a", started_at=i) for i in range(4)]
    demand = [PoolDemand("code", 0, 0, 1, 8)]
    planner = CapacityPlanner()
    plan = planner.plan(snapshot(0, [cpu_node("a")], [pool], instances=ready, demand=demand))
    assert not plan.drains and "DrainBlocked" in codes(plan, "code")
    plan = planner.plan(snapshot(29, [cpu_node("a")], [pool], instances=ready, demand=demand))
    assert not plan.drains
    plan = planner.plan(snapshot(30, [cpu_node("a")], [pool], instances=ready, demand=demand))
    assert len(plan.drains) == 3 and not plan.removals
    assert all(d.reason.code == "ScaleDown" for d in plan.drains)


def test_act_above_target_blocks_scale_down_and_grows_a_queued_pool() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=0, act_target_s=1.0)
    ready = [host(f"h{i}", pool, "a") for i in range(4)]
    slow_idle = [PoolDemand("code", 0, 0, 1, 8, act_recent_s=3.0)]
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=ready, demand=slow_idle))
    assert not plan.drains
    slow_queued = [PoolDemand("code", 2, 2, 4, 30, act_recent_s=3.0)]
    plan = CapacityPlanner().plan(
        snapshot(0, [cpu_node("a", cores=128)], [pool], instances=ready, demand=slow_queued)
    )
    # 32 active cores, ACT 3x its target, growth bounded at 2x -> 64 cores.
    assert plan.pool("code").need_units == 64
    assert len(plan.adds) == 4


def test_scale_down_picks_fewest_sessions_then_least_loaded_then_newest() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=0)
    ready = [
        host("pinned", pool, "a", pinned=1, started_at=9),
        host("busy", pool, "a", running=2, started_at=8),
        host("old-idle", pool, "a", started_at=1),
        host("new-idle", pool, "a", started_at=5),
        host("light", pool, "a", running=1, started_at=7),
    ]
    demand = [PoolDemand("code", 0, 0, 3, 24)]  # keeps 3 of 5 hosts
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=ready, demand=demand))
    assert [d.name for d in plan.drains] == ["new-idle", "old-idle"]
    demand = [PoolDemand("code", 0, 0, 3, 8)]  # keeps 1 of 5
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=ready, demand=demand))
    assert [d.name for d in plan.drains] == ["new-idle", "old-idle", "light", "busy"]


def test_busy_or_pinned_hosts_are_drained_first_and_removed_only_when_drained() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=0)
    planner = CapacityPlanner()
    busy = [host("running", pool, "a", running=1), host("pinned", pool, "a", pinned=2)]
    plan = planner.plan(snapshot(0, [cpu_node("a")], [pool], instances=busy))
    assert sorted(d.name for d in plan.drains) == ["pinned", "running"]
    assert not plan.removals  # drain first, never straight to removal
    still = [
        host("running", pool, "a", phase="draining", running=1),
        host("pinned", pool, "a", phase="draining", pinned=2),
    ]
    for t in (1, 100, 10_000):
        plan = planner.plan(snapshot(t, [cpu_node("a")], [pool], instances=still))
        assert not plan.removals and not plan.drains and not plan.adds
    done = [
        host("running", pool, "a", phase="draining"),
        host("pinned", pool, "a", phase="draining", pinned=1),
    ]
    plan = planner.plan(snapshot(10_001, [cpu_node("a")], [pool], instances=done))
    assert [(r.name, r.reason.code) for r in plan.removals] == [("running", "Drained")]


def test_an_idle_ready_host_is_drained_before_it_is_removed() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=0)
    planner = CapacityPlanner()
    plan = planner.plan(snapshot(0, [cpu_node("a")], [pool], instances=[host("h", pool, "a")]))
    assert [d.name for d in plan.drains] == ["h"] and not plan.removals
    plan = planner.plan(
        snapshot(1, [cpu_node("a")], [pool], instances=[host("h", pool, "a", phase="draining")])
    )
    assert [r.name for r in plan.removals] == ["h"]


def test_returning_demand_undrains_before_starting_new_hosts() -> None:
    pool = sandbox_pool(host_cores=8)
    instances = [
        host("d-busy", pool, "a", phase="draining", running=1),
        host("d-empty", pool, "a", phase="draining"),
        host("r", pool, "a"),
    ]
    demand = [PoolDemand("code", 10, 10, 1, 8)]  # 18 cores -> 3 hosts
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=instances, demand=demand))
    assert [u.name for u in plan.undrains] == ["d-busy", "d-empty"]
    assert not plan.adds and not plan.removals
    demand = [PoolDemand("code", 2, 2, 1, 8)]  # 10 cores -> 2 hosts: one comes back, the empty one goes
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=instances, demand=demand))
    assert [u.name for u in plan.undrains] == ["d-busy"]
    assert [r.name for r in plan.removals] == ["d-empty"]


def test_surplus_starting_hosts_are_cancelled_before_ready_ones_are_drained() -> None:
    pool = sandbox_pool(host_cores=8, idle_timeout_s=0)
    instances = [host("r0", pool, "a"), host("s0", pool, "a", phase="starting", started_at=5)]
    demand = [PoolDemand("code", 0, 0, 1, 4)]
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=instances, demand=demand))
    assert [(r.name, r.reason.code) for r in plan.removals] == [("s0", "CancelStart")]
    assert not plan.drains


def test_failed_instances_are_removed_and_replaced() -> None:
    pool = sandbox_pool(host_cores=8, min_instances=1)
    instances = [host("dead", pool, "a", phase="failed", running=3)]
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool], instances=instances))
    assert [(r.name, r.reason.code) for r in plan.removals] == [("dead", "InstanceFailed")]
    assert len(plan.adds) == 1


def test_placement_respects_free_capacity_selectors_and_cordoned_nodes() -> None:
    pool = sandbox_pool(host_cores=16, host_memory_gib=64, node_selector={"pool": "cpu"})
    nodes = [
        cpu_node("small", cores=40, memory_gib=512, labels={"pool": "cpu"}),  # 2 hosts by cpu
        cpu_node("lowmem", cores=128, memory_gib=130, labels={"pool": "cpu"}),  # 2 hosts by memory
        cpu_node("other", cores=256, labels={"pool": "gpu"}),  # wrong label
        cpu_node("cordoned", cores=256, labels={"pool": "cpu"}, schedulable=False),
        cpu_node("busy", cores=64, labels={"pool": "cpu"}, reserved_cpu_millicores=60_000),
    ]
    snap = snapshot(0, nodes, [pool], demand=[PoolDemand("code", 160, 160)])
    plan = CapacityPlanner().plan(snap)
    per_node = {
        n: sum(1 for a in plan.adds if a.node == n) for n in ("small", "lowmem", "other", "cordoned", "busy")
    }
    assert per_node == {"small": 2, "lowmem": 2, "other": 0, "cordoned": 0, "busy": 0}
    assert plan.pool("code").unmet_units == 160 - 64
    assert "Unplaceable" in codes(plan, "code")
    assert not overcommitted_nodes(snap, plan)


def test_gpu_replicas_land_where_enough_gpus_are_free_and_big_enough() -> None:
    svc = reward_service(sizes=(4,), model_gib=200, max_starting=1)
    other = reward_service(name="other", sizes=(2,))
    nodes = [gpu_node("full", gpus=8), gpu_node("free", gpus=8), gpu_node("small-gpus", gpus=8, gpu_gib=40)]
    taken = [replica(f"o{i}", other, "full", 2) for i in range(3)]  # 6 of 8 GPUs busy on "full"
    snap = snapshot(0, nodes, services=[svc, other], instances=taken, demand=[PoolDemand("rm", 4, 4)])
    plan = CapacityPlanner().plan(snap)
    adds = [a for a in plan.adds if a.pool == "rm"]
    # 4 x 40 GiB GPUs cannot hold 200 GiB; "full" has 2 GPUs free.
    assert [(a.node, a.gpus) for a in adds] == [("free", 4)]
    assert not overcommitted_nodes(snap, plan)


def test_gpu_memory_need_rules_out_replica_sizes_too_small_to_hold_the_model() -> None:
    svc = reward_service(sizes=(1, 2, 4, 8), model_gib=140)  # needs >= 2 x 80 GiB
    plan = CapacityPlanner().plan(
        snapshot(0, [gpu_node("g")], services=[svc], demand=[PoolDemand("rm", 1, 1)])
    )
    assert [a.gpus for a in plan.adds] == [2]
    assert plan.pool("rm").planned_units == 2


def test_plan_packs_new_instances_onto_nodes_already_in_use() -> None:
    pool = sandbox_pool(host_cores=8)
    nodes = [cpu_node("a"), cpu_node("b"), cpu_node("c")]
    instances = [host("h0", pool, "b")]
    demand = [PoolDemand("code", 16, 16, 1, 8)]
    plan = CapacityPlanner().plan(snapshot(0, nodes, [pool], instances=instances, demand=demand))
    assert [a.node for a in plan.adds] == ["b", "b"]


def test_greedy_solver_setting_never_runs_a_milp() -> None:
    pool = sandbox_pool(host_cores=8)
    plan = CapacityPlanner(PlannerConfig(solver="greedy")).plan(
        snapshot(0, [cpu_node("a")], [pool], demand=[PoolDemand("code", 16, 16)])
    )
    assert plan.placement.method == "greedy" and plan.placement.solver is None
    assert plan.placement.sol_status == "not-run"
    assert len(plan.adds) == 2


def test_nothing_to_do_runs_no_solver() -> None:
    pool = sandbox_pool()
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a")], [pool]))
    assert plan.is_empty
    assert plan.placement.method == "none" and plan.placement.sol_status == "not-run"
    assert plan.pool("code").reasons[0].code == "Steady"


def test_sessions_memory_sizes_a_sandbox_pool_with_no_action_yet() -> None:
    pool = sandbox_pool(host_cores=8, host_memory_gib=16)
    # 100 GiB of live sessions on hosts of 16 GiB: 7 hosts, whatever the (empty) queue says.
    demand = PoolDemand("code", session_memory_bytes=100 * 2**30)
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a"), cpu_node("b")], [pool], demand=[demand]))
    assert plan.pool("code").need_units == 56
    assert len(plan.adds) == 7
    assert any("live sessions need 56 units" in r.message for r in plan.pool("code").reasons)
    # Hosts that take 4 sessions each: 30 sessions need 8 hosts, more than their memory (3 GiB).
    capped = sandbox_pool(host_cores=8, host_memory_gib=16)
    capped = type(capped)(capped.name, 8, capped.host_memory_bytes, capped.scaling, sessions_per_host=4)
    demand = PoolDemand("code", session_memory_bytes=3 * 2**30, sessions=30)
    plan = CapacityPlanner().plan(snapshot(0, [cpu_node("a"), cpu_node("b")], [capped], demand=[demand]))
    assert plan.pool("code").need_units == 64
    # A reward service has no sessions: the field does not size it.
    rm = reward_service("rm", max_instances=4)
    plan = CapacityPlanner().plan(
        snapshot(0, [gpu_node("g")], [], [rm], demand=[PoolDemand("rm", session_memory_bytes=2**40)])
    )
    assert plan.pool("rm").need_units == 0
