"""The gateway authenticates against the real API server: real ServiceAccount tokens from
TokenRequest, checked with TokenReview (audience bound) and a SubjectAccessReview for ``create
actionbatches.tangram.arl.dev`` in the pool's namespace, decided by real RBAC.

The gateway runs in this test process (real HTTP on loopback) in front of the real dispatcher and
a real sandbox agent process; its authenticator uses the test bed's kubeconfig credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from kubernetes import client
from testbed import Cluster, wait_for

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "integration" / "sandbox"))
sys.path.insert(0, str(TESTS / "integration" / "gateway"))
sys.path.insert(0, str(TESTS / "integration" / "dispatch"))  # gateway_harness's dispatch_harness

from gateway_harness import Gateway, read_until_closed, serve_gateway  # noqa: E402
from sandbox_agent_harness import Agent, start_agent, stop_agent  # noqa: E402

from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator  # noqa: E402
from arl_tangram.gateway.auth import ReviewThrottle  # noqa: E402
from arl_tangram.gateway.state import STATE  # noqa: E402

AUDIENCE = "tangram-gateway"
POOL = "py"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("e2e-gw") / "work")
    yield running
    stop_agent(running)


@pytest.fixture
def other_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-gw-other-{secrets.token_hex(3)}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    cluster.core.delete_namespace(name, propagation_policy="Background")


def _service_account(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})


def _grant(cluster: Cluster, namespace: str, sa_namespace: str, sa: str) -> None:
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": f"run-actions-{sa}"},
            "rules": [
                {"apiGroups": ["tangram.arl.dev"], "resources": ["actionbatches"], "verbs": ["create"]}
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": f"run-actions-{sa}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"run-actions-{sa}"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace}],
        },
    )


def _wait_rbac(cluster: Cluster, user: str, namespace: str, allowed: bool) -> None:
    """Until the API server's RBAC authorizer has seen the new bindings (its informers lag a little)."""
    authz = client.AuthorizationV1Api(cluster.api)
    attrs = {
        "group": "tangram.arl.dev",
        "resource": "actionbatches",
        "verb": "create",
        "namespace": namespace,
    }
    deadline = time.monotonic() + 30
    while True:
        review = authz.create_subject_access_review(
            {"spec": {"user": user, "groups": ["system:serviceaccounts"], "resourceAttributes": attrs}}
        )
        if review.status.allowed == allowed:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"RBAC for {user} in {namespace} did not become allowed={allowed}")
        time.sleep(0.1)


def _token(cluster: Cluster, namespace: str, sa: str, audiences: list[str] | None = None) -> str:
    spec: dict[str, object] = {"expirationSeconds": 600}
    if audiences is not None:
        spec["audiences"] = audiences
    review = cluster.core.create_namespaced_service_account_token(sa, namespace, {"spec": spec})
    token: str = review.status.token
    return token


@pytest.fixture
def gateway(cluster: Cluster, namespace: str, agent: Agent) -> Iterator[Gateway]:
    auth = KubernetesAuthenticator(cluster.api, AUDIENCE)
    config = GatewayConfig(default_namespace=namespace, default_pools={namespace: POOL})
    with serve_gateway([agent], auth=auth, config=config, pools=((namespace, POOL),)) as gw:
        yield gw


