# mypy: disable-error-code="arg-type,no-untyped-call,attr-defined"
# The kubernetes client's stubs type request bodies as models; this file passes plain dicts.
"""What a pod worker asks of the API server for its pod: ConfigMaps and Secrets, service-account
tokens, status patches and the final deletion."""

from __future__ import annotations

import base64
import logging
from typing import Literal

from kubernetes import client
from kubernetes.client.rest import ApiException

from .api import MERGE_PATCH, ConfigError, Json

log = logging.getLogger("node-runner")


class PodApi:
    """The API calls of one pod's worker (namespace, name and uid fixed)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str, uid: str) -> None:
        self.core, self.ns, self.name, self.uid = core, namespace, name, uid

    def lookup(self, kind: str, name: str, optional: bool) -> dict[str, str] | None:
        """A ConfigMap's or Secret's data (podspec.Lookup): None when missing and optional."""
        try:
            if kind == "configMap":
                return dict(self.core.read_namespaced_config_map(name, self.ns).data or {})
            data = self.core.read_namespaced_secret(name, self.ns).data or {}
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        except ApiException as exc:
            if exc.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind} "{name}" not found') from exc
            raise

    def token(self, service_account: str, audience: str | None, expiration_s: int) -> str:
        """A token bound to this pod (TokenRequest), as the kubelet fills projected volumes."""
        body = {
            "spec": {
                "audiences": [audience] if audience else None,
                "expirationSeconds": expiration_s,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
            }
        }
        tr = self.core.create_namespaced_service_account_token(service_account, self.ns, body)
        if tr.status is None or not tr.status.token:
            raise ConfigError(f"no token for service account {self.ns}/{service_account}")
        return str(tr.status.token)

    def patch_status(self, status: Json) -> Literal["sent", "gone", "failed"]:
        """Patches the pod's status: "gone" when the pod no longer exists, "failed" (logged) when the
        API server refused it otherwise, so that the next report tries again."""
        try:
            self.core.patch_namespaced_pod_status(
                self.name, self.ns, {"status": status}, _content_type=MERGE_PATCH
            )
        except ApiException as exc:
            if exc.status == 404:
                return "gone"
            log.warning("pod %s/%s: status update failed: %s", self.ns, self.name, exc.reason)
            return "failed"
        return "sent"

    def delete_final(self) -> None:
        """The kubelet's last word: delete the object for good, only if it is still this pod."""
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
        )
        try:
            self.core.delete_namespaced_pod(self.name, self.ns, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
