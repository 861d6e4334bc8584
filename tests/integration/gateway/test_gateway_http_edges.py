"""HTTP as a trainer's own client may speak it: content codings, header limits, framing, and JSON's
corners. Each gets the right answer or a JSON error naming the problem, never a 500 or a traceback."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator

import pytest
import requests
from gateway_harness import NS, POOL, Gateway, read_until_closed, serve_gateway
from sandbox_agent_harness import Agent

from arl_tangram.gateway import GatewayConfig
from arl_tangram.gateway.parsing import BODY_CODINGS

ACTION = {"type": "code", "target": POOL, "payload": {"code": "print(1)"}}
RAW = json.dumps(ACTION).encode()
RUN_CODE = json.dumps({"code": "print(1)", "language": "python"}).encode()
LIMIT = 1 << 16


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent]) -> Iterator[Gateway]:
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, max_body_bytes=LIMIT)
    with serve_gateway(hosts, config=config) as gw:
        yield gw


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# --- Content-Encoding ----------------------------------------------------------------------------------

UNSUPPORTED = ["br", "zstd", "foo", "gzip, br", "gzip, gzip", "compress"]


@pytest.mark.parametrize("coding", UNSUPPORTED)
def test_an_unsupported_content_coding_is_415_naming_it(
    gateway: Gateway, coding: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``br`` and ``zstd`` got aiohttp's plain-text 400 ("Please install `Brotli`") and a logged
    traceback; ``foo`` and a chain (``gzip, br``) were passed through undecoded, so a body that was
    not plain ran as if it were (a plain body labelled ``gzip, br`` ran: 200). Each is now 415 in
    JSON naming the coding sent and those accepted, on every shape of route, with no traceback."""
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    accepted = ", ".join(BODY_CODINGS)
    with caplog.at_level(logging.INFO):
        for path, body in (("/v1/actions", RAW), ("/run_code", RUN_CODE), ("/v1/actions:stream", RAW)):
            resp = requests.post(gateway.url + path, data=body, headers=headers, timeout=60)
            assert resp.status_code == 415, (path, resp.status_code, resp.text)
            answer = resp.json()
            assert repr(coding) in answer["error"] and accepted in answer["error"], answer
            assert answer["field"] == "Content-Encoding", answer
            assert resp.headers["Accept-Encoding"] == accepted, resp.headers
        sf = requests.post(gateway.url + "/run_code", data=RUN_CODE, headers=headers, timeout=60).json()
        assert sf["status"] == "SandboxError" and repr(coding) in sf["message"], sf
    assert not _errors(caplog), caplog.text
    assert requests.post(gateway.url + "/v1/actions", json=ACTION, timeout=60).json()["stdout"] == "1\n"


def test_an_unsupported_coding_is_refused_before_its_body_is_sent(gateway: Gateway) -> None:
    """With ``Expect: 100-continue`` the 415 comes instead of the 100: the body need not be sent."""
    with gateway.raw_connection(30) as conn:
        conn.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: br\r\nExpect: 100-continue\r\nConnection: close\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        answer = read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 415"), answer
    assert "'br'" in json.loads(body)["error"], answer


def _multi_member_gzip(raw: bytes) -> bytes:
    # gzip(1) concatenates members (``cat a.gz b.gz``); the body is their contents joined.
    return gzip.compress(raw[:10]) + gzip.compress(raw[10:])


ACCEPTED: list[tuple[str, str, bytes]] = [
    ("identity", "identity", RAW),
    ("gzip", "gzip", gzip.compress(RAW)),
    ("GZIP (case)", "GZIP", gzip.compress(RAW)),
    ("x-gzip (RFC 9110's alias)", "x-gzip", gzip.compress(RAW)),
    ("gzip of two members", "gzip", _multi_member_gzip(RAW)),
    # Zero padding between members (Python's gzip skips it): read whether or not a chunk ends there.
    (
        "gzip of two members, zeros between",
        "gzip",
        gzip.compress(RAW[:10]) + bytes(9) + gzip.compress(RAW[10:]),
    ),
    ("gzip, zeros after", "gzip", gzip.compress(RAW) + bytes(9)),
    ("deflate (zlib)", "deflate", zlib.compress(RAW)),
    ("identity then gzip", "identity, gzip", gzip.compress(RAW)),
]


