"""The discrete-event simulator: the real scheduler and managers, simulated time and executions.

Deterministic: the trajectories come from the workload's seed, events at equal times are processed
in insertion order, and nothing reads the wall clock except the scheduler's own CPU-time counter.
One ``schedule`` call follows each batch of events with the same timestamp (event-driven, as the
operator does on arrival and completion).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from arl_tangram.core.action import Action
from arl_tangram.core.policies.registry import POLICIES
from arl_tangram.core.policies.static import Replica, StaticConfig, StaticNode, StaticPolicy
from arl_tangram.core.pool import Grant, PoolManager
from arl_tangram.core.scheduler import Scheduler
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.managers.gpu import GpuManager, GpuNode
from arl_tangram.managers.quota import ApiQuota, QuotaManager
from arl_tangram.sim.workload import (
    ClusterSpec,
    RewardSource,
    SearchSource,
    Trajectory,
    Workload,
    declared_services,
    generate,
)


class PlannerHook(Protocol):
    """What the simulator asks of a capacity planner every ``period_s`` simulated seconds: given a
    snapshot of demand and capacity, change the pools (add or remove hosts / replicas)."""

    period_s: float

    def attach(self, sim: Simulation) -> None:
        """Called once before the run: set up the initial instances."""
        ...

    def tick(self, sim: Simulation, now: float) -> None:
        """One planning round at ``now``: read the simulation's demand, apply the plan."""
        ...

    def finish(self, sim: Simulation, end: float) -> None:
        """Called once after the run: close the accounting at ``end``."""
        ...


@dataclass
class ActionRecord:
    """What happened to one action (a retried API call is one record, from its first arrival).

    ``key`` names the action the same way under every policy (trajectory, step), so that runs can
    be compared over the actions they all completed. ``pod_wait_s`` is the part of the wait spent
    for the trajectory's own pod to start (``static`` only); the rest of the wait is ``queue``."""

    kind: str
    pool: str
    arrival: float
    start: float
    end: float
    exec_s: float
    overhead_s: float
    key: tuple[str, int] = ("", 0)
    pod_wait_s: float = 0.0

    @property
    def act(self) -> float:
        return self.end - self.arrival

    @property
    def queue(self) -> float:
        """Waiting for units, pod start-up excluded."""
        return self.start - self.arrival - self.pod_wait_s


@dataclass
class SimResult:
    workload: str
    policy: str
    records: list[ActionRecord]
    makespan_s: float
    cpu_core_seconds: float
    gpu_seconds: float
    lost_trajectories: int
    api_violations: int
    api_failures: int
    decisions_us: list[float]
    gpus: int
    trajectories: int = 0
    unfinished_trajectories: int = 0
    queued_at_end: int = 0
    resampled: int = 0  # lost trajectories replaced by new ones (RL steps)
    cut_at: float | None = None  # the staleness bound stopped the rollout (unfinished ones cut)

    @property
    def complete(self) -> bool:
        """Every trajectory ended (finished or lost) and nothing is left waiting: a run that stops
        with work left over (a deadlock, pods that never bind) must not read as a fast one."""
        return self.unfinished_trajectories == 0 and self.queued_at_end == 0

    @property
    def completed_trajectories(self) -> int:
        """Trajectories that ran to their last action."""
        return self.trajectories - self.unfinished_trajectories - self.lost_trajectories


@dataclass
class _TrajState:
    traj: Trajectory
    step: int = 0
    failures: int = 0
    first_arrival: float = -1.0
    lost: bool = False
    pod_ready_at: float = math.inf
    done: bool = False


