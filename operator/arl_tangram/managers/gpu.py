"""GPU manager (evict-on-execution): aligned buddy chunks, NVLink-aware, MIG slices, LRU service cache.

Each node's GPUs are cut into aligned chunks of 1, 2, 4, 8 (buddy-style). When the NVLink matrix is
not all-to-all the GPUs are first ordered so that aligned blocks are NVLink cliques wherever the
topology allows, and a block that is not a clique is never handed out whole. GPUs in MIG mode leave
the buddy tree and serve their MIG instances as sub-GPU units, one action per instance. Every
service (a model at one tensor-parallel size) may be cached on many chunks; an action prefers a
free chunk where its service is resident, otherwise the service is restored from host memory,
evicting least recently used services on those GPUs until it fits. At most one action per GPU.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Grant, Partition, Scratch
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.count_op import CountOperator

LEVELS = (1, 2, 4, 8)
CacheKey = tuple[str, int, str, int]  # (service, tp size, node, block start position)


@dataclass
class MigSlice:
    """One MIG instance: a sub-GPU unit with its profile (e.g. ``3g.40gb``)."""

    gpu: int
    index: int
    profile: str
    busy: bool = False


def _clique(members: Sequence[int], nvlink: Sequence[Sequence[bool]] | None) -> bool:
    if nvlink is None:
        return True
    return all(nvlink[a][b] for a, b in itertools.combinations(members, 2))


def nvlink_order(n: int, nvlink: Sequence[Sequence[bool]] | None) -> list[int]:
    """Order GPUs so that aligned blocks are NVLink cliques where possible (recursive bisection
    choosing, at each level, the split with the most NVLink pairs inside the halves)."""
    if nvlink is None:
        return list(range(n))

    def links(group: Sequence[int]) -> int:
        return sum(1 for a, b in itertools.combinations(group, 2) if nvlink[a][b])

    def split(group: list[int]) -> list[int]:
        if len(group) <= 1:
            return group
        half = len(group) // 2
        first = group[0]  # fix one member to halve the symmetric search
        best: tuple[int, list[int], list[int]] | None = None
        for rest in itertools.combinations(group[1:], half - 1):
            left = [first, *rest]
            right = [g for g in group if g not in left]
            score = links(left) + links(right)
            if best is None or score > best[0]:
                best = (score, left, right)
        assert best is not None
        return split(best[1]) + split(best[2])

    return split(list(range(n)))


@dataclass
class GpuNode:
    """One GPU node. ``nvlink`` is None for all-to-all (NVSwitch), else a boolean matrix."""

    name: str
    gpus: int
    memory_gb: float = 80.0
    nvlink: list[list[bool]] | None = None
    mig: dict[int, list[str]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    busy: set[int] = field(default_factory=set)
    slices: list[MigSlice] = field(default_factory=list)
    cache: dict[int, OrderedDict[CacheKey, float]] = field(default_factory=dict)
    draining: bool = False  # finishes what runs on it, takes nothing new (the planner scales down)

    def __post_init__(self) -> None:
        if self.gpus not in LEVELS:
            raise InvalidSpec(f"gpuNode[{self.name}].gpus", f"must be one of {LEVELS}, got {self.gpus}")
        if self.nvlink is not None:
            if len(self.nvlink) != self.gpus or any(len(r) != self.gpus for r in self.nvlink):
                raise InvalidSpec(f"gpuNode[{self.name}].nvlink", f"must be a {self.gpus}x{self.gpus} matrix")
            if all(self.nvlink[a][b] for a in range(self.gpus) for b in range(self.gpus) if a != b):
                self.nvlink = None
        for g in self.mig:
            if not 0 <= g < self.gpus:
                raise InvalidSpec(f"gpuNode[{self.name}].mig", f"no GPU {g}")
        self.order = nvlink_order(self.gpus, self.nvlink)
        self.slices = [
            MigSlice(g, i, p) for g, profiles in sorted(self.mig.items()) for i, p in enumerate(profiles)
        ]
        self.cache = {g: OrderedDict() for g in range(self.gpus)}
        # Every aligned block's GPU bitmask and whether it may be handed out whole (computed once).
        self._mig_mask = sum(1 << g for g in self.mig)
        self._blocks: dict[tuple[int, int], tuple[int, bool]] = {}
        size = self.gpus
        while size >= 1:
            for start in range(0, self.gpus, size):
                mask = sum(1 << g for g in self.members(start, size))
                self._blocks[(start, size)] = (mask, self.allocatable(start, size))
            size //= 2

    def members(self, start: int, size: int) -> list[int]:
        """Physical GPU ids of the aligned block at ``start`` positions of ``size``."""
        return self.order[start : start + size]

    def allocatable(self, start: int, size: int) -> bool:
        members = self.members(start, size)
        return not any(g in self.mig for g in members) and _clique(members, self.nvlink)

    def block_free(self, start: int, size: int, busy: set[int]) -> bool:
        return not any(g in busy or g in self.mig for g in self.members(start, size))

    def free_blocks(self, busy: set[int] | None = None) -> list[tuple[int, int]]:
        """Maximal free allocatable aligned blocks as (start, size), in buddy-tree order."""
        busy = self.busy if busy is None else busy
        if self.draining:
            return []
        taken = self._mig_mask
        for g in busy:
            taken |= 1 << g
        out: list[tuple[int, int]] = []
        stack = [(0, self.gpus)]
        while stack:
            start, size = stack.pop()
            mask, allocatable = self._blocks[(start, size)]
            if not mask & taken and allocatable:
                out.append((start, size))
            elif size > 1:
                half = size // 2
                stack.append((start + half, half))
                stack.append((start, half))
        return out

    def must_evict(self, start: int, size: int, need_gb: float) -> bool:
        """True when a service needing ``need_gb`` per GPU does not fit on the block's free memory."""
        return any(
            self.memory_gb - sum(self.cache[g].values()) < need_gb - 1e-9 for g in self.members(start, size)
        )

    def resident(self, key: tuple[str, int], start: int) -> bool:
        service, tp = key
        ck: CacheKey = (service, tp, self.name, start)
        return all(ck in self.cache[g] for g in self.members(start, tp))


