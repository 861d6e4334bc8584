"""A pool with no host and none coming (no node can hold one, its container cannot start, hosts
failing in a row: the controller's ``pool_outage``): the dispatcher refuses what waits for a host
with the outage's message and when to send it again, instead of holding it until its caller gives
up; what a host it still has can run (a session pinned to a draining host) runs on. Against a real
sandbox agent on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from dispatch_harness import NS, pool_for_tests
from dispatch_harness import endpoint as _endpoint
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.controllers.actionbatch import BatchManager
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.domain.actions import ActionRequest, Outage, Outcome, Reason
from arl_tangram.errors import TargetUnavailable

KEY = f"{NS}/py"
OUTAGE = Outage(f"pool {KEY} has no host: host py-1 cannot start: container agent: ImagePullBackOff", 7.0)


def _req(key: str, code: str, session: str | None = None) -> ActionRequest:
    return ActionRequest(
        key=key,
        namespace=NS,
        target="py",
        kind="code",
        payload={"runtime": "python", "code": code},
        session=session,
    )


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("host") / "work")
    yield running
    stop_agent(running)


@pytest.fixture
async def dispatcher() -> AsyncIterator[Dispatcher]:
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(pool_for_tests())
    await d.sync_hosts(KEY, [])  # known, and no host yet
    yield d
    await d.shutdown()
    await client.close()


async def test_waiting_actions_are_refused_with_the_reason_and_sent_again_later(
    dispatcher: Dispatcher, agent: Agent
) -> None:
    waiting = [asyncio.create_task(dispatcher.run(_req(f"w-{i}", f"print({i})"))) for i in range(3)]
    for _ in range(100):  # each is queued on the loop's next turns
        await asyncio.sleep(0.01)
    stats = dispatcher.stats(KEY)
    assert stats is not None and stats.queued_actions == 3
    dispatcher.set_outage(KEY, OUTAGE)
    for task in waiting:
        with pytest.raises(TargetUnavailable) as refused:
            await asyncio.wait_for(task, 10)
        assert str(refused.value) == OUTAGE.message and refused.value.delay == 7.0
    assert not dispatcher.scheduler.queued()  # none left queued (the refused count as demand)
    # One sent meanwhile is refused at once.
    with pytest.raises(TargetUnavailable, match="ImagePullBackOff"):
        await asyncio.wait_for(dispatcher.run(_req("w-0", "print(0)")), 10)
    # A host comes: the outage ends and the same keys run (nothing ran under them before).
    dispatcher.set_outage(KEY, None)
    await dispatcher.sync_hosts(KEY, [_endpoint(agent, "py-2")])
    outcomes = await asyncio.gather(*(dispatcher.run(_req(f"w-{i}", f"print({i})")) for i in range(3)))
    assert [(o.state, o.stdout, o.host) for o in outcomes] == [
        (Outcome.SUCCEEDED, f"{i}\n", "py-2") for i in range(3)
    ]


async def test_a_session_pinned_to_a_draining_host_runs_on_through_an_outage(
    dispatcher: Dispatcher, agent: Agent
) -> None:
    await dispatcher.sync_hosts(KEY, [_endpoint(agent, "py-0")])
    first = await dispatcher.run(_req("s-1", "open('state', 'w').write('kept')", session="traj"))
    assert first.state is Outcome.SUCCEEDED and first.host == "py-0"
    # Its host drains (a rollout to a template whose image cannot be pulled): no host is ready.
    await dispatcher.sync_hosts(KEY, [_endpoint(agent, "py-0", draining=True)])
    dispatcher.set_outage(KEY, OUTAGE)
    second = await asyncio.wait_for(
        dispatcher.run(_req("s-2", "print(open('state').read())", session="traj")), 30
    )
    assert (second.state, second.stdout, second.host) == (Outcome.SUCCEEDED, "kept\n", "py-0")
    with pytest.raises(TargetUnavailable):
        await asyncio.wait_for(dispatcher.run(_req("fresh", "print(1)")), 10)
    with pytest.raises(TargetUnavailable):  # a new session has no host to go to either
        await asyncio.wait_for(dispatcher.run(_req("n-1", "print(1)", session="new")), 10)


async def test_a_long_session_backlog_is_refused_whole(dispatcher: Dispatcher) -> None:
    """A session's actions queue behind its first: all are refused at the outage, each with the
    reason (one by one, each the next one's queueing, they overflowed the stack at a few hundred)."""
    calls = [
        asyncio.create_task(dispatcher.run(_req(f"b-{i}", f"print({i})", session="long")))
        for i in range(1200)
    ]
    for _ in range(100):
        await asyncio.sleep(0.01)
    dispatcher.set_outage(KEY, OUTAGE)
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
    assert all(isinstance(r, TargetUnavailable) for r in results), {type(r).__name__ for r in results}
    assert not dispatcher.scheduler.queued()  # none left queued (the refused count as demand)


async def test_bad_input_is_refused_as_such_and_nothing_is_counted_as_arriving(
    dispatcher: Dispatcher,
) -> None:
    dispatcher.set_outage(KEY, OUTAGE)
    outcome = await dispatcher.run(dataclasses.replace(_req("big", "print(1)"), units_min=64, units_max=64))
    assert outcome.reason is Reason.CAPACITY_EXCEEDED  # the caller's to fix: not "send again later"
    before = dispatcher.stats(KEY)
    for i in range(50):
        with pytest.raises(TargetUnavailable):
            await dispatcher.run(_req(f"again-{i}", "print(1)"))
    after = dispatcher.stats(KEY)
    assert before is not None and after is not None
    assert after.arrival_rate_per_s == before.arrival_rate_per_s  # refusals are no demand


async def test_a_lost_or_closed_session_is_answered_as_such_during_an_outage(
    dispatcher: Dispatcher, agent: Agent
) -> None:
    """``SessionLost`` is its answer, outage or not: told to send again later, a caller would send
    the same call to a session that can never come back, for as long as the outage lasts."""
    await dispatcher.sync_hosts(KEY, [_endpoint(agent, "py-0")])
    session = await dispatcher.open_session(NS, "py")
    await dispatcher.run(_req("c-1", "print(1)", session=session))
    await dispatcher.close_session(NS, "py", session)
    await dispatcher.sync_hosts(KEY, [])
    dispatcher.set_outage(KEY, OUTAGE)
    outcome = await asyncio.wait_for(dispatcher.run(_req("c-2", "print(2)", session=session)), 10)
    assert outcome.reason is Reason.SESSION_LOST, outcome


async def test_refused_callers_stay_demand_while_the_outage_lasts(dispatcher: Dispatcher) -> None:
    """The planner's "no room" (what the outage may rest on) needs something waiting: refused
    callers, who send again after Retry-After, count as waiting actions meanwhile."""
    dispatcher.set_outage(KEY, OUTAGE)
    with pytest.raises(TargetUnavailable):
        await dispatcher.run(dataclasses.replace(_req("d-1", "print(1)"), units_min=2, units_max=2))
    stats = dispatcher.stats(KEY)
    assert stats is not None and (stats.queued_actions, stats.queued_units, stats.waiting_trajectories) == (
        1,
        2,
        1,
    )
    dispatcher.set_outage(KEY, None)
    stats = dispatcher.stats(KEY)
    assert stats is not None and (stats.queued_actions, stats.queued_units) == (0, 0)


async def test_every_refused_action_counts_in_the_queue_once_while_the_outage_lasts() -> None:
    """A pool's queueDepth during an outage says how much work waits for it: each action refused
    (a batch's held action, a gateway caller) counts once, however often it is sent again, until
    two of its Retry-After pass without it being sent again (its caller gave up)."""
    now = [1000.0]  # the dispatcher's clock, moved by hand: what lapses is the refusals' window
    client = AgentClient()
    dispatcher = Dispatcher(client, clock=lambda: now[0])
    dispatcher.upsert_pool(pool_for_tests())
    await dispatcher.sync_hosts(KEY, [])
    try:
        waiting = [asyncio.create_task(dispatcher.run(_req(f"q-{i}", f"print({i})"))) for i in range(2)]
        for _ in range(100):  # each is queued on the loop's next turns
            await asyncio.sleep(0.01)
        dispatcher.set_outage(KEY, OUTAGE)  # the two queued are refused
        for task in waiting:
            with pytest.raises(TargetUnavailable):
                await asyncio.wait_for(task, 10)
        for key in ("f-1", "f-2", "q-0", "f-1"):  # two fresh ones; two sent again
            with pytest.raises(TargetUnavailable):
                await dispatcher.run(dataclasses.replace(_req(key, "print(1)"), units_min=2, units_max=2))
        stats = dispatcher.stats(KEY)
        assert stats is not None
        # q-1 needs 1 unit; q-0 (sent again asking 2), f-1 and f-2 need 2 each.
        assert (stats.queued_actions, stats.queued_units, stats.waiting_trajectories) == (4, 7, 1)
        # Sent again within two Retry-After, an action stays counted; one not sent again is not.
        now[0] += OUTAGE.retry_after_s * 1.5
        with pytest.raises(TargetUnavailable):
            await dispatcher.run(_req("f-2", "print(1)"))
        now[0] += OUTAGE.retry_after_s * 1.5
        stats = dispatcher.stats(KEY)
        assert stats is not None and (stats.queued_actions, stats.queued_units) == (1, 1)
    finally:
        await dispatcher.shutdown()
        await client.close()


async def test_the_refused_counted_are_bounded_by_the_pools_wait_limit() -> None:
    """Keyless callers sending again get a new key each time: the refused counted (and the memory
    that counts them) stop at the pool's wait limit, as its queue does."""
    client = AgentClient()
    dispatcher = Dispatcher(client, max_waiting_per_pool=3)
    dispatcher.upsert_pool(pool_for_tests())
    await dispatcher.sync_hosts(KEY, [])
    dispatcher.set_outage(KEY, OUTAGE)
    try:
        for i in range(5):
            with pytest.raises(TargetUnavailable):
                await dispatcher.run(_req(f"new-{i}", "print(1)"))
        stats = dispatcher.stats(KEY)
        assert stats is not None and stats.queued_actions == 3
    finally:
        await dispatcher.shutdown()
        await client.close()


async def test_a_batch_waiting_out_the_outage_shows_in_its_pool_queue(dispatcher: Dispatcher) -> None:
    """The operator's batch manager holds a refused action and sends it again after Retry-After:
    each of a batch's actions it holds counts in the pool's queue (its status's queueDepth), not
    one for them all."""

    async def languages(namespace: str, pool: str) -> tuple[str, ...] | None:
        return ("python", "bash")

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        pass

    async def delete(namespace: str, name: str, uid: str) -> None:
        pass

    dispatcher.set_outage(KEY, OUTAGE)
    batches = BatchManager(dispatcher.run, dispatcher.cancel, languages, patch, delete)
    actions = [{"id": f"a{i}", "type": "code", "target": "py", "payload": {"code": "1"}} for i in range(5)]
    batches.ensure(
        {
            "metadata": {"namespace": NS, "name": "b", "uid": "u-1", "generation": 1},
            "spec": {"actions": actions},
        }
    )
    try:
        for _ in range(1000):  # each is sent, refused and held on the loop's next turns
            stats = dispatcher.stats(KEY)
            assert stats is not None
            if stats.queued_actions == 5:
                break
            await asyncio.sleep(0.01)
        assert stats.queued_actions == 5
    finally:
        await batches.forget(NS, "b", "u-1")
