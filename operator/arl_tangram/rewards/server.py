"""``tangram reward-runtime``: the HTTP server in reward pods (aiohttp), and its services file.

API (docs/gpu.md has the full shapes):

- ``POST /v1/score`` ``{"service": NAME, "inputs": [TEXT, ...]}`` -> ``{"service", "scores": [...],
  "restore_s", "queue_s", "exec_s", "batch_size", "evicted": [...]}``; 404 unknown service, 400 bad
  body, 429 queue full (``Retry-After``), 503 backend failure.
- ``GET /v1/health`` -> ``{"status": "ok", "device", "capacity_bytes", "used_bytes", "resident",
  "restoring", "requests"}``.
- ``GET /v1/services`` -> ``{"services": [{"name", "resident", "device_bytes", "queued", ...}]}``.
- ``POST /v1/services/{name}/evict`` and ``/restore``: scale a service to zero, or pre-warm it.
  Without ``--no-prewarm`` the runtime also pre-warms by itself: while nothing waits, services
  that fit the device's free memory are restored ahead of their requests (``rewards.runtime``).

Services file (YAML)::

    services:
      - name: rm-small            # builtin: a model file on a local path (never downloaded)
        backend: builtin
        path: /models/rm-small.npz
        maxBatchSize: 64
        maxWaitMillis: 5
      - name: judge               # vllm / sglang: a server beside this one in the pod
        backend: vllm
        url: http://127.0.0.1:8001
        model: Qwen/Qwen3-8B
        deviceMemory: 20Gi        # its share of the chunk's memory when awake
        keepResident: false
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from aiohttp import web

from arl_tangram.api.quantity import quantity_bytes
from arl_tangram.loop import stop_on_signals
from arl_tangram.rewards import SCORE_TIMEOUT_S
from arl_tangram.rewards.backends import (
    BackendError,
    BuiltinBackend,
    ServiceBackend,
    SglangBackend,
    VllmBackend,
)
from arl_tangram.rewards.builtin import BuiltinScorer, ModelError, write_model
from arl_tangram.rewards.cache import DoesNotFit
from arl_tangram.rewards.runtime import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT_MS,
    BadInput,
    QueueFull,
    RewardRuntime,
    ServiceSpec,
    UnknownService,
)

log = logging.getLogger("tangram.reward-runtime")

MAX_INPUTS_PER_REQUEST = 4096
MAX_BODY_BYTES = 64 * 2**20
# The HTTP backends' calls other than scoring (start, restore, evict): a vLLM wake-up of big weights
# may block this long. Scoring calls have their own, shorter ``--score-timeout``.
CONTROL_TIMEOUT_S = 600.0
SERVICE_KEYS = {
    "name",
    "backend",
    "path",
    "url",
    "model",
    "deviceMemory",
    "maxBatchSize",
    "maxWaitMillis",
    "maxQueueLength",
    "keepResident",
}


class ConfigError(ValueError):
    """A services file that cannot be served; the message names the entry and the field."""


def parse_services(doc: Any) -> list[dict[str, Any]]:
    """The service entries of a services file, checked (no I/O)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), list) or not doc["services"]:
        raise ConfigError("the services file must have a non-empty list `services`")
    if set(doc) != {"services"}:
        raise ConfigError(f"unknown top-level keys: {sorted(set(doc) - {'services'})}")
    out = []
    for i, entry in enumerate(doc["services"]):
        where = f"services[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a mapping")
        unknown = set(entry) - SERVICE_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(SERVICE_KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name is required")
        backend = entry.get("backend", "builtin")
        if backend not in ("builtin", "vllm", "sglang"):
            raise ConfigError(f"{where}.backend must be builtin, vllm or sglang, got {backend!r}")
        need = ("path",) if backend == "builtin" else ("url", "model", "deviceMemory")
        for key in need:
            if not entry.get(key):
                raise ConfigError(f"{where}.{key} is required for backend {backend}")
        if backend != "builtin":
            url = urlsplit(str(entry["url"]))
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ConfigError(f"{where}.url must be http://HOST[:PORT], got {entry['url']!r}")
        for key in ("maxBatchSize", "maxQueueLength"):
            v = entry.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}.{key} must be an integer >= 1, got {v!r}")
        wait = entry.get("maxWaitMillis", 0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf:
            raise ConfigError(f"{where}.maxWaitMillis must be a number >= 0, got {wait!r}")
        # A YAML string such as "false" would be true to bool().
        if not isinstance(entry.get("keepResident", False), bool):
            raise ConfigError(f"{where}.keepResident must be true or false, got {entry['keepResident']!r}")
        out.append({**entry, "backend": backend})
    return out


def _spec(entry: dict[str, Any]) -> ServiceSpec:
    """The batching of a checked entry (``parse_services``)."""
    return ServiceSpec(
        entry["name"],
        entry.get("maxBatchSize", DEFAULT_MAX_BATCH),
        entry.get("maxWaitMillis", DEFAULT_MAX_WAIT_MS) / 1000,
        entry.get("maxQueueLength", DEFAULT_MAX_QUEUE),
        entry.get("keepResident", False),
    )


def build_backend(
    entry: dict[str, Any],
    device: str,
    session: aiohttp.ClientSession,
    score_timeout_s: float = SCORE_TIMEOUT_S,
) -> ServiceBackend:
    name = entry["name"]
    if entry["backend"] == "builtin":
        try:
            return BuiltinBackend(name, BuiltinScorer.from_file(entry["path"], device))
        except ModelError as exc:
            raise ConfigError(f"service {name}: {exc}") from None
    try:
        nbytes = quantity_bytes(str(entry["deviceMemory"]))
    except ValueError as exc:
        raise ConfigError(f"service {name}.deviceMemory: {exc}") from None
    cls = VllmBackend if entry["backend"] == "vllm" else SglangBackend
    return cls(name, str(entry["url"]), str(entry["model"]), nbytes, session, score_timeout_s)


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def make_app(runtime: RewardRuntime, device: str) -> web.Application:
    """The runtime's HTTP API."""

    async def score(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON")
        except web.HTTPRequestEntityTooLarge:  # aiohttp's own answer is plain text, not {"error"}
            return _error(413, f"the body is over {MAX_BODY_BYTES} bytes (split the inputs over requests)")
        if not isinstance(body, dict) or not isinstance(body.get("service"), str):
            return _error(400, 'the body must be {"service": NAME, "inputs": [TEXT, ...]}')
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
            return _error(400, "inputs must be a list of strings")
        if len(inputs) > MAX_INPUTS_PER_REQUEST:
            return _error(413, f"at most {MAX_INPUTS_PER_REQUEST} inputs per request, got {len(inputs)}")
        try:
            result = await runtime.score(body["service"], inputs)
        except UnknownService:
            return _error(404, f"no service {body['service']!r} here (serving {', '.join(runtime.services)})")
        except BadInput as exc:
            return _error(400, str(exc))
        except QueueFull as exc:
            return _error(429, str(exc), **{"Retry-After": "1"})
        except BackendError as exc:
            return _error(503, str(exc))
        return web.json_response({"service": body["service"], **result.to_json()})

    async def health(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "device": device,
                "capacity_bytes": runtime.cache.capacity,
                "used_bytes": runtime.cache.used,
                "resident": runtime.cache.resident,
                # The services being restored now ([] or one) and the requests not yet answered.
                "restoring": [runtime.restoring] if runtime.restoring else [],
                "requests": runtime.pending,
            }
        )

    async def services(_: web.Request) -> web.Response:
        return web.json_response({"services": runtime.describe()})

    async def control(request: web.Request) -> web.Response:
        name, verb = request.match_info["name"], request.match_info["verb"]
        try:
            # Shielded from the caller going away (``handler_cancellation``): a restore or eviction
            # cut short leaves the server's memory and the cache's count of it apart.
            if verb == "evict":
                return web.json_response(
                    {"service": name, "evicted": await asyncio.shield(runtime.evict(name))}
                )
            return web.json_response(
                {"service": name, "restore_s": await asyncio.shield(runtime.restore(name))}
            )
        except UnknownService:
            return _error(404, f"no service {name!r} here")
        except DoesNotFit as exc:
            return _error(409, str(exc))
        except BackendError as exc:
            return _error(503, str(exc))

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/score", score)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/services", services)
    app.router.add_post("/v1/services/{name}/{verb:evict|restore}", control)
    return app


