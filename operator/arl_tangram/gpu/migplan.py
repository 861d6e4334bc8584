"""MIG planner: per-GPU MIG layouts that serve the reward services' demand on the fewest GPUs.

Each service needs some replicas (from its arrival rate, its execution time and a utilisation target,
at least its minimum), each on one MIG instance with at least its GPU memory and compute slices. A
layout is one of the GPU model's valid profile combinations (``mig.layouts``).

On every MIG table NVIDIA ships, the profiles form a chain: ordered by compute slices, each has at
least the memory of the one before (1g.10gb < 1g.20gb < 2g.20gb < 3g.40gb < 4g.40gb < 7g.80gb). So
a replica that fits a profile fits every later one, and a set of instances serves the replicas exactly
when, for every rank r, the instances of rank >= r are at least the replicas whose smallest fitting
profile has rank >= r (Hall's condition on a chain). The plan is then a covering problem over the
suffix counts of the layouts, solved exactly by iterative deepening over the number of GPUs with a
lower bound, then a greedy matching of replicas to instances (each replica, largest first, takes the
smallest instance that fits). Layouts already on a GPU are kept where the plan has the same one.
Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

from arl_tangram.gpu import mig
from arl_tangram.gpu.inventory import NodeInventory

# Search nodes before the planner settles for the greedy cover (a large fleet with many services);
# small plans finish in a few hundred nodes.
DEFAULT_SEARCH_BUDGET = 200_000


@dataclass(frozen=True)
class ServiceDemand:
    """One reward service's need for MIG instances.

    ``memory_gb``: GPU memory of one replica (decimal GB, compared with the profile's nominal size:
    ``1g.10gb`` holds 10 GB); ``compute_slices``: fewest compute slices a replica needs; ``rate_per_s``
    and ``service_s``: arrivals and mean execution time on such an instance; ``max_utilization``: the
    busy fraction a replica is planned for (headroom for the tail of the queue)."""

    name: str
    memory_gb: float
    compute_slices: int = 1
    rate_per_s: float = 0.0
    service_s: float = 0.0
    min_replicas: int = 0
    max_utilization: float = 0.7

    def __post_init__(self) -> None:
        if self.memory_gb <= 0:
            raise mig.MigError(f"service {self.name}: memory_gb must be > 0, got {self.memory_gb}")
        if not 1 <= self.compute_slices <= 8:
            raise mig.MigError(f"service {self.name}: compute_slices must be 1..8, got {self.compute_slices}")
        if self.rate_per_s < 0 or self.service_s < 0 or self.min_replicas < 0:
            raise mig.MigError(f"service {self.name}: rate, service time and min replicas must be >= 0")
        if not 0 < self.max_utilization <= 1:
            raise mig.MigError(f"service {self.name}: max_utilization must be in (0, 1]")

    def replicas(self) -> int:
        """Replicas needed: offered load over the utilisation target, at least one when requests come."""
        load = self.rate_per_s * self.service_s
        need = math.ceil(load / self.max_utilization - 1e-9) if load > 0 else 0
        if self.rate_per_s > 0:
            need = max(need, 1)
        return max(need, self.min_replicas)


@dataclass(frozen=True)
class MigGpu:
    """A GPU the planner may lay out: an id (UUID), its MIG table and its current layout (None: MIG
    off)."""

    id: str
    model: str
    current: tuple[str, ...] | None = None


@dataclass
class MigPlan:
    """Layouts for the GPUs the demand needs (others are in ``unused``), which profile each service's
    replicas get, and whether the search proved the GPU count minimal."""

    layouts: dict[str, tuple[str, ...]]
    assignment: dict[str, list[str]]
    unused: list[str]
    optimal: bool
    replicas: dict[str, int] = field(default_factory=dict)

    @property
    def gpus_used(self) -> int:
        return len(self.layouts)


@cache
def chain(model_key: str) -> tuple[mig.MigProfile, ...]:
    """The model's profiles without media extensions, in chain order (checked to be a chain)."""
    model = mig.model_of(model_key)
    profiles = sorted(
        (p for p in model.profiles if not p.name.endswith("+me")), key=lambda p: (p.compute, p.memory_gb)
    )
    for a, b in itertools.pairwise(profiles):
        if b.memory_gb < a.memory_gb:
            raise mig.MigError(f"{model_key}: profiles {a.name} and {b.name} do not form a chain")
    return tuple(profiles)


def smallest_fit(model_key: str, demand: ServiceDemand) -> int | None:
    """Chain rank of the smallest profile a replica of ``demand`` fits, or None when none does."""
    for rank, p in enumerate(chain(model_key)):
        if p.compute >= demand.compute_slices and p.memory_gb >= demand.memory_gb - 1e-9:
            return rank
    return None


