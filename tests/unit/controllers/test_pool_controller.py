"""The ActionPool controller around its pure reconcile: a host pod the API server refuses (an
admission rule, an invalid podSpec) still leaves the pool's status written, with the API server's
answer, the round's other operations applied, and no create sent again in a tight loop.

The runtime is a stand-in that refuses creates as the API server does; the e2e tier refuses them on
a real API server."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from arl_tangram.controllers import handlers
from arl_tangram.controllers.actionpool import PoolController
from arl_tangram.controllers.conditions import Event
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.domain.actions import ActionRequest
from arl_tangram.domain.pools import HostRejected, PoolConfig
from arl_tangram.errors import TargetUnavailable
from arl_tangram.planner.capacity_planner import CapacityPlanner, PlannerConfig
from arl_tangram.planner.snapshot import NodeSnapshot
from arl_tangram.runtime.interface import HostObservation
from arl_tangram.runtime.kubernetes import KubernetesRuntime, api_message

NS = "ns"
REFUSAL = 'pods "gv-x1" is forbidden: pod rejected: RuntimeClass "gvisor" not found'
NODES = [NodeSnapshot("n1", 16000, 64 << 30, schedulable=True)]


def _body(generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "gv", "namespace": NS, "uid": "u-1", "generation": generation},
        "spec": {
            "template": {"image": "img:1", "resources": {"cpu": "2", "memory": "4Gi"}},
            "isolation": {"runtimeClassName": "gvisor"},
            "scaling": {"minHosts": 1, "maxHosts": 2},
        },
    }


class _RefusingRuntime:
    """Creates are refused with 403 as RuntimeClass admission does; deletes are recorded."""

    def __init__(self, hosts: list[HostObservation]) -> None:
        self._hosts = hosts
        self.creates = 0
        self.deleted: list[str] = []

    def hosts(self, pool_key: str) -> list[HostObservation]:
        return [h for h in self._hosts if h.name not in self.deleted]

    async def create_host(self, pool: PoolConfig, name: str, node: str | None) -> None:
        self.creates += 1
        raise HostRejected(403, REFUSAL)

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        pass

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        self.deleted.append(name)


def _outdated(name: str) -> HostObservation:
    """A ready host of an older template (its address unknown: it is not asked for its health)."""
    return HostObservation(name, f"{NS}/gv", "ready", "n1", None, "old", 1.0, 2000, 4 << 30)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


async def test_a_refused_host_pod_is_said_in_the_status_and_the_rest_of_the_round_is_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime = _RefusingRuntime([_outdated("gv-old")])
    dispatcher = Dispatcher(AgentClient())
    ctl = PoolController(dispatcher, runtime, CapacityPlanner(PlannerConfig(time_limit_s=0.5)))
    try:
        with caplog.at_level(logging.WARNING):
            status, ops = await ctl.reconcile(_body(), NODES, [])
        # The create was refused, and the outdated host the rollout removes after it still went.
        assert runtime.creates == 1 and runtime.deleted == ["gv-old"]
        conds = _conditions(status)  # (the outdated host was still ready when the round began)
        assert conds["Degraded"]["reason"] == "HostsRejected" and REFUSAL in conds["Degraded"]["message"]
        assert status["observedGeneration"] == 1
        assert any(getattr(op, "reason", None) == "HostsRejected" for op in ops)  # a Warning Event
        assert REFUSAL in caplog.text
        # Within the back-off the same pod is not sent again, round after round.
        for _ in range(3):
            status, _ = await ctl.reconcile(_body(), NODES, [])
        assert runtime.creates == 1
        conds = _conditions(status)
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "HostsRejected")
        assert REFUSAL in conds["Ready"]["message"]
        # Callers (a batch's actions too) are refused with the API server's answer, not left waiting.
        request = ActionRequest("k1", NS, "gv", "code", {"runtime": "python", "code": "print(1)"})
        with pytest.raises(TargetUnavailable, match="RuntimeClass"):
            await dispatcher.run(request)
        # A new spec may fix it: tried at once.
        await ctl.reconcile(_body(generation=2), NODES, [])
        assert runtime.creates == 2
    finally:
        await dispatcher.shutdown()


class _Core:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def create_namespaced_pod(self, namespace: str, body: Any) -> None:
        raise self.exc


def _api_exception(status: int, reason: str, message: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


@pytest.mark.parametrize(
    ("status", "reason", "message"),
    [
        (403, "Forbidden", REFUSAL),
        (422, "Unprocessable Entity", 'Pod "gv-x1" is invalid: spec.volumes[1].name: Duplicate value'),
    ],
)
async def test_the_api_servers_refusal_of_a_host_pod_is_typed_with_its_message(
    status: int, reason: str, message: str
) -> None:
    from arl_tangram.controllers.actionpool import config_of

    runtime = KubernetesRuntime(client.ApiClient(client.Configuration()))
    runtime.core = _Core(_api_exception(status, reason, message))  # type: ignore[assignment]
    with pytest.raises(HostRejected) as refused:
        await runtime.create_host(config_of(_body()), "gv-x1", None)
    assert refused.value.status == status and refused.value.message == message
    # An answer that is no refusal of the pod (the API server busy) stays the platform's to retry.
    runtime.core = _Core(_api_exception(503, "Service Unavailable", "etcd leader changed"))  # type: ignore[assignment]
    with pytest.raises(ApiException):
        await runtime.create_host(config_of(_body()), "gv-x1", None)


async def test_a_pod_the_client_cannot_send_is_refused_naming_the_field() -> None:
    from arl_tangram.controllers.actionpool import config_of

    body = _body()
    body["spec"]["template"]["podSpec"] = {"nodeSelector": "notamap"}  # free-form in the CRD
    api = client.Configuration()
    api.host = "http://127.0.0.1:9"  # never reached: the client checks the body first
    runtime = KubernetesRuntime(client.ApiClient(api))
    with pytest.raises(HostRejected, match=r"not a valid Pod: spec\.nodeSelector: Input should be a valid"):
        await runtime.create_host(config_of(body), "gv-x1", None)


async def test_a_failed_rounds_log_carries_the_api_servers_message(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(handlers, "POOL_PERIOD_S", 0.0)
    stopped = {"now": False}

    class _Stopped:
        def __bool__(self) -> bool:
            return stopped["now"]

    async def reconcile() -> None:
        stopped["now"] = True
        raise _api_exception(422, "Unprocessable Entity", 'ActionPool.tangram.arl.dev "gv" is invalid: x')

    logger = logging.getLogger("test.pool")
    with caplog.at_level(logging.WARNING):
        await handlers._every_period(_Stopped(), logger, "pool", reconcile)  # type: ignore[arg-type]
    assert 'ActionPool.tangram.arl.dev "gv" is invalid: x' in caplog.text
    assert api_message(ApiException(status=500, reason="Internal Server Error")) == "Internal Server Error"


class _Runtime:
    """Hosts as observed; creates and deletes recorded (nothing refused)."""

    def __init__(self, hosts: list[HostObservation]) -> None:
        self._hosts = hosts
        self.created = 0
        self.deleted: list[str] = []

    def hosts(self, pool_key: str) -> list[HostObservation]:
        return [h for h in self._hosts if h.name not in self.deleted]

    async def create_host(self, pool: PoolConfig, name: str, node: str | None) -> None:
        self.created += 1

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        pass

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        self.deleted.append(name)


def _with_cpu(cpu: str, generation: int) -> dict[str, Any]:
    body = _body(generation)
    body["spec"]["template"]["resources"]["cpu"] = cpu
    return body


async def test_a_spec_turned_invalid_is_refused_while_the_last_accepted_one_keeps_serving() -> None:
    """Kubernetes' convention: a refused edit stops nothing that runs. The pool keeps its last
    accepted spec, in the dispatcher and in its reconcile (a failed host is still replaced), and
    its status says that the new spec is refused and which one runs, not that the pool is down."""
    dispatcher = Dispatcher(AgentClient())
    ctl = PoolController(dispatcher, _Runtime([]), CapacityPlanner(PlannerConfig(time_limit_s=0.5)))
    try:
        await ctl.reconcile(_body(1), NODES, [])
        kept = dispatcher.pool_config(NS, "gv")
        assert kept is not None and kept.generation == 1
        failed = HostObservation(
            "gv-a", f"{NS}/gv", "failed", "n1", None, kept.template_hash, 1.0, 2000, 4 << 30
        )
        failed = dataclasses.replace(failed, failure="OOMKilled")
        runtime = ctl.runtime = _Runtime([failed])
        status, ops = await ctl.reconcile(_with_cpu("500m", 2), NODES, [])
        assert dispatcher.pool_config(NS, "gv") == kept  # actions keep running with it
        assert runtime.deleted == ["gv-a"]  # and the pool is still looked after by it
        conds = _conditions(status)
        assert status["observedGeneration"] == 2
        degraded = conds["Degraded"]
        assert (degraded["status"], degraded["reason"], degraded["observedGeneration"]) == (
            "True",
            "InvalidSpec",
            2,
        )
        assert "spec.template.resources.cpu" in degraded["message"]
        assert "keeps running its last accepted spec (generation 1)" in degraded["message"]
        # Ready says what the spec that runs makes of the pool, as of that spec's generation.
        assert conds["Ready"]["reason"] != "InvalidSpec" and conds["Ready"]["observedGeneration"] == 1
        assert "coresTotal" in status and "queueDepth" in status
        warned = [op for op in ops if isinstance(op, Event) and op.reason == "InvalidSpec"]
        assert len(warned) == 1 and warned[0].type == "Warning"
        _, ops = await ctl.reconcile(_with_cpu("500m", 2), NODES, [])
        assert not [op for op in ops if isinstance(op, Event) and op.reason == "InvalidSpec"]  # said once
        # Fixed: the new spec is taken, and the refusal is gone from the status.
        status, _ = await ctl.reconcile(_with_cpu("4", 3), NODES, [])
        fixed = dispatcher.pool_config(NS, "gv")
        assert fixed is not None and (fixed.generation, fixed.host_cores) == (3, 4)
        assert _conditions(status)["Degraded"]["reason"] != "InvalidSpec"
    finally:
        await dispatcher.shutdown()


async def test_a_spec_invalid_with_none_accepted_before_runs_nothing_and_says_so() -> None:
    """No accepted spec to fall back on (the operator started while the spec was invalid, or the
    pool of that name before it was another, deleted one): Ready=False InvalidSpec."""
    dispatcher = Dispatcher(AgentClient())
    ctl = PoolController(dispatcher, _Runtime([]), CapacityPlanner(PlannerConfig(time_limit_s=0.5)))
    try:
        await ctl.reconcile(_body(1), NODES, [])
        other = _with_cpu("500m", 1)
        other["metadata"]["uid"] = "u-2"  # a pool made again under the name
        status, ops = await ctl.reconcile(other, NODES, [])
        ready = _conditions(status)["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and ops == []
    finally:
        await dispatcher.shutdown()


async def test_a_refused_spec_keeps_the_time_it_was_refused_round_after_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Degraded=True InvalidSpec moves its lastTransitionTime only when it becomes true (each round
    made it now, and the status was written again every round while the spec stayed refused)."""
    from datetime import UTC, datetime

    from arl_tangram.controllers import actionpool

    times = [datetime(2026, 12, 3, 12, 0, tzinfo=UTC)]

    class Clock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return times[0]

    monkeypatch.setattr(actionpool, "datetime", Clock)
    dispatcher = Dispatcher(AgentClient())
    ctl = PoolController(dispatcher, _Runtime([]), CapacityPlanner(PlannerConfig(time_limit_s=0.5)))
    try:
        status, _ = await ctl.reconcile(_body(1), NODES, [])
        times[0] = times[0].replace(minute=1)
        refused, _ = await ctl.reconcile({**_with_cpu("500m", 2), "status": status}, NODES, [])
        when = _conditions(refused)["Degraded"]["lastTransitionTime"]
        assert _conditions(refused)["Degraded"]["reason"] == "InvalidSpec" and when == "2026-12-03T12:01:00Z"
        times[0] = times[0].replace(minute=2)
        again, _ = await ctl.reconcile({**_with_cpu("500m", 2), "status": refused}, NODES, [])
        assert _conditions(again)["Degraded"]["lastTransitionTime"] == when
    finally:
        await dispatcher.shutdown()


