"""``paper``: the algorithm of ARL-Tangram's paper, faithfully, and ``fcfs-min`` (no elasticity).

Per pool (the key elastic resource), at each invocation:
1. candidates = the longest FCFS prefix that fits with every action at its minimum units;
2. a pool whose candidates have no known elasticity admits them all at the minimum;
3. otherwise greedy eviction: estimate the objective with all candidates, then evicting the last
   t = 1, 2, ... back to the queue; stop at the first t that does not lower it; admit the rest with
   the units DPArrange gave them.
The estimate is DPArrange over the admitted (summed durations, giving finish times) plus a
list-scheduling simulation of every waiting action on the heap of finish times, with ``depth``.
Queueing is per pool: an action waiting for GPUs never holds back one waiting for CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from arl_tangram.core.action import Action
from arl_tangram.core.dparrange import dp_arrange
from arl_tangram.core.estimate import UnitHeap, list_schedule
from arl_tangram.core.pool import Grant, PoolManager, Scratch
from arl_tangram.core.scheduler import Scheduler


class FcfsMinPolicy(Scheduler):
    """FCFS on the shared pools, every action at its minimum units."""

    name = "fcfs-min"

    def _prefix(self, mgr: PoolManager, pool: str) -> tuple[Scratch, list[Action], list[Action]]:
        """The candidates (longest prefix fitting at minimum units) and the rest, in FCFS order."""
        scratch = mgr.scratch()
        queue = list(self.queue.fcfs(pool))
        n = 0
        for action in queue:
            if not scratch.try_take(action, action.min_units):
                break
            n += 1
        return scratch, queue[:n], queue[n:]

    def _decide(self, now: float) -> list[Grant]:
        grants: list[Grant] = []
        for pool in self.queue.pools():
            mgr = self.pools[pool]
            scratch, cands, _ = self._prefix(mgr, pool)
            grants += self._commit(mgr, [(a, a.min_units) for a in cands], now, scratch)
        return grants


class PaperPolicy(FcfsMinPolicy):
    """The paper's scheduling algorithm (see the module docstring)."""

    name = "paper"

    def __init__(self, pools: Mapping[str, PoolManager], depth: int = 2) -> None:
        super().__init__(pools)
        self.depth = depth

    def _arrange(
        self, mgr: PoolManager, admitted: Sequence[Action]
    ) -> tuple[float, list[int], Scratch] | None:
        """DPArrange of the pool's free units over ``admitted``: (summed durations, units, scratch)."""
        scratch = mgr.scratch()
        for a in admitted:
            if not scratch.try_take(a, a.min_units):
                return None
        units_of: dict[int, int] = {}
        total = 0.0
        for part in scratch.partitions(admitted):
            res = dp_arrange(part.actions, part.operator)
            if res is None:
                return None
            total += res[0]
            for a, k in zip(part.actions, res[1], strict=True):
                units_of[id(a)] = k
        return total, [units_of[id(a)] for a in admitted], scratch

    def objective(
        self, mgr: PoolManager, admitted: Sequence[Action], waiting: Sequence[Action], now: float
    ) -> tuple[float, list[int], Scratch | None]:
        """The estimated objective of admitting ``admitted`` now (and its DPArrange units)."""
        if admitted:
            arranged = self._arrange(mgr, admitted)
            if arranged is None:
                return math.inf, [], None
            total, units, scratch = arranged
        else:
            total, units, scratch = 0.0, [], None
        heap: UnitHeap = [(g.est_end, g.units) for g in self.running.values() if g.action.pool == mgr.pool]
        used = 0
        for a, k in zip(admitted, units, strict=True):
            heap.append((now + a.model.duration(k), k))
            used += k
        left = mgr.free_units() - used
        if left > 0:
            heap.append((now, left))
        total += list_schedule(heap, waiting, now, self.depth, total_units=mgr.total_units())
        return total, units, scratch

    def _decide(self, now: float) -> list[Grant]:
        grants: list[Grant] = []
        for pool in self.queue.pools():
            mgr = self.pools[pool]
            prefix_scratch, cands, rest = self._prefix(mgr, pool)
            if not cands:
                continue
            if not any(a.elastic for a in cands):
                grants += self._commit(mgr, [(a, a.min_units) for a in cands], now, prefix_scratch)
                continue
            best, units, scratch = self.objective(mgr, cands, rest, now)
            keep = len(cands)
            for t in range(1, len(cands)):
                obj, u, s = self.objective(mgr, cands[:-t], cands[-t:] + rest, now)
                if obj >= best:
                    break
                best, units, scratch, keep = obj, u, s, len(cands) - t
            if scratch is None:  # DPArrange found nothing (cannot happen for a fitting prefix)
                units, scratch = [a.min_units for a in cands[:keep]], prefix_scratch
            grants += self._commit(mgr, list(zip(cands[:keep], units, strict=True)), now, scratch)
        return grants