@cache
def _layout_vectors(model_key: str) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    """Non-dominated layouts with their suffix counts (instances of rank >= r), most instances first."""
    ranks = {p.name: i for i, p in enumerate(chain(model_key))}
    n = len(ranks)
    vectors: dict[tuple[int, ...], tuple[str, ...]] = {}
    for lay in mig.layouts(model_key):
        if any(p not in ranks for p in lay):
            continue
        counts = Counter(ranks[p] for p in lay)
        suffix = tuple(sum(counts[q] for q in range(r, n)) for r in range(n))
        if suffix not in vectors or len(lay) > len(vectors[suffix]):
            vectors[suffix] = lay
    keep = [
        (lay, v)
        for v, lay in vectors.items()
        if not any(w != v and all(a >= b for a, b in zip(w, v, strict=True)) for w in vectors)
    ]
    keep.sort(key=lambda lv: (-len(lv[0]), lv[0]))
    return tuple(keep)


class _Cover:
    """Exact covering search: fewest layouts whose suffix counts reach the demand's."""

    def __init__(self, vectors: Sequence[tuple[int, ...]], budget: int) -> None:
        self.vectors = vectors
        self.best_per_rank = [max(v[r] for v in vectors) for r in range(len(vectors[0]))]
        self.budget = budget
        self.nodes = 0
        self.failed: set[tuple[tuple[int, ...], int, int]] = set()

    def lower_bound(self, need: tuple[int, ...]) -> int:
        """GPUs needed at least: per rank, its demand over the most instances one layout offers."""
        bound = 0
        for x, most in zip(need, self.best_per_rank, strict=True):
            if x:
                bound = max(bound, -(-x // most))  # most > 0: the whole-GPU profile is in every table
        return bound

    def search(self, need: tuple[int, ...], k: int, first: int, out: list[int]) -> bool:
        if not any(need):
            return True
        if k == 0 or self.lower_bound(need) > k:
            return False
        key = (need, k, first)
        if key in self.failed:
            return False
        self.nodes += 1
        if self.nodes > self.budget:
            raise _OverBudget
        for i in range(first, len(self.vectors)):
            v = self.vectors[i]
            rest = tuple(max(0, x - y) for x, y in zip(need, v, strict=True))
            if rest == need:
                continue
            out.append(i)
            if self.search(rest, k - 1, i, out):
                return True
            out.pop()
        self.failed.add(key)
        return False


class _OverBudget(Exception):
    pass


def _greedy(vectors: Sequence[tuple[int, ...]], need: tuple[int, ...], limit: int) -> list[int] | None:
    out: list[int] = []
    while any(need) and len(out) < limit:
        gain = [sum(min(x, y) for x, y in zip(need, v, strict=True)) for v in vectors]
        best = max(range(len(vectors)), key=lambda i: (gain[i], -i))
        if gain[best] == 0:
            return None
        out.append(best)
        need = tuple(max(0, x - y) for x, y in zip(need, vectors[best], strict=True))
    return None if any(need) else out


def plan_mig(
    demands: Sequence[ServiceDemand], gpus: Sequence[MigGpu], budget: int = DEFAULT_SEARCH_BUDGET
) -> MigPlan:
    """Layouts for the fewest of ``gpus`` (one MIG model) that serve ``demands``; ``mig.MigError``
    names the service or the shortfall when they cannot."""
    models = {g.model for g in gpus}
    if len(models) > 1:
        raise mig.MigError(f"plan one GPU model at a time; got {', '.join(sorted(models))}")
    if len({g.id for g in gpus}) != len(gpus):
        raise mig.MigError("GPU ids must be unique")
    if len({d.name for d in demands}) != len(demands):
        raise mig.MigError("service names must be unique")
    replicas = {d.name: d.replicas() for d in demands}
    if not gpus:
        if any(replicas.values()):
            raise mig.MigError("no MIG-capable GPUs to serve the demand")
        return MigPlan({}, {d.name: [] for d in demands}, [], True, replicas)
    key = next(iter(models))
    profiles = chain(key)
    n = len(profiles)
    per_rank = [0] * n
    rank_of: dict[str, int] = {}
    for d in demands:
        r = smallest_fit(key, d)
        if r is None:
            raise mig.MigError(
                f"service {d.name} ({d.memory_gb} GB, {d.compute_slices} compute slices) fits no "
                f"{key} MIG profile; give it whole GPUs"
            )
        rank_of[d.name] = r
        per_rank[r] += replicas[d.name]
    need = tuple(sum(per_rank[r:]) for r in range(n))
    table = _layout_vectors(key)
    vectors = [v for _, v in table]
    cover = _Cover(vectors, budget)
    try:
        layouts = _exact(
            cover, need, gpus, [lay for lay, _ in table], {p.name: i for i, p in enumerate(profiles)}
        )
        optimal = True
    except _OverBudget:
        chosen = _greedy(vectors, need, len(gpus))
        layouts = None if chosen is None else _assign_gpus([table[i][0] for i in chosen], gpus)
        optimal = False
    if layouts is None:
        total = sum(replicas.values())
        raise mig.MigError(f"{len(gpus)} {key} GPUs cannot hold the {total} MIG replicas the services need")
    assignment = _match(layouts, demands, replicas, rank_of, profiles)
    unused = [g.id for g in gpus if g.id not in layouts]
    return MigPlan(layouts, assignment, unused, optimal, replicas)


def _suffix(layout: Sequence[str], rank: Mapping[str, int]) -> tuple[int, ...] | None:
    if any(p not in rank for p in layout):
        return None
    counts = Counter(rank[p] for p in layout)
    return tuple(sum(counts[q] for q in range(r, len(rank))) for r in range(len(rank)))


def _exact(
    cover: _Cover,
    need: tuple[int, ...],
    gpus: Sequence[MigGpu],
    table: Sequence[tuple[str, ...]],
    rank: Mapping[str, int],
) -> dict[str, tuple[str, ...]] | None:
    """The fewest GPUs (iterative deepening); among such plans, one that keeps as many current
    layouts as it can (each GPU in order keeps its layout when a plan of that size still exists)."""
    k = next((k for k in range(cover.lower_bound(need), len(gpus) + 1) if cover.search(need, k, 0, [])), None)
    if k is None:
        return None
    out: dict[str, tuple[str, ...]] = {}
    for g in gpus:
        if g.current is None or not any(need) or k == 0:
            continue
        v = _suffix(g.current, rank)
        if v is None:
            continue
        rest = tuple(max(0, x - y) for x, y in zip(need, v, strict=True))
        if rest != need and cover.search(rest, k - 1, 0, []):
            out[g.id] = tuple(sorted(g.current))
            need, k = rest, k - 1
    chosen: list[int] = []
    if not cover.search(need, k, 0, chosen):
        raise AssertionError("a cover found before must still exist")
    out.update(_assign_gpus([table[i] for i in chosen], [g for g in gpus if g.id not in out]))
    return out


def _assign_gpus(chosen: list[tuple[str, ...]], gpus: Sequence[MigGpu]) -> dict[str, tuple[str, ...]]:
    """Chosen layouts onto GPUs: a GPU that already has a chosen layout keeps it (no reconfiguration),
    then GPUs already in MIG mode, then the rest, in order."""
    left = list(chosen)
    out: dict[str, tuple[str, ...]] = {}
    for g in gpus:
        cur = None if g.current is None else tuple(sorted(g.current))
        if cur is not None and cur in left:
            left.remove(cur)
            out[g.id] = cur
    for g in sorted(gpus, key=lambda g: g.current is None):
        if not left:
            break
        if g.id not in out:
            out[g.id] = left.pop(0)
    return out


def _match(
    layouts: Mapping[str, tuple[str, ...]],
    demands: Sequence[ServiceDemand],
    replicas: Mapping[str, int],
    rank_of: Mapping[str, int],
    profiles: Sequence[mig.MigProfile],
) -> dict[str, list[str]]:
    """Profile of each replica: largest requirement first, each takes the smallest instance that fits."""
    rank = {p.name: i for i, p in enumerate(profiles)}
    free = sorted(rank[p] for lay in layouts.values() for p in lay)
    out: dict[str, list[str]] = {d.name: [] for d in demands}
    for d in sorted(demands, key=lambda d: -rank_of[d.name]):
        for _ in range(replicas[d.name]):
            i = next(i for i, r in enumerate(free) if r >= rank_of[d.name])
            out[d.name].append(profiles[free.pop(i)].name)
    return out


def mig_gpus(inventories: Sequence[NodeInventory]) -> dict[str, list[MigGpu]]:
    """MIG-capable GPUs of the inventories, grouped by MIG table (plan each group on its own)."""
    out: dict[str, list[MigGpu]] = {}
    for inv in inventories:
        for g in inv.gpus:
            key = mig.model_key(g.model, g.memory_mib)
            if key is None:
                continue
            current = tuple(sorted(m.profile for m in g.mig_instances)) if g.mig_enabled else None
            out.setdefault(key, []).append(MigGpu(g.uuid, key, current))
    return out
