"""The gateway's settings, stated once: every default lives here and the app, the OpenAPI text and
the docs read it from here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from arl_tangram.api.actionpool import MAX_SESSION_TTL_S
from arl_tangram.api.meta import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN
from arl_tangram.domain.pools import LONGEST_BACKSTOPPED_TTL_S
from arl_tangram.errors import InvalidSpec

POOL_HEADER = "X-Tangram-Pool"
NAMESPACE_HEADER = "X-Tangram-Namespace"
SERVICE_HEADER = "X-Tangram-Service"
LEADER_HEADER = "X-Tangram-Leader"
ACTION_KEY_HEADER = "X-Tangram-Action-Key"


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway bounds and routes what trainers send.

    ``default_namespace`` is where a request that names none goes; ``default_pools`` and
    ``default_services`` map a namespace to the ActionPool (``/run_code``) and RewardModelService
    (reward endpoints) used when a request names none.
    """

    default_namespace: str = "default"
    default_pools: Mapping[str, str] = field(default_factory=dict)
    default_services: Mapping[str, str] = field(default_factory=dict)
    # 16 MiB, as the sandbox agent's own limit: a body the agent would take passes the gateway.
    max_body_bytes: int = 16 << 20
    # Seconds a request body may take to arrive, whole (16 MiB in 60 s is 280 KB/s): a client that
    # sends a byte now and then (slowloris) holds a connection and a handler no longer than this.
    # An NDJSON stream is read as it comes and is not bounded by it.
    body_timeout_s: float = 60.0
    # Results one stream may have outstanding; past it the gateway stops reading the stream's input,
    # so TCP flow control holds the sender (back-pressure) instead of the gateway buffering it.
    stream_in_flight: int = 256
    # Actions the gateway holds at once for one pool and for one tenant (namespace); past either, a
    # request is answered 429 with Retry-After. Generous next to the dispatcher's own waiting bounds:
    # this one only keeps a single tenant from filling the gateway's memory.
    max_in_flight_per_pool: int = 4096
    max_in_flight_per_tenant: int = 4096
    retry_after_s: float = 1.0
    # Sessions: the most a caller may ask for, and the TTL for one that names none behind a service
    # that cannot tell its pools' settings (the dispatcher tells: the pool's sessions.ttlSeconds).
    session_ttl_s: float = 600.0
    max_session_ttl_s: float = 86400.0
    max_sessions_per_tenant: int = 10_000
    # Items one reward request may score (OpenRLHF sends a whole micro-batch in one request).
    max_reward_items: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "stream_in_flight",
            "max_in_flight_per_pool",
            "max_in_flight_per_tenant",
            "max_sessions_per_tenant",
            "max_reward_items",
        ):
            if getattr(self, name) < 1:
                raise InvalidSpec(name, f"must be at least 1, got {getattr(self, name)}")
        for name in ("retry_after_s", "session_ttl_s", "max_session_ttl_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidSpec(name, f"must be positive, got {getattr(self, name)}")
        if self.session_ttl_s > self.max_session_ttl_s:
            raise InvalidSpec("session_ttl_s", "must not exceed max_session_ttl_s")
        # The dispatcher keeps a gateway session as a backstop for its agent TTL (``agent_ttl_s``),
        # within the agents' bound: past it, the backstop would close a session the gateway holds.
        if self.max_session_ttl_s > LONGEST_BACKSTOPPED_TTL_S:
            raise InvalidSpec(
                "max_session_ttl_s",
                f"must be at most {LONGEST_BACKSTOPPED_TTL_S:g} s "
                f"(agents keep a session {MAX_SESSION_TTL_S / 86400:g} days)",
            )


def parse_defaults(where: str, text: str) -> dict[str, str]:
    """``default_pools`` or ``default_services`` from ``NAMESPACE/NAME,...`` (the operator's
    environment): the target of each namespace's requests that name none. Trainers whose URL is
    fixed (SkyRL's SandboxFusion client posts to ``http://HOST:8080/run_code``) can name nothing
    else. ``InvalidSpec`` naming ``where`` for a malformed entry or a namespace given twice."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        namespace, _, name = entry.partition("/")
        if not (
            len(namespace) <= 63
            and re.fullmatch(DNS_LABEL_PATTERN, namespace)
            and len(name) <= 63
            and re.fullmatch(DNS_SUBDOMAIN_PATTERN, name)
        ):
            raise InvalidSpec(where, f"{entry[:80]!r} is not NAMESPACE/NAME (Kubernetes names)")
        if namespace in out:
            raise InvalidSpec(where, f"namespace {namespace!r} is given twice ({out[namespace]}, {name})")
        out[namespace] = name
    return out
