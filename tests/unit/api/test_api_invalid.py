"""Invalid objects are refused with a message that names the field, by the models and by the schema.

Every row starts from a valid sample and breaks one thing. The models must raise InvalidSpec naming the
field; rows the OpenAPI part of the schema can catch are also checked against the generated CRD schema
(with a JSON Schema validator), and every CEL rule of every model has at least one row, so the intent of
each server-side rule is tested here too. Every CEL rule also has edge rows (EDGES): objects exactly on
its boundary (min == max, a name of the longest length, the other branch of an implication) that must be
accepted, each with the one step past the edge that must be refused; test_api_apiserver.py sends both
to the API server's own validation code.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from api_testkit import crd_schema, delete_path, json_schema, sample, set_path

import arl_tangram.api.actionbatch as actionbatch_module
import arl_tangram.api.actionpool as actionpool_module
import arl_tangram.api.meta as meta_module
import arl_tangram.api.rewardmodelservice as rms_module
from arl_tangram.api import MAX_ACTIONS, load, validate_targets
from arl_tangram.api.meta import TangramModel
from arl_tangram.errors import InvalidSpec

POOL, RMS, BATCH = "ActionPool", "RewardModelService", "ActionBatch"


@dataclass(frozen=True)
class Bad:
    """One invalid object: how to break the sample, which field is named, what the message says."""

    name: str
    kind: str
    breaks: Callable[[dict[str, Any]], Any]
    field: str
    message: str
    # Whether the OpenAPI schema alone refuses it; False for CEL rules and checks only the models make.
    schema: bool = True
    # Whether the API server refuses it (OpenAPI, list uniqueness or CEL); False for model-only checks.
    server: bool = True


def put(path: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: set_path(obj, path, copy.deepcopy(value))


def drop(path: str) -> Callable[[dict[str, Any]], Any]:
    return lambda obj: delete_path(obj, path)


def actions(n: int) -> Callable[[dict[str, Any]], Any]:
    def breaks(obj: dict[str, Any]) -> None:
        template = obj["spec"]["actions"][0]
        obj["spec"]["actions"] = [{**copy.deepcopy(template), "id": f"a{i}"} for i in range(n)]

    return breaks


def big_payloads(obj: dict[str, Any]) -> None:
    for i, action in enumerate(obj["spec"]["actions"]):
        action["payload"] = {"language": "python", "code": "x" * 200_000, "n": i}


def dedicated_with_shared(obj: dict[str, Any]) -> None:
    obj["spec"]["mode"] = "shared"
    obj["spec"]["dedicated"] = {"maxSessions": 4}


BAD: list[Bad] = [
    # Negative counts.
    Bad(
        "negative minHosts",
        POOL,
        put("spec.scaling.minHosts", -1),
        "spec.scaling.minHosts",
        "greater than or equal to 0",
    ),
    Bad(
        "negative maxReplicas",
        RMS,
        put("spec.scaling.maxReplicas", -2),
        "spec.scaling.maxReplicas",
        "greater than or equal to 1",
    ),
    Bad(
        "negative timeout",
        POOL,
        put("spec.limits.timeoutSeconds", -5),
        "spec.limits.timeoutSeconds",
        "greater than or equal to 1",
    ),
    Bad("negative replicas", POOL, put("spec.replicas", -1), "spec.replicas", "greater than or equal to 0"),
    Bad(
        "zero units",
        BATCH,
        put("spec.actions[2].units.min", 0),
        "spec.actions[2].units.min",
        "greater than or equal to 1",
    ),
    Bad(
        "negative retries",
        BATCH,
        put("spec.retryPolicy.maxRetries", -1),
        "spec.retryPolicy.maxRetries",
        "greater than or equal to 0",
    ),
    # min > max and other cross-field rules (CEL on the server).
    Bad(
        "minHosts > maxHosts",
        POOL,
        put("spec.scaling.minHosts", 20),
        "spec.scaling.minHosts",
        "minHosts must not exceed maxHosts",
        schema=False,
    ),
    Bad(
        "warmHosts > maxHosts",
        POOL,
        put("spec.scaling.warmHosts", 17),
        "spec.scaling.warmHosts",
        "warmHosts must not exceed maxHosts",
        schema=False,
    ),
    Bad(
        "minReplicas > maxReplicas",
        RMS,
        put("spec.scaling.minReplicas", 3),
        "spec.scaling.minReplicas",
        "minReplicas must not exceed maxReplicas",
        schema=False,
    ),
    Bad(
        "units min > max",
        BATCH,
        put("spec.actions[2].units", {"min": 8, "max": 2}),
        "spec.actions[2].units.min",
        "min must not exceed max",
        schema=False,
    ),
    Bad(
        "output over budget",
        BATCH,
        put("spec.results", {"budgetBytes": 4096, "outputBytesPerAction": 8192}),
        "spec.results.outputBytesPerAction",
        "outputBytesPerAction must not exceed budgetBytes",
        schema=False,
    ),
    Bad(
        "action memory over host memory",
        POOL,
        put("spec.limits.memory", "64Gi"),
        "spec.limits.memory",
        "limits.memory must not exceed template.resources.memory",
        schema=False,
    ),
    Bad(
        "dedicated settings in shared mode",
        POOL,
        dedicated_with_shared,
        "spec.dedicated",
        "dedicated settings apply only with mode: dedicated",
        schema=False,
    ),
    Bad(
        "MIG slice with 2 GPUs",
        RMS,
        put("spec.gpu.count", [1, 2]),
        "spec.gpu.count",
        "count must be [1] when migProfile is set",
        schema=False,
    ),
    Bad(
        "MIG slice with NVLink required",
        RMS,
        put("spec.gpu.nvlink", "Required"),
        "spec.gpu.nvlink",
        "nvlink cannot be Required with migProfile",
        schema=False,
    ),
    Bad(
        "vllm without image",
        RMS,
        put("spec.server.runtime", "vllm"),
        "spec.server.image",
        "image is required when runtime is vllm or sglang",
        schema=False,
    ),
    Bad(
        "session on a reward action",
        BATCH,
        put("spec.actions[3].sessionId", "traj-7"),
        "spec.actions[3].sessionId",
        "sessionId applies only to code and test actions",
        schema=False,
    ),
    Bad(
        "pool name too long",
        POOL,
        put("metadata.name", "p" * 64),
        "metadata.name",
        "at most 63 characters",
        schema=False,
    ),
    Bad(
        "service name too long",
        RMS,
        put("metadata.name", "r" * 64),
        "metadata.name",
        "at most 63 characters",
        schema=False,
    ),
    # Unknown enum values.
    Bad(
        "unknown language",
        POOL,
        put("spec.languages", ["python", "cobol"]),
        "spec.languages[1]",
        "'python', 'bash'",
    ),
    Bad(
        "unknown runtime",
        RMS,
        put("spec.server.runtime", "triton"),
        "spec.server.runtime",
        "'builtin', 'vllm' or 'sglang'",
    ),
    Bad("unknown mode", POOL, put("spec.mode", "exclusive"), "spec.mode", "'shared' or 'dedicated'"),
    Bad(
        "unknown action type",
        BATCH,
        put("spec.actions[0].type", "sql"),
        "spec.actions[0].type",
        "'code', 'test', 'reward' or 'http'",
    ),
    Bad(
        "unknown network setting",
        POOL,
        put("spec.isolation.network", "Open"),
        "spec.isolation.network",
        "'Disabled' or 'Enabled'",
    ),
    Bad("GPU count not a power of two", RMS, put("spec.gpu.count", [3]), "spec.gpu.count[0]", "1, 2, 4 or 8"),
    # Images.
    Bad("empty image", POOL, put("spec.template.image", ""), "spec.template.image", "at least 1 character"),
    Bad(
        "image with a space",
        POOL,
        put("spec.template.image", "python 3.12"),
        "spec.template.image",
        "should match pattern",
    ),
    Bad("missing image", POOL, drop("spec.template.image"), "spec.template.image", "Field required"),
    Bad("empty server image", RMS, put("spec.server.image", ""), "spec.server.image", "at least 1 character"),
    # Quantities.
    Bad(
        "malformed host memory",
        POOL,
        put("spec.template.resources.memory", "4Gx"),
        "spec.template.resources.memory",
        "'4Gx' is not a valid quantity",
    ),
    Bad(
        "malformed action memory",
        POOL,
        put("spec.limits.memory", "4Gx"),
        "spec.limits.memory",
        "'4Gx' is not a valid quantity",
    ),
    Bad(
        "malformed GPU memory",
        RMS,
        put("spec.gpu.memory", "lots"),
        "spec.gpu.memory",
        "'lots' is not a valid quantity",
    ),
    Bad(
        "negative cpu",
        POOL,
        put("spec.template.resources.cpu", "-4"),
        "spec.template.resources.cpu",
        "not a valid quantity",
    ),
    Bad(
        "cpu past the largest quantity",
        POOL,
        put("spec.template.resources.cpu", "1e9999999999"),
        "spec.template.resources.cpu",
        "larger than the largest quantity Kubernetes holds",
        schema=False,
        server=False,
    ),
    Bad(
        "zero cpu",
        POOL,
        put("spec.template.resources.cpu", "0"),
        "spec.template.resources.cpu",
        "must be greater than zero",
    ),
    # The API server refused a zero memory only by the rule comparing limits.memory to it, naming
    # the other field.
    Bad(
        "zero memory",
        POOL,
        put("spec.template.resources.memory", "0.0Gi"),
        "spec.template.resources.memory",
        "must be greater than zero",
    ),
    Bad("zero GPU memory", RMS, put("spec.gpu.memory", "0"), "spec.gpu.memory", "must be greater than zero"),
    # Other malformed values.
    Bad(
        "malformed MIG profile",
        RMS,
        put("spec.gpu.migProfile", "10g.80gb"),
        "spec.gpu.migProfile",
        "should match pattern",
    ),
    Bad(
        "weights over plain http",
        RMS,
        put("spec.model.uri", "http://example.com/model"),
        "spec.model.uri",
        "should match pattern",
    ),
    Bad("missing model", RMS, drop("spec.model"), "spec.model", "Field required"),
    Bad(
        "duplicate language",
        POOL,
        put("spec.languages", ["python", "python"]),
        "spec.languages",
        "duplicate language 'python'",
        schema=False,
    ),
    Bad(
        "duplicate GPU count",
        RMS,
        put("spec.gpu.count", [1, 1]),
        "spec.gpu.count",
        "duplicate GPU count 1",
        schema=False,
    ),
    Bad(
        "duplicate env var",
        POOL,
        put("spec.template.env", [{"name": "A"}, {"name": "A"}]),
        "spec.template.env",
        "duplicate environment variable 'A'",
        schema=False,
    ),
    Bad(
        "unknown field",
        POOL,
        put("spec.scaling.maxHost", 3),
        "spec.scaling.maxHost",
        "Extra inputs are not permitted",
    ),
    Bad(
        "wrong apiVersion",
        POOL,
        put("apiVersion", "tangram.arl.dev/v1"),
        "apiVersion",
        "tangram.arl.dev/v1alpha1",
        schema=False,
        server=False,
    ),
    # ActionBatch shape and size.
    Bad("no actions", BATCH, put("spec.actions", []), "spec.actions", "at least 1 item"),
    Bad(
        "over the maximum of actions",
        BATCH,
        actions(MAX_ACTIONS + 1),
        "spec.actions",
        f"at most {MAX_ACTIONS} items",
    ),
    Bad(
        "duplicate action ids",
        BATCH,
        put("spec.actions[1].id", "traj-7.turn-1"),
        "spec.actions[1].id",
        "duplicate action id 'traj-7.turn-1' (first at index 0)",
        schema=False,
    ),
    Bad(
        "action id with a space",
        BATCH,
        put("spec.actions[0].id", "turn 1"),
        "spec.actions[0].id",
        "should match pattern",
    ),
    Bad(
        "target that is no name",
        BATCH,
        put("spec.actions[0].target", "Python_Sandboxes"),
        "spec.actions[0].target",
        "should match pattern",
    ),
    Bad(
        "action without payload",
        BATCH,
        drop("spec.actions[0].payload"),
        "spec.actions[0].payload",
        "Field required",
    ),
    Bad(
        "spec over the size budget",
        BATCH,
        big_payloads,
        "spec.actions",
        "split the actions into several ActionBatches",
        schema=False,
        server=False,
    ),
]


@dataclass(frozen=True)
class Edge:
    """A valid object on the edge of one CEL rule (min == max, a name of exactly the limit, the
    implication's other branch), accepted by models and server alike; ``over`` then takes it one step
    past the edge, where the rule must refuse it. The step proves the row sits on the boundary: a rule
    that refused the edge itself (``<`` for ``<=``) fails the row, one that never refuses fails the step.
    """

    name: str
    kind: str
    makes: Callable[[dict[str, Any]], Any]
    rule: str  # the message of the rule whose edge this is
    over: Callable[[dict[str, Any]], Any]


def both(*steps: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    def apply(obj: dict[str, Any]) -> None:
        for step in steps:
            step(obj)

    return apply


def dedicated_mode(obj: dict[str, Any]) -> None:
    obj["spec"]["mode"] = "dedicated"
    obj["spec"]["dedicated"] = {"maxSessions": 4}


MIN_MAX = "min must not exceed max"
EDGES: list[Edge] = [
    Edge(
        "units min == max",
        BATCH,
        put("spec.actions[2].units", {"min": 8, "max": 8}),
        MIN_MAX,
        put("spec.actions[2].units.max", 7),
    ),
    Edge(
        "units min == max == 1",
        BATCH,
        put("spec.actions[0].units", {"min": 1, "max": 1}),
        MIN_MAX,
        put("spec.actions[0].units.min", 2),
    ),
    Edge(
        "output equal to the budget",
        BATCH,
        put("spec.results", {"budgetBytes": 4096, "outputBytesPerAction": 4096}),
        "outputBytesPerAction must not exceed budgetBytes",
        put("spec.results.outputBytesPerAction", 4097),
    ),
    Edge(
        "minHosts == maxHosts",
        POOL,
        put("spec.scaling.minHosts", 16),
        "minHosts must not exceed maxHosts",
        put("spec.scaling.maxHosts", 15),
    ),
    Edge(
        "warmHosts == maxHosts",
        POOL,
        put("spec.scaling.warmHosts", 16),
        "warmHosts must not exceed maxHosts",
        put("spec.scaling.warmHosts", 17),
    ),
    Edge(
        "minReplicas == maxReplicas",
        RMS,
        put("spec.scaling.minReplicas", 2),
        "minReplicas must not exceed maxReplicas",
        put("spec.scaling.maxReplicas", 1),
    ),
    Edge(
        # Equal quantities in different units: the rule compares quantities, not strings.
        "action memory equal to host memory",
        POOL,
        put("spec.limits.memory", "32768Mi"),
        "limits.memory must not exceed template.resources.memory",
        put("spec.limits.memory", "32769Mi"),
    ),
    Edge(
        "dedicated settings in dedicated mode",
        POOL,
        dedicated_mode,
        "dedicated settings apply only with mode: dedicated",
        put("spec.mode", "shared"),
    ),
    Edge(
        "MIG slice with one GPU",
        RMS,
        put("spec.gpu.count", [1]),
        "count must be [1] when migProfile is set",
        put("spec.gpu.count", [1, 2]),
    ),
    Edge(
        "several GPU counts without MIG",
        RMS,
        both(drop("spec.gpu.migProfile"), put("spec.gpu.count", [1, 2, 8])),
        "count must be [1] when migProfile is set",
        put("spec.gpu.migProfile", "1g.10gb"),
    ),
    Edge(
        "MIG slice with NVLink preferred",
        RMS,
        put("spec.gpu.nvlink", "Preferred"),
        "nvlink cannot be Required with migProfile",
        put("spec.gpu.nvlink", "Required"),
    ),
    Edge(
        "NVLink required without MIG",
        RMS,
        both(drop("spec.gpu.migProfile"), put("spec.gpu.count", [2, 4]), put("spec.gpu.nvlink", "Required")),
        "nvlink cannot be Required with migProfile",
        both(put("spec.gpu.migProfile", "1g.10gb"), put("spec.gpu.count", [1])),
    ),
    Edge(
        "vllm with an image",
        RMS,
        both(put("spec.server.runtime", "vllm"), put("spec.server.image", "vllm/vllm-openai:v0.11.0")),
        "image is required when runtime is vllm or sglang",
        drop("spec.server.image"),
    ),
    Edge(
        "builtin without an image",
        RMS,
        put("spec.server", {"runtime": "builtin"}),
        "image is required when runtime is vllm or sglang",
        put("spec.server.runtime", "sglang"),
    ),
    Edge(
        "session on a test action",
        BATCH,
        put("spec.actions[2].sessionId", "traj-9"),
        "sessionId applies only to code and test actions",
        put("spec.actions[2].type", "reward"),
    ),
    Edge(
        "session on a code action",
        BATCH,
        put("spec.actions[0].sessionId", "traj-9"),
        "sessionId applies only to code and test actions",
        put("spec.actions[0].type", "http"),
    ),
    Edge(
        "pool name of exactly 63 characters",
        POOL,
        put("metadata.name", "p" * 63),
        "at most 63 characters",
        put("metadata.name", "p" * 64),
    ),
    Edge(
        "service name of exactly 63 characters",
        RMS,
        put("metadata.name", "r" * 63),
        "at most 63 characters",
        put("metadata.name", "r" * 64),
    ),
]


def _broken(bad: Bad) -> dict[str, Any]:
    obj = sample(bad.kind)
    bad.breaks(obj)
    return obj


def on_edge(edge: Edge) -> dict[str, Any]:
    """The sample of ``edge.kind`` moved onto the edge."""
    obj = sample(edge.kind)
    edge.makes(obj)
    return obj


def over_edge(edge: Edge) -> dict[str, Any]:
    """The edge object taken one step past the edge."""
    obj = on_edge(edge)
    edge.over(obj)
    return obj


def _schema_errors(kind: str, obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json_schema(crd_schema(kind)))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("kind", [POOL, RMS, BATCH])
def test_samples_are_valid_to_both(kind: str) -> None:
    obj = sample(kind)
    load(obj)
    assert _schema_errors(kind, obj) == []


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_models_refuse_and_name_the_field(bad: Bad) -> None:
    with pytest.raises(InvalidSpec) as err:
        load(_broken(bad))
    assert err.value.field == bad.field, str(err.value)
    assert bad.message in err.value.message, str(err.value)
    assert str(err.value).startswith(f"{bad.field}: ")


@pytest.mark.parametrize("bad", [b for b in BAD if b.schema], ids=[b.name for b in BAD if b.schema])
def test_schema_refuses_too(bad: Bad) -> None:
    errors = _schema_errors(bad.kind, _broken(bad))
    assert errors, f"the CRD schema accepts {bad.name}"


def _all_rules() -> list[tuple[str, str]]:
    rules = []
    for module in (meta_module, actionpool_module, rms_module, actionbatch_module):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, TangramModel)
                and value.__module__ == module.__name__
            ):
                rules += [(value.__name__, rule.message) for rule in value.cel_rules]
    return rules


def test_every_cel_rule_has_an_invalid_row() -> None:
    rules = _all_rules()
    assert len(rules) >= 10
    untested = [
        (model, message)
        for model, message in rules
        if not any(message in b.message or b.message in message for b in BAD)
    ]
    assert untested == []


def test_every_cel_rule_has_an_edge_row() -> None:
    rules = _all_rules()
    unbounded = [(model, message) for model, message in rules if not any(e.rule in message for e in EDGES)]
    assert unbounded == []
    # Each edge names one rule exactly: a row naming no rule (a typo) would prove nothing.
    assert all(any(e.rule in message for _, message in rules) for e in EDGES)


@pytest.mark.parametrize("edge", EDGES, ids=[e.name for e in EDGES])
def test_models_accept_the_edge_and_refuse_one_step_over(edge: Edge) -> None:
    obj = on_edge(edge)
    load(obj)
    assert _schema_errors(edge.kind, obj) == []
    with pytest.raises(InvalidSpec) as err:
        load(over_edge(edge))
    assert edge.rule in err.value.message, str(err.value)


def test_every_cel_rule_is_in_the_crds() -> None:
    text = "".join(p.read_text() for p in (crd_schema.__globals__["CRDS"]).glob("*.yaml"))
    for _, message in _all_rules():
        assert message in text


def test_several_errors_are_all_reported() -> None:
    obj = sample(POOL)
    obj["spec"]["scaling"]["minHosts"] = -1
    obj["spec"]["template"]["image"] = ""
    with pytest.raises(InvalidSpec) as err:
        load(obj)
    assert "and 1 more" in err.value.message
    named = {
        err.value.field,
        *(f for f in ("spec.scaling.minHosts", "spec.template.image") if f in err.value.message),
    }
    assert named == {"spec.scaling.minHosts", "spec.template.image"}


def test_unknown_kind_is_named() -> None:
    with pytest.raises(InvalidSpec) as err:
        load({"apiVersion": "tangram.arl.dev/v1alpha1", "kind": "ActionPoool", "spec": {}})
    assert err.value.field == "kind" and "ActionPoool" in err.value.message


# Unknown targets: only the controller knows which pools and services exist.
POOLS = ["python-sandboxes"]
SERVICES = ["skywork-reward-small"]


def test_known_targets_pass() -> None:
    batch = load(sample(BATCH))
    assert isinstance(batch, actionbatch_module.ActionBatch)
    validate_targets(batch, pools=POOLS, services=SERVICES)
    validate_targets(batch.spec, pools=set(POOLS), services=set(SERVICES))


def test_unknown_target_pool_is_named() -> None:
    obj = sample(BATCH)
    obj["spec"]["actions"][1]["target"] = "rust-sandboxes"
    batch = load(obj)
    assert isinstance(batch, actionbatch_module.ActionBatch)
    with pytest.raises(InvalidSpec) as err:
        validate_targets(batch, pools=POOLS, services=SERVICES)
    assert err.value.field == "spec.actions[1].target"
    assert "ActionPool 'rust-sandboxes'" in err.value.message and "python-sandboxes" in err.value.message


def test_reward_action_must_target_a_service_not_a_pool() -> None:
    obj = sample(BATCH)
    obj["spec"]["actions"][3]["target"] = "python-sandboxes"
    batch = load(obj)
    assert isinstance(batch, actionbatch_module.ActionBatch)
    with pytest.raises(InvalidSpec) as err:
        validate_targets(batch, pools=POOLS, services=SERVICES)
    assert err.value.field == "spec.actions[3].target"
    assert "RewardModelService 'python-sandboxes'" in err.value.message


def test_no_pools_at_all_is_said_plainly() -> None:
    batch = load(sample(BATCH))
    assert isinstance(batch, actionbatch_module.ActionBatch)
    with pytest.raises(InvalidSpec, match=r"known: none"):
        validate_targets(batch, pools=[], services=SERVICES)


def test_the_maximum_batch_fits_the_etcd_limit() -> None:
    """MAX_ACTIONS actions with room-filling payloads plus a full result budget stay under 1.5 MiB."""
    obj = sample(BATCH)
    actions(MAX_ACTIONS)(obj)
    per_action = actionbatch_module.MAX_SPEC_BYTES // MAX_ACTIONS - 400
    for action in obj["spec"]["actions"]:
        action["payload"] = {"language": "python", "code": "x" * per_action}
    batch = load(obj)
    spec_bytes = len(json.dumps(batch.to_dict()["spec"]))
    assert spec_bytes <= actionbatch_module.MAX_SPEC_BYTES
    # Results at their maximum budget plus the fixed fields of every result (~200 bytes each).
    total = spec_bytes + actionbatch_module.MAX_RESULT_BUDGET_BYTES + 200 * MAX_ACTIONS
    assert total < 1.25 * 2**20


def _programs(n: int, code_bytes: int) -> dict[str, Any]:
    obj = sample(BATCH)
    actions(n)(obj)
    for action in obj["spec"]["actions"]:
        action["payload"] = {"language": "python", "code": "x" * code_bytes}
    return obj


def test_a_spec_over_its_size_says_how_many_of_its_actions_one_batch_holds() -> None:
    """1,000 actions (the CRD allows 1024) of 4 KiB of code each: the refusal said only "split the
    actions into several ActionBatches", leaving the user to guess into how many. It says their
    size, how many one batch holds, and so how many batches it takes; and that many do load."""
    with pytest.raises(InvalidSpec) as refused:
        load(_programs(1000, 4096))
    message = str(refused.value)
    assert "spec.actions" in message and f"over the {actionbatch_module.MAX_SPEC_BYTES} allowed" in message
    said = message.split("its 1000 actions average ")[1]
    fit = int(said.split("one ActionBatch holds about ")[1].split(";")[0])
    assert f"({-(-1000 // fit)} or more, of at most about {fit} actions each)" in message
    assert 100 < fit < 1000
    load(_programs(fit, 4096))  # the number said fits
    with pytest.raises(InvalidSpec):
        load(_programs(fit + 10, 4096))


def test_one_action_too_big_for_any_batch_is_named() -> None:
    """Splitting cannot help an action whose payload alone is over the limit: it is named."""
    obj = _programs(3, 10)
    obj["spec"]["actions"][1]["payload"]["code"] = "x" * actionbatch_module.MAX_SPEC_BYTES
    said = r"action 'a1' alone takes \d+ bytes, more than any ActionBatch holds: make its payload smaller"
    with pytest.raises(InvalidSpec, match=said):
        load(obj)


def test_the_crd_says_how_many_realistic_actions_fit() -> None:
    """The CRD said "at most 1024" actions, which only ~600-byte actions reach: programs of a few
    KiB hit the spec's byte limit (and etcd's) far sooner, said nowhere a user reads."""
    items = crd_schema(BATCH)["properties"]["spec"]["properties"]["actions"]
    description = items["description"]
    assert f"{actionbatch_module.MAX_SPEC_BYTES // 1024} KiB" in description
    fit = actionbatch_module.MAX_SPEC_BYTES // actionbatch_module.TYPICAL_ACTION_BYTES
    assert f"about {fit} actions of 4 KiB of code each" in description
    load(_programs(fit, 4096))
    with pytest.raises(InvalidSpec):
        load(_programs(fit + 5, 4096))
    assert "etcdserver: request is too large" in description and "--server-side" in description


def test_the_spec_size_counts_bytes_as_the_api_server_stores_them() -> None:
    """600,000 characters of ``&&`` (shell lines, C++) passed the 640 KiB check as 600,000 bytes,
    though the API server stores each ``&`` as 6 bytes (``\\u0026``): 3.6 MB, which etcd refuses
    with only "request is too large". The models refuse it first, saying its size."""
    obj = _programs(4, 150_000)
    for action in obj["spec"]["actions"]:
        action["payload"]["code"] = "&" * 150_000
    with pytest.raises(InvalidSpec, match=r"the spec takes \d{7} bytes as JSON"):
        load(obj)
    load(_programs(4, 150_000))  # the same length of plain characters fits
