"""The reward runtime's core: per-service batching queues in front of one GPU chunk (evict-on-execution).

Requests wait in their service's queue; a batch of a service starts when it is full or when its
oldest request has waited the service's batching window. One batch runs at a time on the chunk (the
paper: at most one action per GPU), so the chunk's memory holds the running service plus whatever
else fits: before a batch, least recently used services are evicted until the service fits, then it
is restored from host memory, and the seconds that took are reported on every request of the batch
as ``restore_s``. Among ready services the resident ones go first unless an evicted one has waited
past the grace period (``cache.pick_next``).

While no request waits, the chunk pre-warms: a service not on the device that fits in its free
memory, without evicting another, is restored ahead of its requests, the largest first (its cold
load is the longest). Free memory appears at start, after a scale-to-zero, and where an eviction
freed more than a restore needed; pre-warming never takes a resident service's place, and a
pre-warmed service is the least recently used until a request asks for it. A service scaled to
zero through ``evict`` is left in host memory until it is asked for again.

A request whose caller goes away (its connection closed) leaves its queue; when every caller of a
running batch has gone, its call to a vLLM or SGLang server is closed (the server aborts it, and
frees the device for the next batch) rather than left to run until the scoring timeout for nobody.
A restore is never cut short: the server's memory and the cache's count of it would part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from arl_tangram.api.rewardmodelservice import Batching, RewardModelService, ServiceScaling
from arl_tangram.rewards.backends import BackendError, BackendRefused, RowsRefused, ServiceBackend
from arl_tangram.rewards.cache import DeviceCache, pick_next

log = logging.getLogger("tangram.reward-runtime")

_T = TypeVar("_T")

# Batching and queue defaults are the RewardModelService API's (one source for both).
DEFAULT_MAX_BATCH = int(Batching.model_fields["max_batch_size"].default)
DEFAULT_MAX_WAIT_MS = int(Batching.model_fields["max_wait_millis"].default)
DEFAULT_MAX_QUEUE = int(ServiceScaling.model_fields["max_queue_length"].default)

# How long a request of an evicted service may be passed over for resident ones (seconds): about
# the cost of one small restore, so that preferring residents saves more than it delays.
DEFAULT_GRACE_S = 0.05


class UnknownService(KeyError):
    """No service of that name in this runtime."""


class BadInput(ValueError):
    """An input no backend can score; the message names it. Refused before it joins a batch, where
    its failure would fail every other request of the batch too."""


class QueueFull(Exception):
    """The service's wait queue is full; the caller should retry later or elsewhere."""


class _Abandoned(Exception):
    """Every caller of a batch went away while it was being scored; its scoring was stopped."""


@dataclass(frozen=True)
class ServiceSpec:
    """Batching and queueing of one service."""

    name: str
    max_batch_size: int = DEFAULT_MAX_BATCH
    max_wait_s: float = DEFAULT_MAX_WAIT_MS / 1000
    max_queue: int = DEFAULT_MAX_QUEUE
    keep_resident: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue < 1 or self.max_wait_s < 0:
            raise ValueError(f"service {self.name}: batch size and queue must be >= 1, wait >= 0")


def service_entry(rms: RewardModelService, url: str | None = None, path: str | None = None) -> dict[str, Any]:
    """The services-file entry of a RewardModelService (what the controller writes into the reward
    runtime's ConfigMap): ``path`` of the weights for the built-in backend, ``url`` of the server for
    vLLM and SGLang. Services with replicas that must stay resident (``minReplicas`` > 0) are kept."""
    spec = rms.spec
    entry: dict[str, Any] = {
        "name": rms.metadata.name,
        "backend": spec.server.runtime,
        "maxBatchSize": spec.batching.max_batch_size,
        "maxWaitMillis": spec.batching.max_wait_millis,
        "maxQueueLength": spec.scaling.max_queue_length,
        "keepResident": spec.scaling.min_replicas > 0,
    }
    if spec.server.runtime == "builtin":
        entry["path"] = path if path is not None else spec.model.uri.removeprefix("file://")
    else:
        if url is None or spec.gpu.memory is None:
            raise ValueError(
                f"{rms.metadata.name}: a {spec.server.runtime} service needs its url and gpu.memory"
            )
        entry.update(url=url, model=spec.model.name, deviceMemory=str(spec.gpu.memory))
    return entry


@dataclass(frozen=True)
class ScoreResult:
    """One request's answer: its scores and where its time went."""

    scores: list[float]
    restore_s: float
    queue_s: float
    exec_s: float
    batch_size: int
    evicted: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "scores": self.scores,
            "restore_s": self.restore_s,
            "queue_s": self.queue_s,
            "exec_s": self.exec_s,
            "batch_size": self.batch_size,
            "evicted": list(self.evicted),
        }


