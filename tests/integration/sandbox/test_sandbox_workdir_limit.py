"""Each workdir is bounded (``--workdir-mb``): an action filling it with files gets ENOSPC, as on a
full disk, instead of filling the host's memory, and the next action, or another session, still
has room of its own. Real agents, real actions, real tmpfs mounts (this machine's kernel)."""

from __future__ import annotations

import base64
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent, wait_until, workdirs

from arl_tangram.sandbox.workfiles import workdir_files

LIMIT_MB = 64
# Writes files of 8 MB (under --fsize-mb) until one fails, up to twice the limit (where the limit
# did not hold, the test fails without filling the machine); says how many MB and which errno.
FILL = f"""
import errno, os
written = 0
try:
    for i in range({2 * LIMIT_MB // 8}):
        with open(f"blob{{i}}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * (1 << 20))
                written += 1
except OSError as exc:
    print("stopped", written, errno.errorcode[exc.errno])
else:
    print("never stopped", written)
"""
# Empty files until one cannot be made (or twice as many as may be).
MANY = f"""
import errno
made = 0
try:
    while made < {2 * workdir_files(LIMIT_MB)}:
        open(f"e{{made}}", "w").close()
        made += 1
except OSError as exc:
    print("stopped", made, errno.errorcode[exc.errno])
else:
    print("never stopped", made)
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("wd") / "work", "--workdir-mb", str(LIMIT_MB))
    yield running
    stop_agent(running)


def _execute(agent: Agent, code: str, **fields: object) -> dict[str, object]:
    return agent.execute(code, timeout_s=60, **fields)


def _mounts_of(pid: int) -> list[str]:
    lines = Path(f"/proc/{pid}/mounts").read_text().splitlines()
    return [line.split()[1] for line in lines if line.startswith("tangram-workdir ")]


def _fork_server(agent: Agent) -> int:
    """The pid of the agent's fork server (its child running ``sandbox.forkserver``)."""
    for task in Path(f"/proc/{agent.proc.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"sandbox.forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("the agent has no fork server")


def _workdir_mounts(agent: Agent) -> list[str]:
    """The workdir mounts the agent's own mount namespace holds now, and the fork server's (a
    slave of it, as each action's is)."""
    return _mounts_of(agent.proc.pid) + _mounts_of(_fork_server(agent))


def _stopped_at(body: dict[str, object]) -> tuple[int, str]:
    word, count, name = str(body["stdout"]).split()
    assert word == "stopped", body
    return int(count), name


def test_filling_the_workdir_fails_with_enospc_at_its_limit_and_says_so(agent: Agent) -> None:
    body = _execute(agent, FILL)
    written, err = _stopped_at(body)
    assert err == "ENOSPC"
    assert LIMIT_MB - 8 <= written <= LIMIT_MB  # every MB up to the limit, none past it
    assert _mounts_of(_fork_server(agent)) == []  # received, and gone, there too
    # The program's verdict is its own (it caught the error and exited 0); the agent says why.
    assert body["status"] == "ok"
    (note,) = body["notes"]
    assert note.startswith(
        f"the workdir is full (its limit: {LIMIT_MB} MB and {workdir_files(LIMIT_MB)} files"
    )
    # Gone with the action, from the agent's namespace and from the disk.
    wait_until(lambda: _workdir_mounts(agent) == [] and workdirs(agent) == [], what="the workdir to go")


def test_files_are_bounded_too_not_only_bytes(agent: Agent) -> None:
    made, err = _stopped_at(_execute(agent, MANY))
    assert err == "ENOSPC"
    # Every inode of the tmpfs but its root directory's (and the main file's, when it is there).
    assert workdir_files(LIMIT_MB) - 2 <= made < workdir_files(LIMIT_MB)


def test_a_full_workdir_takes_no_room_from_another_action_or_session(agent: Agent) -> None:
    """A session fills its workdir and keeps it full; a fresh action and another session still
    write nearly all of their own limit (one workdir's bound is not a shared pool)."""
    full = agent.post("/v1/sessions", {}).json()["session_id"]
    other = agent.post("/v1/sessions", {}).json()["session_id"]
    files = f"{agent.url}/v1/sessions/{full}/files"
    try:
        assert requests.put(f"{files}/keep.txt", data=b"the session's own", timeout=30).status_code == 201
        assert _stopped_at(_execute(agent, FILL, session_id=full))[1] == "ENOSPC"
        write = "open('x', 'wb').write(b'y' * (48 << 20)); print('wrote')"
        fresh = _execute(agent, write)
        assert fresh["status"] == "ok" and fresh["stdout"] == "wrote\n" and fresh["notes"] == []
        assert _execute(agent, write, session_id=other)["stdout"] == "wrote\n"
        # The session's files are all there for its next call, and an upload past the limit is
        # refused by name, the session kept.
        listing = _execute(agent, "import os; print(len(os.listdir('.')))", session_id=full)
        assert int(str(listing["stdout"])) >= (LIMIT_MB - 8) // 8
        put = requests.put(f"{files}/more.bin", data=b"z" * (1 << 20), timeout=30)
        assert put.status_code == 400 and put.json()["field"] == "path"
        assert "cannot write 'more.bin': No space left on device" in put.json()["error"]
        assert requests.get(f"{files}/more.bin", timeout=30).status_code == 404  # nothing of it left
        # A file the session has, replaced by more than there is room for: refused, and kept.
        assert requests.put(f"{files}/keep.txt", data=b"w" * (1 << 20), timeout=30).status_code == 400
        assert requests.get(f"{files}/keep.txt", timeout=30).content == b"the session's own"
        assert agent.post("/v1/execute", {"code": "print(1)", "session_id": full}).status_code == 200
    finally:
        for sid in (full, other):
            requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)
    wait_until(lambda: _workdir_mounts(agent) == [], what="the sessions' workdirs to go")


