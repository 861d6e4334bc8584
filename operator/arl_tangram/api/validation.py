"""Turning raw objects into models, and model errors into :class:`InvalidSpec` naming the field.

``parse(ActionPool, obj)`` and ``load(obj)`` are what the controllers, the gateway and the CLI call: a
bad object raises ``InvalidSpec`` whose ``field`` is the full camelCase path, e.g.
``spec.scaling.minHosts`` or ``spec.actions[3].id``, and whose message says what is wrong.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from arl_tangram.api.actionbatch import POOL_ACTION_TYPES, ActionBatch, ActionBatchSpec
from arl_tangram.api.actionpool import ActionPool
from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.errors import InvalidSpec

Resource = ActionPool | RewardModelService | ActionBatch
KINDS: dict[str, type[Resource]] = {
    "ActionPool": ActionPool,
    "RewardModelService": RewardModelService,
    "ActionBatch": ActionBatch,
}

M = TypeVar("M", bound=BaseModel)


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    if part.startswith("["):
        return f"{path}{part}"
    return f"{path}.{part}" if path else part


def error_field(error: ErrorDetails, prefix: str = "") -> str:
    """The dotted camelCase path of one pydantic error, with the field a model rule named appended."""
    path = prefix
    for part in error["loc"]:
        path = _join(path, part)
    ctx = error.get("ctx") or {}
    extra = ctx.get("field") if error["type"] == "tangram_field" else None
    if extra:
        for part in str(extra).split("."):
            path = _join(path, part)
    return path or "(object)"


def _message(error: ErrorDetails) -> str:
    message = error["msg"]
    # pydantic prefixes errors raised by validators; the rest of the message is ours.
    return message.removeprefix("Value error, ")


def invalid_spec(exc: ValidationError, prefix: str = "") -> InvalidSpec:
    """The first error of ``exc`` as an InvalidSpec; the message counts (and lists) any others."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    message = _message(first)
    if len(errors) > 1:
        others = "; ".join(f"{error_field(e, prefix)}: {_message(e)}" for e in errors[1:4])
        more = f" (and {len(errors) - 1} more: {others}{'; ...' if len(errors) > 4 else ''})"
        message += more
    return InvalidSpec(error_field(first, prefix), message)


def parse(model: type[M], data: Mapping[str, Any], prefix: str = "") -> M:
    """Validate ``data`` (camelCase keys, as Kubernetes stores it) as ``model``; raise InvalidSpec."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_spec(exc, prefix) from None


def load(obj: Mapping[str, Any]) -> Resource:
    """The model of a whole object (apiVersion, kind, metadata, spec, status) chosen by its kind."""
    if not isinstance(obj, Mapping):
        raise InvalidSpec("(object)", f"expected a mapping, got {type(obj).__name__}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise InvalidSpec("kind", f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    return parse(KINDS[kind], obj)


def validate_targets(
    batch: ActionBatch | ActionBatchSpec,
    *,
    pools: Collection[str],
    services: Collection[str],
) -> None:
    """Check that every action names an existing target of the right kind.

    ``pools`` and ``services`` are the names of the ActionPools and RewardModelServices in the batch's
    namespace. Code, test and http actions run on an ActionPool; reward actions on a RewardModelService.
    Only the controller knows which exist, so this is not part of the schema. Raises InvalidSpec naming
    ``spec.actions[i].target`` for the first action whose target is unknown.
    """
    spec = batch.spec if isinstance(batch, ActionBatch) else batch
    for index, action in enumerate(spec.actions):
        if action.type in POOL_ACTION_TYPES:
            known, kind = pools, "ActionPool"
        else:
            known, kind = services, "RewardModelService"
        if action.target not in known:
            listed = ", ".join(sorted(known)[:10]) or "none"
            raise InvalidSpec(
                f"spec.actions[{index}].target",
                f"{action.type} action {action.id!r} targets {kind} {action.target!r}, which does not "
                f"exist in this namespace (known: {listed})",
            )
