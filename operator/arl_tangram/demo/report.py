"""The demo's answer: a table side by side, a chart of the ACT distributions and of cores in use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from arl_tangram.demo.records import Hold, RunRecord


def table(base: RunRecord, ours: RunRecord) -> str:
    """Each metric for both runs and their ratio (baseline / tangram: above 1 is tangram's win)."""

    def row(name: str, b: float, o: float, fmt: str, ratio: bool = True) -> tuple[str, str, str, str]:
        return name, format(b, fmt), format(o, fmt), _ratio(b, o) if ratio else ""

    rows = [
        ("actions", str(len(base.actions)), str(len(ours.actions)), ""),
        row("mean ACT (s)", base.mean_act(), ours.mean_act(), ".3f"),
        row("p50 ACT (s)", base.act_percentile(50), ours.act_percentile(50), ".3f"),
        row("p99 ACT (s)", base.act_percentile(99), ours.act_percentile(99), ".3f"),
        row("rollout time (s)", base.rollout_s, ours.rollout_s, ".2f"),
        row("CPU-seconds held", base.cpu_seconds_held(), ours.cpu_seconds_held(), ".1f"),
        row("CPU-seconds running actions", base.cpu_seconds_busy(), ours.cpu_seconds_busy(), ".2f", False),
    ]
    w0 = max(len(r[0]) for r in rows)
    head = f"{'':<{w0}}  {'pod per trajectory':>18}  {'ARL-Tangram':>12}  {'ratio':>7}"
    lines = [head, "-" * len(head)]
    for name, b, o, ratio in rows:
        lines.append(f"{name:<{w0}}  {b:>18}  {o:>12}  {ratio:>7}")
    return "\n".join(lines)


def _ratio(base: float, ours: float) -> str:
    return f"{base / ours:.2f}x" if ours > 0 else "-"


def in_use(holds: Sequence[Hold], end_s: float, step_s: float) -> tuple[list[float], list[float]]:
    """Cores held at each ``step_s`` from 0 to ``end_s`` (a step function sampled finely)."""
    xs: list[float] = []
    ys: list[float] = []
    t = 0.0
    while t <= end_s:
        xs.append(t)
        ys.append(float(sum(h.cores for h in holds if h.start_s <= t < h.end_s)))
        t += step_s
    return xs, ys


def action_holds(record: RunRecord) -> list[Hold]:
    """The cores each action held while it ran (from its answer's own execution time)."""
    return [
        Hold(a.issued_s + a.act_s - a.exec_s, a.issued_s + a.act_s, len(a.cores), a.trajectory)
        for a in record.actions
    ]


def charts(base: RunRecord, ours: RunRecord, out_dir: Path) -> tuple[Path, Path]:
    """``act.png`` (the ACT distributions) and ``cores.png`` (cores held over the rollout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"dedicated": "#d95f02", "tangram": "#1b9e77"}
    act_png = out_dir / "act.png"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rec in (base, ours):
        xs = sorted(rec.acts)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(
            xs,
            ys,
            where="post",
            color=colours[rec.mode],
            linewidth=2,
            label=f"{rec.label}: p50 {rec.act_percentile(50):.2f}s, p99 {rec.act_percentile(99):.2f}s",
        )
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s, log scale): issue to answer, waits included")
    ax.set_ylabel("fraction of actions")
    ax.set_title(f"ACT distribution: {len(ours.actions)} HumanEval actions, {len(ours.rewards)} trajectories")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(act_png, dpi=120)
    plt.close(fig)

    cores_png = out_dir / "cores.png"
    end = max(base.rollout_s, ours.rollout_s)
    step = max(end / 2000, 0.005)
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for ax, rec, holds, what in (
        (axes[0], base, base.holds, "cores held by per-trajectory sandboxes (busy or idle)"),
        (axes[1], ours, action_holds(ours), "cores granted to running actions"),
    ):
        xs, ys = in_use(holds, end, step)
        ax.fill_between(xs, ys, step="post", color=colours[rec.mode], alpha=0.6, label=what)
        busy_x, busy_y = in_use(action_holds(rec), end, step)
        if rec is base:
            ax.plot(
                busy_x,
                busy_y,
                color="black",
                linewidth=0.8,
                drawstyle="steps-post",
                label="of which running an action",
            )
        else:
            held = sum(h.cores for h in rec.holds)
            ax.plot(
                [0, rec.rollout_s],
                [held, held],
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"shared host's cores ({held})",
            )
        ax.axvline(rec.rollout_s, color=colours[rec.mode], linestyle=":", linewidth=1.5)
        ax.set_ylim(0, rec.machine_cores * 1.5 + 0.2)  # room above for the legend
        ax.set_ylabel("cores")
        ax.set_title(f"{rec.label}: rollout {rec.rollout_s:.1f}s", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[1].set_xlabel("seconds into the rollout")
    fig.suptitle(f"cores in use on this {base.machine_cores}-core machine")
    fig.tight_layout()
    fig.savefig(cores_png, dpi=120)
    plt.close(fig)
    return act_png, cores_png
