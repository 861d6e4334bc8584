"""The operator's bookkeeping of pools around their reconcile: a deleted pool's metric series go
with it, and an action naming a pool whose spec is invalid is told that, not "not found".

No API server: the watch's copy of the pool is the index the test fills, and a batch's status
writes are recorded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from arl_tangram.controllers.actionbatch import BatchManager
from arl_tangram.controllers.operator import OperatorSettings, OperatorState, PoolSpecInvalid
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
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

        async def patch(namespace: str, name: str, status: dict[str, Any]) -> None:
            writes.append(status)

        async def delete(namespace: str, name: str) -> None:
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
