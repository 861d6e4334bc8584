"""The agent's APIs end to end: a real agent process, real HTTP on loopback, real forked actions."""

from __future__ import annotations

import base64
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sandbox_agent_harness import SECRET, Agent, agent, processes_of, wait_until

__all__ = ["agent"]


def test_run_code_success_has_sandboxfusion_shape(agent: Agent) -> None:
    resp = agent.post("/run_code", {"code": "print(1+1)", "language": "python"})
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) >= {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert body["status"] == "Success"
    assert body["compile_result"] is None
    run = body["run_result"]
    assert set(run) >= {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert run["status"] == "Finished"
    assert run["return_code"] == 0
    assert run["stdout"] == "2\n"
    assert run["memory_limit_exceeded"] is False


def test_run_code_nonzero_exit_is_failed_but_finished(agent: Agent) -> None:
    body = agent.post(
        "/run_code", {"code": "import sys; print('x', file=sys.stderr); sys.exit(3)", "language": "python"}
    ).json()
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] == 3
    assert body["run_result"]["stderr"] == "x\n"


def test_run_code_timeout(agent: Agent) -> None:
    body = agent.post(
        "/run_code", {"code": "while True: pass", "language": "python", "run_timeout": 0.5}
    ).json()
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["outcome"] == "timeout"


def test_run_code_memory_limit_is_reported_explicitly(agent: Agent) -> None:
    body = agent.post(
        "/run_code", {"code": "x = bytearray(2 * 1024**3)", "language": "python", "memory_limit_MB": 128}
    ).json()
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["memory_limit_exceeded"] is True
    assert body["outcome"] == "memory_limit_exceeded"


@pytest.mark.parametrize(
    "code",
    [
        'raise ValueError("out of memory")',
        'import sys; print("std::bad_alloc, MemoryError", file=sys.stderr); sys.exit(1)',
        'print("out of memory" +',  # a SyntaxError echoes its source line
        'raise ValueError("Cannot allocate memory")',
        "x = 1\nwhat():  std::bad_alloc",
        "class NotEnoughMemoryError(Exception):\n    pass\nraise NotEnoughMemoryError('budget')",
    ],
)
def test_a_failure_that_speaks_of_memory_is_an_ordinary_failure(agent: Agent, code: str) -> None:
    """Only a runtime's own words for running out of memory, as a line of stderr begins them, make
    a failure memory_limit_exceeded; a program's own words anywhere did."""
    body = agent.post("/run_code", {"code": code, "language": "python"}).json()
    assert body["status"] == "Failed", body
    assert body["run_result"]["memory_limit_exceeded"] is False, body
    assert body["outcome"] == "failed", body


def test_a_runtimes_own_words_for_out_of_memory_are_out_of_memory(agent: Agent) -> None:
    """numpy's _ArrayMemoryError (a MemoryError by another name) and bash's xrealloc are what
    those runtimes say as they run out."""
    numpy = "import numpy as np\na = np.ones((40000, 40000))"
    body = agent.post("/run_code", {"code": numpy, "language": "python", "memory_limit_MB": 256}).json()
    assert (body["status"], body["outcome"]) == ("Failed", "memory_limit_exceeded"), body
    bash = 'x=$(head -c 600000000 /dev/zero | tr "\\0" a)'
    body = agent.post("/run_code", {"code": bash, "language": "bash", "memory_limit_MB": 256}).json()
    assert (body["status"], body["outcome"]) == ("Failed", "memory_limit_exceeded"), body
    # As a line of an exception group's traceback, too.
    group = "raise ExceptionGroup('tasks', [MemoryError()])"
    body = agent.post("/run_code", {"code": group, "language": "python", "memory_limit_MB": 256}).json()
    assert (body["status"], body["outcome"]) == ("Failed", "memory_limit_exceeded"), body


def test_run_code_files_stdin_and_fetch(agent: Agent) -> None:
    code = (
        "import sys\n"
        "data = open('in/data.txt').read()\n"
        "open('out.txt', 'w').write(data.upper() + sys.stdin.read())"
    )
    body = agent.post(
        "/run_code",
        {
            "code": code,
            "language": "python",
            "stdin": "!",
            "files": {"in/data.txt": base64.b64encode(b"hello").decode()},
            "fetch_files": ["out.txt", "missing.txt"],
        },
    ).json()
    assert body["status"] == "Success", body
    assert base64.b64decode(body["files"]["out.txt"]) == b"HELLO!"
    assert "missing.txt" not in body["files"]


def test_run_code_files_in_base64_with_line_breaks_are_written_and_garbage_is_refused(agent: Agent) -> None:
    """``base64.encodebytes`` (MIME) breaks lines every 76 characters; SandboxFusion decodes that,
    and so do we. What is neither base64 nor whitespace is a 400 that names the file."""
    data = bytes(range(256)) * 2
    code = "import sys\nsys.stdout.write(open('blob.bin', 'rb').read().hex())"
    files = {"blob.bin": base64.encodebytes(data).decode()}
    assert "\n" in files["blob.bin"].rstrip()
    body = agent.post("/run_code", {"code": code, "language": "python", "files": files}).json()
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == data.hex()
    resp = agent.post("/run_code", {"code": "pass", "language": "python", "files": {"x.txt": "aGk*"}})
    assert resp.status_code == 400
    assert "x.txt" in resp.json()["message"] and "base64" in resp.json()["message"]


@pytest.mark.parametrize(
    "names",
    # (``lib\\v.h`` is another file than ``lib/v.h``: on Linux a backslash is part of a name.)
    [("main.py", "./main.py"), ("lib/v.h", "lib/./v.h"), ("lib/v.h", "lib//v.h"), ("a.txt", "a.txt/")],
)
def test_two_names_of_one_file_are_refused(agent: Agent, names: tuple[str, str]) -> None:
    """Two entries that name one file were written in turn, the later winning: ``./main.c`` beat the
    request's own code, and a build cached under one order was served for the other. Refused, with
    the file named, before anything runs."""
    files = {name: base64.b64encode(f"print({i})".encode()).decode() for i, name in enumerate(names)}
    resp = agent.post("/run_code", {"code": "print('code')", "language": "python", "files": files})
    assert resp.status_code == 400, resp.text
    assert "same file" in resp.json()["message"] and repr(names[1]) in resp.json()["message"], resp.text


def test_run_code_bash_and_unknown_language(agent: Agent) -> None:
    body = agent.post("/run_code", {"code": "echo $((6*7))", "language": "bash"}).json()
    assert body["run_result"]["stdout"] == "42\n"
    resp = agent.post("/run_code", {"code": "x", "language": "cobol"})
    # SandboxFusion's answer to a name it does not know: request validation (more in
    # test_sandbox_languages.py).
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "language"]
    assert "cobol" in resp.json()["message"]
    assert resp.json()["status"] == "SandboxError"


