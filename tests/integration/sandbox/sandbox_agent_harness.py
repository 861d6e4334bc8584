"""A real sandbox agent process on loopback for the integration tests, and leak probes.

Each agent gets its own uid range (derived from the test process id) so that the leak checks count
only this agent's action processes, even when other agents run on the machine at the same time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

# Whether the C fork loop's module was built at install (it needs a C compiler).
C_BUILT = importlib.util.find_spec("arl_tangram.sandbox._zygote") is not None

MAX_CONCURRENT = 32
MAX_SESSIONS = 32
SECRET = "agent-secret-7f3a"


@dataclass
class Agent:
    """A running agent: its URL, process, workdir root and uid range."""

    url: str
    proc: subprocess.Popen[str]
    root: Path
    uid_base: int
    port: int

    @property
    def uids(self) -> range:
        return range(self.uid_base, self.uid_base + MAX_CONCURRENT + MAX_SESSIONS)

    def post(self, path: str, body: object, timeout: float = 60) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def execute(self, code: str, **fields: object) -> dict[str, object]:
        resp = self.post("/v1/execute", {"code": code, **fields})
        assert resp.status_code == 200, resp.text
        body: dict[str, object] = resp.json()
        return body

    def healthy(self) -> bool:
        return requests.get(self.url + "/v1/health", timeout=10).status_code == 200


def workdirs(agent: Agent) -> list[str]:
    """What the agent's workdir root holds besides what it puts there at start (the passwd and
    group files, ``isolation.IDENTITY_FILES``, the link to Node's packages and Go's module): the
    workdirs of actions and sessions."""
    from arl_tangram.sandbox.gopackages import MODULE_FILES
    from arl_tangram.sandbox.nodepackages import NODE_MODULES
    from arl_tangram.sandbox.zygote_wire import IDENTITY_FILES

    fixed = {name for name, _ in IDENTITY_FILES} | {NODE_MODULES, *MODULE_FILES}
    return sorted(set(os.listdir(agent.root)) - fixed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_agent(
    root: Path, *extra: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Agent:
    """Start ``tangram sandbox-agent`` (under ``prefix``, e.g. capsh) and wait for its ready line."""
    port = _free_port()
    uid_base = 100000 + (os.getpid() % 400) * 200
    proc = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "arl_tangram",
            "sandbox-agent",
            "--listen",
            f"127.0.0.1:{port}",
            "--workdir-root",
            str(root),
            "--uid-base",
            str(uid_base),
            "--max-concurrent",
            str(MAX_CONCURRENT),
            "--max-sessions",
            str(MAX_SESSIONS),
            "--log-level",
            "WARNING",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A secret in the agent's environment, which no action may ever see.
        env={**os.environ, "TANGRAM_AGENT_TOKEN_PROBE": SECRET, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready on" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"agent did not start: {line!r} {err}")
    return Agent(f"http://127.0.0.1:{port}", proc, root, uid_base, port)


def stop_agent(agent: Agent) -> None:
    """SIGTERM and wait; the agent removes its workdir root on the way out.

    Then no process of the agent's uids may remain. A process killed a moment ago may still be
    on its way out (a zombie waiting for its reaper), so this waits, with a deadline, for none to
    be left; whatever is still there then is killed by uid (a failed test must not leave, say, a
    fork bomb running for the next) and the leak fails the test.
    """
    agent.proc.terminate()
    try:
        agent.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.proc.kill()
        agent.proc.wait()
    try:
        wait_until(lambda: processes_of(agent.uids) == [], deadline_s=10, what="the agent's processes to end")
    except AssertionError:
        left = kill_processes_of(agent.uids)
        raise AssertionError(f"processes of the agent's uids outlived it (killed now): {left}") from None


def kill_processes_of(uids: range, deadline_s: float = 30.0) -> list[str]:
    """SIGKILL every process of ``uids`` until none is left (a fork bomb forks while it is being
    killed); returns what was found, as 'pid cmdline'."""
    seen: dict[int, str] = {}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = processes_of(uids)
        if not pids:
            break
        for pid in pids:
            if pid not in seen:
                seen[pid] = _cmdline(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)  # a poll interval while they die, not synchronisation
    return [f"{pid} {cmd}" for pid, cmd in sorted(seen.items())]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_of(uids: range) -> list[int]:
    """PIDs of live processes whose real uid is in ``uids`` (zombies included: they are leaks too)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) in uids:
                            found.append(int(name))
                        break
        except OSError:
            continue
    return found


def wait_until(predicate: object, deadline_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true or fail after the deadline (no fixed sleeps as synchronisation)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent for the module (real process, real HTTP on loopback)."""
    root = tmp_path_factory.mktemp("sandbox") / "work"
    running = start_agent(root, "--session-ttl", "600")
    yield running
    stop_agent(running)  # fails if a process of its uids outlives it
    assert not root.exists(), "the agent must remove its workdir root on shutdown"


# What a language's compile may take in the tests that build programs (a cold Go or Rust build on
# two busy cores).
COMPILE_TIMEOUT_S = 120


def need(found: dict[str, Any], language: str) -> None:
    """Skip unless the agent runs ``language`` (``found``: ``/v1/health``'s languages), naming the
    missing binary."""
    if language not in found["found"]:
        pytest.skip(f"{language}: {found['missing'].get(language, 'not detected')}")


def run_language(agent: Agent, language: str, code: str, **fields: Any) -> dict[str, Any]:
    """``/run_code`` of ``code`` in ``language``; the answer, which must be a 200."""
    body = {"code": code, "language": language, "compile_timeout": COMPILE_TIMEOUT_S, **fields}
    resp = agent.post("/run_code", body, timeout=COMPILE_TIMEOUT_S + 60)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer
