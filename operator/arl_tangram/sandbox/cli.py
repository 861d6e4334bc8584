"""``tangram sandbox-agent --listen HOST:PORT [options]``: run the sandbox agent."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys

from aiohttp import web

from arl_tangram.errors import InfrastructureError, InvalidSpec
from arl_tangram.sandbox.config import (
    DEFAULT_PRELOAD,
    RUNTIMES,
    AgentConfig,
    Limits,
    parse_cores,
)
from arl_tangram.sandbox.server import build_app

log = logging.getLogger("tangram.sandbox")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidSpec("listen", f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The command's options; their defaults are ``AgentConfig``'s and ``Limits``'s own."""
    d, lim = AgentConfig, Limits()
    p = argparse.ArgumentParser(prog="tangram sandbox-agent", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT to serve on (default %(default)s)")
    p.add_argument("--cores", help="cores this agent hands out, e.g. 0-7 (default: all it may use)")
    p.add_argument("--workdir-root", help="where workdirs live (default: a fresh dir on /dev/shm)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help="offered runtimes (default %(default)s)")
    p.add_argument(
        "--network-allowed",
        action="store_true",
        help="let actions use the network (they can then reach the agent too: set a token)",
    )
    p.add_argument(
        "--no-pid-namespace",
        action="store_true",
        help="clean up leftover processes by uid/process group instead of a PID namespace per action",
    )
    p.add_argument(
        "--no-private-tmp",
        action="store_true",
        help="no private writable /tmp and /dev/shm per action (saves a mount namespace per action; "
        "both are then read-only to actions)",
    )
    p.add_argument("--preload", default=",".join(DEFAULT_PRELOAD), help="modules the fork server pre-imports")
    p.add_argument(
        "--no-infra-affinity",
        action="store_true",
        help="let the kernel place the HTTP loop and the fork server anywhere (by default they keep to "
        "two disjoint halves of the cores, which on a busy host leaves fewer cores idle)",
    )
    p.add_argument(
        "--fork-loop",
        choices=("auto", "c", "python"),
        default=d.fork_loop,
        help="the zygote's fork loop: C (built at install when a compiler is present; about three "
        "times the throughput), Python, or auto (C when built)",
    )
    p.add_argument(
        "--uid-base",
        type=int,
        default=d.uid_base,
        help="first uid given to actions (as root); agents sharing a host need disjoint ranges "
        "of max-concurrent + max-sessions uids",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=d.max_concurrent, help="actions running at once (uids kept)"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="requests queued beyond --max-concurrent; more are answered 503 with Retry-After",
    )
    p.add_argument("--max-sessions", type=int, default=d.max_sessions)
    p.add_argument(
        "--session-ttl", type=float, default=d.session_ttl_s, help="idle seconds before a session closes"
    )
    p.add_argument(
        "--timeout", type=float, default=lim.timeout_s, help="default wall-clock limit per action (s)"
    )
    p.add_argument("--max-timeout", type=float, default=lim.max_timeout_s)
    p.add_argument(
        "--memory-mb", type=int, default=lim.memory_mb, help="default address-space limit per action"
    )
    p.add_argument("--max-memory-mb", type=int, default=lim.max_memory_mb)
    p.add_argument("--nproc", type=int, default=lim.nproc, help="processes (and threads) per action")
    p.add_argument("--nofile", type=int, default=lim.nofile, help="open files per process")
    p.add_argument("--fsize-mb", type=int, default=lim.fsize_mb, help="largest file an action may write")
    p.add_argument("--output-bytes", type=int, default=lim.output_bytes, help="cap on stdout and on stderr")
    p.add_argument(
        "--max-body-mb", type=float, default=d.max_body_bytes / (1 << 20), help="largest request body"
    )
    p.add_argument(
        "--max-file-mb",
        type=float,
        default=d.max_file_bytes / (1 << 20),
        help="largest file uploaded or fetched",
    )
    p.add_argument(
        "--max-fetch-mb",
        type=float,
        default=d.max_fetch_bytes / (1 << 20),
        help="all of one response's fetch_files together (the rest come back empty, with a note)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("TANGRAM_AGENT_TOKEN"),
        help="require this bearer token (prefer the env var TANGRAM_AGENT_TOKEN: argv is visible in /proc)",
    )
    p.add_argument(
        "--action-key-ttl",
        type=float,
        default=d.action_key_ttl_s,
        help="seconds a finished action's response is kept for a repeat of its X-Tangram-Action-Key",
    )
    p.add_argument(
        "--action-keys-max", type=int, default=d.action_keys_max, help="finished keyed responses kept at most"
    )
    p.add_argument(
        "--action-keys-max-mb",
        type=float,
        default=d.action_keys_max_bytes / (1 << 20),
        help="bytes of finished keyed responses kept at most (the oldest are dropped first)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Settings from parsed options; ``InvalidSpec`` names the bad option."""
    host, port = parse_listen(args.listen)
    config = AgentConfig(
        host=host,
        port=port,
        runtimes=tuple(r.strip() for r in args.runtimes.split(",") if r.strip()),
        network_allowed=args.network_allowed,
        no_pid_namespace=args.no_pid_namespace,
        private_tmp=not args.no_private_tmp,
        preload=tuple(m.strip() for m in args.preload.split(",") if m.strip()),
        fork_loop=args.fork_loop,
        infra_affinity=not args.no_infra_affinity,
        uid_base=args.uid_base,
        max_concurrent=args.max_concurrent,
        max_waiting=args.max_waiting,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_file_bytes=int(args.max_file_mb * (1 << 20)),
        max_fetch_bytes=int(args.max_fetch_mb * (1 << 20)),
        token=args.token or None,
        action_key_ttl_s=args.action_key_ttl,
        action_keys_max=args.action_keys_max,
        action_keys_max_bytes=int(args.action_keys_max_mb * (1 << 20)),
        limits=Limits(
            timeout_s=args.timeout,
            max_timeout_s=args.max_timeout,
            memory_mb=args.memory_mb,
            max_memory_mb=args.max_memory_mb,
            nproc=args.nproc,
            nofile=args.nofile,
            fsize_mb=args.fsize_mb,
            output_bytes=args.output_bytes,
        ),
    )
    if args.cores:
        config.cores = parse_cores(args.cores)
    if args.workdir_root:
        config.workdir_root = os.path.abspath(args.workdir_root)
    config.validate()
    return config


async def serve(config: AgentConfig) -> None:
    """Serve until SIGTERM or SIGINT; then close every session and stop every action."""
    app = build_app(config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
    await site.start()
    log.info("sandbox agent listening on %s:%d (cores %s)", config.host, config.port, config.cores)
    # Tests and supervisors wait for this line on stdout.
    print(f"tangram sandbox-agent ready on http://{config.host}:{config.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str]) -> int:
    """Entry point of ``tangram sandbox-agent``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except InvalidSpec as exc:
        print(f"tangram sandbox-agent: {exc}", file=sys.stderr)
        return 2
    # Many concurrent requests and pipes: raise our own descriptor limit as far as allowed.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        asyncio.run(serve(config))
    except InfrastructureError as exc:  # the fork server could not start: say why, no traceback
        print(f"tangram sandbox-agent: {exc}", file=sys.stderr)
        return 1
    return 0
