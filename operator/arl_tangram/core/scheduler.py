"""The scheduler interface every policy implements, and what the policies share.

Event-driven: the owner calls ``submit`` when an action arrives, ``complete`` when one ends, and then
``schedule`` to get the grants to start now. ``next_wakeup`` says when to call ``schedule`` again
without an event (a token bucket refilling).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Clocked, Grant, PoolManager, Scratch
from arl_tangram.core.queue import ActionQueue
from arl_tangram.errors import CapacityExceeded, InvalidSpec


@dataclass
class DecisionStats:
    """CPU time the scheduler spent per ``schedule`` call, in microseconds: every call's (a
    simulation's run), or the latest ``keep`` (a long-running dispatcher, which would otherwise
    hold one float per decision for as long as it runs)."""

    keep: int | None = None
    samples_us: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.samples_us = deque(maxlen=self.keep)


class Scheduler(ABC):
    """One scheduling policy over a set of pools."""

    name: str = "abstract"

    def __init__(self, pools: Mapping[str, PoolManager]) -> None:
        self.pools = dict(pools)
        self.queue = ActionQueue()
        self.running: dict[int, Grant] = {}
        self.stats = DecisionStats()
        # Protocol isinstance checks are slow: decide once which pools need the clock.
        self._clocked: list[Clocked] = [m for m in self.pools.values() if isinstance(m, Clocked)]

    def submit(self, action: Action, now: float, *, growing: bool = False) -> None:
        """An action arrived; it waits until ``schedule`` admits it. ``CapacityExceeded`` when its
        pool as it stands can never hold it, unless the pool is ``growing``: the operator's
        planner adds hosts for what waits (a pool may have none yet), so it waits like any other,
        counted by the policy as any other."""
        mgr = self.pools.get(action.pool)
        if mgr is None:
            raise InvalidSpec(f"action[{action.id}].pool", f"no pool named {action.pool!r}")
        if not growing and not mgr.can_ever_fit(action):
            raise CapacityExceeded(f"action {action.id} needs more than pool {action.pool!r} can ever hold")
        action.arrival = now
        self.queue.push(action)

    def withdraw(self, action: Action) -> None:
        """A waiting action leaves without running (cancelled, failed, its batch deleted): out of
        the queue, and out of whatever the policy counts of what waits."""
        self.queue.remove(action)
        self._on_withdraw(action)

    def complete(self, grant: Grant, now: float) -> None:
        """A granted action finished: its units go back to its pool."""
        self.running.pop(id(grant), None)
        self.pools[grant.action.pool].release(grant, now)
        self._on_release(grant)

    def adopt(self, grant: Grant) -> None:
        """Take over an action already running on units placed outside this scheduler (after a
        restart, or a benchmark building a busy pool); it is released by ``complete`` as usual."""
        self.running[id(grant)] = grant
        self._on_adopt(grant)

    def _on_adopt(self, grant: Grant) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook for policies keeping incremental state."""

    def _on_release(self, grant: Grant) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook for policies keeping incremental state."""

    def _on_withdraw(self, action: Action) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook for policies keeping incremental state."""

    def schedule(self, now: float) -> list[Grant]:
        """Decide which waiting actions start now and with how many units; returns their grants."""
        t0 = time.process_time_ns()
        for mgr in self._clocked:
            mgr.advance(now)
        grants = self._decide(now)
        for g in grants:
            self.running[id(g)] = g
        self.stats.samples_us.append((time.process_time_ns() - t0) / 1000.0)
        return grants

    @abstractmethod
    def _decide(self, now: float) -> list[Grant]: ...

    def queued(self) -> int:
        """Actions waiting."""
        return len(self.queue)

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time a pool with waiting actions gains capacity without a completion."""
        times = [t for p in self.queue.pools() if (t := self.pools[p].next_wakeup(now)) is not None]
        return min(times) if times else None

    def _commit(
        self,
        mgr: PoolManager,
        plan: Sequence[tuple[Action, int]],
        now: float,
        scratch: Scratch | None,
    ) -> list[Grant]:
        """Place planned (action, units) in order; an action that cannot be placed as planned gets
        its minimum, and if even that fails admission stops there so FCFS order holds."""
        grants: list[Grant] = []
        for action, units in plan:
            grant = mgr.place(action, units, now, scratch)
            if grant is None and units != action.min_units:
                grant = mgr.place(action, action.min_units, now, None)
            if grant is None:
                break
            grant.est_end = now + grant.restore_s + action.model.duration(grant.units)
            self.queue.remove(action)
            grants.append(grant)
        return grants
