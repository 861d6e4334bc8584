"""The dispatcher: the one queue, the scheduler over every pool, and the calls that run its grants.

Every door (ActionBatch controller, gateway, embedded mode) hands actions to :meth:`Dispatcher.run`.
The scheduler (the ``tangram`` policy by default) decides on each arrival and completion which
queued actions start and with how many cores of which host; each grant becomes one HTTP call to
that host's agent, carrying the exact cores and an idempotency key (the logical action's key and
the attempt), so that a repeated call never runs the action twice.

Failures are sorted once (see :mod:`arl_tangram.dispatch.agent`): infrastructure failures (a host
lost, an unreachable or garbled agent) are retried elsewhere within the request's retry budget;
program failures are outcomes and never retried. A session lives on one host; when that host is
lost the session is reported lost to its callers, never silently recreated empty.

Not thread-safe: everything runs on one asyncio loop, and scheduling decisions never await.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from arl_tangram.core.action import Action, Amdahl, DurationModel, Fixed
from arl_tangram.core.policies.registry import POLICIES
from arl_tangram.core.pool import Grant
from arl_tangram.core.scheduler import DecisionStats, Scheduler
from arl_tangram.dispatch.agent import ANSWER_MARGIN_S, AgentClient, AgentRefused, ConnectFailed, Unreachable
from arl_tangram.dispatch.outcomes import interpret
from arl_tangram.dispatch.rewards import RewardRouter
from arl_tangram.domain.actions import (
    OUTAGE_RETRY_MIN_S,
    SANDBOXFUSION_WIRES,
    ActionOutcome,
    ActionRequest,
    Outage,
    Outcome,
    Reason,
)
from arl_tangram.domain.batches import Runner, runner_of
from arl_tangram.domain.pools import PoolConfig, agent_ttl_s, pool_key
from arl_tangram.errors import (
    InfrastructureError,
    InvalidSpec,
    KeyConflict,
    NotFound,
    QueueFull,
    Stopping,
    TangramError,
    TargetUnavailable,
)
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.runtime.interface import Resizer

log = logging.getLogger(__name__)

GIB = 1 << 30
# A host that failed this many calls in a row takes no new work until it answers again.
UNHEALTHY_AFTER = 3
# How much one new duration moves the pool's running estimate of an action kind's duration.
EWMA_WEIGHT = 0.2
# The parallel fraction assumed for an elastic test run until the pool has measured better.
DEFAULT_PARALLEL_FRACTION = 0.9
STOPPING = "the dispatcher is stopping (its operator is shut down or lost its leadership); send it again"
# Wait for a re-attached action's result in slices, so that a lost host is noticed between them.
REATTACH_SLICE_S = 20.0
# Recent ACTs kept per pool for its status and the planner.
ACT_WINDOW_S = 300.0
# The arrival rate the planner's steady-state term sees: short, so a burst's capacity is released
# soon after the burst ends (the idle timeout still holds hosts against flapping).
RATE_WINDOW_S = 60.0
# When actions wait and a host has no free core, a core running an action of a kind whose recent
# runs all ended within this long is booked for the next action: the agent queues the booked call
# behind the running one (its fork server starts it the moment the core is free, and its clock
# starts then), so the core does not sit idle for the round trip between one action's answer and
# the next call. One booking per core. The cost: an action booked behind one that turns out long
# waits for it even if another core frees first (the recent runs are the only forecast there is).
BOOK_AHEAD_MAX_S = 0.1
BOOK_AHEAD_RUNS = 16  # how many recent runs of a kind must all have been that short
# A call cut off on its way (see ``_settle``) is settled by asking its agent again, first after this
# long, then twice as long each time up to the second figure.
SETTLE_FIRST_S = 0.5
SETTLE_MAX_S = 5.0
# How long failed reads of an attempt's stored answer are tried again before it runs anew.
REREAD_FOR_S = 60.0


def agent_key(key: str, attempt: int) -> str:
    """The idempotency key an agent sees: URL-safe, fixed length, one per (action, attempt)."""
    return f"{hashlib.sha256(key.encode()).hexdigest()[:32]}-{attempt}"


# Decision times kept (the latest; the operator exports and clears its own, ``decision_us``).
DECISIONS_KEPT = 4096
# Keys whose actions the dispatcher remembers, to refuse one sent again with another action (the
# agents keep as many finished responses by default: ``--action-keys-max``).
KEYS_REMEMBERED = 10_000


# Outcomes of actions their target refused before anything ran (its payload, or more units than it
# could ever grant, or a pool with no host coming): their key stays free for a corrected request,
# or the same one sent again.
_NOTHING_RAN = (Reason.INVALID_PAYLOAD, Reason.CAPACITY_EXCEEDED, Reason.TARGET_UNAVAILABLE)


def _expiry_s(config: PoolConfig, sess: _Session) -> float:
    """The dispatcher's idle TTL for a session: the pool's; or, for one whose opener (the gateway)
    closes it at a TTL of its own, a backstop behind that (``agent_ttl_s``), for an opener that is
    gone. Only the opener sees a call that holds the session before it reaches the dispatcher (a
    body on its way): closing at the same TTL here lost such a session under it."""
    return config.session_ttl_s if sess.ttl_s is None else agent_ttl_s(sess.ttl_s)


def _nothing_ran(outcome: ActionOutcome) -> bool:
    """Whether nothing of the action ran to an end worth answering a repeat with: refused, or
    cancelled (a repeat of a cancelled key runs it)."""
    return outcome.reason in _NOTHING_RAN or outcome.state is Outcome.CANCELLED


# Each wire's field for the memory an action asks for (SandboxFusion's notebook has none).
_MEMORY_FIELD: dict[str, str] = {"run_code": "memory_limit_MB", "native": "memory_mb"}


def _memory_asked(req: ActionRequest) -> tuple[str, int] | None:
    """The memory an action asks for, in MB, with its field's name as the caller wrote it: a
    SandboxFusion body's ``memory_limit_MB`` (-1 or 0: the pool's most, none asked) or an agent
    payload's ``memory_mb``; None when it asks for none."""
    name = _MEMORY_FIELD.get(req.wire)
    if name is None:
        return None
    value = req.payload.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        # "1024" too, as the body's model coerces it; an integer of any size stays exact (a float
        # of a 400-digit one overflowed, and the action was left begun and never answered).
        asked = value if isinstance(value, int) else int(value)
    except (ValueError, OverflowError):
        return None  # the agent's own validation names it
    return (name, asked) if asked > 0 else None


def _runner(request: ActionRequest) -> Runner:
    """How a test's output is read for its reward (``runner_of``); the other kinds have none."""
    return runner_of(request.payload) if request.kind == "test" else "unknown"


