"""The blocking client: the asynchronous one, run on a private event loop in a thread of its own,
so both behave exactly alike (one implementation of retries, streams and sessions)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from arl_tangram.client.aio import AsyncSession, AsyncTangramClient, code_action
from arl_tangram.client.results import ActionResult

T = TypeVar("T")
# How long an interrupted call (Ctrl-C) gets to end on the client's loop: a ``run_many`` cancels
# its abandoned actions on the gateway then (``aio.ABANDON_TIMEOUT_S``), with a little to spare.
INTERRUPT_GRACE_S = 15.0


class TangramClient:
    """Blocking twin of :class:`~arl_tangram.client.aio.AsyncTangramClient` (same arguments)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tangram-client", daemon=True)
        self._thread.start()
        self._async = AsyncTangramClient(url, **kwargs)

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        ended = threading.Event()
        future = asyncio.run_coroutine_threadsafe(_ending(coro, ended), self._loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                # Interrupted here (Ctrl-C): stop it on the loop too, and let it end there (a
                # run_many cancels its actions on the gateway), or it ran on unseen, and a later
                # call on the same generator found it still running.
                future.cancel()
                ended.wait(INTERRUPT_GRACE_S)  # a second Ctrl-C cuts this short
            raise

    def __enter__(self) -> TangramClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        # Streams still open (a run_many the caller left without closing): ended first, so that
        # they cancel what they leave behind before the loop stops for good.
        self._wait(self._loop.shutdown_asyncgens())
        self._wait(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def run(self, action: Mapping[str, Any]) -> ActionResult:
        return self._wait(self._async.run(action))

    def run_code(self, code: str, **kwargs: Any) -> ActionResult:
        return self.run(code_action(code, **kwargs))

    def run_many(self, actions: Iterable[Mapping[str, Any]]) -> Iterator[ActionResult]:
        """Results as they complete (see the async client's ``run_many``)."""
        return self._iterate(self._async.run_many(list(actions)))

    def cancel(self, keys: Iterable[str], namespace: str | None = None) -> list[str]:
        """Stop actions by their keys (see the async client's ``cancel``)."""
        return self._wait(self._async.cancel(list(keys), namespace))

    def score(self, items: Iterable[Mapping[str, Any]], **kwargs: Any) -> list[float]:
        return self._wait(self._async.score(list(items), **kwargs))

    def batch_results(self, name: str, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        return self._iterate(self._async.batch_results(name, namespace))

    def session(self, pool: str | None = None, ttl_s: float | None = None) -> Session:
        return Session(self, self._async.session(pool, ttl_s))

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._wait(_next(agen))
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and not self._loop.is_closed():
                self._wait(aclose())


async def _next(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()


async def _ending(coro: Coroutine[Any, Any, T], ended: threading.Event) -> T:
    """``coro``, setting ``ended`` however it ends (its caller's thread may wait for that)."""
    try:
        return await coro
    finally:
        ended.set()


class Session:
    """A session as a ``with`` block."""

    def __init__(self, client: TangramClient, inner: AsyncSession) -> None:
        self._client = client
        self._inner = inner

    @property
    def id(self) -> str | None:
        return self._inner.id

    def __enter__(self) -> Session:
        self._client._wait(self._inner.__aenter__())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._client._wait(self._inner.close())

    def run(self, action: Mapping[str, Any]) -> ActionResult:
        return self._client._wait(self._inner.run(action))

    def run_code(self, code: str, **kwargs: Any) -> ActionResult:
        return self.run(code_action(code, **kwargs))
