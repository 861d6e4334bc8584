"""The native API: one action, a stream of actions, sessions, and batches' full results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from arl_tangram.api.actionpool import LANGUAGES as POOL_LANGUAGES
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.batches import action_payload
from arl_tangram.errors import InvalidSpec, NotFound
from arl_tangram.gateway.auth import Forbidden
from arl_tangram.gateway.config import ACTION_KEY_HEADER
from arl_tangram.gateway.errors import HttpError, as_http
from arl_tangram.gateway.keys import scoped_key, unscoped_key
from arl_tangram.gateway.models import (
    ActionResultBody,
    CancelActions,
    CancelledActions,
    GatewayAction,
    SessionAction,
    SessionBody,
    SessionCreate,
    StreamError,
)
from arl_tangram.gateway.parsing import (
    BadRequest,
    body_chunks,
    loads,
    parse,
    read_json,
    unreadable_body,
    validate,
)
from arl_tangram.gateway.routing import valid_namespace
from arl_tangram.gateway.sessions import GatewaySession
from arl_tangram.gateway.state import GatewayState, authorize, state_of
from arl_tangram.sandbox.actions import MAX_KEY_CHARS, parse_action_key

log = logging.getLogger(__name__)
# Every language a pool may declare: the gateway does not hold each pool's list, and the agent
# refuses one its image does not offer, by name. (It was the python and bash of LANGUAGE_RUNTIMES,
# so a native action in cpp was refused as "not among the pool's languages ['python', 'bash']" on a
# pool that declares cpp, though the agent's /v1/execute runs it.)
ALL_LANGUAGES = POOL_LANGUAGES


def caller_key(request: web.Request, body_key: str | None) -> str | None:
    """The idempotency key from the header or the body (they must agree when both are given)."""
    header = parse_action_key(request.headers.get(ACTION_KEY_HEADER))
    if header is not None and body_key is not None and header != body_key:
        raise InvalidSpec("key", f"the body's key {body_key!r} differs from {ACTION_KEY_HEADER} {header!r}")
    return header if header is not None else body_key


def build_request(
    action: Any, namespace: str, target: str, key: str, session: str | None = None
) -> ActionRequest:
    """A gateway action (native or in a session) as the dispatcher's request. The payload goes
    through the same translation as an ActionBatch action's, so both doors accept the same payloads."""
    kind = action.type
    payload = action_payload(kind, action.payload, ALL_LANGUAGES)
    units = action.units
    return ActionRequest(
        key=key,
        namespace=namespace,
        target=target,
        kind=kind,
        payload=payload,
        units_min=units.min if units else 1,
        units_max=units.max if units else 1,
        timeout_s=float(action.timeout_seconds) if action.timeout_seconds else None,
        session=session,
        # As for an ActionBatch (domain.batches.batch_request): the API's priority is "higher runs
        # first"; the scheduler's class 0 is the most urgent.
        priority=max(0, 1000 - action.priority),
    )


def result_body(outcome: ActionOutcome, action_id: str | None) -> dict[str, Any]:
    return ActionResultBody(
        id=action_id,
        key=unscoped_key(outcome.key),
        state=outcome.state,
        reason=outcome.reason.value if outcome.reason else None,
        message=outcome.message,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        reward=outcome.reward,
        duration_seconds=round(outcome.duration_s, 6),
        queued_seconds=round(outcome.queued_s, 6),
        attempts=outcome.attempts,
        host=outcome.host,
        cores=list(outcome.cores),
        truncated=outcome.truncated,
        response=dict(outcome.response),
    ).model_dump(mode="json", by_alias=True)


def keyless_caller(
    request: web.Request, key: str | None, session: GatewaySession | None = None
) -> web.Request | None:
    """The caller whose leaving cancels the action (``run_action``): one that sent no key, outside a
    session. A session's call is not: stopping it stops the session's interpreter, whose state the
    caller's retry in the same session would find gone."""
    return request if key is None and session is None else None


async def run_action(
    state: GatewayState, request: ActionRequest, door: str, keyless_caller: web.Request | None = None
) -> ActionOutcome:
    """Run one action under the gateway's bounds, counted in its metrics. ``keyless_caller``: the
    HTTP request of a caller that sent no key; the action is cancelled if it leaves (``abandoned``)."""
    if state.abandoned.cancelled_early(request.key):
        # Its caller cancelled it before it got here (a stream's line read after the caller left).
        return ActionOutcome(
            request.key, Outcome.CANCELLED, Reason.CANCELLED, "cancelled by its caller before it started"
        )
    with state.admission.hold(f"{request.namespace}/{request.target}", request.tenant_name):
        state.metrics.in_flight.inc()
        if keyless_caller is not None:
            state.abandoned.watch(request.key, keyless_caller)
        try:
            outcome = await state.service.run(request)
        finally:
            state.metrics.in_flight.dec()
            if keyless_caller is not None:
                state.abandoned.forget(request.key)
    state.metrics.action_finished(door, outcome.state.value, outcome.reason.value if outcome.reason else "")
    return outcome


