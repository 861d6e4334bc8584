"""Shared building blocks of the custom resources: the model base, CEL rules, conditions, metadata.

Every model derives from :class:`TangramModel`: camelCase JSON names (as Kubernetes spells them),
unknown fields rejected (the API server prunes or rejects them too), and a list of :class:`CelRule`
that is both emitted into the CRD as ``x-kubernetes-validations`` and checked by the model itself, so
that the intent of every server-side rule is also a unit test of the models.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar, Final, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

GROUP = "tangram.arl.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "tangram.arl.dev/v1alpha1"  # GROUP/VERSION, spelled out so mypy sees a Literal

# Condition types. Pools and services summarise themselves in Ready; a batch in Complete.
READY = "Ready"
SCALING = "Scaling"
DEGRADED = "Degraded"
ACCEPTED = "Accepted"
COMPLETE = "Complete"

# Every list and string a CEL rule may touch is bounded, so the API server can estimate the rule's
# cost at CRD creation; these are the common bounds.
MAX_NAME_LENGTH = 253
MAX_CONDITIONS = 16
MAX_ENV = 64
MAX_ARGS = 64
MAX_MAP_ENTRIES = 64


@dataclass(frozen=True)
class CelRule:
    """A cross-field rule, stated once for both the API server (``rule``) and the models (``check``).

    ``field`` is the camelCase name of the field the message is about, relative to the object the rule
    sits on; it becomes the rule's ``fieldPath`` and the last part of the error's field path.
    """

    rule: str
    message: str
    check: Callable[[Any], bool]
    field: str | None = None
    # The API server checks that fieldPath exists in the schema; metadata has no schema of its own.
    emit_field_path: bool = True

    def to_schema(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry for this rule."""
        entry = {"rule": self.rule, "message": self.message}
        if self.field is not None and self.emit_field_path:
            entry["fieldPath"] = f".{self.field}"
            entry["reason"] = "FieldValueInvalid"
        return entry


def name_fits_a_label(kind: str, max_length: int, owner: str) -> CelRule:
    """The rule that an object's name fits ``max_length``: it becomes a label value on its pods."""
    article = "an" if kind[0] in "AEIOU" else "a"
    return CelRule(
        rule=f"self.metadata.name.size() <= {max_length}",
        message=f"the name of {article} {kind} holds at most {max_length} characters "
        f"(it becomes a label value on the {owner}'s pods)",
        check=lambda s: s.metadata.name is None or len(s.metadata.name) <= max_length,
        field="metadata.name",
        emit_field_path=False,
    )


@dataclass(frozen=True)
class TransitionRule:
    """A rule on an update (``oldSelf`` is the object before it), for the API server alone: a model
    sees one object, never the change, so these have no ``check``."""

    rule: str
    message: str

    def to_schema(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry for this rule."""
        return {"rule": self.rule, "message": self.message}


def _add_cel_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    transitions: tuple[TransitionRule, ...] = getattr(cls, "transition_rules", ())
    entries = [rule.to_schema() for rule in rules] + [rule.to_schema() for rule in transitions]
    if entries:
        schema["x-kubernetes-validations"] = entries


# What the API server's JSON (Go's encoding/json, as a custom object is stored in etcd) escapes as
# six bytes where Python's JSON writes the character itself: HTML's three, and the two line
# separators JavaScript cannot hold in a string.
_GO_ESCAPED = ("<", ">", "&", "\u2028", "\u2029")


def stored_size(json_text: str) -> int:
    """Bytes the API server stores for a value that Python's JSON (``json.dumps(...,
    ensure_ascii=False)`` or pydantic's ``model_dump_json``) writes as ``json_text``. Counting
    characters missed up to 6 times as many bytes: a progress bar's blocks take 3 each, an emoji 4,
    and ``<``, ``>`` and ``&`` (a compiler's error, a shell's ``&&``) 6 each, escaped."""
    size = len(json_text.encode())
    for char in _GO_ESCAPED:
        size += json_text.count(char) * (6 - len(char.encode()))
    return size


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error about ``field`` (camelCase, relative to the model raising it) for use in validators.

    :func:`arl_tangram.api.validation.invalid_spec` appends ``field`` to the error's location, so the
    final message names the full path such as ``spec.scaling.minHosts``.
    """
    return PydanticCustomError("tangram_field", "{message}", {"field": field, "message": message})


@functools.cache
def _collection_fields(model: type[BaseModel]) -> tuple[tuple[str, str | None], ...]:
    """(name, alias) of a model's list and map fields that default to empty, once per class: every
    status write serializes each result, and pydantic's ``model_fields`` is slow to reach."""
    fields = model.model_fields.items()
    return tuple((name, f.alias) for name, f in fields if f.default_factory in (list, dict))


