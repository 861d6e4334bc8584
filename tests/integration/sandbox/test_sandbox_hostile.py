"""Hostile code and bad input: each gets a clear result, the agent keeps serving, nothing leaks.

Real actions in a real agent (as root here, so with a uid per action, a PID namespace per action, a
network namespace and a private /tmp). After each case no process of the agent's action uids may be
left, which is checked right after the response: the PID namespace is torn down before the agent
reaps the action.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sandbox_agent_harness import Agent, agent, processes_of, rss_kb, wait_until, workdirs

from arl_tangram.sandbox.config import Limits

__all__ = ["agent"]

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
DAEMON = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)\n"
    "print('parent done')\n"
)
FLOOD = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
ESCAPE_WRITES = (
    "import os\n"
    "for path in ['/tmp/tangram-escape', '/etc/tangram-escape', '../tangram-escape',\n"
    "             '/dev/shm/tangram-escape', os.path.expanduser('~root/tangram-escape')]:\n"
    "    try:\n"
    "        open(path, 'w').write('x')\n"
    "        print('WROTE', path)\n"
    "    except OSError as e:\n"
    "        print('refused', type(e).__name__)\n"
)
FD_EXHAUSTION = "fds = []\nwhile True:\n    fds.append(open('/dev/null'))\n"


def _sockets(port: int) -> str:
    return (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1)\n"
        "        print('CONNECTED', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )


def _kill_parent(agent_pid: int) -> str:
    # Signal 0 checks the permission exactly as SIGKILL would, without harming anything if it is
    # (wrongly) granted; the agent itself gets a real SIGKILL.
    return (
        "import os, signal\n"
        "mine = os.getuid()\n"
        "for name in os.listdir('/proc'):\n"
        "    if name.isdigit() and int(name) != os.getpid():\n"
        "        try:\n"
        "            if os.stat('/proc/' + name).st_uid != mine:\n"
        "                os.kill(int(name), 0)\n"
        "                print('COULD KILL', name)\n"
        "        except OSError:\n"
        "            pass\n"
        "try:\n"
        f"    os.kill({agent_pid}, signal.SIGKILL)\n"
        "    print('KILLED the agent')\n"
        "except OSError as e:\n"
        "    print('refused', type(e).__name__)\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)  # all it may signal: its own namespace only\n"
        "except OSError:\n"
        "    pass\n"
        "print('survived')\n"
    )


def _no_leftovers(agent: Agent) -> None:
    assert processes_of(agent.uids) == []
    assert agent.healthy()


def test_fork_bomb_is_contained(agent: Agent) -> None:
    body = agent.execute(FORK_BOMB, timeout_s=1)
    assert body["status"] == "timeout"
    # The shell returns at once; the bomb's processes die with the action's PID namespace.
    bash = agent.execute(":(){ :|:& };:", runtime="bash", timeout_s=1)
    assert bash["status"] in ("ok", "timeout", "failed")
    _no_leftovers(agent)


def test_memory_bomb_reports_memory_limit(agent: Agent) -> None:
    body = agent.execute(MEMORY_BOMB, memory_mb=256, timeout_s=10)
    assert body["status"] == "memory_limit_exceeded"
    assert "MemoryError" in str(body["stderr"])
    _no_leftovers(agent)


def test_infinite_loop_and_sleep_are_killed_at_the_timeout(agent: Agent) -> None:
    assert agent.execute("while True: pass", timeout_s=0.5)["status"] == "timeout"
    body = agent.execute("import time; print('before', flush=True); time.sleep(30)", timeout_s=0.5)
    assert body["status"] == "timeout"
    assert body["stdout"] == "before\n"  # output up to the kill is kept
    bash = agent.execute("sleep 30 & sleep 30", runtime="bash", timeout_s=0.5)
    assert bash["status"] == "timeout"
    _no_leftovers(agent)


def test_daemonised_child_does_not_outlive_the_action(agent: Agent) -> None:
    body = agent.execute(DAEMON, timeout_s=5)
    assert body["status"] == "ok"
    assert body["stdout"] == "parent done\n"
    _no_leftovers(agent)
    bash = agent.execute("nohup sleep 60 >/dev/null 2>&1 &\nsetsid sleep 60 &\necho started", runtime="bash")
    assert bash["stdout"] == "started\n"
    _no_leftovers(agent)


def test_100mb_of_output_is_capped_and_flagged(agent: Agent) -> None:
    body = agent.execute(FLOOD, timeout_s=30)
    assert body["status"] == "ok"
    assert body["stdout_truncated"] is True
    assert len(str(body["stdout"])) == Limits().output_bytes
    assert body["stderr_truncated"] is False


def test_writes_outside_the_workdir_are_refused(agent: Agent) -> None:
    body = agent.execute(ESCAPE_WRITES)
    # /tmp and /dev/shm are the action's own (private tmpfs mounts); nothing else is writable.
    wrote = [line for line in str(body["stdout"]).splitlines() if line.startswith("WROTE")]
    assert wrote == ["WROTE /tmp/tangram-escape", "WROTE /dev/shm/tangram-escape"], body["stdout"]
    assert str(body["stdout"]).count("refused") == 3
    # The host's /tmp and /dev/shm got nothing.
    assert not os.path.exists("/tmp/tangram-escape")
    assert not os.path.exists("/dev/shm/tangram-escape")


def test_sockets_reach_nothing_not_even_the_agent(agent: Agent) -> None:
    body = agent.execute(_sockets(agent.port), timeout_s=10)
    assert "CONNECTED" not in str(body["stdout"]), body["stdout"]
    assert str(body["stdout"]).count("refused") == 3


def test_killing_the_parent_fails_and_the_agent_survives(agent: Agent) -> None:
    body = agent.execute(_kill_parent(agent.proc.pid))
    assert "COULD KILL" not in str(body["stdout"])
    assert "KILLED the agent" not in str(body["stdout"])  # not visible (PID namespace) or not permitted
    assert body["status"] == "ok"
    assert agent.proc.poll() is None
    _no_leftovers(agent)


def test_fd_exhaustion_stays_inside_the_action(agent: Agent) -> None:
    body = agent.execute(FD_EXHAUSTION)
    assert body["status"] == "failed"
    assert "Too many open files" in str(body["stderr"])
    assert agent.execute("print('fine')")["stdout"] == "fine\n"


def test_malformed_and_mistyped_requests(agent: Agent) -> None:
    assert requests.post(agent.url + "/v1/execute", data=b"\xff\xfe{", timeout=10).status_code == 400
    assert agent.post("/v1/execute", {"code": ["print(1)"]}).status_code == 422
    assert agent.post("/v1/execute", {"code": "1", "cores": "all"}).status_code == 422
    assert agent.post("/v1/execute", {"code": "1", "ncores": 0}).status_code == 422
    assert agent.post("/v1/execute", {"code": "1", "session_id": "nope"}).status_code == 400
    assert agent.post("/v1/execute", {"code": "1", "memory_mb": 10**9}).status_code == 400
    assert agent.post("/run_code", {"code": "1", "language": "python", "run_timeout": -1}).status_code == 422
    # Lone surrogates are valid JSON escapes but no text: refused naming the field, before anything
    # tries to encode them.
    lone = "\ud800"
    for path, body in (
        ("/v1/execute", {"code": "1", "stdin": lone}),
        ("/v1/execute", {"code": lone, "runtime": "bash"}),
        ("/v1/execute", {"code": "1", "fetch_files": [lone]}),
        ("/v1/execute", {"code": "1", "files": {lone: ""}}),
        ("/run_code", {"code": lone, "language": "pytest"}),
    ):
        resp = agent.post(path, body)
        assert resp.status_code == 422, (body, resp.status_code, resp.text[:200])
        assert "surrogate" in resp.json()["error"], resp.text
    # Valid JSON syntax that the decoder still refuses: an integer of 5000 digits, nesting 100000 deep.
    for raw in (b'{"code": "1", "ncores": 1' + b"0" * 5000 + b"}", b"[" * 100000 + b"]" * 100000):
        for path in ("/v1/execute", "/run_code"):
            resp = requests.post(agent.url + path, data=raw, timeout=10)
            assert resp.status_code == 400, (path, resp.status_code, resp.text[:200])
            assert resp.json()["error"].startswith("malformed JSON")
    assert agent.healthy()


def _hostile_actions(
    agent: Agent,
) -> list[tuple[str, dict[str, object], Callable[[requests.Response], bool]]]:
    def status(*allowed: str) -> Callable[[requests.Response], bool]:
        return lambda r: r.status_code == 200 and r.json()["status"] in allowed

    def http(code: int) -> Callable[[requests.Response], bool]:
        return lambda r: r.status_code == code

    return [
        ("fork bomb", {"code": FORK_BOMB, "timeout_s": 0.3}, status("timeout")),
        ("memory bomb", {"code": MEMORY_BOMB, "memory_mb": 128}, status("memory_limit_exceeded")),
        ("loop", {"code": "while True: pass", "timeout_s": 0.2}, status("timeout")),
        ("sleep", {"code": "import time; time.sleep(10)", "timeout_s": 0.2}, status("timeout")),
        ("daemon", {"code": DAEMON}, status("ok")),
        ("flood", {"code": FLOOD.replace("100", "8"), "timeout_s": 10}, status("ok")),
        ("escape", {"code": ESCAPE_WRITES}, lambda r: r.json()["stdout"].count("refused") == 3),
        ("sockets", {"code": _sockets(agent.port)}, lambda r: "CONNECTED" not in r.json()["stdout"]),
        ("kill parent", {"code": _kill_parent(agent.proc.pid)}, lambda r: "KILL" not in r.json()["stdout"]),
        ("fds", {"code": FD_EXHAUSTION}, status("failed")),
        ("syntax", {"code": "def ("}, status("failed")),
        ("ok", {"code": "print(1+1)"}, lambda r: r.json()["stdout"] == "2\n"),
        ("bash", {"code": "echo hi; sleep 5 &", "runtime": "bash"}, lambda r: r.json()["stdout"] == "hi\n"),
        ("wrong type", {"code": 42}, http(422)),
        ("unknown runtime", {"code": "1", "runtime": "cobol"}, http(400)),
    ]


@pytest.mark.slow
def test_a_mixed_series_of_hostile_actions_leaks_nothing(agent: Agent) -> None:
    """A thousand hostile actions at concurrency 8: every one gets its expected result, then no
    process of the agent's uids, no workdir, no descriptor and no significant memory is left over."""
    actions = _hostile_actions(agent)
    # Warm the agent, then take its baseline.
    for _ in range(20):
        agent.execute("print(1)")
    wait_until(lambda: workdirs(agent) == [], what="warm-up workdirs to be removed")
    rss_before = rss_kb(agent.proc.pid)
    fds_before = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
    rng = random.Random(7)
    # Mostly cheap ones; each expensive kind (CPU burners, big outputs) a bounded number of times.
    weights = {"fork bomb": 1, "memory bomb": 2, "loop": 2, "sleep": 3, "flood": 1}
    series = rng.choices(actions, weights=[weights.get(a[0], 6) for a in actions], k=1000)
    session = requests.Session()

    def run(item: tuple[str, dict[str, object], Callable[[requests.Response], bool]]) -> str | None:
        name, body, ok = item
        resp = session.post(agent.url + "/v1/execute", json=body, timeout=60)
        return None if ok(resp) else f"{name}: {resp.status_code} {resp.text[:300]}"

    with ThreadPoolExecutor(max_workers=8) as pool:
        failures = [f for f in pool.map(run, series) if f is not None]
    session.close()  # its keep-alive connections are descriptors in the agent too
    assert failures == []
    big = b'{"code": "' + b"x" * (64 << 20) + b'"}'
    resp = requests.post(agent.url + "/v1/execute", data=big, timeout=60)
    assert resp.status_code == 413
    assert "exceeds the limit" in resp.json()["error"]
    assert agent.healthy()
    assert processes_of(agent.uids) == []
    wait_until(lambda: workdirs(agent) == [], what="every workdir to be removed")
    wait_until(
        lambda: len(os.listdir(f"/proc/{agent.proc.pid}/fd")) <= fds_before + 4,
        what="the agent's descriptors to return to their baseline",
    )
    # Output buffers of up to 8 MB passed through; the agent must not keep them.
    assert rss_kb(agent.proc.pid) - rss_before < 64 * 1024


