"""Limits that protect the agent without losing what an action did: a response's fetched files have
a budget, and the queue for slots is bounded (real agents, real HTTP)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent, wait_until


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


def test_requests_beyond_the_waiting_bound_get_503_or_run_codes_504_with_retry_after(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--max-concurrent", "1", "--max-waiting", "1")
    try:
        # The one slot is held by an action in a session that waits for a file the test uploads;
        # each step waits for what the agent reports (no timing involved).
        sid = agent.post("/v1/sessions", {}).json()["session_id"]
        gated = "touch started; while [ ! -e go ]; do sleep 0.01; done"
        session_files = f"{agent.url}/v1/sessions/{sid}/files"

        def call(body: dict[str, object]) -> requests.Response:
            return agent.post("/v1/execute", body)

        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(call, {"runtime": "bash", "code": gated, "session_id": sid})
            wait_until(
                lambda: requests.get(f"{session_files}/started", timeout=10).status_code == 200,
                what="the first action to hold the slot",
            )
            second = pool.submit(call, {"code": "print('second')"})
            wait_until(lambda: _waiting(agent) == 1, what="the second request to wait for the slot")
            refused = call({"code": "print('third')"})
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "1"
            assert "wait for one of 1 slots" in refused.json()["error"]
            # SandboxFusion's route answers 504, the status verl's client retries (any other it
            # scores -1 at once), in SandboxFusion's shape, with the same Retry-After.
            refused = agent.post("/run_code", {"code": "print('third')", "language": "python"})
            assert refused.status_code == 504 and refused.headers["Retry-After"] == "1", refused.text
            assert refused.json()["status"] == "SandboxError", refused.text
            assert "wait for one of 1 slots" in refused.json()["message"], refused.text
            assert requests.put(f"{session_files}/go", data=b"", timeout=10).status_code == 201
            assert first.result().json()["status"] == "ok"
            assert second.result().json()["stdout"] == "second\n"
        assert agent.execute("print('still serving')")["stdout"] == "still serving\n"
    finally:
        stop_agent(agent)


def _waiting(agent: Agent) -> float:
    """The agent's gauge of requests queued for a slot."""
    text = requests.get(agent.url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("tangram_sandbox_waiting_requests "))
    return float(line.split()[1])


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


# How late past its deadline an action may be stopped. The action sleeps: a busy loop would be
# ended by its CPU limit (timeout + 1 s) first, which hides a deadline that fires late.
LATENESS_BOUND_S = 2.0


@pytest.mark.parametrize(
    ("runtime", "code"),
    [("python", "import time\ntime.sleep(60)"), ("bash", "sleep 60 & sleep 60; wait")],
)
def test_the_timeout_of_a_sleeping_action_fires_on_time(tmp_path: Path, runtime: str, code: str) -> None:
    agent = start_agent(tmp_path / "work")
    try:
        body = agent.execute(code, runtime=runtime, timeout_s=1.0)
        assert body["status"] == "timeout", body
        assert body["signal"] == 9
        assert 1.0 <= float(body["wall_s"]) <= 1.0 + LATENESS_BOUND_S, body["wall_s"]
        assert float(body["cpu_s"]) < 0.5  # it slept: the CPU limit did not end it
    finally:
        stop_agent(agent)


SPINNERS_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}
static void *spin(void *arg) {
    double t0 = now();
    volatile long x = 0;
    while (now() - t0 < 4.0) x++;
    return arg;
}
int main(void) {
    pthread_t a, b;
    pthread_create(&a, 0, spin, 0); pthread_create(&b, 0, spin, 0);
    pthread_join(a, 0); pthread_join(b, 0);
    puts("done");
    return 0;
}
"""


# The spinners, having first set their affinity to every core (as a program may, outside too).
WIDENED_C = "#define _GNU_SOURCE\n#include <sched.h>\n" + SPINNERS_C.replace(
    "int main(void) {",
    "int main(void) {\n    cpu_set_t all;\n    CPU_ZERO(&all);\n"
    "    for (int i = 0; i < CPU_SETSIZE; i++) CPU_SET(i, &all);\n"
    "    sched_setaffinity(0, sizeof all, &all);",
)


def test_the_cpu_limit_never_comes_before_the_timeout(tmp_path: Path) -> None:
    """CPU time is per process and counts all its threads', on whatever cores they run. The limit
    was one core's worth of the timeout, then the granted cores' worth: a two-thread program on
    two granted cores, and then one on one granted core that widened its own affinity (as it may
    outside), were killed by SIGXCPU well before their timeout (false failures; outside they pass).
    Now it is the timeout's worth on every core of the host, one second over: a backstop only."""
    agent = start_agent(tmp_path / "work")
    try:
        probe = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))"
        want = int(5 * (os.cpu_count() or 1)) + 1
        one = agent.execute(probe, timeout_s=5.0)
        assert one["stdout"] == f"({want}, {want + 1})\n", one
        body = {"code": SPINNERS_C, "language": "c", "run_timeout": 6, "compile_timeout": 60}
        headers = {"X-Tangram-Cores": "0,1"}
        resp = requests.post(agent.url + "/run_code", json=body, headers=headers, timeout=120)
        run = resp.json()["run_result"]
        assert (run["return_code"], run["stdout"]) == (0, "done\n"), resp.json()
        if (os.cpu_count() or 1) >= 2:
            # On one granted core, the same spinners after widening their affinity to every core.
            body = {**body, "code": WIDENED_C}
            one_core = {"X-Tangram-Cores": "0"}
            resp = requests.post(agent.url + "/run_code", json=body, headers=one_core, timeout=120)
            run = resp.json()["run_result"]
            assert (run["return_code"], run["stdout"]) == (0, "done\n"), resp.json()
    finally:
        stop_agent(agent)


def test_calls_queued_on_one_session_hold_no_slot_another_action_needs(tmp_path: Path) -> None:
    """A session runs its calls one at a time. Its queued calls took a slot each before waiting for
    the session, so on an agent of two slots, three calls of one session kept an unrelated action
    waiting for the first call's end; they now wait for the session first, holding nothing."""
    agent = start_agent(tmp_path / "work", "--max-concurrent", "2")
    try:
        sid = agent.post("/v1/sessions", {}).json()["session_id"]
        call = "import time\nprint(time.time())\ntime.sleep(2)\nprint(time.time())"
        body = {"code": call, "session_id": sid, "timeout_s": 30}

        def send(i: int) -> requests.Response:
            headers = {"X-Tangram-Action-Key": f"queued-{i}"}
            return requests.post(agent.url + "/v1/execute", json=body, headers=headers, timeout=60)

        def listed() -> int:
            return len(requests.get(agent.url + "/v1/actions", timeout=10).json()["running"])

        with ThreadPoolExecutor(3) as pool:
            queued = [pool.submit(send, i) for i in range(3)]
            # All three are in (a keyed request is listed from its arrival) before the other comes.
            wait_until(lambda: listed() >= 3, what="the session's three calls to arrive")
            other = agent.execute("import time\nprint(time.time())", timeout_s=30)
            ends = sorted(float(f.result().json()["stdout"].split()[1]) for f in queued)
        assert other["status"] == "ok", other
        # It ran while the session's first call still slept, not after it.
        assert float(other["stdout"]) < ends[0], (other["stdout"], ends)
    finally:
        stop_agent(agent)
