"""The gateway's Prometheus metrics, in a registry of its own (tests run several gateways in one
process; the operator serves this registry on the gateway's ``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
        # Each call's labelled children, looked up once each (``labels`` costs more than the count
        # itself; the label sets are few: routes x statuses, doors x states x reasons).
        self._answered: dict[tuple[str, str], Any] = {}
        self._timed: dict[str, Any] = {}
        self._finished: dict[tuple[str, str, str], Any] = {}

    def request_answered(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its time."""
        key = (route, str(status))
        counter = self._answered.get(key)
        if counter is None:
            counter = self._answered[key] = self.requests.labels(*key)
        counter.inc()
        timer = self._timed.get(route)
        if timer is None:
            timer = self._timed[route] = self.seconds.labels(route)
        timer.observe(seconds)

    def action_finished(self, door: str, state: str, reason: str) -> None:
        """Count one action finished through ``door``."""
        key = (door, state, reason)
        counter = self._finished.get(key)
        if counter is None:
            counter = self._finished[key] = self.actions.labels(*key)
        counter.inc()
