"""Probes: kubelet's success/failure thresholds, and the probe actions against real local servers."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest
from node_runner.probes import Prober, UnsupportedProbe, probers, run_probe


def test_thresholds_decide_after_enough_consecutive_results() -> None:
    p = Prober(
        {"successThreshold": 2, "failureThreshold": 3, "periodSeconds": 5, "initialDelaySeconds": 4},
        "readiness",
    )
    p.arm(started=100.0)
    assert not p.due(103.9) and p.due(104.0)
    p.record(True, 104.0)
    assert p.result is None and p.next_at == 109.0
    p.record(True, 109.0)
    assert p.result is True
    p.record(False, 114.0)
    p.record(False, 119.0)
    assert p.result is True  # two failures: not yet
    p.record(True, 124.0)  # a success resets the failure count
    p.record(False, 129.0)
    p.record(False, 134.0)
    assert p.result is True
    p.record(False, 139.0)
    assert p.result is False


def test_rearming_forgets_the_previous_run() -> None:
    p = Prober({"failureThreshold": 1}, "liveness")
    p.arm(0.0)
    p.record(False, 0.0)
    assert p.result is False
    p.arm(50.0)
    assert p.result is None
    assert (p.failures, p.next_at) == (0, 50.0)


def test_probers_arms_each_kind_the_container_declares() -> None:
    armed = probers(
        {"livenessProbe": {"initialDelaySeconds": 3}, "startupProbe": {"tcpSocket": {"port": 1}}},
        started=10.0,
    )
    assert sorted(armed) == ["liveness", "startup"]
    assert armed["liveness"].next_at == 13.0 and armed["startup"].next_at == 10.0


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = {"/ok": 200, "/moved": 302, "/bad": 500}.get(self.path, 404)
        self.send_response(code)
        self.send_header("Content-Length", "0")
        if code == 302:
            self.send_header("Location", "/ok")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def _no_exec(argv: list[str], timeout: float) -> int:
    raise AssertionError("no exec expected")


def test_http_probes_pass_on_2xx_and_3xx_only(server: int) -> None:
    def probe(path: str) -> bool:
        return run_probe({"httpGet": {"path": path, "port": "web"}}, "127.0.0.1", lambda _p: server, _no_exec)

    assert probe("/ok") and probe("/moved")
    assert not probe("/bad") and not probe("/missing")


def test_tcp_probes_pass_when_something_listens(server: int) -> None:
    assert run_probe({"tcpSocket": {"port": server}}, "127.0.0.1", int, _no_exec)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert not run_probe({"tcpSocket": {"port": port}}, "127.0.0.1", int, _no_exec)


def test_exec_probes_pass_on_exit_zero_with_the_probe_timeout() -> None:
    seen: list[tuple[list[str], float]] = []

    def run_exec(argv: list[str], timeout: float) -> int:
        seen.append((argv, timeout))
        return 0 if argv[-1] == "ok" else 1

    assert run_probe({"exec": {"command": ["check", "ok"]}, "timeoutSeconds": 4}, "", int, run_exec)
    assert not run_probe({"exec": {"command": ["check", "no"]}}, "", int, run_exec)
    assert seen == [(["check", "ok"], 4.0), (["check", "no"], 1.0)]


def test_a_probe_port_that_names_no_port_counts_as_failing() -> None:
    def port_of(port: int | str) -> int:
        raise ValueError(f"no port named {port!r}")

    assert not run_probe({"httpGet": {"port": "nope"}}, "127.0.0.1", port_of, _no_exec)


def test_a_probe_of_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedProbe, match="grpc"):
        run_probe({"grpc": {"port": 1}}, "127.0.0.1", int, _no_exec)
