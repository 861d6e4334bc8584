"""``tangram bench sim`` and ``tangram bench sched``: numbers side by side, never asserted.

``bench sim`` runs one workload under each policy in the same process and prints ACT (split into
queueing, execution and overhead), makespan, resource-seconds, lost trajectories, for GPU workloads
the fewest GPUs at which the policy's mean GPU ACT is no worse than ``static``'s, and the scheduler's
CPU time per decision. ``bench sched`` times single decisions of ``paper`` and ``tangram`` on the
same busy pool at 100, 1,000 and 10,000 queued actions and 64 or 1,280 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from typing import Any

from tqdm import tqdm

from arl_tangram.core.action import Action, Amdahl, Fixed, feasible_range
from arl_tangram.core.policies.registry import POLICIES
from arl_tangram.core.pool import Grant
from arl_tangram.core.scheduler import Scheduler
from arl_tangram.errors import InvalidSpec, TangramError
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.sim.engine import Simulation, percentile
from arl_tangram.sim.metrics import Summary, gpu_act, summarise
from arl_tangram.sim.planning import SimPlanner
from arl_tangram.sim.workload import Workload, builtin, generate, load, with_overrides

DEFAULT_POLICIES = "static,fcfs-min,paper,tangram"


# ---- bench sim -----------------------------------------------------------------------------------------
def _run(wl: Workload, policy: str, label: str, quiet: bool, planner: bool = False) -> Summary:
    trajectories = generate(wl)
    total = sum(len(t.steps) for t in trajectories)
    hook: SimPlanner | None = None
    if planner:
        if wl.planner is None:
            raise InvalidSpec("planner", f"workload {wl.name} has no planner section")
        hook = SimPlanner(wl.planner)
    with tqdm(
        total=total, desc=label, unit="act", file=sys.stderr, disable=True if quiet else None, leave=False
    ) as bar:
        result = Simulation(wl, policy, trajectories=trajectories, planner=hook, progress=bar.update).run()
    if hook is not None:
        # With a planner the capacity itself is elastic: charge what was provisioned, busy or not.
        result.cpu_core_seconds = hook.unit_seconds["cpu"]
        result.gpu_seconds = hook.unit_seconds["gpu"]
    return summarise(result)


def gpus_for_act(wl: Workload, policy: str, target: float) -> int | None:
    """Fewest GPUs (any count up to the workload's; whole nodes, the last one partly in the pool)
    at which ``policy``'s mean GPU ACT is no worse than ``target``; binary search, ACT being taken
    as non-increasing in GPUs. None if even all of the workload's GPUs do not reach it."""
    cands = list(range(1, wl.cluster.total_gpus + 1))
    memo: dict[int, float] = {}

    def act_at(g: int) -> float:
        if g not in memo:
            try:
                trial = with_overrides(wl, gpus=g)
                sim = Simulation(trial, policy)
                value = gpu_act(sim.run())
            except TangramError:  # a service that does not fit on this few GPUs
                value = None
            memo[g] = float("inf") if value is None else value
        return memo[g]

    lo, hi = 0, len(cands) - 1
    if act_at(cands[hi]) > target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if act_at(cands[mid]) <= target:
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


def with_planner(wl: Workload, settings: list[str]) -> Workload:
    """The workload with ``KEY=VALUE`` overrides of its planner section (numbers or the solver)."""
    if not settings:
        return wl
    if wl.planner is None:
        raise InvalidSpec("--planner-set", f"workload {wl.name} has no planner section")
    fields = {f.name: f for f in dataclasses.fields(wl.planner)}
    changes: dict[str, Any] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise InvalidSpec(
                "--planner-set", f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}"
            )
        kind = type(getattr(wl.planner, key))
        try:
            changes[key] = kind(value)
        except ValueError as exc:
            raise InvalidSpec(f"--planner-set {key}", f"{value!r} is not a {kind.__name__}") from exc
    return dataclasses.replace(wl, planner=dataclasses.replace(wl.planner, **changes))


def _workload(args: argparse.Namespace) -> Workload:
    wl = load(args.workload_file) if args.workload_file else builtin(args.workload)
    if args.seed is not None:
        wl = dataclasses.replace(wl, seed=args.seed)
    if args.scale is not None:
        wl = with_overrides(wl, scale=args.scale)
    return wl


