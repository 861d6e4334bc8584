"""A call answers by its deadline whatever its program leaves for the zygote to reap.

Without the seccomp filter (``--no-seccomp``, or a kernel without seccomp) a program can still
leave a process that only the zygote could reap and that it never reaps: a ``clone(CLONE_PARENT)``
sibling (the namespace's teardown waits for it) or a thread traced by the zygote after
``ptrace(PTRACE_TRACEME)`` (its zombie keeps the program's process from ending). The zygote's exit
record then never came, and the call hung past any timeout, holding its slot, cores and uid. The
fork server gives up on the record a bounded grace after the deadline: the call answers
``timeout``, and the next actions run.

Real actions in a real agent without seccomp, on each fork loop (the Python loop's zygote was
never left waiting by either program: there the program keeps its own verdict).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandbox_agent_harness import C_BUILT, Agent, start_agent, stop_agent
from test_sandbox_probe_zygote_children import SIBLING, TRACED_THREAD, run_program


@pytest.fixture(scope="module", params=["c", "python"])
def bare_agent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent without the seccomp filter, on each zygote loop."""
    if request.param == "c" and not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    root = tmp_path_factory.mktemp(f"bare-{request.param}") / "work"
    running = start_agent(root, "--no-seccomp", "--fork-loop", request.param)
    running.loop = request.param  # type: ignore[attr-defined]
    yield running
    stop_agent(running)


@pytest.mark.parametrize("program", [SIBLING, TRACED_THREAD], ids=["sibling", "traced-thread"])
def test_the_call_answers_a_timeout_and_the_host_serves_on(bare_agent: Agent, program: str) -> None:
    # Before the backstop the call never answered: this request's own read timeout ended it.
    body = run_program(bare_agent, program, run_timeout=2)
    run = body["run_result"]
    if bare_agent.loop == "c":  # type: ignore[attr-defined]
        # Its zygote reaps the program, and its namespace's init, by their pids only.
        assert run["status"] == "TimeLimitExceeded", body
    else:
        # The Python loop's zygote was never left waiting by either: the program's own verdict.
        assert (run["status"], run["return_code"]) == ("Finished", 3), body
    # The host still serves, on every slot's next action.
    for _ in range(3):
        out = bare_agent.execute("print('next')")
        assert (out["status"], out["stdout"]) == ("ok", "next\n"), out
