"""What every part of the node runner shares: the JSON shape of API objects and the API's time formats."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

Json = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class StartError(Exception):
    """A container could not be started (reported as terminated, exit code 128, reason StartError)."""


class ConfigError(Exception):
    """A container's config (ConfigMap, Secret) is missing: kubelet waits, CreateContainerConfigError."""
