"""The agent's HTTP face: the native API, SandboxFusion's ``/run_code``, health and metrics.

Routes
- ``POST /v1/execute``: run one action (optionally in a session, optionally on granted cores).
- ``POST /v1/sessions``, ``GET|DELETE /v1/sessions/{id}``: sessions (one per trajectory).
- ``PUT|GET /v1/sessions/{id}/files/{path}``: upload / download a file of a session's workdir.
- ``POST /run_code``: SandboxFusion-compatible; ``GET /v1/ping`` answers ``pong`` as SandboxFusion does.
- ``GET /v1/health`` (also ``/healthz``): the fork server runs; isolation in force; cores and sessions.
- ``GET /metrics``: Prometheus text format.
- ``GET /v1/actions``, ``GET|DELETE /v1/actions/{key}``: actions sent with ``X-Tangram-Action-Key``
  (exactly-once dispatch, see actions.py): list them, fetch one's stored response, cancel one.

Every bad request gets a JSON body naming the problem: 400 for malformed JSON or an invalid value,
422 for a wrong shape or type, 413 for a body over the limit, 503 (with Retry-After) when the host is
full for now. Nothing the caller sends can make the handler answer 500 on purpose.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from arl_tangram.errors import CapacityExceeded, InfrastructureError, InvalidSpec, NotReady
from arl_tangram.labelled import Labelled
from arl_tangram.sandbox import workfiles
from arl_tangram.sandbox.actions import (
    ACTION_KEY_HEADER,
    CORES_HEADER,
    REPLAYED_HEADER,
    ActionControl,
    ActionEntry,
    ActionStore,
    StoredResponse,
    parse_action_key,
    parse_cores_header,
)
from arl_tangram.sandbox.builds import sandboxfusion_text
from arl_tangram.sandbox.config import AgentConfig
from arl_tangram.sandbox.executor import ActionResult, ActionSpec, Executor
from arl_tangram.sandbox.languages import compiles, known_name, unavailable_language
from arl_tangram.sandbox.models import (
    JUPYTER_MARGIN_S,
    RETRY_LATER_STATUS,
    SANDBOXFUSION_PATHS,
    ExecuteRequest,
    Notebook,
    RunCodeRequest,
    RunJupyterRequest,
    SessionRequest,
    run_code_status,
)

log = logging.getLogger(__name__)
EXECUTOR: web.AppKey[Executor] = web.AppKey("executor", Executor)
OPEN_PATHS = ("/v1/health", "/healthz", "/metrics", "/v1/ping")
# SandboxFusion's language names that map onto our runtimes.
LANGUAGES = {"python": "python", "python3": "python", "bash": "bash", "sh": "bash", "pytest": "pytest"}


class Metrics:
    """The agent's Prometheus metrics, in a registry of its own (several agents may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.actions = Counter(
            "tangram_sandbox_actions",
            "Actions run, by API, runtime and outcome",
            ["api", "runtime", "outcome"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "tangram_sandbox_action_seconds",
            "Wall-clock time of actions inside the sandbox",
            ["runtime"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.rejected = Counter(
            "tangram_sandbox_rejected_requests",
            "Requests refused, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.cores_busy = Gauge("tangram_sandbox_cores_busy", "Cores held by actions", registry=self.registry)
        self.cores_total = Gauge("tangram_sandbox_cores", "Cores this agent manages", registry=self.registry)
        self.sessions = Gauge("tangram_sandbox_sessions", "Open sessions", registry=self.registry)
        self.waiting = Gauge(
            "tangram_sandbox_waiting_requests", "Requests queued for a slot", registry=self.registry
        )

        # Each action's children (APIs x runtimes x outcomes: few).
        self._counted = Labelled(self.actions)
        self._timed = Labelled(self.seconds)

    def record(self, api: str, runtime: str, result: ActionResult) -> None:
        """Count one finished action."""
        self._counted(api, runtime, result.outcome).inc()
        self._timed(runtime).observe(result.wall_s)


METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
ACTIONS: web.AppKey[ActionStore] = web.AppKey("actions", ActionStore)


# How long ``DELETE /v1/actions/{key}`` waits for the killed action's end before answering.
CANCEL_WAIT_S = 5.0
# The longest ``GET /v1/actions/{key}?wait=`` honoured (a client wanting longer asks again).
MAX_ACTION_WAIT_S = 3600.0


class BadRequest(Exception):
    """A request we refuse, with its HTTP status and a message naming the problem."""

    def __init__(self, status: int, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app[EXECUTOR].config.max_body_bytes
        raise BadRequest(413, f"request body exceeds the limit of {limit} bytes") from exc


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await _read_body(request)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad syntax or encoding, and also an integer past Python's digit limit;
        # RecursionError: nesting deeper than the decoder goes.
        raise BadRequest(400, f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(422, f"the body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        detail = [
            {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]}
            for err in exc.errors(include_url=False, include_input=False)
        ]
        summary = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in detail)
        raise BadRequest(422, f"invalid request: {summary}", detail) from exc


def _decode_files(files: dict[str, str] | dict[str, str | None]) -> dict[str, bytes]:
    """A request's ``files`` (path -> base64), checked before anything runs.

    As SandboxFusion does, a file whose content is null, or whose name contains
    ``IGNORE_THIS_FILE``, is not written (clients use both as placeholders)."""
    out = {}
    for path, content in files.items():
        if content is None or IGNORED_FILE_MARK in path:
            continue
        # By the path it is written to: two names of one file ("main.c" and "./main.c", "a/b" and
        # "a//b") would otherwise be written in turn, the later one winning over the request's own
        # code or another file, and a build cached under one order served for the other.
        name = "/".join(workfiles.split_relpath(f"files[{path!r}]", path))
        if name in out:
            raise InvalidSpec(f"files[{path!r}]", f"names the same file ({name!r}) as another entry")
        try:
            # Line breaks and spaces are allowed, as SandboxFusion (b64decode without validation)
            # allows them: base64.encodebytes and MIME encoders break lines every 76 characters.
            # Anything else outside the alphabet is refused, where SandboxFusion drops it unsaid.
            out[name] = base64.b64decode("".join((content or "").split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidSpec(f"files[{path!r}]", f"not valid base64: {exc}") from exc
    return out


IGNORED_FILE_MARK = "IGNORE_THIS_FILE"


def _checked_fetch_files(paths: list[str]) -> list[str]:
    """A request's ``fetch_files``, refused before the action runs when a path leaves the workdir."""
    for path in paths:
        workfiles.split_relpath(f"fetch_files[{path!r}]", path)
    return paths


def _error_response(status: int, message: str, extra: dict[str, Any] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if extra:
        body.update(extra)
    return web.json_response(body, status=status)


def _authorized(request: web.Request, token: str) -> bool:
    # Constant-time: with --network-allowed the actions themselves can reach this port and time us.
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode())


REFUSALS = (BadRequest, InvalidSpec, CapacityExceeded, NotReady, InfrastructureError)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn the error taxonomy into clear JSON answers, in the shape of the API that was called."""
    metrics = request.app[METRICS]
    config = request.app[EXECUTOR].config
    if config.token and request.path not in OPEN_PATHS and not _authorized(request, config.token):
        metrics.rejected.labels("unauthorized").inc()
        return _error_response(401, "missing or wrong bearer token")
    try:
        return await handler(request)
    except REFUSALS as exc:
        return _refusal(request, exc)


def _refusal(request: web.Request, exc: Exception) -> web.Response:
    """The JSON answer to a refused request (one of ``REFUSALS``), in the shape of the API called."""
    extra: dict[str, Any] = {}
    label = None
    if isinstance(exc, NotReady):
        status, message, label = 503, str(exc), "not_ready"
    elif isinstance(exc, BadRequest):
        status, message = exc.status, exc.message
        if exc.detail is not None:
            extra["detail"] = exc.detail
    elif isinstance(exc, InvalidSpec):
        status, message = 400, str(exc)
        extra["field"] = exc.field
    elif isinstance(exc, CapacityExceeded):
        status, message = 422, str(exc)
    else:
        status, message = 503, f"sandbox infrastructure failed: {exc}"
    request.app[METRICS].rejected.labels(label or str(status)).inc()
    if request.path in SANDBOXFUSION_PATHS:
        extra.update({"status": "SandboxError", "message": message})
        status = run_code_status(status)
    resp = _error_response(status, message, extra)
    if isinstance(exc, NotReady):
        resp.headers["Retry-After"] = str(int(exc.delay))
    return resp


# ---- handlers ------------------------------------------------------------------------------------------
async def execute(request: web.Request) -> web.Response:
    """``POST /v1/execute``."""
    key = parse_action_key(request.headers.get(ACTION_KEY_HEADER))
    body: ExecuteRequest = await _parse(request, ExecuteRequest)
    spec = ActionSpec(
        runtime=body.runtime,
        code=body.code,
        stdin=body.stdin,
        timeout_s=body.timeout_s,
        memory_mb=body.memory_mb,
        cores=body.cores,
        ncores=body.ncores,
        session_id=body.session_id,
        compile_timeout_s=body.compile_timeout_s,
        files=_decode_files(body.files),
        fetch_files=_checked_fetch_files(body.fetch_files),
        args=body.args,
    )
    return await _keyed(request, key, spec, lambda control: _execute_action(request, spec, control))


async def _execute_action(
    request: web.Request, spec: ActionSpec, control: ActionControl | None
) -> web.Response:
    result = await request.app[EXECUTOR].run(spec, control)
    request.app[METRICS].record("native", spec.runtime, result)
    return web.json_response(
        {
            "status": result.outcome,
            "exit_code": result.exit_code,
            "signal": result.signal,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "stdout_truncated": result.stdout_truncated,
            "stderr_truncated": result.stderr_truncated,
            "wall_s": result.wall_s,
            "cpu_s": result.cpu_s,
            "max_rss_kb": result.max_rss_kb,
            "cores": result.cores,
            "session_id": result.session_id,
            "interpreter_restarted": result.interpreter_restarted,
            "message": result.message,
            "notes": result.notes,
            "compile": None if result.compile is None else result.compile.as_dict(),
            "files": {
                k: base64.b64encode(v).decode() if v is not None else None for k, v in result.files.items()
            },
        }
    )


async def run_code(request: web.Request) -> web.Response:
    """``POST /run_code`` with SandboxFusion's request and response shapes (plus extra fields)."""
    key = parse_action_key(request.headers.get(ACTION_KEY_HEADER))
    cores = parse_cores_header(request.headers.get(CORES_HEADER))
    body: RunCodeRequest = await _parse(request, RunCodeRequest)
    executor = request.app[EXECUTOR]
    runtime = LANGUAGES.get(body.language) or known_name(body.language)
    if runtime is None or not (runtime in executor.config.runtimes or executor.builder.offers(runtime)):
        # SandboxFusion's answers: 422 for a name it does not know, its response shape otherwise.
        offered = [k for k, v in LANGUAGES.items() if v in executor.config.runtimes]
        offered += executor.builder.names()
        status, answer = unavailable_language(body.language, offered, executor.builder.detection.missing)
        return web.json_response(answer, status=status)
    limits = _within_ceilings(request.app, body)
    spec = ActionSpec(
        runtime=runtime,
        code=body.code,
        stdin=body.stdin,
        timeout_s=limits.run_timeout,
        compile_timeout_s=limits.compile_timeout,
        memory_mb=limits.memory_mb,
        files=_decode_files(body.files),
        # Not refused here: as SandboxFusion leaves out a file it cannot return, a path outside the
        # workdir is left out of ``files`` with a note saying why (the action still runs).
        fetch_files=body.fetch_files,
        args=body.args,
        cores=cores,
        # SandboxFusion sets RLIMIT_STACK to a positive memory_limit_MB, and nothing otherwise.
        grow_stack=body.memory_limit_MB > 0,
    )
    _check_cores(executor, cores)
    return await _keyed(
        request, key, spec, lambda control: _run_code_action(request, spec, control, limits.notes)
    )


def _check_cores(executor: Executor, cores: list[int] | None) -> None:
    """The scheduler's grant (``X-Tangram-Cores``), refused by the header's name where this host
    cannot give it."""
    if cores is not None:
        try:
            executor.cores.check(frozenset(cores))
        except InvalidSpec as exc:
            raise InvalidSpec(CORES_HEADER, str(exc)) from exc


@dataclass(frozen=True)
class _RunCodeLimits:
    run_timeout: float
    compile_timeout: float
    memory_mb: int
    notes: tuple[str, ...]


# Our own names of /run_code's limits (the executor's refusals name them) -> SandboxFusion's, the
# names its client sent: an answer must speak of the fields the caller knows.
RUN_CODE_FIELDS = {
    "timeout": "run_timeout",
    "memory_mb": "memory_limit_MB",
    "compile_timeout": "compile_timeout",
}
CAPPED: web.AppKey[set[str]] = web.AppKey("capped", set)


def _within_ceilings(app: web.Application, body: RunCodeRequest) -> _RunCodeLimits:
    """``/run_code``'s limits, each held to this agent's ceiling (``--max-timeout``,
    ``--max-memory-mb``: an ActionPool's ``limits.timeoutSeconds`` and ``limits.memory``), with a
    note for each that was lowered.

    SandboxFusion refuses no limit (it only sets rlimits), and its clients always send them (verl:
    ``memory_limit_MB`` 1024 and its timeout, each configurable): refused, a value above the pool's
    limits turned every sample's reward into -1. Run at the ceiling, the verdict is the ceiling's
    (a program that needs more memory fails as out of memory, one that runs longer times out), and
    the answer's ``notes`` say so. The native API refuses such values (its own contract). Values
    that are no limit at all stay the request's error (its model: 422): a timeout not above 0, a
    memory limit of 1 to 15 MB (0 or less, SandboxFusion's -1 among them, asks for none: the
    ceiling)."""
    lim = app[EXECUTOR].config.limits
    notes: dict[str, str] = {}  # per field lowered, what the answer says of it

    def timeout(name: str, asked: float, noted: bool) -> float:
        if asked <= lim.max_timeout_s:
            return asked
        if noted:
            notes[name] = (
                f"{name} {asked:.15g} s is above the most this sandbox allows, {lim.max_timeout_s:g} s "
                f"(its pool's limits.timeoutSeconds): it ran with {lim.max_timeout_s:g} s"
            )
        return lim.max_timeout_s

    run_timeout = timeout("run_timeout", body.run_timeout, True)
    # Only a language that builds has a compile to time (SandboxFusion's default 10 s, or a client's
    # copy of its run timeout, is no part of a Python run): held all the same, noted where it counts.
    compile_timeout = timeout("compile_timeout", body.compile_timeout, compiles(body.language))
    memory_mb = body.memory_limit_MB
    if memory_mb <= 0:  # SandboxFusion's -1 (its default), or any other: no limit; here the ceiling
        memory_mb = lim.max_memory_mb
    elif memory_mb > lim.max_memory_mb:
        notes["memory_limit_MB"] = (
            f"memory_limit_MB {memory_mb} is above the most this sandbox allows, {lim.max_memory_mb} MB "
            f"(its pool's limits.memory): it ran with {lim.max_memory_mb} MB"
        )
        memory_mb = lim.max_memory_mb
    said = app[CAPPED]
    for name, note in notes.items():
        if name not in said:  # once per agent and field: the operator learns the pool is too small
            said.add(name)
            log.warning(
                "/run_code asked for more than this agent's ceiling (%s); it runs at the ceiling and "
                "says so in its answer's notes: %s (said once per field)",
                name,
                note,
            )
    return _RunCodeLimits(run_timeout, compile_timeout, memory_mb, tuple(notes.values()))


async def _run_code_action(
    request: web.Request, spec: ActionSpec, control: ActionControl | None, notes: tuple[str, ...] = ()
) -> web.Response:
    try:
        result = await request.app[EXECUTOR].run(spec, control)
    except InvalidSpec as exc:
        # Named as the client named it ("run_timeout", not our "timeout").
        name = RUN_CODE_FIELDS.get(exc.field)
        if name is None or type(exc) is not InvalidSpec:
            raise
        raise InvalidSpec(name, exc.message) from exc
    request.app[METRICS].record("run_code", spec.runtime, result)
    if notes:
        result.notes = [*notes, *result.notes]
    return web.json_response(sandboxfusion_response(result))


async def run_jupyter(request: web.Request) -> web.Response:
    """``POST /run_jupyter``: SandboxFusion's notebook call. The cells run in a real IPython kernel
    started for the call, inside the sandbox as any action's program (``jupyter_driver``)."""
    key = parse_action_key(request.headers.get(ACTION_KEY_HEADER))
    cores = parse_cores_header(request.headers.get(CORES_HEADER))
    body: RunJupyterRequest = await _parse(request, RunJupyterRequest)
    executor = request.app[EXECUTOR]
    if "jupyter" not in executor.config.runtimes:
        raise InvalidSpec(
            "kernel", "this sandbox does not offer notebooks (its --runtimes leave out jupyter)"
        )
    lim = executor.config.limits
    # The pool's limit (this agent's ceiling) bounds the cells' total, as it bounds /run_code's run;
    # the kernel's start and stop have JUPYTER_MARGIN_S on top (the executor allows them).
    total = min(body.total_timeout, lim.max_timeout_s)
    notes = []
    if total < body.total_timeout:
        notes.append(
            f"total_timeout {body.total_timeout:.15g} s is above the most this sandbox allows, "
            f"{total:g} s (its pool's limits.timeoutSeconds): it ran with {total:g} s"
        )
    notebook = Notebook(cells=body.cells, cell_timeout=body.cell_timeout, total_timeout=total)
    spec = ActionSpec(
        runtime="jupyter",
        code=notebook.model_dump_json(),
        timeout_s=total + JUPYTER_MARGIN_S,
        # SandboxFusion sets no memory limit on a notebook: here the most the pool allows.
        memory_mb=lim.max_memory_mb,
        files=_decode_files(body.files),
        fetch_files=body.fetch_files,
        cores=cores,
    )
    _check_cores(executor, cores)

    async def action(control: ActionControl | None) -> web.Response:
        result = await executor.run(spec, control)
        request.app[METRICS].record("run_jupyter", spec.runtime, result)
        result.notes = [*notes, *result.notes]
        return web.json_response(jupyter_response(result))

    return await _keyed(request, key, spec, action)


def jupyter_response(result: ActionResult) -> dict[str, Any]:
    """SandboxFusion's ``/run_jupyter`` answer for a jupyter action's ``result``.

    As there: ``Success`` when the notebook ran to its end (a cell that raised is data: its
    ``error``), with each cell's ``stdout``, ``stderr``, ``display`` and ``error``; ``Failed`` with no
    cells when it did not (``driver.status`` TimeLimitExceeded when its time ran out, Error when the
    kernel died or failed to start, with why in ``message``); ``SandboxError`` when the sandbox
    failed. ``driver`` is the driver process's run. Added keys, as on ``/run_code``: ``outcome`` and
    ``notes``, and each cell's ``status`` (ok, error or aborted, as the kernel replied)."""
    driver: dict[str, Any] = {
        "status": "Finished",
        "execution_time": round(result.wall_s, 6),
        "return_code": result.exit_code,
        "stdout": "",
        "stderr": result.stderr,
    }
    answer: dict[str, Any] = {
        "status": "Failed",
        "message": "",
        "driver": driver,
        "cells": [],
        "executor_pod_name": os.environ.get("MY_POD_NAME") or os.environ.get("POD_NAME"),
        "files": {},
        "outcome": result.outcome,
        "notes": result.notes,
    }
    if result.outcome == "sandbox_error":
        driver["status"] = "Error"
        return {**answer, "status": "SandboxError", "message": result.message}
    # A notebook that ran out of its total or lost its kernel is the executor's ``timeout`` or
    # ``failed`` (``_notebook_verdict``), its driver's answer still the stdout: read it below.
    driver_answered = result.outcome in ("timeout", "failed") and result.exit_code == 0
    if result.outcome == "timeout" and not driver_answered:
        driver.update(status="TimeLimitExceeded", return_code=None)
        return {**answer, "message": "the notebook ran past its total_timeout and was stopped"}
    if result.outcome != "ok" and not driver_answered:
        driver["stdout"] = result.stdout
        return {**answer, "message": result.message or f"the notebook's driver ended {result.outcome}"}
    if result.stdout_truncated:
        return {
            **answer,
            "message": "the notebook's output is larger than this sandbox returns (--output-bytes)",
        }
    try:
        ran = json.loads(result.stdout)
        status, message, cells = ran["status"], ran["message"], ran["cells"]
    except (ValueError, KeyError, TypeError):
        driver["stdout"] = result.stdout
        return {**answer, "message": "the notebook's driver gave no answer"}
    if status != "Finished":
        if status == "TimeLimitExceeded":
            driver["status"] = "TimeLimitExceeded"
        return {**answer, "message": message}
    files = {k: base64.b64encode(v).decode() for k, v in result.files.items() if v is not None}
    return {**answer, "status": "Success", "cells": cells, "files": files}


Action = Callable[[ActionControl | None], Awaitable[web.Response]]


def _request_digest(path: str, spec: ActionSpec) -> int:
    """What a keyed request asks for: its endpoint and its program, input, files, session and memory;
    not its cores or timeouts (a retry of the same action may come with another grant or timeout).

    Compared only within this process (the store lives and dies with it), so Python's own hash
    serves: keyed by a secret drawn at start, no caller can make two requests collide; and it reads
    every string without encoding it (a lone surrogate included)."""
    # Strings only: their hash is keyed, an int's is not (memory_mb and memory_mb + 2**61 - 1 hash
    # alike).
    memory = f"{spec.memory_mb} {spec.grow_stack}"
    what = (path, spec.runtime, spec.code, spec.stdin or "", spec.session_id or "", memory)
    return hash((what, tuple(spec.fetch_files), tuple(spec.args), tuple(sorted(spec.files.items()))))


async def _keyed(request: web.Request, key: str | None, spec: ActionSpec, action: Action) -> web.Response:
    """Run ``action`` once per key: a repeat waits for (or replays) the first one's response.

    Without a key this is just ``action``. With one, the first caller going away neither stops the
    action nor loses its response for the retry: aiohttp leaves a handler running when its client
    disconnects (``handler_cancellation`` is off, as ``serve`` sets it), so the action runs in the
    request's own task, with no task and no wait of its own per action.
    """
    if key is None:
        return await action(None)
    digest = _request_digest(request.path, spec)
    store = request.app[ACTIONS]
    entry = store.lookup(key)
    if (
        entry is not None
        and entry.digest != digest
        and entry.response is not None
        and entry.response.status != 200
    ):
        # A refusal (nothing ran) stays for the caller that may ask after it (a dispatcher whose
        # connection was cut reads it back); a corrected request under the key replaces it.
        store.forget(entry)
        entry = None
    if entry is not None:
        if entry.digest != digest:
            # A key names one request: another one under it must not get the first one's answer
            # (another program's verdict, or a native body where /run_code's shape is expected).
            message = f"{ACTION_KEY_HEADER} {key!r} was already used for a different request"
            extra: dict[str, Any] = {"field": ACTION_KEY_HEADER}
            if request.path in SANDBOXFUSION_PATHS:
                extra.update({"status": "SandboxError", "message": message})
            return _error_response(409, message, extra)
        return await _replay(entry)
    # No await between the lookup and here: a concurrent repeat finds this entry.
    entry = store.begin(key, spec.cores, spec.session_id, digest)
    try:
        response = await action(entry.control)
    except REFUSALS as exc:
        response = _refusal(request, exc)
    except Exception:
        # A bug, not an answer: said as JSON like any other, and not kept (a repeat may run it).
        log.exception("keyed action %r failed", key)
        response = _error_response(500, "internal error")
        store.finish(entry, _stored(response), keep=False)
        return response
    except BaseException:
        # Cancelled (the agent shutting down): no answer; a repeat of the key may run it again.
        store.finish(entry, _stored(_error_response(500, "internal error")), keep=False)
        raise
    # 503 (/run_code's 504): the action did not run (full, or the fork server was lost): a retry
    # may run it. A refusal of the request is kept (to be read back) until a corrected request
    # replaces it.
    store.finish(entry, _stored(response), keep=response.status not in (503, RETRY_LATER_STATUS))
    return response  # the first caller's answer is the stored one: the same status, headers, bytes


def _stored(response: web.Response) -> StoredResponse:
    body = response.body  # always bytes here: every answer is built from JSON
    assert isinstance(body, bytes | bytearray), type(body)
    headers = tuple((k, v) for k, v in response.headers.items() if k.lower() != "content-length")
    return StoredResponse(response.status, bytes(body), headers)


async def _replay(entry: ActionEntry) -> web.Response:
    if entry.response is None:
        entry.repeats += 1
        try:
            await entry.done.wait()
        finally:
            entry.repeats -= 1
    return _replayed(entry)


def _replayed(entry: ActionEntry) -> web.Response:
    """The stored response of a finished entry, marked as a replay."""
    stored = entry.response
    assert stored is not None
    resp = web.Response(status=stored.status, body=stored.body, headers=dict(stored.headers))
    resp.headers[REPLAYED_HEADER] = "1"
    return resp


async def list_actions(request: web.Request) -> web.Response:
    """``GET /v1/actions``: the keyed actions running now and those whose response is kept."""
    return web.json_response(request.app[ACTIONS].describe())


async def get_action(request: web.Request) -> web.Response:
    """``GET /v1/actions/{key}[?wait=SECONDS]``: 200 with the stored response, 202 while running."""
    key = _path_key(request)
    wait_s = 0.0
    if "wait" in request.query:
        text = request.query["wait"]
        try:
            wait_s = float(text)
        except ValueError:
            wait_s = -1.0
        if not 0 <= wait_s <= MAX_ACTION_WAIT_S:
            raise InvalidSpec("wait", f"{text!r} is not a number of seconds in [0, {MAX_ACTION_WAIT_S:g}]")
    entry = request.app[ACTIONS].lookup(key)
    if entry is None:
        return _error_response(404, f"no action with key {key!r} is running or remembered on this host")
    if entry.response is None and wait_s > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(entry.done.wait(), timeout=wait_s)
    if entry.response is None:
        return web.json_response({"state": "running"}, status=202)
    return _replayed(entry)


async def cancel_action(request: web.Request) -> web.Response:
    """``DELETE /v1/actions/{key}``: kill a running action's whole process tree.

    Answers once the action has ended (its own request answers ``cancelled`` at the same time),
    within a few seconds: a kill is immediate, but its pipes may be held a moment longer.
    """
    key = _path_key(request)
    entry = request.app[ACTIONS].lookup(key)
    if entry is None:
        return _error_response(404, f"no action with key {key!r} is running on this host")
    if entry.response is not None:
        return _error_response(409, f"the action with key {key!r} has already finished")
    entry.control.cancel()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(entry.done.wait(), timeout=CANCEL_WAIT_S)
    return web.json_response({"cancelled": True})


def _path_key(request: web.Request) -> str:
    key = parse_action_key(request.match_info["key"])
    assert key is not None
    return key


def sandboxfusion_response(result: ActionResult) -> dict[str, Any]:
    """SandboxFusion's response for ``result``.

    Its fields and values are kept exactly (``status``: Success | Failed | SandboxError; run status
    Finished | Error | TimeLimitExceeded, a non-zero exit being Finished with Failed overall). What
    its users lack is added as new keys, which clients that know only the original ignore:
    ``run_result.memory_limit_exceeded``, ``stdout_truncated``, ``stderr_truncated``, ``signal``,
    ``max_rss_kb``, a top-level ``outcome`` (ok | failed | timeout | memory_limit_exceeded |
    sandbox_error), and ``notes`` (why a requested file is not in ``files`` when it exists).
    """
    if result.outcome == "sandbox_error":
        run_status, status = "Error", "SandboxError"
    elif result.outcome == "cancelled":
        run_status, status = "Error", "Failed"
    elif result.outcome == "timeout":
        run_status, status = "TimeLimitExceeded", "Failed"
    else:
        run_status = "Finished"
        status = "Success" if result.exit_code == 0 else "Failed"
    return {
        "status": status,
        "message": result.message if result.outcome in ("sandbox_error", "cancelled") else "",
        "compile_result": None if result.compile is None else result.compile.as_dict(sandboxfusion=True),
        # A failed compile ends the action: no run, as in SandboxFusion.
        "run_result": None
        if result.compile is not None and not result.compile.ok
        else {
            "status": run_status,
            "execution_time": round(result.wall_s, 6),
            "return_code": None if result.outcome == "timeout" else result.exit_code,
            "stdout": sandboxfusion_text(result.stdout, result.stdout_undecodable),
            "stderr": sandboxfusion_text(result.stderr, result.stderr_undecodable),
            "memory_limit_exceeded": result.outcome == "memory_limit_exceeded",
            "stdout_truncated": result.stdout_truncated,
            "stderr_truncated": result.stderr_truncated,
            "signal": result.signal,
            "max_rss_kb": result.max_rss_kb,
        },
        "executor_pod_name": os.environ.get("MY_POD_NAME") or os.environ.get("POD_NAME"),
        "files": {k: base64.b64encode(v).decode() for k, v in result.files.items() if v is not None},
        "outcome": result.outcome,
        "notes": result.notes,
    }


async def create_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions``."""
    body: SessionRequest = await _parse(request, SessionRequest)
    session = await request.app[EXECUTOR].create_session(body.persistent, body.ttl_s, body.memory_mb)
    return web.json_response(session.describe(), status=201)


async def get_session(request: web.Request) -> web.Response:
    """``GET /v1/sessions/{id}``: its state and the memory it accounts for."""
    session = request.app[EXECUTOR].get_session(request.match_info["sid"])
    # Off the event loop: describing walks the workdir, which the session's code may have filled
    # with a million files.
    return web.json_response(await asyncio.to_thread(session.describe))


async def close_session(request: web.Request) -> web.Response:
    """``DELETE /v1/sessions/{id}``."""
    await request.app[EXECUTOR].close_session(request.match_info["sid"])
    return web.json_response({"closed": request.match_info["sid"]})


async def put_file(request: web.Request) -> web.Response:
    """``PUT /v1/sessions/{id}/files/{path}``: the body is the file's content."""
    executor = request.app[EXECUTOR]
    session = executor.get_session(request.match_info["sid"])
    path = request.match_info["path"]
    data = await _read_body(request)
    if len(data) > executor.config.max_file_bytes:
        raise BadRequest(413, f"file exceeds the limit of {executor.config.max_file_bytes} bytes")
    workfiles.write_file(session.workdir, "path", path, data, session.uid)
    return web.json_response({"path": path, "bytes": len(data)}, status=201)


async def get_file(request: web.Request) -> web.StreamResponse:
    """``GET /v1/sessions/{id}/files/{path}``."""
    executor = request.app[EXECUTOR]
    session = executor.get_session(request.match_info["sid"])
    path = request.match_info["path"]
    data = workfiles.read_file(session.workdir, "path", path, executor.config.max_file_bytes)
    if data is None:
        return _error_response(404, f"no regular file {path!r} in the session's workdir")
    return web.Response(body=data, content_type="application/octet-stream")


async def health(request: web.Request) -> web.Response:
    """``GET /v1/health``: 200 when the fork server runs, else 503."""
    executor = request.app[EXECUTOR]
    ok = executor.healthy
    return web.json_response(
        {
            "status": "ok" if ok else "degraded",
            "isolation": executor.isolation,
            "runtimes": list(executor.config.runtimes),
            "languages": executor.builder.describe(),
            # ids: the operator's scheduler grants these exact cores (see dispatch/).
            "cores": {
                "total": len(executor.cores.cores),
                "busy": executor.cores_busy,
                "ids": sorted(executor.cores.cores),
            },
            "sessions": len(executor.sessions),
            "outcomes": executor.counts,
        },
        status=200 if ok else 503,
    )


async def ping(request: web.Request) -> web.Response:
    """``GET /v1/ping`` as in SandboxFusion: the JSON string ``"pong"``."""
    return web.json_response("pong")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``."""
    m = request.app[METRICS]
    executor = request.app[EXECUTOR]
    m.cores_busy.set(executor.cores_busy)
    m.cores_total.set(len(executor.cores.cores))
    m.sessions.set(len(executor.sessions))
    m.waiting.set(executor.waiting)
    return web.Response(body=generate_latest(m.registry), content_type="text/plain", charset="utf-8")


def build_app(config: AgentConfig) -> web.Application:
    """The aiohttp application; the executor starts and stops with it."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])
    executor = Executor(config)
    app[EXECUTOR] = executor
    app[METRICS] = Metrics()
    app[ACTIONS] = ActionStore(config.action_key_ttl_s, config.action_keys_max, config.action_keys_max_bytes)
    app[CAPPED] = set()

    async def lifecycle(app: web.Application) -> Any:
        warnings = await executor.start()
        for line in warnings:
            log.warning("sandbox isolation: %s", line)
        log.info("sandbox %s", executor.builder.detection.summary())
        yield
        # Keyed actions still running die with the fork server.
        await executor.close()

    app.cleanup_ctx.append(lifecycle)

    async def end_actions(app: web.Application) -> None:
        # As the agent starts to stop (SIGTERM), before aiohttp waits (up to a minute) for the
        # handlers in flight: their actions end now and are answered 503 (the dispatcher sends them
        # again elsewhere). Ended only at cleanup, after that wait, a running action held the stop
        # for a minute, past a pod's grace period (30 s) and ``tangram up``'s, and the agent was
        # killed without answering or removing its workdirs.
        await executor.close()

    app.on_shutdown.append(end_actions)
    app.router.add_post("/v1/execute", execute)
    app.router.add_post("/run_code", run_code)
    app.router.add_post("/run_jupyter", run_jupyter)
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_get("/v1/sessions/{sid}", get_session)
    app.router.add_delete("/v1/sessions/{sid}", close_session)
    app.router.add_put("/v1/sessions/{sid}/files/{path:.+}", put_file)
    app.router.add_get("/v1/sessions/{sid}/files/{path:.+}", get_file)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/healthz", health)
    app.router.add_get("/v1/ping", ping)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/actions", list_actions)
    app.router.add_get("/v1/actions/{key:.+}", get_action)
    app.router.add_delete("/v1/actions/{key:.+}", cancel_action)
    return app
