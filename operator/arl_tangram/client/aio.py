"""The asynchronous client of the gateway (aiohttp).

Retries are for infrastructure failures only: no answer, 502/503/504 (a standby, a lost host), 429
(after its Retry-After), and results whose reason says the platform failed. Every retry carries
the same idempotency key, so an action is never run twice; a program that fails is a result and is
never retried.

An action whose key this client made up (the caller gave none) and whose caller stops waiting (a
``run_many`` broken out of or cancelled, a ``run`` cancelled) is cancelled on the gateway: nobody
else knows its key, so nobody could ever fetch its result, and it would hold a core to its end, as
the gateway does for actions sent with no key at all. An action the caller keyed runs on: a retry
with its key gets its result (``cancel`` stops it explicitly). Actions in a session run on too:
stopping one stops the session's interpreter, and with it the state the trajectory built.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from arl_tangram.client.errors import (
    InvalidRequest,
    Overloaded,
    SessionLost,
    TangramClientError,
    Unavailable,
    error_for,
)
from arl_tangram.client.results import ActionResult
from arl_tangram.client.tokens import TokenSource, pod_namespace, token_source

KEY_HEADER = "X-Tangram-Action-Key"
# How long the cancel of an abandoned action's keys may take (its caller has stopped waiting: this
# only bounds how long that stop is held up by an unreachable gateway).
ABANDON_TIMEOUT_S = 10.0
# Keys one cancel request carries at most (the gateway's bound).
CANCEL_BATCH = 10_000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently infrastructure failures are retried."""

    attempts: int = 6
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return retry_after
        return float(min(self.max_backoff_s, self.backoff_s * 2**attempt))


def code_action(
    code: str,
    *,
    pool: str | None = None,
    language: str = "python",
    stdin: str | None = None,
    files: Mapping[str, str] | None = None,
    kind: str = "code",
    timeout_s: int | None = None,
    units: tuple[int, int] | None = None,
    key: str | None = None,
    id: str | None = None,
) -> dict[str, Any]:
    """A native action that runs ``code`` (its payload as an ActionBatch action's)."""
    payload: dict[str, Any] = {"language": language, "code": code}
    if stdin is not None:
        payload["stdin"] = stdin
    if files:
        payload["files"] = dict(files)
    action: dict[str, Any] = {"type": kind, "payload": payload}
    if pool is not None:
        action["target"] = pool
    for name, value in (("timeoutSeconds", timeout_s), ("key", key), ("id", id)):
        if value is not None:
            action[name] = value
    if units is not None:
        action["units"] = {"min": units[0], "max": units[1]}
    return action


