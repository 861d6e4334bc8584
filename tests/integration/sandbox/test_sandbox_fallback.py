"""The clean-up without PID namespaces (``--no-pid-namespace``, as under runtimes that lack them):
leftover processes are killed by process group and then by the action's own uid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent
from test_sandbox_hostile import DAEMON, FORK_BOMB


@pytest.fixture(scope="module")
def fallback_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("fallback") / "work"
    running = start_agent(root, "--no-pid-namespace")
    yield running
    stop_agent(running)
    assert processes_of(running.uids) == []


def test_fallback_is_reported(fallback_agent: Agent) -> None:
    iso = requests.get(fallback_agent.url + "/v1/health", timeout=10).json()["isolation"]
    assert iso["pid_namespace"] is False
    assert iso["per_action_uid"] is True


def test_daemons_timeouts_and_bombs_leave_nothing_without_a_pid_namespace(fallback_agent: Agent) -> None:
    body = fallback_agent.execute(DAEMON)
    assert body["status"] == "ok"
    assert processes_of(fallback_agent.uids) == []
    bash = fallback_agent.execute("setsid sleep 60 &\necho started", runtime="bash")
    assert bash["stdout"] == "started\n"
    assert processes_of(fallback_agent.uids) == []
    assert fallback_agent.execute("import time; time.sleep(30)", timeout_s=0.3)["status"] == "timeout"
    assert fallback_agent.execute(FORK_BOMB, timeout_s=0.5)["status"] == "timeout"
    assert processes_of(fallback_agent.uids) == []
    sid = fallback_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    started = fallback_agent.execute(
        "import subprocess\np = subprocess.Popen(['sleep', '60'])", session_id=sid
    )
    assert started["status"] == "ok"
    assert requests.delete(f"{fallback_agent.url}/v1/sessions/{sid}", timeout=10).status_code == 200
    assert processes_of(fallback_agent.uids) == []
