"""Allocation of free units among admitted actions, minimising their summed durations.

``dp_arrange`` is the paper's DPArrange: a knapsack-style DP whose state space each resource manager
defines through its DP operator. ``greedy_arrange`` is ours: when every duration is convex and
non-increasing in m and the feasible sets are contiguous ranges sharing one capacity, handing out
one unit at a time to the largest marginal gain is exactly optimal (separable convex resource
allocation), and costs O(free log n) instead of O(n * free * |K|).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import Any

from arl_tangram.core.action import Action
from arl_tangram.core.pool import DPOperator


def dp_arrange(actions: Sequence[Action], op: DPOperator[Any]) -> tuple[float, list[int]] | None:
    """Least summed estimated duration and the units per action, or None if no allocation is valid.

    ``dp[i][state]`` is the least summed duration of the first i actions ending in ``state``;
    transitions take each k of action i's feasible set through ``op.prev``.
    """
    start = op.start()
    if not op.is_valid(start):
        return None
    layer: dict[Hashable, float] = {start: 0.0}
    back: list[dict[Hashable, tuple[Hashable, int]]] = []
    for action in actions:
        durations = [(k, action.model.duration(k)) for k in action.feasible]
        nxt: dict[Hashable, float] = {}
        choice: dict[Hashable, tuple[Hashable, int]] = {}
        for state, cost in layer.items():
            for k, d in durations:
                after = op.prev(state, k)
                if after is None or not op.is_valid(after):
                    continue
                total = cost + d
                old = nxt.get(after)
                if old is None or total < old - 1e-12:
                    nxt[after] = total
                    choice[after] = (state, k)
        if not nxt:
            return None
        layer = nxt
        back.append(choice)
    finals = [(cost, repr(state), state) for state, cost in layer.items() if op.end(state)]
    if not finals:
        return None
    best_cost, _, state = min(finals, key=lambda t: (t[0], t[1]))
    units: list[int] = []
    for choice in reversed(back):
        prev_state, k = choice[state]
        units.append(k)
        state = prev_state
    units.reverse()
    return best_cost, units


def is_contiguous(feasible: Sequence[int]) -> bool:
    """True when a feasible set is a range with no holes (so one unit at a time is always valid)."""
    return feasible[-1] - feasible[0] + 1 == len(feasible)


def greedy_arrange(
    actions: Sequence[Action], free_units: int, hold_cost: float = 0.0
) -> tuple[float, list[int]] | None:
    """Marginal-gain allocation of ``free_units`` over actions with contiguous feasible ranges.

    Starts everyone at the minimum and repeatedly gives one unit to the action whose cost drops
    most, while some cost still drops. An action's cost with m units is its duration plus what
    holding the units costs the queue behind it, ``hold_cost * m * dur(m)`` (each waiting action
    delayed by the unit-seconds placed ahead of it over the pool's units: ``hold_cost`` is the
    number waiting over the units). With ``hold_cost`` 0 it is the summed duration, exactly
    optimal for convex non-increasing durations (see the module docstring); ``m * dur(m)`` is
    convex for Amdahl's law, so the greedy stays exact for the priced cost. Returns the summed
    durations and the units.
    """
    units = [a.min_units for a in actions]
    left = free_units - sum(units)
    if left < 0:
        return None

    def gain(a: Action, m: int) -> float:
        d0, d1 = a.model.duration(m), a.model.duration(m + 1)
        return d0 - d1 - hold_cost * ((m + 1) * d1 - m * d0)

    heap: list[tuple[float, int]] = []
    for i, a in enumerate(actions):
        if units[i] < a.feasible[-1]:
            g = gain(a, units[i])
            if g > 1e-12:
                heap.append((-g, i))
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        units[i] += 1
        left -= 1
        a = actions[i]
        if units[i] < a.feasible[-1]:
            g = gain(a, units[i])
            if g > 1e-12:
                heapq.heappush(heap, (-g, i))
    return sum(a.model.duration(u) for a, u in zip(actions, units, strict=True)), units