def run_sim(
    wl: Workload, policies: list[str], quiet: bool = False, gpu_search: bool = True, planner: bool = False
) -> dict[str, Summary]:
    """Every policy on the workload, plus the GPU search for GPU workloads, plus ``tangram`` with
    the capacity planner when ``planner``."""
    out: dict[str, Summary] = {}
    for name in policies:
        out[name] = _run(wl, name, name, quiet)
    if wl.has_gpu and gpu_search:
        static = out.get("static") or _run(wl, "static", "static", quiet)
        target = static.gpu_act_mean_s
        static_gpus = Simulation(wl, "static").static_gpus
        for name in policies:
            if name == "static":
                found: int | None = static_gpus
            elif target is None:
                found = None
            else:
                found = gpus_for_act(wl, name, target)
            out[name] = dataclasses.replace(out[name], gpus_for_static_act=found)
    if planner:
        out["tangram+planner"] = _run(wl, "tangram", "tangram+planner", quiet, planner=True)
    return out


def _table_sim(workload: str, res: dict[str, Summary]) -> str:
    ref = res.get("tangram")
    cols = [
        "policy",
        "ACT mean",
        "p50",
        "p99",
        "queue",
        "exec",
        "ovh",
        "makespan",
        "res-s",
        "lost",
        "GPUs@static",
        "dec us",
        "dec p99",
        "ACT x tangram",
    ]
    rows = [cols]
    for name, s in res.items():
        ratio = f"{s.act_mean_s / ref.act_mean_s:.2f}x" if ref and ref.act_mean_s > 0 else "-"
        rows.append(
            [
                name,
                f"{s.act_mean_s:.3f}",
                f"{s.act_p50_s:.3f}",
                f"{s.act_p99_s:.3f}",
                f"{s.queue_mean_s:.3f}",
                f"{s.exec_mean_s:.3f}",
                f"{s.overhead_mean_s:.3f}",
                f"{s.makespan_s:.1f}",
                f"{s.resource_seconds:.3g}",
                str(s.lost_trajectories),
                "-" if s.gpus_for_static_act is None else str(s.gpus_for_static_act),
                f"{s.decision_us_mean:.1f}",
                f"{s.decision_us_p99:.1f}",
                ratio,
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [f"workload {workload} (seconds; ACT = queueing + execution + overhead)"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def main_sim(argv: list[str]) -> int:
    """``tangram bench sim``."""
    ap = argparse.ArgumentParser(prog="tangram bench sim", description=__doc__)
    ap.add_argument(
        "--workload", default="ai-coding", help="built-in workload (ai-coding, reward-gpu, deepsearch, mixed)"
    )
    ap.add_argument("--workload-file", help="a workload YAML file (see docs/workloads.md)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policies")
    ap.add_argument("--seed", type=int, help="override the workload's seed")
    ap.add_argument(
        "--scale", type=float, help="fraction of trajectories (or of the horizon) for quick looks"
    )
    ap.add_argument("--no-gpu-search", action="store_true", help="skip the GPU-count search")
    ap.add_argument(
        "--planner",
        action="store_true",
        help="also run tangram with the capacity planner scaling hosts and GPU nodes (row tangram+planner; "
        "its resource-seconds are the capacity provisioned)",
    )
    ap.add_argument(
        "--planner-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the workload's planner section (repeatable), e.g. host_cores=256",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"tangram bench sim: unknown policies {unknown}; known: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    try:
        wl = with_planner(_workload(args), args.planner_set)
        res = run_sim(
            wl,
            policies,
            quiet=args.json and not sys.stderr.isatty(),
            gpu_search=not args.no_gpu_search,
            planner=args.planner,
        )
    except TangramError as exc:
        print(f"tangram bench sim: {exc}", file=sys.stderr)
        return 2
    keys = [
        "act_mean_s",
        "act_p50_s",
        "act_p99_s",
        "queue_mean_s",
        "exec_mean_s",
        "overhead_mean_s",
        "makespan_s",
        "resource_seconds",
        "lost_trajectories",
        "gpus_for_static_act",
        "decision_us_mean",
        "decision_us_p99",
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "workload": wl.name,
                    "policies": {n: {k: getattr(s, k) for k in keys} for n, s in res.items()},
                }
            )
        )
    else:
        print(_table_sim(wl.name, res))
        if wl.cluster.apis:
            calls = [
                f"{n} {x.api_failures} failed / {x.api_violations} let beyond a limit" for n, x in res.items()
            ]
            print("API calls: " + ", ".join(calls))
    return 0


# ---- bench sched ---------------------------------------------------------------------------------------
def _bench_action(rng: random.Random, i: int) -> Action:
    """An ai-coding-like action: a tool call on 1 core or (one in five) a test run elastic 1..32."""
    if rng.random() < 0.22:
        return Action(
            f"a{i}",
            f"t{i}",
            "cpu",
            feasible_range(1, 32),
            Amdahl(rng.lognormvariate(2.0, 1.0), rng.uniform(0.85, 0.98)),
        )
    return Action(f"a{i}", f"t{i}", "cpu", (1,), Fixed(0.6))


def _busy_pool(units: int, rng: random.Random) -> tuple[CpuManager, list[Grant]]:
    hosts = (
        [SandboxHost.uniform("h0", 64, 2, 1e6)]
        if units == 64
        else [SandboxHost.uniform(f"h{i}", units // 5, 2, 1e6) for i in range(5)]
    )
    mgr = CpuManager(hosts)
    grants: list[Grant] = []
    i = 0
    # Fill every core with running actions of 1..32 cores, as a saturated pool with a long queue is.
    while mgr.free_units() > 0:
        a = _bench_action(rng, -1 - i)
        k = min(mgr.free_units(), rng.choice([1, 1, 1, 4, 8, 16, 32]))
        a.feasible = (k,)
        g = mgr.place(a, k, 0.0)
        if g is None:
            break
        g.est_end = rng.uniform(0.1, 10.0)
        grants.append(g)
        i += 1
    return mgr, grants


def time_decisions(
    policy: str, queued: int, units: int, budget_s: float, max_n: int, seed: int = 7
) -> list[float]:
    """Microseconds of CPU time per ``schedule`` call after one completion, on a saturated pool of
    ``units`` cores with ``queued`` actions waiting (refilled after each decision)."""
    rng = random.Random(seed)
    mgr, grants = _busy_pool(units, rng)
    sched: Scheduler = POLICIES[policy]({"cpu": mgr})
    for g in grants:
        sched.adopt(g)
    n = 0
    for _ in range(queued):
        sched.submit(_bench_action(rng, n), 0.0)
        n += 1
    samples: list[float] = []
    now = 0.0
    spent = time.process_time()
    while len(samples) < max_n and (time.process_time() - spent < budget_s or len(samples) < 3):
        now += 0.01
        running = list(sched.running.values())
        victim = running[rng.randrange(len(running))]
        sched.complete(victim, now)
        t0 = time.process_time_ns()
        admitted = sched.schedule(now)
        samples.append((time.process_time_ns() - t0) / 1000.0)
        for _ in admitted:
            sched.submit(_bench_action(rng, n), now)
            n += 1
    return samples


def main_sched(argv: list[str]) -> int:
    """``tangram bench sched``."""
    ap = argparse.ArgumentParser(prog="tangram bench sched", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument(
        "--budget-s", type=float, default=4.0, help="CPU seconds per case at most (>= 3 decisions)"
    )
    ap.add_argument("--decisions", type=int, default=500, help="decisions per case at most")
    args = ap.parse_args(argv)
    cases: list[dict[str, float | int | str]] = []
    grid = [(q, u) for u in (64, 1280) for q in (100, 1000, 10000)]
    quiet = args.json and not sys.stderr.isatty()
    for q, u in tqdm(grid, desc="bench sched", file=sys.stderr, disable=True if quiet else None, leave=False):
        for policy in ("paper", "tangram"):
            s = time_decisions(policy, q, u, args.budget_s, args.decisions)
            cases.append(
                {
                    "policy": policy,
                    "queued": q,
                    "units": u,
                    "decision_us_p50": percentile(s, 50),
                    "decision_us_p99": percentile(s, 99),
                    "decision_us_mean": sum(s) / len(s),
                    "decisions": len(s),
                }
            )
    if args.json:
        print(json.dumps({"cases": cases}))
        return 0
    print("scheduler CPU time per decision (us): a saturated CPU pool, one completion before each decision")
    head = [
        "queued",
        "units",
        "paper mean",
        "p50",
        "p99",
        "tangram mean",
        "p50",
        "p99",
        "mean ratio",
        "p99 ratio",
    ]
    rows = [head]
    by = {(c["policy"], c["queued"], c["units"]): c for c in cases}
    for q, u in grid:
        p, t = by[("paper", q, u)], by[("tangram", q, u)]
        rows.append(
            [str(q), str(u)]
            + [f"{float(p[k]):.1f}" for k in ("decision_us_mean", "decision_us_p50", "decision_us_p99")]
            + [f"{float(t[k]):.1f}" for k in ("decision_us_mean", "decision_us_p50", "decision_us_p99")]
            + [
                _ratio(p["decision_us_mean"], t["decision_us_mean"]),
                _ratio(p["decision_us_p99"], t["decision_us_p99"]),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    return 0


def _ratio(a: float | int | str, b: float | int | str) -> str:
    return f"{float(a) / float(b):.1f}x" if float(b) > 0 else "-"
