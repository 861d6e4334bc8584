"""Limits that protect the agent without losing what an action did: a response's fetched files have
a budget, and the queue for slots is bounded (real agents, real HTTP)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import start_agent, stop_agent


def test_fetched_files_over_a_limit_are_left_out_with_a_note(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--max-file-mb", "1", "--max-fetch-mb", "1.5")
    try:
        code = (
            "open('a.bin', 'wb').write(b'a' * 900_000)\n"
            "open('b.bin', 'wb').write(b'b' * 900_000)\n"
            "open('c.bin', 'wb').write(b'c' * 2_000_000)\n"
            "print('done')\n"
        )
        body = agent.post(
            "/run_code",
            {"code": code, "language": "python", "fetch_files": ["a.bin", "b.bin", "c.bin", "none"]},
        ).json()
        # The action's own result is all there.
        assert body["status"] == "Success" and body["run_result"]["stdout"] == "done\n"
        assert len(body["files"]["a.bin"]) == 1_200_000  # 900 000 bytes, base64
        # As SandboxFusion does, files not returned are left out of the map; the message says why.
        assert set(body["files"]) == {"a.bin"}
        assert body["message"] == ""  # SandboxFusion's field, kept as it has it
        b_note, c_note = body["notes"]
        assert b_note.startswith("fetch_files['b.bin']: 'b.bin' (900000 bytes) does not fit the 672864 bytes")
        assert "'c.bin' is 2000000 bytes, over the limit" in c_note
    finally:
        stop_agent(agent)


def test_requests_beyond_the_waiting_bound_get_503_with_retry_after(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--max-concurrent", "1", "--max-waiting", "1")
    try:

        def call(_: int) -> requests.Response:
            return agent.post("/v1/execute", {"code": "import time; time.sleep(1.5)"})

        with ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(call, 0)
            time.sleep(0.3)  # running
            second = pool.submit(call, 1)
            time.sleep(0.3)  # waiting for the one slot
            third = pool.submit(call, 2)
            statuses = sorted(f.result().status_code for f in (first, second, third))
            refused = [f.result() for f in (first, second, third) if f.result().status_code == 503]
        assert statuses == [200, 200, 503]
        assert refused[0].headers["Retry-After"] == "1"
        assert "wait for one of 1 slots" in refused[0].json()["error"]
        assert agent.execute("print('still serving')")["stdout"] == "still serving\n"
    finally:
        stop_agent(agent)


@pytest.mark.parametrize("value", ["-1"])
def test_negative_waiting_bound_is_refused_by_name(tmp_path: Path, value: str) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "sandbox-agent", "--max-waiting", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "max-waiting" in done.stderr
