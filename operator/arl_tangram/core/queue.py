"""The unified action queue: every waiting action of every pool, in arrival order.

Two views of the same actions: per pool in global FCFS order (what the paper's algorithm scans) and
per (pool, priority class, tenant) FIFO lanes (what fair share and priorities pick heads from).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator

from arl_tangram.core.action import Action

Lane = tuple[int, str]  # (priority class, tenant)


class ActionQueue:
    """Waiting actions. Push is O(1); removing a lane's head is O(1)."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._fcfs: dict[str, OrderedDict[int, Action]] = {}
        self._lanes: dict[str, dict[Lane, deque[Action]]] = {}

    def push(self, action: Action) -> None:
        """Enqueue at the tail of its pool and lane; stamps ``action.seq`` (arrival order)."""
        action.seq = next(self._seq)
        self._fcfs.setdefault(action.pool, OrderedDict())[action.seq] = action
        lanes = self._lanes.setdefault(action.pool, {})
        lanes.setdefault((action.priority, action.tenant), deque()).append(action)

    def remove(self, action: Action) -> None:
        """Take an action out (it was admitted)."""
        del self._fcfs[action.pool][action.seq]
        lanes = self._lanes[action.pool]
        key = (action.priority, action.tenant)
        lane = lanes[key]
        if lane and lane[0] is action:
            lane.popleft()
        else:
            lane.remove(action)
        if not lane:
            del lanes[key]

    def is_waiting(self, action: Action) -> bool:
        """Whether the action is still in the queue (not admitted, not removed)."""
        waiting = self._fcfs.get(action.pool)
        return waiting is not None and waiting.get(action.seq) is action

    def fcfs(self, pool: str) -> Iterator[Action]:
        """The pool's waiting actions in arrival order."""
        return iter(self._fcfs.get(pool, {}).values())

    def lanes(self, pool: str) -> dict[Lane, deque[Action]]:
        """The pool's non-empty lanes, each in arrival order."""
        return self._lanes.get(pool, {})

    def pools(self) -> list[str]:
        """Pools with at least one waiting action."""
        return [p for p, q in self._fcfs.items() if q]

    def __len__(self) -> int:
        return sum(len(q) for q in self._fcfs.values())

    def waiting(self, pool: str) -> int:
        return len(self._fcfs.get(pool, {}))
