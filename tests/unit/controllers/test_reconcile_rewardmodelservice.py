"""The pure RewardModelService reconcile and its translation, table-driven (no cluster)."""

from __future__ import annotations

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
