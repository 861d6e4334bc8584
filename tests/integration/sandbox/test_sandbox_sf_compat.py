"""``/run_code`` where SandboxFusion's clients depend on what SandboxFusion does, against a real agent.

- A backslash is an ordinary character of a file name on Linux: SandboxFusion (``os.path.join``)
  writes ``files: {"a\\\\b.txt": ...}`` as the file ``a\\b.txt``, and so does the agent (it was a
  directory ``a`` holding ``b.txt``, and the program's ``open('a\\\\b.txt')`` failed).
- A limit above the agent's ceiling (``--max-timeout``, ``--max-memory-mb``) runs at the ceiling,
  with a note saying so: verl always sends ``memory_limit_MB`` and ``run_timeout``, SandboxFusion
  never refuses a value, and a refusal (400 naming our own fields ``timeout`` / ``memory_mb``) was a
  -1 reward for every sample. The verdict is the one at the ceiling. The native API still refuses.
"""

from __future__ import annotations

import base64
import resource
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sandbox_agent_harness import C_BUILT, Agent, start_agent, stop_agent

MAX_MEMORY_MB = 256
MAX_TIMEOUT_S = 3


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["c", "python"])
def agent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    if request.param == "c" and not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    running = start_agent(
        tmp_path_factory.mktemp(f"sfcompat-{request.param}") / "work",
        "--fork-loop",
        request.param,
        f"--max-memory-mb={MAX_MEMORY_MB}",
        f"--memory-mb={MAX_MEMORY_MB}",
        f"--max-timeout={MAX_TIMEOUT_S}",
        f"--timeout={MAX_TIMEOUT_S}",
    )
    yield running
    stop_agent(running)


def _ok(agent: Agent, **body: object) -> dict[str, object]:
    # Within the ceiling unless a test says otherwise (SandboxFusion's default is 10 s).
    resp = agent.post("/run_code", {"language": "python", "run_timeout": MAX_TIMEOUT_S, **body})
    assert resp.status_code == 200, resp.text
    answer: dict[str, object] = resp.json()
    return answer


def _run(answer: dict[str, object]) -> dict[str, object]:
    run = answer["run_result"]
    assert isinstance(run, dict), answer
    return run


def test_a_backslash_in_a_file_name_is_part_of_the_name(agent: Agent) -> None:
    code = (
        "import os\n"
        "print(open('a\\\\b.txt').read())\n"
        "print('|'.join(sorted(os.listdir('.'))))\n"
        "open('out\\\\x.txt', 'w').write('w')\n"
    )
    body = _ok(
        agent,
        code=code,
        files={"a\\b.txt": _b64(b"hello"), "a/c.txt": _b64(b"c")},
        fetch_files=["out\\x.txt", "a\\b.txt"],
    )
    assert body["status"] == "Success", body
    out = str(_run(body)["stdout"]).splitlines()
    assert out[0] == "hello"
    assert out[1] == "a|a\\b.txt|main.py", out  # a file of that name, beside the directory a
    files = body["files"]
    assert isinstance(files, dict)
    assert base64.b64decode(files["out\\x.txt"]) == b"w", body
    assert base64.b64decode(files["a\\b.txt"]) == b"hello", body
    # ``a/b`` and ``a\\b`` are two files now, not two names of one.
    both = _ok(
        agent,
        code="print(open('a/b').read(), open('a\\\\b').read())",
        files={"a/b": _b64(b"slash"), "a\\b": _b64(b"backslash")},
    )
    assert _run(both)["stdout"] == "slash backslash\n", both


@pytest.mark.parametrize("path", ["/etc/x", "../x", "a/../../x", "a\0b"])
def test_paths_leaving_the_workdir_are_still_refused(agent: Agent, path: str) -> None:
    resp = agent.post("/run_code", {"code": "pass", "language": "python", "files": {path: _b64(b"x")}})
    assert resp.status_code in (400, 422), resp.text
    fetch = {"code": "print(1)", "language": "python", "fetch_files": [path], "run_timeout": MAX_TIMEOUT_S}
    resp = agent.post("/run_code", fetch)
    # As before: the action runs, the path is left out with a note (NUL: the request's own error).
    if "\0" not in path:
        assert resp.status_code == 200 and path not in resp.json()["files"], resp.text
        assert resp.json()["notes"], resp.text


def test_limits_above_the_ceiling_run_at_the_ceiling_with_a_note(agent: Agent) -> None:
    body = _ok(agent, code="print('ok')", run_timeout=7200, memory_limit_MB=10_000_000, compile_timeout=9999)
    assert body["status"] == "Success" and _run(body)["stdout"] == "ok\n", body
    notes = " ".join(map(str, body["notes"]))  # type: ignore[call-overload]
    assert "run_timeout 7200" in notes and f"{MAX_TIMEOUT_S:g} s" in notes, notes
    assert "memory_limit_MB 10000000" in notes and f"{MAX_MEMORY_MB} MB" in notes, notes
    # Our internal names never reach a SandboxFusion client.
    assert "memory_mb" not in notes and "timeout_s" not in notes, notes
    # Within the ceiling: no note.
    plain = _ok(agent, code="print('ok')", run_timeout=MAX_TIMEOUT_S, memory_limit_MB=MAX_MEMORY_MB)
    assert plain["status"] == "Success" and plain["notes"] == [], plain


