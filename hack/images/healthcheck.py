#!/usr/bin/env python3
"""The images' HEALTHCHECK: asks the tangram server running in this container on the address it
really listens on, so a health check follows ``--listen`` (or the operator's TANGRAM_LISTEN_PORT)
instead of assuming a port.

It finds the first process whose command line is ``tangram <command>`` (PID 1 as a rule; a few more
under ``docker run --init``) and reads its address from that command line: ``--listen HOST:PORT`` or
``--listen=HOST:PORT`` for the sandbox agent and the reward runtime, TANGRAM_LISTEN_HOST/PORT for the
operator. A wildcard host is asked on loopback. Exit 0 when the server answers 200, else 1 (with the
reason on stderr, which ``docker inspect`` shows).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

# command -> (path asked, default port). The defaults are the commands' own; they apply only when
# the command line names no address.
SERVERS = {
    "sandbox-agent": ("/v1/health", 8080),
    "reward-runtime": ("/v1/health", 8000),
    "operator": ("/healthz", 8080),
}
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def find_server() -> tuple[str, list[str]]:
    """The tangram command running here and its arguments after the command."""
    for proc in sorted((p for p in Path("/proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if os.path.basename(arg) == "tangram" and argv[i + 1] in SERVERS:
                return argv[i + 1], argv[i + 2 :]
    raise LookupError("no `tangram sandbox-agent|reward-runtime|operator` process in this container")


def address(command: str, args: list[str]) -> tuple[str, int]:
    """Where ``command`` listens, from its arguments or (the operator) its environment."""
    _, default_port = SERVERS[command]
    if command == "operator":
        return os.environ.get("TANGRAM_LISTEN_HOST", ""), int(
            os.environ.get("TANGRAM_LISTEN_PORT", default_port)
        )
    listen = None
    for i, arg in enumerate(args):
        if arg == "--listen" and i + 1 < len(args):
            listen = args[i + 1]
        elif arg.startswith("--listen="):
            listen = arg.split("=", 1)[1]
    if listen is None:
        return "", default_port
    host, _, port = listen.rpartition(":")
    return host, int(port)


def main() -> int:
    try:
        command, args = find_server()
        host, port = address(command, args)
    except (LookupError, ValueError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    if host in WILDCARDS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    url = f"http://{host}:{port}{SERVERS[command][0]}"
    # No proxy: the server is in this container, whatever HTTP_PROXY the image was given.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=3) as resp:
            return 0 if resp.status == 200 else 1
    except OSError as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
