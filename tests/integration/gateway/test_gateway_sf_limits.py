"""``/run_code`` through the gateway with limits above the pool's: run at the pool's limits, the
answer says so, and the operator's log says it once per pool. verl always sends ``memory_limit_MB``
(1024 by default) and ``run_timeout``; SandboxFusion runs whatever it is given, and a 400 here was
a -1 reward for every sample. The native API keeps refusing (its own contract).

The host is started as the operator starts a pool's hosts (``runtime.pods.agent_args``): its
ceilings are the pool's limits (``pool_for_tests``: 30 s, 1 GiB)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import requests
from gateway_harness import NS, POOL, Gateway, serve_gateway
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.gateway import GatewayConfig

POOL_TIMEOUT_S = 30
POOL_MEMORY_MB = 1024


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    host = start_agent(
        tmp_path_factory.mktemp("sflimits") / "work",
        "--fork-loop",
        "python",
        f"--timeout={POOL_TIMEOUT_S}",
        f"--max-timeout={POOL_TIMEOUT_S}",
        f"--memory-mb={POOL_MEMORY_MB}",
        f"--max-memory-mb={POOL_MEMORY_MB}",
    )
    hosts: list[Agent] = [host]
    try:
        with serve_gateway(hosts, config=GatewayConfig(default_namespace=NS, default_pools={NS: POOL})) as gw:
            yield gw
    finally:
        stop_agent(host)


def _post(gateway: Gateway, body: dict[str, object]) -> dict[str, object]:
    resp = requests.post(gateway.url + "/run_code", json={"language": "python", **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    answer: dict[str, object] = resp.json()
    return answer


def test_limits_above_the_pools_run_at_the_pools_limits(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="arl_tangram.dispatch.dispatcher")
    body = _post(gateway, {"code": "print(1)", "memory_limit_MB": 2048, "run_timeout": 31})
    assert body["status"] == "Success", body
    notes = " ".join(map(str, body["notes"]))  # type: ignore[call-overload]
    assert "memory_limit_MB 2048" in notes and f"{POOL_MEMORY_MB} MB" in notes, notes
    assert "run_timeout 31" in notes and f"{POOL_TIMEOUT_S} s" in notes, notes
    assert "memory_mb" not in notes, notes
    # An integer too large for a float: runs at the limit too.
    huge = _post(gateway, {"code": "print(2)", "memory_limit_MB": 10**400})
    assert huge["status"] == "Success" and "memory_limit_MB" in " ".join(map(str, huge["notes"])), huge  # type: ignore[call-overload]
    # verl's default on a pool of 1Gi: no note.
    plain = _post(gateway, {"code": "print(3)", "memory_limit_MB": 1024, "run_timeout": 30})
    assert plain["status"] == "Success" and plain["notes"] == [], plain
    said = [r for r in caplog.records if "limits" in r.getMessage() and f"{NS}/{POOL}" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_compiled_languages_compile_timeout_above_the_pools_runs_too(gateway: Gateway) -> None:
    cpp = {"code": '#include <cstdio>\nint main() { std::puts("hi"); }\n', "language": "cpp"}
    body = _post(gateway, {**cpp, "compile_timeout": 45, "run_timeout": 30})
    if body["status"] == "SandboxError" and "cpp" in str(body.get("message")):
        pytest.skip("no C++ toolchain here")
    assert body["status"] == "Success", body
    assert "compile_timeout 45" in " ".join(map(str, body["notes"])), body  # type: ignore[call-overload]


def test_a_run_capped_by_the_pool_gets_the_verdict_at_the_pools_limit(gateway: Gateway) -> None:
    hog = _post(gateway, {"code": "x = bytearray(1536 << 20)\nprint(len(x))", "memory_limit_MB": 4096})
    run = hog["run_result"]
    assert isinstance(run, dict) and run["memory_limit_exceeded"] is True, hog
    assert hog["status"] == "Failed", hog


def test_the_native_api_still_refuses_limits_above_the_pools(gateway: Gateway) -> None:
    action = {"type": "code", "target": POOL, "payload": {"code": "print(1)"}}
    resp = requests.post(gateway.url + "/v1/actions", json={**action, "timeoutSeconds": 31}, timeout=60)
    assert resp.status_code == 400 and "limits.timeoutSeconds" in resp.text, resp.text
