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
from collections.abc import Sequence
from dataclasses import dataclass

import yaml
from pydantic import ValidationError
from tqdm import tqdm

from arl_tangram.core.action import Action, Amdahl, Fixed, feasible_range
from arl_tangram.core.policies.registry import POLICIES
from arl_tangram.core.pool import Grant
from arl_tangram.core.scheduler import Scheduler
from arl_tangram.core.stats import percentile
from arl_tangram.errors import InvalidSpec, TangramError
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.sim.engine import SimResult, Simulation
from arl_tangram.sim.metrics import Summary, common_acts, gpu_act, gpu_act_p99, summarise
from arl_tangram.sim.planning import SimPlanner
from arl_tangram.sim.steps import StepStats, run_steps
from arl_tangram.sim.sweep import FAMILIES, SWEEP_POLICIES, run_variant
from arl_tangram.sim.workload import (
    BUILTIN,
    RewardSource,
    SearchSource,
    Workload,
    builtin,
    generate,
    load,
    with_overrides,
)
from arl_tangram.sim.workload_file import SCALING_KEYS, Planner, invalid_spec

DEFAULT_POLICIES = "static,fcfs-min,paper,tangram"


# ---- bench sim -----------------------------------------------------------------------------------------
def _run(wl: Workload, policy: str, label: str, quiet: bool, planner: bool = False) -> SimResult:
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
    return result


@dataclass(frozen=True)
class GpuPoint:
    """One policy at one GPU count: mean and p99 ACT of the GPU actions (None: did not fit or did
    not finish)."""

    gpus: int
    mean_s: float | None
    p99_s: float | None


def gpu_only(wl: Workload) -> Workload:
    """The workload's GPU sources alone: the GPU pool is scheduled and simulated apart from the CPU
    pool, so its ACT is the same without the CPU sources, at a fraction of the cost."""
    return dataclasses.replace(
        wl, sources=tuple(s for s in wl.sources if isinstance(s, RewardSource | SearchSource))
    )


