"""``tangram up -f PATH...``: the operator's parts as local processes, until Ctrl-C.

The same pieces as in a cluster, wired the same way: each ActionPool is reconciled by the operator's
:class:`~arl_tangram.controllers.actionpool.PoolController` (capacity planner, pure reconcile, the
runtime applying its operations) against the :mod:`local runtime <arl_tangram.runtime.local>`,
whose hosts are sandbox agent processes on loopback carved out of this machine's cores; the one
:class:`~arl_tangram.dispatch.dispatcher.Dispatcher` queues and schedules every action; the gateway
(native API, ``/run_code``, reward shapes) serves on loopback without authentication. Pool status,
what ``kubectl get actionpool -o yaml`` would show, is at ``GET /v1/pools``. The scheduler's tenant
weights come from the operator's own variable, ``TANGRAM_TENANT_WEIGHTS``, read by the operator's
own parser.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from arl_tangram import loop
from arl_tangram.api.actionpool import ActionPool
from arl_tangram.controllers.actionpool import PoolController
from arl_tangram.controllers.conditions import Event
from arl_tangram.controllers.operator import ENVIRONMENT
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import TENANT_WEIGHTS_ENV, Dispatcher, tenant_weights_from_env
from arl_tangram.domain.actions import ActionOutcome, ActionRequest
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.embedded.rewards import LocalRewards, RewardRuntimeFailed
from arl_tangram.embedded.specs import Loaded, load, pool_names
from arl_tangram.errors import InvalidSpec
from arl_tangram.gateway import GatewayConfig, build_gateway_app
from arl_tangram.planner.capacity_planner import CapacityPlanner, PlannerConfig
from arl_tangram.planner.snapshot import NodeSnapshot
from arl_tangram.runtime.local import (
    DEFAULT_UID_BASE,
    NODE,
    LocalRuntime,
    machine_memory_bytes,
    reserve_uids,
    uids_needed,
    usable_cores,
)
from arl_tangram.sandbox.config import parse_cores

log = logging.getLogger("tangram.up")

LISTEN_HOST = "127.0.0.1"  # no authentication, so loopback only: never a flag
DEFAULT_PORT = 8080
# One planning round per pool per period: short, so that a first action on a pool scaled to zero
# gets its host within a second of the agent's own start-up.
PERIOD_S = 1.0
# The planner's MILP runs every round: keep it well inside the period (greedy stands in on time-out).
PLANNER_TIME_LIMIT_S = 0.3
SESSION_SWEEP_S = 10.0
# At Ctrl-C, requests in flight get this long to be answered (aiohttp's own default is a minute, too
# long to wait at a terminal); then the hosts stop, and the actions still running with them.
ANSWER_AT_STOP_S = 3.0


@dataclass
class EmbeddedService:
    """The ActionService behind the embedded gateway: reward actions to the local reward runtime,
    every other action to the dispatcher."""

    dispatcher: Dispatcher
    rewards: LocalRewards

    async def run(self, request: ActionRequest) -> ActionOutcome:
        if request.kind == "reward":
            return await self.rewards.score(request)
        return await self.dispatcher.run(request)

    async def cancel(self, key: str) -> bool:
        # As the operator's: its dispatcher asks its reward router for a key it runs no job under;
        # here reward actions are the local runtime's, which is asked the same way.
        return await self.dispatcher.cancel(key) or self.rewards.cancel(key)

    async def open_session(self, namespace: str, pool: str, ttl_s: float | None = None) -> str:
        return await self.dispatcher.open_session(namespace, pool, ttl_s)

    async def close_session(self, namespace: str, pool: str, session: str) -> None:
        await self.dispatcher.close_session(namespace, pool, session)

    async def find_pool_config(self, namespace: str, name: str) -> PoolConfig | None:
        return await self.dispatcher.find_pool_config(namespace, name)

    def session_lost(self, namespace: str, pool: str, session: str) -> str | None:
        return self.dispatcher.session_lost(namespace, pool, session)


@dataclass
class Embedded:
    """A running embedded mode (see the module docstring). ``start``, then ``stop``.

    ``listener``: the gateway's socket, bound and listening before anything starts (see
    :func:`listen`); ``uids``: the range :func:`~arl_tangram.runtime.local.reserve_uids` holds for
    the hosts, the only uids a stop kills processes under."""

    loaded: Loaded
    cores: tuple[int, ...]
    state_dir: Path
    listener: socket.socket
    uids: range
    period_s: float = PERIOD_S
    # The scheduler's weighted fair share: tenant -> weight, 1 for each left out.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    url: str = ""
    runtime: LocalRuntime = field(init=False)
    dispatcher: Dispatcher = field(init=False)
    controller: PoolController = field(init=False)
    rewards: LocalRewards = field(init=False)
    notes: list[str] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _bodies: list[dict[str, Any]] = field(default_factory=list)
    _ready: dict[str, int] = field(default_factory=dict)
    _told_pending: set[str] = field(default_factory=set)
    _not_ready: dict[str, Any] = field(default_factory=dict)

    def node(self) -> NodeSnapshot:
        return NodeSnapshot(
            name=NODE,
            cpu_millicores=1000 * len(self.cores),
            memory_bytes=machine_memory_bytes(),
            labels={"kubernetes.io/hostname": NODE},
        )

    def __post_init__(self) -> None:
        self.runtime = LocalRuntime(
            self.state_dir / "hosts", self.cores, uid_base=self.uids.start, uid_stop=self.uids.stop
        )
        self.dispatcher = Dispatcher(AgentClient(), tenant_weights=self.tenant_weights)
        planner = CapacityPlanner(PlannerConfig(time_limit_s=PLANNER_TIME_LIMIT_S))
        self.controller = PoolController(self.dispatcher, self.runtime, planner)
        self.rewards, notes = LocalRewards.plan(self.loaded.services, self.state_dir)
        self.notes.extend(notes)

    async def start(self) -> None:
        await self.rewards.start()
        self._bodies = [dict(b) for b in self.loaded.pools]
        # Register the pools before the gateway answers, so that a first request finds its pool.
        for body in self._bodies:
            await self._reconcile(body)
        app = build_gateway_app(
            EmbeddedService(self.dispatcher, self.rewards),
            None,
            config=self._gateway_config(),
            allow_anonymous=True,
        )
        app.router.add_get("/v1/pools", self._pools)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=ANSWER_AT_STOP_S)
        await self._runner.setup()
        await web.SockSite(self._runner, self.listener).start()
        self.url = f"http://{LISTEN_HOST}:{self.listener.getsockname()[1]}"
        self._tasks.append(asyncio.create_task(self._loop()))
        self._tasks.append(asyncio.create_task(self._sweep_sessions()))

    def _gateway_config(self) -> GatewayConfig:
        """Requests that name no namespace go to the first declared one; no pool or service, to
        the first declared in their namespace."""
        pools: dict[str, str] = {}
        for body in self._bodies:
            meta = body["metadata"]
            pools.setdefault(meta["namespace"], meta["name"])
        services: dict[str, str] = {}
        for key in self.rewards.services:
            ns, _, name = key.partition("/")
            services.setdefault(ns, name)
        first = next(iter(pools), next(iter(services), "default").partition("/")[0])
        return GatewayConfig(default_namespace=first, default_pools=pools, default_services=services)

    async def _pools(self, request: web.Request) -> web.Response:
        return web.json_response({"items": [self._view(b) for b in self._bodies]})

    def _view(self, body: Mapping[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        hosts: list[dict[str, Any]] = []
        for h in self.runtime.hosts(key):
            view: dict[str, Any] = {"name": h.name, "phase": h.phase, "address": h.address}
            if (lh := self.runtime.host(h.name)) is not None:
                view.update(cores=list(lh.cores), pid=lh.proc.pid, uids=[lh.uids.start, lh.uids.stop])
            elif h.pending:
                # Not started: no room for it on this machine yet (``LocalRuntime``'s pending host).
                view.update(cores=[], pid=None, uids=None, pending=h.pending)
            else:
                continue
            hosts.append(view)
        return {
            "namespace": meta["namespace"],
            "name": meta["name"],
            "status": body.get("status"),
            "hosts": hosts,
        }

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            for body in self._bodies:
                try:
                    await self._reconcile(body)
                except Exception:  # one bad round must not stop the others; the next one retries
                    log.exception("reconcile of ActionPool %s failed", body["metadata"].get("name"))

    async def _reconcile(self, body: dict[str, Any]) -> None:
        status, ops = await self.controller.reconcile(body, [self.node()], self.runtime.all_hosts())
        body["status"] = status
        meta = body["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        for op in ops:
            if isinstance(op, Event):
                log.info("ActionPool %s: %s: %s", key, op.reason, op.message)
        ready = int(status.get("hostsReady", 0))
        if self._ready.get(key) != ready:
            self._ready[key] = ready
            cores = status.get("coresTotal", 0)
            print(f"tangram up: ActionPool {key}: {ready} host(s) ready, {cores} core(s)", flush=True)
        self._told_pending &= {h.name for h in self.runtime.all_hosts() if h.pending}
        for h in self.runtime.hosts(key):
            # Said once per host, at once: the pool's status says it only once the host has waited
            # as long as a cluster's scheduler is given (failures.UNSCHEDULABLE_AFTER_S).
            if h.pending and h.name not in self._told_pending:
                self._told_pending.add(h.name)
                print(
                    f"tangram up: ActionPool {key}: host {h.name} cannot start yet: {h.pending}", flush=True
                )
        for cond in status.get("conditions") or ():
            if (
                cond.get("type") == "Ready"
                and cond.get("status") == "False"
                and cond.get("reason") not in ("HostsStarting",)
            ):
                # Once per message, not once a round (a line a second buried everything else).
                if self._not_ready.get(key) != cond.get("message"):
                    self._not_ready[key] = cond.get("message")
                    log.warning("ActionPool %s not ready: %s", key, cond.get("message"))
            elif cond.get("type") == "Ready":
                self._not_ready.pop(key, None)

    async def _sweep_sessions(self) -> None:
        while True:
            await asyncio.sleep(SESSION_SWEEP_S)
            await self.dispatcher.expire_sessions()

    async def stop(self) -> None:
        """Stop serving, then stop every host (and the reward runtime) this run started."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The dispatcher first: each request waiting for an action is answered (503, send again)
        # before the server closes; the other way round their connections were dropped unanswered.
        await self.dispatcher.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.runtime.close()
        await self.rewards.stop()
        await self.dispatcher.agent.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tangram up",
        description="Run ActionPools and RewardModelServices from YAML on this machine (no cluster) "
        "until Ctrl-C; the gateway serves on loopback without authentication.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="PATH",
        help="a YAML file or a directory of them (repeatable), as `kubectl apply -f` takes",
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="gateway port on 127.0.0.1 (default %(default)s; 0 picks a free one)",
    )
    p.add_argument("--cores", help="the cores hosts are carved from, e.g. 0-3 (default: all usable)")
    p.add_argument("--state-dir", help="hosts' workdirs and logs (default: a fresh temporary directory)")
    p.add_argument(
        "--uid-base",
        type=int,
        help="first uid handed to hosts' actions (as root); each host takes a range above it. A "
        "range an account, a group, a process or another tangram up uses is refused (a stop kills "
        f"every process under the hosts' uids); default: the first free range from {DEFAULT_UID_BASE}",
    )
    p.add_argument("--log-level", default="INFO")
    p.epilog = f"environment: {TENANT_WEIGHTS_ENV}: {ENVIRONMENT[TENANT_WEIGHTS_ENV][1]}"
    return p