def refused_payload(outcome: ActionOutcome) -> ActionOutcome:
    """The outcome, unless the target refused the payload (400) or the action asks for more units than
    the pool can ever grant (422): that is the caller's bad input, answered as any other (the native
    doors only; trainers' shapes keep theirs)."""
    if outcome.reason is Reason.INVALID_PAYLOAD:
        raise InvalidSpec("payload", outcome.message or "the target refused the payload")
    if outcome.reason is Reason.CAPACITY_EXCEEDED:
        raise BadRequest(
            422, f"units: {outcome.message or 'more than the pool can ever grant'}", field="units"
        )
    return outcome


async def _prepare(
    request: web.Request, data: Any, where: str = ""
) -> tuple[GatewayAction, ActionRequest, GatewaySession | None]:
    """The action, its dispatcher request, and the open session its ``sessionId`` names (if any;
    no await between its check here and the caller's ``_in_use``)."""
    state = state_of(request)
    action = validate(GatewayAction, data, where)
    namespace = action.namespace or state.config.default_namespace
    await authorize(request, namespace)
    session = None if action.session_id is None else _open_session_of(state, action, namespace)
    key = scoped_key(namespace, caller_key(request, action.key) if not where else action.key)
    return action, build_request(action, namespace, action.target, key, action.session_id), session


def _open_session_of(state: GatewayState, action: Any, namespace: str) -> GatewaySession:
    """The open session an action's ``sessionId`` names, in its namespace and pool. An id nobody
    opened here started a session of that name that the gateway neither bounded nor expired nor
    could close (a typo of a real id ran in an empty workdir, and its state stayed on the host)."""
    sid = action.session_id
    session = state.sessions.sessions.get(sid)
    if session is None or session.namespace != namespace:
        # As for a session the caller may not see: nothing about others' sessions leaks.
        raise NotFound(
            "session", sid, f"no open session {sid!r} (closed, expired, or never opened: POST /v1/sessions)"
        )
    if session.pool != action.target:
        raise InvalidSpec("target", f"session {sid!r} is in pool {session.pool!r}, not {action.target!r}")
    return session


@contextlib.contextmanager
def _in_use(state: GatewayState, session: GatewaySession | None) -> Iterator[None]:
    """Hold ``session`` busy (its TTL does not run out) while a call uses it, and count the call
    as its last use."""
    if session is None:
        yield
        return
    session.busy += 1
    try:
        yield
    finally:
        session.busy -= 1
        session.last_used = state.sessions.clock()


async def post_action(request: web.Request) -> web.Response:
    """``POST /v1/actions``: run one action; answer with its result when it ends."""
    state = state_of(request)
    data = await _read(request, state)
    action, req, session = await _prepare(request, data)
    keyless = keyless_caller(request, caller_key(request, action.key), session)
    with _in_use(state, session):
        outcome = refused_payload(await run_action(state, req, "native", keyless))
    return web.json_response(result_body(outcome, action.id))


async def cancel_actions(request: web.Request) -> web.Response:
    """``POST /v1/actions:cancel``: stop the caller's actions by their keys (queued: dropped;
    running: stopped on their agents). Authorised as running them is, in their namespace."""
    state = state_of(request)
    body = await parse(request, CancelActions, state.config)
    namespace = body.namespace or state.config.default_namespace
    await authorize(request, namespace)
    keys = list(dict.fromkeys(body.keys))
    # Together: stopping a running one waits for its agent to confirm the kill.
    stopped = await asyncio.gather(*(state.abandoned.cancel(scoped_key(namespace, k)) for k in keys))
    answer = CancelledActions(
        cancelled=[k for k, yes in zip(keys, stopped, strict=True) if yes],
        not_running=[k for k, yes in zip(keys, stopped, strict=True) if not yes],
    )
    return web.json_response(answer.model_dump(by_alias=True))


async def _read(request: web.Request, state: GatewayState) -> Any:
    return await read_json(request, state.config, unique_keys=True)


