"""A program cannot make the zygote wait for a process it never reaps, so its call always answers.

The program is the second process of its PID namespace, a child of the zygote, which reaps it (its
status is read by no process the program can reach) and then kills the namespace's init. Two calls
gave the zygote a process of the namespace to reap that it did not know of:

- ``clone`` with ``CLONE_PARENT``: a sibling of the program, another child of the zygote. The
  kernel's teardown of the namespace (the init's exit) waits for it to be reaped;
- ``ptrace(PTRACE_TRACEME)`` in one of the program's threads: the zygote became that thread's
  tracer, and a traced thread that exits stays a zombie until its tracer reaps it, so the program's
  process never became reapable.

The zygote reaped neither, so the call never answered, past its timeout: the request hung, its slot,
cores and uid held for good (a handful of such requests drained the host, and the agent's SIGTERM
waited on them). The seccomp filter refuses both (``EPERM``), as it refuses the namespace flags.

Real actions in a real agent, on each fork loop.
"""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest
import requests
from sandbox_agent_harness import Agent

# Prints what the call answered (``-1`` and errno, or what it returned) as JSON, waits a moment
# (for a sibling or a thread to end first), then exits 3, which must be the verdict.
PRELUDE = (
    "import ctypes, json, os, signal, threading, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def call(nr, *args):\n"
    "    ctypes.set_errno(0)\n"
    "    got = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
    "    return {'got': got, 'errno': ctypes.get_errno()}\n"
)
EPILOGUE = "time.sleep(0.2)\nos._exit(3)\n"

# A raw clone (no stack: the child runs on a copy of the caller's, as fork does) with CLONE_PARENT.
SIBLING = (
    "CLONE_PARENT = 0x8000\n"
    "seen = call(56, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)\n"
    "if seen['got'] == 0:\n"
    "    os._exit(0)\n"
    "print(json.dumps(seen), flush=True)\n"
)
# PTRACE_TRACEME in a thread that is still alive (sleeping) when the process exits.
TRACED_THREAD = (
    "seen = {}\n"
    "def traced():\n"
    "    seen.update(call(101, 0, 0, 0, 0))\n"
    "    time.sleep(30)\n"
    "threading.Thread(target=traced, daemon=True).start()\n"
    "while not seen:\n"
    "    time.sleep(0.01)\n"
    "print(json.dumps(seen), flush=True)\n"
)
# The same in the program's main thread, which then takes a signal it handles (a traced process
# stops at each signal for its tracer).
TRACED_MAIN = (
    "seen = call(101, 0, 0, 0, 0)\n"
    "signal.signal(signal.SIGUSR1, lambda *_: None)\n"
    "os.kill(os.getpid(), signal.SIGUSR1)\n"
    "print(json.dumps(seen), flush=True)\n"
)


def run_program(agent: Agent, program: str, run_timeout: float) -> dict[str, Any]:
    """``program`` (with the prelude and epilogue) through ``/run_code``; its answer's body. The
    read's own timeout ends a call that never answers."""
    resp = requests.post(
        agent.url + "/run_code",
        json={"code": PRELUDE + program + EPILOGUE, "language": "python", "run_timeout": run_timeout},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


@pytest.mark.parametrize(
    "program", [SIBLING, TRACED_THREAD, TRACED_MAIN], ids=["sibling", "traced-thread", "traced-main"]
)
def test_the_call_is_refused_and_the_program_keeps_its_verdict(loop_agent: Agent, program: str) -> None:
    # Its timeout is 5 s: before the fix the first two did not answer at all (the HTTP read timed
    # out), and the third timed out where it exits 3.
    body = run_program(loop_agent, program, run_timeout=5)
    run = body["run_result"]
    assert (body["status"], run["status"], run["return_code"]) == ("Failed", "Finished", 3), body
    assert json.loads(run["stdout"]) == {"got": -1, "errno": errno.EPERM}, body
    # The host still serves.
    out = loop_agent.execute("print('next')")
    assert (out["status"], out["stdout"]) == ("ok", "next\n"), out


def test_a_program_may_still_trace_its_own_child(loop_agent: Agent) -> None:
    """PTRACE_ATTACH of a process of its own namespace (its child) is the kernel's to judge, as
    outside: the filter refuses only the request that makes the zygote a tracer."""
    code = (
        "import ctypes, os, signal, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "ctypes.set_errno(0)\n"
        "got = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH\n"
        "print(got, ctypes.get_errno())\n"
        "_, status = os.waitpid(pid, os.WUNTRACED | 0x40000000)  # __WALL\n"
        "print(os.WIFSTOPPED(status))\n"
        "os.kill(pid, signal.SIGKILL)\n"
    )
    out = loop_agent.execute(code)
    assert (out["status"], out["stdout"]) == ("ok", "0 0\nTrue\n"), out
