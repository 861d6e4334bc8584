"""Code-sandbox clients of trainers not covered by ``test_gateway_trainer_clients.py``, restated as
they call ``/run_code``, against a real gateway in front of a real sandbox agent: the verdicts they
compute from the answer (every field they read, with the type they expect), their concurrency, and
the HTTP their clients speak (compressed and chunked bodies, ``Expect: 100-continue``, keep-alive
connections shared by many requests, content types other than JSON).

Each client is cited by repository and file; its few lines that build the request and read the
answer are restated rather than imported, since the trainers themselves are not dependencies.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import re
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import aiohttp
import pytest
import requests
import sandbox_fusion
from gateway_harness import NS, POOL, Gateway, serve_gateway
from pydantic import BaseModel
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.gateway import GatewayConfig

LIMIT = 256 << 10


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    hosts: list[Agent] = [start_agent(tmp_path_factory.mktemp("codeclients") / "work")]
    try:
        config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, max_body_bytes=LIMIT)
        with serve_gateway(hosts, config=config) as gw:
            yield gw
    finally:
        for host in hosts:
            stop_agent(host)


# --- verl's sandbox_fusion utils, and SkyRL's copy of them ------------------------------------------


def verl_call_sandbox_api(
    url: str,
    code: str,
    stdin: str | None,
    compile_timeout: int,
    run_timeout: int,
    memory_limit_mb: int,
    language: str,
) -> tuple[dict[str, Any] | None, str | None]:
    """``call_sandbox_api`` (volcengine/verl, verl/utils/reward_score/sandbox_fusion/utils.py; the
    same in NovaSky-AI/SkyRL, skyrl-agent/skyrl_agent/tasks/verifiers/sandbox_fusion/utils.py): the
    body encoded by hand, ``stdin`` null where the tool has none, three tries on 504 only (1 s, 2 s
    apart), any other error status is the sample's sandbox error."""
    payload = json.dumps(
        {
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_limit_mb,
            "language": language,
            "files": {},
            "fetch_files": [],
        }
    )
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last_error = None
    for attempt in range(3):
        try:
            response = requests.post(
                url, headers=headers, data=payload, timeout=compile_timeout + run_timeout + 10
            )
            if response.status_code == 504:
                last_error = f"Gateway Timeout (504) on attempt {attempt + 1}"
                if attempt < 2:
                    time.sleep(attempt + 1)
                continue
            response.raise_for_status()
            return response.json(), None
        except requests.exceptions.RequestException as e:
            last_error = f"API Request Error: {e}"
            break
    return None, last_error


def verl_verdict(api_response: dict[str, Any], expected_output: str | None) -> tuple[Any, dict[str, Any]]:
    """How ``_process_single_case`` (same files) reads the answer: True/False for a right or wrong
    answer, -1 a sandbox error, -2 a runtime error, -3 a timeout, -4 a compile error. The fields it
    reads are checked for the types it expects (a ``return_code`` of ``"0"`` would read as an
    error)."""
    compile_result = api_response.get("compile_result")
    run_result = api_response.get("run_result")
    meta: dict[str, Any] = {"api_status": api_response.get("status")}
    if compile_result:
        meta["compile_status"] = compile_result.get("status")
        assert isinstance(compile_result["return_code"], int), compile_result
        assert isinstance(compile_result["execution_time"], float), compile_result
        assert isinstance(compile_result["stderr"], str), compile_result
    if run_result:
        meta["run_status"] = run_result.get("status")
        meta["stdout"], meta["stderr"] = run_result.get("stdout"), run_result.get("stderr")
        assert isinstance(meta["stdout"], str) and isinstance(meta["stderr"], str), run_result
        assert isinstance(run_result["execution_time"], float), run_result
        assert run_result["return_code"] is None or isinstance(run_result["return_code"], int), run_result
    status = meta["api_status"]
    if status == "Failed":
        if compile_result and (
            meta["compile_status"] in ("Error", "TimeLimitExceeded")
            or (meta["compile_status"] == "Finished" and compile_result.get("return_code") != 0)
        ):
            return -4, meta
        if run_result:
            if meta["run_status"] == "TimeLimitExceeded":
                return -3, meta
            if meta["run_status"] == "Error" or (
                meta["run_status"] == "Finished" and run_result.get("return_code") != 0
            ):
                return -2, meta
        return -1, meta
    if status == "Success" and run_result and meta["run_status"] == "Finished":
        return str(meta["stdout"]).rstrip("\n") == str(expected_output).rstrip("\n"), meta
    return -1, meta


