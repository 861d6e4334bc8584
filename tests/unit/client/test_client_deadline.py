"""The client's ``timeout_s`` bounds a whole call, its retries included, against a gateway that
takes connections and never answers (a hung leader, a black-holed Service): a real TCP server on
loopback that reads each request's first line and then says nothing. Each retry used to get the
whole ``timeout_s`` again, so a call waited about seven times as long as the caller asked, and the
error said it had waited ``timeout_s``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from arl_tangram.client import TangramClient, Unavailable, code_action


class Silent:
    """Accepts connections, records each request line, never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[str] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed at the test's end
            self.conns.append(conn)
            first = conn.recv(4096).split(b"\r\n", 1)[0].decode()
            self.requests.append(first)

    def paths(self) -> list[str]:
        return [r.split()[1] for r in self.requests if r]

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.close()


def test_a_run_that_used_up_its_timeout_is_not_sent_again(silent: Silent) -> None:
    client = TangramClient(silent.url, namespace="default", pool="py", token="", timeout_s=1)
    with client, pytest.raises(Unavailable, match=r"timeout_s \(1 s\), retries included"):
        client.run_code("print(1)")
    assert silent.paths() == ["/v1/actions"]


def test_a_stream_that_used_up_its_timeout_is_not_sent_again(silent: Silent) -> None:
    client = TangramClient(silent.url, namespace="default", pool="py", token="", timeout_s=1)
    with client, pytest.raises(Unavailable, match=r"timeout_s \(1 s\), retries included"):
        list(client.run_many([code_action("print(1)")]))
    # Then its action, keyed by the client, is cancelled (that try too gets no answer here).
    assert silent.paths() == ["/v1/actions:stream", "/v1/actions:cancel"]


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_a_timeout_that_allows_no_call_is_refused_by_name(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        TangramClient("http://127.0.0.1:1", timeout_s=timeout_s)
