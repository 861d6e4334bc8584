"""The trainer's client of ARL-Tangram: the gateway (sync and async) and ActionBatches in a cluster.

>>> with TangramClient("http://tangram-operator.tangram-system:8080", pool="py") as client:
...     result = client.run_code("print(1 + 1)")
...     assert result.ok and result.stdout == "2\\n"
"""

from arl_tangram.client.aio import AsyncSession, AsyncTangramClient, RetryPolicy, code_action
from arl_tangram.client.batch import ActionBatches
from arl_tangram.client.errors import (
    AuthenticationError,
    InvalidRequest,
    NotFoundError,
    Overloaded,
    PermissionDenied,
    ServerError,
    SessionLost,
    TangramClientError,
    Unavailable,
)
from arl_tangram.client.results import ActionResult
from arl_tangram.client.sync import Session, TangramClient

__all__ = [
    "ActionBatches",
    "ActionResult",
    "AsyncSession",
    "AsyncTangramClient",
    "AuthenticationError",
    "InvalidRequest",
    "NotFoundError",
    "Overloaded",
    "PermissionDenied",
    "RetryPolicy",
    "ServerError",
    "Session",
    "SessionLost",
    "TangramClient",
    "TangramClientError",
    "Unavailable",
    "code_action",
]
