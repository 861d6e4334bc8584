"""A scoring call that hangs holds the reward runtime's device for ``--score-timeout`` at most, not
for the long timeout of restores (a vLLM wake-up of big weights), and no longer than one of its
callers waits for it; over real HTTP: a real ``tangram reward-runtime`` process in front of a vLLM
stand-in served from a thread of the test."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import requests
import yaml
from aiohttp import web

from arl_tangram.rewards.backends import BackendError, VllmBackend

GIB = 2**30
HANG = "hang"  # the stand-in answers no input holding this until the test is over
RELEASE = web.AppKey("release", asyncio.Event)
SCORED = web.AppKey("scored", list[list[str]])
# The inputs of each ``/pooling`` call whose connection closed before it was answered: what a vLLM
# server takes as an abort (its request leaves the GPU).
ABORTED = web.AppKey("aborted", list[list[str]])


def _vllm_standin(wake_s: float = 0.0) -> web.Application:
    """vLLM's sleep endpoints and ``/pooling``; ``wake_s`` is how long ``/wake_up`` takes."""

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def wake_up(_: web.Request) -> web.Response:
        await asyncio.sleep(wake_s)
        return web.Response(status=200)

    async def pooling(request: web.Request) -> web.Response:
        texts = (await request.json())["input"]
        request.app[SCORED].append(texts)
        if HANG in texts:
            try:
                await request.app[RELEASE].wait()
            except asyncio.CancelledError:  # the caller closed the connection (handler_cancellation)
                request.app[ABORTED].append(texts)
                raise
        rows = [{"index": i, "object": "pooling", "data": [len(t)]} for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "data": rows})

    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app[SCORED] = []
    app[ABORTED] = []
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_post("/pooling", pooling)
    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Standin:
    url: str
    app: web.Application
    loop: asyncio.AbstractEventLoop

    def release(self) -> None:
        """Answer the calls held for ``HANG``."""
        self.loop.call_soon_threadsafe(self.app[RELEASE].set)


@pytest.fixture
def standin() -> Iterator[tuple[str, list[list[str]]]]:
    """The stand-in served from a thread of this process (the runtime is another process): its
    url, and the inputs of each ``/pooling`` call it got."""
    with _standin_served() as served:
        yield served.url, served.app[SCORED]


