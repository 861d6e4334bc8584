# mypy: disable-error-code="arg-type"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""What a kubelet does for a pod, checked through the API only (so the same tests hold on kind):
exit codes, restart policies, graceful deletion, init containers, ConfigMaps, in-cluster credentials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from testbed import (
    IMAGE,
    REPO,
    Cluster,
    Json,
    downward_env,
    echo_answers,
    echo_container,
    http_get_json,
    pod_manifest,
    pod_phase,
    pod_ready,
    shell_container,
    wait_for,
    wait_for_gone,
    wait_for_pod,
)


def _status(pod: Json, container: str = "main") -> Json:
    """The container's status, or {} while the pod reports none yet (predicates see such pods)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == container), {})


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
    assert _status(resized)["allocatedResources"]["cpu"] == "2"
    assert _status(resized)["restartCount"] == 0
    done = wait_for_pod(cluster, namespace, "elastic", lambda p: not _resize_conditions(p), "done resizing")
    assert done["status"]["observedGeneration"] == done["metadata"]["generation"]


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


def _resize_conditions(pod: Json) -> dict[str, Json]:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conditions if c["type"] in ("PodResizePending", "PodResizeInProgress")}


def _resize(cluster: Cluster, namespace: str, pod: str, resources: Json, container: str = "main") -> None:
    patch = json.dumps({"spec": {"containers": [{"name": container, "resources": resources}]}})
    cluster.kubectl("patch", "pod", pod, "-n", namespace, "--subresource", "resize", "--patch", patch)


def _runner_cpus(cluster: Cluster) -> list[int]:
    """The node runner's own CPU set (the cores it pins pods to), from /proc."""
    assert cluster.local_dir is not None
    pid = (cluster.local_dir / "pids" / "5-node-runner").read_text().split()[0]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: list[int] = []
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                cpus += range(int(lo), int(hi or lo) + 1)
            return cpus
    raise AssertionError(f"no Cpus_allowed_list in /proc/{pid}/status")


# Answers with the CPU affinity of its main thread, of a second thread and of a child process, all
# started before any resize: a resize must reach every one of them.
AFFINITY_SERVER = """
import http.server, json, os, queue, subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
asks, answers = queue.Queue(), queue.Queue()
def second_thread():
    while asks.get():
        answers.put(sorted(os.sched_getaffinity(0)))
threading.Thread(target=second_thread, daemon=True).start()
class Affinity(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        asks.put(True)
        body = json.dumps({"main": sorted(os.sched_getaffinity(0)), "thread": answers.get(timeout=5),
                           "child": sorted(os.sched_getaffinity(child.pid)), "child_pid": child.pid}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["POD_IP"], 8080), Affinity).serve_forever()
"""


def test_in_place_resize_moves_every_process_of_the_container_to_its_new_cores(
    cluster: Cluster, namespace: str
) -> None:
    if not cluster.is_local_testbed:
        pytest.skip("CPU affinity as the resize's actuation is the local test bed's (kind uses CPU quota)")
    cpus = _runner_cpus(cluster)
    if len(cpus) < 2:
        pytest.skip(f"the node runner has {len(cpus)} CPU: a resize has no other core to move to")
    one = {"requests": {"cpu": "1", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "64Mi"}}
    main = {
        "name": "main",
        "image": IMAGE,
        "command": ["python3", "-c", AFFINITY_SERVER],
        "env": downward_env(),
        "resources": one,
        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
    }
    cluster.core.create_namespaced_pod(namespace, pod_manifest("pinned", [main]))
    ip = wait_for_pod(cluster, namespace, "pinned", pod_ready, "Ready")["status"]["podIP"]
    before = http_get_json(f"http://{ip}:8080/")
    assert len(before["main"]) == 1 and before["main"] == before["thread"] == before["child"], before
    assert set(before["main"]) <= set(cpus)

    everything = {"cpu": str(len(cpus)), "memory": "64Mi"}
    _resize(cluster, namespace, "pinned", {"requests": everything, "limits": everything})
    resized = wait_for_pod(
        cluster,
        namespace,
        "pinned",
        lambda p: (
            (_status(p).get("resources") or {}).get("limits", {}).get("cpu") == str(len(cpus))
            and not _resize_conditions(p)
        ),
        f"running with {len(cpus)} CPUs",
    )
    after = http_get_json(f"http://{ip}:8080/")
    assert after["main"] == after["thread"] == after["child"] == cpus, after
    assert after["child_pid"] == before["child_pid"]  # the same processes, moved, not restarted
    assert _status(resized)["restartCount"] == 0

    _resize(cluster, namespace, "pinned", {"requests": one["requests"], "limits": one["limits"]})
    wait_for_pod(
        cluster,
        namespace,
        "pinned",
        lambda p: _status(p).get("allocatedResources", {}).get("cpu") == "1" and not _resize_conditions(p),
        "back to 1 CPU",
    )
    shrunk = http_get_json(f"http://{ip}:8080/")
    assert len(shrunk["main"]) == 1 and shrunk["main"] == shrunk["thread"] == shrunk["child"], shrunk


