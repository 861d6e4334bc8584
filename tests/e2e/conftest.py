# mypy: disable-error-code="no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""Fixtures of the e2e tier: a session cluster, the CRDs from crds/, a namespace per test, dumps on failure.

The cluster is the local test bed (hack/cluster-up.sh: a control plane built from source, simulated
nodes, pods as local processes), started here when needed and stopped at the end if this session
started it. With KUBECONFIG set, the suite runs against that cluster instead (kind: `make e2e-kind`),
but only if its context looks like a test cluster (TANGRAM_E2E_ALLOW_ANY_CLUSTER=1 lifts the guard).

Environment: TANGRAM_E2E_SKIP=1 skips the tier (the only way it is skipped: a test bed that cannot be
built or started fails every e2e test with the reason); TANGRAM_E2E_KEEP_CLUSTER=1 leaves a test bed
this session started running; CLUSTER_DIR moves the test bed's state; TANGRAM_E2E_ARTIFACTS is where
failed tests leave their dumps (default artifacts/e2e).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from testbed import (
    BUILD,
    CLUSTER_DOWN,
    CLUSTER_UP,
    REPO,
    TEST_CONTEXT,
    Cluster,
    condition,
    dump_cluster_state,
    kubectl_binary,
    wait_for,
)

E2E_DIR = Path(__file__).resolve().parent
START_TIMEOUT_S = 3600  # a first run builds the control plane (minutes on 2 cores); later runs take seconds
_build_error: str | None = None


def _skip_requested() -> bool:
    return os.environ.get("TANGRAM_E2E_SKIP", "") not in ("", "0")


