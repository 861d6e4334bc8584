"""``/run_jupyter``, SandboxFusion's notebook call, against a real agent and called with
SandboxFusion's own client (``sandbox_fusion.run_jupyter``): cells run one after another in a real
IPython kernel started for the call, inside the sandbox.

The first cases are SandboxFusion's own tests of its ``/run_jupyter`` (its
``sandbox/tests/runners/test_jupyter.py``): a cell's print, an expression's display, a raise that
does not stop the cells after it, a plot. The rest are what a notebook user expects besides, and
what a hostile cell must not do: forge the answer's cells, or outlive the call.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import sandbox_fusion
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent, wait_until, workdirs
from sandbox_fusion import RunJupyterRequest, RunJupyterResponse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("jupyter") / "work", "--max-timeout", "60")
    yield running
    stop_agent(running)


def _notebook(agent: Agent, cells: list[str], **fields: Any) -> RunJupyterResponse:
    """The notebook's answer as SandboxFusion's client reads it (it raises on SandboxError)."""
    request = RunJupyterRequest(cells=cells, **fields)
    return sandbox_fusion.run_jupyter(request, endpoint=agent.url, max_attempts=1, client_timeout=120)


def test_a_cell_prints(agent: Agent) -> None:
    answer = _notebook(agent, ["print(123)"])
    assert answer.status == "Success"
    assert answer.cells[0].stdout == "123\n"


def test_cells_share_one_kernel_and_an_expression_is_displayed(agent: Agent) -> None:
    answer = _notebook(agent, ['a = "hello"', "a", "print(a)"])
    assert answer.cells[0].stdout == ""
    assert answer.cells[1].display[0]["text/plain"] == "'hello'"
    assert answer.cells[2].stdout == "hello\n"


def test_a_raising_cell_is_data_and_the_next_cells_run(agent: Agent) -> None:
    answer = _notebook(
        agent,
        [
            'a = "hello"',
            'import sys\nsys.stderr.write("This is an error message\\n")',
            "assert False",
            "print(a)",
        ],
    )
    assert answer.status == "Success"
    assert answer.cells[0].stdout == ""
    assert answer.cells[1].stderr == "This is an error message\n"
    assert answer.cells[2].error[0]["ename"] == "AssertionError"
    assert answer.cells[3].stdout == "hello\n"


def test_a_plot_is_displayed_as_an_image(agent: Agent) -> None:
    plot = "plt.plot([1, 2, 3], [2, 3, 5])\nplt.title('Simple Plot')\nplt.show()"
    answer = _notebook(agent, ["import matplotlib.pyplot as plt", plot])
    png = base64.b64decode(answer.cells[1].display[0]["image/png"])
    assert png.startswith(b"\x89PNG")


def test_shell_escapes_magics_and_a_subprocess_write_to_the_cells_streams(agent: Agent) -> None:
    answer = _notebook(
        agent, ["!echo from-shell", "%time x = 1", "import os\nos.system('echo from-child >&2')"]
    )
    assert "from-shell" in answer.cells[0].stdout
    assert "Wall time" in answer.cells[1].stdout
    assert "from-child" in answer.cells[2].stderr


def test_files_go_in_and_come_back_and_the_workdir_holds_only_the_requests(agent: Agent) -> None:
    data = base64.b64encode(b"ab").decode()
    answer = _notebook(
        agent,
        [
            "import os\nsorted(n for n in os.listdir('.') if not n.startswith('.tangram-jupyter-'))",
            "open('out.txt', 'w').write(open('in.txt').read() * 2)",
        ],
        files={"in.txt": data},
        fetch_files=["out.txt"],
    )
    assert answer.status == "Success"
    # The notebook's own config was read and removed before the first cell: a cell sees what the
    # request put there, and the kernel's runtime directory.
    assert answer.cells[0].display[0]["text/plain"] == "['in.txt']"
    assert base64.b64decode(answer.files["out.txt"]) == b"abab"


def test_input_fails_in_the_cell_as_in_a_frontend_without_stdin(agent: Agent) -> None:
    answer = _notebook(agent, ["input()", "print('after')"])
    assert answer.cells[0].error[0]["ename"] == "StdinNotImplementedError"
    assert answer.cells[1].stdout == "after\n"


def test_a_cell_over_its_cell_timeout_is_interrupted_and_the_next_runs(agent: Agent) -> None:
    answer = _notebook(
        agent, ["import time\ntime.sleep(30)", "print('next')"], cell_timeout=1, total_timeout=30
    )
    assert answer.status == "Success"
    assert answer.cells[0].error[0]["ename"] == "KeyboardInterrupt"
    assert answer.cells[1].stdout == "next\n"


def test_the_total_timeout_ends_the_notebook(agent: Agent) -> None:
    answer = _notebook(agent, ["import time\ntime.sleep(60)", "print('never')"], total_timeout=2)
    assert answer.status == "Failed"
    assert answer.driver is not None and answer.driver.status == "TimeLimitExceeded"
    assert answer.cells == []
    assert "total_timeout" in answer.message


def test_a_kernel_that_dies_fails_the_notebook_saying_so(agent: Agent) -> None:
    answer = _notebook(agent, ["import os\nos._exit(3)", "print('never')"])
    assert answer.status == "Failed"
    assert answer.message == "cell 1: the kernel died"


FORGED = (
    '{"status": "Finished", "message": "", '
    '"cells": [{"stdout": "forged", "stderr": "", "display": [], "error": []}]}'
)


def test_a_request_file_does_not_choose_the_kernel(agent: Agent) -> None:
    """HOME is the workdir: a request file where Jupyter looks for a user's kernels named the
    command started as the kernel (here one that leaves a mark, then starts the real one)."""
    start = "echo x > marked.txt; exec python -m ipykernel_launcher -f {connection_file}"
    spec = {"argv": ["/bin/sh", "-c", start], "display_name": "Python 3", "language": "python"}
    where = ".local/share/jupyter/kernels/python3/kernel.json"
    files = {where: base64.b64encode(json.dumps(spec).encode()).decode()}
    answer = _notebook(agent, ["import os\nos.path.exists('marked.txt')"], files=files)
    assert answer.status == "Success", answer
    assert answer.cells[0].display[0]["text/plain"] == "False"


def test_a_cell_cannot_forge_the_answer(agent: Agent) -> None:
    """The driver's answer is its stdout: a cell writing JSON to its own descriptors writes its own
    stream, and one writing to the driver's (``/proc/<driver>/fd/1``) is refused."""
    own = f"import os\nos.write(1, b{FORGED!r} + b'\\n')"
    drivers = f"import os\nopen(f'/proc/{{os.getppid()}}/fd/1', 'w').write({FORGED!r})"
    answer = _notebook(agent, [own, drivers, "print('last')"])
    assert answer.status == "Success"
    assert len(answer.cells) == 3
    assert FORGED in answer.cells[0].stdout
    assert answer.cells[1].error[0]["ename"] == "PermissionError"
    assert answer.cells[2].stdout == "last\n"


def test_a_cell_that_kills_the_driver_gets_no_answer_but_a_failure(agent: Agent) -> None:
    answer = _notebook(agent, ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"])
    assert answer.status == "Failed"
    assert answer.cells == []


def test_nothing_a_notebook_started_outlives_it(agent: Agent) -> None:
    answer = _notebook(
        agent, ["import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)"]
    )
    assert answer.status == "Success"
    wait_until(lambda: processes_of(agent.uids) == [], what="no process of an action's uid")
    wait_until(lambda: workdirs(agent) == [], what="no workdir left")


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"cells": "print(1)"}, "cells"),
        ({"cells": ["1"], "kernel": "julia"}, "kernel"),
        ({"cells": ["1"], "total_timeout": 0}, "total_timeout"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(agent: Agent, body: dict[str, Any], names: str) -> None:
    resp = requests.post(agent.url + "/run_jupyter", json=body, timeout=30)
    assert resp.status_code == 422
    assert resp.json()["status"] == "SandboxError"
    assert names in resp.json()["message"]


def test_the_kernels_start_is_not_the_cells_time_and_no_cell_timeout_is_none(agent: Agent) -> None:
    """``total_timeout`` is the cells' time: the kernel's start (about a second) has the 10 s beyond
    it, as SandboxFusion's driver has. A ``cell_timeout`` of 0 or less limits nothing, as there."""
    answer = _notebook(
        agent, ["import time\ntime.sleep(1.0)\nprint('slept')"], total_timeout=1.5, cell_timeout=-1
    )
    assert answer.status == "Success", answer.message
    assert answer.cells[0].stdout == "slept\n"


def test_the_native_runtime_takes_the_notebook_as_its_code(agent: Agent) -> None:
    notebook = {"cells": ["x = 2", "print(x ** 10)"], "total_timeout": 20}
    ran = agent.execute(json.dumps(notebook), runtime="jupyter", timeout_s=60)
    assert ran["status"] == "ok", ran
    answer = json.loads(str(ran["stdout"]))
    assert answer["status"] == "Finished" and answer["cells"][1]["stdout"] == "1024\n"
    # With no total, the cells get the action's timeout less the kernel's start and stop.
    untimed = agent.execute(json.dumps({"cells": ["print('t')"]}), runtime="jupyter", timeout_s=20)
    assert json.loads(str(untimed["stdout"]))["cells"][0]["stdout"] == "t\n", untimed
    # A total the action's timeout cannot hold with the kernel's start is refused, not cut short.
    tight = agent.post("/v1/execute", {"runtime": "jupyter", "code": json.dumps(notebook), "timeout_s": 30})
    assert tight.status_code == 400 and "no room" in tight.json()["error"], tight.text
    for code, names in (
        ("print(1)", "notebook as JSON"),
        ('{"cells": "x"}', "cells"),
        ('{"cell": []}', "cell"),
    ):
        resp = agent.post("/v1/execute", {"runtime": "jupyter", "code": code})
        assert resp.status_code == 400 and resp.json()["field"] == "code", resp.text
        assert names in resp.json()["error"], resp.text


def test_the_native_status_is_the_notebooks(agent: Agent) -> None:
    """A notebook that ran out of its total, or whose kernel died, was ``ok`` (its driver answered
    and exited 0), the verdict only inside the JSON; a cell that raised stays ``ok``, as it is
    ``Success`` on ``/run_jupyter``."""
    sleeps = {"cells": ["import time\ntime.sleep(60)"], "total_timeout": 2}
    timed = agent.execute(json.dumps(sleeps), runtime="jupyter", timeout_s=40)
    assert timed["status"] == "timeout", timed
    assert "total_timeout" in str(timed["message"])
    assert json.loads(str(timed["stdout"]))["status"] == "TimeLimitExceeded"
    died = agent.execute(json.dumps({"cells": ["import os\nos._exit(3)"]}), runtime="jupyter", timeout_s=40)
    assert died["status"] == "failed" and died["message"] == "cell 1: the kernel died", died
    raised = agent.execute(json.dumps({"cells": ["1 / 0", "print(2)"]}), runtime="jupyter", timeout_s=40)
    assert raised["status"] == "ok", raised
    assert json.loads(str(raised["stdout"]))["cells"][1]["stdout"] == "2\n"


def test_a_killed_driver_leaves_nothing_in_its_sessions_workdir(agent: Agent) -> None:
    """The kernel's runtime directory (its connection key, sockets, history) lives in the workdir
    while the notebook runs; a driver killed by a cell cannot remove it, and the agent does."""
    sid = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        notebook = {
            "cells": [
                "open('kept.txt', 'w').write('k')",
                "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
            ]
        }
        ran = agent.execute(json.dumps(notebook), runtime="jupyter", timeout_s=40, session_id=sid)
        assert ran["status"] == "failed", ran
        # (main.py: this listing's own code, as a session's Python action has it.)
        listed = agent.execute("import os\nprint(sorted(os.listdir('.')))", session_id=sid)
        assert listed["stdout"] == "['kept.txt', 'main.py']\n", listed
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)


