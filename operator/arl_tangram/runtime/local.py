"""The local runtime: each sandbox host is a ``tangram sandbox-agent`` process on this machine.

The embedded mode (``tangram up``) and the demo run pools here instead of on a cluster. A host gets
``host_cores`` of the cores this runtime was given, disjoint from every other host's, a uid range of
its own (so that two agents never hand the same uid to actions, and a host's leftovers can be found
and killed by uid), its own workdir root, and a loopback port. Its command line is the one a host pod
runs (:func:`~arl_tangram.runtime.pods.agent_args`), with the pod-only parts (the pod IP, the pod's
workdir volume) replaced by their local equivalents.

Observations are the process table kept here (never a system call in :meth:`LocalRuntime.hosts`): a
host is ``starting`` until its agent answers ``/v1/health``, ``ready`` after, ``failed`` when its
process exited or never answered, ``draining`` when marked so. Draining lives in memory only: a
stopped ``tangram up`` stops every host it started, so there is nothing to find again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from arl_tangram.domain.pools import PoolConfig
from arl_tangram.runtime.interface import HostObservation, HostPhase
from arl_tangram.runtime.pods import agent_args

log = logging.getLogger(__name__)

NODE = "local"
"""The one node of the local runtime (what the planner's snapshot calls this machine)."""

# A host's agent answers health within this long or is failed (a cold agent on a loaded 2-core
# machine was measured at 3-12 s; a minute leaves room for a machine much busier than that).
START_TIMEOUT_S = 60.0
# How long a stopping agent gets to close its sessions and end its actions before SIGKILL.
STOP_GRACE_S = 20.0
# How often a starting host's health is asked (a poll of a process that prints nothing we read).
HEALTH_POLL_S = 0.05
# How often a ready host's process is checked for having exited.
EXIT_POLL_S = 0.5
DEFAULT_UID_BASE = 200_000
"""The first uid handed to hosts' actions unless told otherwise; each host takes a range above it."""
# Actions one local agent runs at once, and the uids it keeps for them: a host of N cores never runs
# more than N actions at once (the dispatcher grants whole cores), but it may hold sessions besides.
MAX_CONCURRENT_PER_CORE = 8
# Pod-only arguments of the agent's command line that a local host replaces.
_POD_ONLY = ("--listen=", "--workdir-root=")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (the agent binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def machine_memory_bytes() -> int:
    """Physical memory of this machine (what the planner's one node holds)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity), in order."""
    return tuple(sorted(os.sched_getaffinity(0)))


def processes_of_uids(uids: range) -> list[int]:
    """PIDs whose real uid is in ``uids`` (zombies too): what a stopped host must not leave behind."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) in uids:
                            found.append(int(name))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return found


@dataclass(eq=False)
class LocalHost:
    """One host: its agent process and what it was given."""

    name: str
    pool: str
    cores: tuple[int, ...]
    uids: range
    port: int
    root: Path
    proc: subprocess.Popen[bytes]
    template_hash: str
    memory_bytes: int
    created_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None
    phase: HostPhase = "starting"
    draining: bool = False
    failure: str | None = None
    watcher: asyncio.Task[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set once it leaves "starting"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def observation(self) -> HostObservation:
        phase: HostPhase = self.phase
        if phase in ("ready", "starting") and self.draining:
            phase = "draining"
        return HostObservation(
            name=self.name,
            pool=self.pool,
            phase=phase,
            node=NODE,
            address=self.address if self.phase == "ready" else None,
            template_hash=self.template_hash,
            created_at=self.created_at,
            cpu_millicores=1000 * len(self.cores),
            memory_bytes=self.memory_bytes,
            failure=self.failure,
        )


class LocalRuntime:
    """Implements :class:`~arl_tangram.runtime.interface.Runtime` with local agent processes.

    ``cores``: the cores hosts are carved from (default: all this process may use). ``uid_base``:
    the first uid handed to hosts; each host takes a range of its own above it. ``state_dir``: where
    hosts' workdirs and logs go (removed by the agents themselves as they stop).
    """

    def __init__(
        self,
        state_dir: Path,
        cores: Sequence[int] | None = None,
        *,
        uid_base: int = DEFAULT_UID_BASE,
        python: str = sys.executable,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.cores = tuple(cores) if cores is not None else usable_cores()
        if not self.cores:
            raise ValueError("the local runtime needs at least one core")
        if len(set(self.cores)) != len(self.cores):
            raise ValueError(f"cores must be distinct, got {list(self.cores)}")
        self.state_dir = state_dir
        self.uid_base = uid_base
        self.python = python
        self.extra_args = tuple(extra_args)
        self._hosts: dict[str, LocalHost] = {}
        self.started: list[int] = []  # every agent pid ever started (for a caller's leak checks)

    # ---- what is free ---------------------------------------------------------------------------
    def free_cores(self) -> list[int]:
        taken = {c for h in self._hosts.values() for c in h.cores}
        return [c for c in self.cores if c not in taken]

    def _uid_range(self, pool: PoolConfig) -> range:
        """The lowest free range of the uids a host of ``pool`` needs (first fit above uid_base)."""
        stride = pool.host_cores * MAX_CONCURRENT_PER_CORE + pool.sessions_per_host
        start = self.uid_base
        for taken in sorted((h.uids for h in self._hosts.values()), key=lambda r: r.start):
            if start + stride <= taken.start:
                break
            start = max(start, taken.stop)
        return range(start, start + stride)

    # ---- the Runtime protocol -------------------------------------------------------------------
    def hosts(self, pool_key: str) -> list[HostObservation]:
        return [h.observation() for h in self._hosts.values() if h.pool == pool_key]

    def all_hosts(self) -> list[HostObservation]:
        return [h.observation() for h in self._hosts.values()]

    def host(self, name: str) -> LocalHost | None:
        return self._hosts.get(name)

    async def wait_started(self, name: str, timeout_s: float = START_TIMEOUT_S) -> HostObservation:
        """Wait until host ``name`` is ready or failed (or gone); its observation then."""
        host = self._hosts.get(name)
        if host is None:
            raise KeyError(f"no host {name!r} in this runtime")
        await asyncio.wait_for(host.started.wait(), timeout_s)
        return host.observation()

    async def create_host(self, pool: PoolConfig, name: str, node: str | None) -> None:
        if name in self._hosts:
            return  # a retried create
        free = self.free_cores()
        if len(free) < pool.host_cores:
            # The planner sees this machine's cores and should not ask for more; a stale round may.
            log.warning(
                "host %s of %s not started: it needs %d cores and %d of %d are free on this machine",
                name,
                pool.key,
                pool.host_cores,
                len(free),
                len(self.cores),
            )
            return
        cores = tuple(free[: pool.host_cores])
        uids = self._uid_range(pool)
        port = free_port()
        root = self.state_dir / name
        root.mkdir(parents=True, exist_ok=True)
        args = [a for a in agent_args(pool) if not a.startswith(_POD_ONLY)]
        argv = [
            self.python,
            "-m",
            "arl_tangram",
            "sandbox-agent",
            f"--listen=127.0.0.1:{port}",
            f"--workdir-root={root / 'work'}",
            f"--cores={','.join(str(c) for c in cores)}",
            f"--uid-base={uids.start}",
            f"--max-concurrent={pool.host_cores * MAX_CONCURRENT_PER_CORE}",
            *args,
            "--log-level=WARNING",
            *self.extra_args,
        ]
        log_file = (self.state_dir / f"{name}.log").open("ab")
        env = {**os.environ, **dict(pool.env)}
        proc = await asyncio.to_thread(
            subprocess.Popen,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            # Its own session: a Ctrl-C at the terminal reaches `tangram up`, which stops the hosts in
            # order, instead of reaching every agent at once.
            start_new_session=True,
        )
        log_file.close()
        self.started.append(proc.pid)
        host = LocalHost(
            name=name,
            pool=pool.key,
            cores=cores,
            uids=uids,
            port=port,
            root=root,
            proc=proc,
            template_hash=pool.template_hash,
            memory_bytes=pool.host_memory_bytes,
        )
        self._hosts[name] = host
        host.watcher = asyncio.create_task(self._watch(host))
        log.info("host %s of %s starting (pid %d, cores %s, port %d)", name, pool.key, proc.pid, cores, port)

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        host = self._hosts.get(name)
        if host is not None:
            host.draining = draining

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        await self._delete(name)

    async def close(self) -> None:
        """Stop every host (``tangram up`` on its way out)."""
        await asyncio.gather(*(self._delete(name) for name in list(self._hosts)), return_exceptions=True)

    async def _delete(self, name: str) -> None:
        host = self._hosts.get(name)
        if host is None:
            return
        host.phase = "terminating"
        await asyncio.to_thread(self._stop, host)
        if host.watcher is not None:
            host.watcher.cancel()
            await asyncio.gather(host.watcher, return_exceptions=True)
        self._hosts.pop(name, None)

    # ---- inside -----------------------------------------------------------------------------------
    async def _watch(self, host: LocalHost) -> None:
        """Starting -> ready once the agent answers health; failed when its process ends."""
        try:
            await self._watch_start(host)
        finally:
            host.started.set()
        while host.phase == "ready":
            # The process ending is the one thing to notice now (the dispatcher sees failed calls):
            # a poll each period, not a thread blocked in wait() per host.
            if host.proc.poll() is not None:
                host.phase, host.failure = "failed", self._exit_message(host)
                break
            await asyncio.sleep(EXIT_POLL_S)

    async def _watch_start(self, host: LocalHost) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            url = f"http://{host.address}/v1/health"
            while host.phase == "starting":
                if host.proc.poll() is not None:
                    host.phase, host.failure = "failed", self._exit_message(host)
                    return
                if time.monotonic() - host.started_at > START_TIMEOUT_S:
                    host.phase = "failed"
                    host.failure = f"the agent did not answer {url} within {START_TIMEOUT_S:g}s"
                    return
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            host.phase = "ready"
                            host.ready_after_s = time.monotonic() - host.started_at
                            log.info("host %s ready after %.2fs", host.name, host.ready_after_s)
                            break
                await asyncio.sleep(HEALTH_POLL_S)

    def _exit_message(self, host: LocalHost) -> str:
        tail = ""
        with contextlib.suppress(OSError):
            lines = (self.state_dir / f"{host.name}.log").read_text(errors="replace").strip().splitlines()
            tail = lines[-1] if lines else ""
        return f"the agent exited {host.proc.returncode}" + (f": {tail}" if tail else "")

    def _stop(self, host: LocalHost) -> None:
        """SIGTERM (the agent closes its sessions and ends its actions), SIGKILL after the grace;
        then whatever still runs under the host's uids is killed, so nothing outlives its host."""
        proc = host.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("host %s did not stop within %gs: killed", host.name, STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            left = processes_of_uids(host.uids)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)  # a poll interval while they die, not synchronisation
