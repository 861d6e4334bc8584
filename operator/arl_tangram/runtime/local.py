"""The local runtime: each sandbox host is a ``tangram sandbox-agent`` process on this machine.

The embedded mode (``tangram up``) and the demo run pools here instead of on a cluster. A host gets
``host_cores`` of the cores this runtime was given, disjoint from every other host's, a uid range of
its own (so that two agents never hand the same uid to actions, and a host's leftovers can be found
and killed by uid), its own workdir root, and a loopback port. Its command line is the one a host pod
runs (:func:`~arl_tangram.runtime.pods.agent_args`), with the pod-only parts (the pod IP, the pod's
workdir volume) replaced by their local equivalents.

Observations are the process table kept here (never a system call in :meth:`LocalRuntime.hosts`): a
host is ``starting`` until its agent answers ``/v1/health``, ``ready`` after, ``failed`` when its
process exited or never answered, ``draining`` when marked so. A host asked for while too few cores
(or uids) are free is kept *pending*, as a pod no node has room for is: observed ``starting`` with
no node and ``pending`` saying what it lacks and who holds it, and started as soon as a host's stop
frees enough. The controllers then treat it as the scheduler's Unschedulable pod (the pool's status
says why, and its actions are refused with that message once it has waited too long), where it used
to be dropped with a log line while the pool said Healthy and its actions waited for ever. Draining
lives in memory only: a stopped ``tangram up`` stops every host it started, so there is nothing to
find again.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from arl_tangram.domain.pools import PoolConfig
from arl_tangram.errors import InvalidSpec
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
"""Where the search for a free range of uids for hosts' actions starts unless a base is given."""
MIN_UID_BASE = 100_000
"""The lowest uid handed to hosts: below it are the system's and people's own accounts (useradd's
UID_MAX is 60000, systemd's dynamic users end at 65519), whose processes a stop would kill."""
# uids above this are read as negative by tools that keep them in a signed 32-bit int.
MAX_UID = (1 << 31) - 1
# Ranges are locked in blocks of this many uids (one lock per block, so two runs overlap in none).
UID_BLOCK = 10_000
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
    return [pid for pid, _, real, _ in _processes() if real in uids]


