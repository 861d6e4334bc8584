"""Runs ``tangram operator`` against the test bed as it runs in a cluster.

The operator runs as local processes (two replicas, as the Deployment has) that authenticate with a
real token of the ``tangram-operator`` ServiceAccount (TokenRequest), bound by the RBAC of
``manifests/rbac.yaml``; so what they may do is exactly what the install grants. (The test bed's node
runner could run it as a pod too; as processes, a test can SIGKILL one at a chosen moment.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from testbed import REPO, Cluster, condition, wait_for

OPERATOR_NS = "tangram-system"
SA = "tangram-operator"
GROUP, VERSION = "tangram.arl.dev", "v1alpha1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sa_kubeconfig(cluster: Cluster, dest: Path) -> Path:
    """A kubeconfig that authenticates as the operator's ServiceAccount (a fresh bound token)."""
    token = cluster.kubectl("create", "token", SA, "-n", OPERATOR_NS, "--duration=3h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig_env).read_text())
    cl = admin["clusters"][0]["cluster"]
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tangram-testbed", "cluster": cl}],
        "users": [{"name": SA, "user": {"token": token}}],
        "contexts": [{"name": "tangram-testbed", "context": {"cluster": "tangram-testbed", "user": SA}}],
        "current-context": "tangram-testbed",
    }
    dest.write_text(yaml.safe_dump(doc))
    return dest


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def readyz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                body: dict[str, Any] = json.loads(resp.read())
                return body
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            return body
        except OSError:
            return None

    @property
    def leads(self) -> bool:
        answer = self.readyz()
        return answer is not None and answer.get("status") == "leader"

    def get(self, path: str, token: str | None = None, timeout: float = 10) -> bytes:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data: bytes = resp.read()
            return data


@dataclass
class Operator:
    """The operator's replicas; ``start`` adds one, ``kill`` SIGKILLs one."""

    cluster: Cluster
    workdir: Path
    kubeconfig: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    def start(self, name: str) -> Replica:
        port = _free_port()
        log = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "POD_NAMESPACE": OPERATOR_NS,
            "POD_NAME": name,
            "TANGRAM_LISTEN_HOST": "127.0.0.1",
            "TANGRAM_LISTEN_PORT": str(port),
            # The test bed's GPU nodes are simulated: reward runtimes score on the CPU.
            "TANGRAM_REWARD_DEVICE": "cpu",
        }
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "arl_tangram", "operator"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        replica = Replica(name, port, proc, log)
        self.replicas[name] = replica
        deadline = time.monotonic() + 60
        while replica.readyz() is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"operator {name} did not serve /readyz: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        return replica

    def leader(self, timeout: float = 30) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.replicas.values():
                if r.proc.poll() is None and r.leads:
                    return r
            time.sleep(0.2)
        logs = "\n".join(f"--- {r.name}\n{r.log.read_text()[-2000:]}" for r in self.replicas.values())
        raise AssertionError(f"no operator replica leads within {timeout:.0f} s\n{logs}")

    def kill(self, name: str) -> None:
        replica = self.replicas.pop(name)
        os.killpg(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait(timeout=30)

    def stop_all(self) -> None:
        for r in self.replicas.values():
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas.values():
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
        self.replicas.clear()


@contextmanager
def running_operator(
    cluster: Cluster, work: Path, names: tuple[str, ...] = ("op-a", "op-b")
) -> Iterator[Operator]:
    """The operator installed and running as ``names`` (two replicas, as the Deployment has); stopped
    afterwards, its logs kept under artifacts/e2e/operator/."""
    install(cluster)
    op = Operator(cluster, work, sa_kubeconfig(cluster, work / "kubeconfig"))
    for name in names:
        op.start(name)
    try:
        yield op
    finally:
        op.stop_all()
        dest = REPO / "artifacts" / "e2e" / "operator"
        dest.mkdir(parents=True, exist_ok=True)
        for log in sorted(work.glob("*.log")):
            (dest / log.name).write_text(log.read_text())


def create(cluster: Cluster, namespace: str, plural: str, body: dict[str, Any]) -> None:
    """Create one of the project's custom objects in ``namespace``."""
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def wait_object(
    cluster: Cluster, namespace: str, plural: str, predicate: Callable[[Any], bool], **kwargs: Any
) -> dict[str, Any]:
    """The first of the namespace's custom objects of ``plural`` for which ``predicate`` holds."""
    found: dict[str, Any] = wait_for(
        cluster.custom.list_namespaced_custom_object,
        predicate,
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        plural=plural,
        **kwargs,
    )
    return found


def wait_batch(cluster: Cluster, namespace: str, name: str, timeout: float = 240) -> dict[str, Any]:
    """The ActionBatch ``name`` once it is Complete."""
    return wait_object(
        cluster,
        namespace,
        "actionbatches",
        lambda o: condition(o, "Complete") == "True",
        field_selector=f"metadata.name={name}",
        description=f"ActionBatch {name} Complete",
        timeout=timeout,
    )


def install(cluster: Cluster) -> None:
    """The namespace and RBAC of manifests/ (the CRDs are the e2e tier's own fixture)."""
    for name in ("namespace.yaml", "rbac.yaml"):
        cluster.kubectl("apply", "-f", str(REPO / "manifests" / name))


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """An ActionPool for the test bed: hosts of 2 cores (the machine has 2 real ones)."""
    body: dict[str, Any] = {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": name},
        "spec": {
            "template": {"image": "arl-tangram-sandbox:0.1.0", "resources": {"cpu": "2", "memory": "4Gi"}},
            "languages": ["python", "bash"],
            "limits": {"timeoutSeconds": 60, "memory": "1Gi", "maxCores": 2},
            "scaling": {"minHosts": 0, "maxHosts": 3, "maxStarting": 2, "idleTimeoutSeconds": 10},
            "sessions": {"ttlSeconds": 30},
        },
    }
    for key, value in spec.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return body


def service_manifest(
    name: str, model: str, model_name: str, gpu: dict[str, Any] | None = None, **scaling: Any
) -> dict[str, Any]:
    """A RewardModelService of the built-in scorer over the weights file ``model`` (a path the
    test bed's pods can read), on ``gpu`` (default one GPU), with ``scaling`` as given."""
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "RewardModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": model_name, "uri": f"file://{model}"},
            "server": {"runtime": "builtin"},
            "gpu": gpu or {"count": [1]},
            "scaling": scaling,
        },
    }


def batch_manifest(name: str, actions: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionBatch",
        "metadata": {"name": name},
        "spec": {"actions": actions, **spec},
    }


def trainer_token(cluster: Cluster, namespace: str, name: str = "trainer") -> str:
    """A ServiceAccount in ``namespace`` that may create and read ActionBatches there, and a token of
    it for the gateway's audience."""
    cluster.kubectl("create", "serviceaccount", name, "-n", namespace)
    cluster.kubectl(
        "create",
        "role",
        f"{name}-batches",
        "-n",
        namespace,
        "--verb=create,get,list",
        "--resource=actionbatches.tangram.arl.dev",
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        f"{name}-batches",
        "-n",
        namespace,
        f"--role={name}-batches",
        f"--serviceaccount={namespace}:{name}",
    )
    return cluster.kubectl(
        "create", "token", name, "-n", namespace, "--audience=tangram-gateway"
    ).stdout.strip()


def post_run_code(
    port: int, namespace: str, pool: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes, Any]:
    """POST /run_code to the gateway on ``port`` for ``pool`` of ``namespace``: status, body and
    headers, an error status included."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/run_code",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "X-Tangram-Namespace": namespace,
            "X-Tangram-Pool": pool,
            **headers,
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers
