"""The client's typed errors: one class per kind of refusal, so a trainer can catch exactly what it
can act on. Program failures are not errors: they are results whose ``ok`` is False."""

from __future__ import annotations

from typing import Any


class TangramClientError(Exception):
    """Base: ``status`` is the HTTP status (0 when no answer came), ``body`` the answer's JSON."""

    def __init__(self, message: str, status: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body


class InvalidRequest(TangramClientError):
    """400, 413 or 422: the request itself is wrong; ``field`` names the culprit when known."""

    @property
    def field(self) -> str | None:
        return self.body.get("field") if isinstance(self.body, dict) else None


class AuthenticationError(TangramClientError):
    """401: no valid token (missing, expired, or minted for another audience)."""


class PermissionDenied(TangramClientError):
    """403: RBAC does not let this identity create ActionBatches in the namespace."""


class NotFoundError(TangramClientError):
    """404: no such pool, service, session or batch."""


class SessionLost(TangramClientError):
    """The session's host was lost; its state is gone (never silently recreated)."""


class Overloaded(TangramClientError):
    """429: a bounded wait is full; retried after ``retry_after`` seconds until retries run out."""

    def __init__(self, message: str, status: int = 429, body: Any = None, retry_after: float = 1.0) -> None:
        super().__init__(message, status, body)
        self.retry_after = retry_after


class Unavailable(TangramClientError):
    """The platform failed (no answer, 502/503/504, a standby, a host lost): retried with the same
    idempotency key, so nothing runs twice; raised when the retries run out."""


class ServerError(TangramClientError):
    """500: a bug in the gateway (never retried: it would likely fail again the same way)."""


def error_for(status: int, body: Any, retry_after: float | None = None) -> TangramClientError:
    """The typed error for an HTTP refusal."""
    message = body.get("error") if isinstance(body, dict) else None
    text = f"{status}: {message or body!r}"
    if status == 429:
        return Overloaded(text, status, body, retry_after or 1.0)
    if status in (502, 503, 504):
        return Unavailable(text, status, body)
    kinds: dict[int, type[TangramClientError]] = {
        401: AuthenticationError,
        403: PermissionDenied,
        404: NotFoundError,
        410: SessionLost,
    }
    if status in kinds:
        return kinds[status](text, status, body)
    if 400 <= status < 500:
        return InvalidRequest(text, status, body)
    return ServerError(text, status, body)
