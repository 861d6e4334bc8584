"""ActionBatch: the pure status computation, and the manager that runs batches through the dispatcher.

A batch's durable truth is its status: the compact result of every finished action and, for the
ones running, the attempt in flight. A restarted operator reads it back, keeps what finished, and
hands the rest to the dispatcher with their attempt counts, so that running attempts are re-attached
on the agents instead of run again. Status is written by :class:`StatusWriter` only: at most once a
second per batch while it runs, plus the final write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from arl_tangram.api.actionbatch import IMMUTABLE_FIELDS, ActionBatchSpec, ActionResult
from arl_tangram.api.actionbatch import Action as BatchAction
from arl_tangram.api.validation import invalid_spec
from arl_tangram.controllers.conditions import ConditionReason, ConditionType, Event, set_condition
from arl_tangram.domain.actions import ActionOutcome, Outcome, Reason
from arl_tangram.domain.batches import (
    FINAL_STATES,
    act_stats,
    batch_request,
    compact_result,
    counts_of,
    fit_results,
    output_tail,
    rfc3339,
)
from arl_tangram.errors import (
    InvalidSpec,
    NotFound,
    QueueFull,
    Stopping,
    TargetUnavailable,
    UnsupportedType,
)

log = logging.getLogger(__name__)

# A running batch's status is written at most once per period; the write that completes it goes out
# at once (a trainer waits on it).
STATUS_PERIOD_S = 1.0
"""The longest a finished result waits before it is written (and the shortest gap between writes)."""
# The least an action refused for an outage waits before it is sent again (whatever the refusal
# said), so that a batch of thousands cannot spin the operator's loop.
HELD_RETRY_MIN_S = 1.0
# How long a deleted batch waits for its actions to stop before it cancels them and drops its state.
STOP_WAIT_S = 10.0
# How long an action waits for a target (ActionPool, RewardModelService) that does not exist yet
# before it fails PoolNotFound / ServiceNotFound. ``kubectl apply -f dir/`` applies files in name
# order (``actionbatch-*.yaml`` before ``actionpool-*.yaml``), and Helm, Argo CD or a trainer's own
# script may create the batch a moment before its pool: its actions all failed at once, though the
# pool came a second later. A name nobody creates (a typo) still fails, after this long.
TARGET_WAIT_S = 30.0
# How often an action waiting for its target looks again (the lookups of a batch's actions that
# look at once are one read of the API server: ``Dispatcher``'s learn).
TARGET_RECHECK_S = 2.0
# The longest a batch whose status write failed waits before it is tried again (the wait doubles
# from STATUS_PERIOD_S). A write the API server refuses for good (an admission policy, a field it
# finds invalid) was sent again every period for as long as the operator ran: each up to a
# megabyte, for every such batch, and a warning in the log each time.
WRITE_BACKOFF_MAX_S = 30.0
# The most whole outputs (stdout, stderr and message of finished actions, beyond the status's cut
# tails) the operator keeps in memory for ``GET .../results``. Batches without a TTL stay until they
# are deleted, so without a bound a trainer's thousands of batches grow the operator until its
# container's limit (2 GiB in the Deployment) kills it, and with it the queue. Past it the oldest
# finished actions' whole outputs go first; their rows are then served from the status, as after
# a restart (``outputWhole: false``).
WHOLE_OUTPUTS_BYTES = 512 * 2**20
# The longest time a status records (as milliseconds, ``durationMillis`` and ``queuedMillis``): the
# CRD's integers are int64, and a reward server answering a finite but absurd time (1e300 s) made
# the API server refuse (422) every write of its batch's status, for good: the batch never showed
# its results nor completed. 2**62 ms leaves room for a float's rounding below 2**63.
MAX_RECORDED_S = 2**62 / 1000


# ---- pure -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchObservation:
    """What a batch's status is computed from."""

    results: Mapping[str, ActionResult]
    conditions: Sequence[Mapping[str, Any]]
    generation: int | None
    start_time: datetime | None
    completion_time: datetime | None
    act_seconds: Sequence[float] = ()
    # Why some of its waiting actions cannot start (their target has no host coming:
    # ``TargetUnavailable``), one line per target.
    held_by: Sequence[str] = ()
    # The ACT summary its status held when this operator started (a restart, a failover): the
    # seconds behind it are gone, and until an action finishes here it is what there is.
    prior_act: Mapping[str, Any] | None = None
    # Why the spec's latest generation is not the one that runs (an edit of what cannot change,
    # which only a CRD older than its rule lets in); ``generation`` is then that refused one.
    edit_refused: str | None = None
    # State -> how many finished actions have no result here: those a restarted operator found
    # left out of a complete batch's status (``resultsOmitted``), counted by its ``counts``.
    unrecorded: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DeleteBatch:
    reason: str


