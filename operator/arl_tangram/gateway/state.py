"""What every gateway handler shares: the service behind it, its settings, its guards."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from arl_tangram.domain.actions import ActionService
from arl_tangram.gateway.abandoned import Abandoned
from arl_tangram.gateway.admission import Admission
from arl_tangram.gateway.auth import ANONYMOUS, Authenticator, Forbidden, Principal
from arl_tangram.gateway.config import GatewayConfig
from arl_tangram.gateway.metrics import GatewayMetrics
from arl_tangram.gateway.sessions import SessionRegistry


@dataclass(frozen=True)
class Leadership:
    """Whether this operator replica leads; a standby knows the leader's address when it can."""

    leader: bool
    leader_address: str | None = None


Readiness = Callable[[], Leadership]


def always_leader() -> Leadership:
    """The readiness of a gateway with no standby (embedded mode, tests)."""
    return Leadership(leader=True)


class BatchResults(Protocol):
    """The full results of ActionBatches, beyond what fits their status (the operator implements it)."""

    async def results(self, namespace: str, name: str) -> AsyncIterator[dict[str, object]] | None:
        """One dict per action result, or None when no such batch is known."""
        ...


@dataclass
class GatewayState:
    """Built once by :func:`~arl_tangram.gateway.app.build_gateway_app`, read by every handler."""

    service: ActionService
    auth: Authenticator | None
    config: GatewayConfig
    metrics: GatewayMetrics
    admission: Admission
    sessions: SessionRegistry
    readiness: Readiness
    batch_results: BatchResults | None
    abandoned: Abandoned


STATE: web.AppKey[GatewayState] = web.AppKey("gateway", GatewayState)
PRINCIPAL_KEY: web.RequestKey[Principal] = web.RequestKey("principal", Principal)


def state_of(request: web.Request) -> GatewayState:
    return request.app[STATE]


@functools.lru_cache(maxsize=1024)  # asked on every anonymous request, from a few addresses
def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


async def authorize(request: web.Request, namespace: str, verb: str = "create") -> Principal:
    """The caller (authenticated by the middleware) may ``verb`` ActionBatches in ``namespace``."""
    principal = request[PRINCIPAL_KEY]
    auth = state_of(request).auth
    if auth is None:
        return principal
    if principal is ANONYMOUS:
        raise Forbidden("anonymous callers may not use this gateway")
    await auth.authorize(principal, namespace, verb)
    return principal