def test_bash_code_leaves_the_files_a_program_names_main_sh_alone(agent: Agent) -> None:
    """The code runs from a file of the agent's, named as no program names its own: a request's
    ``main.sh``, a session's from an earlier action, and one the script writes to run next are the
    program's (the code as ``main.sh`` ran itself until the process limit, or rewrote itself while
    bash read it and stopped)."""
    script = base64.b64encode(b"echo from-the-file\n").decode()
    body = agent.post(
        "/run_code", {"code": "bash main.sh", "language": "bash", "files": {"main.sh": script}}
    ).json()
    assert (body["status"], body["run_result"]["stdout"]) == ("Success", "from-the-file\n"), body
    writes = "cat > main.sh <<'EOF'\necho written\nEOF\nbash main.sh\necho done\n"
    body = agent.post("/run_code", {"code": writes, "language": "bash"}).json()
    assert (body["status"], body["run_result"]["stdout"]) == ("Success", "written\ndone\n"), body
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        agent.execute("printf 'echo kept\\n' > main.sh", runtime="bash", session_id=sid)
        assert agent.execute("bash main.sh", runtime="bash", session_id=sid)["stdout"] == "kept\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to grant two")
def test_pytest_runtime_gets_its_dop_from_the_core_grant(agent: Agent) -> None:
    code = (
        "import os\n"
        "def test_dop():\n"
        "    assert os.environ['TANGRAM_DOP'] == '2'\n"
        "    assert len(os.sched_getaffinity(0)) == 2\n"
        "    assert 'PYTEST_XDIST_WORKER' not in os.environ\n"  # one file: nothing to share out
        "def test_other():\n"
        "    assert 1 + 1 == 2\n"
    )
    body = agent.execute(code, runtime="pytest", ncores=2, timeout_s=60)
    assert body["status"] == "ok", body["stdout"]
    assert "2 passed" in str(body["stdout"])
    # Files named in args run in parallel, one worker per file at a time.
    in_workers = (
        "import os\ndef test_in_a_worker():\n    assert os.environ['PYTEST_XDIST_WORKER_COUNT'] == '2'\n"
    )
    more = {"test_more.py": base64.b64encode(in_workers.encode()).decode()}
    body = agent.execute(
        in_workers, runtime="pytest", ncores=2, timeout_s=60, files=more, args=["test_more.py"]
    )
    assert body["status"] == "ok", body["stdout"]
    assert "2 passed" in str(body["stdout"])
    # Tests of one file that share module state pass with two cores, as under plain pytest: the
    # file's tests stay in one worker, in order.
    shared = "state = []\ndef test_a():\n    state.append(1)\ndef test_b():\n    assert state == [1]\n"
    body = agent.execute(shared, runtime="pytest", ncores=2, timeout_s=60)
    assert body["status"] == "ok", body["stdout"]
    body = agent.execute("def test_fails():\n    assert 1 == 2\n", runtime="pytest", timeout_s=60)
    assert body["status"] == "failed"
    assert "1 failed" in str(body["stdout"])


