# mypy: disable-error-code="no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; these tests pass plain dicts (valid JSON).
"""The operator end to end on the test bed: pools scale, batches of real programs run, and nothing is
lost or run twice when hosts, the leader or the whole operator die.

The operator runs as two local processes authenticated with the operator ServiceAccount's token
(see operator_harness.py); host pods run the real sandbox agent through the node runner.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import config as k8s_config
from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from operator_harness import (
    Operator,
    batch_manifest,
    install,
    pool_manifest,
    post_run_code,
    sa_kubeconfig,
    service_manifest,
    trainer_token,
)
from testbed import REPO, Cluster, condition, http_get_json, wait_for, wait_for_gone

from arl_tangram.domain.actions import ActionRequest
from arl_tangram.errors import NotFound
from arl_tangram.workloads.humaneval import local_verdict, programs

GROUP, VERSION = "tangram.arl.dev", "v1alpha1"
POOL_LABEL = "tangram.arl.dev/pool"


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    install(cluster)
    work = tmp_path_factory.mktemp("operator")
    op = Operator(cluster, work, sa_kubeconfig(cluster, work / "kubeconfig"))
    op.start("op-a")
    op.start("op-b")
    try:
        yield op
    finally:
        op.stop_all()
        for log in sorted(work.glob("*.log")):
            dest = REPO / "artifacts" / "e2e" / "operator"
            dest.mkdir(parents=True, exist_ok=True)
            (dest / log.name).write_text(log.read_text())


def _create(cluster: Cluster, ns: str, plural: str, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)


def _pool(cluster: Cluster, ns: str, name: str = "py", **spec: Any) -> None:
    _create(cluster, ns, "actionpools", pool_manifest(name, **spec))


def _pool_not_ready(cluster: Cluster, ns: str, reason: str) -> dict[str, Any]:
    """The Ready condition of this namespace's pool once it is False for ``reason``."""

    def said(o: dict[str, Any]) -> bool:
        conditions = o.get("status", {}).get("conditions", [])
        return any(
            c["type"] == "Ready" and c["status"] == "False" and c["reason"] == reason for c in conditions
        )

    pool = _wait_for(cluster, ns, "actionpools", said, description=f"Ready=False {reason}", timeout=60)
    return next(c for c in pool["status"]["conditions"] if c["type"] == "Ready")


def _wait_for(cluster: Cluster, ns: str, plural: str, predicate: Any, **kwargs: Any) -> dict[str, Any]:
    """The first of this namespace's objects of ``plural`` for which ``predicate`` holds (a watch)."""
    return wait_for(
        cluster.custom.list_namespaced_custom_object,
        predicate,
        group=GROUP,
        version=VERSION,
        namespace=ns,
        plural=plural,
        **kwargs,
    )


def _wait_batch(cluster: Cluster, ns: str, name: str, timeout: float = 240) -> dict[str, Any]:
    return _wait_for(
        cluster,
        ns,
        "actionbatches",
        lambda o: condition(o, "Complete") == "True",
        field_selector=f"metadata.name={name}",
        description=f"ActionBatch {name} Complete",
        timeout=timeout,
    )


def _host_pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    listed = json.loads(
        cluster.core.list_namespaced_pod(ns, label_selector=POOL_LABEL, _preload_content=False).data
    )
    items: list[dict[str, Any]] = listed["items"]
    return items


def _agents_ran(cluster: Cluster, ns: str) -> int:
    """Actions the pool's live agents report having run (their own counters: the side effect that
    proves an action ran once, since actions cannot write outside their workdir)."""
    total = 0
    for pod in _host_pods(cluster, ns):
        ip = pod.get("status", {}).get("podIP")
        if ip and not pod["metadata"].get("deletionTimestamp"):
            total += sum(http_get_json(f"http://{ip}:8080/v1/health")["outcomes"].values())
    return total


def _running_on(pod: dict[str, Any]) -> list[str]:
    """The keys of the actions a host pod's agent is running. A pod with an address but no agent
    listening runs none: one the pool has just started (its agent not yet up, which a CI run met
    as "connection refused"), or one whose agent is gone with its actions."""
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return []
    try:
        running: list[str] = http_get_json(f"http://{ip}:8080/v1/actions")["running"]
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return []
        raise
    return running


def _run_code(
    operator: Operator, namespace: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, dict[str, Any], Any]:
    """POST /run_code to the leader's gateway for pool ``py`` of ``namespace``: status, JSON answer
    and headers, an error status included."""
    status, data, answer_headers = post_run_code(operator.leader().port, namespace, "py", body, headers)
    return status, json.loads(data or b"{}"), answer_headers


def _sleepers(n: int, seconds: float, prefix: str = "a") -> list[dict[str, Any]]:
    return [
        {
            "id": f"{prefix}{i}",
            "type": "code",
            "target": "py",
            "payload": {"language": "python", "code": f"import time; time.sleep({seconds}); print({i})"},
        }
        for i in range(n)
    ]


