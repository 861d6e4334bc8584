# mypy: disable-error-code="no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""What a person watching Events learns of batches, on the test bed's real API server: kopf posts
Events only from its handlers' context, and a batch's end is written by the operator's status
writer, outside any handler; these show the Events do reach the API server. And what a batch's
status does at the API server's limits: a status refused for what it holds, the largest status."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from operator_harness import Operator, batch_manifest, create, pool_manifest, running_operator, wait_batch
from testbed import Cluster, condition, wait_for

from arl_tangram.api.actionbatch import (
    MAX_ACTION_ID_LENGTH,
    MAX_ACTIONS,
    MAX_OUTPUT_BYTES_PER_ACTION,
    MAX_RESULT_BUDGET_BYTES,
    MAX_SPEC_BYTES,
    ActionBatchSpec,
    ActionResult,
)
from arl_tangram.controllers.actionbatch import BatchObservation, reconcile_actionbatch


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator"), ("op-a",)) as op:
        yield op


def _events_of(cluster: Cluster, namespace: str, name: str, reason: str, timeout: float = 60) -> Any:
    """The Events of the object ``name`` with ``reason``, once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        listed = cluster.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        found = [e for e in listed.items if e.reason == reason]
        if found:
            return found
        assert time.monotonic() < deadline, (
            f"no {reason} Event of {name}: {[(e.type, e.reason, e.message) for e in listed.items]}"
        )
        time.sleep(0.5)


def _action(i: int, code: str) -> dict[str, Any]:
    return {"id": f"a{i}", "type": "code", "target": "py", "payload": {"language": "python", "code": code}}


def test_a_batchs_end_is_an_event_a_warning_naming_why_when_an_action_failed(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    create(cluster, namespace, "actionpools", pool_manifest("py"))
    create(
        cluster,
        namespace,
        "actionbatches",
        batch_manifest("mixed", [_action(0, "print(0)"), _action(1, "raise SystemExit(3)")]),
    )
    create(cluster, namespace, "actionbatches", batch_manifest("clean", [_action(0, "print(0)")]))
    wait_batch(cluster, namespace, "mixed")
    wait_batch(cluster, namespace, "clean")
    (failed,) = _events_of(cluster, namespace, "mixed", "SomeFailed")
    assert failed.type == "Warning" and failed.involved_object.kind == "ActionBatch"
    assert "1 succeeded, 1 failed" in failed.message and "NonZeroExit" in failed.message
    (clean,) = _events_of(cluster, namespace, "clean", "AllFinished")
    assert clean.type == "Normal" and "1 succeeded" in clean.message


def test_a_batch_refused_for_its_size_is_a_warning_event(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    # 1024 actions of about 700 bytes each: over the models' 640 KiB, well within the API server's.
    big = [_action(i, f"print({i})  # " + "x" * 700) for i in range(1024)]
    create(cluster, namespace, "actionbatches", batch_manifest("huge", big))
    (refused,) = _events_of(cluster, namespace, "huge", "InvalidSpec")
    assert refused.type == "Warning" and "bytes" in refused.message
    batch = wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: any(c["type"] == "Accepted" for c in o.get("status", {}).get("conditions", [])),
        group="tangram.arl.dev",
        version="v1alpha1",
        namespace=namespace,
        plural="actionbatches",
        field_selector="metadata.name=huge",
        description="the huge batch's status",
    )
    assert batch["status"]["conditions"][0]["reason"] == "InvalidSpec"
    # What ``kubectl get`` prints for it (the CRD's columns): not empty, as for a batch never seen.
    row = cluster.kubectl("get", "actionbatch", "huge", "-n", namespace, "--no-headers").stdout.split()
    assert row[:3] == ["huge", "False", "InvalidSpec"], row


def test_a_pool_whose_hosts_cannot_start_is_a_warning_event_and_its_recovery_a_normal_one(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """A pool degraded showed only in its conditions: alerting on Warning Events heard nothing."""
    create(
        cluster,
        namespace,
        "actionpools",
        pool_manifest(
            "py", template={"podSpec": {"securityContext": {"runAsNonRoot": True}}}, scaling={"minHosts": 1}
        ),
    )
    (warning,) = _events_of(cluster, namespace, "py", "HostsCannotStart", timeout=120)
    assert warning.type == "Warning" and "CreateContainerConfigError" in warning.message
    assert warning.involved_object.kind == "ActionPool"
    cluster.custom.patch_namespaced_custom_object(
        "tangram.arl.dev",
        "v1alpha1",
        namespace,
        "actionpools",
        "py",
        {"spec": {"template": {"podSpec": None}}},
    )
    (healthy,) = _events_of(cluster, namespace, "py", "Healthy", timeout=120)
    assert healthy.type == "Normal"


def _refusing_results_policy(namespace: str) -> str:
    """A ValidatingAdmissionPolicy, bound to ``namespace`` only, refusing ActionBatch statuses that
    hold results: as a cluster's own policy (or any answer the API server gives for what a status
    holds) would refuse the operator's writes, for good."""
    name = f"tangram-e2e-no-results-{namespace}"
    return f"""
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {{name: {name}}}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
    - apiGroups: [tangram.arl.dev]
      apiVersions: [v1alpha1]
      operations: [UPDATE]
      resources: [actionbatches/status]
  validations:
  - expression: "!has(object.status) || !has(object.status.results) || size(object.status.results) == 0"
    message: results refused by the e2e policy
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {{name: {name}}}
spec:
  policyName: {name}
  validationActions: [Deny]
  matchResources:
    namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: {namespace}}}}}
"""