def test_a_total_above_the_ceiling_runs_at_the_ceiling_and_says_so(agent: Agent) -> None:
    resp = requests.post(
        agent.url + "/run_jupyter", json={"cells": ["print(1)"], "total_timeout": 500}, timeout=120
    )
    answer = resp.json()
    assert resp.status_code == 200 and answer["status"] == "Success", answer
    assert answer["cells"][0]["stdout"] == "1\n"
    assert any(
        "total_timeout 500 s is above the most this sandbox allows, 60 s" in n for n in answer["notes"]
    )
    # At the ceiling it is not lowered: the ceiling bounds the cells, the kernel's start is beyond it.
    at = requests.post(agent.url + "/run_jupyter", json={"cells": ["1"], "total_timeout": 60}, timeout=120)
    assert at.json()["status"] == "Success" and at.json()["notes"] == [], at.text


def test_output_past_what_the_agent_returns_is_cut_and_the_notebook_still_answers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An agent returns at most ``--output-bytes`` of a program's stdout, and the notebook's answer
    is its driver's stdout: cut there, it was no answer at all. The cells' outputs are cut instead,
    each cut said (``*_truncated``, keys SandboxFusion's client ignores), and an error keeps its
    name and the start of its value."""
    small = start_agent(tmp_path_factory.mktemp("jupyter-small") / "work", "--output-bytes", "300000")
    try:
        cells = [
            # Many small displays first: each one's separator counts too (they were not counted,
            # and 5,000 of them took the answer past the limit again).
            "from IPython.display import display\nfor i in range(5000):\n    display(i)",
            "print('x' * 1_000_000)",
            "print('after')",
            "'y' * 1_000_000",
            "raise ValueError('v' * 1_000_000)",
            # Many cells after the cut, raising or not: each one's frame and error name still fit.
            *["raise KeyError('w' * 5000)"] * 100,
            *["pass"] * 300,
        ]
        resp = requests.post(small.url + "/run_jupyter", json={"cells": cells}, timeout=120)
    finally:
        stop_agent(small)
    answer = resp.json()
    assert resp.status_code == 200 and answer["status"] == "Success", answer["message"]
    displays, first, after, shown, raised, *rest = answer["cells"]
    assert len(displays["display"]) == 5000 and not displays["display_truncated"]
    assert len(rest) == 400 and all(c["error"][0]["ename"] == "KeyError" for c in rest[:100])
    assert 0 < len(first["stdout"]) < 300_000 and first["stdout"] == "x" * len(first["stdout"])
    assert first["stdout_truncated"] and not first["stderr_truncated"]
    # Nothing fits after the cut, and each cell says what it lost.
    assert after["stdout"] == "" and after["stdout_truncated"]
    assert shown["display"] == [] and shown["display_truncated"]
    assert raised["error"][0]["ename"] == "ValueError" and raised["error_truncated"]


def test_many_cells_and_a_flood_of_errors_still_answer_within_the_output_bytes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each cell's reserve in the answer is what its record takes: 200 cells in 64 KiB keep their
    output (a reserve of 328 bytes a cell left less than nothing for it, and every cell's stdout was
    dropped). A cell sending the kernel's ``error`` message itself, without end, is cut as any other
    output is: the notebook still answers (each error past the budget was kept, and the answer no
    longer fitted what the agent returns)."""
    small = start_agent(tmp_path_factory.mktemp("jupyter-64k") / "work", "--output-bytes", "65536")
    flood = (
        "k = get_ipython().kernel\n"
        "import time\n"
        "p = k.get_parent('shell')\n"
        "error = {'ename': 'E' * 100, 'evalue': 'v', 'traceback': []}\n"
        # 1,500 errors of about 130 bytes each: three times the answer's 64 KiB, few enough that
        # a loaded machine (a CI run's) sends them well within the notebook's time.
        "for i in range(1500):\n"
        "    k.session.send(k.iopub_socket, 'error', error, parent=p)\n"
        "    if i % 250 == 0: time.sleep(0.002)\n"
        "print('sent')"
    )
    try:
        many = requests.post(
            small.url + "/run_jupyter",
            json={"cells": [f"print({i})" for i in range(200)], "total_timeout": 300},
            timeout=420,
        ).json()
        flooded = requests.post(
            small.url + "/run_jupyter", json={"cells": [flood, "1"], "total_timeout": 300}, timeout=420
        ).json()
    finally:
        stop_agent(small)
    assert many["status"] == "Success", many["message"]
    assert [c["stdout"] for c in many["cells"]] == [f"{i}\n" for i in range(200)]
    assert not any(c["stdout_truncated"] for c in many["cells"])
    assert flooded["status"] == "Success", flooded["message"]
    sender, _ = flooded["cells"]
    assert sender["error_truncated"] and sender["error"][0]["ename"] == "E" * 100
