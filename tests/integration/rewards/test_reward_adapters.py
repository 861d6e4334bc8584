"""The vLLM and SGLang adapters against small stand-in servers that implement the documented endpoints.

No vLLM or SGLang can run here (no GPU), so each stand-in is an aiohttp server with the same paths,
bodies and answers: vLLM's sleep mode (``POST /sleep?level=N``, ``POST /wake_up``, ``GET
/is_sleeping``) and pooling (``POST /pooling``), SGLang's memory saver (``POST
/release_memory_occupation``, ``POST /resume_memory_occupation``) and ``POST /classify``. Both hold
their share of one simulated GPU while awake and refuse to wake past its memory (as CUDA would), so a
runtime that ever put both on the device at once fails the test."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from arl_tangram.rewards.backends import BackendError, SglangBackend, VllmBackend
from arl_tangram.rewards.runtime import RewardRuntime, ServiceSpec

GIB = 2**30


def score_of(text: str) -> float:
    return len(text) / 10


@dataclass
class SimulatedGpu:
    capacity: int
    held: dict[str, int] = field(default_factory=dict)

    def take(self, who: str, nbytes: int) -> bool:
        if sum(v for k, v in self.held.items() if k != who) + nbytes > self.capacity:
            return False
        self.held[who] = nbytes
        return True

    def give(self, who: str) -> None:
        self.held.pop(who, None)


def vllm_standin(gpu: SimulatedGpu, model: str, nbytes: int, calls: list[str]) -> web.Application:
    state = {"sleeping": False}
    gpu.held["vllm"] = nbytes  # a fresh server holds its memory

    async def is_sleeping(_: web.Request) -> web.Response:
        calls.append("is_sleeping")
        return web.json_response({"is_sleeping": state["sleeping"]})

    async def sleep(request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        calls.append(f"sleep level={level}")
        state["sleeping"] = True
        gpu.give("vllm")
        return web.Response(status=200)

    async def wake_up(_: web.Request) -> web.Response:
        calls.append("wake_up")
        if not gpu.take("vllm", nbytes):
            return web.json_response({"error": "CUDA out of memory"}, status=500)
        state["sleeping"] = False
        return web.Response(status=200)

    async def pooling(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(f"pooling {len(body['input'])}")
        if body.get("model") != model:
            return web.json_response({"error": f"model {body.get('model')} not found"}, status=404)
        if state["sleeping"]:
            return web.json_response({"error": "engine is sleeping"}, status=400)
        data = [{"index": i, "object": "pooling", "data": [score_of(t)]} for i, t in enumerate(body["input"])]
        return web.json_response({"id": "pool-1", "object": "list", "data": data})

    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_post("/pooling", pooling)
    return app


def sglang_standin(gpu: SimulatedGpu, model: str, nbytes: int, calls: list[str]) -> web.Application:
    state = {"released": False}
    gpu.held["sglang"] = nbytes

    async def release(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(f"release tags={body.get('tags')}")
        state["released"] = True
        gpu.give("sglang")
        return web.json_response({"success": True})

    async def resume(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(f"resume tags={body.get('tags')}")
        if not gpu.take("sglang", nbytes):
            return web.json_response({"error": "CUDA out of memory"}, status=500)
        state["released"] = False
        return web.json_response({"success": True})

    async def classify(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(f"classify {len(body['text'])}")
        if state["released"]:
            return web.json_response({"error": "memory released"}, status=400)
        return web.json_response(
            [{"embedding": [score_of(t)], "meta_info": {"id": str(i)}} for i, t in enumerate(body["text"])]
        )

    app = web.Application()
    app.router.add_post("/release_memory_occupation", release)
    app.router.add_post("/resume_memory_occupation", resume)
    app.router.add_post("/classify", classify)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@dataclass
class Bed:
    gpu: SimulatedGpu
    vllm_calls: list[str]
    sglang_calls: list[str]
    runtime: RewardRuntime


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    gpu = SimulatedGpu(10 * GIB)
    vcalls: list[str] = []
    scalls: list[str] = []
    vr, vurl = await _serve(vllm_standin(gpu, "judge-model", 6 * GIB, vcalls))
    sr, surl = await _serve(sglang_standin(gpu, "rm-model", 6 * GIB, scalls))
    session = aiohttp.ClientSession()
    rt = RewardRuntime(
        [
            (ServiceSpec("judge", max_wait_s=0), VllmBackend("judge", vurl, "judge-model", 6 * GIB, session)),
            (ServiceSpec("rm", max_wait_s=0), SglangBackend("rm", surl, "rm-model", 6 * GIB, session)),
        ],
        gpu.capacity,
    )
    await rt.start()
    try:
        yield Bed(gpu, vcalls, scalls, rt)
    finally:
        await rt.stop()
        await session.close()
        await vr.cleanup()
        await sr.cleanup()


async def test_start_puts_what_does_not_fit_to_sleep(bed: Bed) -> None:
    assert bed.vllm_calls == ["is_sleeping"]
    assert bed.sglang_calls == ["release tags=None"]
    assert bed.runtime.cache.resident == ["judge"] and set(bed.gpu.held) == {"vllm"}


async def test_requests_alternate_services_through_sleep_and_wake(bed: Bed) -> None:
    texts = ["a", "bbb"]
    r1 = await bed.runtime.score("rm", texts)
    assert r1.scores == [score_of(t) for t in texts] and r1.evicted == ("judge",) and r1.restore_s > 0
    r2 = await bed.runtime.score("judge", texts)
    assert r2.scores == [score_of(t) for t in texts] and r2.evicted == ("rm",)
    r3 = await bed.runtime.score("judge", ["cc"])
    assert r3.restore_s == 0 and r3.evicted == ()
    assert bed.vllm_calls == ["is_sleeping", "sleep level=1", "wake_up", "pooling 2", "pooling 1"]
    assert bed.sglang_calls == ["release tags=None", "resume tags=None", "classify 2", "release tags=None"]
    assert set(bed.gpu.held) == {"vllm"}


async def test_a_server_that_fails_is_a_backend_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        backend = VllmBackend("x", f"http://127.0.0.1:{port}", "m", GIB, session)
        with pytest.raises(BackendError, match="failed"):
            await backend.start()


async def test_an_unexpected_answer_is_named() -> None:
    async def nonsense(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"no": "index"}]})

    app = web.Application()
    app.router.add_post("/pooling", nonsense)
    runner, url = await _serve(app)
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(BackendError, match="unexpected shape"):
                await VllmBackend("x", url, "m", GIB, session).score(["a"])
    finally:
        await runner.cleanup()


RELEASE = web.AppKey("release", asyncio.Event)


def faulty_upstream(fault: str) -> web.Application:
    """A vLLM and SGLang stand-in whose scoring endpoints answer with ``fault``: the documented shapes
    (``/pooling`` rows with ``index`` and ``data``, ``/classify`` a list with ``embedding``), bent in
    one way each."""

    def rows(n: int) -> list[dict[str, object]]:
        return [{"index": i, "object": "pooling", "data": [score_of("x" * i)]} for i in range(n)]

    async def answer(request: web.Request, n: int, good: object) -> web.StreamResponse:
        if fault == "nan":  # what Python's json.dumps writes for float("nan"), and json.loads reads
            return web.Response(text=json.dumps(good).replace("0.0", "NaN"), content_type="application/json")
        if fault == "inf":
            return web.Response(
                text=json.dumps(good).replace("0.1", "Infinity"), content_type="application/json"
            )
        if fault == "500":
            return web.json_response({"object": "error", "message": "CUDA error"}, status=500)
        if fault == "malformed":
            return web.Response(text=json.dumps(good)[:-3], content_type="application/json")
        if fault == "empty":
            return web.Response(status=200)
        if fault == "slow":  # answers only once the test is over
            await request.app[RELEASE].wait()
        if fault == "drop":  # the server goes away mid-request
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        return web.json_response(good)

    async def pooling(request: web.Request) -> web.StreamResponse:
        n = len((await request.json())["input"])
        out = rows(n)
        if fault == "fewer":
            out = out[:-1]
        elif fault == "more":
            out = [*out, {"index": n, "object": "pooling", "data": [1.0]}]
        elif fault == "repeated index":
            out = [{**r, "index": 0} for r in out]
        elif fault == "string score":
            out = [{**r, "data": "0.5"} for r in out]
        elif fault == "boolean score":
            out = [{**r, "data": [True]} for r in out]
        return await answer(request, n, {"id": "pool-1", "object": "list", "data": out})

    async def classify(request: web.Request) -> web.StreamResponse:
        n = len((await request.json())["text"])
        out: list[dict[str, object]] = [{"embedding": [score_of("x" * i)]} for i in range(n)]
        if fault == "fewer":
            out = out[:-1]
        elif fault == "more":
            out = [*out, {"embedding": [1.0]}]
        elif fault == "string score":
            out = [{"embedding": ["0.5"]} for _ in out]
        elif fault == "boolean score":
            out = [{"embedding": [False]} for _ in out]
        return await answer(request, n, out)

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/pooling", pooling)
    app.router.add_post("/classify", classify)
    return app


FAULTS = {
    "nan": "nan",
    "inf": "inf",
    "500": "answered 500",
    "malformed": "malformed JSON",
    "empty": "empty body",
    "slow": "timed out",
    "drop": "failed",
    "fewer": "for 3 inputs",
    "more": "for 3 inputs",
    "repeated index": "for 3 inputs",
    "string score": "not a number",
    "boolean score": "not a number",
}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_misbehaving_server_fails_the_batch_never_a_wrong_score(kind: str, fault: str) -> None:
    """Two requests batched together against a server that answers NaN/inf, too few or too many
    scores, a repeated index, strings or booleans, malformed JSON, nothing, too late, or drops the
    connection: both get a BackendError naming the fault (503 over HTTP, the dispatcher retries
    elsewhere), never scores. NaN, inf, strings, booleans, a repeated index and the wrong counts
    used to pass as scores (NaN then made the runtime's answer invalid JSON)."""
    if kind == "sglang" and fault == "repeated index":
        pytest.skip("SGLang's /classify answers carry no index")
    app = faulty_upstream(fault)
    runner, url = await _serve(app)
    # A short scoring timeout stands for the runtime's own, which the "slow" server never answers in.
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    cls = VllmBackend if kind == "vllm" else SglangBackend
    backend = cls("rm", url, "m", GIB, session, score_timeout_s=1 if fault == "slow" else 60)
    rt = RewardRuntime([(ServiceSpec("rm", max_batch_size=3, max_wait_s=1), backend)], GIB)
    try:
        await rt.start()  # both stand-ins are awake: scoring is what this test asks
        assert rt.cache.resident == ["rm"]
        answers = await asyncio.gather(
            rt.score("rm", ["", "x"]), rt.score("rm", ["xx"]), return_exceptions=True
        )
        for a in answers:
            assert isinstance(a, BackendError), a
            assert re.search(FAULTS[fault], str(a), re.IGNORECASE), str(a)
            assert str(a).startswith("rm: ")
    finally:
        app[RELEASE].set()
        await rt.stop()
        await session.close()
        await runner.cleanup()
