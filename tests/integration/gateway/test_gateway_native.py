"""The native API end to end: actions, streams, sessions, batch results, health and OpenAPI."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import requests
from gateway_harness import NS, POOL, Gateway, serve_gateway
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.client import NotFoundError, TangramClient


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    running = [start_agent(tmp_path_factory.mktemp("gwhost") / "work", "--session-ttl", "600")]
    yield running
    for a in running:
        stop_agent(a)


class Results:
    """A stand-in for the operator's batch results store (the protocol the operator implements)."""

    def __init__(self, batches: dict[tuple[str, str], list[dict[str, object]]]) -> None:
        self.batches = batches

    async def results(self, namespace: str, name: str) -> AsyncIterator[dict[str, object]] | None:
        rows = self.batches.get((namespace, name))
        if rows is None:
            return None

        async def gen() -> AsyncIterator[dict[str, object]]:
            for row in rows:
                yield row

        return gen()


BATCH = [{"id": f"a{i}", "state": "Succeeded", "output": "x" * 5000} for i in range(50)]
# One result whose output is longer than aiohttp's own line reader takes (512 KiB).
BIG = [{"id": "big", "state": "Succeeded", "output": "y" * 600_000}, *BATCH[:2]]


@pytest.fixture(scope="module")
def gateway(agents: list[Agent]) -> Iterator[Gateway]:
    with serve_gateway(agents, batch_results=Results({(NS, "step-1"): BATCH, (NS, "step-big"): BIG})) as gw:
        yield gw


def test_one_action_runs_and_answers_with_its_result(gateway: Gateway) -> None:
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={"id": "a1", "type": "code", "target": POOL, "payload": {"code": "print(6 * 7)"}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == "a1" and body["state"] == "Succeeded" and body["stdout"] == "42\n"
    assert body["exitCode"] == 0 and body["attempts"] == 1 and len(body["cores"]) == 1


def test_a_failing_program_is_a_result_not_an_error(gateway: Gateway) -> None:
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={"type": "code", "target": POOL, "payload": {"command": "echo out; exit 3"}},
        timeout=60,
    )
    body = resp.json()
    assert resp.status_code == 200
    assert body["state"] == "Failed" and body["reason"] == "NonZeroExit" and body["exitCode"] == 3
    assert body["stdout"] == "out\n"


def test_a_test_action_reports_its_pass_fraction(gateway: Gateway) -> None:
    tests = "def test_a():\n    assert True\n\ndef test_b():\n    assert False\n"
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={
            "type": "test",
            "target": POOL,
            "payload": {
                "command": "python -m pytest -q -p no:cacheprovider t_x.py",
                "files": {"t_x.py": tests},
            },
        },
        timeout=60,
    )
    assert resp.json()["reward"] == 0.5, resp.text


def test_the_same_key_runs_once(gateway: Gateway, agents: list[Agent]) -> None:
    """The agent counts what it ran: a repeat of a key (a client's retry) is answered, not rerun."""

    def ran() -> int:
        return sum(requests.get(agents[0].url + "/v1/health", timeout=10).json()["outcomes"].values())

    before = ran()
    action = {"type": "code", "target": POOL, "key": "retry-me-1", "payload": {"code": "print('once')"}}
    first = requests.post(gateway.url + "/v1/actions", json=action, timeout=60).json()
    second = requests.post(gateway.url + "/v1/actions", json=action, timeout=60).json()
    assert first["stdout"] == second["stdout"] == "once\n"
    assert first["key"] == second["key"] == "retry-me-1"
    assert ran() == before + 1


def test_a_key_sent_again_with_another_action_is_refused(gateway: Gateway) -> None:
    """A key names one logical action: sent again with another payload or type it gets 409 naming
    the key, not the first action's result (a test's reward for code that never ran). A retry with
    a different timeout is still the same action; a stream line reusing a key alike."""
    action = {"type": "code", "target": POOL, "key": "one-action-7", "payload": {"code": "print('first')"}}
    first = requests.post(gateway.url + "/v1/actions", json=action, timeout=60)
    assert first.status_code == 200 and first.json()["stdout"] == "first\n", first.text
    for changed in (
        {**action, "payload": {"code": "print('second')"}},
        {**action, "type": "test"},
        {**action, "units": {"min": 1, "max": 2}},
    ):
        resp = requests.post(gateway.url + "/v1/actions", json=changed, timeout=60)
        assert resp.status_code == 409 and resp.json()["field"] == "key", resp.text
        assert "one-action-7" in resp.json()["error"], resp.text
    again = requests.post(gateway.url + "/v1/actions", json={**action, "timeoutSeconds": 30}, timeout=60)
    assert again.status_code == 200 and again.json()["stdout"] == "first\n", again.text
    lines = [
        json.dumps({**action, "key": "one-line-8"}),
        json.dumps({**action, "key": "one-line-8", "payload": {"code": "print(2)"}}),
    ]
    stream = requests.post(gateway.url + "/v1/actions:stream", data="\n".join(lines).encode(), timeout=60)
    out = [json.loads(line) for line in stream.text.splitlines()]
    assert sorted(o.get("status", 200) for o in out) == [200, 409], out


