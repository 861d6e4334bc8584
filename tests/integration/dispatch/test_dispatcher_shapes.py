"""The dispatcher against real sandbox agents on workload shapes its other tests do not send: units
out of range, a wide action among a stream of small ones, many tenants and priority classes,
sessions cancelled or expiring while they wait, agents that stall or cut their answers. After each
case the managers' accounting must be whole again: every core free, nothing held, nothing queued."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
from dispatch_harness import NS
from dispatch_harness import endpoint as _endpoint
from dispatch_harness import pool_for_tests as _pool
from sandbox_agent_harness import Agent

from arl_tangram.core.policies.tangram import TangramPolicy
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher, HostEndpoint
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason

KEY = f"{NS}/py"


def _req(key: str, code: str = "print(1)", **kw: object) -> ActionRequest:
    return ActionRequest(
        key=key,
        namespace=NS,
        target="py",
        kind=kw.pop("kind", "code"),  # type: ignore[arg-type]
        payload={"runtime": "python", "code": code},
        backoff_s=0.05,
        **kw,  # type: ignore[arg-type]
    )


def assert_accounting_whole(d: Dispatcher, key: str = KEY) -> None:
    """Nothing waits or runs in ``key``, and every core of every host is free exactly once."""
    pool = d._pools[key]
    for host in pool.cpu.hosts.values():
        assert host.free_cores == host.cores, (host.name, host.free_cores, host.cores)
        assert sorted(c for node in host.free for c in node) == sorted(c for node in host.numa for c in node)
    assert not pool.holders, pool.holders
    assert pool.waiting == 0 and not pool.before_sync
    assert d.scheduler.queued() == 0 and not d.scheduler.running
    assert all(n == 0 for n in d._tenant_waiting.values()), d._tenant_waiting
    assert not d._jobs, list(d._jobs)


@pytest.fixture
async def dispatcher(agents: list[Agent]) -> AsyncIterator[Dispatcher]:
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())
    await d.sync_hosts(KEY, [_endpoint(a, f"host-{i}") for i, a in enumerate(agents)])
    yield d
    await client.close()


# ---- units out of range ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lo", "hi", "reason", "words"),
    [
        (0, 1, Reason.INVALID_PAYLOAD, "at least 1"),
        (0, 0, Reason.INVALID_PAYLOAD, "at least 1"),
        (2, 1, Reason.INVALID_PAYLOAD, "more than its most"),
        (3, 8, Reason.CAPACITY_EXCEEDED, "grants at most 2"),
        (64, 64, Reason.CAPACITY_EXCEEDED, "grants at most 2"),
    ],
)
async def test_units_no_host_can_grant_are_refused_by_name(
    dispatcher: Dispatcher, lo: int, hi: int, reason: Reason, words: str
) -> None:
    out = await dispatcher.run(_req(f"units-{lo}-{hi}", kind="test", units_min=lo, units_max=hi))
    assert out.state is Outcome.FAILED and out.reason is reason, out
    assert words in (out.message or ""), out.message
    assert_accounting_whole(dispatcher)


async def test_bad_units_behind_a_sessions_running_action_are_answered_and_the_session_goes_on(
    dispatcher: Dispatcher,
) -> None:
    """A session's later action is queued when the one before it ends: refused there, it must still
    be answered, and the session's next action must still run."""
    first = asyncio.create_task(dispatcher.run(_req("sb-0", "import time; time.sleep(0.5)", session="sb")))
    bad = asyncio.create_task(
        dispatcher.run(_req("sb-1", session="sb", kind="test", units_min=0, units_max=1))
    )
    after = asyncio.create_task(dispatcher.run(_req("sb-2", "print('after')", session="sb")))
    outs = await asyncio.wait_for(asyncio.gather(first, bad, after), 60)
    assert outs[0].state is Outcome.SUCCEEDED, outs[0]
    assert outs[1].state is Outcome.FAILED and outs[1].reason is Reason.INVALID_PAYLOAD, outs[1]
    assert outs[2].state is Outcome.SUCCEEDED and outs[2].stdout.strip() == "after", outs[2]
    await dispatcher.close_session(NS, "py", "sb")
    assert_accounting_whole(dispatcher)


