"""The dispatcher against real sandbox agents on loopback: grants become calls with exact cores,
program failures are outcomes, infrastructure failures are retried elsewhere, sessions keep order,
cancellation kills, and a new dispatcher (an operator restart) re-attaches instead of re-running."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import requests
from aiohttp import web
from dispatch_harness import NS
from dispatch_harness import endpoint as _endpoint
from dispatch_harness import pool_for_tests as _pool
from sandbox_agent_harness import Agent, processes_of, start_agent, stop_agent, wait_until

from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import (
    BOOK_AHEAD_RUNS,
    DECISIONS_KEPT,
    Dispatcher,
    HostEndpoint,
    agent_key,
)
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.errors import InfrastructureError, NotFound, NotReady, QueueFull


def _req(key: str, code: str, *, runtime: str = "python", **kw: object) -> ActionRequest:
    return ActionRequest(
        key=key,
        namespace=NS,
        target="py",
        kind=kw.pop("kind", "code"),  # type: ignore[arg-type]
        payload={"runtime": runtime, "code": code},
        backoff_s=0.05,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
async def dispatcher(agents: list[Agent]) -> AsyncIterator[Dispatcher]:
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    await d.sync_hosts(
        f"{NS}/py", [_endpoint(a, f"host-{i}") for i, a in enumerate(agents) if a.proc.poll() is None]
    )
    yield d
    await client.close()


async def test_actions_run_with_granted_cores_and_program_failures_are_not_retried(
    dispatcher: Dispatcher,
) -> None:
    reqs = [_req(f"ok-{i}", f"print({i} * 7)") for i in range(12)]
    bad = _req("bad", "import sys; print('partial'); sys.exit(3)")
    outcomes = await asyncio.gather(*(dispatcher.run(r) for r in [*reqs, bad]))
    for i, out in enumerate(outcomes[:-1]):
        assert out.state is Outcome.SUCCEEDED, out
        assert out.stdout.strip() == str(i * 7)
        assert out.attempts == 1 and len(out.cores) == 1 and out.host in ("host-0", "host-1")
    failed = outcomes[-1]
    assert failed.state is Outcome.FAILED and failed.reason is Reason.NON_ZERO_EXIT
    assert failed.exit_code == 3 and failed.attempts == 1 and "partial" in failed.stdout
    stats = dispatcher.stats(f"{NS}/py")
    assert stats is not None and stats.queued_actions == 0 and stats.running_actions == 0


async def test_elastic_test_actions_get_several_cores_and_a_pass_fraction(dispatcher: Dispatcher) -> None:
    code = "import os; print(len(os.sched_getaffinity(0)), os.environ['TANGRAM_DOP'])"
    out = await dispatcher.run(_req("wide", code, kind="test", units_min=1, units_max=2))
    assert out.state is Outcome.SUCCEEDED
    assert len(out.cores) in (1, 2) and out.stdout.split() == [str(len(out.cores))] * 2
    assert out.reward == 1.0


async def test_a_session_runs_its_actions_in_order_on_one_host(dispatcher: Dispatcher) -> None:
    steps = [
        _req(f"s-{i}", f"open('log.txt', 'a').write('{i}'); print(open('log.txt').read())", session="traj-1")
        for i in range(4)
    ]
    outcomes = await asyncio.gather(*(dispatcher.run(r) for r in steps))
    assert [o.stdout.strip() for o in outcomes] == ["0", "01", "012", "0123"]
    assert len({o.host for o in outcomes}) == 1


async def test_a_closed_session_is_not_silently_recreated_empty(dispatcher: Dispatcher) -> None:
    first = await dispatcher.run(_req("c-0", "open('f', 'w').write('x')", session="closing"))
    assert first.state is Outcome.SUCCEEDED
    await dispatcher.close_session(NS, "py", "closing")
    again = await dispatcher.run(_req("c-1", "print(open('f').read())", session="closing"))
    assert again.state is Outcome.FAILED and again.reason is Reason.SESSION_LOST
    assert "closing" in (again.message or "") and "closed" in (again.message or "")


async def test_a_session_keeps_its_own_ttl_on_the_agent(dispatcher: Dispatcher, agents: list[Agent]) -> None:
    """A session opened for two hours on a pool whose sessions last one: the agent kept it for
    the pool's TTL (2 x pool + 60 s), so it lost the session's state while the gateway, holding it
    open for the two hours, answered that it was still there."""
    name = await dispatcher.open_session(NS, "py", 7200.0)
    done = await dispatcher.run(_req("ttl-0", "open('kept', 'w').write('x')", session=name))
    assert done.state is Outcome.SUCCEEDED, done
    where = next(a for a, i in zip(agents, range(2), strict=True) if done.host == f"host-{i}")
    agent_id = dispatcher._pools[f"{NS}/py"].sessions[name].agent_id  # the agent's name for it
    async with aiohttp.ClientSession() as http, http.get(f"{where.url}/v1/sessions/{agent_id}") as resp:
        seen = await resp.json()
    # Behind the dispatcher's own clock for it (2 x 7200 + 60 s, a backstop behind the gateway's).
    assert seen["ttl_s"] > 2 * 7200.0 + 60, seen


async def test_a_repeat_whose_stored_answer_fails_to_read_once_is_not_run_again(
    dispatcher: Dispatcher, agents: list[Agent]
) -> None:
    """A repeat of a finished key is answered from its host's stored result; one read of it that
    failed (a timeout, a reset: injected here, as no real network fails on cue) ran the action
    again. The read is tried again while the host is there."""
    first = await dispatcher.run(_req("reread", "import random; print(random.random())"))
    real, failed = dispatcher.agent.result, []

    async def flaky(address: str, key: str, wait_s: float) -> dict[str, object] | None:
        if not failed:
            failed.append(key)
            raise InfrastructureError("GET of the stored answer timed out (injected)")
        return await real(address, key, wait_s)

    dispatcher.agent.result = flaky  # type: ignore[method-assign]
    try:
        again = await dispatcher.run(_req("reread", "import random; print(random.random())"))
    finally:
        dispatcher.agent.result = real  # type: ignore[method-assign]
    assert failed and (again.stdout, again.attempts) == (first.stdout, first.attempts), (first, again)


async def test_unknown_pool_is_refused_by_name(dispatcher: Dispatcher) -> None:
    with pytest.raises(NotFound, match="nope"):
        await dispatcher.run(ActionRequest("k", NS, "nope", "code", {"runtime": "python", "code": "1"}))


async def test_a_pool_its_owner_learns_on_demand_holds_the_action_until_hosts_come(
    agents: list[Agent],
) -> None:
    """Just after an operator start or failover a request may name a pool the dispatcher has not been
    given yet: ``learn`` (the operator's watch) adds it, and the action waits for the pool's hosts
    instead of failing PoolNotFound. A name ``learn`` does not know is still refused by name."""
    client = AgentClient()
    d = Dispatcher(client)
    asked: list[tuple[str, str, str]] = []

    async def learn(kind: str, namespace: str, name: str) -> None:
        asked.append((kind, namespace, name))
        await asyncio.sleep(0)  # the operator's may read the API server
        if kind == "ActionPool" and name == "py":
            d.upsert_pool(_pool())

    d.learn = learn
    try:
        waiting = asyncio.create_task(d.run(_req("late-1", "print(6 * 7)")))
        await asyncio.sleep(0.2)
        assert not waiting.done() and asked == [("ActionPool", NS, "py")]
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        out = await asyncio.wait_for(waiting, 60)
        assert out.state is Outcome.SUCCEEDED and out.stdout.strip() == "42", out
        with pytest.raises(NotFound, match="nope"):
            await d.open_session(NS, "nope")
        with pytest.raises(NotFound, match="judge"):
            await d.run(ActionRequest("r", NS, "judge", "reward", {"prompt": "p", "response": "r"}))
        assert asked[1:] == [("ActionPool", NS, "nope"), ("RewardModelService", NS, "judge")]
    finally:
        await client.close()


async def test_one_key_sent_twice_while_its_pool_is_looked_up_runs_once(agents: list[Agent]) -> None:
    """The pool lookup may wait on the API server (the operator's ``learn``): a request repeated
    with the same key meanwhile (a client's retry) joins the first instead of running again."""
    client = AgentClient()
    starts: list[tuple[str, int]] = []
    d = Dispatcher(client, on_started=lambda key, attempt: starts.append((key, attempt)))

    async def learn(kind: str, namespace: str, name: str) -> None:
        await asyncio.sleep(0.2)
        d.upsert_pool(_pool())

    d.learn = learn
    try:
        code = "import os, time; print(os.getpid(), time.time_ns())"
        both = asyncio.gather(d.run(_req("twice", code)), d.run(_req("twice", code)))
        await asyncio.sleep(0.5)
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        first, second = await asyncio.wait_for(both, 60)
        assert first.state is Outcome.SUCCEEDED and first.stdout and first.stdout == second.stdout
        assert starts == [("twice", 1)]
    finally:
        await client.close()


async def test_a_caller_going_away_leaves_the_action_to_the_others_waiting_for_it(
    dispatcher: Dispatcher,
) -> None:
    """Cancelling one caller's ``run`` (its client left) cancels that caller's wait only: the
    action runs on, and a repeat of its key gets its outcome, as it ran once."""
    code = "import time; time.sleep(0.5); print(time.time_ns())"
    gone = asyncio.create_task(dispatcher.run(_req("left", code)))
    await _wait(lambda: (s := dispatcher.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    stays = asyncio.create_task(dispatcher.run(_req("left", code)))
    await asyncio.sleep(0.05)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    out = await asyncio.wait_for(stays, 30)
    assert out.state is Outcome.SUCCEEDED and out.attempts == 1 and out.stdout.strip().isdigit()
    again = await dispatcher.run(_req("left", code))  # after its end: the same run's outcome
    assert again.stdout == out.stdout


async def test_an_action_whose_every_caller_left_is_let_go_when_it_ends(dispatcher: Dispatcher) -> None:
    """The dispatcher holds a job (its request, payload and outcome) only while it runs: one whose
    callers all went away is dropped when it ends, not kept for as long as the process runs."""
    gone = asyncio.create_task(dispatcher.run(_req("all-left", "import time; time.sleep(0.3); print(1)")))
    await _wait(lambda: (s := dispatcher.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    gone.cancel()
    await _wait(lambda: (s := dispatcher.stats(f"{NS}/py")) is not None and s.running_actions == 0)
    await _wait(lambda: "all-left" not in dispatcher._jobs)  # the table itself is the point


async def test_a_caller_gone_while_the_pools_hosts_are_not_yet_known_leaves_a_job_that_runs(
    agents: list[Agent],
) -> None:
    """Just after a start, a pool's hosts are not known yet and an action waits for them. If its
    caller goes away meanwhile, a repeat of its key (the client's retry) must still get it run,
    not wait for ever on a job that nothing would start."""
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    try:
        code = "print('ran once')"
        first = asyncio.create_task(d.run(_req("early", code)))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = asyncio.create_task(d.run(_req("early", code)))
        await asyncio.sleep(0.1)
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        out = await asyncio.wait_for(retry, 30)
        assert out.state is Outcome.SUCCEEDED and out.stdout == "ran once\n" and out.attempts == 1
    finally:
        await d.shutdown()
        await client.close()


async def test_actions_waiting_for_the_pools_first_hosts_count_as_waiting(agents: list[Agent]) -> None:
    """Before a pool's hosts are first known (just after a start) its actions wait like queued ones:
    in its queue statistics and against its waiting limit, and no longer once they are cancelled
    or started."""
    client = AgentClient()
    d = Dispatcher(client, max_waiting_per_pool=2)
    d.upsert_pool(_pool())
    try:
        early = [asyncio.create_task(d.run(_req(f"early-{i}", "print(1)"))) for i in range(2)]
        await asyncio.sleep(0.05)
        stats = d.stats(f"{NS}/py")
        assert stats is not None and stats.queued_actions == 2
        with pytest.raises(QueueFull):
            await d.run(_req("one-too-many", "print(1)"))
        assert await d.cancel("early-0")
        await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.queued_actions == 1)
        later = asyncio.create_task(d.run(_req("later", "print(2)")))
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        outs = await asyncio.wait_for(asyncio.gather(early[1], later), 30)
        assert [o.stdout for o in outs] == ["1\n", "2\n"]
        assert (await early[0]).state is Outcome.CANCELLED
        stats = d.stats(f"{NS}/py")
        assert stats is not None and stats.queued_actions == 0
        assert d._tenant_waiting.get(_req("x", "").tenant_name, 0) == 0
    finally:
        await d.shutdown()
        await client.close()


async def test_deleting_a_pool_fails_its_running_action_and_removes_the_pool(agents: list[Agent]) -> None:
    """A deleted pool's running action ends PoolNotFound (not retried on the pool), the pool goes,
    and an action sent to it afterwards is refused by name instead of waiting for ever."""
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    try:
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        running = asyncio.create_task(d.run(_req("doomed", "import time; time.sleep(5)")))
        await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 1)
        await d.remove_pool(f"{NS}/py")
        out = await asyncio.wait_for(running, 10)
        assert out.reason is Reason.POOL_NOT_FOUND, out
        assert not d.has_pool(NS, "py")
        with pytest.raises(NotFound):
            await asyncio.wait_for(d.run(_req("after", "print(1)")), 10)
    finally:
        # The pool's pods would go with it; here the agent lives on: stop what it still runs.
        await client.cancel(f"127.0.0.1:{agents[0].port}", agent_key("doomed", 1))
        await d.shutdown()
        await client.close()


@contextlib.asynccontextmanager
async def _deleting(
    agents: list[Agent], key: str
) -> AsyncIterator[tuple[Dispatcher, asyncio.Task[ActionOutcome], asyncio.Task[None]]]:
    """A dispatcher whose pool is being deleted, its action ``key`` running on host-0 being stopped:
    the dispatcher, that action's run, and the deletion (both under way)."""
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    try:
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
        running = asyncio.create_task(d.run(_req(key, "import time; time.sleep(5)")))
        await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 1)
        remover = asyncio.create_task(d.remove_pool(f"{NS}/py"))
        await asyncio.sleep(0)
        assert not remover.done(), "the deletion is under way: its running action is being stopped"
        yield d, running, remover
    finally:
        # The pool's pods would go with it; here the agent lives on: stop what it still runs.
        await client.cancel(f"127.0.0.1:{agents[0].port}", agent_key(key, 1))
        await d.shutdown()
        await client.close()


async def test_an_action_sent_while_a_pool_is_being_deleted_is_refused(agents: list[Agent]) -> None:
    """Deleting a pool stops its running actions first (awaits); an action or session asked for
    meanwhile is refused by name, as after the deletion, instead of waiting on a pool that goes."""
    async with _deleting(agents, "doomed-2") as (d, running, remover):
        late = asyncio.create_task(d.run(_req("late", "print(1)")))
        with pytest.raises(NotFound):
            await asyncio.wait_for(d.open_session(NS, "py"), 10)
        await asyncio.wait_for(remover, 10)
        with pytest.raises(NotFound):
            await asyncio.wait_for(late, 10)
        assert (await asyncio.wait_for(running, 10)).reason is Reason.POOL_NOT_FOUND
        assert not d.has_pool(NS, "py")


async def test_a_pool_made_again_while_its_old_self_is_deleted_takes_its_actions(
    agents: list[Agent],
) -> None:
    """A pool deleted and made again under its name at once (nothing holds the name while it goes):
    the new one takes the name when the old one's actions are stopped, and an action sent in
    between runs on it rather than being refused."""
    async with _deleting(agents, "doomed-3") as (d, running, remover):
        again = dataclasses.replace(_pool(), uid="uid-2")
        d.upsert_pool(again)
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[1], "host-1")])  # the old one's: ignored
        meanwhile = asyncio.create_task(d.run(_req("meanwhile", "print('new pool')")))
        assert await asyncio.wait_for(d.find_pool_config(NS, "py"), 10) == again
        await asyncio.wait_for(remover, 10)
        assert (await asyncio.wait_for(running, 10)).reason is Reason.POOL_NOT_FOUND
        stats = d.stats(f"{NS}/py")
        assert stats is not None and stats.cores_total == 0 and stats.queued_actions == 1
        await d.sync_hosts(f"{NS}/py", [_endpoint(agents[1], "host-1")])
        out = await asyncio.wait_for(meanwhile, 30)
        assert out.state is Outcome.SUCCEEDED and out.stdout == "new pool\n" and out.host == "host-1"


async def test_a_pool_made_again_and_deleted_while_its_old_self_goes_does_not_come_back() -> None:
    """Deleted (uid-1), made again (uid-2) and deleted again while uid-1's actions are still being
    stopped: neither is there afterwards (uid-2 came back, with nothing left to give it hosts, and
    took actions that waited for ever); a delete of uid-1 sent again leaves uid-2 made. A caller
    waiting for the name while the dispatcher shuts down is told to send again."""
    gate = asyncio.Event()

    class _SlowToLose(Dispatcher):
        async def _lose_host(self, pool: object, name: str) -> None:  # type: ignore[override]
            await gate.wait()  # the removal under way, as long as the test needs

    for second_delete, made in (("uid-2", False), ("", False), ("uid-1", True)):
        gate.clear()
        d = _SlowToLose(AgentClient())
        d.upsert_pool(dataclasses.replace(_pool(), uid="uid-1"))
        d._pools[f"{NS}/py"].endpoints["host-0"] = HostEndpoint("host-0", "127.0.0.1:9", (0,), 1 << 30)
        remover = asyncio.create_task(d.remove_pool(f"{NS}/py", "uid-1"))
        await asyncio.sleep(0)
        d.upsert_pool(dataclasses.replace(_pool(), uid="uid-2"))
        await d.remove_pool(f"{NS}/py", second_delete)
        gate.set()
        await asyncio.wait_for(remover, 10)
        config = d.pool_config(NS, "py")
        assert (config is not None and config.uid == "uid-2") == made, second_delete
        if not made:
            with pytest.raises(NotFound):
                await asyncio.wait_for(d.run(_req("late", "print(1)")), 10)
        await d.shutdown()

    gate.clear()
    d = _SlowToLose(AgentClient())
    d.upsert_pool(_pool())
    d._pools[f"{NS}/py"].endpoints["host-0"] = HostEndpoint("host-0", "127.0.0.1:9", (0,), 1 << 30)
    remover = asyncio.create_task(d.remove_pool(f"{NS}/py"))
    await asyncio.sleep(0)
    d.upsert_pool(dataclasses.replace(_pool(), uid="uid-2"))
    waiting = asyncio.create_task(d.run(_req("waiting", "print(1)")))
    await asyncio.sleep(0.05)
    await d.shutdown()
    gate.set()
    await asyncio.wait_for(remover, 10)
    with pytest.raises(NotReady):
        await asyncio.wait_for(waiting, 10)
    assert not d._jobs


async def test_a_cancelled_action_stops_counting_as_waiting_at_once() -> None:
    """An action cancelled while its pool's first hosts are not known yet frees its place in the
    waiting limit when ``cancel`` returns, as a queued one does."""
    d = Dispatcher(AgentClient(), max_waiting_per_pool=1)
    d.upsert_pool(_pool())
    try:
        first = asyncio.create_task(d.run(_req("first", "print(1)")))
        await asyncio.sleep(0.05)
        assert await d.cancel("first")
        second = asyncio.create_task(d.run(_req("second", "print(2)")))
        await asyncio.sleep(0.05)
        assert not second.done(), "it waits for the hosts (not refused QueueFull)"
        assert (await first).state is Outcome.CANCELLED
    finally:
        await d.shutdown()


def test_a_dispatchers_decision_times_are_bounded() -> None:
    """The operator's dispatcher decides at least once per action for as long as it runs: it keeps
    the latest decision times, not one per decision ever made."""
    d = Dispatcher(AgentClient())
    for _ in range(DECISIONS_KEPT + 100):
        d.scheduler.schedule(0.0)
    assert len(d.scheduler.stats.samples_us) == DECISIONS_KEPT


async def test_cancelling_a_running_action_kills_it(dispatcher: Dispatcher, agents: list[Agent]) -> None:
    task = asyncio.create_task(dispatcher.run(_req("sleepy", "sleep 60", runtime="bash")))
    await _wait(lambda: (s := dispatcher.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    assert await dispatcher.cancel("sleepy")
    out = await asyncio.wait_for(task, 10)
    assert out.state is Outcome.CANCELLED
    for a in agents:
        wait_until(
            lambda a=a: not any("sleep" in _cmdline(p) for p in processes_of(a.uids)), 10, "sleep gone"
        )


async def test_a_new_dispatcher_reattaches_to_a_running_attempt_instead_of_running_it_again(
    agents: list[Agent],
) -> None:
    """Actions cannot write outside their workdir, so the agents' own counts of the actions they
    ran are the side effect that proves the action ran once."""
    code = "import time; time.sleep(1.5); print('done')"
    before = _actions_run(agents)
    first_client, second_client = AgentClient(), AgentClient()
    first = Dispatcher(first_client)
    first.upsert_pool(_pool())
    hosts = [_endpoint(a, f"host-{i}") for i, a in enumerate(agents) if a.proc.poll() is None]
    await first.sync_hosts(f"{NS}/py", hosts)
    running = asyncio.create_task(first.run(_req("once", code)))
    await _wait(lambda: (s := first.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    # The operator dies: nothing of its memory survives but the attempt count in the batch status.
    await first.shutdown()
    await first_client.close()
    assert running.cancelled() or running.done()
    second = Dispatcher(second_client)
    second.upsert_pool(_pool())
    await second.sync_hosts(f"{NS}/py", hosts)
    out = await second.run(_req("once", code), attempts_so_far=1)
    await second_client.close()
    assert out.state is Outcome.SUCCEEDED and out.stdout.strip() == "done"
    assert out.attempts == 1
    assert _actions_run(agents) == before + 1, "the action ran twice (or not at all)"


async def test_an_attempt_the_status_never_recorded_is_still_found_and_not_run_again(
    agents: list[Agent],
) -> None:
    """The operator died after dispatching but before the batch status said Running: the new one
    starts from attempt 0 and must still find attempt 1 on whichever host runs it."""
    code = "import time; time.sleep(1.5); print('once')"
    before = _actions_run(agents)
    hosts = [_endpoint(a, f"host-{i}") for i, a in enumerate(agents) if a.proc.poll() is None]
    first_client, second_client = AgentClient(), AgentClient()
    first = Dispatcher(first_client)
    first.upsert_pool(_pool())
    await first.sync_hosts(f"{NS}/py", hosts)
    running = asyncio.create_task(first.run(_req("unrecorded", code)))
    await _wait(lambda: (s := first.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    await first.shutdown()
    await first_client.close()
    assert running.done()
    second = Dispatcher(second_client)
    second.upsert_pool(_pool())
    # Many hosts' worth of chances to put it elsewhere: list the idle host first.
    await second.sync_hosts(f"{NS}/py", list(reversed(hosts)))
    out = await second.run(_req("unrecorded", code), attempts_so_far=0)
    await second_client.close()
    assert out.state is Outcome.SUCCEEDED and out.stdout.strip() == "once" and out.attempts == 1
    assert _actions_run(agents) == before + 1, "the action ran twice"


async def _orphaned(
    agents: list[Agent], key: str, seconds: float
) -> tuple[Dispatcher, AgentClient, list[HostEndpoint]]:
    """An operator dies with an attempt of ``key`` running; a new one (returned, with its client and
    the hosts) finds it on its hosts, and no job claims it (its batch was deleted meanwhile)."""
    hosts = [_endpoint(a, f"host-{i}") for i, a in enumerate(agents) if a.proc.poll() is None]
    first_client, second_client = AgentClient(), AgentClient()
    first = Dispatcher(first_client)
    first.upsert_pool(_pool())
    await first.sync_hosts(f"{NS}/py", hosts)
    running = asyncio.create_task(first.run(_req(key, f"import time; time.sleep({seconds})")))
    await _wait(lambda: (s := first.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    await first.shutdown()
    await first_client.close()
    assert running.done()
    second = Dispatcher(second_client)
    second.upsert_pool(_pool())
    await second.sync_hosts(f"{NS}/py", hosts)
    return second, second_client, hosts


async def test_an_attempt_nobody_reattaches_to_keeps_its_cores_booked_until_it_ends(
    agents: list[Agent],
) -> None:
    """An attempt whose batch was deleted while no operator ran is claimed by no job: its cores
    were counted free, and an action granted them waited on its agent behind it, up to the pool's
    timeout. They stay booked while it runs, and come back when it ends."""
    second, second_client, _ = await _orphaned(agents, "orphan", 3)
    pool = second._pools[f"{NS}/py"]

    def free() -> int:
        return sum(h.free_cores for h in pool.cpu.hosts.values())

    total = sum(h.cores for h in pool.cpu.hosts.values())
    try:
        assert free() == total - 1 and len(pool.orphans) == 1
        await _wait(lambda: free() == total)
        assert pool.orphans == {}
    finally:
        await second.shutdown()
        await second_client.close()


@pytest.mark.parametrize("gone", ["host", "pool"])
async def test_a_host_or_pool_lost_while_an_unclaimed_attempt_runs_there_goes_cleanly(
    agents: list[Agent], gone: str
) -> None:
    """The booked cores of an attempt nobody claims are given back when its host goes: kept, the
    host could not be removed (its cores not all free), every later sync failed on it, and the pool
    got no new host; deleting the pool failed alike."""
    second, second_client, hosts = await _orphaned(agents, f"orphan-{gone}", 2)
    try:
        assert len(second._pools[f"{NS}/py"].orphans) == 1
        if gone == "host":
            await second.sync_hosts(f"{NS}/py", [])
            await second.sync_hosts(f"{NS}/py", hosts)  # hosts come (back): they are taken
            assert second._pools[f"{NS}/py"].cpu.hosts.keys() == {h.name for h in hosts}
        else:
            await second.remove_pool(f"{NS}/py")
            assert f"{NS}/py" not in second._pools
    finally:
        await second.shutdown()
        await second_client.close()
    await asyncio.sleep(2.5)  # the attempt ends on its agent before the next test's


def _actions_run(agents: list[Agent]) -> int:
    total = 0
    for a in agents:
        if a.proc.poll() is None:
            total += sum(requests.get(a.url + "/v1/health", timeout=10).json()["outcomes"].values())
    return total


@pytest.mark.parametrize(
    "answer",
    [
        web.Response(text="<html>not an agent</html>", content_type="text/html"),
        # What a reused pod address answered in the reliability suite: not the agent's own 404.
        web.json_response({}, status=404),
    ],
    ids=["html", "404"],
)
async def test_a_garbage_answer_is_an_infrastructure_failure_retried_elsewhere(
    agents: list[Agent], answer: web.Response
) -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=answer.body, status=answer.status, content_type=answer.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", garbage)
    runner, port = await _serve(app)
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    good = _endpoint(agents[0], "good")
    bad_host = HostEndpoint("bad", f"127.0.0.1:{port}", (0, 1), 4 << 30)
    # The garbage host lists no actions, so the scan of new hosts must not reject it first.
    d.agent.inflight = _no_inflight  # type: ignore[method-assign]
    await d.sync_hosts(f"{NS}/py", [bad_host, good])
    outcomes = await asyncio.gather(
        *(d.run(_req(f"g-{i}", "print('fine')", max_retries=3)) for i in range(6))
    )
    await client.close()
    await runner.cleanup()
    assert all(o.state is Outcome.SUCCEEDED and o.host == "good" for o in outcomes), outcomes
    assert any(o.attempts > 1 for o in outcomes), "no action was sent to the garbage host first"


async def test_an_agent_without_run_jupyter_refuses_the_notebook_and_is_not_taken_for_failing() -> None:
    """A pool whose image predates ``/run_jupyter`` answers it with aiohttp's own 404 (text). Taken
    for a failing host, every notebook sent there was retried and counted against its hosts. The
    older agent is stood in by an HTTP server with no routes: no older image can be run here."""
    runner, port = await _serve(web.Application())
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    d.agent.inflight = _no_inflight  # type: ignore[method-assign]
    await d.sync_hosts(f"{NS}/py", [HostEndpoint("old", f"127.0.0.1:{port}", (0, 1), 4 << 30)])
    notebook = {"cells": ["print(1)"]}
    outcomes = [
        await d.run(
            ActionRequest(
                key=f"nb-{i}", namespace=NS, target="py", kind="code", payload=notebook, wire="run_jupyter"
            )
        )
        for i in range(4)  # more than the failures in a row that mark a host unhealthy
    ]
    stats = d.stats(f"{NS}/py")
    await client.close()
    await runner.cleanup()
    for outcome in outcomes:
        assert outcome.state is Outcome.FAILED and outcome.reason is Reason.INVALID_PAYLOAD, outcome
        assert "does not serve /run_jupyter" in (outcome.message or "") and outcome.attempts == 1
    assert stats is not None and set(stats.hosts) == {"old"} and not stats.unhealthy, stats


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` served on a free loopback port: its runner (to clean up) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr,no-any-return]


async def _no_inflight(address: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    return {}, set()


async def test_a_lost_host_fails_its_session_but_retries_plain_actions(tmp_path: Path) -> None:
    doomed = start_agent(tmp_path / "doomed")
    survivor = start_agent(tmp_path / "survivor")
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    await d.sync_hosts(f"{NS}/py", [_endpoint(doomed, "doomed")])
    # Pin a session to the doomed host, then start long actions there.
    first = await d.run(_req("sess-0", "print('state')", session="traj-x"))
    assert first.host == "doomed"
    plain = asyncio.create_task(d.run(_req("plain", "import time; time.sleep(3); print('ok')")))
    in_session = asyncio.create_task(d.run(_req("sess-1", "import time; time.sleep(3)", session="traj-x")))
    await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 2)
    await d.sync_hosts(f"{NS}/py", [_endpoint(survivor, "survivor")])
    doomed.proc.kill()
    plain_out, sess_out = await asyncio.wait_for(asyncio.gather(plain, in_session), 30)
    after = await d.run(_req("sess-2", "print(1)", session="traj-x"))
    await client.close()
    stop_agent(survivor)
    doomed.proc.wait()
    assert plain_out.state is Outcome.SUCCEEDED and plain_out.host == "survivor" and plain_out.attempts == 2
    assert sess_out.state is Outcome.FAILED and sess_out.reason is Reason.SESSION_LOST
    assert after.state is Outcome.FAILED and after.reason is Reason.SESSION_LOST
    assert "traj-x" in (after.message or "")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


async def _wait(predicate: object, deadline_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not predicate():  # type: ignore[operator]
        if loop.time() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def test_short_actions_book_their_core_for_the_next_one_and_never_share_it(
    agents: list[Agent],
) -> None:
    """Once a pool has measured its actions as short, a core's next action is sent while the one
    before it still runs (the agent queues it until the core is free): no idle round trip between
    them, and still never two actions on one core at once (each program reports when it ran)."""
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
    code = "import time; t0 = time.time(); time.sleep(0.005); print(t0, time.time())"
    warm = await asyncio.gather(*(d.run(_req(f"warm-{i}", code)) for i in range(BOOK_AHEAD_RUNS)))
    assert all(o.state is Outcome.SUCCEEDED for o in warm)
    before = d.booked_ahead
    outs = await asyncio.gather(*(d.run(_req(f"short-{i}", code)) for i in range(40)))
    await client.close()
    assert all(o.state is Outcome.SUCCEEDED and o.attempts == 1 for o in outs), outs
    assert d.booked_ahead > before, "no action was booked behind a running one"
    per_core: dict[int, list[tuple[float, float]]] = {}
    for o in outs:
        assert len(o.cores) == 1
        start, end = map(float, o.stdout.split())
        per_core.setdefault(o.cores[0], []).append((start, end))
    for core, spans in per_core.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"two actions ran on core {core} at once"
    stats = d.stats(f"{NS}/py")
    assert stats is not None and stats.running_actions == 0 and stats.queued_actions == 0


async def test_booking_never_passes_over_a_free_core_and_costs_at_most_one_action_per_core(
    agents: list[Agent],
) -> None:
    """An action the forecast took for short may run long: an action booked behind it waits for it.
    No action is booked while a core is free, and at most one waits behind each long one."""
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    await d.sync_hosts(f"{NS}/py", [_endpoint(agents[0], "host-0")])
    fast = "print('fast')"
    await asyncio.gather(*(d.run(_req(f"w-{i}", fast)) for i in range(BOOK_AHEAD_RUNS)))
    done: list[str] = []

    async def run(key: str, code: str) -> None:
        out = await d.run(_req(key, code))
        assert out.state is Outcome.SUCCEEDED, out
        done.append(key)

    # Alone with a free core beside it: the fast action takes that core, not a booking.
    slow = asyncio.create_task(run("slow-1", "import time; time.sleep(1.5)"))
    await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    await run("fast-1", fast)
    await slow
    assert done == ["fast-1", "slow-1"]
    # Under pressure (more waiting than cores): at most one action is booked behind the slow one.
    done.clear()
    slow = asyncio.create_task(run("slow-2", "import time; time.sleep(1.5)"))
    await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 1)
    await asyncio.gather(slow, *(run(f"f-{i}", fast) for i in range(20)))
    await client.close()
    assert len(done[done.index("slow-2") + 1 :]) <= 1, done


class _Cutter:
    """A proxy in front of a real agent that cuts chosen calls off, as a partition does mid-call: a
    cut call is dropped with no answer, before or after the agent got it. (The connection is real;
    the partition is the proxy's, since cutting loopback itself needs the reliability suite's
    test bed, which runs it too.)"""

    def __init__(self, agent: Agent) -> None:
        self.target = agent.url
        self.cut_execute: str | None = None  # "before" or "after" the agent gets it, once
        self.cut_lookups = 0  # how many of the next result lookups are cut
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.http = aiohttp.ClientSession()

    async def stop(self) -> None:
        await self.http.close()
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        cut = False
        if request.path == "/v1/execute" and self.cut_execute:
            cut, when, self.cut_execute = True, self.cut_execute, None
            if when == "before":
                return self._drop(request)
        elif request.path.startswith("/v1/actions/") and self.cut_lookups:
            self.cut_lookups -= 1
            return self._drop(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.http.request(
            request.method, self.target + request.path_qs, data=await request.read(), headers=headers
        ) as resp:
            body = await resp.read()
            if cut:
                return self._drop(request)
            return web.Response(body=body, status=resp.status, content_type=resp.content_type)

    @staticmethod
    def _drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return web.Response()


async def _cut_setup(agent: Agent) -> tuple[Dispatcher, AgentClient, _Cutter]:
    cutter = _Cutter(agent)
    await cutter.start()
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    host = HostEndpoint("cut", f"127.0.0.1:{cutter.port}", tuple(_endpoint(agent, "x").cores), 4 << 30)
    await d.sync_hosts(f"{NS}/py", [host])
    return d, client, cutter


async def test_a_call_cut_off_after_the_agent_got_it_is_settled_there_not_run_again(
    agents: list[Agent],
) -> None:
    """The answer is lost and the host stays unreachable for a while: the agent is asked by the
    action's key until it answers, and its stored result is the outcome; the host serves again."""
    d, client, cutter = await _cut_setup(agents[0])
    before = _actions_run(agents[:1])
    cutter.cut_execute, cutter.cut_lookups = "after", 2
    out = await d.run(_req("cut-after", "print('ran')", max_retries=3))
    again = await d.run(_req("cut-next", "print('next')"))
    stats = d.stats(f"{NS}/py")
    await client.close()
    await cutter.stop()
    assert out.state is Outcome.SUCCEEDED and out.stdout == "ran\n" and out.attempts == 1, out
    assert again.state is Outcome.SUCCEEDED and again.host == "cut"
    assert _actions_run(agents[:1]) == before + 2, "the cut action ran twice (or not at all)"
    assert stats is not None and not stats.unhealthy


async def test_a_call_cut_off_before_the_agent_got_it_runs_as_a_new_attempt(agents: list[Agent]) -> None:
    d, client, cutter = await _cut_setup(agents[0])
    before = _actions_run(agents[:1])
    cutter.cut_execute = "before"
    out = await d.run(_req("cut-before", "print('ran')", max_retries=3))
    await client.close()
    await cutter.stop()
    assert out.state is Outcome.SUCCEEDED and out.stdout == "ran\n" and out.attempts == 2, out
    assert _actions_run(agents[:1]) == before + 1


async def test_the_agent_client_reads_back_keys_of_any_printable_characters(agents: list[Agent]) -> None:
    """Gateway keys are the caller's printable ASCII: '?', '#', '%' and spaces in one must not
    become a query, a fragment or an escape in the path of ``GET /v1/actions/{key}``."""
    client = AgentClient()
    address = f"127.0.0.1:{agents[0].port}"
    health = await client.health(address)
    core = health["cores"]["ids"][0]
    try:
        for key in ("gw/ns/a b?c=1#d%2Fe", "gw/ns/plain"):
            body, raw = await client.execute(
                address,
                {"code": f"print({key!r})", "language": "python"},
                key=key,
                cores=(core,),
                wire="run_code",
                timeout_s=10,
            )
            assert body["run_result"]["stdout"] == key + "\n"
            assert json.loads(raw) == body
            state, stored = await client.lookup(address, key, 1)
            assert state == "done" and stored == body
            assert not await client.cancel(address, key)
        assert await client.lookup(address, "gw/ns/a b?c=1", 0) == ("unknown", None)
    finally:
        await client.close()


async def test_run_code_sends_the_callers_own_bytes_and_returns_the_agents(agents: list[Agent]) -> None:
    """A door that forwards its caller's body verbatim hands over the bytes it parsed: those are
    what the agent gets (not the payload encoded again), and the agent's answer comes back as it
    was sent, with its parsed form."""
    client = AgentClient()
    address = f"127.0.0.1:{agents[0].port}"
    core = (await client.health(address))["cores"]["ids"][0]
    try:
        sent = b'{ "language" : "python",\n  "code" : "print(6 * 7)" }'
        body, raw = await client.execute(
            address,
            {"code": "print('the payload, encoded again')", "language": "python"},
            key="gw/ns/verbatim",
            cores=(core,),
            wire="run_code",
            timeout_s=10,
            encoded=sent,
        )
        assert body["run_result"]["stdout"] == "42\n"
        state, stored = await client.lookup(address, "gw/ns/verbatim", 1)
        assert state == "done" and stored == body == json.loads(raw)
    finally:
        await client.close()


async def test_a_session_action_waiting_for_a_core_when_its_host_is_lost_is_not_run_on_another(
    tmp_path: Path,
) -> None:
    """The session's next action waits in the queue (its one-core host runs another action) when
    the host dies. It was granted the dead host's core given back while the host was being removed,
    and the removal failed (``sync_hosts`` raised, the host stayed); or, granted another host's, it
    ran there in a new empty session and answered Succeeded while the session was lost."""
    doomed = start_agent(tmp_path / "doomed", "--cores=0")
    survivor = start_agent(tmp_path / "survivor", "--cores=0")
    client = AgentClient()
    try:
        d = Dispatcher(client)
        d.upsert_pool(_pool())
        await d.sync_hosts(f"{NS}/py", [_endpoint(doomed, "doomed")])
        first = await d.run(_req("q-sess-0", "open('state.txt', 'w').write('kept')", session="traj-q"))
        assert first.state is Outcome.SUCCEEDED and first.host == "doomed"
        plain = asyncio.create_task(d.run(_req("q-plain", "import time; time.sleep(3); print('ok')")))
        await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.running_actions == 1)
        code = "print(open('state.txt').read())"
        waiting = asyncio.create_task(d.run(_req("q-sess-1", code, session="traj-q")))
        await _wait(lambda: (s := d.stats(f"{NS}/py")) is not None and s.queued_actions == 1)
        await d.sync_hosts(f"{NS}/py", [_endpoint(survivor, "survivor")])
        doomed.proc.kill()
        plain_out, sess_out = await asyncio.wait_for(asyncio.gather(plain, waiting), 30)
        again = await d.run(_req("q-sess-1", code, session="traj-q"))
    finally:
        await client.close()
        stop_agent(survivor)
        if doomed.proc.poll() is None:
            stop_agent(doomed)
    assert plain_out.state is Outcome.SUCCEEDED and plain_out.host == "survivor"
    assert sess_out.state is Outcome.FAILED and sess_out.reason is Reason.SESSION_LOST, sess_out
    assert "traj-q" in (sess_out.message or "")
    assert again.state is Outcome.FAILED and again.reason is Reason.SESSION_LOST, again