def test_samples_are_accepted_and_the_pool_becomes_ready(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """The batch first, as ``kubectl apply -f manifests/samples/`` sends it (files in name order:
    ``actionbatch-step.yaml`` before ``actionpool-python.yaml``): its actions wait for their pool
    (they all failed PoolNotFound at once), and a service nobody creates fails them after the wait."""
    samples = REPO / "manifests" / "samples"
    cluster.kubectl("apply", "-n", namespace, "-f", str(samples / "actionbatch-step.yaml"))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (
            "ActionPool 'python-sandboxes' not found"
            in (
                next((c for c in o.get("status", {}).get("conditions", ()) if c["type"] == "Running"), {})
            ).get("message", "")
        ),
        description="the batch saying it waits for its pool",
        timeout=60,
    )
    cluster.kubectl("apply", "-n", namespace, "-f", str(samples / "actionpool-python.yaml"))
    pool = _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: condition(o, "Ready") == "True" and o["status"].get("hostsReady", 0) >= 1,
        description="sample ActionPool Ready with a host",
        timeout=120,
    )
    assert pool["status"]["selector"] == f"{POOL_LABEL}=python-sandboxes"
    batch = _wait_batch(cluster, namespace, "step-000042")
    results = {r["id"]: r for r in batch["status"]["results"]}
    assert (
        results["traj-7.turn-1"]["state"] == "Succeeded"
        and results["traj-7.turn-1"]["output"].strip() == "832040"
    )
    assert results["traj-7.tests"]["state"] == "Succeeded" and results["traj-7.tests"]["reward"] == 1.0
    # The sample's reward service is not applied here: its actions fail, once the wait is over.
    assert results["traj-7.reward"]["reason"] == "ServiceNotFound"


def test_a_humaneval_batch_gets_each_programs_own_verdict(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace)
    progs = programs(200)
    actions = [
        {"id": p.action_id, "type": "code", "target": "py", "payload": {"language": "python", "code": p.code}}
        for p in progs
    ]
    _create(cluster, namespace, "actionbatches", batch_manifest("he", actions))
    expected = {p.action_id: local_verdict(p) for p in progs}
    batch = _wait_batch(cluster, namespace, "he", timeout=300)
    results = {r["id"]: r for r in batch["status"]["results"]}
    assert len(results) == 200
    for p in progs:
        r = results[p.action_id]
        assert r["exitCode"] == expected[p.action_id], (p.action_id, r)
        assert r["state"] == ("Succeeded" if expected[p.action_id] == 0 else "Failed")
    assert (
        sum(1 for p in progs if p.variant == "canonical" and results[p.action_id]["state"] == "Succeeded")
        == 100
    )
    assert (
        sum(1 for p in progs if p.variant == "mutated" and results[p.action_id]["state"] == "Failed") == 100
    )
    assert batch["status"]["counts"] == {
        "total": 200,
        "pending": 0,
        "running": 0,
        "succeeded": 100,
        "failed": 100,
        "cancelled": 0,
    }
    token = trainer_token(cluster, namespace)
    full = operator.leader().get(f"/v1/batches/{namespace}/he/results", token).decode().splitlines()
    assert len(full) == 200 and all(json.loads(line)["state"] in ("Succeeded", "Failed") for line in full)


