"""Failed hosts or replicas in a row, per pool or service: what the reconciles' crash-loop back-off
reads (a pod that cannot start is not recreated in a tight loop)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from arl_tangram.runtime.interface import HostObservation


def backoff_s(failures: int) -> float:
    """How long after the last of ``failures`` failed pods in a row the next one may start: 5 s
    doubling to 5 min, as a kubelet's crash loop."""
    return 0.0 if failures <= 0 else min(300.0, 5.0 * 2 ** (failures - 1))


@dataclass(frozen=True)
class Streak:
    count: int = 0  # failures since the last ready one
    since_s: float = float("inf")  # since the last failure (inf: none in this streak)
    last: str | None = None  # why the last one failed


class FailureStreaks:
    """Counts each failed pod once (it stays listed as failed until it is deleted); a ready one ends
    the streak."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, tuple[int, float, str | None, frozenset[str]]] = {}

    def observe(self, key: str, pods: Iterable[HostObservation]) -> Streak:
        pods = list(pods)
        count, when, why, seen = self._state.get(key, (0, 0.0, None, frozenset()))
        failed = [p for p in pods if p.phase == "failed" and p.name not in seen]
        if failed:
            count, when, why = count + len(failed), self.clock(), failed[0].failure
        elif any(p.phase == "ready" for p in pods):
            count = 0
        # Only names still listed are kept: a deleted pod's name never comes back (random suffix).
        listed = {p.name for p in pods}
        self._state[key] = (count, when, why, (seen & listed) | {p.name for p in failed})
        return Streak(count, self.clock() - when if count else float("inf"), why)
