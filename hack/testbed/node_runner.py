# mypy: disable-error-code="arg-type,no-untyped-call,attr-defined,no-any-return"
# The kubernetes client's stubs type request bodies as models and know nothing of _preload_content;
# this file passes plain dicts in the API's JSON shape and reads raw responses.
"""The kubelet of the test bed's simulated nodes.

Registers the nodes listed in a YAML file (capacity, labels), keeps them Ready the way a kubelet does
(a Lease renewed every 10 s in kube-node-lease, the node status refreshed every minute), and runs the
pods bound to them as local processes:

- each pod gets its own local address reported as status.podIP: from --pod-cidr, added to `lo` while
  the pod holds it (--address-device lo; a 198.18.X.0/24 by default, as EndpointSlices refuse
  loopback addresses), or a 127.A.B.0/24 address where adding addresses is not allowed; containers
  share the host's network namespace, so a server must bind its pod IP (downward API status.podIP),
  as with hostNetwork pods sharing one node;
- command/args/env with kubelet's $(VAR) expansion, env from the downward API (fieldRef,
  resourceFieldRef), ConfigMaps and Secrets (valueFrom and envFrom);
- emptyDir, configMap, secret, downwardAPI, hostPath and projected volumes (the service-account token
  comes from the TokenRequest API, so in-cluster clients work: KUBERNETES_SERVICE_HOST/PORT point at
  the API server);
- init containers in order, readiness/liveness/startup probes (httpGet, tcpSocket, exec), restartPolicy
  with restartCount and a crash-loop back-off, exit codes and reasons in containerStatuses, the pod
  phase and conditions a kubelet reports;
- graceful deletion: SIGTERM to the container's process group, SIGKILL after the grace period, then
  the final delete with grace 0 (uid precondition), as a kubelet does.

Each container runs under bubblewrap when it is installed (own PID/IPC/UTS namespaces, read-only host
filesystem, a writable /tmp per pod, volumes bound at their mount paths, a container's default
capability set) and dies with the runner. Not enforced: resource limits, runAsUser, images (there is
no image: a container needs a command, or an entry in --entrypoints mapping its image to one).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import hashlib
import http.server
import ipaddress
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("node-runner")

Json = dict[str, Any]
LEASE_SECONDS = 40
LEASE_RENEW_S = 10.0
STATUS_REFRESH_S = 60.0
TICK_S = 0.1
MERGE_PATCH = "application/merge-patch+json"
# What containerd grants a container that asks for nothing (runc's default set).
DEFAULT_CAPS = [
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
    "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
]  # fmt: skip
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- small pure helpers ------------------------------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubelet's $(VAR) expansion: defined names are replaced, $$ escapes, the rest stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
}  # fmt: skip


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3") as a number."""
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(value).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a resource quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


class IpPool:
    """Pod IPs from a CIDR, handed out round-robin so a released address is reused as late as possible.

    With `device` set, each address is added to that interface (`lo`) while a pod holds it, so that a
    pod can bind it although it is no loopback address (EndpointSlices refuse 127.0.0.0/8).
    """

    def __init__(self, cidr: str, device: str | None = None) -> None:
        net = ipaddress.ip_network(cidr)
        self._hosts = [str(h) for h in net.hosts()]
        self._used: dict[str, str] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._device = device

    def allocate(self, uid: str, wanted: str | None = None) -> str:
        with self._lock:
            if uid in self._used:
                return self._used[uid]
            taken = set(self._used.values())
            if wanted in self._hosts and wanted not in taken:
                ip = wanted
            else:
                for k in range(len(self._hosts)):
                    ip = self._hosts[(self._next + k) % len(self._hosts)]
                    if ip not in taken:
                        self._next = (self._next + k + 1) % len(self._hosts)
                        break
                else:
                    raise RuntimeError(f"pod CIDR exhausted ({len(self._hosts)} addresses in use)")
            self._ip("add", ip)
            self._used[uid] = ip
            return ip

    def release(self, uid: str) -> None:
        with self._lock:
            ip = self._used.pop(uid, None)
            if ip is not None:
                self._ip("del", ip)

    def _ip(self, verb: str, ip: str) -> None:
        if self._device is None:
            return
        done = subprocess.run(
            ["ip", "addr", verb, f"{ip}/32", "dev", self._device], capture_output=True, text=True, check=False
        )
        # "File exists"/"Cannot assign": the address is already (or no longer) there, as wanted.
        if done.returncode != 0 and not re.search(r"File exists|Cannot assign", done.stderr):
            raise RuntimeError(f"ip addr {verb} {ip}/32 dev {self._device}: {done.stderr.strip()}")


