"""The operator's read of a pool no watch holds yet (``OperatorState._learn``): a GET the API server
never answers is given up and retried, a pool deleted while it is read is not learned again, a
copy its reconcile added meanwhile is kept, and stopping the operator ends the reads in flight.

The API server is a local socket (for the unanswered GET) or a stand-in for the CustomObjectsApi
that answers when the test says; the e2e tier reads a real API server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.controllers import operator as operator_module
from arl_tangram.controllers.operator import OperatorSettings, OperatorState
from arl_tangram.domain.actions import ActionRequest
from arl_tangram.domain.pools import pool_config

NS = "ns"


def _pool_body(languages: list[str], uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "py", "namespace": NS, "uid": uid},
        "spec": {
            "template": {"image": "img:1", "resources": {"cpu": "2", "memory": "4Gi"}},
            "languages": languages,
            "limits": {"timeoutSeconds": 60, "memory": "1Gi", "maxCores": 2},
        },
    }


def _state(api: client.ApiClient | None = None) -> OperatorState:
    settings = OperatorSettings(namespace="tangram-system", identity="t", leader_election=False)
    return OperatorState(settings, api=api or client.ApiClient(client.Configuration()))


async def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class _SilentThenAnswering:
    """An API server whose first connection is accepted and never answered (a stuck proxy or a
    half-dead apiserver); the later ones get the pool."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.connections == 1:
                self.held.append(conn)  # read nothing, answer nothing
                continue
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                payload = json.dumps(_pool_body(["python", "bash"])).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent_api() -> Iterator[_SilentThenAnswering]:
    server = _SilentThenAnswering()
    yield server
    server.close()


async def test_a_get_the_api_server_never_answers_is_given_up_and_retried(
    silent_api: _SilentThenAnswering, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(operator_module, "READ_TIMEOUT_S", 0.3)
    cfg = client.Configuration(host=f"http://127.0.0.1:{silent_api.port}")
    cfg.retries = False  # urllib3's own retries would only multiply the wait
    api = client.ApiClient(cfg)
    state = _state(api)
    lookup = asyncio.ensure_future(state.dispatcher.find_pool_config(NS, "py"))
    try:
        done, _ = await asyncio.wait({lookup}, timeout=10)
        assert done, "the lookup still waits on a GET the API server never answered"
        found = lookup.result()
        assert found is not None and found.languages == ("python", "bash")
        assert silent_api.connections >= 2
    finally:
        silent_api.close()  # ends a GET left waiting, so that its thread ends too
        lookup.cancel()
        await state.stop()
        api.close()


class _HeldCustom:
    """A CustomObjectsApi whose GET of the pool waits until the test releases it."""

    def __init__(self, answer: Callable[[], dict[str, Any]]) -> None:
        self.answer = answer
        self.asked = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        self.asked.set()
        assert self.release.wait(10)
        return self.answer()


async def test_a_pool_deleted_while_it_is_read_is_not_learned_again() -> None:
    """The GET answers with the pool as it was before its deletion, and the delete handler runs
    before the lookup resumes: the pool must stay unknown (its hosts never come)."""
    state = _state()
    held = _HeldCustom(lambda: _pool_body(["python"], uid="u-1"))
    state.custom = held  # type: ignore[assignment]
    try:
        lookup = asyncio.ensure_future(state.dispatcher.find_pool_config(NS, "py"))
        await _until(held.asked.is_set)
        await state.pool_deleted(NS, "py", "u-1")
        held.release.set()
        assert await asyncio.wait_for(lookup, 10) is None
        assert not state.dispatcher.has_pool(NS, "py")
    finally:
        held.release.set()
        await state.stop()


async def test_a_pool_its_reconcile_added_during_the_read_keeps_that_copy() -> None:
    state = _state()
    held = _HeldCustom(lambda: _pool_body(["python"]))  # read before bash was added
    state.custom = held  # type: ignore[assignment]
    try:
        lookup = asyncio.ensure_future(state.dispatcher.find_pool_config(NS, "py"))
        await _until(held.asked.is_set)
        newer = _pool_body(["python", "bash"])
        state.dispatcher.upsert_pool(pool_config(ActionPool.model_validate(newer), uid="u-1"))
        held.release.set()
        found = await asyncio.wait_for(lookup, 10)
        assert found is not None and found.languages == ("python", "bash")
    finally:
        held.release.set()
        await state.stop()


class _Unreachable:
    def __init__(self) -> None:
        self.calls = 0

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


async def test_stopping_the_operator_ends_the_reads_it_retries() -> None:
    state = _state()
    unreachable = _Unreachable()
    state.custom = unreachable  # type: ignore[assignment]
    lookup = asyncio.ensure_future(state.dispatcher.find_pool_config(NS, "py"))
    await _until(lambda: unreachable.calls >= 1)
    reads = list(state._reads.values())
    assert reads
    await asyncio.wait_for(state.stop(), 10)
    assert all(read.done() for read in reads), "a read goes on retrying after the operator stopped"
    await asyncio.wait({lookup}, timeout=1)
    assert lookup.done()


async def test_a_service_named_by_its_model_is_learned_from_the_watch() -> None:
    """Just after a start or a failover, before a RewardModelService's reconcile ran: a request
    naming it by its own name is held (the service learned from the watch's copy), and one naming
    it by the model it serves (verl's vLLM and SGLang requests) was refused as not found (404)."""
    state = _state()
    body = {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "RewardModelService",
        "metadata": {"name": "rm", "namespace": NS, "uid": "u-rm"},
        "spec": {"model": {"name": "Org/Reward-Model-0.6B", "uri": "file:///w/rm.npz"}},
    }
    state.service_index = {f"{NS}/rm": [body]}
    try:
        request = ActionRequest("k", NS, "Org/Reward-Model-0.6B", "reward", {"prompt": "p", "response": "r"})
        assert state.dispatcher.learn is not None
        await state.dispatcher.learn("RewardModelService", NS, request.target)
        assert state.dispatcher.rewards.resolve(request).target == "rm"
    finally:
        await state.stop()
