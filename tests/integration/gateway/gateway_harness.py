"""A gateway served on loopback from a thread of its own, in front of the real dispatcher.

The gateway and the dispatcher share one event loop in a background thread, so that tests (and the
trainer-side clients they run, most of them blocking) talk to it over real HTTP exactly as a trainer
would. Reward actions go to a real ``tangram reward-runtime`` process (a built-in model on CPU,
:func:`start_reward_runtime`). The dispatcher does not route ``reward`` actions yet, so
:class:`RewardRouting`, a test-only stand-in for that one path, sends them to the runtime's
``POST /v1/score`` (docs/gpu.md) with the sample's prompt and response as one text; every other
action goes to the real dispatcher.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import yaml
from aiohttp import web
from dispatch_harness import NS, endpoint, pool_for_tests
from sandbox_agent_harness import Agent

from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.pools import PoolConfig
from arl_tangram.errors import NotFound
from arl_tangram.gateway import GatewayConfig, build_gateway_app
from arl_tangram.gateway.admission import Admission
from arl_tangram.gateway.auth import Authenticator
from arl_tangram.gateway.review_server import ReviewServer
from arl_tangram.gateway.state import STATE, BatchResults, Readiness, always_leader
from arl_tangram.rewards.builtin import BuiltinScorer, write_model

POOL = "py"
SERVICE = "rm"
T = TypeVar("T")


def sample_text(payload: Mapping[str, Any]) -> str:
    """What a reward model scores for a sample: the prompt (a chat's contents joined) and the response."""
    prompt = payload.get("prompt") or ""
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return f"{prompt}{payload.get('response', '')}"


@dataclass
class RewardRuntime:
    """A running ``tangram reward-runtime`` with one built-in model (:data:`SERVICE`)."""

    url: str
    proc: subprocess.Popen[str]
    model: Path

    def expected(self, texts: list[str]) -> list[float]:
        """The scores the model gives ``texts``, computed here from the same model file."""
        scorer = BuiltinScorer.from_file(self.model)
        scorer.restore()
        return [float(x) for x in scorer.score(texts)]


@contextmanager
def start_reward_runtime(workdir: Path) -> Iterator[RewardRuntime]:
    model = write_model(workdir / "rm.npz", buckets=1024, dim=16, seed=7)
    config = workdir / "services.yaml"
    config.write_text(
        yaml.safe_dump(
            {"services": [{"name": SERVICE, "backend": "builtin", "path": str(model), "maxWaitMillis": 1}]}
        )
    )
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "arl_tangram", "reward-runtime", "--config", str(config)),
            *("--listen", "127.0.0.1:0", "--device", "cpu", "--device-memory", "64Mi"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise AssertionError(f"reward runtime did not start: {line!r} {proc.communicate(timeout=30)[1]}")
    try:
        yield RewardRuntime("http://" + line.split("listening on ")[1].split()[0], proc, model)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RewardRouting:
    """An ActionService: ``reward`` actions to the stand-in runtime, the rest to the dispatcher."""

    dispatcher: Dispatcher
    reward_url: str | None
    services: frozenset[str]
    http: aiohttp.ClientSession | None = None
    running: int = 0
    peak: int = 0  # the most actions this service held at once (back-pressure tests read it)

    async def run(self, request: ActionRequest) -> ActionOutcome:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await self._run(request)
        finally:
            self.running -= 1

    async def _run(self, request: ActionRequest) -> ActionOutcome:
        if request.kind != "reward":
            return await self.dispatcher.run(request)
        if request.target not in self.services:
            raise NotFound("RewardModelService", request.target)
        assert self.http is not None and self.reward_url is not None
        body = {"service": request.target, "inputs": [sample_text(request.payload)]}
        async with self.http.post(f"{self.reward_url}/v1/score", json=body) as resp:
            if resp.status == 404:
                raise NotFound("RewardModelService", request.target)
            if resp.status != 200:
                return ActionOutcome(request.key, Outcome.FAILED, Reason.SANDBOX_ERROR, await resp.text())
            answer = await resp.json()
        return ActionOutcome(
            request.key, Outcome.SUCCEEDED, reward=float(answer["scores"][0]), response=answer, attempts=1
        )

    async def cancel(self, key: str) -> bool:
        return await self.dispatcher.cancel(key)

    async def open_session(self, namespace: str, pool: str, ttl_s: float | None = None) -> str:
        return await self.dispatcher.open_session(namespace, pool, ttl_s)

    async def close_session(self, namespace: str, pool: str, session: str) -> None:
        await self.dispatcher.close_session(namespace, pool, session)

    async def find_pool_config(self, namespace: str, name: str) -> PoolConfig | None:
        return await self.dispatcher.find_pool_config(namespace, name)

    def session_lost(self, namespace: str, pool: str, session: str) -> str | None:
        return self.dispatcher.session_lost(namespace, pool, session)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Gateway:
    """A running gateway: its URL, and the loop (thread) it runs on."""

    url: str
    loop: asyncio.AbstractEventLoop
    service: RewardRouting
    app: web.Application
    rewards: RewardRuntime | None = None

    def admission(self) -> Admission:
        """The gateway's counts of held actions (read from the test thread: plain dict reads)."""
        return self.app[STATE].admission

    def raw_connection(self, timeout_s: float) -> socket.socket:
        """A TCP connection to the gateway, for requests written byte by byte."""
        where = urlsplit(self.url)
        return socket.create_connection((where.hostname, where.port), timeout=timeout_s)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run ``coro`` on the gateway's loop and wait for it (e.g. to inspect the dispatcher)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection."""
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


@contextmanager
def serve_gateway(
    agents: list[Agent],
    *,
    auth: Authenticator | None = None,
    config: GatewayConfig | None = None,
    readiness: Readiness = always_leader,
    batch_results: BatchResults | None = None,
    pools: tuple[tuple[str, str], ...] = ((NS, POOL),),
    setup: Callable[[Dispatcher], None] | None = None,
    rewards: RewardRuntime | None = None,
) -> Iterator[Gateway]:
    """Serve a gateway until the block ends (reward actions go to ``rewards`` when given)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway", daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []
    apps: list[web.Application] = []
    port = free_port()

    async def start() -> RewardRouting:
        client = AgentClient()
        dispatcher = Dispatcher(client, policy="tangram")
        for namespace, name in pools:
            dispatcher.upsert_pool(pool_for_tests(name, namespace))
            await dispatcher.sync_hosts(
                f"{namespace}/{name}", [endpoint(a, f"{name}-host-{i}") for i, a in enumerate(agents)]
            )
        if setup is not None:
            setup(dispatcher)
        service = RewardRouting(
            dispatcher,
            rewards.url if rewards else None,
            frozenset({SERVICE} if rewards else ()),
            aiohttp.ClientSession(),
        )
        app = build_gateway_app(
            service,
            auth,
            config=config or GatewayConfig(default_namespace=NS, default_pools={NS: POOL}),
            readiness=readiness,
            batch_results=batch_results,
            allow_anonymous=auth is None,
            session_check_s=0.05,
        )
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        apps.append(app)
        return service

    async def stop(service: RewardRouting) -> None:
        for runner in runners:
            await runner.cleanup()
        await service.dispatcher.shutdown()
        await service.dispatcher.agent.close()
        if service.http is not None:
            await service.http.close()

    service = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield Gateway(f"http://127.0.0.1:{port}", loop, service, apps[0], rewards)
    finally:
        asyncio.run_coroutine_threadsafe(stop(service), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextmanager
def serve_reviews(server: ReviewServer) -> Iterator[str]:
    """Serve the stand-in TokenReview / SubjectAccessReview endpoints on loopback; yields the URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app())
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="reviews", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
