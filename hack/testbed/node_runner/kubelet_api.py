"""The kubelet API: what `kubectl logs` reaches through the API server (container logs only)."""

from __future__ import annotations

import http.server
import logging
import ssl
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from .container import Container

if TYPE_CHECKING:
    from .node import NodeRunner

log = logging.getLogger("node-runner")


def log_run_index(c: Container, previous: bool) -> int:
    """Which run's log `kubectl logs` shows: the current run, the one before with --previous, and for a
    crash-looping container (waiting to restart) the last run, as kubectl shows it."""
    index = c.restart_count - 1 if previous else c.restart_count
    if "running" not in c.state and "waiting" in c.state and not previous:
        index = c.restart_count - 1
    return index


def select_log(data: bytes, tail_lines: str, limit_bytes: str) -> bytes:
    """tailLines, then limitBytes, as the kubelet applies them (non-numbers are ignored)."""
    if tail_lines.isdigit():
        data = b"".join(data.splitlines(keepends=True)[-int(tail_lines) :]) if int(tail_lines) else b""
    if limit_bytes.isdigit():
        data = data[: int(limit_bytes)]
    return data


class KubeletApi(http.server.BaseHTTPRequestHandler):
    """GET /containerLogs/{namespace}/{pod}/{container} (follow, previous, tailLines, limitBytes) and
    /healthz. Only the API server can call it: TLS with a client certificate from the cluster's CA."""

    runner: NodeRunner
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kubelet API: " + format, *args)

    def _reply(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        if parts == ["healthz"]:
            self._reply(200, "ok")
            return
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._reply(404, f"the test bed's node runner serves container logs only, not {url.path}")
            return
        _, ns, pod, container = parts
        with self.runner.lock:
            worker = next((w for w in self.runner.workers.values() if (w.ns, w.pod_name) == (ns, pod)), None)
        c = None
        if worker is not None:
            c = next((x for x in worker.init_containers + worker.containers if x.name == container), None)
        if worker is None or c is None:
            self._reply(404, f"container {container} of pod {ns}/{pod} is not running on this node")
            return
        previous = query.get("previous", ["false"])[0] == "true"
        index = log_run_index(c, previous)
        path = worker.dir / c.name / f"{index}.log"
        if index < 0 or not path.exists():
            self._reply(400, f'previous terminated container "{container}" in pod "{pod}" not found')
            return
        data = select_log(
            path.read_bytes(), query.get("tailLines", [""])[0], query.get("limitBytes", [""])[0]
        )
        follow = query.get("follow", ["false"])[0] == "true" and not previous
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        if not follow:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = path.stat().st_size
        self._chunk(data)
        run = c.container_id
        # Follow until this run of the container ends (or the client goes away).
        while c.container_id == run and c.proc is not None and not self.runner.stopping.is_set():
            size = path.stat().st_size
            if size > sent:
                with open(path, "rb") as f:
                    f.seek(sent)
                    self._chunk(f.read(size - sent))
                sent = size
            else:
                time.sleep(0.2)  # polling the log file: there is no change notification to wait on
        with open(path, "rb") as f:
            f.seek(sent)
            self._chunk(f.read())
        self._chunk(b"", final=True)

    def _chunk(self, data: bytes, final: bool = False) -> None:
        if not data and not final:
            return  # an empty chunk ends the response
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def serve_kubelet_api(runner: NodeRunner, cert: str, key: str, client_ca: str) -> None:
    """Serves the kubelet API on the runner's host IP and --kubelet-port in a thread."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(client_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    handler = type("Handler", (KubeletApi,), {"runner": runner})
    server = http.server.ThreadingHTTPServer((runner.host_ip, runner.kubelet_port), handler)
    server.daemon_threads = True
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="kubelet-api", daemon=True).start()
    log.info("kubelet API on https://%s:%d", runner.host_ip, runner.kubelet_port)