# verl's wrapper for a LeetCode-style case (``fn_name``): the arguments come as JSON lines on stdin
# and the result is printed as JSON (the gist of its ``wrapper_code``).
FN_WRAPPER = """
import json, sys
{generation}
_args = [json.loads(line) for line in sys.stdin.read().split('\\n')]
_result = globals()[{fn_name!r}](*_args)
print(json.dumps(_result) if isinstance(_result, (dict, list, tuple, bool)) else str(_result))
"""

CPP_SUM = '#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<"\\n";}\n'
CASES: list[tuple[str, str, str, str | None, str, Any]] = [
    # id, language, code, stdin, expected stdout, verl's verdict
    ("python right", "python", "print(int(input()) * 2)", "21", "42", True),
    ("python wrong", "python", "print(int(input()) * 3)", "21", "42", False),
    ("python raises", "python", "raise SystemExit(3)", "", "", -2),
    ("python loops", "python", "while True:\n    pass", "", "", -3),
    ("stdin null", "python", "import sys\nprint(repr(sys.stdin.read()))", None, "''", True),
    (
        "fn_name wrapper",
        "python",
        FN_WRAPPER.format(generation="def add(a, b):\n    return a + b", fn_name="add"),
        "[1, 2]\n[3]",
        "[1, 2, 3]",
        True,
    ),
    ("bash", "bash", "read x; echo $((x + 1))", "41", "42", True),
    ("cpp right", "cpp", CPP_SUM, "40 2", "42", True),
    ("cpp compile error", "cpp", "int main() { return undeclared_name; }\n", "", "", -4),
]


@pytest.mark.parametrize(
    ("what", "language", "code", "stdin", "expected", "verdict"), CASES, ids=[c[0] for c in CASES]
)
def test_verls_and_skyrls_verdicts(
    gateway: Gateway, what: str, language: str, code: str, stdin: str | None, expected: str, verdict: Any
) -> None:
    """verl's reward and tool, and SkyRL's coder1 verifier: the verdict is the one SandboxFusion's
    answer gives (its timeouts are verl's ``sandbox_fusion`` defaults: 10 s each, 1024 MB)."""
    if language == "cpp" and shutil.which("g++") is None:
        pytest.skip("no g++ on this host")
    timeout = 2 if verdict == -3 else 10  # a loop is cut at the run timeout: keep it short
    answer, error = verl_call_sandbox_api(
        f"{gateway.url}/run_code", code, stdin, timeout, timeout, 1024, language
    )
    assert error is None and answer is not None, error
    got, meta = verl_verdict(answer, expected)
    assert got == verdict, (what, meta, answer)


def test_verls_check_correctness_many_cases_at_once(gateway: Gateway) -> None:
    """verl's ``check_correctness`` (same file): every case of a sample at once, from a thread pool of
    at least 32 workers (``max(32, cpu_count * 5)``), each a new connection (``requests.post``
    without a session), under the ``sandbox_fusion.max_concurrent`` semaphore; the results come in
    the cases' order. verl's ``memory_limit_mb`` and ``language`` options go straight into the body."""
    semaphore = threading.Semaphore(24)  # reward_model.sandbox_fusion.max_concurrent
    inputs = [str(i) for i in range(48)]

    def case(stdin: str) -> Any:
        with semaphore:
            answer, error = verl_call_sandbox_api(
                f"{gateway.url}/run_code", "print(int(input()) ** 2)", stdin, 10, 10, 512, "python"
            )
        assert error is None and answer is not None, error
        return verl_verdict(answer, str(int(stdin) ** 2))[0]

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(case, inputs))
    assert results == [True] * len(inputs)