RESERVED = {"key": "tangram.arl.dev/testbed-reserved", "operator": "Exists", "effect": "NoSchedule"}


def test_a_resize_the_node_cannot_hold_is_refused_and_one_it_cannot_hold_yet_is_deferred(
    cluster: Cluster, namespace: str
) -> None:
    if not cluster.is_local_testbed:
        pytest.skip("sized for the local test bed's reserved 16-CPU node")
    # The reserved node (hack/testbed/nodes.yaml): no other test's pods count on its 16 CPUs.
    reserved = {"nodeSelector": {"kubernetes.io/hostname": "tb-reserved-0"}, "tolerations": [RESERVED]}
    big = shell_container("sleep 3600", resources={"requests": {"cpu": "12"}})
    small = shell_container("sleep 3600", resources={"requests": {"cpu": "2"}})
    cluster.core.create_namespaced_pod(namespace, pod_manifest("big", [big], **reserved))
    cluster.core.create_namespaced_pod(namespace, pod_manifest("small", [small], **reserved))
    for name in ("big", "small"):
        wait_for_pod(cluster, namespace, name, pod_phase("Running"), "Running")

    # More than the node has at all: v1.36's PodResize admission plugin refuses it in the API server
    # (so the kubelet's Infeasible is left for what only a node can tell).
    patch = json.dumps({"spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "40"}}}]}})
    refused = cluster.kubectl(
        "patch", "pod", "small", "-n", namespace, "--subresource", "resize", "--patch", patch, check=False
    )
    assert refused.returncode != 0 and "Forbidden" in refused.stderr and "cpu" in refused.stderr, (
        refused.stderr
    )

    _resize(cluster, namespace, "small", {"requests": {"cpu": "6"}})  # 12 + 6 > 16: not while big runs
    deferred = wait_for_pod(
        cluster,
        namespace,
        "small",
        lambda p: _resize_conditions(p).get("PodResizePending", {}).get("reason") == "Deferred",
        "resize Deferred",
    )
    pending = _resize_conditions(deferred)["PodResizePending"]
    assert pending["status"] == "True" and "cpu" in pending["message"], pending
    assert pending["observedGeneration"] == deferred["metadata"]["generation"]
    assert _status(deferred)["allocatedResources"]["cpu"] == "2"  # nothing allocated yet
    cluster.core.delete_namespaced_pod("big", namespace, grace_period_seconds=0)
    done = wait_for_pod(
        cluster,
        namespace,
        "small",
        lambda p: _status(p).get("allocatedResources", {}).get("cpu") == "6" and not _resize_conditions(p),
        "resized once big is gone",
    )
    assert _status(done)["resources"]["requests"]["cpu"] == "6"


def test_a_resize_policy_of_restart_container_restarts_it_with_the_new_resources(
    cluster: Cluster, namespace: str
) -> None:
    resources = {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}
    main = shell_container("sleep 3600", resources=resources)
    main["resizePolicy"] = [{"resourceName": "cpu", "restartPolicy": "RestartContainer"}]
    cluster.core.create_namespaced_pod(
        namespace, pod_manifest("restarter", [main], terminationGracePeriodSeconds=1)
    )
    wait_for_pod(cluster, namespace, "restarter", pod_phase("Running"), "Running")
    _resize(cluster, namespace, "restarter", {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}})
    restarted = wait_for_pod(
        cluster,
        namespace,
        "restarter",
        lambda p: (
            _status(p).get("restartCount") == 1
            and "running" in _status(p)["state"]
            and (_status(p).get("resources") or {}).get("limits", {}).get("cpu") == "2"
        ),
        "restarted with 2 CPUs",
    )
    # The run before the resize ended; the one after it is a new container.
    assert _status(restarted)["lastState"]["terminated"]["containerID"] != _status(restarted)["containerID"]


# Stands in for `tangram operator` in the operator's own Deployment: answers the Deployment's probes
# (/healthz, /readyz on the gateway port) and reports what the process was given.
OPERATOR_STAND_IN = """
import http.server, json, os, shutil, ssl, subprocess, urllib.request
SA = "/var/run/secrets/kubernetes.io/serviceaccount"
def status(field):
    return next(l.split(":", 1)[1].strip() for l in open("/proc/self/status") if l.startswith(field + ":"))
def writable(path):
    try:
        with open(os.path.join(path, ".write-test"), "w"):
            pass
        os.remove(os.path.join(path, ".write-test"))
        return True
    except OSError:
        return False
def username():
    token = open(f"{SA}/token").read()
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    url = f"https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews"
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    https = urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=f"{SA}/ca.crt"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), https)
    return json.loads(opener.open(req, timeout=10).read())["status"]["userInfo"]["username"]
class Operator(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path in ("/healthz", "/readyz"):
            body = b"ok"
        else:
            body = json.dumps({
                "uid": os.getuid(), "gid": os.getgid(), "cap_eff": status("CapEff"),
                "no_new_privs": status("NoNewPrivs"), "root_writable": writable("/"),
                "cwd_writable": writable(os.getcwd()), "tmp_writable": writable("/tmp"),
                "home": os.environ.get("HOME"), "pod_name": os.environ.get("POD_NAME"),
                "pod_namespace": os.environ.get("POD_NAMESPACE"), "tangram": shutil.which("tangram"),
                "tangram_help": subprocess.run(["tangram", "--help"], capture_output=True).returncode,
                "username": username(),
            }).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["POD_IP"], 8080), Operator).serve_forever()
"""


def test_the_operator_deployment_runs_as_its_manifest_says(cluster: Cluster, namespace: str) -> None:
    """manifests/deployment.yaml as it is (security context, ServiceAccount, env, ports, probes,
    volumes), in a namespace that enforces the restricted Pod Security level, with a stand-in for
    `tangram operator` that serves the probes on the pod IP and reports what it was given."""
    if not cluster.is_local_testbed:
        pytest.skip("the stand-in runs on the test bed host's Python; an image would need one")
    runtime = cluster.core.read_node("tb-cpu-0").status.node_info.container_runtime_version
    if runtime != "testbed://bwrap":
        pytest.skip(f"the Deployment mounts an emptyDir, which needs bubblewrap on the host ({runtime})")
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": labels}})
    deployment = yaml.safe_load((REPO / "manifests" / "deployment.yaml").read_text())
    deployment["metadata"]["namespace"] = namespace
    deployment["spec"]["replicas"] = 1
    template = deployment["spec"]["template"]["spec"]
    cluster.core.create_namespaced_service_account(
        namespace, {"metadata": {"name": template["serviceAccountName"]}}
    )
    operator = template["containers"][0]
    assert operator["command"] == ["tangram", "operator"]
    operator["command"] = ["python3", "-c", OPERATOR_STAND_IN]
    operator.pop("args", None)
    if not any(e["name"] == "POD_IP" for e in operator.get("env") or []):
        operator.setdefault("env", []).append(downward_env()[0])  # servers bind their pod IP here
    cluster.apps.create_namespaced_deployment(namespace, deployment)
    name = deployment["metadata"]["name"]
    wait_for(
        cluster.apps.list_namespaced_deployment,
        lambda d: (d.get("status") or {}).get("readyReplicas") == 1,
        namespace=namespace,
        field_selector=f"metadata.name={name}",
        description=f"deployment {name} with its pod Ready (probes /healthz, /readyz)",
        timeout=90,
    )
    pod = cluster.core.list_namespaced_pod(namespace).items[0]
    facts = http_get_json(f"http://{pod.status.pod_ip}:8080/facts", timeout=15)
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (facts["uid"], facts["gid"]) == (security["runAsUser"], security["runAsGroup"])
    assert int(facts["cap_eff"], 16) == 0  # capabilities drop ALL, and a non-root user keeps none
    assert facts["no_new_privs"] == "1"  # allowPrivilegeEscalation: false
    assert not facts["root_writable"] and not facts["cwd_writable"]  # readOnlyRootFilesystem
    assert facts["tmp_writable"]  # the emptyDir at /tmp
    assert facts["home"] == "/tmp"
    assert (facts["pod_name"], facts["pod_namespace"]) == (pod.metadata.name, namespace)
    assert facts["tangram"], "tangram should be on PATH (the project's virtual environment)"
    assert facts["tangram_help"] == 0, "the pod's user should be able to run tangram (and its Python)"
    assert facts["username"] == f"system:serviceaccount:{namespace}:{template['serviceAccountName']}"


def test_run_as_non_root_without_a_user_waits_as_the_kubelet_makes_it(
    cluster: Cluster, namespace: str
) -> None:
    main = shell_container("true", securityContext={"runAsNonRoot": True})
    cluster.core.create_namespaced_pod(namespace, pod_manifest("rootless", [main], restartPolicy="Never"))
    seen = wait_for_pod(
        cluster,
        namespace,
        "rootless",
        lambda p: (
            (_status(p).get("state", {}).get("waiting") or {}).get("reason") == "CreateContainerConfigError"
        ),
        "refused to run as root",
    )
    assert "runAsNonRoot and image will run as root" in _status(seen)["state"]["waiting"]["message"]
