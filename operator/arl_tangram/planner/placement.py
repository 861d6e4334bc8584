"""Where new instances go: the bin-packing problem, its cost, a feasibility check and a greedy packer.

The MILP in :mod:`arl_tangram.planner.milp` and the greedy packer here solve the same
:class:`PlacementProblem` and are scored by the same :func:`placement_cost`, so that the planner can
compare a solver's answer, the greedy fallback and the last good placement on equal terms.

The cost is lexicographic, folded into one integer sum with weights that make each level dominate
everything below it:

1. wanted capacity left unplaced (units: cores or GPUs), then
2. capacity placed beyond what was wanted (a GPU replica larger than the remaining need), then
3. nodes newly opened (nodes that held none of the planner's instances: packing keeps the rest free
   for other work and for the cluster autoscaler to reclaim), then
4. the number of new instances (each one is a cold start and a copy of the weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from arl_tangram.errors import InvalidSpec


@dataclass(frozen=True)
class InstanceShape:
    """One size a pool's instance may take: the capacity it gives and what it requests on a node.

    ``min_gpu_memory_bytes`` is the memory each of its GPUs must have (0: no constraint).
    """

    units: int
    cpu_millicores: int
    memory_bytes: int
    gpus: int = 0
    min_gpu_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if self.units < 1:
            raise InvalidSpec("shape.units", f"must be >= 1, got {self.units}")
        for attr in ("cpu_millicores", "memory_bytes", "gpus", "min_gpu_memory_bytes"):
            if getattr(self, attr) < 0:
                raise InvalidSpec(f"shape.{attr}", f"must be >= 0, got {getattr(self, attr)}")


@dataclass(frozen=True)
class PoolRequest:
    """Capacity one pool wants added: ``units`` in at most ``max_count`` new instances.

    Instances may only go to ``eligible_nodes`` (schedulable and matching the pool's selector).
    A pool may overshoot ``units`` by less than its largest shape, never more.
    """

    pool: str
    shapes: tuple[InstanceShape, ...]
    units: int
    max_count: int
    eligible_nodes: frozenset[str]

    def __post_init__(self) -> None:
        if not self.shapes:
            raise InvalidSpec(f"requests[{self.pool}].shapes", "must list at least one shape")
        if len({s.units for s in self.shapes}) != len(self.shapes):
            raise InvalidSpec(f"requests[{self.pool}].shapes", "shapes must differ in units")
        if self.units < 0 or self.max_count < 0:
            raise InvalidSpec(f"requests[{self.pool}]", "units and max_count must be >= 0")

    @property
    def max_units(self) -> int:
        """The most capacity a placement may add for this pool."""
        if self.max_count == 0 or self.units == 0:
            return 0
        return self.units + max(s.units for s in self.shapes) - 1

    def shape(self, units: int) -> InstanceShape:
        """The shape giving ``units``; KeyError when the pool has none."""
        for shape in self.shapes:
            if shape.units == units:
                return shape
        raise KeyError(units)


@dataclass(frozen=True)
class NodeCapacity:
    """What a node has free for new instances (never negative); ``opened`` if it already holds ours."""

    name: str
    free_cpu_millicores: int
    free_memory_bytes: int
    free_gpus: int
    gpu_memory_bytes: int
    opened: bool

    def __post_init__(self) -> None:
        # An over-committed node (it shrank, or pods outside our view grew) simply has no room.
        object.__setattr__(self, "free_cpu_millicores", max(0, self.free_cpu_millicores))
        object.__setattr__(self, "free_memory_bytes", max(0, self.free_memory_bytes))
        object.__setattr__(self, "free_gpus", max(0, self.free_gpus))


def shape_fits_node_type(shape: InstanceShape, node: NodeCapacity) -> bool:
    """Whether the node's GPUs are of a kind the shape can use at all (ignores what is free)."""
    if shape.gpus == 0:
        return True
    return node.gpu_memory_bytes >= shape.min_gpu_memory_bytes


PlacementKey = tuple[str, str, int]
"""(pool, node, shape units)."""


@dataclass(frozen=True)
class Placement:
    """How many new instances of each (pool, node, shape units); zero counts are dropped."""

    counts: Mapping[PlacementKey, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        cleaned = {key: count for key, count in sorted(self.counts.items()) if count > 0}
        object.__setattr__(self, "counts", cleaned)

    def items(self) -> Iterator[tuple[PlacementKey, int]]:
        """(key, count) pairs in a stable order."""
        return iter(self.counts.items())

    def instances(self) -> int:
        """Total new instances."""
        return sum(self.counts.values())

    def units_of(self, pool: str) -> int:
        """Capacity added to one pool."""
        return sum(units * n for (p, _, units), n in self.counts.items() if p == pool)

    def count_of(self, pool: str) -> int:
        """New instances of one pool."""
        return sum(n for (p, _, _), n in self.counts.items() if p == pool)

    def nodes_used(self) -> set[str]:
        """Nodes that receive at least one new instance."""
        return {node for (_, node, _) in self.counts}


@dataclass(frozen=True)
class PlacementProblem:
    """Requests from every pool against every node's free capacity, solved jointly."""

    requests: tuple[PoolRequest, ...]
    nodes: tuple[NodeCapacity, ...]

    def __post_init__(self) -> None:
        pools = [r.pool for r in self.requests]
        if len(set(pools)) != len(pools):
            raise InvalidSpec("requests", "one request per pool")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise InvalidSpec("nodes", "node names must be unique")

    @property
    def is_trivial(self) -> bool:
        """Nothing is wanted, so the empty placement is optimal."""
        return all(r.units == 0 or r.max_count == 0 for r in self.requests)

    def node(self, name: str) -> NodeCapacity:
        """One node by name; KeyError when unknown."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def request(self, pool: str) -> PoolRequest:
        """One pool's request by name; KeyError when unknown."""
        for req in self.requests:
            if req.pool == pool:
                return req
        raise KeyError(pool)

    def candidates(self) -> Iterator[tuple[PoolRequest, NodeCapacity, InstanceShape]]:
        """Every (request, node, shape) whose instance could go on that node if it had room."""
        for req in self.requests:
            if req.units == 0 or req.max_count == 0:
                continue
            for node in self.nodes:
                if node.name not in req.eligible_nodes:
                    continue
                for shape in req.shapes:
                    if shape_fits_node_type(shape, node) and fits(shape, node, 1):
                        yield req, node, shape

    # The lexicographic weights; each level's weight exceeds the largest possible sum of those below.
    def weights(self) -> tuple[int, int, int, int]:
        """(unplaced unit, overshoot unit, opened node, instance) weights of :func:`placement_cost`."""
        w_instance = 1
        max_instances = sum(r.max_count for r in self.requests)
        w_open = w_instance * (max_instances + 1)
        w_over = w_open * (len(self.nodes) + 1) + w_instance * max_instances
        max_over = sum(max(s.units for s in r.shapes) - 1 for r in self.requests)
        w_short = w_over * (max_over + 1) + w_open * len(self.nodes) + w_instance * max_instances
        return w_short, w_over, w_open, w_instance


def fits(shape: InstanceShape, node: NodeCapacity, count: int) -> bool:
    """Whether ``count`` instances of ``shape`` fit in what the node has free."""
    return (
        shape.cpu_millicores * count <= node.free_cpu_millicores
        and shape.memory_bytes * count <= node.free_memory_bytes
        and shape.gpus * count <= node.free_gpus
    )


@dataclass(frozen=True)
class PlacementCheck:
    """The verdict of :func:`check_placement`: feasible, or the first violation found."""

    feasible: bool
    problem: str = ""


def check_placement(problem: PlacementProblem, placement: Placement) -> PlacementCheck:
    """Whether a placement respects every constraint of the problem; names the first one broken."""
    used: dict[str, list[int]] = {n.name: [0, 0, 0] for n in problem.nodes}
    requests = {r.pool: r for r in problem.requests}
    for (pool, node_name, units), count in placement.items():
        req = requests.get(pool)
        if req is None:
            return PlacementCheck(False, f"pool {pool!r} requested nothing")
        if node_name not in used:
            return PlacementCheck(False, f"unknown node {node_name!r}")
        if node_name not in req.eligible_nodes:
            return PlacementCheck(False, f"node {node_name!r} is not eligible for pool {pool!r}")
        try:
            shape = req.shape(units)
        except KeyError:
            return PlacementCheck(False, f"pool {pool!r} has no shape of {units} units")
        if not shape_fits_node_type(shape, problem.node(node_name)):
            return PlacementCheck(False, f"node {node_name!r} has GPUs too small for {pool!r}")
        acc = used[node_name]
        acc[0] += shape.cpu_millicores * count
        acc[1] += shape.memory_bytes * count
        acc[2] += shape.gpus * count
    for node in problem.nodes:
        cpu, mem, gpus = used[node.name]
        if cpu > node.free_cpu_millicores or mem > node.free_memory_bytes or gpus > node.free_gpus:
            return PlacementCheck(False, f"node {node.name!r} over-committed")
    for req in problem.requests:
        if placement.count_of(req.pool) > req.max_count:
            return PlacementCheck(False, f"pool {req.pool!r} gets more than {req.max_count} instances")
        if placement.units_of(req.pool) > req.max_units:
            return PlacementCheck(False, f"pool {req.pool!r} gets more than {req.max_units} units")
    return PlacementCheck(True)


@dataclass(frozen=True)
class PlacementScore:
    """The parts of a placement's cost, and the weighted total (lower is better)."""

    unplaced_units: int
    overshoot_units: int
    opened_nodes: int
    instances: int
    total: int


def placement_cost(problem: PlacementProblem, placement: Placement) -> PlacementScore:
    """Score a placement (assumed feasible) with the lexicographic cost described in this module."""
    w_short, w_over, w_open, w_instance = problem.weights()
    unplaced = 0
    overshoot = 0
    for req in problem.requests:
        placed = placement.units_of(req.pool)
        unplaced += max(0, req.units - placed)
        overshoot += max(0, placed - req.units)
    already_open = {n.name for n in problem.nodes if n.opened}
    opened = len(placement.nodes_used() - already_open)
    instances = placement.instances()
    total = w_short * unplaced + w_over * overshoot + w_open * opened + w_instance * instances
    return PlacementScore(unplaced, overshoot, opened, instances, total)


def place_greedy(problem: PlacementProblem) -> Placement:
    """Best-fit greedy packing: the fallback when the MILP fails or runs out of time.

    Pools go largest request first; each new instance takes the largest shape that does not exceed
    the remaining need (else the smallest larger one), on the fullest node in use that fits it, else
    on the roomiest unused node. Deterministic for a given problem.
    """
    free = {n.name: [n.free_cpu_millicores, n.free_memory_bytes, n.free_gpus] for n in problem.nodes}
    nodes = {n.name: n for n in problem.nodes}
    opened = {n.name for n in problem.nodes if n.opened}
    counts: dict[PlacementKey, int] = {}
    for req in sorted(problem.requests, key=lambda r: (-r.units, r.pool)):
        placed = 0
        count = 0
        while placed < req.units and count < req.max_count:
            remaining = req.units - placed
            choice = _greedy_choice(req, remaining, nodes, free, opened)
            if choice is None:
                break
            shape, node_name = choice
            key = (req.pool, node_name, shape.units)
            counts[key] = counts.get(key, 0) + 1
            room = free[node_name]
            room[0] -= shape.cpu_millicores
            room[1] -= shape.memory_bytes
            room[2] -= shape.gpus
            opened.add(node_name)
            placed += shape.units
            count += 1
    return Placement(counts)


def _greedy_choice(
    req: PoolRequest,
    remaining: int,
    nodes: Mapping[str, NodeCapacity],
    free: Mapping[str, list[int]],
    opened: set[str],
) -> tuple[InstanceShape, str] | None:
    exact = sorted((s for s in req.shapes if s.units <= remaining), key=lambda s: -s.units)
    larger = sorted((s for s in req.shapes if s.units > remaining), key=lambda s: s.units)
    for shape in (*exact, *larger):
        best: tuple[tuple[bool, int, int, int, str], str] | None = None
        for name in _eligible(req, nodes):
            node = nodes[name]
            room = free[name]
            if not shape_fits_node_type(shape, node):
                continue
            if shape.cpu_millicores > room[0] or shape.memory_bytes > room[1] or shape.gpus > room[2]:
                continue
            # An open node first, best fit among them (least room left over, GPUs first); when a node
            # must be opened, the roomiest one, so that later instances need fewer new nodes.
            left = (room[2] - shape.gpus, room[0] - shape.cpu_millicores, room[1] - shape.memory_bytes)
            is_new = name not in opened
            sign = -1 if is_new else 1
            key = (is_new, sign * left[0], sign * left[1], sign * left[2], name)
            if best is None or key < best[0]:
                best = (key, name)
        if best is not None:
            return shape, best[1]
    return None


def _eligible(req: PoolRequest, nodes: Iterable[str]) -> list[str]:
    return sorted(name for name in nodes if name in req.eligible_nodes)
