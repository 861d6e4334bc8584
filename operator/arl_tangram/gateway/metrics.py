"""The gateway's Prometheus metrics, in a registry of its own (tests run several gateways in one
process; the operator serves this registry on the gateway's ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from arl_tangram.labelled import Labelled


class GatewayMetrics:
    """Requests, latency, actions held, refusals and the auth caches."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "tangram_gateway_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "tangram_gateway_request_seconds",
            "Time to answer a request (streams: to their end), by route",
            ["route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 600),
            registry=self.registry,
        )
        self.actions = Counter(
            "tangram_gateway_actions",
            "Actions finished through the gateway, by door, state and reason",
            ["door", "state", "reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tangram_gateway_actions_in_flight", "Actions the gateway holds now", registry=self.registry
        )
        self.refused = Counter(
            "tangram_gateway_refused",
            "Requests refused before running anything, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.auth_cache = Gauge(
            "tangram_gateway_auth_cache",
            "Auth cache lookups since start (hit: no API call), by review kind and result",
            ["review", "result"],
            registry=self.registry,
        )
        self.sessions = Gauge("tangram_gateway_sessions", "Open sessions", registry=self.registry)
        # Each call's children (routes x statuses, doors x states x reasons: few).
        self._answered = Labelled(self.requests)
        self._timed = Labelled(self.seconds)
        self._finished = Labelled(self.actions)

    def request_answered(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its time."""
        self._answered(route, str(status)).inc()
        self._timed(route).observe(seconds)

    def action_finished(self, door: str, state: str, reason: str) -> None:
        """Count one action finished through ``door``."""
        self._finished(door, state, reason).inc()
