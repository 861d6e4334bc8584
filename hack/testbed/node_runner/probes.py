"""Readiness, liveness and startup probes: kubelet's thresholds (pure) and the three probe actions."""

from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from .api import Json

PROBE_KINDS = ("readiness", "liveness", "startup")


@dataclass
class Prober:
    """One probe of one container with kubelet's thresholds."""

    spec: Json
    kind: str  # readiness | liveness | startup
    successes: int = 0
    failures: int = 0
    result: bool | None = None  # None until the thresholds decide
    next_at: float = 0.0

    def arm(self, started: float) -> None:
        self.successes = self.failures = 0
        self.result = None
        self.next_at = started + float(self.spec.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        self.next_at = now + float(self.spec.get("periodSeconds", 10))
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.result = False


def probers(container: Json, started: float) -> dict[str, Prober]:
    """The armed probes of a container that has just started."""
    out: dict[str, Prober] = {}
    for kind in PROBE_KINDS:
        spec = container.get(f"{kind}Probe")
        if spec:
            out[kind] = Prober(spec, kind)
            out[kind].arm(started)
    return out


class UnsupportedProbe(ValueError):
    """A probe with none of httpGet, tcpSocket, exec (grpc is not done)."""


def run_probe(
    spec: Json,
    host: str,
    port_of: Callable[[int | str], int],
    run_exec: Callable[[list[str], float], int],
) -> bool:
    """One probe action: httpGet (2xx/3xx, TLS unverified as kubelet does), tcpSocket (connects) or exec
    (`run_exec(argv, timeout)` returns the exit code). Errors and timeouts count as failures."""
    timeout = float(spec.get("timeoutSeconds", 1))
    try:
        if "httpGet" in spec:
            h = spec["httpGet"]
            scheme = str(h.get("scheme", "HTTP")).lower()
            url = f"{scheme}://{h.get('host') or host}:{port_of(h['port'])}{h.get('path', '/')}"
            req = urllib.request.Request(
                url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            )
            req.add_header("User-Agent", "kube-probe/testbed")
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            if scheme == "https":  # kubelet skips verification
                opener.add_handler(urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))
            with opener.open(req, timeout=timeout) as resp:
                return bool(200 <= resp.status < 400)
        if "tcpSocket" in spec:
            t = spec["tcpSocket"]
            with socket.create_connection((t.get("host") or host, port_of(t["port"])), timeout=timeout):
                return True
        if "exec" in spec:
            return run_exec(list(spec["exec"]["command"]), timeout) == 0
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    raise UnsupportedProbe(f"unsupported probe {sorted(spec)}")
