"""Reward actions: routed to a RewardModelService's ready replicas (reward runtimes), least busy first.

The runtime in each replica batches requests within its window, keeps weights in host memory and
restores them on demand (evict-on-execution); the router's part is to hold actions while a service
scales from zero (within its bounded queue), spread them over replicas, and retry on another replica
when one fails. A replica whose call failed gets no request until the controller's next view of the
service drops it (its pod failed or went unready) or, when something still listened there, for
``SUSPECT_S``: scoring has no side effect, so a request it may still hold runs again elsewhere, and
the retries of a replica that died go to its replacement instead of spending every attempt on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from arl_tangram.dispatch.agent import AgentClient, AgentRefused, ConnectFailed
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outage, Outcome, Reason
from arl_tangram.domain.services import ServiceConfig, reward_text, service_named
from arl_tangram.errors import InfrastructureError, NotFound, QueueFull
from arl_tangram.rewards import SCORE_TIMEOUT_S

log = logging.getLogger(__name__)

# A request waits this long for a replica beyond the service's cold-start budget before it fails.
WAIT_MARGIN_S = 60.0
ACT_WINDOW_S = 300.0
# How long a replica whose call failed (timeout, 5xx, connection cut, an answer without a valid
# score) gets no request, unless the controller's view drops it first; one where nothing listens
# any more waits for that view.
SUSPECT_S = 5.0


@dataclass
class _Service:
    config: ServiceConfig
    endpoints: dict[str, str] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    # Replica -> until when (the loop's clock) it gets no request; math.inf: until it is gone.
    suspect: dict[str, float] = field(default_factory=dict)
    # Set (and replaced) at every change of the replicas: what a request waiting for one waits on.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    running: int = 0
    last_active: float | None = None
    acts: deque[tuple[float, float]] = field(default_factory=deque)
    # No replica and none coming (the controller's ``service_outage``): requests are refused.
    outage: Outage | None = None
    # The tasks serving its requests (waiting for a replica or calling one): ended when it is deleted.
    serving: set[asyncio.Task[ActionOutcome]] = field(default_factory=set)
    removed: bool = False


@dataclass
class _Progress:
    """How far a request's task got, for its caller when it is cancelled."""

    started: bool = False  # its task ran (and holds its place in the queue from then on)
    attempts: int = 0  # calls made to replicas


@dataclass(frozen=True)
class ServiceStats:
    queued: int
    running: int
    last_active: float | None
    act_recent_s: tuple[float, ...]
    inflight: dict[str, int]