def _run(gw: Gateway, namespace: str, token: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    action = {"namespace": namespace, "type": "code", "target": POOL, "payload": {"code": "print('ran')"}}
    return requests.post(gw.url + "/v1/actions", json=action, headers=headers, timeout=60)


def test_rbac_decides_who_runs_actions(
    cluster: Cluster, namespace: str, other_namespace: str, gateway: Gateway
) -> None:
    for sa in ("trainer", "stranger", "elsewhere"):
        _service_account(cluster, namespace, sa)
    _grant(cluster, namespace, namespace, "trainer")
    _grant(cluster, other_namespace, namespace, "elsewhere")
    _wait_rbac(cluster, f"system:serviceaccount:{namespace}:trainer", namespace, True)
    _wait_rbac(cluster, f"system:serviceaccount:{namespace}:elsewhere", other_namespace, True)

    allowed = _run(gateway, namespace, _token(cluster, namespace, "trainer", [AUDIENCE]))
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["state"] == "Succeeded" and allowed.json()["stdout"] == "ran\n"

    missing = _run(gateway, namespace, None)
    assert missing.status_code == 401 and "missing bearer token" in missing.json()["error"]

    no_rbac = _run(gateway, namespace, _token(cluster, namespace, "stranger", [AUDIENCE]))
    assert no_rbac.status_code == 403, no_rbac.text
    assert (
        f"system:serviceaccount:{namespace}:stranger may not create actionbatches" in no_rbac.json()["error"]
    )

    only_elsewhere = _run(gateway, namespace, _token(cluster, namespace, "elsewhere", [AUDIENCE]))
    assert only_elsewhere.status_code == 403 and f"namespace {namespace!r}" in only_elsewhere.json()["error"]

    # A token for the API server's own audience (the pod's default token) is not the gateway's.
    wrong_audience = _run(gateway, namespace, _token(cluster, namespace, "trainer"))
    assert wrong_audience.status_code == 401 and AUDIENCE in wrong_audience.json()["error"]

    forged = _run(gateway, namespace, "eyJhbGciOiJSUzI1NiJ9.e30.c2ln")
    assert forged.status_code == 401


def test_a_warm_token_makes_no_api_call(cluster: Cluster, namespace: str, gateway: Gateway) -> None:
    _service_account(cluster, namespace, "trainer")
    _grant(cluster, namespace, namespace, "trainer")
    _wait_rbac(cluster, f"system:serviceaccount:{namespace}:trainer", namespace, True)
    token = _token(cluster, namespace, "trainer", [AUDIENCE])
    assert _run(gateway, namespace, token).status_code == 200
    authenticator = gateway.app[STATE].auth
    assert isinstance(authenticator, KubernetesAuthenticator)
    calls = authenticator.api_calls
    for _ in range(5):
        assert _run(gateway, namespace, token).status_code == 200
    assert authenticator.api_calls == calls


def test_a_flood_of_made_up_tokens_spares_the_api_server_and_others_get_in(
    cluster: Cluster, namespace: str, agent: Agent
) -> None:
    """Each distinct token cost one TokenReview on the real API server, as many at once as the
    client sent. Now one client's made-up tokens (well-formed JWTs, which only a review can refuse)
    spend at most its own share, and another client's new, real token is still reviewed and let in.
    The throttle's clock stands still, so its per-second budgets do not refill during the test."""
    _service_account(cluster, namespace, "trainer")
    _grant(cluster, namespace, namespace, "trainer")
    _wait_rbac(cluster, f"system:serviceaccount:{namespace}:trainer", namespace, True)
    token = _token(cluster, namespace, "trainer", [AUDIENCE])
    throttle = ReviewThrottle(client_in_flight=2, client_per_second=5, clock=lambda: 0.0)
    auth = KubernetesAuthenticator(cluster.api, AUDIENCE, throttle=throttle)
    config = GatewayConfig(default_namespace=namespace, default_pools={namespace: POOL})
    header, payload, _ = token.split(".")

    async def flood(url: str) -> list[int]:
        async with aiohttp.ClientSession() as http:

            async def one() -> int:
                made_up = f"{header}.{payload}.{secrets.token_urlsafe(256)}"  # a forged signature
                headers = {"Authorization": f"Bearer {made_up}"}
                async with http.post(f"{url}/v1/actions", json={}, headers=headers) as resp:
                    return resp.status

            return await asyncio.gather(*(one() for _ in range(100)))

    with serve_gateway([agent], auth=auth, config=config, pools=((namespace, POOL),)) as gw:
        statuses = asyncio.run(flood(gw.url))
        assert set(statuses) <= {401, 503} and 503 in statuses, statuses
        assert auth.api_calls <= 10, f"{auth.api_calls} reviews for one client's flood"
        # Another client: its connection's own address (loopback's 127.0.0.2).
        host, port = gw.url.removeprefix("http://").split(":")
        action = b'{"type": "code", "target": "py", "payload": {"code": "print(7)"}}'
        with socket.socket() as conn:
            conn.settimeout(60)
            conn.bind(("127.0.0.2", 0))
            conn.connect((host, int(port)))
            conn.sendall(
                b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                + b"Content-Type: application/json\r\n"
                + f"Authorization: Bearer {token}\r\nContent-Length: {len(action)}\r\n\r\n".encode()
                + action
            )
            answer = read_until_closed(conn)
        assert answer.startswith(b"HTTP/1.1 200") and b'"stdout": "7\\n"' in answer, answer


def test_the_client_batch_helper_creates_waits_by_watch_and_reads_results(
    cluster: Cluster, namespace: str
) -> None:
    """``ActionBatches`` against the real API server. No operator runs in this test: the test itself
    writes the finished status (as the operator would, through the status subresource) while the
    helper waits on its watch, so what is checked is the helper's create, watch and read."""
    import threading

    from pydantic import ValidationError

    from arl_tangram.client import ActionBatches

    batches = ActionBatches(namespace, api_client=cluster.api)
    created = batches.create(
        [{"id": "a1", "type": "code", "target": POOL, "payload": {"code": "print(1)"}}], name="step-1"
    )
    assert created["metadata"]["name"] == "step-1"
    with pytest.raises(ValidationError, match="actions"):
        batches.create([], name="empty")  # the API model refuses it before the API server sees it
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "status": {
            "conditions": [
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "AllFinished",
                    "message": "1 of 1",
                    "lastTransitionTime": now,
                }
            ],
            "counts": {"total": 1, "succeeded": 1},
            "results": [{"id": "a1", "state": "Succeeded", "exitCode": 0, "attempts": 1, "output": "1\n"}],
        }
    }
    waited: list[dict[str, object]] = []
    waiter = threading.Thread(target=lambda: waited.append(batches.wait("step-1", timeout_s=60)))
    waiter.start()
    cluster.custom.patch_namespaced_custom_object_status(
        "tangram.arl.dev", "v1alpha1", namespace, "actionbatches", "step-1", status
    )
    waiter.join(90)
    assert waited and waited[0]["metadata"]["name"] == "step-1"  # type: ignore[index]
    # The API server's defaulting adds truncated: false.
    assert batches.results("step-1") == [{**status["status"]["results"][0], "truncated": False}]


