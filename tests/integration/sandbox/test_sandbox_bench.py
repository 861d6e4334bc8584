"""``tangram bench exec``: a short real run (its own agent, real processes, real HTTP), and the
lean client's response reader on what servers send. Shapes and correctness only: timings are the
benchmark's to print, never a test's to assert."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.sandbox.bench import HttpError, _parse_response


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """A second agent standing in for a SandboxFusion-compatible peer (same /run_code contract)."""
    running = start_agent(tmp_path_factory.mktemp("peer") / "work")
    yield running
    stop_agent(running)


def test_bench_exec_json_has_every_case_and_no_errors(peer: Agent) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "bench",
            "exec",
            "--json",
            "--requests",
            "4",
            "--concurrency",
            "1,3",
            "--peer",
            peer.url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cases = json.loads(out.stdout)["cases"]
    cells = {(c["method"], c["payload"], c["concurrency"]) for c in cases}
    methods = ("native", "run_code", "fresh-process", "peer")
    assert cells == {(m, p, c) for m in methods for p in ("print", "asserts") for c in (1, 3)}
    for case in cases:
        assert set(case) == {"method", "payload", "concurrency", "rps", "p50_ms", "p99_ms", "errors"}
        assert case["errors"] == 0, case
        assert case["rps"] > 0 and 0 < case["p50_ms"] <= case["p99_ms"]


def test_bench_exec_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "bench", "exec", "--concurrency", "one"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--concurrency takes integers" in out.stderr


def test_response_reader_waits_for_the_whole_body() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
    assert _parse_response(bytearray(head[:20])) is None
    assert _parse_response(bytearray(head + b'{"a": ')) is None
    assert _parse_response(bytearray(head + b'{"a": "b"}\n')) == (200, b'{"a": "b"}\n')


def test_response_reader_decodes_chunked_bodies() -> None:
    head = b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n"
    partial = head + b"4\r\nabcd\r\n"
    assert _parse_response(bytearray(partial)) is None
    assert _parse_response(bytearray(partial + b"3;x=y\r\nefg\r\n0\r\n\r\n")) == (500, b"abcdefg")


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"garbage\r\n\r\n", "not an HTTP status line"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nbody", "neither Content-Length nor chunked"),
    ],
)
def test_response_reader_names_what_it_cannot_read(raw: bytes, problem: str) -> None:
    with pytest.raises(HttpError, match=problem):
        _parse_response(bytearray(raw))


def test_report_names_the_target_for_each_payload() -> None:
    from arl_tangram.sandbox.bench import Case, render

    cases = [
        Case("run_code", "print", 16, 1000.0, 15.0, 20.0, 0),
        Case("fresh-process", "print", 16, 190.0, 80.0, 120.0, 0),
        Case("run_code", "asserts", 16, 900.0, 17.0, 21.0, 0),
        Case("fresh-process", "asserts", 16, 190.0, 80.0, 120.0, 0),
    ]
    text = render(cases)
    assert "target run_code rps at c=16 >= 5x fresh-process (print): 5.3x (1000 vs 190 rps) -> met" in text
    assert "(asserts): 4.7x (900 vs 190 rps) -> NOT met" in text