@dataclass
class _ApiServer:
    """The real API's limits, enforced on every call whatever the policy (counts violations)."""

    concurrency: int
    rate: float
    burst: float
    in_flight: int = 0
    tokens: float = 0.0
    stamp: float = 0.0

    def try_call(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.in_flight >= self.concurrency or self.tokens < 1.0 - 1e-9:
            return False
        self.in_flight += 1
        self.tokens -= 1.0
        return True


@dataclass
class _SharedNode:
    """Static pods' CPU sharing on one node: fair shares up to each action's demand (processor sharing)."""

    cores: float
    active: dict[int, list[float]] = field(default_factory=dict)  # grant -> [remaining work s, demand]
    rates: dict[int, float] = field(default_factory=dict)
    last: float = 0.0
    version: int = 0

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0:
            for gid, job in self.active.items():
                job[0] -= dt * self.rates.get(gid, 0.0)
        self.last = now

    def reshare(self) -> None:
        jobs = sorted(self.active.items(), key=lambda kv: kv[1][1])
        left, n = self.cores, len(jobs)
        self.rates = {}
        for gid, (_, demand) in jobs:
            alloc = min(demand, left / n)
            self.rates[gid] = alloc / demand
            left -= alloc
            n -= 1

    def next_done(self) -> float:
        return min(
            (
                max(0.0, job[0]) / self.rates[gid]
                for gid, job in self.active.items()
                if self.rates.get(gid, 0) > 0
            ),
            default=math.inf,
        )


class Simulation:
    """One workload under one policy."""

    def __init__(
        self,
        workload: Workload,
        policy: str,
        *,
        trajectories: list[Trajectory] | None = None,
        planner: PlannerHook | None = None,
        progress: Callable[[int], None] | None = None,
        policy_options: dict[str, Any] | None = None,
        resample: list[Trajectory] | None = None,
        deadline_s: float | None = None,
        prewarm: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidSpec("--policies", f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        self.wl = workload
        self.static_gpus = 0
        self._unreplicated: set[str] = set()
        self._shared: dict[str, _SharedNode] = {}
        # Actions that arrived, per pool, for a planner to read and clear (None: nobody reads).
        self.arrival_log: dict[str, list[Action]] | None = None
        self.policy_name = policy
        self.trajectories = generate(workload) if trajectories is None else trajectories
        self.planner = planner
        self.progress = progress
        c = workload.cluster
        self.cpu: CpuManager | None = None
        self.gpu: GpuManager | None = None
        self.quotas: dict[str, QuotaManager] = {}
        pools: dict[str, PoolManager] = {}
        if c.cpu_hosts:
            self.cpu = CpuManager(
                [
                    SandboxHost.uniform(f"host-{i}", c.cores_per_host, c.numa_per_host, c.memory_gib_per_host)
                    for i in range(c.cpu_hosts)
                ]
            )
            pools["cpu"] = self.cpu
        if c.gpu_nodes:
            nvlink = None
            if c.nvlink == "pairs":
                nvlink = [[a // 2 == b // 2 for b in range(c.gpus_per_node)] for a in range(c.gpus_per_node)]
            self.gpu = GpuManager(
                [
                    GpuNode(
                        f"gpu-{i}",
                        c.gpus_per_node,
                        c.gpu_memory_gb,
                        nvlink,
                        dict(c.mig),
                        reserved=_reserved(c, i),
                    )
                    for i in range(c.gpu_nodes)
                ],
                restore_gbps=c.restore_gbps,
                memory_headroom=c.memory_headroom,
            )
            pools["gpu"] = self.gpu
        for api in c.apis:
            qm = QuotaManager(ApiQuota(api.name, api.concurrency, api.rate, api.burst))
            self.quotas[api.name] = qm
            pools[qm.pool] = qm
        self.apis = {a.name: _ApiServer(a.concurrency, a.rate, a.burst, tokens=a.burst) for a in c.apis}
        self.scheduler: Scheduler
        if policy == "static":
            self.scheduler = self._static(pools)
        else:
            self.scheduler = POLICIES[policy](pools, **(policy_options or {}))
        self.prewarm = prewarm and policy != "static"
        self.prewarm_gpus()
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._state = {t.id: _TrajState(t) for t in self.trajectories}
        self._records: list[ActionRecord] = []
        self._grant_of: dict[int, tuple[Grant, _TrajState, float]] = {}
        self._pod_clock = 0.0
        self.cpu_core_s = 0.0
        self.gpu_s = 0.0
        self.api_violations = 0
        self.api_failures = 0
        self.lost = 0
        self._wake_at = math.inf
        self._act_ids = itertools.count()
        # Requests to a service whose static replica is pending (see ``_static``): never served.
        self._unserved: list[Action] = []
        # Static pods no node can hold yet, in creation order: they bind as pods are deleted, as
        # the kube-scheduler retries pending pods (the overload regime of the paper's baseline).
        self._pending_pods: list[_TrajState] = []
        # An RL step: a lost trajectory is replaced by the next of ``resample`` (the trainer samples
        # another prompt), and the rollout stops at ``deadline_s`` (a staleness bound).
        self._reserve = list(resample or [])
        self.resampled = 0
        self.deadline_s = deadline_s

    # ---- set-up -------------------------------------------------------------------------------------
    def prewarm_gpus(self, only: GpuNode | None = None) -> None:
        """Restore the declared services into free GPU memory (of ``only``, a node just added), as
        the reward runtime does before its first request; ``static``'s replicas are loaded before
        the run too, so neither pays its first load inside it."""
        if self.gpu is not None and self.prewarm:
            self.gpu.prewarm(declared_services(self.wl), only=only)

    def _static(self, pools: dict[str, PoolManager]) -> StaticPolicy:
        c, s = self.wl.cluster, self.wl.static
        nodes = [StaticNode(f"host-{i}", c.cores_per_host, c.memory_gib_per_host) for i in range(c.cpu_hosts)]
        services: list[str] = []
        for src in self.wl.sources:
            if isinstance(src, RewardSource):
                services += [svc.name for svc in src.services]
            elif isinstance(src, SearchSource):
                services.append(src.judge.name)
        replicas: list[Replica] = []
        slots = [
            (f"gpu-{n}", tuple(range(g, g + s.gpus_per_replica)))
            for n in range(c.gpu_nodes)
            for g in range(0, c.gpus_per_node, s.gpus_per_replica)
            if g + s.gpus_per_replica <= c.gpus_per_node
        ]
        # A replica no node has the GPUs for is a pod that stays Pending, as the kube-scheduler
        # leaves it (no GPU is ever freed: replicas are never deleted): its service's requests
        # wait for ever and the run ends INCOMPLETE, instead of the run failing.
        for svc, (node, gpus) in zip(services, slots, strict=False):
            replicas.append(Replica(svc, node, gpus))
        self._unreplicated = set(services[len(slots) :])
        self.static_gpus = len(replicas) * s.gpus_per_replica
        for n in nodes:
            self._shared[n.name] = _SharedNode(float(n.cores))
        cfg = StaticConfig(s.dop, s.pod_request_cores, s.pod_limit_cores, s.gpus_per_replica)
        return StaticPolicy(pools, nodes, replicas, cfg)

    # ---- events -------------------------------------------------------------------------------------
    def at(self, t: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(t)`` at simulated time t (a hook for the planner's instances starting)."""
        self._push(t, "call", callback)

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        """Run to the end of the workload and return what was measured."""
        for st in self._state.values():
            self._push(st.traj.start, "start", st)
        if self.planner is not None:
            self.planner.attach(self)
            self._push(0.0, "plan", None)
        now = 0.0
        cut_at: float | None = None
        while self._events:
            now = self._events[0][0]
            if self.deadline_s is not None and now > self.deadline_s:
                cut_at = self.deadline_s  # the staleness bound: what still runs is cut from the step
                break
            while self._events and self._events[0][0] <= now + 1e-12:
                _, _, kind, payload = heapq.heappop(self._events)
                self._handle(kind, payload, now)
            for grant in self.scheduler.schedule(now):
                self._start(grant, now)
            self._arm_wakeup(now)
        makespan = max((r.end for r in self._records), default=0.0)
        if self.planner is not None:
            self.planner.finish(self, makespan)
        if isinstance(self.scheduler, StaticPolicy):
            self.gpu_s += self.static_gpus * makespan
        samples = list(self.scheduler.stats.samples_us)
        unfinished = sum(1 for st in self._state.values() if not st.done)
        return SimResult(
            self.wl.name,
            self.policy_name,
            self._records,
            makespan,
            self.cpu_core_s,
            self.gpu_s,
            self.lost,
            self.api_violations,
            self.api_failures,
            samples,
            self.static_gpus if isinstance(self.scheduler, StaticPolicy) else self.wl.cluster.total_gpus,
            trajectories=len(self._state),
            unfinished_trajectories=unfinished,
            queued_at_end=self.scheduler.queued() + len(self._pending_pods) + len(self._unserved),
            resampled=self.resampled,
            cut_at=cut_at,
        )

    def trajectory_states(self) -> list[_TrajState]:
        """Every trajectory's progress (a planner reads which sessions are live)."""
        return list(self._state.values())

    @property
    def records(self) -> list[ActionRecord]:
        """Completed actions so far."""
        return self._records

    def _busy(self) -> bool:
        return any(kind != "plan" for _, _, kind, _ in self._events) or self.scheduler.queued() > 0

    def _arm_wakeup(self, now: float) -> None:
        t = self.scheduler.next_wakeup(now)
        if t is not None and t < self._wake_at - 1e-12 and t > now:
            self._wake_at = t
            self._push(t, "wake", None)

    def _handle(self, kind: str, payload: Any, now: float) -> None:
        if kind == "start":
            self._traj_start(payload, now)
        elif kind == "arrive":
            self._arrive(payload, now)
        elif kind == "done":
            self._done(payload, now)
        elif kind == "pod":
            st = payload
            st.pod_ready_at = now
            if not st.done and isinstance(self.scheduler, StaticPolicy):
                self.scheduler.pod_ready(st.traj.id)
        elif kind == "shared":
            self._shared_tick(payload, now)
        elif kind == "wake":
            if now >= self._wake_at - 1e-12:
                self._wake_at = math.inf
        elif kind == "call":
            payload(now)
        elif kind == "plan" and self.planner is not None and self._busy():
            self.planner.tick(self, now)
            self._push(now + self.planner.period_s, "plan", None)

    def _traj_start(self, st: _TrajState, now: float) -> None:
        tr = st.traj
        if tr.needs_pod and isinstance(self.scheduler, StaticPolicy) and not self._bind_pod(st, now):
            self._pending_pods.append(st)
        self._push(now + tr.steps[0].think_s, "arrive", st)

    def _bind_pod(self, st: _TrajState, now: float) -> bool:
        """Bind the trajectory's pod to a node and start it (False: no node holds it yet)."""
        assert isinstance(self.scheduler, StaticPolicy)
        s, tr = self.wl.static, st.traj
        if self.scheduler.create_pod(tr.id, tr.memory_gib) is None:
            return False
        # The control plane admits pods one after another at a finite rate, then each takes a while.
        self._pod_clock = max(self._pod_clock, now) + 1.0 / s.pod_admission_per_s
        rng_start = s.pod_start.median * math.exp(s.pod_start.sigma * _hash_gauss(tr.id))
        self._push(self._pod_clock + rng_start, "pod", st)
        return True

    def _bind_pending(self, now: float) -> None:
        """Pods deleted: bind the pending ones that fit now, oldest first (a pod that still fits
        nowhere does not hold back a smaller one behind it, as with the kube-scheduler)."""
        self._pending_pods = [st for st in self._pending_pods if not self._bind_pod(st, now)]

    def _arrive(self, st: _TrajState, now: float) -> None:
        if st.lost or st.done:
            return
        step = st.traj.steps[st.step]
        if st.first_arrival < 0:
            st.first_arrival = now
        action = Action(
            f"{st.traj.id}/{st.step}/{next(self._act_ids)}",
            st.traj.id,
            step.pool,
            step.feasible,
            step.estimate,
            memory_gib=st.traj.memory_gib,
            service=step.service,
            service_gb=step.service_gb,
            priority=st.traj.priority,
            tenant=st.traj.tenant,
        )
        if step.service in self._unreplicated:
            self._unserved.append(action)
            return
        self.scheduler.submit(action, now)
        if self.arrival_log is not None:
            self.arrival_log.setdefault(step.pool, []).append(action)

    def _start(self, grant: Grant, now: float) -> None:
        action = grant.action
        st = self._state[action.trajectory]
        step = st.traj.steps[st.step]
        if action.pool.startswith("api:"):
            server = self.apis[action.pool[4:]]
            if not server.try_call(now):
                if not isinstance(self.scheduler, StaticPolicy):
                    self.api_violations += 1  # the quota manager let a call beyond a limit through
                self.api_failures += 1
                self._push(now + self.wl.static.api_fail_s, "done", (grant, "fail"))
                self._grant_of[id(grant)] = (grant, st, now)
                return
        if "shared" in grant.extra:
            node = self._shared[grant.host]
            node.advance(now)
            demand = min(float(grant.units), self.wl.static.pod_limit_cores)
            # Work in seconds at full demand: the true duration at that DoP.
            node.active[id(grant)] = [step.true.duration(grant.units), demand]
            self._grant_of[id(grant)] = (grant, st, now)
            self._reshare(grant.host, now)
            return
        overhead = grant.restore_s + (
            0.0 if isinstance(self.scheduler, StaticPolicy) else self.wl.cluster.dispatch_overhead_s
        )
        exec_s = step.true.duration(grant.units)
        self._grant_of[id(grant)] = (grant, st, now)
        self._push(now + overhead + exec_s, "done", (grant, "ok"))

    def _reshare(self, host: str, now: float) -> None:
        node = self._shared[host]
        node.reshare()
        node.version += 1
        nxt = node.next_done()
        if math.isfinite(nxt):
            at = now + nxt
            if nxt > 0 and at <= now:
                # Work left that is shorter than the clock's resolution at ``now``: armed at ``now``
                # it would be re-armed there for ever, with no time passing to finish it.
                at = math.nextafter(now, math.inf)
            self._push(at, "shared", (host, node.version))

    def _shared_tick(self, payload: tuple[str, int], now: float) -> None:
        host, version = payload
        node = self._shared[host]
        if version != node.version:
            return
        node.advance(now)
        finished = [gid for gid, job in node.active.items() if job[0] <= 1e-9]
        for gid in finished:
            del node.active[gid]
            grant, _, _ = self._grant_of[gid]
            # The exec path into the pod (a fresh process per action) adds its latency, no cores.
            self._push(now + self.wl.static.exec_s, "done", (grant, "ok"))
        self._reshare(host, now)

    def _done(self, payload: tuple[Grant, str], now: float) -> None:
        grant, outcome = payload
        _, st, started = self._grant_of.pop(id(grant))
        action = grant.action
        self.scheduler.complete(grant, now)
        step = st.traj.steps[st.step]
        if action.pool.startswith("api:"):
            if outcome == "ok":
                self.apis[action.pool[4:]].in_flight -= 1
            else:
                st.failures += 1
                if st.failures >= self.wl.static.max_failures:
                    st.lost = True
                    self.lost += 1
                    self._end_traj(st, now)
                    self._resample(st, now)
                    return
                backoff = self.wl.static.api_backoff_s * 2 ** (st.failures - 1)
                self._push(now + backoff, "arrive", st)
                return
        if step.pool == "gpu" and not isinstance(self.scheduler, StaticPolicy):
            # Static replicas hold their GPUs for the whole run (charged once, at its end).
            self.gpu_s += grant.units * (now - started)
        elif step.pool == "cpu" and "shared" not in grant.extra:
            self.cpu_core_s += grant.units * (now - started)
        overhead = grant.restore_s
        if not isinstance(self.scheduler, StaticPolicy):
            overhead += self.wl.cluster.dispatch_overhead_s
        elif "shared" in grant.extra:
            overhead += self.wl.static.exec_s
        arrival = st.first_arrival
        pod_wait = max(0.0, min(started, st.pod_ready_at) - arrival) if "shared" in grant.extra else 0.0
        self._records.append(
            ActionRecord(
                step.kind,
                step.pool,
                arrival,
                started,
                now,
                now - started - overhead,
                overhead,
                (st.traj.id, st.step),
                pod_wait,
            )
        )
        if self.progress is not None:
            self.progress(1)
        st.first_arrival = -1.0
        st.step += 1
        if st.step >= len(st.traj.steps):
            self._end_traj(st, now)
        else:
            self._push(now + st.traj.steps[st.step].think_s, "arrive", st)

    def _resample(self, lost: _TrajState, now: float) -> None:
        """Start a replacement for a lost trajectory (the next one of the reserve, from now)."""
        if not self._reserve:
            return
        tr = self._reserve.pop(0)
        self.resampled += 1
        new = Trajectory(
            f"{lost.traj.id}~{self.resampled}",
            now,
            tr.steps,
            tr.memory_gib,
            tr.tenant,
            tr.priority,
            tr.needs_pod,
        )
        st = self._state[new.id] = _TrajState(new)
        self._push(now, "start", st)

    def _end_traj(self, st: _TrajState, now: float) -> None:
        st.done = True
        tr = st.traj
        if isinstance(self.scheduler, StaticPolicy):
            if tr.needs_pod:
                # A pod holds its CPU limit from ready to deletion, busy or not.
                if math.isfinite(st.pod_ready_at):
                    self.cpu_core_s += self.wl.static.pod_limit_cores * max(0.0, now - st.pod_ready_at)
                self.scheduler.delete_pod(tr.id, tr.memory_gib)
                self._bind_pending(now)
        elif self.cpu is not None:
            self.cpu.end_trajectory(tr.id)


def _reserved(c: ClusterSpec, i: int) -> set[int]:
    """GPUs of node i outside the pool: the top ones of the last node when it is only partly in."""
    if i != c.gpu_nodes - 1 or not c.last_node_gpus:
        return set()
    return set(range(c.last_node_gpus, c.gpus_per_node))


def _hash_gauss(key: str) -> float:
    """A standard normal draw fixed by ``key`` (pod start times independent of event order)."""
    import hashlib
    import random

    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return random.Random(seed).gauss(0.0, 1.0)
