"""``tangram bench exec``'s language cases: preloaded numpy and the compiled languages, side by side.

Against an agent of its own started with ``--preload numpy`` (the main cases keep the default,
lean zygote), one run measures:
- ``numpy``, at concurrency 1 and 16: ``import numpy`` and a small computation through
  ``/run_code`` (numpy preloaded in the zygote) against ``python3 -c`` of the same code, a fresh
  interpreter per call;
- for each language the agent found, at concurrency 1: ``/run_code`` with the compile cache warm
  (the same program each call: a hit), with it cold (a program new to the cache each call: a
  real compile in the sandbox), and ``fresh``: the same compile and run commands as plain
  processes in a new directory per call, with no cache, on one core as an action gets (what a
  sandbox that compiles every request pays, before any isolation).

Commands come from ``languages.py`` (one table for the agent and this baseline).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from arl_tangram.core.stats import percentile
from arl_tangram.sandbox.bench import HttpClient
from arl_tangram.sandbox.languages import Detection, Toolchain, detect, jvm_heap_mb

NUMPY_CODE = "import numpy as np\nprint(int(np.arange(1000).sum()))\n"
NUMPY_OUT = "499500\n"
AGENT_ARGS = ["--preload", "numpy"]
# One caller, and as many as the main cases' throughput target uses.
NUMPY_CONCURRENCY = (1, 16)
STDIN, EXPECTED = "20 22\n", "42\n"
# A program per language reading "a b" and printing a + b; {tag} makes a program new to the cache.
PROGRAMS = {
    "cpp": "#include <iostream>\n// {tag}\nint main(){{long a,b; std::cin>>a>>b; std::cout<<a+b<<'\\n';}}\n",
    "c": (
        "#include <stdio.h>\n// {tag}\n"
        'int main(void){{long a,b; scanf("%ld%ld",&a,&b); printf("%ld\\n",a+b);}}\n'
    ),
    "java": (
        "import java.util.*;\n// {tag}\npublic class Main {{ public static void main(String[] x) {{\n"
        "  Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); }} }}\n"
    ),
    "go": (
        'package main\n// {tag}\nimport "fmt"\n'
        "func main(){{ var a, b int64; fmt.Scan(&a, &b); fmt.Println(a+b) }}\n"
    ),
    "rust": (
        "use std::io::Read;\n// {tag}\nfn main(){{ let mut s = String::new();\n"
        "  std::io::stdin().read_to_string(&mut s).unwrap();\n"
        "  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
        '  println!("{{}}", v[0] + v[1]); }}\n'
    ),
    "nodejs": (
        "// {tag}\n"
        'const [a, b] = require("fs").readFileSync(0, "utf8").trim().split(/\\s+/).map(Number);\n'
        "console.log(a + b);\n"
    ),
    "perl": '# {tag}\nmy ($a, $b) = split " ", <STDIN>;\nprint $a + $b, "\\n";\n',
    "typescript": (
        "// {tag}\n"
        "const v: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
        "console.log(v[0] + v[1]);\n"
    ),
}
COMPILE_TIMEOUT_S = 120
Call = Callable[[int], Awaitable[bool]]


@dataclass
class LanguageCase:
    """One measured cell (the ``--json`` shape)."""

    language: str  # a language, or "numpy"
    method: str  # run_code-warm | run_code-cold | fresh (languages); run_code-preloaded | fresh-process
    concurrency: int
    requests: int
    p50_ms: float
    p99_ms: float
    rps: float
    errors: int


async def _measure(
    language: str, method: str, call: Call, requests: int, concurrency: int = 1
) -> LanguageCase:
    latencies: list[float] = []
    errors = 0
    todo = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for i in todo:
            t0 = time.perf_counter()
            try:
                ok = await call(i)
            except Exception:
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors += 0 if ok else 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return LanguageCase(
        language=language,
        method=method,
        concurrency=concurrency,
        requests=requests,
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        rps=round(requests / elapsed, 1),
        errors=errors,
    )


def _run_code(
    client: HttpClient, language: str, code_for: Callable[[int], str], stdin: str, out: str
) -> Call:
    async def call(i: int) -> bool:
        body = {
            "code": code_for(i),
            "language": language,
            "stdin": stdin,
            "compile_timeout": COMPILE_TIMEOUT_S,
        }
        status, raw = await client.send(client.post_bytes("/run_code", json.dumps(body).encode()))
        answer = json.loads(raw)
        return status == 200 and answer["status"] == "Success" and answer["run_result"]["stdout"] == out

    return call


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _one_core() -> None:
    # The baseline gets what an action gets (one core; SandboxFusion's runner too is one CPU).
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


async def _process(
    argv: list[str], cwd: str, env: dict[str, str], stdin: bytes | None, one_core: bool = True
) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=_one_core if one_core else None,
    )
    out, _ = await proc.communicate(stdin)
    return proc.returncode or 0, out


def _fresh_toolchain(toolchain: Toolchain, code_for: Callable[[int], str]) -> Call:
    """Compile (when the language compiles) and run as plain processes in a new directory."""
    language = toolchain.language
    env = {**os.environ, **toolchain.env, "MALLOC_ARENA_MAX": "1"}
    values = {"heap_mb": str(jvm_heap_mb(1024)), "jars": "."}

    async def call(i: int) -> bool:
        workdir = tempfile.mkdtemp(prefix="tangram-bench-")
        try:
            _write(os.path.join(workdir, language.source), code_for(i))
            if language.compiled:
                code, _ = await _process(toolchain.argv(language.compile, values), workdir, env, None)
                if code != 0:
                    return False
            code, out = await _process(toolchain.argv(language.run, values), workdir, env, STDIN.encode())
            return code == 0 and out.decode() == EXPECTED
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    return call


def _fresh_python(code: str, expected: str) -> Call:
    async def call(i: int) -> bool:
        # Unpinned, as the main cases' fresh process: its many callers spread over every core.
        code_, out = await _process([sys.executable, "-c", code], os.getcwd(), dict(os.environ), None, False)
        return code_ == 0 and out.decode() == expected

    return call


async def run_language_bench(
    url: str, requests: int, detection: Detection, numpy_available: bool
) -> list[LanguageCase]:
    """Every language case against the agent at ``url`` (started with ``AGENT_ARGS``)."""
    client = HttpClient(url)
    cases: list[LanguageCase] = []
    try:
        if numpy_available:
            preloaded = _run_code(client, "python", lambda i: NUMPY_CODE, "", NUMPY_OUT)
            fresh = _fresh_python(NUMPY_CODE, NUMPY_OUT)
            for method, call in (("run_code-preloaded", preloaded), ("fresh-process", fresh)):
                await _measure("numpy", method, call, 2)  # warm-up, not reported
            for concurrency in NUMPY_CONCURRENCY:  # the two methods take turns in each cell
                for method, call in (("run_code-preloaded", preloaded), ("fresh-process", fresh)):
                    # Enough calls to keep every caller busy (the cheap case of the two).
                    count = max(requests, 4 * concurrency)
                    cases.append(await _measure("numpy", method, call, count, concurrency))
        run = 0  # a tag no other run of this bench used: cold programs are new to the cache
        stamp = f"{os.getpid()}-{time.time_ns()}"
        for name, toolchain in sorted(detection.found.items()):
            program = PROGRAMS.get(name)
            if program is None:
                continue
            run += 1

            def warm(i: int, program: str = program) -> str:
                return program.format(tag="warm")

            def cold(i: int, program: str = program, run: int = run) -> str:
                return program.format(tag=f"cold {stamp} {run} {i}")

            await _run_code(client, name, warm, STDIN, EXPECTED)(0)  # the warm program's first build
            methods: list[tuple[str, Call]] = [
                ("run_code-warm", _run_code(client, name, warm, STDIN, EXPECTED)),
                ("run_code-cold", _run_code(client, name, cold, STDIN, EXPECTED)),
                ("fresh", _fresh_toolchain(toolchain, cold)),
            ]
            for method, call in methods:
                cases.append(await _measure(name, method, call, requests))
    finally:
        client.close()
    return cases


def render_languages(cases: list[LanguageCase], missing: dict[str, str]) -> str:
    """The language table, then the ratios the targets are about."""
    index = {(c.language, c.method, c.concurrency): c for c in cases}
    lines = ["", "language cases (p50 ms, errors in brackets):"]
    numpy_cells = sorted({c.concurrency for c in cases if c.language == "numpy"})
    for conc in numpy_cells:
        pre, fresh = (
            index.get(("numpy", "run_code-preloaded", conc)),
            index.get(("numpy", "fresh-process", conc)),
        )
        if not (pre and fresh):
            continue
        ratio = pre.rps / fresh.rps if fresh.rps > 0 else 0.0
        lines.append(
            f"  numpy c={conc:<3} run_code (numpy preloaded) p50 {pre.p50_ms:.2f} ms, {pre.rps:.1f} rps "
            f"[{pre.errors}]; fresh-process p50 {fresh.p50_ms:.2f} ms, {fresh.rps:.1f} rps [{fresh.errors}]"
        )
        lines.append(
            f"target run_code rps with numpy preloaded >= 20x fresh-process (c={conc}): {ratio:.1f}x -> "
            f"{'met' if ratio >= 20 else 'NOT met'}"
        )
    if not numpy_cells:
        lines.append("  numpy    not measured (numpy is not installed where the bench runs)")
    columns = ("warm cache", "cold cache", "fresh", "fresh/warm", "fresh/cold")
    lines.append(f"  {'language':<11}" + "".join(f"{c:>12}" for c in columns) + "   (concurrency 1)")
    for language in sorted({c.language for c in cases if c.language != "numpy"}):
        warm, cold, fresh = (index.get((language, m, 1)) for m in ("run_code-warm", "run_code-cold", "fresh"))
        if not (warm and cold and fresh):
            continue

        def cell(case: LanguageCase) -> str:
            return f"{case.p50_ms:.1f}" + (f"[{case.errors}]" if case.errors else "")

        lines.append(
            f"  {language:<11}{cell(warm):>12}{cell(cold):>12}{cell(fresh):>12}"
            f"{fresh.p50_ms / max(warm.p50_ms, 1e-9):>11.1f}x{fresh.p50_ms / max(cold.p50_ms, 1e-9):>11.1f}x"
        )
    for language, why in sorted(missing.items()):
        lines.append(f"  {language:<11}not measured: {why}")
    cpp = [index.get(("cpp", m, 1)) for m in ("run_code-warm", "run_code-cold", "fresh")]
    if all(cpp):
        warm, cold, fresh = cpp
        assert warm and cold and fresh
        lines.append(
            f"C++ compile-and-run vs a fresh compile: warm cache {fresh.p50_ms / warm.p50_ms:.1f}x, "
            f"cold cache {fresh.p50_ms / cold.p50_ms:.1f}x (p50 {warm.p50_ms:.1f} / {cold.p50_ms:.1f} vs "
            f"{fresh.p50_ms:.1f} ms)"
        )
    errors = sum(c.errors for c in cases)
    median = statistics.median(c.p50_ms for c in cases) if cases else 0.0
    lines.append(f"language cases: {len(cases)}, errors {errors}, median p50 {median:.1f} ms")
    return "\n".join(lines)


def numpy_importable() -> bool:
    """Whether numpy is installed for the interpreter the agent runs."""
    import importlib.util

    return importlib.util.find_spec("numpy") is not None


def measure_languages(requests: int) -> tuple[list[LanguageCase], dict[str, str]]:
    """Start an agent with ``AGENT_ARGS``, run every language case, stop it. Returns the cases and
    the languages left out, each with the binary that is missing."""
    from arl_tangram.sandbox.bench import start_agent

    detection = detect()
    proc, url = start_agent(AGENT_ARGS)
    try:
        cases = asyncio.run(run_language_bench(url, requests, detection, numpy_importable()))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return cases, dict(detection.missing)
