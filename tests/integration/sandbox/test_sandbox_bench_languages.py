"""``tangram bench exec``'s language cases: a short real run against a real agent with numpy
preloaded. Shapes and correctness only: timings are the benchmark's to print, never a test's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.sandbox.bench_languages import (
    AGENT_ARGS,
    numpy_importable,
    render_languages,
    run_language_bench,
)
from arl_tangram.sandbox.languages import Detection, detect


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("bench-languages") / "work", *AGENT_ARGS)
    yield running
    stop_agent(running)


def test_language_cases_run_without_errors(agent: Agent) -> None:
    if not numpy_importable():
        pytest.skip("numpy is not installed (the test extras install it)")
    found = detect()
    wanted = {name: tc for name, tc in found.found.items() if name in ("cpp", "nodejs")}
    if not wanted:
        pytest.skip(f"neither g++ nor node here: {found.missing}")
    detection = Detection(found=wanted, missing={})
    cases = asyncio.run(run_language_bench(agent.url, 2, detection, numpy_available=True))
    cells = {(c.language, c.method) for c in cases}
    expected = {("numpy", "run_code-preloaded"), ("numpy", "fresh-process")}
    expected |= {(lang, m) for lang in wanted for m in ("run_code-warm", "run_code-cold", "fresh")}
    assert cells == expected
    assert [c for c in cases if c.errors] == []
    text = render_languages(cases, {"rust": "'rustc' not found on PATH"})
    assert "target run_code rps with numpy preloaded >= 20x fresh-process" in text
    assert "rust       not measured: 'rustc' not found on PATH" in text
    if "cpp" in wanted:
        assert "C++ compile-and-run vs a fresh compile" in text
