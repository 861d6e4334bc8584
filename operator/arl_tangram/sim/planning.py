"""The capacity planner in the simulator: periodic rounds that scale sandbox hosts and GPU nodes.

The planner (``arl_tangram.planner``) sees the workload's machines as nodes, the CPU pool as a
sandbox pool of ``host_cores``-core hosts and the GPU pool as one reward service whose replica is a
whole GPU node (the GPU manager then caches every service on it). Each round takes a snapshot of
instances and demand, and the plan is applied as the runtime would: new instances become usable
after a cold start, drained ones stop taking work, and only drained or starting ones are removed.
Provisioned capacity is accounted in unit-seconds (cores or GPUs, starting ones included).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import cast

from arl_tangram.core.action import Action
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.cpu import SandboxHost
from arl_tangram.managers.gpu import GpuNode
from arl_tangram.planner import CapacityPlanner, PlannerConfig, PlannerSolver, ScalingPlan
from arl_tangram.planner.snapshot import (
    ClusterSnapshot,
    InstancePhase,
    InstanceSnapshot,
    NodeSnapshot,
    PoolDemand,
    RewardServiceSpec,
    SandboxPoolSpec,
)
from arl_tangram.sim.engine import Simulation
from arl_tangram.sim.workload import PlannerSpec

GIB = 1024**3

# The most planning rounds one run may take. A round costs well under a millisecond of CPU on the
# built-ins (about 0.4 ms with ai-coding's 1280 live sessions), so this is seconds of planning;
# it is 50 times the rounds of the longest built-in at its own period (3600 s / 10 s). A slip of
# units (``period_s: 0.001``) otherwise spent minutes planning a run that lasts minutes.
MAX_PLANNER_ROUNDS = 20_000


@dataclass
class _Instance:
    name: str
    pool: str
    node: str
    units: int
    phase: InstancePhase
    started_at: float
    cpu_millicores: int
    memory_bytes: int
    gpus: int


class SimPlanner:
    """Drives a :class:`CapacityPlanner` from inside a :class:`Simulation` (a ``PlannerHook``)."""

    def __init__(self, spec: PlannerSpec) -> None:
        self.spec = spec
        self.period_s = spec.period_s
        self.planner = CapacityPlanner(
            PlannerConfig(solver=cast(PlannerSolver, spec.solver), time_limit_s=spec.time_limit_s)
        )
        self.instances: dict[str, _Instance] = {}
        self.unit_seconds = {"cpu": 0.0, "gpu": 0.0}
        self.rounds: list[ScalingPlan] = []
        self._last = 0.0
        self._seen_records = 0
        self._rate: dict[str, float] = {}
        self._work: dict[str, tuple[float, float]] = {}
        self._n = 0
        self.sessions_per_host = 0

    # ---- set-up --------------------------------------------------------------------------------------
    def attach(self, sim: Simulation) -> None:
        c = sim.wl.cluster
        self._nodes: list[NodeSnapshot] = []
        for i in range(c.cpu_hosts):
            self._nodes.append(
                NodeSnapshot(f"cpu-node-{i}", c.cores_per_host * 1000, int(c.memory_gib_per_host * GIB))
            )
        for i in range(c.gpu_nodes):
            self._nodes.append(
                NodeSnapshot(f"gpu-node-{i}", 64_000, 512 * GIB, c.gpus_per_node, int(c.gpu_memory_gb * 1e9))
            )
        self._pools: list[SandboxPoolSpec] = []
        self._services: list[RewardServiceSpec] = []
        s = self.spec
        if sim.cpu is not None:
            per_node = max(1, c.cores_per_host // s.host_cores)
            self.host_memory = int(c.memory_gib_per_host * GIB * s.host_cores / c.cores_per_host)
            _check_hosts_fit(sim, s.host_cores, self.host_memory / GIB)
            policy = dataclasses.replace(s.cpu_scaling, max_instances=per_node * c.cpu_hosts)
            self.sessions_per_host = int(s.host_cores * s.sessions_per_core)
            if s.sessions_per_core > 0:
                self.sessions_per_host = max(1, self.sessions_per_host)
            self._pools.append(
                SandboxPoolSpec(
                    "cpu", s.host_cores, self.host_memory, policy, sessions_per_host=self.sessions_per_host
                )
            )
            for name in list(sim.cpu.hosts):
                del sim.cpu.hosts[name]
        if sim.gpu is not None:
            policy = dataclasses.replace(s.gpu_scaling, max_instances=c.gpu_nodes)
            self._services.append(
                RewardServiceSpec("gpu", (c.gpus_per_node,), int(c.gpu_memory_gb * 1e9), policy)
            )
            sim.gpu.nodes.clear()
        _check_rounds(sim, s.period_s)
        sim.arrival_log = {}
        # Start at the floor, ready at once (a warm cluster before the rollout begins).
        plan = self.planner.plan(self._snapshot(sim, 0.0))
        self.rounds.append(plan)
        for add in plan.adds:
            self._add(
                sim, add.pool, add.node, add.units, add.cpu_millicores, add.memory_bytes, add.gpus, 0.0, 0.0
            )

    # ---- rounds --------------------------------------------------------------------------------------
    def tick(self, sim: Simulation, now: float) -> None:
        if len(self.rounds) >= MAX_PLANNER_ROUNDS:
            # The run outlasted the length ``attach`` could foresee (queueing): stop, not plan on.
            raise InvalidSpec(
                "planner.period_s",
                f"period_s {self.period_s:g} took {MAX_PLANNER_ROUNDS:,} planning rounds, the most a "
                f"run may take, by {now:.4g} s of simulated time and the run goes on: use a longer "
                "period_s (a run of T s takes T / period_s rounds)",
            )
        self._account(now)
        plan = self.planner.plan(self._snapshot(sim, now))
        self.rounds.append(plan)
        for r in plan.removals:
            self._remove(sim, r.name)
        for d in plan.drains:
            self._set_draining(sim, d.name, True)
        for u in plan.undrains:
            self._set_draining(sim, u.name, False)
        for a in plan.adds:
            scaling = self.spec.cpu_scaling if a.pool == "cpu" else self.spec.gpu_scaling
            cold = scaling.cold_start_s
            self._add(sim, a.pool, a.node, a.units, a.cpu_millicores, a.memory_bytes, a.gpus, now, cold)

    def finish(self, sim: Simulation, end: float) -> None:
        self._account(end)

    def _account(self, now: float) -> None:
        dt = max(0.0, now - self._last)
        for inst in self.instances.values():
            self.unit_seconds[inst.pool] += inst.units * dt
        self._last = max(self._last, now)

    # ---- applying a plan -----------------------------------------------------------------------------
    def _add(
        self,
        sim: Simulation,
        pool: str,
        node: str,
        units: int,
        cpu: int,
        mem: int,
        gpus: int,
        now: float,
        cold: float,
    ) -> None:
        self._n += 1
        name = f"{pool}-inst-{self._n}"
        inst = _Instance(name, pool, node, units, "starting", now, cpu, mem, gpus)
        self.instances[name] = inst

        def ready(_: float) -> None:
            if self.instances.get(name) is not inst or inst.phase != "starting":
                return  # removed (or drained) while it was starting
            inst.phase = "ready"
            if pool == "cpu" and sim.cpu is not None:
                host = SandboxHost.uniform(name, units, 2 if units % 2 == 0 else 1, mem / GIB)
                host.max_sessions = self.sessions_per_host
                sim.cpu.add_host(host)
            elif sim.gpu is not None:
                c = sim.wl.cluster
                node = GpuNode(name, units, c.gpu_memory_gb)
                sim.gpu.add_node(node)
                sim.prewarm_gpus(node)  # its runtimes pre-warm while the node starts

        if cold <= 0:
            ready(now)
        else:
            sim.at(now + cold, ready)

    def _remove(self, sim: Simulation, name: str) -> None:
        inst = self.instances.pop(name, None)
        if inst is None or inst.phase == "starting":
            return
        if inst.pool == "cpu" and sim.cpu is not None:
            sim.cpu.remove_host(name)
        elif sim.gpu is not None:
            sim.gpu.remove_node(name)

    def _set_draining(self, sim: Simulation, name: str, draining: bool) -> None:
        inst = self.instances.get(name)
        if inst is None or inst.phase == "starting":
            return
        inst.phase = "draining" if draining else "ready"
        if inst.pool == "cpu" and sim.cpu is not None:
            sim.cpu.hosts[name].draining = draining
        elif sim.gpu is not None:
            next(n for n in sim.gpu.nodes if n.name == name).draining = draining

    # ---- demand estimates --------------------------------------------------------------------------
    def desired_units(self, action: Action) -> int:
        """The DoP the scheduler would give ``action`` with room to spare: its largest feasible
        count whose parallel efficiency (one-unit work over work at k) is still at least
        ``target_efficiency``; its minimum when it is not elastic."""
        if not action.elastic:
            return action.min_units
        one = action.model.duration(action.min_units) * action.min_units
        best = action.min_units
        for k in action.feasible:
            if one / (action.model.duration(k) * k) >= self.spec.target_efficiency - 1e-12:
                best = k
        return best

    def _desired(self, arrived: list[Action]) -> tuple[float, float]:
        """Mean duration and mean unit-seconds of ``arrived`` at their desired DoP (0, 0: none)."""
        if not arrived:
            return 0.0, 0.0
        dur = work = 0.0
        for a in arrived:
            k = self.desired_units(a)
            d = a.model.duration(k)
            dur += d
            work += d * k
        return dur / len(arrived), work / len(arrived)

    def _sessions(self, sim: Simulation, now: float) -> tuple[int, int]:
        """Bytes of host memory the live CPU sessions (trajectories started, not ended) hold, and
        how many they are."""
        total, count = 0.0, 0
        for st in sim.trajectory_states():
            tr = st.traj
            if tr.memory_gib > 0 and tr.start <= now and not st.done and tr.steps[0].pool == "cpu":
                total += tr.memory_gib
                count += 1
        return int(total * GIB), count

    # ---- the snapshot round ------------------------------------------------------------------------------
    def _snapshot(self, sim: Simulation, now: float) -> ClusterSnapshot:
        instances = []
        # Instances are hosts (sandbox hosts, GPU nodes) of their own names: count grants by host once.
        running_on = Counter(g.host for g in sim.scheduler.running.values())
        for inst in self.instances.values():
            running, pinned = 0, 0
            if inst.phase != "starting":
                running = running_on[inst.name]
                if inst.pool == "cpu" and sim.cpu is not None:
                    pinned = len(sim.cpu.hosts[inst.name].pinned)
            instances.append(
                InstanceSnapshot(
                    inst.name,
                    inst.pool,
                    inst.node,
                    inst.phase,
                    inst.cpu_millicores,
                    inst.memory_bytes,
                    inst.gpus,
                    running,
                    pinned,
                    inst.started_at,
                )
            )
        period = max(now - self._last, self.period_s)
        recent = sim.records[self._seen_records :]
        self._seen_records = len(sim.records)
        demand = []
        log = sim.arrival_log if sim.arrival_log is not None else {}
        sessions, live = self._sessions(sim, now)
        for pool in [p.name for p in self._pools] + [s.name for s in self._services]:
            queued = list(sim.scheduler.queue.fcfs(pool))
            running_g = [g for g in sim.scheduler.running.values() if g.action.pool == pool]
            done = [r for r in recent if r.pool == pool]
            arrived = log.pop(pool, [])
            # The steady-state term sizes for the parallelism the scheduler would give each action
            # with room to spare (its largest DoP still at target_efficiency), so that elastic
            # actions keep their speed; sizing by the units they got would chase its own tail.
            dur, work = self._desired(arrived)
            rate = len(arrived) / period
            # Smooth the rate (a quiet period does not erase a busy one at once) but follow a
            # rise at once: capacity late costs ACT, capacity early only unit-seconds.
            smooth = self._rate.get(pool, 0.0)
            smooth = max(rate, 0.5 * smooth + 0.5 * rate)
            self._rate[pool] = smooth
            if dur > 0:
                self._work[pool] = (dur, work)
            mean_dur, mean_work = self._work.get(pool, (0.0, 0.0))
            demand.append(
                PoolDemand(
                    pool,
                    queued_actions=len(queued),
                    queued_units=sum(a.min_units for a in queued),
                    running_actions=len(running_g),
                    running_units=sum(g.units for g in running_g),
                    arrival_rate_per_s=smooth,
                    mean_action_s=mean_dur,
                    mean_units_per_action=max(1.0, mean_work / mean_dur) if mean_dur > 0 else 1.0,
                    act_recent_s=sum(r.act for r in done) / len(done) if done else None,
                    session_memory_bytes=sessions if pool == "cpu" else 0,
                    sessions=live if pool == "cpu" else 0,
                )
            )
        return ClusterSnapshot(
            now,
            tuple(self._nodes),
            tuple(self._pools),
            tuple(self._services),
            tuple(instances),
            tuple(demand),
        )


def _check_hosts_fit(sim: Simulation, host_cores: int, host_gib: float) -> None:
    """A sandbox host wider than a CPU node is never placed, an action wider than a host or a
    session larger than a host's share of the node's memory is never placed either: the pool
    would hold nothing for it and the run stop at its first action, naming the action. Refused
    here, naming the planner's field."""
    c = sim.wl.cluster
    if host_cores > c.cores_per_host:
        raise InvalidSpec(
            "planner.host_cores",
            f"{host_cores} cores per sandbox host, a CPU node has {c.cores_per_host} "
            "(cluster.cpu_hosts.cores)",
        )
    widest = max(
        (min(st.feasible) for t in sim.trajectories for st in t.steps if st.pool == "cpu"), default=0
    )
    if widest > host_cores:
        raise InvalidSpec(
            "planner.host_cores",
            f"{host_cores} cores per sandbox host, an action needs {widest} at least",
        )
    need = max((t.memory_gib for t in sim.trajectories if t.needs_pod), default=0.0)
    if need > host_gib:
        raise InvalidSpec(
            "planner.host_cores",
            f"a host of {host_cores} cores gets {host_gib:g} GiB (its node's memory pro rata), "
            f"a trajectory holds {need:g}",
        )


def _check_rounds(sim: Simulation, period_s: float) -> None:
    """Refuse, before the run, a period that makes more than ``MAX_PLANNER_ROUNDS`` rounds: the
    planner plans while work is left, and no run is shorter than its longest trajectory with every
    action at its fastest DoP and no wait (``tick`` stops a run that outlasts this)."""
    least = max(
        (
            t.start + sum(st.think_s + min(st.true.duration(k) for k in st.feasible) for st in t.steps)
            for t in sim.trajectories
        ),
        default=0.0,
    )
    rounds = least / period_s
    if rounds > MAX_PLANNER_ROUNDS:
        raise InvalidSpec(
            "planner.period_s",
            f"period_s {period_s:g} makes {rounds:.3g} planning rounds or more (the run lasts "
            f"{least:.4g} s at least); at most {MAX_PLANNER_ROUNDS:,}: period_s >= "
            f"{least / MAX_PLANNER_ROUNDS:.3g}",
        )
