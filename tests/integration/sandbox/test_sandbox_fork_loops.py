"""Both zygote loops (C, and the Python one it falls back to without a compiler) run the same
actions the same way: real agents, real processes, real HTTP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent, wait_until


def test_health_names_the_loop(loop_agent: Agent) -> None:
    iso = requests.get(loop_agent.url + "/v1/health", timeout=10).json()["isolation"]
    assert iso["fork_loop"] == loop_agent.loop  # type: ignore[attr-defined]
    assert iso["pid_namespace"] is True


def test_environment_cwd_uid_and_cores_are_the_actions(loop_agent: Agent) -> None:
    code = (
        "import os\n"
        "print(os.environ['HOME'] == os.getcwd(), os.environ['TANGRAM_CORES'], os.getuid() > 0)\n"
        "print(sorted(os.sched_getaffinity(0)), os.getpid(), 'PYTHONIOENCODING' in os.environ)\n"
        "print(os.popen('echo $TANGRAM_ACTION_ID $HOME').read().split()[1] == os.getcwd())\n"
    )
    body = loop_agent.execute(code)
    first, second, third = body["stdout"].splitlines()
    cores = body["cores"]
    assert first == f"True {','.join(map(str, cores))} True"
    # PID 2 of its own namespace, under the init that reports its true status; the fork server's
    # env is gone.
    assert second == f"{cores} 2 False"
    assert third == "True"  # what the action executes sees the same environment


def test_exit_codes_stdin_and_stderr(loop_agent: Agent) -> None:
    assert loop_agent.execute("import sys; sys.exit(3)")["exit_code"] == 3
    bye = loop_agent.execute("raise SystemExit('bye')")
    assert (bye["exit_code"], bye["stderr"]) == (1, "bye\n")
    echoed = loop_agent.execute(
        "import sys; print(sys.stdin.read()[::-1]); print('e', file=sys.stderr)", stdin="abc"
    )
    assert (echoed["stdout"], echoed["stderr"]) == ("cba\n", "e\n")
    assert loop_agent.execute("echo $((6*7))", runtime="bash")["stdout"] == "42\n"


def test_python_code_runs_as_python_main_py_would(loop_agent: Agent) -> None:
    """Compiled by the manager or in the child, run from C or from Python: what the program sees and
    what it prints are Python's own."""
    # No __future__ of the sandbox's own: annotations are objects, as under `python main.py`.
    body = loop_agent.execute("def f(x: int) -> str: ...\nprint(f.__annotations__)")
    assert body["stdout"] == "{'x': <class 'int'>, 'return': <class 'str'>}\n"
    # A traceback holds the program's frames only, each with its source line.
    body = loop_agent.execute("def g():\n    return 1 / 0\ng()\n")
    lines = body["stderr"].splitlines()
    assert body["exit_code"] == 1 and lines[0] == "Traceback (most recent call last):", body
    assert [line.strip() for line in lines[1:] if not line.strip().startswith("~")] == [
        lines[1].strip(),
        "g()",
        lines[3].strip(),
        "return 1 / 0",
        "ZeroDivisionError: division by zero",
    ], body["stderr"]
    assert lines[1].endswith('main.py", line 3, in <module>') and lines[3].endswith('main.py", line 2, in g')
    # What the compiler says (a warning, an error) comes on the program's stderr, as Python says it.
    body = loop_agent.execute("x = 1\nprint(x is 1)")
    assert body["stdout"] == "True\n" and 'main.py:2: SyntaxWarning: "is" with a literal' in body["stderr"]
    body = loop_agent.execute("def f(:\n    pass")
    assert body["exit_code"] == 1 and body["stderr"].endswith("SyntaxError: invalid syntax\n")
    assert 'main.py", line 1\n' in body["stderr"]
    # After the main module: non-daemon threads are waited for, exit functions run, streams flushed.
    code = (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "sys.stdout.write('main ')\n"
    )
    assert loop_agent.execute(code)["stdout"] == "main thread\natexit\n"
    assert loop_agent.execute("import sys\nprint('x')\nsys.exit('bye')")["stderr"] == "bye\n"


