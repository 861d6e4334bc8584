"""``static``: the paper's baseline, statically provisioned resources.

- CPU: one pod per trajectory for its whole life (0.5 core request, 4 core limit), created when the
  trajectory starts through a control plane the simulator models; an action runs inside its own
  trajectory's pod once the pod is ready, scalable actions at a fixed DoP of 4. The pod's node
  shares its cores fairly between running pods, each up to its limit (the simulator executes that
  sharing: grants here carry ``extra["shared"]``).
- GPU: every reward service holds its own replicas (4 GPUs each, TP 4); requests queue FCFS per
  service and one request runs per replica at a time.
- APIs: every call goes out at once with no traffic control (the API itself may reject it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Grant, PoolManager
from arl_tangram.core.scheduler import Scheduler
from arl_tangram.errors import CapacityExceeded


@dataclass(frozen=True)
class StaticConfig:
    """The baseline's fixed provisioning."""

    dop: int = 4
    pod_request_cores: float = 0.5
    pod_limit_cores: float = 4.0
    gpus_per_replica: int = 4


@dataclass
class StaticNode:
    """A node pods are bound to: capacity by requests."""

    name: str
    cores: int
    memory_gib: float
    requested_cores: float = 0.0
    requested_memory: float = 0.0
    pods: set[str] = field(default_factory=set)


@dataclass
class Replica:
    """A service's dedicated GPUs."""

    service: str
    node: str
    gpus: tuple[int, ...]
    busy: bool = False


class StaticPolicy(Scheduler):
    """The static baseline (see the module docstring)."""

    name = "static"

    def __init__(
        self,
        pools: Mapping[str, PoolManager],
        nodes: Sequence[StaticNode] = (),
        replicas: Sequence[Replica] = (),
        config: StaticConfig | None = None,
    ) -> None:
        super().__init__(pools)
        self.config = config or StaticConfig()
        self.nodes = {n.name: n for n in nodes}
        self.pod_node: dict[str, str] = {}
        self.ready: set[str] = set()
        self.replicas: dict[str, list[Replica]] = {}
        for r in replicas:
            self.replicas.setdefault(r.service, []).append(r)
        self._cpu_waiting: dict[str, deque[Action]] = {}
        self._gpu_waiting: dict[str, deque[Action]] = {}
        self._other: deque[Action] = deque()
        self._startable: deque[str] = deque()

    # ---- pods -------------------------------------------------------------------------------------
    def create_pod(self, trajectory: str, memory_gib: float) -> str | None:
        """Bind the trajectory's pod to the least requested node that holds its requests; None when
        no node does (the pod stays pending)."""
        req = self.config.pod_request_cores
        best: StaticNode | None = None
        for node in self.nodes.values():
            fits = node.requested_cores + req <= node.cores
            fits = fits and node.requested_memory + memory_gib <= node.memory_gib
            if fits and (best is None or node.requested_cores < best.requested_cores):
                best = node
        if best is None:
            return None
        best.requested_cores += req
        best.requested_memory += memory_gib
        best.pods.add(trajectory)
        self.pod_node[trajectory] = best.name
        return best.name

    def pod_ready(self, trajectory: str) -> None:
        """The control plane started the trajectory's pod; its waiting action may run."""
        self.ready.add(trajectory)
        if self._cpu_waiting.get(trajectory):
            self._startable.append(trajectory)

    def delete_pod(self, trajectory: str, memory_gib: float) -> None:
        """The trajectory ended: its pod goes away."""
        name = self.pod_node.pop(trajectory, None)
        self.ready.discard(trajectory)
        if name is not None:
            node = self.nodes[name]
            node.requested_cores -= self.config.pod_request_cores
            node.requested_memory -= memory_gib
            node.pods.discard(trajectory)

    # ---- actions ---------------------------------------------------------------------------------
    def submit(self, action: Action, now: float, *, growing: bool = False) -> None:
        # ``growing`` changes nothing here: a pod that no node holds yet stays pending anyway.
        action.arrival = now
        if action.pool.startswith("api:"):
            self._other.append(action)
        elif action.pool == "gpu" or action.service is not None:
            if action.service not in self.replicas:
                raise CapacityExceeded(f"service {action.service!r} has no static replicas")
            self._gpu_waiting.setdefault(str(action.service), deque()).append(action)
        else:
            # A trajectory whose pod is still pending (no node holds it yet) waits like one whose
            # pod is starting: its actions run once the pod is ready.
            self._cpu_waiting.setdefault(action.trajectory, deque()).append(action)
            if action.trajectory in self.ready:
                self._startable.append(action.trajectory)

    def queued(self) -> int:
        return (
            sum(len(q) for q in self._cpu_waiting.values())
            + sum(len(q) for q in self._gpu_waiting.values())
            + len(self._other)
        )

    def complete(self, grant: Grant, now: float) -> None:
        self.running.pop(id(grant), None)
        service = grant.extra.get("replica")
        if service is not None:
            for r in self.replicas[service]:
                if r.node == grant.host and r.gpus == grant.unit_ids:
                    r.busy = False

    def _cpu_units(self, action: Action) -> int:
        if not action.elastic:
            return action.min_units
        fixed = [k for k in action.feasible if k <= self.config.dop]
        return fixed[-1] if fixed else action.min_units

    def _decide(self, now: float) -> list[Grant]:
        grants: list[Grant] = []
        while self._startable:
            traj = self._startable.popleft()
            waiting = self._cpu_waiting.get(traj)
            while waiting:
                a = waiting.popleft()
                units = self._cpu_units(a)
                grants.append(Grant(a, units, now, self.pod_node[traj], extra={"shared": "1"}))
        while self._other:
            a = self._other.popleft()
            grants.append(Grant(a, a.min_units, now, a.pool))
        for service, waiting in self._gpu_waiting.items():
            for r in self.replicas[service]:
                if not waiting:
                    break
                if not r.busy:
                    a = waiting.popleft()
                    r.busy = True
                    grants.append(Grant(a, len(r.gpus), now, r.node, r.gpus, extra={"replica": service}))
        return grants
