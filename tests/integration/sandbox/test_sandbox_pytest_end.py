"""A ``pytest`` program ends as under ``pytest FILE`` outside, as SandboxFusion runs it: each case's
return code through ``/run_code`` is the one a plain run in a fresh directory gives, with the same
request files.

Real actions in a real agent (both fork loops), against a real pytest outside. Each case ended
otherwise here: the agent ran ``pytest -q -p no:cacheprovider -n 0 test_solution.py``, whose
options the program saw, wrote the code over a request file of the same name, and then ran
``python -m pytest``, which put the working directory first on the path as pytest started.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import Agent

PASSING = "def test_x():\n    assert True\n"
CASES: dict[str, tuple[str, dict[str, str]]] = {
    "the cache fixture": (
        "def test_cache(cache):\n    cache.set('k', 1)\n    assert cache.get('k', 0) == 1\n",
        {},
    ),
    "an ini asking for the last failures": (PASSING, {"pytest.ini": "[pytest]\naddopts = --lf\n"}),
    "an ini turning xdist off": (PASSING, {"pytest.ini": "[pytest]\naddopts = -p no:xdist\n"}),
    "the default verbosity": (
        "def test_verbose(pytestconfig):\n    assert pytestconfig.getoption('verbose') == 0\n",
        {},
    ),
    "a helper named as the agent's test file": (
        "from test_solution import twice\n\ndef test_twice():\n    assert twice(21) == 42\n",
        {"test_solution.py": "def twice(x):\n    return 2 * x\n"},
    ),
    # TMPDIR was the workdir: temporary files and pytest's tmp_path were in the program's listing
    # of its own directory.
    "temporary files outside the working directory": (
        "import glob, os, tempfile\n\n"
        "def test_tmp(tmp_path):\n"
        "    kept = tempfile.NamedTemporaryFile(suffix='.txt')\n"
        "    assert glob.glob('*.txt') == [] and tempfile.gettempdir() == '/tmp'\n"
        "    assert str(tmp_path).startswith('/tmp/')\n"
        "    left = [n for n in os.listdir('.') if n.startswith(('pytest-of', 'tmp'))]\n"
        "    assert [n for n in left if not n.endswith('.py')] == []\n",
        {},
    ),
    "a failing test still fails": ("def test_no():\n    assert 1 == 2\n", {}),
    # Run as ``python -m pytest``, the working directory led the path as pytest started: a helper
    # named as a module pytest imports then (``code``, through pdb) was imported in the standard
    # library's place and the test passed, where ``pytest`` has the standard one and fails to
    # collect the test (exit 2) ...
    "a helper named as a module pytest imports at start": (
        "from code import solve\n\ndef test_solve():\n    assert solve() == 1\n",
        {"code.py": "def solve():\n    return 1\n"},
    ),
    # ... or broke pytest itself (``textwrap`` without ``dedent``: an internal error, exit 1 or 3) ...
    "a helper shadowing a module pytest needs": (
        "from textwrap import hello\n\ndef test_hello():\n    assert hello() == 1\n",
        {"textwrap.py": "def hello():\n    return 1\n"},
    ),
    # ... and a helper was found under ``--import-mode=importlib``, which puts no test's directory
    # on the path: ``pytest`` fails to collect the test.
    "a helper out of reach under the importlib import mode": (
        "from helper import hello\n\ndef test_hello():\n    assert hello() == 1\n",
        {
            "helper.py": "def hello():\n    return 1\n",
            "pytest.ini": "[pytest]\naddopts = --import-mode=importlib\n",
        },
    ),
}

# Cases that fail outside, and so must fail here.
FAILING = {
    "a failing test still fails",
    "a helper named as a module pytest imports at start",
    "a helper shadowing a module pytest needs",
    "a helper out of reach under the importlib import mode",
}


# Cases that hold where each action has a /tmp of its own (the agent as root, mount namespaces).
OWN_TMP_ONLY = {"temporary files outside the working directory"}


def _outside(code: str, files: dict[str, str], tmp_path: Path) -> int:
    """``pytest <file>`` in a fresh directory holding the request's files (SandboxFusion's file
    name is a temporary one, never a request file's), by pytest's console script beside this
    Python, as SandboxFusion runs it: not ``python -m pytest``, which puts the directory first on
    the path."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "tmpq8v1x2zb.py").write_text(code)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path)}
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "pytest"), "tmpq8v1x2zb.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    return done.returncode


@pytest.mark.parametrize("name", list(CASES))
def test_a_pytest_program_ends_as_under_pytest(loop_agent: Agent, name: str, tmp_path: Path) -> None:
    code, files = CASES[name]
    if name in OWN_TMP_ONLY:
        iso = requests.get(loop_agent.url + "/v1/health", timeout=10).json()["isolation"]
        if not (iso["private_tmp"] and iso["per_action_uid"]):
            pytest.skip("no private /tmp per action here: TMPDIR stays the working directory")
    want = _outside(code, files, tmp_path)
    encoded = {n: base64.b64encode(t.encode()).decode() for n, t in files.items()}
    resp = loop_agent.post(
        "/run_code", {"code": code, "language": "pytest", "files": encoded, "run_timeout": 60}
    )
    assert resp.status_code == 200, resp.text
    run = resp.json()["run_result"]
    assert run["return_code"] == want, (name, want, run)
    assert (want == 0) == (name not in FAILING), (name, want)