def test_native_execute_reports_cores_uid_and_fresh_workdir(agent: Agent) -> None:
    code = (
        "import json, os\n"
        "print(json.dumps([os.getuid(), sorted(os.sched_getaffinity(0)), os.listdir('.'), os.getcwd()]))"
    )
    first = agent.execute(code, cores=[0])
    second = agent.execute(code, cores=[0])
    assert first["status"] == "ok"
    assert first["cores"] == [0]
    uid, cores, listing, cwd = json.loads(str(first["stdout"]))
    assert uid in agent.uids  # non-root, from this agent's range
    assert cores == [0]  # exactly the granted core
    # A fresh workdir per action: a different directory, holding only the program's own file
    # (as under SandboxFusion, whose script lies in the directory it runs in).
    assert listing == ["main.py"]
    assert cwd != json.loads(str(second["stdout"]))[3]


def test_actions_run_with_no_new_privileges(agent: Agent) -> None:
    # Set once in the fork server and inherited: an action (and what it executes) cannot gain
    # privileges through a set-uid program.
    code = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('NoNewPrivs')])"
    for runtime in ("python", "bash"):
        body = code if runtime == "python" else "grep NoNewPrivs /proc/self/status"
        result = agent.execute(body, runtime=runtime)
        assert result["status"] == "ok", result
        assert "1" in str(result["stdout"]) and "0" not in str(result["stdout"]), result


def test_foreign_core_grant_is_rejected(agent: Agent) -> None:
    resp = agent.post("/v1/execute", {"code": "print(1)", "cores": [4096]})
    assert resp.status_code == 400
    assert resp.json()["field"] == "cores"


STACK_SCAN = """
import ctypes, os
print(sorted(os.environ))
stack = b''
for line in open('/proc/self/maps'):
    if '[stack]' in line:
        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
        stack = ctypes.string_at(lo, hi - lo)
print('environ', PROBE in open('/proc/self/environ', 'rb').read())
print('stack', len(stack), PROBE in stack)
"""


def test_environment_is_scrubbed_even_in_memory(agent: Agent) -> None:
    # /proc/self/environ (the action's own to read, as outside) and the process's own stack hold the
    # environment its first ancestor started with: that is the fork server's, never the agent's.
    code = f"PROBE = {SECRET.encode()!r}\n" + STACK_SCAN
    body = agent.execute(code)
    assert body["status"] == "ok", body["stderr"]
    out = str(body["stdout"])
    assert "TANGRAM_DOP" in out
    assert "TANGRAM_AGENT_TOKEN_PROBE" not in out
    assert "KUBECONFIG" not in out
    assert out.splitlines()[-2] == "environ False"
    assert out.splitlines()[-1].startswith("stack ")
    assert out.splitlines()[-1].endswith(" False")


