"""Condition types and reasons (enums), and the one function that updates a conditions list (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from arl_tangram.api.meta import Condition
from arl_tangram.domain.batches import rfc3339

MESSAGE_MAX_CHARS: int = next(
    limit
    for limit in (getattr(m, "max_length", None) for m in Condition.model_fields["message"].metadata)
    if isinstance(limit, int)
)
"""The longest condition message the CRDs take (their schema's ``maxLength``, from the model)."""


class ConditionType(StrEnum):
    READY = "Ready"
    SCALING = "Scaling"
    DEGRADED = "Degraded"
    ACCEPTED = "Accepted"
    RUNNING = "Running"
    COMPLETE = "Complete"
    FAILED = "Failed"
    # ActionBatch: whether its status holds its results (False only while the API server refuses them)
    RESULTS_RECORDED = "ResultsRecorded"
    # ActionBatch: some results are left out of its status to keep it within spec.results.budgetBytes
    RESULTS_OMITTED = "ResultsOmitted"


class ConditionReason(StrEnum):
    # ActionPool
    HOSTS_READY = "HostsReady"
    HOSTS_STARTING = "HostsStarting"
    SCALED_TO_ZERO = "ScaledToZero"
    SCALING_UP = "ScalingUp"
    SCALING_DOWN = "ScalingDown"
    ROLLING_OUT = "RollingOut"
    STEADY = "Steady"
    UNSCHEDULABLE = "Unschedulable"
    # A placed host's container waits on something that is not a normal start (an image it
    # cannot pull, a Secret it lacks)
    HOSTS_CANNOT_START = "HostsCannotStart"
    # The API server refused to create a host pod (admission: a RuntimeClass it lacks, a quota;
    # validation: a podSpec it finds invalid); its answer is the message
    HOSTS_REJECTED = "HostsRejected"
    # /scale's replicas (or maxHosts) allow no host: nothing runs until it is scaled up
    PINNED_TO_ZERO = "PinnedToZero"
    # RewardModelService: no node has free devices of the kind a replica asks for
    INSUFFICIENT_GPUS = "InsufficientGPUs"
    HOSTS_FAILED = "HostsFailed"
    HOSTS_UNHEALTHY = "HostsUnhealthy"
    INVALID_SPEC = "InvalidSpec"
    HEALTHY = "Healthy"
    RESIZE_UNSUPPORTED = "InPlaceResizeUnsupported"
    # The hosts' agents run no program of a language spec.languages declares
    LANGUAGES_MISSING = "LanguagesMissing"
    # ActionBatch
    QUEUED = "Queued"
    ACTIONS_RUNNING = "ActionsRunning"
    WAITING = "Waiting"
    ALL_FINISHED = "AllFinished"
    SOME_FAILED = "SomeFailed"
    NONE_FAILED = "NoneFailed"
    IN_PROGRESS = "InProgress"
    DELETING = "Deleting"
    # An edit of what cannot change once the batch exists (only an older CRD lets it in)
    EDIT_REFUSED = "EditRefused"
    # The API server refused a status with the batch's results (its answer is the message)
    STATUS_REFUSED = "StatusRefused"
    # Results left out of the status to keep it within spec.results.budgetBytes
    OVER_BUDGET = "OverBudget"
    # Every result known is in the status again (ResultsOmitted=False, once it was True)
    WITHIN_BUDGET = "WithinBudget"


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the object a reconcile is about."""

    type: str  # Normal or Warning
    reason: str
    message: str


# Posted where they are met, with what was met (a refused host pod, a refused spec): not again for
# the condition they set.
_OWN_EVENTS = frozenset({ConditionReason.INVALID_SPEC.value, ConditionReason.HOSTS_REJECTED.value})
# Ready=False for these wants a person (no node or GPU for it, a container that cannot start); for
# the others it is the object's normal course (starting, scaled or pinned to zero, a rollout).
_NOT_READY_TROUBLE = frozenset(
    {
        ConditionReason.UNSCHEDULABLE.value,
        ConditionReason.HOSTS_CANNOT_START.value,
        ConditionReason.INSUFFICIENT_GPUS.value,
    }
)


def condition_events(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> list[Event]:
    """The Events of a pool's or a service's conditions going from ``before`` (its status as
    written) to ``after`` (this round's): a Warning as it becomes Degraded, or Ready=False for a
    reason that wants a person, or that reason changes; a Normal one as Degraded clears. One per
    reason. Only the conditions said so: alerting on Warning Events heard nothing of a pool whose
    hosts could not start or a service with no GPU."""

    def state(conds: Sequence[Mapping[str, Any]], kind: ConditionType) -> tuple[Any, Any, str]:
        c = next((c for c in conds if c.get("type") == kind.value), None)
        return (c.get("status"), c.get("reason"), str(c.get("message", ""))) if c else (None, None, "")

    out: dict[str, Event] = {}
    was, was_why, _ = state(before, ConditionType.DEGRADED)
    now, why, message = state(after, ConditionType.DEGRADED)
    if now == "True" and (was, was_why) != ("True", why) and why not in _OWN_EVENTS:
        out[why] = Event("Warning", why, message)
    elif now == "False" and was == "True":
        out[why] = Event("Normal", why, message)
    was, was_why, _ = state(before, ConditionType.READY)
    now, why, message = state(after, ConditionType.READY)
    if now == "False" and why in _NOT_READY_TROUBLE and (was, was_why) != ("False", why) and why not in out:
        out[why] = Event("Warning", why, message)
    return list(out.values())


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    kind: ConditionType,
    status: bool | None,
    reason: ConditionReason,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; its lastTransitionTime moves only when its status changes.
    A message over the schema's limit is cut (``fit_message``)."""
    message = fit_message(message)
    text = "Unknown" if status is None else ("True" if status else "False")
    out: list[dict[str, Any]] = []
    found = False
    stamp = rfc3339(now)
    for cond in conditions:
        if cond.get("type") != kind.value:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != text
        out.append(
            {
                "type": kind.value,
                "status": text,
                "observedGeneration": generation,
                "lastTransitionTime": stamp if changed else cond.get("lastTransitionTime", stamp),
                "reason": reason.value,
                "message": message,
            }
        )
    if not found:
        out.append(
            {
                "type": kind.value,
                "status": text,
                "observedGeneration": generation,
                "lastTransitionTime": stamp,
                "reason": reason.value,
                "message": message,
            }
        )
    return out


def fit_message(message: str) -> str:
    """``message`` within :data:`MESSAGE_MAX_CHARS`: its head, and how much was left out. A message
    built from many parts (a batch held by a hundred pools, each saying why) could pass the CRD's
    limit, and the API server then refused the whole status write, every period, for as long as
    it lasted: the object showed nothing at all."""
    if len(message) <= MESSAGE_MAX_CHARS:
        return message
    # The note's own length depends on the count it states; 40 characters hold any such note.
    keep = MESSAGE_MAX_CHARS - 40
    return f"{message[:keep]}... ({len(message) - keep} more characters)"


def refused_spec(
    status: Mapping[str, Any],
    prior: Sequence[Mapping[str, Any]],
    generation: int | None,
    serving: int,
    message: str,
    now: datetime,
    what: str,
) -> dict[str, Any]:
    """``status`` (a round run with the last accepted spec, of generation ``serving``) of a pool or
    service (``what``) whose spec of ``generation`` cannot be used. Ready and Scaling stay as the
    running spec makes them, with its generation (they say what runs: what is sent to it does
    run); Degraded says the new spec is refused and what runs instead, and ``observedGeneration``
    is the refused one: it was seen, and this is the answer to it, not a status still to come.
    ``prior``: the conditions the object's status held, which Degraded's lastTransitionTime is
    kept from (the round's own Degraded, made with the accepted spec, is not what it was)."""
    said = (
        f"the spec of generation {generation} is refused ({message}); the {what} keeps running its "
        f"last accepted spec (generation {serving}) until it is fixed"
    )
    was = next((c for c in prior if c.get("type") == ConditionType.DEGRADED.value), None)
    before: list[Mapping[str, Any]] = [
        was if was is not None and c.get("type") == ConditionType.DEGRADED.value else c
        for c in status.get("conditions") or ()
    ]
    conds = set_condition(
        before,
        ConditionType.DEGRADED,
        True,
        ConditionReason.INVALID_SPEC,
        said,
        generation,
        now,
    )
    return {**status, "observedGeneration": generation, "conditions": conds}
