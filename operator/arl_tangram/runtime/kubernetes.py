# mypy: disable-error-code="arg-type"
# The kubernetes client types request bodies as models; plain dicts are valid JSON for the same calls.
"""The Kubernetes runtime: sandbox hosts are pods the operator creates, owns and deletes itself.

Observations come from a kopf index of the operator's pods (no list calls); changes are single API
calls made off the event loop (the kubernetes client blocks). Every write is counted by verb and
resource for the metrics and the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from arl_tangram.domain.pools import HostRejected, PoolConfig
from arl_tangram.domain.services import ServiceConfig
from arl_tangram.runtime.interface import HostObservation
from arl_tangram.runtime.pods import (
    DRAINING_ANNOTATION,
    host_pod,
    network_policy,
    observe_host,
    observe_replica,
    reward_pod,
    services_configmap,
)

log = logging.getLogger(__name__)

WriteCounter = Callable[[str, str], None]
# How long a resize is waited for before the action runs anyway (measured on the test bed:
# 20-45 ms from the patch to the status showing it).
RESIZE_WAIT_S = 5.0
# Answers to a pod create that are not a refusal of the pod itself: a request timed out, a name
# already taken (a retried create), the API server throttling. Every other 4xx is the pod refused.
_NOT_A_REFUSAL = frozenset({408, 409, 429})


def api_message(exc: ApiException) -> str:
    """What the API server said, as a person reads it: its Status's message (which names the field
    or the admission rule), else the HTTP reason."""
    try:
        found = json.loads(exc.body or "")
    except (TypeError, ValueError):
        found = None
    message = found.get("message") if isinstance(found, dict) else None
    return str(message) if message else f"{exc.reason}"


def _path(loc: tuple[int | str, ...]) -> str:
    # A location opens with the body's position among the client call's arguments.
    return ".".join(str(p) for p in (loc[1:] if loc and isinstance(loc[0], int) else loc))


def _refusal(exc: ValidationError) -> str:
    """A pod the kubernetes client itself cannot send (a podSpec field of the wrong shape), as a
    message naming the field(s), in the client's spelling."""
    parts = [f"{_path(e['loc'])}: {e['msg']}" for e in exc.errors()[:3]]
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return f"the host pod built from spec.template is not a valid Pod: {'; '.join(parts)}{more}"


