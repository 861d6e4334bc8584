"""CPU manager (allocate-on-execution): exclusive cores per action on shared sandbox hosts.

A trajectory is pinned to one host for its life: at its first action, to a host with cores for that
action and memory for the whole trajectory, chosen by load balance (most free cores); or before it, on
arrival, through ``pin_session`` (fewest live sessions per core), as the ``tangram`` policy does.
Each action then gets an exact, exclusive core set on that host, NUMA-local when one NUMA node can
hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Grant, Partition, Scratch
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.count_op import CountOperator


@dataclass
class SandboxHost:
    """One sandbox host: cores grouped by NUMA node, memory for pinned trajectories (``pinned``:
    trajectory to GiB; change it through ``pin`` and ``unpin``, which keep its total)."""

    name: str
    numa: list[list[int]]
    memory_gib: float
    free: list[set[int]] = field(default_factory=list)
    pinned: dict[str, float] = field(default_factory=dict)
    draining: bool = False
    max_sessions: int = 0  # trajectories pinned here at most (0: as many as the memory holds)

    def __post_init__(self) -> None:
        ids = [c for node in self.numa for c in node]
        if len(ids) != len(set(ids)) or not ids:
            raise InvalidSpec(f"host[{self.name}].numa", "core ids must be unique and non-empty")
        if not self.free:
            self.free = [set(node) for node in self.numa]
        # Each core's NUMA node, so that giving cores back (once per action) is O(cores given).
        self._numa_of = {c: i for i, node in enumerate(self.numa) for c in node}
        # The pinned sessions' memory, kept as a total: every scratch reads it for every host.
        self._pinned_gib = sum(self.pinned.values())
        # The core count, kept: the NUMA layout is fixed for the host's life, and every decision
        # reads it for every host (the pool's size, the largest host, where a session fits).
        self._cores = len(ids)

    @property
    def cores(self) -> int:
        return self._cores

    @property
    def free_cores(self) -> int:
        return sum(len(s) for s in self.free)

    @property
    def memory_free(self) -> float:
        return self.memory_gib - self._pinned_gib

    def pin(self, trajectory: str, memory_gib: float) -> None:
        """Hold ``memory_gib`` here for the trajectory's session until ``unpin``."""
        self._pinned_gib += memory_gib - self.pinned.get(trajectory, 0.0)
        self.pinned[trajectory] = memory_gib

    def unpin(self, trajectory: str) -> None:
        """Release the trajectory's session memory (nothing when it is not pinned here)."""
        self._pinned_gib -= self.pinned.pop(trajectory, 0.0)
        if not self.pinned:
            self._pinned_gib = 0.0  # no rounding left over from the additions

    def takes_session(self, memory_gib: float, pinned: int | None = None) -> bool:
        """Whether a new trajectory of ``memory_gib`` may be pinned here (``pinned``: the count
        of trajectories pinned so far, when a scratch has pinned more than the host knows)."""
        count = len(self.pinned) if pinned is None else pinned
        if self.max_sessions and count >= self.max_sessions:
            return False
        return not self.draining and self.memory_free >= memory_gib - 1e-9

    @classmethod
    def uniform(cls, name: str, cores: int, numa_nodes: int, memory_gib: float) -> SandboxHost:
        """A host whose ``cores`` are split evenly over ``numa_nodes``."""
        if cores < 1 or numa_nodes < 1 or cores % numa_nodes:
            raise InvalidSpec(
                f"host[{name}]", f"{cores} cores do not split evenly over {numa_nodes} NUMA nodes"
            )
        per = cores // numa_nodes
        return cls(name, [list(range(i * per, (i + 1) * per)) for i in range(numa_nodes)], memory_gib)

    def take_cores(self, k: int) -> tuple[int, ...]:
        """Exact core set of size k: the fullest NUMA node that still holds all k (best fit keeps
        large NUMA-local sets available), else the fewest NUMA nodes, largest first."""
        if k > self.free_cores:
            raise ValueError(f"host {self.name}: {k} cores asked, {self.free_cores} free")
        fitting = [i for i, s in enumerate(self.free) if len(s) >= k]
        if fitting:
            i = min(fitting, key=lambda j: (len(self.free[j]), j))
            chosen = sorted(self.free[i])[:k]
            self.free[i] -= set(chosen)
            return tuple(chosen)
        chosen_all: list[int] = []
        for i in sorted(range(len(self.free)), key=lambda j: (-len(self.free[j]), j)):
            need = k - len(chosen_all)
            if need <= 0:
                break
            part = sorted(self.free[i])[:need]
            self.free[i] -= set(part)
            chosen_all += part
        return tuple(sorted(chosen_all))

    def give_back(self, cores: Sequence[int]) -> None:
        """Return cores to their NUMA nodes' free sets; a core given back twice is a bug."""
        for c in cores:
            i = self._numa_of.get(c)
            if i is None:
                raise ValueError(f"host {self.name}: core {c} is not on this host")
            if c in self.free[i]:
                raise ValueError(f"host {self.name}: core {c} released twice")
            self.free[i].add(c)


