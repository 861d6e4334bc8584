"""``tangram demo`` end to end on a small rollout: both allocation styles really run, every reward is
checked against the oracle, and the table and the charts come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_demo_runs_both_styles_and_checks_every_reward(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "demo", "--trajectories", "4", "--think", "0.2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reward check: all 8 rewards right" in done.stdout
    for row in ("mean ACT (s)", "p50 ACT (s)", "p99 ACT (s)", "rollout time (s)", "CPU-seconds held"):
        assert row in done.stdout
    out = tmp_path / "tangram-demo"
    for png in ("act.png", "cores.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    for mode in ("dedicated", "tangram"):
        assert len(results[mode]["actions"]) == 12  # 4 trajectories of 3 actions
        assert sorted(results[mode]["rewards"].values()) == [0.0, 0.0, 1.0, 1.0]
    # Each dedicated sandbox was really started (its measured start-up is there), one per trajectory.
    assert len(results["dedicated"]["startup_s"]) == 4
