"""A scoring call that hangs holds the reward runtime's device for ``--score-timeout`` at most, not
for the long timeout of restores (a vLLM wake-up of big weights), over real HTTP: a real
``tangram reward-runtime`` process in front of a vLLM stand-in served from a thread of the test."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
            await request.app[RELEASE].wait()
        rows = [{"index": i, "object": "pooling", "data": [len(t)]} for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "data": rows})

    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app[SCORED] = []
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_post("/pooling", pooling)
    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def standin() -> Iterator[tuple[str, list[list[str]]]]:
    """The stand-in served from a thread of this process (the runtime is another process): its
    url, and the inputs of each ``/pooling`` call it got."""
    loop = asyncio.new_event_loop()
    app = _vllm_standin()
    runner = web.AppRunner(app)
    port = _free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", app[SCORED]
    finally:
        loop.call_soon_threadsafe(app[RELEASE].set)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def _runtime(tmp_path: Path, url: str, score_timeout_s: float) -> Iterator[str]:
    """A runtime process serving two services, ``slow`` and ``fast``, on the stand-in at ``url``;
    yields its ``/v1/score`` url."""
    entry = {"backend": "vllm", "url": url, "deviceMemory": "1Gi", "maxWaitMillis": 0}
    services = [{"name": "slow", "model": "a", **entry}, {"name": "fast", "model": "b", **entry}]
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