async def test_an_elastic_action_wider_than_any_host_runs_on_one_host_within_its_cores(
    dispatcher: Dispatcher,
) -> None:
    code = "import os; print(len(os.sched_getaffinity(0)))"
    outs = await asyncio.gather(
        *(dispatcher.run(_req(f"wide-{i}", code, kind="test", units_min=1, units_max=64)) for i in range(4))
    )
    for out in outs:
        assert out.state is Outcome.SUCCEEDED, out
        assert 1 <= len(out.cores) <= 2 and out.stdout.strip() == str(len(out.cores))
    assert_accounting_whole(dispatcher)


async def test_a_whole_host_action_starts_while_small_ones_keep_arriving(agents: list[Agent]) -> None:
    """One host of 2 cores, a stream of one-core actions, and one action that needs both cores: the
    small ones pass it for at most ``aging_s`` (docs/scheduler.md), then it keeps its place."""
    client = AgentClient()
    d = Dispatcher(client)
    assert isinstance(d.scheduler, TangramPolicy)
    d.scheduler.aging_s = 0.5  # the promise's bound, small enough for a test
    d.upsert_pool(_pool())
    await d.sync_hosts(KEY, [_endpoint(agents[0], "host-0")])
    try:
        started: list[str] = []
        d.on_started = lambda key, attempt: started.append(key)
        big_done = asyncio.Event()
        stream_left = 400

        async def small_stream(lane: int) -> None:
            nonlocal stream_left
            while not big_done.is_set() and stream_left > 0:
                stream_left -= 1
                await d.run(_req(f"small-{lane}-{stream_left}", "import time; time.sleep(0.05)"))

        streams = [asyncio.create_task(small_stream(i)) for i in range(3)]
        await asyncio.sleep(0.3)
        big = await asyncio.wait_for(
            d.run(_req("big", "print('whole')", kind="test", units_min=2, units_max=2)), 120
        )
        big_done.set()
        await asyncio.gather(*streams)
        assert big.state is Outcome.SUCCEEDED and len(big.cores) == 2, big
        assert stream_left > 0, "the wide action started only once the small ones stopped coming"
        assert_accounting_whole(d)
    finally:
        await client.close()


# ---- tenants and priority classes -----------------------------------------------------------------
async def _backlog(d: Dispatcher, reqs: list[ActionRequest]) -> list[ActionOutcome]:
    return await asyncio.wait_for(asyncio.gather(*(d.run(r) for r in reqs)), 120)


async def _one_host(agents: list[Agent], **weights: float) -> tuple[Dispatcher, AgentClient, list[str]]:
    client = AgentClient()
    started: list[str] = []
    d = Dispatcher(client, on_started=lambda key, attempt: started.append(key))
    assert isinstance(d.scheduler, TangramPolicy)
    d.scheduler.weights = dict(weights)
    d.upsert_pool(_pool())
    return d, client, started


async def test_tenants_share_a_saturated_pool_by_their_weights(agents: list[Agent]) -> None:
    """Three tenants of weights 3, 2, 1 with 60 one-core actions each queued at once before any
    host is known: while all three are backlogged, the starts go 3:2:1 (within one action per
    tenant per round of six)."""
    d, client, started = await _one_host(agents, gold=3.0, silver=2.0, bronze=1.0)
    try:
        reqs = [
            _req(f"{t}-{i}", "print(1)", tenant=t) for i in range(60) for t in ("gold", "silver", "bronze")
        ]
        running = asyncio.create_task(_backlog(d, reqs))
        await asyncio.sleep(0.3)  # every request waits for the pool's first host
        await d.sync_hosts(KEY, [_endpoint(agents[0], "host-0")])
        outs = await running
        assert all(o.state is Outcome.SUCCEEDED for o in outs)
        # Bronze's 60 are done last at 1/6 of the rate: look at the first 60 starts, all backlogged.
        window = started[:60]
        counts = {t: sum(k.startswith(t + "-") for k in window) for t in ("gold", "silver", "bronze")}
        assert abs(counts["gold"] - 30) <= 3 and abs(counts["silver"] - 20) <= 3, counts
        assert abs(counts["bronze"] - 10) <= 3, counts
        assert_accounting_whole(d)
    finally:
        await client.close()