def test_skyrls_code_interpreter_tool(gateway: Gateway) -> None:
    """SkyRL's ``CodeInterpreter`` (NovaSky-AI/SkyRL, skyrl-agent/skyrl_agent/tools/sandbox_fusion.py):
    ``SANDBOX_FUSION_URL + "/run_code"``, ``stdin`` null, 30 s for the compile and the run, 1024 MB;
    it answers the model with ``stdout + stderr`` when the run is ``Finished`` (a failing program
    included) and tries again while the output names ``RLIMIT_NPROC``."""
    sandbox_url = f"{gateway.url}/pools/{NS}/{POOL}"
    outputs = []
    for code in ("print(6 * 7)", "import sys\nprint('out')\nsys.stderr.write('err\\n')\nraise SystemExit(1)"):
        answer, error = verl_call_sandbox_api(sandbox_url + "/run_code", code, None, 30, 30, 1024, "python")
        assert error is None and answer is not None, error
        _, meta = verl_verdict(answer, None)
        assert meta["run_status"] == "Finished", answer
        outputs.append(meta["stdout"] + meta["stderr"])
    assert outputs == ["42\n", "out\nerr\n"]
    assert not any("RLIMIT_NPROC" in out for out in outputs)


class SkyRLRunResult(BaseModel):
    """SkyRL's ``CommandRunResult`` (NovaSky-AI/SkyRL,
    skyrl-agent/skyrl_agent/tasks/verifiers/coder1/utils.py, after SandboxFusion's own)."""

    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class SkyRLRunCodeResponse(BaseModel):
    """SkyRL's ``RunCodeResponse`` (same file): ``message`` a string, ``files`` strings."""

    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: SkyRLRunResult | None = None
    run_result: SkyRLRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


def test_skyrls_coder1_verifier(gateway: Gateway) -> None:
    """SkyRL's ``code_exec_sandboxfusion`` (NovaSky-AI/SkyRL,
    skyrl-agent/skyrl_agent/tasks/verifiers/coder1/sandboxfusion_exec.py) posts ``language``,
    ``code``, ``stdin`` (null when none) and ``run_timeout`` only, takes any status but 200 as a
    failed server, and parses a 200 into its pydantic ``RunCodeResponse``: every answer it can get
    must parse, a program's failure and a language the pool does not offer included."""
    url = f"{gateway.url}/run_code"  # it builds http://SERVER:8080/run_code (docs/trainers.md)
    seen = []
    for code, stdin, language in (
        ("print(input()[::-1])", "abc", "python"),
        ("print('no stdin')", None, "python"),
        ("import sys\nprint('partial')\nsys.exit(2)", None, "python"),
        ("print(1)", None, "csharp"),  # SandboxFusion's language, not offered here: 200 SandboxError
    ):
        body = {"language": language, "code": code, "stdin": stdin, "run_timeout": 30}
        response = requests.post(url, json=body, timeout=30 + 2)
        assert response.status_code == 200, response.text
        result = SkyRLRunCodeResponse(**response.json())
        seen.append((result.status, result.run_result.stdout if result.run_result else None))
    assert seen == [
        ("Success", "cba\n"),
        ("Success", "no stdin\n"),
        ("Failed", "partial\n"),
        ("SandboxError", None),
    ]


# --- ROLL's code sandbox reward worker ---------------------------------------------------------------

# ROLL's SOLUTION_IMPORTS["python"], abridged: the prelude it puts before every python case.
ROLL_PRELUDE = "from typing import *\nimport sys\nsys.setrecursionlimit(6*10**5)\nfrom math import inf\n"


