"""The kind lane's overlay still builds on top of the base in manifests/ (checked without Docker)."""

from __future__ import annotations

import subprocess

import yaml
from testbed import REPO, kubectl_binary


def test_the_kind_overlay_uses_the_loaded_images_and_never_pulls_them() -> None:
    built = subprocess.run(
        [kubectl_binary(), "kustomize", str(REPO / "hack" / "kind" / "overlay")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert "CustomResourceDefinition" in kinds  # the base brings the CRDs
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"][:1]:
            assert container["image"].startswith("arl-tangram-")
            assert container["image"].endswith(":0.1.0")
            assert container["imagePullPolicy"] == "IfNotPresent"
