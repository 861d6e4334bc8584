# mypy: disable-error-code="arg-type,no-untyped-call"
# The kubernetes client types request bodies as models (plain dicts are valid JSON for the same
# calls), and its config loaders have no annotations.
"""The operator's long-lived state, built once at start-up and kept in kopf's memo.

One dispatcher (queue, scheduler, agent client), one runtime, one capacity planner, one batch
manager and one status writer per process; the kopf handlers only call into them. Only the leader
builds them: a standby waits for the Lease in :meth:`OperatorState.start` and serves ``/healthz``
and a ``/readyz`` that says who leads.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import urllib3
from aiohttp import web
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from arl_tangram.api.meta import DNS_LABEL_PATTERN, GROUP, VERSION
from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.controllers.actionbatch import WHOLE_OUTPUTS_BYTES, BatchManager, StatusRefused
from arl_tangram.controllers.actionpool import PoolController, config_of, node_snapshot
from arl_tangram.controllers.conditions import Event
from arl_tangram.controllers.failures import UNSCHEDULABLE_AFTER_S
from arl_tangram.controllers.leader import LeaseElector
from arl_tangram.controllers.metrics import OperatorMetrics
from arl_tangram.controllers.rewardmodelservice import ServiceController
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import TENANT_WEIGHTS_ENV, Dispatcher, tenant_weights_from_env
from arl_tangram.domain.actions import ActionOutcome, ActionRequest
from arl_tangram.domain.pools import pool_key
from arl_tangram.domain.services import is_object_name, service_config
from arl_tangram.errors import InvalidSpec, NotFound, TargetUnavailable
from arl_tangram.gateway import build_gateway_app
from arl_tangram.gateway.auth import KubernetesAuthenticator
from arl_tangram.gateway.config import GatewayConfig, parse_defaults
from arl_tangram.gateway.metrics import GatewayMetrics
from arl_tangram.gateway.state import Leadership
from arl_tangram.gpu.placement import DEVICE_STRATEGIES, DeviceStrategy
from arl_tangram.planner.capacity_planner import CapacityPlanner, PlannerConfig
from arl_tangram.planner.snapshot import NodeSnapshot
from arl_tangram.runtime.interface import HostObservation
from arl_tangram.runtime.kubernetes import KubernetesRuntime
from arl_tangram.runtime.pods import observe_host

log = logging.getLogger(__name__)

LEASE_NAME = "tangram-operator"  # manifests/rbac.yaml grants get/update on this name only
# One planning round per pool per period; short enough that a burst gets hosts within seconds.
POOL_PERIOD_S = 2.0
# The planner's MILP runs per pool round: keep it well inside the period (greedy stands in on time-out).
PLANNER_TIME_LIMIT_S = 0.5
# One GET of a pool or service no watch holds yet (``_read``): past it the read is retried. Without
# it a connection the API server accepted and never answered would hold that read, and with it every
# action naming the object, for good.
READ_TIMEOUT_S = 10.0
# How many deleted pools' and services' uids are remembered (``_deleted``): a read in flight when its
# object was deleted must not learn it again; a recreated object has a new uid.
DELETED_KEPT = 1024


# The environment the operator reads (the Deployment sets it), for `tangram operator --help`: each
# variable, the OperatorSettings field it sets (whose default it shows) and what it means.
ENVIRONMENT: dict[str, tuple[str | None, str]] = {
    "POD_NAMESPACE": (None, "where the leader Lease lives (default tangram-system)"),
    "POD_NAME": (None, "this replica's identity in the Lease (default host name and PID)"),
    "TANGRAM_LISTEN_HOST": ("listen_host", "address of health, readiness, metrics, results, gateway"),
    "TANGRAM_LISTEN_PORT": ("listen_port", "their port"),
    "TANGRAM_POLICY": ("policy", "the scheduler policy"),
    "TANGRAM_LEADER_ELECTION": ("leader_election", "false only for a single test replica"),
    "TANGRAM_GATEWAY_ANONYMOUS": ("anonymous", "true: no authentication, loopback callers only"),
    "TANGRAM_REWARD_DEVICE": ("reward_device", "the device reward runtimes score on (cpu: test beds)"),
    "TANGRAM_GPU_DEVICES": ("gpu_devices", "how reward replicas ask for their GPUs (docs/gpu.md)"),
    "TANGRAM_RESULTS_MEMORY_MIB": (
        "results_memory_mib",
        "memory for finished actions' whole outputs (GET .../results); past it the oldest are served "
        "from the status's tails",
    ),
    "TANGRAM_GATEWAY_NAMESPACE": ("gateway_namespace", "the namespace of gateway requests that name none"),
    "TANGRAM_GATEWAY_POOLS": (
        None,
        "NAMESPACE/POOL,...: the ActionPool of a namespace's /run_code and /run_jupyter requests "
        "that name none (default none)",
    ),
    "TANGRAM_GATEWAY_SERVICES": (
        None,
        "NAMESPACE/SERVICE,...: the RewardModelService of a namespace's reward requests that name "
        "none (default none)",
    ),
    TENANT_WEIGHTS_ENV: (
        None,
        "TENANT=WEIGHT,...: the tenants' weights in the scheduler's fair share (a tenant is its "
        "actions' namespace unless they name one; default 1 each)",
    ),
}


@dataclass(frozen=True)
class OperatorSettings:
    """Settings of one operator process, read once at start-up (environment, then flags)."""

    namespace: str
    identity: str
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    policy: str = "tangram"
    leader_election: bool = True
    # The device reward runtimes score on: cuda in a cluster with GPUs; cpu on a test bed without.
    reward_device: str = "cuda"
    # No authentication: only for a test bed's loopback (the gateway then serves loopback callers only).
    anonymous: bool = False
    # How a reward replica's pod asks for the devices the operator chose for it (docs/gpu.md):
    # "device-plugin" (the NVIDIA device plugin's resources on the chosen node) or "visible-devices"
    # (the exact UUIDs, for GPUs the reward pool owns outside the device plugin). One setting for the
    # whole operator: whether the device plugin manages the GPUs is the cluster's, not a service's.
    gpu_devices: DeviceStrategy = "device-plugin"
    results_memory_mib: int = WHOLE_OUTPUTS_BYTES // 2**20
    # The gateway's routing defaults (``GatewayConfig``), for trainers whose URL cannot name a target.
    gateway_namespace: str = GatewayConfig.default_namespace
    gateway_pools: tuple[tuple[str, str], ...] = ()
    gateway_services: tuple[tuple[str, str], ...] = ()
    # The scheduler's fair share: a tenant with weight 2 gets twice the starts of one with weight 1
    # while both wait (core/policies/tangram.py); every tenant left out weighs 1.
    tenant_weights: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_env(cls) -> OperatorSettings:
        """The settings from the environment (ENVIRONMENT lists the variables); unset ones keep the
        field defaults above."""
        port = os.environ.get("TANGRAM_LISTEN_PORT", str(cls.listen_port))
        if not port.isdigit() or not 0 <= int(port) < 65536:
            raise InvalidSpec("TANGRAM_LISTEN_PORT", f"must be a port number, got {port!r}")
        devices = os.environ.get("TANGRAM_GPU_DEVICES", cls.gpu_devices)
        if devices not in DEVICE_STRATEGIES:
            raise InvalidSpec(
                "TANGRAM_GPU_DEVICES", f"must be one of {', '.join(DEVICE_STRATEGIES)}, got {devices!r}"
            )
        memory = os.environ.get("TANGRAM_RESULTS_MEMORY_MIB", str(cls.results_memory_mib))
        if not (memory.isascii() and memory.isdigit()):
            raise InvalidSpec("TANGRAM_RESULTS_MEMORY_MIB", f"must be a whole number of MiB, got {memory!r}")
        policy = os.environ.get("TANGRAM_POLICY", cls.policy)
        weights = tenant_weights_from_env(TENANT_WEIGHTS_ENV)
        if weights and policy != "tangram":
            raise InvalidSpec(TENANT_WEIGHTS_ENV, f"only the tangram policy weighs tenants, not {policy!r}")
        return cls(
            namespace=os.environ.get("POD_NAMESPACE", "tangram-system"),
            identity=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
            listen_host=os.environ.get("TANGRAM_LISTEN_HOST", cls.listen_host),
            listen_port=int(port),
            policy=policy,
            leader_election=os.environ.get("TANGRAM_LEADER_ELECTION", "true").lower() not in ("0", "false"),
            anonymous=os.environ.get("TANGRAM_GATEWAY_ANONYMOUS", "").lower() in ("1", "true"),
            reward_device=os.environ.get("TANGRAM_REWARD_DEVICE", cls.reward_device),
            gpu_devices=next(d for d in DEVICE_STRATEGIES if d == devices),
            results_memory_mib=int(memory),
            gateway_namespace=_namespace("TANGRAM_GATEWAY_NAMESPACE", cls.gateway_namespace),
            gateway_pools=_targets("TANGRAM_GATEWAY_POOLS"),
            gateway_services=_targets("TANGRAM_GATEWAY_SERVICES"),
            tenant_weights=weights,
        )

    def gateway_config(self) -> GatewayConfig:
        return GatewayConfig(
            default_namespace=self.gateway_namespace,
            default_pools=dict(self.gateway_pools),
            default_services=dict(self.gateway_services),
        )


def _without_nulls(value: Any) -> Any:
    """``value`` with the keys whose value is ``None`` left out, at every depth (what a merge patch
    of it leaves stored)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _replaced(exc: ApiException) -> bool:
    """Whether the API server refused a deletion for its uid precondition (409, the only conflict a
    deletion with no resourceVersion has): the name is another object's now."""
    return bool(exc.status == 409)


