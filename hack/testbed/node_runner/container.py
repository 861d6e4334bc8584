"""One container of a pod: its process, its state as the API reports it, its probes, its resources."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass, field

from . import lifecycle
from .api import Json, now_rfc3339
from .probes import Prober


@dataclass
class Container:
    spec: Json
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    state: Json = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Json = field(default_factory=dict)
    started_at: float = 0.0
    started_iso: str = ""
    container_id: str = ""
    backoff_s: float = 0.0
    restart_at: float | None = None
    done: bool = False  # terminated and will not run again
    probes: dict[str, Prober] = field(default_factory=dict)
    # In-place resize (see resize.py): the resources accepted for the node, those enacted on the
    # running process, and the cores its processes may run on.
    allocated: Json = field(default_factory=dict)
    actual: Json = field(default_factory=dict)
    cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.allocated = dict(self.spec.get("resources") or {})

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and "running" in self.state

    @property
    def started(self) -> bool:
        startup = self.probes.get("startup")
        return self.running and (startup is None or startup.result is True)

    @property
    def ready(self) -> bool:
        if not self.started:
            return False
        readiness = self.probes.get("readiness")
        return readiness is None or readiness.result is True

    @property
    def has_run(self) -> bool:
        return self.proc is not None or self.done

    @property
    def waiting_to_restart(self) -> bool:
        """Ran, ended, and waits out its back-off (not: waits for its config to appear)."""
        return self.restart_at is not None and "terminated" in self.last_state

    # -- transitions ---------------------------------------------------------------------------------

    def began(self, proc: subprocess.Popen[bytes], pod_uid: str, now: float, cores: tuple[int, ...]) -> None:
        """Its process was started with `cores` and the allocated resources."""
        self.proc = proc
        self.started_at, self.started_iso = now, now_rfc3339()
        run = f"{pod_uid}/{self.name}/{self.restart_count}"
        self.container_id = "testbed://" + hashlib.sha256(run.encode()).hexdigest()
        self.state = {"running": {"startedAt": self.started_iso}}
        self.restart_at = None
        self.cores, self.actual = cores, dict(self.allocated)

    def terminated(self, code: int, reason: str = "") -> Json:
        """The terminated state of its current (or last) run, ending now."""
        return lifecycle.terminated(
            code, self.started_iso or now_rfc3339(), now_rfc3339(), self.container_id, reason
        )

    def exited(self, terminated: Json, restart: bool, now: float, pod_ref: str) -> None:
        """Its process ended in `terminated`: done for good, or waiting out the crash-loop back-off."""
        self.proc = None
        if not restart:
            self.state, self.done = {"terminated": terminated}, True
            return
        self.backoff_s = lifecycle.next_backoff(
            self.backoff_s, now - self.started_at if self.started_at else 0.0
        )
        self.restart_at = now + self.backoff_s
        self.last_state = {"terminated": terminated}
        self.state = lifecycle.crash_loop_waiting(self.backoff_s, self.name, pod_ref)
        self.restart_count += 1

    def restarting(self, terminated: Json) -> None:
        """Stopped to start again at once (a resize with resizePolicy RestartContainer): a counted
        restart without back-off."""
        self.proc, self.restart_at = None, None
        self.last_state = {"terminated": terminated}
        self.restart_count += 1
        self.state = {"waiting": {"reason": "ContainerCreating"}}

    def stopped(self) -> None:
        """The pod is going: its state is final (a process already stopped has its return code)."""
        if self.proc is not None:
            code = self.proc.wait()
            self.proc = None
            self.state = {"terminated": self.terminated(lifecycle.exit_code(code))}
        elif "terminated" not in self.state:
            self.state = {
                "terminated": {
                    "exitCode": 137 if self.started_iso else 0,
                    "reason": "ContainerStatusUnknown",
                    "message": "the pod was deleted before the container ran again",
                    "finishedAt": now_rfc3339(),
                    "startedAt": self.started_iso or now_rfc3339(),
                }
            }
        self.done = True
        self.probes = {}

    def status(self) -> Json:
        image = str(self.spec.get("image", ""))
        digest = hashlib.sha256(image.encode()).hexdigest()
        out: Json = {
            "name": self.name,
            "image": image,
            "imageID": f"{image.split(':')[0]}@sha256:{digest}",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        if not self.init:
            # What a kubelet reports: the resources enacted on a running container, the allocated
            # ones for a container that is not running (it starts with them).
            resources = self.actual if self.running else self.allocated
            if resources:
                out["resources"] = resources
            if self.allocated.get("requests"):
                out["allocatedResources"] = self.allocated["requests"]
        return out