@pytest.mark.parametrize(("what", "coding", "body"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_codings_run_as_sent_plain(gateway: Gateway, what: str, coding: str, body: bytes) -> None:
    """``x-gzip`` and ``identity, gzip`` were read undecoded (400, malformed JSON); a gzip of
    several members, as aiohttp read it, is still read whole."""
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    resp = requests.post(gateway.url + "/v1/actions", data=body, headers=headers, timeout=60)
    assert resp.status_code == 200 and resp.json()["stdout"] == "1\n", resp.text
    # Chunked, in small pieces, and on the stream (decoded as it comes).
    pieces = iter([body[i : i + 7] for i in range(0, len(body), 7)])
    resp = requests.post(gateway.url + "/v1/actions", data=pieces, headers=headers, timeout=60)
    assert resp.status_code == 200 and resp.json()["stdout"] == "1\n", resp.text
    stream = requests.post(gateway.url + "/v1/actions:stream", data=body, headers=headers, timeout=60)
    (line,) = [json.loads(text) for text in stream.text.splitlines()]
    assert line["state"] == "Succeeded" and line["stdout"] == "1\n", line


def test_a_truncated_or_trailing_compressed_body_is_400_naming_the_coding(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with caplog.at_level(logging.INFO):
        for body, why in (
            (gzip.compress(RAW)[:-12], "ends before"),
            (zlib.compress(RAW) + b"junk", "after the end"),
        ):
            coding = "gzip" if why == "ends before" else "deflate"
            headers["Content-Encoding"] = coding
            resp = requests.post(gateway.url + "/v1/actions", data=body, headers=headers, timeout=60)
            assert resp.status_code == 400, resp.text
            assert why in resp.json()["error"] and coding in resp.json()["error"], resp.text
    assert not _errors(caplog), caplog.text


def test_a_compressed_stream_bounds_its_lines_not_its_whole(gateway: Gateway) -> None:
    """A gzip stream that decodes past ``max_body_bytes`` runs whole when each line is within it;
    a line over it is refused alone (the decoder never holds the whole body)."""
    pad = "#" + "x" * (LIMIT // 4)
    lines = [
        json.dumps({**ACTION, "id": f"a{i}", "payload": {"code": f"{pad}\nprint({i})"}}) for i in range(6)
    ]
    lines.insert(3, json.dumps({**ACTION, "id": "huge", "payload": {"code": "#" * (2 * LIMIT)}}))
    body = gzip.compress(("\n".join(lines) + "\n").encode())
    assert len(body) < LIMIT
    headers = {"Content-Encoding": "gzip"}
    resp = requests.post(gateway.url + "/v1/actions:stream", data=body, headers=headers, timeout=120)
    out = [json.loads(text) for text in resp.text.splitlines()]
    ran = sorted(o["id"] for o in out if o.get("state") == "Succeeded")
    assert ran == [f"a{i}" for i in range(6)], out
    (refused,) = [o for o in out if "status" in o]
    assert refused["status"] == 413 and refused["line"] == 4, refused


# --- Header limits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("what", "headers", "named"),
    [
        (
            "a header line over 8190 bytes",
            b"Authorization: Bearer " + b"t0ken" * 2000 + b"\r\n",
            b"8190 bytes",
        ),
        ("over 128 headers", b"".join(b"X-H%d: 1\r\n" % i for i in range(200)), b"headers"),
        (
            # llhttp's message quotes the offending line itself (not only its first 100 bytes):
            # the filter must keep its description and drop the quote.
            "a header value with a control character",
            b"Authorization: Bearer t0ken\x01t0ken\r\n",
            b"invalid header value char",
        ),
    ],
    ids=["long line", "many headers", "control character"],
)
def test_headers_over_the_parsers_limits_are_400_without_a_traceback(
    gateway: Gateway, what: str, headers: bytes, named: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's parser refuses these before any middleware runs, with its own plain-text 400 (see
    docs/gateway.md: no 431 in JSON is possible there), and logged each as an ERROR with a traceback
    whose message quoted the line's start: a bearer token's head in the log. Now one INFO line names
    the problem; the answer still names the limit; the gateway serves on."""
    with caplog.at_level(logging.INFO), gateway.raw_connection(30) as conn:
        conn.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert named in answer.lower(), answer[:300]
    assert not _errors(caplog), caplog.text
    assert "t0ken" not in caplog.text, caplog.text
    assert any("refused an unparsable request" in r.getMessage() for r in caplog.records), caplog.text
    assert requests.get(gateway.url + "/v1/ping", timeout=10).status_code == 200


# --- Methods, framing, JSON's corners --------------------------------------------------------------------


def test_head_is_answered_wherever_get_is(gateway: Gateway) -> None:
    """RFC 9110 9.1: a server that takes GET takes HEAD. ``HEAD /healthz`` (a load balancer's check)
    and every other GET route answered 405; HEAD now answers as GET would, without a body."""
    for path, status in (
        ("/healthz", 200),
        ("/readyz", 200),
        ("/v1/ping", 200),
        ("/metrics", 200),
        ("/openapi.json", 200),
        ("/v1/sessions/nope", 404),
        ("/v1/batches/team-a/nope/results", 404),
    ):
        got = requests.get(gateway.url + path, timeout=10)
        head = requests.head(gateway.url + path, timeout=10)
        assert head.status_code == got.status_code == status, (path, head.status_code, got.text)
        assert head.content == b"", (path, head.content)
    # A POST route is still 405 to HEAD and OPTIONS, naming what it takes.
    for method in ("HEAD", "OPTIONS"):
        resp = requests.request(method, gateway.url + "/v1/actions", timeout=10)
        assert resp.status_code == 405 and resp.headers["Allow"] == "POST", (method, resp.headers)


def test_a_key_sent_twice_is_refused_by_name_on_the_native_api(gateway: Gateway) -> None:
    """``"payload"`` twice in one object ran the second one without a word (another parser on the
    way may read the first). The native API refuses it, 400 naming the key, on the stream too, as the
    API server refuses a field twice in an ActionBatch. The trainers' shapes take the last, as their
    owners' servers (Python's JSON) do: a SandboxFusion client that works there works here."""
    body = (
        b'{"type": "code", "target": "py", "payload": {"code": "print(1)"}, "payload": {"code": "print(2)"}}'
    )
    resp = requests.post(gateway.url + "/v1/actions", data=body, timeout=60)
    assert resp.status_code == 400 and "'payload' appears twice" in resp.json()["error"], resp.text
    stream = requests.post(gateway.url + "/v1/actions:stream", data=body + b"\n" + RAW + b"\n", timeout=60)
    lines = [json.loads(text) for text in stream.text.splitlines()]
    assert sorted(str(line.get("status") or line.get("state")) for line in lines) == ["400", "Succeeded"], (
        lines
    )
    twice = b'{"code": "print(1)", "language": "python", "code": "print(2)"}'
    resp = requests.post(gateway.url + "/run_code", data=twice, timeout=60)
    assert resp.status_code == 200 and resp.json()["run_result"]["stdout"] == "2\n", resp.text


JSON_CORNERS: list[tuple[str, bytes, int, str]] = [
    ("a UTF-8 byte-order mark", b"\xef\xbb\xbf" + RAW, 200, "Succeeded"),
    ("NaN where a number goes", RAW[:-1] + b', "timeoutSeconds": NaN}', 422, "timeoutSeconds"),
    ("Infinity where a number goes", RAW[:-1] + b', "timeoutSeconds": Infinity}', 422, "timeoutSeconds"),
    ("1e400 where a number goes", RAW[:-1] + b', "timeoutSeconds": 1e400}', 422, "timeoutSeconds"),
    ("an integer of 5000 digits", RAW[:-1] + b', "timeoutSeconds": ' + b"9" * 5000 + b"}", 400, "digits"),
    ("nesting 20000 deep", RAW[:-1] + b', "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, "recursion"),
]


@pytest.mark.parametrize(("what", "body", "status", "named"), JSON_CORNERS, ids=[c[0] for c in JSON_CORNERS])
def test_jsons_corners_get_the_answer_or_an_error_naming_them(
    gateway: Gateway, what: str, body: bytes, status: int, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        resp = requests.post(gateway.url + "/v1/actions", data=body, timeout=60)
        assert resp.status_code == status and named in resp.text, resp.text
        stream = requests.post(gateway.url + "/v1/actions:stream", data=body + b"\n", timeout=60)
        (line,) = [json.loads(text) for text in stream.text.splitlines()]
        assert line.get("status", 200) == status and named in json.dumps(line), line
    assert not _errors(caplog), caplog.text


def test_http_1_0_pipelining_and_chunked_bodies(gateway: Gateway) -> None:
    """HTTP/1.0 (with and without ``Expect``, which it does not have), pipelined keep-alive
    requests (answered in order on one connection), and a chunked body in many chunks."""
    for extra in (b"", b"Expect: 100-continue\r\n"):
        with gateway.raw_connection(60) as conn:
            conn.sendall(
                b"POST /v1/actions HTTP/1.0\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(RAW) + RAW
            )
            answer = read_until_closed(conn)
        assert answer.startswith(b"HTTP/1.0 200") and b'"stdout": "1\\n"' in answer, answer[:300]
    one = b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(RAW) + RAW
    chunked = b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(RAW[i : i + 5]), RAW[i : i + 5]) for i in range(0, len(RAW), 5)
    )
    last = b"GET /v1/ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with gateway.raw_connection(60) as conn:
        conn.sendall(one + chunked + b"0\r\n\r\n" + one + last)
        answer = read_until_closed(conn)
    statuses = [part.split(b"\r\n", 1)[0] for part in answer.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [b"200 OK"] * 4, answer[:2000]
    assert answer.count(b'"state": "Succeeded"') == 3 and answer.endswith(b'"pong"'), answer[-300:]