async def test_a_tenant_back_from_idle_gets_no_credit_for_its_time_away(agents: list[Agent]) -> None:
    """Tenant ``busy`` runs 40 actions alone, then ``back`` returns with 40 while ``busy`` still has a
    backlog: from then on they alternate (equal weights), ``back`` does not take 40 in a row."""
    d, client, started = await _one_host(agents)
    await d.sync_hosts(KEY, [_endpoint(agents[0], "host-0")])
    try:
        await _backlog(d, [_req(f"busy-a{i}", tenant="busy") for i in range(40)])
        mark = len(started)
        both = [_req(f"busy-b{i}", tenant="busy") for i in range(40)]
        both += [_req(f"back-{i}", tenant="back") for i in range(40)]
        await _backlog(d, both)
        window = started[mark : mark + 40]
        back = sum(k.startswith("back-") for k in window)
        assert abs(back - 20) <= 3, window
        assert_accounting_whole(d)
    finally:
        await client.close()


async def test_no_priority_class_starves_behind_a_busier_one(agents: list[Agent]) -> None:
    """Class-0 actions keep arriving; a class-9 one waits, and starts once it has waited
    ``aging_s`` (it counts as class 0 then), while class-0 ones still come."""
    d, client, _ = await _one_host(agents)
    assert isinstance(d.scheduler, TangramPolicy)
    d.scheduler.aging_s = 0.5
    await d.sync_hosts(KEY, [_endpoint(agents[0], "host-0")])
    try:
        done = asyncio.Event()
        left = 400

        async def urgent(lane: int) -> None:
            nonlocal left
            while not done.is_set() and left > 0:
                left -= 1
                await d.run(_req(f"urgent-{lane}-{left}", "import time; time.sleep(0.05)", priority=0))

        lanes = [asyncio.create_task(urgent(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        low = await asyncio.wait_for(d.run(_req("low", "print('low')", priority=9)), 120)
        done.set()
        await asyncio.gather(*lanes)
        assert low.state is Outcome.SUCCEEDED and left > 0, (low, left)
        assert_accounting_whole(d)
    finally:
        await client.close()


# ---- sessions ---------------------------------------------------------------------------------------
async def test_many_sessions_on_few_hosts_each_keep_their_host_and_order(dispatcher: Dispatcher) -> None:
    async def trajectory(n: int) -> list[ActionOutcome]:
        outs = []
        for step in range(3):
            code = f"open('t', 'a').write('{step}'); print(open('t').read())"
            outs.append(await dispatcher.run(_req(f"m{n}-{step}", code, session=f"many-{n}")))
        return outs

    results = await asyncio.wait_for(asyncio.gather(*(trajectory(n) for n in range(24))), 120)
    for outs in results:
        assert [o.stdout.strip() for o in outs] == ["0", "01", "012"], outs
        assert len({o.host for o in outs}) == 1
    for n in range(24):
        await dispatcher.close_session(NS, "py", f"many-{n}")
    assert_accounting_whole(dispatcher)
    assert all(not h.pinned for h in dispatcher._pools[KEY].cpu.hosts.values())


async def test_a_session_action_asking_more_memory_than_the_pool_allows_is_refused_at_once(
    dispatcher: Dispatcher,
) -> None:
    req = ActionRequest(
        key="mem-big",
        namespace=NS,
        target="py",
        kind="code",
        payload={"runtime": "python", "code": "print(1)", "memory_mb": 64 << 10},
        session="mem",
    )
    out = await asyncio.wait_for(dispatcher.run(req), 30)
    assert out.state is Outcome.FAILED and out.reason is Reason.INVALID_PAYLOAD, out
    assert "memory_mb" in (out.message or "") and "limits.memory" in (out.message or "")
    ok = await dispatcher.run(_req("mem-ok", session="mem"))
    assert ok.state is Outcome.SUCCEEDED, ok
    await dispatcher.close_session(NS, "py", "mem")
    assert_accounting_whole(dispatcher)


async def test_cancelling_a_queued_session_action_lets_the_session_go_on(dispatcher: Dispatcher) -> None:
    """Two hosts of two cores busy with long actions; a session's first action waits for a core and
    is cancelled there. The session's next action must then run, and the session must be closable
    by its TTL (not held busy for ever by the cancelled action)."""
    blockers = [
        asyncio.create_task(dispatcher.run(_req(f"block-{i}", "import time; time.sleep(1.5)")))
        for i in range(4)
    ]
    await asyncio.sleep(0.5)
    queued = asyncio.create_task(dispatcher.run(_req("cq-0", session="cq")))
    await asyncio.sleep(0.1)
    assert await dispatcher.cancel("cq-0")
    out = await queued
    assert out.state is Outcome.CANCELLED, out
    nxt = await asyncio.wait_for(dispatcher.run(_req("cq-1", "print('next')", session="cq")), 60)
    assert nxt.state is Outcome.SUCCEEDED and nxt.stdout.strip() == "next", nxt
    await asyncio.gather(*blockers)
    sess = dispatcher._pools[KEY].sessions["cq"]
    assert not sess.busy and not sess.backlog
    await dispatcher.close_session(NS, "py", "cq")
    assert_accounting_whole(dispatcher)


async def test_cancelling_a_session_action_in_its_backlog_keeps_the_rest_in_order(
    dispatcher: Dispatcher,
) -> None:
    first = asyncio.create_task(
        dispatcher.run(_req("cb-0", "import time; time.sleep(0.5); print(0)", session="cb"))
    )
    second = asyncio.create_task(dispatcher.run(_req("cb-1", "print(1)", session="cb")))
    third = asyncio.create_task(dispatcher.run(_req("cb-2", "print(2)", session="cb")))
    await asyncio.sleep(0.2)
    assert await dispatcher.cancel("cb-1")
    outs = await asyncio.wait_for(asyncio.gather(first, second, third), 60)
    assert [o.state for o in outs] == [Outcome.SUCCEEDED, Outcome.CANCELLED, Outcome.SUCCEEDED], outs
    await dispatcher.close_session(NS, "py", "cb")
    assert_accounting_whole(dispatcher)


async def test_cancelling_a_running_action_returns_its_cores_once(dispatcher: Dispatcher) -> None:
    running = asyncio.create_task(
        dispatcher.run(_req("cr", "import time; time.sleep(30)", kind="test", units_min=2, units_max=2))
    )
    pool = dispatcher._pools[KEY]
    for _ in range(200):
        if pool.holders:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    # Twice at once (a client's retry of its cancel): the cores must still come back once.
    assert all(await asyncio.gather(dispatcher.cancel("cr"), dispatcher.cancel("cr")))
    out = await asyncio.wait_for(running, 30)
    assert out.state is Outcome.CANCELLED, out
    assert_accounting_whole(dispatcher)
    again = await dispatcher.run(_req("after-cr", kind="test", units_min=2, units_max=2))
    assert again.state is Outcome.SUCCEEDED and len(again.cores) == 2
    assert_accounting_whole(dispatcher)


async def test_a_session_waiting_in_the_queue_is_not_expired_under_it(agents: list[Agent]) -> None:
    now = [1000.0]
    client = AgentClient()
    d = Dispatcher(client, clock=lambda: now[0])
    d.upsert_pool(_pool())
    await d.sync_hosts(KEY, [_endpoint(agents[0], "host-0")])
    try:
        blockers = [
            asyncio.create_task(d.run(_req(f"tb-{i}", "import time; time.sleep(1)"))) for i in range(2)
        ]
        await asyncio.sleep(0.3)
        name = await d.open_session(NS, "py", 5.0)
        waiting = asyncio.create_task(d.run(_req("ttl-q", "print('ran')", session=name)))
        await asyncio.sleep(0.1)
        now[0] += 10_000.0  # far past its TTL while its action waits for a core
        await d.expire_sessions()
        out = await asyncio.wait_for(waiting, 30)
        assert out.state is Outcome.SUCCEEDED and out.stdout.strip() == "ran", out
        await asyncio.gather(*blockers)
        now[0] += 10_000.0
        await d.expire_sessions()
        assert name not in d._pools[KEY].sessions and name in d._pools[KEY].closed
        assert_accounting_whole(d)
        assert all(not h.pinned for h in d._pools[KEY].cpu.hosts.values())
    finally:
        await client.close()


# ---- agents that stall, answer garbage, or cut the answer ----------------------------------------
class _RawHost:
    """A TCP server on loopback that answers every request with ``answer`` bytes, then closes (or,
    ``answer`` None, holds the connection open without a word)."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.requests = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self._held: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> _RawHost:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self._held:
            w.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        self.requests += 1
        if self.answer is None:
            self._held.append(writer)
            return
        writer.write(self.answer)
        await writer.drain()
        writer.transport.abort()


_HALF = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    b'{"status": "ok", "stdout": "trunc'
)


async def _bad_host_pool(host: _RawHost, name: str) -> tuple[Dispatcher, AgentClient]:
    client = AgentClient()
    d = Dispatcher(client)
    d.upsert_pool(_pool())

    async def no_inflight(address: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        return {}, set()  # the raw host lists nothing: the scan of new hosts must not reject it

    d.agent.inflight = no_inflight  # type: ignore[method-assign]
    await d.sync_hosts(KEY, [HostEndpoint(name, f"127.0.0.1:{host.port}", (0, 1), 4 << 30)])
    return d, client


@pytest.mark.parametrize(
    "answer",
    [_HALF, b"garbage\r\n\r\n", b""],
    ids=["cut-mid-body", "not-http", "closed-at-once"],
)
async def test_a_host_that_cuts_its_answers_is_taken_out_and_the_action_retried_on_a_new_one(
    agents: list[Agent], answer: bytes
) -> None:
    """Alone in its pool, a host whose every answer is cut off: the call may have reached it, so it
    is asked by key until the action's time is up there (``_settle``); those asks fail too, and the
    host is taken out (unhealthy). The attempt is an infrastructure failure: its cores are back,
    and the action waits for a host that answers, then runs there as attempt 2."""
    async with _RawHost(answer) as host:
        d, client = await _bad_host_pool(host, "bad")
        pool = d._pools[KEY]
        try:
            running = asyncio.create_task(d.run(_req("cut-0", "print('fine')", max_retries=2, timeout_s=0.5)))
            for _ in range(1200):
                if "bad" in pool.unhealthy and pool.waiting == 1 and not pool.holders:
                    break
                await asyncio.sleep(0.05)
            assert "bad" in pool.unhealthy and pool.waiting == 1 and not running.done(), pool
            assert pool.cpu.hosts["bad"].free_cores == 2 and not d.scheduler.running
            await d.sync_hosts(
                KEY,
                [
                    HostEndpoint("bad", f"127.0.0.1:{host.port}", (0, 1), 4 << 30),
                    _endpoint(agents[1], "good"),
                ],
            )
            out = await asyncio.wait_for(running, 60)
            assert out.state is Outcome.SUCCEEDED and out.host == "good" and out.attempts == 2, out
            assert_accounting_whole(d)
        finally:
            await client.close()


async def test_a_host_that_answers_garbage_fails_the_action_after_its_retries(agents: list[Agent]) -> None:
    """Alone in its pool, a host that answers every call with a 200 that is not JSON: each attempt
    is an infrastructure failure (not the program's), retried up to ``max_retries``, and then the
    action fails RetriesExhausted with every core back."""
    async with _RawHost(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnot j") as host:
        d, client = await _bad_host_pool(host, "bad")
        try:
            out = await asyncio.wait_for(d.run(_req("junk-0", max_retries=1)), 60)
            assert out.state is Outcome.FAILED and out.reason is Reason.RETRIES_EXHAUSTED, out
            assert out.attempts == 2 and host.requests == 2 and "not a JSON object" in (out.message or "")
            assert_accounting_whole(d)
        finally:
            await client.close()


async def test_a_host_that_cuts_its_answers_sends_the_action_to_a_good_one(agents: list[Agent]) -> None:
    async with _RawHost(_HALF) as host:
        d, client = await _bad_host_pool(host, "bad")
        await d.sync_hosts(
            KEY,
            [HostEndpoint("bad", f"127.0.0.1:{host.port}", (0, 1), 4 << 30), _endpoint(agents[1], "good")],
        )
        try:
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(d.run(_req(f"cg-{i}", "print('fine')", max_retries=3, timeout_s=1.0)) for i in range(6))
                ),
                120,
            )
            assert all(o.state is Outcome.SUCCEEDED and o.host == "good" for o in outs), outs
            assert_accounting_whole(d)
        finally:
            await client.close()


async def test_a_silent_host_fails_the_action_after_its_time_and_returns_its_cores() -> None:
    """A host that takes the call and never answers: after the action's own timeout plus the
    agent's margin, and the asks by key that follow, an infrastructure failure naming the host's
    address; its cores are free again."""
    async with _RawHost(None) as host:
        d, client = await _bad_host_pool(host, "mute")
        try:
            out = await asyncio.wait_for(d.run(_req("mute-0", max_retries=0, timeout_s=0.5)), 120)
            assert out.state is Outcome.FAILED and out.reason is Reason.RETRIES_EXHAUSTED, out
            assert f"127.0.0.1:{host.port}" in (out.message or ""), out.message
            assert_accounting_whole(d)
        finally:
            await client.close()


async def test_a_session_closed_while_its_action_waits_for_a_core_answers_that_action(
    dispatcher: Dispatcher,
) -> None:
    """Its opener (the gateway, at its own TTL) closes a session whose action waits in the queue:
    that action must be answered SessionLost (not run on an empty session, not left unanswered),
    and every core and pin must be back."""
    blockers = [
        asyncio.create_task(dispatcher.run(_req(f"cl-block-{i}", "import time; time.sleep(1.5)")))
        for i in range(4)
    ]
    await asyncio.sleep(0.5)
    name = await dispatcher.open_session(NS, "py")
    queued = asyncio.create_task(dispatcher.run(_req("cl-q", "print('ran')", session=name)))
    behind = asyncio.create_task(dispatcher.run(_req("cl-b", "print('behind')", session=name)))
    await asyncio.sleep(0.1)
    await dispatcher.close_session(NS, "py", name)
    outs = await asyncio.wait_for(asyncio.gather(queued, behind), 30)
    for out in outs:
        assert out.state is Outcome.FAILED and out.reason is Reason.SESSION_LOST, out
        assert name in (out.message or "") and "closed" in (out.message or ""), out.message
    await asyncio.gather(*blockers)
    assert_accounting_whole(dispatcher)
    assert all(not h.pinned for h in dispatcher._pools[KEY].cpu.hosts.values())


async def test_a_session_closed_while_its_action_waits_to_retry_answers_that_action() -> None:
    """A session's first action failed on an infrastructure error before its session existed on any
    host (the host garbled its answer), so it waits out its backoff to be tried again; the session
    is closed meanwhile. The retry must be answered SessionLost, not die on the missing session
    and leave its caller waiting for ever."""
    async with _RawHost(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnot j") as host:
        d, client = await _bad_host_pool(host, "bad")
        pool = d._pools[KEY]
        try:
            name = await d.open_session(NS, "py")
            req = dataclasses.replace(_req("rb-0", session=name, max_retries=3), backoff_s=1.0)
            running = asyncio.create_task(d.run(req))
            for _ in range(400):
                if host.requests and not pool.holders and pool.waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert host.requests == 1 and not running.done()
            await d.close_session(NS, "py", name)
            out = await asyncio.wait_for(running, 30)
            assert out.state is Outcome.FAILED and out.reason is Reason.SESSION_LOST, out
            assert name in (out.message or "") and "closed" in (out.message or ""), out.message
            assert_accounting_whole(d)
        finally:
            await client.close()


async def test_a_session_closed_while_its_action_runs_returns_every_core_and_pin(
    dispatcher: Dispatcher,
) -> None:
    name = await dispatcher.open_session(NS, "py")
    running = asyncio.create_task(
        dispatcher.run(_req("cr-run", "import time; time.sleep(1); print('done')", session=name))
    )
    pool = dispatcher._pools[KEY]
    for _ in range(400):
        if pool.holders:
            break
        await asyncio.sleep(0.01)
    await dispatcher.close_session(NS, "py", name)
    out = await asyncio.wait_for(running, 30)
    # The agent's to say (it kills what runs in a session it closes: Cancelled); answered, at least.
    assert out.state in (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED), out
    after = await dispatcher.run(_req("cr-after", session=name))
    assert after.state is Outcome.FAILED and after.reason is Reason.SESSION_LOST, after
    assert_accounting_whole(dispatcher)
    assert all(not h.pinned for h in pool.cpu.hosts.values())