def test_a_key_refused_before_anything_ran_stays_free(gateway: Gateway) -> None:
    """A request refused before its action began (a pool that does not exist) leaves its key free:
    the corrected request under the same key runs, instead of a 409 for an action that never was."""
    action = {
        "type": "code",
        "target": "no-such-pool",
        "key": "fix-me-2",
        "payload": {"code": "print('ran')"},
    }
    assert requests.post(gateway.url + "/v1/actions", json=action, timeout=60).status_code == 404
    fixed = requests.post(gateway.url + "/v1/actions", json={**action, "target": POOL}, timeout=60)
    assert fixed.status_code == 200 and fixed.json()["stdout"] == "ran\n", fixed.text


def test_an_unknown_pool_is_named(gateway: Gateway) -> None:
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={"type": "code", "target": "nope", "payload": {"code": "1"}},
        timeout=60,
    )
    assert resp.status_code == 404 and "nope" in resp.json()["error"]


def test_a_stream_returns_every_result_once_in_completion_order(gateway: Gateway) -> None:
    slow = {"id": "slow", "type": "code", "target": POOL, "payload": {"code": "import time; time.sleep(1.5)"}}
    fast = [
        {"id": f"f{i}", "type": "code", "target": POOL, "payload": {"code": f"print({i})"}} for i in range(30)
    ]
    lines = [slow, *fast, {"id": "bad", "type": "code", "target": POOL}]
    body = "\n".join(json.dumps(x) for x in lines) + "\nnot json\n"
    resp = requests.post(gateway.url + "/v1/actions:stream", data=body.encode(), timeout=120, stream=True)
    assert resp.status_code == 200
    out = [json.loads(line) for line in resp.iter_lines() if line]
    ids = [o.get("id") for o in out]
    assert sorted(i for i in ids if i) == sorted(["slow", "bad", *(f"f{i}" for i in range(30))])
    assert len(out) == 33, out  # one line each, the unparsable one included
    assert ids.index("slow") > ids.index("f0"), "results must come in completion order"
    by_id = {o.get("id"): o for o in out}
    assert all(by_id[f"f{i}"]["stdout"] == f"{i}\n" for i in range(30))
    assert by_id["bad"]["status"] == 422 and "payload" in by_id["bad"]["error"]
    # Its field as POST /v1/actions names it; the line has its own number (not "line 32.payload").
    assert (by_id["bad"]["field"], by_id["bad"]["line"]) == ("payload", 32), by_id["bad"]
    unparsable = next(o for o in out if o.get("line") == 33)
    assert unparsable["status"] == 400 and "malformed JSON" in unparsable["error"]


def test_sessions_keep_state_until_closed(gateway: Gateway) -> None:
    opened = requests.post(gateway.url + "/v1/sessions", json={"pool": POOL, "ttlSeconds": 60}, timeout=30)
    assert opened.status_code == 201, opened.text
    sid = opened.json()["id"]
    step = "open('n.txt', 'a').write('x'); print(open('n.txt').read())"
    outs = [
        requests.post(
            f"{gateway.url}/v1/sessions/{sid}/actions",
            json={"type": "code", "payload": {"code": step}},
            timeout=60,
        ).json()
        for _ in range(3)
    ]
    assert [o["stdout"] for o in outs] == ["x\n", "xx\n", "xxx\n"]
    info = requests.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).json()
    assert info["pool"] == POOL and 0 < info["expiresInSeconds"] <= 60
    assert requests.delete(f"{gateway.url}/v1/sessions/{sid}", timeout=30).status_code == 200
    gone = requests.post(
        f"{gateway.url}/v1/sessions/{sid}/actions",
        json={"type": "code", "payload": {"code": "1"}},
        timeout=30,
    )
    assert gone.status_code == 404 and sid in gone.json()["error"]