def reconcile_actionbatch(
    spec: ActionBatchSpec, observed: BatchObservation, now: datetime
) -> tuple[dict[str, Any], list[DeleteBatch]]:
    """The batch's status (results in spec order, within the byte budget) and whether it is due for
    deletion (``ttlSecondsAfterFinished``)."""
    ordered = [observed.results[a.id] for a in spec.actions if a.id in observed.results]
    fitted, used, left_out = fit_results(ordered, spec.results.budget_bytes)
    unrecorded = [state for state, n in observed.unrecorded.items() for _ in range(n)]
    counts = counts_of(len(spec.actions), [r.state for r in ordered] + unrecorded)
    omitted = left_out + len(unrecorded)
    done = counts.succeeded + counts.failed + counts.cancelled == counts.total
    gen = observed.generation
    conds = set_condition(
        observed.conditions,
        ConditionType.ACCEPTED,
        True,
        ConditionReason.EDIT_REFUSED if observed.edit_refused else ConditionReason.QUEUED,
        observed.edit_refused or f"{counts.total} action(s) accepted",
        gen,
        now,
    )
    if done:
        completion = observed.completion_time or now
        conds = set_condition(
            conds,
            ConditionType.RUNNING,
            False,
            ConditionReason.ALL_FINISHED,
            "every action has finished",
            gen,
            now,
        )
        conds = set_condition(
            conds,
            ConditionType.COMPLETE,
            True,
            ConditionReason.ALL_FINISHED,
            f"{counts.succeeded} succeeded, {counts.failed} failed, {counts.cancelled} cancelled",
            gen,
            now,
        )
        failed = counts.failed + counts.cancelled
        conds = set_condition(
            conds,
            ConditionType.FAILED,
            failed > 0,
            ConditionReason.SOME_FAILED if failed else ConditionReason.NONE_FAILED,
            _failure_summary(ordered) if failed else "no action failed",
            gen,
            now,
        )
    else:
        completion = None
        running = counts.running > 0
        conds = set_condition(
            conds,
            ConditionType.RUNNING,
            running,
            ConditionReason.ACTIONS_RUNNING if running else ConditionReason.WAITING,
            f"{counts.running} running, {counts.pending} waiting"
            + "".join(f" ({why}; sent again when it has one)" for why in observed.held_by),
            gen,
            now,
        )
        conds = set_condition(
            conds,
            ConditionType.COMPLETE,
            False,
            ConditionReason.IN_PROGRESS,
            f"{counts.total - counts.pending - counts.running} of {counts.total} finished",
            gen,
            now,
        )
    if omitted:
        conds = set_condition(
            conds,
            ConditionType.RESULTS_OMITTED,
            True,
            ConditionReason.OVER_BUDGET,
            f"{omitted} of {len(ordered) + len(unrecorded)} result(s) left out of status.results to keep "
            f"them within spec.results.budgetBytes ({spec.results.budget_bytes}); status.counts counts "
            "them, and the gateway's results endpoint serves them while the operator that ran them does",
            gen,
            now,
        )
    elif any(c.get("type") == ConditionType.RESULTS_OMITTED.value for c in conds):
        # Left out before (read back after a restart, whose re-run actions are Running and small
        # again): the status holds every result now, and the condition must not say otherwise.
        conds = set_condition(
            conds,
            ConditionType.RESULTS_OMITTED,
            False,
            ConditionReason.WITHIN_BUDGET,
            "every result is in status.results, within spec.results.budgetBytes "
            f"({spec.results.budget_bytes})",
            gen,
            now,
        )
    # A batch's summary covers its own actions, so its window is its own span: from its first
    # action's start to its last one's end (to now while it runs). A pool's is its recent past.
    began, ended = observed.start_time, completion or now
    act = act_stats(observed.act_seconds, max(0.0, (ended - began).total_seconds()) if began else 0.0)
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "conditions": conds,
        "counts": counts.model_dump(by_alias=True),
        "results": [r.model_dump(by_alias=True, exclude_none=True, exclude_defaults=False) for r in fitted],
        "resultBytes": used,
        # None, not 0, while nothing is left out: a merge patch then writes no field
        "resultsOmitted": omitted or None,
        "act": act.model_dump(by_alias=True)
        if act
        else (dict(observed.prior_act) if observed.prior_act else None),
        "startTime": rfc3339(observed.start_time) if observed.start_time else None,
        "completionTime": rfc3339(completion) if completion else None,
    }
    due = deletion_due(spec, completion, now)
    return status, [due] if due else []


def refused_status(
    generation: int | None, conditions: Sequence[Mapping[str, Any]], message: str, now: datetime
) -> dict[str, Any]:
    """The status of a batch whose spec the operator cannot run (what the schema cannot check, such
    as the spec's size): Accepted=False with the reason, and nothing runs. ``Complete=False`` says
    the same, since ``kubectl get actionbatches`` shows that condition: with Accepted alone, its
    Complete and Reason columns stayed empty, as for a batch the operator had not seen."""
    for kind in (ConditionType.ACCEPTED, ConditionType.COMPLETE):
        conditions = set_condition(
            conditions, kind, False, ConditionReason.INVALID_SPEC, message, generation, now
        )
    return {"observedGeneration": generation, "conditions": conditions}


def unrecorded_status(
    status: Mapping[str, Any],
    written: Mapping[str, Any] | None,
    answer: str,
    results_at: str,
    now: datetime,
) -> dict[str, Any]:
    """The status to write when the API server refuses ``status`` for what it holds (an admission
    policy, a field it finds invalid, an object grown past etcd's limit): the same conditions and
    counts, the results as last ``written`` (accepted then; a restarted operator keeps them rather
    than finding none), and ``ResultsRecorded=False`` quoting its answer and saying where the
    results are served. Before, the batch kept its last status for good (or none: no condition,
    no counts), its end never said, while the full status was refused again and again."""
    conds = set_condition(
        status.get("conditions") or (),
        ConditionType.RESULTS_RECORDED,
        False,
        ConditionReason.STATUS_REFUSED,
        f"the API server refused the status with the results ({answer}); they are served at "
        f"GET {results_at}, and the full status is written again later",
        status.get("observedGeneration"),
        now,
    )
    kept = ("observedGeneration", "counts", "act", "startTime", "completionTime")
    out = {**{k: status.get(k) for k in kept}, "conditions": conds}
    if written and written.get("results"):
        out.update(
            results=written["results"],
            resultBytes=written.get("resultBytes"),
            resultsOmitted=written.get("resultsOmitted"),
        )
    return out


