# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Load, one row per run length (docs/reliability.md): actions at a steady rate through both doors
at once, the gateway's ``/v1/actions:stream`` (the client library, a real ServiceAccount token) and
ActionBatch objects, each into a pool of its own. Every action comes back once with its own output
and the agents ran each once; the row records the sustained throughput, p99 ACT per door, the
leader's RSS over the run and the operator's API write rate. `make test` runs the short row,
`make test-chaos` the issue's 10,000 actions over 10 minutes as well.

Batches carry ``ttlSecondsAfterFinished``, as a trainer's would: a collector reads each one's results
the moment it completes, and the operator deletes it soon after. So what the leader holds is bounded
by the load, not by the run's length, and the RSS sampled through the run shows whether memory keeps
growing (a leak) or levels off.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from chaos import (
    GROUP,
    VERSION,
    agents_ran,
    echo_actions,
    expected_output,
    make_pool,
    metric_sum,
    metrics,
    process_rss_kib,
    record,
    submit,
)
from operator_harness import Operator, trainer_token
from testbed import Cluster, condition

from arl_tangram.client import AsyncTangramClient, RetryPolicy, code_action


@dataclass(frozen=True)
class Load:
    name: str
    actions: int  # in all, half through each door
    seconds: float  # over how long they are submitted
    batch_every_s: float = 5.0


BATCH_TTL_S = 20  # long enough for the collector (it lists every COLLECT_EVERY_S), short against the run
COLLECT_EVERY_S = 0.5
RSS_EVERY_S = 2.0


class Collector(threading.Thread):
    """Lists the namespace's batches every COLLECT_EVERY_S and keeps each one's results the first
    time it is seen Complete (before its TTL deletes it); counts batches still present."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.ns = cluster, ns
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.present: set[str] = set()
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                listed = self.cluster.custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.ns, "actionbatches"
                )
            except Exception:  # an API hiccup: the next listing sees the same batches
                self.errors += 1
            else:
                self.present = {o["metadata"]["name"] for o in listed["items"]}
                for o in listed["items"]:
                    name = o["metadata"]["name"]
                    if name not in self.results and condition(o, "Complete") == "True":
                        self.results[name] = list(o["status"]["results"])
            self.stop.wait(COLLECT_EVERY_S)


class RssSampler(threading.Thread):
    """The leader's RSS every RSS_EVERY_S, as (seconds since start, KiB)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - t0, process_rss_kib(self.pid)))
            self.stop.wait(RSS_EVERY_S)

    def between(self, lo: float, hi: float) -> list[int]:
        return [kib for t, kib in self.samples if lo <= t < hi]


