"""Sessions opened through the gateway: where each lives, and when it expires.

The dispatcher owns a session's state (its host, its order of actions); the gateway keeps what it
needs to route and police them: the namespace and pool (a later call is authorised against the
session's namespace, not against what the caller claims), the TTL, and a bound per tenant. An
idle session is closed when its TTL passes, by a janitor task that runs while the app runs.

A session's TTL defaults to its pool's ``spec.sessions.ttlSeconds``, and so does what a caller may
ask for (the pool's owner bounds how long its hosts keep an idle trajectory's state). Whether a
session's host was lost is the dispatcher's to say: the gateway asks it (:class:`SessionView`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from arl_tangram.domain.actions import ActionService
from arl_tangram.domain.pools import PoolConfig
from arl_tangram.errors import NotFound, QueueFull

log = logging.getLogger(__name__)


@dataclass
class GatewaySession:
    """A session as the gateway sees it."""

    id: str
    namespace: str
    pool: str
    ttl_s: float
    last_used: float
    busy: int = 0

    def expires_in(self, now: float) -> float:
        return max(0.0, self.last_used + self.ttl_s - now)


@runtime_checkable
class SessionView(Protocol):
    """What the gateway reads of the dispatcher's pools and sessions (the dispatcher has it)."""

    async def find_pool_config(self, namespace: str, name: str) -> PoolConfig | None: ...

    def session_lost(self, namespace: str, pool: str, session: str) -> str | None: ...


def session_view(service: ActionService) -> SessionView | None:
    """``service`` where it reads the dispatcher's pools and sessions (the dispatcher, or a service
    in front of it that passes these on: embedded mode's); None where it cannot tell."""
    return service if isinstance(service, SessionView) else None


class SessionRegistry:
    """Open sessions by id, with their TTLs; closes idle ones through the service."""

    def __init__(
        self,
        service: ActionService,
        max_per_tenant: int,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.max_per_tenant = max_per_tenant
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.sessions: dict[str, GatewaySession] = {}
        self._per_tenant: dict[str, int] = {}
        self.view = session_view(service)

    async def pool_ttl_s(self, namespace: str, pool: str) -> float | None:
        """The pool's ``spec.sessions.ttlSeconds``; None when the pool is unknown (opening the
        session then says so) or the service cannot tell."""
        if self.view is None:
            return None
        config = await self.view.find_pool_config(namespace, pool)
        return None if config is None else config.session_ttl_s

    def lost(self, session: GatewaySession) -> str | None:
        """Why the session's state is gone (as its actions are told), or None while it stands."""
        if self.view is None:
            return None
        return self.view.session_lost(session.namespace, session.pool, session.id)

    async def open(self, namespace: str, pool: str, ttl_s: float) -> GatewaySession:
        if self._per_tenant.get(namespace, 0) >= self.max_per_tenant:
            raise QueueFull(
                f"namespace {namespace} has {self.max_per_tenant} open sessions (its limit); close some",
                self.retry_after_s,
            )
        sid = await self.service.open_session(namespace, pool, ttl_s)
        session = GatewaySession(sid, namespace, pool, ttl_s, self.clock())
        self.sessions[sid] = session
        self._per_tenant[namespace] = self._per_tenant.get(namespace, 0) + 1
        return session

    def get(self, sid: str) -> GatewaySession:
        session = self.sessions.get(sid)
        if session is None:
            raise NotFound("session", sid, f"no open session {sid!r} (closed, expired, or never opened)")
        return session

    async def close(self, sid: str) -> GatewaySession:
        session = self.get(sid)
        self._forget(session)
        await self.service.close_session(session.namespace, session.pool, sid)
        return session

    def _forget(self, session: GatewaySession) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        left = self._per_tenant.get(session.namespace, 1) - 1
        if left:
            self._per_tenant[session.namespace] = left
        else:
            self._per_tenant.pop(session.namespace, None)

    async def expire(self) -> int:
        """Close every idle session past its TTL; returns how many."""
        now = self.clock()
        due = [s for s in self.sessions.values() if not s.busy and s.expires_in(now) == 0.0]
        closed = 0
        for session in due:
            # Checked again: a call may have taken it while an earlier one was being closed.
            if (
                session.busy
                or session.expires_in(self.clock()) > 0.0
                or self.sessions.get(session.id) is not session
            ):
                continue
            closed += 1
            self._forget(session)
            try:
                await self.service.close_session(session.namespace, session.pool, session.id)
            except NotFound:
                pass  # the dispatcher expired or lost it first: nothing left to close
            except Exception as exc:  # the janitor must outlive one failed close
                log.warning("closing expired session %s failed: %s", session.id, exc)
        return closed

    async def janitor(self, period_s: float) -> None:
        """Run :meth:`expire` every ``period_s`` until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            await self.expire()
