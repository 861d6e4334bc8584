# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Faults on the test bed, one row each (docs/reliability.md): a fault is injected while a batch
runs on a pool of two hosts, and then every action ends exactly once in the batch's status with its
own result, the agents' counters (actions cannot write outside their workdir, so an agent's
``outcomes`` is the side effect that shows a run) say nothing ran twice, no host is left running an
action, the operator's metrics agree with the status, and deleting the pool leaves no pod and no
process behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chaos import (
    Partition,
    agent_running,
    agents_ran,
    batch_where,
    counts,
    echo_actions,
    expected_output,
    finished_by_state,
    host_pods,
    live_agents,
    make_pool,
    processes_under,
    record,
    restart_component,
    submit,
    wait_complete,
    wait_until,
)
from operator_harness import Operator
from testbed import Cluster

POOL = "py"
N = 16
SLEEP_S = 2.0


@dataclass
class Ctx:
    cluster: Cluster
    ns: str
    op: Operator
    notes: dict[str, Any]
    undo: list[Callable[[], None]]


def _kill_leader(c: Ctx) -> None:
    old = c.op.leader()
    c.notes["pre_kill_succeeded"] = finished_by_state(old, f"{c.ns}/{POOL}").get("Succeeded", 0)
    t0 = time.monotonic()
    c.op.kill(old.name)
    new = c.op.leader(timeout=30)
    c.notes["takeover_s"] = round(time.monotonic() - t0, 2)
    assert new.name != old.name
    c.op.start(old.name)  # back, as the standby


def _delete_host(c: Ctx) -> None:
    victim = host_pods(c.cluster, c.ns, POOL)[0]["metadata"]["name"]
    c.cluster.core.delete_namespaced_pod(victim, c.ns, grace_period_seconds=0)
    c.notes["deleted"] = victim


def _restart(component: str) -> Callable[[Ctx], None]:
    def inject(c: Ctx) -> None:
        assert c.cluster.local_dir is not None
        c.notes["outage_s"] = round(restart_component(c.cluster.local_dir, component, down_s=3.0), 2)

    return inject


def _partition(c: Ctx) -> None:
    name, ip = sorted(live_agents(c.cluster, c.ns, POOL).items())[0]
    c.notes["partitioned"] = name
    with Partition(ip):
        # The cut lasts until the rest of the batch has finished elsewhere or 20 s: long enough for
        # the operator to notice, short of the pool's action timeout.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            b = c.cluster.custom.get_namespaced_custom_object(
                "tangram.arl.dev", "v1alpha1", c.ns, "actionbatches", "chaos"
            )
            if counts(b).get("succeeded", 0) >= N - 2:
                break
            time.sleep(0.5)


def _node_not_ready(c: Ctx) -> None:
    pod = host_pods(c.cluster, c.ns, POOL)[0]
    node = pod["spec"]["nodeName"]
    c.notes["node"] = node
    patch = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "ChaosTest", "message": "heartbeat stopped"}
            ]
        }
    }
    c.cluster.core.patch_node_status(node, patch)
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "restored by the test"}
    c.undo.append(lambda: c.cluster.core.patch_node_status(node, {"status": {"conditions": [ready]}}))


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[Ctx], None]
    # Whether the agents that ran the batch all survive, so that their counters cover every run.
    agents_survive: bool = True
    # Whether the leader survives, so that its metrics cover every action of the batch.
    leader_survives: bool = True
    long: bool = False
    known_limit: str = ""