def _results_refused(cluster: Cluster, namespace: str, name: str) -> bool:
    """Whether the API server refuses a status with results for the batch ``name`` (the policy is
    in effect: it takes a moment after it is created)."""
    status = {"results": [{"id": "a0", "state": "Pending"}]}
    try:
        cluster.custom.patch_namespaced_custom_object_status(
            "tangram.arl.dev", "v1alpha1", namespace, "actionbatches", name, {"status": status}
        )
    except ApiException as exc:
        return exc.status == 422 and "e2e policy" in str(exc.body)
    return False


def test_a_batch_whose_status_the_api_server_refuses_still_completes_saying_why_its_results_are_not_there(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Before, a status write refused for what it held was only sent again, for good: the batch
    never showed counts nor Complete, and nothing said why. Now its status without the results
    says it completed, and ``ResultsRecorded=False`` quotes the API server's answer (a Warning Event
    too); once the refusal ends, the full status lands."""
    policy = _refusing_results_policy(namespace)
    cluster.kubectl("apply", "-f", "-", stdin=policy)
    try:
        # A batch of no pool (it only waits) to learn when the policy is in effect.
        create(cluster, namespace, "actionbatches", batch_manifest("probe", [_action(0, "1")]))
        deadline = time.monotonic() + 60
        while not _results_refused(cluster, namespace, "probe"):
            assert time.monotonic() < deadline, "the e2e policy never took effect"
            time.sleep(0.5)
        create(cluster, namespace, "actionpools", pool_manifest("py"))
        create(
            cluster,
            namespace,
            "actionbatches",
            batch_manifest("b", [_action(0, "print(0)"), _action(1, "1")]),
        )
        done = wait_batch(cluster, namespace, "b")
        assert done["status"]["counts"]["succeeded"] == 2 and not done["status"].get("results")
        (recorded,) = [c for c in done["status"]["conditions"] if c["type"] == "ResultsRecorded"]
        assert recorded["status"] == "False" and recorded["reason"] == "StatusRefused"
        assert (
            "e2e policy" in recorded["message"]
            and f"/v1/batches/{namespace}/b/results" in recorded["message"]
        )
        (warning,) = _events_of(cluster, namespace, "b", "StatusRefused")
        assert warning.type == "Warning" and "e2e policy" in warning.message
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", stdin=policy)
    full = wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: len(o.get("status", {}).get("results") or ()) == 2,
        group="tangram.arl.dev",
        version="v1alpha1",
        namespace=namespace,
        plural="actionbatches",
        field_selector="metadata.name=b",
        description="the batch's full status, once the policy is gone",
        timeout=120,
    )
    assert condition(full, "Complete") == "True" and condition(full, "ResultsRecorded") is None


def test_the_largest_batch_the_models_accept_still_takes_its_largest_status(
    cluster: Cluster, namespace: str
) -> None:
    """Size: a batch at every limit at once (1024 actions with 128-character ids, a spec of nearly
    640 KiB, 256 KiB of annotations, the widest results budget) takes the status the operator
    computes for it at its largest (every action failed with 64 KiB of output, the Running message
    at its cut), on the test bed's real etcd: status growth never makes the write exceed the
    object limit (1.5 MiB), which would leave the batch's status stale."""
    ids = [f"{i:05d}".rjust(MAX_ACTION_ID_LENGTH, "x") for i in range(MAX_ACTIONS)]
    actions = [{"id": i, "type": "code", "target": "p", "payload": {"language": "python"}} for i in ids]
    budget = {"budgetBytes": MAX_RESULT_BUDGET_BYTES, "outputBytesPerAction": MAX_OUTPUT_BYTES_PER_ACTION}
    body = batch_manifest("big", actions, results=budget)
    body["metadata"]["annotations"] = {"note": "z" * 262000}  # the API server's limit: 256 KiB in all
    bare = len(ActionBatchSpec.model_validate(body["spec"]).model_dump_json(by_alias=True, exclude_none=True))
    for a in actions:  # the rest of the spec's budget, in the actions' code
        a["payload"]["code"] = "#" * ((MAX_SPEC_BYTES - bare - 16 * MAX_ACTIONS) // MAX_ACTIONS)
    spec = ActionBatchSpec.model_validate(body["spec"])
    assert len(spec.model_dump_json(by_alias=True, exclude_none=True)) > MAX_SPEC_BYTES - 20 * MAX_ACTIONS
    create(cluster, namespace, "actionbatches", body)
    failed = ActionResult(
        id="-",
        state="Failed",
        exit_code=-(2**31),
        reward=-1.2345678901234567e-300,
        duration_millis=2**50,
        queued_millis=2**50,
        attempts=1000,
        output="y" * MAX_OUTPUT_BYTES_PER_ACTION,
        truncated=True,
        reason="SandboxError",
    )
    now = datetime.now(UTC)
    status, _ = reconcile_actionbatch(
        spec,
        BatchObservation(
            results={i: failed.model_copy(update={"id": i}) for i in ids[:-1]},  # one still running
            conditions=[],
            generation=1,
            start_time=now,
            completion_time=None,
            act_seconds=[1.0] * MAX_ACTIONS,
            held_by=tuple(f"pool p{k}: " + "h" * 200 for k in range(200)),
        ),
        now,
    )
    cluster.custom.patch_namespaced_custom_object_status(
        "tangram.arl.dev",
        "v1alpha1",
        namespace,
        "actionbatches",
        "big",
        [{"op": "add", "path": "/status", "value": {k: v for k, v in status.items() if v is not None}}],
        _content_type="application/json-patch+json",
    )
    got = cluster.custom.get_namespaced_custom_object(
        "tangram.arl.dev", "v1alpha1", namespace, "actionbatches", "big"
    )
    assert len(got["status"]["results"]) == MAX_ACTIONS - 1
