# mypy: disable-error-code="arg-type,no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; this file passes plain dicts.
"""The pod worker: one thread per pod bound to the runner's nodes, from its binding to its final
deletion. It starts and restarts the containers, probes them, and reports the status a kubelet would."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from . import isolation, podspec, probes, resize
from .api import MERGE_PATCH, ConfigError, Json, StartError, now_rfc3339
from .container import Container
from .volumes import Volumes, prepare_volumes

if TYPE_CHECKING:
    from .node import NodeRunner

log = logging.getLogger("node-runner")
TICK_S = 0.1
# The conditions this worker owns, as a kubelet owns them; others (PodScheduled, DisruptionTarget, a
# readiness gate's) are kept as the pod's status has them.
OWN_CONDITIONS = {
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
    resize.PENDING,
    resize.IN_PROGRESS,
}
RESIZABLE = ("cpu", "memory")


def exit_code(returncode: int) -> int:
    """Popen's return code as a container exit code (a signal N is 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def _in_child(cores: tuple[int, ...], die_with_runner: bool) -> Callable[[], None]:
    """Popen's preexec_fn: the container's CPU affinity (inherited by all it starts), and without
    bubblewrap death with the runner."""

    def child() -> None:
        os.sched_setaffinity(0, cores)
        if die_with_runner:
            isolation.set_pdeathsig()

    return child