def test_the_same_program_twice_is_each_time_its_own_file(loop_agent: Agent) -> None:
    """A program run again (the manager keeps its code object) names its own main file each time,
    in every code object of it, and its tracebacks read their lines from there."""
    code = (
        "import sys\n"
        "class C:\n"
        "    def m(self):\n"
        "        return [sys._getframe().f_code.co_filename for _ in (1,)]\n"
        "print(__file__, C().m()[0], C.m.__code__.co_filename)\n"
        "C.m(None)[5]\n"
    )
    files = set()
    for _ in range(2):
        body = loop_agent.execute(code)
        main, in_method, method = body["stdout"].split()
        assert main == in_method == method and main.endswith("/main.py"), body
        assert f'File "{main}", line 6, in <module>\n    C.m(None)[5]\n' in body["stderr"], body
        assert body["stderr"].endswith("IndexError: list index out of range\n")
        files.add(main)
    assert len(files) == 2


def test_the_zygote_holds_none_of_the_managers_modules(loop_agent: Agent) -> None:
    """The zygote is a fresh interpreter, not a fork of the manager: every module it holds is copied
    (page tables) into each action and torn down at its exit, so the manager's own (the fork
    server's loop, and for the C loop what the Python loop alone uses: socket, select, ctypes and
    isolation) must not be there. An action sees the zygote's modules as its own."""
    body = loop_agent.execute(
        "import sys\n"
        "print(sorted(m for m in ('arl_tangram.sandbox.forkserver', 'arl_tangram.sandbox.reaping',\n"
        "    'arl_tangram.sandbox.cores', 'arl_tangram.sandbox.isolation', 'ctypes', 'runpy',\n"
        "    'socket', 'select', 'selectors') if m in sys.modules))\n"
    )
    # The Python loop itself needs socket (which imports selectors), select, and ctypes (isolation).
    python_loop = "['arl_tangram.sandbox.isolation', 'ctypes', 'select', 'selectors', 'socket']"
    held = python_loop if loop_agent.loop == "python" else "[]"  # type: ignore[attr-defined]
    assert body["stdout"] == held + "\n", body


def test_timeouts_kill_the_tree(loop_agent: Agent) -> None:
    body = loop_agent.execute(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\ntime.sleep(600)",
        timeout_s=0.5,
    )
    assert body["status"] == "timeout"
    wait_until(lambda: processes_of(loop_agent.uids) == [], what="the action's processes to be gone")


def test_code_larger_than_one_datagram(loop_agent: Agent) -> None:
    lines = [f"x{i} = {i}" for i in range(20000)]  # about 200 KB: travels to the zygote in a memfd
    body = loop_agent.execute("\n".join([*lines, "print(x19999 + 1)"]))
    assert body["status"] == "ok" and body["stdout"] == "20000\n"
    # With its input too: the request then carries every descriptor it can (the memfd the last).
    body = loop_agent.execute("\n".join([*lines, "print(x19999 + int(input()))"]), stdin="5\n")
    assert body["status"] == "ok" and body["stdout"] == "20004\n", body


def test_a_session_interpreter_keeps_its_globals(loop_agent: Agent) -> None:
    sid = loop_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    assert loop_agent.execute("counter = 41", session_id=sid)["status"] == "ok"
    assert loop_agent.execute("counter += 1; print(counter)", session_id=sid)["stdout"] == "42\n"
    requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)


def test_unknown_fork_loop_is_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "sandbox-agent", "--fork-loop", "rust"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--fork-loop" in done.stderr and "invalid choice" in done.stderr


