"""The e2e suite refuses a KUBECONFIG whose context does not look like a test cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testbed import REPO

PRODUCTION_KUBECONFIG = """
apiVersion: v1
kind: Config
clusters:
- name: prod-eu-1
  cluster: {server: "https://127.0.0.1:1"}
contexts:
- name: prod-eu-1
  context: {cluster: prod-eu-1, user: admin}
current-context: prod-eu-1
users:
- name: admin
  user: {token: not-a-real-token}
"""


def test_a_context_that_is_not_a_test_cluster_is_refused(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(PRODUCTION_KUBECONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_E2E_")}
    env["KUBECONFIG"] = str(kubeconfig)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/e2e/test_smoke.py",
            "-k",
            "readyz",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "does not look like a test cluster" in done.stdout
    assert "prod-eu-1" in done.stdout
