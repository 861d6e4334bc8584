"""``/run_code`` through the gateway passes the agent's own ``/run_code`` contract tests: the very
test functions of ``tests/integration/sandbox/test_sandbox_api.py``, given the gateway in place of
the agent. Then the routing (header, query, namespace default) and ``/v1/ping``."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
import sandbox_fusion
import test_sandbox_api as agent_contract
from gateway_harness import NS, POOL, Gateway, serve_gateway
from sandbox_agent_harness import Agent, wait_until

from arl_tangram.dispatch.dispatcher import agent_key
from arl_tangram.domain.actions import ActionOutcome, Outcome, Reason
from arl_tangram.gateway import GatewayConfig, sandboxfusion
from arl_tangram.gateway.errors import INFRASTRUCTURE_REASONS
from arl_tangram.gateway.keys import scoped_key
from arl_tangram.gateway.state import STATE

# Imported through the module, so that pytest does not collect them here with the agent's fixture.
CONTRACT = tuple(
    getattr(agent_contract, name) for name in dir(agent_contract) if name.startswith("test_run_code")
)


@dataclass
class GatewayAsAgent:
    """What the agent's contract tests use of an agent (``post``), answered by the gateway."""

    url: str

    def post(self, path: str, body: object, timeout: float = 60) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent]) -> Iterator[Gateway]:
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL})
    with serve_gateway(hosts, config=config, pools=((NS, POOL), (NS, "other"), ("team-b", "py"))) as gw:
        yield gw


@pytest.mark.parametrize("contract", CONTRACT, ids=lambda f: f.__name__)
def test_run_code_contract_through_the_gateway(gateway: Gateway, contract: object) -> None:
    contract(GatewayAsAgent(gateway.url))  # type: ignore[operator]


def _ran_on(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["run_result"]["stdout"])


def test_the_pool_comes_from_header_query_or_the_namespace_default(gateway: Gateway) -> None:
    body = {"code": "print('hi')", "language": "python"}
    assert _ran_on(requests.post(gateway.url + "/run_code", json=body, timeout=60)) == "hi\n"
    by_header = requests.post(
        gateway.url + "/run_code", json=body, headers={"X-Tangram-Pool": "other"}, timeout=60
    )
    assert _ran_on(by_header) == "hi\n"
    by_query = requests.post(gateway.url + "/run_code?namespace=team-b&pool=py", json=body, timeout=60)
    assert _ran_on(by_query) == "hi\n"
    missing = requests.post(gateway.url + "/run_code?pool=absent", json=body, timeout=60)
    assert missing.status_code == 404 and "absent" in missing.json()["error"]
    assert missing.json()["status"] == "SandboxError"
    no_default = requests.post(gateway.url + "/run_code?namespace=team-b", json=body, timeout=60)
    assert no_default.status_code == 400 and "X-Tangram-Pool" in no_default.json()["error"]
    bad_name = requests.post(gateway.url + "/run_code?pool=Not_A_Name", json=body, timeout=60)
    assert bad_name.status_code == 400 and "pool" in bad_name.json()["field"]


def test_ping_answers_pong(gateway: Gateway) -> None:
    resp = requests.get(gateway.url + "/v1/ping", timeout=10)
    assert resp.status_code == 200 and resp.json() == "pong"  # SandboxFusion's JSON string, as the agent's


def test_a_pools_limit_bounds_the_compile_and_the_run_each(gateway: Gateway) -> None:
    """verl's tool sends its timeout as both ``compile_timeout`` and ``run_timeout`` (30 s each by
    default); on a pool of 30 s the two were added and every call refused (400), though Python
    never compiles. Python counts its run only; a compiled language its compile and its run, each
    bounded by the pool's limit; a phase past it is not refused (SandboxFusion refuses none): it
    runs at the pool's limit, its answer saying so (``test_gateway_sf_limits.py``, on a host whose
    ceilings are the pool's limits, as the operator starts them)."""
    python = {"code": "print('hi')", "language": "python", "compile_timeout": 30, "run_timeout": 30}
    assert _ran_on(requests.post(gateway.url + "/run_code", json=python, timeout=60)) == "hi\n"
    cpp = {
        "code": '#include <cstdio>\nint main() { std::puts("hi"); }\n',
        "language": "cpp",
        "compile_timeout": 30,
        "run_timeout": 30,
    }
    assert _ran_on(requests.post(gateway.url + "/run_code", json=cpp, timeout=120)) == "hi\n"
    over = requests.post(gateway.url + "/run_code", json={**python, "run_timeout": 31}, timeout=60)
    assert _ran_on(over) == "hi\n"
    over = requests.post(gateway.url + "/run_code", json={**cpp, "compile_timeout": 45}, timeout=120)
    assert _ran_on(over) == "hi\n"


