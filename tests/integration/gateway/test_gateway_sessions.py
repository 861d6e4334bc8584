"""Gateway sessions against a real gateway and agent: the pool's TTL, a lost host, and the languages
the native API runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from dispatch_harness import pool_for_tests
from gateway_harness import NS, POOL, Gateway, serve_gateway
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.client import SessionLost
from arl_tangram.client.errors import error_for
from arl_tangram.dispatch.dispatcher import Dispatcher

SHORT = "short"  # a pool whose sessions.ttlSeconds is 20


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[Agent]:
    running = start_agent(tmp_path / "work", "--session-ttl", "600")
    yield running
    stop_agent(running)


@pytest.fixture()
def gateway(agent: Agent) -> Iterator[Gateway]:
    def short_pool(dispatcher: Dispatcher) -> None:
        dispatcher.upsert_pool(dataclasses.replace(pool_for_tests(SHORT, NS), session_ttl_s=20.0))

    with serve_gateway([agent], setup=short_pool) as gw:
        yield gw


def test_a_session_gets_its_pools_ttl_which_bounds_what_it_may_ask(gateway: Gateway) -> None:
    """The gateway gave every session its own 600 s, whatever the pool's sessions.ttlSeconds."""
    opened = requests.post(gateway.url + "/v1/sessions", json={"pool": SHORT}, timeout=30)
    assert opened.status_code == 201, opened.text
    assert opened.json()["ttlSeconds"] == 20
    shorter = requests.post(gateway.url + "/v1/sessions", json={"pool": SHORT, "ttlSeconds": 5}, timeout=30)
    assert shorter.status_code == 201 and shorter.json()["ttlSeconds"] == 5, shorter.text
    longer = requests.post(gateway.url + "/v1/sessions", json={"pool": SHORT, "ttlSeconds": 60}, timeout=30)
    assert longer.status_code == 422 and longer.json()["field"] == "ttlSeconds", longer.text
    assert "sessions.ttlSeconds is 20" in longer.json()["error"]
    # The pool of the default TTL (3600) gives that.
    other = requests.post(gateway.url + "/v1/sessions", json={"pool": POOL}, timeout=30)
    assert other.status_code == 201 and other.json()["ttlSeconds"] == 3600, other.text


def test_reading_a_session_whose_host_was_lost_says_it_is_lost(gateway: Gateway, agent: Agent) -> None:
    """``GET /v1/sessions/{id}`` answered 200 for a session whose host was gone while its actions
    were answered SessionLost: now 410 with reason SessionLost, as the client's SessionLost reads."""
    sid = requests.post(gateway.url + "/v1/sessions", json={"pool": POOL}, timeout=30).json()["id"]
    step = {"type": "code", "payload": {"code": "open('s.txt', 'w').write('kept')"}}
    ran = requests.post(f"{gateway.url}/v1/sessions/{sid}/actions", json=step, timeout=60)
    assert ran.status_code == 200 and ran.json()["state"] == "Succeeded", ran.text
    stop_agent(agent)  # the host dies, and the operator takes it out of the pool
    gateway.call(gateway.service.dispatcher.sync_hosts(f"{NS}/{POOL}", []))
    action = requests.post(f"{gateway.url}/v1/sessions/{sid}/actions", json=step, timeout=60)
    assert action.json()["reason"] == "SessionLost", action.text
    read = requests.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30)
    assert read.status_code == 410, read.text
    assert read.json()["reason"] == "SessionLost" and sid in read.json()["error"]
    assert isinstance(error_for(read.status_code, read.json()), SessionLost)  # as the client reads it
    # Closing it still works: the gateway forgets it.
    assert requests.delete(f"{gateway.url}/v1/sessions/{sid}", timeout=30).status_code == 200
    assert requests.get(f"{gateway.url}/v1/sessions/{sid}", timeout=30).status_code == 404


def test_a_pools_language_beyond_python_and_bash_runs_on_the_native_api(gateway: Gateway) -> None:
    """``cpp`` was refused as "not among the pool's languages ['python', 'bash']" (the gateway's
    list, not the pool's), though the agent's /v1/execute compiles and runs it as /run_code does;
    a language no pool may declare is still refused, naming the ones that may be."""
    program = '#include <cstdio>\nint main(){ std::printf("%d\\n", 6 * 7); }'
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={"type": "code", "target": POOL, "payload": {"language": "cpp", "code": program}},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "Succeeded" and resp.json()["stdout"] == "42\n", resp.text
    resp = requests.post(
        gateway.url + "/v1/actions",
        json={"type": "code", "target": POOL, "payload": {"language": "cobol", "code": "x"}},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["field"] == "payload.language", resp.text
    assert "'cpp'" in resp.json()["error"], resp.text