def test_a_session_id_on_an_action_must_name_an_open_session(gateway: Gateway) -> None:
    """``sessionId`` on ``/v1/actions`` (and a stream's lines) runs in a session opened here. An id
    nobody opened started a session the gateway could neither bound, expire nor close (a typo of a
    real id ran in an empty workdir, and its state stayed on the host): 404 now."""
    action = {"type": "code", "target": POOL, "payload": {"code": "print(open('s.txt').read())"}}
    made_up = requests.post(
        gateway.url + "/v1/actions", json={**action, "sessionId": "s-made-up"}, timeout=60
    )
    assert made_up.status_code == 404 and "s-made-up" in made_up.json()["error"], made_up.text
    sid = requests.post(gateway.url + "/v1/sessions", json={"pool": POOL}, timeout=30).json()["id"]
    write = {"type": "code", "payload": {"code": "open('s.txt', 'w').write('kept')"}}
    assert (
        requests.post(f"{gateway.url}/v1/sessions/{sid}/actions", json=write, timeout=60).status_code == 200
    )
    read = requests.post(gateway.url + "/v1/actions", json={**action, "sessionId": sid}, timeout=60)
    assert read.status_code == 200 and read.json()["stdout"] == "kept\n", read.text
    elsewhere = requests.post(
        gateway.url + "/v1/actions", json={**action, "sessionId": sid, "target": "other"}, timeout=60
    )
    assert elsewhere.status_code == 400 and elsewhere.json()["field"] == "target", elsewhere.text
    assert requests.delete(f"{gateway.url}/v1/sessions/{sid}", timeout=30).status_code == 200