def _quantities(resources: Json, name: str) -> tuple[str | None, str | None]:
    return (resources.get("requests") or {}).get(name), (resources.get("limits") or {}).get(name)


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
        self.volumes: Volumes = {}
        self.message = ""
        self.resize = resize.ResizeConditions()

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
            for c in self.init_containers + self.containers:
                self.runner.cores.release(self._core_key(c))
            self.runner.forget(self.uid)

    def _deleting(self) -> bool:
        return self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def node_name(self) -> str:
        return str(self.pod["spec"].get("nodeName", ""))

    @property
    def holds_resources(self) -> bool:
        """Whether the pod's allocation counts on its node (as for a kubelet: until it has finished)."""
        return not self.gone and self.phase not in ("Succeeded", "Failed")

    def allocated_requests(self) -> dict[str, float]:
        return resize.pod_requests(
            [c.allocated for c in self.containers], [c.allocated for c in self.init_containers]
        )

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
        self._resize()
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
        self._exited(c, exit_code(code), restart_on_success)

    @staticmethod
    def _terminated(c: Container, code: int, reason: str = "") -> Json:
        terminated = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": c.started_iso or now_rfc3339(),
            "finishedAt": now_rfc3339(),
        }
        if c.container_id:
            terminated["containerID"] = c.container_id
        return terminated

    def _exited(self, c: Container, code: int, restart_on_success: bool, reason: str = "") -> None:
        c.proc = None
        terminated = self._terminated(c, code, reason)
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
                self._exited(c, exit_code(code), True)
                return

    def _run_probe(self, c: Container, spec: Json) -> bool:
        def port_of(port: int | str) -> int:
            return podspec.port_number(c.spec, port)

        def run_exec(argv: list[str], timeout: float) -> int:
            done = subprocess.run(
                self._wrap(c, argv),
                env=self._env(c),
                cwd=self._cwd(c),
                capture_output=True,
                timeout=timeout,
                check=False,
                preexec_fn=_in_child(c.cores, False) if c.cores else None,
                **self._unisolated_user(c),
            )
            return done.returncode

        try:
            return probes.run_probe(spec, self.ip, port_of, run_exec)
        except probes.UnsupportedProbe as exc:
            log.warning("pod %s/%s: %s (counted as failing)", self.ns, self.pod_name, exc)
            return False

    # -- starting and stopping processes --------------------------------------------------------------

    def _start(self, c: Container) -> None:
        try:
            isolation.check_non_root(self.pod, c.spec)
            env = self._env(c)
        except ConfigError as exc:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            c.restart_at = time.monotonic() + 1.0
            return
        try:
            cdir = self.dir / c.name
            cdir.mkdir(parents=True, exist_ok=True)
            argv = [podspec.expand(a, env) for a in podspec.container_argv(c.spec, self.runner.entrypoints)]
            isolation.check_executable(c.spec, argv[0], env.get("PATH", ""))
            argv = self._wrap(c, argv)
            cores = self._cores(c)
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
                    preexec_fn=_in_child(cores, not self.runner.bwrap),
                    **self._unisolated_user(c),
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
        c.cores, c.actual = cores, dict(c.allocated)
        c.probes = {} if c.init else probes.probers(c.spec, c.started_at)
        log.info("pod %s/%s container %s: started pid %d", self.ns, self.pod_name, c.name, c.proc.pid)

    # -- in-place resize ------------------------------------------------------------------------------------

    def _core_key(self, c: Container) -> str:
        return f"{self.uid}/{'init/' if c.init else ''}{c.name}"

    def _cores(self, c: Container) -> tuple[int, ...]:
        """The cores the container's processes get for its allocated resources."""
        cores = self.runner.cores
        return cores.assign(self._core_key(c), resize.cores_for(c.allocated, len(cores.cores)))

    def _resize(self) -> None:
        """Allocates a resize that fits the node (else PodResizePending with its reason), then actuates
        it on the running containers; PodResizeInProgress lasts until they all run with it."""
        generation = self.pod["metadata"].get("generation")
        desired = {c.name: dict(c.spec.get("resources") or {}) for c in self.containers}
        if any(desired[c.name] != c.allocated for c in self.containers):
            verdict = self.runner.resize_fit(self, list(desired.values()))
            if verdict is None:
                for c in self.containers:
                    c.allocated = desired[c.name]
                self.resize.clear_pending()
                self.resize.start(generation)
                log.info("pod %s/%s: resize to generation %s allocated", self.ns, self.pod_name, generation)
            elif self.resize.set_pending(*verdict, generation):
                log.info("pod %s/%s: resize %s: %s", self.ns, self.pod_name, *verdict)
        else:
            self.resize.clear_pending()
        for c in self.containers:
            if c.running and c.actual != c.allocated:
                try:
                    self._actuate(c)
                except OSError as exc:
                    self.resize.failed(f"container {c.name}: {exc}")
                    log.warning("pod %s/%s: resize of %s failed: %s", self.ns, self.pod_name, c.name, exc)
        if all(not c.running or c.actual == c.allocated for c in self.containers):
            self.resize.done()

    def _actuate(self, c: Container) -> None:
        """Enacts the allocated resources on a running container: a new CPU affinity for all its
        processes and threads, or a restart where its resizePolicy asks for one."""
        assert c.proc is not None
        changed = {r for r in RESIZABLE if _quantities(c.actual, r) != _quantities(c.allocated, r)}
        policy = {p["resourceName"]: p.get("restartPolicy") for p in c.spec.get("resizePolicy") or []}
        if any(policy.get(r) == "RestartContainer" for r in changed) and self._policy() != "Never":
            self._restart_for_resize(c)
            return
        cores = self._cores(c)
        if cores != c.cores:
            resize.set_tree_affinity(c.proc.pid, cores)
            log.info("pod %s/%s container %s: cores %s", self.ns, self.pod_name, c.name, list(cores))
            c.cores = cores
        c.actual = dict(c.allocated)

    def _restart_for_resize(self, c: Container) -> None:
        """resizePolicy RestartContainer: stop the container and start it again at once with the new
        resources (a restart counted in restartCount, without the crash-loop back-off)."""
        assert c.proc is not None
        self._kill(c, float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
        c.last_state = {"terminated": self._terminated(c, exit_code(c.proc.wait()))}
        c.proc, c.restart_at = None, None
        c.restart_count += 1
        c.state = {"waiting": {"reason": "ContainerCreating"}}
        log.info("pod %s/%s container %s: restarted for its resize", self.ns, self.pod_name, c.name)

    def _cwd(self, c: Container) -> str:
        wd = c.spec.get("workingDir")
        if wd and (self.runner.bwrap or os.path.isdir(wd)):
            return "/" if self.runner.bwrap else str(wd)  # bwrap --chdir sets the real one
        d = self.dir / c.name / "work"
        d.mkdir(parents=True, exist_ok=True)
        return str(d)

    def _unisolated_user(self, c: Container) -> dict[str, Any]:
        """Popen's user and groups where there is no sandbox to switch users in (bwrap: setpriv)."""
        who = isolation.identity(self.pod["spec"], c.spec)
        if self.runner.bwrap or who is None:
            return {}
        return {"user": who.uid, "group": who.gid, "extra_groups": list(who.groups)}

    def _wrap(self, c: Container, argv: list[str]) -> list[str]:
        if not self.runner.bwrap:
            isolation.check_unisolated(c.spec)
            return argv
        tmp = self.dir / "tmp"
        if not tmp.exists():
            tmp.mkdir()
            tmp.chmod(0o1777)  # an image's /tmp: anyone may write, only the owner delete
        return isolation.bwrap_command(
            self.runner.bwrap,
            argv,
            hostname=self.pod["spec"].get("hostname") or self.pod_name,
            container=c.spec,
            volumes=self.volumes,
            tmp_dir=tmp,
            container_dir=self.dir / c.name,
            workdir=c.spec.get("workingDir") or self._cwd(c),
            user=isolation.identity(self.pod["spec"], c.spec),
            # A user other than root must reach the interpreter behind PATH and its working directory.
            reachable=[sys.executable, str(self.dir / c.name / "work" / "-")],
        )

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
                        "exitCode": exit_code(code),
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
                        "message": "the pod was deleted before the container ran again",
                        "finishedAt": now_rfc3339(),
                        "startedAt": c.started_iso or now_rfc3339(),
                    }
                }
            c.done = True
        for c in self.init_containers + self.containers:
            c.probes = {}

    # -- environment and volumes ---------------------------------------------------------------------

    def _field(self, path: str) -> str:
        return podspec.field_value(self.pod, path, self.ip, self.runner.host_ip)

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
        base = {
            "PATH": api.path_env,
            "HOME": "/root",
            "HOSTNAME": self.pod["spec"].get("hostname") or self.pod_name,
            "KUBERNETES_SERVICE_HOST": api.api_host,
            "KUBERNETES_SERVICE_PORT": str(api.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(api.api_port),
            "KUBERNETES_PORT": f"tcp://{api.api_host}:{api.api_port}",
        }
        capacity = api.node_capacity(self.pod["spec"]["nodeName"])
        specs = [x.spec for x in self.containers]

        def resource(ref: Json) -> str:
            return podspec.resource_value(specs, c.spec, ref, capacity)

        return podspec.container_env(c.spec, base, self.ns, self._lookup, self._field, resource)

    def _token(self, audience: str | None, expiration_s: int) -> str:
        body = {
            "spec": {
                "audiences": [audience] if audience else None,
                "expirationSeconds": expiration_s,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.uid},
            }
        }
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        tr = self.runner.core.create_namespaced_service_account_token(sa, self.ns, body)
        if tr.status is None or not tr.status.token:
            raise ConfigError(f"no token for service account {self.ns}/{sa}")
        return str(tr.status.token)

    def _prepare_volumes(self) -> bool:
        """Materialises the pod's volumes; False while a ConfigMap or Secret they need is missing."""
        try:
            self.volumes, problems = prepare_volumes(
                self.pod, self.dir, self._lookup, self._field, self._token
            )
        except ConfigError as exc:
            self.volumes = {}
            self.message = str(exc)
            for c in self.containers:
                c.state = {"waiting": {"reason": "ContainerCreating", "message": self.message}}
            return False
        for problem in problems:
            log.warning("pod %s/%s: %s", self.ns, self.pod_name, problem)
        self.message = "; ".join(problems)
        return True

    # -- status ------------------------------------------------------------------------------------------

    def _set_condition(self, kind: str, ok: bool, reason: str = "", message: str = "") -> None:
        status = "True" if ok else "False"
        old = self.conditions.get(kind)
        cond: Json = {"type": kind, "status": status, "lastProbeTime": None}
        # v1.36 kubelets (PodObservedGenerationTracking, GA) say which pod generation each is about.
        cond["observedGeneration"] = self.pod["metadata"].get("generation")
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
        theirs = [
            c
            for c in (self.pod.get("status") or {}).get("conditions") or []
            if c["type"] not in ours and c["type"] not in OWN_CONDITIONS
        ]
        host = self.runner.host_ip
        status: Json = {
            "phase": self.phase,
            "conditions": theirs + [ours[k] for k in sorted(ours)] + self.resize.list(),
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
