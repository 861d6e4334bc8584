"""The blocking client: the asynchronous one, run on a private event loop in a thread of its own,
so both behave exactly alike (one implementation of retries, streams and sessions)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from arl_tangram.client.aio import AsyncSession, AsyncTangramClient, code_action
from arl_tangram.client.errors import TangramClientError
from arl_tangram.client.results import ActionResult

T = TypeVar("T")
# How long an interrupted call (Ctrl-C) gets to end on the client's loop: a ``run_many`` cancels
# its abandoned actions on the gateway then (``aio.ABANDON_TIMEOUT_S``), with a little to spare.
INTERRUPT_GRACE_S = 15.0


class TangramClient:
    """Blocking twin of :class:`~arl_tangram.client.aio.AsyncTangramClient` (same arguments)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._async = AsyncTangramClient(url, **kwargs)  # bad arguments refused before a thread starts
        self._lock = threading.Lock()
        self._closed = False
        self._start_loop()
        _CLIENTS.add(self)

    def _start_loop(self) -> None:
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tangram-client", daemon=True)
        self._thread.start()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The client's loop, started again in a process forked after it was made: a fork copies no
        thread but the caller's, so the inherited loop is never run again and every call waited on
        it for ever (``multiprocessing`` with fork, a ``DataLoader`` worker). The inherited loop is
        left alone: its epoll is shared with the parent (see ``AsyncTangramClient._forget_http``)."""
        with self._lock:
            if self._closed:
                raise TangramClientError(f"this TangramClient of {self._async.url} is closed")
            if self._pid != os.getpid():
                self._start_loop()
            return self._loop

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            running = self._running_loop()
        except TangramClientError:
            coro.close()  # never started: closed, or Python warns it was never awaited
            raise
        try:
            return _wait_on(running, coro)
        except concurrent.futures.CancelledError:
            if self._closed:  # another thread closed the client under this call
                raise TangramClientError(f"this TangramClient of {self._async.url} was closed") from None
            raise

    def __enter__(self) -> TangramClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._pid != os.getpid():
                return  # made in the parent, not used here: its loop and connections are the parent's
            running, thread = self._loop, self._thread
        _wait_on(running, self._shutdown())
        running.call_soon_threadsafe(running.stop)
        thread.join()
        running.close()

    async def _shutdown(self) -> None:
        # Calls other threads still wait on end first (a TangramClientError there): on a stopped
        # loop they waited for ever. Then streams still open (a run_many the caller left without
        # closing), so that they cancel what they leave behind before the loop stops for good.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()
        await self._async.close()

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
            if aclose is not None and not self._closed:
                self._wait(aclose())


def _wait_on(running: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, run on ``running`` (another thread's loop)."""
    ended = threading.Event()
    future = asyncio.run_coroutine_threadsafe(_ending(coro, ended), running)
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


_CLIENTS: weakref.WeakSet[TangramClient] = weakref.WeakSet()


def _after_fork() -> None:
    # A lock another thread held at the fork stays held in the child, where no thread releases it.
    for client in list(_CLIENTS):
        client._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


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
