"""An attacker holding a valid gateway token for one namespace (A), against the real API server's
TokenReview and SubjectAccessReview: nothing of another namespace (B) is reachable, whatever the
request names B by (body, header, query, path, the gateway's default namespace, a session id, a
key), and tokens that are not live gateway tokens get nowhere.

The gateway runs in this test process (real HTTP on loopback) in front of the real dispatcher and a
real sandbox agent, with a pool ``py`` in both namespaces; its default namespace is B's, so that a
request naming no namespace aims at the victim.
"""

from __future__ import annotations

import base64
import json
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from kubernetes import client
from testbed import Cluster

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "integration" / "sandbox"))
sys.path.insert(0, str(TESTS / "integration" / "gateway"))
sys.path.insert(0, str(TESTS / "integration" / "dispatch"))  # gateway_harness's dispatch_harness

from gateway_harness import Gateway, serve_gateway  # noqa: E402
from operator_harness import trainer_token  # noqa: E402
from sandbox_agent_harness import Agent, start_agent, stop_agent  # noqa: E402

from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator  # noqa: E402

AUDIENCE = "tangram-gateway"
POOL = "py"
CODE = {"code": "print(1)", "language": "python"}


class Batches:
    """Batch results as the operator serves them: one batch, ``secret``, in each namespace."""

    async def results(self, namespace: str, name: str) -> AsyncIterator[dict[str, object]] | None:
        if name != "secret":
            return None

        async def rows() -> AsyncIterator[dict[str, object]]:
            yield {"id": "a1", "state": "Succeeded", "stdout": f"{namespace}'s data\n"}

        return rows()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("e2e-authz") / "work")
    yield running
    stop_agent(running)