def test_sessions_keep_state_and_files_and_are_isolated(agent: Agent) -> None:
    a = agent.post("/v1/sessions", {"persistent": True}).json()
    b = agent.post("/v1/sessions", {}).json()
    sid_a, sid_b = a["session_id"], b["session_id"]
    try:
        assert (
            agent.execute("x = 41\nopen('secret.txt', 'w').write('a-only')", session_id=sid_a)["status"]
            == "ok"
        )
        again = agent.execute("x += 1\nimport os\nprint(x, os.getcwd())", session_id=sid_a)
        value, workdir_a = str(again["stdout"]).split()
        assert value == "42"
        # Upload / download through the native file API.
        put = requests.put(f"{agent.url}/v1/sessions/{sid_b}/files/dir/in.txt", data=b"payload", timeout=10)
        assert put.status_code == 201
        assert agent.execute("print(open('dir/in.txt').read())", session_id=sid_b)["stdout"] == "payload\n"
        got = requests.get(f"{agent.url}/v1/sessions/{sid_a}/files/secret.txt", timeout=10)
        assert got.content == b"a-only"
        # Session b cannot read session a's files.
        probe = agent.execute(
            f"try:\n    print(open({workdir_a + '/secret.txt'!r}).read())\n"
            "except OSError as e:\n    print(type(e).__name__)",
            session_id=sid_b,
        )
        assert probe["stdout"] == "PermissionError\n"
        state = requests.get(f"{agent.url}/v1/sessions/{sid_a}", timeout=10).json()
        assert state["actions"] == 2
        assert state["memory"]["interpreter_rss_kb"] > 0
        assert state["memory"]["workdir_bytes"] == len("a-only")
        # A timeout kills the interpreter; the next call gets a fresh one and says so.
        assert agent.execute("while True: pass", session_id=sid_a, timeout_s=0.5)["status"] == "timeout"
        after = agent.execute("print('x' in globals())", session_id=sid_a)
        assert after["stdout"] == "False\n"
        assert after["interpreter_restarted"] is True
    finally:
        for sid in (sid_a, sid_b):
            assert requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10).status_code == 200
    assert requests.get(f"{agent.url}/v1/sessions/{sid_a}", timeout=10).status_code == 400
    wait_until(lambda: processes_of(agent.uids) == [], what="session processes to end")
    # Closing detaches the workdir (or hands it to the janitor thread, where it is a plain
    # directory): wait for it. Named "s<n>", never by the session's id.
    wait_until(
        lambda: not any(n.startswith("s") for n in os.listdir(agent.root)), what="session workdirs removed"
    )


def test_each_session_call_runs_from_its_own_main_file(agent: Agent) -> None:
    """Under ``python main.py`` a program never finds an earlier program's file beside it: each
    call of a session runs from ``main.py``, gone when the call ends (the files piled up as
    ``main_.py``, ``main__.py``, and from the fourth call ``__file__`` was undefined)."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        agent.execute("open('kept.txt', 'w').write('x')", session_id=sid)
        for _ in range(5):
            got = agent.execute(
                "import os\nprint(os.path.basename(__file__), sorted(os.listdir('.')))", session_id=sid
            )
            assert got["status"] == "ok", got
            assert got["stdout"] == "main.py ['kept.txt', 'main.py']\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_sessions_own_files_are_never_taken_for_a_calls_code(agent: Agent) -> None:
    """A file the session holds under the name a runtime writes its code to (a helper the tests
    import, uploaded first) is the session's: the call's code goes beside it, and is gone after the
    call. The helper was overwritten with the test code, and a notebook's call removed the
    session's files of the driver's names."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    url = f"{agent.url}/v1/sessions/{sid}/files"
    try:
        for name, body in (
            ("test_solution.py", b"HELPER = 42\n"),
            (".tangram-notebook.json", b"{}"),
            (".tangram-jupyter-keep.txt", b"kept"),
            (".tangram-main.sh", b"echo mine\n"),
        ):
            assert requests.put(f"{url}/{name}", data=body, timeout=10).status_code == 201
        test = "from test_solution import HELPER\n\ndef test_helper():\n    assert HELPER == 42\n"
        ran = agent.post("/v1/execute", {"runtime": "pytest", "code": test, "session_id": sid}).json()
        assert ran["status"] == "ok", ran
        notebook = json.dumps({"cells": ["1 + 1"]})
        ran = agent.post("/v1/execute", {"runtime": "jupyter", "code": notebook, "session_id": sid}).json()
        assert ran["status"] == "ok", ran
        listed = agent.post(
            "/v1/execute", {"runtime": "bash", "code": "ls -A | sort | tr '\\n' ' '", "session_id": sid}
        ).json()
        assert listed["stdout"] == (
            ".pytest_cache .tangram-jupyter-keep.txt .tangram-main.sh .tangram-main_.sh "
            ".tangram-notebook.json test_solution.py "
        ), listed
        for name, body in (
            ("test_solution.py", b"HELPER = 42\n"),
            (".tangram-notebook.json", b"{}"),
            (".tangram-jupyter-keep.txt", b"kept"),
            (".tangram-main.sh", b"echo mine\n"),
        ):
            assert requests.get(f"{url}/{name}", timeout=10).content == body
        # The bash call's own file (it listed itself) went with the call, as the others did.
        for name in (".tangram-main_.sh", "test_solution_.py", ".tangram-notebook_.json"):
            assert requests.get(f"{url}/{name}", timeout=10).status_code == 404
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


