"""``tangram bench exec``: the agent's native API and ``/run_code`` vs a fresh interpreter per call.

One run measures, side by side, throughput and p50/p99 latency at concurrency 1, 4, 16 and 64 of two
payloads (``print(1+1)`` and a function with eight asserts) through:
- ``native``: the agent's ``POST /v1/execute``;
- ``run_code``: the agent's SandboxFusion-compatible ``POST /run_code``;
- ``fresh-process``: ``python3 -c CODE`` started per call (what a per-call interpreter costs);
- ``peer``: any SandboxFusion-compatible server given with ``--peer URL``.

The bench starts its own agent as a local process. The human table ends with the ratios the targets
are about; ``--json`` prints ``{"cases": [...]}`` and nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from arl_tangram.core.stats import percentile

PAYLOADS = {
    "print": ("print(1+1)", "2\n"),
    "asserts": (
        "def check(x):\n"
        "    assert x == 2\n"
        "    assert x + 1 == 3\n"
        "    assert x * 2 == 4\n"
        "    assert x ** 2 == 4\n"
        "    assert str(x) == '2'\n"
        "    assert [x] * 2 == [2, 2]\n"
        "    assert {x: 1}[2] == 1\n"
        "    assert sum(range(x + 1)) == 3\n"
        "    return 'ok'\n"
        "print(check(2))\n",
        "ok\n",
    ),
}
CONCURRENCY = (1, 4, 16, 64)
# Each cell is measured in this many rounds, the methods taking turns round by round: load from
# elsewhere on a shared machine comes in bursts of seconds, and a burst that fell on one method's
# whole block moved the ratios by a third from run to run.
ROUNDS = 5


@dataclass
class Case:
    """One measured cell of the table (the ``--json`` shape)."""

    method: str
    payload: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


Call = Callable[[str, str], Awaitable[bool]]
CpuProbe = Callable[[], float]


def _tree_cpu_s(root: int) -> float:
    """CPU seconds used by ``root`` and every process below it, reaped children included."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    stats: dict[int, list[bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(fields[1])
        stats[int(name)] = fields
    members = {root}
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in members and pid not in members:
                members.add(pid)
                changed = True
    for pid in members:
        row = stats.get(pid)
        if row:
            total += sum(int(f) for f in row[11:15]) / tick
    return total


