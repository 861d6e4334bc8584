# mypy: disable-error-code="arg-type"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""What a kubelet does for a pod, checked through the API only (so the same tests hold on kind):
exit codes, restart policies, graceful deletion, init containers, ConfigMaps, in-cluster credentials."""

from __future__ import annotations

import pytest
from kubernetes import client
from testbed import (
    IMAGE,
    Cluster,
    Json,
    echo_answers,
    echo_container,
    pod_manifest,
    pod_phase,
    pod_ready,
    shell_container,
    wait_for,
    wait_for_gone,
    wait_for_pod,
)


def _status(pod: Json, container: str = "main") -> Json:
    return next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)


def test_never_reports_the_exit_code_and_fails_the_pod(cluster: Cluster, namespace: str) -> None:
    pod = pod_manifest("exit3", [shell_container("exit 3")], restartPolicy="Never")
    cluster.core.create_namespaced_pod(namespace, pod)
    done = wait_for_pod(cluster, namespace, "exit3", pod_phase("Failed"), "Failed")
    terminated = _status(done)["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["reason"] == "Error"
    assert _status(done)["restartCount"] == 0


def test_on_failure_restarts_until_the_container_succeeds(cluster: Cluster, namespace: str) -> None:
    # The first run leaves a mark in an emptyDir (which outlives container restarts) and fails.
    script = "if [ -e /scratch/ran ]; then exit 0; fi; touch /scratch/ran; exit 7"
    container = shell_container(script, volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}])
    pod = pod_manifest(
        "retry", [container], restartPolicy="OnFailure", volumes=[{"name": "scratch", "emptyDir": {}}]
    )
    cluster.core.create_namespaced_pod(namespace, pod)
    done = wait_for_pod(cluster, namespace, "retry", pod_phase("Succeeded"), "Succeeded")
    status = _status(done)
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 7
    assert status["state"]["terminated"]["exitCode"] == 0


def test_always_restarts_a_container_that_exits(cluster: Cluster, namespace: str) -> None:
    pod = pod_manifest("blink", [shell_container("exit 0")], restartPolicy="Always")
    cluster.core.create_namespaced_pod(namespace, pod)
    seen = wait_for_pod(cluster, namespace, "blink", lambda p: _restarts(p) >= 2, "restarted twice")
    assert seen["status"]["phase"] == "Running"
    assert _status(seen)["lastState"]["terminated"]["reason"] == "Completed"


def _restarts(pod: Json) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return int(statuses[0]["restartCount"]) if statuses else 0


def test_deletion_kills_a_process_that_ignores_sigterm_after_the_grace_period(
    cluster: Cluster, namespace: str
) -> None:
    server = echo_container()
    # The server ignores SIGTERM, so only the SIGKILL after the grace period stops it.
    server["command"] = [
        "python3",
        "-c",
        "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + server["command"][2],
    ]
    pod = pod_manifest("stubborn", [server], terminationGracePeriodSeconds=1)
    cluster.core.create_namespaced_pod(namespace, pod)
    ready = wait_for_pod(cluster, namespace, "stubborn", pod_ready, "Ready")
    cluster.core.delete_namespaced_pod("stubborn", namespace)
    wait_for_gone(
        cluster.core.list_namespaced_pod, "stubborn", namespace=namespace, description="pod stubborn"
    )
    if cluster.is_local_testbed:
        assert not echo_answers(ready["status"]["podIP"])


def test_init_containers_run_first_and_share_volumes(cluster: Cluster, namespace: str) -> None:
    init = shell_container("echo prepared > /shared/note", name="prepare")
    init["volumeMounts"] = [{"name": "shared", "mountPath": "/shared"}]
    main = shell_container('test "$(cat /shared/note)" = prepared')
    main["volumeMounts"] = [{"name": "shared", "mountPath": "/shared"}]
    pod = pod_manifest("init", [main], initContainers=[init], restartPolicy="Never")
    pod["spec"]["volumes"] = [{"name": "shared", "emptyDir": {}}]
    cluster.core.create_namespaced_pod(namespace, pod)
    done = wait_for_pod(cluster, namespace, "init", pod_phase("Succeeded", "Failed"), "finished")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert done["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_configmaps_reach_env_and_volumes(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"MODE": "fast", "limits.txt": "8 cores"}}
    )
    script = (
        'test "$MODE" = fast && test "$X_MODE" = fast && test "$(cat /etc/settings/limits.txt)" = "8 cores"'
    )
    main = shell_container(
        script,
        env=[{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}}}],
        envFrom=[{"prefix": "X_", "configMapRef": {"name": "settings"}}],
        volumeMounts=[{"name": "settings", "mountPath": "/etc/settings", "readOnly": True}],
    )
    pod = pod_manifest(
        "config",
        [main],
        restartPolicy="Never",
        volumes=[{"name": "settings", "configMap": {"name": "settings"}}],
    )
    cluster.core.create_namespaced_pod(namespace, pod)
    done = wait_for_pod(cluster, namespace, "config", pod_phase("Succeeded", "Failed"), "finished")
    assert done["status"]["phase"] == "Succeeded", done["status"]


IN_CLUSTER_CLIENT = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
req = urllib.request.Request(f"https://{host}:{port}/version", headers={"Authorization": f"Bearer {token}"})
https = urllib.request.HTTPSHandler(context=ctx)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https)
version = json.loads(opener.open(req, timeout=10).read())
assert open(f"{sa}/namespace").read() == os.environ["POD_NAMESPACE"]
print(version["gitVersion"])
"""


