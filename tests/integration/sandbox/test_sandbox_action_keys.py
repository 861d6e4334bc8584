"""Exactly-once dispatch (``X-Tangram-Action-Key``) against a real agent over real HTTP.

Actions count their own runs by appending a line to a file in a session's workdir, which the test
reads back through the agent's file API: a repeat that ran the action again would add a line. Where
an action must still be running, it waits for a ``go`` file the test uploads (no timing involved).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent, wait_until

KEY = "X-Tangram-Action-Key"
# Appends a line to count.txt, then waits until the test uploads ``go``.
GATED = "echo run >> count.txt; while [ ! -e go ]; do sleep 0.01; done; echo done"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("keys") / "work", "--session-ttl", "600")
    yield running
    stop_agent(running)
    assert processes_of(running.uids) == []


def _session(agent: Agent) -> str:
    resp = agent.post("/v1/sessions", {})
    assert resp.status_code == 201, resp.text
    sid: str = resp.json()["session_id"]
    return sid


def _runs(agent: Agent, sid: str) -> int:
    resp = requests.get(f"{agent.url}/v1/sessions/{sid}/files/count.txt", timeout=10)
    if resp.status_code == 404:
        return 0
    assert resp.status_code == 200, resp.text
    return resp.text.count("run\n")


def _go(agent: Agent, sid: str) -> None:
    assert requests.put(f"{agent.url}/v1/sessions/{sid}/files/go", data=b"", timeout=10).status_code == 201


def _keyed(agent: Agent, key: str, body: dict[str, object], path: str = "/v1/execute") -> requests.Response:
    return requests.post(agent.url + path, json=body, headers={KEY: key}, timeout=120)


def _running(agent: Agent) -> dict[str, dict[str, object]]:
    listing = requests.get(agent.url + "/v1/actions", timeout=10).json()
    return {e["key"]: e for e in listing["running"]}


def test_a_repeat_of_a_running_key_waits_for_the_same_run(agent: Agent) -> None:
    sid = _session(agent)
    body = {"runtime": "bash", "code": GATED, "session_id": sid}
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(_keyed, agent, "k-running", body)
        wait_until(lambda: _runs(agent, sid) == 1, what="the first run to start")
        second = pool.submit(_keyed, agent, "k-running", body)
        wait_until(lambda: _running(agent)["k-running"]["repeats"] == 1, what="the repeat to be waiting")
        entry = _running(agent)["k-running"]
        assert entry["session_id"] == sid and entry["cores"] is None
        # While it runs: 202, and a short wait says the same.
        polled = requests.get(agent.url + "/v1/actions/k-running?wait=0.01", timeout=10)
        assert polled.status_code == 202 and polled.json() == {"state": "running"}
        _go(agent, sid)
        a, b = first.result(), second.result()
    assert a.status_code == b.status_code == 200
    assert a.json()["status"] == "ok" and a.json()["stdout"] == "done\n"
    assert a.content == b.content
    assert "X-Tangram-Replayed" not in a.headers and b.headers["X-Tangram-Replayed"] == "1"
    assert _runs(agent, sid) == 1


def test_a_caller_gone_mid_run_leaves_the_action_running_and_its_answer_stored(agent: Agent) -> None:
    """A dispatcher whose connection is cut reads the answer back by key: the agent must neither
    stop the action when its caller goes away nor lose what it answers."""
    sid = _session(agent)
    body = json.dumps({"runtime": "bash", "code": GATED, "session_id": sid}).encode()
    host, port = agent.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"POST /v1/execute HTTP/1.1\r\nHost: {host}\r\n{KEY}: k-gone\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        wait_until(lambda: _runs(agent, sid) == 1, what="the action to start")
    # The caller is gone (its socket closed) while the action waits for ``go``.
    wait_until(lambda: "k-gone" in _running(agent), what="the action to be listed as running")
    _go(agent, sid)
    fetched = requests.get(agent.url + "/v1/actions/k-gone?wait=60", timeout=90)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["status"] == "ok" and fetched.json()["stdout"] == "done\n"
    assert _runs(agent, sid) == 1


def test_a_finished_key_replays_its_stored_response_without_running(agent: Agent) -> None:
    sid = _session(agent)
    _go(agent, sid)
    body = {"runtime": "bash", "code": GATED + "; echo $RANDOM$RANDOM", "session_id": sid}
    first = _keyed(agent, "k-done", body)
    assert first.status_code == 200 and first.json()["status"] == "ok"
    again = _keyed(agent, "k-done", body)
    assert again.content == first.content and again.headers["X-Tangram-Replayed"] == "1"
    assert again.headers["Content-Type"] == first.headers["Content-Type"]
    fetched = requests.get(agent.url + "/v1/actions/k-done", timeout=10)
    assert fetched.status_code == 200 and fetched.content == first.content
    assert fetched.headers["X-Tangram-Replayed"] == "1"
    assert _runs(agent, sid) == 1
    listing = requests.get(agent.url + "/v1/actions", timeout=10).json()
    assert "k-done" in {e["key"] for e in listing["finished"]}
    assert "k-done" not in _running(agent)
    # The key is the caller's: the same body without it runs again.
    assert agent.post("/v1/execute", body).json()["status"] == "ok"
    assert _runs(agent, sid) == 2


def test_a_key_sent_again_with_another_request_is_409_not_the_first_answer(agent: Agent) -> None:
    """A key names one request: another body (or the other endpoint) under it got the first one's
    answer (another program's verdict; a native body where /run_code's shape was expected). Now 409
    naming the header; the same request again still replays."""
    first = _keyed(agent, "k-one", {"code": "print('first')"})
    assert first.status_code == 200 and first.json()["stdout"] == "first\n"
    other = _keyed(agent, "k-one", {"code": "raise SystemExit(5)"})
    assert other.status_code == 409 and other.json()["field"] == KEY, other.text
    run_code = _keyed(agent, "k-one", {"code": "print('first')", "language": "python"}, path="/run_code")
    assert run_code.status_code == 409 and run_code.json()["status"] == "SandboxError", run_code.text
    again = _keyed(agent, "k-one", {"code": "print('first')"})
    assert again.content == first.content and again.headers["X-Tangram-Replayed"] == "1"


def test_requests_that_differ_only_in_a_huge_memory_limit_are_told_apart(agent: Agent) -> None:
    """The key's request is compared by a hash that no caller's values can make collide: memory
    limits 2**61 - 1 apart (equal as Python's unkeyed int hash sees them) are two requests."""
    body = {"code": "print('ran')", "language": "python", "memory_limit_MB": 256}
    first = _keyed(agent, "k-huge", body, path="/run_code")
    assert first.status_code == 200 and first.json()["status"] == "Success", first.text
    other = _keyed(agent, "k-huge", {**body, "memory_limit_MB": 256 + 2**61 - 1}, path="/run_code")
    assert other.status_code == 409 and "X-Tangram-Replayed" not in other.headers, other.text


def test_a_refused_request_leaves_its_key_free_for_the_corrected_one(agent: Agent) -> None:
    """A request refused before anything ran (here a runtime the agent lacks) is not remembered:
    the corrected request under the same key runs (it got the old refusal replayed)."""
    refused = _keyed(agent, "k-fix", {"runtime": "cobol", "code": "DISPLAY 'x'"})
    assert refused.status_code == 400, refused.text
    # Kept until then: a dispatcher whose connection was cut reads the refusal back.
    assert requests.get(agent.url + "/v1/actions/k-fix", timeout=10).status_code == 400
    fixed = _keyed(agent, "k-fix", {"code": "print('fixed')"})
    assert fixed.status_code == 200 and fixed.json()["stdout"] == "fixed\n", fixed.text
    # A lone surrogate in a keyed request's fields is the request's own error, not the agent's.
    odd = _keyed(agent, "k-odd", {"code": "print(1)", "session_id": "\ud800"})
    assert odd.status_code == 400 and "session_id" in odd.text, odd.text


def test_run_code_with_a_key_and_a_core_grant(agent: Agent) -> None:
    body = {"code": "import os; print(sorted(os.sched_getaffinity(0)))", "language": "python"}
    resp = requests.post(
        agent.url + "/run_code", json=body, headers={KEY: "rc/1 ?&%", "X-Tangram-Cores": "0"}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["run_result"]["stdout"] == "[0]\n"
    # Any printable key, percent-encoded in the path.
    fetched = requests.get(agent.url + "/v1/actions/" + quote("rc/1 ?&%", safe=""), timeout=10)
    assert fetched.status_code == 200 and fetched.content == resp.content


def test_cancel_kills_the_whole_tree_and_the_request_answers_cancelled(agent: Agent) -> None:
    code = "sleep 60 & sleep 60 & sleep 60"
    for path, body in (
        ("/v1/execute", {"runtime": "bash", "code": code, "timeout_s": 120}),
        ("/run_code", {"language": "bash", "code": code, "run_timeout": 120}),
    ):
        key = f"k-cancel{path}"
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(_keyed, agent, key, body, path)
            # Three sleeps (bash runs the last one in its own process).
            wait_until(lambda: len(processes_of(agent.uids)) >= 3, what="the action's processes")
            resp = requests.delete(agent.url + "/v1/actions/" + quote(key, safe=""), timeout=30)
            assert resp.status_code == 200 and resp.json() == {"cancelled": True}
            # The answer comes once the action ended: nothing of it is left.
            assert processes_of(agent.uids) == []
            answer = pending.result().json()
        if path == "/v1/execute":
            assert answer["status"] == "cancelled"
            assert "cancelled" in answer["message"]
        else:
            assert answer["status"] == "Failed"
            assert answer["run_result"]["status"] == "Error"
            assert "cancelled" in answer["message"]
        # Finished now: a second cancel is a conflict; the stored answer is the cancelled one.
        again = requests.delete(agent.url + "/v1/actions/" + quote(key, safe=""), timeout=30)
        assert again.status_code == 409 and "already finished" in again.json()["error"]
        assert _keyed(agent, key, body, path).json() == answer


def test_cancel_of_an_unknown_key_is_404(agent: Agent) -> None:
    for method in (requests.delete, requests.get):
        resp = method(agent.url + "/v1/actions/never-sent", timeout=10)
        assert resp.status_code == 404 and "never-sent" in resp.json()["error"]


def test_bad_header_values_are_refused_naming_the_header(agent: Agent) -> None:
    body = {"code": "print(1)", "language": "python"}
    for headers, named in (
        ({KEY: "k" * 257}, KEY),
        ({KEY: ""}, KEY),
        ({KEY: "caf\u00e9".encode().decode("latin-1")}, KEY),
        ({"X-Tangram-Cores": "0,x"}, "X-Tangram-Cores"),
        ({"X-Tangram-Cores": ""}, "X-Tangram-Cores"),
        ({"X-Tangram-Cores": "0,0"}, "X-Tangram-Cores"),
        ({"X-Tangram-Cores": "-1"}, "X-Tangram-Cores"),
        ({"X-Tangram-Cores": "4096"}, "X-Tangram-Cores"),
    ):
        resp = requests.post(agent.url + "/run_code", json=body, headers=headers, timeout=30)
        assert resp.status_code == 400, (headers, resp.text)
        assert resp.json()["field"] == named, resp.json()
        assert resp.json()["status"] == "SandboxError"
    resp = requests.post(agent.url + "/v1/execute", json={"code": "1"}, headers={KEY: "k" * 257}, timeout=30)
    assert resp.status_code == 400 and resp.json()["field"] == KEY
    resp = requests.get(agent.url + "/v1/actions/x?wait=soon", timeout=10)
    assert resp.status_code == 400 and resp.json()["field"] == "wait"


def test_cancel_of_an_action_still_waiting_for_a_slot(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--max-concurrent", "1")
    try:
        sid = _session(agent)
        with ThreadPoolExecutor(max_workers=2) as pool:
            holder = pool.submit(
                agent.post, "/v1/execute", {"runtime": "bash", "code": GATED, "session_id": sid}
            )
            wait_until(lambda: _runs(agent, sid) == 1, what="the slot's holder to run")
            queued = pool.submit(_keyed, agent, "k-queued", {"code": "print('ran')"})
            wait_until(lambda: "k-queued" in _running(agent), what="the keyed action to queue")
            resp = requests.delete(agent.url + "/v1/actions/k-queued", timeout=30)
            assert resp.status_code == 200
            answer = queued.result().json()
            assert answer["status"] == "cancelled" and answer["stdout"] == ""
            assert answer["message"] == "cancelled before it started"
            _go(agent, sid)
            assert holder.result().json()["status"] == "ok"
        assert agent.execute("print('still serving')")["stdout"] == "still serving\n"
    finally:
        stop_agent(agent)


def test_finished_keys_expire_after_the_ttl_and_then_run_again(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--action-key-ttl", "0.5")
    try:
        sid = _session(agent)
        _go(agent, sid)
        body = {"runtime": "bash", "code": GATED, "session_id": sid}
        assert _keyed(agent, "k-ttl", body).status_code == 200
        wait_until(
            lambda: requests.get(agent.url + "/v1/actions/k-ttl", timeout=10).status_code == 404,
            what="the key to expire",
        )
        again = _keyed(agent, "k-ttl", body)
        assert again.status_code == 200 and "X-Tangram-Replayed" not in again.headers
        assert _runs(agent, sid) == 2
    finally:
        stop_agent(agent)


def test_the_store_is_bounded_by_count_and_by_bytes(tmp_path: Path) -> None:
    agent = start_agent(tmp_path / "work", "--action-keys-max", "2", "--action-keys-max-mb", "0.005")
    try:

        def finished() -> list[str]:
            listing = requests.get(agent.url + "/v1/actions", timeout=10).json()
            return [e["key"] for e in listing["finished"]]

        for key in ("c1", "c2", "c3"):
            assert _keyed(agent, key, {"code": "print(1)"}).status_code == 200
        assert finished() == ["c2", "c3"]  # by count: the oldest went first
        assert requests.get(agent.url + "/v1/actions/c1", timeout=10).status_code == 404
        # By bytes (5242): a response of about 5 KB fits beside nothing else.
        big = _keyed(agent, "b1", {"code": "print('x' * 4700)"})
        assert big.status_code == 200 and 4700 < len(big.content) <= 5242
        assert finished() == ["b1"]
        # One larger than the whole budget is answered but not kept.
        huge = _keyed(agent, "b2", {"code": "print('x' * 6000)"})
        assert json.loads(huge.content)["stdout"] == "x" * 6000 + "\n"
        assert finished() == ["b1"]
    finally:
        stop_agent(agent)
