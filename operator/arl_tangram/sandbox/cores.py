"""Exclusive cores per action on one sandbox host.

The operator's scheduler normally sends the grant with the request (``cores: [2, 3]``); the agent then
only checks that the cores are its own and waits, should the previous holder not have released them
yet. A request without a grant (``/run_code`` from a trainer) asks for a number of cores and gets the
first free ones, first come first served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from arl_tangram.errors import CapacityExceeded, InvalidSpec

Grant = Callable[[list[int]], None]


class _Waiter:
    __slots__ = ("grant", "live", "want")

    def __init__(self, want: int | frozenset[int], grant: Grant) -> None:
        self.want = want
        self.grant = grant
        self.live = True

    def cancel(self) -> None:
        self.live = False


def _nothing() -> None:
    return None


class CoreAllocator:
    """Hands out disjoint core sets; waiters are served in arrival order.

    ``request`` is the hot path: its ``grant`` callback runs synchronously, either at once or inside
    the ``release`` that frees the cores, so the next action is dispatched the moment the previous
    one answers (no event-loop iterations in between, during which the cores would sit idle).
    """

    def __init__(self, cores: list[int]) -> None:
        self.cores = list(cores)
        self.free: set[int] = set(cores)
        self._waiters: deque[_Waiter] = deque()

    @property
    def busy(self) -> int:
        """Cores held by running actions."""
        return len(self.cores) - len(self.free)

    def check(self, want: int | frozenset[int]) -> None:
        """``InvalidSpec``/``CapacityExceeded`` for a request this host can never serve."""
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

    def request(self, want: int | frozenset[int], grant: Grant) -> Callable[[], None]:
        """Call ``grant(cores)`` now, or later from ``release``; returns a cancel function (which
        only withdraws a request still waiting: cores already granted are the grantee's to free)."""
        self.check(want)
        if not self._waiters:
            got = self._take(want)
            if got is not None:
                grant(got)
                return _nothing
        waiter = _Waiter(want, grant)
        self._waiters.append(waiter)
        return waiter.cancel

    async def acquire(self, want: int | frozenset[int]) -> list[int]:
        """Wait for, and take, ``want`` cores (a count, or exactly this set)."""
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

        def grant(got: list[int]) -> None:
            if fut.done():
                self.release(got)
            else:
                fut.set_result(got)

        cancel = self.request(want, grant)
        try:
            return await fut
        except asyncio.CancelledError:
            cancel()
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    def release(self, cores: list[int]) -> None:
        """Give cores back and grant whoever can now run."""
        self.free.update(cores)
        while self._waiters:
            waiter = self._waiters[0]
            if not waiter.live:
                self._waiters.popleft()
                continue
            got = self._take(waiter.want)
            if got is None:
                break
            self._waiters.popleft()
            waiter.live = False
            waiter.grant(got)
