"""A lean HTTP/1.1 keep-alive client for the operator's calls to its own agents.

Every action the gateway or a batch runs is one request from the operator to an agent, so this hop
is on the critical path of every action: at concurrency 1 a general-purpose client (aiohttp's, with
its request and response objects, tracing hooks, cookie jar and timers) cost about as much CPU
per call as the rest of the gateway's work put together. The peers here are known (our sandbox
agents and reward runtimes, both aiohttp servers) and the requests are small JSON, so this client
does only what those calls need: one pooled connection per request in flight, a request written in
one ``write``, and a strict incremental parser for ``Content-Length``, chunked and read-until-close
answers.

Errors keep the distinction the dispatcher relies on (see :mod:`arl_tangram.dispatch.agent`):
:class:`ConnectError` when the request certainly never left (no connection, the client closed,
the time ran out before it was sent), :class:`ExchangeError` when it failed once it was on its way
(the peer may have it), and :class:`TimeoutError` when the time ran out after that.
"""

from __future__ import annotations

import asyncio
import errno
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

# Bounds on what a peer may send back: a header block past this is not one of our agents.
MAX_HEAD_BYTES = 64 * 1024
# An action's answer carries at most two 8 MiB streams (JSON-escaped, so up to 6x) and its files;
# a body past this is refused rather than held in the operator's memory.
MAX_BODY_BYTES = 256 * 1024 * 1024
# Idle keep-alive connections kept per peer; more are closed when their call ends.
MAX_IDLE_PER_PEER = 64
# An idle connection older than this is closed, not reused: well inside the keep-alive time of
# aiohttp's servers (75 s), so that the peer does not close it just as a request is written on it.
IDLE_S = 15.0
# How long close() waits for its sockets to be closed.
CLOSE_WAIT_S = 2.0
# Statuses that never carry a body (RFC 9112, section 6.3).
_NO_BODY = frozenset({204, 304})
# Methods that may be sent again when a kept-alive connection turns out dead before any answer
# (RFC 9110, section 9.2.2): the peer ran nothing for them, or running them twice changes nothing.
_IDEMPOTENT = frozenset({"GET", "DELETE", "PUT", "OPTIONS"})
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET = re.compile(r"/[!-~]*")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class ConnectError(OSError):
    """The request never left: no connection to the peer, or none in time. ``errno`` is the cause's."""


