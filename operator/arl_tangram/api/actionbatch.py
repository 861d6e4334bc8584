"""ActionBatch: the actions of one trainer step, posted as one object.

One object carries up to :data:`MAX_ACTIONS` actions and their compact results; never one Kubernetes
object per action, because the API server is not built for millions of short-lived objects.

Size budget (etcd refuses objects over 1.5 MiB): the spec, payloads included, may take at most
:data:`MAX_SPEC_BYTES` (640 KiB) as the API server stores it (:func:`~arl_tangram.api.meta.stored_size`),
and the results at most ``spec.results.budgetBytes`` (256 KiB by default,
:data:`MAX_RESULT_BUDGET_BYTES` = 384 KiB at most), counted the same way. Together with metadata and
the per-action result fields the object stays near 1 MiB in the worst case, well under the limit.

So the spec's bytes, not :data:`MAX_ACTIONS`, bound a batch of realistic actions: 1024 fit only at
about 600 bytes each, while programs of a few KiB fit by the hundred (the CRD's description of
``spec.actions`` and the operator's refusal both say how many).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal, Self, get_args

from pydantic import Field, field_validator, model_validator

from arl_tangram.api.meta import (
    API_VERSION,
    DNS_SUBDOMAIN_PATTERN,
    ActStats,
    CelRule,
    Conditions,
    ObjectMeta,
    TangramModel,
    TransitionRule,
    defaulted,
    field_error,
    no_duplicates,
    stored_size,
)

ActionType = Literal["code", "test", "reward", "http"]
ACTION_TYPES: tuple[str, ...] = get_args(ActionType)
# Which kind of object an action's target names.
POOL_ACTION_TYPES = frozenset({"code", "test", "http"})
SERVICE_ACTION_TYPES = frozenset({"reward"})
ActionState = Literal["Pending", "Running", "Succeeded", "Failed", "Cancelled"]
ACTION_STATES: tuple[str, ...] = get_args(ActionState)

MAX_ACTIONS = 1024
"""Most actions in one ActionBatch (see the module docstring for the size budget behind it)."""
MAX_SPEC_BYTES = 640 * 1024
"""Most bytes the spec may take as the API server stores it (``stored_size``), payloads included."""
# About what an action with 4 KiB of code takes as JSON (its id, type, target, options and keys add
# 100 to 250 bytes): the example by which the CRD says how many realistic actions fit in MAX_SPEC_BYTES.
TYPICAL_ACTION_BYTES = 4 * 1024 + 256
MAX_RESULT_BUDGET_BYTES = 384 * 1024
"""Largest allowed ``spec.results.budgetBytes``."""
MAX_OUTPUT_BYTES_PER_ACTION = 64 * 1024
MAX_ACTION_ID_LENGTH = 128
MAX_TARGET_LENGTH = 63
ACTION_ID_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$"


class UnitRange(TangramModel):
    """Units of the action's key elastic resource: cores for code and test, GPUs for reward."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.min <= self.max",
            message="min must not exceed max",
            check=lambda s: s.min <= s.max,
            field="min",
        ),
    )

    min: int = Field(default=1, ge=1, le=1024, description="Fewest units the action runs with.")
    max: int = Field(default=1, ge=1, le=1024, description="Most units the action can use (its top DoP).")


