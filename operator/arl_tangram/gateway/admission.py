"""Bounded waiting at the gateway, per pool and per tenant (namespace).

The dispatcher bounds its own queue (and raises QueueFull); this bound is in front of it and
counts every action the gateway holds, waiting or running, so that one tenant flooding the gateway
is answered 429 with Retry-After instead of filling the operator's memory. The scheduler's
weighted fair share decides the order among what is admitted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from arl_tangram.errors import QueueFull


class Admission:
    """Counts of held actions per pool and per tenant, each with its bound."""

    def __init__(self, per_pool: int, per_tenant: int, retry_after_s: float) -> None:
        self.per_pool = per_pool
        self.per_tenant = per_tenant
        self.retry_after_s = retry_after_s
        self.pools: dict[str, int] = {}
        self.tenants: dict[str, int] = {}

    @contextmanager
    def hold(self, pool: str, tenant: str) -> Iterator[None]:
        """Hold one slot of ``pool`` and of ``tenant`` for the body; QueueFull when either is full."""
        held_pool, held_tenant = self.pools.get(pool, 0), self.tenants.get(tenant, 0)
        if held_pool >= self.per_pool:
            raise QueueFull(
                f"pool {pool} has {held_pool} actions in the gateway (limit {self.per_pool})",
                self.retry_after_s,
            )
        if held_tenant >= self.per_tenant:
            raise QueueFull(
                f"tenant {tenant} has {held_tenant} actions in the gateway (limit {self.per_tenant})",
                self.retry_after_s,
            )
        self.pools[pool] = held_pool + 1
        self.tenants[tenant] = held_tenant + 1
        try:
            yield
        finally:
            self._release(self.pools, pool)
            self._release(self.tenants, tenant)

    @staticmethod
    def _release(counts: dict[str, int], name: str) -> None:
        left = counts[name] - 1
        if left:
            counts[name] = left
        else:
            del counts[name]  # names come and go; the maps must not grow with every name ever seen


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds; never 0, which some clients read as 'now, in a loop'."""
    return str(max(1, math.ceil(seconds)))
