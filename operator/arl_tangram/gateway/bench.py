"""``tangram bench gateway``: SandboxFusion's ``/run_code`` through the gateway against straight to
one sandbox agent, at concurrency 1 and 16, with authentication off and on (warm cache), in one run.

The gateway runs as a process of its own in front of the real dispatcher and the same agent the
direct case calls, as in the operator. With authentication on it asks a stand-in of the API
server's TokenReview and SubjectAccessReview endpoints on loopback
(:mod:`arl_tangram.gateway.review_server`): the bench needs no cluster, and a warm request makes no
review call anyway, which the bench checks. Cases take turns within each concurrency, so a burst of
load from elsewhere on a shared machine hits them alike. A fourth method, ``forwarder``, is the
floor the gateway's added latency stands on: a bare process of the same stack (aiohttp's server,
the operator's agent client, uvloop) that passes ``/run_code`` bodies to the agent with no
authentication, queue, scheduling or keys. ``--json`` prints ``{"cases": [...], "targets": {...}}``
only.

``python -m arl_tangram.gateway.bench serve ...`` is the gateway process the bench starts (also
used by the tests that kill a gateway mid-stream); ``serve --bare`` is the forwarder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from arl_tangram import loop
from arl_tangram.core.stats import percentile
from arl_tangram.gateway.review_server import stand_in_jwt
from arl_tangram.sandbox.bench import Case, CpuProbe, HttpClient, _tree_cpu_s, measure, start_agent

NAMESPACE, POOL, AUDIENCE = "bench", "py", "tangram-gateway"
USER = "system:serviceaccount:bench:trainer"
TOKEN = stand_in_jwt(USER)  # JWT-shaped, as ServiceAccount tokens are
CONCURRENCY = (1, 16)
METHODS = ("direct", "forwarder", "gateway", "gateway+auth")


# ---- the gateway process ---------------------------------------------------------------------------
async def _until_stopped(runner: Any, listen: str) -> None:
    """Serve ``runner``'s app on ``listen`` (host:port) until SIGTERM or SIGINT."""
    from aiohttp import web

    host, _, port_text = listen.rpartition(":")
    await runner.setup()
    await web.TCPSite(runner, host, int(port_text)).start()
    print(f"gateway ready on {listen}", flush=True)
    await loop.stop_on_signals().wait()