DEVICE_FORMAT = re.compile(r"cpu|cuda(:\d+)?")


def _device_capacity(device: str, flag: str | None) -> int:
    if not DEVICE_FORMAT.fullmatch(device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if flag is not None:
        try:
            return quantity_bytes(flag)
        except ValueError as exc:
            raise ConfigError(f"--device-memory: {exc}") from None
    if device == "cpu":
        raise ConfigError("--device-memory is required with --device cpu (the budget the cache keeps to)")
    try:
        import torch
    except ImportError:
        raise ConfigError(
            f"--device {device} without PyTorch: give the budget with --device-memory"
        ) from None
    # No GPU (or a CUDA-less PyTorch) raises AssertionError or RuntimeError deep in torch, and an
    # index past the GPUs "invalid device ordinal": one line naming the flag instead.
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ConfigError(f"--device {device}: PyTorch sees {count} CUDA device(s) on this machine")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    # What is free now, less a margin for the CUDA context and activations of the running batch.
    return int(free * 0.9)


def read_services(path: str) -> list[dict[str, Any]]:
    try:
        with Path(path).open() as f:
            return parse_services(yaml.safe_load(f))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


async def serve(args: argparse.Namespace, entries: list[dict[str, Any]]) -> int:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S))
    try:
        # The device first: a bad --device is named as such, not as each model's load failing on it.
        capacity = _device_capacity(args.device, args.device_memory)
        pairs = [(_spec(e), build_backend(e, args.device, session, args.score_timeout)) for e in entries]
        runtime = RewardRuntime(pairs, capacity, prewarm=not args.no_prewarm)
        await runtime.start()
        host, _, port = args.listen.rpartition(":")
        # A score request whose caller went away (the dispatcher gave up on it) is cancelled, and
        # is then dropped from its queue instead of being scored for nobody on the device.
        runner = web.AppRunner(make_app(runtime, args.device), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
        bound = runner.addresses[0]  # the real port when --listen asked for port 0
        where = f"{bound[0]}:{bound[1]}"
        print(f"reward runtime listening on {where} ({len(pairs)} services, {args.device})", flush=True)
        await stop_on_signals().wait()
        # Fail what still waits first (503, the dispatcher retries elsewhere), then close the server:
        # the other order would hold the shutdown for as long as the longest batching window.
        await runtime.stop()
        await runner.cleanup()
    finally:
        await session.close()
    return 0


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tangram reward-runtime", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="services file (YAML)")
    p.add_argument("--listen", default="0.0.0.0:8000", help="HOST:PORT")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the chunk's first GPU)")
    p.add_argument("--device-memory", default=None, help="device memory budget, e.g. 70Gi (cuda: 90%% free)")
    p.add_argument(
        "--no-prewarm",
        action="store_true",
        help="restore a service only when a request asks for it, not into free device memory ahead of it",
    )
    p.add_argument(
        "--score-timeout",
        type=float,
        default=SCORE_TIMEOUT_S,
        metavar="SECONDS",
        help="how long one scoring call to a vLLM or SGLang server may hold the device "
        f"(default {SCORE_TIMEOUT_S:g}, the dispatcher's default wait for an answer)",
    )
    p.add_argument(
        "--write-model",
        metavar="PATH",
        help="write a built-in scorer model of --model-mib and exit (demos, tests)",
    )
    p.add_argument("--model-mib", type=float, default=16.0, help="size of the model --write-model writes")
    p.add_argument("--seed", type=int, default=0, help="seed of the model --write-model writes")
    args = p.parse_args(list(argv))
    if args.write_model:
        if args.model_mib <= 0:
            p.error("--model-mib must be > 0")
        dim = 64
        buckets = max(1, int(args.model_mib * 2**20 / (4 * dim)))
        out = write_model(args.write_model, buckets=buckets, dim=dim, hidden=64, seed=args.seed)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if not args.config:
        p.error("--config is required")
    if not 0 < args.score_timeout < math.inf:
        p.error(f"--score-timeout must be a number of seconds > 0, got {args.score_timeout}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(serve(args, read_services(args.config)))
    except (ConfigError, DoesNotFit, BackendError, ValueError) as exc:
        print(f"tangram reward-runtime: {exc}", file=sys.stderr)
        return 2
