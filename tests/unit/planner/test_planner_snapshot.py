"""Bad planner input fails where it is built, with an error naming the field."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from planner_factories import GiB, cpu_node, host, sandbox_pool, snapshot

from arl_tangram.errors import InvalidSpec
from arl_tangram.planner import (
    InstanceSnapshot,
    NodeSnapshot,
    PoolDemand,
    RewardServiceSpec,
    SandboxPoolSpec,
    ScalingPolicy,
)

POLICY = ScalingPolicy(max_instances=2)

CASES: list[tuple[str, Callable[[], object]]] = [
    ("scaling.min_instances", lambda: ScalingPolicy(max_instances=1, min_instances=2)),
    ("scaling.max_starting", lambda: ScalingPolicy(max_instances=1, max_starting=0)),
    ("scaling.idle_timeout_s", lambda: ScalingPolicy(max_instances=1, idle_timeout_s=float("nan"))),
    ("scaling.target_utilisation", lambda: ScalingPolicy(max_instances=1, target_utilisation=1.5)),
    ("scaling.act_target_s", lambda: ScalingPolicy(max_instances=1, act_target_s=0)),
    ("nodes[n].cpu_millicores", lambda: NodeSnapshot("n", -1, 0)),
    ("nodes[n].gpu_memory_bytes", lambda: NodeSnapshot("n", 1000, GiB, gpus=8)),
    ("nodes[n].labels", lambda: NodeSnapshot("n", 1000, GiB, labels={"a": 1})),  # type: ignore[dict-item]
    ("pools[p].host_cores", lambda: SandboxPoolSpec("p", 0, GiB, POLICY)),
    ("services[s].gpus_per_replica", lambda: RewardServiceSpec("s", (), GiB, POLICY)),
    ("services[s].gpus_per_replica", lambda: RewardServiceSpec("s", (0, 2), GiB, POLICY)),
    ("instances[i].phase", lambda: InstanceSnapshot("i", "p", "n", "running", 1000, GiB)),  # type: ignore[arg-type]
    (
        "instances[i].running_actions",
        lambda: InstanceSnapshot("i", "p", "n", "ready", 1000, GiB, running_actions=-1),
    ),
    ("demand[p].queued_units", lambda: PoolDemand("p", queued_units=-3)),
    ("demand[p].arrival_rate_per_s", lambda: PoolDemand("p", arrival_rate_per_s=float("inf"))),
]


@pytest.mark.parametrize(("field", "build"), CASES, ids=[c[0] for c in CASES])
def test_invalid_values_name_their_field(field: str, build: Callable[[], object]) -> None:
    with pytest.raises(InvalidSpec) as err:
        build()
    assert err.value.field == field


def test_snapshot_cross_references_are_checked() -> None:
    pool = sandbox_pool()
    with pytest.raises(InvalidSpec) as err:
        snapshot(0, [cpu_node("a")], [pool], instances=[host("h", pool, "nowhere")])
    assert err.value.field == "instances[h].node" and "nowhere" in err.value.message
    other = sandbox_pool("other")
    with pytest.raises(InvalidSpec) as err:
        snapshot(0, [cpu_node("a")], [pool], instances=[host("h", other, "a")])
    assert err.value.field == "instances[h].pool"
    with pytest.raises(InvalidSpec) as err:
        snapshot(0, [cpu_node("a"), cpu_node("a")], [pool])
    assert err.value.field == "nodes" and "'a'" in err.value.message
    with pytest.raises(InvalidSpec) as err:
        snapshot(0, [cpu_node("a")], [pool, sandbox_pool()])
    assert err.value.field == "pools"
    with pytest.raises(InvalidSpec) as err:
        snapshot(0, [cpu_node("a")], [pool], demand=[PoolDemand("ghost")])
    assert err.value.field == "demand[ghost].pool"


def test_inputs_are_frozen_and_labels_cannot_be_changed_behind_the_planners_back() -> None:
    labels = {"zone": "a"}
    node = cpu_node("a", labels=labels)
    labels["zone"] = "b"
    assert node.labels["zone"] == "a"
    with pytest.raises(TypeError):
        node.labels["zone"] = "c"  # type: ignore[index]
    with pytest.raises(AttributeError):
        node.cpu_millicores = 1  # type: ignore[misc]


def test_reward_sizes_are_normalised_and_sandbox_hosts_report_their_cpu() -> None:
    svc = RewardServiceSpec("s", (8, 2, 2, 1), GiB, POLICY)
    assert svc.gpus_per_replica == (1, 2, 8)
    assert SandboxPoolSpec("p", 16, GiB, POLICY).host_cpu_millicores == 16_000
