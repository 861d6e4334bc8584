"""One action from any door (ActionBatch, gateway, SandboxFusion-compatible endpoint), and its outcome.

These are the only types that cross from the doors into the dispatcher and back. They are frozen and
plain so that the gateway, the batch controller and the embedded mode share them without sharing
any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

ActionKind = Literal["code", "test", "reward", "http"]
Wire = Literal["native", "run_code", "run_jupyter"]
# The wires whose payload is a SandboxFusion body, sent verbatim to the agent's path of the same name
# (``/run_code``, ``/run_jupyter``) and answered in SandboxFusion's shape.
SANDBOXFUSION_WIRES: tuple[Wire, ...] = ("run_code", "run_jupyter")


class Outcome(StrEnum):
    """How an action ended, as ActionBatch status spells it."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class Reason(StrEnum):
    """Why an action failed or was not run (CamelCase, as in ActionBatch results)."""

    NON_ZERO_EXIT = "NonZeroExit"
    TIMEOUT = "Timeout"
    OUT_OF_MEMORY = "OutOfMemory"
    SIGNALLED = "Signalled"
    COMPILE_ERROR = "CompileError"
    INVALID_PAYLOAD = "InvalidPayload"
    POOL_NOT_FOUND = "PoolNotFound"
    SERVICE_NOT_FOUND = "ServiceNotFound"
    UNSUPPORTED_TYPE = "UnsupportedType"
    CAPACITY_EXCEEDED = "CapacityExceeded"
    HOST_LOST = "HostLost"
    SESSION_LOST = "SessionLost"
    RETRIES_EXHAUSTED = "RetriesExhausted"
    CANCELLED = "Cancelled"
    SANDBOX_ERROR = "SandboxError"
    # Refused, never run: its pool or service has no host and none is coming soon (``TargetUnavailable``).
    TARGET_UNAVAILABLE = "TargetUnavailable"


@dataclass(frozen=True)
class ActionRequest:
    """One action to run.

    ``key`` identifies the logical action for exactly-once delivery (the dispatcher appends the
    attempt number when it talks to an agent). ``payload`` is the target's own request: for
    ``wire="native"`` the sandbox agent's ``/v1/execute`` fields (``runtime``, ``code``, ``stdin``,
    ``files`` as base64, ``fetch_files``, ``args``); for ``wire="run_code"`` (``"run_jupyter"``) a
    SandboxFusion ``/run_code`` (``/run_jupyter``) body, passed to the agent verbatim so that shapes
    and verdicts are the agent's own;
    for ``kind="reward"`` the reward runtime's scoring body. ``units_min``/``units_max`` bound the
    cores (or GPUs) of the key elastic resource. ``tenant`` defaults to the namespace.
    """

    key: str
    namespace: str
    target: str
    kind: ActionKind
    payload: Mapping[str, Any]
    units_min: int = 1
    units_max: int = 1
    timeout_s: float | None = None
    session: str | None = None
    priority: int = 0
    tenant: str | None = None
    wire: Wire = "native"
    max_retries: int = 2
    backoff_s: float = 1.0
    # Where ``timeout_s`` is the sum of phases each under its own limit (/run_code: a compile, then
    # a run), the longest phase and the caller's name for it: the pool's limits.timeoutSeconds
    # bounds each phase, not their sum. None: ``timeout_s`` is one phase, named timeoutSeconds.
    longest_phase: tuple[str, float] | None = None
    # What ``timeout_s`` holds beyond its phases, which the pool's limit does not bound (a notebook's
    # kernel start and stop, allowed by its agent on top of the cells' total).
    beyond_phases_s: float = 0.0
    # ``payload`` as the JSON bytes it was parsed from, where a door forwards the caller's body
    # verbatim (/run_code): sent to the target as they are, not encoded a second time. Not part of
    # what the action is (``payload`` is).
    payload_json: bytes | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.namespace


@dataclass
class ActionOutcome:
    """What came of one action. ``response`` is the target's response body, verbatim (native or
    SandboxFusion shape), for the doors that return it as it is."""

    key: str
    state: Outcome
    reason: Reason | None = None
    message: str | None = None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    reward: float | None = None
    duration_s: float = 0.0
    queued_s: float = 0.0
    attempts: int = 0
    host: str | None = None
    cores: tuple[int, ...] = ()
    truncated: bool = False
    response: Mapping[str, Any] = field(default_factory=dict)
    # ``response`` as the JSON bytes the target sent, where they came over the wire: a door that
    # answers with the response unchanged sends these rather than encoding it again.
    response_json: bytes | None = None


# The least a caller refused for an outage is told to wait: the outage is looked at again each
# reconcile (every few seconds), and a batch sending its actions again each time the back-off had a
# moment left spun the operator's loop.
OUTAGE_RETRY_MIN_S = 5.0


@dataclass(frozen=True)
class Outage:
    """Why a pool (or a reward service) can run nothing now and will not soon: no host (replica) is
    ready and none is coming (no node can hold one, its container cannot start, or hosts failed in a
    row and the next may not start yet). Its actions are refused meanwhile, to be sent again after
    ``retry_after_s``."""

    message: str
    retry_after_s: float


class ActionService(Protocol):
    """The one queue, seen from a door. The operator's dispatcher implements it; so does the
    embedded mode. ``run`` raises :class:`~arl_tangram.errors.InvalidSpec` for a request that can
    never run (bad payload), :class:`~arl_tangram.errors.QueueFull` when the pool's or the tenant's
    bounded wait is full, :class:`~arl_tangram.errors.NotFound` for an unknown target, and
    :class:`~arl_tangram.errors.TargetUnavailable` when its pool has no host and none coming; every
    other failure is an outcome, not an exception."""

    async def run(self, request: ActionRequest) -> ActionOutcome: ...

    async def cancel(self, key: str) -> bool:
        """Cancel a queued or running action; False when no such action is known."""
        ...

    async def open_session(self, namespace: str, pool: str, ttl_s: float | None = None) -> str:
        """Open a session (per-trajectory state) in a pool; returns its id."""
        ...

    async def close_session(self, namespace: str, pool: str, session: str) -> None: ...
