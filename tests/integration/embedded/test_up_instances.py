"""Two ``tangram up`` on one machine, or one beside processes it did not start: a run that cannot
have its port starts nothing (and so stops nothing of the other's); a uid range some process uses is
refused and the process lives; with no --uid-base, two runs take disjoint ranges by themselves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from up_harness import leftovers, pool_doc, tangram_up, uid_base_for_test, wait_until

POOL = "default/py"


def _up(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arl_tangram", "up", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _uids_taken(output: str) -> range:
    found = re.search(r"run under uids (\d+)\.\.(\d+)", output)
    assert found is not None, output
    return range(int(found[1]), int(found[2]) + 1)


def test_a_second_run_on_a_taken_port_starts_nothing_and_leaves_the_first_alone(tmp_path: Path) -> None:
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump(pool_doc()))
    with tangram_up(spec) as first:
        wait_until(lambda: first.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")
        answers: list[dict[str, Any]] = []

        def run_long() -> None:
            code = "import time; time.sleep(8); print('survived')"
            body = {"code": code, "language": "python"}
            answers.append(requests.post(first.url + "/run_code", json=body, timeout=120).json())

        runner = threading.Thread(target=run_long, daemon=True)
        runner.start()
        uids = [range(*h["uids"]) for h in first.hosts(POOL)]
        wait_until(lambda: leftovers([], uids), 30, "the action's process under the host's uids")
        port = first.url.rsplit(":", 1)[1]
        # The same port and the same uids: what a mistyped second command line does.
        base = str(_uids_taken(first.output()).start)
        second = _up("-f", str(spec), "--port", port, "--uid-base", base)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"--port {port}" in second.stderr and "nothing was started" in second.stderr
        assert "starting (pid" not in second.stdout + second.stderr, "no host may start"
        runner.join(timeout=60)
        assert answers and answers[0]["status"] == "Success", answers
        assert answers[0]["run_result"]["stdout"] == "survived\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="a process under another uid needs root")
def test_a_uid_range_a_process_uses_is_refused_and_the_process_lives(tmp_path: Path) -> None:
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump(pool_doc(minHosts=0)))  # nothing to start, should it serve
    base = uid_base_for_test()
    bystander = subprocess.Popen(
        ["setpriv", f"--reuid={base + 1}", f"--regid={base + 1}", "--clear-groups", "sleep", "300"],
        start_new_session=True,
    )
    try:
        wait_until(lambda: leftovers([], [range(base + 1, base + 2)]), 30, "the bystander under its uid")
        refused = _up("-f", str(spec), "--port", "0", "--uid-base", str(base), timeout_s=30)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        err = refused.stderr
        assert "--uid-base" in err and f"uid {base + 1} is used by process {bystander.pid} (sleep)" in err
        assert "pass --uid-base" in err and "leave --uid-base out" in err
        assert bystander.poll() is None, "the bystander must live"
    finally:
        os.killpg(bystander.pid, signal.SIGKILL)
        bystander.wait()


def test_two_runs_with_no_uid_base_take_disjoint_ranges(tmp_path: Path) -> None:
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump(pool_doc(minHosts=0)))
    with tangram_up(spec, own_uid_base=False) as first, tangram_up(spec, own_uid_base=False) as second:
        a, b = _uids_taken(first.output()), _uids_taken(second.output())
        assert len(a) > 0 and len(b) > 0
        assert a.stop <= b.start or b.stop <= a.start, (a, b)


def test_sigterm_stops_every_process_and_a_new_run_takes_the_port_at_once(tmp_path: Path) -> None:
    """SIGTERM (a service manager's, a job scheduler's stop), not only Ctrl-C: the action running is
    answered and killed, no process it started is left, and the same port serves a run started
    right after (its connections' TIME_WAIT does not hold the port)."""
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump(pool_doc()))
    ended: list[int] = []
    with tangram_up(spec) as first:
        wait_until(lambda: first.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")

        def run_long() -> None:
            body = {"code": "import time; time.sleep(120)", "language": "python"}
            ended.append(requests.post(first.url + "/run_code", json=body, timeout=180).status_code)

        runner = threading.Thread(target=run_long, daemon=True)
        runner.start()
        hosts = first.hosts(POOL)
        pids, uids = [h["pid"] for h in hosts], [range(*h["uids"]) for h in hosts]
        wait_until(lambda: leftovers([], uids), 30, "the action's process under the host's uids")
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=60) == 0, first.output()
        assert leftovers(pids, uids) == []
        runner.join(timeout=30)
        assert ended == [504], "answered: send it again"
        port = first.url.rsplit(":", 1)[1]
    with tangram_up(spec, extra=("--port", port)) as again:
        assert again.url.endswith(f":{port}")
        wait_until(lambda: again.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")
        answer = requests.post(
            again.url + "/run_code", json={"code": "print(2)", "language": "python"}, timeout=60
        )
        assert answer.json()["run_result"]["stdout"] == "2\n"
