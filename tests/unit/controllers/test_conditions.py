"""The conditions' one update function and the Events their changes post (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api.meta import Condition
from arl_tangram.controllers.conditions import (
    MESSAGE_MAX_CHARS,
    ConditionReason,
    ConditionType,
    Event,
    condition_events,
    set_condition,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def conds(
    ready: tuple[str, str] | None = None, degraded: tuple[str, str] | None = None
) -> list[dict[str, Any]]:
    out = []
    for kind, value in (("Ready", ready), ("Degraded", degraded)):
        if value is not None:
            out.append(
                {"type": kind, "status": value[0], "reason": value[1], "message": f"{kind} {value[1]}"}
            )
    return out


def test_a_message_over_the_crds_limit_is_cut_to_fit_saying_so() -> None:
    """The CRDs take condition messages of at most 32768 characters: one over it made the API
    server refuse the object's whole status write."""
    long = "x" * (MESSAGE_MAX_CHARS * 2)
    (cond,) = set_condition((), ConditionType.READY, False, ConditionReason.UNSCHEDULABLE, long, 1, NOW)
    Condition.model_validate(cond)
    assert cond["message"].startswith("xxx") and cond["message"].endswith(
        f"({MESSAGE_MAX_CHARS + 40} more characters)"
    )
    (kept,) = set_condition((), ConditionType.READY, False, ConditionReason.UNSCHEDULABLE, "short", 1, NOW)
    assert kept["message"] == "short"


@pytest.mark.parametrize(
    ("before", "after", "expect"),
    [
        # Becoming degraded: a Warning with its reason; staying so: nothing more.
        (
            conds(degraded=("False", "Healthy")),
            conds(degraded=("True", "HostsFailed")),
            [("Warning", "HostsFailed")],
        ),
        (conds(), conds(degraded=("True", "LanguagesMissing")), [("Warning", "LanguagesMissing")]),
        (conds(degraded=("True", "HostsFailed")), conds(degraded=("True", "HostsFailed")), []),
        # Another reason while degraded: said; cleared: a Normal one.
        (
            conds(degraded=("True", "HostsFailed")),
            conds(degraded=("True", "HostsUnhealthy")),
            [("Warning", "HostsUnhealthy")],
        ),
        (
            conds(degraded=("True", "HostsFailed")),
            conds(degraded=("False", "Healthy")),
            [("Normal", "Healthy")],
        ),
        (conds(degraded=("False", "Healthy")), conds(degraded=("False", "Healthy")), []),
        # Not ready for a reason that wants a person: a Warning; starting, scaled to zero: none.
        (
            conds(ready=("True", "HostsReady")),
            conds(ready=("False", "InsufficientGPUs")),
            [("Warning", "InsufficientGPUs")],
        ),
        (conds(ready=("True", "HostsReady")), conds(ready=("False", "HostsStarting")), []),
        (conds(ready=("False", "HostsStarting")), conds(ready=("False", "ScaledToZero")), []),
        (conds(ready=("False", "Unschedulable")), conds(ready=("False", "Unschedulable")), []),
        # Both for one reason (a pool's Ready and Degraded): one Event.
        (
            conds(("False", "HostsStarting"), ("False", "Healthy")),
            conds(("False", "HostsCannotStart"), ("True", "HostsCannotStart")),
            [("Warning", "HostsCannotStart")],
        ),
        # Reasons whose Events are posted where they are met (with what was met): not again.
        (conds(degraded=("False", "Healthy")), conds(degraded=("True", "InvalidSpec")), []),
        (
            conds(ready=("False", "HostsStarting")),
            conds(("False", "HostsRejected"), ("True", "HostsRejected")),
            [],
        ),
    ],
)
def test_condition_changes_that_want_a_person_are_events(
    before: list[dict[str, Any]], after: list[dict[str, Any]], expect: list[tuple[str, str]]
) -> None:
    events = condition_events(before, after)
    assert [(e.type, e.reason) for e in events] == expect
    for e in events:
        assert isinstance(e, Event) and e.message.endswith(e.reason)