@dataclass
class _Request:
    inputs: list[str]
    arrival: float
    future: asyncio.Future[ScoreResult]


@dataclass
class _Service:
    spec: ServiceSpec
    backend: ServiceBackend
    queue: deque[_Request] = field(default_factory=deque)
    batches: int = 0
    restores: int = 0
    evictions: int = 0
    restore_s_total: float = 0.0
    last_used: float | None = None

    def queued_inputs(self) -> int:
        return sum(len(r.inputs) for r in self.queue)


class RewardRuntime:
    """Several services on one device of ``capacity`` bytes."""

    def __init__(
        self,
        services: Sequence[tuple[ServiceSpec, ServiceBackend]],
        capacity: int,
        grace_s: float = DEFAULT_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        prewarm: bool = True,
    ) -> None:
        self.cache = DeviceCache(capacity)
        self.services: dict[str, _Service] = {}
        for spec, backend in services:
            if spec.name in self.services:
                raise ValueError(f"service {spec.name} declared twice")
            self.cache.add(spec.name, backend.device_bytes, keep=spec.keep_resident)
            self.services[spec.name] = _Service(spec, backend)
        self.grace_s = grace_s
        self.clock = clock
        self.prewarm = prewarm
        # Services scaled to zero by ``evict``: not pre-warmed until a request or ``restore`` asks.
        self._cold: set[str] = set()
        self._wake = asyncio.Event()
        self._device = asyncio.Lock()  # one batch, restore or eviction on the chunk at a time
        self._task: asyncio.Task[None] | None = None
        # The service whose weights are being copied to the device now, and the score requests not
        # yet answered (queued or in the running batch): what a health check shows of the chunk.
        self.restoring: str | None = None
        self.pending = 0

    async def start(self) -> None:
        """Learn which services already hold device memory, evict what does not fit, start serving."""
        for name, svc in self.services.items():
            on_device = await svc.backend.start()
            if not on_device:
                continue
            if self.cache.used + self.cache.sizes[name] <= self.cache.capacity:
                self.cache.mark_resident(name)
            else:
                await svc.backend.evict()
        for name in sorted(self.cache.keep):
            await self._ensure_resident(name)
        self._task = asyncio.create_task(self._serve(), name="reward-runtime")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for svc in self.services.values():
            for req in svc.queue:
                if not req.future.done():
                    req.future.set_exception(BackendError("the reward runtime is stopping"))
            svc.queue.clear()
            await svc.backend.close()

    async def score(self, service: str, inputs: Sequence[str]) -> ScoreResult:
        """Queue ``inputs`` for ``service`` and wait for their scores."""
        svc = self.services.get(service)
        if svc is None:
            raise UnknownService(service)
        for i, text in enumerate(inputs):
            try:
                text.encode()
            except UnicodeEncodeError as exc:  # a lone surrogate: valid JSON ("\ud800"), not text
                raise BadInput(f"inputs[{i}] is not valid Unicode: {exc.reason} at {exc.start}") from None
        if len(svc.queue) >= svc.spec.max_queue:
            raise QueueFull(
                f"service {service}: {len(svc.queue)} requests waiting (max {svc.spec.max_queue})"
            )
        fut: asyncio.Future[ScoreResult] = asyncio.get_running_loop().create_future()
        svc.queue.append(_Request(list(inputs), self.clock(), fut))
        self._wake.set()
        self.pending += 1
        try:
            return await fut
        finally:
            self.pending -= 1

    async def evict(self, service: str) -> bool:
        """Take a service off the device (scale to zero); False when it was not resident."""
        if service not in self.services:
            raise UnknownService(service)
        self._cold.add(service)
        async with self._device:
            if not self.cache.is_resident(service):
                return False
            await self._evict(service)
        self._wake.set()  # the memory it held may take another service's pre-warm
        return True

    async def restore(self, service: str) -> float:
        """Put a service on the device ahead of its requests (pre-warm); returns the restore seconds."""
        if service not in self.services:
            raise UnknownService(service)
        self._cold.discard(service)
        async with self._device:
            _, seconds = await self._make_resident(service)
        self._wake.set()  # a pre-warm it held back may go on
        return seconds

    def describe(self) -> list[dict[str, Any]]:
        """Each service's residency, queue and counters (``GET /v1/services``)."""
        now = self.clock()
        return [
            {
                "name": name,
                "resident": self.cache.is_resident(name),
                "restoring": self.restoring == name,
                "keep_resident": name in self.cache.keep,
                "device_bytes": self.cache.sizes[name],
                "queued": len(svc.queue),
                "batches": svc.batches,
                "restores": svc.restores,
                "evictions": svc.evictions,
                "restore_s_total": svc.restore_s_total,
                "idle_s": None if svc.last_used is None else now - svc.last_used,
            }
            for name, svc in self.services.items()
        ]

    # ---- the device ----------------------------------------------------------------------------

    async def _evict(self, name: str) -> None:
        svc = self.services[name]
        await svc.backend.evict()  # an error leaves it counted as resident: memory may still be held
        self.cache.mark_evicted(name)
        svc.evictions += 1

    async def _make_resident(self, name: str, asked: bool = True) -> tuple[tuple[str, ...], float]:
        """Restore ``name`` (evicting what it needs); ``asked`` False for a pre-warm, which leaves
        it least recently used: nobody has asked for it yet."""
        if self.cache.is_resident(name):
            return (), 0.0
        victims = tuple(self.cache.plan(name))
        for v in victims:
            await self._evict(v)
        svc = self.services[name]
        t0 = self.clock()
        self.restoring = name
        try:
            await svc.backend.restore()
        finally:
            self.restoring = None
        seconds = self.clock() - t0
        self.cache.mark_resident(name, recent=asked)
        svc.restores += 1
        svc.restore_s_total += seconds
        return victims, seconds

    async def _ensure_resident(self, name: str) -> None:
        async with self._device:
            await self._make_resident(name)

    async def _prewarm_one(self, name: str) -> bool:
        """Restore ``name`` if it is still the one to pre-warm; False when it no longer is."""
        async with self._device:
            # An ``evict`` or ``restore`` may have held the device since the choice, and requests
            # may have come meanwhile (each wakes the loop, which chooses again).
            if self._to_prewarm() != name:
                return False
            # A ``stop`` now cancels the wait, not the copy under way in its thread; the process
            # exits after it, so the device copy goes with it.
            await self._make_resident(name, asked=False)
            return True

    def _to_prewarm(self) -> str | None:
        """The service to restore ahead of its requests now, or None: nothing waits, and the
        largest service off the device that fits its free memory without evicting another."""
        if not self.prewarm or any(svc.queue for svc in self.services.values()):
            return None
        free = self.cache.capacity - self.cache.used
        fits = [
            n
            for n, size in self.cache.sizes.items()
            if size <= free and n not in self._cold and not self.cache.is_resident(n)
        ]
        # Ties go in the services file's order.
        return max(fits, key=lambda n: self.cache.sizes[n], default=None)

    # ---- batching ------------------------------------------------------------------------------

    def _ready(self, now: float) -> tuple[dict[str, float], float | None]:
        """Services whose batch may start now (-> oldest arrival), and when the next one will."""
        ready: dict[str, float] = {}
        soonest: float | None = None
        for name, svc in self.services.items():
            if not svc.queue:
                continue
            first = svc.queue[0].arrival
            due = first + svc.spec.max_wait_s
            if svc.queued_inputs() >= svc.spec.max_batch_size or now >= due:
                ready[name] = first
            elif soonest is None or due < soonest:
                soonest = due
        return ready, soonest

    async def _serve(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock()
            ready, soonest = self._ready(now)
            name = pick_next(ready, self.cache, now, self.grace_s)
            if name is None and (warm := self._to_prewarm()) is not None:
                try:
                    if await self._prewarm_one(warm):
                        continue
                except Exception as exc:  # its first request restores it, or reports the error
                    log.warning("pre-warming %s failed: %s", warm, exc)
                    self._cold.add(warm)
                    continue
            if name is None:
                timeout = None if soonest is None else max(0.0, soonest - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            try:
                await self._run_batch(name)
            except BackendError as exc:  # the batch's requests got it (503); the chunk serves on
                log.warning("batch of %s failed: %s", name, exc)
            except Exception:  # a bug must not stop the chunk serving others; the batch got the error
                log.exception("batch of %s failed", name)

    def _take_batch(self, svc: _Service) -> list[_Request]:
        batch: list[_Request] = []
        n = 0
        while svc.queue and (not batch or n + len(svc.queue[0].inputs) <= svc.spec.max_batch_size):
            req = svc.queue.popleft()
            if req.future.done():  # its caller went away (cancelled): nobody to score it for
                continue
            batch.append(req)
            n += len(req.inputs)
        return batch

    async def _run_batch(self, name: str) -> None:
        svc = self.services[name]
        self._cold.discard(name)
        batch = self._take_batch(svc)
        if not batch:  # every caller went away: no restore, no scoring
            return
        inputs = [x for r in batch for x in r.inputs]
        try:
            async with self._device:
                start = self.clock()
                victims, restore_s = await self._make_resident(name)
                t0 = self.clock()
                scoring = self._answers(svc, batch, inputs)
                try:
                    if svc.backend.abortable:
                        answers = await _while_awaited(batch, scoring)
                    else:
                        answers = await scoring
                except _Abandoned:
                    log.info(
                        "%s: every caller of a batch of %d inputs went away: its scoring call was closed",
                        name,
                        len(inputs),
                    )
                    return
                exec_s = self.clock() - t0
                self.cache.touch(name)
        except BaseException as exc:
            # Every request of the batch gets an answer, whatever happened: a cancellation (``stop``
            # during the batch) included, or its caller would wait for ever.
            if isinstance(exc, BackendError):
                err = exc
            elif isinstance(exc, asyncio.CancelledError):
                err = BackendError("the reward runtime is stopping")
            else:
                err = BackendError(f"{name}: {exc}")
            for r in batch:
                if not r.future.done():  # a caller that went away cancelled its own
                    r.future.set_exception(err)
            raise
        svc.batches += 1
        svc.last_used = self.clock()
        for r, answer in zip(batch, answers, strict=True):
            if r.future.done():
                continue
            if isinstance(answer, BadInput):
                r.future.set_exception(answer)
            else:
                r.future.set_result(
                    ScoreResult(answer, restore_s, start - r.arrival, exec_s, len(inputs), victims)
                )

    async def _answers(
        self, svc: _Service, batch: list[_Request], inputs: list[str]
    ) -> list[list[float] | BadInput]:
        """Each request's scores (or BadInput) of a batch of ``inputs``, on the device."""
        name = svc.spec.name
        try:
            scores = await self._score_all(svc, inputs)
            answers: list[list[float] | BadInput] = []
            i = 0
            for r in batch:
                answers.append(_answer(name, scores[i : i + len(r.inputs)]))
                i += len(r.inputs)
            return answers
        except BackendRefused as exc:
            # The server refused an input (past the model's length): each request alone then, so
            # that only the one holding it fails, and as its own fault (400, not retried
            # elsewhere, where it would be refused again).
            if len(batch) == 1:
                return [BadInput(str(exc))]
            return [await self._score_alone(svc, r.inputs) for r in batch]

    async def _score_alone(self, svc: _Service, inputs: list[str]) -> list[float] | BadInput:
        """One request's scores, or the BadInput of the server's refusal of its inputs."""
        try:
            return _answer(svc.spec.name, await self._score_all(svc, inputs))
        except BackendRefused as exc:
            return BadInput(str(exc))

    async def _score_all(self, svc: _Service, inputs: list[str]) -> list[float | str]:
        """The backend's scores of ``inputs``, in parts of at most a batch (a request bigger than a
        batch), each checked; in place of a score, what is wrong with an input the backend answered
        no score for (``RowsRefused``: that input's request fails, the others are answered)."""
        scores: list[float | str] = []
        size = svc.spec.max_batch_size
        for i in range(0, len(inputs), size):
            part = inputs[i : i + size]
            got: Sequence[float | str]
            try:
                got = await svc.backend.score(part)
            except RowsRefused as exc:
                got = exc.rows
            scores += _checked(svc.spec.name, part, got)
        return scores


async def _while_awaited(batch: list[_Request], scoring: Coroutine[Any, Any, _T]) -> _T:
    """``scoring``'s result, or ``_Abandoned`` once every request of ``batch`` is done, which before
    the batch is answered means that its caller went away (its future was cancelled with it)."""
    task = asyncio.ensure_future(scoring)

    def left(_: object) -> None:
        if all(r.future.done() for r in batch):
            task.cancel()

    for r in batch:  # one already done is called back at once: all gone before the call began
        r.future.add_done_callback(left)
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # the runtime is stopping (``stop``), not the callers gone
        raise _Abandoned from None
    finally:
        for r in batch:
            r.future.remove_done_callback(left)


def _checked(name: str, inputs: Sequence[str], scores: Sequence[float | str]) -> list[float | str]:
    """A backend's scores for ``inputs``, one finite number each (or what is wrong with that
    input): a count that differs would shift every later request's scores onto another's inputs,
    and NaN or inf is no reward (nor JSON)."""
    if len(scores) != len(inputs):
        raise BackendError(f"{name}: {len(scores)} scores for {len(inputs)} inputs")
    for i, x in enumerate(scores):
        if not isinstance(x, str) and not math.isfinite(x):
            raise BackendError(f"{name}: score {x} for input {i} of {len(inputs)} (not a finite number)")
    return list(scores)


def _answer(name: str, scores: list[float | str]) -> list[float] | BadInput:
    """One request's scores, or the BadInput naming the first of its inputs that got none."""
    for j, x in enumerate(scores):
        if isinstance(x, str):
            return BadInput(f"{name}: inputs[{j}]: {x}")
    return [x for x in scores if not isinstance(x, str)]