async def _forward(args: argparse.Namespace) -> None:
    """The floor: ``/run_code`` bodies passed to the agent and its answers back, nothing else."""
    from aiohttp import web

    from arl_tangram.dispatch.http1 import Http1Client

    address = args.agent.split("://", 1)[-1].rstrip("/")
    agent = Http1Client()

    async def run_code(request: web.Request) -> web.Response:
        body = await request.read()
        answer = await agent.request("POST", address, "/run_code", body=body, timeout_s=60)
        return web.Response(status=answer.status, body=answer.body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/run_code", run_code)
    runner = web.AppRunner(app, access_log=None)
    await _until_stopped(runner, args.listen)
    await runner.cleanup()
    await agent.close()


async def _serve(args: argparse.Namespace) -> None:
    import aiohttp
    from aiohttp import web

    from arl_tangram.api.actionpool import ActionPool
    from arl_tangram.dispatch.agent import AgentClient
    from arl_tangram.dispatch.dispatcher import Dispatcher, HostEndpoint
    from arl_tangram.domain.pools import pool_config
    from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator, build_gateway_app
    from arl_tangram.gateway.review_server import ReviewServer, StandInToken, api_client_for

    address = args.agent.split("://", 1)[-1].rstrip("/")
    async with aiohttp.ClientSession() as http, http.get(f"http://{address}/v1/health") as resp:
        health = await resp.json()
    cores = tuple(health["cores"]["ids"])
    model = ActionPool.model_validate(
        {
            "metadata": {"name": args.pool, "namespace": args.namespace, "generation": 1},
            "spec": {
                "template": {"image": "sandbox", "resources": {"cpu": str(len(cores)), "memory": "4Gi"}},
                "languages": ["python", "bash"],
                "limits": {"timeoutSeconds": 60, "memory": "1Gi", "maxCores": len(cores)},
            },
        }
    )
    agents = AgentClient()
    dispatcher = Dispatcher(agents)
    dispatcher.upsert_pool(pool_config(model, uid="bench"))
    await dispatcher.sync_hosts(
        f"{args.namespace}/{args.pool}", [HostEndpoint("host-0", address, cores, 4 << 30)]
    )
    runners: list[web.AppRunner] = []
    auth = None
    if args.review_token:
        reviews = ReviewServer(tokens={args.review_token: StandInToken(USER, (AUDIENCE,))})
        reviews.grant(USER, [args.namespace])
        runner = web.AppRunner(reviews.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        auth = KubernetesAuthenticator(api_client_for(f"http://127.0.0.1:{port}"), AUDIENCE)
    config = GatewayConfig(default_namespace=args.namespace, default_pools={args.namespace: args.pool})
    app = build_gateway_app(dispatcher, auth, config=config, allow_anonymous=auth is None)
    runner = web.AppRunner(app, access_log=None)
    runners.append(runner)
    await _until_stopped(runner, args.listen)
    for r in reversed(runners):
        await r.cleanup()
    await dispatcher.shutdown()
    await agents.close()
    if auth is not None:
        print(f"review calls: {auth.api_calls}", flush=True)


def serve_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m arl_tangram.gateway.bench serve")
    p.add_argument("--agent", required=True, help="the one agent's URL")
    p.add_argument("--listen", required=True, help="host:port")
    p.add_argument("--namespace", default=NAMESPACE)
    p.add_argument("--pool", default=POOL)
    p.add_argument("--review-token", help="authenticate, accepting this token (stand-in review server)")
    p.add_argument("--bare", action="store_true", help="the forwarder: no gateway, only the hop")
    args = p.parse_args(argv)
    loop.run(_forward(args) if args.bare else _serve(args))
    return 0


def start_gateway(
    agent_url: str, port: int, review_token: str | None = None, bare: bool = False
) -> subprocess.Popen[str]:
    """Start a gateway process in front of ``agent_url`` (``bare``: the forwarder); returns once it
    serves."""
    cmd = [sys.executable, "-m", "arl_tangram.gateway.bench", "serve", "--agent", agent_url]
    cmd += ["--listen", f"127.0.0.1:{port}"]
    if review_token:
        cmd += ["--review-token", review_token]
    if bare:
        cmd.append("--bare")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready on" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise RuntimeError(f"the gateway did not start: {line!r} {err[-2000:]}")
    return proc


def stop_process(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, wait, and return what it printed after its ready line."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


# ---- the measurement -----------------------------------------------------------------------------
def _run_code_call(client: HttpClient, token: str | None) -> Any:
    body = json.dumps({"code": "print(1+1)", "language": "python"}).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (
        f"POST {client.prefix}/run_code HTTP/1.1\r\nHost: {client.host}:{client.port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def call(code: str, expected: str) -> bool:
        status, raw = await client.send(request)
        answer = json.loads(raw)
        return status == 200 and answer["status"] == "Success" and answer["run_result"]["stdout"] == expected

    return call


ROUNDS = 10


async def _round(call: Any, concurrency: int, requests: int) -> tuple[list[float], float, int]:
    """``requests`` calls with ``concurrency`` in flight: each latency, the elapsed time, errors."""
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                ok = await call("print(1+1)", "2\n")
            except Exception:
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors += 0 if ok else 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start, errors


async def run_cases(
    urls: dict[str, tuple[str, str | None]],
    requests: int,
    cpu: dict[str, dict[str, CpuProbe]],
    cpu_ms: dict[tuple[str, str, int], float],
) -> list[Case]:
    """Every case. The methods take turns in :data:`ROUNDS` rounds of ``requests / ROUNDS`` calls, so
    that load from elsewhere on a shared machine, which comes and goes, hits each method alike.
    ``cpu_ms[(method, part, concurrency)]`` receives the CPU per call of each part of the server side
    (``cpu[method]``: "agent", and "gateway" for the gateway cases), which other load hardly moves."""
    clients = {m: HttpClient(url) for m, (url, _) in urls.items()}
    calls = {m: _run_code_call(clients[m], token) for m, (_, token) in urls.items()}
    cases: list[Case] = []
    per_round = max(1, requests // ROUNDS)
    try:
        for method in METHODS:  # warm connections, fork servers and the auth cache
            await measure(calls[method], method, "print", max(CONCURRENCY), max(CONCURRENCY) * 4)
        for c in CONCURRENCY:
            latencies: dict[str, list[float]] = {m: [] for m in METHODS}
            elapsed = dict.fromkeys(METHODS, 0.0)
            errors = dict.fromkeys(METHODS, 0)
            cpu_s = {(m, part): 0.0 for m in METHODS for part in cpu[m]}
            for _ in range(ROUNDS):
                for method in METHODS:
                    before = {part: probe() for part, probe in cpu[method].items()}
                    lat, took, bad = await _round(calls[method], c, per_round)
                    for part, probe in cpu[method].items():
                        cpu_s[(method, part)] += probe() - before[part]
                    latencies[method] += lat
                    elapsed[method] += took
                    errors[method] += bad
            for method in METHODS:
                done = sorted(latencies[method])
                for part in cpu[method]:
                    cpu_ms[(method, part, c)] = cpu_s[(method, part)] * 1000 / len(done)
                cases.append(
                    Case(
                        method=method,
                        payload="print",
                        concurrency=c,
                        rps=round(len(done) / elapsed[method], 1),
                        p50_ms=round(percentile(done, 50) * 1000, 2),
                        p99_ms=round(percentile(done, 99) * 1000, 2),
                        errors=errors[method],
                    )
                )
    finally:
        for client in clients.values():
            client.close()
    return cases


def targets(cases: list[Case]) -> dict[str, Any]:
    index = {(c.method, c.concurrency): c for c in cases}
    out: dict[str, Any] = {}
    direct16, direct1 = index[("direct", 16)], index[("direct", 1)]
    for method in ("gateway", "gateway+auth"):
        ratio = index[(method, 16)].rps / direct16.rps if direct16.rps else 0.0
        added = index[(method, 1)].p50_ms - direct1.p50_ms
        out[method] = {
            "throughput_ratio_c16": round(ratio, 3),
            "throughput_met": ratio >= 0.5,
            "p50_added_ms_c1": round(added, 3),
            "latency_met": added <= 1.0,
        }
    return out


def render(
    cases: list[Case], goals: dict[str, Any], review_calls: int, cpu_ms: dict[tuple[str, str, int], float]
) -> str:
    index = {(c.method, c.concurrency): c for c in cases}
    lines = [
        f"{'method':<14}{'conc':>5}{'rps':>10}{'ratio':>8}{'p50 ms':>10}{'+p50 ms':>9}"
        f"{'p99 ms':>10}{'errors':>8}{'agent cpu ms':>14}{'gateway cpu ms':>16}"
    ]
    for c in sorted(cases, key=lambda c: (c.concurrency, METHODS.index(c.method))):
        base = index[("direct", c.concurrency)]
        ratio = c.rps / base.rps if base.rps else 0.0
        lines.append(
            f"{c.method:<14}{c.concurrency:>5}{c.rps:>10.1f}{ratio:>8.2f}{c.p50_ms:>10.2f}"
            f"{c.p50_ms - base.p50_ms:>9.2f}{c.p99_ms:>10.2f}{c.errors:>8}"
            f"{cpu_ms.get((c.method, 'agent', c.concurrency), 0.0):>14.2f}"
            f"{cpu_ms.get((c.method, 'gateway', c.concurrency), 0.0):>16.2f}"
        )
    lines.append("")
    for method, goal in goals.items():
        lines.append(
            f"target {method} rps at c=16 >= 0.5x direct: {goal['throughput_ratio_c16']:.2f}x -> "
            f"{'met' if goal['throughput_met'] else 'NOT met'}"
        )
        lines.append(
            f"target {method} p50 added at c=1 <= 1 ms: {goal['p50_added_ms_c1']:+.2f} ms -> "
            f"{'met' if goal['latency_met'] else 'NOT met'}"
        )
    floor = index[("forwarder", 1)].p50_ms - index[("direct", 1)].p50_ms
    lines.append(
        f"floor: a bare forwarder (the same HTTP stack, no auth, queue or keys) adds {floor:+.2f} ms "
        "to p50 at c=1 here"
    )
    lines.append(
        f"review calls to the (stand-in) API server during the run: {review_calls} "
        "(a warm cache: one TokenReview and one SubjectAccessReview per 60 s TTL)"
    )
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: list[str]) -> int:
    """Entry point of ``tangram bench gateway``."""
    p = argparse.ArgumentParser(prog="tangram bench gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the cases and targets as JSON only")
    p.add_argument("--requests", type=int, default=1000, help="requests per case (default %(default)s)")
    p.add_argument("--agent-arg", action="append", default=[], help="extra option for the agent")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    agent, agent_url = start_agent(args.agent_arg)
    cpu_ms: dict[tuple[str, str, int], float] = {}
    gateways: list[subprocess.Popen[str]] = []
    try:
        plain_port, auth_port, bare_port = _free_port(), _free_port(), _free_port()
        gateways.append(start_gateway(agent_url, plain_port))
        gateways.append(start_gateway(agent_url, auth_port, TOKEN))
        gateways.append(start_gateway(agent_url, bare_port, bare=True))
        urls = {
            "direct": (agent_url, None),
            "forwarder": (f"http://127.0.0.1:{bare_port}", None),
            "gateway": (f"http://127.0.0.1:{plain_port}", None),
            "gateway+auth": (f"http://127.0.0.1:{auth_port}", TOKEN),
        }

        def tree(pid: int) -> CpuProbe:
            return lambda: _tree_cpu_s(pid)

        cpu = {
            "direct": {"agent": tree(agent.pid)},
            "forwarder": {"agent": tree(agent.pid), "gateway": tree(gateways[2].pid)},
            "gateway": {"agent": tree(agent.pid), "gateway": tree(gateways[0].pid)},
            "gateway+auth": {"agent": tree(agent.pid), "gateway": tree(gateways[1].pid)},
        }
        cases = asyncio.run(run_cases(urls, args.requests, cpu, cpu_ms))
    finally:
        outputs = [stop_process(g) for g in gateways]
        agent.terminate()
        agent.wait(timeout=30)
    review_calls = next(
        (
            int(line.split()[-1])
            for o in outputs
            for line in o.splitlines()
            if line.startswith("review calls")
        ),
        -1,
    )
    goals = targets(cases)
    if args.json:
        cpu_rows = [
            {"method": m, "part": part, "concurrency": c, "cpu_ms_per_call": v}
            for (m, part, c), v in cpu_ms.items()
        ]
        report: dict[str, Any] = {"cases": [asdict(c) for c in cases], "cpu": cpu_rows, "targets": goals}
        index = {(c.method, c.concurrency): c for c in cases}
        report["floor_p50_added_ms_c1"] = round(
            index[("forwarder", 1)].p50_ms - index[("direct", 1)].p50_ms, 3
        )
        print(json.dumps({**report, "review_calls": review_calls}))
    else:
        print(render(cases, goals, review_calls, cpu_ms))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
