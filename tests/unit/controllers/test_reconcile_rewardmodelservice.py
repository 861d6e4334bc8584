"""The pure RewardModelService reconcile and its translation, table-driven (no cluster)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.controllers.rewardmodelservice import (
    CreateReplica,
    DeleteReplica,
    ServiceObservation,
    backoff_s,
    reconcile_rewardmodelservice,
)
from arl_tangram.dispatch.rewards import ServiceStats
from arl_tangram.domain.services import reward_text, service_config
from arl_tangram.errors import InvalidSpec
from arl_tangram.runtime.interface import HostObservation

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def cfg(uri: str = "file:///w/rm.npz", **scaling: Any) -> Any:
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns", "generation": 2},
            "spec": {
                "model": {"name": "m", "uri": uri},
                "scaling": {"maxReplicas": 3, "idleTimeoutSeconds": 60, **scaling},
                "batching": {"maxBatchSize": 4},
            },
        }
    )
    return service_config(rms, uid="u")


def rep(name: str, phase: str = "ready", **kw: Any) -> HostObservation:
    return HostObservation(name, "ns/rm", phase, "tb-gpu-0", "10.0.0.9:8000", "h", 1.0, 0, 0, **kw)  # type: ignore[arg-type]


def stats(queued: int = 0, running: int = 0, last: float | None = None) -> ServiceStats:
    return ServiceStats(queued, running, last, (0.5,), {})


@pytest.mark.parametrize(
    ("replicas", "load", "now_mono", "ops", "ready"),
    [
        ([], stats(), 1000.0, [], ("True", "ScaledToZero")),
        ([], stats(queued=2, last=999.0), 1000.0, ["create"], ("False", "HostsStarting")),
        ([rep("a", "starting")], stats(queued=2, last=999.0), 1000.0, [], ("False", "HostsStarting")),
        ([rep("a")], stats(queued=9, last=999.0), 1000.0, ["create"], ("True", "HostsReady")),
        ([rep("a")], stats(last=990.0), 1000.0, [], ("True", "HostsReady")),
        ([rep("a")], stats(last=900.0), 1000.0 + 60, [("delete", "a")], ("True", "HostsReady")),
        (
            [rep("a", "failed", failure="exit 2")],
            stats(queued=1, last=999.0),
            1000.0,
            [("delete", "a"), "create"],
            ("False", "HostsStarting"),
        ),
    ],
)
def test_replicas_follow_demand(
    replicas: list[HostObservation],
    load: ServiceStats,
    now_mono: float,
    ops: list[Any],
    ready: tuple[str, str],
) -> None:
    status, got = reconcile_rewardmodelservice(cfg(), ServiceObservation(replicas, load, now_mono), NOW)
    kinds = [
        "create" if isinstance(o, CreateReplica) else ("delete", o.name)
        for o in got
        if isinstance(o, CreateReplica | DeleteReplica)
    ]
    assert kinds == ops
    cond = {c["type"]: c for c in status["conditions"]}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ready
    assert status["selector"] == "tangram.arl.dev/service=rm"


def test_min_replicas_keep_the_service_up_while_idle() -> None:
    _, ops = reconcile_rewardmodelservice(cfg(minReplicas=1), ServiceObservation([], stats(), 10_000.0), NOW)
    assert [type(o) for o in ops] == [CreateReplica]


def test_a_replica_that_keeps_failing_is_retried_with_back_off() -> None:
    obs = ServiceObservation(
        [],
        stats(queued=1, last=999.0),
        1000.0,
        failures=3,
        since_failure_s=5.0,
        last_failure="the agent exited 2",
    )
    status, ops = reconcile_rewardmodelservice(cfg(), obs, NOW)
    assert ops == [] and backoff_s(3) == 20.0
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "exited 2" in degraded["message"]
    later = ServiceObservation([], stats(queued=1, last=999.0), 1000.0, failures=3, since_failure_s=21.0)
    assert [type(o) for o in reconcile_rewardmodelservice(cfg(), later, NOW)[1]] == [CreateReplica]


def test_placements_and_residency_in_status() -> None:
    obs = ServiceObservation([rep("a"), rep("b")], stats(), 1.0, resident={"a": True, "b": False})
    status, _ = reconcile_rewardmodelservice(cfg(minReplicas=2), obs, NOW)
    assert [(p["pod"], p["state"]) for p in status["placements"]] == [("a", "Resident"), ("b", "Evicted")]


@pytest.mark.parametrize("uri", ["hf://org/model", "s3://bucket/w"])
def test_weights_are_never_downloaded(uri: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        cfg(uri=uri)
    assert err.value.field == "spec.model.uri" and "never downloaded" in err.value.message


def test_pvc_weights_are_mounted() -> None:
    c = cfg(uri="pvc://weights/rm/model.npz")
    assert c.claim == "weights" and c.weights_path.endswith("/rm/model.npz")


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        ({"prompt": "Q?", "response": "A"}, "Q?A"),
        ({"prompt": [{"role": "user", "content": "Q?"}], "response": "A"}, "Q?A"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}, "Q\nA"),
        ({"input": "raw"}, "raw"),
    ],
)
def test_reward_payloads_become_the_text_scored(payload: dict[str, Any], text: str) -> None:
    assert reward_text(payload) == text


def test_a_reward_payload_without_a_text_is_refused() -> None:
    with pytest.raises(InvalidSpec):
        reward_text({"label": "x"})


class _Replicas:
    """A runtime whose replicas are what the test says (the controller's calls are recorded)."""

    def __init__(self) -> None:
        self.listed: list[HostObservation] = []
        self.created: list[str] = []
        self.deleted: list[str] = []

    async def ensure_services_file(self, svc: Any) -> None:
        return None

    def replicas(self, key: str) -> list[HostObservation]:
        return list(self.listed)

    async def create_replica(self, svc: Any, name: str, device: str) -> None:
        self.created.append(name)
        self.listed.append(rep(name, "starting"))

    async def delete_replica(self, svc: Any, name: str) -> None:
        self.deleted.append(name)
        self.listed = [r for r in self.listed if r.name != name]


def test_the_controller_backs_off_after_failed_replicas_instead_of_recreating_at_once() -> None:
    """The controller feeds the reconcile its failure streak: a replica that fails is replaced
    only after the back-off (before, the streak was never counted and the replacement came at once,
    every time, for a replica that could never start)."""
    from arl_tangram.controllers.rewardmodelservice import ServiceController
    from arl_tangram.dispatch.rewards import RewardRouter

    clock = [1000.0]
    body = {
        "metadata": {"name": "rm", "namespace": "ns", "generation": 1, "uid": "u"},
        "spec": {"model": {"name": "m", "uri": "file:///w/rm.npz"}, "scaling": {"minReplicas": 1}},
    }

    async def run() -> None:
        runtime = _Replicas()
        ctl = ServiceController(RewardRouter(client=None, clock=lambda: clock[0]), runtime, None, "cpu")  # type: ignore[arg-type]
        ctl._failures.clock = lambda: clock[0]
        await ctl.reconcile(body)
        assert len(runtime.created) == 1
        first = runtime.created[0]
        runtime.listed = [rep(first, "failed", failure="exit 2")]
        status = await ctl.reconcile(body)  # deleted, and no replacement within the back-off
        assert runtime.deleted == [first] and len(runtime.created) == 1
        degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
        assert degraded["status"] == "True" and "exit 2" in degraded["message"], degraded
        clock[0] += backoff_s(1) + 0.1
        await ctl.reconcile(body)
        assert len(runtime.created) == 2

    asyncio.run(run())


def test_a_failure_streak_counts_each_failed_pod_once_and_ends_at_a_ready_one() -> None:
    from arl_tangram.controllers.failures import FailureStreaks

    now = [0.0]
    streaks = FailureStreaks(clock=lambda: now[0])
    assert streaks.observe("k", [rep("a", "starting")]).count == 0
    assert streaks.observe("k", [rep("a", "failed", failure="oom")]).count == 1
    now[0] = 3.0
    again = streaks.observe("k", [rep("a", "failed", failure="oom")])  # still listed: not twice
    assert (again.count, again.since_s, again.last) == (1, 3.0, "oom")
    assert streaks.observe("k", [rep("b", "failed", failure="exit 1")]).count == 2
    assert streaks.observe("k", [rep("c")]).count == 0
    assert streaks.observe("other", []).since_s == float("inf")
