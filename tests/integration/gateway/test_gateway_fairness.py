"""Bounded waiting: past the gateway's bound per tenant, or the dispatcher's per pool, a request
is answered 429 with Retry-After, and another tenant's requests are still admitted."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import requests
from gateway_harness import NS, POOL, serve_gateway
from sandbox_agent_harness import Agent, wait_until

from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.gateway import GatewayConfig

SLOW = {"type": "code", "target": POOL, "payload": {"command": "sleep 3"}}
FAST = {"type": "code", "target": POOL, "payload": {"code": "print('in')"}}


def test_a_tenant_past_its_bound_gets_429_and_others_still_run(hosts: list[Agent]) -> None:
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, max_in_flight_per_tenant=2)
    with (
        serve_gateway(hosts, config=config, pools=((NS, POOL), ("team-b", POOL))) as gw,
        ThreadPoolExecutor(4) as ex,
    ):
        held = [ex.submit(requests.post, gw.url + "/v1/actions", json=SLOW, timeout=60) for _ in range(2)]
        wait_until(lambda: gw.admission().tenants.get(NS, 0) == 2, 20, "two actions held for team-a")
        refused = requests.post(gw.url + "/v1/actions", json=FAST, timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1" and "tenant team-a" in refused.json()["error"]
        other = requests.post(gw.url + "/v1/actions", json={**FAST, "namespace": "team-b"}, timeout=60)
        assert other.status_code == 200 and other.json()["stdout"] == "in\n"
        assert all(f.result().status_code == 200 for f in held)
        again = requests.post(gw.url + "/v1/actions", json=FAST, timeout=60)
        assert again.status_code == 200, "the bound frees as actions end"


def test_the_dispatchers_queue_bound_is_429_too(hosts: list[Agent]) -> None:
    def one_waiting(dispatcher: Dispatcher) -> None:
        dispatcher.max_waiting_per_pool = 1

    with serve_gateway(hosts, setup=one_waiting) as gw, ThreadPoolExecutor(8) as ex:
        cores = len(requests.get(hosts[0].url + "/v1/health", timeout=10).json()["cores"]["ids"])
        busy: list[Future[requests.Response]] = [
            ex.submit(requests.post, gw.url + "/v1/actions", json=SLOW, timeout=60) for _ in range(cores + 1)
        ]
        # Every core busy and one action waiting in the dispatcher's queue: the next is refused.
        wait_until(lambda: gw.admission().pools.get(f"{NS}/{POOL}", 0) == cores + 1, 20, "queue full")
        refused = requests.post(gw.url + "/run_code", json={"code": "1", "language": "python"}, timeout=60)
        # 504 on /run_code, not 429: the one status verl's client retries (sandboxfusion.py).
        assert refused.status_code == 504 and refused.headers["Retry-After"] == "1"
        assert refused.json()["status"] == "SandboxError" and "waiting" in refused.json()["error"]
        assert all(f.result().status_code == 200 for f in busy)


def test_a_stream_holds_at_most_its_in_flight_bound(hosts: list[Agent]) -> None:
    """A stream of 40 actions with a bound of 3: never more than 3 reach the queue at once (the rest
    wait unread in the request), and every action still comes back once."""
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, stream_in_flight=3)
    lines = [
        json.dumps({"id": f"s{i}", "type": "code", "target": POOL, "payload": {"code": f"print({i})"}})
        for i in range(40)
    ]
    with serve_gateway(hosts, config=config) as gw:
        resp = requests.post(gw.url + "/v1/actions:stream", data="\n".join(lines).encode(), timeout=120)
        out = [json.loads(line) for line in resp.text.splitlines()]
        assert sorted(o["id"] for o in out) == sorted(f"s{i}" for i in range(40))
        assert 1 <= gw.service.peak <= 3
