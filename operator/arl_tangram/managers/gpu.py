"""GPU manager (evict-on-execution): aligned buddy chunks, NVLink-aware, MIG slices, LRU service cache.

Each node's GPUs are cut into aligned chunks of 1, 2, 4, 8 (buddy-style). When the NVLink matrix is
not all-to-all the GPUs are first ordered so that aligned blocks are NVLink cliques wherever the
topology allows, and a block that is not a clique is never handed out whole. GPUs in MIG mode leave
the buddy tree and serve their MIG instances as sub-GPU units, one action per instance. Every
service (a model at one tensor-parallel size) may be cached on many chunks; an action prefers a
free chunk where its service is resident, otherwise the service is restored from host memory,
evicting least recently used services on those GPUs until it fits. At most one action per GPU.

``GpuNode.from_inventory`` builds a node from what the node agent publishes (``arl_tangram.gpu``): the
NVLink matrix, the MIG instances with their UUIDs, and the GPU UUIDs, which grants carry in
``extra["uuids"]`` so that the reward runtime is handed exactly those devices.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Grant, Partition, PlacementOption, Scratch
from arl_tangram.errors import InvalidSpec
from arl_tangram.gpu.inventory import NodeInventory
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
    uuid: str = ""


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
    reserved: set[int] = field(default_factory=set)  # GPUs of the node outside this pool
    uuids: list[str] = field(default_factory=list)  # GPU UUIDs by index (empty: unknown)
    mig_uuids: dict[int, list[str]] = field(default_factory=dict)  # MIG instance UUIDs, as ``mig``

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
        for g in self.reserved:
            if not 0 <= g < self.gpus or g in self.mig:
                raise InvalidSpec(f"gpuNode[{self.name}].reserved", f"GPU {g} is not a whole GPU of the node")
        if self.uuids and len(self.uuids) != self.gpus:
            raise InvalidSpec(f"gpuNode[{self.name}].uuids", f"must list {self.gpus} UUIDs, one per GPU")
        for g, ids in self.mig_uuids.items():
            if len(ids) != len(self.mig.get(g, ())):
                raise InvalidSpec(f"gpuNode[{self.name}].migUuids", f"GPU {g}: one UUID per MIG instance")
        self.order = nvlink_order(self.gpus, self.nvlink)
        self.slices = [
            MigSlice(g, i, p, uuid=self.mig_uuids[g][i] if g in self.mig_uuids else "")
            for g, profiles in sorted(self.mig.items())
            for i, p in enumerate(profiles)
        ]
        self.cache = {g: OrderedDict() for g in range(self.gpus)}
        # Every aligned block's GPU bitmask and whether it may be handed out whole (computed once).
        self._mig_mask = sum(1 << g for g in self.mig) | sum(1 << g for g in self.reserved)
        self._blocks: dict[tuple[int, int], tuple[int, bool]] = {}
        size = self.gpus
        while size >= 1:
            for start in range(0, self.gpus, size):
                mask = sum(1 << g for g in self.members(start, size))
                self._blocks[(start, size)] = (mask, self.allocatable(start, size))
            size //= 2

    @classmethod
    def from_inventory(
        cls, inv: NodeInventory, name: str | None = None, reserved: Sequence[int] = ()
    ) -> GpuNode:
        """A node from a published inventory: MIG-mode GPUs serve their instances; the others are
        cut into chunks along the NVLink matrix. A GPU count that is not 1, 2, 4 or 8 is padded to
        the next one with GPUs that never leave ``reserved`` (aligned chunks need a power of two)."""
        n = len(inv.gpus)
        if n == 0 or n > LEVELS[-1]:
            raise InvalidSpec(f"gpuNode[{inv.node}]", f"needs 1 to {LEVELS[-1]} GPUs, the inventory has {n}")
        size = next(level for level in LEVELS if level >= n)
        whole = [g for g in inv.gpus if not g.mig_enabled] or list(inv.gpus)
        links = inv.link_matrix()
        nvlink = (
            None
            if inv.all_to_all
            else [[a < n and b < n and links[a][b] for b in range(size)] for a in range(size)]
        )
        mig = {g.index: [m.profile for m in g.mig_instances] for g in inv.gpus if g.mig_enabled}
        return cls(
            name or inv.node,
            size,
            memory_gb=min(g.memory_gib for g in whole),
            nvlink=nvlink,
            mig=mig,
            reserved=set(reserved) | set(range(n, size)),
            uuids=[g.uuid for g in inv.gpus] + [""] * (size - n),
            mig_uuids={g.index: [m.uuid for m in g.mig_instances] for g in inv.gpus if g.mig_enabled},
        )

    def uuids_of(self, members: Sequence[int]) -> str:
        """Comma-separated UUIDs of GPUs ``members`` ("" when the node's UUIDs are unknown)."""
        return ",".join(self.uuids[g] for g in members) if self.uuids else ""

    def members(self, start: int, size: int) -> list[int]:
        """Physical GPU ids of the aligned block at ``start`` positions of ``size``."""
        return self.order[start : start + size]

    def allocatable(self, start: int, size: int) -> bool:
        members = self.members(start, size)
        out = self.mig.keys() | self.reserved
        return not any(g in out for g in members) and _clique(members, self.nvlink)

    def block_free(self, start: int, size: int, busy: set[int]) -> bool:
        return not any(g in busy or g in self.mig or g in self.reserved for g in self.members(start, size))

    @property
    def pool_gpus(self) -> int:
        """Whole GPUs of this node in the pool (not MIG, not reserved)."""
        return self.gpus - len(self.mig) - len(self.reserved)

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


def _pick_any_block(nodes: Sequence[GpuNode], k: int, need_gb: float = 0.0) -> tuple[GpuNode, int] | None:
    """The first aligned block of size k whose GPUs are all free whole GPUs of the pool, whether or
    not they form an NVLink clique, on a node whose GPUs hold ``need_gb`` each. Only whole blocks:
    a block past the node's last GPU is short (``members`` slices), and a TP size over a node's
    GPUs was granted the node's few as if they were k."""
    for node in nodes:
        if node.draining or need_gb > node.memory_gb:
            continue
        for start in range(0, node.gpus - k + 1, k):
            if node.block_free(start, k, node.busy):
                return node, start
    return None


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
        picked = _pick_block(self._mgr.holding(action, units), self.busy, units, None)
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


VictimRank = Callable[[CacheKey, int], tuple[float, int]]


def _lru_rank(ck: CacheKey, position: int) -> tuple[float, int]:
    """The paper's order: least recently used first."""
    return 0.0, position


def _victims(node: GpuNode, members: Sequence[int], need_gb: float, rank: VictimRank) -> list[CacheKey]:
    """Cached services to evict, in order, so that ``need_gb`` fits on every GPU of ``members``;
    on each GPU short of memory the entries are taken by ``rank`` (of the entry and its LRU
    position). Evicting an entry frees it on every GPU of its block."""
    free = {g: node.memory_gb - sum(node.cache[g].values()) for g in members}
    gone: set[CacheKey] = set()
    out: list[CacheKey] = []
    for g in members:
        if free[g] >= need_gb - 1e-9:
            continue
        entries = sorted((rank(ck, i), i, ck) for i, ck in enumerate(node.cache[g]) if ck not in gone)
        for _, _, ck in entries:
            if free[g] >= need_gb - 1e-9:
                break
            gone.add(ck)
            out.append(ck)
            for h in node.members(ck[3], ck[1]):
                if h in free:
                    free[h] += node.cache[h].get(ck, 0.0)
    return out


class GpuPlan(_GpuScratch):
    """A decision's residency-aware view of the GPUs (``tangram``): for each action the best free
    block per TP size (resident first, then the least costly restore, counting what it evicts)
    and the earliest busy block per TP size that already holds the service. Evicting a cached
    service costs its restore time weighted by its ``heat`` (expected demand: 0..1, above 1 while
    requests wait for it); victims are
    taken coldest first, then least recently used."""

    def __init__(
        self,
        mgr: GpuManager,
        now: float,
        heat: Mapping[str, float],
        busy_until: Mapping[tuple[str, int], float],
    ) -> None:
        super().__init__(mgr)
        self.now = now
        self.heat = heat
        self.until = dict(busy_until)
        self.choice: dict[int, tuple[str, int, int]] = {}
        self._nodes = {n.name: n for n in mgr.nodes}
        # Resident copies per (service, tp): (node, block start), on free and busy blocks alike.
        self.copies: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for node in mgr.nodes:
            if node.draining:
                continue
            for g, cache in node.cache.items():
                for ck in cache:
                    svc, tp, _, start = ck
                    if node.members(start, tp)[0] == g and node.resident((svc, tp), start):
                        self.copies.setdefault((svc, tp), []).append((node.name, start))

    def restore_s_of(self, ck: CacheKey, node: GpuNode) -> float:
        """Seconds to restore the cached entry ``ck`` again (its whole weights over the bandwidth)."""
        per_gpu = node.cache[node.members(ck[3], ck[1])[0]].get(ck, 0.0)
        return per_gpu * ck[1] / self._mgr.memory_headroom / self._mgr.restore_gbps

    def rank(self, ck: CacheKey, position: int) -> tuple[float, int]:
        """Victim order: the coldest service first, then least recently used."""
        return self.heat.get(ck[0], 0.0), position

    def _penalty(self, node: GpuNode, victims: Sequence[CacheKey], service: str | None) -> float:
        # A copy of the service being restored costs nothing to evict: its requests will have the
        # new copy (only its TP size changes).
        return sum(
            self.heat.get(ck[0], 0.0) * self.restore_s_of(ck, node) for ck in victims if ck[0] != service
        )

    def options(self, action: Action) -> list[PlacementOption]:
        now = self.now
        if action.mig_profile is not None:
            if self.mig_free.get(action.mig_profile, 0) < 1 or 1 not in action.feasible:
                return []
            return [PlacementOption(1, now, 0.0, 0.0, ("", -1))]
        mgr = self._mgr
        svc = action.service
        out: list[PlacementOption] = []
        for k in action.feasible:
            if k not in LEVELS or not mgr.fits_memory(action, k):
                continue
            need = mgr.per_gpu_gb(action, k)
            restore = 0.0 if svc is None else action.service_gb / mgr.restore_gbps
            best: tuple[tuple[float, int, int, int, int], PlacementOption] | None = None
            for n_idx, node in enumerate(mgr.nodes):
                if need > node.memory_gb:
                    continue  # its GPUs cannot hold the service at this size (``fits_memory``)
                for start, size in node.free_blocks(self.busy[node.name]):
                    if size < k:
                        continue
                    for sub in range(start, start + size, k):
                        if svc is not None and node.resident((svc, k), sub):
                            opt = PlacementOption(k, now, 0.0, 0.0, (node.name, sub))
                            score = (0.0, 0, size, n_idx, sub)
                        else:
                            victims = _victims(node, node.members(sub, k), need, self.rank)
                            pen = self._penalty(node, victims, svc)
                            other = any(ck[0] != svc for ck in victims)
                            opt = PlacementOption(k, now, restore, pen, (node.name, sub), other)
                            score = (restore + pen, int(bool(victims)), size, n_idx, sub)
                        if best is None or score < best[0]:
                            best = (score, opt)
            if best is not None:
                out.append(best[1])
            if svc is None:
                continue
            warm: PlacementOption | None = None
            for name, start in self.copies.get((svc, k), ()):
                node = self._nodes[name]
                members = node.members(start, k)
                busy = self.busy[name]
                if all(g not in busy for g in members):
                    continue  # a free resident block: offered above
                ready = max(self.until.get((name, g), now) for g in members)
                if warm is None or ready < warm.ready_at:
                    # Busy now, whatever the estimate says (a running action may overrun it).
                    warm = PlacementOption(k, max(ready, now + 1e-6), 0.0, 0.0, (name, start))
            if warm is not None:
                out.append(warm)
        return out

    def has_free(self) -> bool:
        if any(v > 0 for v in self.mig_free.values()):
            return True
        return any(len(self.busy[n.name]) < n.pool_gpus for n in self._mgr.nodes if not n.draining)

    def take(self, action: Action, option: PlacementOption, end: float) -> None:
        if action.mig_profile is not None:
            self.mig_free[action.mig_profile] -= 1
            return
        name, start = option.ref
        node = self._nodes[name]
        members = node.members(start, option.units)
        busy = self.busy[name]
        if option.ready_at <= self.now and not any(g in busy for g in members):
            busy |= set(members)
            self.choice[id(action)] = (name, start, option.units)
            if option.restore_s > 0 and action.service is not None:
                # Resident once restored: later actions of the service may wait for this block.
                self.copies.setdefault((action.service, option.units), []).append((name, start))
        for g in members:
            self.until[(name, g)] = end


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
        return sum(n.pool_gpus for n in self.nodes) + sum(len(n.slices) for n in self.nodes)

    def free_units(self) -> int:
        whole = sum(n.pool_gpus - len(n.busy) for n in self.nodes)
        return whole + sum(1 for n in self.nodes for s in n.slices if not s.busy)

    def per_gpu_gb(self, action: Action, k: int) -> float:
        return action.service_gb * self.memory_headroom / k

    def fits_memory(self, action: Action, k: int) -> bool:
        """Whether some node's GPUs hold ``action``'s service at size ``k`` (each placement then
        takes only such nodes: ``holding``). It asked every node: in a cluster of 80 GB and 40 GB
        GPUs, a service needing 60 GB a GPU was placed on neither, and waited for good."""
        return any(self.per_gpu_gb(action, k) <= n.memory_gb for n in self.nodes)

    def holding(self, action: Action, k: int) -> list[GpuNode]:
        """The nodes whose GPUs hold ``action``'s service at size ``k``, in node order."""
        need = self.per_gpu_gb(action, k)
        return [n for n in self.nodes if need <= n.memory_gb]

    def scratch(self) -> _GpuScratch:
        return _GpuScratch(self)

    def can_ever_fit(self, action: Action) -> bool:
        if action.mig_profile is not None:
            return any(s.profile == action.mig_profile for n in self.nodes for s in n.slices)
        empty = {n.name: set[int]() for n in self.nodes}
        return any(
            k in LEVELS and _pick_block(self.holding(action, k), empty, k, None) is not None
            for k in action.feasible
        )

    def residency_plan(
        self, now: float, heat: Mapping[str, float], busy_until: Mapping[tuple[str, int], float]
    ) -> GpuPlan:
        """A residency-aware view for one decision (see ``GpuPlan``)."""
        return GpuPlan(self, now, heat, busy_until)

    def prewarm(
        self, services: Mapping[str, tuple[float, Sequence[int]]], only: GpuNode | None = None
    ) -> list[CacheKey]:
        """Restore declared services into free GPU memory before any request, as the reward runtime
        does when it starts (``rewards.runtime``: what fits without evicting another service is
        restored ahead of its requests). ``services``: name -> (weights in GB, feasible TP sizes).

        The largest services go first (they are the hardest to fit), each at its widest TP size
        that fits without evicting: a wide copy serves a request soonest, and the scheduler makes
        narrower copies when requests contend for its GPUs. Among blocks of that size the one
        with the most memory left is taken (then the node with the most), so copies share GPUs
        only once every block holds one. A service that fits nowhere stays in host memory only.
        Why widest rather than each service on GPUs of its own, as ``static`` has them: on the
        built-in ``reward-gpu`` (ten bursty services, rarely two on at once) own 4-GPU blocks gave
        tangram 0.400 / 1.804 s mean / p99 against 0.374 / 1.547 s. ``only``: a node just added
        (the planner scaled up), whose runtimes pre-warm as they start. Returns the copies made."""
        made: list[CacheKey] = []
        nodes = self.nodes if only is None else [only]
        for name in sorted(services, key=lambda n: -services[n][0]):
            gb, feasible = services[name]
            for k in sorted((k for k in feasible if k in LEVELS), reverse=True):
                need = gb * self.memory_headroom / k
                spot = self._prewarm_block([n for n in nodes if need <= n.memory_gb], k, need)
                if spot is not None:
                    node, start = spot
                    ck: CacheKey = (name, k, node.name, start)
                    for g in node.members(start, k):
                        node.cache[g][ck] = need
                    made.append(ck)
                    break
        return made

    @staticmethod
    def _prewarm_block(nodes: Sequence[GpuNode], k: int, need: float) -> tuple[GpuNode, int] | None:
        """The block of ``k`` GPUs of ``nodes`` with the most memory left that holds ``need`` GB per
        GPU without evicting (then the node with the most left); None if there is none."""
        best: tuple[tuple[float, float], GpuNode, int] | None = None
        for node in nodes:
            if node.draining or k > node.gpus:
                continue
            out = node.mig.keys() | node.reserved
            spare = sum(node.memory_gb - sum(c.values()) for g, c in node.cache.items() if g not in out)
            for start in range(0, node.gpus, k):
                if not node.allocatable(start, k) or node.must_evict(start, k, need):
                    continue
                members = node.members(start, k)
                left = min(node.memory_gb - sum(node.cache[g].values()) for g in members)
                if best is None or (left, spare) > best[0]:
                    best = ((left, spare), node, start)
        return None if best is None else (best[1], best[2])

    def place(
        self, action: Action, units: int, now: float, plan: Scratch | None = None, across_pcie: bool = False
    ) -> Grant | None:
        """Grant ``units`` GPUs (or one MIG slice) to ``action``, or None. ``across_pcie``: when no
        NVLink clique of that size is free, take an aligned block that is not one (a service whose
        NVLink need is Preferred or None); its GPUs are still the most linked ones (``nvlink_order``)."""
        if action.mig_profile is not None:
            for node in self.nodes:
                for s in node.slices:
                    if not s.busy and s.profile == action.mig_profile and units == 1:
                        s.busy = True
                        extra = {"mig": f"{s.gpu}:{s.index}"}
                        if s.uuid:
                            extra["uuids"] = s.uuid
                        return Grant(action, 1, now, node.name, (s.gpu,), extra=extra)
            return None
        if units not in LEVELS or not self.fits_memory(action, units):
            return None
        busy = {n.name: n.busy for n in self.nodes}
        key = None if action.service is None else (action.service, units)
        rank: VictimRank = _lru_rank
        picked: tuple[GpuNode, int] | None = None
        if isinstance(plan, GpuPlan):
            rank = plan.rank
            chosen = plan.choice.get(id(action))
            if chosen is not None and chosen[2] == units:
                node = next(n for n in self.nodes if n.name == chosen[0])
                if node.block_free(chosen[1], units, node.busy) and not node.draining:
                    picked = (node, chosen[1])
        if picked is None:
            picked = _pick_block(
                self.holding(action, units), busy, units, key, self.per_gpu_gb(action, units)
            )
        if picked is None and across_pcie:
            picked = _pick_any_block(self.nodes, units, self.per_gpu_gb(action, units))
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
                for victim in _victims(node, members, need, rank):
                    self._evict(node, victim)
                for g in members:
                    node.cache[g][ck] = need
                restore = action.service_gb / self.restore_gbps
        extra = {"block": str(start)}
        if node.uuids:
            extra["uuids"] = node.uuids_of(sorted(members))
        return Grant(
            action,
            units,
            now,
            node.name,
            tuple(sorted(members)),
            restore_s=restore,
            extra=extra,
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
