"""The kubelet's container lifecycle rules (pure): exit codes, terminated states, restart policy,
the crash-loop back-off, the pod phase and its readiness."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .api import Json

# Crash-loop back-off: 1 s, doubling up to 5 min, reset after 10 min of good running (the kubelet's).
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_AFTER_S = 600.0


class ContainerView(Protocol):
    """What the pod-level rules read of a container."""

    @property
    def name(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def state(self) -> Json: ...
    @property
    def waiting_to_restart(self) -> bool: ...
    @property
    def has_run(self) -> bool: ...


def exit_code(returncode: int) -> int:
    """Popen's return code as a container exit code (killed by signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def terminated(code: int, started: str, finished: str, container_id: str, reason: str = "") -> Json:
    """A containerStatuses[].state.terminated: Completed for 0, Error otherwise, unless `reason`."""
    state: Json = {
        "exitCode": code,
        "reason": reason or ("Completed" if code == 0 else "Error"),
        "startedAt": started,
        "finishedAt": finished,
    }
    if container_id:
        state["containerID"] = container_id
    return state


def restart_wanted(pod_policy: str, init: bool, code: int, restart_on_success: bool) -> bool:
    """Whether an exited container runs again: restartPolicy Always restarts it (a successful init
    container or a main container with `restart_on_success` False only on failure), OnFailure on a
    non-zero exit, Never not at all. Init containers of an Always pod behave as OnFailure."""
    policy = "OnFailure" if init and pod_policy == "Always" else pod_policy
    if policy == "Always":
        return restart_on_success or code != 0
    return policy == "OnFailure" and code != 0


def next_backoff(previous_s: float, ran_for_s: float) -> float:
    """The delay before the next restart of a container that ran for `ran_for_s`."""
    if previous_s == 0 or ran_for_s > BACKOFF_RESET_AFTER_S:
        return BACKOFF_FIRST_S
    return min(previous_s * 2, BACKOFF_MAX_S)


def crash_loop_waiting(backoff_s: float, container: str, pod_ref: str) -> Json:
    """The waiting state of a container between a crash and its restart (`pod_ref`: name_ns(uid))."""
    message = f"back-off {int(backoff_s)}s restarting failed container={container} pod={pod_ref}"
    return {"waiting": {"reason": "CrashLoopBackOff", "message": message}}


def pod_phase(containers: Sequence[ContainerView]) -> str:
    """The phase from the main containers once the init containers are done: Succeeded or Failed when
    all are done (by their exit codes), Running once one has run, else Pending."""
    if all(c.done for c in containers):
        codes = [c.state["terminated"]["exitCode"] for c in containers]
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"
    return "Running" if any(c.has_run or c.waiting_to_restart for c in containers) else "Pending"


def readiness(phase: str, containers: Sequence[ContainerView]) -> tuple[bool, str, str]:
    """(ready, reason, message) of the ContainersReady and Ready conditions."""
    unready = [c.name for c in containers if not c.ready]
    if phase in ("Succeeded", "Failed"):
        return not unready, "PodCompleted", ""
    return not unready, "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]"
