"""Quota manager ("traffic control") for rate-limited external APIs.

Each API has a concurrency cap and a token bucket (``rate`` per second, ``burst`` tokens). An action
starts only when both allow it, so no call ever goes beyond a limit; when only tokens are missing,
``next_wakeup`` says when the scheduler should look again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from arl_tangram.core.action import Action
from arl_tangram.core.pool import Grant, Partition, Scratch
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.count_op import CountOperator


@dataclass
class ApiQuota:
    """Limits of one API and its live usage."""

    name: str
    concurrency: int
    rate: float
    burst: float
    in_flight: int = 0
    tokens: float = 0.0
    stamp: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise InvalidSpec(f"api[{self.name}].concurrency", "must be >= 1")
        if self.rate <= 0 or self.burst < 1:
            raise InvalidSpec(f"api[{self.name}].rate", "rate must be > 0 and burst >= 1")
        self.tokens = self.burst

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def available(self, now: float) -> int:
        """Calls that may start now."""
        self.refill(now)
        return max(0, min(self.concurrency - self.in_flight, int(self.tokens + 1e-9)))


class _QuotaScratch:
    def __init__(self, mgr: QuotaManager) -> None:
        self.left = mgr.quota.available(mgr.now)
        self.base = self.left

    def try_take(self, action: Action, units: int) -> bool:
        if units > self.left:
            return False
        self.left -= units
        return True

    def partitions(self, actions: Sequence[Action]) -> list[Partition]:
        return [Partition(CountOperator(self.base), list(actions), self.base, countable=True)]


class QuotaManager:
    """One API's quota as a pool named ``api:<name>``; one unit is one call."""

    def __init__(self, quota: ApiQuota) -> None:
        self.quota = quota
        self.now = 0.0
        self.started = 0

    @property
    def pool(self) -> str:
        return f"api:{self.quota.name}"

    def advance(self, now: float) -> None:
        """Tell the manager the time (token buckets depend on it)."""
        self.now = max(self.now, now)

    def total_units(self) -> int:
        return self.quota.concurrency

    def free_units(self) -> int:
        return self.quota.available(self.now)

    def scratch(self) -> _QuotaScratch:
        return _QuotaScratch(self)

    def can_ever_fit(self, action: Action) -> bool:
        return action.min_units <= min(self.quota.concurrency, int(self.quota.burst))

    def place(self, action: Action, units: int, now: float, plan: Scratch | None = None) -> Grant | None:
        self.advance(now)
        if units > self.quota.available(now):
            return None
        self.quota.in_flight += units
        self.quota.tokens -= units
        self.started += units
        return Grant(action, units, now, self.quota.name)

    def release(self, grant: Grant, now: float) -> None:
        if self.quota.in_flight < grant.units:
            raise ValueError(f"api {self.quota.name}: released more calls than in flight")
        self.quota.in_flight -= grant.units

    def next_wakeup(self, now: float) -> float | None:
        """When a token will be there, if tokens (not concurrency) are what blocks."""
        q = self.quota
        q.refill(now)
        if q.in_flight < q.concurrency and q.tokens < 1.0:
            return now + (1.0 - q.tokens) / q.rate
        return None