def _cluster_dir() -> Path:
    return Path(os.environ.get("CLUSTER_DIR") or REPO / ".cluster").resolve()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Builds the control plane (first run only) and starts the test bed before any test starts,
    outside the per-test timeout."""
    global _build_error, _testbed
    if _skip_requested() or os.environ.get("KUBECONFIG") or session.config.option.collectonly:
        return
    if not any(E2E_DIR in Path(str(item.fspath)).parents for item in session.items):
        return
    log = Path(os.environ.get("TANGRAM_E2E_ARTIFACTS") or REPO / "artifacts" / "e2e") / "testbed-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"e2e: making sure the test bed's control plane is built (minutes on a first run; {log})"
        )
    with open(log, "w") as out:
        done = subprocess.run(["bash", str(BUILD)], stdout=subprocess.DEVNULL, stderr=out, check=False)
    if done.returncode != 0:
        _build_error = f"building the test bed failed (exit {done.returncode}):\n{log.read_text()[-3000:]}"
        return
    # Started here too, outside the per-test timeout: with the real node (TESTBED_REAL_NODE=1) a
    # start imports the sandbox image into its containerd (minutes), which would otherwise count
    # against whichever test first asks for the cluster.
    if reporter is not None:
        reporter.write_line("e2e: starting the local test bed (or finding it up)")
    try:
        _testbed = _start_testbed()
    except _TestbedError as e:
        _testbed = e


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call"))


def _artifacts_dir(request: pytest.FixtureRequest) -> Path:
    root = Path(os.environ.get("TANGRAM_E2E_ARTIFACTS") or REPO / "artifacts" / "e2e")
    return root / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)


def _guard(context: str, cluster_name: str) -> None:
    if os.environ.get("TANGRAM_E2E_ALLOW_ANY_CLUSTER") == "1":
        return
    if not (TEST_CONTEXT.match(context) or TEST_CONTEXT.match(cluster_name)):
        pytest.fail(
            f"KUBECONFIG's current context {context!r} (cluster {cluster_name!r}) does not look like a test "
            "cluster (kind-*, k3d-*, minikube, tangram-testbed, ...): the e2e suite creates and deletes "
            "namespaces and CRDs. Unset KUBECONFIG to use the local test bed, or set "
            "TANGRAM_E2E_ALLOW_ANY_CLUSTER=1 if this cluster is really meant for it.",
            pytrace=False,
        )


def _apply_crds(cluster: Cluster) -> None:
    """Applies crds/*.yaml (tolerating an empty directory) and waits until each CRD is Established."""
    files = sorted((REPO / "crds").glob("*.yaml"))
    if not files:
        return
    for f in files:
        # Client-side apply, as the README tells users to install: a later `kubectl apply` (or its
        # --dry-run=client) then finds the last-applied annotation it needs for its three-way merge.
        cluster.kubectl("apply", "-f", str(f))
    applied = cluster.kubectl(
        "get", "-o", "name", *[arg for f in files for arg in ("-f", str(f))]
    ).stdout.split()
    for ref in applied:
        name = ref.split("/", 1)[1]
        crd = wait_for(
            cluster.apiext.list_custom_resource_definition,
            lambda o: condition(o, "Established") == "True",
            field_selector=f"metadata.name={name}",
            description=f"CRD {name} Established",
        )
        cluster.crds.append(f"{crd['spec']['names']['plural']}.{crd['spec']['group']}")


class _TestbedError(Exception):
    """The local test bed did not start; the message says why and where its logs are."""


# The test bed started at collection (its kubeconfig and whether this session started it), or why not.
_testbed: tuple[Path, bool] | _TestbedError | None = None


def _local_testbed() -> tuple[Path, bool]:
    """The local test bed, started at collection (or now); its kubeconfig and whether we started it."""
    global _testbed
    if _build_error:
        pytest.fail(_build_error + "\n(TANGRAM_E2E_SKIP=1 skips the e2e tier on purpose)", pytrace=False)
    bed = _testbed
    if bed is None:
        try:
            bed = _start_testbed()
        except _TestbedError as e:
            bed = e
    if isinstance(bed, _TestbedError):
        pytest.fail(str(bed), pytrace=False)
    _testbed = bed
    return bed


def _stop_testbed_we_started() -> None:
    """Stops the local test bed if this session started it, once: from the cluster fixture's
    teardown, or at session end where no test asked for the cluster (every e2e test skipped or
    deselected after the start at collection). Kept with TANGRAM_E2E_KEEP_CLUSTER=1, and under
    pytest-xdist, where every worker has its own session and none may stop a bed the others use."""
    global _testbed
    bed = _testbed
    keep = os.environ.get("TANGRAM_E2E_KEEP_CLUSTER") == "1" or "PYTEST_XDIST_WORKER" in os.environ
    if not isinstance(bed, tuple) or not bed[1] or keep:
        return
    _testbed = (bed[0], False)
    subprocess.run(
        ["bash", str(CLUSTER_DOWN)],
        env={**os.environ, "CLUSTER_DIR": str(_cluster_dir())},
        capture_output=True,
        timeout=120,
        check=False,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _stop_testbed_we_started()


def _start_testbed() -> tuple[Path, bool]:
    """Starts the local test bed (or finds it up); raises ``_TestbedError`` naming what failed."""
    cdir = _cluster_dir()
    kubeconfig = cdir / "kubeconfig"
    was_up = False
    if kubeconfig.exists():
        probe = subprocess.run(
            [kubectl_binary(), "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        was_up = probe.returncode == 0
    env = {**os.environ, "CLUSTER_DIR": str(cdir)}
    try:
        done = subprocess.run(
            ["bash", str(CLUSTER_UP)],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise _TestbedError(f"the local test bed did not start within {START_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise _TestbedError(
            f"the local test bed did not start (hack/cluster-up.sh exit {done.returncode}); its output:\n"
            f"{done.stderr[-4000:]}\nLogs: {cdir / 'logs'}. "
            "TANGRAM_E2E_SKIP=1 skips the e2e tier on purpose."
        )
    return Path(done.stdout.strip().splitlines()[-1]), not was_up


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The session's cluster, with the CRDs from crds/ applied."""
    if _skip_requested():
        pytest.skip("TANGRAM_E2E_SKIP is set: e2e tier skipped on request")
    if os.environ.get("KUBECONFIG"):
        _, current = config.list_kube_config_contexts()
        _guard(current["name"], current["context"].get("cluster", ""))
        api = config.new_client_from_config(context=current["name"])
        c = Cluster(api=api, context=current["name"], kubeconfig_env=os.environ["KUBECONFIG"])
    else:
        kubeconfig, _ = _local_testbed()
        api = config.new_client_from_config(config_file=str(kubeconfig))
        c = Cluster(
            api=api, context="tangram-testbed", kubeconfig_env=str(kubeconfig), local_dir=_cluster_dir()
        )
    try:
        _apply_crds(c)
        yield c
    finally:
        api.close()
        _stop_testbed_we_started()  # a no-op unless this session started the local bed


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (its default ServiceAccount exists); deleted afterwards, and
    dumped with the cluster's state and logs to the artifacts directory when the test failed."""
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{secrets.token_hex(3)}"
    cluster.core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"tangram.arl.dev/e2e": "true"}))
    )
    wait_for(
        cluster.core.list_namespaced_service_account,
        lambda _sa: True,
        namespace=name,
        field_selector="metadata.name=default",
        description=f"default ServiceAccount in {name}",
    )
    try:
        yield name
    finally:
        if _failed(request):
            dump_cluster_state(cluster, _artifacts_dir(request), name)
        cluster.core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(autouse=True)
def _dump_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Cluster state for failed tests that use the cluster but no namespace fixture."""
    yield
    if "cluster" in request.fixturenames and "namespace" not in request.fixturenames and _failed(request):
        dump_cluster_state(request.getfixturevalue("cluster"), _artifacts_dir(request), None)
