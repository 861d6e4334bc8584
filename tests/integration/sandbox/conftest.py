"""Fixtures shared by the sandbox's integration modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandbox_agent_harness import C_BUILT, Agent, processes_of, start_agent, stop_agent


@pytest.fixture(scope="module", params=["c", "python"])
def loop_agent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """A real agent on each zygote loop in turn (C, and the Python one it falls back to); ``.loop``
    names it. The C one is skipped where it was not built."""
    if request.param == "c" and not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    running = start_agent(
        tmp_path_factory.mktemp(f"loop-{request.param}") / "work", "--fork-loop", request.param
    )
    running.loop = request.param  # type: ignore[attr-defined]
    yield running
    stop_agent(running)
    assert processes_of(running.uids) == []
