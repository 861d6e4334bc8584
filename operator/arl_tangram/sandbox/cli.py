"""``tangram sandbox-agent --listen HOST:PORT [options]``: run the sandbox agent."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import resource
import sys
from typing import Any

from aiohttp import web

from arl_tangram.errors import InfrastructureError, InvalidSpec
from arl_tangram.loop import stop_on_signals
from arl_tangram.sandbox import isolation
from arl_tangram.sandbox.config import AgentConfig, Limits
from arl_tangram.sandbox.server import build_app

log = logging.getLogger("tangram.sandbox")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidSpec("listen", f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _settings() -> list[tuple[str, dataclasses.Field[Any]]]:
    """(where, field) of every setting with a flag: ``where`` is "" for ``AgentConfig``'s own and
    "limits" for ``Limits``'."""
    out: list[tuple[str, dataclasses.Field[Any]]] = []
    for where, cls in (("", AgentConfig), ("limits", Limits)):
        out += [(where, f) for f in dataclasses.fields(cls) if "flag" in f.metadata]
    return out


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return ""  # computed at start-up; the help says what
    value = f.default
    if f.metadata["per_mb"]:
        value = value / (1 << 20)
    if isinstance(value, tuple):
        value = ",".join(value)
    return f" (default {value})"


def build_parser() -> argparse.ArgumentParser:
    """The command's options, made from the settings in ``config`` (their one source): a flag left
    out keeps the setting's default."""
    p = argparse.ArgumentParser(prog="tangram sandbox-agent", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT to serve on (default %(default)s)")
    for _, f in _settings():
        meta = f.metadata
        help_text = meta["help"].replace("%", "%%")
        if f.type in ("bool", bool):
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=None, help=help_text)
            continue
        kind: Any = str if meta["parse"] is not None else (float if meta["per_mb"] else type(f.default))
        if f.default is dataclasses.MISSING and meta["parse"] is None:
            kind = int  # a computed numeric default (max_memory_mb)
        p.add_argument(
            meta["flag"],
            dest=f.name,
            type=kind,
            default=None,
            choices=meta["choices"],
            metavar=None if meta["choices"] else meta["flag"].lstrip("-").upper().replace("-", "_"),
            help=help_text + _default_text(f),
        )
    p.add_argument(
        "--token",
        default=os.environ.get("TANGRAM_AGENT_TOKEN"),
        help="require this bearer token (prefer the env var TANGRAM_AGENT_TOKEN: argv is visible in /proc)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Settings from parsed options; ``InvalidSpec`` names the bad option."""
    host, port = parse_listen(args.listen)
    given: dict[str, dict[str, Any]] = {"": {}, "limits": {}}
    for where, f in _settings():
        value = getattr(args, f.name)
        if value is None:
            continue
        meta = f.metadata
        if meta["negated"]:
            value = not value
        elif meta["parse"] is not None:
            value = meta["parse"](value)
        elif meta["per_mb"]:
            value = int(value * (1 << 20))
        given[where][f.name] = value
    config = AgentConfig(
        host=host, port=port, token=args.token or None, limits=Limits(**given["limits"]), **given[""]
    )
    config.validate()
    return config


async def serve(config: AgentConfig) -> None:
    """Serve until SIGTERM or SIGINT; then close every session and stop every action."""
    app = build_app(config)
    # Not cancelled when a client goes away: a keyed action runs in its request's handler, and a
    # dispatcher whose connection was cut reads its answer back by key (server._keyed).
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
    await site.start()
    log.info("sandbox agent listening on %s:%d (cores %s)", config.host, config.port, config.cores)
    # Tests and supervisors wait for this line on stdout.
    print(f"tangram sandbox-agent ready on http://{config.host}:{config.port}", flush=True)
    await stop_on_signals().wait()
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
    if config.limits.workdir_mb > 0:
        # Here, while this process has one thread: a mount namespace is a thread's own, and every
        # thread started later (the janitor's) must share this one.
        why = isolation.own_mount_namespace(config.workdir_root)
        if why is not None:
            log.warning("no mount namespace of the agent's own (%s): workdirs cannot be bounded", why)
    try:
        asyncio.run(serve(config))
    except InfrastructureError as exc:  # the fork server could not start: say why, no traceback
        print(f"tangram sandbox-agent: {exc}", file=sys.stderr)
        return 1
    return 0
