"""Reward actions: routed to a RewardModelService's ready replicas (reward runtimes), least busy first.

The runtime in each replica batches requests within its window, keeps weights in host memory and
restores them on demand (evict-on-execution); the router's part is to hold actions while a service
scales from zero (within its bounded queue), spread them over replicas, and retry on another replica
when one fails.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from arl_tangram.dispatch.agent import AgentClient, AgentRefused
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.domain.services import ServiceConfig, reward_text
from arl_tangram.errors import InfrastructureError, NotFound, QueueFull

# A request waits this long for a replica beyond the service's cold-start budget before it fails.
WAIT_MARGIN_S = 60.0
ACT_WINDOW_S = 300.0


@dataclass
class _Service:
    config: ServiceConfig
    endpoints: dict[str, str] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    running: int = 0
    last_active: float | None = None
    acts: deque[tuple[float, float]] = field(default_factory=deque)


@dataclass(frozen=True)
class ServiceStats:
    queued: int
    running: int
    last_active: float | None
    act_recent_s: tuple[float, ...]
    inflight: dict[str, int]


class RewardRouter:
    """The reward half of the dispatcher."""

    def __init__(self, client: AgentClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self._services: dict[str, _Service] = {}

    def upsert(self, config: ServiceConfig) -> None:
        svc = self._services.get(config.key)
        if svc is None:
            self._services[config.key] = _Service(config)
        else:
            svc.config = config

    def remove(self, key: str) -> None:
        self._services.pop(key, None)

    def has(self, key: str) -> bool:
        return key in self._services

    def sync(self, key: str, ready: Iterable[tuple[str, str]]) -> None:
        """The service's ready replicas, as (pod name, address)."""
        svc = self._services.get(key)
        if svc is None:
            return
        svc.endpoints = dict(ready)
        svc.inflight = {name: svc.inflight.get(name, 0) for name in svc.endpoints}
        if svc.endpoints:
            svc.ready.set()
        else:
            svc.ready.clear()

    def stats(self, key: str) -> ServiceStats | None:
        svc = self._services.get(key)
        if svc is None:
            return None
        now = self.clock()
        while svc.acts and svc.acts[0][0] < now - ACT_WINDOW_S:
            svc.acts.popleft()
        return ServiceStats(
            svc.waiting, svc.running, svc.last_active, tuple(a for _, a in svc.acts), dict(svc.inflight)
        )

    async def run(self, request: ActionRequest) -> ActionOutcome:
        key = f"{request.namespace}/{request.target}"
        svc = self._services.get(key)
        if svc is None:
            raise NotFound(
                "RewardModelService",
                request.target,
                f"RewardModelService {request.target!r} not found in namespace {request.namespace!r}",
            )
        text = reward_text(request.payload)  # InvalidSpec: the action fails naming the field
        cfg = svc.config
        if svc.waiting + svc.running >= cfg.max_queue:
            raise QueueFull(f"RewardModelService {key} holds {cfg.max_queue} requests (its maxQueueLength)")
        submitted = self.clock()
        svc.last_active = submitted
        attempts = 0
        last_error = ""
        svc.waiting += 1
        waiting = True
        try:
            while attempts <= request.max_retries:
                patience = cfg.cold_start_budget_s + WAIT_MARGIN_S
                try:
                    await asyncio.wait_for(svc.ready.wait(), patience)
                except TimeoutError:
                    return ActionOutcome(
                        request.key,
                        Outcome.FAILED,
                        Reason.RETRIES_EXHAUSTED if attempts else Reason.SANDBOX_ERROR,
                        f"no replica of {key} became ready within {patience:g} s "
                        f"(coldStartBudgetSeconds {cfg.cold_start_budget_s:g} + {WAIT_MARGIN_S:g})",
                        attempts=attempts,
                        queued_s=self.clock() - submitted,
                    )
                replica = min(svc.endpoints, key=lambda n: svc.inflight.get(n, 0))
                address = svc.endpoints[replica]
                attempts += 1
                if waiting:
                    svc.waiting -= 1
                    waiting = False
                svc.running += 1
                svc.inflight[replica] = svc.inflight.get(replica, 0) + 1
                started = self.clock()
                try:
                    body = await self.client.score(address, cfg.name, [text], request.timeout_s or 300.0)
                except InfrastructureError as exc:
                    last_error = str(exc)
                    await asyncio.sleep(request.backoff_s * 2 ** (attempts - 1))
                    continue
                except AgentRefused as exc:
                    return ActionOutcome(
                        request.key,
                        Outcome.FAILED,
                        Reason.INVALID_PAYLOAD,
                        str(exc),
                        attempts=attempts,
                        response=dict(exc.body),
                    )
                finally:
                    svc.running -= 1
                    if replica in svc.inflight:
                        svc.inflight[replica] -= 1
                scores = body.get("scores")
                if not isinstance(scores, list) or not scores or not isinstance(scores[0], int | float):
                    last_error = f"replica {replica} answered without a score: {body!r}"[:300]
                    continue
                now = self.clock()
                svc.acts.append((now, now - submitted))
                svc.last_active = now
                queue_s = float(body.get("queue_s", 0.0))
                restore_s = float(body.get("restore_s", 0.0))
                return ActionOutcome(
                    request.key,
                    Outcome.SUCCEEDED,
                    reward=float(scores[0]),
                    duration_s=float(body.get("exec_s", now - started)),
                    queued_s=(started - submitted) + queue_s,
                    attempts=attempts,
                    host=replica,
                    message=f"restore {restore_s:.3f} s" if restore_s else None,
                    response=dict(body),
                )
            return ActionOutcome(
                request.key,
                Outcome.FAILED,
                Reason.RETRIES_EXHAUSTED,
                f"{attempts} attempts failed; last: {last_error}",
                attempts=attempts,
            )
        finally:
            if waiting:
                svc.waiting -= 1