async def roll_process_single_test(
    url: str, session: aiohttp.ClientSession, test_case: dict[str, Any], max_retries: int = 3
) -> list[dict[str, Any]]:
    """``CodeTester.process_single_test`` (alibaba/ROLL,
    roll/pipeline/rlvr/rewards/code_sandbox_reward_worker.py): the case twice, each retried (1 s
    apart) on any status but 200 and on a 200 ``SandboxError``; a trace id header of its own and
    the case's ``expected_stdout`` in the body."""
    results = []
    for _ in range(2):
        result = None
        for _ in range(max_retries):
            headers = {
                "Content-Type": "application/json",
                "Accept": "application/json",
                "eagleeye-traceid": str(uuid.uuid4()),
            }
            async with session.post(url, headers=headers, json=test_case) as response:
                if response.status == 200:
                    result = await response.json()
                    if result.get("status") != "SandboxError":
                        break
            await asyncio.sleep(1)
        if result:
            results.append(result)
    return results


def roll_judge(test_case: dict[str, Any], responses: list[dict[str, Any]]) -> bool:
    """``sandbox_result_judge`` (same file), for one case: passed when an answer is ``Success`` and
    its ``run_result.stdout``, stripped, is the expected output (or none is expected)."""
    expected = test_case.get("expected_stdout", "").strip()
    return any(
        r["status"] == "Success" and (expected == "" or r["run_result"]["stdout"].strip() == expected)
        for r in responses
    )


