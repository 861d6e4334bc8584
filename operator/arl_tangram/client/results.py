"""What the client returns: one action's result, as the gateway reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arl_tangram.client.errors import TangramClientError

# Reasons that mean the platform, not the program, failed: the action is sent again (same key).
INFRASTRUCTURE_REASONS = frozenset({"HostLost", "RetriesExhausted", "SandboxError"})


@dataclass
class ActionResult:
    """How one action ended. ``ok`` is True when it succeeded; a failing program is a result with
    ``ok`` False (read ``reason``, ``exit_code``, ``stderr``), never an exception. ``error`` is set
    only when the gateway refused the action in a stream (bad input, no permission)."""

    key: str
    state: str
    id: str | None = None
    reason: str | None = None
    message: str | None = None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    reward: float | None = None
    duration_seconds: float = 0.0
    queued_seconds: float = 0.0
    attempts: int = 0
    host: str | None = None
    cores: list[int] = field(default_factory=list)
    truncated: bool = False
    response: dict[str, Any] = field(default_factory=dict)
    error: TangramClientError | None = None

    @property
    def ok(self) -> bool:
        return self.state == "Succeeded"

    @property
    def infrastructure_failure(self) -> bool:
        return self.reason in INFRASTRUCTURE_REASONS

    def raise_for_error(self) -> ActionResult:
        """Raise the refusal, if the action was refused; the result otherwise."""
        if self.error is not None:
            raise self.error
        return self

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ActionResult:
        return cls(
            key=str(body.get("key", "")),
            state=str(body.get("state", "")),
            id=body.get("id"),
            reason=body.get("reason"),
            message=body.get("message"),
            exit_code=body.get("exitCode"),
            stdout=body.get("stdout", ""),
            stderr=body.get("stderr", ""),
            reward=body.get("reward"),
            duration_seconds=body.get("durationSeconds", 0.0),
            queued_seconds=body.get("queuedSeconds", 0.0),
            attempts=body.get("attempts", 0),
            host=body.get("host"),
            cores=list(body.get("cores", [])),
            truncated=body.get("truncated", False),
            response=dict(body.get("response", {})),
        )
