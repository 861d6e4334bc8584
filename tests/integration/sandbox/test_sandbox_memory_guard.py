"""The memory guard: an action's memory limit bounds each of its processes, not their sum, so an
action of many processes, or one writing to memfds or to its files, could take the host's memory,
and the kernel or the kubelet would kill the host with every action on it. When less than the
reserve is left, the action holding the most is killed, and the others run on.

Real agents and actions, each agent in a memory cgroup of its own of 3 GB, as in a pod (cgroup v1
on this machine): the guard watches that cgroup, so what the rest of the machine does meanwhile
cannot move the point where it acts (2 GB, with a reserve of 1 GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import C_BUILT, Agent, start_agent, stop_agent

LIMIT_MB, RESERVE_MB = 3072, 1024
HOG_MB = 2400  # each hostile action's, in pieces each under the limits of one process or file
PIECES = 40
PIECE_MB = HOG_MB // PIECES


def _v1_memory_cgroup() -> Path | None:
    """A fresh child of this process's v1 memory cgroup (None where none can be made)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            child = Path("/sys/fs/cgroup/memory" + path.rstrip("/")) / f"tangram-guard-{os.getpid()}"
            try:
                child.mkdir()
            except OSError:
                return None
            return child
    return None


@pytest.fixture
def contained(tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    """An agent in a memory cgroup of LIMIT_MB, guarding RESERVE_MB of it, with workdirs large
    enough for HOG_MB."""
    cgroup = _v1_memory_cgroup()
    if cgroup is None:
        pytest.skip("no v1 memory cgroup can be made here")
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(LIMIT_MB << 20))
        enter = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
        args = (
            "--memory-mb",
            "256",
            "--memory-reserve-mb",
            str(RESERVE_MB),
            "--workdir-mb",
            str(HOG_MB + 256),
        )
        agent = start_agent(tmp_path / "work", *args, prefix=("sh", "-c", enter, "sh"))
        try:
            yield agent, cgroup
        finally:
            stop_agent(agent)
    finally:
        for _ in range(100):  # its last processes leave the cgroup as they are reaped
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)


MANY_PROCESSES = f"""
import os, time
kids = []
for i in range({PIECES}):
    pid = os.fork()
    if pid == 0:
        b = bytearray({PIECE_MB} << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
print("never stopped")
"""
MEMFDS = f"""
import os, time
chunk = b"x" * (1 << 20)
fds = []
for i in range({PIECES}):
    fd = os.memfd_create(f"m{{i}}")
    for _ in range({PIECE_MB}):
        os.write(fd, chunk)
    fds.append(fd)
time.sleep(30)
print("never stopped")
"""
# Mapped with a plain mmap(2) (not Python's, which keeps a descriptor) and closed: in no descriptor,
# and only the one page mapped, untouched, in no resident count.
MAPPED_MEMFDS = f"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
chunk = b"x" * (1 << 20)
for i in range({PIECES}):
    fd = os.memfd_create(f"m{{i}}")
    for _ in range({PIECE_MB}):
        os.write(fd, chunk)
    assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)
    os.close(fd)
time.sleep(30)
print("never stopped")
"""
WORKDIR_FILES = f"""
import time
chunk = b"x" * (1 << 20)
for i in range({PIECES}):
    with open(f"blob{{i}}", "wb") as f:
        for _ in range({PIECE_MB}):
            f.write(chunk)
time.sleep(30)
print("never stopped")
"""
# One process that raises its own memory limits (as a process outside, or under SandboxFusion, may:
# only their soft limits are set) and then writes far past its request's.
LIMIT_RAISED = f"""
import resource, time
for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
    resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
b = bytearray({HOG_MB} << 20)
for j in range(0, len(b), 4096):
    b[j] = 1
