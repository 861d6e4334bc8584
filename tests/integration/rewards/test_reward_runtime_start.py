"""What a real ``tangram reward-runtime`` process refuses at start (one line naming the field or
flag, exit 2, before any request), and a vLLM stand-in's refusal of one input over real HTTP."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from aiohttp import web

from arl_tangram.rewards.builtin import write_model

STARTUP_S = 60
MAX_CHARS = 20  # the vLLM stand-in's maximum length, in characters


def _run(cfg: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The runtime run to its end (it is expected to refuse to start)."""
    return subprocess.run(
        [sys.executable, "-m", "arl_tangram", "reward-runtime", "--config", str(cfg), *flags],
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )


def _services(tmp_path: Path, *entries: dict[str, Any]) -> Path:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"services": list(entries)}))
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr.strip()


HTTP = {"backend": "sglang", "model": "m", "deviceMemory": "1Gi"}


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        # Each was taken at start and failed later: a url without scheme or of another scheme at
        # the first request, a quoted "false" kept the service resident (bool("false") is true), a
        # word for a number was refused without naming the field.
        ({"name": "rm", **HTTP, "url": "127.0.0.1:8001"}, "services[0].url must be http://HOST[:PORT]"),
        ({"name": "rm", **HTTP, "url": "ftp://h"}, "services[0].url must be http://HOST[:PORT]"),
        ({"name": "rm", **HTTP, "url": "http://h", "keepResident": "false"}, "services[0].keepResident"),
        ({"name": "rm", **HTTP, "url": "http://h", "maxBatchSize": "zero"}, "services[0].maxBatchSize"),
        ({"name": "rm", **HTTP, "url": "http://h", "maxQueueLength": 0}, "services[0].maxQueueLength"),
        ({"name": "rm", **HTTP, "url": "http://h", "maxWaitMillis": "5ms"}, "services[0].maxWaitMillis"),
    ],
)
def test_a_bad_field_is_named_at_start(tmp_path: Path, entry: dict[str, Any], says: str) -> None:
    line = _one_line(_run(_services(tmp_path, entry), "--device-memory", "2Gi"))
    assert line.startswith(f"tangram reward-runtime: {says}"), line


def test_an_sglang_url_where_nothing_listens_stops_the_start(tmp_path: Path) -> None:
    """SGLang's adapter asked nothing at start: a wrong url served, and every request failed 503.
    Now the start fails naming the service and the url, as vLLM's does."""
    url = f"http://127.0.0.1:{_free_port()}"
    cfg = _services(tmp_path, {"name": "rm", **HTTP, "url": url})
    line = _one_line(_run(cfg, "--device-memory", "2Gi"))
    assert line.startswith(f"tangram reward-runtime: rm: GET {url}/health failed"), line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--device", "gpu0", "--device-memory", "2Gi"], "--device must be cpu, cuda or cuda:N, got 'gpu0'"),
        (["--device-memory", "lots"], "--device-memory: 'lots' is not a valid quantity"),
    ],
)
def test_a_bad_device_flag_is_named_at_start(tmp_path: Path, flags: list[str], says: str) -> None:
    cfg = _services(
        tmp_path, {"name": "rm", "path": str(write_model(tmp_path / "rm.npz", buckets=64, dim=4))}
    )
    line = _one_line(_run(cfg, *flags))
    assert line.startswith(f"tangram reward-runtime: {says}"), line


def test_a_missing_model_path_is_named_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "rm.npz"
    line = _one_line(
        _run(_services(tmp_path, {"name": "rm", "path": str(missing)}), "--device-memory", "1Gi")
    )
    assert line == f"tangram reward-runtime: service rm: no model file at {missing}"


def _vllm_standin() -> web.Application:
    """vLLM's sleep query and ``/pooling``, refusing with its 400 an input past ``MAX_CHARS``."""

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def pooling(request: web.Request) -> web.Response:
        texts = (await request.json())["input"]
        if any(len(t) > MAX_CHARS for t in texts):
            msg = f"This model's maximum context length is {MAX_CHARS} tokens."
            return web.json_response({"object": "error", "message": msg, "code": 400}, status=400)
        rows = [{"index": i, "object": "pooling", "data": [len(t)]} for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "data": rows})

    app = web.Application()
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/pooling", pooling)
    return app


@pytest.fixture
def vllm_url() -> Iterator[str]:
    """The stand-in served from a thread of this process (the runtime is another process)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_vllm_standin())
    port = _free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_an_input_past_the_models_length_is_a_400_for_its_request_only(tmp_path: Path, vllm_url: str) -> None:
    """Three requests batched together, one holding an input the vLLM server refuses (past its
    maximum length): that one is a 400 with the server's message (the dispatcher does not retry
    it), the others 200 with their own scores. All three were 503s before."""
    cfg = _services(
        tmp_path,
        {
            "name": "rm",
            "backend": "vllm",
            "url": vllm_url,
            "model": "m",
            "deviceMemory": "1Gi",
            "maxWaitMillis": 500,
            "maxBatchSize": 16,
        },
    )
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "reward-runtime",
            "--config",
            str(cfg),
            "--listen",
            f"127.0.0.1:{port}",
            "--device-memory",
            "2Gi",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "listening" in proc.stdout.readline()
        bodies = [["short", "é😀"], ["fine", "x" * (MAX_CHARS + 1)], ["", "a"]]
        url = f"http://127.0.0.1:{port}/v1/score"
        with ThreadPoolExecutor(3) as pool:
            answers = list(
                pool.map(
                    lambda b: requests.post(url, json={"service": "rm", "inputs": b}, timeout=60), bodies
                )
            )
        assert [a.status_code for a in answers] == [200, 400, 200], [a.text for a in answers]
        assert answers[0].json()["scores"] == [5, 2] and answers[2].json()["scores"] == [0, 1]
        assert "maximum context length" in answers[1].json()["error"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
