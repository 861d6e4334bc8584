"""What one tenant (namespace) does to the gateway's shared state must not reach another's."""

from __future__ import annotations

import pytest

from arl_tangram.gateway import abandoned
from arl_tangram.gateway.abandoned import Abandoned
from arl_tangram.gateway.keys import key_namespace, scoped_key


class NothingRuns:
    """A service with no action queued or running: every cancel is of a key not arrived yet."""

    async def cancel(self, key: str) -> bool:
        return False


async def test_cancelling_made_up_keys_does_not_forget_another_namespaces_cancels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``POST /v1/actions:cancel`` keeps the keys of actions not arrived yet (a stream's unread lines)
    to answer them Cancelled. The bound on them was one for all namespaces: a tenant cancelling
    made-up keys pushed out another's, whose abandoned actions then ran."""
    monkeypatch.setattr(abandoned, "CANCELLED_KEPT", 10)
    gateway = Abandoned(NothingRuns())  # type: ignore[arg-type]
    victims = [scoped_key("team-b", "line-7"), scoped_key("team-b", "line-8")]
    for key in victims:
        assert not await gateway.cancel(key)
    for i in range(50):
        await gateway.cancel(scoped_key("team-a", f"junk-{i}"))
    assert all(gateway.cancelled_early(key) for key in victims)
    assert not gateway.cancelled_early(victims[0]), "answered Cancelled once; a later retry runs"
    # The noisy tenant's own are bounded (its oldest forgotten), and keys not scoped by the gateway
    # share a bucket of their own.
    assert not gateway.cancelled_early(scoped_key("team-a", "junk-0"))
    assert gateway.cancelled_early(scoped_key("team-a", "junk-49"))
    assert key_namespace(scoped_key("team-a", "x/y", space="gw-reward")) == "team-a"
    assert key_namespace("3f2c-uid/a1") == ""


async def test_keys_cancelled_early_are_forgotten_once_too_old_to_answer() -> None:
    now = [0.0]
    gateway = Abandoned(NothingRuns(), clock=lambda: now[0])  # type: ignore[arg-type]
    await gateway.cancel(scoped_key("team-a", "old"))
    now[0] = abandoned.CANCELLED_KEPT_S + 1
    await gateway.cancel(scoped_key("team-a", "new"))
    assert not gateway.cancelled_early(scoped_key("team-a", "old"))
    assert gateway.cancelled_early(scoped_key("team-a", "new"))
