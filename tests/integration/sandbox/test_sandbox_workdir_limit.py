"""Each workdir is bounded (``--workdir-mb``): an action filling it with files gets ENOSPC, as on a
full disk, instead of filling the host's memory, and the next action, or another session, still
has room of its own. Real agents, real actions, real tmpfs mounts (this machine's kernel)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent, wait_until, workdirs

from arl_tangram.sandbox.workfiles import workdir_files

LIMIT_MB = 64
# Writes files of 8 MB (under --fsize-mb) until one fails; says how many MB and which errno.
FILL = """
import errno, os
written = 0
try:
    for i in range(10_000):
        with open(f"blob{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * (1 << 20))
                written += 1
except OSError as exc:
    print("stopped", written, errno.errorcode[exc.errno])
else:
    print("never stopped", written)
"""
# Empty files until one cannot be made.
MANY = """
import errno
made = 0
try:
    while True:
        open(f"e{made}", "w").close()
        made += 1
except OSError as exc:
    print("stopped", made, errno.errorcode[exc.errno])
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("wd") / "work", "--workdir-mb", str(LIMIT_MB))
    yield running
    stop_agent(running)


def _execute(agent: Agent, code: str, **fields: object) -> dict[str, object]:
    return agent.execute(code, timeout_s=60, **fields)


def _workdir_mounts(agent: Agent) -> list[str]:
    """The workdir mounts the agent's own mount namespace holds now."""
    lines = Path(f"/proc/{agent.proc.pid}/mounts").read_text().splitlines()
    return [line.split()[1] for line in lines if line.startswith("tangram-workdir ")]


def _stopped_at(body: dict[str, object]) -> tuple[int, str]:
    word, count, name = str(body["stdout"]).split()
    assert word == "stopped", body
    return int(count), name


def test_filling_the_workdir_fails_with_enospc_at_its_limit_and_says_so(agent: Agent) -> None:
    body = _execute(agent, FILL)
    written, err = _stopped_at(body)
    assert err == "ENOSPC"
    assert LIMIT_MB - 8 <= written <= LIMIT_MB  # every MB up to the limit, none past it
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
    try:
        assert _stopped_at(_execute(agent, FILL, session_id=full))[1] == "ENOSPC"
        write = "open('x', 'wb').write(b'y' * (48 << 20)); print('wrote')"
        fresh = _execute(agent, write)
        assert fresh["status"] == "ok" and fresh["stdout"] == "wrote\n" and fresh["notes"] == []
        assert _execute(agent, write, session_id=other)["stdout"] == "wrote\n"
        # The session's files are all there for its next call, and an upload past the limit is
        # refused by name, the session kept.
        listing = _execute(agent, "import os; print(len(os.listdir('.')))", session_id=full)
        assert int(str(listing["stdout"])) >= (LIMIT_MB - 8) // 8
        put = requests.put(
            f"{agent.url}/v1/sessions/{full}/files/more.bin", data=b"z" * (1 << 20), timeout=30
        )
        assert put.status_code == 400 and put.json()["field"] == "path"
        assert "cannot write 'more.bin': No space left on device" in put.json()["error"]
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
