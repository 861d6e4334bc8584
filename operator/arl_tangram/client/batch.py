# mypy: disable-error-code="no-untyped-call"
# The kubernetes client is untyped; its calls here pass and return plain dicts (JSON).
"""ActionBatches from inside a cluster: create one, wait for it by watch, read its results (the
compact ones from status, and every output whole from the gateway's results endpoint).

Inside a pod it uses the pod's ServiceAccount (in-cluster config) and namespace; elsewhere the
kubeconfig. The kubernetes client is blocking: the async methods run it in a thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

from arl_tangram.api.actionbatch import ActionBatchSpec
from arl_tangram.client.errors import NotFoundError, TangramClientError
from arl_tangram.client.tokens import pod_namespace

GROUP, VERSION, PLURAL = "tangram.arl.dev", "v1alpha1", "actionbatches"


def finished(batch: Mapping[str, Any]) -> bool:
    """Whether every action of the batch has ended (Complete, or Failed with nothing left)."""
    status = batch.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions", [])}
    if conditions.get("Complete") == "True":
        return True
    counts = status.get("counts") or {}
    return conditions.get("Failed") == "True" and counts.get("pending", 1) + counts.get("running", 1) == 0


class ActionBatches:
    """ActionBatches in one namespace. ``api_client`` defaults to the in-cluster or kubeconfig one."""

    def __init__(self, namespace: str | None = None, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.namespace = namespace or pod_namespace() or "default"
        self.api = client.CustomObjectsApi(api_client)

    def create(
        self,
        actions: Iterable[Mapping[str, Any]],
        *,
        name: str | None = None,
        generate_name: str = "batch-",
        retry_policy: Mapping[str, Any] | None = None,
        ttl_seconds_after_finished: int | None = None,
    ) -> dict[str, Any]:
        """Create a batch; its spec is checked by the API's own model first (errors name the field)."""
        spec: dict[str, Any] = {"actions": [dict(a) for a in actions]}
        if retry_policy is not None:
            spec["retryPolicy"] = dict(retry_policy)
        if ttl_seconds_after_finished is not None:
            spec["ttlSecondsAfterFinished"] = ttl_seconds_after_finished
        ActionBatchSpec.model_validate(spec)
        metadata = {"name": name} if name else {"generateName": generate_name}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ActionBatch", "metadata": metadata, "spec": spec}
        created = self.api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        return cast(dict[str, Any], created)

    def get(self, name: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            batch = self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                raise NotFoundError(f"no ActionBatch {self.namespace}/{name}", 404) from exc
            raise
        return cast(dict[str, Any], batch)

    def wait(self, name: str, timeout_s: float = 3600.0) -> dict[str, Any]:
        """The batch once it has finished, watched (list, then watch from its resourceVersion)."""
        from kubernetes import watch

        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.get(name)
            if finished(batch):
                return batch
            left = deadline - time.monotonic()
            if left <= 0:
                raise TangramClientError(
                    f"ActionBatch {self.namespace}/{name} did not finish in {timeout_s:g} s"
                )
            w = watch.Watch()
            for event in w.stream(
                self.api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                field_selector=f"metadata.name={name}",
                resource_version=batch["metadata"]["resourceVersion"],
                # The server ends the watch after this; the loop then lists again (and sees a
                # deletion as NotFound) rather than trusting a silent connection.
                timeout_seconds=max(1, min(int(left), 60)),
            ):
                obj = event["object"]
                if event["type"] == "DELETED":
                    raise NotFoundError(f"ActionBatch {self.namespace}/{name} was deleted", 404)
                if finished(obj):
                    w.stop()
                    return dict(obj)

    def results(self, name: str) -> list[dict[str, Any]]:
        """The compact per-action results in the batch's status."""
        return list((self.get(name).get("status") or {}).get("results", []))

    def full_results(self, name: str, gateway_url: str, **client_kwargs: Any) -> Iterator[dict[str, Any]]:
        """Every result with its whole output, from the gateway's results endpoint."""
        from arl_tangram.client.sync import TangramClient

        with TangramClient(gateway_url, namespace=self.namespace, **client_kwargs) as client:
            yield from client.batch_results(name, self.namespace)

    async def acreate(self, actions: Iterable[Mapping[str, Any]], **kwargs: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.create, list(actions), **kwargs)

    async def await_finished(self, name: str, timeout_s: float = 3600.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait, name, timeout_s)
