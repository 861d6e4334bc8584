"""Failed hosts or replicas in a row, per pool or service: what the reconciles' crash-loop back-off
reads (a pod that cannot start is not recreated in a tight loop); and how long some of them have
waited on what may never come (a node, a container start)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from arl_tangram.domain.actions import OUTAGE_RETRY_MIN_S, Outage
from arl_tangram.runtime.interface import HostObservation

# A pod waiting this long without a node means no node can hold the template (the minute,
# with room for one planner period); a placed pod whose container waits this long on something
# other than a normal start (an image it cannot pull) is taken to wait for good too.
UNSCHEDULABLE_AFTER_S = 30.0
# Pods failed in a row (none ready between) after which the actions are refused during the back-off
# before the next start, rather than wait for a pod that has failed each time.
OUTAGE_AFTER_FAILURES = 3


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

    def forget(self, key: str) -> None:
        """``key`` was deleted: one made again under its name starts with no streak (and no back-off)."""
        self._state.pop(key, None)


@dataclass(frozen=True)
class Rejection:
    count: int  # the API server's refusals of the pool's pods in a row, for this generation
    since_s: float  # since the last one
    message: str  # the last one's answer (``HostRejected``)


class Rejections:
    """Per pool, the API server's refusals of its host pods in a row (``HostRejected``: an admission
    rule, an invalid podSpec). The same pod would be refused again, so the next create waits out a
    back-off (``backoff_s``), unless the spec changes (a new generation, which may fix it: tried at
    once). A pod created ends the streak."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, tuple[int, float, str, int]] = {}

    def observe(self, key: str, generation: int) -> Rejection | None:
        """The streak of the pool at ``generation``; None when there is none (or it was of an
        earlier spec)."""
        found = self._state.get(key)
        if found is None or found[3] != generation:
            self._state.pop(key, None)
            return None
        count, when, message, _ = found
        return Rejection(count, self.clock() - when, message)

    def rejected(self, key: str, generation: int, message: str) -> Rejection:
        found = self._state.get(key)
        count = found[0] + 1 if found is not None and found[3] == generation else 1
        self._state[key] = (count, self.clock(), message, generation)
        return Rejection(count, 0.0, message)

    def forget(self, key: str) -> None:
        self._state.pop(key, None)


class Waits:
    """Per pool or service, since when some of its pods have waited on one kind of thing (no node
    for them, a container that cannot start): how long it has lasted, 0 while none waits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since: dict[str, float] = {}

    def observe(self, key: str, waiting: bool) -> float:
        now = self.clock()
        if not waiting:
            self._since.pop(key, None)
            return 0.0
        return now - self._since.setdefault(key, now)

    def forget(self, key: str) -> None:
        self._since.pop(key, None)


class Stalls:
    """Per pool or service, since when each of its pods has been stalled (``HostObservation.stalled``),
    each on its own clock. A pod waiting for its volumes or sandbox (``setting_up``) counts as
    stalled only once it has for ``UNSCHEDULABLE_AFTER_S``: every pod does for a moment as it
    starts, and pods starting one after another must never add up to a pool that looks stuck. A
    container the kubelet cannot start (an image it cannot pull) counts at once, as no normal start
    looks like that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since: dict[str, dict[str, float]] = {}

    def observe(self, key: str, pods: Sequence[HostObservation]) -> list[HostObservation]:
        """``pods``, those setting up for less than ``UNSCHEDULABLE_AFTER_S`` as starting
        (``stalled`` cleared), each of the rest with how long it has been stalled (``stalled_s``)."""
        now = self.clock()
        was = self._since.get(key, {})
        since = {p.name: was.get(p.name, now) for p in pods if p.stalled}
        if since:
            self._since[key] = since
        else:
            self._since.pop(key, None)

        def seen(p: HostObservation) -> HostObservation:
            if not p.stalled:
                return p
            waited = now - since[p.name]
            if p.setting_up and waited < UNSCHEDULABLE_AFTER_S:
                return replace(p, stalled=None, setting_up=False)
            return replace(p, stalled_s=waited)

        return [seen(p) for p in pods]

    def forget(self, key: str) -> None:
        self._since.pop(key, None)


def cannot_start(noun: str, hosts: Iterable[HostObservation]) -> str | None:
    """ "host X cannot start: <the kubelet's reason>" (``noun`` for "host") once one of ``hosts``
    has waited ``UNSCHEDULABLE_AFTER_S`` on what is not a normal start (``HostObservation.stalled``
    for ``stalled_s``); None before, or when none is stalled."""
    # The one stalled longest: a pod of the same template stalled a moment ago may be a later one.
    stalled = max((h for h in hosts if h.stalled), key=lambda h: h.stalled_s, default=None)
    if stalled is None or stalled.stalled_s < UNSCHEDULABLE_AFTER_S:
        return None
    return f"{noun} {stalled.name} cannot start: {stalled.stalled}"


def outage(
    what: str,
    noun: str,
    live: Sequence[HostObservation],
    *,
    coming: bool,
    unplaceable: str | None,
    unplaceable_for_s: float,
    unplaced_for_s: float,
    failures: int,
    since_failure_s: float,
    last_failure: str | None,
    rejected: str | None = None,
    rejected_retry_s: float = 0.0,
) -> Outage | None:
    """Why a pool's hosts (a service's replicas: ``noun``) can run nothing now and will not soon,
    or None; ``what`` opens the message ("pool ns/py has no host"). Only where none of ``live``
    (those not terminating) is ready and none is on its way (``coming``: being added or brought
    back this round; or one starting that neither waits for a node nor is stalled), when: the
    placement found no node for one (``unplaceable``) for ``UNSCHEDULABLE_AFTER_S``; one has waited
    as long for a node or for its container to start; or ``OUTAGE_AFTER_FAILURES`` failed in a row
    and the back-off keeps the next from starting yet; or the API server refused the last one
    (``rejected``: its answer, naming the field) and none is tried before ``rejected_retry_s``."""
    if coming or any(h.phase == "ready" for h in live):
        return None
    starting = [h for h in live if h.phase == "starting"]
    if any(not h.pending and not h.stalled for h in starting):
        return None  # one is on its way (an image pulled, an agent starting)
    if rejected:
        # Told at once: the API server's answer is final for this pod, not a wait that may end.
        return Outage(f"{what}: {rejected}", max(rejected_retry_s, OUTAGE_RETRY_MIN_S))
    if unplaceable and unplaceable_for_s >= UNSCHEDULABLE_AFTER_S and not starting:
        return Outage(f"{what}: {unplaceable}", UNSCHEDULABLE_AFTER_S)
    pending = [h for h in starting if h.pending]
    if pending and unplaced_for_s >= UNSCHEDULABLE_AFTER_S:
        return Outage(
            f"{what}: {noun} {pending[0].name} cannot be placed: {pending[0].pending}", UNSCHEDULABLE_AFTER_S
        )
    stalled = cannot_start(noun, starting)
    if stalled:
        return Outage(f"{what}: {stalled}", UNSCHEDULABLE_AFTER_S)
    left = backoff_s(failures) - since_failure_s
    if failures >= OUTAGE_AFTER_FAILURES and left > 0 and not starting:
        return Outage(
            f"{what}: {failures} {noun}(s) failed in a row, last: {last_failure}; another may start "
            f"in about {left:.0f} s, when something asks for one",
            max(left, OUTAGE_RETRY_MIN_S),
        )
    return None
