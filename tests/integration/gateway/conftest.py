"""The gateway tests run the real gateway app on loopback in front of the real dispatcher, which
drives real sandbox agents (started by the sandbox tests' harness)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dispatch"))  # dispatch_harness
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (Below the paths: the harness is found through them.)
from collections.abc import Iterator

import pytest
from sandbox_agent_harness import Agent, start_agent, stop_agent


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    """One real sandbox agent behind each module's gateway (a module that needs others defines its
    own ``hosts``)."""
    running = [start_agent(tmp_path_factory.mktemp("host") / "work")]
    yield running
    for a in running:
        stop_agent(a)
