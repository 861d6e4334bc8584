"""``tangram demo``: a HumanEval rollout really executed, pod-per-trajectory against ARL-Tangram.

One run, on this machine: ``tangram up`` serves a shared pool and the rollout's trajectories run
through its gateway; then the same rollout (same problems, same think times) runs with a dedicated
sandbox process per trajectory. It prints ACT (mean, p50, p99), rollout time and CPU-seconds held
side by side, writes ``act.png`` and ``cores.png`` into ``tangram-demo/``, and checks every reward:
canonical solutions must score 1.0 and broken ones 0.0 (exit status 1 otherwise).
``tangram demo --simulate`` runs the scheduler simulator's demo instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from arl_tangram.demo.records import RunRecord
from arl_tangram.demo.workload import Trajectory, actions_of, rollout

DEFAULT_TRAJECTORIES = 16
DEFAULT_THINK_S = 2.0
UP_UID_BASE = 300_000
DEDICATED_UID_BASE = 400_000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tangram demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--simulate",
        action="store_true",
        help="the simulator's demo instead (its own options follow; see --simulate --help)",
    )
    p.add_argument(
        "--trajectories",
        type=int,
        default=DEFAULT_TRAJECTORIES,
        help="trajectories in the rollout, half canonical, half broken (default %(default)s)",
    )
    p.add_argument(
        "--think",
        type=float,
        default=DEFAULT_THINK_S,
        help="mean think time between a trajectory's actions, seconds (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the think times (default %(default)s)")
    p.add_argument("--cores", help="cores to use, e.g. 0-1 (default: all usable)")
    p.add_argument("--out", default="tangram-demo", help="where the charts go (default %(default)s)")
    return p  # fmt: skip


def check_rewards(record: RunRecord, trajectories: Sequence[Trajectory]) -> list[str]:
    """Every trajectory's reward against the oracle's; canonical must be 1.0, broken 0.0."""
    problems = []
    for traj in trajectories:
        got = record.rewards.get(traj.name)
        want = 1.0 if traj.variant == "canonical" else 0.0
        if got != want or traj.expected_reward != want:
            problems.append(
                f"{record.mode}: {traj.name}: reward {got}, oracle {traj.expected_reward}, must be {want}"
            )
    return problems


async def _run(args: argparse.Namespace, cores: tuple[int, ...], out: Path) -> int:
    from tqdm import tqdm

    from arl_tangram.demo.baseline import run_dedicated
    from arl_tangram.demo.report import charts, table
    from arl_tangram.demo.shared import run_shared, start_up, stop_up

    trajectories, skipped = rollout(args.trajectories, args.think, args.seed)
    n = actions_of(trajectories)
    canon = sum(1 for t in trajectories if t.variant == "canonical")
    print(
        f"rollout: {len(trajectories)} HumanEval trajectories ({canon} canonical, "
        f"{len(trajectories) - canon} broken; {skipped} problem(s) passed over whose broken solution "
        f"passes its tests), 3 actions each, think time mean {args.think:g}s; {len(cores)} cores"
    )
    print("starting tangram up (the embedded mode) on a shared pool ...", flush=True)
    t_up = time.monotonic()
    up = await start_up(out, cores, UP_UID_BASE)
    pool_start_s = time.monotonic() - t_up
    print(
        f"tangram up: gateway on {up.url}; pool ready after {pool_start_s:.1f}s (log: {up.log})",
        flush=True,
    )
    try:
        with tqdm(total=n, desc="ARL-Tangram (shared pool)", unit="action") as bar:
            ours = await run_shared(up, trajectories, len(cores), on_action=lambda: bar.update())
    finally:
        code, alive = await asyncio.to_thread(stop_up, up)
    problems = []
    if code != 0:
        problems.append(f"tangram up exited {code} on SIGINT")
    if alive:
        problems.append(f"tangram up left agent processes running: {alive}")
    with (
        tempfile.TemporaryDirectory(prefix="tangram-demo-") as tmp,
        tqdm(total=n, desc="pod per trajectory", unit="action") as bar,
    ):
        base = await run_dedicated(
            trajectories, cores, Path(tmp), DEDICATED_UID_BASE, on_action=lambda: bar.update()
        )
    startup = sorted(base.startup_s)
    if startup:
        print(
            f"pod per trajectory: {len(startup)} sandboxes started on demand, start-up measured here: "
            f"median {startup[len(startup) // 2]:.2f}s, max {startup[-1]:.2f}s"
        )
    print()
    print(table(base, ours))
    print(
        "ACT: from the moment a trajectory issues an action to its answer (waiting for a sandbox and its\n"
        "start-up included). CPU-seconds held: each per-trajectory sandbox from its start to its stop;\n"
        f"the shared host's {len(cores)} cores over the whole rollout (its start-up, "
        f"{pool_start_s:.1f}s above, is once per pool, not per trajectory)."
    )
    print()
    problems += check_rewards(base, trajectories) + check_rewards(ours, trajectories)
    act_png, cores_png = charts(base, ours, out)
    results = out / "results.json"
    results.write_text(json.dumps({"dedicated": asdict(base), "tangram": asdict(ours)}, indent=1))
    print(f"charts: {act_png}  {cores_png}")
    print(f"every action: {results}")
    scored = sum(len(r.rewards) for r in (base, ours))
    if problems:
        print(f"\nreward check FAILED ({len(problems)} of {scored}):", file=sys.stderr)
        for p in problems[:20]:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"reward check: all {scored} rewards right (canonical 1.0, broken 0.0, as the oracle says)")
    return 0


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--simulate" in argv:
        from arl_tangram.sim.demo import main as simulate

        argv.remove("--simulate")
        return int(simulate(argv) or 0)
    args = build_parser().parse_args(argv)
    if args.trajectories < 2:
        print(f"tangram demo: --trajectories must be at least 2, got {args.trajectories}", file=sys.stderr)
        return 2
    if args.think < 0:
        print(f"tangram demo: --think must be >= 0, got {args.think}", file=sys.stderr)
        return 2
    from arl_tangram.embedded.up import resolve_cores
    from arl_tangram.errors import InvalidSpec

    try:
        cores = resolve_cores(args.cores)
    except InvalidSpec as exc:
        print(f"tangram demo: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_run(args, cores, out))