def test_a_capped_run_gets_the_verdict_it_would_get_at_the_ceiling(agent: Agent) -> None:
    # More memory than the ceiling: out of memory, as at the ceiling (not run with 10 TB).
    hog = _ok(agent, code="x = bytearray(512 << 20)\nprint(len(x))", memory_limit_MB=10_000_000)
    assert hog["status"] == "Failed" and _run(hog)["memory_limit_exceeded"] is True, hog
    assert hog["outcome"] == "memory_limit_exceeded", hog
    # Within it: runs.
    fits = _ok(agent, code="x = bytearray(64 << 20)\nprint(len(x) >> 20)", memory_limit_MB=10_000_000)
    assert fits["status"] == "Success" and _run(fits)["stdout"] == "64\n", fits
    # Longer than the ceiling: a timeout at the ceiling.
    slow = _ok(agent, code="import time\ntime.sleep(60)", run_timeout=7200)
    assert slow["status"] == "Failed" and _run(slow)["status"] == "TimeLimitExceeded", slow
    assert float(_run(slow)["execution_time"]) < MAX_TIMEOUT_S + 5, slow  # type: ignore[arg-type]


def test_the_native_api_still_refuses_limits_above_the_ceiling(agent: Agent) -> None:
    resp = agent.post("/v1/execute", {"code": "print(1)", "timeout_s": 7200})
    assert resp.status_code == 400 and resp.json()["field"] == "timeout", resp.text
    resp = agent.post("/v1/execute", {"code": "print(1)", "memory_mb": 10_000_000})
    assert resp.status_code == 400 and resp.json()["field"] == "memory_mb", resp.text


def test_nonsense_limits_are_refused_in_the_callers_words(agent: Agent) -> None:
    for field, value in (
        ("run_timeout", 0),
        ("run_timeout", -5),
        ("memory_limit_MB", 8),
        ("run_timeout", "x"),
    ):
        resp = agent.post("/run_code", {"code": "print(1)", "language": "python", field: value})
        assert resp.status_code == 422 and resp.json()["status"] == "SandboxError", resp.text
        assert field in resp.json()["message"], resp.text


def test_any_memory_limit_of_zero_or_less_asks_for_none(agent: Agent) -> None:
    """SandboxFusion sets a memory limit only for a positive memory_limit_MB: -5 ran there and was
    refused here (422)."""
    for value in (-1, 0, -5, -(10**6)):
        body = _ok(agent, code="print('ok')", memory_limit_MB=value)
        assert body["run_result"]["stdout"] == "ok\n", body


def _fits_outside(limit_mb: int, sizes_mb: list[int]) -> dict[int, bool]:
    """Whether ``bytearray(n MB)`` succeeds in a fresh interpreter under SandboxFusion's
    address-space limit of ``limit_mb``, for each n."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))

    out = {}
    for n in sizes_mb:
        code = f"b = bytearray({n} << 20)"
        done = subprocess.run(
            [sys.executable, "-c", code], preexec_fn=limited, capture_output=True, timeout=60
        )
        out[n] = done.returncode == 0
    return out


def test_a_python_program_may_allocate_what_it_may_outside(agent: Agent) -> None:
    """Forked from the zygote, a program started with its address space (about 7 MB more than a
    fresh interpreter's) under ``memory_limit_MB``: a 50 MB bytearray under 64 MB raised
    MemoryError here and passes there. The difference is added to the limit."""
    sizes = [40, 50, 70]
    outside = _fits_outside(64, sizes)
    assert outside == {40: True, 50: True, 70: False}, outside
    inside = {n: _run(_ok(agent, code=f"b = bytearray({n} << 20)", memory_limit_MB=64)) for n in sizes}
    assert {n: run["return_code"] == 0 for n, run in inside.items()} == outside, inside


def test_output_that_is_not_utf8_is_answered_as_sandboxfusion_answers_it(agent: Agent) -> None:
    """SandboxFusion decodes a stream strictly (``try_decode``): bytes that are not UTF-8 give
    ``[DecodeError]`` and the decoder's message instead of the output. The agent returned the
    output with U+FFFD in place of them, a verdict SandboxFusion never gives. The native API keeps
    the text."""
    raw = b"ab\xff\xfecd\n"
    try:
        raw.decode()
    except UnicodeDecodeError as err:
        want = f"[DecodeError] {err}"
    code = f"import sys\nsys.stdout.buffer.write({raw!r})\nsys.stderr.buffer.write({raw!r})\n"
    run = _run(_ok(agent, code=code))
    assert (run["return_code"], run["stdout"], run["stderr"]) == (0, want, want), run
    # Another language, the same: the bytes are the stream's, whoever wrote them.
    shell = _run(_ok(agent, code="printf 'ab\\377\\376cd\\n'", language="bash"))
    assert shell["stdout"] == want, shell
    native = agent.execute(code)
    assert native["stdout"] == native["stderr"] == raw.decode("utf-8", "replace"), native
    # UTF-8, however odd, comes back as written.
    odd = _run(_ok(agent, code="import sys\nsys.stdout.write('a\\rb\\x00c\\u00e9')"))
    assert odd["stdout"] == "a\rb\x00c\u00e9", odd
