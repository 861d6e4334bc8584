"""The API models: samples load, round-trip, agree with the schema's defaults; statuses round-trip."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from api_testkit import apply_defaults, crd_schema, sample, sample_files

from arl_tangram.api import (
    API_VERSION,
    GROUP,
    VERSION,
    ActionBatch,
    ActionPool,
    RewardModelService,
    load,
    parse,
    parse_quantity,
    quantity_bytes,
)
from arl_tangram.api.actionbatch import ActionBatchStatus
from arl_tangram.api.actionpool import ActionPoolStatus
from arl_tangram.api.rewardmodelservice import RewardModelServiceStatus
from arl_tangram.errors import InvalidSpec

KINDS = ["ActionPool", "RewardModelService", "ActionBatch"]
NOW = datetime(2026, 3, 14, 12, 0, 0, tzinfo=UTC)


def _subset(small: Any, large: Any) -> bool:
    """Whether every key and value of ``small`` is in ``large`` (lists compared item by item)."""
    if isinstance(small, dict):
        return isinstance(large, dict) and all(k in large and _subset(v, large[k]) for k, v in small.items())
    if isinstance(small, list):
        return (
            isinstance(large, list)
            and len(small) == len(large)
            and all(_subset(a, b) for a, b in zip(small, large, strict=True))
        )
    return bool(small == large)


def test_api_version_is_group_and_version() -> None:
    assert f"{GROUP}/{VERSION}" == API_VERSION == "tangram.arl.dev/v1alpha1"


def test_there_is_one_sample_per_kind() -> None:
    kinds = sorted(load(doc).kind for doc in (sample(k) for k in KINDS))
    assert kinds == sorted(KINDS)
    assert len(sample_files()) == len(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_round_trips(kind: str) -> None:
    obj = sample(kind)
    model = load(obj)
    dumped = model.to_dict()
    # Nothing the user wrote is lost or changed; only defaults are added.
    assert _subset(obj, dumped), dumped
    again = load(dumped)
    assert again == model
    assert again.to_dict() == dumped


@pytest.mark.parametrize("kind", KINDS)
def test_model_defaults_equal_the_api_servers_defaults(kind: str) -> None:
    """What the operator reads from the models is what the API server stores after defaulting."""
    obj = sample(kind)
    defaulted = apply_defaults(crd_schema(kind), obj)
    assert load(obj).to_dict()["spec"] == defaulted["spec"]


def test_minimal_pool_gets_every_default() -> None:
    pool = parse(ActionPool, {"spec": {"template": {"image": "sandbox:1"}}})
    assert pool.kind == "ActionPool" and pool.api_version == API_VERSION
    assert pool.spec.mode == "shared"
    assert pool.spec.languages == ["python"]
    assert pool.spec.isolation.network == "Disabled"
    assert pool.spec.scaling.min_hosts == 0 and pool.spec.scaling.max_hosts == 4
    assert pool.spec.limits.timeout_seconds == 30
    assert pool.spec.replicas is None and pool.status is None
    # Unset optionals stay out of the stored form (never `null`).
    assert "replicas" not in pool.to_dict()["spec"] and "status" not in pool.to_dict()


def test_fields_accept_python_names_too() -> None:
    pool = ActionPool.model_validate(
        {"spec": {"template": {"image": "s:1"}, "scaling": {"min_hosts": 1, "max_hosts": 2}}}
    )
    assert pool.to_dict()["spec"]["scaling"]["minHosts"] == 1


def _condition(type_: str, status: str, reason: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": "2026-03-14T12:00:00Z",
        "observedGeneration": 3,
    }


STATUSES: list[tuple[type[Any], dict[str, Any]]] = [
    (
        ActionPoolStatus,
        {
            "observedGeneration": 3,
            "conditions": [
                _condition("Ready", "True", "HostsReady"),
                _condition("Scaling", "False", "Steady"),
            ],
            "replicas": 4,
            "selector": "tangram.arl.dev/pool=python-sandboxes",
            "hostsReady": 3,
            "hostsStarting": 1,
            "coresTotal": 48,
            "coresBusy": 40,
            "sessions": 120,
            "queueDepth": 7,
            "act": {
                "count": 1000,
                "windowSeconds": 60,
                "meanMillis": 85,
                "p50Millis": 40,
                "p90Millis": 200,
                "p99Millis": 900,
            },
        },
    ),
    (
        RewardModelServiceStatus,
        {
            "observedGeneration": 1,
            "conditions": [_condition("Ready", "False", "Restoring")],
            "replicas": 2,
            "readyReplicas": 1,
            "placements": [
                {"node": "gpu-0", "gpus": ["MIG-5c1a"], "state": "Resident", "pod": "rm-0"},
                {"node": "gpu-1", "gpus": ["GPU-aa", "GPU-bb"], "state": "Restoring"},
            ],
            "queueDepth": 12,
        },
    ),
    (
        ActionBatchStatus,
        {
            "observedGeneration": 1,
            "conditions": [_condition("Complete", "True", "AllFinished")],
            "counts": {"total": 2, "pending": 0, "running": 0, "succeeded": 1, "failed": 1, "cancelled": 0},
            "results": [
                {
                    "id": "a",
                    "state": "Succeeded",
                    "exitCode": 0,
                    "durationMillis": 12,
                    "attempts": 1,
                    "output": "832040\n",
                    "truncated": False,
                },
                {
                    "id": "b",
                    "state": "Failed",
                    "reward": 0.25,
                    "attempts": 2,
                    "reason": "Timeout",
                    "truncated": True,
                },
            ],
            "resultBytes": 120,
            "startTime": "2026-03-14T12:00:00Z",
            "completionTime": "2026-03-14T12:00:05Z",
        },
    ),
]


@pytest.mark.parametrize(("model", "status"), STATUSES, ids=[m.__name__ for m, _ in STATUSES])
def test_status_round_trips(model: type[Any], status: dict[str, Any]) -> None:
    parsed = model.model_validate(status)
    assert _subset(status, parsed.to_dict())
    assert model.model_validate(parsed.to_dict()) == parsed
    assert parsed.conditions[0].last_transition_time == NOW


def test_status_rejects_two_conditions_of_one_type() -> None:
    status = {"conditions": [_condition("Ready", "True", "A"), _condition("Ready", "False", "B")]}
    with pytest.raises(InvalidSpec) as err:
        parse(ActionPoolStatus, status, prefix="status")
    assert err.value.field == "status.conditions" and "duplicate condition type 'Ready'" in err.value.message


def test_condition_status_is_true_false_or_unknown() -> None:
    with pytest.raises(InvalidSpec) as err:
        parse(ActionPoolStatus, {"conditions": [_condition("Ready", "Yes", "A")]}, prefix="status")
    assert err.value.field == "status.conditions[0].status"


def test_whole_objects_with_status_load() -> None:
    batch = sample("ActionBatch")
    batch["status"] = STATUSES[2][1]
    loaded = load(batch)
    assert isinstance(loaded, ActionBatch) and loaded.status is not None
    assert loaded.status.counts is not None and loaded.status.counts.failed == 1
    service = sample("RewardModelService")
    service["status"] = STATUSES[1][1]
    assert isinstance(load(service), RewardModelService)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("2", 2),
        ("500m", 0.5),
        ("1.5G", 1.5e9),
        ("1e3", 1000),
        ("100k", 100_000),
        ("0.25Ki", 256),
        ("1E", 10**18),
    ],
)
def test_quantities_parse_like_kubernetes(text: str, value: float) -> None:
    assert float(parse_quantity(text)) == pytest.approx(value)


@pytest.mark.parametrize("text", ["4Gx", "", "-1", "1.2.3", "Gi", "4 Gi", "4gi", "1KiB"])
def test_malformed_quantities_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="not a valid quantity"):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["1e9999999999", "1e999999", "1e19", "10E", "8Ei", "99999999999999999999"])
def test_quantities_past_what_kubernetes_holds_are_refused_as_values(text: str) -> None:
    """1e9999999999 raised decimal.Overflow, not ValueError: validating the object failed with no
    field named; 1e999999 passed and failed later, turned into bytes."""
    with pytest.raises(ValueError, match="larger than the largest quantity Kubernetes holds"):
        parse_quantity(text)


def test_the_largest_quantity_kubernetes_holds_and_tiny_exponents_parse() -> None:
    assert parse_quantity(str(2**63 - 1)) == 2**63 - 1
    assert parse_quantity("1E-99999999") == parse_quantity("0e9999999999") == 0


def test_memory_in_bytes_rounds_up() -> None:
    assert quantity_bytes("1Gi") == 2**30
    assert quantity_bytes("1500m") == 2