def slope_mib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS against time."""
    ts = [t for t, _ in samples]
    ys = [kib / 1024 for _, kib in samples]
    if len(ts) < 2 or max(ts) == min(ts):
        return 0.0
    return statistics.linear_regression(ts, ys).slope * 60


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
    rss_start = process_rss_kib(lead.proc.pid)
    n_gw = load.actions // 2
    n_batch = load.actions - n_gw
    n_batches = max(1, math.ceil(load.seconds / load.batch_every_s))
    per_batch = math.ceil(n_batch / n_batches)
    collector = Collector(cluster, namespace)
    sampler = RssSampler(lead.proc.pid)

    async def batches() -> list[str]:
        names = []
        start = time.monotonic()
        for k, first in enumerate(range(0, n_batch, per_batch)):
            await asyncio.sleep(max(0.0, start + k * load.batch_every_s - time.monotonic()))
            name = f"load-{k:04d}"
            actions = echo_actions(min(per_batch, n_batch - first) + first, "batch", prefix="b")[first:]
            await asyncio.to_thread(
                submit, cluster, namespace, name, actions, ttlSecondsAfterFinished=BATCH_TTL_S
            )
            names.append(name)
        return names

    async def both() -> tuple[tuple[list[float], int], list[str]]:
        url = f"http://127.0.0.1:{lead.port}"
        gw, names = await asyncio.gather(_gateway_door(url, namespace, token, n_gw, load.seconds), batches())
        return gw, names

    collector.start()
    sampler.start()
    t0 = time.monotonic()
    (gw_acts, gw_wrong), names = asyncio.run(both())
    submitted_s = time.monotonic() - t0
    # Every batch collected, then every batch gone (its TTL passed): what the leader holds after
    # the load is what it keeps for good.
    deadline = time.monotonic() + 600
    while not set(names) <= collector.results.keys() and time.monotonic() < deadline:
        time.sleep(COLLECT_EVERY_S)
    elapsed = time.monotonic() - t0
    while collector.present and time.monotonic() < deadline:
        time.sleep(COLLECT_EVERY_S)
    drained_s = time.monotonic() - t0
    time.sleep(3 * RSS_EVERY_S)
    collector.stop.set()
    sampler.stop.set()
    collector.join()
    sampler.join()
    m1 = metrics(lead)

    missing = sorted(set(names) - collector.results.keys())
    assert not missing, f"{len(missing)} batches never seen Complete before they went: {missing[:5]}"
    assert not collector.present, f"batches not deleted by their TTL: {sorted(collector.present)[:5]}"
    batch_acts: list[float] = []
    batch_wrong = 0
    for name in names:
        for r in collector.results[name]:
            batch_acts.append((r.get("queuedMillis", 0) + r.get("durationMillis", 0)) / 1000)
            i = int(r["id"][1:])
            if r["state"] != "Succeeded" or (r.get("output") or "").strip() != expected_output("b", i):
                batch_wrong += 1

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
    # Memory: the first fifth of the run warms up (pools, connections, interpreter caches); over
    # the rest the RSS must level off. A leak grows with the actions served, so it shows as the last
    # quarter of the load sitting above the middle (median against median: single samples jump
    # with the allocator), and as a slope that does not fall back once the batches are gone.
    warm = sampler.between(0.0, 0.2 * submitted_s)
    loaded = statistics.median(sampler.between(0.2 * submitted_s, 0.5 * submitted_s) or warm)
    last = statistics.median(sampler.between(0.75 * submitted_s, submitted_s) or [loaded])
    after_drain = statistics.median(sampler.between(drained_s, math.inf) or [last])
    steady = [(t, kib) for t, kib in sampler.samples if 0.2 * submitted_s <= t < submitted_s]
    slope = slope_mib_per_min(steady)
    allowance = max(8 * 1024, 0.05 * loaded)
    assert last - loaded <= allowance, (
        f"leader RSS kept growing under steady load: median {loaded / 1024:.1f} MiB over 20-50% of the "
        f"run, {last / 1024:.1f} MiB over its last quarter (allowed {allowance / 1024:.1f} MiB more; "
        f"slope {slope:+.2f} MiB/min)"
    )
    writes = metric_sum(m1, "tangram_api_writes_total") - metric_sum(m0, "tangram_api_writes_total")
    status_writes = metric_sum(m1, "tangram_api_writes_total", resource="actionbatches/status") - metric_sum(
        m0, "tangram_api_writes_total", resource="actionbatches/status"
    )
    record(
        f"load-{load.name}",
        actions=load.actions,
        submitted_over_s=load.seconds,
        elapsed_s=round(elapsed, 1),
        batch_ttl_s=BATCH_TTL_S,
        throughput_per_s=round(load.actions / elapsed, 1),
        gateway_p50_act_ms=round(_p(gw_acts, 0.5) * 1000),
        gateway_p99_act_ms=round(_p(gw_acts, 0.99) * 1000),
        batch_p50_act_ms=round(_p(batch_acts, 0.5) * 1000),
        batch_p99_act_ms=round(_p(batch_acts, 0.99) * 1000),
        batches=len(names),
        leader_rss_mib_start=round(rss_start / 1024, 1),
        leader_rss_mib_loaded_median=round(loaded / 1024, 1),
        leader_rss_mib_last_quarter_median=round(last / 1024, 1),
        leader_rss_mib_after_batches_gone=round(after_drain / 1024, 1),
        leader_rss_mib_max=round(max(kib for _, kib in sampler.samples) / 1024, 1),
        leader_rss_slope_mib_per_min=round(slope, 3),
        leader_rss_samples=len(sampler.samples),
        leader_rss_mib_by_minute=[
            round(kib / 1024, 1) for t, kib in sampler.samples if int(t) % 60 < RSS_EVERY_S
        ],
        api_writes=writes,
        api_writes_per_s=round(writes / elapsed, 2),
        batch_status_writes=status_writes,
        agents_ran=ran,
    )
