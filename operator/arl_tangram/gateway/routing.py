"""Which namespace, pool or service a trainer-shaped request goes to: trainers cannot add fields
to their bodies, so the choice comes from a header, a query parameter, or the namespace's default."""

from __future__ import annotations

import re
from collections.abc import Collection

from aiohttp import web

from arl_tangram.api.meta import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN
from arl_tangram.errors import InvalidSpec
from arl_tangram.gateway.config import NAMESPACE_HEADER, POOL_HEADER, SERVICE_HEADER
from arl_tangram.gateway.state import state_of

_LABEL = re.compile(DNS_LABEL_PATTERN)
_SUBDOMAIN = re.compile(DNS_SUBDOMAIN_PATTERN)


# Every query parameter a route may take, with what it means (the OpenAPI text says it from here).
QUERY_PARAMS: dict[str, str] = {
    "namespace": f"The target's namespace (as {NAMESPACE_HEADER}); else the gateway's default.",
    "pool": f"The ActionPool (as {POOL_HEADER}): /run_code's (else the namespace's default pool), or on a "
    "reward route the pool of a test-based reward (else the reward goes to a RewardModelService).",
    "service": f"The RewardModelService (as {SERVICE_HEADER}); else the body's model or the default.",
}


def check_query(request: web.Request, allowed: Collection[str]) -> None:
    """400 for a query parameter the route does not take (a typo such as ``?pol=`` would otherwise
    send the request to the default target without a word) or one given twice (which would win?)."""
    for name in request.query:
        if name not in allowed:
            takes = ", ".join(f"?{p}" for p in sorted(allowed)) or "none"
            raise InvalidSpec(
                f"?{name}", f"unknown query parameter {name[:40]!r} (this route takes: {takes})"
            )
        if len(request.query.getall(name)) > 1:
            raise InvalidSpec(f"?{name}", f"query parameter {name!r} is given more than once")


# SandboxFusion's routes with the target in the path, for a client that can name it nowhere else
# (SandboxFusion's own appends the route to its endpoint): ``/pools/NAMESPACE/POOL/run_code``.
POOL_PREFIX = "/pools/{namespace}/{pool}"


def given(request: web.Request, header: str, param: str) -> str | None:
    """The value of ``header``, of ``?param``, or of the path's ``{param}``; 400 when two are given
    and differ."""
    said = {
        where: value
        for where, value in (
            (header, request.headers.get(header)),
            (f"?{param}", request.query.get(param)),
            (f"the path's {param}", request.match_info.get(param)),
        )
        if value is not None
    }
    if not said:
        return None
    (first_where, first), *others = said.items()
    for where, value in others:
        if value != first:
            raise InvalidSpec(
                f"?{param}", f"{first_where} says {first[:80]!r} but {where} says {value[:80]!r}"
            )
    return first


def _checked(value: str, where: str, pattern: re.Pattern[str]) -> str:
    # fullmatch: the patterns end in ``$``, which ``match`` lets past a trailing newline, so that
    # ``?namespace=team-a%0A`` was a valid name (one no RoleBinding names, and no object has).
    if not 1 <= len(value) <= 63 or not pattern.fullmatch(value):
        raise InvalidSpec(where, f"{value[:80]!r} is not a valid Kubernetes name")
    return value


def valid_namespace(value: str, where: str) -> str:
    """``value`` when it is a namespace's name; ``InvalidSpec`` naming ``where`` otherwise."""
    return _checked(value, where, _LABEL)


def namespace_of(request: web.Request) -> str:
    """``X-Tangram-Namespace`` or ``?namespace=``, else the gateway's default namespace."""
    value = given(request, NAMESPACE_HEADER, "namespace")
    if value is None:
        return state_of(request).config.default_namespace
    return valid_namespace(value, f"{NAMESPACE_HEADER} / ?namespace")


def pool_of(request: web.Request, namespace: str) -> str | None:
    """``X-Tangram-Pool`` or ``?pool=``; else the namespace's default pool (None when it has none)."""
    value = given(request, POOL_HEADER, "pool")
    if value is None:
        return state_of(request).config.default_pools.get(namespace)
    return _checked(value, f"{POOL_HEADER} / ?pool", _SUBDOMAIN)


def service_of(request: web.Request, namespace: str, model: str | None = None) -> str | None:
    """``X-Tangram-Service`` or ``?service=``, else the body's ``model`` (vLLM and SGLang name the
    served model there), else the namespace's default RewardModelService."""
    value = given(request, SERVICE_HEADER, "service")
    if value is not None:
        return _checked(value, f"{SERVICE_HEADER} / ?service", _SUBDOMAIN)
    if model is not None:
        return model
    return state_of(request).config.default_services.get(namespace)


def require_pool(request: web.Request, namespace: str) -> str:
    pool = pool_of(request, namespace)
    if pool is None:
        raise InvalidSpec(
            "pool",
            f"no ActionPool named: send {POOL_HEADER}, add ?pool=NAME to the URL, or configure a default "
            f"pool for namespace {namespace!r}",
        )
    return pool
