"""One container of a pod: its process, its state as the API reports it, its probes."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass, field

from .api import Json
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
