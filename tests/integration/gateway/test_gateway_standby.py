"""A standby replica: not ready (so the Service leaves it out), and its action routes answer 503
with the leader's address; it flips to serving when it becomes the leader."""

from __future__ import annotations

import requests
from gateway_harness import POOL, serve_gateway
from sandbox_agent_harness import Agent

from arl_tangram.gateway import Leadership


def test_standby_points_at_the_leader_until_it_leads(hosts: list[Agent]) -> None:
    role = [Leadership(leader=False, leader_address="10.1.2.3:8080")]
    action = {"type": "code", "target": POOL, "payload": {"code": "print('led')"}}
    with serve_gateway(hosts, readiness=lambda: role[0]) as gw:
        ready = requests.get(gw.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json() == {"status": "standby", "leader": "10.1.2.3:8080"}
        assert requests.get(gw.url + "/healthz", timeout=10).status_code == 200
        # /run_code answers 504, what verl retries (sandbox.models.RETRY_LATER_STATUS).
        for path, body, status in (
            ("/v1/actions", action, 503),
            ("/run_code", {"code": "1", "language": "python"}, 504),
        ):
            resp = requests.post(gw.url + path, json=body, timeout=10)
            assert resp.status_code == status and resp.json()["leader"] == "10.1.2.3:8080", resp.text
            assert resp.headers["X-Tangram-Leader"] == "10.1.2.3:8080"
        role[0] = Leadership(leader=True)
        assert requests.get(gw.url + "/readyz", timeout=10).status_code == 200
        assert requests.post(gw.url + "/v1/actions", json=action, timeout=60).json()["stdout"] == "led\n"
