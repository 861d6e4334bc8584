"""Orphans of what a session's calls start cannot use up the session's processes.

A session's persistent interpreter is its PID namespace's first process, so every orphan of what a
call starts (a double fork, a shell's ``cmd &`` whose shell returned) becomes the interpreter's
child, and Python reaps only the children it waits for itself: each such orphan that exited stayed
a zombie for the session's life, holding one of the uid's processes (``--nproc``). Past the limit
every fork of a later call failed (``BlockingIOError``: EAGAIN), where under ``python main.py`` the
host's init reaps them and the same calls pass. The fork server cannot reap them in the
interpreter's place, and the interpreter cannot tell them from exited children of the program's own
that it may still wait for, so an interpreter holding more exited processes than a session keeps
(with the ones it keeps running, ``COMPANY_MAX``) goes at the call's answer, as one keeping too
many processes does: the next call gets a fresh one and is told so.

Real sessions in a real agent, on each fork loop.
"""

from __future__ import annotations

import pytest
import requests
from sandbox_agent_harness import Agent, processes_of, wait_until

from arl_tangram.sandbox.forkserver import COMPANY_MAX

# Leaves ``n`` orphans that have exited (each the grandchild of a fork whose child exits at once)
# and waits until they are zombies, then prints that every fork and a subprocess worked (a child
# whose fork failed exits 1).
ORPHANS = (
    "import os, time\n"
    "def orphans(n):\n"
    "    made = 0\n"
    "    for _ in range(n):\n"
    "        pid = os.fork()\n"
    "        if pid == 0:\n"
    "            try:\n"
    "                if os.fork() == 0:\n"
    "                    time.sleep(0.05)\n"
    "                    os._exit(0)\n"
    "            except OSError:\n"
    "                os._exit(1)\n"
    "            os._exit(0)\n"
    "        made += os.waitpid(pid, 0)[1] == 0\n"
    "    time.sleep(0.3)\n"
    "    return made\n"
    "assert orphans({n}) == {n}\n"
    "import subprocess\n"
    "print(subprocess.run(['echo', 'forks still work'], capture_output=True, text=True).stdout, end='')\n"
)


def _session(agent: Agent) -> str:
    sid: str = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    return sid


def test_calls_that_leave_orphans_never_run_out_of_processes(loop_agent: Agent) -> None:
    # Each call leaves fewer orphans than a session keeps, together far more than --nproc (512):
    # before the fix the ninth call's forks failed (EAGAIN), and every call's after it.
    per_call = COMPANY_MAX - 4
    sid = _session(loop_agent)
    try:
        for i in range(10):
            body = loop_agent.execute(ORPHANS.format(n=per_call), session_id=sid, timeout_s=60)
            assert (body["status"], body["stdout"], body["stderr"]) == ("ok", "forks still work\n", ""), (
                i,
                body,
            )
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(loop_agent.uids) == [], what="the sessions' processes to end")


def test_an_interpreter_holding_too_many_zombies_goes_and_the_next_call_is_told(loop_agent: Agent) -> None:
    sid = _session(loop_agent)
    try:
        kept = loop_agent.execute("x = 'kept'\n" + ORPHANS.format(n=4), session_id=sid)
        assert (kept["status"], kept["message"]) == ("ok", ""), kept
        # A few zombies: the interpreter, its variables with it, stays.
        same = loop_agent.execute("print(x)", session_id=sid)
        assert (same["stdout"], same["interpreter_restarted"]) == ("kept\n", False), same
        over = loop_agent.execute(ORPHANS.format(n=COMPANY_MAX + 1), session_id=sid)
        # The call's own verdict is its program's; its message says the interpreter went.
        assert (over["status"], over["stdout"]) == ("ok", "forks still work\n"), over
        assert "exited processes" in str(over["message"]), over
        fresh = loop_agent.execute("print('x' in globals())", session_id=sid)
        assert (fresh["stdout"], fresh["interpreter_restarted"]) == ("False\n", True), fresh
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)


@pytest.mark.parametrize("n", [COMPANY_MAX])
def test_a_session_may_keep_as_many_exited_children_as_processes(loop_agent: Agent, n: int) -> None:
    """The bound is the one for processes kept: up to it the interpreter stays, and a child of
    the program's own that exited keeps its status for the program's wait in a later call."""
    sid = _session(loop_agent)
    try:
        code = (
            "import os\nkids = []\n"
            f"for i in range({n - 1}):\n"
            "    kid = os.fork()\n"
            "    if kid == 0:\n        os._exit(i % 7)\n"
            "    kids.append(kid)\n"
            "import time\ntime.sleep(0.3)\n"
        )
        body = loop_agent.execute(code, session_id=sid)
        assert (body["status"], body["message"]) == ("ok", ""), body
        waited = loop_agent.execute(
            "print(sorted({os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids}))", session_id=sid
        )
        assert (waited["stdout"], waited["interpreter_restarted"]) == ("[0, 1, 2, 3, 4, 5, 6]\n", False), (
            waited
        )
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)
