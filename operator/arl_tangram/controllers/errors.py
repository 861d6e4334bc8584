"""The one adapter from the domain's errors to kopf's and to a Ready=False condition's reason."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import kopf

from arl_tangram.controllers.conditions import ConditionReason
from arl_tangram.errors import InfrastructureError, InvalidSpec, NotFound, NotReady, TangramError

T = TypeVar("T")

# Transient platform failures (an API call refused, a host unreachable) are retried after this long.
INFRA_RETRY_DELAY_S = 5.0


def reason_of(exc: BaseException) -> ConditionReason:
    """The condition reason a domain error shows as."""
    if isinstance(exc, InvalidSpec):
        return ConditionReason.INVALID_SPEC
    if isinstance(exc, NotReady):
        return ConditionReason.HOSTS_STARTING
    return ConditionReason.HOSTS_FAILED


def to_kopf(exc: BaseException) -> BaseException:
    """``InvalidSpec`` is permanent (retrying cannot help); not-yet and platform failures are temporary."""
    if isinstance(exc, InvalidSpec | NotFound):
        return kopf.PermanentError(str(exc))
    if isinstance(exc, NotReady):
        return kopf.TemporaryError(str(exc), delay=exc.delay)
    if isinstance(exc, InfrastructureError | TangramError):
        return kopf.TemporaryError(str(exc), delay=INFRA_RETRY_DELAY_S)
    return exc


async def adapted(call: Callable[[], Awaitable[T]]) -> T:
    """Run ``call`` with the domain's errors turned into kopf's."""
    try:
        return await call()
    except TangramError as exc:
        raise to_kopf(exc) from exc