class AsyncTangramClient:
    """A client of one gateway. ``namespace`` defaults to the pod's own; ``pool`` is the default
    target of code actions. Use as ``async with``, or call :meth:`close`.

    ``timeout_s`` is the longest one call waits, its retries included (a ``run_many``: its whole
    stream); past it the call raises :class:`Unavailable` saying so. A ``run_many`` left unfinished
    then spends up to ``ABANDON_TIMEOUT_S`` more cancelling its actions. One client serves one event
    loop after another (``asyncio.run`` per step) and a process forked after it was made: each gets
    connections of its own."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str | None = None,
        pool: str | None = None,
        token: TokenSource = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 3600.0,
        stream_in_flight: None = None,
    ) -> None:
        if stream_in_flight is not None:
            # It was accepted and never used: a caller believed it bounded its streams.
            raise TypeError(
                "stream_in_flight was removed from the client: it never bounded anything. The gateway "
                "bounds each stream's outstanding actions (its own stream_in_flight setting, 256 by "
                "default) and holds a faster sender by TCP flow control; drop the argument"
            )
        self.url = url.rstrip("/")
        self.namespace = namespace or pod_namespace()
        self.pool = pool
        self.retry = retry or RetryPolicy()
        self._token = token_source(token)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        # The longest one call waits, its retries included: each retry used to get all of it again,
        # so a gateway that never answered held a caller of timeout_s=2 for 20 s (a stream, 30 s).
        self.timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        # Where ``_http`` was made: its connections belong to that process and that event loop.
        self._http_owner: tuple[int, asyncio.AbstractEventLoop] | None = None
        # Pools this process must not close (see ``_forget_http``): kept, never used again.
        self._inherited: list[aiohttp.ClientSession] = []
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> AsyncTangramClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None and self._http_owner == _here():
            await self._http.close()
        elif self._http is not None:
            self._forget_http()
        self._http = None

    def _session(self) -> aiohttp.ClientSession:
        """The connection pool, made again where the one at hand cannot serve this call: in a
        process forked after it was made (its connections are the parent's sockets: both would
        read one stream's answers), or on another event loop (``asyncio.run`` once per step: the
        last loop is closed, and aiohttp only said "Event loop is closed")."""
        here = _here()
        if self._http is not None and self._http_owner != here:
            self._forget_http()
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
            self._http_owner = here
        return self._http

    def _forget_http(self) -> None:
        """Drop a pool made in another process or on another loop, touching its sockets only where
        that is safe: a forked child's are the parent's, registered in an epoll the two share
        (closing them here unregisters them there, and the parent's reads hang), so they are only
        kept; a closed loop's are gone with it, and closing the session just marks it closed."""
        stale, owner = self._http, self._http_owner
        self._http = self._http_owner = None
        if stale is None or owner is None:
            return
        pid, stale_loop = owner
        if pid == os.getpid() and stale_loop.is_closed():
            closing = asyncio.get_running_loop().create_task(stale.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        elif pid == os.getpid() and stale_loop.is_running():
            asyncio.run_coroutine_threadsafe(stale.close(), stale_loop)  # its own loop closes it
        else:
            self._inherited.append(stale)

    def _headers(self, key: str | None = None) -> dict[str, str]:
        headers = {}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if key:
            headers[KEY_HEADER] = key
        return headers

    # ---- plumbing ---------------------------------------------------------------------------------
    def _deadline(self) -> float:
        """When a call begun now must have ended (on the running loop's clock), retries included."""
        return asyncio.get_running_loop().time() + self.timeout_s

    def _left(self, deadline: float) -> float:
        return deadline - asyncio.get_running_loop().time()

    def _timed_out(self) -> Unavailable:
        # This client's own limit, not the gateway's failure: say which, and how to raise it.
        return Unavailable(
            f"no answer from {self.url} within this client's timeout_s ({self.timeout_s:g} s), "
            "retries included; a longer action needs a larger timeout_s"
        )

    async def _pause(self, delay: float, deadline: float, last: TangramClientError) -> None:
        """Sleep before a retry, or raise ``last`` where the retry could not begin before the
        deadline (it would only be cut off by it)."""
        if delay >= self._left(deadline):
            raise last
        await asyncio.sleep(delay)

    async def _call(
        self, method: str, path: str, body: Any = None, key: str | None = None, deadline: float | None = None
    ) -> Any:
        """One request, retried on infrastructure failures until ``deadline`` (default: timeout_s
        from now); the answer's JSON, or a typed error."""
        if deadline is None:
            deadline = self._deadline()
        last: TangramClientError | None = None
        for attempt in range(self.retry.attempts):
            if last is not None:
                retry_after = last.retry_after if isinstance(last, Overloaded) else None
                await self._pause(self.retry.delay(attempt - 1, retry_after), deadline, last)
            try:
                async with self._session().request(
                    method,
                    self.url + path,
                    json=body,
                    headers=self._headers(key),
                    timeout=aiohttp.ClientTimeout(total=max(self._left(deadline), 0.001)),
                ) as resp:
                    data = await _json(resp)
                    if resp.status < 300:
                        return data
                    error = error_for(resp.status, data, _retry_after(resp))
            except TimeoutError:
                raise self._timed_out() from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                error = Unavailable(f"no answer from {self.url}: {exc!r}")
            if not isinstance(error, Unavailable | Overloaded):
                raise error
            last = error
        assert last is not None
        raise last

    def _action(self, action: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(action)
        out.setdefault("key", uuid.uuid4().hex)
        if self.namespace is not None:
            out.setdefault("namespace", self.namespace)
        if self.pool is not None and out.get("type", "code") in ("code", "test"):
            out.setdefault("target", self.pool)
        return out

    # ---- actions ----------------------------------------------------------------------------------
    async def run(self, action: Mapping[str, Any]) -> ActionResult:
        """Run one action (a native action dict, e.g. from :func:`code_action`) to its end."""
        body = self._action(action)
        try:
            return await self._run_keyed("/v1/actions", body, body["key"])
        except asyncio.CancelledError:
            if _ours(action, body):
                await self._abandon([body["key"]], body.get("namespace"))
            raise

    async def cancel(self, keys: Iterable[str], namespace: str | None = None) -> list[str]:
        """Stop actions by their keys (queued: dropped; running: stopped on their agents); the keys
        of those that were queued or running. A key that has not arrived yet (a stream's line still
        on its way) is not run if it arrives within minutes."""
        ns = namespace or self.namespace
        wanted = list(dict.fromkeys(keys))
        stopped: list[str] = []
        for at in range(0, len(wanted), CANCEL_BATCH):
            body: dict[str, Any] = {"keys": wanted[at : at + CANCEL_BATCH]}
            if ns is not None:
                body["namespace"] = ns
            stopped += (await self._call("POST", "/v1/actions:cancel", body))["cancelled"]
        return stopped

    async def _abandon(self, keys: list[str], namespace: str | None) -> None:
        """Cancel actions whose caller stopped waiting (see the module's docstring); bounded, and
        never raising: the caller is on its way out (an error, a break, a cancel) already."""
        if not keys:
            return
        try:
            await asyncio.wait_for(self.cancel(keys, namespace), ABANDON_TIMEOUT_S)
        except (TangramClientError, TimeoutError, aiohttp.ClientError, asyncio.CancelledError) as exc:
            log.warning("could not cancel %d abandoned action(s) on %s: %r", len(keys), self.url, exc)

    async def _run_keyed(self, path: str, body: dict[str, Any], key: str) -> ActionResult:
        deadline = self._deadline()
        result = ActionResult.from_body(await self._call("POST", path, body, key, deadline))
        for attempt in range(1, self.retry.attempts):
            if not result.infrastructure_failure:
                break
            delay = self.retry.delay(attempt - 1)
            if delay >= self._left(deadline):
                break  # no time left for another try: the platform's failure is the result
            await asyncio.sleep(delay)
            result = ActionResult.from_body(await self._call("POST", path, body, key, deadline))
        return result

    async def run_code(self, code: str, **kwargs: Any) -> ActionResult:
        """Run a program (see :func:`code_action` for the options)."""
        return await self.run(code_action(code, **kwargs))

    async def run_many(self, actions: Iterable[Mapping[str, Any]]) -> AsyncIterator[ActionResult]:
        """Run many actions through one stream; yield each result as it completes (completion order).

        An action the gateway refuses comes back as a result with ``error`` set; refusals that mean
        "later" (429, 503) and infrastructure failures are sent again, with the same key, in a new
        stream, as is everything unanswered when a stream breaks (e.g. the leader died). Left before
        the last result (a break, a cancel, an error), it cancels those still out whose keys it made
        up (see the module's docstring)."""
        given = list(actions)
        pending: dict[str, dict[str, Any]] = {}
        own: set[str] = set()  # keys this client made up, outside sessions: cancelled if abandoned
        for asked, one in ((x, self._action(x)) for x in given):
            if one["key"] in pending:
                # One of them was dropped without a word (its result, or the gateway's 409, lost).
                raise InvalidRequest(
                    f"two actions under key {one['key']!r}: a key names one action", body={"field": "key"}
                )
            pending[one["key"]] = one
            if _ours(asked, one):
                own.add(one["key"])
        tries = dict.fromkeys(pending, 0)
        round_ = 0
        again: dict[str, dict[str, Any]] = {}
        began: list[bool] = []  # a stream was taken: its actions may be on the gateway
        deadline = self._deadline()
        try:
            while pending:
                if round_:
                    await self._pause(self.retry.delay(round_ - 1), deadline, self._timed_out())
                round_ += 1
                again = {}
                try:
                    async for key, result in self._stream(list(pending.values()), began, deadline):
                        action = pending.pop(key, None)
                        if action is None:
                            continue  # a duplicate answer of a key already answered: never twice
                        retryable = result.infrastructure_failure or isinstance(
                            result.error, Overloaded | Unavailable
                        )
                        tries[key] += 1
                        if retryable and tries[key] < self.retry.attempts:
                            again[key] = action
                        else:
                            yield result
                    if pending and round_ >= self.retry.attempts:
                        # Streams that ended leaving these unanswered, each time: sent again for
                        # ever, they held the caller in this loop without a word.
                        raise Unavailable(
                            f"{len(pending)} action(s) got no answer from {self.url} in {round_} streams"
                        )
                except TimeoutError:
                    raise self._timed_out() from None
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, Unavailable) as exc:
                    if round_ >= self.retry.attempts:
                        raise Unavailable(f"the stream to {self.url} failed {round_} times: {exc!r}") from exc
                except Overloaded:
                    if round_ >= self.retry.attempts:
                        raise
                pending.update(again)
        finally:
            # Left before every result came (a break, a cancel, an error): what is still out is
            # cancelled where nobody else could ever fetch it (see the module's docstring).
            if began:  # else nothing was taken (a refused token, say): nothing to cancel
                await self._abandon([k for k in (*pending, *again) if k in own], self.namespace)

    async def _stream(
        self, actions: list[dict[str, Any]], began: list[bool] | None = None, deadline: float | None = None
    ) -> AsyncIterator[tuple[str, ActionResult]]:
        """The results of ``actions`` sent in one stream. ``began`` gets an entry as the stream is
        sent (lines may reach the gateway before its answer begins), taken back if it refuses it."""

        async def body() -> AsyncIterator[bytes]:
            for action in actions:
                yield json.dumps(action).encode() + b"\n"

        headers = {**self._headers(), "Content-Type": "application/x-ndjson"}
        if began is not None:
            began.append(True)
        left = self._left(deadline) if deadline is not None else self.timeout_s
        async with self._session().post(
            self.url + "/v1/actions:stream",
            data=body(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=max(left, 0.001)),
        ) as resp:
            if resp.status >= 300:
                if began is not None:
                    began.pop()  # refused whole: none of its lines was taken
                raise error_for(resp.status, await _json(resp), _retry_after(resp))
            # One action per line, in order: a refusal the gateway could not tie to its action (a line
            # over its limit, never parsed) names the line, and the line names what was sent.
            by_line = {i + 1: a for i, a in enumerate(actions)}
            async for raw in _lines(resp.content):
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if "state" in line:
                    yield line["key"], ActionResult.from_body(line)
                    continue
                sent = by_line.get(line.get("line", 0), {})
                key = line.get("key") or sent.get("key", "")
                error = error_for(int(line.get("status", 500)), line, line.get("retryAfter"))
                yield (
                    key,
                    ActionResult(
                        key=key,
                        state="Refused",
                        id=line.get("id") or sent.get("id"),
                        message=line.get("error"),
                        error=error,
                    ),
                )

    # ---- sessions, rewards, batches ------------------------------------------------------------
    def session(self, pool: str | None = None, ttl_s: float | None = None) -> AsyncSession:
        """A session as an ``async with`` block: opened on entry, closed on exit."""
        target = pool or self.pool
        if target is None:
            raise ValueError("name the pool of the session (or give the client a default pool)")
        return AsyncSession(self, target, ttl_s)

    async def score(
        self,
        items: Iterable[Mapping[str, Any]],
        *,
        service: str | None = None,
        pool: str | None = None,
    ) -> list[float]:
        """Rewards for ``items`` (``{prompt, response, label}``) from a RewardModelService, or the pass
        fraction of the tests in ``label`` run in ``pool``."""
        body: dict[str, Any] = {"items": [dict(i) for i in items]}
        for name, value in (("namespace", self.namespace), ("service", service), ("pool", pool)):
            if value is not None:
                body[name] = value
        answer = await self._call("POST", "/v1/rewards", body)
        return [float(r) for r in answer["rewards"]]

    async def batch_results(self, name: str, namespace: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Every result of an ActionBatch, outputs whole (beyond what its status can hold)."""
        ns = namespace or self.namespace
        if ns is None:
            raise ValueError("name the batch's namespace (or give the client one)")
        async with self._session().get(
            f"{self.url}/v1/batches/{ns}/{name}/results", headers=self._headers()
        ) as resp:
            if resp.status >= 300:
                raise error_for(resp.status, await _json(resp), _retry_after(resp))
            async for raw in _lines(resp.content):
                if raw.strip():
                    yield json.loads(raw)


class AsyncSession:
    """An open session: actions run in order with the session's state (workdir, interpreter)."""

    def __init__(self, client: AsyncTangramClient, pool: str, ttl_s: float | None) -> None:
        self.client = client
        self.pool = pool
        self.ttl_s = ttl_s
        self.id: str | None = None

    async def __aenter__(self) -> AsyncSession:
        body: dict[str, Any] = {"pool": self.pool}
        if self.client.namespace is not None:
            body["namespace"] = self.client.namespace
        if self.ttl_s is not None:
            body["ttlSeconds"] = self.ttl_s
        self.id = (await self.client._call("POST", "/v1/sessions", body))["id"]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self.id is None:
            return
        sid, self.id = self.id, None
        try:
            await self.client._call("DELETE", f"/v1/sessions/{sid}")
        except TangramClientError as exc:
            if exc.status != 404:  # already expired: closed is what we wanted
                raise

    async def run(self, action: Mapping[str, Any]) -> ActionResult:
        if self.id is None:
            raise RuntimeError("the session is not open (use it inside `async with`)")
        body = {k: v for k, v in action.items() if k not in ("target", "namespace", "sessionId")}
        body.setdefault("key", uuid.uuid4().hex)
        result = await self.client._run_keyed(f"/v1/sessions/{self.id}/actions", body, body["key"])
        if result.reason == "SessionLost":
            # The state this trajectory built is gone: the caller must know, not read a fresh one.
            raise SessionLost(result.message or f"session {self.id} was lost", 410, result.response)
        return result

    async def run_code(self, code: str, **kwargs: Any) -> ActionResult:
        return await self.run(code_action(code, **kwargs))


def _here() -> tuple[int, asyncio.AbstractEventLoop]:
    return os.getpid(), asyncio.get_running_loop()


def _ours(action: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
    """Whether ``body`` (``action`` as sent) is cancelled when its caller abandons it: its key was
    made up here, and it runs outside a session."""
    return "key" not in action and not body.get("sessionId")


async def _json(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return {"error": text[:500]}


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = resp.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A response's lines, however long: aiohttp's own line reader gives up at 512 KiB, and one
    result carrying a program's output (up to the sandbox's 8 MiB, twice) is longer."""
    buffer = bytearray()
    async for chunk in content.iter_any():
        # Only the new chunk can hold the end of the line begun before it: scan that alone.
        at = chunk.find(b"\n")
        if at < 0:
            buffer += chunk
            continue
        yield bytes(buffer + chunk[:at])
        start = at + 1
        while (end := chunk.find(b"\n", start)) >= 0:
            yield chunk[start:end]
            start = end + 1
        buffer = bytearray(chunk[start:])
    if buffer:
        yield bytes(buffer)
