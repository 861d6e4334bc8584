"""The operator's bookkeeping of pools around their reconcile: a deleted pool's metric series go
with it, and an action naming a pool whose spec is invalid is told that, not "not found".

No API server: the watch's copy of the pool is the index the test fills, and a batch's status
writes are recorded."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.controllers.actionbatch import BatchManager
from arl_tangram.controllers.actionpool import config_of
from arl_tangram.controllers.operator import OperatorSettings, OperatorState, PoolSpecInvalid
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.services import ServiceConfig, service_config
from arl_tangram.errors import NotFound, TargetUnavailable

NS = "p4"


def _state() -> OperatorState:
    settings = OperatorSettings(namespace="tangram-system", identity="t", leader_election=False)
    return OperatorState(settings, api=client.ApiClient(client.Configuration()))


async def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _series(state: OperatorState, pool: str) -> list[str]:
    return [
        f"{sample.name}{sample.labels}"
        for metric in state.metrics.registry.collect()
        for sample in metric.samples
        if sample.labels.get("pool") == pool
    ]


async def test_a_deleted_pools_metric_series_go_with_it() -> None:
    state = _state()
    try:
        status = {"queueDepth": 2, "coresBusy": 6, "coresTotal": 8, "hostsReady": 1, "hostsStarting": 1}
        state._export_pool("p2/py", status, ())
        state._export_pool("p2/other", status, ())
        request = ActionRequest("k", "p2", "py", "code", {"runtime": "python", "code": "1"})
        outcome = ActionOutcome("k", Outcome.FAILED, Reason.HOST_LOST, "gone")
        state.metrics.finished("p2/py", request, outcome, 1.0)
        state.metrics.scale_events.labels("p2/py", "up").inc()
        assert len(_series(state, "p2/py")) > 10
        await state.pool_deleted("p2", "py", "u-py")
        assert _series(state, "p2/py") == []
        assert _series(state, "p2/other")  # another pool's stay
        # A round of its daemon that raced the delete handler does not bring them back.
        body = {"metadata": {"name": "py", "namespace": "p2", "uid": "u-py"}, "spec": {}}
        await state.reconcile_pool(body)
        assert _series(state, "p2/py") == []
    finally:
        await state.stop()


def _service(name: str) -> ServiceConfig:
    return service_config(
        RewardModelService.model_validate(
            {
                "metadata": {"name": name, "namespace": "p2", "generation": 1},
                "spec": {"model": {"name": "org/judge", "uri": "file:///w/rm.npz"}, "gpu": {"count": [1]}},
            }
        ),
        uid=f"u-{name}",
    )


async def test_a_deleted_services_metric_series_go_with_it_and_stay_gone() -> None:
    """Reward actions are counted under their service's namespace/name, in the pool label; a pool of
    the same name keeps its own series."""
    state = _state()
    try:
        state.dispatcher.rewards.upsert(_service("rm"))
        state.dispatcher.rewards.upsert(_service("other"))
        state.dispatcher.upsert_pool(config_of(_pool_body("rm")))
        failed = ActionOutcome("k", Outcome.FAILED, Reason.RETRIES_EXHAUSTED, "no replica answered")
        reward = ActionRequest("k", "p2", "rm", "reward", {"input": "x"})
        code = ActionRequest("k", "p2", "rm", "code", {"runtime": "python", "code": "1"})
        state.metrics.finished("p2/rm", reward, failed, 1.0)
        state.metrics.finished("p2/rm", code, failed, 1.0)
        state.metrics.finished(
            "p2/other", ActionRequest("k", "p2", "other", "reward", {"input": "x"}), failed, 1.0
        )
        state.service_deleted("p2", "rm", "u-rm")
        left = _series(state, "p2/rm")
        assert left and not [s for s in left if "'type': 'reward'" in s], left
        assert [s for s in left if "'type': 'code'" in s]  # the pool's stay
        assert _series(state, "p2/other")  # another service's stay

        # A reward action the deletion ended (in flight meanwhile) does not bring them back; one of
        # a live service, named by the model it serves, is counted under the service.
        async def answer(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
            return failed

        state.dispatcher.run = answer  # type: ignore[method-assign]
        await state._run(reward)
        assert not [s for s in _series(state, "p2/rm") if "'type': 'reward'" in s]
        labels = {"pool": "p2/other", "type": "reward", "state": "Failed", "reason": "RetriesExhausted"}
        assert state.metrics.registry.get_sample_value("tangram_actions_total", labels) == 1
        await state._run(ActionRequest("k2", "p2", "org/judge", "reward", {"input": "x"}))
        assert state.metrics.registry.get_sample_value("tangram_actions_total", labels) == 2
        assert _series(state, "p2/org/judge") == []
        # The pool goes too: now nothing of the name is left.
        await state.pool_deleted("p2", "rm", "u-pool")
        assert _series(state, "p2/rm") == []
    finally:
        await state.stop()


async def test_a_round_of_a_deleted_services_daemon_does_not_bring_it_back() -> None:
    """Its daemon's round may come after its delete handler ran (as a pool's): the router must not
    learn the service again, or its requests would wait for replicas that never come."""
    state = _state()
    try:
        state.service_deleted("p2", "rm", "u-rm")
        body = {
            "metadata": {"name": "rm", "namespace": "p2", "uid": "u-rm", "generation": 1},
            "spec": {"model": {"name": "org/judge", "uri": "file:///w/rm.npz"}, "gpu": {"count": [1]}},
        }
        with contextlib.suppress(Exception):  # (no API server: a round that went on fails later)
            await state.reconcile_service(body)
        assert not state.dispatcher.rewards.has("p2/rm")
    finally:
        await state.stop()


def _pool_body(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "p2", "uid": "u-pool", "generation": 1},
        "spec": {"template": {"image": "img:1", "resources": {"cpu": "2", "memory": "4Gi"}}},
    }


def _invalid_pool() -> dict[str, Any]:
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "halfcore", "namespace": NS, "uid": "u-half", "generation": 1},
        "spec": {
            "template": {"image": "img:1", "resources": {"cpu": "500m", "memory": "4Gi"}},
            "languages": ["python", "bash"],
        },
    }


async def test_an_action_on_a_pool_whose_spec_is_invalid_is_told_so_not_that_it_is_missing() -> None:
    state = _state()
    state.pool_index = {f"{NS}/halfcore": [_invalid_pool()]}
    try:
        request = ActionRequest("k1", NS, "halfcore", "code", {"runtime": "python", "code": "print(1)"})
        with pytest.raises(TargetUnavailable) as refused:  # a caller on the gateway: 503, Retry-After
            await state.dispatcher.run(request)
        assert isinstance(refused.value, PoolSpecInvalid) and not isinstance(refused.value, NotFound)
        message = str(refused.value)
        assert "ActionPool p4/halfcore exists, but its spec is invalid" in message, message
        assert "template.resources.cpu" in message and "not found" not in message
        # A batch's action is checked against the languages its spec names, then waits, its
        # batch's status saying why, as for a pool with no host.
        assert await state._pool_languages(NS, "halfcore") == ("python", "bash")
        writes: list[dict[str, Any]] = []

        async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
            writes.append(status)

        async def delete(namespace: str, name: str, uid: str) -> None:
            pass

        batches = BatchManager(state._run, state._cancel, state._pool_languages, patch, delete)
        batch = {
            "metadata": {"namespace": NS, "name": "b", "uid": "u-b", "generation": 1},
            "spec": {
                "actions": [
                    {"id": "x1", "type": "code", "target": "halfcore", "payload": {"code": "print(1)"}}
                ]
            },
        }
        batches.ensure(batch)
        await _until(lambda: batches.pending_count() == 1 and bool(batches._batches))
        await asyncio.sleep(0.1)
        await batches.flush()
        running = {c["type"]: c for c in writes[-1]["conditions"]}["Running"]
        assert "exists, but its spec is invalid" in running["message"], running
        assert writes[-1]["counts"]["pending"] == 1 and writes[-1]["counts"].get("failed", 0) == 0
        await batches.forget(NS, "b")
    finally:
        await state.stop()