class _PodWatcher:
    """Records, from a watch, the most host pods that were starting (not Ready) at one time."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        self.state: dict[str, bool] = {}
        self.max_starting = 0
        self.max_pods = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Watched again when the stream ends or is cut (a watch the API server closes early), so no
        # pod start is missed while the test runs.
        while not self._stop.is_set():
            try:
                self._watch()
            except (ApiException, urllib3.exceptions.HTTPError, OSError):
                self._stop.wait(0.5)

    def _watch(self) -> None:
        w = watch.Watch()
        for event in w.stream(
            self.cluster.core.list_namespaced_pod, self.ns, label_selector=POOL_LABEL, timeout_seconds=600
        ):
            pod = event["object"]
            name = pod.metadata.name
            if event["type"] == "DELETED" or pod.metadata.deletion_timestamp:
                self.state.pop(name, None)
            else:
                ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
                self.state[name] = ready
            self.max_starting = max(self.max_starting, sum(1 for r in self.state.values() if not r))
            self.max_pods = max(self.max_pods, len(self.state))
            if self._stop.is_set():
                w.stop()
                return

    def stop(self) -> None:
        self._stop.set()


def test_a_pool_scales_from_zero_within_max_starting_and_back_after_idle(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(
        cluster, namespace, scaling={"minHosts": 0, "maxHosts": 4, "maxStarting": 2, "idleTimeoutSeconds": 8}
    )
    watcher = _PodWatcher(cluster, namespace)
    _create(cluster, namespace, "actionbatches", batch_manifest("burst", _sleepers(48, 1.0)))
    batch = _wait_batch(cluster, namespace, "burst")
    assert batch["status"]["counts"]["succeeded"] == 48
    assert watcher.max_pods >= 3, f"the pool grew to only {watcher.max_pods} host(s) under a burst"
    assert watcher.max_starting <= 2, f"{watcher.max_starting} hosts were starting at once (maxStarting 2)"
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("replicas") == 0,
        description="pool back to zero hosts after idle",
        timeout=90,
    )
    watcher.stop()


def test_a_host_deleted_mid_batch_loses_no_action(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 2, "maxHosts": 3})
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 2,
        description="two hosts ready",
        timeout=120,
    )
    _create(
        cluster,
        namespace,
        "actionbatches",
        batch_manifest("survive", _sleepers(12, 3.0), retryPolicy={"maxRetries": 3, "backoffSeconds": 0}),
    )
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) >= 2,
        description="actions running",
        timeout=60,
    )
    victim = next(
        p["metadata"]["name"]
        for p in _host_pods(cluster, namespace)
        if p.get("status", {}).get("podIP")
        and http_get_json(f"http://{p['status']['podIP']}:8080/v1/actions")["running"]
    )
    cluster.core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    batch = _wait_batch(cluster, namespace, "survive")
    results = batch["status"]["results"]
    assert [r["state"] for r in results] == ["Succeeded"] * 12, results
    assert all(r["output"].strip() == str(i) for i, r in enumerate(results))
    assert any(r["attempts"] == 2 for r in results), "no action was running on the deleted host"


def test_deleting_a_batch_stops_its_running_actions(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 1})
    _create(cluster, namespace, "actionbatches", batch_manifest("doomed", _sleepers(4, 120.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) >= 1,
        description="actions running",
        timeout=90,
    )
    # Nothing of kopf's is written on a batch (each write of a big batch costs the API server): the
    # deletion below is heard from the watch, with no finalizer.
    meta = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches", "doomed")[
        "metadata"
    ]
    assert not meta.get("finalizers"), meta.get("finalizers")
    assert not [a for a in meta.get("annotations") or {} if a.startswith(GROUP)], meta.get("annotations")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches", "doomed")
    deadline = time.monotonic() + 15
    while True:
        running = [key for pod in _host_pods(cluster, namespace) for key in _running_on(pod)]
        if not running:
            break
        assert time.monotonic() < deadline, f"still running 15 s after the batch was deleted: {running}"
        time.sleep(0.2)


async def test_a_pool_no_watch_has_seen_yet_is_read_from_the_api_server(
    cluster: Cluster, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    """Each resource has its own watch stream, so a batch created just after its pool (one
    ``kubectl apply`` of both) can reach the operator before the pool does; a CI run saw its actions
    fail PoolNotFound. Here an operator state whose watch holds nothing (its index is empty, as a
    lagging watch's is) is asked for a pool that exists: it reads it from the real API server, with the
    operator's own ServiceAccount token, instead of answering not found. A name the API server does
    not hold is still not found, and so is a reward service, and so is a pool being deleted."""
    from arl_tangram.controllers.operator import OperatorSettings, OperatorState

    _pool(cluster, namespace, name="fresh", scaling={"minHosts": 0})
    api = k8s_config.new_client_from_config(str(sa_kubeconfig(cluster, tmp_path / "kubeconfig")))
    state = OperatorState(OperatorSettings(namespace="tangram-system", identity="probe"), api=api)
    try:
        assert state.pool_index == {}  # nothing seen by any watch
        cfg = await state.dispatcher.find_pool_config(namespace, "fresh")
        assert cfg is not None and cfg.languages == tuple(pool_manifest("x")["spec"]["languages"]), cfg
        assert await state.dispatcher.find_pool_config(namespace, "no-such-pool") is None
        # A pool being deleted (held here by a finalizer of the test's) is not learned again: its
        # requests would wait for hosts that never come.
        held = pool_manifest("going")
        held["metadata"]["finalizers"] = ["e2e.tangram.arl.dev/hold"]
        _create(cluster, namespace, "actionpools", held)
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionpools", "going")
        try:
            assert await state.dispatcher.find_pool_config(namespace, "going") is None
        finally:
            cluster.custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "actionpools", "going", {"metadata": {"finalizers": None}}
            )
        # A batch's actions naming one such pool at once share one read.
        many = [state.dispatcher.find_pool_config(namespace, "also-missing") for _ in range(40)]
        assert await asyncio.gather(*many) == [None] * 40
        if cluster.local_dir is not None:  # the audit log is the local test bed's
            from testbed import audit_events, wait_for_audit_event

            def _read_of_it(e: dict[str, Any]) -> bool:
                ref = e.get("objectRef") or {}
                return e.get("verb") == "get" and ref.get("name") == "also-missing"

            user = "system:serviceaccount:tangram-system:tangram-operator"
            wait_for_audit_event(cluster.local_dir, _read_of_it, user=user, description="the read")
            reads = [e for e in audit_events(cluster.local_dir, user) if _read_of_it(e)]
            assert len({e["auditID"] for e in reads}) == 1, reads
        with pytest.raises(NotFound, match="no-such-judge"):
            await state.dispatcher.run(
                ActionRequest("r", namespace, "no-such-judge", "reward", {"prompt": "p", "response": "r"})
            )
    finally:
        await state.agent.close()
        api.close()


def test_a_batch_left_with_an_earlier_operators_finalizer_is_still_deleted(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Operators before this one put kopf's finalizer on every batch; one of those batches must not
    hang in Terminating now that nothing of this operator adds or needs it."""
    body = batch_manifest("inherited", _sleepers(1, 0.0, prefix="i"))
    body["metadata"]["finalizers"] = [f"{GROUP}/finalizer"]
    _create(cluster, namespace, "actionbatches", body)
    _wait_batch(cluster, namespace, "inherited", timeout=90)  # no pool named py: it fails, and ends
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches", "inherited")
    deadline = time.monotonic() + 30
    while True:
        try:
            cluster.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, "actionbatches", "inherited"
            )
        except ApiException as exc:
            assert exc.status == 404
            break
        assert time.monotonic() < deadline, "the batch is still Terminating 30 s after its deletion"
        time.sleep(0.2)