def _api_message(exc: ApiException) -> str:
    """The API server's own words of a refusal (its Status's message), not the client's dump of
    the response's headers."""
    try:
        said = json.loads(exc.body or "").get("message")
    except (ValueError, AttributeError):
        said = None
    return str(said or exc.reason or exc.body)


def _too_large(exc: ApiException) -> bool:
    """Whether etcd refused the object for its size (the API server passes it on as a 500)."""
    return "request is too large" in _api_message(exc)


def _targets(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(parse_defaults(name, os.environ.get(name, "")).items())


def _namespace(name: str, default: str) -> str:
    value = os.environ.get(name) or default
    if not (len(value) <= 63 and re.fullmatch(DNS_LABEL_PATTERN, value)):
        raise InvalidSpec(name, f"{value[:80]!r} is not a namespace name")
    return value


class PoolSpecInvalid(TargetUnavailable):
    """The target ActionPool exists but its spec cannot be used (its Ready condition says
    ``InvalidSpec``): no host runs for it until the spec is fixed. A refusal like a pool's outage
    (its actions wait, or are sent again later), as fixing the spec is all it takes; ``languages``:
    those its spec names, which its actions are checked against meanwhile."""

    def __init__(self, message: str, languages: tuple[str, ...]) -> None:
        # A fixed spec is seen by the watch at once; waiting actions look again this often.
        super().__init__(message, UNSCHEDULABLE_AFTER_S)
        self.languages = languages


def _declared_languages(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The languages an invalid pool's spec names, where they are a list of names; else none (the
    actions' own default then applies)."""
    found = (body.get("spec") or {}).get("languages")
    if isinstance(found, list) and all(isinstance(lang, str) for lang in found):
        return tuple(found)
    return ()


def _post_event(body: Mapping[str, Any], event: Event) -> None:
    """Post ``event`` on the object of ``body`` (called within its kopf handler: the event queue)."""
    kopf.event(dict(body), type=event.type, reason=event.reason, message=event.message)


def api_client() -> client.ApiClient:
    """The in-cluster ServiceAccount when there is one, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class OperatorState:
    """Everything the handlers share; see the module docstring."""

    def __init__(self, settings: OperatorSettings, api: client.ApiClient | None = None) -> None:
        self.settings = settings
        self.api = api or api_client()
        self.metrics = OperatorMetrics()
        self.custom = client.CustomObjectsApi(self.api)
        self.agent = AgentClient()
        self.batches = BatchManager(
            run=self._run,
            cancel=self._cancel,
            pool_languages=self._pool_languages,
            patch_status=self._patch_batch_status,
            delete=self._delete_batch,
            whole_outputs_bytes=settings.results_memory_mib * 2**20,
            emit=self._batch_event,
        )
        # A context of a kopf handler (``keep_event_context``): where kopf.event finds its queue.
        self._event_context: contextvars.Context | None = None
        self.dispatcher = Dispatcher(
            self.agent,
            policy=settings.policy,
            on_started=self.batches.started,
            tenant_weights=dict(settings.tenant_weights),
        )
        self.runtime = KubernetesRuntime(self.api, count_write=self.metrics.api_write)
        self.dispatcher.resizer = self.runtime
        self.dispatcher.learn = self._learn
        self.planner = CapacityPlanner(PlannerConfig(time_limit_s=PLANNER_TIME_LIMIT_S))
        self.pools = PoolController(self.dispatcher, self.runtime, self.planner)
        self.services = ServiceController(
            self.dispatcher.rewards,
            self.runtime,
            self.agent,
            settings.reward_device,
            settings.gpu_devices,
            emit=_post_event,
        )
        self.elector = LeaseElector(
            self.api, settings.namespace, LEASE_NAME, settings.identity, count_write=self.metrics.api_write
        )
        self.pool_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}
        self.node_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}
        self.host_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}
        self.replica_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}  # service key -> reward pods
        self.service_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}  # service key -> its object
        # (plural, namespace, name) -> the status last written, so an unchanged one is not patched.
        self._written_status: dict[tuple[str, str, str], dict[str, Any]] = {}
        # (kind, namespace, name) -> the read of it in flight: a batch of a thousand actions naming one
        # pool that no watch holds makes one GET, not a thousand.
        self._reads: dict[tuple[str, str, str], asyncio.Task[Mapping[str, Any] | None]] = {}
        # The uids of pools and services whose delete handler ran, newest last (an ordered set).
        self._deleted: dict[str, None] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.started_at = time.time()

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve health, wait for leadership, then start the status writer."""
        await self._serve()
        if self.settings.leader_election:
            await self.elector.acquire()
            self._tasks.append(asyncio.create_task(self.elector.hold(self._lost_leadership)))
        else:
            self.elector.is_leader = True
        self.metrics.leader.set(1)
        self._tasks.append(asyncio.create_task(self.batches.run_writer()))
        self._tasks.append(asyncio.create_task(self._sessions_janitor()))

    def _lost_leadership(self) -> None:
        # Stop at once: another replica may lead now, and two leaders would hand out the same cores.
        log.error("leadership lost: stopping so that this replica restarts as a standby")
        self.metrics.leader.set(0)
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        await self.batches.flush()
        # A read retried while the API server does not answer would go on past this process's end;
        # and one that ended during the dispatcher's shutdown would start its actions past it.
        reads = list(self._reads.values())
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        await self.dispatcher.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.settings.leader_election:  # without it, there is no Lease to give up
            await self.elector.release()
        await self.agent.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _sessions_janitor(self) -> None:
        # Often enough that a dedicated pool's pod goes soon after its session's TTL; each round
        # only looks at the sessions in memory.
        while True:
            await asyncio.sleep(2)
            await self.dispatcher.expire_sessions()

    # ---- what the batch manager needs ---------------------------------------------------------
    async def _run(self, request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        started = time.monotonic()
        outcome = await self.dispatcher.run(request, attempts_so_far)
        # (An action its pool's or service's deletion ended is not counted: their series went with
        # them, and one counted now would stay for good.)
        if request.kind == "reward":
            try:  # named by its service, or by the model one serves: counted under the service
                target = self.dispatcher.rewards.resolve(request).target
            except (InvalidSpec, NotFound):
                target = request.target
            counted = self.dispatcher.rewards.has(pool_key(request.namespace, target))
        else:
            target = request.target
            counted = self.dispatcher.has_pool(request.namespace, target)
        if counted:
            self.metrics.finished(
                pool_key(request.namespace, target), request, outcome, time.monotonic() - started
            )
        return outcome

    async def _cancel(self, key: str) -> bool:
        return await self.dispatcher.cancel(key)

    async def _pool_languages(self, namespace: str, name: str) -> tuple[str, ...] | None:
        """The languages of an existing pool; None when there is no such ActionPool. A pool whose
        spec is invalid exists: its languages are those its spec names (the action is checked
        against them, then waits, as for a pool with no host, until the spec is fixed: ``_learn``)."""
        try:
            cfg = await self.dispatcher.find_pool_config(namespace, name)
        except PoolSpecInvalid as exc:
            return exc.languages
        return cfg.languages if cfg is not None else None

    async def _learn(self, kind: str, namespace: str, name: str) -> None:
        """A request (a batch's action, or the gateway's) may come before this process reconciled its
        pool or service (just after a start or a failover, while its daemon has not run yet): the
        dispatcher then learns the object from the watch's copy and holds the request for hosts or a
        replica, instead of failing it as not found.

        The watch's copy can also lag: each resource has its own watch stream, so a batch created
        just after its pool (one ``kubectl apply`` of both) may be seen before the pool is. An object
        the watch does not hold is therefore read from the API server, which alone says it does not
        exist. One being deleted stays unknown (its delete handler has removed it, or is about to:
        learning it again would hold requests for hosts that never come). One whose spec is invalid
        (its own reconcile reports why) is not learned either, and is answered ``PoolSpecInvalid``
        naming what is wrong: it exists, so "not found" would send its user looking for the wrong
        fault; its actions wait (a batch) or are refused for now (the gateway) until it is fixed."""
        index = self.pool_index if kind == "ActionPool" else self.service_index
        body = next(iter(index.get(f"{namespace}/{name}", ())), None)  # both indexes: namespace/name
        if body is None and kind == "RewardModelService" and not is_object_name(name):
            # Named by the model it serves (vLLM's and SGLang's clients: a Hugging Face id, which
            # no object can be named): each service of the watch's copy that serves it.
            for key, bodies in list(index.items()):
                for found in bodies if str(key).startswith(f"{namespace}/") else ():
                    if ((found.get("spec") or {}).get("model") or {}).get("name") == name:
                        self._learn_body(kind, found)
            return
        if body is None:
            ident = (kind, namespace, name)
            read = self._reads.get(ident)
            if read is None:
                read = self._reads[ident] = asyncio.create_task(self._read(*ident))
                read.add_done_callback(lambda _: self._reads.pop(ident, None))
            body = await asyncio.shield(read)  # one caller cancelled leaves the read to the others
            # While it was read, its reconcile (or another caller of the same read) may have added
            # it, from a copy at least as new: keep that one.
            if self._holds(kind, namespace, name):
                return
        if body is not None:
            self._learn_body(kind, body)

    def _learn_body(self, kind: str, body: Mapping[str, Any]) -> None:
        """Upsert the object of ``body`` (a watch's copy, or the API server's) unless it is being
        deleted or its spec is invalid (``_learn`` says why)."""
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp") or str(meta.get("uid", "")) in self._deleted:
            # Being deleted, or deleted while it was read (the GET answered before the delete
            # handler ran): learning it would hold requests for hosts that never come.
            return
        if kind == "ActionPool":
            try:
                cfg = config_of(body)
            except InvalidSpec as exc:  # its own reconcile reports it too (its Ready condition)
                raise PoolSpecInvalid(
                    f"ActionPool {meta.get('namespace')}/{meta.get('name')} exists, but its spec is "
                    f"invalid: {exc}; fix the pool, then its actions run",
                    _declared_languages(body),
                ) from exc
            self.dispatcher.upsert_pool(cfg)
            return
        obj, uid = {"metadata": dict(meta), "spec": body.get("spec") or {}}, str(meta.get("uid", ""))
        try:
            svc = service_config(RewardModelService.model_validate(obj), uid=uid)
        except (ValueError, InvalidSpec):
            return  # its own reconcile reports what is wrong with it
        self.dispatcher.rewards.upsert(svc)

    def _holds(self, kind: str, namespace: str, name: str) -> bool:
        if kind == "ActionPool":
            return self.dispatcher.has_pool(namespace, name)
        return self.dispatcher.rewards.has(f"{namespace}/{name}")

    def _tombstone(self, uid: str) -> None:
        """The object of ``uid`` is deleted: a read of it still in flight does not learn it."""
        if uid:
            self._deleted.pop(uid, None)
            self._deleted[uid] = None
            while len(self._deleted) > DELETED_KEPT:
                del self._deleted[next(iter(self._deleted))]

    async def _read(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The object as the API server has it; None when it does not exist. Other errors (the API
        server unreachable) are retried: failing the action as not found would be a wrong verdict."""
        plural = "actionpools" if kind == "ActionPool" else "rewardmodelservices"
        delay = 0.5
        while True:
            try:
                found: Mapping[str, Any] = await asyncio.to_thread(
                    self.custom.get_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    namespace,
                    plural,
                    name,
                    _request_timeout=READ_TIMEOUT_S,
                )
                return found
            except ApiException as exc:
                if exc.status == 404:
                    return None
                if exc.status in (401, 403):  # waiting would not help: say what is missing
                    log.error(
                        "may not read %s %s/%s (%s %s): grant the operator's ServiceAccount `get` on %s "
                        "(manifests/rbac.yaml); until then a name no watch has seen yet is not found",
                        kind, namespace, name, exc.status, exc.reason, plural,
                    )  # fmt: skip
                    return None
                why = f"{exc.status} {exc.reason}"
            except (urllib3.exceptions.HTTPError, OSError) as exc:  # no answer at all, or too late
                why = str(exc)
            log.warning("reading %s %s/%s failed (%s); retrying in %.1f s", kind, namespace, name, why, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any] | list[dict[str, Any]]
    ) -> None:
        """Patch an object's status subresource (the one way status is written): a merge patch of
        ``{"status": ...}``, or the JSON patch ``status`` when it is a list of operations."""
        self.metrics.api_write("patch", f"{plural}/status")
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            plural,
            name,
            status if isinstance(status, list) else {"status": status},
            _content_type="application/json-patch+json" if isinstance(status, list) else None,
        )

    async def _write_if_changed(self, plural: str, body: Mapping[str, Any], status: dict[str, Any]) -> None:
        """Patch a pool's or a service's status unless it is what was last written."""
        meta = body.get("metadata") or {}
        ident = (plural, str(meta.get("namespace")), str(meta.get("name")))
        if self._written_status.get(ident) == status:
            return
        await self._patch_status(*ident, status)
        self._written_status[ident] = status

    # A batch's status and its TTL deletion go to the object of its uid only. By name alone, a batch
    # deleted and made again under its name (a trainer reusing names step after step) could be given
    # the old one's results, which it would then take as final and never run its own actions, or be
    # deleted by the old one's TTL. A uid in a merge patch is no precondition on the status
    # subresource (the API server takes only the status from it), so the status goes as a JSON
    # patch whose first operation tests the uid; the deletion carries DeleteOptions' precondition.
    async def _patch_batch_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        ops = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            # The whole status, as the merge patch of all of it: its ``None``s are fields absent.
            {"op": "add", "path": "/status", "value": _without_nulls(status)},
        ]
        try:
            await self._patch_status("actionbatches", namespace, name, ops)
        except ApiException as exc:
            if exc.status == 404:  # gone: nothing left to report to
                return
            # A failed test answers 422 saying only that the request was wrong, as an invalid
            # status would: a patch that only tests the uid tells which (it changes nothing, and
            # needs no verb the operator does not have already).
            if exc.status == 422 and not await self._is_uid("actionbatches", namespace, name, uid):
                return
            if exc.status in (400, 413, 422) or _too_large(exc):
                # Refused for what it holds: sending it again cannot help (``StatusRefused``).
                raise StatusRefused(f"{exc.status}: {_api_message(exc)}") from exc
            raise

    def keep_event_context(self) -> None:
        """Keep the context of a kopf handler (called by each). kopf posts Events through its
        queue, which it sets in its handlers' context only; a batch's Events are posted by the
        status writer, a task started at start-up, outside any handler."""
        if self._event_context is None:
            self._event_context = contextvars.copy_context()

    def _batch_event(self, namespace: str, name: str, uid: str, event: Event) -> None:
        """Post ``event`` on the ActionBatch of ``uid`` (kopf's queue, as every Event)."""
        ctx = self._event_context
        if ctx is None:  # no handler has run: no batch has either
            return
        ref = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ActionBatch",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
        }
        try:
            ctx.run(kopf.event, ref, type=event.type, reason=event.reason, message=event.message)
        except (LookupError, RuntimeError) as exc:  # an Event is worth no failed status write
            log.warning("event %s of batch %s/%s not posted: %s", event.reason, namespace, name, exc)

    async def _is_uid(self, plural: str, namespace: str, name: str, uid: str) -> bool:
        """Whether the object of that name is still the one of ``uid``."""
        try:
            await self._patch_status(
                plural, namespace, name, [{"op": "test", "path": "/metadata/uid", "value": uid}]
            )
        except ApiException as exc:
            if exc.status in (404, 422):
                return False
            raise
        return True

    async def _delete_batch(self, namespace: str, name: str, uid: str) -> None:
        self.metrics.api_write("delete", "actionbatches")
        try:
            await asyncio.to_thread(
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                "actionbatches",
                name,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        except ApiException as exc:
            if exc.status != 404 and not _replaced(exc):
                raise

    # ---- pools --------------------------------------------------------------------------------
    def nodes(self) -> list[NodeSnapshot]:
        out = []
        for bodies in self.node_index.values():
            for body in bodies:
                node = node_snapshot(body)
                if node is not None:
                    out.append(node)
        return out

    def all_hosts(self) -> list[HostObservation]:
        found = [observe_host(b) for bodies in self.host_index.values() for b in bodies]
        return [h for h in found if h is not None]

    async def reconcile_pool(self, body: Mapping[str, Any]) -> None:
        """One round for one pool, status written only when it changed."""
        meta = body.get("metadata") or {}
        if str(meta.get("uid", "")) in self._deleted:
            return  # a round that raced its pool's delete handler would bring back what it removed
        t0 = time.perf_counter()
        status, ops = await self.pools.reconcile(body, self.nodes(), self.all_hosts())
        self.metrics.reconcile.labels("ActionPool").observe(time.perf_counter() - t0)
        key = pool_key(str(meta.get("namespace")), str(meta.get("name")))
        cfg = self.dispatcher.pool_config(str(meta.get("namespace")), str(meta.get("name")))
        if cfg is not None:
            await self.runtime.ensure_network_policy(cfg, self.settings.namespace)
        for op in ops:
            if isinstance(op, Event):
                kopf.event(body, type=op.type, reason=op.reason, message=op.message)
        if str(meta.get("uid", "")) in self._deleted:
            return  # deleted during the round: its series are gone, and stay gone
        self._export_pool(key, status, ops)
        await self._write_if_changed("actionpools", body, status)

    def _export_pool(self, key: str, status: Mapping[str, Any], ops: Iterable[Any]) -> None:
        from arl_tangram.controllers.actionpool import CreateHost, DeleteHost

        m = self.metrics
        m.queue_depth.labels(key).set(status.get("queueDepth", 0))
        m.units.labels(key, "busy").set(status.get("coresBusy", 0))
        m.units.labels(key, "total").set(status.get("coresTotal", 0))
        m.hosts.labels(key, "ready").set(status.get("hostsReady", 0))
        m.hosts.labels(key, "starting").set(status.get("hostsStarting", 0))
        for op in ops:
            if isinstance(op, CreateHost):
                m.scale_events.labels(key, "up").inc()
            elif isinstance(op, DeleteHost):
                m.scale_events.labels(key, "down").inc()
        stats = self.dispatcher.stats(key)
        for us in list(self.dispatcher.decision_us):
            m.decisions.observe(us / 1e6)
        self.dispatcher.decision_us.clear()
        if stats is not None:
            m.hosts.labels(key, "unhealthy").set(len(stats.unhealthy))

    async def reconcile_service(self, body: Mapping[str, Any]) -> None:
        """One round for one RewardModelService, status written only when it changed."""
        uid = str((body.get("metadata") or {}).get("uid", ""))
        if uid in self._deleted:
            # A round that raced its service's delete handler (as a pool's, ``reconcile_pool``) would
            # put it back in the router: its requests would wait for replicas that never come.
            return
        t0 = time.perf_counter()
        nodes = [b for bodies in self.node_index.values() for b in bodies]
        status = await self.services.reconcile(body, nodes, self.replica_index)
        self.metrics.reconcile.labels("RewardModelService").observe(time.perf_counter() - t0)
        if uid in self._deleted:
            return  # deleted during the round: nothing left to write to
        await self._write_if_changed("rewardmodelservices", body, status)

    def service_deleted(self, namespace: str, name: str, uid: str = "") -> None:
        self._tombstone(uid)
        self._written_status.pop(("rewardmodelservices", namespace, name), None)
        self.services.deleted(f"{namespace}/{name}")
        # As a pool's (``pool_deleted``): its last values must not be reported for good.
        self.metrics.forget_service(pool_key(namespace, name), self.dispatcher.has_pool(namespace, name))

    async def pool_deleted(self, namespace: str, name: str, uid: str = "") -> None:
        self._tombstone(uid)
        self._written_status.pop(("actionpools", namespace, name), None)
        await self.pools.deleted(namespace, name, uid)
        # After its actions were ended: a deleted pool's last values must not be reported for good
        # (dashboards, alerts, an autoscaler reading its queue depth), nor its name kept for ever.
        self.metrics.forget_pool(
            pool_key(namespace, name), self.dispatcher.rewards.has(pool_key(namespace, name))
        )

    # ---- HTTP: the gateway (actions, /run_code, rewards, sessions), health, readiness, metrics ----
    def _leadership(self) -> Leadership:
        return Leadership(leader=self.elector.is_leader, leader_address=self.elector.holder)

    async def _serve(self) -> None:
        """The gateway in front of the dispatcher, on one port with health, readiness, metrics and
        the full batch results. A standby serves it too: its readiness says standby (so a Service
        sends trainers to the leader) and its action routes answer 503 naming the leader."""
        auth = None if self.settings.anonymous else KubernetesAuthenticator(self.api)
        app = build_gateway_app(
            self.dispatcher,
            auth,
            config=self.settings.gateway_config(),
            readiness=self._leadership,
            batch_results=self.batches,
            allow_anonymous=self.settings.anonymous,
            metrics=GatewayMetrics(self.metrics.registry),
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # The kernel's largest backlog, as `tangram up`'s gateway: aiohttp's default of 128 made a
        # trainer opening hundreds of connections at once (one per rollout worker's request) wait
        # a SYN retransmit, a second or more, for each connection past it.
        site = web.TCPSite(
            self._runner, self.settings.listen_host, self.settings.listen_port, backlog=socket.SOMAXCONN
        )
        await site.start()
        log.info("gateway on %s:%d", self.settings.listen_host, self.settings.listen_port)