class KubernetesRuntime:
    """Hosts as pods. ``index`` maps a pool key to the bodies of its pods (a kopf index)."""

    def __init__(self, api: client.ApiClient, count_write: WriteCounter | None = None) -> None:
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self._policies: dict[str, str] = {}  # pool key -> template hash its policy was written for
        self._resize_unsupported: dict[str, str] = {}
        self._resize_target: dict[str, int] = {}  # host -> the CPU last asked for
        self._configmaps: dict[str, str] = {}
        self._replica_index: Mapping[str, Iterable[Mapping[str, Any]]] = {}
        self._index: Mapping[str, Iterable[Mapping[str, Any]]] = {}
        self._count = count_write or (lambda verb, resource: None)

    def bind(self, index: Mapping[str, Iterable[Mapping[str, Any]]]) -> None:
        """Use this (live) index of host pods for observations."""
        self._index = index

    def hosts(self, pool_key: str) -> list[HostObservation]:
        return _observed(self._index.get(pool_key, ()), observe_host)

    async def _create_pod(self, namespace: str, body: dict[str, Any]) -> None:
        self._count("create", "pods")
        try:
            await asyncio.to_thread(self.core.create_namespaced_pod, namespace, body)
        except ApiException as exc:
            if exc.status != 409:  # already there: a retried create
                raise

    async def _delete_pod(self, namespace: str, name: str) -> None:
        self._count("delete", "pods")
        try:
            await asyncio.to_thread(self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=5)
        except ApiException as exc:
            if exc.status != 404:  # gone already
                raise

    async def _create_or_patch(
        self, resource: str, create: Callable[..., Any], patch: Callable[..., Any], body: dict[str, Any]
    ) -> None:
        """Create a namespaced object, or patch it to ``body`` when it exists."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            self._count("create", resource)
            await asyncio.to_thread(create, namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self._count("patch", resource)
            await asyncio.to_thread(patch, name, namespace, body)

    async def create_host(self, pool: PoolConfig, name: str, node: str | None) -> None:
        """Create the host's pod; ``HostRejected`` with the API server's answer (or the client's,
        for a body it cannot send) when the pod itself is refused."""
        try:
            await self._create_pod(pool.namespace, host_pod(pool, name, node))
        except ApiException as exc:
            if exc.status is None or not 400 <= exc.status < 500 or exc.status in _NOT_A_REFUSAL:
                raise
            raise HostRejected(exc.status, api_message(exc)) from exc
        except ValidationError as exc:
            raise HostRejected(None, _refusal(exc)) from exc

    async def resize_host(self, pool: PoolConfig, name: str, cpu_millicores: int) -> bool:
        """Patch the pod's ``resize`` subresource and wait (on the index) until it is enacted."""
        if self._resize_unsupported.get(pool.key):
            return False
        cpu = f"{cpu_millicores}m"
        self._resize_target[name] = cpu_millicores
        patch = {
            "spec": {
                "containers": [
                    {"name": "agent", "resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}}
                ]
            }
        }
        self._count("patch", "pods/resize")
        try:
            await asyncio.to_thread(self.core.patch_namespaced_pod_resize, name, pool.namespace, patch)
        except ApiException as exc:
            if exc.status in (403, 404, 405, 422) and "not found" not in str(exc.body).lower():
                log.warning("pool %s: in-place resize refused (%s): cores stay fixed", pool.key, exc.reason)
                self._resize_unsupported[pool.key] = (
                    f"the cluster refused an in-place resize: {exc.status} {exc.reason}"
                )
                return False
            raise
        deadline = asyncio.get_running_loop().time() + RESIZE_WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            host = next((h for h in self.hosts(pool.key) if h.name == name), None)
            if host is None or host.phase in ("failed", "terminating"):
                return False
            if host.cpu_applied_millicores == cpu_millicores:
                return True
            if self._resize_target.get(name) != cpu_millicores:
                return True  # a later resize of the same host superseded this one
            await asyncio.sleep(0.02)  # the index follows the pod's watch; nothing to wait on directly
        # Not enacted in time: the node may be full for now (the kubelet defers the resize until
        # room frees). The action runs on the cores it was granted; the next resize tries again.
        log.info(
            "pool %s: resize of %s to %s not enacted within %g s; running anyway",
            pool.key,
            name,
            cpu,
            RESIZE_WAIT_S,
        )
        return False

    def resize_refusal(self, pool_key: str) -> str | None:
        """Why in-place resize does not work for this pool, when it does not."""
        return self._resize_unsupported.get(pool_key)

    async def set_draining(self, pool: PoolConfig, name: str, draining: bool) -> None:
        patch = {"metadata": {"annotations": {DRAINING_ANNOTATION: "true" if draining else None}}}
        self._count("patch", "pods")
        try:
            await asyncio.to_thread(self.core.patch_namespaced_pod, name, pool.namespace, patch)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def delete_host(self, pool: PoolConfig, name: str) -> None:
        await self._delete_pod(pool.namespace, name)

    async def ensure_network_policy(self, pool: PoolConfig, operator_namespace: str) -> None:
        """Create or update the pool's NetworkPolicy (once per change of the pool's template)."""
        if self._policies.get(pool.key) == pool.template_hash:
            return
        await self._create_or_patch(
            "networkpolicies",
            self.networking.create_namespaced_network_policy,
            self.networking.patch_namespaced_network_policy,
            network_policy(pool, operator_namespace),
        )
        self._policies[pool.key] = pool.template_hash

    async def create_replica(self, svc: ServiceConfig, name: str, device: str) -> None:
        await self._create_pod(svc.namespace, reward_pod(svc, name, device))

    async def delete_replica(self, svc: ServiceConfig, name: str) -> None:
        await self._delete_pod(svc.namespace, name)

    async def ensure_services_file(self, svc: ServiceConfig) -> None:
        """Create or update the ConfigMap holding the replicas' services file (once per change)."""
        if self._configmaps.get(svc.key) == svc.template_hash:
            return
        await self._create_or_patch(
            "configmaps",
            self.core.create_namespaced_config_map,
            self.core.patch_namespaced_config_map,
            services_configmap(svc),
        )
        self._configmaps[svc.key] = svc.template_hash

    def bind_replicas(self, index: Mapping[str, Iterable[Mapping[str, Any]]]) -> None:
        self._replica_index = index

    def replicas(self, service_key: str) -> list[HostObservation]:
        return _observed(self._replica_index.get(service_key, ()), observe_replica)


def _observed(
    bodies: Iterable[Mapping[str, Any]], observe: Callable[[Mapping[str, Any]], HostObservation | None]
) -> list[HostObservation]:
    """Observations of the pods an index holds, oldest first."""
    found = [observe(body) for body in bodies]
    return sorted((h for h in found if h is not None), key=lambda h: (h.created_at, h.name))