class ExchangeError(Exception):
    """The connection failed, or the peer answered something that is not HTTP/1.1, after the
    request was on its way: the peer may have received it."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into host and port; a ValueError names a malformed one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"agent address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses the answer to the one request in flight on it."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_lost = on_lost
        self._buf = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._reset()

    def _reset(self) -> None:
        self.answered = False  # any byte of an answer to the request in flight has come
        self._scanned = 0  # how far the search for the header block's end has looked
        self._status = 0
        self._headers: dict[str, str] = {}
        self._length = -1  # body bytes expected; -1 before the head, -2 chunked, -3 until close
        self._chunks: list[bytes] = []
        self._chunked_bytes = 0
        self._keep_alive = True

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._waiter is None or self._waiter.done():
            # Nothing asked (a peer that speaks first, bytes after an answer): not an answer to anything.
            self._fail(ExchangeError("the peer sent data nobody asked for"))
            return
        self.answered = True
        try:
            response = self._advance()
        except ExchangeError as exc:
            self._fail(exc)
            return
        if response is not None:
            self._waiter.set_result(response)

    def eof_received(self) -> bool:
        self.closed = True  # from now on nothing can be sent on it
        if self._length == -3 and self._waiter is not None and not self._waiter.done():
            self._keep_alive = False
            self._waiter.set_result(self._response(bytes(self._buf)))
            self._buf.clear()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            reason = f": {exc}" if exc else ""
            self._waiter.set_exception(ExchangeError(f"the connection closed before the answer{reason}"))
        self._on_lost(self)

    # ---- the exchange ------------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """Open, and not closing: a request written now reaches the peer's reader."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._reset()
        self._buf.clear()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._waiter

    @property
    def reusable(self) -> bool:
        return self.usable and self._keep_alive and not self._buf

    def abort(self) -> None:
        """Close now, dropping what is still unsent (a peer that stopped reading holds no socket)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: ExchangeError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.abort()

    def _response(self, body: bytes) -> Response:
        return Response(self._status, self._headers, body)

    def _advance(self) -> Response | None:
        """Parse what has arrived; the response once it is whole, else None."""
        while self._length == -1:
            end = self._buf.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0:
                self._scanned = len(self._buf)
                if self._scanned > MAX_HEAD_BYTES:
                    raise ExchangeError(f"the answer's header block passed {MAX_HEAD_BYTES} bytes")
                return None
            head = bytes(self._buf[:end])
            del self._buf[: end + 4]
            self._scanned = 0
            if not self._head(head):
                continue  # an interim 1xx answer: the real one follows
        if self._length >= 0:
            if len(self._buf) < self._length:
                return None
            body = bytes(self._buf[: self._length])
            del self._buf[: self._length]
            return self._response(body)
        if self._length == -2:
            return self._chunked()
        if len(self._buf) > MAX_BODY_BYTES:
            raise ExchangeError(f"the answer passed {MAX_BODY_BYTES} bytes")
        return None  # until close: eof_received ends it

    def _head(self, head: bytes) -> bool:
        """Read a header block; False for an interim (1xx) answer."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if (
            len(parts) < 2
            or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(parts[1]) != 3
            or not parts[1].isdigit()
        ):
            raise ExchangeError(f"not an HTTP/1.1 answer: {lines[0][:100]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                # No colon, a folded continuation line (obsolete, refused by RFC 9112), a space
                # before the colon: a header this client could read otherwise than the peer meant.
                raise ExchangeError(f"a malformed header line in the answer: {line[:100]!r}")
            key, text = name.lower().decode("ascii"), value.strip(b" \t").decode("latin-1")
            if key == "content-length" and headers.get(key, text) != text:
                raise ExchangeError(f"the answer has two Content-Lengths: {headers[key]!r} and {text!r}")
            headers[key] = text
        self._status, self._headers = status, headers
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        self._keep_alive = "close" not in tokens and parts[0] == b"HTTP/1.1"
        if status in _NO_BODY:
            self._length = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._length = -2
        elif "content-length" in headers:
            length = headers["content-length"]
            if not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY_BYTES:
                raise ExchangeError(f"the answer's Content-Length is {length[:40]!r}")
            self._length = int(length)
        else:
            self._length, self._keep_alive = -3, False
        return True

    def _chunked(self) -> Response | None:
        """Consume whole chunks from the buffer; the response after the last one and its trailers."""
        while True:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise ExchangeError("a chunk's size line is too long")
                return None
            size_text = bytes(self._buf[:line_end]).split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_text):
                raise ExchangeError(f"a malformed chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                # The last chunk: trailer lines (ignored) up to an empty line.
                after = line_end + 2
                if self._buf[after : after + 2] == b"\r\n":
                    end = after + 2
                else:
                    found = self._buf.find(b"\r\n\r\n", max(after, self._scanned - 3))
                    if found < 0:
                        self._scanned = len(self._buf)
                        if self._scanned - after > MAX_HEAD_BYTES:
                            raise ExchangeError(f"the answer's trailers passed {MAX_HEAD_BYTES} bytes")
                        return None
                    end = found + 4
                del self._buf[:end]
                return self._response(b"".join(self._chunks))
            if self._chunked_bytes + size > MAX_BODY_BYTES:
                raise ExchangeError(f"the answer passed {MAX_BODY_BYTES} bytes")
            start = line_end + 2
            if len(self._buf) < start + size + 2:
                return None
            if self._buf[start + size : start + size + 2] != b"\r\n":
                raise ExchangeError("a chunk does not end with CRLF")
            self._chunks.append(bytes(self._buf[start : start + size]))
            self._chunked_bytes += size
            del self._buf[: start + size + 2]


class Http1Client:
    """Keep-alive HTTP/1.1 to ``host:port`` peers; at most ``max_connections`` open at once (a call
    past that waits for one to free). Create inside the running loop; :meth:`close` when done."""

    def __init__(
        self,
        max_connections: int = 512,
        default_headers: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[str, deque[_Connection]] = {}
        self._open: dict[_Connection, str] = {}  # every connection and its peer, in use or idle
        self._fixed = b"".join(_header(k, v) for k, v in (default_headers or {}).items())
        self._clock = clock
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None
        # Calls not yet sent: close() cancels them (a connect to a lost node can hang for minutes).
        self._unsent: set[asyncio.Task[object]] = set()
        self._stopped: set[asyncio.Task[object]] = set()

    async def request(
        self,
        method: str,
        address: str,
        target: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> Response:
        """One exchange with ``address`` within ``timeout_s`` (waiting for a slot, connecting,
        sending and the whole answer). ``target`` is the path and query, already percent-encoded."""
        if method == "HEAD":  # its answer's Content-Length comes without a body: not parsed here
            raise ValueError("HEAD is not supported")
        if not _TOKEN.fullmatch(method.encode()) or not _TARGET.fullmatch(target):
            raise ValueError(f"not a request line: {method!r} {target!r} (quote the target's parts)")
        head = [f"{method} {target} HTTP/1.1\r\nHost: {address}\r\n".encode("ascii"), self._fixed]
        head += [_header(k, v) for k, v in (headers or {}).items()]
        if body is not None:
            head.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        if body:
            head.append(body)
        request = b"".join(head)
        sent = False
        task = cast("asyncio.Task[object]", asyncio.current_task())
        self._unsent.add(task)
        try:
            async with asyncio.timeout(timeout_s), self._slots:
                for first in (True, False):
                    try:
                        conn, was_reused = await self._connection(address, reuse=first)
                    except ConnectError as exc:
                        if first:
                            raise
                        # The first try may have reached the peer: not "never sent".
                        raise ExchangeError(f"sent again to {address}, and {exc}") from exc
                    sent = True
                    self._unsent.discard(task)  # an answer that has come is not failed by close()
                    try:
                        response = await conn.send(request)
                    except ExchangeError:
                        conn.abort()
                        # A kept-alive connection found dead before any answer (the peer closed it
                        # as it went idle): sent again on a new connection where that is safe.
                        if (
                            first
                            and was_reused
                            and not conn.answered
                            and not self._closed
                            and method in _IDEMPOTENT
                        ):
                            self._unsent.add(task)  # the second try's connect may hang too
                            continue
                        raise
                    except BaseException:
                        conn.abort()  # cancelled or timed out mid-exchange: what comes next is unknown
                        raise
                    self._release(address, conn)
                    return response
                raise AssertionError("unreachable: the second try uses a new connection")
        except TimeoutError:
            if not sent:
                raise ConnectError(
                    errno.ETIMEDOUT, f"no connection to {address} within {timeout_s:g} s"
                ) from None
            raise
        except asyncio.CancelledError:
            # Cancelled by close() (and by nobody else): the caller hears why, as for any failure.
            if task in self._stopped and task.uncancel() == 0:
                if not sent:
                    raise ConnectError(None, f"the HTTP client closed (not sent to {address})") from None
                raise ExchangeError(f"the HTTP client closed while {address} had the request") from None
            raise
        finally:
            self._unsent.discard(task)
            self._stopped.discard(task)

    async def _connection(self, address: str, reuse: bool) -> tuple[_Connection, bool]:
        """A connection to ``address``, and whether it was kept alive from an earlier call."""
        self._check_open(address)
        idle = self._idle.get(address)
        now = self._clock()
        while reuse and idle:
            conn = idle.pop()  # the most recently used: the least likely to have been closed
            if conn.usable and now - conn.idle_since < IDLE_S:
                return conn, True
            self._drop(conn)
        loop = asyncio.get_running_loop()
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise ConnectError(None, str(exc)) from None
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self._forget), host, port)
        except OSError as exc:
            raise ConnectError(exc.errno, f"connect to {address}: {exc.strerror or exc}") from exc
        self._open[conn] = address
        if not conn.usable:
            # Closed before a byte was sent (a peer that speaks first, or resets at once).
            self._drop(conn)
            raise ConnectError(None, f"connect to {address}: the peer closed the new connection")
        if self._closed:
            self._drop(conn)
            self._check_open(address)
        return conn, False

    def _check_open(self, address: str) -> None:
        if self._closed:
            raise ConnectError(None, f"the HTTP client is closed (not sent to {address})")

    def _release(self, address: str, conn: _Connection) -> None:
        idle = self._idle.setdefault(address, deque())
        if self._closed or not conn.reusable or len(idle) >= MAX_IDLE_PER_PEER:
            self._drop(conn)  # the answer was read whole: nothing of ours is left to send
        else:
            conn.idle_since = self._clock()
            idle.append(conn)
            if self._sweep is None:
                self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def _expire(self) -> None:
        """Close connections idle past ``IDLE_S`` (a peer gone without a word holds none for long)."""
        self._sweep = None
        now = self._clock()
        for conn in [c for idle in self._idle.values() for c in idle if now - c.idle_since >= IDLE_S]:
            self._drop(conn)
        if self._idle and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def _drop(self, conn: _Connection) -> None:
        conn.abort()
        self._forget(conn)

    def _forget(self, conn: _Connection) -> None:
        """Out of the pool: let go of, or closed by either side (at once, not at its peer's next call)."""
        address = self._open.pop(conn, None)
        if address is None or address not in self._idle:
            return
        idle = self._idle[address]
        if conn in idle:
            idle.remove(conn)
        if not idle:
            del self._idle[address]

    async def close(self) -> None:
        """Close every connection: calls in flight fail with :class:`ExchangeError`, calls not yet
        sent with :class:`ConnectError`, and none is sent after this."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
        for task in self._unsent:
            self._stopped.add(task)
            task.cancel()
        conns = list(self._open)
        for conn in conns:
            conn.abort()
        self._open.clear()
        self._idle.clear()
        lost = [conn.lost for conn in conns if not conn.lost.done()]
        if lost:  # the transports close on the loop's next turns; return once they have
            await asyncio.wait(lost, timeout=CLOSE_WAIT_S)


def _header(name: str, value: str) -> bytes:
    if not _TOKEN.fullmatch(name.encode()) or any(c in value for c in "\r\n\0"):
        raise ValueError(f"header {name!r}: not a token, or a line break or NUL in its value")
    return f"{name}: {value}\r\n".encode("latin-1")
