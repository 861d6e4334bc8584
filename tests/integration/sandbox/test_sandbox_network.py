"""A pool that allows the network: actions reach loopback, so the agent takes a bearer token."""

from __future__ import annotations

import pytest
import requests
from sandbox_agent_harness import start_agent, stop_agent


def test_network_allowed_pool_with_a_token(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("net") / "work"
    agent = start_agent(root, "--network-allowed", env={"TANGRAM_AGENT_TOKEN": "t0ken"})
    auth = {"Authorization": "Bearer t0ken"}
    try:
        assert requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["network_allowed"]
        refused = requests.post(agent.url + "/v1/execute", json={"code": "print(1)"}, timeout=10)
        assert refused.status_code == 401
        # A wrong token of another length, and one that is not ASCII, are refused the same way.
        for wrong in ("Bearer t0ke", "Bearer t\u00f6ken"):
            resp = requests.post(
                agent.url + "/v1/execute", json={"code": "1"}, headers={"Authorization": wrong}, timeout=10
            )
            assert resp.status_code == 401, wrong
        probe = (
            "import urllib.request, urllib.error\n"
            f"req = urllib.request.Request('{agent.url}/v1/execute', data=b'{{\"code\": \"1\"}}')\n"
            "try:\n"
            "    urllib.request.urlopen(req, timeout=5)\n"
            "    print('ACCEPTED')\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)\n"
        )
        body = requests.post(agent.url + "/v1/execute", json={"code": probe}, headers=auth, timeout=30).json()
        # The action reached the agent over loopback, and the agent refused it: no token in its env.
        assert body["stdout"] == "401\n", body
    finally:
        stop_agent(agent)
