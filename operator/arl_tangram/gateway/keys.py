"""The dispatcher's keys for callers' idempotency keys, and back: one format, both ways."""

from __future__ import annotations

import uuid

# The key spaces the gateway scopes keys in: a caller's own, and those it derives for a reward
# request's samples (``KEY/i``), which no caller's key can reach.
SPACES = ("gw", "gw-reward")


def scoped_key(namespace: str, key: str | None, space: str = "gw") -> str:
    """The dispatcher's key for a caller's key: scoped by namespace, so that two tenants who pick the
    same key never share an action; a fresh one when the caller gave none. ``space`` keeps keys the
    gateway derives (a reward request's samples: ``gw-reward``) apart from any a caller could send."""
    return f"{space}/{namespace}/{key or uuid.uuid4().hex}"


def unscoped_key(key: str) -> str:
    """The caller's key in a dispatcher key made by ``scoped_key`` (any other key as it is)."""
    space, _, rest = key.partition("/")
    return rest.partition("/")[2] if space in SPACES and "/" in rest else key


def key_namespace(key: str) -> str:
    """The namespace a dispatcher key made by ``scoped_key`` is scoped to ("" for any other key)."""
    space, _, rest = key.partition("/")
    return rest.partition("/")[0] if space in SPACES and "/" in rest else ""
