"""Where the client's bearer token comes from.

In order: the ``token`` argument (a string, or a callable returning one, for tokens that rotate);
``TANGRAM_TOKEN``; the file named by ``TANGRAM_TOKEN_FILE``; the projected ServiceAccount token at
:data:`PROJECTED_TOKEN_PATH` (inside a pod that mounts one for the gateway's audience, see
docs/gateway.md). A token file is read again whenever it changes, because the kubelet rotates
projected tokens. The pod's default token (audience: the API server) is not used: the gateway
refuses tokens minted for another audience.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

PROJECTED_TOKEN_PATH = Path("/var/run/secrets/tangram/token")
NAMESPACE_PATH = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

TokenSource = str | Callable[[], str | None] | None


class FileToken:
    """A token read from a file, re-read when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._token: str | None = None

    def __call__(self) -> str | None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return None
        if mtime != self._mtime:
            self._token = self.path.read_text().strip() or None
            self._mtime = mtime
        return self._token


def token_source(token: TokenSource) -> Callable[[], str | None]:
    """A callable giving the current token (or None: send no credentials)."""
    if callable(token):
        return token
    if token is not None:
        return lambda: token
    if os.environ.get("TANGRAM_TOKEN"):
        value = os.environ["TANGRAM_TOKEN"]
        return lambda: value
    if os.environ.get("TANGRAM_TOKEN_FILE"):
        return FileToken(Path(os.environ["TANGRAM_TOKEN_FILE"]))
    if PROJECTED_TOKEN_PATH.exists():
        return FileToken(PROJECTED_TOKEN_PATH)
    return lambda: None


def pod_namespace() -> str | None:
    """The namespace of the pod this runs in, when it runs in one."""
    try:
        return NAMESPACE_PATH.read_text().strip() or None
    except OSError:
        return None
