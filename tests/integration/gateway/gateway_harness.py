"""A gateway served on loopback from a thread of its own, in front of the real dispatcher.

The gateway, the dispatcher and the stand-in reward runtime share one event loop in a background
thread, so that tests (and the trainer-side clients they run, most of them blocking) talk to it over
real HTTP exactly as a trainer would. The dispatcher does not serve ``reward`` actions yet (the GPU
work builds the reward runtime), so :class:`RewardRouting` sends those to a small stand-in reward
runtime speaking the internal protocol documented on :func:`standin_reward_app`; every other
action goes to the real dispatcher.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import requests
from aiohttp import web
from sandbox_agent_harness import Agent

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher, HostEndpoint
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.errors import NotFound
from arl_tangram.gateway import GatewayConfig, build_gateway_app
from arl_tangram.gateway.admission import Admission
from arl_tangram.gateway.auth import Authenticator
from arl_tangram.gateway.review_server import ReviewServer
from arl_tangram.gateway.state import STATE, BatchResults, Readiness, always_leader

NS = "team-a"
POOL = "py"
SERVICE = "rm"
T = TypeVar("T")


def pool_for_tests(name: str = POOL, namespace: str = NS) -> PoolConfig:
    model = ActionPool.model_validate(
        {
            "metadata": {"name": name, "namespace": namespace, "generation": 1},
            "spec": {
                "template": {"image": "sandbox:test", "resources": {"cpu": "2", "memory": "4Gi"}},
                "languages": ["python", "bash"],
                "limits": {"timeoutSeconds": 30, "memory": "1Gi", "maxCores": 2},
            },
        }
    )
    return pool_config(model, uid=f"uid-{namespace}-{name}")


def endpoint(agent: Agent, name: str) -> HostEndpoint:
    health = requests.get(agent.url + "/v1/health", timeout=10).json()
    return HostEndpoint(name, f"127.0.0.1:{agent.port}", tuple(health["cores"]["ids"]), 4 << 30)


def standin_reward_app(scored: list[dict[str, Any]]) -> web.Application:
    """A stand-in reward runtime. Internal protocol: ``POST /v1/score`` with ``{"service", "prompt",
    "response", "label"}`` answers ``{"reward": float}``: 1.0 when the label occurs in the response,
    0.0 when it does not, and len(response)/100 when there is no label. Each call is recorded."""

    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        scored.append(body)
        label, response = body.get("label"), body["response"]
        reward = len(response) / 100 if label is None else float(str(label) in response)
        return web.json_response({"reward": reward})

    app = web.Application()
    app.router.add_post("/v1/score", score)
    return app


@dataclass
class RewardRouting:
    """An ActionService: ``reward`` actions to the stand-in runtime, the rest to the dispatcher."""

    dispatcher: Dispatcher
    reward_url: str
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
        assert self.http is not None
        async with self.http.post(
            f"{self.reward_url}/v1/score", json={"service": request.target, **request.payload}
        ) as resp:
            if resp.status != 200:
                return ActionOutcome(request.key, Outcome.FAILED, Reason.SANDBOX_ERROR, await resp.text())
            body = await resp.json()
        return ActionOutcome(
            request.key, Outcome.SUCCEEDED, reward=float(body["reward"]), response=body, attempts=1
        )

    async def cancel(self, key: str) -> bool:
        return await self.dispatcher.cancel(key)

    async def open_session(self, namespace: str, pool: str, ttl_s: float | None = None) -> str:
        return await self.dispatcher.open_session(namespace, pool, ttl_s)

    async def close_session(self, namespace: str, pool: str, session: str) -> None:
        await self.dispatcher.close_session(namespace, pool, session)


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
    scored: list[dict[str, Any]] = field(default_factory=list)

    def admission(self) -> Admission:
        """The gateway's counts of held actions (read from the test thread: plain dict reads)."""
        return self.app[STATE].admission

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run ``coro`` on the gateway's loop and wait for it (e.g. to inspect the dispatcher)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)


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
) -> Iterator[Gateway]:
    """Serve a gateway (and the stand-in reward runtime) until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway", daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []
    apps: list[web.Application] = []
    scored: list[dict[str, Any]] = []
    port, reward_port = free_port(), free_port()

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
            dispatcher, f"http://127.0.0.1:{reward_port}", frozenset({SERVICE}), aiohttp.ClientSession()
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
        for application, p in ((app, port), (standin_reward_app(scored), reward_port)):
            runner = web.AppRunner(application)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", p).start()
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
        yield Gateway(f"http://127.0.0.1:{port}", loop, service, apps[0], scored)
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
