"""The paper's estimated objective: summed durations of admitted actions plus a list-scheduling
simulation of the actions still waiting, on a heap of (time units become free, units)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from arl_tangram.core.action import Action

UnitHeap = list[tuple[float, int]]


def _place(heap: UnitHeap, units: int, duration: float) -> float | None:
    """Pop free times until ``units`` are gathered; the action starts at the last of them. Returns
    its start, or None when the heap holds fewer units in all."""
    got = 0
    start = -math.inf
    popped: list[tuple[float, int]] = []
    while got < units and heap:
        t, u = heapq.heappop(heap)
        popped.append((t, u))
        got += u
        start = max(start, t)
    if got < units:
        for item in popped:
            heapq.heappush(heap, item)
        return None
    heapq.heappush(heap, (start + duration, units))
    if got > units:
        heapq.heappush(heap, (start, got - units))
    return start


def list_schedule(
    heap: UnitHeap,
    waiting: Sequence[Action],
    now: float,
    depth: int,
    total_units: int | None = None,
    branch: Callable[[Action], Sequence[int]] | None = None,
) -> float:
    """Summed completion time (from now) of ``waiting`` when started in order at their minimum
    units as units free up. With ``depth`` d > 1 the first waiting action tries every feasible
    allocation (and recursively the next d - 2 ones) and the best is kept, as the paper's ``depth``.
    ``branch`` narrows the allocations tried (default: the whole feasible set)."""
    heap = list(heap)
    heapq.heapify(heap)
    cap = sum(u for _, u in heap) if total_units is None else total_units
    return _ls(heap, list(waiting), 0, now, depth, cap, branch or _all_units)


def _all_units(action: Action) -> Sequence[int]:
    return action.feasible


def _ls(
    heap: UnitHeap,
    waiting: list[Action],
    i: int,
    now: float,
    depth: int,
    cap: int,
    branch: Callable[[Action], Sequence[int]],
) -> float:
    if depth > 1 and i < len(waiting):
        action = waiting[i]
        best = math.inf
        for k in branch(action):
            if k > cap:
                break
            trial = list(heap)
            d = action.model.duration(k)
            start = _place(trial, k, d)
            if start is None:
                continue
            cost = start - now + d + _ls(trial, waiting, i + 1, now, depth - 1, cap, branch)
            best = min(best, cost)
        return best
    total = 0.0
    for action in waiting[i:]:
        d = action.model.duration(action.min_units)
        start = _place(heap, action.min_units, d)
        if start is None:
            return math.inf
        total += start - now + d
    return total