def test_rolls_code_sandbox_reward(gateway: Gateway) -> None:
    """ROLL's ``sandbox_test_async``: an aiohttp session of at most 20 keep-alive connections, all of
    a prompt's cases at once; stdin cases (``stdin`` and ``expected_stdout``), assert cases and
    pytest cases (``language: pytest``), 30 s each for the compile and the run."""
    solution = "def add(a, b):\n    return a + b\n"
    cases = [
        *(
            {
                "compile_timeout": 30,
                "run_timeout": 30,
                "code": ROLL_PRELUDE + "a, b = map(int, input().split())\nprint(a + b)",
                "language": "python",
                "stdin": f"{i} {i}",
                "expected_stdout": str(2 * i),
            }
            for i in range(30)
        ),
        {
            "compile_timeout": 30,
            "run_timeout": 30,
            "code": ROLL_PRELUDE + solution + "\nassert add(1, 2) == 3\n",
            "language": "python",
            "stdin": "",
            "expected_stdout": "",
        },
        {
            "compile_timeout": 30,
            "run_timeout": 30,
            "code": solution + "\ndef test_add():\n    assert add(2, 2) == 4\n",
            "language": "pytest",
            "stdin": "",
            "expected_stdout": "",
        },
    ]
    failing = {**cases[-1], "code": solution + "\ndef test_add():\n    assert add(2, 2) == 5\n"}

    async def run() -> list[list[dict[str, Any]]]:
        connector = aiohttp.TCPConnector(limit=20, force_close=False, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=90, connect=20, sock_read=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            semaphore = asyncio.Semaphore(20)

            async def bounded(case: dict[str, Any]) -> list[dict[str, Any]]:
                async with semaphore:
                    return await roll_process_single_test(f"{gateway.url}/run_code", session, case)

            return await asyncio.gather(*(bounded(c) for c in [*cases, failing]))

    responses = asyncio.run(run())
    assert all(len(r) == 2 for r in responses), responses
    assert [roll_judge(c, r) for c, r in zip(cases, responses[:-1], strict=True)] == [True] * len(cases)
    assert not roll_judge(failing, responses[-1])
    assert responses[-1][0]["status"] == "Failed" and responses[-1][0]["run_result"]["return_code"] == 1


# --- HTTP as the clients speak it ---------------------------------------------------------------------

BODY = {"code": "print(6 * 7)", "language": "python"}


def _ran(resp: requests.Response) -> None:
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "Success" and resp.json()["run_result"]["stdout"] == "42\n", resp.text


def test_compressed_and_chunked_bodies(gateway: Gateway) -> None:
    """A body sent gzip or deflate (zlib's or raw), whole or in chunks, runs as sent plain."""
    raw = json.dumps(BODY).encode()
    deflater = zlib.compressobj(wbits=-15)
    encoded = {
        "gzip": [gzip.compress(raw)],
        "deflate": [zlib.compress(raw), deflater.compress(raw) + deflater.flush()],
    }
    for encoding, bodies in encoded.items():
        for body in bodies:
            headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
            _ran(requests.post(gateway.url + "/run_code", data=body, headers=headers, timeout=60))
            # A generator is sent chunked (Transfer-Encoding: chunked, no Content-Length).
            chunks = iter([body[:7], body[7:]])
            _ran(requests.post(gateway.url + "/run_code", data=chunks, headers=headers, timeout=60))

    async def aiohttp_compressed() -> tuple[int, Any]:
        # aiohttp's own ``compress=``: deflate, sent chunked.
        async with (
            aiohttp.ClientSession() as session,
            session.post(gateway.url + "/run_code", data=raw, compress="deflate") as resp,
        ):
            return resp.status, await resp.json()

    status, answer = asyncio.run(aiohttp_compressed())
    assert status == 200 and answer["run_result"]["stdout"] == "42\n", answer


def test_the_size_limit_counts_the_decoded_body(gateway: Gateway) -> None:
    """A body of exactly the limit is read; one byte more is 413 naming the limit, whether it comes
    plain, chunked, or as a small gzip that decodes past it."""

    def body_of(size: int) -> bytes:
        head = json.dumps({**BODY, "code": "print(6 * 7)\n#"})[:-2].encode()
        tail = b'", "language": "python"}'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    exact = body_of(LIMIT)
    assert len(exact) == LIMIT
    headers = {"Content-Type": "application/json"}
    _ran(requests.post(gateway.url + "/run_code", data=exact, headers=headers, timeout=60))
    over = body_of(LIMIT + 1)
    for data, extra in (
        (over, {}),
        (iter([over[:1000], over[1000:]]), {}),
        (gzip.compress(over), {"Content-Encoding": "gzip"}),
    ):
        resp = requests.post(gateway.url + "/run_code", data=data, headers={**headers, **extra}, timeout=60)
        assert resp.status_code == 413, resp.text
        assert str(LIMIT) in resp.json()["message"] and resp.json()["status"] == "SandboxError"


def test_expect_100_continue_from_aiohttp(gateway: Gateway) -> None:
    """aiohttp's ``expect100=True`` waits for the 100 before its body: it gets one and its answer."""

    async def post() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(gateway.url + "/run_code", json=BODY, expect100=True) as resp,
        ):
            return resp.status, await resp.json()

    status, answer = asyncio.run(post())
    assert status == 200 and answer["run_result"]["stdout"] == "42\n", answer


def test_content_types_other_than_json(gateway: Gateway) -> None:
    """SandboxFusion clients that encode the body themselves send it with whatever Content-Type
    (``requests`` sends none for a str): the JSON is read all the same. A form is not JSON, and is
    refused saying so in SandboxFusion's shape."""
    raw = json.dumps(BODY)
    for content_type in (None, "text/plain", "application/json; charset=utf-8", "application/octet-stream"):
        headers = {"Content-Type": content_type} if content_type else {}
        _ran(requests.post(gateway.url + "/run_code", data=raw, headers=headers, timeout=60))
    form = requests.post(gateway.url + "/run_code", data=BODY, timeout=60)
    assert form.status_code == 400 and "malformed JSON" in form.json()["message"], form.text
    assert form.json()["status"] == "SandboxError"


