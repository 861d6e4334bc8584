"""Service backends of the reward runtime: how a service is restored, evicted and asked for scores.

- ``BuiltinBackend``: the built-in scorer in this process (``rewards.builtin``).
- ``VllmBackend``: a vLLM server started with ``--enable-sleep-mode`` (and ``VLLM_SERVER_DEV_MODE=1``,
  which exposes the sleep endpoints): evict is ``POST /sleep?level=1`` (weights offloaded to host
  memory, KV cache dropped), restore is ``POST /wake_up``, ``GET /is_sleeping`` reports the state;
  scores come from ``POST /pooling`` (``{"model", "input": [...]}`` -> ``data[i].data``).
- ``SglangBackend``: an SGLang server started with ``--enable-memory-saver``: evict is
  ``POST /release_memory_occupation``, restore ``POST /resume_memory_occupation`` (both take an
  optional ``{"tags": [...]}``; without tags, weights and KV cache together); scores come from
  ``POST /classify`` (``{"model", "text": [...]}`` -> ``[{"embedding": [label values]}, ...]``).

Where a server answers more than one value per input, both take the last (``_last_value``); an
input whose output holds no value at all (a process reward model's empty step list: no step mark in
that input) fails alone (``RowsRefused``), the other inputs of the answer keep their scores.

Each blocking step of the built-in backend runs in a worker thread; the HTTP backends share one
aiohttp session made at start-up. A failed call raises ``BackendError`` (an infrastructure failure:
the dispatcher may retry elsewhere), or ``BackendRefused`` where the server refused the inputs.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp

from arl_tangram.rewards import SCORE_TIMEOUT_S
from arl_tangram.rewards.builtin import BuiltinScorer


class BackendError(RuntimeError):
    """A backend call failed (server down, bad answer)."""


class BackendRefused(BackendError):
    """The server refused the inputs themselves (400, 413 or 422: an input past the model's
    maximum length, one it cannot tokenize): another replica would refuse them too, and in a batch
    one such input fails the others with it (``RewardRuntime`` then scores each request alone)."""


# The answers that blame the request's content, not the server: vLLM's BadRequestError is a 400
# (past ``max_model_len``), a validation error a 422, a body over its limit a 413.
REFUSED_STATUSES = frozenset({400, 413, 422})


class RowsRefused(BackendRefused):
    """The server answered for every input, but some outputs hold no score (a process reward
    model's empty step list for an input without a step mark): those inputs' fault, not the
    server's. ``rows`` is the answer, a score or, for such an input, what is wrong with it."""

    def __init__(self, message: str, rows: list[float | str]) -> None:
        super().__init__(message)
        self.rows = rows


class EmptyOutput(ValueError):
    """An input's output with no value in it."""


class ServiceBackend(Protocol):
    """What the runtime needs of a service."""

    name: str
    device_bytes: int
    # Whether cancelling ``score`` stops the work on the device: the runtime then abandons a call
    # every caller of has gone away. Not so for work in a thread, which runs on past its cancel
    # (and would run beside the next batch if the device were handed on).
    abortable: bool

    async def start(self) -> bool:
        """Prepare; returns whether the weights are already on the device."""
        ...

    async def restore(self) -> None: ...

    async def evict(self) -> None: ...

    async def score(self, inputs: Sequence[str]) -> list[float]: ...

    async def close(self) -> None: ...


class BuiltinBackend:
    """The built-in scorer; ``device_bytes`` is its weights' size."""

    abortable = False  # its scoring runs in a worker thread

    def __init__(self, name: str, scorer: BuiltinScorer) -> None:
        self.name = name
        self.scorer = scorer
        self.device_bytes = scorer.nbytes

    async def start(self) -> bool:
        return False  # loaded into host memory only; restored on the first request

    async def restore(self) -> None:
        await asyncio.to_thread(self.scorer.restore)

    async def evict(self) -> None:
        self.scorer.evict()

    async def score(self, inputs: Sequence[str]) -> list[float]:
        return await asyncio.to_thread(self.scorer.score, list(inputs))

    async def close(self) -> None:
        self.scorer.evict()


class _HttpBackend:
    """Common HTTP plumbing of the external servers."""

    # A cancelled call closes its connection, which vLLM and SGLang take as an abort of the request.
    abortable = True

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        device_bytes: int,
        session: aiohttp.ClientSession,
        score_timeout_s: float = SCORE_TIMEOUT_S,
    ) -> None:
        if not 0 < score_timeout_s < math.inf:
            raise ValueError(f"service {name}: the scoring timeout must be > 0 s, got {score_timeout_s}")
        self.name = name
        self.url = url.rstrip("/")
        self.model = model
        self.device_bytes = device_bytes
        self.session = session
        self.score_timeout = aiohttp.ClientTimeout(total=score_timeout_s)

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        answer: bool = False,
        limit: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        """One call to the server; ``answer`` when its JSON answer is needed (a body that is not JSON
        is then an error, not text handed on to be misread); ``limit`` in place of the session's timeout."""
        timeout = limit or self.session.timeout
        try:
            async with self.session.request(method, self.url + path, json=body, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    cls = BackendRefused if resp.status in REFUSED_STATUSES else BackendError
                    raise cls(f"{self.name}: {method} {path} answered {resp.status}: {text[:200]}")
                if not text:
                    if answer:
                        raise BackendError(f"{self.name}: {method} {path} answered an empty body")
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    if answer:
                        raise BackendError(
                            f"{self.name}: {method} {path} answered malformed JSON: {text[:200]!r}"
                        ) from None
                    return text
        except aiohttp.ClientConnectorError as exc:
            # Nothing listens there: the services file's url is wrong or the server is down.
            raise BackendError(f"{self.name}: {method} {self.url}{path} failed: {exc}") from None
        except aiohttp.ClientError as exc:
            raise BackendError(f"{self.name}: {method} {path} failed: {exc}") from None
        except TimeoutError:
            # A bare TimeoutError says nothing of which server or call.
            total = timeout.total
            after = f" after {total} s" if total else ""
            raise BackendError(f"{self.name}: {method} {path} timed out{after}") from None

    async def close(self) -> None:
        return None


class VllmBackend(_HttpBackend):
    """A vLLM server in sleep mode (level 1: weights kept in host memory, nothing to reload)."""

    async def start(self) -> bool:
        state = await self._call("GET", "/is_sleeping")
        if not isinstance(state, dict) or "is_sleeping" not in state:
            raise BackendError(f"{self.name}: /is_sleeping answered {state!r} (is sleep mode enabled?)")
        return not bool(state["is_sleeping"])

    async def restore(self) -> None:
        await self._call("POST", "/wake_up")

    async def evict(self) -> None:
        await self._call("POST", "/sleep?level=1")

    async def score(self, inputs: Sequence[str]) -> list[float]:
        body = {"model": self.model, "input": list(inputs)}
        out = await self._call("POST", "/pooling", body, answer=True, limit=self.score_timeout)
        try:
            rows = _field(out, "data", "the answer")
            if not isinstance(rows, list):
                raise ValueError(f"data is {_json_kind(rows)}, not a list of rows")
            # Each row says which input it scores: a missing or repeated index would hand one
            # input's score to another, so the indices must be exactly 0..n-1.
            by_index = {
                _field(r, "index", f"row {j}"): _field(r, "data", f"row {j}") for j, r in enumerate(rows)
            }
            if len(rows) != len(inputs) or set(by_index) != set(range(len(inputs))):
                raise ValueError(
                    f"{len(rows)} rows with indices {sorted(by_index, key=str)[:10]} for {len(inputs)} inputs"
                )
            return _scores(self.name, "POST /pooling", [by_index[i] for i in range(len(inputs))])
        except (TypeError, ValueError) as exc:
            raise BackendError(f"{self.name}: POST /pooling answered an unexpected shape: {exc}") from None


class SglangBackend(_HttpBackend):
    """An SGLang server with the memory saver (release / resume memory occupation)."""

    async def start(self) -> bool:
        # A wrong url fails the start, as vLLM's ``/is_sleeping`` does, not the first request; any
        # answer will do (a server without ``/health`` still listens there).
        try:
            async with self.session.get(self.url + "/health") as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendError(
                f"{self.name}: GET {self.url}/health failed: {exc or type(exc).__name__}"
            ) from None
        # SGLang has no query for the state; a freshly started server holds its memory.
        return True

    async def restore(self) -> None:
        await self._call("POST", "/resume_memory_occupation", {})

    async def evict(self) -> None:
        await self._call("POST", "/release_memory_occupation", {})

    async def score(self, inputs: Sequence[str]) -> list[float]:
        body = {"model": self.model, "text": list(inputs)}
        out = await self._call("POST", "/classify", body, answer=True, limit=self.score_timeout)
        try:
            # The answer has no index: its order is the inputs', so only its length can be checked.
            if not isinstance(out, list):
                # Another server's answer (vLLM's or SGLang's own ``/v1/classify``: ``{"data":
                # [...]}``): said as such, with what it holds.
                raise ValueError(
                    f'the answer is {_json_kind(out)}, not a list of {{"embedding": [...]}} per input'
                )
            if len(out) != len(inputs):
                raise ValueError(f"{len(out)} results for {len(inputs)} inputs")
            # Every label's value, as vLLM's rows: the same rule picks the score (``_last_value``).
            return _scores(
                self.name, "POST /classify", [_field(r, "embedding", f"row {i}") for i, r in enumerate(out)]
            )
        except (TypeError, ValueError) as exc:
            raise BackendError(f"{self.name}: POST /classify answered an unexpected shape: {exc}") from None


def _field(obj: Any, key: str, where: str) -> Any:
    """``obj[key]`` of a JSON object in a server's answer; ``ValueError`` names what is missing and
    what is there instead (another server version's shape, such as vLLM's ``probs`` or ``score``)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is {_json_kind(obj)}, not an object with {key!r}")
    if key not in obj:
        raise ValueError(f"{where} has no {key!r} (it has {sorted(obj)[:10]})")
    return obj[key]


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (a server's author knows no ``NoneType``); an object
    with its first keys, which tell another API's answer from a broken one."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:10]}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return f"a {'list' if isinstance(value, list) else 'string'}"


def _last_value(value: Any, i: int) -> Any:
    """The score in input ``i``'s output: a number, or the last number of a (nested) list. One rule
    for every server and model shape: a model with ``num_labels`` > 1 gives its last label's value
    (label 1 of a binary classifier, its positive class), a process reward model (``[p(wrong),
    p(right)]`` per step) its last step's ``p(right)``, a token-level reward model its last token's."""
    while isinstance(value, list):
        if not value:
            raise EmptyOutput(f"row {i}: empty output")
        value = value[-1]
    return value


def _scores(name: str, route: str, outputs: list[Any]) -> list[float]:
    """The score of each input's output. An output with no value fails its input only
    (``RowsRefused``, with the others' scores); any other bad value, the whole answer
    (``ValueError``: a server that answers NaN or a string for one input is not to be trusted for
    the others)."""
    rows: list[float | str] = []
    for i, value in enumerate(outputs):
        try:
            rows.append(_score(_last_value(value, i), i))
        except EmptyOutput:
            rows.append(
                f"{route} answered an empty output for it (a process reward model finds no step in "
                "an input without its step mark)"
            )
    empty = [i for i, r in enumerate(rows) if isinstance(r, str)]
    if empty:
        raise RowsRefused(
            f"{name}: {route} answered an empty output for {len(empty)} of {len(rows)} inputs "
            f"(row {empty[0]} first)",
            rows,
        )
    return [r for r in rows if not isinstance(r, str)]


def _score(value: Any, i: int) -> float:
    """A server's score for input ``i``: a finite JSON number. A string, a boolean or NaN/inf (which
    Python's JSON reader accepts) would otherwise pass as a reward nobody computed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"score of input {i} is {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"score of input {i} is {value}")
    return float(value)
