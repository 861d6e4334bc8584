"""SandboxFusion's API, so that a trainer written for it switches by changing a URL.

``POST /run_code`` (and ``POST /run_jupyter``, a notebook's cells) takes SandboxFusion's body
(validated with the sandbox agent's own model, so both refuse alike) and forwards it verbatim to an
agent of the chosen pool; the answer is the agent's body, so shapes and verdicts are exactly the
agent's own. ``GET /v1/ping`` answers the JSON string ``"pong"``. A failure of the platform (the
host lost, retries spent) is SandboxFusion's
``SandboxError`` with 504 and Retry-After (``models.RETRY_LATER_STATUS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Reason, Wire
from arl_tangram.gateway.admission import retry_after_header
from arl_tangram.gateway.errors import INFRASTRUCTURE_REASONS, REASON_STATUS
from arl_tangram.gateway.keys import scoped_key
from arl_tangram.gateway.native import caller_key, keyless_caller, run_action
from arl_tangram.gateway.parsing import loads, read_body, validate
from arl_tangram.gateway.routing import namespace_of, require_pool
from arl_tangram.gateway.state import authorize, state_of
from arl_tangram.sandbox.languages import LANGUAGE_UNAVAILABLE, compiles
from arl_tangram.sandbox.models import JUPYTER_MARGIN_S, RunCodeRequest, RunJupyterRequest, run_code_status


def sandbox_error(message: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """SandboxFusion's body for a request the sandbox could not run."""
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
        "error": message,
        **(extra or {}),
    }


def answer(outcome: ActionOutcome, retry_after_s: float) -> web.Response:
    """The agent's body when it ran the code; else SandboxFusion's error shape with the status the
    reason calls for."""
    body = outcome.response
    if body.get("status") in ("Success", "Failed") or body.get(LANGUAGE_UNAVAILABLE):
        # The code ran (and passed, failed, or timed out): SandboxFusion's verdict, as the agent gave
        # it; or the language is not offered, which SandboxFusion answers 200 SandboxError too.
        if outcome.response_json is not None:  # its bytes as they came: not encoded a second time
            return web.Response(body=outcome.response_json, content_type="application/json")
        return web.json_response(dict(body))
    reason = outcome.reason or Reason.SANDBOX_ERROR
    status = REASON_STATUS.get(reason, 500)
    message = outcome.message or reason.value
    if body.get("status") == "SandboxError":
        # The agent refused it (an unknown language, a bad file path): its own words, and its own
        # status, which the outcome does not carry but the body tells: the agent answers 422 with
        # ``detail`` for a request that fails validation, 400 for a value it cannot use.
        return web.json_response(dict(body), status=422 if "detail" in body else status)
    response = web.json_response(
        sandbox_error(message, {"reason": reason.value}), status=run_code_status(status)
    )
    if reason in INFRASTRUCTURE_REASONS:
        response.headers["Retry-After"] = retry_after_header(retry_after_s)
    return response


async def _forward(
    request: web.Request,
    model: type[BaseModel],
    wire: Wire,
    timing: Callable[[Any], Timing],
) -> web.Response:
    """A SandboxFusion body as one action on the pool, answered with the agent's own answer.
    ``timing``: the action's timeout, its longest phase (the one the pool's limit bounds) and what
    the timeout holds beyond its phases."""
    state = state_of(request)
    namespace = namespace_of(request)
    pool = require_pool(request, namespace)
    await authorize(request, namespace)
    encoded = await read_body(request, state.config)
    raw = loads(encoded)
    timeout_s, longest, beyond_s = timing(validate(model, raw))
    given = caller_key(request, None)
    req = ActionRequest(
        key=scoped_key(namespace, given),
        namespace=namespace,
        target=pool,
        kind="code",
        payload=raw,
        timeout_s=timeout_s,
        longest_phase=longest,
        beyond_phases_s=beyond_s,
        wire=wire,
        payload_json=encoded,  # forwarded as the caller sent it: the agent parses the same bytes
    )
    outcome = await run_action(state, req, wire, keyless_caller(request, given))
    return answer(outcome, state.config.retry_after_s)


# An action's timeout, its longest phase, and what the timeout holds beyond its phases.
Timing = tuple[float, tuple[str, float], float]


def _run_code_timing(body: RunCodeRequest) -> Timing:
    # A compiled language builds (up to compile_timeout), then runs (up to run_timeout): the call
    # may take both, and the pool's limit bounds each. Python and bash only run: their
    # compile_timeout (SandboxFusion's default 10 s, or a client's copy of its run timeout) is no
    # part of it, and added in, it refused verl's tool (30 s each) on a pool of 30 s.
    phases = {"run_timeout": body.run_timeout}
    if compiles(body.language):
        phases["compile_timeout"] = body.compile_timeout
    return sum(phases.values()), max(phases.items(), key=lambda item: item[1]), 0.0


def _notebook_timing(body: RunJupyterRequest) -> Timing:
    # The cells' total is the phase the pool's limits.timeoutSeconds bounds; the kernel's start and
    # stop come on top, as in SandboxFusion.
    total = body.total_timeout
    return total + JUPYTER_MARGIN_S, ("total_timeout", total), JUPYTER_MARGIN_S


async def run_code(request: web.Request) -> web.Response:
    """``POST /run_code``."""
    return await _forward(request, RunCodeRequest, "run_code", _run_code_timing)


async def run_jupyter(request: web.Request) -> web.Response:
    """``POST /run_jupyter``: a notebook's cells, run in a kernel of their own on a host of the pool,
    as one action; the answer is the agent's, as for ``/run_code``."""
    return await _forward(request, RunJupyterRequest, "run_jupyter", _notebook_timing)


async def ping(request: web.Request) -> web.Response:
    """``GET /v1/ping``, as SandboxFusion answers it (and the agent): the JSON string ``"pong"``."""
    return web.json_response("pong")