class TangramModel(BaseModel):
    """Base of every API model: camelCase aliases, no unknown fields, CEL rules checked on validation."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_add_cel_rules,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()
    transition_rules: ClassVar[tuple[TransitionRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        for rule in type(self).cel_rules:
            if not rule.check(self):
                raise field_error(rule.field or "", rule.message)
        return self

    @model_serializer(mode="wrap")
    def _omit_empty_collections(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        # Kubernetes' omitempty: a list or map field left at its empty default is not written, so the
        # stored form equals what the API server's defaulting produces (the schema has no [] defaults).
        data = handler(self)
        if not isinstance(data, dict):
            return data
        for name, alias in _collection_fields(type(self)):
            key = alias if info.by_alias and alias else name
            if data.get(key, None) in ([], {}):
                del data[key]
        return data

    def to_dict(self) -> dict[str, Any]:
        """The object as Kubernetes would store it: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def defaulted(model: type[TangramModel], description: str) -> Any:
    """A nested object field that defaults to ``model()``, the default spelled out in full in the schema.

    The API server evaluates CEL rules on a default value as written (nested defaults not applied), so
    ``default: {}`` would fail rules such as ``self.minHosts <= self.maxHosts``.
    """
    return Field(
        default_factory=model, description=description, json_schema_extra={"default": model().to_dict()}
    )


def no_duplicates(values: list[Any], what: str) -> list[Any]:
    """Mirror of ``x-kubernetes-list-type: set``: the API server rejects repeated items."""
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"duplicate {what} {value!r}")
        seen.add(value)
    return values


CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# A DNS-1123 subdomain: names of Kubernetes objects (pools, services, runtime classes).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A DNS-1123 label: names that become parts of other names or label values.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


class Condition(TangramModel):
    """One aspect of the object's state, in the shape of Kubernetes' metav1.Condition."""

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=CONDITION_TYPE_PATTERN,
        description="Type of the condition in CamelCase, e.g. Ready, Scaling, Degraded, Complete.",
    )
    status: Literal["True", "False", "Unknown"] = Field(
        description="Status of the condition: True, False or Unknown.",
    )
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        description="metadata.generation of the object this condition was computed from.",
    )
    last_transition_time: datetime = Field(
        description="When the condition last changed its status (RFC 3339).",
    )
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=CONDITION_REASON_PATTERN,
        description="Machine-readable reason for the last transition in CamelCase, e.g. HostsStarting.",
    )
    message: str = Field(
        max_length=32768,
        description="Human-readable explanation of the last transition; says what to do when it helps.",
    )


def _unique_condition_types(conditions: list[Condition]) -> list[Condition]:
    # Mirror of the list-map key on ``type``: one condition per type.
    no_duplicates([c.type for c in conditions], "condition type")
    return conditions


Conditions = Annotated[
    list[Condition],
    Field(
        max_length=MAX_CONDITIONS,
        description="Current state of the object, one entry per condition type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
    AfterValidator(_unique_condition_types),
]
"""The ``conditions`` list every status carries, keyed by ``type``."""


class ActStats(TangramModel):
    """Action completion time (queueing plus execution) over the recent window."""

    count: int = Field(default=0, ge=0, description="Number of actions completed in the window.")
    window_seconds: int = Field(
        default=0,
        ge=0,
        description="Length of the window in seconds: an ActionPool's and a RewardModelService's are "
        "the last 300 s; an ActionBatch's is its own span, from startTime to completionTime (to the "
        "status's time while it runs).",
    )
    mean_millis: int = Field(default=0, ge=0, description="Mean action completion time in milliseconds.")
    p50_millis: int = Field(default=0, ge=0, description="Median action completion time in milliseconds.")
    p90_millis: int = Field(
        default=0, ge=0, description="90th percentile of completion time in milliseconds."
    )
    p99_millis: int = Field(
        default=0, ge=0, description="99th percentile of completion time in milliseconds."
    )


class EnvVar(TangramModel):
    """An environment variable set in the pods' main container."""

    name: str = Field(
        min_length=1, max_length=256, pattern=ENV_NAME_PATTERN, description="Name of the variable."
    )
    value: str = Field(default="", max_length=32768, description="Value of the variable.")


class ObjectMeta(BaseModel):
    """The parts of Kubernetes object metadata the models read; everything else is kept as it is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, alias_generator=to_camel)

    name: str | None = Field(default=None, description="Name of the object.")
    namespace: str | None = Field(default=None, description="Namespace of the object.")
    generation: int | None = Field(default=None, description="Generation of the spec.")
    labels: dict[str, str] | None = Field(default=None, description="Labels.")
    annotations: dict[str, str] | None = Field(default=None, description="Annotations.")