def chunk_counts(nodes: Sequence[GpuNode], busy: dict[str, set[int]]) -> tuple[int, int, int, int]:
    """Free maximal aligned chunks per level over all nodes: the GPU DP state."""
    counts = [0, 0, 0, 0]
    for node in nodes:
        for _, size in node.free_blocks(busy[node.name]):
            counts[LEVELS.index(size)] += 1
    return counts[0], counts[1], counts[2], counts[3]


@dataclass(frozen=True)
class BuddyOperator:
    """GPU DP operator. State: free aligned chunks of 1, 2, 4, 8 (a mixed-radix tuple). Taking k
    uses the smallest free chunk of size >= k and splits the rest buddy-style, as the allocator does."""

    counts: tuple[int, int, int, int]

    def start(self) -> tuple[int, int, int, int]:
        return self.counts

    def prev(self, state: tuple[int, int, int, int], k: int) -> tuple[int, int, int, int] | None:
        if k not in LEVELS:
            return None
        lvl = LEVELS.index(k)
        for j in range(lvl, 4):
            if state[j] > 0:
                out = list(state)
                out[j] -= 1
                for split in range(lvl, j):
                    out[split] += 1
                return out[0], out[1], out[2], out[3]
        return None

    def is_valid(self, state: tuple[int, int, int, int]) -> bool:
        return min(state) >= 0

    def end(self, state: tuple[int, int, int, int]) -> bool:
        return True