def test_the_standby_takes_over_when_the_leader_dies_and_nothing_runs_twice(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 2, "maxHosts": 2})
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 2,
        description="two hosts ready",
        timeout=120,
    )
    before = _agents_ran(cluster, namespace)
    n = 24
    _create(cluster, namespace, "actionbatches", batch_manifest("ha", _sleepers(n, 2.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("succeeded", 0) >= 2,
        description="some actions done",
        timeout=120,
    )
    leader = operator.leader()
    killed_at = time.monotonic()
    operator.kill(leader.name)
    successor = operator.leader(timeout=30)
    took_over = time.monotonic() - killed_at
    assert successor.name != leader.name
    assert took_over < 20, f"the standby took {took_over:.1f} s to lead"
    operator.start(leader.name)  # back as the standby
    batch = _wait_batch(cluster, namespace, "ha")
    results = batch["status"]["results"]
    assert [r["state"] for r in results] == ["Succeeded"] * n
    assert _agents_ran(cluster, namespace) - before == n, "an action ran twice (or was lost)"


def test_an_operator_killed_and_restarted_completes_the_batch_running_nothing_twice(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 2, "maxHosts": 2})
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 2,
        description="two hosts ready",
        timeout=120,
    )
    before = _agents_ran(cluster, namespace)
    n = 16
    _create(cluster, namespace, "actionbatches", batch_manifest("restart", _sleepers(n, 2.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) >= 2,
        description="actions running",
        timeout=120,
    )
    names = list(operator.replicas)
    for name in names:  # every replica dies at once: only the batch status and the agents remember
        operator.kill(name)
    for name in names:
        operator.start(name)
    batch = _wait_batch(cluster, namespace, "restart")
    results = batch["status"]["results"]
    assert [r["state"] for r in results] == ["Succeeded"] * n
    assert _agents_ran(cluster, namespace) - before == n, "an action ran twice (or was lost)"


def test_an_invalid_batch_is_refused_naming_the_field(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    bad = batch_manifest(
        "bad",
        [
            {
                "id": "x",
                "type": "code",
                "target": "py",
                "units": {"min": 4, "max": 2},
                "payload": {"code": "1"},
            }
        ],
    )
    with pytest.raises(ApiException) as refused:
        _create(cluster, namespace, "actionbatches", bad)
    assert refused.value.status == 422
    assert "min must not exceed max" in refused.value.body and "units" in refused.value.body


def test_a_template_change_rolls_the_hosts_without_killing_a_running_action(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 1, "maxHosts": 2})
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 1,
        description="a host ready",
        timeout=120,
    )
    old = {p["metadata"]["name"] for p in _host_pods(cluster, namespace)}
    _create(cluster, namespace, "actionbatches", batch_manifest("long", _sleepers(1, 8.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) == 1,
        description="the action running",
        timeout=60,
    )
    cluster.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "actionpools",
        "py",
        {"spec": {"template": {"env": [{"name": "ROLLED", "value": "1"}]}}},
    )
    batch = _wait_batch(cluster, namespace, "long")
    (result,) = batch["status"]["results"]
    assert result["state"] == "Succeeded" and result["attempts"] == 1, result
    pool = _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: (
            o.get("status", {}).get("hostsReady", 0) >= 1
            and not old & {p["metadata"]["name"] for p in _host_pods(cluster, namespace)}
        ),
        description="every host replaced by one of the new template",
        timeout=120,
    )
    assert condition(pool, "Ready") == "True"
    for pod in _host_pods(cluster, namespace):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env.get("ROLLED") == "1"


def test_a_finished_batch_is_deleted_after_its_ttl(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace)
    _create(
        cluster,
        namespace,
        "actionbatches",
        batch_manifest("brief", _sleepers(1, 0.0), ttlSecondsAfterFinished=2),
    )
    from testbed import wait_for_gone

    wait_for_gone(
        cluster.custom.list_namespaced_custom_object,
        "brief",
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        plural="actionbatches",
        description="the batch deleted after its TTL",
        timeout=120,
    )


def test_a_pool_no_node_can_hold_says_so(cluster: Cluster, namespace: str, operator: Operator) -> None:
    _pool(
        cluster,
        namespace,
        template={"image": "i", "resources": {"cpu": "500", "memory": "4Gi"}},
        limits={"maxCores": 8},
        scaling={"minHosts": 1},
    )
    pool = _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: (
            condition(o, "Ready") == "False"
            and any(c["reason"] == "Unschedulable" for c in o.get("status", {}).get("conditions", []))
        ),
        description="Ready=False Unschedulable",
        timeout=60,
    )
    ready = next(c for c in pool["status"]["conditions"] if c["type"] == "Ready")
    assert "500 cores" in ready["message"] and "spec.template.resources" in ready["message"], ready


def _cannot_start(cluster: Cluster, namespace: str, batch: str, why: str) -> dict[str, Any]:
    """Wait for pool ``py`` to be Degraded with HostsCannotStart and for ``batch`` to say it waits
    because of ``why``; the pool's Degraded condition."""
    pool = _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: any(
            c["type"] == "Degraded" and c["reason"] == "HostsCannotStart"
            for c in o.get("status", {}).get("conditions", [])
        ),
        description="Degraded HostsCannotStart",
        timeout=120,
    )
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: any(
            c["type"] == "Running" and why in c.get("message", "")
            for c in o.get("status", {}).get("conditions", [])
        ),
        field_selector=f"metadata.name={batch}",
        description="the batch saying why it waits",
        timeout=60,
    )
    degraded: dict[str, Any] = next(c for c in pool["status"]["conditions"] if c["type"] == "Degraded")
    return degraded


def test_a_pool_whose_hosts_cannot_start_refuses_callers_holds_batches_and_serves_once_fixed(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """A template whose pods can never start (here a pod securityContext the agent's container
    breaks: the kubelet's CreateContainerConfigError, as for an image it cannot pull or a Secret
    it lacks) is named in the pool's conditions; a caller on the wire hears it at once (504
    SandboxError on /run_code, with Retry-After) instead of waiting until it gives up; a batch
    waits, its status saying why; once the template is fixed the batch's actions run."""
    why = "breaks non-root policy"
    _pool(
        cluster,
        namespace,
        template={"podSpec": {"securityContext": {"runAsNonRoot": True}}},
        scaling={"minHosts": 1},
    )
    _create(cluster, namespace, "actionbatches", batch_manifest("held", _sleepers(2, 0)))
    degraded = _cannot_start(cluster, namespace, "held", why)
    assert "CreateContainerConfigError" in degraded["message"] and why in degraded["message"], degraded
    token = trainer_token(cluster, namespace)
    started = time.monotonic()
    status, answer, headers = _run_code(
        operator, namespace, {"code": "print(1)", "language": "python"}, {"Authorization": f"Bearer {token}"}
    )
    assert time.monotonic() - started < 10, "the caller was left waiting"
    assert status == 504 and answer["status"] == "SandboxError", answer
    assert why in answer["message"] and int(headers["Retry-After"]) > 0, answer
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "actionpools", "py", {"spec": {"template": {"podSpec": None}}}
    )
    batch = _wait_batch(cluster, namespace, "held", timeout=180)
    assert [r["state"] for r in batch["status"]["results"]] == ["Succeeded", "Succeeded"], batch["status"]


