"""The agent stopping (SIGTERM: a pod deleted, ``tangram up`` stopping) with an action running."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import requests
from sandbox_agent_harness import processes_of, start_agent, stop_agent, wait_until


def test_sigterm_with_an_action_running_ends_it_answers_it_and_stops(tmp_path: Path) -> None:
    """aiohttp waits up to a minute for the handlers in flight before the app's cleanup, and the
    actions ended only at that cleanup: a running action held the stop for a minute, past a pod's
    grace period, and the agent was killed without answering. Now the action ends as the agent
    starts to stop, its call is answered 503 (the dispatcher sends it again), and the agent exits."""
    agent = start_agent(tmp_path / "work")
    answers: list[requests.Response | BaseException] = []

    def call() -> None:
        try:
            answers.append(
                agent.post("/v1/execute", {"code": "import time; time.sleep(600)", "timeout_s": 600}, 120)
            )
        except BaseException as exc:
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        wait_until(lambda: processes_of(agent.uids) != [], 30, "the action to start")
        agent.proc.terminate()
        try:
            # Well inside aiohttp's minute: without the fix the stop waits for the action.
            code = agent.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            raise AssertionError("the agent was still stopping 45 s after SIGTERM") from None
        caller.join(30)
        assert code == 0, agent.proc.stderr.read() if agent.proc.stderr else code
        assert len(answers) == 1 and isinstance(answers[0], requests.Response), answers
        assert answers[0].status_code == 503, answers[0].text
    finally:
        stop_agent(agent)