# ---- through the operator's own gateway ----------------------------------------------------------
class LeaderProxy:
    """What the operator Service does for trainers: every new connection goes to the replica that is
    ready (the leader). On the test bed Services get no endpoints for pods on loopback addresses, and
    the replicas here are processes; so this small TCP proxy stands in for the Service."""

    def __init__(self, operator: Any) -> None:
        self.operator = operator
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="leader-proxy", daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            leader = await asyncio.to_thread(self.operator.leader, 30)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", leader.port)
        except (AssertionError, OSError):
            writer.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # the proxy is stopping (``__exit__``)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def __enter__(self) -> LeaderProxy:
        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._serve, "127.0.0.1", 0)

        self._thread.start()
        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            # Connections still piped are cancelled and closed while the loop runs; left pending,
            # their coroutines were collected after the loop had gone ("Event loop is closed").
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from operator_harness import Operator, install, sa_kubeconfig

    install(cluster)
    work = tmp_path_factory.mktemp("gw-operator")
    op = Operator(cluster, work, sa_kubeconfig(cluster, work / "kubeconfig"))
    op.start("gw-op-a")
    op.start("gw-op-b")
    try:
        yield op
    finally:
        op.stop_all()


def _host_pods_ran(cluster: Cluster, namespace: str) -> int:
    """Actions the pool's live agents report having run: the side effect that proves "once"."""
    from testbed import http_get_json

    total = 0
    for pod in cluster.core.list_namespaced_pod(namespace, label_selector="tangram.arl.dev/pool").items:
        if pod.status.pod_ip and pod.metadata.deletion_timestamp is None and pod.status.phase == "Running":
            total += sum(http_get_json(f"http://{pod.status.pod_ip}:8080/v1/health")["outcomes"].values())
    return total


def test_streams_through_the_operator_come_back_once_even_when_the_leader_dies(
    cluster: Cluster, namespace: str, operator: Any
) -> None:
    """1,000 actions through the leader's ``/v1/actions:stream`` all come back exactly once; then the
    leader is SIGKILLed mid-stream and the client's same-key retries finish the work on the new
    leader with nothing run twice (the agents' own counts prove it)."""
    from operator_harness import pool_manifest, trainer_token

    from arl_tangram.client import RetryPolicy, TangramClient, code_action

    cluster.custom.create_namespaced_custom_object(
        "tangram.arl.dev",
        "v1alpha1",
        namespace,
        "actionpools",
        pool_manifest(POOL, scaling={"minHosts": 2, "maxHosts": 2}),
    )
    wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 2,
        group="tangram.arl.dev",
        version="v1alpha1",
        namespace=namespace,
        plural="actionpools",
        description="two hosts ready",
        timeout=180,
    )
    token = trainer_token(cluster, namespace)
    _wait_rbac(cluster, f"system:serviceaccount:{namespace}:trainer", namespace, True)
    retry = RetryPolicy(attempts=15, backoff_s=0.5, max_backoff_s=4.0)
    with (
        LeaderProxy(operator) as proxy,
        TangramClient(
            f"http://127.0.0.1:{proxy.port}", namespace=namespace, pool=POOL, token=token, retry=retry
        ) as client,
    ):
        results = list(client.run_many(code_action(f"print({i})", id=f"t{i}") for i in range(1000)))
        assert sorted(r.id or "" for r in results) == sorted(f"t{i}" for i in range(1000))
        assert all(r.ok and r.stdout == f"{(r.id or 't')[1:]}\n" for r in results)

        before = _host_pods_ran(cluster, namespace)
        sleepers = [code_action(f"import time; time.sleep(0.1); print({i})", id=f"s{i}") for i in range(200)]
        seen = []
        for result in client.run_many(sleepers):
            seen.append(result)
            if len(seen) == 50:
                leader = operator.leader()
                operator.kill(leader.name)
                operator.start(leader.name)  # back, as the standby
        assert sorted(r.id or "" for r in seen) == sorted(f"s{i}" for i in range(200))
        assert all(r.ok and r.stdout == f"{(r.id or 's')[1:]}\n" for r in seen), [
            r for r in seen if not r.ok
        ][:3]
        assert _host_pods_ran(cluster, namespace) - before == 200, "an action ran twice (or was lost)"
