"""The pod worker: one thread per pod bound to the runner's nodes, from its binding to its final
deletion. It starts and restarts the containers, probes them, actuates resizes, and reports the status
a kubelet would (the rules themselves live in lifecycle, status, resize, podspec and isolation)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from . import isolation, lifecycle, podspec, probes, processes, resize
from .api import ConfigError, Json, StartError, now_rfc3339
from .container import Container
from .podapi import PodApi
from .status import PodConditions, pod_status
from .volumes import Volumes, prepare_volumes

if TYPE_CHECKING:
    from .node import NodeRunner

log = logging.getLogger("node-runner")
TICK_S = 0.1  # how often a pod's containers are looked at (exits, probes, restarts) without an event
RESIZABLE = ("cpu", "memory")


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
        self.api = PodApi(runner.core, self.ns, self.pod_name, self.uid)
        self.gone = False  # the API object was removed (force deletion)
        self.changed = threading.Event()
        self.ip = ""
        self.dir = runner.state_dir / f"{self.ns}_{self.pod_name}_{self.uid}"
        self.init_containers = [Container(c, True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, False) for c in pod["spec"]["containers"]]
        self.init_index = 0
        self.phase = "Pending"
        self.conditions = PodConditions()
        self.resize = resize.ResizeConditions()
        self.last_sent: Json | None = None
        self.start_time = ""
        self.volumes: Volumes = {}
        self.message = ""

    # -- inputs from the watch, and what the node asks --------------------------------------------------

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

    # -- main loop -------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: runner error", self.ns, self.pod_name)
            self._stop_all(2.0)
        finally:
            self.runner.ip_pool.release(self.uid)
            for c in self.init_containers + self.containers:
                self.runner.cores.release(self._core_key(c))
            self.runner.forget(self.uid)

    def _deleting(self) -> bool:
        return self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def _generation(self) -> int | None:
        generation = self.pod["metadata"].get("generation")
        return None if generation is None else int(generation)

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
        self.conditions.set("PodReadyToStartContainers", False, self._generation)
        self.conditions.set(
            "Initialized", not self.init_containers, self._generation, "ContainersNotInitialized"
        )
        self._report()
        while not self._prepare_volumes():
            if self._deleting() or self.runner.stopping.is_set():
                break
            self._report()
            self.changed.wait(1.0)
            self.changed.clear()
        self.conditions.set("PodReadyToStartContainers", True, self._generation)
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
            self._stop_all(2.0)  # the runner stops; the pod object stays, as when a kubelet stops
            return
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self._stop_all(0.0 if self.gone else float(grace))
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
        self.api.delete_final()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- container state machine --------------------------------------------------------------------

    def _policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy", "Always"))

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _step(self) -> None:
        now = time.monotonic()
        self._resize()
        if self.init_index < len(self.init_containers):
            c = self.init_containers[self.init_index]
            self._drive(c, now, restart_on_success=False)
            if c.done:
                if c.state["terminated"]["exitCode"] != 0:
                    self.phase = "Failed"
                    return
                self.init_index += 1
            if self.init_index < len(self.init_containers):
                for m in self.containers:
                    m.state = {"waiting": {"reason": "PodInitializing"}}
                self.phase = "Pending"
                return
            self.conditions.set("Initialized", True, self._generation)
        for c in self.containers:
            self._drive(c, now, restart_on_success=self._policy() == "Always")
        self.phase = lifecycle.pod_phase(self.containers)
        ready, reason, message = lifecycle.readiness(self.phase, self.containers)
        self.conditions.set("ContainersReady", ready, self._generation, reason, message)
        self.conditions.set("Ready", ready, self._generation, reason, message)
        if self.phase in ("Succeeded", "Failed"):
            self.conditions.set("PodReadyToStartContainers", False, self._generation)

    def _drive(self, c: Container, now: float, restart_on_success: bool) -> None:
        """Advances one container: start it, notice its exit, restart it per restartPolicy, probe it."""
        if c.done:
            return
        if c.proc is None:
            if c.restart_at is None or now >= c.restart_at:
                self._start(c)
            return
        code = c.proc.poll()
        if code is None:
            self._probe(c, now)
            return
        self._exited(c, lifecycle.exit_code(code), restart_on_success)

    def _exited(self, c: Container, code: int, restart_on_success: bool, reason: str = "") -> None:
        restart = (
            lifecycle.restart_wanted(self._policy(), c.init, code, restart_on_success)
            and not self._deleting()
        )
        c.exited(
            c.terminated(code, reason), restart, time.monotonic(), f"{self.pod_name}_{self.ns}({self.uid})"
        )

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
            if kind in ("liveness", "startup") and p.result is False and c.proc is not None:
                log.info(
                    "pod %s/%s container %s: %s probe failed: restarting",
                    self.ns,
                    self.pod_name,
                    c.name,
                    kind,
                )
                processes.stop([c.proc], self._grace())
                self._exited(c, lifecycle.exit_code(c.proc.wait()), True)
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
                preexec_fn=processes.in_child(c.cores, False),
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
            with open(cdir / f"{c.restart_count}.log", "ab") as logf:  # the child keeps its own copy
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self._cwd(c),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=processes.in_child(cores, not self.runner.bwrap),
                    **self._unisolated_user(c),
                )
        except (OSError, StartError) as exc:
            c.started_iso = now_rfc3339()
            self._exited(c, 128, False if c.init else self._policy() == "Always", reason="StartError")
            for state in (c.state, c.last_state):
                if "terminated" in state:
                    state["terminated"]["message"] = str(exc)
                    break
            log.warning("pod %s/%s container %s: %s", self.ns, self.pod_name, c.name, exc)
            return
        # cluster-down finds leftovers of a runner that died by these files.
        processes.record_pid(self.dir / f"{c.name}.pid", proc.pid)
        c.began(proc, self.uid, time.monotonic(), cores)
        c.probes = {} if c.init else probes.probers(c.spec, c.started_at)
        log.info("pod %s/%s container %s: started pid %d", self.ns, self.pod_name, c.name, proc.pid)

    def _stop_all(self, grace: float) -> None:
        everything = self.init_containers + self.containers
        processes.stop([c.proc for c in everything if c.proc is not None], grace)
        for c in everything:
            c.stopped()

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
            hostname=podspec.hostname(self.pod),
            container=c.spec,
            volumes=self.volumes,
            tmp_dir=tmp,
            container_dir=self.dir / c.name,
            workdir=c.spec.get("workingDir") or self._cwd(c),
            user=isolation.identity(self.pod["spec"], c.spec),
            # A user other than root must reach the interpreter behind PATH and its working directory.
            reachable=[sys.executable, str(self.dir / c.name / "work" / "-")],
        )

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
        desired = {c.name: dict(c.spec.get("resources") or {}) for c in self.containers}
        if any(desired[c.name] != c.allocated for c in self.containers):
            verdict = self.runner.resize_fit(self, list(desired.values()))
            if verdict is None:
                for c in self.containers:
                    c.allocated = desired[c.name]
                self.resize.clear_pending()
                self.resize.start(self._generation)
                log.info(
                    "pod %s/%s: resize to generation %s allocated", self.ns, self.pod_name, self._generation
                )
            elif self.resize.set_pending(*verdict, self._generation):
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
            processes.stop([c.proc], self._grace())
            c.restarting(c.terminated(lifecycle.exit_code(c.proc.wait())))
            log.info("pod %s/%s container %s: restarted for its resize", self.ns, self.pod_name, c.name)
            return
        cores = self._cores(c)
        if cores != c.cores:
            resize.set_tree_affinity(c.proc.pid, cores)
            log.info("pod %s/%s container %s: cores %s", self.ns, self.pod_name, c.name, list(cores))
            c.cores = cores
        c.actual = dict(c.allocated)

    # -- environment and volumes ---------------------------------------------------------------------

    def _field(self, path: str) -> str:
        return podspec.field_value(self.pod, path, self.ip, self.runner.host_ip)

    def _env(self, c: Container) -> dict[str, str]:
        api = self.runner
        base = {
            "PATH": api.path_env,
            "HOME": "/root",
            "HOSTNAME": podspec.hostname(self.pod),
            "KUBERNETES_SERVICE_HOST": api.api_host,
            "KUBERNETES_SERVICE_PORT": str(api.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(api.api_port),
            "KUBERNETES_PORT": f"tcp://{api.api_host}:{api.api_port}",
        }
        capacity = api.node_capacity(self.node_name)
        specs = [x.spec for x in self.containers]

        def resource(ref: Json) -> str:
            return podspec.resource_value(specs, c.spec, ref, capacity)

        return podspec.container_env(c.spec, base, self.ns, self.api.lookup, self._field, resource)

    def _token(self, audience: str | None, expiration_s: int) -> str:
        return self.api.token(self.pod["spec"].get("serviceAccountName") or "default", audience, expiration_s)

    def _prepare_volumes(self) -> bool:
        """Materialises the pod's volumes; False while a ConfigMap or Secret they need is missing."""
        try:
            self.volumes, problems = prepare_volumes(
                self.pod, self.dir, self.api.lookup, self._field, self._token
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

    def _report(self) -> None:
        if self.gone:
            return
        status = pod_status(
            phase=self.phase,
            conditions=self.conditions.list() + self.resize.list(),
            reported=self.pod.get("status") or {},
            host_ip=self.runner.host_ip,
            pod_ip=self.ip,
            start_time=self.start_time,
            generation=self._generation,
            containers=[c.status() for c in self.containers],
            init_containers=[c.status() for c in self.init_containers],
            message=self.message,
        )
        if status == self.last_sent:
            return
        outcome = self.api.patch_status(status)
        if outcome == "sent":
            self.last_sent = status
        elif outcome == "gone":
            self.gone = True