def test_memory_past_the_pools_limit_runs_at_the_pools_limit(gateway: Gateway) -> None:
    """verl sends ``memory_limit_MB`` 1024 by default: above the pool's limit it was refused (first
    in the agent's own words, ``memory_mb``, then in the caller's), a -1 reward for every sample.
    It runs at the pool's limit (``test_gateway_sf_limits.py``), even an integer too large for a
    float (it was a 500, its key held for ever)."""
    body = {"code": "print(1)", "language": "python", "memory_limit_MB": 2048}
    assert _ran_on(requests.post(gateway.url + "/run_code", json=body, timeout=60)) == "1\n"
    huge = requests.post(gateway.url + "/run_code", json={**body, "memory_limit_MB": 10**400}, timeout=60)
    assert _ran_on(huge) == "1\n"
    assert (
        _ran_on(requests.post(gateway.url + "/run_code", json={**body, "memory_limit_MB": 1024}, timeout=60))
        == "1\n"
    )


def test_a_language_the_pool_does_not_run_is_the_callers_not_the_hosts(gateway: Gateway) -> None:
    """A name SandboxFusion knows that this pool's image does not run is answered 200
    ``SandboxError`` naming it, as SandboxFusion answers it. It was taken for a failing host:
    retried, answered 503, and counted against the host until the pool had none (a model that
    names ``julia`` in a tool call took the sandbox down for everyone)."""
    for _ in range(5):  # more than the failures in a row that mark a host unhealthy
        resp = requests.post(gateway.url + "/run_code", json={"code": "1", "language": "julia"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "SandboxError" and "julia" in resp.json()["message"], resp.text
    body = {"code": "print('still here')", "language": "python"}
    assert _ran_on(requests.post(gateway.url + "/run_code", json=body, timeout=30)) == "still here\n"


def test_the_answer_is_the_agents_own_bytes(gateway: Gateway, hosts: list[Agent]) -> None:
    """The verdict is the agent's answer byte for byte, as the agent stored it under the attempt's
    key (the gateway neither reshapes nor re-encodes what the code's run said)."""
    body = b'{"language": "python",  "code": "print(\'\\u00e9t\\u00e9\')"}'
    headers = {"Content-Type": "application/json", "X-Tangram-Action-Key": "sf-bytes"}
    resp = requests.post(gateway.url + "/run_code", data=body, headers=headers, timeout=60)
    assert resp.status_code == 200 and resp.json()["run_result"]["stdout"] == "\u00e9t\u00e9\n"
    stored = requests.get(f"{hosts[0].url}/v1/actions/{agent_key(scoped_key(NS, 'sf-bytes'), 1)}", timeout=10)
    assert stored.status_code == 200 and stored.content == resp.content


def _send_and_leave(gateway: Gateway, code: str, key: str | None = None) -> None:
    """POST ``/run_code`` on a connection of its own, wait until the gateway holds the action, and
    close the connection before any answer (a client that timed out)."""
    body = json.dumps({"code": code, "language": "python", "run_timeout": 30}).encode()
    head = f"X-Tangram-Action-Key: {key}\r\n" if key else ""
    port = int(gateway.url.rsplit(":", 1)[1])
    held = gateway.admission().pools.get(f"{NS}/{POOL}", 0)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            f"POST /run_code HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: gateway.admission().pools.get(f"{NS}/{POOL}", 0) > held, 20, "the action held")


def test_a_keyless_action_whose_caller_left_is_cancelled(gateway: Gateway) -> None:
    """Sent with no key, nobody can fetch its result once its caller has gone: it is cancelled (it
    ran to its end, holding its core while the timed-out trainer sent it again as a new action).
    One sent with a key runs on: a retry with the key gets its result."""
    _send_and_leave(gateway, "import time\ntime.sleep(28)")
    # Well before its 28 s end: within a few of the gateway's checks (every 0.05 s here).
    wait_until(lambda: gateway.admission().pools.get(f"{NS}/{POOL}", 0) == 0, 10, "the action cancelled")
    assert gateway.app[STATE].abandoned.cancelled >= 1
    _send_and_leave(gateway, "import time\ntime.sleep(1)\nprint('kept')", key="sf-left")
    again = requests.post(
        gateway.url + "/run_code",
        json={"code": "import time\ntime.sleep(1)\nprint('kept')", "language": "python", "run_timeout": 30},
        headers={"X-Tangram-Action-Key": "sf-left"},
        timeout=60,
    )
    assert _ran_on(again) == "kept\n"


@pytest.mark.parametrize("reason", sorted(INFRASTRUCTURE_REASONS, key=str))
def test_a_platform_failure_is_what_verl_retries(reason: Reason) -> None:
    """A host lost or retries spent: ``SandboxError`` with 504 and Retry-After, the one status verl's
    client retries (it scored a 503 as a sandbox error, -1: a wrong reward for the sample). The
    outcome is made here: a host lost is not something this test can cause on cue."""
    resp = sandboxfusion.answer(ActionOutcome("k", Outcome.FAILED, reason, "host-0 was lost"), 2.0)
    assert resp.status == 504 and resp.headers["Retry-After"] == "2"
    assert resp.body is not None and b'"SandboxError"' in resp.body  # type: ignore[operator]


def test_run_jupyter_through_the_gateway_with_sandboxfusions_client(gateway: Gateway) -> None:
    """SandboxFusion's own client's ``run_jupyter`` against the gateway: the cells run as one action
    on a host of the pool (chosen as for ``/run_code``), in one kernel, and the answer is the
    agent's. A platform failure is answered in SandboxFusion's shape, as on ``/run_code``."""
    request = sandbox_fusion.RunJupyterRequest(cells=["x = 6 * 7", "x", "print(x)", "1 / 0"])
    answer = sandbox_fusion.run_jupyter(request, endpoint=gateway.url, max_attempts=1, client_timeout=120)
    assert answer.status == "Success"
    assert answer.cells[1].display[0]["text/plain"] == "42"
    assert answer.cells[2].stdout == "42\n"
    assert answer.cells[3].error[0]["ename"] == "ZeroDivisionError"
    by_query = requests.post(
        gateway.url + "/run_jupyter?namespace=team-b&pool=py", json={"cells": ["print('b')"]}, timeout=120
    )
    assert by_query.status_code == 200 and by_query.json()["cells"][0]["stdout"] == "b\n", by_query.text
    missing = requests.post(gateway.url + "/run_jupyter?pool=absent", json={"cells": ["1"]}, timeout=60)
    assert missing.status_code == 404 and missing.json()["status"] == "SandboxError"
    bad = requests.post(gateway.url + "/run_jupyter", json={"cells": [1]}, timeout=60)
    assert bad.status_code == 422 and bad.json()["status"] == "SandboxError", bad.text
    assert "cells" in bad.json()["message"]


def test_a_notebook_over_its_total_timeout_fails_through_the_gateway(gateway: Gateway) -> None:
    body = {"cells": ["import time\ntime.sleep(60)"], "total_timeout": 2}
    resp = requests.post(gateway.url + "/run_jupyter", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "Failed" and resp.json()["driver"]["status"] == "TimeLimitExceeded"


def test_sandboxfusions_client_names_the_pool_in_its_endpoints_path(gateway: Gateway) -> None:
    """SandboxFusion's client appends ``/run_code`` to its endpoint and sends no headers, so the
    pool (when it is not the namespace's default) goes in the path: ``/pools/NAMESPACE/POOL``."""
    endpoint = gateway.url + "/pools/team-b/py"
    code = sandbox_fusion.RunCodeRequest(code="print(input()[::-1])", stdin="abc", language="python")
    ran = sandbox_fusion.run_code(code, endpoint=endpoint, max_attempts=1, client_timeout=120)
    assert ran.status == "Success" and ran.run_result is not None and ran.run_result.stdout == "cba\n"
    notebook = sandbox_fusion.RunJupyterRequest(cells=["print('nb')"])
    answer = sandbox_fusion.run_jupyter(notebook, endpoint=endpoint, max_attempts=1, client_timeout=120)
    assert answer.status == "Success" and answer.cells[0].stdout == "nb\n"
    # Named twice, differently: which one was meant? Refused, naming both.
    body = {"code": "print(1)", "language": "python"}
    both = requests.post(endpoint + "/run_code", json=body, headers={"X-Tangram-Pool": "other"}, timeout=60)
    assert both.status_code == 400 and both.json()["status"] == "SandboxError", both.text
    assert "'other'" in both.json()["message"] and "'py'" in both.json()["message"]
    absent = requests.post(gateway.url + "/pools/team-b/absent/run_code", json=body, timeout=60)
    assert absent.status_code == 404 and "absent" in absent.json()["message"]
    typo = requests.post(endpoint + "/run_code?pol=x", json=body, timeout=60)
    assert typo.status_code == 400 and "pol" in typo.json()["message"]
    # Refused before any route is matched (a wrong method), still in SandboxFusion's shape.
    wrong = requests.get(endpoint + "/run_jupyter", timeout=60)
    assert wrong.status_code == 405 and wrong.json()["status"] == "SandboxError", wrong.text