def deletion_due(spec: ActionBatchSpec, completion: datetime | None, now: datetime) -> DeleteBatch | None:
    """A finished batch whose ``ttlSecondsAfterFinished`` has passed is deleted."""
    ttl = spec.ttl_seconds_after_finished
    if completion is not None and ttl is not None and now >= completion + timedelta(seconds=ttl):
        return DeleteBatch(f"finished {ttl}s ago (ttlSecondsAfterFinished)")
    return None


def _failure_summary(results: Sequence[ActionResult]) -> str:
    reasons: dict[str, int] = {}
    for r in results:
        if r.state in ("Failed", "Cancelled"):
            reasons[r.reason or r.state] = reasons.get(r.reason or r.state, 0) + 1
    return ", ".join(f"{n} {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


def recordable(outcome: ActionOutcome) -> ActionOutcome:
    """``outcome`` as a status can hold it. Its numbers are the target's answer (a reward server of
    the user's own image may say anything): a time that is not a finite number of seconds, 0 or
    more, made the result fail to record (its action stayed Running, its batch never completed),
    and a score of NaN or infinity is no JSON (the API server refused every write of the batch's
    status, which stayed stale for good), as was a time past ``MAX_RECORDED_S``. A time is only a
    measurement: it is taken as 0. A score is the result: one that is no number fails the action,
    naming it."""
    fixes: dict[str, Any] = {}
    for name in ("duration_s", "queued_s"):
        value = getattr(outcome, name)
        if not math.isfinite(value) or not 0 <= value <= MAX_RECORDED_S:
            fixes[name] = 0.0
    if outcome.reward is not None and not math.isfinite(outcome.reward):
        fixes.update(
            state=Outcome.FAILED,
            reason=Reason.SANDBOX_ERROR,
            reward=None,
            message=f"the target answered a score of {outcome.reward}, which is not a finite number",
        )
    return dataclasses.replace(outcome, **fixes) if fixes else outcome


def recovered_results(status: Mapping[str, Any] | None) -> dict[str, ActionResult]:
    """The results a batch's status already holds (after an operator restart)."""
    out: dict[str, ActionResult] = {}
    for raw in (status or {}).get("results") or ():
        try:
            r = ActionResult.model_validate(raw)
        except ValueError:
            continue
        out[r.id] = r
    return out


def unrecorded_finished(
    status: Mapping[str, Any] | None, results: Mapping[str, ActionResult]
) -> dict[str, int]:
    """State -> how many actions of a complete batch have no final result in its ``status``: its
    counts less the final ``results`` recovered. Those were left out for the budget
    (``resultsOmitted``), or the API server refused the status that held them (``StatusRefused``:
    the results as last accepted, some still Running, beside the complete counts). A restarted
    operator ran those actions again, which turned a batch reported Complete back to running.
    Empty for a batch not complete: its actions without a result run again, as any not yet
    recorded does."""
    if not status or not status.get("completionTime"):
        return {}
    counts = status.get("counts") or {}
    out: dict[str, int] = {}
    for state in sorted(FINAL_STATES):
        held = sum(1 for r in results.values() if r.state == state)
        missing = int(counts.get(state.lower()) or 0) - held
        if missing > 0:
            out[state] = missing
    return out


# ---- the manager ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Batch:
    namespace: str
    name: str
    uid: str
    generation: int | None
    spec: ActionBatchSpec
    results: dict[str, ActionResult]
    conditions: list[Mapping[str, Any]]
    start_time: datetime | None
    completion_time: datetime | None
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    acts: list[float] = field(default_factory=list)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    dirty: bool = True
    written: dict[str, Any] | None = None
    deleting: bool = False
    ending: bool = False  # ``_end`` has begun: its actions are being stopped and its state dropped
    # Target -> the last TargetUnavailable one of its actions met there, until one of them starts.
    held_by: dict[str, str] = field(default_factory=dict)
    # The tasks of its actions waiting out a target's outage (``forget`` wakes them at once).
    held: set[asyncio.Task[None]] = field(default_factory=set)
    prior_act: Mapping[str, Any] | None = None  # BatchObservation.prior_act
    unrecorded: Mapping[str, int] = field(default_factory=dict)  # BatchObservation.unrecorded
    edit_refused: str | None = None  # BatchObservation.edit_refused
    write_failures: int = 0  # status writes failed in a row
    write_after: float = 0.0  # (the manager's clock) no write before, after failed ones
    refusal_said: bool = False  # the Warning Event of a refused status is posted (once per batch)
    # (kind, target) -> when (the manager's clock) one of its actions first found it missing, until
    # found (a pool and a service may share a name).
    missing_since: dict[tuple[str, str], float] = field(default_factory=dict)


Runner = Callable[..., Awaitable[ActionOutcome]]
PoolLookup = Callable[[str, str], Awaitable[Sequence[str] | None]]
"""(namespace, pool) -> the pool's languages, or None when no such ActionPool exists."""
StatusPatch = Callable[[str, str, str, dict[str, Any]], Awaitable[None]]
"""(namespace, name, uid, status): written to that object only, not to one made again under its name."""
Deleter = Callable[[str, str, str], Awaitable[None]]
"""(namespace, name, uid): that object only."""
BatchEventSink = Callable[[str, str, str, Event], None]
"""(namespace, name, uid, event): posted on that object."""


class StatusRefused(Exception):
    """A :data:`StatusPatch` the API server refused for what the status holds (not for being away):
    sending it again cannot help until something changes, so a status without the new results is
    written meanwhile (:func:`unrecorded_status`)."""


def completion_event(status: Mapping[str, Any]) -> Event:
    """The Event of a batch's completion (pure): Normal when every action succeeded, Warning naming
    how many failed and why otherwise. A batch's end showed only in its conditions, so nothing
    that watches Events (``kubectl get events``, alerting on Warnings) heard of a failed batch."""
    conds = {c.get("type"): c for c in status.get("conditions") or ()}
    complete = conds.get(ConditionType.COMPLETE.value) or {}
    failed = conds.get(ConditionType.FAILED.value) or {}
    if failed.get("status") == "True":
        return Event(
            "Warning",
            ConditionReason.SOME_FAILED.value,
            f"{complete.get('message', '')}: {failed.get('message', '')}",
        )
    return Event("Normal", ConditionReason.ALL_FINISHED.value, str(complete.get("message", "")))


class BatchManager:
    """Runs every batch's actions and keeps their results; :meth:`flush` writes changed statuses."""

    def __init__(
        self,
        run: Runner,
        cancel: Callable[[str], Awaitable[bool]],
        pool_languages: PoolLookup,
        patch_status: StatusPatch,
        delete: Deleter,
        whole_outputs_bytes: int = WHOLE_OUTPUTS_BYTES,
        emit: BatchEventSink | None = None,
    ) -> None:
        self._run = run
        self._emit: BatchEventSink = emit or (lambda namespace, name, uid, event: None)
        self._cancel = cancel
        self._pool_languages = pool_languages
        self._patch = patch_status
        self._delete = delete
        self._batches: dict[tuple[str, str], _Batch] = {}
        # Batches whose spec cannot be run: (uid, generation) and the status saying why, until
        # written (``None`` then).
        self._refused: dict[tuple[str, str], tuple[tuple[str, Any], dict[str, Any] | None]] = {}
        self._by_key: dict[str, tuple[_Batch, str, str]] = {}  # key -> batch, action id, target
        self.writes = 0
        self._finished = asyncio.Event()  # a batch's last action ended: write without waiting
        self._ending: set[asyncio.Task[None]] = set()  # batches replaced under their name, ending
        # Whole outputs kept, oldest finished first: (batch, action id) -> the memory they hold
        # (``_memory``), and the total, bounded by ``whole_budget``.
        self.whole_budget = whole_outputs_bytes
        self._whole: OrderedDict[tuple[_Batch, str], int] = OrderedDict()
        self.whole_bytes = 0
        self.clock: Callable[[], float] = time.monotonic
        self.target_wait_s = TARGET_WAIT_S

    def ensure(self, body: Mapping[str, Any]) -> None:
        """Start (or resume) the batch in ``body``: every action without a final result is run."""
        meta = body.get("metadata") or {}
        ident = (str(meta.get("namespace")), str(meta.get("name")))
        batch = self._batches.get(ident)
        if batch is not None and batch.uid == meta.get("uid"):
            self._refresh(batch, meta, body.get("spec") or {})
            return
        if batch is not None and not batch.ending:
            # Another batch held the name: it was deleted (its deletion not heard yet, or never:
            # a watch that restarted lists what is, not what went). Its actions must not run on
            # for an object that is gone. (Also one its TTL deleted: its deletion, heard after
            # this, no longer finds it under the name, and its keys and whole outputs stayed.)
            ending = asyncio.get_running_loop().create_task(self._end(batch), name=f"end {batch.uid}")
            self._ending.add(ending)  # (the loop holds tasks weakly)
            ending.add_done_callback(self._ending.discard)
        status = body.get("status") or {}
        version = (str(meta.get("uid")), meta.get("generation"))
        refused = self._refused.get(ident)
        if refused is not None and refused[0] == version:
            return
        try:
            spec = ActionBatchSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            # What the schema cannot check (the spec's size): said in the batch's status, where
            # its author looks. Raised here, kopf logged it and the batch said nothing, ever.
            message = str(invalid_spec(exc, "spec"))
            log.warning("batch %s/%s refused: %s", ident[0], ident[1], message)
            conditions = status.get("conditions") or ()
            self._refused[ident] = (
                version,
                refused_status(version[1], conditions, message, datetime.now(UTC)),
            )
            self._finished.set()
            return
        self._refused.pop(ident, None)
        results = recovered_results(status)
        unrecorded = unrecorded_finished(status, results)
        if unrecorded:
            # A complete batch: a result not final is one written before its action finished (a
            # later status was refused), and the counts say it did.
            results = {k: r for k, r in results.items() if r.state in FINAL_STATES}
        batch = _Batch(
            namespace=ident[0],
            name=ident[1],
            uid=str(meta.get("uid")),
            generation=meta.get("generation"),
            spec=spec,
            results=results,
            conditions=list(status.get("conditions") or ()),
            start_time=_parse_time(status.get("startTime")),
            completion_time=_parse_time(status.get("completionTime")),
            prior_act=status.get("act") or None,
            # What the API server holds: a status computed the same is not written again (a
            # restart wrote every finished batch's status, each up to a megabyte, at once).
            written=_present(status) if status else None,
        )
        self._batches[ident] = batch
        batch.unrecorded = unrecorded
        for action in spec.actions:
            prior = results.get(action.id)
            if prior is not None and prior.state in FINAL_STATES:
                continue
            if prior is None and unrecorded:
                # Finished, its result not in the complete batch's status: not run again.
                continue
            attempts = prior.attempts if prior is not None else 0
            batch.tasks[action.id] = asyncio.get_running_loop().create_task(
                self._one(batch, action, attempts), name=f"{ident[0]}/{ident[1]}/{action.id}"
            )
        batch.dirty = True

    def _refresh(self, batch: _Batch, meta: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
        """A change to a running batch's spec: only ``ttlSecondsAfterFinished`` may change (the
        CRD refuses the rest); its generation is then the one observed. An edit of the rest, which
        a CRD older than that rule lets in (Helm never upgrades a chart's CRDs), is refused in the
        status: ``Accepted`` names the fields, its generation observed, a Warning Event once. It was
        only logged: the batch said nothing, its observedGeneration lagging for good."""
        generation = meta.get("generation")
        if generation == batch.generation:
            return
        try:
            spec = ActionBatchSpec.model_validate(raw)
        except ValidationError as exc:
            changed: list[str] | str = str(invalid_spec(exc, "spec"))
        else:
            changed = [
                f"spec.{alias}"
                for name, alias in _IMMUTABLE
                if spec.model_dump(include={name}) != batch.spec.model_dump(include={name})
            ]
        batch.generation = generation
        batch.dirty = True
        if not changed:
            batch.edit_refused = None
            batch.spec = batch.spec.model_copy(
                update={"ttl_seconds_after_finished": spec.ttl_seconds_after_finished}
            )
            return
        what = changed if isinstance(changed, str) else f"{', '.join(sorted(changed))} changed"
        batch.edit_refused = (
            f"generation {generation} refused ({what}): only ttlSecondsAfterFinished may change once the "
            "ActionBatch exists, and the actions accepted first run; create another ActionBatch"
        )
        log.warning("batch %s/%s: %s", batch.namespace, batch.name, batch.edit_refused)
        self._emit(
            batch.namespace,
            batch.name,
            batch.uid,
            Event("Warning", ConditionReason.EDIT_REFUSED.value, batch.edit_refused),
        )

    def started(self, key: str, attempt: int) -> None:
        """The dispatcher started an attempt: the action is Running with that many attempts."""
        found = self._by_key.get(key)
        if found is None:
            return
        batch, action_id, target = found
        if batch.held_by.pop(target, None) is not None:
            batch.dirty = True
        prior = batch.results.get(action_id)
        if prior is not None and prior.state in FINAL_STATES:
            return
        batch.results[action_id] = ActionResult(id=action_id, state="Running", attempts=attempt)
        if batch.start_time is None:
            batch.start_time = datetime.now(UTC)
        batch.dirty = True

    async def _one(self, batch: _Batch, action: BatchAction, attempts: int) -> None:
        action_id = action.id
        started = asyncio.get_running_loop().time()
        outcome: ActionOutcome
        try:
            while True:
                try:
                    outcome = await self._attempt(batch, action, attempts)
                    break
                except NotFound as exc:
                    await self._wait_for_target(batch, action.target, exc)
        except UnsupportedType as exc:
            outcome = ActionOutcome(action_id, Outcome.FAILED, Reason.UNSUPPORTED_TYPE, str(exc))
        except InvalidSpec as exc:
            outcome = ActionOutcome(action_id, Outcome.FAILED, Reason.INVALID_PAYLOAD, str(exc))
        except NotFound as exc:
            reason = Reason.POOL_NOT_FOUND if exc.kind == "ActionPool" else Reason.SERVICE_NOT_FOUND
            outcome = ActionOutcome(action_id, Outcome.FAILED, reason, str(exc))
        except asyncio.CancelledError:
            if not batch.deleting:
                raise
            outcome = ActionOutcome(action_id, Outcome.CANCELLED, Reason.CANCELLED, "the batch was deleted")
        except Exception as exc:  # a fault of the operator's own: the action ends, the batch with it
            # Without a result the action stayed Pending and its batch never completed. The reason
            # is the platform's (a trainer may send the action again), never the program's.
            log.exception("action %s of %s/%s failed in the operator", action_id, batch.namespace, batch.name)
            message = f"the operator failed to run it: {type(exc).__name__}: {exc}"
            outcome = ActionOutcome(action_id, Outcome.FAILED, Reason.SANDBOX_ERROR, message)
        self._record(batch, action_id, outcome, asyncio.get_running_loop().time() - started)

    async def _attempt(self, batch: _Batch, action: BatchAction, attempts: int) -> ActionOutcome:
        """``action`` sent to its target until it has an outcome; ``NotFound`` where its target
        does not exist."""
        languages = (
            await self._pool_languages(batch.namespace, action.target) if action.type != "reward" else ()
        )
        if languages is None:
            raise NotFound(
                "ActionPool",
                action.target,
                f"ActionPool {action.target!r} not found in namespace {batch.namespace!r}",
            )
        if batch.deleting:
            # Deleted while its pool was looked up (a read of the API server): ``forget``
            # cancelled the keys it knew, not this one's, and its action must not start now.
            raise asyncio.CancelledError
        request = batch_request(batch.namespace, batch.uid, batch.spec, action, languages)
        self._by_key[request.key] = (batch, action.id, action.target)
        if action.type != "reward":  # its pool exists (a service shows it by answering, below)
            batch.missing_since.pop(("ActionPool", action.target), None)
        while True:
            try:
                outcome = await self._run(request, attempts_so_far=attempts)
                if batch.held_by.pop(action.target, None) is not None:  # its target served it
                    batch.dirty = True
                if action.type == "reward":
                    batch.missing_since.pop(("RewardModelService", action.target), None)
                return outcome
            except QueueFull as exc:
                await asyncio.sleep(exc.retry_after)  # a batch waits its turn; it is never dropped
            except Stopping:
                # This operator stops: the action is the next leader's (it re-attaches).
                raise asyncio.CancelledError from None
            except TargetUnavailable as exc:
                # Its target has no host coming: the batch waits for one (a node may be added,
                # the image fixed), its status saying why, where a caller on the wire is told
                # at once.
                if batch.held_by.get(action.target) != str(exc):
                    batch.held_by[action.target] = str(exc)
                    batch.dirty = True
                await self._held(batch, exc.delay)

    async def _wait_for_target(self, batch: _Batch, target: str, exc: NotFound) -> None:
        """Wait a while for ``target``, which does not exist (yet): raise ``exc`` once it has been
        missing for ``target_wait_s`` (counted from the first of the batch's actions to miss it),
        the batch's status saying meanwhile what it waits for."""
        if exc.kind not in ("ActionPool", "RewardModelService"):
            raise exc
        now = self.clock()
        since = batch.missing_since.setdefault((exc.kind, target), now)
        if now - since >= self.target_wait_s:
            if batch.held_by.pop(target, None) is not None:  # no longer waited for: not said so
                batch.dirty = True
            raise exc
        why = f"{exc}; waiting up to {self.target_wait_s:g} s for it to be created"
        if batch.held_by.get(target) != why:
            batch.held_by[target] = why
            batch.dirty = True
        await self._held(batch, min(TARGET_RECHECK_S, since + self.target_wait_s - now))

    @staticmethod
    async def _held(batch: _Batch, delay_s: float) -> None:
        """Wait out a target's outage before sending the action again; a batch deleted meanwhile
        ends the wait at once (``forget``) and the action with it (``CancelledError``)."""
        if batch.deleting:  # deleted while its refusal was on its way: ``forget`` has passed
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        batch.held.add(task)
        try:
            await asyncio.sleep(max(delay_s, HELD_RETRY_MIN_S))
        finally:
            batch.held.discard(task)
        if batch.deleting:
            raise asyncio.CancelledError

    def _record(self, batch: _Batch, action_id: str, outcome: ActionOutcome, act_s: float) -> None:
        outcome = recordable(outcome)
        result = compact_result(action_id, outcome, batch.spec.results.output_bytes_per_action)
        if (
            outcome.reason is not None
            and outcome.message
            and outcome.state is Outcome.FAILED
            and not result.output
        ):
            # A failure with no output says why in the output, so `kubectl get -o yaml` shows it:
            # its tail, as of any output (where a traceback or an error chain ends with its cause),
            # within the same bytes, and said to be cut when it is.
            said, cut = output_tail(outcome.message, batch.spec.results.output_bytes_per_action)
            result = result.model_copy(update={"output": said or None, "truncated": result.truncated or cut})
        batch.results[action_id] = result
        batch.outcomes[action_id] = {
            "id": action_id,
            "state": outcome.state.value,
            "reason": outcome.reason.value if outcome.reason else None,
            "message": outcome.message,
            "exitCode": outcome.exit_code,
            "reward": outcome.reward,
            "stdout": outcome.stdout,
            "stderr": outcome.stderr,
            "attempts": outcome.attempts,
            "durationSeconds": outcome.duration_s,
            "queuedSeconds": outcome.queued_s,
            "host": outcome.host,
            "cores": list(outcome.cores),
            # Whole as the operator got it; the agent may have capped a stream (its output limit).
            "truncated": outcome.truncated,
            "outputWhole": True,
        }
        if not batch.ending:  # (an ended batch's go with it: accounted, they kept it in memory)
            kept = _memory(outcome.stdout) + _memory(outcome.stderr) + _memory(outcome.message)
            self._keep_whole(batch, action_id, kept)
        batch.acts.append(act_s)
        batch.tasks.pop(action_id, None)
        if batch.start_time is None:
            batch.start_time = datetime.now(UTC)
        batch.dirty = True
        if not batch.tasks:
            self._finished.set()

    def _keep_whole(self, batch: _Batch, action_id: str, size: int) -> None:
        """Account for the whole output just recorded, and drop the oldest ones past the budget
        (never the one just recorded: a results read right after its action ended finds it)."""
        self._drop_whole(batch, action_id)  # a result recorded again replaces its old one
        self._whole[(batch, action_id)] = size
        self.whole_bytes += size
        dropped = 0
        while self.whole_bytes > self.whole_budget and len(self._whole) > 1:
            (old, old_id), old_size = self._whole.popitem(last=False)
            self.whole_bytes -= old_size
            old.outcomes.pop(old_id, None)
            dropped += 1
        if dropped:
            log.info(
                "whole outputs of %d finished actions dropped from memory (over %d MiB); their results "
                "are served from the status's tails (outputWhole false)",
                dropped,
                self.whole_budget // 2**20,
            )

    def _drop_whole(self, batch: _Batch, action_id: str) -> None:
        size = self._whole.pop((batch, action_id), None)
        if size is not None:
            self.whole_bytes -= size

    def status_of(self, batch: _Batch, now: datetime) -> tuple[dict[str, Any], list[DeleteBatch]]:
        observed = BatchObservation(
            results=batch.results,
            conditions=batch.conditions,
            generation=batch.generation,
            start_time=batch.start_time,
            completion_time=batch.completion_time,
            act_seconds=batch.acts,
            held_by=tuple(batch.held_by[t] for t in sorted(batch.held_by)),
            prior_act=batch.prior_act,
            edit_refused=batch.edit_refused,
            unrecorded=batch.unrecorded,
        )
        status, ops = reconcile_actionbatch(batch.spec, observed, now)
        if status["completionTime"] and batch.completion_time is None:
            batch.completion_time = now
        return status, ops

    async def flush(self) -> None:
        """Write the status of every batch that changed since its last write; delete those due."""
        now = datetime.now(UTC)
        for ident, (version, refusal) in list(self._refused.items()):
            if refusal is None:
                continue
            try:
                await self._patch(ident[0], ident[1], str(version[0]), refusal)
                self.writes += 1
                self._refused[ident] = (version, None)
                accepted = next(c for c in refusal["conditions"] if c["type"] == ConditionType.ACCEPTED.value)
                self._emit(
                    ident[0],
                    ident[1],
                    str(version[0]),
                    Event("Warning", ConditionReason.INVALID_SPEC.value, str(accepted["message"])),
                )
            except Exception as exc:  # the API server may be restarting: try again next period
                log.warning("status of batch %s/%s not written: %s", ident[0], ident[1], exc)
        for batch in list(self._batches.values()):
            if batch.deleting:
                continue
            if batch.dirty:
                status, ops = self.status_of(batch, now)
            else:
                # Nothing changed since the last write: only its TTL can have come (computing the
                # status of every finished batch each period would cost per result, forever).
                due = deletion_due(batch.spec, batch.completion_time, now)
                status, ops = {}, [due] if due else []
            # Deleted only once the status that completes it is written: with a short TTL (0: "at
            # once") the batch went with that status unwritten, and whoever waited for it to
            # complete (``kubectl wait``, a trainer's watch) saw it vanish instead, its results
            # unknown.
            if ops and (batch.written or {}).get("completionTime"):
                await self._delete_due(batch, ops[0])
                continue
            if not batch.dirty or self.clock() < batch.write_after:
                continue
            batch.dirty = False
            if _present(status) == batch.written:
                continue
            batch.conditions = status["conditions"]
            completes = bool(status.get("completionTime")) and not (batch.written or {}).get("completionTime")
            try:
                await self._patch(batch.namespace, batch.name, batch.uid, status)
                self.writes += 1
                batch.written = _present(status)
            except Exception as exc:  # the API server may be restarting: try again, backing off
                batch.write_failures += 1
                wait = min(STATUS_PERIOD_S * 2 ** (batch.write_failures - 1), WRITE_BACKOFF_MAX_S)
                batch.write_after = self.clock() + wait
                log.warning(
                    "status of batch %s/%s not written (%d failed in a row; next try in %g s): %s",
                    batch.namespace,
                    batch.name,
                    batch.write_failures,
                    wait,
                    exc,
                )
                batch.dirty = True
                if isinstance(exc, StatusRefused):
                    await self._write_unrecorded(batch, status, str(exc), completes, now)
                continue
            batch.write_failures, batch.write_after = 0, 0.0
            if completes:  # once: a restarted operator reads the completed status back
                self._emit(batch.namespace, batch.name, batch.uid, completion_event(status))
            if ops:
                await self._delete_due(batch, ops[0])

    async def _write_unrecorded(
        self, batch: _Batch, status: Mapping[str, Any], answer: str, completes: bool, now: datetime
    ) -> None:
        """Write the status without its new results (``unrecorded_status``), so that the batch
        still says how far it is, that it completed, and why its results are not there."""
        results_at = f"/v1/batches/{batch.namespace}/{batch.name}/results"
        # The condition as last written, so that its transition time holds while refusals repeat
        # (each would otherwise be a new status to write).
        said = [
            c
            for c in (batch.written or {}).get("conditions") or ()
            if c.get("type") == ConditionType.RESULTS_RECORDED.value
        ]
        base = {**status, "conditions": [*status["conditions"], *said]}
        fallback = _present(unrecorded_status(base, batch.written, answer, results_at, now))
        if fallback == batch.written:
            return
        try:
            await self._patch(batch.namespace, batch.name, batch.uid, fallback)
        except Exception as exc:  # nothing more to fall back on: the full status is tried again
            log.warning(
                "status of batch %s/%s without results not written either: %s",
                batch.namespace,
                batch.name,
                exc,
            )
            return
        self.writes += 1
        batch.written = fallback
        if not batch.refusal_said:
            batch.refusal_said = True
            message = next(
                c["message"]
                for c in fallback["conditions"]
                if c["type"] == ConditionType.RESULTS_RECORDED.value
            )
            self._emit(
                batch.namespace,
                batch.name,
                batch.uid,
                Event("Warning", ConditionReason.STATUS_REFUSED.value, message),
            )
        if completes:
            self._emit(batch.namespace, batch.name, batch.uid, completion_event(fallback))

    async def _delete_due(self, batch: _Batch, due: DeleteBatch) -> None:
        batch.deleting = True
        log.info("deleting batch %s/%s: %s", batch.namespace, batch.name, due.reason)
        await self._delete(batch.namespace, batch.name, batch.uid)

    async def run_writer(self) -> None:
        """Flush every period, forever (one place writes every batch status)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._finished.wait(), STATUS_PERIOD_S)
            self._finished.clear()
            await self.flush()

    async def forget(self, namespace: str, name: str, uid: str = "") -> None:
        """The batch (of ``uid``; "": whichever holds the name) is being deleted: cancel its queued
        and running actions and drop its state. A batch made again under its name is another
        object (kopf hears each uid on its own, so its events may come while this one's deletion
        is still being handled, or before it): it is left alone."""
        ident = (namespace, name)
        refused = self._refused.get(ident)
        if refused is not None and (not uid or refused[0][0] == uid):
            del self._refused[ident]
        batch = self._batches.get(ident)
        if batch is None or (uid and batch.uid != uid):
            return
        await self._end(batch)

    async def _end(self, batch: _Batch) -> None:
        """Cancel the batch's queued and running actions and drop its state (its object is gone)."""
        batch.deleting = batch.ending = True
        for task in batch.held:  # waiting out an outage: nothing of theirs is in the dispatcher
            task.cancel()
        keys = [k for k, (b, _, _) in self._by_key.items() if b is batch]
        await asyncio.gather(*(self._cancel(k) for k in keys), return_exceptions=True)
        tasks = list(batch.tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
            for task in pending:
                task.cancel()
        for k in keys:
            self._by_key.pop(k, None)
        for action_id in list(batch.outcomes):  # after its tasks: none records any more
            self._drop_whole(batch, action_id)
        if self._batches.get((batch.namespace, batch.name)) is batch:  # not one made again since
            del self._batches[(batch.namespace, batch.name)]

    def has(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self._batches

    async def results(self, namespace: str, name: str) -> AsyncIterator[dict[str, Any]] | None:
        """Every finished action's full result (outputs not cut to the status budget), spec order."""
        batch = self._batches.get((namespace, name))
        if batch is None:
            return None

        async def rows() -> AsyncIterator[dict[str, Any]]:
            for action in batch.spec.actions:
                row = batch.outcomes.get(action.id)
                if row is not None:
                    yield row
                    continue
                state = batch.results.get(action.id)
                if state is None and batch.unrecorded:
                    # Finished before this operator started, its result not in the status
                    # (``unrecorded_finished``): nothing of it is known here but that it ended.
                    yield {"id": action.id, "state": "Unknown", "message": _UNRECORDED}
                    continue
                if state is None or state.state not in FINAL_STATES:
                    yield {"id": action.id, "state": state.state if state else "Pending"}
                    continue
                # Finished before this operator started (a restart, a failover): its whole output
                # was in the memory of the one before. What the status kept is served, and said to
                # be all there is; a row with only its state looked like an action with no output.
                # The same keys as a whole row's: the streams unknown (None), their kept tail in
                # ``output``.
                yield {
                    "id": action.id,
                    "state": state.state,
                    "reason": state.reason,
                    "message": None,
                    "exitCode": state.exit_code,
                    "reward": state.reward,
                    "stdout": None,
                    "stderr": None,
                    "attempts": state.attempts,
                    "durationSeconds": _seconds(state.duration_millis),
                    "queuedSeconds": _seconds(state.queued_millis),
                    "host": None,
                    "cores": [],
                    "output": state.output,
                    "truncated": state.truncated,
                    "outputWhole": False,
                }

        return rows()

    def pending_count(self) -> int:
        return sum(len(b.tasks) for b in self._batches.values())


_UNRECORDED = (
    "finished before this operator started; its result is not in the status (left out to keep it "
    "within spec.results.budgetBytes, or in a status the API server refused), and its output was in "
    "the memory of the operator before"
)

# What cannot change once a batch exists (the CRD's transition rule): (field, its name in the spec).
_IMMUTABLE = tuple(
    (name, field.alias or name)
    for name, field in ActionBatchSpec.model_fields.items()
    if (field.alias or name) in IMMUTABLE_FIELDS
)


def _present(status: Mapping[str, Any]) -> dict[str, Any]:
    """A status as the API server keeps it: a merge patch's ``None`` removes a field."""
    return {k: v for k, v in status.items() if v is not None}


def _memory(text: str | None) -> int:
    """Bytes of memory ``text`` holds: CPython stores a string in 1, 2 or 4 bytes a character (its
    widest), so counting characters took outputs of emoji or a progress bar's blocks for a quarter
    or half of what they hold."""
    return sys.getsizeof(text) if text else 0


def _seconds(millis: int | None) -> float | None:
    return None if millis is None else millis / 1000


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return None
