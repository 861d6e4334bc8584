# mypy: disable-error-code="arg-type,no-untyped-call"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""hack/cluster-up.sh and hack/cluster-down.sh on a second test bed of their own (a separate
CLUSTER_DIR): up is idempotent, down stops every process up started (pods included) and its state."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kubernetes import client, config
from testbed import (
    CLUSTER_DOWN,
    CLUSTER_UP,
    kubectl_binary,
    pod_manifest,
    pod_phase,
    shell_container,
    wait_for,
)


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line mentions `text` (the state directory of a test bed)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(") ", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def _local_addresses() -> str:
    """The addresses on lo (pod IPs live there while their pods run), or "" without iproute2."""
    done = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=False
    )
    return done.stdout


def _run(script: Path, cluster_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLUSTER_DIR": str(cluster_dir)}
    env.pop("KUBECONFIG", None)
    env.pop("TESTBED_REAL_NODE", None)  # the second test bed is the standard one
    return subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_cluster_down_leaves_no_process_behind(tmp_path: Path) -> None:
    if os.environ.get("KUBECONFIG") or os.environ.get("TANGRAM_E2E_SKIP", "") not in ("", "0"):
        pytest.skip("runs only where the local test bed is in use")
    cluster_dir = tmp_path / "second-testbed"
    pids: dict[str, str] = {}
    pod_prefix = "-no-pod-prefix-"
    up = _run(CLUSTER_UP, cluster_dir)
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip().splitlines()[-1]
        assert Path(kubeconfig) == cluster_dir / "kubeconfig"
        ready = subprocess.run(
            [kubectl_binary(), "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert ready.stdout.strip() == "ok"
        again = _run(CLUSTER_UP, cluster_dir)
        assert again.returncode == 0 and "already up" in again.stderr
        # A pod whose process would outlive a careless teardown.
        api = config.new_client_from_config(config_file=kubeconfig)
        core = client.CoreV1Api(api)
        wait_for(
            core.list_namespaced_service_account,
            lambda _sa: True,
            namespace="default",
            field_selector="metadata.name=default",
            description="default ServiceAccount",
        )
        core.create_namespaced_pod("default", pod_manifest("lingerer", [shell_container("sleep 3600")]))
        wait_for(
            core.list_namespaced_pod,
            pod_phase("Running"),
            namespace="default",
            field_selector="metadata.name=lingerer",
            description="pod lingerer Running",
        )
        api.close()
        pids = {f.name: f.read_text().split()[0] for f in (cluster_dir / "pids").iterdir()}
        env = dict(
            line.split("=", 1) for line in (cluster_dir / "env").read_text().splitlines() if "=" in line
        )
        if env.get("ADDRESS_DEVICE"):  # else loopback pod IPs, which need no address of their own
            pod_prefix = env["POD_CIDR"].removesuffix("0/24")
            assert pod_prefix in _local_addresses(), "the running pod's address should be on lo"
        assert set(pids) == {
            "1-etcd",
            "2-kube-apiserver",
            "3-kube-controller-manager",
            "4-kube-scheduler",
            "5-node-runner",
        }
        assert _processes_mentioning(str(cluster_dir)), (
            "the test bed's processes should be visible while it is up"
        )
    finally:
        down = _run(CLUSTER_DOWN, cluster_dir)
    assert down.returncode == 0, down.stderr
    assert _processes_mentioning(str(cluster_dir)) == []
    for name, pid in pids.items():
        stat = Path(f"/proc/{pid}/stat")
        alive = stat.exists() and stat.read_text().rsplit(") ", 1)[1].split()[0] != "Z"
        assert not alive, f"{name} (pid {pid}) survived cluster-down"
    assert not cluster_dir.exists()
    assert pod_prefix not in _local_addresses(), "cluster-down should remove the pods' addresses"
    # Nothing left to stop: a second cluster-down is a no-op.
    assert _run(CLUSTER_DOWN, cluster_dir).returncode == 0