def _session_call_with_a_slow_body(gateway: Gateway, meanwhile: Callable[[], object]) -> tuple[bytes, bytes]:
    """A call in a session of 0.5 s whose body comes 1.5 s after its headers (``meanwhile`` runs
    in between): the answer's head and body."""
    from urllib.parse import urlsplit

    sid = requests.post(
        gateway.url + "/v1/sessions", json={"pool": POOL, "ttlSeconds": 0.5}, timeout=30
    ).json()["id"]
    body = json.dumps({"type": "code", "payload": {"code": "print('arrived')"}}).encode()
    where = urlsplit(gateway.url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as conn:
        conn.sendall(
            f"POST /v1/sessions/{sid}/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        time.sleep(1.5)  # three TTLs
        meanwhile()
        conn.sendall(body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return head, rest


def test_a_session_call_whose_body_is_slow_keeps_its_session(gateway: Gateway) -> None:
    """A session is held from the moment a call names it, not once its body has arrived: a short
    TTL ran out while the body was on its way, and the call found its session gone."""
    head, rest = _session_call_with_a_slow_body(gateway, lambda: None)
    assert head.startswith(b"HTTP/1.1 200"), (head, rest)
    assert json.loads(rest)["stdout"] == "arrived\n", rest


def test_the_dispatchers_clock_does_not_close_a_session_the_gateway_holds(gateway: Gateway) -> None:
    """The operator also expires the dispatcher's idle sessions (every 2 s): at the same TTL it
    closed a gateway session whose call was still sending its body, which only the gateway sees.
    Its clock is a backstop behind the gateway's for sessions the gateway opened."""
    # As the operator's janitor does, while the body is on its way.
    head, rest = _session_call_with_a_slow_body(
        gateway, lambda: gateway.call(gateway.service.dispatcher.expire_sessions())
    )
    assert head.startswith(b"HTTP/1.1 200") and json.loads(rest)["stdout"] == "arrived\n", (head, rest)


def test_the_gateways_janitor_spares_a_session_taken_while_it_closed_others() -> None:
    """The janitor picked its due sessions once, then closed them one by one (an HTTP call each):
    a session a call took meanwhile was closed under it. Each is checked again before its close.
    (The service is a stand-in: what is tested is the registry's own order of events.)"""
    import asyncio

    from arl_tangram.gateway.sessions import SessionRegistry

    class Service:
        def __init__(self) -> None:
            self.closed: list[str] = []
            self.opened = 0

        async def open_session(self, namespace: str, pool: str, ttl_s: float) -> str:
            self.opened += 1
            return f"s{self.opened}"

        async def close_session(self, namespace: str, pool: str, sid: str) -> None:
            await asyncio.sleep(0.1)  # the DELETE to the session's agent
            self.closed.append(sid)

    now = [0.0]
    service = Service()

    async def main() -> None:
        registry = SessionRegistry(service, 10, 1.0, clock=lambda: now[0])  # type: ignore[arg-type]
        await registry.open("ns", "p", 1.0)
        later = await registry.open("ns", "p", 1.0)
        now[0] = 5.0
        janitor = asyncio.create_task(registry.expire())
        await asyncio.sleep(0.05)  # the first close is under way
        registry.get(later.id).busy += 1  # a call takes the second
        await janitor
        assert later.id in registry.sessions and service.closed == ["s1"], service.closed

    asyncio.run(main())


def test_an_idle_session_expires_by_its_ttl(gateway: Gateway) -> None:
    from sandbox_agent_harness import wait_until

    sid = requests.post(
        gateway.url + "/v1/sessions", json={"pool": POOL, "ttlSeconds": 0.3}, timeout=30
    ).json()["id"]
    wait_until(
        lambda: requests.get(f"{gateway.url}/v1/sessions/{sid}", timeout=10).status_code == 404, 10, "expiry"
    )


def test_batch_results_stream_as_ndjson(gateway: Gateway) -> None:
    resp = requests.get(f"{gateway.url}/v1/batches/{NS}/step-1/results", timeout=30)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in resp.iter_lines() if line]
    assert rows == BATCH
    missing = requests.get(f"{gateway.url}/v1/batches/{NS}/nope/results", timeout=30)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    with TangramClient(gateway.url, namespace=NS) as client:
        assert list(client.batch_results("step-1")) == BATCH
        assert list(client.batch_results("step-big")) == BIG  # it raised LineTooLong
        with pytest.raises(NotFoundError):
            list(client.batch_results("nope"))


def test_health_readiness_metrics_and_openapi(gateway: Gateway) -> None:
    assert requests.get(gateway.url + "/healthz", timeout=10).json() == {"status": "ok"}
    assert requests.get(gateway.url + "/readyz", timeout=10).json() == {"status": "leader"}
    action = {"type": "code", "target": POOL, "payload": {"code": "1"}}
    assert requests.post(gateway.url + "/v1/actions", json=action, timeout=60).status_code == 200
    metrics = requests.get(gateway.url + "/metrics", timeout=10).text
    assert 'tangram_gateway_requests_total{route="/v1/actions",status="200"}' in metrics
    spec = requests.get(gateway.url + "/openapi.json", timeout=10).json()
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/actions",
        "/v1/actions:stream",
        "/run_code",
        "/get_reward",
        "/slime/reward",
        "/v1/sessions",
    ):
        assert path in spec["paths"], path
    action = spec["components"]["schemas"]["GatewayAction"]
    assert {"type", "target", "payload", "timeoutSeconds", "sessionId"} <= set(action["properties"])


def test_a_client_that_leaves_a_stream_does_not_cancel_its_actions(
    gateway: Gateway, agents: list[Agent]
) -> None:
    """The client sends four keyed actions and hangs up once the gateway has taken them; they run to
    their end, and a retry of each key gets its result without running it again. (Lines the gateway
    had not read when the client left are lost with the connection: the client re-sends them.)"""
    from sandbox_agent_harness import wait_until

    def ran() -> int:
        return sum(requests.get(agents[0].url + "/v1/health", timeout=10).json()["outcomes"].values())

    before = ran()
    actions = [
        {
            "key": f"left-{i}",
            "type": "code",
            "target": POOL,
            "payload": {"code": f"import time; time.sleep(0.5); print({i})"},
        }
        for i in range(4)
    ]
    body = "\n".join(json.dumps(a) for a in actions).encode() + b"\n"
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        head = f"POST /v1/actions:stream HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        wait_until(lambda: gateway.service.running == 4, 30, "the gateway to take all four")
    wait_until(lambda: ran() == before + 4, 30, "the four actions to run")
    for i, action in enumerate(actions):
        again = requests.post(gateway.url + "/v1/actions", json=action, timeout=60).json()
        assert again["stdout"] == f"{i}\n"
    assert ran() == before + 4, "a retry ran an action again"


def test_a_client_that_leaves_a_stream_cancels_its_keyless_actions(gateway: Gateway) -> None:
    """Lines sent without a key cannot be fetched by anyone once their client has gone: they are
    cancelled (``gateway/abandoned.py``), not left to hold their cores for 20 s each."""
    from sandbox_agent_harness import wait_until

    line = {"type": "code", "target": POOL, "payload": {"code": "import time; time.sleep(20)"}}
    body = (json.dumps(line) + "\n") * 2
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        head = f"POST /v1/actions:stream HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body.encode())
        wait_until(lambda: gateway.service.running == 2, 30, "the gateway to take both")
    wait_until(lambda: gateway.service.running == 0, 10, "both cancelled, well before their 20 s")


def test_openapi_schemas_are_valid_and_describe_what_the_gateway_accepts(gateway: Gateway) -> None:
    from jsonschema import Draft202012Validator

    spec = requests.get(gateway.url + "/openapi.json", timeout=10).json()
    for schema in spec["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)  # raises on an invalid schema

    def validator(name: str) -> Draft202012Validator:
        return Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
        )

    action = {"type": "code", "target": POOL, "payload": {"code": "print(1)"}, "timeoutSeconds": 5}
    assert validator("GatewayAction").is_valid(action)
    assert not validator("GatewayAction").is_valid({**action, "colour": "red"})
    assert not validator("GatewayAction").is_valid({**action, "timeoutSeconds": 0})
    assert validator("OpenRLHFRewardRequest").is_valid({"query": ["q"], "labels": ["l"]})
    ran = requests.post(gateway.url + "/v1/actions", json=action, timeout=60).json()
    assert validator("ActionResultBody").is_valid(ran)


def _running_on(agents: list[Agent]) -> list[dict[str, object]]:
    """The keyed calls the agents run now (``GET /v1/actions``)."""
    return [r for a in agents for r in requests.get(a.url + "/v1/actions", timeout=10).json()["running"]]


def test_actions_are_cancelled_by_their_keys(gateway: Gateway, agents: list[Agent]) -> None:
    """``POST /v1/actions:cancel`` (what the client sends for a ``run_many`` it abandons): a running
    action stops and its caller hears Cancelled; a key not arrived yet (a stream's line the gateway
    reads after its caller left) is not run when it arrives, and only that once."""
    running: dict[str, object] = {}

    def run_long() -> None:
        action = {
            "type": "code",
            "target": POOL,
            "key": "cancel-me",
            "payload": {"code": "import time; time.sleep(600)"},
        }
        running.update(requests.post(f"{gateway.url}/v1/actions", json=action, timeout=120).json())

    caller = threading.Thread(target=run_long)
    caller.start()

    def cancel(*keys: str) -> dict[str, list[str]]:
        resp = requests.post(f"{gateway.url}/v1/actions:cancel", json={"keys": list(keys)}, timeout=60)
        assert resp.status_code == 200, resp.text
        answer: dict[str, list[str]] = resp.json()
        return answer

    # Not a cancel each poll: one before the action arrived would keep it from running at all.
    deadline = time.monotonic() + 60
    while not _running_on(agents) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll until the action runs, not synchronisation
    assert cancel("cancel-me") == {"cancelled": ["cancel-me"], "notRunning": []}
    caller.join(120)
    assert running["state"] == "Cancelled", running
    assert cancel("not-yet") == {"cancelled": [], "notRunning": ["not-yet"]}
    later = {"type": "code", "target": POOL, "key": "not-yet", "payload": {"code": "print('ran')"}}
    first = requests.post(f"{gateway.url}/v1/actions", json=later, timeout=60).json()
    assert first["state"] == "Cancelled", first
    again = requests.post(f"{gateway.url}/v1/actions", json=later, timeout=60).json()
    assert again["state"] == "Succeeded" and again["stdout"] == "ran\n", "a retry after it runs"
    refused = requests.post(f"{gateway.url}/v1/actions:cancel", json={"keys": []}, timeout=60)
    assert refused.status_code == 422 and refused.json()["field"] == "keys", refused.text


def test_closing_a_session_stops_its_running_call_and_the_agent_closes_it(
    gateway: Gateway, agents: list[Agent]
) -> None:
    """A close while the session's call ran waited on the agent for the call to end (up to its
    timeout), and the dispatcher gave up on the agent after its 5 s control timeout: the close
    answered late, the call ran on in the closed session's workdir, and the agent's session was
    left to its TTL. Now the call is stopped (its caller hears Cancelled) and the agent closes."""
    sid = requests.post(gateway.url + "/v1/sessions", json={"pool": POOL}, timeout=30).json()["id"]
    running: dict[str, object] = {}

    def call() -> None:
        body = {"type": "code", "payload": {"code": "import time; time.sleep(600)"}}
        resp = requests.post(f"{gateway.url}/v1/sessions/{sid}/actions", json=body, timeout=120)
        running.update(resp.json())

    caller = threading.Thread(target=call)
    caller.start()

    def started() -> bool:  # the call is on its agent, running in the session
        return any(r["session_id"] for r in _running_on(agents))

    deadline = time.monotonic() + 60
    while not started() and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll until the call runs, not synchronisation
    closed = requests.delete(f"{gateway.url}/v1/sessions/{sid}", timeout=60)
    assert closed.status_code == 200, closed.text
    caller.join(120)
    assert running.get("state") == "Cancelled", running
    assert not started(), "the call ran on after its session closed"
