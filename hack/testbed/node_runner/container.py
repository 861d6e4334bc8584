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
        resources = self.spec.get("resources")
        if not self.init and resources:
            # Nothing to actuate (no cgroups): an in-place resize takes effect at once.
            out["resources"] = resources
            if resources.get("requests"):
                out["allocatedResources"] = resources["requests"]
        return out
