"""The memory guard: an action's memory limit bounds each of its processes, not their sum, so an
action of many processes, or one writing to memfds, could take the host's memory, and the kernel or
the kubelet would kill the host with every action on it. When less than the reserve is left, the
action holding the most is killed, and the others run on.

Real agents and actions on this machine. The reserve is set just below the memory this machine has
available as the test starts (``MemAvailable``), so that the guard acts once the actions have taken
about ``HEADROOM_MB`` of it, with the hostile ones taking four times that."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent

HEADROOM_MB = 600
CHILDREN, CHILD_MB = 12, 200  # 2,400 MB in all, each child under the 256 MB limit


def _available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    if _available_mb() < 4 * CHILDREN * CHILD_MB // 2:
        pytest.skip("this machine has too little memory available for the test's actions")
    reserve = _available_mb() - HEADROOM_MB
    running = start_agent(tmp_path / "work", "--memory-mb", "256", "--memory-reserve-mb", str(reserve))
    yield running
    stop_agent(running)


MANY_PROCESSES = f"""
import os, time
kids = []
for i in range({CHILDREN}):
    pid = os.fork()
    if pid == 0:
        b = bytearray({CHILD_MB} << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
print("never stopped")
"""

# The same in memfds, each under the 64 MB file size limit.
MEMFDS = f"""
import os
chunk = b"x" * (1 << 20)
fds = []
for i in range({CHILDREN * CHILD_MB // 60}):
    fd = os.memfd_create(f"m{{i}}")
    for _ in range(60):
        os.write(fd, chunk)
    fds.append(fd)
print("never stopped")
"""


@pytest.mark.parametrize("hog", [MANY_PROCESSES, MEMFDS], ids=["many-processes", "memfds"])
def test_the_action_holding_the_hosts_memory_is_killed_and_the_others_run_on(agent: Agent, hog: str) -> None:
    guard = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["memory_guard"]
    assert guard is not None and guard["source"] in ("host", "cgroup1", "cgroup2"), guard
    others: list[dict[str, object]] = []

    def bystander() -> None:
        others.append(agent.execute("import time; time.sleep(4); print('fine')", timeout_s=60))

    thread = threading.Thread(target=bystander)
    thread.start()
    body = agent.execute(hog, timeout_s=60)
    thread.join()
    assert body["status"] == "memory_limit_exceeded" and body["signal"] == 9, body
    assert "never stopped" not in str(body["stdout"])
    message = str(body["message"])
    assert "the host's memory was nearly exhausted" in message and "held the most" in message, message
    (other,) = others
    assert (other["status"], other["stdout"]) == ("ok", "fine\n"), other
    # What it held is back: the next action runs (one holding less than memguard.MIN_VICTIM is
    # never taken for the cause, whatever else on the machine takes its memory meanwhile).
    assert agent.execute("print(1)")["stdout"] == "1\n"


def _v1_memory_cgroup() -> Path | None:
    """A fresh child of this process's v1 memory cgroup (cgroup v2 hosts: None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parent = Path("/sys/fs/cgroup/memory" + path.rstrip("/"))
            child = parent / f"tangram-guard-{os.getpid()}"
            try:
                child.mkdir()
            except OSError:
                return None
            return child
    return None


def test_a_container_with_a_memory_limit_is_guarded_by_its_cgroup(tmp_path: Path) -> None:
    """As in a pod: the agent in a memory cgroup of 3 GB (cgroup v1, as on this machine) watches
    that cgroup, not the machine, and kills the action of many processes before the kernel's OOM
    killer would pick a process of the cgroup itself."""
    cgroup = _v1_memory_cgroup()
    if cgroup is None:
        pytest.skip("no v1 memory cgroup can be made here")
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(3 << 30))
        enter = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
        running = start_agent(
            tmp_path / "work",
            "--memory-mb",
            "256",
            "--memory-reserve-mb",
            "1024",
            prefix=("sh", "-c", enter, "sh"),
        )
        try:
            iso = requests.get(running.url + "/v1/health", timeout=10).json()["isolation"]
            assert iso["memory_guard"] == {"source": "cgroup1", "reserve_mb": 1024, "total_mb": 3072}, iso
            body = running.execute(MANY_PROCESSES, timeout_s=60)
            assert body["status"] == "memory_limit_exceeded" and "held the most" in str(body["message"]), body
            assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"
            assert running.execute("print(1)")["stdout"] == "1\n"
        finally:
            stop_agent(running)
    finally:
        for _ in range(100):  # its last processes leave the cgroup as they are reaped
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_processes_within_the_hosts_memory_are_left_alone(tmp_path: Path) -> None:
    """With the default reserve (a twentieth of the memory), an action of several processes that
    the host has room for runs to its end, as it would outside."""
    running = start_agent(tmp_path / "work", "--memory-mb", "256")
    try:
        guard = requests.get(running.url + "/v1/health", timeout=10).json()["isolation"]["memory_guard"]
        assert guard is not None and guard["reserve_mb"] >= 64
        code = MANY_PROCESSES.replace(f"range({CHILDREN})", "range(3)").replace(
            "time.sleep(30)", "time.sleep(1)"
        )
        body = running.execute(code, timeout_s=60)
        assert (body["status"], body["stdout"]) == ("ok", "never stopped\n"), body
    finally:
        stop_agent(running)


def test_the_guard_can_be_turned_off(tmp_path: Path) -> None:
    running = start_agent(tmp_path / "work", "--memory-reserve-mb", "0")
    try:
        iso = requests.get(running.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["memory_guard"] is None
    finally:
        stop_agent(running)