def test_a_pool_whose_pods_wait_for_a_missing_secret_says_so_and_starts_once_it_exists(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """A Secret the pods mount (here for a sidecar) that does not exist: the kubelet leaves the
    pod "ContainerCreating", PodReadyToStartContainers False, with the reason only in its events.
    After 30 s the pool says its host cannot start (not "starting" for ever) and a batch says why
    it waits; once the Secret is made, the pod starts by itself and the batch runs."""
    sidecar = {
        "name": "creds",
        "image": "arl-tangram-sandbox:0.1.0",
        "command": ["sleep", "infinity"],
        "volumeMounts": [{"name": "creds", "mountPath": "/creds", "readOnly": True}],
    }
    pod_spec = {"containers": [sidecar], "volumes": [{"name": "creds", "secret": {"secretName": "api-key"}}]}
    _pool(cluster, namespace, template={"podSpec": pod_spec}, scaling={"minHosts": 1})
    _create(cluster, namespace, "actionbatches", batch_manifest("held", _sleepers(1, 0)))
    degraded = _cannot_start(cluster, namespace, "held", "volumes or pod sandbox are not ready")
    assert "its volumes or pod sandbox are not ready" in degraded["message"], degraded
    assert "api-key" in degraded["message"], degraded  # the test bed's kubelet names it
    cluster.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "api-key"}, "stringData": {"key": "k-123"}}
    )
    batch = _wait_batch(cluster, namespace, "held", timeout=180)
    assert [r["state"] for r in batch["status"]["results"]] == ["Succeeded"], batch["status"]


def test_a_host_pod_the_api_server_refuses_is_said_and_held_batches_run_once_fixed(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """A podSpec the API server refuses (a volume named as the operator's own: 422) gives the pool
    a status naming the field (it had none), and its batch waits saying why; fixed, it runs."""
    why = "Duplicate value"
    _pool(
        cluster,
        namespace,
        template={"podSpec": {"volumes": [{"name": "work", "emptyDir": {}}]}},
        scaling={"minHosts": 1},
    )
    _create(cluster, namespace, "actionbatches", batch_manifest("refused", _sleepers(1, 0)))
    ready = _pool_not_ready(cluster, namespace, "HostsRejected")
    assert why in ready["message"] and "spec.volumes" in ready["message"], ready
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: any(
            c["type"] == "Running" and why in c.get("message", "")
            for c in o.get("status", {}).get("conditions", [])
        ),
        field_selector="metadata.name=refused",
        description="the batch saying why it waits",
        timeout=60,
    )
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "actionpools", "py", {"spec": {"template": {"podSpec": None}}}
    )
    batch = _wait_batch(cluster, namespace, "refused", timeout=180)
    assert [r["state"] for r in batch["status"]["results"]] == ["Succeeded"], batch["status"]


def _batch_waits_saying(cluster: Cluster, namespace: str, batch: str, why: str) -> None:
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: any(
            c["type"] == "Running" and why in c.get("message", "")
            for c in o.get("status", {}).get("conditions", [])
        ),
        field_selector=f"metadata.name={batch}",
        description=f"the batch saying it waits: {why}",
        timeout=60,
    )


def test_an_action_on_a_pool_whose_spec_is_invalid_waits_saying_so_and_runs_once_fixed(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """The pool exists: its actions are not failed as PoolNotFound but held, naming its fault."""
    _pool(cluster, namespace, template={"resources": {"cpu": "500m"}}, scaling={"minHosts": 1})
    _create(cluster, namespace, "actionbatches", batch_manifest("oninvalid", _sleepers(1, 0)))
    _batch_waits_saying(cluster, namespace, "oninvalid", "exists, but its spec is invalid")
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "actionpools", "py", {"spec": {"template": {"resources": {"cpu": "2"}}}}
    )
    batch = _wait_batch(cluster, namespace, "oninvalid", timeout=180)
    assert [r["state"] for r in batch["status"]["results"]] == ["Succeeded"], batch["status"]


def test_a_pool_pinned_to_zero_says_so_to_the_actions_that_wait(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 0, "maxHosts": 2})
    cluster.kubectl("scale", "-n", namespace, "actionpool/py", "--replicas=0")
    _create(cluster, namespace, "actionbatches", batch_manifest("zero", _sleepers(1, 0)))
    _batch_waits_saying(cluster, namespace, "zero", "pinned to 0 hosts by /scale")
    ready = _pool_not_ready(cluster, namespace, "PinnedToZero")
    assert "action(s) wait" in ready["message"], ready
    cluster.kubectl("scale", "-n", namespace, "actionpool/py", "--replicas=1")
    batch = _wait_batch(cluster, namespace, "zero", timeout=180)
    assert [r["state"] for r in batch["status"]["results"]] == ["Succeeded"], batch["status"]


