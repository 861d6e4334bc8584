"""The dispatcher's tests drive real sandbox agents, started by the sandbox tests' harness."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))

from sandbox_agent_harness import Agent, start_agent, stop_agent


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    """Two real agents per test module (a test may stop one: the rest of its module sees that)."""
    running = [start_agent(tmp_path_factory.mktemp(f"host{i}") / "work") for i in range(2)]
    yield running
    for a in running:
        if a.proc.poll() is None:
            stop_agent(a)