def _processes() -> Iterator[tuple[int, str, int, tuple[int, ...]]]:
    """(pid, command name, real uid, every uid and gid) of each process on this machine."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        ids: list[int] = []
        real = -1
        try:
            with open(f"/proc/{name}/status") as fh:
                for line in fh:
                    if line.startswith(("Uid:", "Gid:")):
                        values = [int(v) for v in line.split()[1:]]
                        if line.startswith("Uid:"):
                            real = values[0]
                        ids += values
                    if line.startswith("Gid:"):
                        break
            with open(f"/proc/{name}/comm") as fh:
                comm = fh.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        if real >= 0:
            yield int(name), comm, real, tuple(ids)


def host_uids(pool: PoolConfig) -> int:
    """How many uids a host of ``pool`` hands out: one per action it may run at once, one per
    session it may hold (the agent's --max-concurrent and --max-sessions)."""
    return pool.host_cores * MAX_CONCURRENT_PER_CORE + pool.sessions_per_host


def uids_needed(pools: Iterable[PoolConfig], cores: int) -> int:
    """The uids a runtime of ``cores`` cores never goes past with hosts of ``pools``: at most
    ``cores`` hosts live at once (each has a core of its own), and first fit puts a new host after
    the live ones and the gaps between them, each gap narrower than the new host; so under twice
    ``cores`` widest hosts."""
    return 2 * cores * max((host_uids(p) for p in pools), default=0)


def _subordinate_ids() -> Iterator[tuple[range, str]]:
    # Ranges given to people's rootless containers: their processes appear under these uids.
    for path in ("/etc/subuid", "/etc/subgid"):
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                owner, _, rest = line.partition(":")
                start, _, count = rest.partition(":")
                if start.isdigit() and count.isdigit():
                    yield range(int(start), int(start) + int(count)), f"{owner}'s subordinate ids ({path})"


def uid_users() -> list[tuple[range, str]]:
    """Every uid or gid this machine uses now, each with who uses it: accounts, groups, subordinate
    ranges and running processes (any of their real, effective, saved or filesystem ids)."""
    used = [(range(a.pw_uid, a.pw_uid + 1), f"account {a.pw_name!r}") for a in pwd.getpwall()]
    used += [(range(g.gr_gid, g.gr_gid + 1), f"group {g.gr_name!r}") for g in grp.getgrall()]
    used += list(_subordinate_ids())
    for pid, comm, _, ids in _processes():
        used += [(range(i, i + 1), f"process {pid} ({comm})") for i in set(ids)]
    return used


@dataclass
class UidReservation:
    """uids held for this process's hosts until :meth:`close`: a lock per block that another run's
    :func:`reserve_uids` sees, released by the kernel however this process ends."""

    uids: range
    locks: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for lock in self.locks:
            lock.close()
        self.locks.clear()


def _lock_blocks(uids: range) -> list[socket.socket] | None:
    """One abstract unix socket per UID_BLOCK the range touches (a name in the kernel, no file to
    leave behind); None when another process holds one of them."""
    locks: list[socket.socket] = []
    for block in range(uids.start // UID_BLOCK, (uids.stop - 1) // UID_BLOCK + 1):
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0arl-tangram-uids-{block}")
        except OSError:
            lock.close()
            for held in locks:
                held.close()
            return None
        locks.append(lock)
    return locks


def reserve_uids(base: int | None, count: int) -> UidReservation:
    """Hold ``count`` uids for hosts' actions, from ``base``; with no base, the first free range
    from DEFAULT_UID_BASE up. A range some account, group, process or other ``tangram up`` uses is
    refused (a stop kills every process under its hosts' uids) with :class:`InvalidSpec` naming
    ``--uid-base``, the user and a base that is free."""
    if base is not None and base < MIN_UID_BASE:
        raise InvalidSpec(
            "--uid-base",
            f"{base} is below {MIN_UID_BASE}: those uids belong to the system's and people's "
            "accounts, and a stop kills every process under its hosts' uids; "
            f"pass {MIN_UID_BASE} or more, or leave --uid-base out to pick a free range",
        )
    if count <= 0:
        return UidReservation(range(base or DEFAULT_UID_BASE, base or DEFAULT_UID_BASE))
    used = uid_users()

    def user_of(uids: range) -> tuple[range, str] | None:
        return next(((r, who) for r, who in used if r.start < uids.stop and uids.start < r.stop), None)

    def free_from(start: int) -> UidReservation | None:
        while start + count - 1 <= MAX_UID:
            uids = range(start, start + count)
            clash = user_of(uids)
            if clash is None:
                locks = _lock_blocks(uids)
                if locks is not None:
                    return UidReservation(uids, locks)
                after = uids.stop
            else:
                after = clash[0].stop
            start = -(-max(after, start + 1) // UID_BLOCK) * UID_BLOCK  # the next block boundary
        return None

    if base is None:
        found = free_from(DEFAULT_UID_BASE)
        if found is None:
            raise InvalidSpec("--uid-base", f"no {count} free uids from {DEFAULT_UID_BASE} up to {MAX_UID}")
        return found
    uids = range(base, base + count)
    if uids.stop - 1 > MAX_UID:
        raise InvalidSpec("--uid-base", f"{base} + the {count} uids the hosts need passes {MAX_UID}")
    clash = user_of(uids)
    if clash is None:
        locks = _lock_blocks(uids)
        if locks is not None:
            return UidReservation(uids, locks)
        who = f"another tangram up on this machine holds uids in {uids.start}..{uids.stop - 1}"
    else:
        uid = max(clash[0].start, uids.start)
        who = f"uid {uid} is used by {clash[1]}"
    instead = free_from(uids.stop)
    hint = f"pass --uid-base {instead.uids.start} (free now) or " if instead is not None else ""
    if instead is not None:
        instead.close()
    raise InvalidSpec(
        "--uid-base",
        f"{base}: the hosts need uids {uids.start}..{uids.stop - 1} and {who} (a stop kills every "
        f"process under its hosts' uids); {hint}leave --uid-base out to pick a free range",
    )


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


@dataclass(eq=False)
class PendingHost:
    """A host asked for that does not fit yet: what it needs, and why it waits."""

    name: str
    config: PoolConfig
    reason: str
    created_at: float = field(default_factory=time.time)
    draining: bool = False

    @property
    def pool(self) -> str:
        return self.config.key

    def observation(self) -> HostObservation:
        return HostObservation(
            name=self.name,
            pool=self.config.key,
            phase="draining" if self.draining else "starting",
            node="",  # placed nowhere: it holds none of this machine's cores (the planner's view)
            address=None,
            template_hash=self.config.template_hash,
            created_at=self.created_at,
            cpu_millicores=1000 * self.config.host_cores,
            memory_bytes=self.config.host_memory_bytes,
            pending=self.reason,
        )


class LocalRuntime:
    """Implements :class:`~arl_tangram.runtime.interface.Runtime` with local agent processes.

    ``cores``: the cores hosts are carved from (default: all this process may use). ``uid_base``:
    the first uid handed to hosts; each host takes a range of its own above it, below ``uid_stop``
    when given (the end of a :func:`reserve_uids` range: a host that would pass it is not started,
    since its stop kills whatever runs under its uids). ``state_dir``: where hosts' workdirs and
    logs go (removed by the agents themselves as they stop).
    """

    def __init__(
        self,
        state_dir: Path,
        cores: Sequence[int] | None = None,
        *,
        uid_base: int = DEFAULT_UID_BASE,
        uid_stop: int | None = None,
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
        self.uid_stop = uid_stop
        self.python = python
        self.extra_args = tuple(extra_args)
        self._hosts: dict[str, LocalHost] = {}
        # Hosts asked for that do not fit yet, oldest first (started in that order as room frees).
        self._pending: dict[str, PendingHost] = {}
        self._closing = False
        # Cores and uids of hosts whose process is being started (taken before the await, so that
        # another start meanwhile cannot be given them too).
        self._claims: dict[str, tuple[tuple[int, ...], range]] = {}
        self.started: list[int] = []  # every agent pid ever started (for a caller's leak checks)

    # ---- what is free ---------------------------------------------------------------------------
    def free_cores(self) -> list[int]:
        taken = {c for h in self._hosts.values() for c in h.cores}
        taken.update(c for cores, _ in self._claims.values() for c in cores)
        return [c for c in self.cores if c not in taken]

    def _uid_range(self, pool: PoolConfig) -> range | None:
        """The lowest free range of the uids a host of ``pool`` needs (first fit above uid_base);
        None when it would pass uid_stop."""
        stride = host_uids(pool)
        start = self.uid_base
        held = [h.uids for h in self._hosts.values()] + [uids for _, uids in self._claims.values()]
        for taken in sorted(held, key=lambda r: r.start):
            if start + stride <= taken.start:
                break
            start = max(start, taken.stop)
        if self.uid_stop is not None and start + stride > self.uid_stop:
            return None
        return range(start, start + stride)

    # ---- the Runtime protocol -------------------------------------------------------------------
    def hosts(self, pool_key: str) -> list[HostObservation]:
        return [h.observation() for h in self._every() if h.pool == pool_key]

    def all_hosts(self) -> list[HostObservation]:
        return [h.observation() for h in self._every()]

    def _every(self) -> list[LocalHost | PendingHost]:
        return [*self._hosts.values(), *self._pending.values()]

    def pending(self, name: str) -> PendingHost | None:
        """The host ``name`` if it waits for room (see :class:`PendingHost`)."""
        return self._pending.get(name)

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
        if name in self._hosts or name in self._pending:
            return  # a retried create
        if self._closing:
            return
        why = self._no_room(pool)
        if why is not None:
            # Kept, not dropped: the pool's status and its waiting actions must hear why no host
            # comes (the controllers read ``pending`` as a pod's Unschedulable), and it starts by
            # itself once room frees.
            self._pending[name] = PendingHost(name, pool, why)
            log.info("host %s of %s waits: %s", name, pool.key, why)
            return
        await self._spawn(pool, name)

    def _no_room(self, pool: PoolConfig) -> str | None:
        """Why a host of ``pool`` cannot start now (too few free cores or uids), or None."""
        free = self.free_cores()
        if len(free) < pool.host_cores:
            holders: dict[str, int] = {}
            for h in self._hosts.values():
                holders[h.pool] = holders.get(h.pool, 0) + len(h.cores)
            held = ", ".join(f"{n} by {key}'s hosts" for key, n in sorted(holders.items()))
            return (
                f"it needs {pool.host_cores} core(s) and {len(free)} of the {len(self.cores)} given to "
                f"tangram up are free ({held or 'none held'}); it starts when hosts stop and free "
                "enough (scale other pools down, or give tangram up more --cores)"
            )
        if self._uid_range(pool) is None:
            return (
                f"its {host_uids(pool)} uids do not fit below {self.uid_stop}, the end of the uids "
                "reserved for this machine's hosts; it starts when hosts stop and free enough"
            )
        return None

    async def _start_pending(self) -> None:
        """Start each pending host that fits now, oldest first (room freed by a host's stop)."""
        for name, waiting in list(self._pending.items()):
            if self._closing:
                return
            if self._pending.get(name) is not waiting or self._no_room(waiting.config) is not None:
                continue
            del self._pending[name]
            log.info("host %s of %s: room freed, starting", name, waiting.pool)
            await self._spawn(waiting.config, name, draining=waiting.draining)

    async def _spawn(self, pool: PoolConfig, name: str, *, draining: bool = False) -> None:
        """Start host ``name`` on the first free cores and uids (``_no_room`` said there are)."""
        cores = tuple(self.free_cores()[: pool.host_cores])
        uids = self._uid_range(pool)
        assert uids is not None
        self._claims[name] = (cores, uids)
        try:
            await self._start_process(pool, name, cores, uids, draining)
        finally:
            self._claims.pop(name, None)

    async def _start_process(
        self, pool: PoolConfig, name: str, cores: tuple[int, ...], uids: range, draining: bool
    ) -> None:
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
            draining=draining,
        )
        self._hosts[name] = host
        host.watcher = asyncio.create_task(self._watch(host))
        log.info("host %s of %s starting (pid %d, cores %s, port %d)", name, pool.key, proc.pid, cores, port)

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        host = self._hosts.get(name) or self._pending.get(name)
        if host is not None:
            host.draining = draining

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        await self._delete(name)

    async def close(self) -> None:
        """Stop every host (``tangram up`` on its way out); none waiting starts."""
        self._closing = True
        self._pending.clear()
        await asyncio.gather(
            *(self._delete(name, at_once=True) for name in list(self._hosts)), return_exceptions=True
        )

    async def _delete(self, name: str, at_once: bool = False) -> None:
        if self._pending.pop(name, None) is not None:
            return  # it never started: nothing to stop
        host = self._hosts.get(name)
        if host is None:
            return
        host.phase = "terminating"
        await asyncio.to_thread(self._stop, host, at_once)
        if host.watcher is not None:
            host.watcher.cancel()
            await asyncio.gather(host.watcher, return_exceptions=True)
        self._hosts.pop(name, None)
        await self._start_pending()  # its cores and uids are free now

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

    def _stop(self, host: LocalHost, at_once: bool = False) -> None:
        """SIGTERM (the agent closes its sessions and ends its actions), SIGKILL after the grace;
        then whatever still runs under the host's uids is killed, so nothing outlives its host.

        ``at_once`` (``tangram up`` stopping): its actions are killed first. The agent answers the
        requests in flight before it stops (aiohttp waits up to a minute for them), so with an
        action still running it outwaited the grace and was killed itself, its workdirs left behind."""
        proc = host.proc
        if at_once:
            self._kill_uids(host)
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
        self._kill_uids(host)

    @staticmethod
    def _kill_uids(host: LocalHost) -> None:
        """SIGKILL every process under the host's uids until none is left (within the grace)."""
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            left = processes_of_uids(host.uids)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)  # a poll interval while they die, not synchronisation