class Action(TangramModel):
    """One atomic call to an external resource."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.sessionId) || self.type == 'code' || self.type == 'test'",
            message="sessionId applies only to code and test actions",
            check=lambda s: s.session_id is None or s.type in ("code", "test"),
            field="sessionId",
        ),
    )

    id: str = Field(
        min_length=1,
        max_length=MAX_ACTION_ID_LENGTH,
        pattern=ACTION_ID_PATTERN,
        description="Identifier of the action, unique within the batch; its result carries the same id.",
    )
    type: ActionType = Field(
        description="code: run a program in a sandbox; test: run tests that compute a reward; reward: call "
        "a reward model; http: reserved for an outbound call from a sandbox host of the target pool, "
        "not served by this release (the action fails with UnsupportedType)."
    )
    target: str = Field(
        min_length=1,
        max_length=MAX_TARGET_LENGTH,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of the ActionPool (code, test, http) or RewardModelService (reward) in this "
        "namespace that runs the action.",
    )
    payload: dict[str, Any] = Field(
        description="What to run, in the target's terms: for code, e.g. {language, code, stdin, files}; "
        "for reward, e.g. {prompt, response}. Free-form; checked by the target when the action runs.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    units: UnitRange | None = Field(
        default=None, description="Units of the key elastic resource; unset: exactly one unit."
    )
    timeout_seconds: int | None = Field(
        default=None, ge=1, le=86400, description="Wall-clock limit; unset: the target's own limit."
    )
    session_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=ACTION_ID_PATTERN,
        description="Session (trajectory) whose state the action uses and keeps: working directory, "
        "live interpreter. Actions of one session run one at a time, in order.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Higher runs first among actions that arrived together; order is otherwise FCFS.",
    )


class RetryPolicy(TangramModel):
    """Retries of actions that failed because of the platform (a host lost), never of failing code."""

    max_retries: int = Field(default=2, ge=0, le=10, description="Most retries of one action.")
    backoff_seconds: int = Field(default=1, ge=0, le=600, description="Wait before the first retry; doubles.")


class ResultBudget(TangramModel):
    """How much of the object the results may take, so it stays well under etcd's object size limit."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.outputBytesPerAction <= self.budgetBytes",
            message="outputBytesPerAction must not exceed budgetBytes",
            check=lambda s: s.output_bytes_per_action <= s.budget_bytes,
            field="outputBytesPerAction",
        ),
    )

    budget_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        le=MAX_RESULT_BUDGET_BYTES,
        description="Bytes of all results together in status, as the API server stores them (JSON in "
        "UTF-8, where <, > and & take 6 bytes each); beyond it outputs are dropped (truncated), then whole "
        "results (status.resultsOmitted counts them).",
    )
    output_bytes_per_action: int = Field(
        default=1024,
        ge=0,
        le=MAX_OUTPUT_BYTES_PER_ACTION,
        description="Bytes of output kept per action in status (the tail); full output goes to the caller "
        "of the gateway, not into the object.",
    )


# The spec's fields (as the API names them) that cannot change once the ActionBatch exists: the
# CRD's transition rule below, and the operator's check for an edit an older CRD let in.
IMMUTABLE_FIELDS = ("actions", "retryPolicy", "results")


class ActionBatchSpec(TangramModel):
    """Desired state of an ActionBatch: the actions to run."""

    # The operator runs the actions it accepted: an edit was ignored until a restart, which then
    # ran the new actions of a batch already reported Complete. As a Job's template, only the
    # time to keep it may change (both policies are defaulted, so present on either side).
    transition_rules: ClassVar[tuple[TransitionRule, ...]] = (
        TransitionRule(
            rule=" && ".join(f"self.{f} == oldSelf.{f}" for f in IMMUTABLE_FIELDS),
            message="actions, retryPolicy and results cannot change once the ActionBatch exists "
            "(the operator runs the actions it accepted): create another ActionBatch",
        ),
    )

    actions: list[Action] = Field(
        min_length=1,
        max_length=MAX_ACTIONS,
        description=f"The actions, at most {MAX_ACTIONS}; ids are unique. The whole spec, payloads "
        f"included, may take at most {MAX_SPEC_BYTES // 1024} KiB as the API server stores it (JSON in "
        "UTF-8, where <, > and & take 6 bytes each), which bounds realistic batches "
        f"first: about {MAX_SPEC_BYTES // TYPICAL_ACTION_BYTES} actions of 4 KiB of code each. Split a "
        "larger step into several ActionBatches: a spec over that size is refused by the operator "
        "(Accepted=False, naming how many of its actions fit), and an object over etcd's limit (about "
        '1.5 MiB) by the API server itself ("etcdserver: request is too large"). Create large batches '
        "with kubectl create or kubectl apply --server-side: client-side apply copies the object into "
        "an annotation, which holds at most 256 KiB.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    retry_policy: RetryPolicy = defaulted(RetryPolicy, "Retries after infrastructure failures.")
    results: ResultBudget = defaulted(ResultBudget, "Size budget of the results in status.")
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=2592000,
        description="Delete the batch this long after it completes; unset: keep it.",
    )

    @field_validator("actions")
    @classmethod
    def _unique_ids(cls, actions: list[Action]) -> list[Action]:
        seen: dict[str, int] = {}
        for index, action in enumerate(actions):
            if action.id in seen:
                raise field_error(
                    f"[{index}].id", f"duplicate action id {action.id!r} (first at index {seen[action.id]})"
                )
            seen[action.id] = index
        return actions

    @model_validator(mode="after")
    def _fits_size_budget(self) -> Self:
        # Only the models can check this: a schema cannot bound the size of free-form payloads.
        size = stored_size(self.model_dump_json(by_alias=True, exclude_none=True))
        if size > MAX_SPEC_BYTES:
            raise field_error("actions", oversize_message(self.actions, size))
        return self


