"""``tangram demo``: the win of action-level scheduling, shown on simulated workloads.

``tangram demo --simulate`` (plain ``tangram demo`` runs real sandboxes through the embedded mode)
runs the built-in ``ai-coding`` and ``reward-gpu`` workloads (optionally shortened with ``--scale``)
under the ``static`` baseline and under ``tangram`` in the simulator, and prints ACT, its split,
makespan and resource use side by side. ``--plot FILE`` also writes a PNG of the ACT distributions
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time

from arl_tangram.errors import TangramError
from arl_tangram.sim.engine import SimResult, Simulation
from arl_tangram.sim.metrics import summarise
from arl_tangram.sim.workload import builtin, with_overrides

WORKLOADS = ("ai-coding", "reward-gpu")
POLICIES = ("static", "tangram")


def run(scale: float) -> dict[str, dict[str, SimResult]]:
    """Each demo workload under each demo policy."""
    out: dict[str, dict[str, SimResult]] = {}
    for name in WORKLOADS:
        wl = builtin(name)
        if scale < 1.0:
            wl = with_overrides(wl, scale=scale)
        out[name] = {p: Simulation(wl, p).run() for p in POLICIES}
    return out


def report(results: dict[str, dict[str, SimResult]]) -> str:
    """The comparison as text."""
    lines = []
    for name, by_policy in results.items():
        s, t = summarise(by_policy["static"]), summarise(by_policy["tangram"])
        lines.append(f"{name}: {s.actions} actions")
        for label, x in (("static", s), ("tangram", t)):
            if not x.complete:
                lines.append(f"  {label} did not finish: {x.queued_at_end} queued at the end")
        lines.append(f"  {'':24}{'static':>12}{'tangram':>12}{'static/tangram':>16}")
        rows = [
            ("mean ACT (s)", s.act_mean_s, t.act_mean_s),
            ("  pod start (s)", s.pod_mean_s, t.pod_mean_s),
            ("  queueing (s)", s.queue_mean_s, t.queue_mean_s),
            ("  execution (s)", s.exec_mean_s, t.exec_mean_s),
            ("  overhead (s)", s.overhead_mean_s, t.overhead_mean_s),
            ("p99 ACT (s)", s.act_p99_s, t.act_p99_s),
            ("makespan (s)", s.makespan_s, t.makespan_s),
            ("CPU core-seconds held", s.cpu_core_seconds, t.cpu_core_seconds),
            ("GPU-seconds held", s.gpu_seconds, t.gpu_seconds),
        ]
        for label, a, b in rows:
            ratio = f"{a / b:.2f}x" if a > 0 and b > 0 else "-"
            lines.append(f"  {label:24}{a:>12.3f}{b:>12.3f}{ratio:>16}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, SimResult]], path: str) -> None:
    """ACT distributions (CDF) per workload, static against tangram, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (name, by_policy) in zip(axes, results.items(), strict=True):
        for policy, res in by_policy.items():
            xs = sorted(r.act for r in res.records)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=f"{policy} (mean {sum(xs) / len(xs):.2f} s)")
        ax.set_xscale("log")
        ax.set_xlabel("action completion time (s)")
        ax.set_ylabel("fraction of actions")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Entry point of ``tangram demo``."""
    ap = argparse.ArgumentParser(prog="tangram demo", description=__doc__)
    ap.add_argument("--scale", type=float, default=0.5, help="fraction of each workload to run (default 0.5)")
    ap.add_argument("--plot", metavar="FILE", help="also write a PNG of the ACT distributions")
    args = ap.parse_args(argv)
    started = time.monotonic()
    print(f"simulating {', '.join(WORKLOADS)} under {' and '.join(POLICIES)} (scale {args.scale}) ...")
    try:
        results = run(args.scale)
    except TangramError as exc:
        print(f"tangram demo: {exc}", file=sys.stderr)
        return 2
    print(report(results))
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError:
            print("tangram demo: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    print(f"({time.monotonic() - started:.1f} s)")
    return 0
