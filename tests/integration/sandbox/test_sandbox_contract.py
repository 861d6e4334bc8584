"""SandboxFusion-style ``/run_code`` cases on the semantics a reward depends on, against a real agent
(both fork loops). Written from SandboxFusion's documented behaviour: a program's verdict is what it
would get run directly (``python file.py``, ``bash file.sh``), whatever the sandbox does around it.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent, wait_until


@pytest.fixture(scope="module", params=["c", "python"])
def agent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("contract") / "work", "--fork-loop", request.param)
    yield running
    stop_agent(running)


def _run(agent: Agent, code: str, language: str = "python", **fields: object) -> dict[str, object]:
    resp = agent.post("/run_code", {"code": code, "language": language, **fields})
    assert resp.status_code == 200, resp.text
    body: dict[str, object] = resp.json()
    return body


def _result(body: dict[str, object]) -> dict[str, object]:
    run = body["run_result"]
    assert isinstance(run, dict)
    return run


@pytest.mark.parametrize(
    ("code", "language", "signal"),
    [
        # The answer is printed, then the program kills itself: a runtime error, not a success.
        ("import os, signal\nprint(42, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)", "python", 9),
        ("import os\nprint(42, flush=True)\nos.abort()", "python", 6),
        ("import os, signal\nprint(42, flush=True)\nos.kill(os.getpid(), signal.SIGTERM)", "python", 15),
        ("echo 42; kill -9 $$", "bash", 9),
        ("echo 42; kill -SEGV $$", "bash", 11),
    ],
)
def test_a_program_that_kills_itself_fails_with_its_own_signal(
    agent: Agent, code: str, language: str, signal: int
) -> None:
    body = _run(agent, code, language)
    run = _result(body)
    assert body["status"] == "Failed", body
    assert run["status"] == "Finished"
    assert run["stdout"] == "42\n"
    assert run["signal"] == signal
    assert run["return_code"] == -signal


@pytest.mark.parametrize(
    ("code", "status", "code_out"), [("print(1)", "Success", 0), ("raise SystemExit(3)", "Failed", 3)]
)
def test_exit_statuses_are_the_programs_own(agent: Agent, code: str, status: str, code_out: int) -> None:
    body = _run(agent, code)
    assert (body["status"], _result(body)["return_code"], _result(body)["signal"]) == (status, code_out, None)


def test_what_a_program_leaves_running_still_ends_with_it(agent: Agent) -> None:
    # A child that outlives the program (and ignores SIGTERM) must not keep the call open.
    code = "trap '' TERM; (trap '' TERM; sleep 300) & echo started"
    body = _run(agent, code, "bash", run_timeout=20)
    assert body["status"] == "Success", body
    assert _result(body)["stdout"] == "started\n"


def test_defaults_let_what_sandboxfusion_clients_send_through(agent: Agent) -> None:
    # A correct answer of 3 MB is returned whole (clients score stdout and ignore truncation).
    # (Generous time limits: the machine may be loaded; these cases are about sizes, not time.)
    body = _run(agent, "import sys\nsys.stdout.write('7' * 3_000_000)", run_timeout=120)
    assert body["status"] == "Success", body
    assert len(str(_result(body)["stdout"])) == 3_000_000 and _result(body)["stdout_truncated"] is False
    # memory_limit_MB: -1 (SandboxFusion's default) is no limit below the host's: 2 GiB can be had.
    body = _run(agent, "x = bytearray(2 << 30)\nprint(len(x) >> 30)", memory_limit_MB=-1, run_timeout=120)
    assert body["status"] == "Success", body
    assert _result(body)["stdout"] == "2\n"
    # Long runs and large limits are not refused up front.
    body = _run(agent, "print('ok')", run_timeout=1200, memory_limit_MB=16384)
    assert body["status"] == "Success", body


def test_small_differences_match_sandboxfusion(agent: Agent) -> None:
    import base64

    assert requests.get(agent.url + "/v1/ping", timeout=10).json() == "pong"
    data = base64.b64encode(b"hi").decode()
    code = "import os\nprint(sorted(os.listdir('.')))\nprint(open('a.txt').read())"
    files = {"a.txt": data, "none.txt": None, "x/IGNORE_THIS_FILE.txt": data}
    body = _run(agent, code, files=files)
    assert body["status"] == "Success", body
    # Null content and IGNORE_THIS_FILE names are placeholders: nothing is written for them.
    listing = str(_result(body)["stdout"]).splitlines()[0]
    assert listing == "['a.txt', 'main.py']"
    # A fetch path outside the workdir leaves that file out, saying why; the action still ran.
    body = _run(agent, "print(1)", fetch_files=["/etc/passwd", "../up.txt"])
    assert body["status"] == "Success" and body["files"] == {}
    notes = body["notes"]
    assert isinstance(notes, list) and len(notes) == 2
    assert "absolute" in notes[0] and "leaves the working directory" in notes[1]
    # An absolute path to write is refused before anything runs, naming the reason.
    resp = agent.post("/run_code", {"code": "print(1)", "language": "python", "files": {"/tmp/x": data}})
    assert resp.status_code == 400
    assert resp.json()["status"] == "SandboxError" and "absolute" in resp.json()["message"]


def test_python_runs_as_a_file_so_tracebacks_show_source(agent: Agent) -> None:
    code = (
        "import inspect, os, sys\n"
        "def answer():\n"
        "    return 42\n"
        "assert __file__ == sys.argv[0] == os.path.join(os.getcwd(), 'main.py'), (__file__, sys.argv)\n"
        "print(inspect.getsource(answer), end='')\n"
        "raise ValueError('boom')\n"
    )
    body = _run(agent, code)
    run = _result(body)
    assert body["status"] == "Failed" and run["return_code"] == 1
    assert run["stdout"] == "def answer():\n    return 42\n"
    # As under `python main.py`: the file and line, then the line itself.
    assert "main.py\", line 6, in <module>\n    raise ValueError('boom')\n" in str(run["stderr"])
    assert str(run["stderr"]).endswith("ValueError: boom\n")


def test_a_request_file_named_like_the_program_is_kept(agent: Agent) -> None:
    import base64

    files = {"main.py": base64.b64encode(b"VALUE = 7\n").decode()}
    body = _run(
        agent, "import os\nfrom main import VALUE\nprint(VALUE, os.path.basename(__file__))", files=files
    )
    assert body["status"] == "Success", body
    assert _result(body)["stdout"] == "7 main_.py\n"


def test_tmp_and_dev_shm_are_private_writable_and_gone_at_the_end(agent: Agent) -> None:
    # Writable (multiprocessing's semaphores live in /dev/shm): a Pool works, forked and spawned.
    for method in ("fork", "spawn"):
        code = (
            "import multiprocessing as mp\n"
            "if __name__ == '__main__':\n"
            f"    mp.set_start_method('{method}')\n"
            "    with mp.Pool(2) as pool:\n"
            "        print(pool.map(abs, [-1, -2, 3]))\n"
        )
        body = _run(agent, code, run_timeout=60)
        assert body["status"] == "Success", body
        assert _result(body)["stdout"] == "[1, 2, 3]\n"
    # Private: what one action leaves in /tmp and /dev/shm is not there for the next.
    leave = "open('/tmp/left', 'w').write('x')\nopen('/dev/shm/left', 'w').write('x')\nprint('left')"
    assert _result(_run(agent, leave))["stdout"] == "left\n"
    look = "import os\nprint(os.path.exists('/tmp/left'), os.path.exists('/dev/shm/left'))"
    assert _result(_run(agent, look))["stdout"] == "False False\n"


def test_a_persistent_interpreter_has_its_own_tmp_and_proc_kept_between_its_calls(agent: Agent) -> None:
    """A session's persistent interpreter (a code tool's kernel) gets what an action gets: a
    writable private /tmp and /dev/shm (a multiprocessing Pool works), kept between its calls as
    its globals are, unseen by other actions; a /proc that shows its own processes only; and
    loopback of its own (a server it starts in one call answers in the next)."""
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        pool = (
            "import multiprocessing as mp\n"
            "with mp.get_context('fork').Pool(2) as pool:\n"
            "    print(pool.map(abs, [-1, -2]))\n"
            "open('/tmp/kept', 'w').write('k')\nopen('/dev/shm/kept', 'w').write('k')\n"
        )
        first = agent.execute(pool, session_id=sid, timeout_s=60)
        assert first["stdout"] == "[1, 2]\n", first
        again = agent.execute(
            "print(open('/tmp/kept').read() + open('/dev/shm/kept').read())", session_id=sid
        )
        assert again["stdout"] == "kk\n", again
        look = "import os\nprint(os.path.exists('/tmp/kept'), os.path.exists('/dev/shm/kept'))"
        assert _result(_run(agent, look))["stdout"] == "False False\n"
        procs = (
            "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [os.getpid()])"
        )
        assert agent.execute(procs, session_id=sid)["stdout"] == "True\n"
        serve = "import socket\nsrv = socket.socket()\nsrv.bind(('127.0.0.1', 0))\nsrv.listen()\nprint('up')"
        assert agent.execute(serve, session_id=sid)["stdout"] == "up\n"
        connect = "c = socket.create_connection(srv.getsockname(), timeout=5)\nprint(srv.accept()[1][0])"
        assert agent.execute(connect, session_id=sid)["stdout"] == "127.0.0.1\n"
        # Its input is a pipe too, fed as it reads (more than a pipe holds).
        total = "import sys\nprint(len(sys.stdin.buffer.read()))\n"
        assert agent.execute(total, session_id=sid, stdin="z" * 2_000_000)["stdout"] == "2000000\n"
        assert agent.execute("import os\nHOME = os.getcwd()", session_id=sid)["exit_code"] == 0
        # Each call reads its own input only, whatever the last one read ahead and left.
        first = agent.execute("print(input())", session_id=sid, stdin="one\n" + "left\n" * 1000)
        assert first["stdout"] == "one\n", first
        second = agent.execute("import sys\nprint(repr(sys.stdin.read()))", session_id=sid, stdin="two\n")
        assert second["stdout"] == "'two\\n'\n", second
        # A call that leaves the interpreter in a directory since removed does not end the session.
        gone = (
            "import os, tempfile\nwith tempfile.TemporaryDirectory() as d:\n    os.chdir(d)\nprint('gone')\n"
        )
        assert agent.execute(gone, session_id=sid)["stdout"] == "gone\n"
        after = agent.execute("os.chdir(HOME)\nprint(os.getcwd() == HOME)", session_id=sid)
        assert (after["stdout"], after["interpreter_restarted"]) == ("True\n", False), after
        # A module of its own named as one the agent holds is what it imports, once the file is
        # there; and it stays once imported.
        put = requests.put(
            f"{agent.url}/v1/sessions/{sid}/files/json.py", data=b"def dumps(x):\n    return 'mine'\n"
        )
        assert put.status_code in (200, 201), put.text
        mine = "import json\nprint(json.dumps(1))\n"
        assert agent.execute(mine, session_id=sid)["stdout"] == "mine\n"
        assert agent.execute(mine, session_id=sid)["stdout"] == "mine\n"
        # What a call printed before it rebound sys.stdout is that call's output, not the next's.
        rebind = "import io, sys\nprint('first')\nsys.stdout = io.StringIO()\n"
        assert agent.execute(rebind, session_id=sid)["stdout"] == "first\n"
        back = "sys.stdout = sys.__stdout__\nprint('second')\n"
        assert agent.execute(back, session_id=sid)["stdout"] == "second\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_hundred_threads_start_under_a_gigabyte(agent: Agent) -> None:
    """The memory limit bounds a Python program's address space; glibc's default of a malloc arena
    per thread (64 MB of address space each) let only about 20 threads start under 1 GB, where
    outside a sandbox hundreds do. Children keep to two arenas."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack != 8 << 20:  # the agent's (and so each thread's) stack: 100 of them fit 1 GB at 8 MB
        pytest.skip(f"the stack limit here is {stack}, not 8 MB")
    code = (
        "import threading\nev = threading.Event()\n"
        "ts = [threading.Thread(target=ev.wait) for _ in range(100)]\n"
        "for t in ts:\n    t.start()\nev.set()\nfor t in ts:\n    t.join()\nprint(len(ts))\n"
    )
    body = _run(agent, code, memory_limit_MB=1024)
    assert body["status"] == "Success", body
    assert _result(body)["stdout"] == "100\n"


