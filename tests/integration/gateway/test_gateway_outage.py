"""A pool with no host and none coming, through the gateway: each door answers at once with the
pool's reason and when to send again (native 503, SandboxFusion's /run_code 504 SandboxError, a
stream's line 503), each with Retry-After; the operator's client reports the reason once its retries
are spent. The outage is set as the pool controller sets it (``Dispatcher.set_outage``); the pool has
no host, so nothing could run."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
from gateway_harness import NS, POOL, Gateway, serve_gateway

from arl_tangram.client import RetryPolicy, TangramClient, Unavailable
from arl_tangram.domain.actions import Outage

WHY = (
    f"pool {NS}/{POOL} has no host: host {POOL}-1 cannot start: "
    'container agent: ErrImagePull: "img:typo" not found'
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    with serve_gateway([], setup=lambda d: d.set_outage(f"{NS}/{POOL}", Outage(WHY, 12.0))) as gw:
        yield gw


def test_the_native_door_answers_503_with_the_reason(gateway: Gateway) -> None:
    action = {"type": "code", "target": POOL, "payload": {"code": "print(1)"}, "key": "k1"}
    resp = requests.post(gateway.url + "/v1/actions", json=action, timeout=30)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"] == WHY and resp.headers["Retry-After"] == "12"


def test_run_code_answers_a_sandbox_error_to_retry(gateway: Gateway) -> None:
    resp = requests.post(
        gateway.url + "/run_code", json={"code": "print(1)", "language": "python"}, timeout=30
    )
    assert resp.status_code == 504, resp.text
    body = resp.json()
    assert body["status"] == "SandboxError" and body["message"] == WHY
    assert resp.headers["Retry-After"] == "12"


def test_a_stream_refuses_each_line_with_the_reason(gateway: Gateway) -> None:
    lines = [
        {"id": f"a{i}", "type": "code", "target": POOL, "payload": {"code": "print(1)"}} for i in range(3)
    ]
    body = "\n".join(json.dumps(x) for x in lines) + "\n"
    resp = requests.post(gateway.url + "/v1/actions:stream", data=body.encode(), timeout=30, stream=True)
    out = [json.loads(line) for line in resp.iter_lines() if line]
    assert sorted(o["id"] for o in out) == ["a0", "a1", "a2"]
    assert all(o["status"] == 503 and o["error"] == WHY for o in out), out


def test_the_client_reports_the_reason_once_its_retries_are_spent(gateway: Gateway) -> None:
    retry = RetryPolicy(attempts=3, backoff_s=0.01)
    with (
        TangramClient(gateway.url, namespace=NS, pool=POOL, retry=retry) as client,
        pytest.raises(Unavailable) as err,
    ):
        client.run_code("print(1)")
    assert err.value.status == 503 and WHY in str(err.value)
