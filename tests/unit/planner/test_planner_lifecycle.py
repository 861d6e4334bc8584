"""Several planning rounds end to end: a burst ramps up under max_starting, then the pool drains back
to its floor, removing hosts only once drained.

A minimal in-test runtime applies each plan (create as ``starting``, ready after the cold start,
cordon, delete); the real runtime and the simulator live elsewhere. The planner is the real one.
"""

from __future__ import annotations

import dataclasses

from planner_factories import cpu_node, overcommitted_nodes, sandbox_pool, snapshot

from arl_tangram.planner import CapacityPlanner, InstanceSnapshot, PoolDemand, ScalingPlan

COLD_START_S = 10.0
PERIOD_S = 5.0


class TinyRuntime:
    """Applies plans to a dict of instances the way the runtime contract in the planner says."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceSnapshot] = {}
        self.created = 0
        self.removed_while_held: list[str] = []

    def apply(self, plan: ScalingPlan, now: float) -> None:
        for removal in plan.removals:
            inst = self.instances.pop(removal.name)
            if inst.phase != "failed" and (inst.running_actions or inst.pinned_sessions):
                self.removed_while_held.append(inst.name)
        for drain in plan.drains:
            self.instances[drain.name] = dataclasses.replace(self.instances[drain.name], phase="draining")
        for undrain in plan.undrains:
            self.instances[undrain.name] = dataclasses.replace(self.instances[undrain.name], phase="ready")
        for add in plan.adds:
            name = f"h{self.created}"
            self.created += 1
            self.instances[name] = InstanceSnapshot(
                name,
                add.pool,
                add.node,
                "starting",
                add.cpu_millicores,
                add.memory_bytes,
                add.gpus,
                started_at=now,
            )

    def tick(self, now: float) -> None:
        for name, inst in list(self.instances.items()):
            if inst.phase == "starting" and now - inst.started_at >= COLD_START_S:
                self.instances[name] = dataclasses.replace(inst, phase="ready")

    def set_load(self, name: str, running: int, pinned: int) -> None:
        self.instances[name] = dataclasses.replace(
            self.instances[name], running_actions=running, pinned_sessions=pinned
        )

    def count(self, phase: str) -> int:
        return sum(1 for i in self.instances.values() if i.phase == phase)


def test_burst_ramps_up_within_max_starting_then_drains_back_to_the_floor() -> None:
    pool = sandbox_pool(host_cores=8, min_instances=1, max_instances=6, max_starting=2, idle_timeout_s=20)
    nodes = [cpu_node("a", cores=32), cpu_node("b", cores=32)]
    planner = CapacityPlanner()
    runtime = TinyRuntime()
    now = 0.0

    def round_(demand: list[PoolDemand]) -> ScalingPlan:
        nonlocal now
        runtime.tick(now)
        snap = snapshot(now, nodes, [pool], instances=runtime.instances.values(), demand=demand)
        plan = planner.plan(snap)
        assert not overcommitted_nodes(snap, plan)
        runtime.apply(plan, now)
        assert runtime.count("starting") <= 2
        assert len(runtime.instances) <= 6
        now += PERIOD_S
        return plan

    # Burst: 44 cores of work -> 6 hosts (capped by max_instances), started two at a time.
    while runtime.count("ready") < 6:
        assert now < 60, "ramp-up did not finish"
        round_([PoolDemand("code", 44, 44)])
    # All six fully busy for a while; two hold pinned sessions (one and two of them).
    names = sorted(runtime.instances)
    sessions = {names[0]: 1, names[1]: 2}
    for name in names:
        runtime.set_load(name, 1, sessions.get(name, 0))
    for _ in range(4):
        plan = round_([PoolDemand("code", 0, 0, 6, 48)])
        assert not plan.drains and not plan.removals

    # The load falls to 6 cores: surplus, drained only once it has lasted idle_timeout_s (20 s).
    quiet_since = now
    while True:
        plan = round_([PoolDemand("code", 0, 0, 6, 6)])
        if plan.drains:
            break
        assert now - quiet_since <= 25, "surplus never drained"
    assert now - PERIOD_S - quiet_since == 20
    # Five go; the one kept is the one with the most sessions. Busy hosts are cordoned, not removed.
    assert sorted(d.name for d in plan.drains) == sorted(set(names) - {names[1]})
    assert not plan.removals
    for _ in range(3):
        plan = round_([PoolDemand("code", 0, 0, 6, 6)])
        assert not plan.removals and not plan.drains
    # Actions finish; names[0] still holds a session, so it stays cordoned while the rest go.
    for name in names:
        runtime.set_load(name, 0, sessions.get(name, 0))
    plan = round_([])
    assert sorted(r.name for r in plan.removals) == sorted(set(names) - {names[0], names[1]})
    assert all(r.reason.code == "Drained" for r in plan.removals)
    assert runtime.instances[names[0]].phase == "draining"
    # The session ends: now it is drained and removed; the floor host remains.
    runtime.set_load(names[0], 0, 0)
    plan = round_([])
    assert [r.name for r in plan.removals] == [names[0]]
    assert list(runtime.instances) == [names[1]] and runtime.count("ready") == 1
    assert runtime.removed_while_held == []