@contextlib.contextmanager
def _standin_served() -> Iterator[Standin]:
    loop = asyncio.new_event_loop()
    app = _vllm_standin()
    # As vLLM's server: a request whose connection closes is cancelled there (an abort).
    runner = web.AppRunner(app, handler_cancellation=True)
    port = _free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield Standin(f"http://127.0.0.1:{port}", app, loop)
    finally:
        loop.call_soon_threadsafe(app[RELEASE].set)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def _runtime(tmp_path: Path, url: str, score_timeout_s: float, **slow: object) -> Iterator[str]:
    """A runtime process serving two services, ``slow`` (with the entry's keys ``slow``) and
    ``fast``, on the stand-in at ``url``; yields its ``/v1/score`` url."""
    entry = {"backend": "vllm", "url": url, "deviceMemory": "1Gi", "maxWaitMillis": 0}
    services = [{"name": "slow", "model": "a", **entry, **slow}, {"name": "fast", "model": "b", **entry}]
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"services": services}))
    port = _free_port()
    flags = [
        "--listen",
        f"127.0.0.1:{port}",
        "--device-memory",
        "4Gi",
        "--score-timeout",
        str(score_timeout_s),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "arl_tangram", "reward-runtime", "--config", str(cfg), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "listening" in proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
        yield f"http://127.0.0.1:{port}/v1/score"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_hanging_scoring_call_frees_the_device_after_the_score_timeout(
    tmp_path: Path, standin: tuple[str, list[list[str]]]
) -> None:
    """Two services on one chunk; the server hangs on one's batch. That request fails with a 503
    naming the timeout (the dispatcher retries elsewhere), and the other service is served after
    it. The scoring call had only the session's 600 s, twice what the dispatcher waits for an
    answer: the device stayed held, and every other service's requests behind it, for up to ten
    minutes after the caller had given up."""
    with _runtime(tmp_path, standin[0], 1) as url:
        hung = requests.post(url, json={"service": "slow", "inputs": [HANG]}, timeout=60)
        assert hung.status_code == 503, hung.text
        assert hung.json()["error"] == "slow: POST /pooling timed out after 1.0 s", hung.text
        served = requests.post(url, json={"service": "fast", "inputs": ["abc"]}, timeout=60)
        assert served.status_code == 200 and served.json()["scores"] == [3], served.text


def test_a_request_whose_caller_went_away_is_not_scored(
    tmp_path: Path, standin: tuple[str, list[list[str]]]
) -> None:
    """A request queued behind a hanging batch whose caller gives up (the dispatcher's timeout, a
    cancelled action) is dropped from the queue, not scored for nobody once the device is free. It
    was scored all the same, holding the device from the requests still waited for."""
    url, scored = standin
    with _runtime(tmp_path, url, 3) as score_url, ThreadPoolExecutor(1) as pool:
        hung = pool.submit(requests.post, score_url, json={"service": "slow", "inputs": [HANG]}, timeout=60)
        while not scored:  # the hanging batch holds the device now
            time.sleep(0.05)
        with pytest.raises(requests.Timeout):
            requests.post(score_url, json={"service": "slow", "inputs": ["gone"]}, timeout=0.5)
        assert hung.result().status_code == 503
        served = requests.post(score_url, json={"service": "fast", "inputs": ["abc"]}, timeout=60)
        assert served.status_code == 200, served.text
    assert scored == [[HANG], ["abc"]]


def _until(what: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Wait for ``what`` to hold (a bound for a stuck run, not a measurement)."""
    deadline = time.monotonic() + limit_s
    while not what():
        assert time.monotonic() < deadline, "it never happened"
        time.sleep(0.05)


def test_a_scoring_call_whose_every_caller_left_is_aborted_on_the_server(tmp_path: Path) -> None:
    """The only caller of a batch gives up while the server scores it: the runtime closes its call
    to the server (vLLM and SGLang abort the request, and free the GPU) and serves the next
    service's request. The call ran on until ``--score-timeout`` (300 s by default), holding the
    device, and every other service's requests behind it, for nobody."""
    with _standin_served() as standin, _runtime(tmp_path, standin.url, 600) as url:
        # The caller leaves once the server has its request (a timeout of the caller's own could
        # fire before the runtime took the batch on a loaded machine: then nothing is sent at all).
        where = urlsplit(url)
        caller = http.client.HTTPConnection(where.hostname or "", where.port, timeout=60)
        caller.request(
            "POST",
            where.path,
            json.dumps({"service": "slow", "inputs": [HANG]}),
            {"Content-Type": "application/json"},
        )
        _until(lambda: [HANG] in standin.app[SCORED])
        caller.close()
        _until(lambda: standin.app[ABORTED] == [[HANG]])
        served = requests.post(url, json={"service": "fast", "inputs": ["abc"]}, timeout=60)
        assert served.status_code == 200 and served.json()["scores"] == [3], served.text


def test_a_scoring_call_is_not_aborted_while_one_of_its_callers_waits(tmp_path: Path) -> None:
    """Two requests share one call to the server (one batch); one caller gives up: the call goes
    on, and the other caller gets its score."""
    with (
        _standin_served() as standin,
        _runtime(tmp_path, standin.url, 600, maxBatchSize=2, maxWaitMillis=600_000) as url,
        ThreadPoolExecutor(2) as pool,
    ):
        health = url.replace("/v1/score", "/v1/health")
        stays = pool.submit(requests.post, url, json={"service": "slow", "inputs": ["stays"]}, timeout=60)
        _until(lambda: requests.get(health, timeout=10).json()["requests"] == 1)
        leaves = pool.submit(requests.post, url, json={"service": "slow", "inputs": [HANG]}, timeout=3)
        _until(lambda: bool(standin.app[SCORED]))  # the batch of both: it is full
        assert sorted(standin.app[SCORED][0]) == sorted(["stays", HANG])
        with pytest.raises(requests.Timeout):
            leaves.result()
        # The runtime saw it go: one request left unanswered.
        _until(lambda: requests.get(health, timeout=10).json()["requests"] == 1)
        standin.release()
        answer = stays.result()
        assert answer.status_code == 200 and answer.json()["scores"] == [len("stays")], answer.text
        assert standin.app[ABORTED] == []


@pytest.mark.parametrize("value", ["0", "nan"])
def test_a_score_timeout_that_is_no_positive_number_is_refused(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"services": [{"name": "rm", "path": str(tmp_path / "m.npz")}]}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "reward-runtime",
            "--config",
            str(cfg),
            "--score-timeout",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--score-timeout must be a number of seconds > 0" in out.stderr, out.stderr


@pytest.fixture
async def slow_waking() -> AsyncIterator[str]:
    app = _vllm_standin(wake_s=1.5)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        app[RELEASE].set()
        await runner.cleanup()


async def test_a_wake_up_longer_than_the_score_timeout_is_not_cut_short(slow_waking: str) -> None:
    """The scoring timeout bounds scoring only: a wake-up that takes longer (big weights copied
    back to the device) keeps the session's timeout, and scoring after it is bounded again."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        backend = VllmBackend("rm", slow_waking, "m", GIB, session, score_timeout_s=0.5)
        await backend.restore()
        assert await backend.score(["ab"]) == [2.0]
        with pytest.raises(BackendError, match=r"^rm: POST /pooling timed out after 0\.5 s$"):
            await backend.score([HANG])
