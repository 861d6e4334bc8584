"""The gateway's aiohttp application: routes, guards, and the answers to every failure.

Guards, outermost first: metrics and the error taxonomy (every refusal is JSON naming the problem;
nothing a caller sends answers 500 on purpose); leadership (a standby answers the action routes 503
with the leader's address); authentication (bearer ServiceAccount token, or anonymous by explicit
flag and from loopback only). Each handler then authorises the caller in its target's namespace.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from prometheus_client import generate_latest

from arl_tangram.domain.actions import ActionService
from arl_tangram.gateway import native, rewards, sandboxfusion
from arl_tangram.gateway.abandoned import Abandoned
from arl_tangram.gateway.admission import Admission
from arl_tangram.gateway.auth import ANONYMOUS, Authenticator, Forbidden, Unauthenticated
from arl_tangram.gateway.config import LEADER_HEADER, GatewayConfig
from arl_tangram.gateway.errors import as_http
from arl_tangram.gateway.metrics import GatewayMetrics
from arl_tangram.gateway.models import (
    ActionResultBody,
    CancelActions,
    CancelledActions,
    EmbeddingsRequest,
    EmbeddingsResponse,
    GatewayAction,
    OpenRLHFRewardRequest,
    OpenRLHFRewardResponse,
    RewardRequest,
    RewardResponse,
    SessionAction,
    SessionBody,
    SessionCreate,
    SlimeRewardRequest,
    VllmClassifyRequest,
    VllmClassifyResponse,
    VllmPoolingRequest,
    VllmPoolingResponse,
    VllmScoreRequest,
    VllmScoreResponse,
)
from arl_tangram.gateway.openapi import RouteDoc, openapi
from arl_tangram.gateway.parsing import BODY_UNDECODABLE, BadRequest, ClientGone, body_coding, too_large
from arl_tangram.gateway.routing import POOL_PREFIX, check_query
from arl_tangram.gateway.sessions import SessionRegistry
from arl_tangram.gateway.state import (
    PRINCIPAL_KEY,
    STATE,
    BatchResults,
    GatewayState,
    Readiness,
    always_leader,
    is_loopback,
    state_of,
)
from arl_tangram.sandbox.models import RunCodeRequest, RunJupyterRequest, run_code_status

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    doc: RouteDoc
    handler: Handler


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 on the leader; 503 on a standby (so the Service sends trainers to the leader)."""
    lead = state_of(request).readiness()
    if lead.leader:
        return web.json_response({"status": "leader"})
    return web.json_response({"status": "standby", "leader": lead.leader_address}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    for review in ("tokens", "reviews"):
        cache = getattr(state.auth, review, None)
        if cache is not None:
            state.metrics.auth_cache.labels(review, "hit").set(cache.hits)
            state.metrics.auth_cache.labels(review, "miss").set(cache.misses)
    state.metrics.sessions.set(len(state.sessions.sessions))
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


# The reward shapes' target: a RewardModelService, or an ActionPool for test-based rewards.
TARGET_QUERY = ("namespace", "pool", "service")
# vLLM and SGLang queue what they cannot serve yet and never answer 429, so their clients take any
# 4xx as final: verl's reward loop gave up on a 429 at once (failing the step), while it retries a
# 5xx with backoff. Their shapes answer a full bounded wait 503 with Retry-After instead.
OPENAI_SHAPES_BUSY = 503


def _docs() -> list[Route]:
    R = RouteDoc
    return [
        Route(
            R("POST", "/v1/actions", "Run one action; answer when it ends", GatewayAction, ActionResultBody),
            native.post_action,
        ),
        Route(
            R(
                "POST",
                "/v1/actions:stream",
                "NDJSON actions in, NDJSON results out in completion order",
                GatewayAction,
                ActionResultBody,
                ndjson_in=True,
                ndjson_out=True,
            ),
            native.post_stream,
        ),
        Route(
            R(
                "POST",
                "/v1/actions:cancel",
                "Stop actions by their keys (queued: dropped; running: stopped)",
                CancelActions,
                CancelledActions,
            ),
            native.cancel_actions,
        ),
        Route(
            R("POST", "/v1/sessions", "Open a session in a pool", SessionCreate, SessionBody, status=201),
            native.open_session,
        ),
        Route(
            R("GET", "/v1/sessions/{sid}", "A session and its remaining TTL", None, SessionBody),
            native.get_session,
        ),
        Route(
            R(
                "POST",
                "/v1/sessions/{sid}/actions",
                "Run one action in the session",
                SessionAction,
                ActionResultBody,
            ),
            native.run_in_session,
        ),
        Route(R("DELETE", "/v1/sessions/{sid}", "Close a session"), native.close_session),
        Route(
            R(
                "GET",
                "/v1/batches/{namespace}/{name}/results",
                "Every result of an ActionBatch (NDJSON)",
                ndjson_out=True,
            ),
            native.batch_results,
        ),
        Route(
            R(
                "POST",
                "/run_code",
                "SandboxFusion's run_code (pool by X-Tangram-Pool or ?pool=)",
                RunCodeRequest,
                query=("namespace", "pool"),
            ),
            sandboxfusion.run_code,
        ),
        Route(
            R(
                "POST",
                "/run_jupyter",
                "SandboxFusion's run_jupyter: notebook cells in one kernel (pool as for /run_code)",
                RunJupyterRequest,
                query=("namespace", "pool"),
            ),
            sandboxfusion.run_jupyter,
        ),
        # The same, with the pool in the path: SandboxFusion's own client appends /run_code to its
        # endpoint, so a query there is lost (``?pool=P/run_code``) and it sends no headers.
        *[
            Route(
                R("POST", f"{POOL_PREFIX}{path}", f"{text}, to the pool the path names", body),
                handler,
            )
            for path, text, body, handler in (
                ("/run_code", "SandboxFusion's run_code", RunCodeRequest, sandboxfusion.run_code),
                ("/run_jupyter", "SandboxFusion's run_jupyter", RunJupyterRequest, sandboxfusion.run_jupyter),
            )
        ],
        Route(R("GET", "/v1/ping", "SandboxFusion's ping", text_out=True, open=True), sandboxfusion.ping),
        Route(
            R(
                "POST",
                "/v1/rewards",
                "Score samples (model- or test-based)",
                RewardRequest,
                RewardResponse,
                query=("service",),
            ),
            rewards.native_rewards,
        ),
        Route(
            R(
                "POST",
                "/get_reward",
                "OpenRLHF's remote reward model",
                OpenRLHFRewardRequest,
                OpenRLHFRewardResponse,
                query=TARGET_QUERY,
            ),
            rewards.openrlhf_reward,
        ),
        Route(
            R(
                "POST",
                "/slime/reward",
                "slime's remote reward model (answers a bare number)",
                SlimeRewardRequest,
                number_out=True,
                query=TARGET_QUERY,
            ),
            rewards.slime_reward,
        ),
        *[
            Route(
                R(
                    "POST",
                    f"{prefix}/score",
                    "vLLM's score API",
                    VllmScoreRequest,
                    VllmScoreResponse,
                    query=TARGET_QUERY,
                    busy_status=OPENAI_SHAPES_BUSY,
                ),
                rewards.vllm_score,
            )
            for prefix in ("", "/v1")
        ],
        *[
            Route(
                R(
                    "POST",
                    f"{prefix}/classify",
                    "vLLM's classify (input) or SGLang's (text)",
                    VllmClassifyRequest,
                    VllmClassifyResponse,
                    query=TARGET_QUERY,
                    busy_status=OPENAI_SHAPES_BUSY,
                ),
                rewards.classify,
            )
            for prefix in ("", "/v1")
        ],
        Route(
            R(
                "POST",
                "/pooling",
                "vLLM's pooling API (reward models' scores)",
                VllmPoolingRequest,
                VllmPoolingResponse,
                query=TARGET_QUERY,
                busy_status=OPENAI_SHAPES_BUSY,
            ),
            rewards.vllm_pooling,
        ),
        Route(
            R(
                "POST",
                "/v1/embeddings",
                "OpenAI's embeddings API as SGLang serves reward models (the score is the embedding)",
                EmbeddingsRequest,
                EmbeddingsResponse,
                query=TARGET_QUERY,
                busy_status=OPENAI_SHAPES_BUSY,
            ),
            rewards.embeddings,
        ),
        Route(R("GET", "/healthz", "Liveness", open=True), healthz),
        Route(R("GET", "/readyz", "Readiness: 200 on the leader, 503 on a standby", open=True), readyz),
        Route(R("GET", "/metrics", "Prometheus metrics", text_out=True, open=True), metrics),
    ]


ROUTES = _docs()
# The paths that answer in SandboxFusion's shape, errors included (``status``, ``message``, 504):
# matched on the request's path, since a refusal before routing (a wrong method, a standby) has no
# route to name.
SANDBOXFUSION_ROUTES = re.compile(
    "|".join(
        "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(r.doc.path)) + "$"
        for r in ROUTES
        if r.handler in (sandboxfusion.run_code, sandboxfusion.run_jupyter)
    )
)
OPEN_PATHS = frozenset(r.doc.path for r in ROUTES if r.doc.open) | {"/openapi.json"}
# The query parameters each path takes (every method of a path takes the same).
QUERY_OF: dict[str, frozenset[str]] = {}
for _r in ROUTES:
    QUERY_OF[_r.doc.path] = QUERY_OF.get(_r.doc.path, frozenset()) | frozenset(_r.doc.query)
# Paths whose body is read as it comes (NDJSON), bounded per line rather than whole.
STREAMED_PATHS = frozenset(r.doc.path for r in ROUTES if r.doc.ndjson_in)
# The status a full bounded wait is answered with, where it is not 429.
BUSY_STATUS = {r.doc.path: r.doc.busy_status for r in ROUTES if r.doc.busy_status != 429}


def _unslashed(path: str) -> str:
    """``path`` less one trailing slash: each route is also served with one (its twin, registered in
    ``build_gateway_app``), as the trainers' own servers serve it (FastAPI redirects it to the path
    without, and their clients follow): a URL set as ``.../run_code/`` or ``.../get_reward/``
    worked there."""
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def _path(request: web.Request) -> str:
    """The request's path as its route's (see ``_unslashed``)."""
    return _unslashed(request.path)


# Query parameters that clients (and OAuth's RFC 6750) use for a bearer token. A token in a URL ends
# up in proxies' and access logs: such a request is refused, never authenticated.
TOKEN_QUERY = ("access_token", "token", "bearer")


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer T``, or the password of ``Basic`` (so a trainer whose
    HTTP client sends no headers of its own can carry it in the URL: ``http://tangram:T@host/``),
    or its user where the password is empty (``http://T@host/``: the token was sent, as the user,
    and was answered "missing bearer token"). A refusal never quotes the credentials."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise Unauthenticated("the Basic credentials are not base64 of user:token") from None
        user, _, token = decoded.partition(":")
        return token or user or None
    if scheme.lower() in ("bearer", "basic"):
        raise Unauthenticated(f"the Authorization header's {scheme} scheme carries no credentials")
    # A header of the token alone (no scheme) must not be echoed: only a short word is named.
    named = repr(scheme) if scheme.isalpha() and len(scheme) <= 20 else "(none)"
    raise Unauthenticated(f"unsupported Authorization scheme {named}: use Bearer <token>")


def _credentials(request: web.Request) -> str | None:
    """The request's token (see ``bearer_token``); refuses a token in the query string and a request
    with more than one Authorization header (which one is the caller?)."""
    for name in TOKEN_QUERY:
        if name in request.query:
            raise Unauthenticated(
                f"a token in the query string (?{name}=) is not accepted, as URLs are logged:"
                " send Authorization: Bearer <token>"
            )
    headers = request.headers.getall(hdrs.AUTHORIZATION, [])
    if len(headers) > 1:
        raise Unauthenticated(f"{len(headers)} Authorization headers: send one")
    return bearer_token(headers[0] if headers else None)


def _route_name(request: web.Request) -> str:
    info = request.match_info.route.resource
    if info is None:
        return "unmatched"
    return _unslashed(info.canonical)  # a route's trailing-slash twin is the route itself


def _answer_error(
    request: web.Request,
    state: GatewayState,
    status: int,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
) -> web.Response:
    """An error's answer, counted among the refusals where it is one (401, 403, 429)."""
    if status in (401, 403, 429):
        state.metrics.refused.labels(str(status)).inc()
    return _error_response(request, status, body, headers)


def _error_response(
    request: web.Request, status: int, body: Mapping[str, Any], headers: Mapping[str, str]
) -> web.Response:
    if SANDBOXFUSION_ROUTES.match(_path(request)):
        # As the agent's own /run_code: SandboxFusion clients look at status and message.
        body = {**body, "status": "SandboxError", "message": body.get("error")}
        status = run_code_status(status)  # 504 for 429 and 503: what verl retries
    elif status == 429:
        status = BUSY_STATUS.get(_route_name(request), status)
    response = web.json_response(dict(body), status=status, headers=dict(headers))
    if status in (408, 413, 417) or request.content.exception() is not None or request.get(BODY_UNDECODABLE):
        # The rest of the body is not read, or its stream broke (a body that does not decode as
        # its Content-Encoding says): the connection is closed after this answer (aiohttp first
        # lingers a few seconds, reading and dropping what still comes, so that the client reads
        # the answer rather than a reset), not kept alive for another request.
        response.force_close()
    return response


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: a body announced over the limit is refused before it is sent (the
    client asked in order to learn that); any other is told to go on, as aiohttp's own handler does.
    An NDJSON stream is bounded per line, not whole, so only its lines can be refused. (This runs
    before the middleware, as aiohttp's own handler does: its refusals are counted here.)"""
    if request.version != HttpVersion11:
        return None
    state = state_of(request)
    route = _route_name(request)
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        state.metrics.requests.labels(route, "417").inc()
        return _error_response(
            request, 417, {"error": f"unknown Expect: {expect[:80]!r}; only 100-continue"}, {}
        )
    # Who asks, before the body is sent: a client without a valid token (or at a standby) that
    # waits for the 100 is refused at once, as it would be once it had sent its body.
    try:
        refusal = await _admit(request, state)
    except Exception as exc:
        answer = as_http(exc)
        if answer is None:
            raise
        state.metrics.requests.labels(route, str(answer.status)).inc()
        return _answer_error(request, state, answer.status, answer.body, answer.headers)
    if refusal is not None:
        state.metrics.requests.labels(route, str(refusal.status)).inc()
        return refusal
    limit = state.config.max_body_bytes
    length = request.content_length
    if length is not None and length > limit and route not in STREAMED_PATHS:
        state.metrics.requests.labels(route, "413").inc()
        return _error_response(request, 413, {"error": too_large(state.config).message}, {})
    try:
        body_coding(request)  # a body the gateway cannot decode is refused before it is sent
    except BadRequest as exc:
        answer = as_http(exc)
        assert answer is not None
        state.metrics.requests.labels(route, str(answer.status)).inc()
        return _error_response(request, answer.status, answer.body, answer.headers)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the 100 is not part of the response's own size
    return None


# The status counted for a request whose client left before its body arrived (nginx's convention).
CLIENT_GONE = 499


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = state_of(request)
    start = time.perf_counter()
    status = 500
    try:
        response = await _guarded(request, handler, state)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        if exc.status < 400:
            raise
        error, allowed = exc.reason, {}
        allow = exc.headers.get("Allow")
        if allow is not None:  # a 405: HTTP asks for the methods the path takes
            allowed["Allow"] = allow
            error = f"{request.method} is not allowed on {request.path}; it takes {allow}"
        return _error_response(request, exc.status, {"error": error}, allowed)
    except ClientGone as exc:
        # Nobody left to answer, and not the gateway's failure: no 500 in its log or metrics.
        status = CLIENT_GONE
        log.info(
            "gateway: %s %s: the client left before its body arrived (%s)", request.method, request.path, exc
        )
        return web.Response(status=CLIENT_GONE, reason="Client Closed Request")
    except Exception as exc:
        answer = as_http(exc)
        if answer is None:
            log.exception("gateway: %s %s failed", request.method, request.path)
            answer_status, body = 500, {"error": f"internal error: {type(exc).__name__}"}
            headers: dict[str, str] = {}
        else:
            answer_status, body, headers = answer.status, answer.body, answer.headers
        response = _answer_error(request, state, answer_status, body, headers)
        status = response.status  # as answered (a route's shape may answer 429 as 503 or 504)
        return response
    finally:
        state.metrics.request_answered(_route_name(request), status, time.perf_counter() - start)


async def _admit(request: web.Request, state: GatewayState) -> web.StreamResponse | None:
    """Whether this replica takes the request, and from whom: a standby's 503 (returned), or the
    caller's principal (kept on the request); raises ``Unauthenticated`` or ``Forbidden``. Asked
    once per request, by ``_expect`` where the client waits to send its body, else by ``_guarded``."""
    if _path(request) in OPEN_PATHS or PRINCIPAL_KEY in request:
        return None
    lead = state.readiness()
    if not lead.leader:
        state.metrics.refused.labels("standby").inc()
        body = {"error": "this replica is a standby; send to the leader", "leader": lead.leader_address}
        headers = {
            "Retry-After": "1",
            **({LEADER_HEADER: lead.leader_address} if lead.leader_address else {}),
        }
        return _error_response(request, 503, body, headers)
    token = _credentials(request)
    if state.auth is None:
        # Only reachable with allow_anonymous (the factory refuses otherwise).
        if not is_loopback(request.remote):
            raise Forbidden(
                "anonymous access is allowed only from loopback; this gateway has no authenticator"
            )
        request[PRINCIPAL_KEY] = ANONYMOUS
    elif token is None:
        raise Unauthenticated("missing bearer token: send Authorization: Bearer <ServiceAccount token>")
    else:
        request[PRINCIPAL_KEY] = await state.auth.authenticate(token, request.remote or "")
    return None


async def _guarded(request: web.Request, handler: Handler, state: GatewayState) -> web.StreamResponse:
    if _path(request) in OPEN_PATHS:
        return await handler(request)
    refusal = await _admit(request, state)
    if refusal is not None:
        return refusal
    route = _route_name(request)
    if route in QUERY_OF:  # an unknown path or method is answered 404 / 405 by its own handler
        check_query(request, QUERY_OF[route])
        if request.body_exists:
            body_coding(request)  # 415 for a coding the gateway does not decode, before any work
    return await handler(request)


class _ParserRefusals(logging.Filter):
    """Turns aiohttp's record of a request its HTTP parser refused (a header line over 8190 bytes,
    over 128 headers, a malformed request line) into one INFO line naming the problem: it was logged
    as an ERROR with a traceback, though the fault is the client's, and its message quoted the
    start of the offending line (``Authorization: Bearer <token>`` put the token's head in the log).
    Any other record (a handler's unhandled exception) passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if isinstance(exc, LineTooLong):
            why = f"a request line or header over {exc.args[1]} bytes"
        else:
            # llhttp's message is its description, a blank line, then the offending line quoted
            # whole (``Authorization: Bearer <token>`` with a bad character): the description only.
            said = " ".join(exc.message.split("\n\n", 1)[0].split()).rstrip(":")
            why = f"{type(exc).__name__}: {said[:120]}"
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "gateway: refused an unparsable request from %s (%s)",
            (remote, why),
            None,
            None,
        )
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


# aiohttp's server logs through this logger (``handler_args``), so that the filter sees its records.
HTTP_LOG = logging.getLogger("arl_tangram.gateway.http")
HTTP_LOG.addFilter(_ParserRefusals())


def build_gateway_app(
    service: ActionService,
    auth: Authenticator | None,
    *,
    config: GatewayConfig | None = None,
    readiness: Readiness = always_leader,
    batch_results: BatchResults | None = None,
    allow_anonymous: bool = False,
    metrics: GatewayMetrics | None = None,
    session_check_s: float = 1.0,
) -> web.Application:
    """The gateway in front of ``service``.

    ``auth`` None means no authentication, which must be asked for with ``allow_anonymous=True``
    and then serves loopback callers only. ``readiness`` says whether this replica leads;
    ``batch_results`` serves ``/v1/batches/.../results``. Idle sessions are closed by their TTL,
    and keyless actions whose caller left are cancelled (``abandoned``), both checked every
    ``session_check_s`` seconds.
    """
    if auth is None and not allow_anonymous:
        raise ValueError("no authenticator given: pass one, or allow_anonymous=True for loopback-only use")
    config = config or GatewayConfig()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_guard],
        # Bodies are decoded by the gateway (``parsing.body_coding``), so that a coding it cannot
        # decode is answered 415 in JSON, not by aiohttp's parser (plain text and a traceback).
        handler_args={"auto_decompress": False, "logger": HTTP_LOG},
    )
    state = GatewayState(
        service=service,
        auth=auth,
        config=config,
        metrics=metrics or GatewayMetrics(),
        admission=Admission(
            config.max_in_flight_per_pool, config.max_in_flight_per_tenant, config.retry_after_s
        ),
        sessions=SessionRegistry(service, config.max_sessions_per_tenant, config.retry_after_s),
        readiness=readiness,
        batch_results=batch_results,
        abandoned=Abandoned(service),
    )
    app[STATE] = state
    for route in ROUTES:
        for path in (route.doc.path, f"{route.doc.path}/"):  # the twin: see ``_unslashed``
            app.router.add_route(route.doc.method, path, route.handler, expect_handler=_expect)
            if route.doc.method == "GET":
                # HTTP asks every server to take HEAD wherever it takes GET (RFC 9110 9.1): a load
                # balancer's HEAD /healthz was answered 405. aiohttp answers it without the body.
                app.router.add_route("HEAD", path, route.handler, expect_handler=_expect)
    spec = json.dumps(openapi([r.doc for r in ROUTES])).encode()

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=spec, content_type="application/json")

    app.router.add_get("/openapi.json", openapi_json)

    async def janitor(app: web.Application) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(state.sessions.janitor(session_check_s)),
            asyncio.create_task(state.abandoned.janitor(session_check_s)),
        ]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.cleanup_ctx.append(janitor)
    return app
