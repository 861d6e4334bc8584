# mypy: disable-error-code="no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""What a person watching Events learns of batches, on the test bed's real API server: kopf posts
Events only from its handlers' context, and a batch's end is written by the operator's status
writer, outside any handler; these show the Events do reach the API server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import Operator, batch_manifest, create, pool_manifest, running_operator, wait_batch
from testbed import Cluster, wait_for


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