def test_kubectl_scale_sets_the_hosts_within_bounds(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(cluster, namespace, scaling={"minHosts": 0, "maxHosts": 3})
    cluster.kubectl("scale", "-n", namespace, "actionpool/py", "--replicas=2")
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady") == 2 and o["status"].get("replicas") == 2,
        description="two hosts after kubectl scale --replicas=2",
        timeout=120,
    )
    cluster.kubectl("scale", "-n", namespace, "actionpool/py", "--replicas=9")  # clamped to maxHosts
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady") == 3,
        description="three hosts (maxHosts) after --replicas=9",
        timeout=120,
    )


def test_a_dedicated_pool_runs_one_pod_per_session_and_removes_it_after(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    _pool(
        cluster,
        namespace,
        mode="dedicated",
        dedicated={"maxSessions": 8},
        sessions={"ttlSeconds": 3},
        scaling={"maxHosts": 8},
    )
    actions = [
        {
            "id": f"t{t}.{k}",
            "type": "code",
            "target": "py",
            "sessionId": f"traj-{t}",
            "payload": {"command": f"echo {t}{k} >> turns; cat turns | tr -d '\\n'; echo; hostname"},
        }
        for k in range(2)
        for t in range(3)
    ]
    actions.append(
        {
            "id": "wide",
            "type": "test",
            "target": "py",
            "sessionId": "traj-0",
            "units": {"min": 2, "max": 2},
            "payload": {"command": "nproc; echo $TANGRAM_DOP"},
        }
    )
    _create(cluster, namespace, "actionbatches", batch_manifest("dedicated", actions))
    batch = _wait_batch(cluster, namespace, "dedicated", timeout=180)
    wide = {r["id"]: r for r in batch["status"]["results"]}["wide"]
    assert wide["state"] == "Succeeded" and wide["output"].split() == ["2", "2"], wide
    if cluster.local_dir is not None:  # the cores came by resizing the session's pod in place
        from testbed import audit_events

        resizes = [
            e
            for e in audit_events(cluster.local_dir, "system:serviceaccount:tangram-system:tangram-operator")
            if (e.get("objectRef") or {}).get("subresource") == "resize"
            and (e.get("objectRef") or {}).get("namespace") == namespace
            and e.get("stage") == "ResponseComplete"
        ]
        assert resizes and all(e["responseStatus"]["code"] == 200 for e in resizes), resizes[:3]
        pool = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "actionpools", "py")
        refused = [c for c in pool["status"]["conditions"] if c["reason"] == "InPlaceResizeUnsupported"]
        assert not refused, refused
    results = {r["id"]: r for r in batch["status"]["results"]}
    pods_of = {}
    for t in range(3):
        first, second = results[f"t{t}.0"], results[f"t{t}.1"]
        assert first["state"] == second["state"] == "Succeeded", (first, second)
        assert second["output"].splitlines()[0] == f"{t}0{t}1"  # the session's own files, in order
        host_a, host_b = first["output"].splitlines()[1], second["output"].splitlines()[1]
        assert host_a == host_b
        pods_of[t] = host_a
    assert len(set(pods_of.values())) == 3, f"sessions shared pods: {pods_of}"
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("replicas") == 0,
        description="every session pod removed after its session's TTL",
        timeout=90,
    )