def _allowed(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_http_loop_and_fork_server_keep_to_disjoint_cores(loop_agent: Agent) -> None:
    agent_pid = loop_agent.proc.pid
    manager = [p for p in _children(agent_pid) if "forkserver" in _cmdline(p)]
    assert len(manager) == 1
    zygote = [p for p in _children(manager[0]) if "arl_tangram.sandbox.zygote" in _cmdline(p)]
    http, server = _allowed(agent_pid), _allowed(manager[0])
    assert http and server and not http & server
    assert http | server == set(os.sched_getaffinity(0))
    assert zygote and all(_allowed(z) == server for z in zygote)
    # The actions themselves run on their grants, wherever those are.
    cores = set(loop_agent.execute("import os; print(sorted(os.sched_getaffinity(0)))")["cores"])
    assert len(cores) == 1


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode(errors="replace")


@pytest.fixture()
def package_without_the_c_loop(tmp_path: Path) -> Path:
    """This package as an install without a C compiler has it: the same sources, no extension."""
    import arl_tangram

    top = tmp_path / "site"
    src = Path(arl_tangram.__file__).parent
    shutil.copytree(src, top / "arl_tangram", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return top


def test_asking_for_the_c_loop_where_it_is_not_built_fails_in_one_line(
    package_without_the_c_loop: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(package_without_the_c_loop)}
    root = package_without_the_c_loop / "work"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "arl_tangram", "sandbox-agent", "--listen", "127.0.0.1:0"),
            *("--fork-loop", "c", "--workdir-root", str(root)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=package_without_the_c_loop,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "tangram sandbox-agent: the fork server could not start: RuntimeError: --fork-loop c: the C fork "
        "loop is not built (No module named 'arl_tangram.sandbox._zygote')"
    )
    assert "Traceback" not in done.stderr
    assert not root.exists(), "a failed start leaves no workdir root behind"


def test_without_the_c_loop_auto_forks_from_python_and_says_so(
    package_without_the_c_loop: Path, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path / "work", env={"PYTHONPATH": str(package_without_the_c_loop)})
    try:
        iso = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["fork_loop"] == "python"
        assert any("the C fork loop is not built" in note for note in iso["notes"])
        assert agent.execute("print(6 * 7)")["stdout"] == "42\n"
    finally:
        stop_agent(agent)


def test_a_program_may_exit_with_any_status_the_sandboxs_own_included(loop_agent: Agent) -> None:
    """249 is the status a child whose set-up failed exits with, and it was read as such: a program's
    own `exit 249` came back `sandbox_error`, which the dispatcher retries and counts against its
    host (three in a row drained it). Set-up failure is told out of band now; any status is the
    program's, from Python, from what it execs and from a session's interpreter alike."""
    for code, runtime in (
        ("print(42)\nraise SystemExit(249)", "python"),
        ("import os; os._exit(249)", "python"),
        ("echo 42; exit 249", "bash"),
    ):
        body = loop_agent.execute(code, runtime=runtime)
        assert (body["status"], body["exit_code"]) == ("failed", 249), body
    session = loop_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        for _ in range(2):  # the session's interpreter restarts after the first
            body = loop_agent.execute("raise SystemExit(249)", session_id=session)
            assert (body["status"], body["exit_code"]) == ("failed", 249), body
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{session}", timeout=10)


def test_a_set_up_that_fails_is_still_the_sandboxs_error(tmp_path: Path) -> None:
    """The other side of the flag: a toolchain the action cannot execute is the sandbox's failure,
    not the program's, in both loops. Here the agent found `perl` in a directory of the host's /tmp,
    which an action, with a private /tmp of its own, cannot see."""
    perl = shutil.which("perl")
    if perl is None:
        pytest.skip("no perl here to stand in for a toolchain")
    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "perl"
    fake.write_text(f'#!/bin/sh\nexec {perl} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}
    for loop in ("c", "python"):
        agent = start_agent(tmp_path / f"work-{loop}", "--fork-loop", loop, env=env)
        try:
            body = agent.execute("print 6*7", runtime="perl")
            assert (body["status"], body["exit_code"]) == ("sandbox_error", 249), body
            assert "cannot execute" in str(body["stderr"]), body
            assert agent.execute("import sys; sys.exit(249)")["status"] == "failed"
        finally:
            stop_agent(agent)


def test_glibcs_own_signals_kill_as_they_do_outside(loop_agent: Agent) -> None:
    """Signals 32 and 33 were ignored in every action (the agent starts its zygote with posix_spawn,
    whose helper leaves them so, and ignored signals survive fork and exec): a program that sent
    itself one ran on where outside it dies."""
    body = loop_agent.execute("import os\nos.kill(os.getpid(), 33)\nprint('survived')")
    assert (body["exit_code"], body["stdout"]) == (-33, ""), body
    body = loop_agent.execute("kill -s 32 $$; echo alive", runtime="bash")
    assert (body["exit_code"], body["stdout"]) == (-32, ""), body
    status = loop_agent.execute("grep SigIgn /proc/self/status", runtime="bash")["stdout"]
    assert int(str(status).split()[1], 16) & (0b11 << 31) == 0, status


def test_a_program_leads_its_own_process_group_not_a_session(loop_agent: Agent) -> None:
    """It was a session's leader, so its setpgrp() failed (EPERM) where outside it works. It leads
    a process group of its own now: setpgrp() works, what it signals as its group (kill(0),
    `kill -- -$$`, killpg(getpgrp())) is its own and reaches it, never the agent. Its setsid()
    still fails, as a group leader's does outside (a group led by another process of its namespace
    would be its init's, PID 1, and killpg(1) is kill(-1))."""
    code = (
        "import os, signal\n"
        "print(os.getpgrp() == os.getpid(), os.getsid(0) != os.getpid())\n"
        "os.setpgrp(); print(os.getpgrp() == os.getpid())\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('got it'))\n"
        "os.killpg(os.getpgrp(), signal.SIGUSR1)\n"
    )
    body = loop_agent.execute(code)
    assert (body["status"], body["stdout"]) == ("ok", "True True\nTrue\ngot it\n"), body
    body = loop_agent.execute("trap 'echo caught' TERM; kill -TERM -- -$$; echo rc $?", runtime="bash")
    assert body["stdout"] == "caught\nrc 0\n", body
    body = loop_agent.execute(
        "import os\nif os.fork() == 0:\n    os.setsid()\n    os._exit(0)\nos.wait()\nprint('ok')"
    )
    assert (body["status"], body["stdout"]) == ("ok", "ok\n"), body
    body = loop_agent.execute("setsid -w sh -c 'echo in its own session'", runtime="bash")
    assert body["stdout"] == "in its own session\n", body
    body = loop_agent.execute("import os, signal\nos.kill(0, signal.SIGKILL)\nprint('alive')")
    assert (body["exit_code"], body["stdout"]) == (-9, ""), body
    assert loop_agent.execute("print('the agent lives')")["stdout"] == "the agent lives\n"


def test_no_action_reaches_another_actions_set_up_flag(loop_agent: Agent) -> None:
    """Each child's flag page was inherited by every child forked while it lived: a program could
    write 1 into a running action's page, and that action's own exit 249 came back sandbox_error
    (retried, counted against the host)."""
    import concurrent.futures

    forger = (
        "import ctypes\n"
        "n = 0\n"
        "for line in open('/proc/self/maps'):\n"
        "    f = line.split()\n"
        "    lo, hi = (int(x, 16) for x in f[0].split('-'))\n"
        "    if hi - lo == 4096 and f[1] == 'rw-s':\n"
        "        ctypes.c_ubyte.from_address(lo).value = 1\n"
        "        n += 1\n"
        "print(n)\n"
    )
    # The victim holds its slot until the test uploads `go` to its session, once the forger ran.
    sid = loop_agent.post("/v1/sessions", {}).json()["session_id"]
    files = f"{loop_agent.url}/v1/sessions/{sid}/files"
    gated = "touch started; while [ ! -e go ]; do sleep 0.01; done; exit 249"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            victim = pool.submit(loop_agent.execute, gated, runtime="bash", session_id=sid)
            wait_until(
                lambda: requests.get(f"{files}/started", timeout=10).status_code == 200,
                what="the victim to run",
            )
            assert loop_agent.execute(forger)["stdout"] == "0\n"
            assert requests.put(f"{files}/go", data=b"", timeout=10).status_code == 201
            body = victim.result()
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)
    assert (body["status"], body["exit_code"]) == ("failed", 249), body


def test_a_program_holds_no_descriptor_but_its_own(loop_agent: Agent) -> None:
    """Every descriptor a program starts with is its stdio (bash's own script descriptor besides),
    whether it runs in the child's process (Python) or by execve (bash): none of the zygote's, the
    agent's or another action's (a control socket, a pipe of the fork server) reaches it."""
    python = (
        "import os\n"
        "held = []\n"
        "for fd in range(3, 65536):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "    except OSError:\n"
        "        continue\n"
        "    held.append(fd)\n"
        "print(held)\n"
    )
    assert loop_agent.execute(python)["stdout"] == "[]\n"
    # ls reads the shell's descriptors from outside (a glob would count its own directory's).
    held = loop_agent.execute("ls /proc/$$/fd", runtime="bash")["stdout"]
    assert sorted(map(int, str(held).split())) == [0, 1, 2, 255], held
