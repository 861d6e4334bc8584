"""RL training steps on a workload (its ``training`` section): step time and steps per hour.

Each step releases the workload's trajectories as one batch, a fresh sample (the seed advances per
step), and rolls out until every trajectory ended or the staleness bound cut the rest; a lost
trajectory is replaced by a new sample from a reserve drawn with another seed; then the trainer
trains for ``train_s`` with no external demand, so every pool is idle and the next step starts on
an empty cluster (which is why each step is simulated on its own).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from arl_tangram.errors import InvalidSpec
from arl_tangram.sim.engine import ActionRecord, Simulation
from arl_tangram.sim.workload import MAX_ACTIONS, Workload, check_size, generate

RESERVE_SEED_OFFSET = 1_000_003  # replacement prompts come from a stream no step's batch uses
RESERVE_BATCHES = 4


@dataclass(frozen=True)
class StepStats:
    """One policy's steps: means per step."""

    policy: str
    steps: int
    rollout_mean_s: float
    step_mean_s: float
    steps_per_h: float
    completed_per_step: float
    lost_per_step: float
    resampled_per_step: float
    cut_per_step: float
    # Every step ended with nothing left over (a cut by the bound is not left over) and, with
    # re-sampling, with its whole batch completed.
    complete: bool
    # The trajectory that ended its step last (the step's critical path): the share of its life
    # spent in external actions (ACT), the rest being LLM time. A policy can only shorten that
    # share, so it bounds the step speed-up: at most 1 / (1 - share) with ACT brought to zero.
    critical_external_share: float = 0.0


def run_steps(wl: Workload, policy: str) -> StepStats:
    """``wl.training.steps`` steps of ``wl`` under ``policy``."""
    tr = wl.training
    if tr is None:
        raise InvalidSpec("training", f"workload {wl.name} has no training section")
    # Each step simulates the whole workload again: bounded in all as one source is.
    per_step = check_size(wl)
    if tr.steps * per_step > MAX_ACTIONS:
        raise InvalidSpec(
            "training.steps",
            f"{tr.steps} steps of about {per_step:.3g} actions each; the simulator takes at most "
            f"{MAX_ACTIONS:,} over the steps (use fewer steps, or --scale)",
        )
    rollouts: list[float] = []
    shares: list[float] = []
    done = lost = resampled = cut = 0
    complete = True
    for k in range(tr.steps):
        step_wl = dataclasses.replace(wl, seed=wl.seed + k)
        batch = generate(step_wl)
        reserve = None
        if tr.resample:
            # Up to RESERVE_BATCHES batches of replacements; a step that loses more does not fill
            # its batch and is reported incomplete (a policy that loses nearly every trajectory).
            reserve = [
                t
                for j in range(RESERVE_BATCHES)
                for t in generate(dataclasses.replace(wl, seed=wl.seed + RESERVE_SEED_OFFSET * (j + 1) + k))
            ]
        res = Simulation(
            step_wl, policy, trajectories=batch, resample=reserve, deadline_s=tr.staleness_s
        ).run()
        rollouts.append(res.cut_at if res.cut_at is not None else res.makespan_s)
        shares.append(critical_share(res.records, {t.id: t.start for t in batch}))
        if res.cut_at is not None:
            cut += res.unfinished_trajectories
        elif not res.complete or (tr.resample and res.completed_trajectories < len(batch)):
            complete = False
        done += res.completed_trajectories
        lost += res.lost_trajectories
        resampled += res.resampled
    n = tr.steps
    rollout = statistics.fmean(rollouts)
    step = rollout + tr.train_s
    return StepStats(
        policy,
        n,
        rollout,
        step,
        3600.0 / step if step > 0 else 0.0,
        done / n,
        lost / n,
        resampled / n,
        cut / n,
        complete,
        statistics.fmean(shares) if shares else 0.0,
    )


def critical_share(records: Sequence[ActionRecord], starts: Mapping[str, float]) -> float:
    """Of the trajectory whose last action ended last: its summed ACT over its life (release to
    last completion; a re-sampled one from its first action's arrival)."""
    if not records:
        return 0.0
    last = max(records, key=lambda r: r.end)
    mine = [r for r in records if r.key[0] == last.key[0]]
    born = starts.get(last.key[0], min(r.arrival for r in mine))
    life = last.end - born
    return sum(r.act for r in mine) / life if life > 0 else 0.0