@pytest.fixture
def victim(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-authz-b-{secrets.token_hex(3)}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    cluster.core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture
def gateway(cluster: Cluster, namespace: str, victim: str, agent: Agent) -> Iterator[Gateway]:
    auth = KubernetesAuthenticator(cluster.api, AUDIENCE)
    config = GatewayConfig(default_namespace=victim, default_pools={victim: POOL, namespace: POOL})
    pools = ((namespace, POOL), (victim, POOL))
    with serve_gateway([agent], auth=auth, config=config, pools=pools, batch_results=Batches()) as gw:
        yield gw


def _until(check: Callable[[], bool], description: str) -> None:
    """Until ``check()`` holds (the API server's informers, the dispatcher's queue), for 30 s."""
    deadline = time.monotonic() + 30
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within 30 s: {description}")
        time.sleep(0.05)


def _allowed(cluster: Cluster, namespace: str, sa: str) -> None:
    """Until the API server's RBAC authorizer has seen the new binding (its informers lag a little)."""
    authz = client.AuthorizationV1Api(cluster.api)
    attrs = {
        "group": "tangram.arl.dev",
        "resource": "actionbatches",
        "verb": "create",
        "namespace": namespace,
    }
    spec = {"user": f"system:serviceaccount:{namespace}:{sa}", "groups": ["system:serviceaccounts"]}
    _until(
        lambda: bool(
            authz.create_subject_access_review({"spec": {**spec, "resourceAttributes": attrs}}).status.allowed
        ),
        f"RBAC allows {spec['user']} in {namespace}",
    )


def _caller(gw: Gateway, token: str) -> Any:
    def call(method: str, path: str, **kw: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        return requests.request(method, gw.url + path, headers=headers, timeout=60, **kw)

    return call


def _code(namespace: str | None, code: str, **extra: Any) -> dict[str, Any]:
    body = {"type": "code", "target": POOL, "payload": {"code": code}, **extra}
    return {**body, "namespace": namespace} if namespace else body


def test_a_token_for_one_namespace_reaches_nothing_in_another(
    cluster: Cluster, namespace: str, victim: str, gateway: Gateway
) -> None:
    a, b = namespace, victim
    alice = _caller(gateway, trainer_token(cluster, a, "alice"))
    bob = _caller(gateway, trainer_token(cluster, b, "bob"))
    _allowed(cluster, a, "alice")
    _allowed(cluster, b, "bob")

    # B's own state: a session, a keyed result, a long action under a key of B's.
    b_session = bob("POST", "/v1/sessions", json={"namespace": b, "pool": POOL})
    assert b_session.status_code == 201, b_session.text
    sid = b_session.json()["id"]
    ran = bob("POST", "/v1/actions", json=_code(b, "print('bob')", key="shared"))
    assert ran.status_code == 200 and ran.json()["stdout"] == "bob\n", ran.text
    long: list[requests.Response] = []
    sleeper = threading.Thread(
        target=lambda: long.append(
            bob("POST", "/v1/actions", json=_code(b, "import time; time.sleep(2); print('done')", key="long"))
        )
    )
    sleeper.start()
    dispatcher = gateway.service.dispatcher
    _until(lambda: f"gw/{b}/long" in dispatcher._jobs, "B's action running")

    def refused(resp: requests.Response, status: int = 403) -> None:
        assert resp.status_code == status, (resp.request.method, resp.request.url, resp.text)
        assert "bob" not in resp.text, resp.text  # nothing of B's output or key leaks

    # Keys are B's alone: A's cancel of "long" stops nothing of B's (it runs on, below), and A's
    # "shared" runs A's own action rather than answering B's result.
    mine = alice("POST", "/v1/actions", json=_code(a, "print('alice')", key="shared"))
    assert mine.status_code == 200 and mine.json()["stdout"] == "alice\n", mine.text
    refused(alice("POST", "/v1/actions:cancel", json={"namespace": b, "keys": ["long"]}))
    cancel = alice("POST", "/v1/actions:cancel", json={"namespace": a, "keys": ["long"]})
    assert cancel.status_code == 200 and cancel.json() == {"cancelled": [], "notRunning": ["long"]}

    # Naming B: in the body, a stream's line, a header, the query, the path, or nothing (B is the
    # gateway's default namespace, and its default pool the default of /run_code).
    refused(alice("POST", "/v1/actions", json=_code(b, "print(1)")))
    refused(alice("POST", "/v1/actions", json=_code(None, "print(1)")))
    stream = alice("POST", "/v1/actions:stream", data=json.dumps(_code(b, "print(1)")) + "\n")
    assert stream.status_code == 200 and json.loads(stream.text)["status"] == 403, stream.text
    refused(alice("POST", "/run_code", json=CODE))
    refused(alice("POST", "/run_code", json=CODE, headers={"X-Tangram-Namespace": b}))
    refused(alice("POST", f"/run_code?namespace={b}&pool={POOL}", json=CODE))
    refused(alice("POST", f"/pools/{b}/{POOL}/run_code", json=CODE))
    refused(alice("POST", f"/pools/{b}/{POOL}/run_jupyter", json={"cells": ["1"]}))
    refused(alice("POST", "/v1/sessions", json={"namespace": b, "pool": POOL}))
    rewards = {
        "namespace": b,
        "pool": POOL,
        "items": [{"prompt": "p", "response": "r", "label": "import solution"}],
    }
    refused(alice("POST", "/v1/rewards", json=rewards))
    openrlhf = {"query": ["q"], "prompts": ["q"], "labels": ["import solution"]}
    refused(alice("POST", f"/get_reward?namespace={b}&pool={POOL}", json=openrlhf))
    refused(alice("POST", f"/v1/score?namespace={b}", json={"model": "rm", "text_1": "a", "text_2": ["b"]}))
    # Tricks on the names: another namespace behind encoded slashes and dot-segments, a
    # trailing newline, a capital; a header and a query that disagree; a parameter given twice.
    refused(alice("POST", f"/pools/{a}%2F..%2F{b}/{POOL}/run_code", json=CODE), 400)
    refused(alice("POST", f"/run_code?namespace={a}%0A&pool={POOL}", json=CODE), 400)
    refused(alice("POST", f"/run_code?namespace={a.upper()}&pool={POOL}", json=CODE), 400)
    refused(alice("POST", f"/run_code?namespace={a}", json=CODE, headers={"X-Tangram-Namespace": b}), 400)
    refused(alice("POST", f"/run_code?namespace={a}&namespace={b}&pool={POOL}", json=CODE), 400)
    refused(alice("GET", f"/v1/batches/{a}%2F..%2F{b}/secret/results"), 400)

    # B's batch results: refused alike whether the batch exists (nothing tells them apart); A's own
    # are served.
    refused(alice("GET", f"/v1/batches/{b}/secret/results"))
    refused(alice("GET", f"/v1/batches/{b}/nothing/results"))
    own = alice("GET", f"/v1/batches/{a}/secret/results")
    assert own.status_code == 200 and f"{a}'s data" in own.text, own.text

    # B's session: not read, not run in, not closed (its id is no capability), and answered as an
    # id that is open nowhere (a 403 told A that it is open, and in which namespace); named from A's
    # namespace, it is no session at all.
    for method, path, body in (
        ("GET", "", None),
        ("POST", "/actions", {"type": "code", "payload": {"code": "1"}}),
        ("DELETE", "", None),
    ):
        for session in (sid, "s-0123456789abcdef"):
            resp = alice(method, f"/v1/sessions/{session}{path}", json=body)
            refused(resp, 404)
            assert b not in resp.text and "no open session" in resp.json()["error"], resp.text
    refused(alice("POST", "/v1/actions", json=_code(a, "1", sessionId=sid)), 404)
    assert bob("GET", f"/v1/sessions/{sid}").status_code == 200, "B's session was closed by A"

    sleeper.join(60)
    assert long and long[0].status_code == 200 and long[0].json()["stdout"] == "done\n", long

    # The open routes say nothing of B.
    metrics = requests.get(gateway.url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and b not in metrics.text


def test_only_live_gateway_tokens_pass(cluster: Cluster, namespace: str, gateway: Gateway) -> None:
    a = namespace
    token = trainer_token(cluster, a, "alice")
    cluster.kubectl("create", "serviceaccount", "ghost", "-n", a)
    ghost = cluster.kubectl("create", "token", "ghost", "-n", a, "--audience", AUDIENCE).stdout.strip()
    api_audience = cluster.kubectl("create", "token", "alice", "-n", a).stdout.strip()
    _allowed(cluster, a, "alice")
    # The ghost's account is deleted before the gateway ever sees its token (nothing cached).
    cluster.kubectl("delete", "serviceaccount", "ghost", "-n", a)
    authn = client.AuthenticationV1Api(cluster.api)
    _until(
        lambda: (
            not authn.create_token_review(
                {"spec": {"token": ghost, "audiences": [AUDIENCE]}}
            ).status.authenticated
        ),
        "the API server refuses the deleted ServiceAccount's token",
    )

    def run(headers: dict[str, str], path: str = f"/run_code?namespace={a}") -> requests.Response:
        return requests.post(gateway.url + path, json=CODE, headers=headers, timeout=60)

    header, payload, signature = token.split(".")
    forged_claims = payload[:-4] + ("AAAA" if payload[-4:] != "AAAA" else "BBBB")
    for bad in (
        ghost,
        api_audience,  # the API server's audience, not the gateway's
        f"{header}.{payload}.{signature[:-4]}{'AAAA' if signature[-4:] != 'AAAA' else 'BBBB'}",
        f"{header}.{forged_claims}.{signature}",
        "eyJhbGciOiJub25lIn0.eyJzdWIiOiJzeXN0ZW06YWRtaW4ifQ.",  # alg none
    ):
        resp = run({"Authorization": f"Bearer {bad}"})
        assert resp.status_code == 401 and resp.json()["status"] == "SandboxError", resp.text
    # No token: headers a proxy would add are not credentials, and anonymous is not loopback's here.
    spoofed = run({"X-Forwarded-For": "127.0.0.1", "X-Remote-User": f"system:serviceaccount:{a}:alice"})
    assert spoofed.status_code == 401, spoofed.text
    # An oversize header is refused by the HTTP parser, and the gateway goes on serving.
    huge = run({"Authorization": "Bearer " + "x" * 9000})
    assert huge.status_code == 400, huge.status_code
    ok = run({"Authorization": "Basic " + base64.b64encode(f"tangram:{token}".encode()).decode()})
    assert ok.status_code == 200 and ok.json()["status"] == "Success", ok.text
