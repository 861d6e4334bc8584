"""One action against another on the same agent: what a hostile action holds while it runs must not
change the verdict of an innocent one beside it."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from sandbox_agent_harness import (
    COMPILE_TIMEOUT_S,
    Agent,
    agent,
    need,
    processes_of,
    run_language,
    wait_until,
)

__all__ = ["agent"]  # the module's agent (a fixture of the harness)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace per action needs root")

# Locks every file a Go build reads under a shared flock that lies where an action may open it
# (the go.mod and go.sum at the workdir root, the build cache's own files), then holds them.
HOLD_GO_LOCKS = """
import fcntl, os, sys, time
paths = [os.path.join(os.path.dirname(os.getcwd()), n) for n in ("go.mod", "go.sum")]
cache = {cache!r}
paths += [os.path.join(cache, n) for n in os.listdir(cache) if os.path.isfile(os.path.join(cache, n))]
held = []
for path in paths:
    if os.path.isfile(path):
        f = open(path)
        fcntl.flock(f, fcntl.LOCK_EX)
        held.append(f)
print(len(held), flush=True)
time.sleep(3600)
"""


def _flock_writers(uids: range) -> int:
    """How many exclusive flocks processes of ``uids`` hold (``/proc/locks``)."""
    pids = {str(pid) for pid in processes_of(uids)}
    count = 0
    with open("/proc/locks") as fh:
        for line in fh:
            fields = line.split()
            if "FLOCK" in fields and "WRITE" in fields and fields[fields.index("WRITE") + 1] in pids:
                count += 1
    return count


@pytest.fixture(scope="module")
def found(agent: Agent) -> dict[str, Any]:
    body: dict[str, Any] = requests.get(agent.url + "/v1/health", timeout=10).json()["languages"]
    return body


def test_a_lock_on_shared_go_files_does_not_hold_another_actions_build(
    agent: Agent, found: dict[str, Any]
) -> None:
    """Go reads go.mod, go.sum and its cache's trim.txt under a shared flock, and flock needs only
    read access: an action that held them exclusively held every other action's Go build until its
    compile timeout (a correct program failed). Each action now locks copies of its own."""
    need(found, "go")
    go = found["found"]["go"]["binaries"]["go"]
    cache = subprocess.run([go, "env", "GOCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    key = f"hold-go-locks-{uuid.uuid4()}"
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(
            requests.post,
            agent.url + "/v1/execute",
            json={"code": HOLD_GO_LOCKS.format(cache=cache), "timeout_s": 3 * COMPILE_TIMEOUT_S},
            headers={"X-Tangram-Action-Key": key},
            timeout=4 * COMPILE_TIMEOUT_S,
        )
        try:
            wait_until(lambda: _flock_writers(agent.uids) >= 3, what="the holder's locks")
            # A source no earlier build made (the compile cache would answer without a build).
            nonce = uuid.uuid4().hex
            code = f'package main\nimport "fmt"\nfunc main() {{ fmt.Println("{nonce}") }}\n'
            # Well within its limit alone; held, the build waited for the holder until killed.
            answer = run_language(agent, "go", code, compile_timeout=60)
            assert answer["status"] == "Success", json.dumps(answer)[:2000]
            assert answer["run_result"]["stdout"] == nonce + "\n"
        finally:
            requests.delete(agent.url + "/v1/actions/" + key, timeout=60)
            holder.result()


# Prints the environment the agent gives a Go program (its build's: the caches, the flags).
PRINT_GO_ENV = """package main
import ("fmt"; "os"; "strings")
func main() {
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GO") || strings.HasPrefix(kv, "PATH=") { fmt.Println(kv) }
	}
}
"""

# A session's Python building a Go program itself, with the agent's Go settings.
SESSION_GO_BUILD = """
import subprocess
with open("prog.go", "w") as f:
    f.write('package main\\nimport "fmt"\\nfunc main() {{ fmt.Println("built") }}\\n')
env = {env!r}
done = subprocess.run([{go!r}, "build", "-o", "prog", "prog.go"], env=env, timeout=60)
print(done.returncode, subprocess.run(["./prog"], capture_output=True, text=True).stdout.strip())
"""


def test_a_sessions_go_build_is_not_held_by_another_sessions_lock(
    agent: Agent, found: dict[str, Any]
) -> None:
    """A session's persistent interpreter gets copies of its own too: one whose Python keeps the
    shared files locked between its calls held every other session's Go build (run from its
    Python) for its whole life; now each locks its own."""
    need(found, "go")
    go = found["found"]["go"]["binaries"]["go"]
    cache = subprocess.run([go, "env", "GOCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    printed = run_language(agent, "go", PRINT_GO_ENV)
    assert printed["status"] == "Success", json.dumps(printed)[:2000]
    env = dict(line.split("=", 1) for line in printed["run_result"]["stdout"].splitlines())
    holder, builder = (
        agent.post("/v1/sessions", {"persistent": True}).json()["session_id"] for _ in range(2)
    )
    try:
        # Held in the interpreter's globals: kept (the interpreter stopped) until its next call.
        hold = HOLD_GO_LOCKS.format(cache=cache).replace("time.sleep(3600)", "")
        held = agent.execute(hold, session_id=holder)
        assert held["status"] == "ok" and int(str(held["stdout"])) >= 3, held
        answer = agent.execute(
            SESSION_GO_BUILD.format(env=env, go=go), session_id=builder, timeout_s=COMPILE_TIMEOUT_S
        )
        assert answer["status"] == "ok", json.dumps(answer)[:2000]
        assert answer["stdout"] == "0 built\n"
    finally:
        for session in (holder, builder):
            requests.delete(f"{agent.url}/v1/sessions/{session}", timeout=60)
