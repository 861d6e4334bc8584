# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Bad input, from the descriptions the operator publishes (docs/reliability.md): the gateway's
``/openapi.json`` drives hypothesis (derandomized: the same examples every run) through every JSON
body it documents, and the CRDs' OpenAPI schemas drive ActionBatch and ActionPool objects sent to
the API server. Every one is a 4xx whose body names the problem, and afterwards the leader still
leads and runs a real action.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from chaos import GROUP, VERSION, make_pool, record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException
from operator_harness import Operator, trainer_token
from testbed import REPO, Cluster

FUZZ = settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ODD_TEXT = st.sampled_from(
    ["\ud800", "\x00", "\u202e\u0000evil", "e\u0301" * 4096, "\U0001f4a9" * 1000, "\ufeff", "\uffff"]
) | st.text(min_size=1, max_size=64)
HUGE_NUMBERS = st.sampled_from([-1, -(2**63), 2**63, 10**30, -1e308, 1e308, 1e-320])


class Gateway:
    def __init__(self, port: int, token: str, ns: str) -> None:
        self.port, self.token, self.ns = port, token, ns
        self.seen: dict[int, int] = {}

    def post(self, path: str, data: bytes, content_type: str = "application/json") -> tuple[int, str]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method="POST",
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": content_type,
                "X-Tangram-Namespace": self.ns,
                "X-Tangram-Pool": "nope",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, body = resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode(errors="replace")
        self.seen[status] = self.seen.get(status, 0) + 1
        return status, body


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref:
        return _resolve(spec, spec["components"]["schemas"][ref.rsplit("/", 1)[1]])
    for option in schema.get("anyOf", []):
        if option.get("type") != "null":
            return _resolve(spec, option)
    return schema


def _dummy(spec: dict[str, Any], schema: dict[str, Any]) -> Any:
    s = _resolve(spec, schema)
    if "enum" in s:
        return s["enum"][0]
    t = s.get("type")
    if t == "object":
        return {
            k: _dummy(spec, s["properties"][k]) for k in s.get("required", []) if k in s.get("properties", {})
        }
    return {"string": "x", "integer": 1, "number": 1, "boolean": True, "array": []}.get(t or "", "x")


