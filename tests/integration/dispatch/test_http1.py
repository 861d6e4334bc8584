"""The operator's HTTP/1.1 client against real servers over real loopback sockets: an aiohttp server
(what the agents run) and raw socket servers for what aiohttp never sends (chunks split mid-line,
interim answers, bodies delimited by close, malformed answers, idle connections closed under the
pool). Every case runs on asyncio's loop and on uvloop's (the operator's own, see arl_tangram.loop),
whose transports differ."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web

from arl_tangram.dispatch import http1
from arl_tangram.dispatch.http1 import ConnectError, ExchangeError, Http1Client, split_address

Runner = Callable[[Coroutine[Any, Any, None]], None]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


async def _aiohttp_server(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


async def _raw_server(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def test_requests_and_answers_through_aiohttp_with_connections_reused(run: Runner) -> None:
    seen: list[dict[str, Any]] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "key": request.headers.get("X-Key"),
                "auth": request.headers.get("Authorization"),
                "peer": request.transport.get_extra_info("peername"),
            }
        )  # type: ignore[union-attr]
        return web.json_response(
            {"got": json.loads(body) if body else None}, status=201, headers={"X-Out": "yes"}
        )

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def big(request: web.Request) -> web.StreamResponse:
        # No Content-Length: aiohttp sends it chunked, in many chunks.
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(200):
            await resp.write(b"%05d" % i * 1000)
        await resp.write_eof()
        return resp

    async def scenario() -> None:
        runner, address = await _aiohttp_server(
            [
                web.post("/echo", echo),
                web.get("/echo", echo),
                web.delete("/gone", empty),
                web.get("/big", big),
            ]
        )
        client = Http1Client(default_headers={"Authorization": "Bearer t0k"})
        try:
            r = await client.request(
                "POST", address, "/echo?a=1", body=b'{"x": 1}', headers={"X-Key": "k1"}, timeout_s=5
            )
            assert (r.status, json.loads(r.body), r.headers["x-out"]) == (201, {"got": {"x": 1}}, "yes")
            r = await client.request("GET", address, "/echo", timeout_s=5)
            assert json.loads(r.body) == {"got": None}
            r = await client.request("DELETE", address, "/gone", timeout_s=5)
            assert (r.status, r.body) == (204, b"")
            r = await client.request("GET", address, "/big", timeout_s=5)
            assert r.body == b"".join(b"%05d" % i * 1000 for i in range(200))
            r = await client.request("GET", address, "/echo", timeout_s=5)
            assert r.status == 201
        finally:
            await client.close()
            await runner.cleanup()
        assert [s["path"] for s in seen] == ["/echo?a=1", "/echo", "/echo"]
        assert {s["auth"] for s in seen} == {"Bearer t0k"} and seen[0]["key"] == "k1"
        # One after the other, the calls share one kept-alive connection.
        assert len({s["peer"] for s in seen}) == 1

    run(scenario())


def test_concurrent_calls_each_get_their_own_answer(run: Runner) -> None:
    async def slow_echo(request: web.Request) -> web.Response:
        n = int(request.query["n"])
        await asyncio.sleep((n % 5) / 100)
        return web.json_response({"n": n})

    async def scenario() -> None:
        runner, address = await _aiohttp_server([web.get("/n", slow_echo)])
        client = Http1Client(max_connections=8)
        try:
            answers = await asyncio.gather(
                *(client.request("GET", address, f"/n?n={n}", timeout_s=10) for n in range(60))
            )
            assert [json.loads(a.body)["n"] for a in answers] == list(range(60))
        finally:
            await client.close()
            await runner.cleanup()

    run(scenario())


def test_raw_answers_split_anywhere_interim_answers_and_close_delimited_bodies(run: Runner) -> None:
    """Byte by byte, so every parser state meets the end of the data it has."""
    answers = [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwxyz\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ]
    bodies = [b"hello", b"abcde", b"wxyz", b"until the end"]

    async def scenario() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for i, raw in enumerate(answers):
                await _read_request(reader)
                for b in range(len(raw)):
                    writer.write(raw[b : b + 1])
                    await writer.drain()
                    await asyncio.sleep(0)
                if i == len(answers) - 1:
                    writer.close()

        server, address = await _raw_server(answer)
        client = Http1Client()
        try:
            for body in bodies:
                r = await client.request("GET", address, "/", timeout_s=10)
                assert (r.status, r.body) == (200, body)
        finally:
            await client.close()
            server.close()

    run(scenario())


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed before the answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc", "two Content-Lengths"),
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded: 2\r\nContent-Length: 0\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nab\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "chunk size"),
    ],
)
def test_a_malformed_or_cut_answer_is_an_exchange_error_naming_it(run: Runner, raw: bytes, says: str) -> None:
    async def scenario() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(raw)
            await writer.drain()
            writer.close()

        server, address = await _raw_server(answer)
        client = Http1Client()
        try:
            with pytest.raises(ExchangeError, match=says):
                await client.request("POST", address, "/", body=b"{}", timeout_s=5)
        finally:
            await client.close()
            server.close()

    run(scenario())


def test_refused_connect_timeout_and_bad_addresses(run: Runner) -> None:
    async def scenario() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        client = Http1Client()
        with pytest.raises(ConnectError) as refused:
            await client.request("GET", f"127.0.0.1:{port}", "/", timeout_s=5)
        assert refused.value.errno == errno.ECONNREFUSED

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        server, address = await _raw_server(silent)
        with pytest.raises(TimeoutError):
            await client.request("GET", address, "/", timeout_s=0.3)
        server.close()
        for bad in ("nohost", "h:port", "h:0", ":80"):
            with pytest.raises(ConnectError, match="not host:port"):
                await client.request("GET", bad, "/", timeout_s=1)
        with pytest.raises(ValueError, match="line break"):
            await client.request("GET", address, "/", headers={"X-Key": "a\r\nInjected: 1"}, timeout_s=1)
        for target in ("/x HTTP/1.1\r\nInjected: 1", "/\u4e2d", "relative"):
            with pytest.raises(ValueError, match="not a request line"):
                await client.request("DELETE", address, target, timeout_s=1)
        await client.close()

    run(scenario())
    assert split_address("[::1]:8080") == ("::1", 8080)


def test_an_idle_connection_the_server_closed_is_not_reused(run: Runner) -> None:
    async def scenario() -> None:
        connections = 0

        async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()  # as a server's keep-alive timeout does

        server, address = await _raw_server(answer_once)
        client = Http1Client()
        try:
            for _ in range(3):
                assert (await client.request("GET", address, "/", timeout_s=5)).body == b"ok"
                await asyncio.sleep(0.3)
            assert connections == 3
        finally:
            await client.close()
            server.close()

    run(scenario())


def test_close_fails_calls_in_flight_and_a_cancelled_call_drops_its_connection(run: Runner) -> None:
    async def scenario() -> None:
        peers: list[object] = []

        async def slow(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            await asyncio.sleep(float(request.query.get("s", "0")))
            return web.json_response({})

        runner, address = await _aiohttp_server([web.get("/", slow)])
        client = Http1Client()
        try:
            cancelled = asyncio.create_task(client.request("GET", address, "/?s=5", timeout_s=10))
            await asyncio.sleep(0.2)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            # Its answer may still come on that connection: the next call must not read it.
            await client.request("GET", address, "/", timeout_s=5)
            assert len(set(peers)) == 2
            in_flight = asyncio.create_task(client.request("GET", address, "/?s=5", timeout_s=10))
            await asyncio.sleep(0.2)
            await client.close()
            assert in_flight.done()
            with pytest.raises(ExchangeError):
                in_flight.result()
            with pytest.raises(ConnectError, match="closed"):
                await client.request("GET", address, "/", timeout_s=5)
        finally:
            await runner.cleanup()

    run(scenario())


def test_calls_not_yet_sent_when_the_client_closes_never_leave(run: Runner) -> None:
    """One slot: the second call waits for it. Closed meanwhile, the second call fails as never
    sent (ConnectError) and the server never sees it; a call that times out waiting for a slot is
    never sent either."""

    async def scenario() -> None:
        received: list[str] = []

        async def slow(request: web.Request) -> web.Response:
            received.append(request.path)
            await asyncio.sleep(0.5)
            return web.json_response({})

        runner, address = await _aiohttp_server([web.get("/{name}", slow)])
        try:
            client = Http1Client(max_connections=1)
            first = asyncio.create_task(client.request("GET", address, "/first", timeout_s=10))
            await asyncio.sleep(0.1)
            with pytest.raises(ConnectError) as waited:
                await client.request("GET", address, "/too-late", timeout_s=0.2)
            assert waited.value.errno == errno.ETIMEDOUT
            second = asyncio.create_task(client.request("GET", address, "/second", timeout_s=10))
            await asyncio.sleep(0.1)
            await client.close()
            await asyncio.sleep(0.8)
            with pytest.raises(ExchangeError):
                first.result()
            with pytest.raises(ConnectError, match="closed"):
                second.result()
            assert received == ["/first"]
        finally:
            await runner.cleanup()

    run(scenario())


def test_idle_connections_expire_and_closed_ones_leave_the_pool(run: Runner) -> None:
    async def scenario() -> None:
        peers: list[object] = []

        async def answer(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            return web.json_response({})

        now = [1000.0]
        runner, address = await _aiohttp_server([web.get("/", answer)])
        client = Http1Client(clock=lambda: now[0])
        try:
            await client.request("GET", address, "/", timeout_s=5)
            await client.request("GET", address, "/", timeout_s=5)
            now[0] += 60  # idle past IDLE_S: a new connection, not one the peer may be closing
            await client.request("GET", address, "/", timeout_s=5)
            assert peers[0] == peers[1] != peers[2]
        finally:
            await runner.cleanup()  # the server closes its idle connections
        await asyncio.sleep(0.3)
        # Gone from the pool as they close, not at the next call to that (gone) address.
        assert not client._open and not client._idle
        await client.close()

    run(scenario())


def test_a_kept_alive_connection_closed_under_a_request_is_retried_only_when_safe(run: Runner) -> None:
    """The server reads the second request on a connection and closes it without an answer, as a
    server's keep-alive timeout firing just as the request arrives does. GET and DELETE are sent
    again on a new connection; POST is not (the server may have acted on it): the caller hears."""

    async def scenario() -> None:
        for method, retried in (("GET", True), ("DELETE", True), ("POST", False)):
            seen: list[bytes] = []

            async def answer(
                reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes] = seen
            ) -> None:
                while True:
                    try:
                        head, _ = await _read_request(reader)
                    except asyncio.IncompleteReadError:
                        return
                    seen.append(head.split(b" ")[1])
                    if len(seen) == 2:
                        writer.close()
                        return
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()

            server, address = await _raw_server(answer)
            client = Http1Client()
            body = b"{}" if method == "POST" else None
            try:
                await client.request(method, address, "/one", body=body, timeout_s=5)
                if retried:
                    again = await client.request(method, address, "/two", body=body, timeout_s=5)
                    assert again.body == b"ok" and seen == [b"/one", b"/two", b"/two"]
                else:
                    with pytest.raises(ExchangeError):
                        await client.request(method, address, "/two", body=body, timeout_s=5)
                    assert seen == [b"/one", b"/two"]
            finally:
                await client.close()
                server.close()

    run(scenario())


def test_a_peer_that_speaks_first_or_stops_reading(run: Runner) -> None:
    """A banner before any request (another service on a reused address) is never taken for an
    answer; a peer that stops reading a large body does not hold close() or the socket."""

    async def scenario() -> None:
        async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server, address = await _raw_server(banner)
        client = Http1Client()
        for _ in range(5):
            with pytest.raises((ConnectError, ExchangeError)):
                await client.request("GET", address, "/", timeout_s=5)
        server.close()

        async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        server, address = await _raw_server(deaf)
        stuck = asyncio.create_task(client.request("POST", address, "/", body=b"x" * (8 << 20), timeout_s=30))
        await asyncio.sleep(0.3)
        await client.close()
        assert stuck.done() and isinstance(stuck.exception(), ExchangeError)
        server.close()

    run(scenario())


def test_close_ends_a_call_still_connecting_at_once(run: Runner) -> None:
    """A connect whose SYN nobody answers (a full accept queue here; a lost node in a cluster) can
    hang for minutes: close() ends it, and the call queued behind it for the one slot, as never sent."""

    async def scenario() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler = socket.socket()
        filler.setblocking(False)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        try:
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            await asyncio.sleep(0.05)
            client = Http1Client(max_connections=1)
            calls = [asyncio.create_task(client.request("GET", address, "/", timeout_s=60)) for _ in range(2)]
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls)
            await client.close()
            await asyncio.sleep(0)
            done, _ = await asyncio.wait(calls, timeout=5)
            assert len(done) == 2
            for call in calls:
                with pytest.raises(ConnectError, match="closed"):
                    call.result()
        finally:
            filler.close()
            listener.close()

    run(scenario())


def test_idle_connections_are_swept_and_trailers_are_bounded(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that never closes (or vanished without a word) holds no idle connection past IDLE_S,
    whether or not it is called again; and an answer's trailers are held to MAX_HEAD_BYTES."""
    monkeypatch.setattr(http1, "IDLE_S", 0.2)

    async def scenario() -> None:
        async def answer(request: web.Request) -> web.Response:
            return web.json_response({})

        runner, address = await _aiohttp_server([web.get("/", answer)])
        client = Http1Client()
        try:
            await asyncio.gather(*(client.request("GET", address, "/", timeout_s=5) for _ in range(3)))
            assert len(client._open) == 3
            await asyncio.sleep(0.7)
            assert not client._open and not client._idle
        finally:
            await runner.cleanup()

        async def endless_trailers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
            with contextlib.suppress(ConnectionError):
                for _ in range(200):
                    writer.write(b"X-T: " + b"t" * 1000 + b"\r\n")
                    await writer.drain()

        server, address = await _raw_server(endless_trailers)
        try:
            with pytest.raises(ExchangeError, match="trailers passed"):
                await client.request("GET", address, "/", timeout_s=10)
        finally:
            await client.close()
            server.close()

    run(scenario())
