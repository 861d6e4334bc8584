"""Summaries of a simulation run: the numbers ``tangram bench sim`` prints."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from arl_tangram.sim.engine import SimResult, percentile


@dataclass(frozen=True)
class Summary:
    """One policy's numbers (the JSON keys of ``bench sim``)."""

    act_mean_s: float
    act_p50_s: float
    act_p99_s: float
    queue_mean_s: float
    exec_mean_s: float
    overhead_mean_s: float
    makespan_s: float
    resource_seconds: float
    lost_trajectories: int
    gpus_for_static_act: int | None
    decision_us_mean: float
    decision_us_p99: float
    actions: int
    api_failures: int
    api_violations: int
    cpu_core_seconds: float
    gpu_seconds: float
    gpu_act_mean_s: float | None


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def gpu_act(result: SimResult) -> float | None:
    """Mean ACT of the GPU actions (what ``gpus_for_static_act`` compares), None without any."""
    acts = [r.act for r in result.records if r.pool == "gpu"]
    return mean(acts) if acts else None


def summarise(result: SimResult) -> Summary:
    """The summary of one run (``gpus_for_static_act`` is the GPU search's, filled in by the bench)."""
    acts = [r.act for r in result.records]
    return Summary(
        act_mean_s=mean(acts),
        act_p50_s=percentile(acts, 50),
        act_p99_s=percentile(acts, 99),
        queue_mean_s=mean([r.queue for r in result.records]),
        exec_mean_s=mean([r.exec_s for r in result.records]),
        overhead_mean_s=mean([r.overhead_s for r in result.records]),
        makespan_s=result.makespan_s,
        resource_seconds=result.cpu_core_seconds + result.gpu_seconds,
        lost_trajectories=result.lost_trajectories,
        gpus_for_static_act=None,
        decision_us_mean=mean(result.decisions_us),
        decision_us_p99=percentile(result.decisions_us, 99),
        actions=len(acts),
        api_failures=result.api_failures,
        api_violations=result.api_violations,
        cpu_core_seconds=result.cpu_core_seconds,
        gpu_seconds=result.gpu_seconds,
        gpu_act_mean_s=gpu_act(result),
    )