async def _lines(request: web.Request, limit: int) -> AsyncIterator[tuple[int, bytes | None]]:
    """The request body's lines, numbered from 1; a line over ``limit`` bytes comes as None (and is
    skipped to its end), so that one huge line costs a refusal, not the gateway's memory."""
    buffer = bytearray()
    number = 0
    skipping = False
    async for chunk in body_chunks(request):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                if not skipping:
                    buffer += chunk[start:]
                    if len(buffer) > limit:
                        skipping = True
                        buffer.clear()
                break
            number += 1
            if skipping or len(buffer) + end - start > limit:
                # Over the limit whether it came in pieces or in one chunk with its newline (that
                # one was never measured, and ran however long it was).
                skipping = False
                buffer.clear()
                yield number, None
            else:
                buffer += chunk[start:end]
                line = bytes(buffer)
                buffer.clear()
                if line.strip():
                    yield number, line
            start = end + 1
    if skipping:
        yield number + 1, None
    elif buffer.strip():
        yield number + 1, bytes(buffer)


def _refusal(number: int, exc: Exception, data: Any) -> bytes:
    answer = as_http(exc)
    if answer is None:
        log.error("action on line %d failed inside the gateway", number, exc_info=exc)
        answer = HttpError(500, {"error": f"internal error: {type(exc).__name__}"})
    ident = data.get("id") if isinstance(data, dict) else None
    key = data.get("key") if isinstance(data, dict) else None
    line = StreamError(
        id=ident if isinstance(ident, str) else None,
        key=key if isinstance(key, str) and len(key) <= MAX_KEY_CHARS else None,
        line=number,
        status=answer.status,
        error=str(answer.body.get("error")),
        field=answer.body.get("field"),
        retry_after=answer.body.get("retryAfter"),
    )
    return line.model_dump_json(by_alias=True, exclude_none=True).encode() + b"\n"


