# mypy: disable-error-code="arg-type,union-attr"
# The kubernetes client types bodies as models and every field as optional; plain dicts are valid
# JSON for the same calls, and a Lease read back always has its spec and metadata.
"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Expiry is judged on this process's own clock: a candidate notes when it last saw the lease's record
change and takes over only when it has not changed for ``lease_s`` (no trust in other machines'
clocks). The holder renews every ``renew_s``; if it cannot renew for ``lease_s`` it must stop
leading before a standby may take over, so it calls ``on_lost`` (the operator exits and restarts
as a standby).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

# Takeover within 15 s of the leader's death: the lease lapses after 10 s, a standby retries every 2 s.
LEASE_S = 10
RENEW_S = 2.0
RETRY_S = 2.0


def _micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """One candidate for the lease ``namespace/name``, identified by ``identity`` (the pod name)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        lease_s: int = LEASE_S,
        renew_s: float = RENEW_S,
        retry_s: float = RETRY_S,
        count_write: Callable[[str, str], None] | None = None,
    ) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_s, self.renew_s, self.retry_s = lease_s, renew_s, retry_s
        self.holder: str | None = None
        self.is_leader = False
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0
        self._count = count_write or (lambda verb, resource: None)
        # A thread of its own: on the shared default executor a renewal waits behind the operator's
        # other blocking calls, and under load (1,000s of actions) the lease lapsed while the leader
        # was alive (found by tests/reliability's load run).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")

    def _body(self, transitions: int, acquire: str | None) -> dict[str, Any]:
        now = _micro_time(datetime.now(UTC))
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.lease_s,
                "acquireTime": acquire or now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    def _try_once(self) -> bool:
        """One attempt to take or renew the lease (blocking; run it in a thread)."""
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._count("create", "leases")
            try:
                self.coord.create_namespaced_lease(self.namespace, self._body(0, None))
            except ApiException as create_exc:
                if create_exc.status == 409:  # another candidate created it first
                    return False
                raise
            self.holder = self.identity
            return True
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time, spec.lease_transitions)
        now = time.monotonic()
        if record != self._seen:
            self._seen, self._seen_at = record, now
        self.holder = spec.holder_identity
        mine = spec.holder_identity == self.identity
        lapsed = not spec.holder_identity or now - self._seen_at > (
            spec.lease_duration_seconds or self.lease_s
        )
        if not mine and not lapsed:
            return False
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        acquire = _micro_time(spec.acquire_time) if mine and spec.acquire_time else None
        body = self._body(transitions, acquire)
        body["metadata"]["resourceVersion"] = lease.metadata.resource_version
        self._count("update", "leases")
        try:
            self.coord.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # someone else wrote it between our read and write
                return False
            raise
        self.holder = self.identity
        return True

    async def acquire(self) -> None:
        """Wait until this candidate leads."""
        while True:
            try:
                if await asyncio.get_running_loop().run_in_executor(self._thread, self._try_once):
                    self.is_leader = True
                    log.info("leading: lease %s/%s held by %s", self.namespace, self.name, self.identity)
                    return
            except Exception as exc:  # the API server may be restarting: keep trying
                log.warning("lease %s/%s not readable: %s", self.namespace, self.name, exc)
            await asyncio.sleep(self.retry_s)

    async def hold(self, on_lost: Callable[[], None]) -> None:
        """Renew while leading; call ``on_lost`` once renewal has failed for a whole lease term."""
        last_ok = time.monotonic()
        while self.is_leader:
            await asyncio.sleep(self.renew_s)
            try:
                if await asyncio.get_running_loop().run_in_executor(self._thread, self._try_once):
                    last_ok = time.monotonic()
                    continue
                log.error("lease %s/%s taken by %s", self.namespace, self.name, self.holder)
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
                if time.monotonic() - last_ok < self.lease_s - self.renew_s:
                    continue
            self.is_leader = False
            on_lost()
            return

    async def release(self) -> None:
        """Give the lease up at a clean stop, so a standby takes over at once."""
        if not self.is_leader:
            return
        self.is_leader = False

        def _release() -> None:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            body = self._body(lease.spec.lease_transitions or 0, None)
            body["spec"]["holderIdentity"] = None
            body["spec"]["leaseDurationSeconds"] = 1
            body["metadata"]["resourceVersion"] = lease.metadata.resource_version
            self._count("update", "leases")
            self.coord.replace_namespaced_lease(self.name, self.namespace, body)

        try:
            await asyncio.to_thread(_release)
        except Exception as exc:
            log.warning("lease not released (it lapses by itself): %s", exc)