def test_a_program_may_hold_three_hundred_files_open(agent: Agent) -> None:
    """A shell's usual soft limit of open files (1024), not 256: 300 held at once is ordinary."""
    code = "fs = [open(f'f{i}', 'w') for i in range(300)]\nimport resource\n"
    code += "print(len(fs), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    body = _run(agent, code)
    assert body["status"] == "Success", body
    assert _result(body)["stdout"] == "300 1024\n"


def test_tmp_is_bounded_by_the_pools_memory_limit(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each private tmpfs holds at most the pool's default memory limit (48 MB here, below the
    64 MB one file may grow to, so the tmpfs fills first)."""
    small = start_agent(tmp_path_factory.mktemp("small-tmp") / "work", "--memory-mb", "48")
    try:
        code = (
            "try:\n"
            "    with open('/tmp/big', 'wb') as f:\n"
            "        for _ in range(200):\n"
            "            f.write(b'x' * (1 << 20))\n"
            "    print('wrote 200 MB')\n"
            "except OSError as e:\n"
            "    print('full', e.errno)\n"
        )
        look = "import os\nprint(os.listdir('/tmp'))"
        fresh = _result(_run(small, look))["stdout"]  # (the workdir root's path, if it is under /tmp)
        assert "big" not in str(fresh)
        body = _run(small, code, run_timeout=60)
        assert _result(body)["stdout"] == "full 28\n", body  # ENOSPC
        # That namespace is not reused with the file in it: the next action finds /tmp as fresh.
        assert _result(_run(small, look))["stdout"] == fresh
    finally:
        stop_agent(small)


LISTEN = (
    "import socket, os\n"
    "tcp = socket.socket()\n"
    "tcp.bind(('127.0.0.1', 5555))\n"
    "tcp.listen()\n"
    "unix = socket.socket(socket.AF_UNIX)\n"
    "unix.bind('\\0tangram-contract')\n"
    "unix.listen()\n"
    "open('listening', 'w').close()\n"
    "while not os.path.exists('go'):\n"
    "    os.sched_yield()\n"
    "print('done')\n"
)
CONNECT = (
    "import socket\n"
    "targets = ((socket.AF_INET, ('127.0.0.1', 5555)), (socket.AF_UNIX, '\\0tangram-contract'))\n"
    "for family, address in targets:\n"
    "    s = socket.socket(family)\n"
    "    try:\n"
    "        s.connect(address)\n"
    "        print('CONNECTED', family.name)\n"
    "    except OSError as e:\n"
    "        print('refused', family.name, e.errno)\n"
    "loop = socket.socket()\n"
    "loop.bind(('127.0.0.1', 5555))\n"
    "loop.listen()\n"
    "c = socket.create_connection(('127.0.0.1', 5555))\n"
    "print('loopback', c.getpeername()[0])\n"
)


def test_each_action_has_its_own_network_with_loopback(agent: Agent) -> None:
    """Loopback works, and what one action listens on (a TCP port, an abstract unix socket) is not
    there for another running at the same time: each has a network namespace of its own."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    files = f"{agent.url}/v1/sessions/{sid}/files"
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            holder = pool.submit(agent.execute, LISTEN, session_id=sid, timeout_s=60)
            wait_until(
                lambda: requests.get(f"{files}/listening", timeout=10).status_code == 200,
                what="the first action to listen",
            )
            body = agent.execute(CONNECT)
            assert requests.put(f"{files}/go", data=b"", timeout=10).status_code == 201
            assert holder.result()["stdout"] == "done\n"
        assert body["status"] == "ok", body
        assert body["stdout"] == ("refused AF_INET 111\nrefused AF_UNIX 111\nloopback 127.0.0.1\n"), body[
            "stdout"
        ]
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


