# mypy: disable-error-code="no-untyped-call,attr-defined"
"""A reward runtime killed while it restores a model (docs/reliability.md): a RewardModelService of
the built-in CPU scorer, big enough that copying its weights to the "device" takes a noticeable
time, scaled from zero by a batch of reward actions; the replica's runtime process is SIGKILLed
while its health says it is restoring the weights for the batch's first requests. Then every action
ends once, Succeeded, with the score the same model computes here (the scorer is deterministic);
the actions that were at the killed replica count a second attempt; the operator replaces the
replica; its metrics agree with the status; and deleting the service leaves no pod and no process.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from chaos import (
    GROUP,
    VERSION,
    counts,
    create,
    finished_by_state,
    processes_under,
    record,
    submit,
    wait_complete,
    wait_until,
)
from operator_harness import Operator, service_manifest
from testbed import REPO, Cluster, condition, http_get_json, wait_for

from arl_tangram.rewards.builtin import load_model, score_numpy, write_model

SERVICE = "rm"
SERVICE_LABEL = "tangram.arl.dev/service"
PORT = 8000  # the RewardModelService's default server port
N = 16
MODEL_MIB = 256  # a fresh process copies this to its "device" in about a second on a busy 2-core host
DIM = 64


def _replicas(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    listed = json.loads(
        cluster.core.list_namespaced_pod(
            ns, label_selector=f"{SERVICE_LABEL}={SERVICE}", _preload_content=False
        ).data
    )
    items: list[dict[str, Any]] = listed["items"]
    return items


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        not pod["metadata"].get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or ())
    )


def _runtime_processes(ip: str) -> list[int]:
    """PIDs of the processes serving a reward runtime at ``ip`` (the node runner's bubblewrap around
    it included): its command line holds ``--listen=IP:PORT``, after the kubelet's $(POD_IP)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"reward-runtime" in argv and f"--listen={ip}:{PORT}".encode() in argv:
            found.append(int(proc.name))
    return found


def _runtime_pid(ip: str) -> int:
    """The runtime's own interpreter (not the bubblewrap or setpriv that started it)."""
    pids = []
    for pid in _runtime_processes(ip):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if Path(argv0).name not in ("bwrap", "setpriv"):
            pids.append(pid)
    assert len(pids) == 1, f"expected one reward runtime at {ip}, found {pids}"
    return pids[0]


def _health(ip: str) -> dict[str, Any]:
    return dict(http_get_json(f"http://{ip}:{PORT}/v1/health", timeout=5))


def _services(ip: str) -> dict[str, Any]:
    [svc] = http_get_json(f"http://{ip}:{PORT}/v1/services", timeout=5)["services"]
    return dict(svc)