time.sleep(30)
print("never stopped")
"""
# Holds 100 MB, more than the guard's floor: killing it would give back something, but not what
# is short.
BYSTANDER = (
    "import time; b = bytearray(100 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(4); print('fine')"
)


@pytest.mark.parametrize(
    "hog",
    [MANY_PROCESSES, MEMFDS, MAPPED_MEMFDS, WORKDIR_FILES, LIMIT_RAISED],
    ids=["many-processes", "memfds", "mapped-memfds", "workdir-files", "limit-raised"],
)
def test_the_action_holding_the_memory_is_killed_and_the_others_run_on(
    contained: tuple[Agent, Path], hog: str
) -> None:
    agent, cgroup = contained
    guard = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["memory_guard"]
    assert guard == {"source": "cgroup1", "reserve_mb": RESERVE_MB, "total_mb": LIMIT_MB}, guard
    others: list[dict[str, object]] = []

    def bystander() -> None:
        others.append(agent.execute(BYSTANDER, timeout_s=60))

    thread = threading.Thread(target=bystander)
    thread.start()
    time.sleep(0.5)  # it holds its 100 MB before the hog starts
    body = agent.execute(hog, timeout_s=60)
    thread.join()
    assert body["status"] == "memory_limit_exceeded" and body["signal"] == 9, body
    assert "never stopped" not in str(body["stdout"])
    message = str(body["message"])
    assert "the host's memory was nearly exhausted" in message and (
        "held the most" in message or "more than its own memory limit" in message
    ), message
    (other,) = others
    assert (other["status"], other["stdout"]) == ("ok", "fine\n"), other
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"
    # What it held is back: the next action runs.
    assert agent.execute("print(1)")["stdout"] == "1\n"


# 2 GB in memfds passed over a socket to itself and closed: in flight, in no process's descriptors
# or mappings, so no action is seen to hold it. Then it ends by itself.
HIDDEN_MB = 2000
HIDDEN = f"""
import os, socket, time
a, b = socket.socketpair()
chunk = b"x" * (1 << 20)
for i in range({PIECES}):
    fd = os.memfd_create(f"m{{i}}")
    for _ in range({HIDDEN_MB // PIECES}):
        os.write(fd, chunk)
    socket.send_fds(a, [b"."], [fd])
    os.close(fd)
time.sleep(3)
print("held it")
"""


def test_memory_no_action_is_seen_to_hold_costs_no_innocent_its_run(contained: tuple[Agent, Path]) -> None:
    """Memory short that the guard cannot place is some action's, not necessarily the largest
    one it sees: the bystander of 100 MB is not killed for the 2 GB another holds out of sight
    (before, it was, and the hog ran on). The kernel's OOM killer stays the last resort; here the
    cgroup's limit is not reached."""
    agent, cgroup = contained
    others: list[dict[str, object]] = []

    def bystander() -> None:
        others.append(agent.execute(BYSTANDER.replace("sleep(4)", "sleep(6)"), timeout_s=60))

    thread = threading.Thread(target=bystander)
    thread.start()
    time.sleep(0.5)
    body = agent.execute(HIDDEN, timeout_s=60)
    thread.join()
    assert (body["status"], body["stdout"]) == ("ok", "held it\n"), body
    (other,) = others
    assert (other["status"], other["stdout"]) == ("ok", "fine\n"), other
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"


def test_memory_no_action_is_seen_to_hold_costs_no_idle_session_its_interpreter(
    contained: tuple[Agent, Path],
) -> None:
    """Nor is an idle session's interpreter stopped for it: memory out of sight is some action's,
    and giving up the session's gives none of it back."""
    agent, cgroup = contained
    made = agent.post("/v1/sessions", {"persistent": True, "memory_mb": 1000})
    assert made.status_code in (200, 201), made.text
    sid = made.json()["session_id"]
    try:
        grow = "kept = bytearray(500 << 20); kept[::4096] = b'x' * len(kept[::4096]); print('kept')"
        assert agent.execute(grow, timeout_s=60, session_id=sid)["stdout"] == "kept\n"
        hidden = HIDDEN.replace(f"range({PIECES})", "range(32)")  # 1,600 MB
        body = agent.execute(hidden, timeout_s=60)
        assert (body["status"], body["stdout"]) == ("ok", "held it\n"), body
        again = agent.execute("print(len(kept) >> 20)", session_id=sid)
        assert again["interpreter_restarted"] is False and again["stdout"] == "500\n", again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"


def test_what_an_idle_session_holds_does_not_shield_the_action_that_holds_the_most(
    contained: tuple[Agent, Path],
) -> None:
    """Memory the guard sees, though on no running action (a session's interpreter between calls,
    which grew while other actions ran), is not taken for memory it cannot place: the hog of 1 GB
    is killed though the idle session holds more."""
    agent, cgroup = contained
    made = agent.post("/v1/sessions", {"persistent": True, "memory_mb": 1600})
    assert made.status_code in (200, 201), made.text
    sid = made.json()["session_id"]
    others: list[dict[str, object]] = []

    def bystander() -> None:
        others.append(agent.execute(BYSTANDER.replace("sleep(4)", "sleep(12)"), timeout_s=60))

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        time.sleep(0.5)  # from here on an action runs: the guard's picture of the idle agent is older
        grow = "kept = bytearray(1200 << 20); kept[::4096] = b'x' * len(kept[::4096]); print('kept')"
        grown = agent.execute(grow, timeout_s=60, session_id=sid)
        assert (grown["status"], grown["stdout"]) == ("ok", "kept\n"), grown
        hog = MANY_PROCESSES.replace(f"range({PIECES})", "range(17)")  # 1,020 MB
        body = agent.execute(hog, timeout_s=60)
        assert body["status"] == "memory_limit_exceeded" and body["signal"] == 9, body
        assert "more than its own memory limit" in str(body["message"]), body
    finally:
        thread.join()
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)
    (other,) = others
    assert (other["status"], other["stdout"]) == ("ok", "fine\n"), other
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"


def test_idle_sessions_give_their_memory_up_before_an_action_within_its_limit_is_killed(
    contained: tuple[Agent, Path],
) -> None:
    """A host filled by sessions' idle interpreters killed each action that came, well within its
    own limit, as the one holding the most. An idle interpreter's variables are a cache: the least
    recently used goes, and its session's next call is told so."""
    agent, cgroup = contained
    sids = []
    try:
        for _ in range(2):
            made = agent.post("/v1/sessions", {"persistent": True, "memory_mb": 1000})
            assert made.status_code in (200, 201), made.text
            sids.append(made.json()["session_id"])
            grow = "kept = bytearray(650 << 20); kept[::4096] = b'x' * len(kept[::4096]); print('kept')"
            grown = agent.execute(grow, timeout_s=60, session_id=sids[-1])
            assert (grown["status"], grown["stdout"]) == ("ok", "kept\n"), grown
        fill = "b = bytearray(800 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(3)\n"
        fill += "print('ran')"
        ran = agent.execute(fill, timeout_s=60, memory_mb=1000)
        assert (ran["status"], ran["stdout"]) == ("ok", "ran\n"), ran
        first, second = (agent.execute("print('kept' in globals())", session_id=sid) for sid in sids)
        assert first["interpreter_restarted"] is True and first["stdout"] == "False\n", first
        assert "memory ran short" in str(first["message"]), first
        assert second["interpreter_restarted"] is False and second["stdout"] == "True\n", second
    finally:
        for sid in sids:
            requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"


def test_an_action_over_its_own_limit_goes_before_a_larger_one_within_its_limit(
    contained: tuple[Agent, Path],
) -> None:
    """The largest holder went, though it held only what its own limit allows, while the action
    whose processes together held four times its limit ran on."""
    agent, cgroup = contained
    within: list[dict[str, object]] = []
    big = "b = bytearray(1100 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(6)\n"
    big += "print('within')"

    def innocent() -> None:
        within.append(agent.execute(big, timeout_s=60, memory_mb=1400))

    thread = threading.Thread(target=innocent)
    thread.start()
    try:
        time.sleep(1.5)  # it holds its memory by now
        hog = MANY_PROCESSES.replace(f"range({PIECES})", "range(17)")  # 1,020 MB under 256 MB
        body = agent.execute(hog, timeout_s=60)
        assert body["status"] == "memory_limit_exceeded"
        assert "more than its own memory limit" in str(body["message"]), body
    finally:
        thread.join()
    (other,) = within
    assert (other["status"], other["stdout"]) == ("ok", "within\n"), other
    assert int((cgroup / "memory.failcnt").read_text()) == 0, "the cgroup's limit was reached"


# A sibling container's memory, as the agent sees it in a pod: in no process it can see (another
# container's processes are in another PID namespace), so here in a file of a tmpfs of its own.
SIBLING = """
import sys
with open(sys.argv[1], "wb") as f:
    for _ in range(2200):
        f.write(b"x" * (1 << 20))
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_sibling_containers_memory_is_not_taken_for_the_actions(tmp_path: Path) -> None:
    """As in a pod of two containers: the agent's cgroup has no limit, its parent (the pod's) has
    4 GB, and a sibling takes 2.2 GB while actions run. What is short is then the pod's, but what
    the guard cannot place is counted in the agent's own cgroup: the sibling's memory does not
    shield a 900 MB hog (counted in the pod's, it did)."""
    pod = _v1_memory_cgroup()
    if pod is None:
        pytest.skip("no v1 memory cgroup can be made here")
    mine, sibling = pod / "agent", pod / "sibling"
    for d in (mine, sibling):
        d.mkdir()
    neighbour = None
    kept = Path(f"/dev/shm/tangram-sibling-{os.getpid()}")
    try:
        (pod / "memory.limit_in_bytes").write_text(str(4096 << 20))
        enter = f'echo $$ > {mine}/cgroup.procs && exec "$@"'
        args = ("--memory-mb", "256", "--memory-reserve-mb", str(RESERVE_MB))
        agent = start_agent(tmp_path / "work", *args, prefix=("sh", "-c", enter, "sh"))
        try:
            guard = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["memory_guard"]
            assert guard == {"source": "cgroup1", "reserve_mb": RESERVE_MB, "total_mb": 4096}, guard
            others: list[dict[str, object]] = []

            def bystander() -> None:
                others.append(agent.execute(BYSTANDER.replace("sleep(4)", "sleep(10)"), timeout_s=60))

            thread = threading.Thread(target=bystander)
            thread.start()
            time.sleep(0.5)  # from here on an action runs
            side = f'echo $$ > {sibling}/cgroup.procs && exec "$@"'
            neighbour = subprocess.Popen(
                ["sh", "-c", side, "sh", sys.executable, "-c", SIBLING, str(kept)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert neighbour.stdout is not None and neighbour.stdout.readline() == "ready\n"
            body = agent.execute(MANY_PROCESSES.replace(f"range({PIECES})", "range(15)"), timeout_s=60)
            thread.join()
            assert body["status"] == "memory_limit_exceeded" and body["signal"] == 9, body
            (other,) = others
            assert (other["status"], other["stdout"]) == ("ok", "fine\n"), other
            assert int((pod / "memory.failcnt").read_text()) == 0, "the pod's limit was reached"
        finally:
            stop_agent(agent)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        kept.unlink(missing_ok=True)
        for d in (mine, sibling, pod):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def test_processes_within_the_memory_are_left_alone(tmp_path: Path) -> None:
    """With the default reserve (a twentieth of the memory), an action of several processes that
    the host has room for runs to its end, as it would outside."""
    running = start_agent(tmp_path / "work", "--memory-mb", "256")
    try:
        guard = requests.get(running.url + "/v1/health", timeout=10).json()["isolation"]["memory_guard"]
        assert guard is not None and guard["reserve_mb"] >= 64
        code = MANY_PROCESSES.replace(f"range({PIECES})", "range(3)").replace(
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


# System V shared memory written and detached is in no process's address space, and message queues
# and semaphores are kernel memory: an action's own IPC namespace holds at most its memory limit of
# each (the agent's default, 1024 MB, here).
SYSV = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
def segment(size):
    return "made" if libc.shmget(0, size, 0o1000 | 0o600) >= 0 else errno.errorcode[ctypes.get_errno()]
def queues():
    made = 0
    while libc.msgget(0, 0o1000 | 0o600) >= 0:
        made += 1
    return made, errno.errorcode[ctypes.get_errno()]
bounds = [int(open(f"/proc/sys/kernel/{n}").read()) for n in ("shmall", "msgmni")]
bounds.append(int(open("/proc/sys/kernel/sem").read().split()[1]))
print(bounds, segment((1024 << 20) + 4096), segment(1000 << 20), segment(100 << 20), *queues())
"""


def test_an_actions_system_v_memory_is_bounded_by_its_limit(loop_agent: Agent) -> None:
    """On both zygote loops: the bounds are written in the action's child, after its own IPC
    namespace is made (child.bound_ipc, and _zygote.c's twin)."""
    from arl_tangram.sandbox import child

    body = loop_agent.execute(SYSV, timeout_s=60)
    assert body["exit_code"] == 0, body
    shm_pages, queues, sems = child.ipc_bounds(1024 << 20)
    assert queues < 1000 and sems < 10_000_000  # the kernel's defaults are 32,000 and 1,024,000,000
    # Past the limit: refused as the kernel refuses it (ENOSPC); within it, made; and what is made
    # counts: 100 MB more no longer fits. Queues: as many as the bound, then ENOSPC.
    assert body["stdout"] == f"[{shm_pages}, {queues}, {sems}] ENOSPC made ENOSPC {queues} ENOSPC\n", body


def test_an_action_and_what_it_starts_are_the_oom_killers_first_choice(loop_agent: Agent) -> None:
    """Where memory the guard cannot place runs out, the kernel kills an action's process before
    the agent and its fork server (child.oom_first and its C twin). Without CAP_SYS_RESOURCE (as
    here, and in most pods) a program that execs may write it back down: best effort."""
    code = (
        "import subprocess\n"
        "print(open('/proc/self/oom_score_adj').read().strip())\n"
        "out = subprocess.run(['cat', '/proc/self/oom_score_adj'], capture_output=True, text=True)\n"
        "print(out.stdout.strip())\n"
    )
    body = loop_agent.execute(code, timeout_s=60)
    assert body["stdout"] == "1000\n1000\n", body
    # The agent and every process of its own (fork server, zygote) keep the default.
    agent_pids = [loop_agent.proc.pid]
    for pid in agent_pids:
        with suppress(FileNotFoundError):
            agent_pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert len(agent_pids) >= 3, agent_pids
    for pid in agent_pids:
        assert int(Path(f"/proc/{pid}/oom_score_adj").read_text()) < 1000, pid


def test_a_read_only_proc_sys_leaves_system_v_unbounded_and_the_probe_says_so() -> None:
    """A container runtime may mount /proc/sys read-only: the bounds cannot be written there, and
    the fork server's probe says so (a note in /v1/health) instead of leaving the kernel's defaults
    in silence; an action with a /proc of its own writes them through it."""
    from arl_tangram.sandbox import isolation

    assert isolation.probe_ipc_bounds(False) is None and isolation.probe_ipc_bounds(True) is None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a mount namespace of its own with /proc/sys read-only, as in such a container
        code = 1
        try:
            os.close(r)
            isolation.unshare(isolation.CLONE_NEWNS)
            isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
            isolation.mount("/proc/sys", "/proc/sys", None, isolation.MS_BIND)
            flags = isolation.MS_REMOUNT | isolation.MS_BIND | isolation.MS_RDONLY
            isolation.mount("none", "/proc/sys", None, flags)
            answers = [isolation.probe_ipc_bounds(False), isolation.probe_ipc_bounds(True)]
            os.write(w, json.dumps(answers).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as fh:
        seen = fh.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert json.loads(seen) == ["Read-only file system", None], seen


@pytest.mark.skipif(not C_BUILT, reason="the C fork loop is not built here (no C compiler at install)")
def test_the_c_loop_bounds_system_v_memory_as_the_python_loop_does() -> None:
    from arl_tangram.sandbox import _zygote, child  # type: ignore[attr-defined]

    for size in (0, 1, 4096, 1 << 20, 256 << 20, 1 << 30, 1 << 40):
        assert _zygote.ipc_bounds(size) == child.ipc_bounds(size), size
