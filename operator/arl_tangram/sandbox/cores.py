"""Exclusive cores per action on one sandbox host.

The operator's scheduler normally sends the grant with the request (``cores: [2, 3]``); the agent then
only checks that the cores are its own and waits, should the previous holder not have released them
yet. A request without a grant (``/run_code`` from a trainer) asks for a number of cores and gets the
first free ones, first come first served.
"""

from __future__ import annotations

import asyncio
from collections import deque

from arl_tangram.errors import CapacityExceeded, InvalidSpec


class CoreAllocator:
    """Hands out disjoint core sets; waiters are served in arrival order."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = list(cores)
        self.free: set[int] = set(cores)
        self._waiters: deque[tuple[int | frozenset[int], asyncio.Future[list[int]]]] = deque()

    @property
    def busy(self) -> int:
        """Cores held by running actions."""
        return len(self.cores) - len(self.free)

    def _check(self, want: int | frozenset[int]) -> None:
        if isinstance(want, int):
            if want < 1:
                raise InvalidSpec("ncores", "must be at least 1")
            if want > len(self.cores):
                raise CapacityExceeded(f"ncores={want} but this host has {len(self.cores)} cores")
        else:
            foreign = want - set(self.cores)
            if not want:
                raise InvalidSpec("cores", "must name at least one core")
            if foreign:
                raise InvalidSpec("cores", f"cores {sorted(foreign)} do not belong to this host {self.cores}")

    def _take(self, want: int | frozenset[int]) -> list[int] | None:
        if isinstance(want, int):
            if len(self.free) < want:
                return None
            got = sorted(self.free)[:want]
        else:
            if not want <= self.free:
                return None
            got = sorted(want)
        self.free.difference_update(got)
        return got

    async def acquire(self, want: int | frozenset[int]) -> list[int]:
        """Wait for, and take, ``want`` cores (a count, or exactly this set)."""
        self._check(want)
        if not self._waiters:
            got = self._take(want)
            if got is not None:
                return got
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters.append((want, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            else:
                self._waiters = deque(w for w in self._waiters if w[1] is not fut)
            raise

    def release(self, cores: list[int]) -> None:
        """Give cores back and wake whoever can now run."""
        self.free.update(cores)
        while self._waiters:
            want, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            got = self._take(want)
            if got is None:
                break
            self._waiters.popleft()
            fut.set_result(got)