def test_a_lost_fork_server_is_replaced(agent: Agent) -> None:
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    assert agent.execute("x = 1", session_id=sid)["status"] == "ok"
    children = [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _parent_of(int(p)) == agent.proc.pid and "forkserver" in _cmdline(int(p))
    ]
    assert children, "the agent runs its fork servers as child processes"
    os.kill(children[0], 9)
    wait_until(lambda: _state(children[0]) in ("Z", ""), what="the fork server to be gone")
    results = [agent.execute("print(6*7)")["stdout"] for _ in range(4)]
    assert results == ["42\n"] * 4
    assert agent.healthy()
    # The session's interpreter died with its fork server: the session says so rather than
    # silently answering from a fresh one.
    again = agent.execute("print('x' in globals())", session_id=sid)
    assert (again["stdout"], again["interpreter_restarted"]) == ("False\n", True)
    assert agent.execute("print('x' in globals())", session_id=sid)["interpreter_restarted"] is False
    requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_what_a_lost_fork_server_leaves_is_reaped_by_the_agent(agent: Agent) -> None:
    """The agent is the child subreaper of its fork servers' descendants: a session interpreter
    orphaned by its fork server's death goes to the agent, which kills and reaps it, never to the
    host's init (which may reap late: the zombie then outlives the agent's clean-up)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    assert agent.execute("x = 1", session_id=sid)["status"] == "ok"
    (interp,) = processes_of(agent.uids)  # the session's interpreter, its only process
    (server,) = [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _parent_of(int(p)) == agent.proc.pid and "forkserver" in _cmdline(int(p))
    ]
    os.kill(server, 9)
    parents: set[int] = set()

    def reaped() -> bool:
        if _state(interp) == "":
            return True
        parents.add(_parent_of(interp))
        return False

    wait_until(reaped, what="the orphaned interpreter to be reaped")
    parents.discard(-1)  # gone between the two reads
    assert 1 not in parents, parents
    assert agent.execute("print(6*7)")["stdout"] == "42\n"
    requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return -1


def _state(pid: int) -> str:
    return _state_of(f"/proc/{pid}/stat")


def _state_of(stat: str) -> str:
    try:
        with open(stat, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def test_an_interpreter_that_breaks_its_control_socket_just_ends(agent: Agent) -> None:
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        body = agent.execute("import os\nos.close(3)\nprint('closed')", session_id=sid, timeout_s=5)
        assert body["stdout"] == "closed\n"
        again = agent.execute("print('next')", session_id=sid)
        assert again["stdout"] == "next\n"
        assert again["interpreter_restarted"] is True
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    assert agent.healthy()
    wait_until(lambda: processes_of(agent.uids) == [], what="the broken interpreter to be gone")


# Frames a session's code writes on its interpreter's control socket itself (descriptor 3), in the
# fork server's framing (a 4-byte length, then marshal), then what it does next.
_FRAME = (
    "import marshal, os, struct\n"
    "def frame(obj):\n    b = marshal.dumps(obj)\n    os.write(3, struct.pack('<I', len(b)) + b)\n"
)
FORGED_ANSWERS = {
    "a list for an answer": "frame([1])\nprint('after')\n",
    "a success, then a failure": "frame({'exit_code': 0})\nraise SystemExit(3)\n",
    "a success, then running on": (
        "frame({'exit_code': 0})\nimport time\nt = time.time()\nwhile time.time() - t < 20:\n    pass\n"
    ),
    "a marshal bomb (a tuple of 2**31 slots in 9 bytes)": (
        "os.write(3, struct.pack('<I', 5) + b'(' + struct.pack('<i', 2**31 - 1))\nprint('after')\n"
    ),
    "an answer of the right size for another call": (
        "os.write(3, struct.pack('<qi', 12345, 0))\nprint('after')\n"
    ),
    "an answer of 200 MB announced": (
        "os.write(3, struct.pack('<I', 200 << 20) + b'x' * (4 << 20))\nprint('after')\n"
    ),
}


@pytest.mark.parametrize("name", list(FORGED_ANSWERS))
def test_an_answer_a_session_writes_itself_ends_its_interpreter_not_the_agent(
    agent: Agent, name: str
) -> None:
    """A session's code shares its interpreter's process, so it can write to the control socket
    on which the interpreter answers each call. What it writes is not the loop's answer to the call
    (the call's id, one small frame): the interpreter goes and the call fails, instead of the fork
    server crashing for every action (a list frame), a failing call passing and running on past
    its timeout ({"exit_code": 0}), or the fork server holding hundreds of MB (a huge frame). An
    action running meanwhile is untouched, and the session's next call gets a fresh interpreter."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        assert agent.execute("x = 1", session_id=sid)["status"] == "ok"
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(agent.execute, "import time\ntime.sleep(1)\nprint('beside')", timeout_s=30)
            body = agent.execute(_FRAME + FORGED_ANSWERS[name], session_id=sid, timeout_s=10)
            assert beside.result()["stdout"] == "beside\n"
        assert body["status"] != "ok" and body["exit_code"] != 0, body
        assert agent.healthy()
        again = agent.execute("print('fresh', 'x' in globals())", session_id=sid)
        assert again["stdout"] == "fresh False\n" and again["interpreter_restarted"] is True, again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the interpreter to be gone")


def test_an_interpreter_whose_control_socket_is_swapped_fails_the_call(agent: Agent) -> None:
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        # Keep the control socket open elsewhere and put a silent socket in its place: the loop
        # sees that descriptor 3 is no longer its socket, and the interpreter ends, failing the call
        # (before, its answer went nowhere and the call ran into its deadline).
        hijack = (
            "import os, socket\n"
            "keep = os.dup(3)\n"
            "a, b = socket.socketpair()\n"
            "os.dup2(a.fileno(), 3)\n"
            "print('hijacked')"
        )
        body = agent.execute(hijack, session_id=sid, timeout_s=5)
        assert body["status"] == "failed", body
        assert "interpreter ended during the call" in str(body["message"]), body
        assert body["stdout"] == "hijacked\n"
        assert agent.execute("print('still serving')")["stdout"] == "still serving\n"
        again = agent.execute("print('fresh')", session_id=sid)
        assert again["stdout"] == "fresh\n"
        assert again["interpreter_restarted"] is True
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the interpreter to be gone")


def test_planted_fifo_and_links_in_a_session_cannot_stall_or_crash_uploads(agent: Agent) -> None:
    """An action plants a FIFO where the caller will upload next (and a link and a file where
    directories are expected): the upload is refused with a clear error; the agent never blocks on
    opening the FIFO for writing (which would stall every request) and never answers 500."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        plant = "mkfifo test_solution.py pipe && ln -s / up && touch plain"
        assert agent.execute(plant, runtime="bash", session_id=sid)["status"] == "ok"
        for path in ("pipe", "up/x", "plain/x"):
            resp = requests.put(f"{agent.url}/v1/sessions/{sid}/files/{path}", data=b"x", timeout=10)
            assert resp.status_code == 400, (path, resp.status_code, resp.text)
            assert path.split("/")[0] in resp.json()["error"]
        # The pytest runtime writes its test file into the session's workdir: never over the
        # session's own file of that name (the FIFO), but beside it, never opening it.
        resp = agent.post(
            "/v1/execute", {"runtime": "pytest", "code": "def test_x(): pass", "session_id": sid}
        )
        assert resp.status_code == 200 and resp.json()["status"] == "ok", resp.text
        assert "test_solution_.py ." in resp.json()["stdout"], resp.text
        assert agent.execute("print('still serving')")["stdout"] == "still serving\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_processes_a_persistent_call_leaves_run_only_during_calls_on_their_cores(agent: Agent) -> None:
    """A session's interpreter outlives each call by design, and so, as in a notebook's kernel, do
    the processes a call starts in it (a multiprocessing pool, a server): the interpreter went, its
    variables with it, at any process left. They must not run between calls (past the call's
    timeout, on cores handed to other actions): all of it is stopped until the next call, which
    moves every thread of them to its own cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to grant different ones")
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        leftover = (
            "import os\nchild = os.fork()\nif child == 0:\n"
            "    if os.fork() == 0:\n        os.setsid()\n    while True:\n        pass\n"
        )
        body = agent.execute(f"y = 2\n{leftover}print('started')", session_id=sid, timeout_s=5, cores=[0])
        assert (body["status"], body["stdout"], body["message"]) == ("ok", "started\n", ""), body
        # Stopped between calls, the interpreter and both spinning processes (one in a session of
        # its own): none can take a core from anyone.
        assert sorted(_state(pid) for pid in processes_of(agent.uids)) == ["T", "T", "T"]
        probe = (
            "import os, time\ntime.sleep(0.2)\n"
            "print(y, open(f'/proc/{child}/status').read().split('Cpus_allowed_list:')[1].split()[0],"
            " open(f'/proc/{child}/stat').read().rsplit(')', 1)[1].split()[0])"
        )
        again = agent.execute(probe, session_id=sid, cores=[1])
        assert again["interpreter_restarted"] is False, again
        assert again["stdout"] == "2 1 R\n", again
        assert sorted(_state(pid) for pid in processes_of(agent.uids)) == ["T", "T", "T"]
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the session's processes to be gone")


def test_a_process_pool_a_persistent_call_made_serves_the_next_call(agent: Agent) -> None:
    """What a notebook keeps: a pool made in one call maps in the next, with the variables."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        made = "import multiprocessing as mp\nX = 2\npool = mp.Pool(2)\nprint(pool.map(abs, [-1, -2]))"
        first = agent.execute(made, session_id=sid, timeout_s=30)
        assert (first["status"], first["stdout"]) == ("ok", "[1, 2]\n"), first
        again = agent.execute("print(X, pool.map(abs, [-3]))", session_id=sid, timeout_s=30)
        assert (again["status"], again["stdout"]) == ("ok", "2 [3]\n"), again
        assert again["interpreter_restarted"] is False
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the session's processes to be gone")


def test_what_kept_processes_write_in_a_later_call_is_that_calls_output(agent: Agent) -> None:
    """A kept process writes to the pipe of the call that started it: that pipe stays open, and
    what comes goes to the call running then, as a notebook shows a worker's output in the cell
    that ran it (closed, its writes failed with EPIPE: a pool's worker that printed, or a server
    logging a request, died of it)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        made = "import multiprocessing as mp, os\npool = mp.Pool(1)\nprint('made')"
        first = agent.execute(made, session_id=sid, timeout_s=30)
        assert (first["status"], first["stdout"]) == ("ok", "made\n"), first
        for n in range(2):
            code = f"pool.apply(os.write, (1, b'worker {n}\\n'))\nprint('main {n}')"
            again = agent.execute(code, session_id=sid, timeout_s=30)
            assert again["status"] == "ok" and again["interpreter_restarted"] is False, again
            assert sorted(str(again["stdout"]).splitlines()) == [f"main {n}", f"worker {n}"], again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the session's processes to be gone")


def test_a_call_that_leaves_too_many_processes_ends_its_interpreter(agent: Agent) -> None:
    """Each kept process holds a descriptor of the fork server's and a slot of the host's processes
    until its session ends: past COMPANY_MAX the interpreter goes, as it did for any process."""
    from arl_tangram.sandbox.forkserver import COMPANY_MAX

    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        many = (
            f"import os, time\nx = 1\nfor _ in range({COMPANY_MAX + 1}):\n"
            "    if os.fork() == 0:\n        time.sleep(60)\n        os._exit(0)\nprint('forked')"
        )
        body = agent.execute(many, session_id=sid, timeout_s=30)
        assert (body["status"], body["stdout"]) == ("ok", "forked\n"), body
        assert "interpreter was stopped" in str(body["message"]), body
        wait_until(lambda: processes_of(agent.uids) == [], what="the processes to be gone")
        again = agent.execute("print('x' in globals())", session_id=sid)
        assert again["interpreter_restarted"] is True and again["stdout"] == "False\n", again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


# A kept process that wakes itself between calls: a POSIX timer whose signal is SIGCONT (which a
# SIGSTOP does not hold against), and a handler so that the timer goes on firing.
_WAKES_ITSELF = r"""
import ctypes, signal
lib = ctypes.CDLL(None, use_errno=True)
class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]
class TimeSpec(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", TimeSpec), ("value", TimeSpec)]
signal.signal(signal.SIGCONT, lambda *_: None)
timer = ctypes.c_void_p()
assert lib.timer_create(1, ctypes.byref(SigEvent(None, signal.SIGCONT, 0)), ctypes.byref(timer)) == 0
every = ITimerSpec(TimeSpec(0, 50_000_000), TimeSpec(0, 50_000_000))
assert lib.timer_settime(timer, 0, ctypes.byref(every), None) == 0
while True:
    pass
"""


def test_a_kept_process_that_wakes_itself_between_calls_ends_its_interpreter(agent: Agent) -> None:
    """A stopped session runs again between calls only by its own doing (a timer raising SIGCONT):
    it is stopped for good within a moment, all of it, and its next call is told why (it ran at
    full speed for as long as its session lived, on cores handed to others)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        start = (
            "import subprocess, sys, time\nx = 1\n"
            f"child = subprocess.Popen([sys.executable, '-c', {_WAKES_ITSELF!r}])\ntime.sleep(0.5)\n"
        )
        body = agent.execute(start, session_id=sid, timeout_s=30)
        assert body["status"] == "ok", body
        wait_until(lambda: processes_of(agent.uids) == [], what="the session that woke itself to be gone")
        again = agent.execute("print('x' in globals())", session_id=sid)
        assert again["interpreter_restarted"] is True and again["stdout"] == "False\n", again
        assert "ran between calls" in str(again["message"]), again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_process_whose_main_thread_ended_is_kept_stopped_too(agent: Agent) -> None:
    """A process whose main thread exited (``pthread_exit``) shows its leader as a zombie while
    its other threads run: it was taken for gone, never stopped, and spun between calls."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        leader_ends = (
            "import ctypes, threading\n"
            "threading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()\n"
            "ctypes.CDLL(None).syscall(60, 0)\n"  # exit(2) of the main thread alone
        )
        start = (
            "import subprocess, sys, time\nx = 1\n"
            f"child = subprocess.Popen([sys.executable, '-c', {leader_ends!r}])\ntime.sleep(0.5)\n"
        )
        body = agent.execute(start, session_id=sid, timeout_s=30)
        assert body["status"] == "ok", body
        time.sleep(0.5)
        threads = [
            _state_of(f"/proc/{pid}/task/{tid}/stat")
            for pid in processes_of(agent.uids)
            for tid in os.listdir(f"/proc/{pid}/task")
        ]
        assert set(threads) <= {"T", "Z", ""}, threads
        again = agent.execute("print(x)", session_id=sid)
        assert again["stdout"] == "1\n", again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_threads_a_persistent_call_leaves_run_only_during_calls_on_their_cores(agent: Agent) -> None:
    """Threads are the interpreter's own state (a BLAS pool, an executor): the interpreter keeps
    them, but is stopped between calls, and each call moves every thread to its own cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to grant different ones")
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        joined = (
            "import threading\nt = threading.Thread(target=sum, args=([1, 2],))\nt.start()\nt.join()\nx = 1"
        )
        assert agent.execute(joined, session_id=sid)["status"] == "ok"
        assert agent.execute("print(x)", session_id=sid)["stdout"] == "1\n"
        spin = (
            "import threading\nticks = [0]\n"
            "def spin():\n    while True:\n        ticks[0] += 1\n"
            "threading.Thread(target=spin, daemon=True).start()\nprint('started')"
        )
        body = agent.execute(spin, session_id=sid, cores=[0])
        assert (body["status"], body["stdout"], body["message"]) == ("ok", "started\n", "")
        # Stopped between calls: the spinning thread cannot take a core from anyone.
        assert [_state(pid) for pid in processes_of(agent.uids)] == ["T"]
        probe = (
            "import os\nprint(threading.active_count(), "
            "{open(f'/proc/self/task/{t}/status').read().split('Cpus_allowed_list:')[1].split()[0] "
            "for t in os.listdir('/proc/self/task')})"
        )
        again = agent.execute(probe, session_id=sid, cores=[1])
        assert again["interpreter_restarted"] is False
        assert again["stdout"] == "2 {'1'}\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the interpreter to be gone")


# A session's call that fails, made to look as if it passed: by what the call itself does, or by
# what an earlier call of the session left behind. None may be reported "ok".
_FORWARDER = (
    "import os, socket, subprocess, sys\n"
    "a, b = socket.socketpair()\n"
    "real = os.dup(3)\n"
    "os.dup2(a.fileno(), 3)\n"
    "helper = ('import os, struct, sys\\n'\n"
    "          'b, real = int(sys.argv[1]), int(sys.argv[2])\\n'\n"
    "          'token, status = struct.unpack(\"<qi\", os.read(b, 12))\\n'\n"
    "          'os.write(real, struct.pack(\"<qi\", token, 0))\\n')\n"
    "subprocess.Popen([sys.executable, '-c', helper, str(b.fileno()), str(real)],\n"
    "                 pass_fds=(b.fileno(), real))\n"
)
FAKED_SESSION_CALLS: dict[str, tuple[str, str]] = {
    # (an earlier call, the failing call)
    "the answer written with the loop's token, read from its frame": (
        "x = 1\n",
        "import struct, sys, os\nf = sys._getframe()\n"
        "while f is not None and 'request' not in f.f_locals:\n    f = f.f_back\n"
        "token = f.f_locals['request']['call'] if f is not None else 0\n"
        "os.write(3, struct.pack('<qi', token, 0))\nassert 1 == 2\n",
    ),
    "the answer written with every token a dict of the process holds": (
        "x = 1\n",
        "import gc, os, struct\n"
        "for d in gc.get_objects():\n"
        "    if isinstance(d, dict) and isinstance(d.get('call'), int):\n"
        "        os.write(3, struct.pack('<qi', d['call'], 0))\n"
        "assert 1 == 2\n",
    ),
    "the true answer passed on changed by a helper process": ("x = 1\n", _FORWARDER + "assert 1 == 2\n"),
    "the true answer passed on changed by a thread": (
        "x = 1\n",
        "import os, socket, struct, threading\n"
        "a, b = socket.socketpair()\nreal = os.dup(3)\nos.dup2(a.fileno(), 3)\n"
        "def forward():\n"
        "    token, status = struct.unpack('<qi', b.recv(12))\n"
        "    os.write(real, struct.pack('<qi', token, 0))\n"
        "threading.Thread(target=forward, daemon=True).start()\n"
        "assert 1 == 2\n",
    ),
    "the agent's status functions replaced by an earlier call": (
        "import sys\nfor m in list(sys.modules.values()):\n"
        "    for k in ('_status_of', '_exit_code_of', '_run_code', '_report'):\n"
        "        if isinstance(getattr(m, '__dict__', None), dict) and k in m.__dict__:\n"
        "            m.__dict__[k] = lambda *a, **kw: 0\n",
        "assert 1 == 2\n",
    ),
    "the agent's preparation replaced by an earlier call, to exit 0": (
        "import os, sys\nfor m in list(sys.modules.values()):\n"
        "    d = getattr(m, '__dict__', None)\n"
        "    if isinstance(d, dict) and callable(d.get('_prepare_call')):\n"
        "        d['_prepare_call'].__code__ = (lambda request: __import__('os')._exit(0)).__code__\n",
        "assert 1 == 2\n",
    ),
    "the interpreter ended with status 0 by the call": ("x = 1\n", "import os\nos._exit(0)\n"),
    # A socket of its own put on descriptor 3: the loop would read a request of the program's
    # making (which runs Python, so a thread runs), and answer to it, for the thread to pass on.
    "the loop fed a request of the program's making, its answer passed on changed": (
        "x = 1\n",
        "import marshal, os, socket, struct, threading\n"
        "a, b = socket.socketpair()\nreal = os.dup(3)\nos.dup2(a.fileno(), 3)\n"
        "fake = marshal.dumps({'code': 'import time\\ntime.sleep(5)\\n', 'cores': None, 'env': None})\n"
        "b.sendall(struct.pack('<Iq', len(fake), 1) + fake)\n"
        "def relay():\n    d = b''\n    while len(d) < 12:\n        d += b.recv(12 - len(d))\n"
        "    token, status = struct.unpack('<qi', d)\n    os.write(real, struct.pack('<qi', token, 0))\n"
        "threading.Thread(target=relay, daemon=True).start()\nassert 1 == 2\n",
    ),
    # Threads an earlier call left read each request ahead of the loop (MSG_PEEK), and answer it.
    "the request read ahead of the loop, and answered with its nonce": (
        "import os, socket, struct, sys, threading\nsys.setswitchinterval(1e-6)\ndone = []\n"
        "def steal():\n    s = socket.socket(fileno=os.dup(3))\n    while not done:\n"
        "        head = s.recv(12, socket.MSG_PEEK)\n        if len(head) == 12:\n"
        "            length, nonce = struct.unpack('<Iq', head)\n            done.append(1)\n"
        "            for status in (0,):\n"
        "                os.write(3, struct.pack('<qiQ', nonce, status, 0))\n"
        "for _ in range(4):\n    threading.Thread(target=steal, daemon=True).start()\n",
        "import time\ntime.sleep(0.2)\nassert 1 == 2\n",
    ),
    # A gc callback that looks through what the process allocates while the loop takes a request.
    "the token read by a gc callback while the request was read": (
        "import gc\nTOK = []\ndef cb(phase, info):\n    if phase == 'start':\n"
        "        for o in gc.get_objects(0):\n            if type(o) is dict and 'code' in o:\n"
        "                TOK.extend(v for v in o.values() if type(v) is int and v > 1000)\n"
        "gc.callbacks.append(cb)\ngc.set_threshold(1)\nprint('armed')\ngc.collect()\n",
        "import os, struct, time\nfor t in TOK:\n    os.write(3, struct.pack('<qi', t, 0))\n"
        "time.sleep(0.3)\nassert 1 == 2\n",
    ),
}


@pytest.mark.parametrize("name", list(FAKED_SESSION_CALLS))
def test_a_failing_session_call_cannot_be_made_to_pass(agent: Agent, name: str) -> None:
    """The program shares its session's interpreter, so it can reach the loop that answers each
    call, and the control socket it answers on. The answer carries a token drawn for each call and
    held where the program cannot read it, it is taken only from the interpreter's own process, and
    an interpreter that ends during a call has not passed it."""
    earlier, failing = FAKED_SESSION_CALLS[name]
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        assert agent.execute(earlier, session_id=sid)["status"] == "ok"
        body = agent.execute(failing, session_id=sid, timeout_s=3)
        assert body["status"] != "ok", (name, body)
        assert agent.healthy()
        # The session goes on (with a fresh interpreter where the old one went).
        assert agent.execute("print('next')", session_id=sid)["stdout"] == "next\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
    wait_until(lambda: processes_of(agent.uids) == [], what="the interpreter to be gone")


def test_a_call_that_leaves_the_control_socket_non_blocking_does_not_fail_the_next(agent: Agent) -> None:
    """The loop's descriptor is the program's too: one made non-blocking is set back, not read as
    the fork server gone (the interpreter ended between calls, and the next, innocent call failed)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        first = agent.execute("import os\nos.set_blocking(3, False)\nx = 7\n", session_id=sid)
        assert first["status"] == "ok", first
        again = agent.execute("print(x)", session_id=sid)
        assert again["status"] == "ok" and again["stdout"] == "7\n", again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_sessions_globals_are_its_main_module(agent: Agent) -> None:
    """What finds things through ``__main__`` (pickle, multiprocessing, ``import __main__``) finds
    a session's names, as in a notebook's kernel."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        assert agent.execute("x = 1\ndef f():\n    return 2\n", session_id=sid)["status"] == "ok"
        body = agent.execute(
            "import pickle, sys, __main__\nprint(sys.modules['__main__'].__dict__ is globals(), __main__.x)\n"
            "print(pickle.loads(pickle.dumps(f))())\n",
            session_id=sid,
        )
        assert body["status"] == "ok" and body["stdout"] == "True 1\n2\n", body
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_signal_between_session_calls_keeps_the_session(agent: Agent) -> None:
    """A signal the session handles in Python, coming while its loop waits for the next call (an
    alarm left set, SIGCONT when the fork server thaws it), interrupts that wait: it is waited
    again, not taken for the fork server gone (which ended the interpreter and its state)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        first = agent.execute(
            "import signal\nx = 41\nsignal.signal(signal.SIGALRM, lambda *a: None)\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.2)\n",
            session_id=sid,
        )
        assert first["status"] == "ok", first
        time.sleep(0.6)
        again = agent.execute("print(x + 1)", session_id=sid)
        assert again["stdout"] == "42\n" and again["interpreter_restarted"] is False, again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_process_a_session_call_forked_ends_there(agent: Agent) -> None:
    """A child the call forked that runs on to the call's end ends as it would under ``python -c``:
    it does not answer in the interpreter's place, and the call is the parent's."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        code = (
            "import os\npid = os.fork()\n"
            "if pid:\n    os.waitpid(pid, 0)\n    print('parent')\nelse:\n    print('child')\n"
        )
        body = agent.execute(code, session_id=sid)
        assert body["status"] == "ok" and sorted(str(body["stdout"]).split()) == ["child", "parent"], body
        again = agent.execute("print(pid > 0)", session_id=sid)
        assert again["stdout"] == "True\n" and again["interpreter_restarted"] is False, again
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


# Session calls that try to outlast their timeout: none has a way to stop the kill at the deadline.
UNSTOPPABLE_CELLS = {
    "every signal blocked, spinning": (
        "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
        "while True:\n    pass\n"
    ),
    "every signal ignored, sleeping": (
        "import signal, time\nfor s in signal.valid_signals():\n    try:\n"
        "        signal.signal(s, signal.SIG_IGN)\n    except (OSError, ValueError):\n        pass\n"
        "time.sleep(100)\n"
    ),
    "every descriptor closed, spinning": "import os\nos.closerange(0, 4096)\nwhile True:\n    pass\n",
    "a child in a session of its own holding the pipes, the interpreter spinning": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nwhile True:\n    pass\n"
    ),
}


@pytest.mark.parametrize("name", list(UNSTOPPABLE_CELLS))
def test_a_session_call_that_will_not_stop_ends_at_its_timeout(agent: Agent, name: str) -> None:
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        body = agent.execute(UNSTOPPABLE_CELLS[name], session_id=sid, timeout_s=2)
        assert body["status"] == "timeout", body
        after = agent.execute("print('next')", session_id=sid)
        seen = (after["status"], after["stdout"], after["interpreter_restarted"])
        assert seen == ("ok", "next\n", True), after
        assert agent.healthy()
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)
