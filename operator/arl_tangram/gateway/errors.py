"""The error taxonomy as HTTP, in one place: the middleware answers with it, and the stream writes
the same status and message on a refused action's line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from arl_tangram.domain.actions import Reason
from arl_tangram.errors import (
    CapacityExceeded,
    InfrastructureError,
    InvalidSpec,
    KeyConflict,
    NotFound,
    NotReady,
    QueueFull,
)
from arl_tangram.gateway.admission import retry_after_header
from arl_tangram.gateway.auth import AuthUnavailable, Forbidden, Unauthenticated
from arl_tangram.gateway.keys import unscoped_key
from arl_tangram.gateway.parsing import BadRequest

log = logging.getLogger(__name__)

# What HTTP status a failed action's reason gets on the doors that answer in HTTP terms only
# (/run_code and the reward shapes; the native API returns the outcome itself with 200).
REASON_STATUS: dict[Reason, int] = {
    Reason.INVALID_PAYLOAD: 400,
    Reason.UNSUPPORTED_TYPE: 400,
    Reason.POOL_NOT_FOUND: 404,
    Reason.SERVICE_NOT_FOUND: 404,
    Reason.CANCELLED: 409,
    Reason.SESSION_LOST: 410,
    Reason.CAPACITY_EXCEEDED: 422,
    Reason.HOST_LOST: 503,
    Reason.RETRIES_EXHAUSTED: 503,
    Reason.SANDBOX_ERROR: 503,
}
# Reasons that mean the platform failed the action: the same request (same key) may be sent again.
INFRASTRUCTURE_REASONS = frozenset(r for r, status in REASON_STATUS.items() if status == 503)


@dataclass
class HttpError:
    """An exception as an answer: status, JSON body, headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def as_http(exc: Exception) -> HttpError | None:
    """The answer for a known exception; None for anything else (a bug: the caller answers 500)."""
    if isinstance(exc, BadRequest):
        body: dict[str, Any] = {"error": exc.message}
        if exc.field:
            body["field"] = exc.field
        if exc.detail is not None:
            body["detail"] = exc.detail
        return HttpError(exc.status, body, dict(exc.headers))
    if isinstance(exc, KeyConflict):
        # Named as the caller sent it, not as the dispatcher scoped it (``gw/<namespace>/...``).
        return HttpError(409, {"error": f"key {unscoped_key(exc.key)!r} {exc.why}", "field": exc.field})
    if isinstance(exc, InvalidSpec):
        return HttpError(400, {"error": str(exc), "field": exc.field})
    if isinstance(exc, CapacityExceeded):
        return HttpError(422, {"error": str(exc)})
    if isinstance(exc, NotFound):
        return HttpError(404, {"error": str(exc), "kind": exc.kind, "name": exc.name})
    if isinstance(exc, QueueFull):
        retry = retry_after_header(exc.retry_after)
        return HttpError(429, {"error": str(exc), "retryAfter": float(retry)}, {"Retry-After": retry})
    if isinstance(exc, Unauthenticated):
        return HttpError(401, {"error": str(exc)}, {"WWW-Authenticate": 'Bearer realm="tangram"'})
    if isinstance(exc, Forbidden):
        return HttpError(403, {"error": str(exc)})
    if isinstance(exc, AuthUnavailable | NotReady):
        delay = exc.delay if isinstance(exc, NotReady) else 1.0
        retry = retry_after_header(delay)
        return HttpError(503, {"error": str(exc), "retryAfter": float(retry)}, {"Retry-After": retry})
    if isinstance(exc, InfrastructureError):
        return HttpError(503, {"error": f"infrastructure failure: {exc}"}, {"Retry-After": "1"})
    return None
