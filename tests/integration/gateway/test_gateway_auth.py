"""Authentication and authorisation through the gateway, against a stand-in of the API server's
TokenReview and SubjectAccessReview endpoints (real HTTP, the real kubernetes client; the e2e test
``tests/e2e/test_gateway_auth.py`` does the same against the real API server with real tokens)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import Iterator

import pytest
import requests
from aiohttp import web
from gateway_harness import NS, POOL, Gateway, free_port, read_until_closed, serve_gateway, serve_reviews
from sandbox_agent_harness import Agent

from arl_tangram.errors import InvalidSpec
from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator, build_gateway_app
from arl_tangram.gateway.auth import Forbidden, TtlCache, token_expiry
from arl_tangram.gateway.config import parse_defaults
from arl_tangram.gateway.review_server import ReviewServer, StandInToken, api_client_for, stand_in_jwt

AUD = "tangram-gateway"
# JWT-shaped, as ServiceAccount tokens are.
ALICE, BOB, CAROL, APISERVER, NOBODY = (
    stand_in_jwt(name) for name in ("alice", "bob", "carol", "alice-for-the-apiserver", "nobody")
)
ACTION = {"type": "code", "target": POOL, "payload": {"code": "print('authorised')"}}


@pytest.fixture(scope="module")
def reviews() -> Iterator[tuple[ReviewServer, str]]:
    server = ReviewServer()
    server.tokens = {
        ALICE: StandInToken("system:serviceaccount:team-a:alice", (AUD,)),
        BOB: StandInToken("system:serviceaccount:team-a:bob", (AUD,)),
        CAROL: StandInToken("system:serviceaccount:team-b:carol", (AUD,)),
        APISERVER: StandInToken("system:serviceaccount:team-a:alice", ("https://kubernetes.default.svc",)),
    }
    server.grant("system:serviceaccount:team-a:alice", [NS])
    server.grant("system:serviceaccount:team-b:carol", ["team-b"])
    with serve_reviews(server) as url:
        yield server, url


@pytest.fixture(scope="module")
def gateway(
    hosts: list[Agent], reviews: tuple[ReviewServer, str]
) -> Iterator[tuple[Gateway, KubernetesAuthenticator]]:
    auth = KubernetesAuthenticator(api_client_for(reviews[1]), AUD)
    with serve_gateway(
        hosts, auth=auth, config=GatewayConfig(default_namespace=NS, default_pools={NS: POOL})
    ) as gw:
        yield gw, auth


def _post(
    gw: Gateway, token: str | None, body: object = ACTION, path: str = "/v1/actions"
) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(gw.url + path, json=body, headers=headers, timeout=60)


def test_a_token_with_rbac_runs_and_a_warm_request_makes_no_api_call(
    gateway: tuple[Gateway, KubernetesAuthenticator], reviews: tuple[ReviewServer, str]
) -> None:
    gw, _ = gateway
    resp = _post(gw, ALICE)
    assert resp.status_code == 200 and resp.json()["stdout"] == "authorised\n", resp.text
    calls = reviews[0].calls
    for _ in range(5):
        assert _post(gw, ALICE).status_code == 200
    rc = requests.post(
        gw.url + "/run_code",
        json={"code": "print(1)", "language": "python"},
        auth=("tangram", ALICE),
        timeout=60,
    )
    assert rc.status_code == 200 and rc.json()["status"] == "Success"  # Basic auth carries it too
    # The token as the URL's user (http://TOKEN@host/: Basic with an empty password) is taken too.
    as_user = requests.post(
        gw.url + "/run_code",
        json={"code": "print(1)", "language": "python"},
        auth=(ALICE, ""),
        timeout=60,
    )
    assert as_user.status_code == 200 and as_user.json()["status"] == "Success", as_user.text
    assert reviews[0].calls == calls, "a warm request called the API server"


def test_refusals_name_what_is_missing(gateway: tuple[Gateway, KubernetesAuthenticator]) -> None:
    gw, _ = gateway
    none = _post(gw, None)
    assert none.status_code == 401 and "missing bearer token" in none.json()["error"]
    assert none.headers["WWW-Authenticate"].startswith("Bearer")
    bad = _post(gw, NOBODY)
    assert bad.status_code == 401 and "not accepted" in bad.json()["error"]
    wrong_audience = _post(gw, APISERVER)
    assert wrong_audience.status_code == 401 and AUD in wrong_audience.json()["error"]
    no_rbac = _post(gw, BOB)
    assert no_rbac.status_code == 403
    assert "may not create actionbatches.tangram.arl.dev in namespace 'team-a'" in no_rbac.json()["error"]
    elsewhere = _post(gw, CAROL)
    assert elsewhere.status_code == 403 and "team-b:carol" in elsewhere.json()["error"]
    run_code = requests.post(
        gw.url + "/run_code",
        json={"code": "1", "language": "python"},
        headers={"Authorization": f"Bearer {BOB}"},
        timeout=60,
    )
    assert run_code.status_code == 403 and run_code.json()["status"] == "SandboxError"


def test_a_name_with_a_trailing_newline_is_no_name(gateway: tuple[Gateway, KubernetesAuthenticator]) -> None:
    """``$`` in the name patterns matched before a final newline: ``?namespace=team-a%0A`` passed as a
    namespace (reaching the SubjectAccessReview and, as a pool, the API server). Each is a 400 naming
    the parameter, like any other name that is none."""
    gw, _ = gateway
    code = {"code": "print(1)", "language": "python"}
    headers = {"Authorization": f"Bearer {ALICE}"}
    for query, field in ((f"namespace={NS}%0A&pool={POOL}", "namespace"), (f"pool={POOL}%0A", "pool")):
        resp = requests.post(f"{gw.url}/run_code?{query}", json=code, headers=headers, timeout=60)
        assert resp.status_code == 400 and "not a valid Kubernetes name" in resp.json()["error"], resp.text
        assert field in resp.json()["field"], resp.text
    batch = requests.get(f"{gw.url}/v1/batches/{NS}%0A/b/results", headers=headers, timeout=60)
    assert batch.status_code == 400 and batch.json()["field"] == "namespace", batch.text
    with pytest.raises(InvalidSpec, match="TANGRAM_GATEWAY_POOLS"):
        parse_defaults("TANGRAM_GATEWAY_POOLS", f"{NS}\n/{POOL}")


def _expecting(gw: Gateway, token: str | None, body: bytes) -> socket.socket:
    """A POST that announces its body and waits to be told to send it (``Expect: 100-continue``,
    as curl sends it for a large upload)."""
    conn = gw.raw_connection(30)
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    conn.sendall(
        b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + auth
        + b"Expect: 100-continue\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    return conn


def test_a_body_waiting_for_100_continue_is_refused_before_it_is_sent(
    gateway: tuple[Gateway, KubernetesAuthenticator],
) -> None:
    """A caller with no valid token that asks before sending its body hears 401 at once, not a
    100 that has it upload the body only to be refused; one with a valid token gets the 100."""
    gw, _ = gateway
    body = json.dumps(ACTION).encode()
    for token, why in ((None, "missing bearer token"), (NOBODY, "not accepted")):
        with _expecting(gw, token, body) as conn:
            answer = read_until_closed(conn)  # the body never sent: the answer came before it
        head, _, text = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), answer
        assert why in json.loads(text)["error"], answer
    with _expecting(gw, ALICE, body) as conn:
        assert conn.recv(64).startswith(b"HTTP/1.1 100 Continue"), "no 100 for a valid token"
        conn.sendall(body)
        answer = read_until_closed(conn)
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer
    assert json.loads(text)["stdout"] == "authorised\n", answer


def test_open_routes_need_no_token(gateway: tuple[Gateway, KubernetesAuthenticator]) -> None:
    gw, _ = gateway
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/ping"):
        assert requests.get(gw.url + path, timeout=10).status_code == 200, path
    metrics = requests.get(gw.url + "/metrics", timeout=10).text
    assert 'tangram_gateway_auth_cache{result="hit",review="tokens"}' in metrics


def test_a_session_is_authorised_in_its_own_namespace(
    gateway: tuple[Gateway, KubernetesAuthenticator],
) -> None:
    gw, _ = gateway
    opened = _post(gw, ALICE, {"pool": POOL}, "/v1/sessions")
    assert opened.status_code == 201
    sid = opened.json()["id"]
    carol = {"Authorization": f"Bearer {CAROL}"}
    foreign = requests.post(
        f"{gw.url}/v1/sessions/{sid}/actions",
        json={"type": "code", "payload": {"code": "1"}},
        headers=carol,
        timeout=60,
    )
    # Another tenant's session is answered as one that does not exist: a 403 told carol that the id
    # is open, and in which namespace.
    made_up = "s-0123456789abcdef"
    for method, path in (("POST", "/actions"), ("GET", ""), ("DELETE", "")):
        for session in (sid, made_up):
            resp = requests.request(
                method,
                f"{gw.url}/v1/sessions/{session}{path}",
                json={"type": "code", "payload": {"code": "1"}} if path else None,
                headers=carol,
                timeout=60,
            )
            assert resp.status_code == 404, (method, path, resp.text)
            assert resp.json()["error"] == f"no open session {session!r} (closed, expired, or never opened)"
            assert NS not in resp.text, resp.text
    assert foreign.status_code == 404
    mine = requests.get(
        f"{gw.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=60
    )
    assert mine.status_code == 200, "carol's calls closed alice's session"


async def test_cache_expires_bounds_its_size_and_shares_one_lookup() -> None:
    now = [0.0]
    cache: TtlCache[str, int] = TtlCache(ttl_s=10, negative_ttl_s=1, max_entries=2, clock=lambda: now[0])
    calls: list[str] = []

    async def lookup(key: str, value: int) -> int:
        calls.append(key)
        await asyncio.sleep(0)
        return value

    results = await asyncio.gather(*(cache.get("a", lambda: lookup("a", 1)) for _ in range(10)))
    assert results == [1] * 10 and calls == ["a"], "concurrent misses must share one lookup"
    await cache.get("b", lambda: lookup("b", 2))
    await cache.get("c", lambda: lookup("c", 3))
    assert len(cache) == 2
    await cache.get("a", lambda: lookup("a", 1))
    assert calls == ["a", "b", "c", "a"], "the oldest entry must have been dropped"
    now[0] = 11.0
    await cache.get("c", lambda: lookup("c", 3))
    assert calls[-1] == "c", "an expired entry must be looked up again"

    async def deny() -> int:
        calls.append("deny")
        raise Forbidden("no")

    for _ in range(3):
        with pytest.raises(Forbidden):
            await cache.get("d", deny)
    assert calls.count("deny") == 1, "a refusal is cached for the negative TTL"
    now[0] = 12.5
    with pytest.raises(Forbidden):
        await cache.get("d", deny)
    assert calls.count("deny") == 2


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            address: str = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_anonymous_access_needs_the_flag_and_loopback() -> None:
    with pytest.raises(ValueError, match="allow_anonymous"):
        build_gateway_app(object(), None)  # type: ignore[arg-type]
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    app = build_gateway_app(object(), None, allow_anonymous=True)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        loop = asyncio.get_running_loop()
        resp = await loop.run_in_executor(
            None,
            lambda: requests.post(
                f"http://{address}:{port}/v1/actions",
                json=ACTION,
                # Only the connection's own address counts: headers a proxy would add are not read.
                headers={
                    "X-Forwarded-For": "127.0.0.1",
                    "X-Real-IP": "127.0.0.1",
                    "Forwarded": "for=127.0.0.1",
                },
                timeout=10,
            ),
        )
    finally:
        await runner.cleanup()
    assert resp.status_code == 403 and "only from loopback" in resp.json()["error"]


def _jwt(claims: dict[str, object]) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{payload}.c2ln"


def test_a_token_is_not_cached_past_its_own_expiry() -> None:
    jwt = _jwt
    assert token_expiry(jwt({"exp": 1700000000, "aud": ["x"]})) == 1700000000.0
    assert token_expiry(jwt({"aud": ["x"]})) is None
    assert token_expiry("not-a-jwt") is None
    assert token_expiry("a.!!!.c") is None
    assert token_expiry(jwt({"exp": 10**400})) is None  # past any float: no expiry to read


async def test_the_authenticator_trusts_a_cached_token_no_longer_than_its_own_expiry(
    reviews: tuple[ReviewServer, str],
) -> None:
    """A token's ``exp`` bounds how long its review is kept: one that has expired is reviewed again
    on every call (the API server says whether it still holds), one that lasts is reviewed once."""
    server, url = reviews
    user = "system:serviceaccount:team-a:alice"
    lasting, expired = _jwt({"exp": time.time() + 3600}), _jwt({"exp": time.time() - 5})
    server.tokens[lasting] = StandInToken(user, (AUD,))
    server.tokens[expired] = StandInToken(user, (AUD,))
    auth = KubernetesAuthenticator(api_client_for(url), AUD)
    before = server.calls
    for _ in range(3):
        assert (await auth.authenticate(lasting)).username == user
    assert server.calls == before + 1
    for _ in range(3):
        assert (await auth.authenticate(expired)).username == user
    assert server.calls == before + 4


async def test_callers_sharing_a_lookup_all_hear_when_its_ttl_cannot_be_read() -> None:
    """Concurrent misses of one key share one lookup: if what is looked up cannot be kept (its TTL
    fails to read), every caller hears of it; none waits for ever."""
    cache: TtlCache[str, int] = TtlCache(ttl_s=60, negative_ttl_s=1, max_entries=10)
    release = asyncio.Event()

    async def lookup() -> int:
        await release.wait()
        return 1

    def ttl() -> float:
        raise OverflowError("no expiry to read")

    first = asyncio.create_task(cache.get("t", lookup, ttl_s=ttl))
    await asyncio.sleep(0)
    second = asyncio.create_task(cache.get("t", lookup, ttl_s=ttl))
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 5)
    assert all(isinstance(r, OverflowError) for r in results), results


async def test_a_short_lived_entry_expires_before_the_cache_ttl() -> None:
    now = [0.0]
    cache: TtlCache[str, int] = TtlCache(ttl_s=60, negative_ttl_s=1, max_entries=10, clock=lambda: now[0])
    calls: list[int] = []

    async def lookup() -> int:
        calls.append(1)
        return 1

    await cache.get("t", lookup, ttl_s=lambda: 2)
    now[0] = 1.0
    await cache.get("t", lookup, ttl_s=lambda: 2)
    assert len(calls) == 1
    now[0] = 2.5
    await cache.get("t", lookup, ttl_s=lambda: 2)
    assert len(calls) == 2