def _pick_block(
    nodes: Sequence[GpuNode],
    busy: dict[str, set[int]],
    k: int,
    prefer: tuple[str, int] | None,
    need_gb: float = 0.0,
) -> tuple[GpuNode, int] | None:
    """Buddy choice of an aligned free block of size k: a block where the service is resident
    first, then one where it fits without evicting another cached service, then inside the
    smallest maximal free chunk (keeps big chunks whole); ties by node order."""
    best: tuple[tuple[int, int, int, int, int], GpuNode, int] | None = None
    for n_idx, node in enumerate(nodes):
        for start, size in node.free_blocks(busy[node.name]):
            if size < k:
                continue
            for sub in range(start, start + size, k):
                res = 0 if prefer is not None and node.resident(prefer, sub) else 1
                evicts = int(res == 1 and need_gb > 0 and node.must_evict(sub, k, need_gb))
                score = (res, evicts, size, n_idx, sub)
                if best is None or score < best[0]:
                    best = (score, node, sub)
    return None if best is None else (best[1], best[2])


class _GpuScratch:
    def __init__(self, mgr: GpuManager) -> None:
        self._mgr = mgr
        self.busy = {n.name: set(n.busy) for n in mgr.nodes}
        self.base = chunk_counts(mgr.nodes, self.busy)
        self.mig_free: dict[str, int] = {}
        for n in mgr.nodes:
            for s in n.slices:
                if not s.busy:
                    self.mig_free[s.profile] = self.mig_free.get(s.profile, 0) + 1
        self.base_mig = dict(self.mig_free)

    def try_take(self, action: Action, units: int) -> bool:
        if action.mig_profile is not None:
            if units != 1 or self.mig_free.get(action.mig_profile, 0) < 1:
                return False
            self.mig_free[action.mig_profile] -= 1
            return True
        if units not in LEVELS or not self._mgr.fits_memory(action, units):
            return False
        picked = _pick_block(self._mgr.nodes, self.busy, units, None)
        if picked is None:
            return False
        node, start = picked
        self.busy[node.name] |= set(node.members(start, units))
        return True

    def partitions(self, actions: Sequence[Action]) -> list[Partition]:
        whole = [a for a in actions if a.mig_profile is None]
        parts: list[Partition] = []
        if whole:
            free = self.base[0] + 2 * self.base[1] + 4 * self.base[2] + 8 * self.base[3]
            parts.append(Partition(BuddyOperator(self.base), whole, free))
        profiles = sorted({a.mig_profile for a in actions if a.mig_profile is not None})
        for p in profiles:
            acts = [a for a in actions if a.mig_profile == p]
            parts.append(Partition(CountOperator(self.base_mig.get(p, 0)), acts, self.base_mig.get(p, 0)))
        return parts


