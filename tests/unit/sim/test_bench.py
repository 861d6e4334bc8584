"""The benchmark commands print the JSON shapes the issue fixes (tiny sizes: numbers not asserted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from arl_tangram.sim import bench, demo

SIM_KEYS = {
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
}


def test_bench_sim_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.main_sim(
            ["--workload", "reward-gpu", "--scale", "0.03", "--json", "--policies", "static,tangram"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "reward-gpu"
    assert set(out["policies"]) == {"static", "tangram"}
    for numbers in out["policies"].values():
        assert set(numbers) == SIM_KEYS
    assert out["policies"]["static"]["gpus_for_static_act"] == 40
    assert all(p["complete"] for p in out["policies"].values())


def test_bench_sim_marks_a_run_with_work_left_over_incomplete(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main_sim(["--workload", "memory-tight", "--policies", "paper,tangram"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "INCOMPLETE(" in rows["paper"] and rows["paper"].rstrip().endswith("-")  # not compared
    assert " complete " in rows["tangram"]


def test_gpus_needed_takes_the_count_from_which_on_the_target_holds() -> None:
    curve = [(4, 9.0, 20.0), (8, 1.0, 5.0), (12, 3.0, 6.0), (16, 1.0, 4.0)]
    pts = [bench.GpuPoint(g, m, p) for g, m, p in curve]
    # 8 GPUs meet a mean of 2 s, 12 do not, 16 do: 16 is the answer (not 8, as a bisection may say).
    assert bench.gpus_needed(pts, 2.0, p99=False) == 16
    assert bench.gpus_needed(pts, 6.0, p99=True) == 8
    assert bench.gpus_needed(pts, 0.5, p99=False) is None


def test_bench_sim_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.main_sim(["--workload", "ai-coding", "--scale", "0.02", "--policies", "fcfs-min,tangram"]) == 0
    )
    out = capsys.readouterr().out
    assert "tangram" in out and "ACT x tangram" in out
    assert bench.main_sim(["--policies", "nope"]) == 2
    assert bench.main_sim(["--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_bench_sched_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main_sched(["--json", "--budget-s", "0.01", "--decisions", "3"]) == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert {(c["policy"], c["queued"], c["units"]) for c in cases} == {
        (p, q, u) for p in ("paper", "tangram") for q in (100, 1000, 10000) for u in (64, 1280)
    }
    assert all({"decision_us_p50", "decision_us_p99"} <= set(c) for c in cases)


def test_demo_prints_the_comparison_and_writes_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "act.png"
    assert demo.main(["--scale", "0.02", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ai-coding" in out and "reward-gpu" in out and "static/tangram" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planner_settings_override_the_workload_file() -> None:
    wl = bench.with_planner(bench.builtin("ai-coding"), ["host_cores=128", "target_efficiency=0.3"])
    assert wl.planner is not None
    assert (wl.planner.host_cores, wl.planner.target_efficiency) == (128, 0.3)
    with pytest.raises(bench.InvalidSpec, match="KEY=VALUE"):
        bench.with_planner(wl, ["nope=1"])
    with pytest.raises(bench.InvalidSpec, match="host_cores"):
        bench.with_planner(wl, ["host_cores=many"])


def test_a_static_run_with_pending_replicas_is_incomplete_and_sets_no_gpu_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    # The built-in on one node of 8 GPUs.
    doc = yaml.safe_load((Path(bench.__file__).parent / "workloads" / "reward-gpu.yaml").read_text())
    doc["cluster"]["gpu_nodes"]["count"] = 1  # static's 10 replicas of 4 GPUs: 2 bind, 8 stay pending
    f = tmp_path / "one-node.yaml"
    f.write_text(yaml.safe_dump(doc))
    argv = ["--workload-file", str(f), "--scale", "0.03", "--json", "--policies", "static,tangram"]
    assert bench.main_sim(argv) == 0  # not a failed run
    out = json.loads(capsys.readouterr().out)["policies"]
    assert not out["static"]["complete"] and out["static"]["queued_at_end"] > 0
    assert out["tangram"]["complete"]
    # Its ACT over the requests it served would flatter it: no GPU target, no GPU count.
    assert out["static"]["gpus_for_static_act"] is None and out["tangram"]["gpus_for_static_act"] is None
    assert out["tangram"]["gpus_for_static_p99"] is None


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        # Each was taken as given: 0 or -5 divided by zero, nan too, host_cores=0 as well.
        ("period_s=0", "greater than 0"),
        ("period_s=-5", "greater than 0"),
        ("period_s=nan", "finite number"),
        ("host_cores=0", "greater than or equal to 1"),
        ("target_efficiency=2", "less than or equal to 1"),
        ("solver=fastest", "'greedy'"),
        ("period_s=1e300", "limit of 1e+07 s"),
        ("min_hosts=", "needs a value"),
    ],
)
def test_planner_settings_are_checked_as_the_files_are(setting: str, message: str) -> None:
    wl = bench.builtin("memory-tight")
    with pytest.raises(bench.InvalidSpec, match=re.escape(message)) as err:
        bench.with_planner(wl, [setting])
    assert err.value.field == f"--planner-set {setting.partition('=')[0]}"


def test_a_bad_planner_setting_is_an_error_of_the_command_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workload", "memory-tight", "--policies", "tangram", "--planner", "--planner-set", "period_s=0"]
    assert bench.main_sim(argv) == 2
    assert "--planner-set period_s: '0': " in capsys.readouterr().err


def test_a_run_that_completed_no_action_shows_no_act(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """static's pods request more cores than the host has: none binds, no action completes. Its
    ACT, p50, p99 and components were printed as 0.000 (a mean over nothing)."""
    import yaml

    doc = yaml.safe_load((Path(bench.__file__).parent / "workloads" / "memory-tight.yaml").read_text())
    doc["static"]["pod_request_cores"] = 1000
    f = tmp_path / "no-pod-binds.yaml"
    f.write_text(yaml.safe_dump(doc))
    argv = ["--workload-file", str(f), "--json", "--policies", "static,tangram"]
    assert bench.main_sim(argv) == 0
    out = json.loads(capsys.readouterr().out)["policies"]
    assert not out["static"]["complete"] and out["static"]["completed_trajectories"] == 0
    assert all(out["static"][k] is None for k in bench.PER_ACTION_KEYS)
    assert out["tangram"]["complete"] and out["tangram"]["act_mean_s"] > 0
    assert bench.main_sim([*argv[:-3], "--policies", "static"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("static"))
    assert row.split("unfinished)")[1].split()[:7] == ["-"] * 7  # ACT, p50, p99, pod .. ovh


def test_a_workload_that_generates_no_action_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Every policy read "complete" with an ACT of 0 s on a workload with nothing to run."""
    argv = ["--workload", "reward-gpu", "--scale", "0.0001", "--policies", "tangram", "--no-gpu-search"]
    assert bench.main_sim(argv) == 2
    assert "sources: the workload generates no actions" in capsys.readouterr().err