def test_many_keep_alive_connections_at_once(gateway: Gateway) -> None:
    """64 requests at once over one aiohttp session's pool of 16 keep-alive connections, twice: each
    answer is its own request's (the connections are reused, not crossed)."""

    async def run() -> list[str]:
        connector = aiohttp.TCPConnector(limit=16, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(i: int) -> str:
                body = {"code": f"print({i})", "language": "python"}
                async with session.post(gateway.url + "/run_code", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    stdout: str = (await resp.json())["run_result"]["stdout"]
                    return stdout

            first = await asyncio.gather(*(one(i) for i in range(64)))
            second = await asyncio.gather(*(one(i) for i in range(64, 128)))
            return [*first, *second]

    assert asyncio.run(run()) == [f"{i}\n" for i in range(128)]


WRONG_TYPES: list[tuple[str, dict[str, Any], str]] = [
    ("/run_code", {**BODY, "language": 1}, "language"),
    ("/run_code", {**BODY, "stdin": 5}, "stdin"),
    ("/run_code", {**BODY, "files": []}, "files"),
    ("/run_code", {**BODY, "files": {"a.txt": 5}}, "files.a.txt"),
    ("/run_code", {**BODY, "fetch_files": "a.txt"}, "fetch_files"),
    ("/run_code", {**BODY, "memory_limit_MB": 1024.5}, "memory_limit_MB"),
    ("/run_code", {**BODY, "run_timeout": None}, "run_timeout"),
    ("/run_code", {**BODY, "compile_timeout": "soon"}, "compile_timeout"),
    ("/run_code", {"language": "python"}, "code"),
    ("/run_jupyter", {"cells": "print(1)"}, "cells"),
    ("/run_jupyter", {"cells": ["1"], "total_timeout": "x"}, "total_timeout"),
]


@pytest.mark.parametrize(("path", "body", "field"), WRONG_TYPES, ids=[f"{p} {f}" for p, _, f in WRONG_TYPES])
def test_a_wrong_type_is_422_naming_the_field(
    gateway: Gateway, path: str, body: dict[str, Any], field: str
) -> None:
    """In SandboxFusion's shape (``status``, ``message``), with the field as the client named it."""
    resp = requests.post(gateway.url + path, json=body, timeout=60)
    assert resp.status_code == 422, resp.text
    answer = resp.json()
    assert answer["status"] == "SandboxError" and answer["field"] == field, answer
    assert re.search(rf"\b{re.escape(field)}\b", answer["message"]), answer


def test_sandboxfusions_own_async_and_concurrent_clients(gateway: Gateway) -> None:
    """SandboxFusion's SDK (``sandbox_fusion``): ``run_code_async`` (aiohttp) and ``run_concurrent``
    (20 threads of the blocking ``run_code``), with ``files`` in (base64) and ``fetch_files`` out,
    parsed into its own ``RunCodeResponse`` (it raises on any status but 200, and on a
    ``SandboxError``)."""
    endpoint = f"{gateway.url}/pools/{NS}/{POOL}"
    code = "n = int(open('in.txt').read())\nopen('out.txt', 'w').write(str(n * 2))\nprint(n)"

    def request(n: int) -> sandbox_fusion.RunCodeRequest:
        return sandbox_fusion.RunCodeRequest(
            code=code,
            language="python",
            files={"in.txt": base64.b64encode(f"{n}\n".encode()).decode()},
            fetch_files=["out.txt"],
        )

    async def run_async() -> list[sandbox_fusion.RunCodeResponse]:
        return await asyncio.gather(
            *(
                sandbox_fusion.run_code_async(
                    request(i), endpoint=endpoint, max_attempts=1, client_timeout=120
                )
                for i in range(10)
            )
        )

    answers = asyncio.run(run_async())
    answers += sandbox_fusion.run_concurrent(
        sandbox_fusion.run_code,
        kwargs=[{"request": request(i), "endpoint": endpoint, "max_attempts": 1} for i in range(10, 40)],
    )
    for n, answer in enumerate(answers):
        assert answer.status == sandbox_fusion.RunStatus.Success, answer
        assert answer.run_result is not None and answer.run_result.stdout == f"{n}\n", answer
        assert base64.b64decode(answer.files["out.txt"]) == str(2 * n).encode(), answer