def test_a_reward_runtime_killed_while_restoring_loses_no_score(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    models = REPO / "artifacts" / "reliability" / "models"  # pods see the host's files, not its /tmp
    models.mkdir(parents=True, exist_ok=True)
    model = models / f"{namespace}.npz"
    write_model(model, buckets=MODEL_MIB * 2**20 // (4 * DIM), dim=DIM, hidden=64, seed=11)
    try:
        _run(cluster, namespace, operator, model)
    finally:
        model.unlink(missing_ok=True)


def _run(cluster: Cluster, ns: str, operator: Operator, model: Path) -> None:
    samples = [
        (f"Question {i}: what is {i} squared?", f"It is {i * i}." if i % 3 else "No idea.") for i in range(N)
    ]
    meta, arrays = load_model(model)
    expected = score_numpy(arrays, meta, [p + r for p, r in samples])  # the model, computed here
    del arrays
    # From zero, and restoring on request (``--no-prewarm``): by default a replica starts
    # restoring the weights as it starts, and the restore is over before requests reach it.
    rms = service_manifest(
        SERVICE,
        model,
        "builtin-scorer",
        minReplicas=0,
        maxReplicas=1,
        idleTimeoutSeconds=600,
        coldStartBudgetSeconds=120,
    )
    rms["spec"]["server"]["args"] = ["--no-prewarm"]
    create(cluster, ns, "rewardmodelservices", rms)
    wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: condition(o, "Ready") == "True" and o["status"].get("replicas") == 0,
        group=GROUP,
        version=VERSION,
        namespace=ns,
        plural="rewardmodelservices",
        description="the service Ready at zero replicas",
        timeout=60,
    )
    actions = [
        {"id": f"r{i}", "type": "reward", "target": SERVICE, "payload": {"prompt": p, "response": r}}
        for i, (p, r) in enumerate(samples)
    ]
    t_submit = time.monotonic()
    submit(cluster, ns, "scores", actions, retryPolicy={"maxRetries": 3, "backoffSeconds": 0})

    # The first replica: once ready, its health is polled until it says it is restoring the weights.
    first: dict[str, Any] = {}

    def first_ready() -> bool:
        ready = [p for p in _replicas(cluster, ns) if _ready(p)]
        if ready:
            first.update(ready[0])
        return bool(ready)

    wait_until(first_ready, "a first replica ready", timeout=180)
    victim, victim_ip, victim_uid = (
        first["metadata"]["name"],
        first["status"]["podIP"],
        first["metadata"]["uid"],
    )
    cold_start_s = time.monotonic() - t_submit
    pid = _runtime_pid(victim_ip)
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while True:
        try:
            health = _health(victim_ip)
        except (OSError, urllib.error.URLError):
            health = {}
        if SERVICE in health.get("restoring", ()):
            seen = health
            break
        assert SERVICE not in health.get("resident", ()), (
            f"the replica restored {SERVICE} before a health check saw it restoring: {health}"
        )
        assert time.monotonic() < deadline, f"replica {victim} never restored {SERVICE}: {health}"
        time.sleep(0.02)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    at_kill = int(seen["requests"])
    assert at_kill >= 1, seen

    # The operator replaces the failed replica, and the batch completes on the replacement.
    replacement: dict[str, Any] = {}

    def replaced() -> bool:
        ready = [p for p in _replicas(cluster, ns) if _ready(p) and p["metadata"]["name"] != victim]
        if ready:
            replacement.update(ready[0])
        return bool(ready)

    wait_until(replaced, f"a replica replacing {victim} ready", timeout=180)
    replaced_s = time.monotonic() - t_kill
    batch = wait_complete(cluster, ns, "scores", timeout=300)
    done_s = time.monotonic() - t_kill

    results = batch["status"]["results"]
    attempts = {r["id"]: int(r.get("attempts", 1)) for r in results}
    retried = sorted(i for i, a in attempts.items() if a > 1)
    numbers: dict[str, Any] = {
        "actions": N,
        "model_mib": MODEL_MIB,
        "cold_start_s": round(cold_start_s, 1),
        "requests_at_kill": at_kill,
        "replacement_ready_after_kill_s": round(replaced_s, 1),
        "done_after_kill_s": round(done_s, 1),
        "retried_actions": len(retried),
        "attempts_total": sum(attempts.values()),
        "states": counts(batch),
    }
    record("reward-runtime-killed-restoring", **numbers)  # kept even when a check below fails
    assert sorted(r["id"] for r in results) == sorted(f"r{i}" for i in range(N)), "an action missing or twice"
    wrong = [
        (r, expected[int(r["id"][1:])])
        for r in results
        if r["state"] != "Succeeded"
        or r.get("reward") != pytest.approx(expected[int(r["id"][1:])], rel=1e-5, abs=1e-6)
    ]
    assert not wrong, wrong
    assert counts(batch).get("succeeded") == N, counts(batch)
    # Each request the killed runtime held failed with it and was sent again.
    assert len(retried) >= at_kill, (at_kill, attempts)

    # The killed replica is gone (the operator deleted its failed pod) and the replacement restored
    # the weights once and serves nothing more.
    wait_until(
        lambda: victim not in {p["metadata"]["name"] for p in _replicas(cluster, ns)},
        f"the killed replica {victim} deleted",
        timeout=120,
    )
    new_ip = replacement["status"]["podIP"]
    svc = _services(new_ip)
    health = _health(new_ip)
    assert svc["restores"] == 1 and svc["resident"] and svc["batches"] >= 1, svc
    assert health["restoring"] == [] and health["requests"] == 0, health

    states = finished_by_state(operator.leader(), f"{ns}/{SERVICE}")
    assert states == {"Succeeded": N}, states
    status = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "rewardmodelservices", SERVICE)
    assert status["status"]["readyReplicas"] == 1 and status["status"]["replicas"] == 1, status["status"]

    numbers.update(
        replacement_restore_s=round(float(svc["restore_s_total"]), 2),
        replacement_batches=svc["batches"],
        leader_metrics=states,
    )
    record("reward-runtime-killed-restoring", **numbers)

    # No orphans: deleting the service removes its pods and every process of theirs.
    pods = {victim: victim_uid, replacement["metadata"]["name"]: replacement["metadata"]["uid"]}
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, "rewardmodelservices", SERVICE)
    wait_until(lambda: not _replicas(cluster, ns), "the service's pods deleted", timeout=120)
    assert cluster.local_dir is not None
    left = {ip: _runtime_processes(ip) for ip in (victim_ip, new_ip)}
    left.update(
        {
            name: processes_under(Path(cluster.local_dir) / "pods" / f"{ns}_{name}_{uid}")
            for name, uid in pods.items()
        }
    )
    assert not any(left.values()), f"processes of deleted replicas still alive: {left}"
    print(json.dumps(numbers))
