"""A small benchmark of the placement: MILP (HiGHS, CBC) against the greedy packer, side by side.

``python -m arl_tangram.planner.bench [--seed S] [--time-limit T] [--json]`` builds seeded synthetic
clusters of growing size (CPU nodes and 8-GPU nodes, sandbox pools and reward services, some nodes
partly taken), plans one round with each solver, and prints per case: planning time, the solver's
``sol_status``, the method used and the placement cost against greedy's (cost parts: unplaced units,
nodes opened). Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

from arl_tangram.planner.capacity_planner import CapacityPlanner, PlannerConfig, PlannerSolver
from arl_tangram.planner.snapshot import (
    ClusterSnapshot,
    InstanceSnapshot,
    NodeSnapshot,
    PoolDemand,
    RewardServiceSpec,
    SandboxPoolSpec,
    ScalingPolicy,
)

GIB = 2**30
CASES = ((8, 4), (32, 8), (128, 16))
# Sandboxes stay on CPU nodes and replicas on GPU nodes, as node selectors would keep them.
CPU_LABELS = {"tangram.arl.dev/node-kind": "cpu"}
GPU_LABELS = {"tangram.arl.dev/node-kind": "gpu"}
SOLVERS: tuple[PlannerSolver, ...] = ("highs", "cbc", "greedy")


def synthetic_cluster(nodes: int, pools: int, seed: int) -> ClusterSnapshot:
    """A seeded cluster: a quarter of the nodes carry GPUs; half the pools are reward services.
    Some CPU is taken by other pods, and some GPUs by replicas already running."""
    rng = random.Random(seed)
    node_list = []
    for j in range(nodes):
        if j % 4 == 3:
            node_list.append(
                NodeSnapshot(
                    f"gpu-{j:03d}", 128_000, 1024 * GIB, gpus=8, gpu_memory_bytes=80 * GIB, labels=GPU_LABELS
                )
            )
        else:
            cores = rng.choice([64, 96, 128, 256])
            node_list.append(
                NodeSnapshot(
                    f"cpu-{j:03d}",
                    cores * 1000,
                    cores * 4 * GIB,
                    labels=CPU_LABELS,
                    reserved_cpu_millicores=rng.randrange(0, cores // 2) * 1000,
                )
            )
    sandboxes = []
    services = []
    demand = []
    instances: list[InstanceSnapshot] = []
    for i in range(pools):
        if i % 2 == 0:
            cores = rng.choice([4, 8, 16, 32])
            spec = SandboxPoolSpec(
                f"sandbox-{i}",
                cores,
                cores * 2 * GIB,
                ScalingPolicy(max_instances=64, max_starting=16),
                CPU_LABELS,
            )
            sandboxes.append(spec)
            queued = rng.randrange(0, cores * 12)
        else:
            model_gib = rng.choice([14, 28, 70, 140])
            svc = RewardServiceSpec(
                f"reward-{i}",
                (1, 2, 4, 8),
                model_gib * GIB,
                ScalingPolicy(max_instances=8, max_starting=4),
                8000,
                64 * GIB,
                GPU_LABELS,
            )
            services.append(svc)
            queued = rng.randrange(0, 12)
        demand.append(PoolDemand(f"{'sandbox' if i % 2 == 0 else 'reward'}-{i}", queued, queued))
    # Some GPUs already hold replicas of the first service, so free GPUs are uneven.
    if services:
        gpu_nodes = [n for n in node_list if n.gpus]
        for k, node in enumerate(gpu_nodes):
            taken = rng.choice([0, 2, 4, 6])
            if taken:
                svc = services[0]
                instances.append(
                    InstanceSnapshot(
                        f"pre-{k}",
                        svc.name,
                        node.name,
                        "ready",
                        svc.replica_cpu_millicores,
                        svc.replica_memory_bytes,
                        taken,
                        running_actions=1,
                    )
                )
    return ClusterSnapshot(
        0.0, tuple(node_list), tuple(sandboxes), tuple(services), tuple(instances), tuple(demand)
    )


@dataclass(frozen=True)
class BenchRow:
    """One (case, solver) measurement."""

    nodes: int
    pools: int
    solver: str
    method: str
    sol_status: str
    planning_ms: float
    objective: float
    greedy_objective: float
    adds: int
    unplaced_units: int
    nodes_opened: int


def run(seed: int, time_limit_s: float) -> list[BenchRow]:
    """Plan every case with every solver; one fresh planner each, so no plan is reused."""
    rows = []
    for nodes, pools in CASES:
        snap = synthetic_cluster(nodes, pools, seed)
        for solver in SOLVERS:
            plan = CapacityPlanner(PlannerConfig(solver=solver, time_limit_s=time_limit_s)).plan(snap)
            rows.append(
                BenchRow(
                    nodes,
                    pools,
                    solver,
                    plan.placement.method,
                    plan.placement.sol_status,
                    plan.planning_seconds * 1000,
                    plan.placement.objective,
                    plan.placement.greedy_objective,
                    len(plan.adds),
                    sum(p.unmet_units for p in plan.pools),
                    len({a.node for a in plan.adds} - {i.node for i in snap.instances}),
                )
            )
    return rows


def main(argv: list[str]) -> int:
    """Print the benchmark table (or one JSON object with ``--json``); returns the exit status."""
    parser = argparse.ArgumentParser(prog="tangram bench plan", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=1.0, help="solver time limit per round (s)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    rows = run(args.seed, args.time_limit)
    if args.json:
        print(json.dumps({"cases": [row.__dict__ for row in rows]}))
        return 0
    print(
        f"{'nodes':>5} {'pools':>5} {'solver':>7} {'method':>15} {'sol_status':>12} {'ms':>9} "
        f"{'cost':>12} {'greedy cost':>12} {'cost/greedy':>11} {'adds':>5} {'unplaced':>8} {'opened':>6}"
    )
    for row in rows:
        ratio = row.objective / row.greedy_objective if row.greedy_objective else 1.0
        print(
            f"{row.nodes:>5} {row.pools:>5} {row.solver:>7} {row.method:>15} {row.sol_status:>12} "
            f"{row.planning_ms:>9.1f} {row.objective:>12.0f} {row.greedy_objective:>12.0f} {ratio:>11.3f} "
            f"{row.adds:>5} {row.unplaced_units:>8} {row.nodes_opened:>6}"
        )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
