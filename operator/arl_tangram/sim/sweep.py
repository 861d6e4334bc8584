"""Variants of a built-in workload family, drawn at random, and the issue's targets checked on each.

The suite's built-ins are single points; a change tuned to them can lose on the next workload of
the same family. ``swe_variants`` draws SWE-style workloads around the built-in ``swe``: pool size
(hosts and cores per host), trajectories per burst, test length, parallel fraction and widest
DoP, turns, tool-call length and think time, so that saturated pools (tests of minutes at one
core on a few hosts) are drawn as often as roomy ones. ``tangram bench sim --sweep swe`` runs them.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from arl_tangram.sim.engine import Simulation
from arl_tangram.sim.metrics import common_acts
from arl_tangram.sim.workload import Workload, parse

SWEEP_POLICIES = ("static", "paper", "tangram")


def swe_variants(n: int, seed: int = 0) -> list[tuple[str, Workload]]:
    """``n`` SWE-style variants, each with a one-line description (the same ``seed``, the same ones)."""
    base = yaml.safe_load(resources.files("arl_tangram.sim").joinpath("workloads", "swe.yaml").read_text())
    rng = random.Random(seed)
    out: list[tuple[str, Workload]] = []
    for i in range(n):
        doc: dict[str, Any] = copy.deepcopy(base)
        hosts = rng.choice([2, 3, 4, 6])
        cores = rng.choice([32, 64])
        per_burst = rng.choice([32, 48, 64, 96])
        t1 = rng.choice([60, 120, 200])
        p_min = rng.choice([0.9, 0.95])
        top = rng.choice([16, 32, 48])
        turns = rng.choice([(5, 15), (5, 30), (10, 30)])
        tool = rng.choice([0.3, 0.5, 1.0])
        think = rng.choice([3.0, 6.0, 10.0])
        gap = rng.choice([200, 400, 800])
        doc["name"] = f"swe-v{i}"
        doc["seed"] = seed * 1000 + i
        doc["cluster"]["cpu_hosts"] = {"count": hosts, "cores": cores, "numa_nodes": 2, "memory_gib": 512}
        for k, src in enumerate(doc["sources"]):
            src["trajectories"] = per_burst
            src["release_at_s"] = k * gap
            src["actions"] = {"min": turns[0], "max": turns[1]}
            src["think"]["median_s"] = think
            src["tool"]["median_s"] = tool
            src["test"].update(t1_median_s=t1, p_min=p_min, cores_max=top)
        what = (
            f"{hosts}x{cores} cores, 3x{per_burst} traj {gap} s apart, T1 {t1} s, p>={p_min}, "
            f"DoP<={top}, {turns[0]}-{turns[1]} turns, tool {tool} s, think {think} s"
        )
        out.append((what, parse(doc, f"swe-v{i}")))
    return out


@dataclass(frozen=True)
class VariantResult:
    """One variant: mean and p99 ACT over the actions every policy completed, per policy."""

    name: str
    what: str
    mean: dict[str, float]
    p99: dict[str, float]
    complete: dict[str, bool]

    def targets(self) -> dict[str, bool]:
        """The issue's targets on this variant: every row complete, ``tangram`` the lowest mean
        and a p99 no worse than ``static``'s, and within 1% of ``paper`` on mean and p99."""
        t = "tangram"
        others = [p for p in self.mean if p != t]
        return {
            "complete": all(self.complete.values()),
            "lowest mean": all(self.mean[t] <= self.mean[p] for p in others),
            "p99 <= static": "static" not in self.p99 or self.p99[t] <= self.p99["static"],
            "within 1% of paper": "paper" not in self.mean
            or (self.mean[t] <= 1.01 * self.mean["paper"] and self.p99[t] <= 1.01 * self.p99["paper"]),
        }


def run_variant(
    name: str, what: str, wl: Workload, policies: tuple[str, ...] = SWEEP_POLICIES
) -> VariantResult:
    """Every policy on one variant; ACT compared over the actions all of them completed."""
    results = {p: Simulation(wl, p).run() for p in policies}
    done = {p: r for p, r in results.items() if r.complete}
    acts = common_acts(done) if len(done) > 1 else {}
    nan = float("nan")
    return VariantResult(
        name,
        what,
        {p: acts.get(p, (nan, nan))[0] for p in policies},
        {p: acts.get(p, (nan, nan))[1] for p in policies},
        {p: r.complete for p, r in results.items()},
    )