# The server side closes first, so its port stays in TIME_WAIT (a minute) after the action ends.
CLOSE_FIRST = (
    "import socket\n"
    "srv = socket.socket()\n"
    "srv.bind(('127.0.0.1', 6000))\n"
    "srv.listen()\n"
    "c = socket.create_connection(('127.0.0.1', 6000))\n"
    "a, _ = srv.accept()\n"
    "a.close()\n"
    "c.recv(1)\n"
    "c.close()\n"
    "srv.close()\n"
    "print('served')\n"
)
# A listener whose descriptor is in flight in a unix socket cycle when the action ends: it outlives
# every process of the action, until the kernel's collector finds the cycle.
LISTENER_IN_FLIGHT = (
    "import socket\n"
    "srv = socket.socket()\n"
    "srv.bind(('127.0.0.1', 6001))\n"
    "srv.listen()\n"
    "a, b = socket.socketpair()\n"
    "socket.send_fds(a, [b'x'], [srv.fileno(), b.fileno()])\n"
    "print('left')\n"
)
BIND_AGAIN = (
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', 6001), timeout=2)\n"
    "    print('reached an earlier action')\n"
    "except OSError as e:\n"
    "    print('refused', e.errno)\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 6000))\n"
    "print('bound')\n"
)


def test_a_later_action_finds_no_socket_an_earlier_one_left(agent: Agent) -> None:
    """Every process of an action gone is not every socket gone: a port it closed first stays in
    TIME_WAIT, and a listener in flight lives on. A namespace is reused only once it holds no
    socket at all, so the actions after these two bind the port (no SO_REUSEADDR, as
    ``socketserver.TCPServer``) and reach no listener of theirs, as each would on a fresh machine.
    Run in a row, each reuses the namespace the one before gave back, where one is reused."""
    assert _result(_run(agent, CLOSE_FIRST))["stdout"] == "served\n"
    assert _result(_run(agent, LISTENER_IN_FLIGHT))["stdout"] == "left\n"
    for _ in range(3):
        body = _run(agent, BIND_AGAIN)
        assert _result(body)["stdout"] == "refused 111\nbound\n", body
    # And a namespace its action left empty is reused (made again for each, that costs about 1 ms
    # in the fork server's loop: a check reading a count that is the host's dropped every one).
    which = "import os\nprint(os.readlink('/proc/self/ns/net'))"
    first, second = (_result(_run(agent, which))["stdout"] for _ in range(2))
    assert first == second, (first, second)


def test_the_outside_network_stays_unreachable(agent: Agent) -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('10.255.255.1', 80), timeout=2)\n"
        "    print('REACHED')\n"
        "except OSError as e:\n"
        "    print('unreachable', e.errno)\n"
    )
    body = _run(agent, code)
    assert _result(body)["stdout"] == "unreachable 101\n", body  # ENETUNREACH: no route at all