def test_the_leaders_gateway_serves_run_code_to_a_token_with_rbac_only(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Trainers reach the operator's gateway with their ServiceAccount's token; RBAC on
    ActionBatches in the pool's namespace decides (the gateway's own suite covers the cases in
    depth; this checks the operator serves it with its own credentials)."""
    _pool(cluster, namespace, scaling={"minHosts": 1})
    cluster.kubectl("create", "serviceaccount", "trainer", "-n", namespace)
    cluster.kubectl(
        "create",
        "role",
        "submit",
        "-n",
        namespace,
        "--verb=create",
        "--resource=actionbatches.tangram.arl.dev",
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "submit",
        "-n",
        namespace,
        "--role=submit",
        f"--serviceaccount={namespace}:trainer",
    )
    token = cluster.kubectl(
        "create", "token", "trainer", "-n", namespace, "--audience=tangram-gateway"
    ).stdout.strip()
    body = {"code": "print(sum(range(10)))", "language": "python"}

    def call(headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        return _run_code(operator, namespace, body, headers)[:2]

    status, answer = call({"Authorization": f"Bearer {token}"})
    assert status == 200 and answer["status"] == "Success", answer
    assert answer["run_result"]["stdout"].strip() == "45"
    assert call({})[0] == 401
    other = cluster.kubectl(
        "create", "token", "default", "-n", namespace, "--audience=tangram-gateway"
    ).stdout.strip()
    assert call({"Authorization": f"Bearer {other}"})[0] == 403


def test_a_reward_model_service_scores_batch_actions_and_scales_to_zero(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    from arl_tangram.rewards.builtin import BuiltinScorer, write_model

    models = REPO / "artifacts" / "e2e" / "models"  # pods see the host's files read-only (not its /tmp)
    models.mkdir(parents=True, exist_ok=True)
    model = write_model(str(models / f"{namespace}.npz"), buckets=256, dim=16, hidden=16, seed=3)
    rms = service_manifest(
        "rm",
        model,
        "tiny-scorer",
        minReplicas=0,
        maxReplicas=2,
        idleTimeoutSeconds=5,
        coldStartBudgetSeconds=60,
    )
    _create(cluster, namespace, "rewardmodelservices", rms)
    _wait_for(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: condition(o, "Ready") == "True" and o["status"].get("replicas") == 0,
        description="the service Ready at zero replicas",
        timeout=60,
    )
    samples = [
        ("What is 2+2?", "4"),
        ("Name a prime.", "9"),
        ("Capital of France?", "Paris"),
        ("hi", "hello"),
    ]
    actions = [
        {"id": f"r{i}", "type": "reward", "target": "rm", "payload": {"prompt": p, "response": r}}
        for i, (p, r) in enumerate(samples)
    ]
    _create(cluster, namespace, "actionbatches", batch_manifest("scores", actions))
    serving = _wait_for(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: o.get("status", {}).get("readyReplicas", 0) >= 1 and bool(o["status"].get("placements")),
        description="a replica placed and serving",
        timeout=120,
    )
    (place, *_) = serving["status"]["placements"]
    assert place["node"].startswith("tb-gpu") or place["node"].startswith("tb-mig"), place
    batch = _wait_batch(cluster, namespace, "scores", timeout=180)
    scorer = BuiltinScorer.from_file(str(model))
    scorer.restore()
    expected = [float(x) for x in scorer.score([p + r for p, r in samples])]
    results = {r["id"]: r for r in batch["status"]["results"]}
    for i in range(len(samples)):
        assert results[f"r{i}"]["state"] == "Succeeded", results[f"r{i}"]
        assert results[f"r{i}"]["reward"] == pytest.approx(expected[i], rel=1e-5, abs=1e-6)
    _wait_for(
        cluster,
        namespace,
        "rewardmodelservices",
        lambda o: o.get("status", {}).get("replicas") == 0 and condition(o, "Ready") == "True",
        description="scaled back to zero after idle",
        timeout=90,
    )
    # A change of the batching window reaches the replicas' services file.
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "rewardmodelservices", "rm", {"spec": {"batching": {"maxWaitMillis": 25}}}
    )
    wait_for(
        cluster.core.list_namespaced_config_map,
        lambda o: "maxWaitMillis: 25" in (o.get("data") or {}).get("services.yaml", ""),
        namespace=namespace,
        field_selector="metadata.name=tangram-rms-rm",
        description="the services file updated",
        timeout=60,
    )


# Grants that the tests above do not exercise, each with the code path that needs it.
UNEXERCISED: dict[tuple[str, str, str], str] = {}


def test_the_operators_rbac_is_exactly_what_it_uses(cluster: Cluster, operator: Operator) -> None:
    """Runs last in this module: the audit log then holds every call the operator made in the tests
    above. Every call was allowed by RBAC, and every grant was used."""
    if cluster.local_dir is None:
        pytest.skip("the audit log is the local test bed's (kind keeps none by default)")
    from testbed import audit_events

    user = "system:serviceaccount:tangram-system:tangram-operator"
    events = [e for e in audit_events(cluster.local_dir, user) if e.get("stage") == "ResponseComplete"]
    assert events, "no audit events of the operator's ServiceAccount"
    denied = [
        e for e in events if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"
    ]
    assert not denied, [(e["verb"], e.get("objectRef")) for e in denied[:5]]
    used = set()
    for e in events:
        ref = e.get("objectRef") or {}
        if not ref.get("resource"):
            continue  # discovery (/api, /apis): open to every authenticated user
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
    granted = set()
    for path in ("rbac.yaml",):
        for doc in yaml.safe_load_all((REPO / "manifests" / path).read_text()):
            for rule in (doc or {}).get("rules", []):
                for g in rule["apiGroups"]:
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            granted.add((g, r, v))
    unused = granted - used - set(UNEXERCISED)
    assert not unused, f"granted but never used by the operator: {sorted(unused)}"


def test_a_pool_deleted_under_its_batch_fails_each_action_by_name_and_a_namespace_deleted_whole_goes(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Deleting in the wrong order: the pool goes while its batch's actions run and wait. Each
    action ends Failed ``PoolNotFound`` saying its pool was deleted (at once, not held), none
    is left Pending or Running, and the batch completes. Then the namespace is deleted with a pool
    and a batch in it: nothing (no finalizer of the operator's) keeps it."""
    _pool(cluster, namespace, scaling={"minHosts": 1, "maxHosts": 1})
    _create(cluster, namespace, "actionbatches", batch_manifest("orphan", _sleepers(3, 120.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) >= 1,
        description="actions running",
        timeout=90,
    )
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionpools", "py")
    done = _wait_batch(cluster, namespace, "orphan", timeout=120)
    results = done["status"]["results"]
    assert [r["state"] for r in results] == ["Failed"] * 3, results
    assert {r["reason"] for r in results} == {"PoolNotFound"}, results
    assert all(r["output"] == f"ActionPool {namespace}/py was deleted" for r in results), results
    assert condition(done, "Failed") == "True"

    # A namespace of this test's own (the fixture's deletes its namespace itself).
    whole = f"{namespace[:50]}-whole"
    cluster.core.create_namespace({"metadata": {"name": whole, "labels": {"tangram.arl.dev/e2e": "true"}}})
    try:
        wait_for(
            cluster.core.list_namespaced_service_account,
            lambda _sa: True,
            namespace=whole,
            field_selector="metadata.name=default",
            description=f"default ServiceAccount in {whole}",
        )
        _pool(cluster, whole, name="other", scaling={"minHosts": 1})
        waiting = [{**a, "target": "other"} for a in _sleepers(2, 120.0)]
        _create(cluster, whole, "actionbatches", batch_manifest("left", waiting))
        _wait_for(
            cluster,
            whole,
            "actionbatches",
            lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) >= 1,
            description="actions running in the namespace to delete",
            timeout=90,
        )
    finally:
        cluster.core.delete_namespace(whole)
    wait_for_gone(cluster.core.list_namespace, whole, description=f"namespace {whole}", timeout=120)