async def test_a_pool_made_again_under_its_name_does_not_wait_out_the_deleted_ones_back_off() -> None:
    """A pool deleted while its hosts failed (a bad image), then made again fixed, starts its hosts
    at once: the deleted one's failure streak stayed under the name and held the new pool back."""
    dispatcher = Dispatcher(AgentClient())
    ctl = PoolController(dispatcher, _Runtime([]), CapacityPlanner(PlannerConfig(time_limit_s=0.5)))
    try:
        await ctl.reconcile(_body(1), NODES, [])
        kept = dispatcher.pool_config(NS, "gv")
        assert kept is not None
        failed = [
            dataclasses.replace(
                HostObservation(
                    f"gv-{i}", f"{NS}/gv", "failed", "n1", None, kept.template_hash, 1.0, 2000, 4 << 30
                ),
                failure="ErrImagePull",
            )
            for i in range(4)
        ]
        ctl.runtime = _Runtime(failed)
        await ctl.reconcile(_body(1), NODES, [])
        assert ctl.runtime.created == 0  # backing off
        await ctl.deleted(NS, "gv", "u-1")
        runtime = ctl.runtime = _Runtime([])
        again = _body(1)
        again["metadata"]["uid"] = "u-2"
        await ctl.reconcile(again, NODES, [])
        assert runtime.created >= 1
    finally:
        await dispatcher.shutdown()
