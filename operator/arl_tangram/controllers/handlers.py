"""The kopf wiring, and nothing else: every handler is one call into :class:`OperatorState`.

Indexes (pods of sandbox hosts and reward replicas, nodes, ActionPools, RewardModelServices) are kept
by kopf from its watches, so no handler lists anything. kopf's own state (progress, the last handled
spec, the finalizer) lives under ``tangram.arl.dev``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from arl_tangram.api.meta import GROUP, VERSION
from arl_tangram.controllers.errors import adapted
from arl_tangram.controllers.operator import POOL_PERIOD_S, OperatorSettings, OperatorState
from arl_tangram.domain.pools import pool_key
from arl_tangram.runtime.kubernetes import api_message
from arl_tangram.runtime.pods import (
    POOL_LABEL,
    ROLE_LABEL,
    ROLE_REWARD_REPLICA,
    ROLE_SANDBOX_HOST,
    SERVICE_LABEL,
)

POOLS = (GROUP, VERSION, "actionpools")
SERVICES = (GROUP, VERSION, "rewardmodelservices")
BATCHES = (GROUP, VERSION, "actionbatches")


class _DiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled configuration, but none for ActionBatches: no handler of theirs reads a
    diff (they take events as they come), and kopf builds one on every event by deep-copying the
    whole object, thousands of actions and results."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        if body.get("kind") == "ActionBatch":
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None if body.get("kind") == "ActionBatch" else super().fetch(body=body)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = _DiffBase(prefix=GROUP, key="last-handled-configuration")
    # Leadership is ours (a Lease), not kopf's peering objects.
    settings.peering.standalone = True
    # The API server ends watches after its own timeout; ask for 5 minutes so a quiet watch is
    # renewed before any proxy in between drops it, and give the client a margin on top.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Events are posted by the controllers themselves (scaling, rollouts, failures); kopf's own
    # per-handler chatter stays in the log.
    settings.posting.level = logging.WARNING
    state = OperatorState(OperatorSettings.from_env())
    memo["state"] = state
    await state.start()  # a standby waits here until it leads


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState | None = memo.get("state")
    if state is not None:
        await state.stop()


# ---- indexes ---------------------------------------------------------------------------------------
@kopf.index("pods", labels={ROLE_LABEL: ROLE_SANDBOX_HOST})
def host_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[str, kopf.Body]:
    return {pool_key(namespace or "", labels.get(POOL_LABEL, "")): body}


@kopf.index("pods", labels={ROLE_LABEL: ROLE_REWARD_REPLICA})
def reward_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[str, kopf.Body]:
    return {f"{namespace}/{labels.get(SERVICE_LABEL, '')}": body}


@kopf.index("nodes")
def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, kopf.Body]:
    return {name: body}


@kopf.index(*SERVICES)
def services(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[str, kopf.Body]:
    return {f"{namespace}/{name}": body}


@kopf.index(*POOLS)
def pools(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[str, kopf.Body]:
    return {pool_key(namespace or "", name): body}


def _bind(memo: kopf.Memo, indexes: dict[str, Any]) -> OperatorState:
    """The state, looking at kopf's live indexes (passed to handlers by their function names)."""
    state: OperatorState = memo["state"]
    state.keep_event_context()
    host_index = indexes["host_pods"]
    state.host_index, state.node_index, state.pool_index = host_index, indexes["nodes"], indexes["pools"]
    state.runtime.bind(host_index)
    state.replica_index, state.service_index = indexes["reward_pods"], indexes["services"]
    state.runtime.bind_replicas(state.replica_index)
    return state


# ---- ActionPool --------------------------------------------------------------------------------------
@kopf.daemon(*POOLS, id="reconcile", cancellation_timeout=10)
async def pool_loop(
    body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Level-based: one reconcile of the pool every period for as long as it exists."""
    state = _bind(memo, kwargs)
    await _every_period(stopped, logger, "pool", lambda: state.reconcile_pool(body))


async def _every_period(
    stopped: kopf.DaemonStopped, logger: kopf.Logger, what: str, reconcile: Callable[[], Awaitable[None]]
) -> None:
    """Run ``reconcile`` every period until the object goes; one failure never stops the loop."""
    while not stopped:
        try:
            await adapted(reconcile)
        except kopf.TemporaryError as exc:
            logger.warning("%s reconcile: %s (retrying in %ss)", what, exc, exc.delay)
        except ApiException as exc:  # e.g. 403 while the namespace terminates, 409 on a stale write
            logger.warning(
                "%s reconcile: the API server answered %s %s: %s; retrying",
                what,
                exc.status,
                exc.reason,
                api_message(exc),
            )
        except Exception:
            logger.exception("%s reconcile failed; retrying", what)
        await asyncio.sleep(POOL_PERIOD_S)


@kopf.on.delete(*POOLS, id="release", optional=True)
async def pool_deleted(namespace: str | None, name: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    await memo["state"].pool_deleted(namespace or "", name, str(meta.get("uid") or ""))


# ---- RewardModelService ----------------------------------------------------------------------------
@kopf.daemon(*SERVICES, id="reconcile", cancellation_timeout=10)
async def service_loop(
    body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Level-based, as the pools' loop."""
    state = _bind(memo, kwargs)
    await _every_period(stopped, logger, "service", lambda: state.reconcile_service(body))


@kopf.on.delete(*SERVICES, id="release", optional=True)
async def service_deleted(
    namespace: str | None, name: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    memo["state"].service_deleted(namespace or "", name, str(meta.get("uid") or ""))


# ---- ActionBatch ----------------------------------------------------------------------------------
# Straight from the watch's events, with no kopf state on the object: a batch's progress is its
# status, which the BatchManager writes. kopf's create and delete handlers would first add a
# finalizer and then a last-handled-configuration annotation (a copy of the whole spec), two more
# writes of an object that can hold thousands of actions, before and after its first action
# starts. Deletion needs no finalizer either: a batch's actions run in this process, which hears
# the deletion and cancels them; a batch deleted while no operator runs has nothing running here.
@kopf.on.event(*BATCHES, id="run")
async def batch_event(
    type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = _bind(memo, kwargs)
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    if type == "DELETED" or meta.get("deletionTimestamp"):
        # (A batch left with the finalizer earlier operators put on batches loses it to kopf, which
        # takes its finalizer off objects no handler needs it for.)
        await state.batches.forget(namespace, name, str(meta.get("uid") or ""))
        return
    state.batches.ensure(body)