def test_an_action_cannot_unmount_or_grow_its_workdir(agent: Agent) -> None:
    code = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for call in (lambda: libc.umount2(os.getcwd().encode(), 2),\n"
        "             lambda: libc.mount(b'x', os.getcwd().encode(), b'tmpfs', 32, b'size=8g')):\n"
        "    print(call(), errno.errorcode[ctypes.get_errno()])\n"
        "print(os.statvfs('.').f_blocks * os.statvfs('.').f_frsize >> 20)\n"
    )
    out = str(_execute(agent, code)["stdout"]).splitlines()
    assert out[:2] == ["-1 EPERM", "-1 EPERM"]
    assert out[2] == str(LIMIT_MB)


def test_files_given_and_fetched_live_in_the_bounded_workdir(agent: Agent) -> None:
    body = _execute(
        agent,
        "import os; s = os.statvfs('.'); print(open('in.txt').read(), s.f_blocks * s.f_frsize >> 20)\n"
        "open('out.txt', 'w').write('back')",
        files={"in.txt": "aGVsbG8="},
        fetch_files=["out.txt"],
    )
    assert body["stdout"] == f"hello {LIMIT_MB}\n" and body["files"] == {"out.txt": "YmFjaw=="}


def test_without_a_limit_workdirs_are_plain_directories_and_health_says_so(tmp_path: Path) -> None:
    unbounded = start_agent(tmp_path / "work", "--workdir-mb", "0")
    try:
        iso = requests.get(unbounded.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["workdir_mb"] == 0
        out = unbounded.execute("import os; print(os.statvfs('.').f_blocks == os.statvfs('..').f_blocks)")
        assert out["stdout"] == "True\n"  # the root's own filesystem
        # There a file of the action's own could be renamed within the root's filesystem, and the
        # root's permissions refuse it (with a limit, the rename cannot cross filesystems at all).
        swap = (
            "import os\nopen('mine', 'w').write('root::0:0::/:/bin/sh\\n')\n"
            "try:\n    os.replace('mine', '../.passwd')\n"
            "except OSError as exc:\n    print(type(exc).__name__)\n"
        )
        assert unbounded.execute(swap)["stdout"] == "PermissionError\n"
        assert _workdir_mounts(unbounded) == []
    finally:
        stop_agent(unbounded)
    # The default: bounded, and /v1/health says by how much.
    bounded = start_agent(tmp_path / "work2")
    try:
        iso = requests.get(bounded.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["workdir_mb"] == 1024
    finally:
        stop_agent(bounded)


def test_request_files_past_the_limit_are_refused_by_name_and_leave_nothing(tmp_path: Path) -> None:
    small = start_agent(tmp_path / "work", "--workdir-mb", "4")
    try:
        blob = base64.b64encode(b"q" * (6 << 20)).decode()
        resp = small.post("/v1/execute", {"code": "print(1)", "files": {"ok.txt": "eA==", "big.bin": blob}})
        assert resp.status_code == 400 and resp.json()["field"] == "files['big.bin']"
        assert "No space left on device" in resp.json()["error"]
        wait_until(lambda: _workdir_mounts(small) == [] and workdirs(small) == [], what="the workdir to go")
        assert small.execute("print('next')")["stdout"] == "next\n"
    finally:
        stop_agent(small)


def test_no_action_learns_a_sessions_id_from_its_mount_table(agent: Agent) -> None:
    """Every workdir is a mount every action's namespace lists; a session's id, all it takes to use
    the session through the agent's API, is not in its name."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        _execute(agent, "open('x', 'w').write('held')", session_id=sid)
        table = str(_execute(agent, "print(open('/proc/self/mountinfo').read())")["stdout"])
        assert "tangram-workdir" in table and sid not in table
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)


def test_a_descriptor_kept_of_an_ended_actions_workdir_gains_no_room(agent: Agent) -> None:
    """An action opens its workdir to all (its own to do) and a session's interpreter keeps a
    descriptor of it past the action's end; once detached, the workdir takes nothing more through
    it."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    opened = (
        "import os, time\nos.chmod('.', 0o777)\nopen('ready', 'w').close()\n"
        "deadline = time.monotonic() + 30\n"
        "while not os.path.exists('go') and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
    )
    # The root may not be listed (0711): the workdirs' names are tried ("a<n>", a counter).
    grab = (
        "import os, time\nheld = None\nroot = os.path.dirname(os.getcwd())\n"
        "deadline = time.monotonic() + 30\n"
        "while held is None and time.monotonic() < deadline:\n"
        "    for n in range(1, 1000):\n"
        "        try:\n"
        "            fd = os.open(f'{root}/a{n}', os.O_RDONLY | os.O_DIRECTORY)\n"
        "        except OSError:\n"
        "            continue\n"
        "        if os.path.exists(f'/proc/self/fd/{fd}/ready'):\n"
        "            held = fd\n"
        "            break\n"
        "        os.close(fd)\n"
        "os.close(os.open('go', os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=held))\nprint('held')\n"
    )
    fill = (
        "import errno\nprint('free', os.fstatvfs(held).f_bavail)\nwritten = 0\ntry:\n"
        "    with open(os.open('more', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=held), 'wb') as f:\n"
        f"        for _ in range({2 * LIMIT_MB}):\n"
        "            f.write(b'x' * (1 << 20)); f.flush(); written += 1\n"
        "except OSError as exc:\n    print('stopped', written, errno.errorcode[exc.errno])\n"
    )
    try:
        with ThreadPoolExecutor(1) as pool:
            victim = pool.submit(_execute, agent, opened)
            assert _execute(agent, grab, session_id=sid)["stdout"] == "held\n"
            assert victim.result()["status"] == "ok"
        # Only the session's own is left mounted ("s<n>"; an action's is "a<n>").
        wait_until(
            lambda: [os.path.basename(m)[0] for m in _mounts_of(agent.proc.pid)] == ["s"],
            what="the action's workdir to be detached",
        )
        # Its size was cut to what it held (ENOSPC); where writes are confined to one's own trees
        # (Landlock), a detached workdir is beneath none of them, and the write is refused first.
        confined = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["landlock"]
        filled = _execute(agent, fill, session_id=sid)
        free, _, rest = str(filled["stdout"]).partition("\n")
        assert free == "free 0", filled  # its size cut to what it holds
        assert _stopped_at({"stdout": rest}) == (0, "EACCES" if confined else "ENOSPC")
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)


def test_closing_a_session_whose_fork_server_is_lost_still_frees_its_workdir(tmp_path: Path) -> None:
    """The interpreter's stop fails with the fork server: the workdir goes all the same."""
    own = start_agent(tmp_path / "work", "--workdir-mb", str(LIMIT_MB))
    try:
        sid = own.post("/v1/sessions", {"persistent": True}).json()["session_id"]
        own.execute("open('x', 'wb').write(b'y' * (8 << 20))", session_id=sid)
        assert len(_mounts_of(own.proc.pid)) == 1
        server = _fork_server(own)
        os.kill(server, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            closing = pool.submit(requests.delete, f"{own.url}/v1/sessions/{sid}", timeout=60)
            # Gone from the agent's table once its close waits on the interpreter's stop.
            wait_until(
                lambda: requests.get(f"{own.url}/v1/sessions/{sid}", timeout=10).status_code == 400,
                what="the close to wait on the fork server",
            )
            os.kill(server, signal.SIGKILL)
            assert closing.result().status_code in (200, 503)
        wait_until(lambda: _mounts_of(own.proc.pid) == [], what="the session's workdir to go")
        assert own.execute("print('next')")["stdout"] == "next\n"  # on a new fork server
    finally:
        stop_agent(own)