def _set_pdeathsig() -> None:
    """Child side of Popen without bubblewrap: die with the runner (PR_SET_PDEATHSIG = 1)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


_SANDBOX_OWN = {"proc", "dev", "tmp", "run", "sys", "lost+found"}  # made fresh for each sandbox


def _host_binds(directory: str, opened: set[str]) -> list[str]:
    """bwrap arguments mirroring `directory` read-only, opening up (as tmpfs) the directories in `opened`."""
    out: list[str] = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if directory == "/" and entry in _SANDBOX_OWN:
            continue
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif path in opened:
            out += ["--dir", path, *_host_binds(path, opened)]
        elif os.path.isdir(path) or os.path.isfile(path):
            out += ["--ro-bind-try", path, path]
    return out


# ---- probes ----------------------------------------------------------------------------------------------


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


# ---- one container -----------------------------------------------------------------------------------


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


class StartError(Exception):
    """A container could not be started (reported as terminated, exit code 128, reason StartError)."""


class ConfigError(Exception):
    """A container's config (ConfigMap, Secret) is missing: kubelet waits, CreateContainerConfigError."""


# ---- one pod -----------------------------------------------------------------------------------------------


class PodWorker(threading.Thread):
    """Runs one pod from its binding to its final deletion."""

    def __init__(self, runner: NodeRunner, pod: Json) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.gone = False  # the API object was removed (force deletion)
        self.changed = threading.Event()
        self.ip = ""
        self.dir = runner.state_dir / f"{self.ns}_{self.pod_name}_{self.uid}"
        self.init_containers = [Container(c, True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, False) for c in pod["spec"]["containers"]]
        self.init_index = 0
        self.phase = "Pending"
        self.conditions: dict[str, Json] = {}
        self.last_sent: Json | None = None
        self.start_time = ""
        self.volumes: dict[str, tuple[Path, bool]] = {}
        self.message = ""

    # -- inputs from the watch ------------------------------------------------------------------------

    def update(self, pod: Json) -> None:
        self.pod = pod
        # Resources are the only container field that may change (in-place resize).
        specs = {c["name"]: c for c in pod["spec"]["containers"]}
        for c in self.containers:
            if c.name in specs:
                c.spec = {**c.spec, "resources": specs[c.name].get("resources") or {}}
        self.changed.set()

    def deleted(self) -> None:
        self.gone = True
        self.changed.set()

    # -- main loop -------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: runner error", self.ns, self.pod_name)
            self._kill_all(2.0)
        finally:
            self.runner.ip_pool.release(self.uid)
            self.runner.forget(self.uid)

    def _deleting(self) -> bool:
        return self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> None:
        status = self.pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            # Finished before this runner saw it (a runner restart): only the final deletion is left.
            self._wait_deletion_then_finalize(status["phase"])
            return
        self.start_time = status.get("startTime") or now_rfc3339()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.pod["spec"].get("hostNetwork"):
            self.ip = self.runner.host_ip
        else:
            self.ip = self.runner.ip_pool.allocate(self.uid, status.get("podIP"))
        self._set_condition("PodReadyToStartContainers", False)
        self._set_condition("Initialized", not self.init_containers, "ContainersNotInitialized")
        self._report()
        while not self._prepare_volumes():
            if self._deleting() or self.runner.stopping.is_set():
                break
            self._report()
            self.changed.wait(1.0)
            self.changed.clear()
        self._set_condition("PodReadyToStartContainers", True)
        while not (self._deleting() or self.runner.stopping.is_set()):
            self._step()
            self._report()
            if self.phase in ("Succeeded", "Failed"):
                self.runner.ip_pool.release(self.uid)
                self._wait_deletion_then_finalize(self.phase)
                return
            self.changed.wait(TICK_S)
            self.changed.clear()
        if self.runner.stopping.is_set() and not self._deleting():
            self._kill_all(2.0)  # the runner stops; the pod object stays, as when a kubelet stops
            return
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self._kill_all(0.0 if self.gone else float(grace))
        if not self.gone:
            codes = [c.state.get("terminated", {}).get("exitCode", 0) for c in self.containers]
            self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
            self._report()
            self._finalize()

    def _wait_deletion_then_finalize(self, phase: str) -> None:
        self.phase = phase
        while not (self._deleting() or self.runner.stopping.is_set()):
            self.changed.wait(1.0)
            self.changed.clear()
        if self._deleting() and not self.gone:
            self._finalize()

    def _finalize(self) -> None:
        """The kubelet's last word: delete the object for good, only if it is still this pod."""
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
        )
        try:
            self.runner.core.delete_namespaced_pod(self.pod_name, self.ns, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- container state machine --------------------------------------------------------------------

    def _policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy", "Always"))

    def _step(self) -> None:
        now = time.monotonic()
        if self.init_index < len(self.init_containers):
            c = self.init_containers[self.init_index]
            self._drive(c, now, restart_on_success=False)
            if c.done:
                code = c.state["terminated"]["exitCode"]
                if code == 0:
                    self.init_index += 1
                else:
                    self.phase = "Failed"
                    return
            if self.init_index < len(self.init_containers):
                for m in self.containers:
                    m.state = {"waiting": {"reason": "PodInitializing"}}
                self.phase = "Pending"
                return
            self._set_condition("Initialized", True)
        for c in self.containers:
            self._drive(c, now, restart_on_success=self._policy() == "Always")
        if all(c.done for c in self.containers):
            codes = [c.state["terminated"]["exitCode"] for c in self.containers]
            self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        else:
            self.phase = (
                "Running" if any(c.proc or c.done or c.restart_at for c in self.containers) else "Pending"
            )
        unready = [c.name for c in self.containers if not c.ready]
        terminal = self.phase in ("Succeeded", "Failed")
        reason = "PodCompleted" if terminal else "ContainersNotReady"
        message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
        self._set_condition("ContainersReady", not unready, reason, message)
        self._set_condition("Ready", not unready, reason, message)
        if terminal:
            self._set_condition("PodReadyToStartContainers", False)

    def _drive(self, c: Container, now: float, restart_on_success: bool) -> None:
        """Advances one container: start it, notice its exit, restart it per restartPolicy, probe it."""
        if c.done:
            return
        if c.proc is None:
            if c.restart_at is not None and now < c.restart_at:
                return
            self._start(c)
            return
        code = c.proc.poll()
        if code is None:
            self._probe(c, now)
            return
        self._exited(c, code if code >= 0 else 128 - code, restart_on_success)

    def _exited(self, c: Container, code: int, restart_on_success: bool, reason: str = "") -> None:
        c.proc = None
        terminated = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": c.started_iso or now_rfc3339(),
            "finishedAt": now_rfc3339(),
        }
        if c.container_id:
            terminated["containerID"] = c.container_id
        policy = "OnFailure" if c.init and self._policy() == "Always" else self._policy()
        wants = restart_on_success or code != 0 if policy == "Always" else policy == "OnFailure" and code != 0
        restart = wants and not self._deleting()
        if not restart:
            c.state = {"terminated": terminated}
            c.done = True
            return
        # Crash-loop back-off: 1 s, doubling up to 5 min, reset after 10 min of good running.
        ran_for = time.monotonic() - c.started_at if c.started_at else 0.0
        c.backoff_s = 1.0 if ran_for > 600 or c.backoff_s == 0 else min(c.backoff_s * 2, 300.0)
        c.restart_at = time.monotonic() + c.backoff_s
        c.last_state = {"terminated": terminated}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {int(c.backoff_s)}s restarting failed container={c.name} "
                f"pod={self.pod_name}_{self.ns}({self.uid})",
            }
        }
        c.restart_count += 1

    def _probe(self, c: Container, now: float) -> None:
        startup = c.probes.get("startup")
        for kind in ("startup", "readiness", "liveness"):
            p = c.probes.get(kind)
            if p is None or not p.due(now):
                continue
            if kind != "startup" and startup is not None and startup.result is not True:
                continue
            if kind == "startup" and p.result is True:
                continue
            p.record(self._run_probe(c, p.spec), now)
            if kind in ("liveness", "startup") and p.result is False:
                log.info(
                    "pod %s/%s container %s: %s probe failed: restarting",
                    self.ns,
                    self.pod_name,
                    c.name,
                    kind,
                )
                self._kill(c, float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
                code = c.proc.wait() if c.proc else 137
                self._exited(c, code if code >= 0 else 128 - code, True)
                return

    def _run_probe(self, c: Container, spec: Json) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                scheme = str(h.get("scheme", "HTTP")).lower()
                host = h.get("host") or self.ip
                path = h.get("path", "/")
                url = f"{scheme}://{host}:{self._port(c, h['port'])}{path}"
                req = urllib.request.Request(
                    url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                )
                req.add_header("User-Agent", "kube-probe/testbed")
                ctx = (
                    ssl._create_unverified_context() if scheme == "https" else None
                )  # kubelet skips verification
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                if ctx is not None:
                    opener.add_handler(urllib.request.HTTPSHandler(context=ctx))
                with opener.open(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                with socket.create_connection(
                    (t.get("host") or self.ip, self._port(c, t["port"])), timeout=timeout
                ):
                    return True
            if "exec" in spec:
                argv = self._wrap(c, list(spec["exec"]["command"]))
                env = self._env(c)
                done = subprocess.run(
                    argv, env=env, cwd=self._cwd(c), capture_output=True, timeout=timeout, check=False
                )
                return done.returncode == 0
        except (OSError, subprocess.SubprocessError, ValueError):
            return False
        log.warning(
            "pod %s/%s: unsupported probe %s (counted as failing)", self.ns, self.pod_name, sorted(spec)
        )
        return False

    @staticmethod
    def _port(c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"container {c.name} has no port named {port!r}")

    # -- starting and stopping processes --------------------------------------------------------------

    def _start(self, c: Container) -> None:
        try:
            env = self._env(c)
        except ConfigError as exc:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            c.restart_at = time.monotonic() + 1.0
            return
        try:
            cdir = self.dir / c.name
            cdir.mkdir(parents=True, exist_ok=True)
            argv = [expand(a, env) for a in self._argv(c)]
            self._check_executable(c, argv[0], env)
            argv = self._wrap(c, argv)
            logf = open(cdir / f"{c.restart_count}.log", "ab")  # noqa: SIM115 (owned by the child)
            try:
                c.proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self._cwd(c),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=None if self.runner.bwrap else _set_pdeathsig,
                )
            finally:
                logf.close()
        except (OSError, StartError) as exc:
            c.started_iso = now_rfc3339()
            self._exited(c, 128, False if c.init else self._policy() == "Always", reason="StartError")
            if "terminated" in c.state:
                c.state["terminated"]["message"] = str(exc)
            elif "terminated" in c.last_state:
                c.last_state["terminated"]["message"] = str(exc)
            log.warning("pod %s/%s container %s: %s", self.ns, self.pod_name, c.name, exc)
            return
        # cluster-down finds leftovers of a runner that died by these files (PID and start time).
        st = Path(f"/proc/{c.proc.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
        (self.dir / f"{c.name}.pid").write_text(f"{c.proc.pid} {st}\n")
        c.started_at = time.monotonic()
        c.started_iso = now_rfc3339()
        c.container_id = (
            "testbed://" + hashlib.sha256(f"{self.uid}/{c.name}/{c.restart_count}".encode()).hexdigest()
        )
        c.state = {"running": {"startedAt": c.started_iso}}
        c.restart_at = None
        c.probes = {}
        for kind in ("readiness", "liveness", "startup"):
            spec = c.spec.get(f"{kind}Probe")
            if spec and not c.init:
                c.probes[kind] = Prober(spec, kind)
                c.probes[kind].arm(c.started_at)
        log.info("pod %s/%s container %s: started pid %d", self.ns, self.pod_name, c.name, c.proc.pid)

    def _check_executable(self, c: Container, program: str, env: dict[str, str]) -> None:
        """Fails like containerd when the entrypoint cannot be found (bwrap would exit 1 instead)."""
        mounts = [str(m["mountPath"]) for m in c.spec.get("volumeMounts") or []]
        if "/" in program:
            if any(program.startswith(m.rstrip("/") + "/") for m in mounts):
                return  # inside a volume: only the sandbox can tell
            if os.access(program, os.X_OK) and not os.path.isdir(program):
                return
            raise StartError(f'exec: "{program}": stat {program}: no such file or directory')
        if shutil.which(program, path=env.get("PATH", "")) is None:
            raise StartError(f'exec: "{program}": executable file not found in $PATH')

    def _argv(self, c: Container) -> list[str]:
        command = list(c.spec.get("command") or [])
        args = list(c.spec.get("args") or [])
        if not command:
            image = str(c.spec.get("image", ""))
            entry = self.runner.entrypoint(image)
            if entry is None:
                raise StartError(
                    f"container {c.name}: the test bed runs no images, so it needs a command "
                    f"(or an entry for image {image!r} in the node runner's --entrypoints file)"
                )
            command, default_args = entry
            args = args or default_args
        return command + args

    def _cwd(self, c: Container) -> str:
        wd = c.spec.get("workingDir")
        if wd and (self.runner.bwrap or os.path.isdir(wd)):
            return "/" if self.runner.bwrap else str(wd)  # bwrap --chdir sets the real one
        d = self.dir / c.name / "work"
        d.mkdir(parents=True, exist_ok=True)
        return str(d)

    def _wrap(self, c: Container, argv: list[str]) -> list[str]:
        """The command under bubblewrap: read-only host, own PID/IPC/UTS, volumes, capabilities."""
        mounts = c.spec.get("volumeMounts") or []
        if not self.runner.bwrap:
            # Without a mount namespace only the injected service-account volume can be done without
            # (in-cluster clients then fail, as they would with automountServiceAccountToken: false).
            unsupported = [
                m["mountPath"] for m in mounts if not m.get("name", "").startswith("kube-api-access")
            ]
            if unsupported:
                raise StartError(f"volume mounts {unsupported} need bubblewrap (bwrap) on the test bed host")
            return argv
        b = [self.runner.bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        b += ["--hostname", self.pod["spec"].get("hostname") or self.pod_name]
        # The root is bwrap's own tmpfs with the host's directories bound read-only into it. A mount
        # point that does not exist on the host (/etc/settings) needs a writable parent: such parents
        # become tmpfs directories holding read-only binds of the host's entries.
        opened: set[str] = set()
        for m in mounts:
            target = os.path.realpath(m["mountPath"])
            if os.path.lexists(target) or target.split("/")[1] in _SANDBOX_OWN:
                continue
            parent = os.path.dirname(target)
            while not os.path.isdir(parent):
                parent = os.path.dirname(parent)
            while parent != "/":
                opened.add(parent)
                parent = os.path.dirname(parent)
        b += _host_binds("/", opened)
        b += ["--ro-bind", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run"]
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        b += ["--bind", str(tmp), "/tmp", "--bind", str(self.dir / c.name), str(self.dir / c.name)]
        for m in mounts:
            name = m["name"]
            if name not in self.volumes:
                raise StartError(f"container {c.name}: volume {name!r} is not defined in the pod")
            src, vol_ro = self.volumes[name]
            if m.get("subPath"):
                src = src / m["subPath"]
            ro = vol_ro or bool(m.get("readOnly"))
            # Resolved through the host's symlinks (/var/run -> /run): bwrap creates mount points only
            # in its own directories, never through a link in a read-only bind.
            b += ["--ro-bind" if ro else "--bind", str(src), os.path.realpath(m["mountPath"])]
        wd = c.spec.get("workingDir")
        b += ["--chdir", wd if wd else self._cwd(c)]
        sc = c.spec.get("securityContext") or {}
        caps = (sc.get("capabilities") or {}) if not sc.get("privileged") else None
        if caps is not None:
            drop = {x.upper().removeprefix("CAP_") for x in caps.get("drop") or []}
            add = {x.upper().removeprefix("CAP_") for x in caps.get("add") or []}
            keep = (set() if "ALL" in drop else set(DEFAULT_CAPS) - drop) | add
            b += ["--cap-drop", "ALL"]
            for cap in sorted(keep - {"ALL"}):
                b += ["--cap-add", "CAP_" + cap]
        return [*b, "--", *argv]

    def _kill(self, c: Container, grace: float) -> None:
        proc = c.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=max(grace, 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _kill_all(self, grace: float) -> None:
        running = [
            c for c in self.init_containers + self.containers if c.proc is not None and c.proc.poll() is None
        ]
        for c in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + grace
        for c in running:
            assert c.proc is not None
            try:
                c.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        for c in self.init_containers + self.containers:
            if c.proc is not None:
                code = c.proc.wait()
                c.proc = None
                c.state = {
                    "terminated": {
                        "exitCode": code if code >= 0 else 128 - code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": c.started_iso,
                        "finishedAt": now_rfc3339(),
                        "containerID": c.container_id,
                    }
                }
            elif "terminated" not in c.state:
                c.state = {
                    "terminated": {
                        "exitCode": 137 if c.started_iso else 0,
                        "reason": "ContainerStatusUnknown",
                    }
                }
                c.state["terminated"]["message"] = "the pod was deleted before the container ran again"
                c.state["terminated"]["finishedAt"] = now_rfc3339()
                c.state["terminated"]["startedAt"] = c.started_iso or now_rfc3339()
            c.done = True
        for c in self.init_containers + self.containers:
            c.probes = {}

    # -- environment and volumes ---------------------------------------------------------------------

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        values = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.runner.host_ip,
            "status.hostIPs": self.runner.host_ip,
        }
        if path not in values:
            raise StartError(f"unsupported downward API field {path!r}")
        return str(values[path])

    def _resource(self, c: Container, ref: Json) -> str:
        res = ref["resource"]
        kind, _, name = res.partition(".")
        target = c
        if ref.get("containerName"):
            target = next((x for x in self.containers if x.name == ref["containerName"]), c)
        value = ((target.spec.get("resources") or {}).get(kind) or {}).get(name)
        if value is None:
            value = self.runner.node_capacity(self.pod["spec"]["nodeName"]).get(name, "0")
        divisor = quantity(ref.get("divisor", "1"))
        return str(math.ceil(quantity(value) / divisor))

    def _lookup(self, kind: str, name: str, optional: bool) -> dict[str, str] | None:
        try:
            if kind == "configMap":
                return dict(self.runner.core.read_namespaced_config_map(name, self.ns).data or {})
            data = self.runner.core.read_namespaced_secret(name, self.ns).data or {}
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        except ApiException as exc:
            if exc.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind} "{name}" not found') from exc
            raise

    def _env(self, c: Container) -> dict[str, str]:
        api = self.runner
        env: dict[str, str] = {
            "PATH": api.path_env,
            "HOME": "/root",
            "HOSTNAME": self.pod["spec"].get("hostname") or self.pod_name,
            "KUBERNETES_SERVICE_HOST": api.api_host,
            "KUBERNETES_SERVICE_PORT": str(api.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(api.api_port),
            "KUBERNETES_PORT": f"tcp://{api.api_host}:{api.api_port}",
        }
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind in ("configMap", "secret"):
                ref = src.get(f"{kind}Ref")
                if ref:
                    data = self._lookup(kind, ref["name"], bool(ref.get("optional")))
                    env.update({prefix + k: v for k, v in (data or {}).items()})
        for var in c.spec.get("env") or []:
            name = var["name"]
            if "value" in var:
                env[name] = expand(str(var["value"]), env)
                continue
            vf = var.get("valueFrom") or {}
            if "fieldRef" in vf:
                env[name] = self._field(vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[name] = self._resource(c, vf["resourceFieldRef"])
            else:
                for kind in ("configMap", "secret"):
                    ref = vf.get(f"{kind}KeyRef")
                    if ref:
                        data = self._lookup(kind, ref["name"], bool(ref.get("optional")))
                        if data is not None and ref["key"] in data:
                            env[name] = data[ref["key"]]
                        elif not ref.get("optional"):
                            raise ConfigError(
                                f"couldn't find key {ref['key']} in {kind} {self.ns}/{ref['name']}"
                            )
            if name not in env and not vf:
                env[name] = ""
        return env

    def _write_files(self, root: Path, files: dict[str, bytes | str]) -> None:
        for rel, content in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content.encode() if isinstance(content, str) else content)

    def _items(self, data: dict[str, str], items: list[Json] | None) -> dict[str, bytes | str]:
        if not items:
            return dict(data)
        return {it["path"]: data[it["key"]] for it in items if it["key"] in data}

    def _prepare_volumes(self) -> bool:
        """Materialises the pod's volumes; False while a ConfigMap or Secret they need is missing."""
        self.volumes = {}
        try:
            for v in self.pod["spec"].get("volumes") or []:
                name = v["name"]
                root = self.dir / "volumes" / name
                root.mkdir(parents=True, exist_ok=True)
                if "emptyDir" in v:
                    self.volumes[name] = (root, False)
                elif "hostPath" in v:
                    hp = Path(v["hostPath"]["path"])
                    if v["hostPath"].get("type") in ("DirectoryOrCreate",):
                        hp.mkdir(parents=True, exist_ok=True)
                    self.volumes[name] = (hp, False)
                elif "configMap" in v or "secret" in v:
                    kind = "configMap" if "configMap" in v else "secret"
                    ref = v[kind]
                    data = self._lookup(
                        kind, ref.get("name") or ref.get("secretName", ""), bool(ref.get("optional"))
                    )
                    self._write_files(root, self._items(data or {}, ref.get("items")))
                    self.volumes[name] = (root, True)
                elif "downwardAPI" in v:
                    files = {
                        it["path"]: self._field(it["fieldRef"]["fieldPath"])
                        for it in v["downwardAPI"]["items"]
                    }
                    self._write_files(root, dict(files))
                    self.volumes[name] = (root, True)
                elif "projected" in v:
                    self._write_files(root, self._projected(v["projected"]))
                    self.volumes[name] = (root, True)
                else:
                    self.message = f"volume {name}: unsupported volume type {sorted(set(v) - {'name'})}"
                    log.warning("pod %s/%s: %s", self.ns, self.pod_name, self.message)
                    self.volumes[name] = (root, False)
        except ConfigError as exc:
            self.message = str(exc)
            for c in self.containers:
                c.state = {"waiting": {"reason": "ContainerCreating", "message": self.message}}
            return False
        self.message = ""
        return True

    def _projected(self, spec: Json) -> dict[str, bytes | str]:
        files: dict[str, bytes | str] = {}
        for src in spec.get("sources") or []:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                body = {
                    "spec": {
                        "audiences": [t["audience"]] if t.get("audience") else None,
                        "expirationSeconds": int(t.get("expirationSeconds", 3607)),
                        "boundObjectRef": {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": self.pod_name,
                            "uid": self.uid,
                        },
                    }
                }
                sa = self.pod["spec"].get("serviceAccountName") or "default"
                tr = self.runner.core.create_namespaced_service_account_token(sa, self.ns, body)
                if tr.status is None or not tr.status.token:
                    raise ConfigError(f"no token for service account {self.ns}/{sa}")
                files[t["path"]] = tr.status.token
            for kind in ("configMap", "secret"):
                if kind in src:
                    ref = src[kind]
                    data = self._lookup(kind, ref["name"], bool(ref.get("optional")))
                    files.update(self._items(data or {}, ref.get("items")))
            if "downwardAPI" in src:
                for it in src["downwardAPI"].get("items") or []:
                    files[it["path"]] = self._field(it["fieldRef"]["fieldPath"])
        return files

    # -- status ------------------------------------------------------------------------------------------

    def _set_condition(self, kind: str, ok: bool, reason: str = "", message: str = "") -> None:
        status = "True" if ok else "False"
        old = self.conditions.get(kind)
        cond: Json = {"type": kind, "status": status, "lastProbeTime": None}
        cond["lastTransitionTime"] = (
            old["lastTransitionTime"] if old and old["status"] == status else now_rfc3339()
        )
        if not ok and reason:
            cond["reason"] = reason
            if message:
                cond["message"] = message
        self.conditions[kind] = cond

    def _status(self) -> Json:
        ours = self.conditions
        theirs = [c for c in (self.pod.get("status") or {}).get("conditions") or [] if c["type"] not in ours]
        host = self.runner.host_ip
        status: Json = {
            "phase": self.phase,
            "conditions": theirs + [ours[k] for k in sorted(ours)],
            "hostIP": host,
            "hostIPs": [{"ip": host}],
            "podIP": self.ip or None,
            "podIPs": [{"ip": self.ip}] if self.ip else None,
            "startTime": self.start_time,
            "observedGeneration": self.pod["metadata"].get("generation"),
            "containerStatuses": sorted((c.status() for c in self.containers), key=lambda s: s["name"]),
            "message": self.message or None,
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        return status

    def _report(self) -> None:
        if self.gone:
            return
        status = self._status()
        if status == self.last_sent:
            return
        try:
            self.runner.core.patch_namespaced_pod_status(
                self.pod_name, self.ns, {"status": status}, _content_type=MERGE_PATCH
            )
            self.last_sent = status
        except ApiException as exc:
            if exc.status == 404:
                self.gone = True
                return
            log.warning("pod %s/%s: status update failed: %s", self.ns, self.pod_name, exc.reason)


# ---- the node ------------------------------------------------------------------------------------------


class NodeRunner:
    """Registers and heartbeats the simulated nodes and runs one PodWorker per pod bound to them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.api = config.new_client_from_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.nodes: list[Json] = yaml.safe_load(Path(args.nodes).read_text())["nodes"]
        self.node_names = {n["name"] for n in self.nodes}
        self.state_dir = Path(args.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ip_pool = IpPool(args.pod_cidr, args.address_device or None)
        self.host_ip = "127.0.0.1"
        self.api_host = args.api_host
        self.api_port = args.api_port
        self.bwrap = "" if args.no_bwrap else (shutil.which("bwrap") or "")
        self.entrypoints: dict[str, Json] = {}
        if args.entrypoints:
            self.entrypoints = yaml.safe_load(Path(args.entrypoints).read_text()) or {}
        self.path_env = os.pathsep.join(
            [
                os.path.dirname(sys.executable),
                "/usr/local/sbin",
                "/usr/local/bin",
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin",
            ]
        )
        self.stopping = threading.Event()
        self.kubelet_port = int(args.kubelet_port or 0)
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()

    def entrypoint(self, image: str) -> tuple[list[str], list[str]] | None:
        """The command an image would run, from the --entrypoints file (keys: image names without tag)."""
        base = image.rsplit("@", 1)[0]
        if ":" in base.rsplit("/", 1)[-1]:
            base = base.rsplit(":", 1)[0]
        entry = self.entrypoints.get(image) or self.entrypoints.get(base)
        if entry is None:
            return None
        return list(entry.get("command") or []), list(entry.get("args") or [])

    def node_capacity(self, name: str) -> dict[str, str]:
        for n in self.nodes:
            if n["name"] == name:
                return {k: str(v) for k, v in n["capacity"].items()}
        return {}

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    # -- nodes -------------------------------------------------------------------------------------------

    def _node_status(self, spec: Json) -> Json:
        now = now_rfc3339()
        capacity = {k: str(v) for k, v in spec["capacity"].items()}
        conds = [
            (
                "MemoryPressure",
                "False",
                "KubeletHasSufficientMemory",
                "kubelet has sufficient memory available",
            ),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status (test bed node runner)"),
        ]
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": m,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
                for t, s, r, m in conds
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.host_ip},
                {"type": "Hostname", "address": spec["name"]},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "osImage": "ARL-Tangram test bed",
                "kernelVersion": os.uname().release,
                "kubeletVersion": os.environ.get("TESTBED_KUBE_VERSION", "v1.36.3"),
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "testbed://" + ("bwrap" if self.bwrap else "process"),
                "machineID": hashlib.md5(spec["name"].encode()).hexdigest(),
                "systemUUID": hashlib.md5(("uuid" + spec["name"]).encode()).hexdigest(),
                "bootID": hashlib.md5(f"{spec['name']}{time.time()}".encode()).hexdigest(),
            },
        }

    def _labels(self, spec: Json) -> dict[str, str]:
        labels = {
            "kubernetes.io/hostname": spec["name"],
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "tangram.arl.dev/testbed": "true",
        }
        labels.update({k: str(v) for k, v in (spec.get("labels") or {}).items()})
        return labels

    def register_nodes(self) -> None:
        for spec in self.nodes:
            name = spec["name"]
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": self._labels(spec)},
                "spec": {"taints": spec.get("taints") or []},
            }
            try:
                self.core.create_node(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.core.patch_node(name, {"metadata": {"labels": self._labels(spec)}})
            self.core.patch_node_status(name, {"status": self._node_status(spec)})
            log.info("node %s registered", name)

    def _lease(self, name: str, node_uid: str) -> None:
        body = {
            "metadata": {
                "name": name,
                "namespace": "kube-node-lease",
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}],
            },
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()},
        }
        try:
            self.coord.patch_namespaced_lease(name, "kube-node-lease", {"spec": body["spec"]})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", body)

    def heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.is_set():
            try:
                refresh = time.monotonic() - last_status >= STATUS_REFRESH_S
                for spec in self.nodes:
                    node = self.core.read_node(spec["name"])
                    self._lease(spec["name"], str(node.metadata.uid if node.metadata else ""))
                    if refresh:
                        self.core.patch_node_status(spec["name"], {"status": self._node_status(spec)})
                if refresh:
                    last_status = time.monotonic()
            except ApiException as exc:
                if exc.status == 404:
                    log.warning("a node was deleted: registering the nodes again")
                    with contextlib.suppress(ApiException):
                        self.register_nodes()
                else:
                    log.warning("heartbeat failed: %s", exc.reason)
            except Exception:
                log.exception("heartbeat failed")
            self.stopping.wait(LEASE_RENEW_S)

    # -- pods --------------------------------------------------------------------------------------------

    def _dispatch(self, kind: str, pod: Json) -> None:
        if (pod.get("spec") or {}).get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.deleted()
                return
            if worker is None:
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod)

    def watch_pods(self) -> None:
        """List, then watch from that version; on expiry, list again (pods that vanished are deleted)."""
        while not self.stopping.is_set():
            try:
                listed = self.core.list_pod_for_all_namespaces(_preload_content=False)
                data = json.loads(listed.data)
                seen = set()
                for pod in data["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self._dispatch("ADDED", pod)
                with self.lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in seen]
                for worker in vanished:
                    worker.deleted()
                rv = data["metadata"]["resourceVersion"]
                stream = watch.Watch()
                for event in stream.stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=rv,
                    timeout_seconds=300,
                    allow_watch_bookmarks=True,
                ):
                    if self.stopping.is_set():
                        stream.stop()
                        break
                    kind = event["type"]
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._dispatch(kind, event["raw_object"])
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch failed: %s", exc.reason)
                    self.stopping.wait(1.0)
            except Exception:
                if self.stopping.is_set():
                    break
                log.exception("pod watch failed")
                self.stopping.wait(1.0)

    def stop_pods(self) -> None:
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.changed.set()
        for w in workers:
            w.join(timeout=10)


# ---- the kubelet API: what `kubectl logs` reaches through the API server ------------------------------


class KubeletApi(http.server.BaseHTTPRequestHandler):
    """GET /containerLogs/{namespace}/{pod}/{container} (follow, previous, tailLines, limitBytes) and
    /healthz. Only the API server can call it: TLS with a client certificate from the cluster's CA."""

    runner: NodeRunner
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kubelet API: " + format, *args)

    def _reply(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        if parts == ["healthz"]:
            self._reply(200, "ok")
            return
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._reply(404, f"the test bed's node runner serves container logs only, not {url.path}")
            return
        _, ns, pod, container = parts
        with self.runner.lock:
            worker = next((w for w in self.runner.workers.values() if (w.ns, w.pod_name) == (ns, pod)), None)
        c = None
        if worker is not None:
            c = next((x for x in worker.init_containers + worker.containers if x.name == container), None)
        if worker is None or c is None:
            self._reply(404, f"container {container} of pod {ns}/{pod} is not running on this node")
            return
        previous = query.get("previous", ["false"])[0] == "true"
        index = c.restart_count - 1 if previous else c.restart_count
        if "running" not in c.state and "waiting" in c.state and not previous:
            index = c.restart_count - 1  # crash-looping: the last run's output, as kubectl shows it
        path = worker.dir / c.name / f"{index}.log"
        if index < 0 or not path.exists():
            self._reply(400, f'previous terminated container "{container}" in pod "{pod}" not found')
            return
        data = path.read_bytes()
        tail = query.get("tailLines", [""])[0]
        if tail.isdigit():
            data = b"".join(data.splitlines(keepends=True)[-int(tail) :]) if int(tail) else b""
        limit = query.get("limitBytes", [""])[0]
        if limit.isdigit():
            data = data[: int(limit)]
        follow = query.get("follow", ["false"])[0] == "true" and not previous
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        if not follow:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = path.stat().st_size
        self._chunk(data)
        run = c.container_id
        # Follow until this run of the container ends (or the client goes away).
        while c.container_id == run and c.proc is not None and not self.runner.stopping.is_set():
            size = path.stat().st_size
            if size > sent:
                with open(path, "rb") as f:
                    f.seek(sent)
                    self._chunk(f.read(size - sent))
                sent = size
            else:
                time.sleep(0.2)
        with open(path, "rb") as f:
            f.seek(sent)
            self._chunk(f.read())
        self._chunk(b"", final=True)

    def _chunk(self, data: bytes, final: bool = False) -> None:
        if not data and not final:
            return  # an empty chunk ends the response
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def serve_kubelet_api(runner: NodeRunner, cert: str, key: str, client_ca: str) -> None:
    """Serves the kubelet API on 127.0.0.1:--kubelet-port in a thread."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(client_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    handler = type("Handler", (KubeletApi,), {"runner": runner})
    server = http.server.ThreadingHTTPServer((runner.host_ip, runner.kubelet_port), handler)
    server.daemon_threads = True
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="kubelet-api", daemon=True).start()
    log.info("kubelet API on https://%s:%d", runner.host_ip, runner.kubelet_port)


def main(argv: list[str] | None = None) -> int:
    """Runs until SIGTERM/SIGINT; then stops every pod process it started and exits."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--nodes", required=True, help="YAML file: nodes: [{name, labels, capacity, taints}]")
    p.add_argument("--state-dir", required=True, help="per-pod directories (logs, volumes, PIDs)")
    p.add_argument("--pod-cidr", required=True, help="loopback CIDR the pod IPs come from, e.g. 127.3.4.0/24")
    p.add_argument("--address-device", default="", help="add each pod IP to this interface (lo) while in use")
    p.add_argument("--api-host", default="127.0.0.1")
    p.add_argument("--api-port", type=int, required=True)
    p.add_argument("--ca-file", default="", help="CA of the API server's client certificate (kubelet API)")
    p.add_argument("--kubelet-port", type=int, default=0, help="serve the kubelet API (container logs) here")
    p.add_argument("--tls-cert", default="", help="serving certificate of the kubelet API")
    p.add_argument("--tls-key", default="")
    p.add_argument(
        "--entrypoints", default="", help="YAML: image name -> {command, args} for pods without one"
    )
    p.add_argument("--no-bwrap", action="store_true", help="run pods without bubblewrap even where present")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    runner = NodeRunner(args)
    log.info("isolation: %s", f"bubblewrap ({runner.bwrap})" if runner.bwrap else "none (bwrap not found)")

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        runner.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if runner.kubelet_port:
        serve_kubelet_api(runner, args.tls_cert, args.tls_key, args.ca_file)
    runner.register_nodes()
    (runner.state_dir / ".registered").write_text("")
    threading.Thread(target=runner.heartbeat, name="heartbeat", daemon=True).start()
    threading.Thread(target=runner.watch_pods, name="pod-watch", daemon=True).start()
    runner.stopping.wait()
    runner.stop_pods()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