class _CpuScratch:
    def __init__(self, mgr: CpuManager) -> None:
        self._mgr = mgr
        self.free = {h.name: h.free_cores for h in mgr.hosts.values()}
        self.mem = {h.name: h.memory_free for h in mgr.hosts.values()}
        self.sessions = {h.name: len(h.pinned) for h in mgr.hosts.values()}
        # A draining host finishes its pinned trajectories but takes no new ones.
        self.open = [h.name for h in mgr.hosts.values() if not h.draining]
        self.pins: dict[str, str] = {}
        self.host_of: dict[int, str] = {}
        self.held: set[str] = set()  # hosts that take no new session in this scratch

    def _host_for(self, action: Action, units: int) -> str | None:
        pinned = self._mgr.pins.get(action.trajectory) or self.pins.get(action.trajectory)
        if pinned is not None:
            return pinned if self.free.get(pinned, -1) >= units else None
        best: str | None = None
        for name in self.open:
            if name in self.held:
                continue
            free = self.free[name]
            cap = self._mgr.hosts[name].max_sessions
            fits = (
                free >= units
                and self.mem[name] >= action.memory_gib - 1e-9
                and not (cap and self.sessions[name] >= cap)
            )
            if fits and (best is None or free > self.free[best]):
                best = name
        return best

    def try_take(self, action: Action, units: int) -> bool:
        host = self._host_for(action, units)
        if host is None:
            return False
        if action.trajectory not in self._mgr.pins and action.trajectory not in self.pins:
            self.pins[action.trajectory] = host
            self.mem[host] -= action.memory_gib
            self.sessions[host] += 1
        self.free[host] -= units
        self.host_of[id(action)] = host
        return True

    def partitions(self, actions: Sequence[Action]) -> list[Partition]:
        by_host: dict[str, list[Action]] = {}
        for a in actions:
            by_host.setdefault(self.host_of[id(a)], []).append(a)
        parts: list[Partition] = []
        for host, acts in by_host.items():
            # Capacity before these actions were taken in this scratch = their units back on top.
            free = self.free[host] + sum(a.min_units for a in acts)
            parts.append(Partition(CountOperator(free), acts, free, countable=True))
        return parts


