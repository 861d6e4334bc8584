"""Summaries of a simulation run: the numbers ``tangram bench sim`` prints."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from arl_tangram.core.stats import percentile
from arl_tangram.sim.engine import ActionRecord, SimResult


@dataclass(frozen=True)
class Breakdown:
    """Mean ACT of a set of actions and its components (seconds): the trajectory's pod starting
    (``static`` only), waiting for units, executing, and overhead (dispatch, GPU restores)."""

    actions: int
    act_mean_s: float
    act_p99_s: float
    pod_s: float
    queue_s: float
    exec_s: float
    overhead_s: float


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
    gpu_act_p99_s: float | None = None
    pod_mean_s: float = 0.0
    complete: bool = True
    trajectories: int = 0
    completed_trajectories: int = 0
    unfinished_trajectories: int = 0
    queued_at_end: int = 0
    goodput_per_h: float = 0.0
    by_kind: Mapping[str, Breakdown] = field(default_factory=dict)
    # Over the actions every policy of the run completed (filled in by the bench).
    common_act_mean_s: float | None = None
    common_act_p99_s: float | None = None
    gpus_for_static_p99: int | None = None


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def gpu_act(result: SimResult) -> float | None:
    """Mean ACT of the GPU actions (what ``gpus_for_static_act`` compares), None without any."""
    acts = [r.act for r in result.records if r.pool == "gpu"]
    return mean(acts) if acts else None


def gpu_act_p99(result: SimResult) -> float | None:
    """p99 ACT of the GPU actions, None without any."""
    acts = [r.act for r in result.records if r.pool == "gpu"]
    return percentile(acts, 99) if acts else None


def breakdown(records: Sequence[ActionRecord]) -> Breakdown:
    """Mean ACT and its components over ``records``."""
    acts = [r.act for r in records]
    return Breakdown(
        len(records),
        mean(acts),
        percentile(acts, 99),
        mean([r.pod_wait_s for r in records]),
        mean([r.queue for r in records]),
        mean([r.exec_s for r in records]),
        mean([r.overhead_s for r in records]),
    )


def summarise(result: SimResult) -> Summary:
    """The summary of one run (``gpus_for_static_act`` is the GPU search's, filled in by the bench)."""
    recs = result.records
    acts = [r.act for r in recs]
    kinds: dict[str, list[ActionRecord]] = {}
    for r in recs:
        kinds.setdefault(r.kind, []).append(r)
    hours = result.makespan_s / 3600.0
    return Summary(
        act_mean_s=mean(acts),
        act_p50_s=percentile(acts, 50),
        act_p99_s=percentile(acts, 99),
        queue_mean_s=mean([r.queue for r in recs]),
        exec_mean_s=mean([r.exec_s for r in recs]),
        overhead_mean_s=mean([r.overhead_s for r in recs]),
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
        gpu_act_p99_s=gpu_act_p99(result),
        pod_mean_s=mean([r.pod_wait_s for r in recs]),
        complete=result.complete,
        trajectories=result.trajectories,
        completed_trajectories=result.completed_trajectories,
        unfinished_trajectories=result.unfinished_trajectories,
        queued_at_end=result.queued_at_end,
        goodput_per_h=result.completed_trajectories / hours if hours > 0 else 0.0,
        by_kind={k: breakdown(v) for k, v in sorted(kinds.items())},
    )


def common_acts(results: Mapping[str, SimResult]) -> dict[str, tuple[float, float]]:
    """Per policy, mean and p99 ACT over the actions that every run in ``results`` completed (a
    policy that loses trajectories must not look fast by leaving their later actions out); empty
    when they have none in common."""
    keys: set[tuple[str, int]] | None = None
    for res in results.values():
        done = {r.key for r in res.records}
        keys = done if keys is None else keys & done
    out: dict[str, tuple[float, float]] = {}
    if not keys:
        return out  # no action in common: nothing to compare (a mean of none is not 0 s)
    for name, res in results.items():
        acts = [r.act for r in res.records if keys is not None and r.key in keys]
        out[name] = (mean(acts), percentile(acts, 99))
    return out