class KeyedTasks:
    """The reward requests being served, by action key (a retry may come while the first still
    runs): what ``cancel`` stops. The operator's router and ``tangram up``'s local rewards keep
    theirs alike, so that a trainer's cancel works the same in both."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[asyncio.Task[ActionOutcome]]] = {}

    def add(self, key: str, task: asyncio.Task[ActionOutcome]) -> None:
        self._by_key.setdefault(key, set()).add(task)

    def discard(self, key: str, task: asyncio.Task[ActionOutcome]) -> None:
        serving = self._by_key.get(key)
        if serving is not None:
            serving.discard(task)
            if not serving:
                del self._by_key[key]

    def cancel(self, key: str) -> bool:
        """Cancel the requests under ``key``; False when none runs."""
        tasks = [t for t in self._by_key.get(key, ()) if not t.done()]
        for task in tasks:
            task.cancel()
        return bool(tasks)


class RewardRouter:
    """The reward half of the dispatcher."""

    def __init__(
        self, client: AgentClient, clock: Callable[[], float] = time.monotonic, suspect_s: float = SUSPECT_S
    ) -> None:
        self.client = client
        self.clock = clock
        self.suspect_s = suspect_s
        self._services: dict[str, _Service] = {}
        self._serving = KeyedTasks()

    def upsert(self, config: ServiceConfig) -> None:
        svc = self._services.get(config.key)
        if svc is None:
            self._services[config.key] = _Service(config)
        else:
            svc.config = config

    def remove(self, key: str) -> None:
        """The service was deleted: its requests end now, failed ``ServiceNotFound``, as a deleted
        pool's do. Left alone they waited for a replica of a service no one syncs any more (its
        pods go with it) for the whole cold-start budget, and then failed with a reason that
        blamed the replicas; one made again under the name is another service, whose replicas
        they would never have seen."""
        svc = self._services.pop(key, None)
        if svc is None:
            return
        svc.removed = True
        for task in svc.serving:
            task.cancel()

    def set_outage(self, key: str, outage: Outage | None) -> None:
        """Whether the service has no replica and none coming. While it does, a request that would
        wait for a replica is refused with the outage's message (those waiting now at once)."""
        svc = self._services.get(key)
        if svc is None:
            return
        if (outage is None) != (svc.outage is None):
            log.warning(
                "%s", outage.message if outage else f"RewardModelService {key} has a replica coming again"
            )
        svc.outage = outage
        if outage is not None:
            svc.changed.set()  # what waits for a replica wakes, and finds the outage
            svc.changed = asyncio.Event()

    def outage(self, key: str) -> Outage | None:
        svc = self._services.get(key)
        return svc.outage if svc is not None else None

    def has(self, key: str) -> bool:
        return key in self._services

    def resolve(self, request: ActionRequest) -> ActionRequest:
        """``request`` with its target the RewardModelService it names, by name or by the model it
        serves (``service_named``)."""
        if f"{request.namespace}/{request.target}" in self._services:
            return request  # the common case, without a look at every service
        served = ((s.config.namespace, s.config.name, s.config.model) for s in self._services.values())
        name = service_named(request.namespace, request.target, served)
        return request if name == request.target else replace(request, target=name)

    def sync(self, key: str, ready: Iterable[tuple[str, str]]) -> None:
        """The service's ready replicas, as (pod name, address)."""
        svc = self._services.get(key)
        if svc is None:
            return
        before = svc.endpoints
        svc.endpoints = dict(ready)
        # A replica no longer listed gets no new call, but the calls it holds run to their end (a
        # replica drained for a rollout is deleted only once they have: its count is kept while
        # any runs, and is what ``stats`` reports for it).
        svc.inflight = {
            name: count for name, count in svc.inflight.items() if count > 0 or name in svc.endpoints
        }
        for name in svc.endpoints:
            svc.inflight.setdefault(name, 0)
        # A replica no longer listed (or listed at another address) is no longer suspect: it is gone.
        svc.suspect = {
            n: until
            for n, until in svc.suspect.items()
            if n in svc.endpoints and before.get(n) == svc.endpoints[n]
        }
        if svc.endpoints != before:
            svc.changed.set()
            svc.changed = asyncio.Event()

    async def _replica(self, svc: _Service, patience_s: float) -> str | None:
        """The least busy replica that is not suspect, waiting up to ``patience_s`` for one (a new
        replica listed, or a suspicion lapsed); None when none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience_s
        while True:
            now = loop.time()
            usable = [n for n in svc.endpoints if svc.suspect.get(n, -math.inf) <= now]
            if usable:
                return min(usable, key=lambda n: svc.inflight.get(n, 0))
            if now >= deadline or svc.outage is not None:
                return None
            lapse = min((svc.suspect[n] for n in svc.endpoints if n in svc.suspect), default=math.inf)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(svc.changed.wait(), min(deadline, lapse) - now)

    def _suspect(self, svc: _Service, replica: str, gone: bool = False) -> None:
        """No request for ``replica`` for ``suspect_s``; ``gone`` (nothing listens there any more):
        until the controller's view drops it."""
        until = math.inf if gone else asyncio.get_running_loop().time() + self.suspect_s
        svc.suspect[replica] = max(svc.suspect.get(replica, -math.inf), until)

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
        # Its place in the queue is taken now, with the check: taken in its task, every request of
        # the same turn of the loop passed the check before any was counted.
        svc.waiting += 1
        progress = _Progress()
        # Served in a task of its own, so that ``cancel`` can stop it (waiting for a replica, or its
        # call to one: the connection is closed, which a vLLM or SGLang server takes as an abort)
        # and its caller still gets an outcome. A caller cancelled itself cancels it too.
        task = asyncio.create_task(self._serve(svc, request, text, progress))
        self._serving.add(request.key, task)
        svc.serving.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # its caller was cancelled, not the request
            if svc.removed:
                return ActionOutcome(
                    request.key,
                    Outcome.FAILED,
                    Reason.SERVICE_NOT_FOUND,
                    f"RewardModelService {key} was deleted",
                    attempts=progress.attempts,
                )
            return ActionOutcome(
                request.key, Outcome.CANCELLED, Reason.CANCELLED, "cancelled", attempts=progress.attempts
            )
        finally:
            if not progress.started:  # cancelled before its task ran: its place is given back here
                svc.waiting -= 1
            self._serving.discard(request.key, task)
            svc.serving.discard(task)

    def cancel(self, key: str) -> bool:
        """Stop the requests under ``key`` (waiting for a replica or scoring); False when none runs."""
        return self._serving.cancel(key)

    async def _serve(
        self, svc: _Service, request: ActionRequest, text: str, progress: _Progress
    ) -> ActionOutcome:
        """Serve one request, counted as waiting already (``run`` took its place in the queue)."""
        progress.started = True
        key, cfg = f"{request.namespace}/{request.target}", svc.config
        submitted = self.clock()
        svc.last_active = submitted
        attempts = 0
        last_error = ""
        waiting = True
        try:
            while attempts <= request.max_retries:
                patience = cfg.cold_start_budget_s + WAIT_MARGIN_S
                replica = await self._replica(svc, patience)
                if replica is None and svc.outage is not None:
                    return ActionOutcome(
                        request.key,
                        Outcome.FAILED,
                        Reason.TARGET_UNAVAILABLE,
                        svc.outage.message,
                        attempts=attempts,
                        queued_s=self.clock() - submitted,
                    )
                if replica is None:
                    return ActionOutcome(
                        request.key,
                        Outcome.FAILED,
                        Reason.RETRIES_EXHAUSTED if attempts else Reason.SANDBOX_ERROR,
                        f"no replica of {key} ready to serve within {patience:g} s "
                        f"(coldStartBudgetSeconds {cfg.cold_start_budget_s:g} + {WAIT_MARGIN_S:g})",
                        attempts=attempts,
                        queued_s=self.clock() - submitted,
                    )
                address = svc.endpoints[replica]
                attempts += 1
                progress.attempts = attempts
                if waiting:
                    svc.waiting -= 1
                    waiting = False
                svc.running += 1
                svc.inflight[replica] = svc.inflight.get(replica, 0) + 1
                started = self.clock()
                try:
                    body = await self.client.score(
                        address, cfg.name, [text], request.timeout_s or SCORE_TIMEOUT_S
                    )
                except InfrastructureError as exc:
                    last_error = str(exc)
                    self._suspect(svc, replica, gone=isinstance(exc, ConnectFailed) and exc.refused)
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
                        if not svc.inflight[replica] and replica not in svc.endpoints:
                            del svc.inflight[replica]  # unlisted, and its last call is done
                    # Waiting again (for a retry) until it ends: the outer finally settles it.
                    svc.waiting += 1
                    waiting = True
                scores = body.get("scores")
                # One input went, so exactly one score comes back: of two, the first was taken,
                # which may be another input's (a custom server's batch mixed up).
                if not isinstance(scores, list) or len(scores) != 1 or not _is_number(scores[0]):
                    # NaN, infinity and booleans included: a custom server's NaN became the action's
                    # reward (and invalid JSON in every answer and status that carried it).
                    last_error = f"replica {replica} answered without one score for one input: {body!r}"[:300]
                    # A replica that misbehaves as a 5xx does: the retry goes to another one, after
                    # the backoff (tried at once, the least busy was the same replica, every time).
                    self._suspect(svc, replica)
                    await asyncio.sleep(request.backoff_s * 2 ** (attempts - 1))
                    continue
                svc.suspect.pop(replica, None)  # it answered
                now = self.clock()
                svc.acts.append((now, now - submitted))
                svc.last_active = now
                queue_s = _seconds(body, "queue_s", 0.0)
                restore_s = _seconds(body, "restore_s", 0.0)
                return ActionOutcome(
                    request.key,
                    Outcome.SUCCEEDED,
                    reward=float(scores[0]),
                    duration_s=_seconds(body, "exec_s", now - started),
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


def _is_number(value: object) -> bool:
    """A score: a finite number (JSON has no NaN or infinity; a bool is no score)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(body: Mapping[str, Any], name: str, default: float) -> float:
    """A time the replica reports (only a measurement): ``default`` where it is no finite number of
    seconds, 0 or more; a string there raised out of the action, and NaN went into its status."""
    value = body.get(name, default)
    return float(value) if _is_number(value) and value >= 0 else default
