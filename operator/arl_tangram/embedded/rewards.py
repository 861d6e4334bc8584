"""RewardModelServices in the embedded mode: the reward runtime as one local process.

A service with ``server.runtime: builtin`` whose weights are a local file (``model.uri:
file:///PATH``, a ``.npz`` of the built-in scorer) is served by ``tangram reward-runtime`` on
loopback, on the CPU, with the service's batching settings. Anything else (weights on a hub or in a
bucket, vLLM and SGLang servers) needs a cluster's pods and is reported as not served, with why.

Reward actions arrive as the gateway builds them (payload ``{prompt, response, label}`` or the
ActionBatch form ``{messages: [...]}``); the text scored is the prompt followed by the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.dispatch.rewards import KeyedTasks
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.services import service_named
from arl_tangram.errors import InvalidSpec, NotFound
from arl_tangram.runtime.local import free_port

# The reward runtime's host-memory budget for weights when a service names no GPU memory.
DEFAULT_BUDGET = "1Gi"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


class RewardRuntimeFailed(RuntimeError):
    """The reward runtime process did not start (a damaged model file, a budget too small); the
    message is its own reason."""


def key_of(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def servable(svc: RewardModelService) -> str | None:
    """None when the embedded mode can serve ``svc``; else why not, in words."""
    if svc.spec.server.runtime != "builtin":
        return f"server.runtime {svc.spec.server.runtime} needs its own server image (a cluster's pods)"
    if not svc.spec.model.uri.startswith("file://"):
        return f"model.uri {svc.spec.model.uri} is not a local file (file:///PATH.npz); nothing is downloaded"
    path = Path(svc.spec.model.uri.removeprefix("file://"))
    if not path.is_file():
        return f"model.uri names {path}, which does not exist"
    return None


def text_of(payload: Mapping[str, Any]) -> str:
    """The text a reward action asks to score: the prompt (a chat's contents joined) followed by the
    response, or an ActionBatch action's ``messages`` joined."""
    if isinstance(payload.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in payload["messages"] if isinstance(m, Mapping))
    prompt = payload.get("prompt") or ""
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, Mapping))
    response = payload.get("response")
    if not isinstance(response, str):
        raise InvalidSpec("payload.response", "a reward action needs a response (text) or messages")
    return f"{prompt}{response}"


@dataclass
class LocalRewards:
    """The reward runtime process for the servable services (none when there are none)."""

    services: dict[str, RewardModelService]
    state_dir: Path
    # Declared but not served (namespace/name -> why): a request naming one is told why, not that
    # no such service exists.
    unserved: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None
    http: aiohttp.ClientSession | None = None
    # The requests scoring, by key: what ``cancel`` stops, as the operator's reward router does.
    _serving: KeyedTasks = field(default_factory=KeyedTasks)

    @classmethod
    def plan(cls, services: Sequence[RewardModelService], state_dir: Path) -> tuple[LocalRewards, list[str]]:
        served: dict[str, RewardModelService] = {}
        unserved: dict[str, str] = {}
        notes = []
        for svc in services:
            key = key_of(svc.metadata.namespace or "default", svc.metadata.name or "")
            why = servable(svc)
            if why is None:
                served[key] = svc
            else:
                unserved[key] = f"RewardModelService {key}: not served by tangram up: {why}"
                notes.append(unserved[key])
        return cls(served, state_dir, unserved=unserved), notes

    def _services_file(self) -> Path:
        entries = []
        for key, svc in self.services.items():
            batching = svc.spec.batching
            entries.append(
                {
                    # The runtime's own names are flat; the namespace is the gateway's business.
                    "name": key.replace("/", "."),
                    "backend": "builtin",
                    "path": svc.spec.model.uri.removeprefix("file://"),
                    "maxBatchSize": batching.max_batch_size,
                    "maxWaitMillis": batching.max_wait_millis,
                    "maxQueueLength": svc.spec.scaling.max_queue_length,
                    "keepResident": svc.spec.scaling.min_replicas > 0,
                }
            )
        path = self.state_dir / "reward-services.yaml"
        path.write_text(yaml.safe_dump({"services": entries}))
        return path

    async def start(self) -> None:
        if not self.services:
            return
        port = free_port()
        budget = next((str(s.spec.gpu.memory) for s in self.services.values() if s.spec.gpu.memory), None)
        argv = [
            self.python,
            "-m",
            "arl_tangram",
            "reward-runtime",
            f"--config={self._services_file()}",
            f"--listen=127.0.0.1:{port}",
            "--device=cpu",
            f"--device-memory={budget or DEFAULT_BUDGET}",
        ]
        with (self.state_dir / "reward-runtime.log").open("ab") as log_file:
            self.proc = await asyncio.to_thread(
                subprocess.Popen,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{port}"
        self.http = aiohttp.ClientSession()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = (self.state_dir / "reward-runtime.log").read_text(errors="replace").strip()
                # Its own last line says why (``tangram reward-runtime: service ...: ...``).
                last = tail.splitlines()[-1] if tail else "(no output)"
                raise RewardRuntimeFailed(f"the reward runtime exited {self.proc.returncode}: {last[-500:]}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self.http.get(f"{self.url}/v1/health") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RewardRuntimeFailed(
                    f"the reward runtime did not answer within {START_TIMEOUT_S:g}s "
                    f"(its log: {self.state_dir / 'reward-runtime.log'})"
                )
            await asyncio.sleep(0.05)  # a poll interval while it starts

    async def score(self, request: ActionRequest) -> ActionOutcome:
        """Score one reward action; CANCELLED when ``cancel`` stopped it."""
        # Served in a task of its own, so that ``cancel`` can stop it (its call to the runtime:
        # the connection is closed) while its caller still gets an outcome.
        task = asyncio.create_task(self._score(request))
        self._serving.add(request.key, task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # its caller was cancelled (which cancelled the request too), not the request
            return ActionOutcome(request.key, Outcome.CANCELLED, Reason.CANCELLED, "cancelled")
        finally:
            self._serving.discard(request.key, task)

    def cancel(self, key: str) -> bool:
        """Stop the reward actions under ``key``; False when none is being scored."""
        return self._serving.cancel(key)

    async def _score(self, request: ActionRequest) -> ActionOutcome:
        served = (
            (svc.metadata.namespace or "default", svc.metadata.name or "", svc.spec.model.name)
            for svc in self.services.values()
        )
        name = service_named(request.namespace, request.target, served)
        key = key_of(request.namespace, name)
        if key in self.unserved:
            raise NotFound("RewardModelService", name, self.unserved[key])
        if key not in self.services or self.http is None or self.url is None:
            raise NotFound("RewardModelService", request.target)
        text = text_of(request.payload)
        started = time.monotonic()
        try:
            async with self.http.post(
                f"{self.url}/v1/score", json={"service": key.replace("/", "."), "inputs": [text]}
            ) as resp:
                body = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return ActionOutcome(request.key, Outcome.FAILED, Reason.SANDBOX_ERROR, f"reward runtime: {exc}")
        if status != 200 or not isinstance(body, dict):
            message = body.get("error") if isinstance(body, dict) else str(body)
            return ActionOutcome(request.key, Outcome.FAILED, Reason.SANDBOX_ERROR, str(message), attempts=1)
        return ActionOutcome(
            request.key,
            Outcome.SUCCEEDED,
            reward=float(body["scores"][0]),
            duration_s=time.monotonic() - started,
            attempts=1,
            response=body,
        )

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