def agent_cpu(proc: subprocess.Popen[str]) -> CpuProbe:
    """CPU seconds of the agent, its fork servers and every action they ran."""
    return lambda: _tree_cpu_s(proc.pid)


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the fresh processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_agent(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start ``tangram sandbox-agent`` on a free loopback port; returns it and its URL once ready."""
    port = _free_port()
    # Its own uid range, so that it never shares action uids with another agent on this host.
    uid_base = ["--uid-base", str(200000 + (os.getpid() % 1000) * 1500)]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "sandbox-agent",
            "--listen",
            f"127.0.0.1:{port}",
            *uid_base,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "ready on" in line:
            return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    raise RuntimeError("the sandbox agent did not start (run `tangram sandbox-agent` to see why)")


def _percentile(sorted_values: list[float], q: float) -> float:
    return percentile(sorted_values, q * 100)  # the one definition every benchmark prints


@dataclass
class Tally:
    """What one method's rounds of a cell add up to."""

    latencies: list[float]
    elapsed_s: float = 0.0
    errors: int = 0
    cpu_s: float = 0.0

    def case(self, method: str, payload: str, concurrency: int) -> Case:
        self.latencies.sort()
        return Case(
            method=method,
            payload=payload,
            concurrency=concurrency,
            rps=round(len(self.latencies) / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0,
            p50_ms=round(_percentile(self.latencies, 0.50) * 1000, 2),
            p99_ms=round(_percentile(self.latencies, 0.99) * 1000, 2),
            errors=self.errors,
        )


async def measure(
    call: Call,
    method: str,
    payload: str,
    concurrency: int,
    requests: int,
    cpu: CpuProbe | None = None,
    cpu_ms: dict[tuple[str, str, int], float] | None = None,
) -> Case:
    """Run ``requests`` calls with ``concurrency`` in flight; latency of each, throughput of all.
    With ``cpu``, also the server-side CPU milliseconds per call, into ``cpu_ms``."""
    tally = Tally([])
    await measure_round(call, payload, concurrency, requests, tally, cpu)
    if cpu is not None and cpu_ms is not None:
        cpu_ms[(method, payload, concurrency)] = tally.cpu_s * 1000 / max(1, len(tally.latencies))
    return tally.case(method, payload, concurrency)


async def measure_round(
    call: Call, payload: str, concurrency: int, requests: int, tally: Tally, cpu: CpuProbe | None = None
) -> None:
    """``requests`` calls with ``concurrency`` in flight, added to ``tally``."""
    code, expected = PAYLOADS[payload]
    latencies = tally.latencies
    errors = 0
    remaining = requests

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                ok = await call(code, expected)
            except Exception:
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors += 0 if ok else 1

    cpu0 = cpu() if cpu else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.elapsed_s += time.perf_counter() - start
    tally.errors += errors
    if cpu is not None:
        tally.cpu_s += cpu() - cpu0


class HttpError(Exception):
    """A response the bench's client could not read (names what was wrong)."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request in flight, its response read in place."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            try:
                done = _parse_response(self.buf)
            except HttpError as exc:
                self.waiter.set_exception(exc)
                return
            if done is not None:
                self.waiter.set_result(done)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection closed before the response ended ({exc})"))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.buf.clear()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter


def _parse_response(buf: bytearray) -> tuple[int, bytes] | None:
    """(status, body) once ``buf`` holds a whole response; ``None`` while it does not yet."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    try:
        status = int(head[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise HttpError(f"not an HTTP status line: {head[0][:80]!r}") from None
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body_at = end + 4
    if "content-length" in headers:
        size = int(headers["content-length"])
        if len(buf) - body_at < size:
            return None
        return status, bytes(buf[body_at : body_at + size])
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        at = body_at
        while True:
            line_end = buf.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(bytes(buf[at:line_end]).split(b";")[0], 16)
            if len(buf) < line_end + 2 + size + 2:
                return None
            if size == 0:
                return status, bytes(body)
            body += buf[line_end + 2 : line_end + 2 + size]
            at = line_end + 2 + size + 2
    raise HttpError("a response with neither Content-Length nor chunked encoding")


class HttpClient:
    """A lean keep-alive HTTP/1.1 client for the bench's load.

    The load generator shares the machine's cores with what it measures, so it must cost as little
    as it can (what ``wrk`` is to C servers): one connection per concurrent caller, requests built
    once, responses parsed in place. Every response is still read whole, JSON-decoded and checked.
    """

    def __init__(self, url: str) -> None:
        rest = url.split("://", 1)[-1].rstrip("/")
        hostport, _, prefix = rest.partition("/")
        host, _, port = hostport.rpartition(":")
        if not host:
            host, port = hostport, "80"
        self.host, self.port, self.prefix = host, int(port), f"/{prefix}".rstrip("/")
        self.idle: list[_Connection] = []
        self.all: list[_Connection] = []

    def post_bytes(self, path: str, body: bytes) -> bytes:
        """The whole request for ``body`` posted as JSON to ``path`` (built once per payload)."""
        return (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send a prepared request; returns (status, body)."""
        conn = self.idle.pop() if self.idle else None
        if conn is None or conn.closed:
            _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
            self.all.append(conn)
        result = await conn.request(request)
        self.idle.append(conn)
        return result

    def close(self) -> None:
        for conn in self.all:
            if conn.transport is not None:
                conn.transport.close()


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _http_call(
    client: HttpClient,
    path: str,
    body_for: Callable[[str], dict[str, Any]],
    ok: Callable[[dict[str, Any], str], bool],
) -> Call:
    """A call that posts ``body_for(code)`` to ``path`` (each request built once) and checks the
    answer with ``ok(body, expected_stdout)``."""
    requests = {code: client.post_bytes(path, _encoded(body_for(code))) for code, _ in PAYLOADS.values()}

    async def call(code: str, expected: str) -> bool:
        status, raw = await client.send(requests[code])
        return status == 200 and ok(json.loads(raw), expected)

    return call


def http_native(client: HttpClient) -> Call:
    """A call through ``/v1/execute``."""
    return _http_call(
        client,
        "/v1/execute",
        lambda code: {"runtime": "python", "code": code},
        lambda body, expected: body["status"] == "ok" and body["stdout"] == expected,
    )


def http_run_code(client: HttpClient) -> Call:
    """A call through a SandboxFusion-compatible ``/run_code`` (ours or the peer's)."""
    return _http_call(
        client,
        "/run_code",
        lambda code: {"code": code, "language": "python"},
        lambda body, expected: body["status"] == "Success" and body["run_result"]["stdout"] == expected,
    )


def fresh_process() -> Call:
    """A call that starts ``python3 -c CODE`` (the interpreter the bench itself runs on)."""

    async def call(code: str, expected: str) -> bool:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        return proc.returncode == 0 and out.decode() == expected

    return call


def _lean_child_watcher() -> None:
    """On Python 3.11, watch the fresh processes through pidfds, as 3.12 and later do by default,
    instead of a thread started per process (the bench client's share of the CPU counts against
    what it measures). The processes themselves are the same ``python3 -c`` either way."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return  # no pidfds here: keep the default watcher
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.get_event_loop_policy().set_child_watcher(watcher)


async def run_bench(
    url: str,
    peer: str | None,
    requests: int,
    concurrency: tuple[int, ...],
    agent: CpuProbe | None = None,
    cpu_ms: dict[tuple[str, str, int], float] | None = None,
) -> list[Case]:
    """Every case. The methods take turns within each (payload, concurrency) cell, round by round
    (``ROUNDS``), so that a burst of load from elsewhere on a shared machine hits all of them alike
    rather than one method's block.
    ``cpu_ms`` receives the server-side CPU per call (the agent's process tree; the fresh processes),
    which, unlike throughput, other load on the machine hardly moves."""
    cases: list[Case] = []
    _lean_child_watcher()
    # The client shares the machine's cores with what it measures, so it is kept lean for every
    # method alike: keep-alive connections and requests built once for HTTP; a pidfd per child
    # instead of a waiting thread for the fresh processes.
    ours, theirs = HttpClient(url), HttpClient(peer) if peer else None
    try:
        methods: list[tuple[str, Call, CpuProbe | None]] = [
            ("native", http_native(ours), agent),
            ("run_code", http_run_code(ours), agent),
            ("fresh-process", fresh_process(), children_cpu),
        ]
        if theirs is not None:
            methods.append(("peer", http_run_code(theirs), None))
        for method, call, _ in methods:
            # Warm connections, fork servers and caches once, outside the measurement.
            await measure(call, method, "print", max(concurrency), max(concurrency))
        for payload in PAYLOADS:
            for c in concurrency:
                # Rounds of at least a full wave of calls each (fewer rounds for a small --requests).
                rounds = max(1, min(ROUNDS, requests // max(1, c)))
                tallies = {method: Tally([]) for method, _, _ in methods}
                for r in range(rounds):
                    share = requests // rounds + (1 if r < requests % rounds else 0)
                    for method, call, cpu in methods:
                        await measure_round(call, payload, c, share, tallies[method], cpu)
                for method, _, cpu in methods:
                    tally = tallies[method]
                    cases.append(tally.case(method, payload, c))
                    if cpu is not None and cpu_ms is not None:
                        cpu_ms[(method, payload, c)] = tally.cpu_s * 1000 / max(1, len(tally.latencies))
    finally:
        ours.close()
        if theirs is not None:
            theirs.close()
    order = {name: i for i, (name, _, _) in enumerate(methods)}
    cases.sort(key=lambda c: (order[c.method], c.payload != "print", c.concurrency))
    return cases


def render(cases: list[Case], cpu_ms: dict[tuple[str, str, int], float] | None = None) -> str:
    """The human table (with server-side CPU per call where measured), then ratios against the
    fresh process and the target lines."""
    cpu_ms = cpu_ms or {}
    lines = [
        f"{'method':<14}{'payload':<9}{'conc':>5}{'rps':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}"
        f"{'cpu ms/call':>13}"
    ]
    for c in cases:
        cpu = cpu_ms.get((c.method, c.payload, c.concurrency))
        lines.append(
            f"{c.method:<14}{c.payload:<9}{c.concurrency:>5}{c.rps:>10.1f}{c.p50_ms:>10.2f}{c.p99_ms:>10.2f}"
            f"{c.errors:>8}{'' if cpu is None else f'{cpu:.2f}':>13}"
        )
    index = {(c.method, c.payload, c.concurrency): c for c in cases}
    lines.append("")
    lines.append("ratios (rps / fresh-process rps, same payload and concurrency):")
    for payload in PAYLOADS:
        for conc in sorted({c.concurrency for c in cases}):
            base = index.get(("fresh-process", payload, conc))
            if base is None or base.rps <= 0:
                continue
            parts = []
            for method in ("native", "run_code", "peer"):
                mine = index.get((method, payload, conc))
                if mine is not None:
                    parts.append(f"{method} {mine.rps / base.rps:.1f}x")
            lines.append(f"  {payload:<8} c={conc:<3} " + ", ".join(parts))
    # The throughput target, for each payload (the print payload is the issue's own example).
    for payload in PAYLOADS:
        rc16 = index.get(("run_code", payload, 16))
        fp16 = index.get(("fresh-process", payload, 16))
        if rc16 and fp16 and fp16.rps > 0:
            ratio = rc16.rps / fp16.rps
            lines.append(
                f"target run_code rps at c=16 >= 5x fresh-process ({payload}): {ratio:.1f}x "
                f"({rc16.rps:.0f} vs {fp16.rps:.0f} rps) -> {'met' if ratio >= 5 else 'NOT met'}"
            )
    cpu_ratios = [
        fresh / mine
        for (method, payload, conc), mine in (cpu_ms or {}).items()
        if method == "run_code"
        and mine > 0
        and (fresh := (cpu_ms or {}).get(("fresh-process", payload, conc))) is not None
    ]
    if cpu_ratios:
        lines.append(
            "server-side CPU per call, fresh-process / run_code (load elsewhere hardly moves it): "
            f"median {statistics.median(cpu_ratios):.1f}x"
        )
    n1 = index.get(("native", "print", 1))
    r1 = index.get(("run_code", "print", 1))
    for name, case in (("native", n1), ("run_code", r1)):
        if case:
            verdict = "met" if case.p50_ms < 5 else "NOT met"
            lines.append(
                f"target p50 at c=1 for print(1+1) < 5 ms ({name}): {case.p50_ms:.2f} ms -> {verdict}"
            )
    best = max((c.rps for c in cases if c.method == "run_code"), default=0.0)
    lines.append(f"best run_code rps: {best:.0f} (aim: >= 700, 10x SandboxFusion's ~70 here)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of ``tangram bench exec``."""
    p = argparse.ArgumentParser(prog="tangram bench exec", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help='print {"cases": [...]} only')
    p.add_argument("--peer", help="base URL of a SandboxFusion-compatible server to compare with")
    p.add_argument("--requests", type=int, default=1000, help="requests per case (default %(default)s)")
    p.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="comma-separated concurrency levels (default %(default)s)",
    )
    p.add_argument("--agent-arg", action="append", default=[], help="extra option for the agent")
    p.add_argument(
        "--language-requests",
        type=int,
        default=20,
        help="requests per language case (at most --requests; 0 leaves them out; default %(default)s)",
    )
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        p.error("--concurrency takes integers like 1,4,16,64")
    proc, url = start_agent(args.agent_arg)
    try:
        cpu_ms: dict[tuple[str, str, int], float] = {}
        cases = asyncio.run(run_bench(url, args.peer, args.requests, concurrency, agent_cpu(proc), cpu_ms))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # numpy preloaded and the compiled languages, against an agent of their own (bench_languages.py).
    from arl_tangram.sandbox.bench_languages import measure_languages, render_languages

    language_requests = min(args.requests, args.language_requests)
    language_cases, missing = measure_languages(language_requests) if language_requests > 0 else ([], {})
    if args.json:
        languages = [asdict(c) for c in language_cases]
        print(json.dumps({"cases": [asdict(c) for c in cases], "language_cases": languages}))
    else:
        print(f"tangram bench exec: {args.requests} requests per case, {os.cpu_count()} CPUs, agent at {url}")
        print(render(cases, cpu_ms))
        if language_requests > 0:
            print(render_languages(language_cases, missing))
        errors = sum(c.errors for c in cases)
        median_rps = statistics.median(c.rps for c in cases)
        print(f"total errors: {errors}; median rps over all cases: {median_rps:.0f}")
    return 0