def listen(port: int) -> socket.socket:
    """The gateway's socket, listening on loopback: taken before any host starts, so that a port in
    use stops this run before it has started (or may stop) anything. Connections made before the
    gateway serves wait in the backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Only lets a port in TIME_WAIT from a run just stopped be bound; one listening stays refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LISTEN_HOST, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def needed_uids(loaded: Loaded, cores: int) -> int:
    """How many uids the hosts of ``loaded``'s pools may hold at once on ``cores`` cores."""
    configs = [pool_config(ActionPool.model_validate(body)) for body in loaded.pools]
    return uids_needed(configs, cores)


def resolve_cores(text: str | None) -> tuple[int, ...]:
    usable = usable_cores()
    if text is None:
        return usable
    try:
        cores = tuple(parse_cores(text))
    except Exception as exc:
        raise InvalidSpec("--cores", str(exc)) from None
    outside = sorted(set(cores) - set(usable))
    if outside:
        raise InvalidSpec("--cores", f"cores {outside} are not usable here (usable: {list(usable)})")
    return cores


async def serve(embedded: Embedded) -> int:
    stop = loop.stop_on_signals()
    try:
        await embedded.start()
        for note in embedded.loaded.notes + tuple(embedded.notes):
            print(f"tangram up: {note}", flush=True)
        if not embedded.rewards.services:
            print("tangram up: reward endpoints: no RewardModelService is served", flush=True)
        print(
            f"tangram up: pools {', '.join(pool_names(embedded.loaded.pools)) or '(none)'}; "
            f"cores {','.join(map(str, embedded.cores))}",
            flush=True,
        )
        # Tests and scripts wait for this line.
        print(
            f"tangram up: gateway on {embedded.url} (no authentication, loopback only; Ctrl-C stops)",
            flush=True,
        )
        await stop.wait()
        print("tangram up: stopping: every host it started", flush=True)
    finally:
        await embedded.stop()
    return 0


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 0 <= args.port < 65536:
        print(f"tangram up: --port must be 0..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        cores = resolve_cores(args.cores)
        loaded = load(args.filename, len(cores), machine_memory_bytes())
        weights = dict(tenant_weights_from_env(TENANT_WEIGHTS_ENV))
    except InvalidSpec as exc:
        print(f"tangram up: {exc}", file=sys.stderr)
        return 2
    # The port and the uids first: a run that cannot have both must not start anything.
    try:
        listener = listen(args.port)
    except OSError as exc:
        print(
            f"tangram up: --port {args.port}: cannot listen on {LISTEN_HOST}:{args.port}: "
            f"{exc.strerror or exc}; nothing was started (--port 0 picks a free port)",
            file=sys.stderr,
        )
        return 1
    try:
        reservation = reserve_uids(args.uid_base, needed_uids(loaded, len(cores)))
    except InvalidSpec as exc:
        listener.close()
        print(f"tangram up: {exc}", file=sys.stderr)
        return 2
    own_dir = args.state_dir is None
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="tangram-up-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    embedded = Embedded(loaded, cores, state_dir, listener, reservation.uids, tenant_weights=weights)
    if weights:
        shares = ", ".join(f"{tenant}={weight:g}" for tenant, weight in weights.items())
        embedded.notes.append(f"tenant weights ({TENANT_WEIGHTS_ENV}): {shares}; every other tenant 1")
    if reservation.uids:
        embedded.notes.append(
            f"hosts' actions run under uids {reservation.uids.start}..{reservation.uids.stop - 1} "
            "(when run as root; a stop kills what runs under them)"
        )
    try:
        return loop.run(serve(embedded))
    except (OSError, RewardRuntimeFailed) as exc:
        print(f"tangram up: {exc}", file=sys.stderr)
        return 1
    finally:
        listener.close()
        reservation.close()
        if own_dir:
            shutil.rmtree(state_dir, ignore_errors=True)