def _single_type(spec: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """The one JSON type a property takes, or None when it takes several or any (nothing is then
    a wrong type for it)."""
    options = [o for o in schema.get("anyOf", [schema]) if o.get("type") != "null"]
    if len(options) != 1:
        return None
    t = _resolve(spec, options[0]).get("type")
    return t if isinstance(t, str) else None


def _wrong_for(t: str | None) -> st.SearchStrategy[Any]:
    """Values no lax parser turns into the declared type."""
    options: dict[str, st.SearchStrategy[Any]] = {
        "string": st.one_of(st.integers(), st.lists(st.integers(), max_size=2), st.just({"a": 1})),
        "integer": st.one_of(
            st.text(alphabet="abc", min_size=1), st.lists(st.integers(), max_size=2), st.just({})
        ),
        "number": st.one_of(
            st.text(alphabet="abc", min_size=1), st.lists(st.integers(), max_size=2), st.just({})
        ),
        "boolean": st.one_of(st.just("maybe"), st.lists(st.integers(), max_size=2), st.just({})),
        "array": st.one_of(st.integers(), st.just({"a": 1})),
        "object": st.one_of(st.integers(), st.just([1, 2]), st.text(alphabet="abc", min_size=1)),
    }
    return options.get(t or "", st.just([[[]]]))


def _json_bodies(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {})
            if method == "post" and "application/json" in content and "{" not in path:
                yield path, _resolve(spec, content["application/json"]["schema"])


@pytest.fixture(scope="module")
def gateway(
    cluster: Cluster, operator: Operator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    ns = f"fuzz-{int(time.time())}"
    cluster.kubectl("create", "namespace", ns)
    try:
        yield Gateway(operator.leader().port, trainer_token(cluster, ns), ns)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_every_documented_body_refuses_bad_input_naming_it(
    cluster: Cluster, namespace: str, operator: Operator, gateway: Gateway
) -> None:
    lead = operator.leader()
    spec = json.loads(lead.get("/openapi.json"))
    bodies = dict(_json_bodies(spec))
    assert "/run_code" in bodies and "/v1/actions" in bodies, sorted(bodies)
    problems: list[str] = []
    cases = 0

    def check(path: str, status: int, body: str, names: str) -> None:
        nonlocal cases
        cases += 1
        if not 400 <= status < 500:
            problems.append(f"{path}: {status} for bad input naming {names!r}: {body[:200]}")
        elif names.lower() not in body.lower():
            problems.append(f"{path}: {status} does not name {names!r}: {body[:200]}")

    unknown: dict[str, int] = {}

    def fuzz(path: str, schema: dict[str, Any]) -> None:
        base = _dummy(spec, schema)
        props = {k: _resolve(spec, v) for k, v in schema.get("properties", {}).items()}
        typed = {k: t for k, v in schema.get("properties", {}).items() if (t := _single_type(spec, v))}

        @FUZZ
        @given(raw=st.binary(max_size=64).filter(lambda b: not _parses(b)))
        def malformed(raw: bytes) -> None:
            status, body = gateway.post(path, raw)
            check(path, status, body, "json")

        malformed()
        if not props:
            return

        @FUZZ
        @given(data=st.data())
        def wrong_type(data: st.DataObject) -> None:
            name = data.draw(st.sampled_from(sorted(typed)))
            value = data.draw(_wrong_for(typed[name]))
            status, body = gateway.post(path, json.dumps({**base, name: value}).encode())
            check(path, status, body, name)

        if typed:
            wrong_type()

        @FUZZ
        @given(data=st.data())
        def odd_values(data: st.DataObject) -> None:
            # Odd unicode in strings, negative and huge numbers in numbers: valid JSON, so the answer
            # is a refusal of the value or of the pool that does not exist; never a 5xx or a 2xx.
            name = data.draw(st.sampled_from(sorted(props)))
            t = props[name].get("type")
            value = data.draw(HUGE_NUMBERS if t in ("integer", "number") else ODD_TEXT)
            status, body = gateway.post(path, json.dumps({**base, name: value}).encode())
            nonlocal cases
            cases += 1
            if not 400 <= status < 500 or "error" not in json.loads(body):
                problems.append(f"{path}: {status} for {name}={value!r:.40}: {body[:200]}")

        odd_values()

        status, body = gateway.post(path, json.dumps({**base, "no_such_field_zz": 1}).encode())
        unknown[path] = status
        if path == "/v1/actions":
            check(path, status, body, "no_such_field_zz")

    for path, schema in bodies.items():
        fuzz(path, schema)

    # A 64 MB body: refused by size before it is parsed, naming the limit.
    big = b'{"code": "' + b"x" * (64 << 20) + b'", "language": "python"}'
    t0 = time.monotonic()
    status, body = gateway.post("/run_code", big)
    big_s = time.monotonic() - t0
    cases += 1
    if status != 413 or "limit" not in body.lower():
        problems.append(f"64 MB body: {status} {body[:200]}")

    # NDJSON with a broken line: that line refused by number, the stream still answers.
    status, body = gateway.post("/v1/actions:stream", b'{"type": "code"\n[1,2]\n', "application/x-ndjson")
    cases += 1
    if status >= 500:
        problems.append(f"stream with broken lines: {status} {body[:200]}")

    # Unharmed: the same leader, and it runs a real action for the namespace that has a pool.
    assert operator.leader().name == lead.name
    make_pool(cluster, gateway.ns, "py", hosts=1)
    req = urllib.request.Request(
        f"http://127.0.0.1:{lead.port}/run_code",
        data=json.dumps({"code": "print(6 * 7)", "language": "python"}).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {gateway.token}",
            "Content-Type": "application/json",
            "X-Tangram-Namespace": gateway.ns,
            "X-Tangram-Pool": "py",
        },
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["run_result"]["stdout"].strip() == "42", answer
    record(
        "bad-input-gateway",
        cases=cases,
        bodies=len(bodies),
        statuses=gateway.seen,
        problems=len(problems),
        big_body_s=round(big_s, 2),
        unknown_field_statuses=unknown,
        first_problems=problems[:5],
    )
    assert not problems, f"{len(problems)} of {cases} bad inputs answered wrongly:\n" + "\n".join(
        problems[:20]
    )


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def _crd_spec(kind: str) -> dict[str, Any]:
    for f in (REPO / "crds").glob("*.yaml"):
        doc = yaml.safe_load(f.read_text())
        if doc["spec"]["names"]["kind"] == kind:
            schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
                "spec"
            ]
            return schema
    raise AssertionError(f"no CRD of kind {kind}")


@pytest.mark.parametrize("kind,plural", [("ActionBatch", "actionbatches"), ("ActionPool", "actionpools")])
def test_the_api_server_refuses_bad_objects_naming_the_field(
    cluster: Cluster, namespace: str, operator: Operator, kind: str, plural: str
) -> None:
    schema = _crd_spec(kind)
    props = {k: v for k, v in schema.get("properties", {}).items() if v.get("type")}
    refused: list[int] = []
    problems: list[str] = []

    @FUZZ
    @given(data=st.data())
    def bad(data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(props)))
        t = props[name]["type"]
        value = data.draw(
            _wrong_for(t) | (HUGE_NUMBERS.filter(lambda v: v < 0) if t in ("integer",) else _wrong_for(t))
        )
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": kind,
            "metadata": {"generateName": "fuzz-"},
            "spec": {name: value},
        }
        try:
            cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)
        except ApiException as exc:
            refused.append(exc.status)
            if not 400 <= exc.status < 500 or name not in (exc.body or ""):
                problems.append(f"spec.{name}={value!r:.40}: {exc.status} {(exc.body or '')[:200]}")
            return
        problems.append(f"spec.{name}={value!r:.40} accepted")

    bad()
    assert operator.leader() is not None
    record(
        f"bad-input-crd-{kind}",
        cases=len(refused) + sum("accepted" in p for p in problems),
        refused=len(refused),
        statuses=sorted(set(refused)),
        problems=len(problems),
        first_problems=problems[:5],
    )
    assert not problems, "\n".join(problems[:20])