def gpu_counts(wl: Workload, points: int = 10) -> list[int]:
    """The GPU counts the curve visits: ``points`` evenly spaced up to the workload's GPUs."""
    total = wl.cluster.total_gpus
    step = max(1, -(-total // points))
    return sorted({*range(step, total, step), total})


def gpu_curve(wl: Workload, policy: str, counts: Sequence[int]) -> list[GpuPoint]:
    """``policy``'s GPU ACT at each count (the curve is printed: it need not be monotone)."""
    base = gpu_only(wl)
    out: list[GpuPoint] = []
    for g in counts:
        try:
            res = Simulation(with_overrides(base, gpus=g), policy).run()
        except TangramError:  # a service that does not fit on this few GPUs
            out.append(GpuPoint(g, None, None))
            continue
        if not res.complete:
            out.append(GpuPoint(g, None, None))
        else:
            out.append(GpuPoint(g, gpu_act(res), gpu_act_p99(res)))
    return out


def gpus_needed(curve: Sequence[GpuPoint], target: float, p99: bool) -> int | None:
    """Fewest GPUs of the curve from which on every larger count meets ``target`` (mean, or p99):
    a count that meets it by chance between two that do not is not taken."""
    found: int | None = None
    for pt in sorted(curve, key=lambda p: -p.gpus):
        value = pt.p99_s if p99 else pt.mean_s
        if value is None or value > target:
            break
        found = pt.gpus
    return found


def with_planner(wl: Workload, settings: list[str]) -> Workload:
    """The workload with ``KEY=VALUE`` overrides of its planner section: a field of the file's
    planner section (docs/workloads.md), its VALUE read and checked as the file's would be."""
    if not settings:
        return wl
    if wl.planner is None:
        raise InvalidSpec("--planner-set", f"workload {wl.name} has no planner section")
    spec = wl.planner
    known = sorted(Planner.model_fields)
    for item in settings:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            expected = f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(known)}"
            raise InvalidSpec("--planner-set", expected)
        try:
            value = getattr(Planner.model_validate({key: yaml.safe_load(text)}), key)
        except (ValidationError, yaml.YAMLError) as exc:
            problem = invalid_spec(exc).message if isinstance(exc, ValidationError) else "not a YAML value"
            raise InvalidSpec(f"--planner-set {key}", f"{text!r}: {problem}") from None
        if value is None:  # the file's "left out" (a scaling default) is not a value to set
            raise InvalidSpec(f"--planner-set {key}", f"{text!r}: needs a value")
        if key not in SCALING_KEYS:
            spec = dataclasses.replace(spec, **{key: value})
            continue
        pools, field = SCALING_KEYS[key]
        for pool in pools:
            attr = f"{pool}_scaling"
            changed = dataclasses.replace(getattr(spec, attr), **{field: value})
            spec = dataclasses.replace(spec, **{attr: changed})
    return dataclasses.replace(wl, planner=spec)


def _workload(args: argparse.Namespace) -> Workload:
    wl = load(args.workload_file) if args.workload_file else builtin(args.workload)
    if args.seed is not None:
        wl = dataclasses.replace(wl, seed=args.seed)
    if args.scale is not None:
        wl = with_overrides(wl, scale=args.scale)
    return wl


def run_sim(
    wl: Workload, policies: list[str], quiet: bool = False, gpu_search: bool = True, planner: bool = False
) -> tuple[dict[str, Summary], dict[str, list[GpuPoint]]]:
    """Every policy on the workload, plus the GPU curve for GPU workloads, plus ``tangram`` with
    the capacity planner when ``planner``. ACT over the actions every policy completed is filled in."""
    results = {name: _run(wl, name, name, quiet) for name in policies}
    out = {name: summarise(r) for name, r in results.items()}
    # Compared over the actions every complete run finished (an incomplete run is not compared).
    complete = {name: r for name, r in results.items() if r.complete}
    if len(complete) > 1:
        for name, (m, p) in common_acts(complete).items():
            out[name] = dataclasses.replace(out[name], common_act_mean_s=m, common_act_p99_s=p)
    curves: dict[str, list[GpuPoint]] = {}
    if wl.has_gpu and gpu_search:
        static = results.get("static") or _run(wl, "static", "static", quiet)
        # A static run that left requests unserved (a replica no node holds) sets no target: its
        # ACT over the requests it did serve would flatter it, and its GPUs do not serve the load.
        target_mean = gpu_act(static) if static.complete else None
        target_p99 = gpu_act_p99(static) if static.complete else None
        static_gpus = Simulation(wl, "static").static_gpus if static.complete else None
        counts = gpu_counts(wl)
        for name in policies:
            found: int | None
            found_p99: int | None
            if name == "static":
                found, found_p99 = static_gpus, static_gpus
            else:
                curves[name] = gpu_curve(wl, name, counts)
                found = None if target_mean is None else gpus_needed(curves[name], target_mean, False)
                found_p99 = None if target_p99 is None else gpus_needed(curves[name], target_p99, True)
            out[name] = dataclasses.replace(
                out[name], gpus_for_static_act=found, gpus_for_static_p99=found_p99
            )
    if planner:
        out["tangram+planner"] = summarise(_run(wl, "tangram", "tangram+planner", quiet, planner=True))
    return out, curves


# The paper's per-kind ACT ratios of its baseline over ARL-Tangram (environment: tool calls and
# tests in sandboxes; reward: reward models and judges on GPUs).
PAPER_KIND_RATIO = {"environment": 9.0, "reward": 2.8}
KIND_CLASS = {
    "tool": "environment",
    "test": "environment",
    "reward": "reward",
    "judge": "reward",
    "call": "API",
}


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _state(s: Summary) -> str:
    if s.complete:
        return "complete"
    return f"INCOMPLETE({s.queued_at_end} queued, {s.unfinished_trajectories} unfinished)"


def _opt(x: float | int | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


# Figures averaged over the run's completed actions, in the table's order: none without any (a
# run that completed no action has no ACT, not one of 0 s).
PER_ACTION_KEYS = (
    "act_mean_s",
    "act_p50_s",
    "act_p99_s",
    "pod_mean_s",
    "queue_mean_s",
    "exec_mean_s",
    "overhead_mean_s",
)


def _per_action(s: Summary, key: str) -> float | int | None:
    value: float | int | None = getattr(s, key)
    return None if key in PER_ACTION_KEYS and s.actions == 0 else value


def _table_sim(workload: str, res: dict[str, Summary]) -> str:
    """The main table: one row per policy. ``ACT x tangram`` compares means over the actions
    every policy completed, and only between complete runs."""
    ref = res.get("tangram")
    cols = ["policy", "state", "ACT mean", "p50", "p99", "pod", "queue", "exec", "ovh", "common mean"]
    cols += ["common p99", "makespan", "res-s", "traj done", "lost", "goodput/h", "GPUs@mean", "GPUs@p99"]
    cols += ["dec us", "dec p99", "ACT x tangram"]
    rows = [cols]
    for name, s in res.items():
        ratio = "-"
        if ref is not None and s.complete and ref.complete:
            a = s.common_act_mean_s if s.common_act_mean_s is not None else s.act_mean_s
            b = ref.common_act_mean_s if ref.common_act_mean_s is not None else ref.act_mean_s
            ratio = f"{a / b:.2f}x" if b > 0 else "-"
        rows.append(
            [
                name,
                _state(s),
                *[_opt(_per_action(s, key)) for key in PER_ACTION_KEYS],
                _opt(s.common_act_mean_s),
                _opt(s.common_act_p99_s),
                f"{s.makespan_s:.1f}",
                f"{s.resource_seconds:.3g}",
                f"{s.completed_trajectories}/{s.trajectories}",
                str(s.lost_trajectories),
                f"{s.goodput_per_h:.0f}",
                _opt(s.gpus_for_static_act, "{}"),
                _opt(s.gpus_for_static_p99, "{}"),
                f"{s.decision_us_mean:.1f}",
                f"{s.decision_us_p99:.1f}",
                ratio,
            ]
        )
    lines = [
        f"workload {workload} (seconds; ACT = pod start + queueing + execution + overhead; common = over "
        "the actions every policy completed; goodput = completed trajectories per hour)"
    ]
    return "\n".join(lines + _grid(rows))


def _table_kinds(res: dict[str, Summary]) -> str:
    """ACT per action kind and component, every policy, and static over tangram per kind beside
    the paper's figures."""
    kinds = sorted({k for s in res.values() for k in s.by_kind})
    rows = [["kind", "policy", "actions", "ACT mean", "p99", "pod", "queue", "exec", "ovh"]]
    for k in kinds:
        for name, s in res.items():
            b = s.by_kind.get(k)
            if b is None:
                continue
            figures = (b.act_mean_s, b.act_p99_s, b.pod_s, b.queue_s, b.exec_s, b.overhead_s)
            rows.append([k, name, str(b.actions)] + [f"{x:.3f}" for x in figures])
    lines = ["ACT by action kind and component (seconds)", *_grid(rows)]
    st, tg = res.get("static"), res.get("tangram")
    if st is not None and tg is not None:
        parts = []
        for k in kinds:
            a, b = st.by_kind.get(k), tg.by_kind.get(k)
            if a is None or b is None or b.act_mean_s <= 0:
                continue
            cls = KIND_CLASS.get(k, k)
            paper = PAPER_KIND_RATIO.get(cls)
            no_pod = (a.act_mean_s - a.pod_s) / b.act_mean_s
            note = f" (paper's {cls}: {paper:.1f}x)" if paper is not None else ""
            parts.append(f"{k} {a.act_mean_s / b.act_mean_s:.2f}x, {no_pod:.2f}x without pod start{note}")
        if parts:
            lines.append("static/tangram mean ACT per kind: " + "; ".join(parts))
    return "\n".join(lines)


def _table_curve(curves: dict[str, list[GpuPoint]], static: Summary | None) -> str:
    """GPUs against mean and p99 ACT of the GPU actions, per pooled policy."""
    names = list(curves)
    rows = [["GPUs", *[f"{n} mean/p99" for n in names]]]
    counts = sorted({p.gpus for c in curves.values() for p in c})
    for g in counts:
        row = [str(g)]
        for n in names:
            pt = next((p for p in curves[n] if p.gpus == g), None)
            row.append("-" if pt is None or pt.mean_s is None else f"{pt.mean_s:.3f}/{_opt(pt.p99_s)}")
        rows.append(row)
    head = "GPU actions' ACT against the GPU count (s)"
    if static is not None:
        head += f"; static on its {static.gpus_for_static_act} GPUs: "
        head += f"{_opt(static.gpu_act_mean_s)} mean, {_opt(static.gpu_act_p99_s)} p99"
    return "\n".join([head, *_grid(rows)])


def _table_steps(wl: Workload, steps: dict[str, StepStats]) -> str:
    """Step time per policy, and each policy's steps per hour over static's (the paper: 1.5x)."""
    assert wl.training is not None
    tr = wl.training
    ref = steps.get("static")
    rows = [["policy", "state", "rollout s", "step s", "steps/h", "done/step", "lost/step"]]
    rows[0] += ["resampled/step", "cut/step", "ext share", "steps/h x static", "rollout x static"]
    for name, st in steps.items():
        faster = rollout = "-"
        if ref is not None and st.complete and ref.complete and st.step_mean_s > 0:
            faster = f"{ref.step_mean_s / st.step_mean_s:.2f}x"
            rollout = f"{ref.rollout_mean_s / st.rollout_mean_s:.2f}x" if st.rollout_mean_s > 0 else "-"
        rows.append(
            [
                name,
                "complete" if st.complete else "INCOMPLETE",
                f"{st.rollout_mean_s:.1f}",
                f"{st.step_mean_s:.1f}",
                f"{st.steps_per_h:.2f}",
                f"{st.completed_per_step:.1f}",
                f"{st.lost_per_step:.1f}",
                f"{st.resampled_per_step:.1f}",
                f"{st.cut_per_step:.1f}",
                f"{st.critical_external_share:.3f}",
                faster,
                rollout,
            ]
        )
    bound = "none" if tr.staleness_s is None else f"{tr.staleness_s:g} s"
    head = (
        f"RL steps: {tr.steps} batches, training {tr.train_s:g} s per step, staleness bound {bound}, "
        f"lost trajectories {'re-sampled' if tr.resample else 'not replaced'} "
        "(the paper: 1.5x faster steps); ext share = share of the last trajectory's life spent in "
        "external actions (the rest is LLM time)"
    )
    return "\n".join([head, *_grid(rows)])


def main_sim(argv: list[str]) -> int:
    """``tangram bench sim``."""
    ap = argparse.ArgumentParser(prog="tangram bench sim", description=__doc__)
    ap.add_argument("--workload", default="ai-coding", help=f"built-in workload ({', '.join(BUILTIN)})")
    ap.add_argument("--workload-file", help="a workload YAML file (see docs/workloads.md)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policies")
    ap.add_argument("--seed", type=int, help="override the workload's seed")
    ap.add_argument(
        "--scale", type=float, help="fraction of trajectories (or of the horizon) for quick looks"
    )
    ap.add_argument("--no-gpu-search", action="store_true", help="skip the GPU-count curve")
    ap.add_argument(
        "--no-steps", action="store_true", help="skip the RL step model (workloads with a training section)"
    )
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
    ap.add_argument(
        "--sweep",
        choices=sorted(FAMILIES),
        help="instead of one workload, random variants of a family (every policy on each) "
        "and the issue's targets per variant",
    )
    ap.add_argument("--variants", type=int, default=12, help="variants of --sweep (default 12)")
    args = ap.parse_args(argv)
    if args.sweep:
        return _main_sweep(args.sweep, args.variants, 0 if args.seed is None else args.seed, args.json)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"tangram bench sim: unknown policies {unknown}; known: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    try:
        wl = with_planner(_workload(args), args.planner_set)
        res, curves = run_sim(
            wl,
            policies,
            quiet=args.json and not sys.stderr.isatty(),
            gpu_search=not args.no_gpu_search,
            planner=args.planner,
        )
        steps = (
            {} if wl.training is None or args.no_steps else {name: run_steps(wl, name) for name in policies}
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
        "complete",
        "queued_at_end",
        "unfinished_trajectories",
        "completed_trajectories",
        "goodput_per_h",
        "common_act_mean_s",
        "common_act_p99_s",
        "gpus_for_static_p99",
        "pod_mean_s",
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "workload": wl.name,
                    "policies": {n: {k: _per_action(s, k) for k in keys} for n, s in res.items()},
                    "steps": {n: dataclasses.asdict(st) for n, st in steps.items()},
                }
            )
        )
    else:
        print(_table_sim(wl.name, res))
        print(_table_kinds(res))
        if curves:
            print(_table_curve(curves, res.get("static")))
        if steps:
            print(_table_steps(wl, steps))
        if wl.cluster.apis:
            calls = [
                f"{n} {x.api_failures} failed / {x.api_violations} let beyond a limit" for n, x in res.items()
            ]
            print("API calls: " + ", ".join(calls))
    return 0


