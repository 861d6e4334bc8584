"""A host's agent killed (``kill -9``) under ``tangram up`` while a session and a keyed action use
it: the keyed action runs again on the replacement host under its key and is not run a third time
when sent again; the session is said to be lost, to the action that was waiting for a core as to
every later call, and none of them runs in an empty session on the replacement host."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from up_harness import Up, pool_doc, tangram_up, wait_until

POOL = "default/py"


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool_doc()))  # one host of one core
    with tangram_up(tmp_path / "pool.yaml") as running:
        wait_until(lambda: running.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")
        yield running


def test_a_killed_hosts_session_is_lost_and_its_keyed_action_runs_once_more(up: Up) -> None:
    session = requests.post(up.url + "/v1/sessions", json={"pool": "py"}, timeout=30).json()
    calls = up.url + f"/v1/sessions/{session['id']}/actions"
    code = "open('state.txt', 'w').write('kept')"
    write = {"type": "code", "payload": {"language": "python", "code": code}}
    assert requests.post(calls, json=write, timeout=60).json()["state"] == "Succeeded"
    [host] = up.hosts(POOL)
    answers: dict[str, dict[str, Any]] = {}

    def send(name: str, url: str, body: dict[str, Any]) -> None:
        answers[name] = requests.post(url, json=body, timeout=120).json()

    # The host's one core runs the keyed action; the session's next action waits for it.
    # Long enough that it still runs when the host is killed, on a loaded machine too.
    slow = "import time, random; time.sleep(15); print(random.random())"
    keyed = {"type": "code", "target": "py", "key": "k-1", "payload": {"language": "python", "code": slow}}
    read = {"type": "code", "payload": {"language": "python", "code": "print(open('state.txt').read())"}}
    threads = [threading.Thread(target=send, args=("keyed", up.url + "/v1/actions", keyed))]
    threads[0].start()
    wait_until(lambda: up.pools()[POOL]["status"]["coresBusy"] == 1, 30, "the keyed action to run")
    threads.append(threading.Thread(target=send, args=("waiting", calls, read)))
    threads[1].start()
    wait_until(lambda: up.pools()[POOL]["status"]["queueDepth"] >= 1, 30, "the session's action to wait")
    os.kill(host["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    waiting = answers["waiting"]
    assert waiting["state"] == "Failed" and waiting["reason"] == "SessionLost", waiting
    assert session["id"] in waiting["message"], waiting
    later = requests.post(calls, json=read, timeout=60).json()
    assert later["state"] == "Failed" and later["reason"] == "SessionLost", later
    first = answers["keyed"]
    assert first["state"] == "Succeeded" and first["attempts"] == 2 and first["host"] != host["name"], first
    again = requests.post(up.url + "/v1/actions", json=keyed, timeout=60).json()
    assert again["stdout"] == first["stdout"] and again["attempts"] == 2, again  # its answer, not a third run