class CpuManager:
    """Cores of every sandbox host in one pool."""

    def __init__(self, hosts: Sequence[SandboxHost], pool: str = "cpu") -> None:
        self.hosts = {h.name: h for h in hosts}
        if len(self.hosts) != len(hosts):
            raise InvalidSpec("hosts", "host names must be unique")
        self._pool = pool
        self.pins: dict[str, str] = {}

    @property
    def pool(self) -> str:
        return self._pool

    def total_units(self) -> int:
        return sum(h.cores for h in self.hosts.values() if not h.draining)

    def free_units(self) -> int:
        return sum(h.free_cores for h in self.hosts.values() if not h.draining)

    def max_host_cores(self) -> int:
        return max((h.cores for h in self.hosts.values() if not h.draining), default=0)

    def scratch(self) -> _CpuScratch:
        return _CpuScratch(self)

    def can_ever_fit(self, action: Action) -> bool:
        pinned = self.pins.get(action.trajectory)
        if pinned is not None:
            return self.hosts[pinned].cores >= action.min_units
        return any(
            h.cores >= action.min_units and h.memory_gib >= action.memory_gib for h in self.hosts.values()
        )

    def place(self, action: Action, units: int, now: float, plan: Scratch | None = None) -> Grant | None:
        host_name: str | None = None
        if isinstance(plan, _CpuScratch):
            planned = plan.host_of.get(id(action))
            if planned is not None and self._fits(planned, action, units):
                host_name = planned
        if host_name is None:
            scratch = self.scratch()
            if not scratch.try_take(action, units):
                return None
            host_name = scratch.host_of[id(action)]
        host = self.hosts[host_name]
        if action.trajectory not in self.pins:
            self._pin(action, host)
        cores = host.take_cores(units)
        return Grant(action, units, now, host.name, cores)

    def _fits(self, host_name: str, action: Action, units: int) -> bool:
        host = self.hosts[host_name]
        pinned = self.pins.get(action.trajectory)
        if pinned is not None:
            return pinned == host_name and host.free_cores >= units
        return host.free_cores >= units and host.takes_session(action.memory_gib)

    def release(self, grant: Grant, now: float) -> None:
        self.hosts[grant.host].give_back(grant.unit_ids)

    def pinned_host(self, action: Action, scratch: Scratch | None = None) -> str | None:
        """The host the action's trajectory is pinned to (None before its first action); with
        ``scratch``, a trajectory pinned in it (earlier in the same decision) counts too."""
        host = self.pins.get(action.trajectory)
        if host is None and isinstance(scratch, _CpuScratch):
            host = scratch.pins.get(action.trajectory)
        return host

    def hosts_open(self) -> int:
        """Hosts that are not draining."""
        return sum(1 for h in self.hosts.values() if not h.draining)

    def hosts_total(self) -> int:
        """Every host, draining ones included."""
        return len(self.hosts)

    def session_hosts(self, action: Action) -> list[str]:
        """Open hosts with memory left for the trajectory of an unpinned action and cores enough
        for it (a host too small for the action never takes its session)."""
        return [
            h.name
            for h in self.hosts.values()
            if h.cores >= action.min_units and h.takes_session(action.memory_gib)
        ]

    def hold(self, scratch: Scratch, host: str) -> None:
        """In ``scratch``, pin no new trajectory to ``host`` (its queue head waits for cores)."""
        if isinstance(scratch, _CpuScratch):
            scratch.held.add(host)

    def host_free(self, scratch: Scratch, host: str) -> int:
        """Cores of ``host`` still free in ``scratch`` (a scratch of another manager: free now)."""
        if isinstance(scratch, _CpuScratch):
            return scratch.free.get(host, 0)
        return self.hosts[host].free_cores

    def pin_session(self, action: Action) -> str | None:
        """Pin the action's session now, before its first cores, to the host with the fewest live
        sessions per core (ties: the most free cores) among those with memory for it. A session
        stays on its host for its whole life, so a host's load over the next minutes is its
        sessions, not the cores free this instant: pinning where most cores were free put a whole
        burst of sessions on the one host that had a few idle cores. This is the kube-scheduler's
        least-requested spreading, which the static baseline's pods get."""
        host = self.pins.get(action.trajectory)
        if host is not None:
            return host
        names = self.session_hosts(action)
        if not names:
            return None
        hosts = self.hosts

        def load(name: str) -> tuple[float, int]:
            h = hosts[name]
            return len(h.pinned) / max(1, h.cores), -h.free_cores

        target = min(names, key=load)
        self._pin(action, hosts[target])
        return target

    def _pin(self, action: Action, host: SandboxHost) -> None:
        """Tie the action's trajectory to ``host`` for its life and hold its memory there."""
        self.pins[action.trajectory] = host.name
        host.pin(action.trajectory, action.memory_gib)

    def end_trajectory(self, trajectory: str) -> None:
        """Unpin a finished trajectory and free its memory on its host."""
        host = self.pins.pop(trajectory, None)
        if host is not None:
            self.hosts[host].unpin(trajectory)

    def next_wakeup(self, now: float) -> float | None:
        return None

    def add_host(self, host: SandboxHost) -> None:
        """Add capacity (the planner scaled up)."""
        if host.name in self.hosts:
            raise InvalidSpec("host", f"host {host.name} already exists")
        self.hosts[host.name] = host

    def remove_host(self, name: str) -> None:
        """Remove an idle host with nothing pinned; refuses otherwise (drain first)."""
        host = self.hosts[name]
        if host.free_cores != host.cores or host.pinned:
            raise ValueError(f"host {name} still has running actions or pinned sessions")
        del self.hosts[name]
