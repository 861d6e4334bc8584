"""The agent's queue for cores, against a real agent: an action granted exact cores waits for those
cores only, never behind an earlier action waiting for other ones (the operator books a core's next
action while the one before it still runs there); actions for the same core keep their order."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sandbox_agent_harness import Agent, agent, wait_until

__all__ = ["agent"]

KEY = "X-Tangram-Action-Key"

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to grant two")


def _keyed(agent: Agent, key: str, code: str, cores: list[int]) -> dict[str, object]:
    resp = requests.post(
        agent.url + "/v1/execute", json={"code": code, "cores": cores}, headers={KEY: key}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, object] = resp.json()
    return body


def _known(agent: Agent, key: str) -> bool:
    listed = requests.get(agent.url + "/v1/actions", timeout=10).json()
    return any(a.get("key") == key for a in listed["running"])


def test_an_action_for_a_free_core_passes_one_waiting_for_a_busy_core(agent: Agent) -> None:
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(_keyed, agent, "q-long", "import time; time.sleep(60)", [0])
        wait_until(lambda: _known(agent, "q-long"), 20, "the long action on core 0")
        booked = pool.submit(_keyed, agent, "q-booked", "print('booked')", [0])
        wait_until(lambda: _known(agent, "q-booked"), 20, "the booked action queued for core 0")
        other = agent.execute("print('other')", cores=[1])
        # Core 1 was free: its action ran at once, while core 0 still runs the long one and the
        # booked one still waits for it.
        assert other["stdout"] == "other\n" and other["cores"] == [1]
        assert not long.done() and not booked.done()
        assert requests.delete(agent.url + "/v1/actions/q-long", timeout=30).status_code == 200
        assert long.result(timeout=60)["status"] == "cancelled"
        after = booked.result(timeout=60)
    assert after["stdout"] == "booked\n" and after["cores"] == [0]
