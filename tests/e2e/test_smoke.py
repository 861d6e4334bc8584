# mypy: disable-error-code="arg-type,attr-defined,union-attr,index"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""Smoke tests of the cluster itself: the API server, the controller manager, the garbage collector,
CEL validation, and (on the local test bed) pods that are real processes reachable at their pod IPs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from testbed import (
    IMAGE,
    REPO,
    Cluster,
    Json,
    audit_events,
    condition,
    deployment_manifest,
    echo_answers,
    echo_container,
    http_get_json,
    pod_manifest,
    pod_ready,
    restarts_explained,
    wait_for,
    wait_for_audit_event,
    wait_for_gone,
    wait_for_pod,
)

local_only = "pod IPs are reachable from the test process only on the local test bed"


def test_readyz_answers_ok(cluster: Cluster) -> None:
    assert cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_pods_serve_http_at_their_own_pod_ips(cluster: Cluster, namespace: str) -> None:
    if not cluster.is_local_testbed:
        pytest.skip(local_only)
    env = [
        {"name": "GREETING", "value": "hello-$(POD_NAME)"},
        {"name": "ESCAPED", "value": "$$(POD_NAME)"},
        {"name": "UNDEFINED", "value": "$(NO_SUCH_VAR)"},
    ]
    names = ["echo-a", "echo-b"]
    for name in names:
        pod = pod_manifest(name, [echo_container(env=env, args=["$(GREETING)", "$(POD_NAMESPACE)"])])
        # Both on one node: they must still get distinct addresses and both serve on port 8080.
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "tb-cpu-0"}
        cluster.core.create_namespaced_pod(namespace, pod)
    ips = []
    for name in names:
        pod = wait_for_pod(cluster, namespace, name, pod_ready, "Ready")
        ip = pod["status"]["podIP"]
        ips.append(ip)
        seen = http_get_json(f"http://{ip}:8080/")
        assert seen["env"]["POD_IP"] == ip
        assert seen["env"]["POD_NAME"] == name
        assert seen["env"]["POD_NAMESPACE"] == namespace
        assert seen["env"]["GREETING"] == f"hello-{name}"
        assert seen["env"]["ESCAPED"] == "$(POD_NAME)"
        assert seen["env"]["UNDEFINED"] == "$(NO_SUCH_VAR)"
        assert seen["argv"] == [f"hello-{name}", namespace]
        status = pod["status"]["containerStatuses"][0]
        assert status["restartCount"] == 0, restarts_explained(cluster, namespace, pod)
        assert status["ready"] and "running" in status["state"]
        assert pod["status"]["phase"] == "Running"
    assert len(set(ips)) == 2


def test_deployment_produces_its_pods(cluster: Cluster, namespace: str) -> None:
    deployment = deployment_manifest(
        "sleepers", 3, [{"name": "sleep", "image": IMAGE, "command": ["sleep", "3600"]}]
    )
    cluster.apps.create_namespaced_deployment(namespace, deployment)
    wait_for(
        cluster.apps.list_namespaced_deployment,
        lambda d: (d.get("status") or {}).get("readyReplicas") == 3,
        namespace=namespace,
        field_selector="metadata.name=sleepers",
        description="deployment sleepers with 3 ready replicas",
    )
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=sleepers").items
    assert len(pods) == 3
    assert {p.metadata.owner_references[0].kind for p in pods} == {"ReplicaSet"}
    assert all(p.status.phase == "Running" for p in pods)
    assert len({p.status.pod_ip for p in pods}) == 3


def test_deleting_an_owner_deletes_its_children(cluster: Cluster, namespace: str) -> None:
    deployment = deployment_manifest("owned", 2, [echo_container()])
    cluster.apps.create_namespaced_deployment(namespace, deployment)
    wait_for(
        cluster.apps.list_namespaced_deployment,
        lambda d: (d.get("status") or {}).get("readyReplicas") == 2,
        namespace=namespace,
        field_selector="metadata.name=owned",
        description="deployment owned with 2 ready replicas",
    )
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=owned").items
    replica_sets = cluster.apps.list_namespaced_replica_set(namespace, label_selector="app=owned").items
    assert len(pods) == 2 and len(replica_sets) == 1
    # Background propagation: the API server deletes the Deployment at once and the garbage collector
    # deletes the ReplicaSet, then the pods.
    cluster.apps.delete_namespaced_deployment("owned", namespace, propagation_policy="Background")
    wait_for_gone(
        cluster.apps.list_namespaced_replica_set,
        replica_sets[0].metadata.name,
        namespace=namespace,
        description="the deployment's ReplicaSet",
    )
    for pod in pods:
        wait_for_gone(
            cluster.core.list_namespaced_pod, pod.metadata.name, namespace=namespace, description="pod"
        )
    if cluster.is_local_testbed:
        # The node runner killed the servers: nothing listens at the old pod IPs any more.
        for pod in pods:
            assert not echo_answers(pod.status.pod_ip)


