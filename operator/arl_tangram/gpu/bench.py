"""``tangram bench gpu``: what MIG and NVLink-aware chunks buy, on the real allocator, in simulation.

Three measurements, one run, numbers side by side:

1. **MIG on vs off**: small reward services (1-16 GB of weights) at a steady Poisson load. Off: whole
   GPUs shared by evict-on-execution (restores from host memory, LRU). On: the MIG planner's layouts
   (``migplan``), each instance holding one service resident. A MIG instance with c of the GPU's 7
   compute slices runs an action (c/7)^e as fast as the whole GPU: e = 1 for compute-bound work,
   smaller for small models that cannot fill a whole GPU (both are printed). Reported: the fewest GPUs
   that reach the whole-GPU configuration's mean ACT and p99 ACT at a reference size, either way.
2. **NVLink-aware vs naive chunks** on the PCIe-pairs board (``fake.pcie_pairs``: bridges join GPUs
   0-2, 1-3, ...): tensor-parallel-2 services; the naive allocator cuts chunks by index (as if the
   board were all-to-all), so its pairs cross PCIe, where a TP-2 step is ``--pcie-penalty`` slower.
3. **Allocator decision latency**: microseconds per place+release on 8-GPU nodes, and per MIG plan.

The simulator (``arl_tangram.sim``) drives the scheduler policies over workloads whose actions know no
MIG profile and whose chunks pay nothing for crossing PCIe; so this bench runs its own reward-only
event loop (FCFS with backfill, one action per GPU or MIG instance) over the same ``GpuManager`` and
reports p99 with the project's one percentile (``core.stats``). Service times and penalties are model
assumptions, printed with the results.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arl_tangram.core.action import Action, EfficiencyCurve
from arl_tangram.core.pool import Grant
from arl_tangram.core.stats import percentile
from arl_tangram.gpu.fake import fake_inventory, nvswitch_board
from arl_tangram.gpu.migplan import MigGpu, ServiceDemand, plan_mig
from arl_tangram.managers.gpu import GpuManager, GpuNode

CURVE = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7))
RESTORE_GBPS = 20.0  # host-to-device restore, as the simulator's workloads assume


@dataclass(frozen=True)
class Service:
    name: str
    weights_gb: float
    rate_per_s: float
    t1_s: float  # mean execution on one whole GPU
    tp: int = 1


@dataclass
class RunResult:
    gpus: int
    act_mean_s: float
    act_p99_s: float
    restore_mean_s: float
    actions: int


def _arrivals(services: Sequence[Service], horizon_s: float, seed: int) -> list[tuple[float, Service, float]]:
    """(time, service, execution seconds on one whole GPU) of every request, the same for a seed."""
    rng = random.Random(seed)
    out = []
    for svc in services:
        t = 0.0
        while True:
            t += rng.expovariate(svc.rate_per_s)
            if t >= horizon_s:
                break
            out.append((t, svc, svc.t1_s * rng.lognormvariate(-0.125, 0.5)))  # mean 1 x t1
    out.sort(key=lambda x: (x[0], x[1].name))
    return out


def simulate(
    mgr: GpuManager,
    arrivals: Sequence[tuple[float, Service, float]],
    speed: dict[str, float] | None = None,
    mig_of: dict[str, str] | None = None,
    pcie_penalty: float = 1.0,
    cliques: dict[str, Any] | None = None,
) -> RunResult:
    """Serve ``arrivals`` FCFS with backfill on ``mgr``; ``mig_of`` sends a service to MIG instances
    labelled with it, ``speed`` is the fraction of a whole GPU they run at, ``cliques`` (node ->
    inventory) makes a chunk that is not an NVLink clique ``pcie_penalty`` times slower."""
    curve = EfficiencyCurve(1.0, CURVE)
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    for t, svc, work in arrivals:
        heapq.heappush(events, (t, next(seq), "arrive", (svc, work)))
    # One FCFS queue per kind of request (a MIG label or a TP size): requests of one kind need the
    # same units, so when its head cannot be placed nothing behind it can; others may backfill.
    queues: dict[str, deque[tuple[float, Action, Service, float]]] = {}
    acts: list[float] = []
    restores: list[float] = []
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            svc, work = payload
            prof = None if mig_of is None else mig_of.get(svc.name)
            a = Action(
                f"a{next(seq)}",
                "t",
                "gpu",
                (1 if prof else svc.tp,),
                curve,
                service=svc.name,
                service_gb=svc.weights_gb,
                mig_profile=prof,
                arrival=now,
            )
            queues.setdefault(prof or f"tp{svc.tp}", deque()).append((now, a, svc, work))
        else:
            grant, arrived = payload
            mgr.release(grant, now)
            acts.append(now - arrived)
        for q in sorted((q for q in queues.values() if q), key=lambda q: q[0][0]):
            while q:
                arrived, a, svc, work = q[0]
                g = mgr.place(a, a.feasible[0], now)
                if g is None:
                    break
                q.popleft()
                if a.mig_profile is not None:
                    exec_s = work / (speed or {}).get(svc.name, 1.0)
                else:
                    exec_s = work / (dict(CURVE)[g.units] * g.units)
                    inv = None if cliques is None else cliques.get(g.host)
                    if inv is not None and g.units > 1 and not inv.is_clique(g.unit_ids):
                        exec_s *= pcie_penalty
                restores.append(g.restore_s)
                heapq.heappush(events, (now + g.restore_s + exec_s, next(seq), "done", (g, arrived)))
    return RunResult(
        mgr.total_units(), statistics.fmean(acts), percentile(acts, 99), statistics.fmean(restores), len(acts)
    )


def _whole(gpus: int) -> GpuManager:
    nodes = []
    for i in range(math.ceil(gpus / 8)):
        n = min(8, gpus - 8 * i)
        inv = nvswitch_board(f"n{i}")
        node = GpuNode.from_inventory(inv, reserved=range(n, 8))
        nodes.append(node)
    return GpuManager(nodes, restore_gbps=RESTORE_GBPS)


def _mig(
    services: Sequence[Service], gpus: int, exponent: float
) -> tuple[GpuManager, dict[str, str], dict[str, float]] | None:
    """MIG layouts for ``gpus`` H100s: the planner's, with as many replicas as fit (the utilisation
    target lowered step by step), each instance labelled with its service."""
    best = None
    for util in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1):
        slow = (1 / 7) ** -exponent  # a 1g instance's execution time over a whole GPU's
        demands = [
            ServiceDemand(s.name, s.weights_gb * 1.2, 1, s.rate_per_s, s.t1_s * slow, max_utilization=util)
            for s in services
        ]
        try:
            plan = plan_mig(demands, [MigGpu(f"g{i}", "H100-80GB") for i in range(gpus)])
        except ValueError:
            break
        best = plan
    if best is None:
        return None
    # Each planned instance holds the service the planner gave it, resident (its runtime pod); all of
    # a service's instances carry one label, and run at the speed of its smallest one.
    pools = {name: list(profiles) for name, profiles in best.assignment.items()}
    speed = {name: (min(int(p[0]) for p in ps) / 7) ** exponent for name, ps in pools.items() if ps}
    layouts: dict[int, list[str]] = {}
    for gpu_id, lay in best.layouts.items():
        labelled = []
        for prof in lay:
            owner = next((n for n, ps in pools.items() if prof in ps), None)
            if owner is not None:
                pools[owner].remove(prof)
            labelled.append(f"svc@{owner}" if owner else "idle")
        layouts[int(gpu_id[1:])] = labelled
    nodes = []
    for n in range(math.ceil(gpus / 8)):
        size = min(8, gpus - 8 * n)
        mig = {g: layouts.get(8 * n + g, ["idle"]) for g in range(size)}
        nodes.append(GpuNode(f"m{n}", 8, 80.0, None, mig, reserved=set(range(size, 8))))
    mig_of = {name: f"svc@{name}" for name in speed}
    return GpuManager(nodes, restore_gbps=RESTORE_GBPS), mig_of, speed


def _fewest(target: float, key: str, run: Any, lo: int, hi: int) -> int | None:
    for g in range(lo, hi + 1):
        r = run(g)
        if r is not None and getattr(r, key) <= target:
            return g
    return None


def bench_mig(
    horizon_s: float, seed: int, ref_gpus: int, max_gpus: int, exponents: Sequence[float]
) -> dict[str, Any]:
    services = [
        Service(f"rm-{i}", w, r, t)
        for i, (w, r, t) in enumerate(
            [
                (1.2, 4.0, 0.05),
                (1.2, 3.0, 0.08),
                (3.0, 2.0, 0.1),
                (3.0, 1.5, 0.12),
                (6.0, 1.0, 0.15),
                (6.0, 0.8, 0.2),
                (8.0, 0.6, 0.25),
                (12.0, 0.4, 0.3),
                (14.0, 0.3, 0.3),
                (16.0, 0.2, 0.4),
            ]
        )
    ]
    arrivals = _arrivals(services, horizon_s, seed)

    def off(g: int) -> RunResult:
        return simulate(_whole(g), arrivals)

    def on(exponent: float) -> Any:
        def run(g: int) -> RunResult | None:
            built = _mig(services, g, exponent)
            if built is None:
                return None
            mgr, mig_of, speed = built
            return simulate(mgr, arrivals, speed, mig_of)

        return run

    load = sum(s.rate_per_s * s.t1_s for s in services)  # busy GPUs: fewer can never keep up
    lo = max(1, math.ceil(load / 0.95))
    ref = off(ref_gpus)
    out: dict[str, Any] = {
        "services": len(services),
        "requests": len(arrivals),
        "max_gpus": max_gpus,
        "reference_gpus": ref_gpus,
        "reference_act_mean_s": ref.act_mean_s,
        "reference_act_p99_s": ref.act_p99_s,
        "off_gpus_for_mean": _fewest(ref.act_mean_s, "act_mean_s", off, lo, max_gpus),
        "off_gpus_for_p99": _fewest(ref.act_p99_s, "act_p99_s", off, lo, max_gpus),
        "on": {},
    }
    for e in exponents:
        out["on"][str(e)] = {
            # MIG needs no lower bound: a plan that cannot carry the load is refused by the planner.
            "gpus_for_mean": _fewest(ref.act_mean_s, "act_mean_s", on(e), 1, max_gpus),
            "gpus_for_p99": _fewest(ref.act_p99_s, "act_p99_s", on(e), 1, max_gpus),
        }
    return out


def bench_nvlink(horizon_s: float, seed: int, penalty: float) -> dict[str, Any]:
    services = [Service(f"tp2-{i}", 60.0, 0.5, 1.2, tp=2) for i in range(3)]
    arrivals = _arrivals(services, horizon_s, seed)
    out: dict[str, Any] = {"pcie_penalty": penalty, "requests": len(arrivals)}
    for label, aware in (("aware", True), ("naive", False)):
        invs = {f"p{i}": fake_inventory("pcie-pairs", f"p{i}") for i in range(2)}
        nodes = []
        for inv in invs.values():
            node = GpuNode.from_inventory(inv)
            if not aware:  # the allocator believes the board is all-to-all and cuts chunks by index
                node = GpuNode(node.name, node.gpus, node.memory_gb, None, uuids=node.uuids)
            nodes.append(node)
        r = simulate(
            GpuManager(nodes, restore_gbps=RESTORE_GBPS), arrivals, pcie_penalty=penalty, cliques=invs
        )
        out[label] = {"act_mean_s": r.act_mean_s, "act_p99_s": r.act_p99_s, "actions": r.actions}
    return out


def bench_latency(rounds: int) -> dict[str, Any]:
    curve = EfficiencyCurve(1.0, CURVE)
    out: dict[str, Any] = {}
    for topo in ("pcie-pairs", "mig-h100"):
        mgr = GpuManager([GpuNode.from_inventory(fake_inventory(topo, f"n{i}")) for i in range(8)])
        rng = random.Random(1)
        held: list[Grant] = []
        samples = []
        for i in range(rounds):
            k = rng.choice((1, 1, 2, 4))
            a = Action(f"a{i}", "t", "gpu", (k,), curve, service=f"s{rng.randrange(10)}", service_gb=10.0)
            t0 = time.perf_counter()
            g = mgr.place(a, k, float(i))
            if g is not None:
                held.append(g)
            if len(held) > 20 or (g is None and held):
                mgr.release(held.pop(rng.randrange(len(held))), float(i))
            samples.append((time.perf_counter() - t0) * 1e6)
        out[f"place_us_{topo}"] = {"median": statistics.median(samples), "p99": percentile(samples, 99)}
    demands = [ServiceDemand(f"s{i}", 5 + 3 * (i % 5), 1 + i % 3, 2.0, 0.3) for i in range(12)]
    t0 = time.perf_counter()
    plan = plan_mig(demands, [MigGpu(f"g{i}", "H100-80GB") for i in range(64)])
    out["mig_plan_ms_64_gpus_12_services"] = (time.perf_counter() - t0) * 1e3
    out["mig_plan_gpus"] = plan.gpus_used
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tangram bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--horizon", type=float, default=600.0, help="simulated seconds of requests")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reference-gpus", type=int, default=2, help="whole GPUs of the reference ACT")
    ap.add_argument("--pcie-penalty", type=float, default=1.6, help="TP-2 step time across PCIe vs NVLink")
    ap.add_argument(
        "--slice-exponent",
        type=float,
        default=0.3,
        help="e of a MIG instance's speed (c/7)^e for small models",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.horizon <= 0 or args.reference_gpus < 1 or args.pcie_penalty < 1:
        ap.error("--horizon > 0, --reference-gpus >= 1 and --pcie-penalty >= 1 are required")
    result = {
        "mig": bench_mig(
            args.horizon, args.seed, args.reference_gpus, 4 * args.reference_gpus, (1.0, args.slice_exponent)
        ),
        "nvlink": bench_nvlink(args.horizon, args.seed, args.pcie_penalty),
        "latency": bench_latency(5000),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    m, n, lat = result["mig"], result["nvlink"], result["latency"]
    print(f"MIG on vs off: {m['services']} small reward services, {m['requests']} requests, H100 80GB")
    print(
        f"  reference: {m['reference_gpus']} whole GPUs -> ACT mean {m['reference_act_mean_s']:.3f} s, "
        f"p99 {m['reference_act_p99_s']:.3f} s"
    )

    def gpus(k: int | None) -> str:
        return str(k) if k is not None else f"none up to {m['max_gpus']}"

    for what in ("mean", "p99"):
        off = m[f"off_gpus_for_{what}"]
        cells = []
        for e, r in m["on"].items():
            on = r[f"gpus_for_{what}"]
            ratio = f" ({on / off:.2f}x)" if off and on else ""
            cells.append(f"MIG on, speed (c/7)^{e}: {gpus(on)}{ratio}")
        print(f"  GPUs for equal {what:>4} ACT: MIG off {gpus(off)}; " + "; ".join(cells))
    a, v = n["aware"], n["naive"]
    print(
        f"NVLink-aware vs naive chunks: PCIe-pairs board x2, TP-2 services, {n['requests']} requests, "
        f"PCIe step {n['pcie_penalty']:.1f}x slower"
    )
    print(
        f"  ACT mean: aware {a['act_mean_s']:.3f} s, naive {v['act_mean_s']:.3f} s "
        f"(naive/aware {v['act_mean_s'] / a['act_mean_s']:.2f}x)"
    )
    print(
        f"  ACT p99:  aware {a['act_p99_s']:.3f} s, naive {v['act_p99_s']:.3f} s "
        f"(naive/aware {v['act_p99_s'] / a['act_p99_s']:.2f}x)"
    )
    print("allocator decision latency (8 nodes x 8 GPUs):")
    for topo in ("pcie-pairs", "mig-h100"):
        d = lat[f"place_us_{topo}"]
        print(f"  place+release on {topo}: median {d['median']:.1f} us, p99 {d['p99']:.1f} us")
    print(
        f"  MIG plan, 12 services on 64 H100s: {lat['mig_plan_ms_64_gpus_12_services']:.1f} ms "
        f"({lat['mig_plan_gpus']} GPUs laid out)"
    )
    return 0