FAULTS = [
    Fault("leader-sigkill", _kill_leader, leader_survives=False),
    # Chaos only: 1 run in 3 here ended with actions Failed "agent answered 404: {}" (see
    # docs/reliability.md); tests/e2e covers a deleted host in `make test` meanwhile.
    Fault("host-pod-deleted", _delete_host, agents_survive=False, long=True),
    Fault("kube-apiserver-restart", _restart("kube-apiserver")),
    Fault("etcd-restart", _restart("etcd"), long=True),
    # The calls cut off by the partition are settled by asking the host again by key once it is
    # back (the dispatcher's _settle), so nothing runs twice and the host is kept.
    Fault("partition-one-host", _partition, long=True),
    Fault("node-not-ready", _node_not_ready, long=True),
]


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(
            f,
            id=f.name,
            marks=([pytest.mark.chaos_long] if f.long else [])
            + (
                [pytest.mark.xfail(reason=f"known limit: {f.known_limit}", strict=False)]
                if f.known_limit
                else []
            ),
        )
        for f in FAULTS
    ],
)
def test_a_fault_mid_batch_loses_nothing_and_runs_nothing_twice(
    cluster: Cluster, namespace: str, operator: Operator, fault: Fault
) -> None:
    make_pool(cluster, namespace, POOL, hosts=2)
    before = agents_ran(cluster, namespace, POOL)
    pod_dirs = {p["metadata"]["name"]: p["metadata"]["uid"] for p in host_pods(cluster, namespace, POOL)}
    submit(
        cluster,
        namespace,
        "chaos",
        echo_actions(N, POOL, SLEEP_S),
        retryPolicy={"maxRetries": 3, "backoffSeconds": 0},
    )
    batch_where(
        cluster, namespace, "chaos", lambda o: counts(o).get("running", 0) >= 2, "running", timeout=120
    )
    ctx = Ctx(cluster, namespace, operator, {}, [])
    t0 = time.monotonic()
    try:
        fault.inject(ctx)
        batch = wait_complete(cluster, namespace, "chaos", timeout=300)
    finally:
        for undo in ctx.undo:
            undo()
    elapsed = time.monotonic() - t0

    results = batch["status"]["results"]
    assert sorted(r["id"] for r in results) == sorted(f"a{i}" for i in range(N)), "an action missing or twice"
    bad = [
        r
        for r in results
        if r["state"] != "Succeeded" or r["output"].strip() != expected_output("a", int(r["id"][1:]))
    ]
    assert not bad, bad
    assert counts(batch).get("succeeded") == N, counts(batch)
    retried = sum(1 for r in results if r.get("attempts", 1) > 1)

    after = agents_ran(cluster, namespace, POOL)
    ran = sum(after.get(k, 0) - before.get(k, 0) for k in after)
    # The numbers so far, kept even when a check below fails (a known limit's row quotes them).
    record(f"fault-{fault.name}", actions=N, agents_ran=ran, retried_actions=retried, **ctx.notes)
    if fault.agents_survive:
        assert set(after) == set(before), f"hosts changed: {sorted(before)} -> {sorted(after)}"
        assert ran == N, f"the agents ran {ran} actions for {N}: something ran twice or was lost"
    else:
        assert ran <= N, f"the surviving agents ran {ran} actions for {N}"

    # Nothing left running on any host once the batch is Complete.
    for name, ip in live_agents(cluster, namespace, POOL).items():
        assert agent_running(ip) == [], f"{name} still runs actions of a finished batch"

    lead = operator.leader()
    states = finished_by_state(lead, f"{namespace}/{POOL}")
    if fault.leader_survives:
        assert states.get("Succeeded", 0) == N and sum(states.values()) == N, states
    else:
        # The dead leader's counters died with it: the successor counts what it finished (or
        # re-attached to), and together with the leader's last scrape every action is counted.
        pre = ctx.notes["pre_kill_succeeded"]
        assert states.get("Succeeded", 0) <= N and pre + states.get("Succeeded", 0) >= N, (pre, states)

    # No orphans: deleting the pool removes its pods and every process of theirs.
    pod_dirs.update(
        {p["metadata"]["name"]: p["metadata"]["uid"] for p in host_pods(cluster, namespace, POOL)}
    )
    cluster.custom.delete_namespaced_custom_object(
        "tangram.arl.dev", "v1alpha1", namespace, "actionpools", POOL
    )
    wait_until(lambda: not host_pods(cluster, namespace, POOL), "the pool's pods deleted", timeout=120)
    assert cluster.local_dir is not None
    leftovers = {}
    for name, uid in pod_dirs.items():
        d = Path(cluster.local_dir) / "pods" / f"{namespace}_{name}_{uid}"
        left = processes_under(d)
        if left:
            leftovers[name] = left
    assert not leftovers, f"processes of deleted pods still alive: {leftovers}"

    record(
        f"fault-{fault.name}",
        actions=N,
        action_s=SLEEP_S,
        hosts=2,
        recovered_in_s=round(elapsed, 1),
        retried_actions=retried,
        agents_ran=ran,
        leader_metrics=states,
        **ctx.notes,
    )
    print(json.dumps(counts(batch)))
