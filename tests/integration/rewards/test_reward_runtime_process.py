"""A real ``tangram reward-runtime`` process with three built-in models on CPU, over real HTTP."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from arl_tangram.rewards.builtin import BuiltinScorer, write_model

STARTUP_S = 60


@dataclass
class Runtime:
    url: str
    proc: subprocess.Popen[str]
    models: dict[str, Path]

    def post(self, path: str, body: object) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=60)

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, timeout=60)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    """A runtime that restores only on request (the cache's order is what these tests check)."""
    with _running(tmp_path, "--no-prewarm") as rt:
        yield rt


@contextlib.contextmanager
def _running(tmp_path: Path, *flags: str) -> Iterator[Runtime]:
    models = {
        n: write_model(tmp_path / f"{n}.npz", buckets=4096, dim=32, seed=i) for i, n in enumerate("abc")
    }
    size = BuiltinScorer.from_file(models["a"]).nbytes
    services = [
        {"name": n, "backend": "builtin", "path": str(p), "maxWaitMillis": 0} for n, p in models.items()
    ]
    services.append(
        {
            "name": "slow",
            "backend": "builtin",
            "path": str(models["a"]),
            "maxWaitMillis": 60000,
            "maxBatchSize": 1000,
            "maxQueueLength": 1,
        }
    )
    cfg = tmp_path / "services.yaml"
    cfg.write_text(yaml.safe_dump({"services": services}))
    # Room for two of the models: the third evicts the least recently used.
    budget = str(size * 2 + size // 2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "reward-runtime",
            "--config",
            str(cfg),
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
            "--device-memory",
            budget,
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the runtime prints where it listens once it serves
    if "listening on" not in line:
        proc.kill()
        pytest.fail(f"runtime did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    url = "http://" + line.split("listening on ")[1].split()[0]
    try:
        yield Runtime(url, proc, models)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _local_scores(path: Path, texts: list[str]) -> list[float]:
    s = BuiltinScorer.from_file(path)
    s.restore()
    return s.score(texts)


def test_scores_restore_overhead_and_lru_over_http(runtime: Runtime) -> None:
    texts = ["print(1)", "assert f(2) == 4", ""]
    first = runtime.post("/v1/score", {"service": "a", "inputs": texts})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["service"] == "a" and body["scores"] == _local_scores(runtime.models["a"], texts)
    assert body["restore_s"] > 0 and body["queue_s"] >= 0 and body["exec_s"] >= 0
    assert runtime.post("/v1/score", {"service": "a", "inputs": ["x"]}).json()["restore_s"] == 0
    runtime.post("/v1/score", {"service": "b", "inputs": ["x"]})
    third = runtime.post("/v1/score", {"service": "c", "inputs": ["x"]}).json()
    assert third["evicted"] == ["a"]
    services = {s["name"]: s for s in runtime.get("/v1/services").json()["services"]}
    assert [n for n, s in services.items() if s["resident"]] == ["b", "c"]
    assert services["a"]["evictions"] == 1 and services["a"]["restores"] == 1
    health = runtime.get("/v1/health").json()
    assert health["status"] == "ok" and health["used_bytes"] <= health["capacity_bytes"]
    assert health["resident"] == ["b", "c"]


def test_prewarms_what_fits_and_scaled_to_zero_stays_cold(tmp_path: Path) -> None:
    """By default the runtime fills free device memory before any request: two of the four equal
    services fit, the first two of the file, and their first requests restore nothing; another
    still evicts the least recently used."""
    with _running(tmp_path) as runtime:
        deadline = time.monotonic() + STARTUP_S
        while len(runtime.get("/v1/health").json()["resident"]) < 2:
            assert time.monotonic() < deadline, runtime.get("/v1/services").json()
            time.sleep(0.05)
        services = {s["name"]: s for s in runtime.get("/v1/services").json()["services"]}
        warm = [n for n, s in services.items() if s["resident"]]
        assert warm == ["a", "b"] and all(services[n]["restores"] == 1 for n in warm), services
        body = runtime.post("/v1/score", {"service": warm[0], "inputs": ["x"]}).json()
        assert body["restore_s"] == 0 and body["evicted"] == []
        cold = next(n for n in "abc" if n not in warm)
        assert runtime.post("/v1/score", {"service": cold, "inputs": ["x"]}).json()["evicted"] == [warm[1]]
        # Scaled to zero, a service is not restored again by itself, though its memory is free.
        assert runtime.post(f"/v1/services/{cold}/evict", {}).json()["evicted"] is True
        time.sleep(0.5)
        resident = runtime.get("/v1/health").json()["resident"]
        assert cold not in resident and warm[0] in resident, resident


def test_scale_to_zero_and_prewarm(runtime: Runtime) -> None:
    assert runtime.post("/v1/services/a/restore", {}).json()["restore_s"] > 0
    assert runtime.post("/v1/services/a/evict", {}).json() == {"service": "a", "evicted": True}
    assert runtime.get("/v1/health").json()["resident"] == []
    assert runtime.post("/v1/services/zzz/evict", {}).status_code == 404


def test_bad_requests_get_clear_errors(runtime: Runtime) -> None:
    unknown = runtime.post("/v1/score", {"service": "nope", "inputs": ["x"]})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    assert runtime.post("/v1/score", {"service": "a", "inputs": "x"}).status_code == 400
    assert runtime.post("/v1/score", {"inputs": ["x"]}).status_code == 400
    raw = requests.post(runtime.url + "/v1/score", data=b"{", timeout=30)
    assert raw.status_code == 400


def test_a_full_queue_is_refused_with_retry_after(runtime: Runtime) -> None:
    # "slow" batches only after a minute or 1000 inputs and queues one request: the second is refused.
    import threading

    answers: list[int] = []

    def wait_in_queue() -> None:
        answers.append(runtime.post("/v1/score", {"service": "slow", "inputs": ["x"]}).status_code)

    waiter = threading.Thread(target=wait_in_queue, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while True:
        queued = {s["name"]: s["queued"] for s in runtime.get("/v1/services").json()["services"]}
        if queued["slow"] == 1:
            break
        assert time.monotonic() < deadline, "the first request never queued"
        time.sleep(0.05)
    refused = runtime.post("/v1/score", {"service": "slow", "inputs": ["y"]})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    # Stopping the runtime answers the waiting request at once (503), not after its window.
    runtime.proc.terminate()
    waiter.join(timeout=30)
    assert answers == [503]


def test_a_bad_services_file_is_one_clear_line(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"services": [{"name": "x", "backend": "vllm", "url": "http://h"}]}))
    out = _start_with(cfg)
    assert out.returncode == 2
    assert out.stderr.strip() == "tangram reward-runtime: services[0].model is required for backend vllm"


def test_write_model_makes_a_file_the_runtime_serves(tmp_path: Path) -> None:
    path = tmp_path / "demo.npz"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl_tangram",
            "reward-runtime",
            "--write-model",
            str(path),
            "--model-mib",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert out.returncode == 0, out.stderr
    scorer = BuiltinScorer.from_file(path)
    assert 1.9 * 2**20 < scorer.nbytes < 2.1 * 2**20


def test_odd_inputs_over_http_get_their_own_answers(runtime: Runtime) -> None:
    """A lone surrogate (valid JSON, no text) is a 400 naming the input, not a 503 for its batch;
    a body over the limit is a JSON 413 like every other error; empty strings, NUL and emoji score."""
    odd = ["", "\x00", "😀" * 10, "a\u0301"]
    ok = runtime.post("/v1/score", {"service": "a", "inputs": odd})
    assert ok.status_code == 200 and ok.json()["scores"] == _local_scores(runtime.models["a"], odd)
    raw = b'{"service": "a", "inputs": ["fine", "x\\ud800"]}'
    bad = requests.post(runtime.url + "/v1/score", data=raw, timeout=60)
    assert bad.status_code == 400 and "inputs[1]" in bad.json()["error"], bad.text
    huge = runtime.post("/v1/score", {"service": "a", "inputs": ["x" * (65 * 2**20)]})
    assert huge.status_code == 413 and "split the inputs" in huge.json()["error"], huge.text


def test_a_damaged_model_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    """A truncated weights file is refused at start with one line naming it (it was a zipfile
    traceback)."""
    model = write_model(tmp_path / "rm.npz", buckets=256, dim=8)
    model.write_bytes(model.read_bytes()[:1000])
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({"services": [{"name": "rm", "backend": "builtin", "path": str(model)}]}))
    out = _start_with(cfg)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(
        f"tangram reward-runtime: service rm: {model} is not a built-in scorer model"
    )
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _start_with(cfg: Path) -> subprocess.CompletedProcess[str]:
    """``tangram reward-runtime --config cfg`` run to its end (it is expected to refuse the file)."""
    command = [sys.executable, "-m", "arl_tangram", "reward-runtime"]
    return subprocess.run(
        [*command, "--config", str(cfg), "--device-memory", "1Gi"],
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
