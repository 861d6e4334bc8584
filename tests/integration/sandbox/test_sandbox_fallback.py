"""The clean-up without PID namespaces (``--no-pid-namespace``, as under runtimes that lack them):
leftover processes are killed by process group and then by the action's own uid."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import requests
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent
from test_sandbox_hostile import DAEMON, FORK_BOMB


@pytest.fixture(scope="module")
def fallback_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("fallback") / "work"
    running = start_agent(root, "--no-pid-namespace")
    yield running
    stop_agent(running)
    assert processes_of(running.uids) == []


def test_fallback_is_reported(fallback_agent: Agent) -> None:
    iso = requests.get(fallback_agent.url + "/v1/health", timeout=10).json()["isolation"]
    assert iso["pid_namespace"] is False
    assert iso["per_action_uid"] is True


def test_daemons_timeouts_and_bombs_leave_nothing_without_a_pid_namespace(fallback_agent: Agent) -> None:
    body = fallback_agent.execute(DAEMON)
    assert body["status"] == "ok"
    assert processes_of(fallback_agent.uids) == []
    bash = fallback_agent.execute("setsid sleep 60 &\necho started", runtime="bash")
    assert bash["stdout"] == "started\n"
    assert processes_of(fallback_agent.uids) == []
    assert fallback_agent.execute("import time; time.sleep(30)", timeout_s=0.3)["status"] == "timeout"
    assert fallback_agent.execute(FORK_BOMB, timeout_s=0.5)["status"] == "timeout"
    assert processes_of(fallback_agent.uids) == []
    sid = fallback_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    started = fallback_agent.execute(
        "import subprocess\np = subprocess.Popen(['sleep', '60'])", session_id=sid
    )
    assert started["status"] == "ok"
    assert requests.delete(f"{fallback_agent.url}/v1/sessions/{sid}", timeout=10).status_code == 200
    assert processes_of(fallback_agent.uids) == []


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(name)] = (int(fields[1]), fields[0].decode(), cmd)
    return out


def _live_children_of_forkservers(agent_pid: int) -> list[int]:
    table = _table()
    below = {agent_pid}
    for _ in range(5):
        below |= {pid for pid, (ppid, _, _) in table.items() if ppid in below}
    servers = {pid for pid in below if "arl_tangram.sandbox.forkserver" in table[pid][2]}
    return [pid for pid, (ppid, state, _) in table.items() if ppid in servers and state != "Z"]


def _cmdlines() -> list[str]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    out.append(fh.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return out


@pytest.mark.skipif(shutil.which("capsh") is None or os.geteuid() != 0, reason="needs root and capsh")
def test_root_without_capabilities_degrades_with_warnings(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Root with CAP_SYS_ADMIN/SETUID/SETGID dropped (a common pod setting): no namespaces and no uid
    switch, so actions run as the agent and leftovers are found by their env marker; it says so."""
    root = tmp_path_factory.mktemp("nocaps") / "work"
    capsh = ("capsh", "--drop=cap_sys_admin,cap_setuid,cap_setgid", "--", "-c", 'exec "$0" "$@"')
    weak = start_agent(root, prefix=capsh)
    try:
        iso = requests.get(weak.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["per_action_uid"] is False
        assert iso["pid_namespace"] is False
        assert weak.execute("print(6 * 7)")["stdout"] == "42\n"
        # The fork server's own processes (its zygote): there before any daemon could be.
        own = set(_live_children_of_forkservers(weak.proc.pid))
        daemon = "import os\nif os.fork() == 0:\n    os.setsid()\n"
        daemon += "    os.execv('/bin/sleep', ['sleep', '61.2345'])\n"
        assert weak.execute(daemon + "print('spawned')")["stdout"] == "spawned\n"
        pure = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(61.2345)\n"
        assert weak.execute(pure + "print('spawned')")["stdout"] == "spawned\n"
        # A fork that never exec'd shows no marker; orphaned, it became the fork server's child.
        assert set(_live_children_of_forkservers(weak.proc.pid)) - own == set()
        assert not any("sleep 61.2345" in c for c in _cmdlines())
    finally:
        stop_agent(weak)
    warnings = weak.proc.stderr.read() if weak.proc.stderr else ""
    assert "no uid per action: actions run as ROOT" in warnings
    assert "no PID namespace and not root" in warnings or "env marker" in warnings
