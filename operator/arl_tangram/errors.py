"""The domain's error taxonomy, in one place.

Every layer raises these so that the edges (controllers, gateway, CLI) can decide uniformly:
- ``InvalidSpec`` is permanent: the input is wrong and retrying cannot help; it names the field.
- ``NotReady`` is temporary: try again after ``delay`` seconds.
- ``InfrastructureError``: the platform failed (a pod was lost); the action may be retried elsewhere.
- ``ProgramError``: the user's code failed; report it, never retry.
"""

from __future__ import annotations


class TangramError(Exception):
    """Base of every error this project raises on purpose."""


class InvalidSpec(TangramError):
    """Input that can never be accepted as it is. ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UnsupportedType(InvalidSpec):
    """An action of a type this release does not serve (``field`` names the type's field)."""


class KeyConflict(InvalidSpec):
    """An idempotency key already names another action: its result is not this request's answer."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__("key", f"key {key!r} {why}")
        self.key = key
        self.why = why


class NotReady(TangramError):
    """Something is not there yet; the same request may succeed after ``delay`` seconds."""

    def __init__(self, message: str, delay: float = 5.0) -> None:
        super().__init__(message)
        self.delay = delay


class Stopping(NotReady):
    """The dispatcher is stopping (its operator lost its leadership or is shut down, or ``tangram
    up`` ends): what was sent runs on, or ran, on its host; send it again (to the next leader)."""


class TargetUnavailable(NotReady):
    """A pool has no host and none is coming soon (its status says why); send again after ``delay``."""


class InfrastructureError(TangramError):
    """The platform failed the action (host lost, connection refused); safe to retry elsewhere."""


class ProgramError(TangramError):
    """The submitted program failed on its own; reported to the caller and never retried."""


class CapacityExceeded(TangramError):
    """A request asks for more than the pool could ever hold (not merely more than is free now)."""


class NotFound(TangramError):
    """A named object (pool, service, batch, session) does not exist. ``kind`` and ``name`` say which."""

    def __init__(self, kind: str, name: str, message: str | None = None) -> None:
        super().__init__(message or f"{kind} {name!r} not found")
        self.kind = kind
        self.name = name


class QueueFull(TangramError):
    """A bounded wait (per pool or per tenant) is full; the caller may retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