def test_pods_reach_the_api_server_with_their_service_account(cluster: Cluster, namespace: str) -> None:
    main = {
        "name": "main",
        "image": IMAGE,
        "command": ["python3", "-c", IN_CLUSTER_CLIENT],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    }
    cluster.core.create_namespaced_pod(namespace, pod_manifest("incluster", [main], restartPolicy="Never"))
    done = wait_for_pod(cluster, namespace, "incluster", pod_phase("Succeeded", "Failed"), "finished")
    assert done["status"]["phase"] == "Succeeded", done["status"]


def test_a_container_whose_program_is_missing_reports_a_start_error(cluster: Cluster, namespace: str) -> None:
    main = {"name": "main", "image": IMAGE, "command": ["/no/such/program"]}
    cluster.core.create_namespaced_pod(namespace, pod_manifest("broken", [main], restartPolicy="Never"))
    done = wait_for_pod(cluster, namespace, "broken", pod_phase("Failed"), "Failed")
    terminated = _status(done)["state"]["terminated"]
    # What containerd reports when the entrypoint cannot be executed.
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
    assert "/no/such/program" in terminated["message"]


def test_in_place_resize_is_reported_in_the_container_status(cluster: Cluster, namespace: str) -> None:
    resources = {"requests": {"cpu": "1", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "64Mi"}}
    main = shell_container("sleep 3600", resources=resources)
    cluster.core.create_namespaced_pod(namespace, pod_manifest("elastic", [main]))
    wait_for_pod(cluster, namespace, "elastic", pod_phase("Running"), "Running")
    patch = (
        '{"spec":{"containers":[{"name":"main","resources":{"requests":{"cpu":"2"},"limits":{"cpu":"2"}}}]}}'
    )
    cluster.kubectl("patch", "pod", "elastic", "-n", namespace, "--subresource", "resize", "--patch", patch)
    resized = wait_for_pod(
        cluster,
        namespace,
        "elastic",
        lambda p: (_status(p).get("resources") or {}).get("requests", {}).get("cpu") == "2",
        "reporting 2 CPUs",
    )
    assert _status(resized)["resources"]["limits"]["cpu"] == "2"
    assert _status(resized)["restartCount"] == 0


def test_kubectl_logs_shows_what_the_container_printed(cluster: Cluster, namespace: str) -> None:
    main = shell_container("echo first line; echo to stderr >&2; echo last line")
    cluster.core.create_namespaced_pod(namespace, pod_manifest("talker", [main], restartPolicy="Never"))
    wait_for_pod(cluster, namespace, "talker", pod_phase("Succeeded"), "Succeeded")
    logs = cluster.kubectl("logs", "talker", "-n", namespace).stdout.splitlines()
    assert logs == ["first line", "to stderr", "last line"]
    assert cluster.kubectl("logs", "talker", "-n", namespace, "--tail=1").stdout.splitlines() == ["last line"]


def test_a_failing_liveness_probe_restarts_the_container(cluster: Cluster, namespace: str) -> None:
    # Healthy for its first moments only: the probe then fails and the container is restarted.
    main = shell_container(
        "touch /tmp/healthy; sleep 2; rm /tmp/healthy; sleep 3600",
        livenessProbe={
            "exec": {"command": ["test", "-e", "/tmp/healthy"]},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    )
    pod = pod_manifest("liveness", [main], terminationGracePeriodSeconds=1)
    cluster.core.create_namespaced_pod(namespace, pod)
    seen = wait_for_pod(
        cluster, namespace, "liveness", lambda p: _restarts(p) >= 1, "restarted by its liveness probe"
    )
    assert seen["status"]["phase"] == "Running"


def test_ready_pods_appear_in_their_services_endpoint_slices(cluster: Cluster, namespace: str) -> None:
    if cluster.pod_ips_are_loopback:
        pytest.skip("this test bed could not add pod addresses to lo (no CAP_NET_ADMIN): loopback pod IPs")
    cluster.core.create_namespaced_pod(namespace, pod_manifest("backend", [echo_container()]))
    service = {
        "metadata": {"name": "backend"},
        "spec": {"selector": {"app": "backend"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    cluster.core.create_namespaced_service(namespace, service)
    pod = wait_for_pod(cluster, namespace, "backend", pod_ready, "Ready")
    discovery = client.DiscoveryV1Api(cluster.api)
    endpoints = wait_for(
        discovery.list_namespaced_endpoint_slice,
        lambda s: any((e.get("conditions") or {}).get("ready") for e in s.get("endpoints") or []),
        namespace=namespace,
        label_selector="kubernetes.io/service-name=backend",
        description="a ready endpoint for service backend",
    )
    assert [e["addresses"] for e in endpoints["endpoints"]] == [[pod["status"]["podIP"]]]
    assert endpoints["endpoints"][0]["targetRef"]["name"] == "backend"
    assert endpoints["ports"][0]["port"] == 8080
