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


class NotReady(TangramError):
    """Something is not there yet; the same request may succeed after ``delay`` seconds."""

    def __init__(self, message: str, delay: float = 5.0) -> None:
        super().__init__(message)
        self.delay = delay


class InfrastructureError(TangramError):
    """The platform failed the action (host lost, connection refused); safe to retry elsewhere."""


class ProgramError(TangramError):
    """The submitted program failed on its own; reported to the caller and never retried."""


class CapacityExceeded(TangramError):
    """A request asks for more than the pool could ever hold (not merely more than is free now)."""
