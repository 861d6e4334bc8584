"""The operator's Prometheus metrics, in a registry of its own (tests may run several operators)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from arl_tangram.domain.actions import ActionKind, ActionOutcome, ActionRequest

# From a millisecond tool call to a long test run.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class OperatorMetrics:
    """What the issue asks to see: ACT, queueing and execution by pool and type; queue depth; units;
    hosts by state; scale events; dispatch errors; reconcile durations; API writes."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.act = Histogram(
            "tangram_action_completion_seconds",
            "Action completion time (queue + run)",
            ["pool", "type"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.queueing = Histogram(
            "tangram_action_queue_seconds",
            "Time actions waited for units",
            ["pool", "type"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.execution = Histogram(
            "tangram_action_execution_seconds",
            "Time actions ran",
            ["pool", "type"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.outcomes = Counter(
            "tangram_actions_total",
            "Finished actions by outcome",
            ["pool", "type", "state", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge("tangram_queue_depth", "Actions waiting", ["pool"], registry=r)
        self.units = Gauge("tangram_units", "Units of the key resource", ["pool", "state"], registry=r)
        self.hosts = Gauge("tangram_hosts", "Hosts by state", ["pool", "state"], registry=r)
        self.scale_events = Counter(
            "tangram_scale_events_total", "Hosts added or removed", ["pool", "direction"], registry=r
        )
        self.dispatch_errors = Counter(
            "tangram_dispatch_errors_total", "Failed dispatches by kind", ["pool", "kind"], registry=r
        )
        self.reconcile = Histogram(
            "tangram_reconcile_seconds", "Reconcile durations", ["kind"], buckets=TIME_BUCKETS, registry=r
        )
        self.api_writes = Counter(
            "tangram_api_writes_total", "Kubernetes API writes", ["verb", "resource"], registry=r
        )
        self.decisions = Histogram(
            "tangram_scheduler_decision_seconds",
            "Scheduler decision time",
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
            registry=r,
        )
        self.leader = Gauge("tangram_leader", "1 on the leader, 0 on a standby", registry=r)

    def forget_pool(self, pool: str, service_lives: bool = False) -> None:
        """Remove every series of ``pool`` (a deleted pool's). Reward actions are counted under their
        service's ``namespace/name`` in the same ``pool`` label: a live service of the same name keeps
        its series (those of type reward, and the dispatch errors, which carry no type)."""
        for metric in (self.queue_depth, self.units, self.hosts, self.scale_events):
            metric.remove_by_labels({"pool": pool})
        self._forget_actions(pool, [k for k in get_args(ActionKind) if k != "reward"], not service_lives)

    def forget_service(self, service: str, pool_lives: bool = False) -> None:
        """Remove every series of ``service`` (a deleted RewardModelService's, ``namespace/name``):
        its reward actions'. A live pool of the same name keeps its own (``forget_pool``)."""
        self._forget_actions(service, ["reward"], not pool_lives)

    def _forget_actions(self, key: str, kinds: Iterable[str], dispatch_errors: bool) -> None:
        for metric in (self.act, self.queueing, self.execution, self.outcomes):
            for kind in kinds:
                metric.remove_by_labels({"pool": key, "type": kind})
        if dispatch_errors:
            self.dispatch_errors.remove_by_labels({"pool": key})

    def api_write(self, verb: str, resource: str) -> None:
        self.api_writes.labels(verb, resource).inc()

    def finished(self, pool: str, request: ActionRequest, outcome: ActionOutcome, act_s: float) -> None:
        kind = request.kind
        self.act.labels(pool, kind).observe(act_s)
        self.queueing.labels(pool, kind).observe(outcome.queued_s)
        self.execution.labels(pool, kind).observe(outcome.duration_s)
        reason = outcome.reason.value if outcome.reason else ""
        self.outcomes.labels(pool, kind, outcome.state.value, reason).inc()
        if reason in ("HostLost", "RetriesExhausted", "SessionLost"):
            self.dispatch_errors.labels(pool, reason).inc()