CEL_CRD: Json = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "ranges.e2e.tangram.arl.dev"},
    "spec": {
        "group": "e2e.tangram.arl.dev",
        "names": {"plural": "ranges", "singular": "range", "kind": "Range", "listKind": "RangeList"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
                                "x-kubernetes-validations": [
                                    {"rule": "self.min <= self.max", "message": "min must not exceed max"}
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def _create_range(cluster: Cluster, namespace: str, name: str, lo: int, hi: int) -> None:
    body = {"apiVersion": "e2e.tangram.arl.dev/v1", "kind": "Range", "metadata": {"name": name}}
    body["spec"] = {"min": lo, "max": hi}
    cluster.custom.create_namespaced_custom_object("e2e.tangram.arl.dev", "v1", namespace, "ranges", body)


def test_api_server_refuses_a_custom_resource_that_breaks_a_cel_rule(
    cluster: Cluster, namespace: str
) -> None:
    name = CEL_CRD["metadata"]["name"]
    try:
        cluster.apiext.create_custom_resource_definition(CEL_CRD)
    except ApiException as exc:
        if exc.status != 409:
            raise
    try:
        wait_for(
            cluster.apiext.list_custom_resource_definition,
            lambda o: condition(o, "Established") == "True",
            field_selector=f"metadata.name={name}",
            description=f"CRD {name} Established",
        )
        _create_range(cluster, namespace, "fine", 1, 2)
        with pytest.raises(ApiException) as refused:
            _create_range(cluster, namespace, "inverted", 3, 2)
        assert refused.value.status == 422
        assert "min must not exceed max" in str(refused.value.body)
    finally:
        cluster.apiext.delete_custom_resource_definition(name)


ACTIONPOOL_CRD = "actionpools.tangram.arl.dev"
SAMPLE = REPO / "manifests" / "samples" / "actionpool-python.yaml"


@pytest.mark.parametrize(
    ("min_hosts", "max_hosts", "warm_hosts", "refusal"),
    [
        (2, 2, 1, None),  # the boundary of min <= max: accepted
        (3, 2, 1, "minHosts must not exceed maxHosts"),
        (0, 4, 4, None),  # the boundary of warm <= max: accepted
        (0, 4, 5, "warmHosts must not exceed maxHosts"),
    ],
)
def test_the_actionpool_crd_checks_its_scaling_bounds_in_the_api_server(
    cluster: Cluster, namespace: str, min_hosts: int, max_hosts: int, warm_hosts: int, refusal: str | None
) -> None:
    """The project's own CEL rules, on the CRD the suite applied from crds/ (generated from the API
    models), against the ActionPool sample with its scaling bounds changed."""
    assert ACTIONPOOL_CRD in cluster.crds, f"crds/ should hold the ActionPool CRD; applied: {cluster.crds}"
    sample = yaml.safe_load(SAMPLE.read_text())
    group, version = sample["apiVersion"].split("/")
    sample["metadata"] = {"name": f"bounds-{min_hosts}-{max_hosts}-{warm_hosts}"}
    sample["spec"]["scaling"].update(minHosts=min_hosts, maxHosts=max_hosts, warmHosts=warm_hosts)
    if refusal is None:
        created = cluster.custom.create_namespaced_custom_object(
            group, version, namespace, "actionpools", sample
        )
        assert created["spec"]["scaling"]["minHosts"] == min_hosts
        return
    with pytest.raises(ApiException) as refused:
        cluster.custom.create_namespaced_custom_object(group, version, namespace, "actionpools", sample)
    assert refused.value.status == 422
    assert refusal in str(refused.value.body)


def _call(fn: Any, *args: Any) -> int:
    """The HTTP status of one API call made with a ServiceAccount's client."""
    try:
        fn(*args)
    except ApiException as exc:
        return int(exc.status)
    return 200


def test_the_audit_log_records_who_called_what_and_the_answer(cluster: Cluster, namespace: str) -> None:
    """What RBAC tests read (testbed.audit_events): user, verb, resource, subresource, namespace, code."""
    if not cluster.is_local_testbed:
        pytest.skip("the audit log is the local test bed's (hack/cluster-up.sh turns it on)")
    assert cluster.local_dir is not None
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "auditee"}})
    rule = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "read-config"}, "rules": [rule]})
    binding = {
        "metadata": {"name": "read-config"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-config"},
        "subjects": [{"kind": "ServiceAccount", "name": "auditee", "namespace": namespace}],
    }
    rbac.create_namespaced_role_binding(namespace, binding)
    cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "present"}, "data": {"a": "b"}}
    )
    token = cluster.core.create_namespaced_service_account_token(
        "auditee", namespace, {"spec": {}}
    ).status.token
    cfg = client.Configuration()
    cfg.host = cluster.api.configuration.host
    cfg.ssl_ca_cert = cluster.api.configuration.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    user = f"system:serviceaccount:{namespace}:auditee"
    with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        # RBAC takes effect once the binding reaches the authorizer's informer cache (milliseconds,
        # with no event to watch for): retry the allowed call until a deadline.
        deadline = time.monotonic() + 30
        while _call(core.read_namespaced_config_map, "present", namespace) != 200:
            assert time.monotonic() < deadline, "the RoleBinding never let the auditee read configmap present"
            time.sleep(0.1)
        assert _call(core.list_namespaced_secret, namespace) == 403
        assert _call(core.read_namespaced_pod_status, "nothing", namespace) == 403

    def seen(verb: str, resource: str, subresource: str | None, code: int) -> Json:
        def matches(e: Json) -> bool:
            ref = e.get("objectRef") or {}
            return (
                e["verb"] == verb
                and e["stage"] == "ResponseComplete"
                and ref.get("resource") == resource
                and ref.get("subresource") == subresource
                and ref.get("namespace") == namespace
                and (e.get("responseStatus") or {}).get("code") == code
            )

        return wait_for_audit_event(
            cluster.local_dir, matches, user=user, description=f"{verb} {resource}/{subresource} -> {code}"
        )

    got = seen("get", "configmaps", None, 200)
    assert got["user"]["username"] == user and got["objectRef"]["name"] == "present"
    assert got["objectRef"].get("apiGroup", "") == ""  # the core group
    seen("list", "secrets", None, 403)
    assert seen("get", "pods", "status", 403)["objectRef"]["name"] == "nothing"
    events = audit_events(cluster.local_dir, user=user)
    assert events and {e["user"]["username"] for e in events} == {user}
    assert not [e for e in events if e["verb"] in ("create", "update", "patch", "delete")]
