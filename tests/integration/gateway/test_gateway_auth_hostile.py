"""Hostile callers of the gateway's authentication: floods of made-up tokens, malformed and
duplicated credentials, tokens in URLs. Against the stand-in of the API server's review endpoints
(real HTTP, the real kubernetes client) and the real gateway on loopback."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import socket
from collections.abc import Iterator

import aiohttp
import pytest
import requests
from gateway_harness import NS, POOL, Gateway, read_until_closed, serve_gateway, serve_reviews
from sandbox_agent_harness import Agent

from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator
from arl_tangram.gateway.auth import (
    MAX_TOKEN_CHARS,
    ReviewsThrottled,
    ReviewThrottle,
    TtlCache,
    Unauthenticated,
    token_refusal,
)
from arl_tangram.gateway.review_server import ReviewServer, StandInToken, api_client_for, stand_in_jwt

AUD = "tangram-gateway"
USER = "system:serviceaccount:team-a:alice"
ALICE = stand_in_jwt(USER)
ACTION = {"type": "code", "target": POOL, "payload": {"code": "print('authorised')"}}
# Loggers not the gateway's: the harness's access log, and the test's own HTTP client.
CLIENT_SIDE_LOGS = ("aiohttp.access", "urllib3")
# The throttle's clock stands still, so that its per-second budgets never refill during a test: what
# is reviewed is then exactly what the bursts allow, whatever the machine's speed.
THROTTLE = {"max_in_flight": 8, "per_second": 30.0, "client_in_flight": 2, "client_per_second": 5.0}


@pytest.fixture
def reviews() -> Iterator[tuple[ReviewServer, str]]:
    server = ReviewServer(tokens={ALICE: StandInToken(USER, (AUD,))})
    server.grant(USER, [NS])
    with serve_reviews(server) as url:
        yield server, url


@pytest.fixture
def gateway(hosts: list[Agent], reviews: tuple[ReviewServer, str]) -> Iterator[Gateway]:
    throttle = ReviewThrottle(**THROTTLE, clock=lambda: 0.0)  # type: ignore[arg-type]
    auth = KubernetesAuthenticator(api_client_for(reviews[1]), AUD, throttle=throttle)
    with serve_gateway(
        hosts, auth=auth, config=GatewayConfig(default_namespace=NS, default_pools={NS: POOL})
    ) as gw:
        yield gw


def _made_up() -> str:
    return stand_in_jwt(f"attacker-{secrets.token_hex(8)}")


async def _flood(url: str, tokens: list[str]) -> list[int]:
    async with aiohttp.ClientSession() as http:

        async def one(token: str) -> int:
            headers = {"Authorization": f"Bearer {token}"}
            async with http.post(f"{url}/v1/actions", json=ACTION, headers=headers) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one(t) for t in tokens))


def _raw(gw: Gateway, head: bytes, source: str | None = None) -> tuple[int, bytes]:
    """Send ``head`` (a request's line and headers, no body) and read the whole answer; from the
    loopback address ``source`` where given (another client, as far as the gateway can tell)."""
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
        conn.settimeout(60)
        if source is not None:
            conn.bind((source, 0))
        conn.connect((host, int(port)))
        conn.sendall(head + b"Connection: close\r\nContent-Length: 0\r\n\r\n")
        answer = read_until_closed(conn)
    return int(answer.split(b" ", 2)[1]), answer


def test_a_flood_of_made_up_tokens_is_bounded_and_other_clients_still_get_in(
    gateway: Gateway, reviews: tuple[ReviewServer, str]
) -> None:
    """Every distinct token used to cost one TokenReview, all at once: a client sending made-up
    tokens put as many reviews on the API server as it liked. Now one client spends at most its own
    share (a burst, then its rate; a few at once), each refused one a 503 with Retry-After, and
    another client's new token is still reviewed and let in."""
    server, _ = reviews
    server.review_delay_s = 0.2  # an API server under load: reviews overlap
    flood = [_made_up() for _ in range(120)]
    statuses = asyncio.run(_flood(gateway.url, flood))
    assert set(statuses) <= {401, 503}, statuses
    assert statuses.count(503) > 0, "nothing was throttled"
    burst = int(2 * THROTTLE["client_per_second"])
    assert server.token_reviews <= burst, f"{server.token_reviews} reviews for one client's flood"
    assert server.most_in_flight <= THROTTLE["client_in_flight"], server.most_in_flight
    refused = requests.post(
        gateway.url + "/v1/actions", json=ACTION, headers={"Authorization": f"Bearer {flood[-1]}"}, timeout=60
    )
    if refused.status_code == 503:
        assert refused.headers["Retry-After"] and "too many new tokens" in refused.json()["error"]
    # Another client (another address) with a token the gateway has not seen yet gets in.
    status, answer = _raw(
        gateway,
        b"GET /v1/ping HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode() + b"\r\n",
        source="127.0.0.2",
    )
    assert status == 200, answer


async def test_the_throttle_bounds_reviews_in_all_and_per_client() -> None:
    now = [0.0]
    throttle = ReviewThrottle(
        max_in_flight=3, per_second=4, client_in_flight=2, client_per_second=1, clock=lambda: now[0]
    )
    throttle.acquire("a")
    throttle.acquire("a")
    with pytest.raises(ReviewsThrottled, match="this client already has 2"):
        throttle.acquire("a")
    throttle.acquire("b")
    with pytest.raises(ReviewsThrottled, match="3 new tokens are under review"):
        throttle.acquire("c")
    for client in ("a", "a", "b"):
        throttle.release(client)
    assert throttle.in_flight == 0
    # "a" spent its burst (2): refused until its rate refills, while "c" is served from the rest.
    with pytest.raises(ReviewsThrottled, match="more than 1 new tokens a second"):
        throttle.acquire("a")
    throttle.acquire("c")
    throttle.release("c")
    with pytest.raises(ReviewsThrottled, match="more than 4 new tokens a second are being reviewed"):
        throttle.acquire("d")
    now[0] = 1.0
    throttle.acquire("a")
    throttle.release("a")
    with pytest.raises(ValueError, match="client_in_flight must be positive"):
        ReviewThrottle(client_in_flight=0)


def test_tokens_that_cannot_be_service_account_tokens_are_refused_without_a_review(
    gateway: Gateway, reviews: tuple[ReviewServer, str]
) -> None:
    """A bearer token is RFC 6750's b64token, of a kilobyte or two: anything else was sent to the
    API server to review all the same."""
    server, _ = reviews
    too_long = stand_in_jwt("x" * MAX_TOKEN_CHARS)
    why_chars = "characters no bearer token has"
    for token, why in (
        ("a.b!.c", why_chars),
        ('"quoted"', why_chars),
        ("tok,en", why_chars),
        ("t\u00f6ken", why_chars),
        ("=padding-first", why_chars),
        (too_long, f"over the limit of {MAX_TOKEN_CHARS}"),
        (ALICE[:20] + " " + ALICE[20:], "whitespace"),
        (ALICE[:20] + "\t" + ALICE[20:], "whitespace"),
    ):
        resp = requests.post(
            gateway.url + "/v1/actions", json=ACTION, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        assert resp.status_code == 401 and why in resp.json()["error"], (token[:30], resp.text)
        assert token not in resp.text
    assert server.token_reviews == 0, "a token that cannot be one was reviewed"
    assert token_refusal(ALICE) is None


def test_tokens_of_other_authenticators_than_service_accounts_are_still_reviewed(
    gateway: Gateway, reviews: tuple[ReviewServer, str]
) -> None:
    """A TokenReview asks every authenticator the API server has: EKS's IAM tokens, GKE's access
    tokens, opaque static or webhook tokens are not JWTs, and a shape check that wanted one refused
    such a cluster's users without asking. (The stand-in review server knows none of them: 401.)"""
    server, _ = reviews
    before = server.token_reviews
    for token in (
        "k8s-aws-v1.aHR0cHM6Ly9zdHMuYW1hem9uYXdzLmNvbS8_QWN0aW9u",
        "ya29.a0AfH6SMB-x_y~z+w/v=",
        "opaque",
    ):
        assert token_refusal(token) is None, token
        resp = requests.post(
            gateway.url + "/v1/actions", json=ACTION, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        assert resp.status_code == 401 and "characters" not in resp.json()["error"], resp.text
    assert server.token_reviews == before + 3


def test_credentials_sent_wrongly_are_refused_with_a_clear_401_and_never_logged(
    gateway: Gateway, reviews: tuple[ReviewServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Each way of sending credentials wrongly is a 401 naming it, never a 500 (or a token taken
    from a place it should not be), and no token reaches the log. (The operator serves the gateway
    with no access log; the harness's aiohttp access log, which prints request lines, is left out.)"""
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    alice = ALICE.encode()
    basic = base64.b64encode(b"tangram:" + alice)
    cases: list[tuple[bytes, int, str]] = [
        # Two Authorization headers: which one is the caller?
        (
            b"Authorization: Bearer " + alice + b"\r\nAuthorization: Bearer " + alice + b"\r\n",
            401,
            "2 Authorization headers",
        ),
        (b"Authorization: Basic !!notbase64\r\n", 401, "not base64"),
        (b"Authorization: Digest username=x\r\n", 401, "unsupported Authorization scheme 'Digest'"),
        # The token alone, with no scheme: refused without quoting it.
        (b"Authorization: " + alice + b"\r\n", 401, "unsupported Authorization scheme (none)"),
        (b"Authorization: Bearer\r\n", 401, "carries no credentials"),
        (b"Authorization: Bearer    \r\n", 401, "carries no credentials"),
        # A header folded onto a second line is not HTTP the parser takes.
        (b"Authorization: Bearer " + alice[:10] + b"\r\n " + alice[10:] + b"\r\n", 400, ""),
        # Over the HTTP parser's header limit: its 400, before the gateway.
        (b"Authorization: Bearer " + b"x" * 9000 + b"\r\n", 400, ""),
    ]
    for headers, status, why in cases:
        got, answer = _raw(gateway, b"POST /v1/actions HTTP/1.1\r\nHost: x\r\n" + headers)
        assert got == status, (headers[:60], answer)
        assert why.encode() in answer, (why, answer)
        assert alice not in answer
    # A token in the query string is refused even when it is valid (URLs end up in logs), and so is
    # a valid Basic one together with it.
    for query in ("access_token", "token"):
        resp = requests.post(
            f"{gateway.url}/v1/actions?{query}={ALICE}",
            json=ACTION,
            headers={"Authorization": f"Basic {basic.decode()}"},
            timeout=60,
        )
        assert resp.status_code == 401 and f"?{query}=" in resp.json()["error"], resp.text
        assert ALICE not in resp.text
    # The same valid Basic credentials on their own are taken.
    ok = requests.post(
        gateway.url + "/v1/actions",
        json=ACTION,
        headers={"Authorization": f"Basic {basic.decode()}"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["stdout"] == "authorised\n", ok.text
    # The gateway's own logs and aiohttp's server's (the test's own client, urllib3, logs its URLs).
    logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(CLIENT_SIDE_LOGS))
    assert ALICE not in logged and ALICE[-20:] not in logged


async def test_refusals_do_not_push_accepted_tokens_out_of_the_cache() -> None:
    """Refusals and acceptances shared one bound: a flood of made-up tokens (each refusal cached)
    pushed every caller's accepted token out, so each was reviewed again, against the throttle's
    budget the flood was using up."""
    cache: TtlCache[str, str] = TtlCache(ttl_s=60, negative_ttl_s=5, max_entries=3)
    looked_up: list[str] = []

    async def accept(key: str) -> str:
        looked_up.append(key)
        return key

    async def refuse() -> str:
        raise Unauthenticated("no")

    await cache.get("alice", lambda: accept("alice"))
    for i in range(10):
        with pytest.raises(Unauthenticated):
            await cache.get(f"made-up-{i}", refuse)
    assert await cache.get("alice", lambda: accept("alice")) == "alice"
    assert looked_up == ["alice"], "alice's accepted token was pushed out by refusals"
    assert len(cache) == 4  # alice, and the last three refusals


def test_a_valid_token_naming_new_namespaces_cannot_flood_access_reviews(
    gateway: Gateway, reviews: tuple[ReviewServer, str]
) -> None:
    """The namespace is the caller's to choose, and each new (namespace, verb) of a caller cost one
    SubjectAccessReview, unthrottled: a tenant with a valid token naming a made-up namespace in each
    request put one review per request on the API server (120 here). Its access reviews now spend
    a share of the same throttle as new tokens, keyed by its name (so more addresses do not buy
    more): a burst, then 503 with Retry-After naming the permission checks; another caller's first
    request is still reviewed and runs."""
    server, _ = reviews
    server.grant("system:serviceaccount:team-b:bob", [NS])
    bob = stand_in_jwt("system:serviceaccount:team-b:bob")
    server.tokens[bob] = StandInToken("system:serviceaccount:team-b:bob", (AUD,))

    async def flood() -> list[tuple[int, str]]:
        headers = {"Authorization": f"Bearer {ALICE}"}
        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> tuple[int, str]:
                body = {**ACTION, "namespace": f"made-up-{i}"}
                async with http.post(f"{gateway.url}/v1/actions", json=body, headers=headers) as resp:
                    return resp.status, await resp.text()

            return await asyncio.gather(*(one(i) for i in range(120)))

    answers = asyncio.run(flood())
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {403, 503}, statuses
    burst = int(2 * THROTTLE["client_per_second"])
    assert server.access_reviews <= burst, f"{server.access_reviews} access reviews for one caller's flood"
    assert statuses.count(503) >= 120 - burst, statuses
    throttled = next(text for status, text in answers if status == 503)
    assert "too many new permission checks" in throttled, throttled
    ran = requests.post(
        gateway.url + "/v1/actions", json=ACTION, headers={"Authorization": f"Bearer {bob}"}, timeout=60
    )
    assert ran.status_code == 200 and ran.json()["stdout"] == "authorised\n", ran.text