@pytest.mark.parametrize("persistent", [False, True])
def test_closing_a_session_cancels_its_running_call(agent: Agent, persistent: bool) -> None:
    """A session closed while a call of it runs ends that call (its processes killed) and closes at
    once, as a kernel's shutdown does: the close waited for the call to reach its timeout, and a
    call of a plain session ran on to the end, writing into the closed session's workdir."""
    sid = agent.post("/v1/sessions", {"persistent": persistent}).json()["session_id"]
    code = "import time\nwhile True:\n    open('beat', 'a').write('.')\n    time.sleep(0.05)\n"
    with ThreadPoolExecutor(2) as pool:
        call = pool.submit(agent.execute, code, session_id=sid, timeout_s=120)
        wait_until(lambda: processes_of(agent.uids) != [], what="the call to be running")
        closed = pool.submit(requests.delete, f"{agent.url}/v1/sessions/{sid}", timeout=110)
        result = call.result(timeout=110)
        assert closed.result().status_code == 200
    assert result["status"] == "cancelled", result
    wait_until(lambda: processes_of(agent.uids) == [], what="the session's processes to end")


def test_file_api_refuses_escapes(agent: Agent) -> None:
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        agent.execute("import os; os.symlink('/etc/passwd', 'link')", session_id=sid)
        got = requests.get(f"{agent.url}/v1/sessions/{sid}/files/link", timeout=10)
        assert got.status_code == 404  # a symlink is never followed out of the workdir
        bad = requests.get(f"{agent.url}/v1/sessions/{sid}/files/..%2F..%2Fetc%2Fpasswd", timeout=10)
        assert bad.status_code in (400, 404)
        resp = agent.post("/v1/execute", {"code": "1", "files": {"../x": ""}})
        assert resp.status_code == 400
        assert "leaves the working directory" in resp.json()["error"]
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_session_ttl_expires(tmp_path_factory: object) -> None:
    from sandbox_agent_harness import start_agent, stop_agent

    root = tmp_path_factory.mktemp("ttl") / "work"  # type: ignore[attr-defined]
    short = start_agent(root)
    try:
        sid = short.post("/v1/sessions", {"ttl_s": 0.2}).json()["session_id"]
        wait_until(
            lambda: requests.get(f"{short.url}/v1/sessions/{sid}", timeout=10).status_code == 400,
            what="the session to expire",
        )
    finally:
        stop_agent(short)


