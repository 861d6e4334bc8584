"""Bad input of every kind gets a 4xx naming the problem, and the gateway goes on serving."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests
from gateway_harness import NS, POOL, Gateway, read_until_closed, serve_gateway
from sandbox_agent_harness import Agent

from arl_tangram.gateway import GatewayConfig

LIMIT = 1 << 20
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent]) -> Iterator[Gateway]:
    config = GatewayConfig(
        default_namespace=NS, default_pools={NS: POOL}, max_body_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT_S
    )
    with serve_gateway(hosts, config=config) as gw:
        yield gw


ACTION = {"type": "code", "target": POOL, "payload": {"code": "print(1)"}}
CASES: list[tuple[str, str, bytes, int, str]] = [
    # SandboxFusion's limits: finite and positive, named as the client named them.
    (
        "/run_code",
        "negative compile timeout",
        b'{"code": "1", "language": "python", "compile_timeout": -100}',
        422,
        "compile_timeout",
    ),
    (
        "/run_code",
        "NaN run timeout",
        b'{"code": "1", "language": "python", "run_timeout": NaN}',
        422,
        "run_timeout",
    ),
    (
        "/run_code",
        "memory under 16 MB",
        b'{"code": "1", "language": "python", "memory_limit_MB": 5}',
        422,
        "memory_limit_MB",
    ),
    # Not served: refused by its type (its payload reached the code runner as it was, so a
    # nodejs program ran on a pool that offers no nodejs).
    (
        "/v1/actions",
        "http type",
        b'{"type": "http", "target": "'
        + POOL.encode()
        + b'", "payload": {"runtime": "nodejs", "code": "1"}}',
        400,
        "http actions are not served",
    ),
    ("/v1/actions", "malformed", b'{"type": ', 400, "malformed JSON"),
    ("/v1/actions", "empty", b"", 400, "empty body"),
    ("/v1/actions", "array", b"[1, 2]", 422, "JSON object"),
    (
        "/v1/actions",
        "wrong type",
        json.dumps({**ACTION, "timeoutSeconds": "soon"}).encode(),
        422,
        "timeoutSeconds",
    ),
    ("/v1/actions", "unknown field", json.dumps({**ACTION, "colour": "red"}).encode(), 422, "colour"),
    # The native API is typed as the API server types the same fields of an ActionBatch.
    (
        "/v1/actions",
        "boolean for a number",
        json.dumps({**ACTION, "timeoutSeconds": True}).encode(),
        422,
        "timeoutSeconds",
    ),
    (
        "/v1/actions",
        "string for a number",
        json.dumps({**ACTION, "units": {"min": "2", "max": 4}}).encode(),
        422,
        "units.min",
    ),
    ("/v1/actions", "string priority", json.dumps({**ACTION, "priority": "9"}).encode(), 422, "priority"),
    (
        "/v1/sessions",
        "boolean ttl",
        json.dumps({"pool": POOL, "ttlSeconds": True}).encode(),
        422,
        "ttlSeconds",
    ),
    (
        "/v1/rewards",
        "string reward timeout",
        json.dumps({"pool": POOL, "items": [{"response": "x"}], "timeoutSeconds": "30"}).encode(),
        422,
        "timeoutSeconds",
    ),
    # A query parameter the route does not take, or one given twice, is named (a typo of ?pool=
    # went to the default pool without a word).
    (
        "/run_code?pol=other",
        "unknown query parameter",
        b'{"code": "print(1)", "language": "python"}',
        400,
        "?pol",
    ),
    (
        "/run_code?pool=py&pool=other",
        "query parameter twice",
        b'{"code": "print(1)", "language": "python"}',
        400,
        "more than once",
    ),
    ("/v1/actions?pool=py", "query on a route that takes none", json.dumps(ACTION).encode(), 400, "?pool"),
    ("/get_reward?pool=py&colour=red", "unknown reward query", b'{"query": ["a"]}', 400, "colour"),
    ("/v1/actions", "unknown action type", json.dumps({**ACTION, "type": "magic"}).encode(), 422, "type"),
    ("/v1/actions", "negative number", json.dumps({**ACTION, "priority": -5000}).encode(), 422, "priority"),
    (
        "/v1/actions",
        "huge number",
        b'{"type": "code", "target": "py", "payload": {}, "timeoutSeconds": 1' + b"0" * 5000 + b"}",
        400,
        "malformed JSON",
    ),
    ("/v1/actions", "bad units", json.dumps({**ACTION, "units": {"min": 4, "max": 2}}).encode(), 422, "min"),
    (
        "/v1/actions",
        "more units than a host",
        json.dumps({**ACTION, "units": {"min": 64, "max": 64}}).encode(),
        422,
        "units",
    ),
    (
        "/v1/actions",
        "lone surrogate",
        b'{"type": "code", "target": "py", "payload": {"code": "\\ud800"}}',
        400,
        "payload",
    ),
    ("/v1/actions", "target not a name", json.dumps({**ACTION, "target": "../etc"}).encode(), 422, "target"),
    (
        "/v1/actions",
        "bad payload field",
        json.dumps({**ACTION, "payload": {"kode": "1"}}).encode(),
        400,
        "payload",
    ),
    ("/v1/actions", "deep nesting", b"[" * 100000 + b"]" * 100000, 400, "malformed JSON"),
    (
        "/v1/sessions",
        "negative ttl",
        json.dumps({"pool": POOL, "ttlSeconds": -1}).encode(),
        422,
        "ttlSeconds",
    ),
    ("/v1/sessions", "infinite ttl", b'{"pool": "py", "ttlSeconds": 1e999}', 422, "ttlSeconds"),
    # Past the gateway's own bound: out of range as any other value (it was a 400).
    ("/v1/sessions", "ttl past the bound", b'{"pool": "py", "ttlSeconds": 100000}', 422, "ttlSeconds"),
    ("/run_code", "run_code wrong type", json.dumps({"code": 1, "language": "python"}).encode(), 422, "code"),
    (
        "/run_code",
        "run_code bad base64",
        json.dumps({"code": "1", "language": "python", "files": {"a": "!!"}}).encode(),
        400,
        "base64",
    ),
    ("/get_reward", "openrlhf no query", b'{"prompts": ["a"]}', 422, "query"),
    ("/slime/reward", "slime unknown field", b'{"response": "x", "extra": 1}', 422, "extra"),
    ("/score", "score empty list", b'{"model": "rm", "text_1": "a", "text_2": []}', 400, "text_2"),
]


@pytest.mark.parametrize(("path", "what", "body", "status", "named"), CASES, ids=[c[1] for c in CASES])
def test_bad_input_is_refused_by_name(
    gateway: Gateway, path: str, what: str, body: bytes, status: int, named: str
) -> None:
    resp = requests.post(
        gateway.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert resp.status_code == status, resp.text
    assert named in json.dumps(resp.json()), resp.text
    assert requests.post(gateway.url + "/v1/actions", json=ACTION, timeout=60).json()["stdout"] == "1\n"


def test_a_huge_body_is_413_with_the_limit(gateway: Gateway) -> None:
    big = json.dumps({**ACTION, "payload": {"code": "x" * (2 * LIMIT)}}).encode()
    resp = requests.post(gateway.url + "/v1/actions", data=big, timeout=60)
    assert resp.status_code == 413 and str(LIMIT) in resp.json()["error"]
    run_code = requests.post(gateway.url + "/run_code", data=big, timeout=60)
    assert run_code.status_code == 413 and run_code.json()["status"] == "SandboxError"


def test_a_huge_stream_line_is_refused_alone(gateway: Gateway) -> None:
    lines = [json.dumps({**ACTION, "id": "before"}), "x" * (2 * LIMIT), json.dumps({**ACTION, "id": "after"})]
    resp = requests.post(gateway.url + "/v1/actions:stream", data="\n".join(lines).encode(), timeout=60)
    out = [json.loads(line) for line in resp.text.splitlines()]
    assert sorted(o.get("id") or f"line{o['line']}" for o in out) == ["after", "before", "line2"]
    refused = next(o for o in out if o.get("line") == 2)
    assert refused["status"] == 413 and str(LIMIT) in refused["error"]


@pytest.mark.parametrize("path", ["/v1/actions", "/run_code", "/v1/rewards", "/get_reward?pool=" + POOL])
def test_a_body_that_cannot_be_decoded_is_refused_by_name(
    gateway: Gateway, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt compressed body (``Content-Encoding: gzip`` over bytes that are not gzip) is the
    client's error, said as such: it was a 500 with a stack trace in the log, then a 400 with
    aiohttp's "Unhandled exception" logged as it drained the rest. Its connection is closed after
    the answer (its stream broke), and the client's next request runs on a new one."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with caplog.at_level(logging.WARNING), requests.Session() as session:
        resp = session.post(gateway.url + path, data=b"xxxxx", headers=headers, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "Content-Encoding" in resp.json()["error"], resp.text
        assert resp.headers.get("Connection", "").lower() == "close", resp.headers
        after = session.post(gateway.url + "/v1/actions", json=ACTION, timeout=60)
        assert after.status_code == 200, after.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    stream = requests.post(gateway.url + "/v1/actions:stream", data=b"xxxxx", headers=headers, timeout=60)
    (line,) = [json.loads(text) for text in stream.text.splitlines()]
    assert line["status"] == 400 and line["line"] == 0 and "Content-Encoding" in line["error"], line


def test_a_client_that_leaves_mid_body_is_no_server_error(gateway: Gateway) -> None:
    """A client that closes its connection before its body arrived is nobody's 500: the gateway
    counts it as 499 (client closed request) and logs no error."""

    def count(metrics: str, status: str) -> float:
        prefix = f'tangram_gateway_requests_total{{route="/v1/actions",status="{status}"}} '
        return sum(float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix))

    before = requests.get(gateway.url + "/metrics", timeout=10).text
    where = urlsplit(gateway.url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"type": "code", "target": "py"'
        )
    for _ in range(50):
        after = requests.get(gateway.url + "/metrics", timeout=10).text
        if count(after, "499") > count(before, "499"):
            break
        time.sleep(0.1)
    assert count(after, "499") == count(before, "499") + 1, after
    assert count(after, "500") == count(before, "500")


def test_unknown_routes_and_methods_answer_json(gateway: Gateway) -> None:
    resp = requests.get(gateway.url + "/nope", timeout=10)
    assert resp.status_code == 404 and "error" in resp.json()
    resp = requests.get(gateway.url + "/v1/actions", timeout=10)
    assert resp.status_code == 405 and "POST" in resp.headers["Allow"], resp.headers  # as HTTP asks
    assert "GET is not allowed on /v1/actions" in resp.json()["error"], resp.text
    resp = requests.post(
        gateway.url + "/v1/actions", json=ACTION, headers={"Authorization": "Digest x"}, timeout=10
    )
    assert resp.status_code == 401 and "Bearer" in resp.json()["error"]


def test_the_pool_named_twice_differently_is_refused(gateway: Gateway) -> None:
    """``X-Tangram-Pool`` and ``?pool=`` naming different pools: which did the caller mean? (The
    header won without a word.) The same name twice is fine."""
    body = {"code": "print(1)", "language": "python"}
    resp = requests.post(
        gateway.url + "/run_code?pool=other", json=body, headers={"X-Tangram-Pool": POOL}, timeout=60
    )
    assert resp.status_code == 400 and "?pool" in resp.json()["error"], resp.text
    same = requests.post(
        gateway.url + f"/run_code?pool={POOL}", json=body, headers={"X-Tangram-Pool": POOL}, timeout=60
    )
    assert same.status_code == 200 and same.json()["run_result"]["stdout"] == "1\n", same.text


def test_trainer_shapes_keep_their_owners_lax_numbers(gateway: Gateway) -> None:
    """SandboxFusion's server (pydantic's default parsing) runs ``"run_timeout": "10"``; so does
    ``/run_code`` here, while the native API refuses it (the cases above)."""
    body = {"code": "print(1)", "language": "python", "run_timeout": "10"}
    resp = requests.post(gateway.url + "/run_code", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["status"] == "Success", resp.text


UNION_FIELDS: list[tuple[str, dict[str, object], list[list[object]]]] = [
    ("/classify", {"model": "rm", "input": 5}, [["input"], ["input"]]),
    ("/v1/embeddings", {"model": "rm", "input": {"text": "a"}}, [["input"], ["input"]]),
    ("/score", {"model": "rm", "text_1": ["a", 5], "text_2": "b"}, [["text_1"], ["text_1", 1]]),
    ("/pooling", {"model": "rm", "input": None}, [["input"], ["input"]]),
    ("/slime/reward", {"prompt": 5, "response": "x"}, [["prompt"], ["prompt"]]),
]


@pytest.mark.parametrize(("path", "body", "locs"), UNION_FIELDS, ids=[c[0] for c in UNION_FIELDS])
def test_a_field_of_either_type_is_named_as_sent(
    gateway: Gateway, path: str, body: dict[str, object], locs: list[list[object]]
) -> None:
    """A field that takes a string or a list (vLLM's ``input``, ``text_1``) was named with the
    member of the type pydantic tried (``"field": "input.function-after[_encodable(), str]"``): a
    field no client sent. It is named as sent, in ``field``, ``detail`` and the message."""
    resp = requests.post(gateway.url + path, json=body, timeout=60)
    assert resp.status_code == 422, resp.text
    answer = resp.json()
    assert answer["field"] == ".".join(map(str, locs[0])), answer
    assert [d["loc"] for d in answer["detail"]] == locs, answer
    assert "[" not in answer["error"], answer


def _raw(gateway: Gateway) -> socket.socket:
    return gateway.raw_connection(BODY_TIMEOUT_S * 10)


def test_a_body_that_trickles_in_is_cut_off_with_408(gateway: Gateway) -> None:
    """A client that sends its body a byte now and then (slowloris) held a connection and a handler
    for as long as it liked: the body must arrive within ``body_timeout_s``, else 408 naming it,
    answered while the client is still sending."""
    with _raw(gateway) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n" + b'{"type": "code"'
        )
        conn.setblocking(False)
        answer = b""
        for _ in range(int(BODY_TIMEOUT_S * 10) * 10):  # a byte every 0.1 s, 10 timeouts' worth at most
            time.sleep(0.1)
            try:
                answer += conn.recv(65536)
            except BlockingIOError:
                conn.sendall(b" ")
                continue
            if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                break
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert f"{BODY_TIMEOUT_S:g} seconds" in json.loads(body)["error"], answer
    assert b"Connection: close" in head, head
    assert requests.post(gateway.url + "/v1/actions", json=ACTION, timeout=60).json()["stdout"] == "1\n"


def test_expect_continue_over_the_limit_is_refused_before_the_body(gateway: Gateway) -> None:
    """``Expect: 100-continue`` asks whether to send the body at all: one announced over the limit
    gets 413 at once (it got 100, was sent whole, then refused); one within it gets 100 and runs."""
    with _raw(gateway) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(LIMIT * 4).encode() + b"\r\n\r\n"
        )
        answer = read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer
    assert str(LIMIT) in json.loads(body)["error"], answer
    small = json.dumps(ACTION).encode()
    with _raw(gateway) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(len(small)).encode() + b"\r\n\r\n"
        )
        assert conn.recv(64).startswith(b"HTTP/1.1 100 Continue"), "no 100 for a body within the limit"
        conn.sendall(small)
        answer = read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer
    assert json.loads(body)["stdout"] == "1\n", answer


def test_expect_continue_on_a_stream_bounds_its_lines_not_its_whole(gateway: Gateway) -> None:
    """An NDJSON stream is bounded per line: a stream longer than ``max_body_bytes`` whose lines
    are each within it runs whole with ``Expect: 100-continue`` too (curl sends it for any large
    upload), as it does without it."""
    pad = "#" + "x" * (LIMIT // 4)
    lines = [
        json.dumps({**ACTION, "id": f"a{i}", "payload": {"code": f"{pad}\nprint({i})"}}) for i in range(6)
    ]
    body = ("\n".join(lines) + "\n").encode()
    assert len(body) > LIMIT
    with _raw(gateway) as conn:
        conn.sendall(
            b"POST /v1/actions:stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        first = conn.recv(64)  # the stream's own answer begins at once, maybe in the same read
        assert first.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), "no 100 for a stream of small lines"
        conn.sendall(body)
        answer = first[len(b"HTTP/1.1 100 Continue\r\n\r\n") :] + read_until_closed(conn)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    assert sorted(set(re.findall(rb'\{"id": "(a\d)"', rest))) == [b"a%d" % i for i in range(6)], rest[:500]


def test_an_unknown_expectation_is_refused_as_json(gateway: Gateway) -> None:
    with _raw(gateway) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nExpect: something-else\r\nContent-Length: 2\r\n\r\n"
        )
        answer = read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 417"), answer
    assert "something-else" in json.loads(body)["error"], answer


def test_a_wrong_path_or_method_with_a_query_is_404_or_405(gateway: Gateway) -> None:
    """The query check is the route's: an unknown path is still 404 (``/reward?service=rm`` was
    answered that ``service`` is unknown, pointing a trainer at the wrong mistake)."""
    resp = requests.post(gateway.url + "/reward?service=rm", json={}, timeout=10)
    assert resp.status_code == 404, resp.text
    resp = requests.get(gateway.url + "/v1/actions?x=1", timeout=10)
    assert resp.status_code == 405, resp.text


def test_whole_floats_are_integers(gateway: Gateway) -> None:
    """JSON does not tell ``30`` from ``30.0`` (JSON Schema calls both integers): a trainer whose
    timeout is computed in floats is not refused; ``30.5`` is."""
    body = {**ACTION, "timeoutSeconds": 30.0, "units": {"min": 1.0, "max": 1}}
    resp = requests.post(gateway.url + "/v1/actions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["stdout"] == "1\n", resp.text
    resp = requests.post(gateway.url + "/v1/actions", json={**body, "timeoutSeconds": 30.5}, timeout=60)
    assert resp.status_code == 422 and resp.json()["field"] == "timeoutSeconds", resp.text


def test_a_reward_target_named_twice_differently_is_refused(gateway: Gateway) -> None:
    """``/v1/rewards?service=rm`` with a body naming a pool ran on the pool without a word."""
    body = {"pool": POOL, "items": [{"response": "x", "label": "assert True"}]}
    resp = requests.post(gateway.url + "/v1/rewards?service=rm", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "service", resp.text


def test_a_gateway_session_ttl_past_what_agents_keep_is_refused_at_start() -> None:
    """The dispatcher keeps a gateway session, as a backstop, 2 x its TTL + 60 s, and agents keep
    one 7 days at most: a gateway allowing sessions past half that would see them closed under it."""
    from arl_tangram.errors import InvalidSpec

    with pytest.raises(InvalidSpec, match="max_session_ttl_s"):
        GatewayConfig(max_session_ttl_s=5 * 86400)
    assert GatewayConfig(max_session_ttl_s=3 * 86400).max_session_ttl_s == 3 * 86400


def test_a_stream_line_over_the_limit_is_refused_however_it_arrives(hosts: list[Agent]) -> None:
    """A line that arrived in one piece with its newline was never measured: it ran, however long.
    Now it is refused (413, naming its line) as one that arrived in pieces is; the others run."""
    limit = 4096
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, max_body_bytes=limit)
    lines = [
        {**ACTION, "id": "before"},
        {**ACTION, "id": "huge", "payload": {"code": "#" * (2 * limit) + "\nprint(1)"}},
        {**ACTION, "id": "after"},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    with serve_gateway(hosts, config=config) as gw:
        resp = requests.post(gw.url + "/v1/actions:stream", data=body, timeout=60)
    answers = {a.get("id") or f"line {a.get('line')}": a for a in map(json.loads, resp.text.splitlines())}
    assert sorted(answers) == ["after", "before", "line 2"], answers
    assert answers["line 2"]["status"] == 413 and "exceeds the limit" in answers["line 2"]["error"]
    assert answers["before"]["state"] == answers["after"]["state"] == "Succeeded", answers