def _main_sweep(family: str, n: int, seed: int, as_json: bool) -> int:
    """``bench sim --sweep FAMILY``: per variant, mean and p99 ACT over the common actions of each
    policy that ran to the end, tangram over static, and which targets hold."""
    if n < 1:
        print("tangram bench sim: --variants must be at least 1", file=sys.stderr)
        return 2
    rows = [["variant", *[f"{p} mean/p99" for p in SWEEP_POLICIES], "static/tangram", "targets", "what"]]
    met = 0
    out = []
    for i, (what, wl) in enumerate(FAMILIES[family](n, seed)):
        if not as_json:
            print(f"variant {i + 1}/{n}: {what}", file=sys.stderr)
        v = run_variant(wl.name, what, wl)
        targets = v.targets()
        ok = all(targets.values())
        met += ok
        out.append({"name": v.name, "what": what, "mean": v.mean, "p99": v.p99, "targets": targets})
        missed = [k for k, good in targets.items() if not good]
        rows.append(
            [
                v.name,
                *[
                    f"{v.mean[p]:.2f}/{v.p99[p]:.1f}" if v.complete[p] else "INCOMPLETE"
                    for p in SWEEP_POLICIES
                ],
                f"{v.mean['static'] / v.mean['tangram']:.2f}x mean, "
                f"{v.p99['static'] / v.p99['tangram']:.2f}x p99",
                "all met" if ok else "missed: " + ", ".join(missed),
                what,
            ]
        )
    if as_json:
        print(json.dumps({"sweep": family, "seed": seed, "variants": out, "met": met}))
        return 0
    print(f"sweep {family} (seed {seed}): ACT over the actions every complete policy completed (s)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    print(f"variants meeting every target: {met} of {n}")
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
