"""The pure ActionPool reconcile, table-driven: observed hosts, load and the planner's decision in;
status and operations out. No cluster, no I/O."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.controllers.actionpool import (
    UNSCHEDULABLE_AFTER_S,
    CreateHost,
    DeleteHost,
    PoolObservation,
    SetDraining,
    reconcile_actionpool,
)
from arl_tangram.dispatch.dispatcher import HostLoad, PoolStats
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.planner.plan import (
    InstanceAdd,
    InstanceDrain,
    InstanceRemoval,
    PlacementReport,
    Reason,
    ScalingPlan,
)
from arl_tangram.runtime.interface import HostObservation, HostPhase

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def cfg(**scaling: Any) -> PoolConfig:
    model = ActionPool.model_validate(
        {
            "metadata": {"name": "py", "namespace": "ns", "generation": 3},
            "spec": {"template": {"image": "img:1", "resources": {"cpu": "4"}}, "scaling": scaling},
        }
    )
    return pool_config(model, uid="u")


CFG = cfg(minHosts=0, maxHosts=4, maxStarting=2)


def host(name: str, phase: HostPhase = "ready", template: str | None = None, **kw: Any) -> HostObservation:
    return HostObservation(
        name=name,
        pool=CFG.key,
        phase=phase,
        node="n1",
        address="10.0.0.1:8080",
        template_hash=CFG.template_hash if template is None else template,
        created_at=1.0,
        cpu_millicores=4000,
        memory_bytes=1 << 34,
        **kw,
    )


def stats(
    loads: dict[str, tuple[int, int]] | None = None, queued: int = 0, unhealthy: frozenset[str] = frozenset()
) -> PoolStats:
    hosts = {h: HostLoad(r, s, r) for h, (r, s) in (loads or {}).items()}
    return PoolStats(
        queued,
        queued,
        sum(r for r, _ in (loads or {}).values()),
        0,
        4 * len(hosts),
        0,
        (1.0, 3.0),
        0.0,
        0.0,
        None,
        hosts,
        unhealthy,
    )


def plan(**parts: Any) -> ScalingPlan:
    report = PlacementReport("none", None, "", "not-run", 0.0, 0.0, 0.0, 0.0, "")
    return ScalingPlan(
        0.0, parts.get("adds", ()), parts.get("drains", ()), (), parts.get("removals", ()), (), report, 0.0
    )


R = Reason("ScaleUp", "because")


def _kinds(ops: list[Any]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for op in ops:
        if isinstance(op, CreateHost):
            out.append(("create", op.node or ""))
        elif isinstance(op, DeleteHost):
            out.append(("delete", op.name))
        elif isinstance(op, SetDraining):
            out.append(("drain" if op.draining else "undrain", op.name))
    return out


CASES = [
    pytest.param([], None, plan(), [], ("True", "ScaledToZero"), id="idle-pool-at-zero-is-ready"),
    pytest.param(
        [],
        stats(queued=3),
        plan(adds=(InstanceAdd(CFG.key, "n1", 4, 4000, 1, 0, R),) * 2),
        [("create", "n1"), ("create", "n1")],
        ("True", "ScaledToZero"),
        id="planner-adds-become-creates",
    ),
    pytest.param(
        [host("a", "starting")],
        stats(queued=1),
        plan(),
        [],
        ("False", "HostsStarting"),
        id="starting-not-ready",
    ),
    pytest.param(
        [host("a", "failed", failure="OOMKilled")],
        stats(),
        plan(),
        [("delete", "a")],
        ("True", "ScaledToZero"),
        id="failed-host-is-replaced",
    ),
    pytest.param(
        [host("a"), host("b")],
        stats({"a": (0, 0), "b": (0, 0)}, unhealthy=frozenset({"b"})),
        plan(),
        [("delete", "b")],
        ("True", "HostsReady"),
        id="unhealthy-host-is-replaced",
    ),
    pytest.param(
        [host("a")],
        stats({"a": (0, 0)}),
        plan(drains=(InstanceDrain("a", CFG.key, "n1", R),)),
        [("drain", "a")],
        ("True", "HostsReady"),
        id="planner-drain",
    ),
    pytest.param(
        [host("a", "draining")],
        stats({"a": (0, 0)}),
        plan(removals=(InstanceRemoval("a", CFG.key, "n1", R),)),
        [("delete", "a")],
        ("True", "ScaledToZero"),
        id="drained-host-removed",
    ),
    pytest.param(
        [host("old1", template="x"), host("old2", template="x"), host("new")],
        stats({"old1": (1, 0), "old2": (0, 0), "new": (0, 0)}),
        plan(),
        [("drain", "old1"), ("delete", "old2")],
        ("True", "HostsReady"),
        id="rollout-deletes-idle-outdated-hosts-and-drains-busy-ones",
    ),
    pytest.param(
        [host("old1", template="x")],
        stats({"old1": (2, 1)}),
        plan(),
        [("drain", "old1")],
        ("True", "HostsReady"),
        id="rollout-drains-a-busy-host-with-a-session",
    ),
    pytest.param(
        [host("s", "starting", template="x")],
        stats(),
        plan(),
        [("delete", "s")],
        ("False", "HostsStarting"),
        id="rollout-deletes-outdated-starting-hosts",
    ),
]


@pytest.mark.parametrize(("hosts", "load", "decision", "ops", "ready"), CASES)
def test_reconcile(
    hosts: list[HostObservation],
    load: PoolStats | None,
    decision: ScalingPlan,
    ops: list[tuple[str, ...]],
    ready: tuple[str, str],
) -> None:
    status, got = reconcile_actionpool(CFG, PoolObservation(hosts, load, decision), NOW)
    assert _kinds(got) == ops
    cond = {c["type"]: c for c in status["conditions"]}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ready
    assert status["observedGeneration"] == 3
    assert status["replicas"] == len(hosts)
    assert status["selector"] == "tangram.arl.dev/pool=py"


def test_a_host_no_node_can_hold_says_so_after_a_while() -> None:
    pending = [host("a", "starting", pending="0/2 nodes are available: 2 Insufficient cpu.")]
    early, _ = reconcile_actionpool(CFG, PoolObservation(pending, stats(), plan(), (), 1.0), NOW)
    late, _ = reconcile_actionpool(
        CFG, PoolObservation(pending, stats(), plan(), (), UNSCHEDULABLE_AFTER_S), NOW
    )
    assert {c["type"]: c["reason"] for c in early["conditions"]}["Ready"] == "HostsStarting"
    cond = {c["type"]: c for c in late["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "Unschedulable"
    assert "Insufficient cpu" in cond["Ready"]["message"]
    assert cond["Degraded"]["status"] == "True"


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first, _ = reconcile_actionpool(CFG, PoolObservation([], stats(), plan()), NOW)
    later = NOW.replace(hour=13)
    second, _ = reconcile_actionpool(CFG, PoolObservation([], stats(), plan(), first["conditions"]), later)
    assert first["conditions"] == second["conditions"]
    third, _ = reconcile_actionpool(
        CFG, PoolObservation([host("a", "starting")], stats(), plan(), second["conditions"]), later
    )
    ready = {c["type"]: c for c in third["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2026-12-03T13:00:00Z"


def test_the_same_observation_gives_the_same_answer() -> None:
    obs = PoolObservation([host("a"), host("b", "starting")], stats({"a": (1, 0)}, queued=4), plan())
    assert reconcile_actionpool(CFG, obs, NOW) == reconcile_actionpool(CFG, obs, NOW)


def test_scale_replicas_pin_the_bounds_within_min_and_max() -> None:
    assert cfg(minHosts=1, maxHosts=4).desired_bounds == (1, 4)
    pinned = pool_config(
        ActionPool.model_validate(
            {
                "metadata": {"name": "py", "namespace": "ns"},
                "spec": {
                    "template": {"image": "i"},
                    "scaling": {"minHosts": 1, "maxHosts": 4},
                    "replicas": 9,
                },
            }
        )
    )
    assert pinned.desired_bounds == (4, 4)
    assert pinned.scaling_policy().max_instances == 4 and pinned.scaling_policy().min_instances == 4


def test_hosts_that_keep_failing_are_replaced_with_back_off() -> None:
    adds = plan(adds=(InstanceAdd(CFG.key, "n1", 4, 4000, 1, 0, R),))
    held = PoolObservation([], stats(queued=1), adds, failures=3, since_failure_s=5.0, last_failure="exit 1")
    status, ops = reconcile_actionpool(CFG, held, NOW)
    assert _kinds(ops) == []
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "exit 1" in degraded["message"] and "20 s" in degraded["message"]
    later = PoolObservation([], stats(queued=1), adds, failures=3, since_failure_s=21.0)
    assert _kinds(reconcile_actionpool(CFG, later, NOW)[1]) == [("create", "n1")]