def test_a_pool_edited_under_running_actions_observes_the_edit_and_kills_none(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """``kubectl edit`` of a pool while its actions run: maxHosts shrunk, the hosts' memory and the
    sessions' TTL changed (a new template: a rollout). Its status observes the new generation
    (``observedGeneration`` and every condition's), the running actions finish where they run
    (one attempt each), and ``kubectl get`` shows it Ready."""
    _pool(cluster, namespace, scaling={"minHosts": 1, "maxHosts": 2})
    _create(cluster, namespace, "actionbatches", batch_manifest("busy", _sleepers(2, 8.0)))
    _wait_for(
        cluster,
        namespace,
        "actionbatches",
        lambda o: (o.get("status", {}).get("counts") or {}).get("running", 0) == 2,
        description="both actions running",
        timeout=120,
    )
    cluster.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "actionpools",
        "py",
        {
            "spec": {
                "scaling": {"maxHosts": 1},
                "sessions": {"ttlSeconds": 60},
                "template": {"resources": {"memory": "3Gi"}},
            }
        },
    )

    def observed(o: dict[str, Any]) -> bool:
        gen = o["metadata"]["generation"]
        status = o.get("status", {})
        return (
            gen == 2
            and status.get("observedGeneration") == gen
            and all(c.get("observedGeneration") == gen for c in status.get("conditions", []))
        )

    _wait_for(cluster, namespace, "actionpools", observed, description="generation 2 observed", timeout=60)
    batch = _wait_batch(cluster, namespace, "busy")
    results = batch["status"]["results"]
    assert [(r["state"], r["attempts"]) for r in results] == [("Succeeded", 1)] * 2, results
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: condition(o, "Ready") == "True" and o["status"]["observedGeneration"] == 2,
        description="the pool Ready at generation 2",
        timeout=120,
    )
    row = cluster.kubectl("get", "actionpool", "py", "-n", namespace, "--no-headers").stdout.split()
    assert row[:3] == ["py", "True", "HostsReady"], row


def test_results_past_a_small_budget_are_left_out_counted_and_not_run_again_after_a_restart(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """A batch whose results do not fit its ``budgetBytes`` even without outputs (long ids): its
    status stayed over the budget its user set. Now the API server holds a status within it that
    counts what it left out; and every operator replica killed and started again runs none of the
    actions whose results it left out (they read as never run before)."""
    _pool(cluster, namespace, scaling={"minHosts": 1, "maxHosts": 1})
    _wait_for(
        cluster,
        namespace,
        "actionpools",
        lambda o: o.get("status", {}).get("hostsReady", 0) >= 1,
        description="a host ready",
        timeout=120,
    )
    before = _agents_ran(cluster, namespace)
    n = 30
    actions = [{**a, "id": f"{'x' * 120}-{a['id']}"} for a in _sleepers(n, 0)]
    budget = {"budgetBytes": 1024, "outputBytesPerAction": 16}
    _create(cluster, namespace, "actionbatches", batch_manifest("small", actions, results=budget))
    status = _wait_batch(cluster, namespace, "small")["status"]
    kept = status["results"]
    used = sum(len(json.dumps(r, separators=(",", ":"))) for r in kept)
    assert status["resultBytes"] <= 1024 and used <= 1024, status
    assert status["resultsOmitted"] == n - len(kept) > 0, status
    assert status["counts"]["succeeded"] == n, status
    assert any(c["type"] == "ResultsOmitted" and c["status"] == "True" for c in status["conditions"])
    names = list(operator.replicas)
    for name in names:
        operator.kill(name)
    for name in names:
        operator.start(name)
    # A batch created after the restart completes only once the new leader runs, and it reads every
    # batch when it starts.
    _create(cluster, namespace, "actionbatches", batch_manifest("after", _sleepers(1, 0)))
    _wait_batch(cluster, namespace, "after")
    again = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches", "small")
    assert condition(again, "Complete") == "True" and again["status"]["counts"] == status["counts"]
    assert _agents_ran(cluster, namespace) - before == n + 1, "an action left out of the status ran again"


def test_results_of_outputs_the_api_server_escapes_stay_within_the_budget_as_it_stores_them(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Outputs of progress bars and compiler errors (``█``: 3 bytes in UTF-8; ``<`` and ``&``: 6, as
    the API server escapes them) were counted as characters, so the status the API server held took
    several times the ``budgetBytes`` its user set. Read back as the API server serves it, the
    results take no more than their budget, and ``resultBytes`` says what they take."""
    _pool(cluster, namespace, scaling={"minHosts": 1, "maxHosts": 1})
    n, budget = 20, 8192
    actions = [
        {
            "id": f"e{i}",
            "type": "code",
            "target": "py",
            "payload": {"language": "python", "code": "print('\\u2588<&' * 400)"},
        }
        for i in range(n)
    ]
    results = {"budgetBytes": budget, "outputBytesPerAction": 1024}
    _create(cluster, namespace, "actionbatches", batch_manifest("escaped", actions, results=results))
    status = _wait_batch(cluster, namespace, "escaped")["status"]
    assert status["counts"]["succeeded"] == n
    assert status["results"][0]["output"].startswith(("\u2588", "<", "&"))  # the first output kept
    raw: bytes = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "actionbatches", "escaped", _preload_content=False
    ).data
    assert b"\\u003c" in raw  # the API server's own escaping, which the budget must count
    # Go writes a map's keys in order: "results" is followed by "startTime".
    start = raw.index(b'"results":[') + len(b'"results":')
    stored = raw[start : raw.index(b',"startTime"', start)]
    kept = len(status["results"])
    assert len(stored) - (kept + 1) == status["resultBytes"] <= budget  # less brackets and commas
