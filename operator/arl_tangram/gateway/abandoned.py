"""Keyless actions whose caller left: cancelled, so that work nobody can fetch holds no core.

An action sent without an idempotency key gets a fresh key of the gateway's (``keys.scoped_key``):
no retry can find it again, and once its caller's connection is gone nobody ever reads its result.
It used to run to its end anyway, queued or not. A trainer's client that timed out (verl's timeout
counts the time queued) then left its actions holding cores while it sent them again as new ones,
so an overloaded pool fed on itself. Each such action is watched while it is in the gateway's
hands, and cancelled (queued: dropped; running: stopped on its agent) once its caller's connection
closes. An action with a key is never cancelled this way: a retry with the key re-attaches to it.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from arl_tangram.domain.actions import ActionService

log = logging.getLogger(__name__)


def _left(request: web.BaseRequest) -> bool:
    """Whether the connection ``request`` came on is gone (or going): no answer can reach it."""
    transport = request.transport
    return transport is None or transport.is_closing()


class Abandoned:
    """The keyless actions in flight and their callers' requests; ``janitor`` cancels the left."""

    def __init__(self, service: ActionService) -> None:
        self.service = service
        self.watched: dict[str, web.BaseRequest] = {}
        self.cancelled = 0  # actions cancelled because their caller left, since start

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
