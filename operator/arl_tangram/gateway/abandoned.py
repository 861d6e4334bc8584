"""Keyless actions whose caller left: cancelled, so that work nobody can fetch holds no core.

An action sent without an idempotency key gets a fresh key of the gateway's (``keys.scoped_key``):
no retry can find it again, and once its caller's connection is gone nobody ever reads its result.
It used to run to its end anyway, queued or not. A trainer's client that timed out (verl's timeout
counts the time queued) then left its actions holding cores while it sent them again as new ones,
so an overloaded pool fed on itself. Each such action is watched while it is in the gateway's
hands, and cancelled (queued: dropped; running: stopped on its agent) once its caller's connection
closes. An action with a key is never cancelled this way: a retry with the key re-attaches to it.

A caller may also cancel its own actions by key (``POST /v1/actions:cancel``: the client does so for
a ``run_many`` it abandons). A key not queued or running then may still be on its way (a stream's
lines the gateway has not read yet, which it goes on reading after the caller left): it is kept for
a while, and an action arriving under it is answered Cancelled instead of run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from arl_tangram.domain.actions import ActionService
from arl_tangram.gateway.keys import key_namespace

log = logging.getLogger(__name__)

# How long, and how many per namespace, keys cancelled before they arrived are kept (a stream's
# unread lines are read within moments; the bound keeps a caller cancelling made-up keys from filling
# memory). Per namespace: with one bound for all, a tenant cancelling made-up keys pushed out the
# keys another tenant had cancelled, whose actions then ran when they arrived.
CANCELLED_KEPT_S = 300.0
CANCELLED_KEPT = 100_000


def _left(request: web.BaseRequest) -> bool:
    """Whether the connection ``request`` came on is gone (or going): no answer can reach it."""
    transport = request.transport
    return transport is None or transport.is_closing()


class Abandoned:
    """The keyless actions in flight and their callers' requests; ``janitor`` cancels the left."""

    def __init__(self, service: ActionService, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.clock = clock
        self.watched: dict[str, web.BaseRequest] = {}
        self.cancelled = 0  # actions cancelled because their caller left, since start
        # Keys cancelled before they arrived, by the namespace they are scoped to (``keys``).
        self._early: dict[str, OrderedDict[str, float]] = {}

    async def cancel(self, key: str) -> bool:
        """A caller's cancel of its action ``key``: True when it was queued or running (stopped
        now); else False, and an action arriving under ``key`` soon is not run (``cancelled_early``)."""
        if await self.service.cancel(key):
            return True
        now = self.clock()
        early = self._early.setdefault(key_namespace(key), OrderedDict())
        early[key] = now
        early.move_to_end(key)
        # Oldest first: past the bound, or too old to be answered Cancelled any more.
        while len(early) > CANCELLED_KEPT or (early and now - next(iter(early.values())) >= CANCELLED_KEPT_S):
            early.popitem(last=False)
        return False

    def cancelled_early(self, key: str) -> bool:
        """Whether ``key`` was cancelled (``cancel``) before it arrived; consumed by this call, so that
        one later retry under the key runs."""
        namespace = key_namespace(key)
        early = self._early.get(namespace)
        when = None if early is None else early.pop(key, None)
        if early is not None and not early:
            del self._early[namespace]
        return when is not None and self.clock() - when < CANCELLED_KEPT_S

    def watch(self, key: str, request: web.BaseRequest) -> None:
        self.watched[key] = request

    def forget(self, key: str) -> None:
        self.watched.pop(key, None)

    async def sweep(self) -> int:
        """Cancel every watched action whose caller has left; how many were."""
        gone = [key for key, request in self.watched.items() if _left(request)]
        for key in gone:
            self.watched.pop(key, None)
            if await self.service.cancel(key):
                self.cancelled += 1
                log.info("gateway: action %s cancelled: its caller left and sent no key to fetch it by", key)
        return len(gone)

    async def janitor(self, period_s: float) -> None:
        """``sweep`` every ``period_s`` seconds until cancelled (a dict scan: cheap when idle)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("gateway: cancelling the actions of callers that left failed")
