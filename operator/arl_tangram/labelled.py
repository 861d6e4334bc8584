"""Labelled Prometheus metrics on a hot path: each label set's child looked up once."""

from __future__ import annotations

from typing import Any

from prometheus_client.metrics import MetricWrapperBase


class Labelled:
    """The children of ``metric``, one per label values, each made on first use and kept:
    ``labels()`` costs more than the count itself. For label sets that are few and bounded (routes,
    statuses, outcomes), never for a caller's own values."""

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
