"""The pod status a kubelet reports (pure): its own conditions, kept with their transition times, and
the status object that is patched."""

from __future__ import annotations

from .api import Json, now_rfc3339
from .resize import IN_PROGRESS, PENDING

# The conditions the kubelet owns; others (PodScheduled, DisruptionTarget, a readiness gate's) stay as
# the pod's status has them.
OWN_CONDITIONS = {
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
    PENDING,
    IN_PROGRESS,
}


class PodConditions:
    """The kubelet's conditions of one pod: lastTransitionTime changes only when the status does."""

    def __init__(self) -> None:
        self._by_type: dict[str, Json] = {}

    def set(self, kind: str, ok: bool, generation: int | None, reason: str = "", message: str = "") -> None:
        status = "True" if ok else "False"
        old = self._by_type.get(kind)
        cond: Json = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            # v1.36 kubelets (PodObservedGenerationTracking, GA) say which pod generation each is about.
            "observedGeneration": generation,
            "lastTransitionTime": old["lastTransitionTime"]
            if old and old["status"] == status
            else now_rfc3339(),
        }
        if not ok and reason:
            cond["reason"] = reason
            if message:
                cond["message"] = message
        self._by_type[kind] = cond

    def list(self) -> list[Json]:
        return [self._by_type[k] for k in sorted(self._by_type)]


def pod_status(
    *,
    phase: str,
    conditions: list[Json],
    reported: Json,
    host_ip: str,
    pod_ip: str,
    start_time: str,
    generation: int | None,
    containers: list[Json],
    init_containers: list[Json],
    message: str,
) -> Json:
    """The status to patch: `conditions` are the kubelet's (replacing any it owns in the `reported`
    status), the others are kept; containers sorted by name, as the kubelet sorts them."""
    theirs = [c for c in reported.get("conditions") or [] if c["type"] not in OWN_CONDITIONS]
    status: Json = {
        "phase": phase,
        "conditions": theirs + conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip or None,
        "podIPs": [{"ip": pod_ip}] if pod_ip else None,
        "startTime": start_time,
        "observedGeneration": generation,
        "containerStatuses": sorted(containers, key=lambda s: s["name"]),
        "message": message or None,
    }
    if init_containers:
        status["initContainerStatuses"] = init_containers
    return status