def oversize_message(actions: list[Action], size: int) -> str:
    """Why a spec of ``size`` bytes is refused, and what to do: how many of its actions one batch
    holds at their size. "Split the actions" alone left a user of 1,000 small-enough-looking
    actions (the CRD allows 1024) to guess how many to put in each batch."""
    sizes = [stored_size(a.model_dump_json(by_alias=True, exclude_none=True)) for a in actions]
    said = (
        f"the spec takes {size} bytes as JSON, over the {MAX_SPEC_BYTES} allowed "
        f"({MAX_SPEC_BYTES // 1024} KiB)"
    )
    room = MAX_SPEC_BYTES - (size - sum(sizes))  # what the actions may take besides the spec's other fields
    largest = max(range(len(actions)), key=sizes.__getitem__)
    if sizes[largest] > room:
        # Splitting cannot help an action that does not fit a batch on its own.
        return (
            f"{said}; action {actions[largest].id!r} alone takes {sizes[largest]} bytes, more than any "
            "ActionBatch holds: make its payload smaller"
        )
    average = sum(sizes) / len(sizes)
    fit = max(1, int(room // average))
    batches = -(-len(actions) // fit)
    return (
        f"{said}: its {len(actions)} actions average {average:.0f} bytes, of which one ActionBatch holds "
        f"about {fit}; split the actions into several ActionBatches ({batches} or more, of at most "
        f"about {fit} actions each)"
    )


class ActionCounts(TangramModel):
    """How many actions are in each state."""

    total: int = Field(default=0, ge=0, description="All actions of the batch.")
    pending: int = Field(default=0, ge=0, description="Waiting in the queue.")
    running: int = Field(default=0, ge=0, description="Running now.")
    succeeded: int = Field(default=0, ge=0, description="Finished and exited 0 (or scored).")
    failed: int = Field(default=0, ge=0, description="Finished with an error, a timeout or a non-zero exit.")
    cancelled: int = Field(default=0, ge=0, description="Cancelled before they finished.")


class ActionResult(TangramModel):
    """The compact result of one action."""

    id: str = Field(
        min_length=1, max_length=MAX_ACTION_ID_LENGTH, description="Id of the action (spec.actions[].id)."
    )
    state: ActionState = Field(description="Pending, Running, Succeeded, Failed or Cancelled.")
    exit_code: int | None = Field(default=None, description="Exit status of the program (code, test).")
    reward: float | None = Field(default=None, description="Score the reward model or the tests produced.")
    duration_millis: int | None = Field(default=None, ge=0, description="Execution time, queueing excluded.")
    queued_millis: int | None = Field(default=None, ge=0, description="Time spent waiting in the queue.")
    attempts: int = Field(default=0, ge=0, description="Times the action was started (retries included).")
    output: str | None = Field(
        default=None,
        max_length=MAX_OUTPUT_BYTES_PER_ACTION,
        description="Tail of stdout and stderr, within spec.results.outputBytesPerAction.",
    )
    truncated: bool = Field(default=False, description="Whether output was cut to fit the budget.")
    reason: str | None = Field(
        default=None,
        max_length=256,
        description="Why the action failed, in CamelCase: Timeout, OutOfMemory, HostLost, InvalidPayload...",
    )


class ActionBatchStatus(TangramModel):
    """Observed state of an ActionBatch, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this status was computed from."
    )
    conditions: Conditions = Field(default_factory=list)
    counts: ActionCounts | None = Field(default=None, description="Actions per state.")
    results: list[ActionResult] = Field(
        default_factory=list,
        max_length=MAX_ACTIONS,
        description="Compact result per action, in spec order.",
        # Atomic, not a map keyed by id: the operator is its only writer and always writes the whole
        # list, and a map costs the API server per-item bookkeeping (managed fields, ratcheting) on
        # every status write, which for a 1,000-action batch about doubles the write's cost.
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    result_bytes: int = Field(
        default=0, ge=0, description="Bytes of results used of spec.results.budgetBytes."
    )
    results_omitted: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ACTIONS,
        description="Results left out of results to keep them within spec.results.budgetBytes (running "
        "actions' first, then the latest); counts still counts them, and the gateway serves them while the "
        "operator that ran them runs. "
        "Unset when none is.",
    )
    act: ActStats | None = Field(default=None, description="Action completion times of this batch.")
    start_time: datetime | None = Field(default=None, description="When the first action started.")
    completion_time: datetime | None = Field(default=None, description="When the last action finished.")

    @field_validator("results")
    @classmethod
    def _unique_result_ids(cls, results: list[ActionResult]) -> list[ActionResult]:
        no_duplicates([r.id for r in results], "result id")
        return results


class ActionBatch(TangramModel):
    """The actions of one trainer step, with their compact results."""

    api_version: Literal["tangram.arl.dev/v1alpha1"] = Field(default=API_VERSION, description="API version.")
    kind: Literal["ActionBatch"] = Field(default="ActionBatch", description="Kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard object metadata.")
    spec: ActionBatchSpec = Field(description="Desired state.")
    status: ActionBatchStatus | None = Field(default=None, description="Observed state.")