class GpuManager:
    """GPUs of every node in the reward pool, with the service cache of each GPU."""

    def __init__(
        self,
        nodes: Sequence[GpuNode],
        pool: str = "gpu",
        restore_gbps: float = 20.0,
        memory_headroom: float = 1.2,
    ) -> None:
        self.nodes = list(nodes)
        if len({n.name for n in self.nodes}) != len(self.nodes):
            raise InvalidSpec("gpuNodes", "node names must be unique")
        if restore_gbps <= 0:
            raise InvalidSpec("restoreGBps", "must be > 0")
        self._pool = pool
        self.restore_gbps = restore_gbps
        self.memory_headroom = memory_headroom

    @property
    def pool(self) -> str:
        return self._pool

    def total_units(self) -> int:
        return sum(n.gpus - len(n.mig) for n in self.nodes) + sum(len(n.slices) for n in self.nodes)

    def free_units(self) -> int:
        whole = sum(n.gpus - len(n.mig) - len(n.busy) for n in self.nodes)
        return whole + sum(1 for n in self.nodes for s in n.slices if not s.busy)

    def per_gpu_gb(self, action: Action, k: int) -> float:
        return action.service_gb * self.memory_headroom / k

    def fits_memory(self, action: Action, k: int) -> bool:
        return all(self.per_gpu_gb(action, k) <= n.memory_gb for n in self.nodes)

    def scratch(self) -> _GpuScratch:
        return _GpuScratch(self)

    def can_ever_fit(self, action: Action) -> bool:
        if action.mig_profile is not None:
            return any(s.profile == action.mig_profile for n in self.nodes for s in n.slices)
        empty = {n.name: set[int]() for n in self.nodes}
        return any(
            k in LEVELS
            and self.fits_memory(action, k)
            and _pick_block(self.nodes, empty, k, None) is not None
            for k in action.feasible
        )

    def restore_estimate(self, action: Action, k: int) -> float:
        """Seconds to make the service resident on a free chunk of size k (0 when one holds it)."""
        if action.service is None or action.mig_profile is not None:
            return 0.0
        key = (action.service, k)
        for node in self.nodes:
            for start, size in node.free_blocks():
                if size >= k and any(node.resident(key, s) for s in range(start, start + size, k)):
                    return 0.0
        return action.service_gb / self.restore_gbps

    def place(self, action: Action, units: int, now: float, plan: Scratch | None = None) -> Grant | None:
        if action.mig_profile is not None:
            for node in self.nodes:
                for s in node.slices:
                    if not s.busy and s.profile == action.mig_profile and units == 1:
                        s.busy = True
                        return Grant(action, 1, now, node.name, (s.gpu,), extra={"mig": f"{s.gpu}:{s.index}"})
            return None
        if units not in LEVELS or not self.fits_memory(action, units):
            return None
        busy = {n.name: n.busy for n in self.nodes}
        key = None if action.service is None else (action.service, units)
        picked = _pick_block(self.nodes, busy, units, key, self.per_gpu_gb(action, units))
        if picked is None:
            return None
        node, start = picked
        members = node.members(start, units)
        node.busy |= set(members)
        restore = 0.0
        if key is not None:
            ck: CacheKey = (key[0], key[1], node.name, start)
            if node.resident(key, start):
                for g in members:
                    node.cache[g].move_to_end(ck)
            else:
                need = self.per_gpu_gb(action, units)
                for g in members:
                    while node.memory_gb - sum(node.cache[g].values()) < need - 1e-9 and node.cache[g]:
                        victim = next(iter(node.cache[g]))  # least recently used
                        self._evict(node, victim)
                for g in members:
                    node.cache[g][ck] = need
                restore = action.service_gb / self.restore_gbps
        return Grant(
            action,
            units,
            now,
            node.name,
            tuple(sorted(members)),
            restore_s=restore,
            extra={"block": str(start)},
        )

    def _evict(self, node: GpuNode, victim: CacheKey) -> None:
        _, tp, _, start = victim
        for g in node.members(start, tp):
            node.cache[g].pop(victim, None)

    def release(self, grant: Grant, now: float) -> None:
        node = next(n for n in self.nodes if n.name == grant.host)
        if "mig" in grant.extra:
            gpu, idx = (int(x) for x in grant.extra["mig"].split(":"))
            for s in node.slices:
                if s.gpu == gpu and s.index == idx:
                    if not s.busy:
                        raise ValueError(f"MIG slice {gpu}:{idx} on {node.name} released twice")
                    s.busy = False
                    return
            raise ValueError(f"no MIG slice {gpu}:{idx} on {node.name}")
        if not set(grant.unit_ids) <= node.busy:
            raise ValueError(f"GPUs {grant.unit_ids} on {node.name} released but not busy")
        node.busy -= set(grant.unit_ids)

    def next_wakeup(self, now: float) -> float | None:
        return None

    def add_node(self, node: GpuNode) -> None:
        """Add a GPU node (the planner scaled up)."""
        if any(n.name == node.name for n in self.nodes):
            raise InvalidSpec("gpuNode", f"node {node.name} already exists")
        self.nodes.append(node)

    def remove_node(self, name: str) -> None:
        """Remove a node with nothing running on it; refuses otherwise (drain first)."""
        node = next(n for n in self.nodes if n.name == name)
        if node.busy or any(s.busy for s in node.slices):
            raise ValueError(f"GPU node {name} still runs actions")
        self.nodes.remove(node)