def test_health_and_metrics(agent: Agent) -> None:
    health = requests.get(agent.url + "/v1/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["isolation"]["pid_namespace"] is True
    assert health["isolation"]["network_namespace"] is True
    agent.execute("print(1)")
    text = requests.get(agent.url + "/metrics", timeout=10).text
    assert 'tangram_sandbox_actions_total{api="native",outcome="ok",runtime="python"}' in text
    assert "tangram_sandbox_cores " in text
    assert requests.get(agent.url + "/v1/ping", timeout=10).json() == "pong"  # SandboxFusion's JSON string


def test_bad_requests_get_clear_errors(agent: Agent) -> None:
    resp = requests.post(agent.url + "/run_code", data=b'{"code": ', timeout=10)
    assert resp.status_code == 400
    assert "malformed JSON" in resp.json()["message"]
    resp = agent.post("/run_code", {"code": 123, "language": "python"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["code"]
    resp = agent.post("/v1/execute", {"code": "1", "timeout_s": "soon"})
    assert resp.status_code == 422
    resp = agent.post("/v1/execute", [1, 2])
    assert resp.status_code == 422
    resp = agent.post("/v1/execute", {"code": "1", "runtime": "fortran"})
    assert resp.status_code == 400
    assert "fortran" in resp.json()["error"]
    big = b'{"code": "' + b"x" * (64 << 20) + b'"}'
    resp = requests.post(agent.url + "/run_code", data=big, timeout=60)
    assert resp.status_code == 413
    assert resp.json()["status"] == "SandboxError"
    assert agent.healthy()


def test_output_below_the_cap_arrives_whole(agent: Agent) -> None:
    code = (
        "import sys\nfor i in range(300):\n    sys.stdout.write(str(i % 10) * 3000)\nprint(file=sys.stderr)"
    )
    body = agent.execute(code)
    assert body["status"] == "ok"
    assert body["stdout_truncated"] is False
    assert len(str(body["stdout"])) == 900_000
    assert body["stderr"] == "\n"


def _running_actions(uids: range) -> dict[int, set[int]]:
    """uid -> cores allowed, for every live action process right now."""
    seen: dict[int, set[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                status = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        uid = int(status["Uid"].split()[0])
        if uid not in uids or status["State"].strip().startswith("Z"):
            continue
        cores: set[int] = set()
        for part in status["Cpus_allowed_list"].strip().split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        seen.setdefault(uid, set()).update(cores)
    return seen


def test_concurrent_actions_never_share_a_core(agent: Agent) -> None:
    host_cores = set(os.sched_getaffinity(0))
    busy = "import time\nend = time.time() + 0.3\nwhile time.time() < end:\n    pass\nprint('done')"
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(agent.execute, busy, ncores=1) for _ in range(8)]
        samples = 0
        while not all(f.done() for f in futures):
            running = _running_actions(agent.uids)
            cores = [c for cs in running.values() for c in cs]
            assert len(cores) == len(set(cores)), f"two actions share a core: {running}"
            assert set(cores) <= host_cores
            samples += 1
        results = [f.result() for f in futures]
    assert samples > 0
    assert all(r["stdout"] == "done\n" and len(r["cores"]) == 1 for r in results)  # type: ignore[arg-type]


def test_a_persistent_interpreter_runs_each_call_on_that_calls_cores(agent: Agent) -> None:
    """The interpreter is forked once, but each call is granted its own cores: it must run on them
    (and see them in TANGRAM_CORES), not on the first call's, which may be another action's now."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to grant different ones")
    sid = agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    probe = "import os\nprint(sorted(os.sched_getaffinity(0)), os.environ['TANGRAM_CORES'])"
    try:
        for core in (0, 1, 0):
            body = agent.execute(probe, session_id=sid, cores=[core])
            assert body["cores"] == [core]
            assert body["stdout"] == f"[{core}] {core}\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_a_persistent_interpreter_has_the_sessions_memory_limit(agent: Agent) -> None:
    """The interpreter is limited once, when its first call starts it: a call may not give it
    another limit (the first one used to set it for the whole session)."""
    sid = agent.post("/v1/sessions", {"persistent": True, "memory_mb": 256}).json()["session_id"]
    try:
        resp = agent.post("/v1/execute", {"code": "1", "session_id": sid, "memory_mb": 4096})
        assert resp.status_code == 400, resp.text
        assert resp.json()["field"] == "memory_mb"
        probe = "import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)"
        # The session's 256 MB, plus what its fork of the zygote starts with beyond a fresh
        # interpreter (executor._limits): never the call's 4096.
        limit = int(str(agent.execute(probe, session_id=sid, memory_mb=256)["stdout"]))
        assert 256 <= limit < 256 + 64, limit
        # Plain actions of the session run in their own process and may set their own limit (a
        # program beyond Python: on what it writes, its data).
        bash = agent.execute("ulimit -d", runtime="bash", session_id=sid, memory_mb=512)
        assert bash["stdout"] == f"{512 * 1024}\n"
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=10)


def test_out_of_memory_said_after_much_output_is_out_of_memory(agent: Agent) -> None:
    """Go's fatal error comes after what the program wrote: behind 6 KB of its own stderr it was
    past the first and last 4 KB that were read."""
    if shutil.which("go") is None:
        pytest.skip("go: 'go' not found on PATH")
    go = (
        'package main\nimport ("fmt"; "os"; "strings")\n'
        'func main(){ fmt.Fprintln(os.Stderr, strings.Repeat("x", 6000))\n'
        "  b := make([]byte, 2<<30); for i := range b { b[i] = 1 }; fmt.Println(len(b)) }\n"
    )
    body = agent.post("/run_code", {"code": go, "language": "go", "memory_limit_MB": 256}).json()
    assert (body["status"], body["outcome"]) == ("Failed", "memory_limit_exceeded"), body
