"""What an agent's answer means: the outcome of the action, or an infrastructure failure (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from arl_tangram.domain.actions import SANDBOXFUSION_WIRES, ActionOutcome, Outcome, Reason, Wire
from arl_tangram.domain.batches import Runner, pass_fraction_reward
from arl_tangram.errors import InfrastructureError
from arl_tangram.sandbox.languages import LANGUAGE_UNAVAILABLE

_NATIVE = {
    "ok": (Outcome.SUCCEEDED, None),
    "failed": (Outcome.FAILED, Reason.NON_ZERO_EXIT),
    "timeout": (Outcome.FAILED, Reason.TIMEOUT),
    "memory_limit_exceeded": (Outcome.FAILED, Reason.OUT_OF_MEMORY),
    "cancelled": (Outcome.CANCELLED, Reason.CANCELLED),
}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def interpret(
    key: str, kind: str, wire: Wire, body: Mapping[str, Any], *, runner: Runner = "unknown"
) -> ActionOutcome:
    """The outcome an agent's response body says; raises InfrastructureError when the sandbox
    itself failed (``sandbox_error`` / ``SandboxError``): the program never had its fair run.
    ``runner``: how a test action's output is read for its reward (``runner_of``)."""
    if wire in SANDBOXFUSION_WIRES:
        # /run_jupyter's answer has the driver's run where /run_code's has the program's.
        return _run_code(key, kind, body, "run_result" if wire == "run_code" else "driver")
    status = body.get("status")
    if status == "sandbox_error":
        raise InfrastructureError(f"the sandbox failed: {body.get('message') or 'no message'}")
    if status not in _NATIVE:
        raise InfrastructureError(f"the agent answered an unknown status {status!r}")
    state, reason = _NATIVE[status]
    if state is Outcome.FAILED and reason is Reason.NON_ZERO_EXIT and body.get("signal"):
        reason = Reason.SIGNALLED
    stdout, stderr = _text(body.get("stdout")), _text(body.get("stderr"))
    exit_code = body.get("exit_code") if isinstance(body.get("exit_code"), int) else None
    wall = body.get("wall_s")
    return ActionOutcome(
        key=key,
        state=state,
        reason=reason,
        message=_text(body.get("message")) or None,
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        reward=pass_fraction_reward(exit_code, stdout, runner=runner) if kind == "test" else None,
        duration_s=float(wall) if isinstance(wall, int | float) else 0.0,
        truncated=bool(body.get("stdout_truncated") or body.get("stderr_truncated")),
        response=dict(body),
    )


def _run_code(key: str, kind: str, body: Mapping[str, Any], run_field: str) -> ActionOutcome:
    status = body.get("status")
    if status == "SandboxError" and body.get(LANGUAGE_UNAVAILABLE):
        # The request's language is not run by this pool's image: the caller's choice, not a
        # failing host (retried and counted as one, a model naming "lean" took hosts out of the pool).
        return ActionOutcome(
            key,
            Outcome.FAILED,
            Reason.INVALID_PAYLOAD,
            _text(body.get("message")) or None,
            response=dict(body),
        )
    if status == "SandboxError":
        raise InfrastructureError(f"the sandbox failed: {body.get('message') or 'no message'}")
    if status not in ("Success", "Failed"):
        raise InfrastructureError(f"the agent answered an unknown SandboxFusion status {status!r}")
    run_raw, compiled_raw = body.get(run_field), body.get("compile_result")
    run: dict[str, Any] = run_raw if isinstance(run_raw, dict) else {}
    compiled: dict[str, Any] = compiled_raw if isinstance(compiled_raw, dict) else {}
    reason: Reason | None = None
    if status == "Failed":
        if compiled and compiled.get("return_code") not in (0, None) and not run:
            reason = Reason.COMPILE_ERROR
        elif run.get("status") == "TimeLimitExceeded":
            reason = Reason.TIMEOUT
        else:
            reason = Reason.NON_ZERO_EXIT
    code = run.get("return_code") if isinstance(run.get("return_code"), int) else None
    stdout, stderr = _text(run.get("stdout")), _text(run.get("stderr"))
    elapsed = run.get("execution_time")
    return ActionOutcome(
        key=key,
        state=Outcome.SUCCEEDED if status == "Success" else Outcome.FAILED,
        reason=reason,
        message=_text(body.get("message")) or None,
        exit_code=code,
        stdout=stdout,
        stderr=stderr,
        reward=pass_fraction_reward(code if isinstance(code, int) else None, stdout)
        if kind == "test"
        else None,
        duration_s=float(elapsed) if isinstance(elapsed, int | float) else 0.0,
        response=dict(body),
    )
