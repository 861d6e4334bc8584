# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Load, one row per run length (docs/reliability.md): actions at a steady rate through both doors
at once, the gateway's ``/v1/actions:stream`` (the client library, a real ServiceAccount token) and
ActionBatch objects, each into a pool of its own. Every action comes back once with its own output
and the agents ran each once; the row records the sustained throughput, p99 ACT per door, the
leader's RSS over the run and the operator's API write rate. `make test` runs the short row,
`make test-chaos` the issue's 10,000 actions over 10 minutes as well.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import pytest
from chaos import (
    agents_ran,
    echo_actions,
    expected_output,
    make_pool,
    metric_sum,
    metrics,
    process_rss_kib,
    record,
    submit,
    wait_complete,
)
from operator_harness import Operator, trainer_token
from testbed import Cluster

from arl_tangram.client import AsyncTangramClient, RetryPolicy, code_action


@dataclass(frozen=True)
class Load:
    name: str
    actions: int  # in all, half through each door
    seconds: float  # over how long they are submitted
    batch_every_s: float = 5.0


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


async def _gateway_door(url: str, ns: str, token: str, n: int, seconds: float) -> tuple[list[float], int]:
    """n actions over ``seconds`` in one-second ticks, one stream per tick; ACT as the client sees it."""
    per_tick = max(1, math.ceil(n / seconds))
    acts: list[float] = []
    wrong = 0
    async with AsyncTangramClient(
        url, namespace=ns, pool="gw", token=token, retry=RetryPolicy(attempts=5)
    ) as client:

        async def tick(first: int, count: int) -> None:
            nonlocal wrong
            t0 = time.monotonic()
            actions = [
                code_action(f"print('g{i}', {i} * {i})", id=f"g{i}") for i in range(first, first + count)
            ]
            async for result in client.run_many(actions):
                acts.append(time.monotonic() - t0)
                i = int((result.id or "g-1")[1:])
                if not result.ok or result.stdout.strip() != expected_output("g", i):
                    wrong += 1

        tasks = []
        start = time.monotonic()
        for k, first in enumerate(range(0, n, per_tick)):
            # Paced by the clock: tick k starts k seconds after the first (no sleep as synchronisation:
            # the pacing is the load's shape).
            await asyncio.sleep(max(0.0, start + k - time.monotonic()))
            tasks.append(asyncio.create_task(tick(first, min(per_tick, n - first))))
        await asyncio.gather(*tasks)
    return acts, wrong


LOADS = [
    pytest.param(Load("short", 1000, 60.0), id="1000-over-1-minute", marks=[pytest.mark.timeout(600)]),
    pytest.param(
        Load("full", 10000, 600.0, batch_every_s=10.0),
        id="10000-over-10-minutes",
        marks=[pytest.mark.chaos_long, pytest.mark.timeout(1800)],
    ),
]


@pytest.mark.parametrize("load", LOADS)
def test_sustained_load_through_both_doors(
    cluster: Cluster, namespace: str, operator: Operator, load: Load
) -> None:
    make_pool(cluster, namespace, "gw", hosts=1)
    make_pool(cluster, namespace, "batch", hosts=1)
    token = trainer_token(cluster, namespace)
    lead = operator.leader()
    before = {**agents_ran(cluster, namespace, "gw"), **agents_ran(cluster, namespace, "batch")}
    m0 = metrics(lead)
    rss = [process_rss_kib(lead.proc.pid)]
    n_gw = load.actions // 2
    n_batch = load.actions - n_gw
    n_batches = max(1, math.ceil(load.seconds / load.batch_every_s))
    per_batch = math.ceil(n_batch / n_batches)

    async def batches() -> list[str]:
        names = []
        start = time.monotonic()
        for k, first in enumerate(range(0, n_batch, per_batch)):
            await asyncio.sleep(max(0.0, start + k * load.batch_every_s - time.monotonic()))
            name = f"load-{k:04d}"
            actions = echo_actions(min(per_batch, n_batch - first) + first, "batch", prefix="b")[first:]
            await asyncio.to_thread(submit, cluster, namespace, name, actions)
            names.append(name)
            rss.append(process_rss_kib(lead.proc.pid))
        return names

    async def both() -> tuple[tuple[list[float], int], list[str]]:
        url = f"http://127.0.0.1:{lead.port}"
        gw, names = await asyncio.gather(_gateway_door(url, namespace, token, n_gw, load.seconds), batches())
        return gw, names

    t0 = time.monotonic()
    (gw_acts, gw_wrong), names = asyncio.run(both())
    batch_acts: list[float] = []
    batch_wrong = 0
    for name in names:
        b = wait_complete(cluster, namespace, name, timeout=600)
        for r in b["status"]["results"]:
            batch_acts.append((r.get("queuedMillis", 0) + r.get("durationMillis", 0)) / 1000)
            i = int(r["id"][1:])
            if r["state"] != "Succeeded" or (r.get("output") or "").strip() != expected_output("b", i):
                batch_wrong += 1
    elapsed = time.monotonic() - t0
    rss.append(process_rss_kib(lead.proc.pid))
    m1 = metrics(lead)

    assert len(gw_acts) == n_gw and gw_wrong == 0, (
        f"gateway: {len(gw_acts)}/{n_gw} answered, {gw_wrong} wrong"
    )
    assert len(batch_acts) == n_batch and batch_wrong == 0, (
        f"batches: {len(batch_acts)}/{n_batch}, {batch_wrong} wrong"
    )
    after = {**agents_ran(cluster, namespace, "gw"), **agents_ran(cluster, namespace, "batch")}
    ran = sum(after[k] - before.get(k, 0) for k in after)
    assert ran == load.actions, f"the agents ran {ran} actions for {load.actions}"
    assert operator.leader().name == lead.name, "the leader changed under load"
    # No growth trend: the leader ends well inside twice what it held once the load had started.
    assert rss[-1] < 2 * rss[1], f"leader RSS grew from {rss[1]} KiB to {rss[-1]} KiB"
    writes = metric_sum(m1, "tangram_api_writes_total") - metric_sum(m0, "tangram_api_writes_total")
    status_writes = metric_sum(m1, "tangram_api_writes_total", resource="actionbatches/status") - metric_sum(
        m0, "tangram_api_writes_total", resource="actionbatches/status"
    )
    record(
        f"load-{load.name}",
        actions=load.actions,
        submitted_over_s=load.seconds,
        elapsed_s=round(elapsed, 1),
        throughput_per_s=round(load.actions / elapsed, 1),
        gateway_p50_act_ms=round(_p(gw_acts, 0.5) * 1000),
        gateway_p99_act_ms=round(_p(gw_acts, 0.99) * 1000),
        batch_p50_act_ms=round(_p(batch_acts, 0.5) * 1000),
        batch_p99_act_ms=round(_p(batch_acts, 0.99) * 1000),
        batches=len(names),
        leader_rss_kib_start=rss[0],
        leader_rss_kib_loaded=rss[1],
        leader_rss_kib_end=rss[-1],
        leader_rss_kib_max=max(rss),
        api_writes=writes,
        api_writes_per_s=round(writes / elapsed, 2),
        batch_status_writes=status_writes,
        agents_ran=ran,
    )