def action_digest(request: ActionRequest) -> str:
    """What makes a request the action it is (not its timeout, priority or retries), hashed."""
    what: list[object] = [request.kind, request.namespace, request.target, request.wire, request.session]
    what += [request.units_min, request.units_max, request.payload]
    text = json.dumps(what, sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class _SessionClosed(Exception):
    """The session an action was granted cores for was closed meanwhile."""


@dataclass(frozen=True)
class HostEndpoint:
    """A ready sandbox host: its pod name, agent address (``ip:port``) and the core ids it grants."""

    name: str
    address: str
    cores: tuple[int, ...]
    memory_bytes: int
    draining: bool = False


@dataclass(eq=False)
class _Session:
    name: str
    last_used: float
    host: str | None = None
    agent_id: str | None = None
    lost: str | None = None
    busy: bool = False
    backlog: deque[_Job] = field(default_factory=deque)
    ttl_s: float | None = None  # None: the pool's sessions.ttlSeconds
    # Its action waiting in the scheduler's queue, if any (at most one: the rest wait in
    # ``backlog``), so that closing the session answers it too.
    queued: _Job | None = None


# Closed sessions remembered per pool, so that an action naming one is refused (SessionLost)
# instead of silently starting an empty session of the same name.
CLOSED_SESSIONS_KEPT = 100_000


@dataclass(eq=False)
class _Job:
    request: ActionRequest
    future: asyncio.Future[ActionOutcome]
    submitted: float
    attempts: int
    action: Action | None = None
    grant: Grant | None = None
    task: asyncio.Task[None] | None = None
    queued_s: float = 0.0
    queued_since: float = 0.0
    cancelled: bool = False
    host_lost: bool = False
    # Its grant went back to the scheduler when it was sent (its cores booked for the next action).
    released: bool = False
    # The callers' own futures for its outcome (``Dispatcher._outcome``), set with ``future``.
    waiters: list[asyncio.Future[ActionOutcome]] = field(default_factory=list)


@dataclass
class _Pool:
    config: PoolConfig
    cpu: CpuManager
    endpoints: dict[str, HostEndpoint] = field(default_factory=dict)
    sessions: dict[str, _Session] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    unhealthy: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)  # dedicated pods whose trajectory ended
    closed: dict[str, str] = field(default_factory=dict)  # session -> why it closed (oldest first)
    # Agent keys each host reported running or finished when it was first seen (re-attachment).
    known_running: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    known_finished: dict[str, str] = field(default_factory=dict)
    # Agent keys found running that no job has re-attached to yet -> (host, the cores booked for
    # them, the task waiting for their end). Their cores stay booked until they end: an attempt
    # whose batch was deleted while no operator ran holds them on its agent, and a new action
    # granted them waited there behind it, up to the pool's timeout.
    orphans: dict[str, tuple[str, tuple[int, ...], asyncio.Task[None]]] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    estimates: dict[str, float] = field(default_factory=dict)
    acts: deque[tuple[float, float]] = field(default_factory=deque)
    runs: deque[tuple[float, float]] = field(default_factory=deque)
    last_active: float | None = None
    arrivals: deque[float] = field(default_factory=deque)
    # (host, core) -> the jobs sent to the agent on that core, oldest first (at most two: the one
    # running there, and the one booked behind it).
    holders: dict[tuple[str, int], list[_Job]] = field(default_factory=dict)
    # The latest run times of each action kind (the forecast for booking ahead).
    recent_runs: dict[str, deque[float]] = field(default_factory=dict)
    # Hosts with calls in doubt (cut off on their way, being settled): not replaced meanwhile.
    in_doubt: dict[str, int] = field(default_factory=dict)
    # Deleted, its actions being stopped: it takes no new action or session meanwhile; those who
    # ask wait for ``removed``, then find the pool made again under its name (``recreated``) or none.
    removing: bool = False
    removed: asyncio.Event = field(default_factory=asyncio.Event)
    recreated: PoolConfig | None = None
    # Actions that came before its hosts were first known (just after a start): waiting too, so
    # counted in its queue's statistics and limits.
    before_sync: set[_Job] = field(default_factory=set)
    # No host and none coming (the controller's ``pool_outage``): what cannot run elsewhere is refused.
    outage: Outage | None = None
    # Refused callers are demand still (a batch's held actions and the gateway's callers send again
    # after Retry-After): action key -> (until when it counts, the units it needs), each key once
    # however often it is sent again. The pool's statistics count them as waiting while the outage
    # lasts: its queueDepth says how much work waits for a host, and the planner keeps looking for
    # room for one (its "no room" is what the outage may rest on) and keeps a host that waits for a
    # node, instead of forgetting both once the refusals empty the queue.
    refused: dict[str, tuple[float, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class HostLoad:
    """What holds a host: running actions and sessions pinned to it."""

    running: int
    sessions: int
    cores_busy: int


@dataclass(frozen=True)
class PoolStats:
    """The dispatcher's view of one pool, for its status and the capacity planner."""

    queued_actions: int
    queued_units: int
    running_actions: int
    running_units: int
    cores_total: int
    sessions: int
    act_recent_s: tuple[float, ...]
    arrival_rate_per_s: float
    mean_action_s: float
    last_active: float | None
    hosts: dict[str, HostLoad]
    unhealthy: frozenset[str]
    waiting_trajectories: int = 0
    retired: frozenset[str] = frozenset()


# The variable the operator and ``tangram up`` read the scheduler's tenant weights from.
TENANT_WEIGHTS_ENV = "TANGRAM_TENANT_WEIGHTS"


def tenant_weights_from_env(name: str) -> tuple[tuple[str, float], ...]:
    """``TENANT=WEIGHT,...`` from the environment variable ``name`` (the operator's and ``tangram
    up``'s ``TANGRAM_TENANT_WEIGHTS``, one parser for both): each weight a positive, finite number,
    each tenant once."""
    text = os.environ.get(name, "").strip()
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, value = item.partition("=")
        tenant = tenant.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not tenant or not (math.isfinite(weight) and weight > 0):
            raise InvalidSpec(name, f"{item[:80]!r} is not TENANT=WEIGHT with a positive number")
        if tenant in out:
            raise InvalidSpec(name, f"tenant {tenant[:80]!r} is given twice")
        out[tenant] = weight
    return tuple(out.items())


class Dispatcher:
    """Implements :class:`~arl_tangram.domain.actions.ActionService` over sandbox agents."""

    def __init__(
        self,
        agent: AgentClient,
        *,
        policy: str = "tangram",
        max_waiting_per_pool: int = 100_000,
        max_waiting_per_tenant: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_host_unhealthy: Callable[[str, str], None] | None = None,
        on_started: Callable[[str, int], None] | None = None,
        resizer: Resizer | None = None,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.agent = agent
        if tenant_weights and policy != "tangram":
            # Only tangram orders tenants by weighted fair share; the others would drop them silently.
            raise InvalidSpec("tenant weights", f"only the tangram policy weighs tenants, not {policy!r}")
        options: dict[str, Any] = {"tenant_weights": dict(tenant_weights)} if tenant_weights else {}
        self.scheduler: Scheduler = POLICIES[policy]({}, **options)
        self.scheduler.stats = DecisionStats(keep=DECISIONS_KEPT)
        self.clock = clock
        self.max_waiting_per_pool = max_waiting_per_pool
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.on_host_unhealthy = on_host_unhealthy
        # Called with (request key, attempt) when an attempt starts or is re-attached to.
        self.on_started = on_started
        # Dedicated pools get each action's cores by resizing its session's pod in place.
        self.resizer = resizer
        # Awaited with (kind, namespace, name) before a pool or reward service this dispatcher does
        # not hold is answered NotFound: its owner may know it from elsewhere (the operator's watch,
        # just after a start or failover, before the object's first reconcile; or the API server,
        # when the object was created a moment before the request and no watch has seen it yet) and
        # add it, so that a request in that window waits for hosts instead of failing as if the
        # object did not exist.
        self.learn: Callable[[str, str, str], Awaitable[None]] | None = None
        self._background: set[asyncio.Task[bool]] = set()
        self._pools: dict[str, _Pool] = {}
        self.rewards = RewardRouter(agent, clock)
        self._jobs: dict[str, _Job] = {}
        # What each recent key asked for (``action_digest``), the newest last: a key sent again with
        # another action is refused instead of answered with the first one's result.
        self._asked: OrderedDict[str, str] = OrderedDict()
        # Where each of those keys ran to its end (pool, attempt, host), outside sessions: a repeat
        # after it ended is answered from that host's stored result. Without it the repeat ran
        # again, on whichever host the scheduler chose (the first one's agent alone knows the key).
        self._ran: dict[str, tuple[str, int, str]] = {}
        self._by_action: dict[int, _Job] = {}
        self._tenant_waiting: dict[str, int] = {}
        self.decision_us: deque[float] = deque(maxlen=DECISIONS_KEPT)
        # Pools whose /run_code limits were lowered to the pool's (``_within_limits``): said once each.
        self._capped_pools: set[str] = set()
        self.booked_ahead = 0  # grants sent while the action before them still ran on their cores
        self._stopped = False

    # ---- pools and hosts ------------------------------------------------------------------------
    def upsert_pool(self, config: PoolConfig) -> None:
        """Add a pool or take its new settings (limits apply to actions submitted from now on)."""
        pool = self._pools.get(config.key)
        if pool is None:
            cpu = CpuManager([], pool=config.key)
            self._pools[config.key] = _Pool(config=config, cpu=cpu)
            self.scheduler.pools[config.key] = cpu
        elif pool.removing:
            # Made again under its name while the old one's actions are being stopped (nothing
            # holds the name while it goes): the new one takes the name once the old one is gone.
            pool.recreated = config
        else:
            pool.config = config

    def has_pool(self, namespace: str, name: str) -> bool:
        return pool_key(namespace, name) in self._pools

    async def _find_pool(self, namespace: str, name: str) -> _Pool | None:
        """The pool, after asking ``learn`` for one this dispatcher does not hold yet."""
        key = pool_key(namespace, name)
        learned = False
        while True:
            pool = self._pools.get(key)
            if pool is not None and pool.removing:
                await pool.removed.wait()  # then the pool made again under its name, or none
                if self._stopped:
                    raise Stopping(STOPPING)
            elif pool is None and not learned and self.learn is not None:
                learned = True
                await self.learn("ActionPool", namespace, name)
            else:
                return pool

    def pool_config(self, namespace: str, name: str) -> PoolConfig | None:
        pool = self._pools.get(pool_key(namespace, name))
        return pool.config if pool else None

    async def find_pool_config(self, namespace: str, name: str) -> PoolConfig | None:
        """``pool_config``, after asking ``learn`` for a pool this dispatcher does not hold yet."""
        pool = await self._find_pool(namespace, name)
        return pool.config if pool else None

    def session_lost(self, namespace: str, pool: str, session: str) -> str | None:
        """Why a session's state is gone (its host lost, or closed here), as its actions are told
        (SessionLost); None while it stands."""
        state = self._pools.get(pool_key(namespace, pool))
        if state is None:
            return None
        sess = state.sessions.get(session)
        if sess is not None:
            return sess.lost
        why = state.closed.get(session)
        return None if why is None else f"session {session!r} was {why}: its state is gone"

    async def remove_pool(self, key: str, uid: str = "") -> None:
        """The pool (of ``uid``; "": whichever holds the name) was deleted: its queued and running
        actions fail (PoolNotFound)."""
        pool = self._pools.get(key)
        if pool is None:
            return
        if pool.removing:
            # The pool made again under its name meanwhile is deleted in turn: it is not made (it
            # came back once the old one was gone, with no daemon left to give it hosts).
            if pool.recreated is not None and uid in ("", pool.recreated.uid):
                pool.recreated = None
            return
        # From here on it takes nothing new: an action sent while the running ones are stopped
        # below (awaits) was queued on it and, once the pool was gone, waited for ever.
        pool.removing = True
        try:
            await self._stop_pool(pool)
        finally:
            del self._pools[key]  # still this pool: a pool made meanwhile waits in ``recreated``
            self.scheduler.pools.pop(key, None)
            if pool.recreated is not None:
                self.upsert_pool(pool.recreated)
            pool.removed.set()

    async def _stop_pool(self, pool: _Pool) -> None:
        key = pool.config.key
        for orphan in list(pool.orphans):
            self._unbook_orphan(pool, orphan)  # (its host is removed below)
        jobs = [j for j in self._jobs.values() if pool_key(j.request.namespace, j.request.target) == key]
        for sess in pool.sessions.values():
            sess.backlog.clear()  # failed below with the rest: none starts after its predecessor
        tasks = [j.task for j in jobs if j.task is not None]
        for job in jobs:
            job.cancelled = True  # its task (stopped below) ends as cancelled: no retry
            self._fail(job, Reason.POOL_NOT_FOUND, f"ActionPool {key} was deleted")
        # A failed job leaves the table at once: its task is stopped here, before the hosts go
        # (removing a host that still runs an action is refused).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in list(pool.endpoints):
            await self._lose_host(pool, name)

    async def sync_hosts(self, key: str, ready: Iterable[HostEndpoint]) -> None:
        """Make the pool's hosts exactly ``ready``: new ones are asked what they run (to re-attach
        actions started before an operator restart) and added; missing ones are lost."""
        pool = self._pools.get(key)
        if pool is None or pool.removing:
            return  # a pool made again under its name while the old one goes: hosts at its next sync
        wanted = {h.name: h for h in ready}
        for name in [n for n in pool.endpoints if n not in wanted]:
            await self._lose_host(pool, name)
        fresh = [h for n, h in wanted.items() if n not in pool.endpoints]
        scans = await asyncio.gather(*(self.agent.inflight(h.address) for h in fresh), return_exceptions=True)
        for host, scan in zip(fresh, scans, strict=True):
            if isinstance(scan, BaseException):
                log.warning("host %s of %s did not list its actions (%s); added later", host.name, key, scan)
                continue
            running, finished = scan
            pool.known_running.update({k: (host.name, cores) for k, cores in running.items()})
            pool.known_finished.update(dict.fromkeys(finished, host.name))
            pool.endpoints[host.name] = host
            if pool.config.mode == "dedicated":
                self._idle(pool, host.name)
            cores = host.cores[: pool.config.host_cores]
            pool.cpu.add_host(
                SandboxHost(
                    host.name,
                    [list(cores)],
                    memory_gib=host.memory_bytes / GIB,
                    max_sessions=pool.config.sessions_per_host,
                )
            )
            for agent_key_, held in running.items():
                self._book_orphan(pool, host, agent_key_, held)
        for name, host in wanted.items():
            if name in pool.cpu.hosts:
                pool.cpu.hosts[name].draining = (
                    host.draining or name in pool.unhealthy or name in pool.retired
                )
        pool.synced.set()
        self._pump()

    def _book_orphan(self, pool: _Pool, host: HostEndpoint, key: str, cores: tuple[int, ...]) -> None:
        """Book the cores an action found running on a new host holds, until a job re-attaches to
        it (``_unbook_orphan``) or it ends there."""
        cpu_host = pool.cpu.hosts.get(host.name)
        if cpu_host is None:
            return
        taken = tuple(c for c in cores if any(c in free for free in cpu_host.free))
        if not taken:
            return
        for free in cpu_host.free:
            free.difference_update(taken)
        task = asyncio.get_running_loop().create_task(
            self._await_orphan(pool, host, key), name=f"orphan {host.name} {key}"
        )
        pool.orphans[key] = (host.name, taken, task)

    async def _await_orphan(self, pool: _Pool, host: HostEndpoint, key: str) -> None:
        """Wait for an unclaimed action's end on its host, then give its cores back."""
        try:
            while host.name in pool.endpoints and key in pool.orphans:
                try:
                    where, _ = await self.agent.lookup(host.address, key, REATTACH_SLICE_S)
                except InfrastructureError:
                    await asyncio.sleep(1.0)  # the host's loss, if it is lost, ends this
                    continue
                except Exception as exc:  # an answer no agent gives: the cores are not held for ever
                    log.warning(
                        "host %s: %s could not be followed (%s); its cores are free", host.name, key, exc
                    )
                    break
                if where != "running":
                    break
        finally:
            if pool.orphans.get(key, (None, None, None))[2] is asyncio.current_task():
                self._unbook_orphan(pool, key)
                self._pump()

    @staticmethod
    def _unbook_orphan(pool: _Pool, key: str) -> None:
        """Give an orphan's booked cores back (its host may be gone: then nothing to give)."""
        host_name, cores, task = pool.orphans.pop(key)
        if task is not asyncio.current_task():
            task.cancel()
        cpu_host = pool.cpu.hosts.get(host_name)
        if cpu_host is not None:
            cpu_host.give_back(cores)

    async def _lose_host(self, pool: _Pool, name: str) -> None:
        """A host is gone (pod deleted, not ready): its running actions are infrastructure failures,
        retried elsewhere; its sessions are lost."""
        for key in [k for k, (h, _, _) in pool.orphans.items() if h == name]:
            # Given back before the host is removed, which refuses a host whose cores are not all
            # free (kept, every later sync failed on it and the pool got no new host).
            self._unbook_orphan(pool, key)
        if name in pool.cpu.hosts:
            pool.cpu.hosts[name].draining = True
        lost: dict[str, str] = {}
        for sess in pool.sessions.values():
            if sess.host == name and sess.lost is None:
                sess.lost = lost[sess.name] = f"session {sess.name!r} was lost with its host {name}"
        # A lost session's action still waiting for a core fails now: left queued, it was granted
        # the lost host's core its running actions give back below (pinned there, which made the
        # host's removal fail), or, once unpinned, another host's, where it ran in a new empty session.
        for job in list(self._jobs.values()):
            req = job.request
            if (
                job.grant is None
                and req.session in lost
                and pool_key(req.namespace, req.target) == pool.config.key
            ):
                self._fail(job, Reason.SESSION_LOST, lost[req.session])
        tasks = []
        for job in self._jobs.values():
            if job.grant is not None and job.grant.host == name and job.task is not None:
                job.host_lost = True
                job.task.cancel()
                tasks.append(job.task)
        await asyncio.gather(*tasks, return_exceptions=True)
        host = pool.cpu.hosts.get(name)
        if host is not None:
            for trajectory in list(host.pinned):
                pool.cpu.end_trajectory(trajectory)
            pool.cpu.remove_host(name)
        pool.endpoints.pop(name, None)
        pool.failures.pop(name, None)
        pool.unhealthy.discard(name)
        pool.retired.discard(name)
        for k in [k for k, (h, _) in pool.known_running.items() if h == name]:
            del pool.known_running[k]
        for k in [k for k, h in pool.known_finished.items() if h == name]:
            del pool.known_finished[k]
        for sess in list(pool.sessions.values()):
            if sess.lost is not None:
                self._drain_lost_session(pool, sess)

    @staticmethod
    def _retire(pool: _Pool, host: str) -> None:
        pool.retired.add(host)
        pool.cpu.hosts[host].draining = True

    def drain(self, key: str, host: str, draining: bool = True) -> None:
        """Cordon (or uncordon) a host: it takes no new action or session."""
        pool = self._pools.get(key)
        if pool is not None and host in pool.cpu.hosts:
            pool.cpu.hosts[host].draining = draining or host in pool.unhealthy or host in pool.retired
            self._pump()

    def set_outage(self, key: str, outage: Outage | None) -> None:
        """Whether the pool has no host and none coming (``controllers.actionpool.pool_outage``).
        While it does, an action that waits for a host (none of its session's holds it) is refused
        with the outage's message, those waiting now at once: its caller hears why and when to send
        it again, where it waited until the caller gave up. Running actions run on."""
        pool = self._pools.get(key)
        if pool is None:
            return
        if (outage is None) != (pool.outage is None):
            log.warning("%s", outage.message if outage else f"pool {key} has a host coming again")
        pool.outage = outage
        if outage is None or not pool.waiting:
            return
        stranded = [
            job
            for job in self._by_action.values()
            if job.grant is None
            and job.action is not None
            and job.action.pool == key
            and self._stranded(pool, job.action.trajectory)
        ]
        for job in stranded:
            self._refuse(pool, job, outage)

    @staticmethod
    def _stranded(pool: _Pool, trajectory: str) -> bool:
        """Whether an action of ``trajectory`` can only wait while the pool's outage lasts: no host
        of the pool holds its session (a draining one still serves the sessions pinned to it)."""
        return pool.outage is not None and pool.cpu.pins.get(trajectory) not in pool.cpu.hosts

    @staticmethod
    def _fresh_session(pool: _Pool, session: str | None) -> bool:
        """Whether an action of ``session`` would be queued now as a new one: no session, or one
        neither busy (its action goes behind the running one) nor lost or closed (``SessionLost``
        is its answer, outage or not)."""
        if session is None:
            return True
        sess = pool.sessions.get(session)
        if sess is None:
            return session not in pool.closed
        return not sess.busy and sess.lost is None

    def _refuse(self, pool: _Pool, job: _Job, outage: Outage) -> None:
        """Refuse a stranded job, and the actions of its session queued behind it (stranded too: the
        session has no host). In a loop: refused one by one, each the next one's ``_queue`` (through
        ``_fail``'s ``_next_in_session``), a long backlog overflowed the stack."""
        sess = pool.sessions.get(job.request.session) if job.request.session else None
        behind = list(sess.backlog) if sess is not None else []
        if sess is not None:
            sess.backlog.clear()
        for refused in (job, *behind):
            self._count_refused(pool, refused.request, outage)
            self._fail(refused, Reason.TARGET_UNAVAILABLE, outage.message)

    def _count_refused(self, pool: _Pool, req: ActionRequest, outage: Outage) -> None:
        """Count a refused action as demand for two of its Retry-After (``_Pool.refused``): sent
        again within one, it stays counted, once. At most the pool's wait limit are counted, as at
        most that many may wait in its queue: keyless callers sending again under new keys would
        otherwise grow the count, and its memory, with every retry."""
        if req.key not in pool.refused and len(pool.refused) >= self.max_waiting_per_pool:
            return
        pool.refused[req.key] = (self.clock() + 2 * outage.retry_after_s, max(1, req.units_min))

    def stats(self, key: str) -> PoolStats | None:
        """The pool's queue, load per host and recent ACTs."""
        pool = self._pools.get(key)
        if pool is None:
            return None
        now = self.clock()
        while pool.acts and pool.acts[0][0] < now - ACT_WINDOW_S:
            pool.acts.popleft()
        while pool.runs and pool.runs[0][0] < now - ACT_WINDOW_S:
            pool.runs.popleft()
        while pool.arrivals and pool.arrivals[0] < now - RATE_WINDOW_S:
            pool.arrivals.popleft()
        queued = list(self.scheduler.queue.fcfs(key))
        running = [j for j in self._jobs.values() if j.grant is not None and j.grant.action.pool == key]
        per_host: dict[str, list[int]] = {h: [0, 0, 0] for h in pool.cpu.hosts}
        for j in running:
            assert j.grant is not None
            entry = per_host.setdefault(j.grant.host, [0, 0, 0])
            entry[0] += 1
            entry[2] += j.grant.units
        for sess in pool.sessions.values():
            if sess.host in per_host and sess.lost is None:
                per_host[sess.host][1] += 1
        durations = [act for _, act in pool.acts]
        runs = [run for _, run in pool.runs]
        # Trajectories with a queued action and no host yet (dedicated pools start one pod for each).
        waiting_trajectories = len({a.trajectory for a in queued if a.trajectory not in pool.cpu.pins})
        pool.refused = {k: held for k, held in pool.refused.items() if now < held[0]}
        # (Once the outage ends, those still held are sent again and queued: counted from then.)
        refused = list(pool.refused.values()) if pool.outage is not None else []
        return PoolStats(
            queued_actions=len(queued)
            + sum(len(s.backlog) for s in pool.sessions.values())
            + len(pool.before_sync)
            + len(refused),
            queued_units=sum(a.min_units for a in queued) + sum(units for _, units in refused),
            running_actions=len(running),
            running_units=sum(j.grant.units for j in running if j.grant is not None),
            cores_total=pool.cpu.total_units(),
            sessions=sum(1 for s in pool.sessions.values() if s.lost is None),
            act_recent_s=tuple(durations),
            arrival_rate_per_s=len(pool.arrivals) / RATE_WINDOW_S,
            mean_action_s=sum(runs) / len(runs) if runs else 0.0,
            last_active=pool.last_active,
            hosts={h: HostLoad(*v) for h, v in per_host.items()},
            # A host whose calls are being settled stays (drained): replacing it would kill what it
            # may still run, and lose the results it keeps.
            unhealthy=frozenset(h for h in pool.unhealthy if not pool.in_doubt.get(h)),
            # One for all the refused: a dedicated pool keeps one pod looking for a node (one each
            # would be as many pods pending where none fits); each gets its own once it is queued.
            waiting_trajectories=waiting_trajectories + min(1, len(refused)),
            retired=frozenset(pool.retired),
        )

    async def shutdown(self) -> None:
        """Stop waiting for every action without cancelling any on the agents: what runs there goes
        on, and the next leader re-attaches to it (leadership lost, operator stopping)."""
        self._stopped = True  # a caller waiting for a pool being deleted starts nothing after this
        tasks = [j.task for j in self._jobs.values() if j.task is not None]
        for pool in self._pools.values():
            tasks += [task for _, _, task in pool.orphans.values()]
            pool.orphans.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in list(self._jobs.values()):
            if not job.future.done():
                job.future.cancel()
            for waiter in job.waiters:
                # Said to each caller (a gateway's request answers 503 and when to send again):
                # cancelled, the request's connection was dropped without an answer.
                if not waiter.done():
                    waiter.set_exception(Stopping(STOPPING))
        self._jobs.clear()

    # ---- the ActionService ----------------------------------------------------------------------
    async def run(self, request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        """Run one action to its end. ``attempts_so_far`` (from a batch's status after an operator
        restart) makes the dispatcher look for that attempt on the agents before starting another.
        ``TargetUnavailable`` when its pool (or reward service) has no host and none coming (its
        outage): it did not run, and may be sent again (its key is free) after the exception's
        ``delay``."""
        if self._stopped:
            raise Stopping(STOPPING)
        if request.kind == "reward":
            if not self.rewards.has(f"{request.namespace}/{request.target}") and self.learn is not None:
                # Just after a start or a failover its reconcile may not have run: the watch's copy
                # (or the API server) says whether it exists, by its name or by the model it serves.
                await self.learn("RewardModelService", request.namespace, request.target)
            request = self.rewards.resolve(request)  # named by the service or by its model
        outcome = await self._run(request, attempts_so_far)
        if outcome.reason is Reason.TARGET_UNAVAILABLE:
            key = pool_key(request.namespace, request.target)
            if request.kind == "reward":
                outage = self.rewards.outage(key)
            else:
                pool = self._pools.get(key)
                outage = pool.outage if pool is not None else None
            # The outage may have ended while the refusal was on its way: the least it ever says.
            delay = outage.retry_after_s if outage else OUTAGE_RETRY_MIN_S
            raise TargetUnavailable(outcome.message or f"{request.target} has no host", delay)
        return outcome

    async def _run(self, request: ActionRequest, attempts_so_far: int) -> ActionOutcome:
        digest = action_digest(request)  # once: it hashes the whole payload
        self._same_action(request, digest)
        existing = self._jobs.get(request.key)
        if existing is not None:
            return await self._outcome(existing)
        if request.kind == "reward":
            # (Its service was learned and named in ``run``.) Remembered as it begins (a concurrent
            # request under the key with another payload is refused), forgotten if it never ran
            # (an unknown service, a payload its service refused: the key stays free for the
            # corrected one).
            self._same_action(request, digest)
            fresh = request.key not in self._asked
            self._remember(request.key, digest)
            try:
                outcome = await self.rewards.run(request)
            except TangramError:
                if fresh:
                    self._forget(request.key)
                raise
            if fresh and outcome.reason in _NOTHING_RAN:
                self._forget(request.key)
            return outcome
        key = pool_key(request.namespace, request.target)
        pool = await self._find_pool(request.namespace, request.target)
        existing = self._jobs.get(request.key)
        if existing is not None:  # the same key came in while the pool was being looked up
            self._same_action(request, digest)
            return await self._outcome(existing)
        if pool is None:
            raise NotFound(
                "ActionPool",
                request.target,
                f"ActionPool {request.target!r} not found in namespace {request.namespace!r}",
            )
        waiting = pool.waiting + len(pool.before_sync)
        if waiting >= self.max_waiting_per_pool:
            raise QueueFull(f"pool {key} has {waiting} actions waiting (limit {self.max_waiting_per_pool})")
        tenant = request.tenant_name
        if self._tenant_waiting.get(tenant, 0) >= self.max_waiting_per_tenant:
            raise QueueFull(f"tenant {tenant} has {self.max_waiting_per_tenant} actions waiting (its limit)")
        outage = pool.outage
        if (
            outage is not None
            and not attempts_so_far  # an attempt may run on a host still there: re-attach first
            and pool.synced.is_set()
            and self._beyond_limits(pool.config, request) is None
            and self._stranded(pool, self._trajectory(request.session, request.key))
            and self._fresh_session(pool, request.session)
            and request.key not in self._ran  # a result a host still holds is answered from it
            and not pool.known_running
            and not pool.known_finished
        ):
            # Refused before it is a job: nothing to undo, and no arrival counted (a batch sending
            # it again each second during an outage made the planner see a flood); demand still.
            self._count_refused(pool, request, outage)
            raise TargetUnavailable(outage.message, outage.retry_after_s)
        now = self.clock()
        job = _Job(request, asyncio.get_running_loop().create_future(), now, attempts_so_far)
        self._jobs[request.key] = job
        pool.refused.pop(request.key, None)  # a job now, counted as one: no longer as refused
        self._remember(request.key, digest)
        pool.arrivals.append(now)
        if pool.synced.is_set():
            try:
                self._start(pool, job)
            except Exception as exc:
                # Answered, as once its pool's hosts are known (``_start_when_synced``): left
                # begun, the action held its key, and a retry with the key waited for ever.
                log.exception("action %s could not start", request.key)
                self._fail(job, Reason.INVALID_PAYLOAD, f"could not start: {exc}")
        else:
            # Until the pool's hosts are first known (just after a start), the job waits for them
            # in a task of its own: a caller going away meanwhile left it begun but never started,
            # and a repeat of its key (the client's retry) waited on it for ever.
            job.task = asyncio.get_running_loop().create_task(self._start_when_synced(pool, job))
            self._wait_for_sync(pool, job, True)
            # Cancelled (the action cancelled, its pool deleted, a shutdown), perhaps before its
            # first step, where no ``finally`` of its own would run.
            job.task.add_done_callback(lambda _: self._wait_for_sync(pool, job, False))
        return await self._outcome(job)

    def _start(self, pool: _Pool, job: _Job) -> None:
        """Re-attach the job to an attempt already on the agents, or queue it."""
        if not self._reattach(pool, job):
            self._enter(pool, job)

    def _wait_for_sync(self, pool: _Pool, job: _Job, waits: bool) -> None:
        """Count (or stop counting) ``job`` among those waiting for the pool's first hosts: in the
        pool's and its tenant's waiting actions, as once it is queued."""
        if waits == (job in pool.before_sync):
            return
        if waits:
            pool.before_sync.add(job)
        else:
            pool.before_sync.discard(job)
        self._count_waiting(job.request.tenant_name, 1 if waits else -1)

    def _count_waiting(self, tenant: str, change: int) -> None:
        self._tenant_waiting[tenant] = self._tenant_waiting.get(tenant, 0) + change

    async def _start_when_synced(self, pool: _Pool, job: _Job) -> None:
        await pool.synced.wait()
        self._wait_for_sync(pool, job, False)
        job.task = None
        if job.future.done():  # failed or cancelled meanwhile (its pool deleted)
            return
        try:
            self._start(pool, job)
        except Exception as exc:
            # As it would have reached the caller had it started at once; no waiter is left hanging.
            log.exception("action %s could not start", job.request.key)
            self._fail(job, Reason.INVALID_PAYLOAD, f"could not start: {exc}")

    @staticmethod
    async def _outcome(job: _Job) -> ActionOutcome:
        """The job's outcome, for one of its callers. As ``asyncio.shield(job.future)``: a caller
        that goes away cancels its own wait, not the job (which runs on, and others may wait for);
        but ``_resolve`` sets this caller's future itself, where shield's is set by a callback on
        the loop's next turn: one turn less between the agent's answer and every caller."""
        if job.future.done():
            return job.future.result()
        waiter: asyncio.Future[ActionOutcome] = asyncio.get_running_loop().create_future()
        job.waiters.append(waiter)
        try:
            return await waiter
        finally:
            if waiter in job.waiters:  # cancelled before the outcome came
                job.waiters.remove(waiter)

    def _same_action(self, request: ActionRequest, digest: str) -> None:
        """``KeyConflict`` when ``request.key`` already named another action (another payload, kind,
        target, session or units): a key names one logical action, and answering with the first
        one's result (a test's reward for code that never ran) would be wrong."""
        known = self._asked.get(request.key)
        if known is not None and known != digest:
            raise KeyConflict(
                request.key,
                "was already used for a different action (its payload, type, target, session or "
                "units differ); use a new key for a new action",
            )

    def _forget(self, key: str) -> None:
        """Forget a key whose action never ran (refused): a corrected request may use it, and must
        not be answered with anything stored under it."""
        self._asked.pop(key, None)
        self._ran.pop(key, None)

    def _remember(self, key: str, digest: str) -> None:
        """What ``key`` asks for (its ``action_digest``), once it has begun (a request refused
        before, say for a pool that does not exist, leaves the key free for the corrected one).
        Bounded to the ``KEYS_REMEMBERED`` newest keys, as the agents' own store is."""
        self._asked[key] = digest
        self._asked.move_to_end(key)
        while len(self._asked) > KEYS_REMEMBERED:
            oldest, _ = self._asked.popitem(last=False)
            self._ran.pop(oldest, None)

    async def cancel(self, key: str) -> bool:
        job = self._jobs.get(key)
        if job is None or job.future.done():
            return self.rewards.cancel(key)  # a reward action is no job: its router serves it
        job.cancelled = True
        pool = self._pools.get(pool_key(job.request.namespace, job.request.target))
        if job.grant is None:
            # Whether the job is its session's current action (queued, or waiting out the backoff
            # before a retry): then the session's next one goes on when it is cancelled. Left busy,
            # the session queued every later action behind the cancelled one for ever, and never
            # expired.
            current = True
            if pool is not None and not pool.synced.is_set() and job.task is not None:
                job.task.cancel()  # it waits for the pool's first hosts (``_start_when_synced``)
                self._wait_for_sync(pool, job, False)  # not waiting from now (its task ends later)
                current = False  # not entered its session yet
            if job.action is not None and pool is not None and id(job.action) in self._by_action:
                self._unqueue(pool, job)
            elif pool is not None and job.request.session in pool.sessions:
                backlog = pool.sessions[job.request.session].backlog
                if job in backlog:
                    backlog.remove(job)
                    current = False  # the session's current action is another one
            self._resolve(
                job,
                ActionOutcome(
                    job.request.key,
                    Outcome.CANCELLED,
                    Reason.CANCELLED,
                    "cancelled before it started",
                    attempts=job.attempts,
                ),
            )
            if pool is not None and current:
                self._next_in_session(pool, job)
            return True
        endpoint = pool.endpoints.get(job.grant.host) if pool else None
        stopped = False
        if endpoint is not None:
            try:
                stopped = await self.agent.cancel(endpoint.address, agent_key(job.request.key, job.attempts))
            except (InfrastructureError, AgentRefused) as exc:
                log.warning("cancel of %s on %s failed: %s", key, job.grant.host, exc)
        if not stopped and job.task is not None:
            job.task.cancel()
        return True

    async def open_session(self, namespace: str, pool: str, ttl_s: float | None = None) -> str:
        state = await self._find_pool(namespace, pool)
        if state is None:
            raise NotFound("ActionPool", pool)
        name = f"s-{secrets.token_hex(8)}"
        state.sessions[name] = _Session(name, self.clock(), ttl_s=ttl_s)
        return name

    async def close_session(self, namespace: str, pool: str, session: str) -> None:
        state = self._pools.get(pool_key(namespace, pool))
        if state is None:
            raise NotFound("ActionPool", pool)
        sess = state.sessions.get(session)
        if sess is None:
            raise NotFound("session", session)
        await self._close_session(state, sess)

    async def expire_sessions(self) -> None:
        """Close sessions idle for longer than their pool's session TTL (called periodically)."""
        now = self.clock()
        for pool in list(self._pools.values()):
            for sess in list(pool.sessions.values()):
                idle = not sess.busy and not sess.backlog
                ttl = _expiry_s(pool.config, sess)
                if idle and now - sess.last_used > ttl:
                    await self._close_session(pool, sess, f"idle for its TTL of {ttl:g} s")

    async def _close_session(self, pool: _Pool, sess: _Session, why: str = "closed") -> None:
        pool.sessions.pop(sess.name, None)
        pool.closed[sess.name] = why
        while len(pool.closed) > CLOSED_SESSIONS_KEPT:
            del pool.closed[next(iter(pool.closed))]
        if pool.config.mode == "dedicated" and sess.host in pool.cpu.hosts:
            self._retire(pool, sess.host)  # its pod served this trajectory only
        # Its action waiting for a core too: left queued, it was granted one, found no session to
        # run in, and its task died with its caller left waiting for ever.
        for job in [sess.queued, *sess.backlog]:
            if job is not None:
                self._fail(job, Reason.SESSION_LOST, f"session {sess.name!r} was {why}")
        pool.cpu.end_trajectory(self._trajectory(sess.name, ""))
        endpoint = pool.endpoints.get(sess.host or "")
        if endpoint is not None and sess.agent_id is not None:
            try:
                await self.agent.close_session(endpoint.address, sess.agent_id)
            except (InfrastructureError, AgentRefused) as exc:
                log.info(
                    "closing session %s on %s: %s (it expires there by its TTL)", sess.name, sess.host, exc
                )
        self._pump()

    # ---- queueing ---------------------------------------------------------------------------------
    @staticmethod
    def _trajectory(session: str | None, key: str) -> str:
        return f"session:{session}" if session else f"action:{key}"

    def _enter(self, pool: _Pool, job: _Job) -> None:
        """Queue a job, behind the running or waiting actions of its session."""
        session = job.request.session
        if session is not None:
            sess = pool.sessions.get(session)
            if sess is None and session in pool.closed:
                self._fail(
                    job,
                    Reason.SESSION_LOST,
                    f"session {session!r} was {pool.closed[session]}: its state is gone; start a new session",
                )
                return
            if sess is None:
                sess = pool.sessions[session] = _Session(session, self.clock())
            if sess.lost is not None:
                self._fail(job, Reason.SESSION_LOST, sess.lost)
                return
            if sess.busy:
                sess.backlog.append(job)
                return
            sess.busy = True
        self._queue(pool, job)

    def _model(self, pool: _Pool, request: ActionRequest, units_max: int) -> DurationModel:
        estimate = pool.estimates.get(request.kind, 1.0)
        if request.kind == "test" and units_max > 1:
            return Amdahl(max(estimate, 1e-3), DEFAULT_PARALLEL_FRACTION)
        return Fixed(estimate)

    @staticmethod
    def _beyond_limits(cfg: PoolConfig, req: ActionRequest) -> tuple[Reason, str] | None:
        """Why the pool can never run ``req`` (more cores, time or memory than its limits), or None."""
        lo = req.units_min
        # Checked here, where the caller's words are at hand: left to the scheduler's ``Action``, a
        # DoP of 0 raised from inside ``_queue`` (a session's next action is queued from the task
        # that ran the one before it, which then died and left that caller waiting for ever).
        if lo < 1:
            return Reason.INVALID_PAYLOAD, f"units.min {lo}: an action needs at least 1 core"
        if req.units_max < lo:
            return Reason.INVALID_PAYLOAD, (
                f"units.min {lo} is more than its most, units.max {req.units_max}"
            )
        if lo > cfg.limits.max_cores or lo > cfg.host_cores:
            most = min(cfg.limits.max_cores, cfg.host_cores)
            return Reason.CAPACITY_EXCEEDED, f"asks for {lo} cores; pool {cfg.key} grants at most {most}"
        if req.wire in SANDBOXFUSION_WIRES:
            # SandboxFusion's limits above the pool's run at the pool's (``_within_limits``), as
            # SandboxFusion refuses none and verl scores a refusal -1 for every sample.
            return None
        bounded = req.longest_phase or (None if req.timeout_s is None else ("timeoutSeconds", req.timeout_s))
        if bounded is not None and bounded[1] > cfg.limits.timeout_s:
            return Reason.INVALID_PAYLOAD, (
                f"{bounded[0]} {bounded[1]:g} exceeds the pool's limits.timeoutSeconds "
                f"{cfg.limits.timeout_s:g} ({cfg.key})"
            )
        memory = _memory_asked(req)
        limit_mb = cfg.limits.memory_mb
        if memory is not None and memory[1] > limit_mb:
            # Refused here in the caller's own words: the agent's refusal named its internal field
            # ("memory_mb: 1024 MB is outside [16, 512] MB") and not the pool's limit to raise.
            return Reason.INVALID_PAYLOAD, (
                f"{memory[0]} {memory[1]} exceeds the pool's limits.memory {limit_mb} MB ({cfg.key})"
            )
        return None

    def _within_limits(self, cfg: PoolConfig, req: ActionRequest) -> ActionRequest:
        """A ``/run_code`` request whose limits are above the pool's, waited for as long as the
        pool's limits let it run: its host runs it at those limits (an agent's ceilings are its
        pool's limits, ``runtime.pods.agent_args``) and its answer's ``notes`` say so. Said in the
        log once per pool: its limits are below what its callers ask for. The native API's requests
        are refused instead (``_beyond_limits``)."""
        over: list[str] = []
        limit_s = cfg.limits.timeout_s
        timeout_s, phase = req.timeout_s, req.longest_phase
        if timeout_s is not None and phase is not None and phase[1] > limit_s:
            # The longest phase and the others (a compile's and a run's timeouts), each held, and
            # what is beyond the phases kept whole (by itself: a total of 1e18 rounds it away).
            others = max(timeout_s - phase[1] - req.beyond_phases_s, 0.0)
            timeout_s = limit_s + min(others, limit_s) + req.beyond_phases_s
            over.append(f"{phase[0]} {phase[1]:g} s (limits.timeoutSeconds {limit_s:g} s)")
            phase = (phase[0], limit_s)
        memory = _memory_asked(req)
        if memory is not None and memory[1] > cfg.limits.memory_mb:
            over.append(f"{memory[0]} {memory[1]} (limits.memory {cfg.limits.memory_mb} MB)")
        if not over:
            return req
        if cfg.key not in self._capped_pools:
            self._capped_pools.add(cfg.key)
            log.warning(
                "pool %s: a SandboxFusion call asked for more than the pool's limits (%s); such calls run "
                "at the pool's limits and their answers say so (said once per pool)",
                cfg.key,
                ", ".join(over),
            )
        if timeout_s == req.timeout_s:
            return req
        return dataclasses.replace(req, timeout_s=timeout_s, longest_phase=phase)

    def _queue(self, pool: _Pool, job: _Job) -> None:
        if job.request.wire in SANDBOXFUSION_WIRES:
            job.request = self._within_limits(pool.config, job.request)
        req, cfg = job.request, pool.config
        beyond = self._beyond_limits(cfg, req)
        if beyond is not None:  # before an outage: bad input is the caller's to fix, not to retry
            self._fail(job, *beyond)
            return
        if pool.outage is not None and self._stranded(pool, self._trajectory(req.session, req.key)):
            self._refuse(pool, job, pool.outage)
            return
        lo, hi = req.units_min, min(req.units_max, cfg.limits.max_cores)
        action = Action(
            id=agent_key(req.key, job.attempts + 1),
            trajectory=self._trajectory(req.session, req.key),
            pool=cfg.key,
            feasible=tuple(range(lo, max(lo, hi) + 1)),
            model=self._model(pool, req, hi),
            priority=req.priority,
            tenant=req.tenant_name,
        )
        job.action = action
        job.queued_since = self.clock()
        self._by_action[id(action)] = job
        sess = pool.sessions.get(req.session or "")
        if sess is not None:
            sess.queued = job
        # No host may hold it *now* (the pool may have none yet): the planner adds hosts for what
        # waits, so it waits like any other action (what can never fit was refused above).
        self.scheduler.submit(action, job.queued_since, growing=True)
        pool.waiting += 1
        self._count_waiting(req.tenant_name, 1)
        pool.last_active = job.queued_since
        self._pump()

    def _unqueue(self, pool: _Pool, job: _Job) -> None:
        assert job.action is not None
        self.scheduler.withdraw(job.action)
        self._left_queue(pool, job)

    def _left_queue(self, pool: _Pool, job: _Job) -> None:
        assert job.action is not None
        self._by_action.pop(id(job.action), None)
        sess = pool.sessions.get(job.request.session or "")
        if sess is not None and sess.queued is job:
            sess.queued = None
        pool.waiting -= 1
        self._count_waiting(job.request.tenant_name, -1)

    def _pump(self) -> None:
        """Admit what the scheduler grants now; each grant becomes a task calling its host. Then, if
        cores were booked ahead (see ``BOOK_AHEAD_MAX_S``), the scheduler decides once more."""
        while self.scheduler.queued():  # nothing waits (an action ended on an idle pool): no decision
            t0 = time.perf_counter()
            grants = self.scheduler.schedule(self.clock())
            self.decision_us.append((time.perf_counter() - t0) * 1e6)
            for grant in grants:
                job = self._by_action.get(id(grant.action))
                pool = self._pools.get(grant.action.pool)
                if job is None or pool is None:  # cannot happen: every queued action has its job
                    self.scheduler.complete(grant, self.clock())
                    continue
                self._left_queue(pool, job)
                job.grant = grant
                job.queued_s += self.clock() - job.queued_since
                job.task = asyncio.get_running_loop().create_task(self._execute(pool, job, grant))
                for core in grant.unit_ids:
                    pool.holders.setdefault((grant.host, core), []).append(job)
            if not self._book_ahead():
                return

    def _book_ahead(self) -> bool:
        """Give the grants of short actions on full hosts of pools with waiting actions back to the
        scheduler, so that their cores go to the next actions at once (queued behind them on the
        agent). Only an action alone on every one of its cores is booked behind. True if any was."""
        booked = False
        for pool in self._pools.values():
            if not pool.waiting or pool.config.mode == "dedicated" or not pool.holders:
                continue
            heads = {id(held[0]): held[0] for held in pool.holders.values() if len(held) == 1}
            for job in heads.values():
                grant = job.grant
                if grant is None or job.released or not self._short(pool, job.request.kind):
                    continue
                host = pool.cpu.hosts.get(grant.host)
                if host is None or host.free_cores:
                    continue  # a core is free there: nothing waits for this one
                if any(pool.holders.get((grant.host, c)) != [job] for c in grant.unit_ids):
                    continue
                job.released = True
                self.booked_ahead += 1
                self._release(pool, job, grant)
                booked = True
        return booked

    @staticmethod
    def _short(pool: _Pool, kind: str) -> bool:
        runs = pool.recent_runs.get(kind)
        return runs is not None and len(runs) == BOOK_AHEAD_RUNS and max(runs) <= BOOK_AHEAD_MAX_S

    def _release(self, pool: _Pool, job: _Job, grant: Grant) -> None:
        """The scheduler's side of an action's end: its cores (and, outside a session, its
        trajectory's pin) are free for other actions."""
        self.scheduler.complete(grant, self.clock())
        if not job.request.session:
            pool.cpu.end_trajectory(grant.action.trajectory)

    @staticmethod
    def _unhold(pool: _Pool, job: _Job, grant: Grant) -> None:
        """The agent is done with the job: whoever was booked behind it on its cores runs there now
        (and may be booked behind in turn, at the next decision)."""
        for core in grant.unit_ids:
            held = pool.holders.get((grant.host, core))
            if held is None:
                continue
            if job in held:
                held.remove(job)
            if not held:
                del pool.holders[(grant.host, core)]

    # ---- running ----------------------------------------------------------------------------------
    async def _execute(self, pool: _Pool, job: _Job, grant: Grant) -> None:
        req = job.request
        job.attempts += 1
        if self.on_started is not None:
            self.on_started(req.key, job.attempts)
        endpoint = pool.endpoints[grant.host]
        timeout_s = req.timeout_s or pool.config.limits.timeout_s
        outcome: ActionOutcome | None = None
        failure: str | None = None
        resized = False
        try:
            if self.resizer is not None and pool.config.mode == "dedicated":
                resized = await self.resizer.resize_host(pool.config, grant.host, 1000 * grant.units)
            session_id = await self._session_on(pool, req.session, endpoint) if req.session else None
            payload = dict(req.payload)
            if req.wire == "native":
                payload.setdefault("timeout_s", timeout_s)
            key = agent_key(req.key, job.attempts)
            sent = self.clock()
            encoded: bytes | None = None  # the agent's answer as it came (not when read back by key)
            try:
                body, encoded = await self.agent.execute(
                    endpoint.address,
                    payload,
                    key=key,
                    cores=grant.unit_ids,
                    wire=req.wire,
                    timeout_s=timeout_s,
                    session_id=session_id,
                    encoded=req.payload_json,
                )
            except Unreachable as exc:
                self._count_failure(pool, grant.host)
                # By the agent's own clock, the action is over this long after it was sent.
                until = max(sent + timeout_s + ANSWER_MARGIN_S, self.clock() + ANSWER_MARGIN_S)
                body = await self._settle(pool, endpoint, key, until, str(exc))
            outcome = interpret(req.key, req.kind, req.wire, body, runner=_runner(req))
            outcome.response_json = encoded
            self._answered(pool, grant.host)
        except AgentRefused as exc:
            if req.session and exc.body.get("field") == "session_id":
                # The agent no longer has the session's state (it restarted, or expired it): lost.
                sess = pool.sessions.get(req.session)
                if sess is not None:
                    sess.lost = sess.lost or f"session {req.session!r} is gone from host {grant.host}: {exc}"
            outcome = ActionOutcome(
                req.key, Outcome.FAILED, Reason.INVALID_PAYLOAD, str(exc), response=dict(exc.body)
            )
            if req.session and exc.body.get("field") == "session_id":
                outcome.reason = Reason.SESSION_LOST
        except _SessionClosed as exc:
            outcome = ActionOutcome(req.key, Outcome.FAILED, Reason.SESSION_LOST, str(exc))
        except InfrastructureError as exc:
            failure = str(exc)
            self._count_failure(pool, grant.host)
        except asyncio.CancelledError:
            if job.host_lost:
                failure = f"host {grant.host} was lost"
            elif job.cancelled:
                outcome = ActionOutcome(req.key, Outcome.CANCELLED, Reason.CANCELLED, "cancelled")
            else:
                raise
        finally:
            if resized:
                self._idle(pool, grant.host)
            if not job.released:
                self._release(pool, job, grant)
            job.released = False
            if not req.session and pool.config.mode == "dedicated" and grant.host in pool.cpu.hosts:
                self._retire(pool, grant.host)  # one action, one pod
            self._unhold(pool, job, grant)
            job.grant = None
            job.task = None
        if outcome is not None:
            self._finish(pool, job, outcome, grant)
        else:
            await self._infra_failure(pool, job, failure or "unknown", grant.host)
        self._pump()

    def _idle(self, pool: _Pool, host: str) -> None:
        """Resize a dedicated pod back to its idle CPU between actions (in the background)."""
        if self.resizer is None or pool.config.idle_cpu_millicores is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.resizer.resize_host(pool.config, host, pool.config.idle_cpu_millicores)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _session_on(self, pool: _Pool, session: str, endpoint: HostEndpoint) -> str:
        sess = pool.sessions.get(session)
        if sess is None:
            # Closed while this action waited out a retry's backoff: nothing of it is left to run in.
            raise _SessionClosed(
                f"session {session!r} was {pool.closed.get(session, 'closed')}: its state is gone"
            )
        if sess.agent_id is None or sess.host != endpoint.name:
            sess.agent_id = await self.agent.create_session(
                endpoint.address,
                persistent=pool.config.persistent_interpreter,
                # Behind the dispatcher's own clock, whichever is longer: a gateway session of an
                # hour on a pool of minutes lost its state to the agent's clock while the gateway
                # kept it, and one of a second to the agent's while its next action was queued.
                ttl_s=agent_ttl_s(max(pool.config.session_ttl_s, _expiry_s(pool.config, sess))),
            )
            sess.host = endpoint.name
        return sess.agent_id

    async def _settle(
        self, pool: _Pool, endpoint: HostEndpoint, key: str, until: float, why: str
    ) -> dict[str, Any]:
        """A call was cut off on its way: the agent may have it, and may be running it. Running it
        elsewhere now could run it twice, so that agent is asked by the action's key until it
        answers (with the stored response; or that it never got the call, and then the action runs
        elsewhere) or until ``until``, when the action is over there by its own timeout. Meanwhile
        the host takes no new work and is not replaced; if it is lost (its pod deleted, which kills
        what it runs), this task is cancelled and the action runs elsewhere."""
        pool.in_doubt[endpoint.name] = pool.in_doubt.get(endpoint.name, 0) + 1
        delay = SETTLE_FIRST_S
        try:
            while True:
                wait_s = min(REATTACH_SLICE_S, max(0.0, until - self.clock()))
                try:
                    state, body = await self.agent.lookup(endpoint.address, key, wait_s)
                except (Unreachable, ConnectFailed) as exc:
                    self._count_failure(pool, endpoint.name)
                    if isinstance(exc, ConnectFailed) and exc.refused:
                        raise InfrastructureError(
                            f"{why}; nothing listens on {endpoint.name}'s agent port now (its actions "
                            "ended with it)"
                        ) from exc
                    if self.clock() >= until:
                        raise InfrastructureError(
                            f"{why}; host {endpoint.name} was still unreachable when the action's time "
                            "was up there (it may have run there too)"
                        ) from exc
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, SETTLE_MAX_S)
                    continue
                self._answered(pool, endpoint.name)
                if state == "done":
                    assert body is not None
                    log.info("settled %s on %s after: %s", key, endpoint.name, why)
                    return body
                if state == "unknown":
                    raise InfrastructureError(f"{why}; the agent on {endpoint.name} never got the call")
        finally:
            pool.in_doubt[endpoint.name] -= 1
            if not pool.in_doubt[endpoint.name]:
                del pool.in_doubt[endpoint.name]

    def _answered(self, pool: _Pool, host: str) -> None:
        """The host's agent answered: its failures are forgotten, and it takes work again if only
        its failures had stopped it."""
        pool.failures[host] = 0
        if host in pool.unhealthy:
            pool.unhealthy.discard(host)
            endpoint = pool.endpoints.get(host)
            if host in pool.cpu.hosts and endpoint is not None:
                pool.cpu.hosts[host].draining = endpoint.draining or host in pool.retired
            log.info("host %s of %s answers again", host, pool.config.key)

    def _count_failure(self, pool: _Pool, host: str) -> None:
        pool.failures[host] = pool.failures.get(host, 0) + 1
        if pool.failures[host] >= UNHEALTHY_AFTER and host not in pool.unhealthy:
            pool.unhealthy.add(host)
            if host in pool.cpu.hosts:
                pool.cpu.hosts[host].draining = True
            log.warning(
                "host %s of %s failed %d calls in a row: unhealthy", host, pool.config.key, UNHEALTHY_AFTER
            )
            if self.on_host_unhealthy is not None:
                self.on_host_unhealthy(pool.config.key, host)

    async def _infra_failure(self, pool: _Pool, job: _Job, message: str, host: str) -> None:
        req = job.request
        sess = pool.sessions.get(req.session or "")
        if sess is not None and sess.host == host and sess.agent_id is not None:
            # The session's state lives on that host: running elsewhere would start it empty.
            sess.lost = sess.lost or f"session {sess.name!r} lost its host {host}: {message}"
            self._fail(job, Reason.SESSION_LOST, sess.lost)
            self._drain_lost_session(pool, sess)
            return
        if job.cancelled:
            self._fail(job, Reason.CANCELLED, "cancelled", Outcome.CANCELLED)
            return
        if job.attempts > req.max_retries:
            self._fail(
                job,
                Reason.HOST_LOST if job.host_lost else Reason.RETRIES_EXHAUSTED,
                f"{job.attempts} attempts failed; last: {message}",
            )
            return
        log.info("retrying %s after an infrastructure failure: %s", req.key, message)
        job.host_lost = False
        await asyncio.sleep(req.backoff_s * 2 ** (job.attempts - 1))
        if job.cancelled or pool.config.key not in self._pools:
            self._fail(job, Reason.CANCELLED, "cancelled", Outcome.CANCELLED)
            return
        self._queue(pool, job)

    def _drain_lost_session(self, pool: _Pool, sess: _Session) -> None:
        while sess.backlog:
            self._fail(sess.backlog.popleft(), Reason.SESSION_LOST, sess.lost or "session lost")
        sess.busy = False

    def _finish(self, pool: _Pool, job: _Job, outcome: ActionOutcome, grant: Grant | None) -> None:
        now = self.clock()
        outcome.attempts = job.attempts
        outcome.queued_s = job.queued_s
        if grant is not None:
            outcome.host, outcome.cores = grant.host, grant.unit_ids
        if outcome.state is not Outcome.CANCELLED and outcome.duration_s > 0:
            old = pool.estimates.get(job.request.kind)
            t1 = outcome.duration_s
            pool.estimates[job.request.kind] = (
                t1 if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * t1
            )
            recent = pool.recent_runs.setdefault(job.request.kind, deque(maxlen=BOOK_AHEAD_RUNS))
            recent.append(t1)
        pool.acts.append((now, now - job.submitted))
        pool.runs.append((now, outcome.duration_s))
        pool.last_active = now
        req = job.request
        if grant is not None and not req.session and req.key in self._asked and not _nothing_ran(outcome):
            self._ran[req.key] = (pool.config.key, job.attempts, grant.host)
        self._resolve(job, outcome)
        self._next_in_session(pool, job)

    def _next_in_session(self, pool: _Pool, job: _Job) -> None:
        sess = pool.sessions.get(job.request.session or "")
        if sess is None:
            return
        sess.last_used = self.clock()
        if sess.lost is not None:
            self._drain_lost_session(pool, sess)
        elif sess.backlog:
            self._queue(pool, sess.backlog.popleft())
        else:
            sess.busy = False

    def _fail(self, job: _Job, reason: Reason, message: str, state: Outcome = Outcome.FAILED) -> None:
        if job.future.done():
            return
        pool = self._pools.get(pool_key(job.request.namespace, job.request.target))
        if (
            pool is not None
            and job.action is not None
            and id(job.action) in self._by_action
            and job.grant is None
        ):
            self._unqueue(pool, job)
        if pool is not None:
            self._wait_for_sync(pool, job, False)
        outcome = ActionOutcome(
            job.request.key, state, reason, message, attempts=job.attempts, queued_s=job.queued_s
        )
        self._resolve(job, outcome)
        if pool is not None and reason is not Reason.SESSION_LOST:
            self._next_in_session(pool, job)

    def _resolve(self, job: _Job, outcome: ActionOutcome) -> None:
        if job.future.done():
            return
        job.future.set_result(outcome)
        for waiter in job.waiters:
            if not waiter.done():
                waiter.set_result(outcome)
        job.waiters.clear()
        # Over: out of the table here, not in its caller's ``run`` (a job whose every caller had
        # gone away stayed in it for good, payload and all); a repeat of its key from now on is
        # answered from where it ran (``_ran``). A key whose action never ran is free again for
        # the corrected request.
        key = job.request.key
        if self._jobs.get(key) is job:
            del self._jobs[key]
        if outcome.reason in _NOTHING_RAN:
            self._forget(key)

    # ---- re-attachment after an operator restart --------------------------------------------------
    def _reattach(self, pool: _Pool, job: _Job) -> bool:
        """Find the job's latest attempt on the agents (an operator restart may have left one running,
        or finished, whether or not the batch's status recorded it). Returns True when one was found
        (running: the job waits for it; finished: its stored result is the outcome); False to run
        a new attempt. Called once the pool's hosts are known (``synced``)."""
        ran = self._ran.get(job.request.key)
        if ran is not None and ran[0] == pool.config.key:
            # This operator ran the key to its end: its host's agent answers from its store.
            _, attempt, host = ran
            endpoint = pool.endpoints.get(host)
            if endpoint is not None:
                job.attempts = attempt
                key = agent_key(job.request.key, attempt)
                job.task = asyncio.get_running_loop().create_task(
                    self._await_stored(pool, job, endpoint, key, None)
                )
                return True
        if not pool.known_running and not pool.known_finished:
            return False
        found: tuple[int, str, tuple[int, ...] | None] | None = None
        # The attempt the status names, and any later one started before the status was written.
        for attempt in range(max(1, job.attempts), job.attempts + job.request.max_retries + 2):
            key = agent_key(job.request.key, attempt)
            if key in pool.known_running:
                host_name, held = pool.known_running[key]
                found = (attempt, host_name, held)
            elif key in pool.known_finished:
                found = (attempt, pool.known_finished[key], None)
        if found is None:
            return False
        attempt, host, held_cores = found
        key = agent_key(job.request.key, attempt)
        if key in pool.orphans:
            self._unbook_orphan(pool, key)  # its job has come: it books them itself (``_adopt``)
        running = pool.known_running.pop(key, None)
        pool.known_finished.pop(key, None)
        endpoint = pool.endpoints.get(host)
        if endpoint is None:
            return False
        job.attempts = attempt
        if self.on_started is not None:
            self.on_started(job.request.key, attempt)
        if job.request.session:
            sess = pool.sessions.setdefault(job.request.session, _Session(job.request.session, self.clock()))
            sess.busy = True
            sess.host = endpoint.name
        grant = (
            self._adopt(pool, job, endpoint.name, held_cores) if running and held_cores is not None else None
        )
        job.task = asyncio.get_running_loop().create_task(self._await_stored(pool, job, endpoint, key, grant))
        return True

    def _adopt(self, pool: _Pool, job: _Job, host_name: str, cores: tuple[int, ...]) -> Grant | None:
        """Book the cores a re-attached action still holds on its host, so nothing else gets them."""
        host = pool.cpu.hosts.get(host_name)
        if host is None:
            return None
        req = job.request
        taken = tuple(c for c in cores if any(c in free for free in host.free))
        if not taken:
            # Booked behind another re-attached action on the same cores (see BOOK_AHEAD_MAX_S):
            # that one holds them here; this one waits for its result without holding any.
            return None
        for free in host.free:
            free.difference_update(taken)
        trajectory = self._trajectory(req.session, req.key)
        if trajectory not in pool.cpu.pins:
            pool.cpu.pins[trajectory] = host_name
            host.pin(trajectory, 0.0)
        units = max(1, len(taken))
        action = Action(
            id=agent_key(req.key, job.attempts),
            trajectory=trajectory,
            pool=pool.config.key,
            feasible=(units,),
            model=self._model(pool, req, units),
            priority=req.priority,
            tenant=req.tenant_name,
        )
        grant = Grant(action, len(taken), self.clock(), host_name, taken)
        self.scheduler.adopt(grant)
        job.grant = grant
        return grant

    def _release_adopted(self, pool: _Pool, job: _Job, grant: Grant | None) -> None:
        if grant is None:
            return
        job.grant = None
        if grant.host in pool.cpu.hosts:
            self.scheduler.complete(grant, self.clock())
            if not job.request.session:
                pool.cpu.end_trajectory(grant.action.trajectory)
        else:
            self.scheduler.running.pop(id(grant), None)

    async def _read_stored(self, pool: _Pool, endpoint: HostEndpoint, key: str) -> dict[str, Any] | None:
        """Attempt ``key``'s stored answer on ``endpoint`` once it has one; None when the agent does
        not have it (gone from its store, or never got it). A read that fails (a timeout, a 5xx, a
        reset) is tried again for a while, as long as the host is in the pool and its agent
        listens: running a finished action again because one read failed ran it twice."""
        delay, failing_since = SETTLE_FIRST_S, None
        while True:
            called = self.clock()
            try:
                body = await self.agent.result(endpoint.address, key, REATTACH_SLICE_S)
                if body is None:
                    running, _ = await self.agent.inflight(endpoint.address)
                    if key in running:  # still running there: wait on (no failure so far)
                        delay, failing_since = SETTLE_FIRST_S, None
                        continue
                    body = await self.agent.result(endpoint.address, key, 0)
                self._answered(pool, endpoint.name)  # it answers: failures in a row start again
                return body
            except InfrastructureError as exc:
                gone = isinstance(exc, ConnectFailed) and exc.refused
                self._count_failure(pool, endpoint.name)
                # By the clock, from the first failed call's start: their own time counts (20 s each).
                failing_since = called if failing_since is None else failing_since
                spent = self.clock() - failing_since
                if gone or pool.endpoints.get(endpoint.name) is not endpoint or spent >= REREAD_FOR_S:
                    raise
                log.info(
                    "reading %s's stored answer on %s failed (%s); again in %.1f s",
                    key,
                    endpoint.name,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, SETTLE_MAX_S)

    async def _await_stored(
        self, pool: _Pool, job: _Job, endpoint: HostEndpoint, key: str, grant: Grant | None
    ) -> None:
        req = job.request
        try:
            body = await self._read_stored(pool, endpoint, key)
            if body is None:
                raise InfrastructureError(f"attempt {key} vanished from host {endpoint.name}")
            outcome = interpret(req.key, req.kind, req.wire, body, runner=_runner(req))
            outcome.host = endpoint.name  # (its cores too, where the grant is known: ``_finish``)
        except (InfrastructureError, AgentRefused, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not (job.host_lost or job.cancelled):
                raise
            job.task = None
            self._release_adopted(pool, job, grant)
            if job.cancelled:
                self._fail(job, Reason.CANCELLED, "cancelled", Outcome.CANCELLED)
                return
            # The attempt is gone with its host: run the next one (counted).
            if req.session and req.session in pool.sessions:
                pool.sessions[req.session].busy = False
            self._enter(pool, job)
            return
        job.task = None
        self._release_adopted(pool, job, grant)
        self._finish(pool, job, outcome, grant)
        self._pump()