async def post_stream(request: web.Request) -> web.StreamResponse:
    """``POST /v1/actions:stream``: NDJSON actions in, NDJSON results out in completion order.

    At most ``stream_in_flight`` actions of one stream are outstanding (running, or finished and not
    yet written back); past that the gateway stops reading the request, so a fast sender is held by
    TCP flow control. A line that cannot run gets a line of its own with the status and message
    ``POST /v1/actions`` would answer; the other lines go on. A client that goes away does not cancel
    its keyed actions: they finish, and a retry with the same keys gets their results. Its keyless
    ones are cancelled, as ``POST /v1/actions``'s (``abandoned``): nobody could fetch them.
    """
    state = state_of(request)
    limit = state.config.max_body_bytes
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    listening = await _begin(response, request)
    slots = asyncio.Semaphore(state.config.stream_in_flight)
    done: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    async def one(number: int, raw: bytes | None) -> None:
        data: Any = None
        try:
            if raw is None:
                raise BadRequest(413, f"line {number} exceeds the limit of {limit} bytes")
            data = loads(raw, unique_keys=True)
            action, req, session = await _prepare(request, data, where=f"line {number}")
            keyless = keyless_caller(request, action.key, session)
            with _in_use(state, session):
                outcome = refused_payload(await run_action(state, req, "stream", keyless))
            line = json.dumps(result_body(outcome, action.id)).encode() + b"\n"
        except Exception as exc:
            line = _refusal(number, exc, data)
        await done.put(line)

    async def read() -> None:
        try:
            async for number, raw in _lines(request, limit):
                await slots.acquire()
                task = asyncio.create_task(one(number, raw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (RequestPayloadError, BadRequest) as exc:
            # The body itself cannot be decoded (a corrupt Content-Encoding): a line says so, and
            # the connection is closed (the rest of the body is not read).
            refusal = unreadable_body(request, exc) if isinstance(exc, RequestPayloadError) else exc
            await slots.acquire()
            await done.put(_refusal(0, refusal, None))
            response.force_close()
        except Exception as exc:
            # The request stream broke (the client died mid-upload): what arrived still runs.
            log.info("stream from %s broke after some lines: %r", request.remote, exc)
        finally:
            while tasks:
                # wait, not gather: nothing here may cancel an action that has begun.
                await asyncio.wait(set(tasks))
            await done.put(None)

    reader = asyncio.create_task(read())
    # A client that left is no reason to stop: its actions run on (and the lines still unread are
    # read), so that a retry with the same keys finds them done instead of half of them never begun.
    while (line := await done.get()) is not None:
        if listening:
            try:
                await response.write(line)
            except ConnectionError as exc:
                listening = False
                log.info("stream client %s left: %r", request.remote, exc)
        slots.release()
    await reader
    if listening:
        with contextlib.suppress(ConnectionError):  # it left just as the stream ended
            await response.write_eof()
    return response


async def _begin(response: web.StreamResponse, request: web.Request) -> bool:
    """Send the answer's headers; False when the client has already gone."""
    try:
        await response.prepare(request)
    except ConnectionError as exc:
        log.info("stream client %s left before the answer began: %r", request.remote, exc)
        return False
    return True


# ---- sessions ------------------------------------------------------------------------------------------
def _session_body(state: GatewayState, session: GatewaySession) -> dict[str, Any]:
    return SessionBody(
        id=session.id,
        namespace=session.namespace,
        pool=session.pool,
        ttl_seconds=session.ttl_s,
        expires_in_seconds=round(session.expires_in(state.sessions.clock()), 3),
    ).model_dump(by_alias=True)


async def open_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions``: open a session in a pool."""
    state = state_of(request)
    body = await parse(request, SessionCreate, state.config)
    namespace = body.namespace or state.config.default_namespace
    await authorize(request, namespace)
    # The pool's sessions.ttlSeconds is the default and the most a caller may ask for (its owner
    # bounds how long its hosts keep an idle trajectory's state), within the gateway's own bound.
    pool_ttl = await state.sessions.pool_ttl_s(namespace, body.pool)
    limit = state.config.max_session_ttl_s
    if pool_ttl is None:
        default, bound = state.config.session_ttl_s, f"{limit:g} seconds"
    else:
        default = min(pool_ttl, limit)
        bound = f"{default:g} seconds (pool {body.pool}'s sessions.ttlSeconds is {pool_ttl:g})"
        limit = default
    ttl = body.ttl_seconds or default
    if ttl > limit:
        # Out of range, as every such value: 422 with the field (it was a 400).
        raise BadRequest(422, f"ttlSeconds: must be at most {bound}", field="ttlSeconds")
    session = await state.sessions.open(namespace, body.pool, ttl)
    state.metrics.sessions.set(len(state.sessions.sessions))
    return web.json_response(_session_body(state, session), status=201)


async def _session(request: web.Request, verb: str) -> GatewaySession:
    state = state_of(request)
    sid = request.match_info["sid"]
    session = state.sessions.sessions.get(sid)
    if session is None:
        raise _no_session(sid)
    try:
        await authorize(request, session.namespace, verb)
    except Forbidden:
        # Answered as a session that does not exist: a 403 told another tenant that the id is
        # open, and in which namespace.
        raise _no_session(sid) from None
    if state.sessions.sessions.get(sid) is not session:
        raise _no_session(sid)  # closed (its TTL, or another call) while the caller was authorised
    return session


def _no_session(sid: str) -> NotFound:
    return NotFound("session", sid, f"no open session {sid!r} (closed, expired, or never opened)")


async def get_session(request: web.Request) -> web.Response:
    """``GET /v1/sessions/{id}``: the session; ``410`` with ``reason: SessionLost`` once its state is
    gone (its host lost), as its actions are answered (it stays listed until closed or expired)."""
    state = state_of(request)
    session = await _session(request, "get")
    lost = state.sessions.lost(session)
    if lost is not None:
        return web.json_response(
            {"error": lost, "reason": Reason.SESSION_LOST.value, "id": session.id}, status=410
        )
    return web.json_response(_session_body(state, session))


async def run_in_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/actions``: run one action in the session (in order with its others)."""
    state = state_of(request)
    session = await _session(request, "create")
    # Busy from here: a body slow to arrive must not see its session expire under it.
    with _in_use(state, session):
        data = await _read(request, state)
        action: Any = validate(SessionAction, data)
        if action.type not in ("code", "test"):
            raise InvalidSpec("type", f"only code and test actions run in a session, not {action.type!r}")
        key = scoped_key(session.namespace, caller_key(request, action.key))
        req = build_request(action, session.namespace, session.pool, key, session.id)
        outcome = refused_payload(await run_action(state, req, "session"))
    return web.json_response(result_body(outcome, action.id))


async def close_session(request: web.Request) -> web.Response:
    """``DELETE /v1/sessions/{id}``."""
    state = state_of(request)
    session = await _session(request, "create")
    await state.sessions.close(session.id)
    state.metrics.sessions.set(len(state.sessions.sessions))
    return web.json_response({"closed": session.id})


# ---- batches -------------------------------------------------------------------------------------------
async def batch_results(request: web.Request) -> web.StreamResponse:
    """``GET /v1/batches/{namespace}/{name}/results``: every result of a batch, as NDJSON."""
    state = state_of(request)
    namespace = valid_namespace(request.match_info["namespace"], "namespace")
    name = request.match_info["name"]
    await authorize(request, namespace, "get")
    if state.batch_results is None:
        raise NotFound("ActionBatch", f"{namespace}/{name}", "this gateway serves no batch results")
    results = await state.batch_results.results(namespace, name)
    if results is None:
        raise NotFound("ActionBatch", f"{namespace}/{name}", f"no ActionBatch {namespace}/{name} is known")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        async for item in results:
            await response.write(json.dumps(item).encode() + b"\n")
        await response.write_eof()
    except ConnectionError as exc:
        log.info("batch results to %s cut short: %r", request.remote, exc)
    return response
