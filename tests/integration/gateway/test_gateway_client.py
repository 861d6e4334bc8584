"""The trainer's client against the real gateway: sync and async, streams, sessions, rewards, typed
errors; retries of infrastructure failures with the same key, so a gateway killed mid-stream and
replaced loses nothing and runs nothing twice."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gateway_harness import (
    NS,
    POOL,
    SERVICE,
    Gateway,
    endpoint,
    free_port,
    serve_gateway,
    start_reward_runtime,
)
from sandbox_agent_harness import Agent, start_agent, stop_agent, wait_until

from arl_tangram.client import (
    AsyncTangramClient,
    InvalidRequest,
    NotFoundError,
    RetryPolicy,
    SessionLost,
    TangramClient,
    Unavailable,
    code_action,
)
from arl_tangram.client.tokens import token_source
from arl_tangram.gateway import GatewayConfig
from arl_tangram.gateway.bench import start_gateway, stop_process


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, default_services={NS: SERVICE})
    with (
        start_reward_runtime(tmp_path_factory.mktemp("rm")) as rewards,
        serve_gateway(hosts, config=config, rewards=rewards) as gw,
    ):
        yield gw


def ran(agent: Agent) -> int:
    """How many actions the agent has run (its own count): the side effect that proves "once"."""
    return sum(requests.get(agent.url + "/v1/health", timeout=10).json()["outcomes"].values())


def test_run_code_and_a_failing_program_is_a_result_run_once(gateway: Gateway, hosts: list[Agent]) -> None:
    with TangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        assert client.run_code("print(2 + 2)").stdout == "4\n"
        before = ran(hosts[0])
        failed = client.run_code("raise SystemExit(7)")
        assert not failed.ok and failed.reason == "NonZeroExit" and failed.exit_code == 7
        assert ran(hosts[0]) == before + 1, "a program failure must never be retried"


def test_typed_errors(gateway: Gateway) -> None:
    with TangramClient(gateway.url, namespace=NS) as client:
        with pytest.raises(NotFoundError, match="ghost"):
            client.run_code("1", pool="ghost")
        with pytest.raises(InvalidRequest) as bad:
            client.run({"type": "code", "target": POOL, "payload": {"code": "1"}, "timeoutSeconds": -1})
        assert bad.value.status == 422 and bad.value.field == "timeoutSeconds"


def test_a_thousand_actions_through_one_stream_come_back_exactly_once(gateway: Gateway) -> None:
    actions = [code_action(f"print({i})", id=f"a{i}") for i in range(1000)]
    with TangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        results = list(client.run_many(actions))
    assert len(results) == 1000
    assert sorted(r.id for r in results if r.id) == sorted(f"a{i}" for i in range(1000))
    assert all(r.ok and r.stdout == f"{r.id[1:]}\n" for r in results if r.id)


def test_sessions_as_context_managers_and_rewards(gateway: Gateway) -> None:
    with TangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        with client.session(ttl_s=60) as session:
            session.run_code("open('state', 'w').write('kept')")
            assert session.run_code("print(open('state').read())").stdout == "kept\n"
            sid = session.id
        assert requests.get(f"{gateway.url}/v1/sessions/{sid}", timeout=10).status_code == 404
        assert gateway.rewards is not None
        want = gateway.rewards.expected(["p" + "r" * 25])
        assert client.score([{"prompt": "p", "response": "r" * 25}], service=SERVICE) == want


async def test_the_async_client(gateway: Gateway) -> None:
    async with AsyncTangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        assert (await client.run_code("print('async')")).stdout == "async\n"
        seen = [r.stdout async for r in client.run_many([code_action(f"print({i})") for i in range(20)])]
        assert sorted(seen) == sorted(f"{i}\n" for i in range(20))
        async with client.session() as session:
            assert (await session.run_code("print(1)")).ok


def test_a_gateway_killed_mid_stream_is_replaced_and_nothing_runs_twice(hosts: list[Agent]) -> None:
    """The gateway process is SIGKILLed after some results; a new one starts on the same address
    (as a new leader behind the Service). The client re-sends what was unanswered with the same
    keys: every action comes back exactly once and the agent ran each exactly once."""
    agent = hosts[0]
    port = free_port()
    first = start_gateway(agent.url, port)
    replacement = None
    before = ran(agent)
    actions = [code_action(f"import time; time.sleep(0.2); print({i})", id=f"k{i}") for i in range(40)]
    results = []
    retry = RetryPolicy(attempts=12, backoff_s=0.2, max_backoff_s=2.0)
    try:
        with TangramClient(f"http://127.0.0.1:{port}", namespace="bench", pool="py", retry=retry) as client:
            for result in client.run_many(actions):
                results.append(result)
                if len(results) == 10:
                    os.kill(first.pid, signal.SIGKILL)
                    first.wait()
                    replacement = start_gateway(agent.url, port)
    finally:
        if first.poll() is None:
            first.kill()
        if replacement is not None:
            stop_process(replacement)
    assert replacement is not None
    assert sorted(r.id or "" for r in results) == sorted(f"k{i}" for i in range(40))
    assert all(r.ok and r.stdout == f"{(r.id or 'k')[1:]}\n" for r in results), results
    assert ran(agent) - before == 40, "an action ran twice (or never)"


def test_a_session_whose_host_is_lost_raises_session_lost(tmp_path: Path) -> None:
    doomed, survivor = start_agent(tmp_path / "doomed"), start_agent(tmp_path / "survivor")
    try:
        with serve_gateway([doomed]) as gw, TangramClient(gw.url, namespace=NS, pool=POOL) as client:
            with client.session() as session:
                assert session.run_code("x = 1").ok
                doomed.proc.kill()
                doomed.proc.wait()
                # The operator sees the pod gone and hands the dispatcher the hosts that remain.
                gw.call(gw.service.dispatcher.sync_hosts(f"{NS}/{POOL}", [endpoint(survivor, "survivor")]))
                with pytest.raises(SessionLost, match="lost"):
                    session.run_code("print(x)")
            assert client.run_code("print('elsewhere')").stdout == "elsewhere\n"
    finally:
        stop_agent(survivor)
        if doomed.proc.poll() is None:
            stop_agent(doomed)


def test_the_token_comes_from_the_argument_the_environment_or_a_rotating_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    monkeypatch.delenv("TANGRAM_TOKEN_FILE", raising=False)
    assert token_source("given")() == "given"
    monkeypatch.setenv("TANGRAM_TOKEN", "from-env")
    assert token_source(None)() == "from-env"
    monkeypatch.delenv("TANGRAM_TOKEN")
    path = tmp_path / "token"
    path.write_text("first\n")
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(path))
    source = token_source(None)
    assert source() == "first"
    path.write_text("rotated")
    os.utime(path, (1, 1))  # a new mtime, as the kubelet's atomic swap gives
    assert source() == "rotated"


def test_a_key_repeated_after_it_ended_is_answered_not_run_again_on_another_host(tmp_path: Path) -> None:
    """With two hosts, a repeat of a key after its action ended went wherever the scheduler put
    it (its first host busy: the other one) and ran again, with another result: only the first
    host's agent knew the key. The dispatcher remembers where a key ran and answers the repeat
    from that host's stored result, even with that host cordoned for new work."""
    agents = [start_agent(tmp_path / "a"), start_agent(tmp_path / "b")]
    try:
        with serve_gateway(agents) as gw:
            action = {
                "type": "code",
                "target": POOL,
                "key": "once-only",
                "payload": {"code": "import random; print(random.random())"},
            }
            first = requests.post(gw.url + "/v1/actions", json=action, timeout=60).json()
            before = [ran(a) for a in agents]
            dispatcher = gw.service.dispatcher

            async def cordon(draining: bool) -> None:
                dispatcher.drain(f"{NS}/{POOL}", first["host"], draining)

            gw.call(cordon(True))  # a new run could only go to the other host
            again = requests.post(gw.url + "/v1/actions", json=action, timeout=60).json()
            assert (again["stdout"], again["host"]) == (first["stdout"], first["host"]), (first, again)
            assert [ran(a) for a in agents] == before, "the repeat ran again"
            other = {**action, "payload": {"code": "print('another')"}}
            conflict = requests.post(gw.url + "/v1/actions", json=other, timeout=60)
            assert conflict.status_code == 409, conflict.text
            # Named as the caller sent it, not as the dispatcher scoped it (gw/<namespace>/...).
            assert conflict.json()["error"].startswith("key 'once-only' "), conflict.text
            gw.call(cordon(False))
    finally:
        for a in agents:
            stop_agent(a)


def test_run_many_takes_results_of_any_size_and_refuses_two_actions_under_one_key(gateway: Gateway) -> None:
    """One result carrying 600 KB of output ended ``run_many`` (aiohttp's line reader stops at
    512 KiB) and lost the results still to come; two actions under one key lost one of them
    without a word."""
    actions = [code_action(f"print({i})", key=f"many-{i}") for i in range(6)]
    actions.insert(3, code_action("print('x' * 600_000)", key="many-big"))
    with TangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        results = {r.key: r for r in client.run_many(actions)}
        assert sorted(results) == sorted(a["key"] for a in actions), sorted(results)
        assert results["many-big"].stdout == "x" * 600_000 + "\n"
        assert all(results[f"many-{i}"].stdout == f"{i}\n" for i in range(6))
        twice = [code_action("print(1)", key="dup"), code_action("print(2)", key="dup")]
        with pytest.raises(InvalidRequest, match="dup"):
            list(client.run_many(twice))


def test_a_key_with_outer_spaces_is_refused_by_name(gateway: Gateway) -> None:
    """HTTP drops a header's outer spaces: a key ``'k '`` sent in the body and the header (as the
    client sends it) came back as two keys that differ, a message about a header the caller never
    wrote. Such a key cannot round-trip through HTTP: it is refused as the key it is (422)."""
    with TangramClient(gateway.url, namespace=NS, pool=POOL) as client:
        with pytest.raises(InvalidRequest) as refused:
            client.run(code_action("print(1)", key="trailing "))
        assert refused.value.field == "key" and refused.value.status == 422, refused.value
        assert "differs" not in str(refused.value), refused.value  # it was told the header changed it


def test_the_clients_own_timeout_is_named_as_such(gateway: Gateway) -> None:
    """A long action past the client's ``timeout_s`` read as the gateway's failure ("no answer ...
    TimeoutError()"): the error says it was this client's limit, and which argument raises it."""
    with (
        TangramClient(
            gateway.url, namespace=NS, pool=POOL, timeout_s=0.5, retry=RetryPolicy(attempts=1)
        ) as client,
        pytest.raises(Unavailable) as err,
    ):
        client.run_code("import time; time.sleep(3)")
    assert "timeout_s (0.5 s)" in str(err.value)


def _outstanding(gw: Gateway) -> int:
    """Actions the gateway's dispatcher holds for the pool, queued or running."""

    async def count() -> int:
        stats = gw.service.dispatcher.stats(f"{NS}/{POOL}")
        return 0 if stats is None else stats.queued_actions + stats.running_actions

    return gw.call(count())


def _sleepers(n: int) -> list[dict[str, object]]:
    # They end by the pool's timeout unless cancelled first (``_ended_by_cancel`` tells which).
    return [code_action("import time; time.sleep(600)", id=f"sleep{i}") for i in range(n)]


def _timeouts(agent: Agent) -> int:
    outcomes: dict[str, int] = requests.get(agent.url + "/v1/health", timeout=10).json()["outcomes"]
    return outcomes.get("timeout", 0)


def _ended_by_cancel(gw: Gateway, agent: Agent, timeouts_before: int) -> None:
    """Wait until the gateway holds none of the sleepers, and check none ran to its timeout."""
    wait_until(lambda: _outstanding(gw) == 0, 120, "the sleepers to end")
    assert _timeouts(agent) == timeouts_before, "they ran on to the pool's timeout: not cancelled"


def test_a_refused_stream_line_comes_back_with_its_id(hosts: list[Agent]) -> None:
    """A line over the gateway's limit is never parsed, so the gateway cannot name its id: its
    refusal came back with ``id`` None, a result the caller could not match to what it sent."""
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, max_body_bytes=4096)
    with serve_gateway(hosts, config=config) as gw, TangramClient(gw.url, namespace=NS, pool=POOL) as client:
        actions = [code_action("print('x' * 10)", id="small"), code_action("#" * 8192, id="huge")]
        results = {r.id: r for r in client.run_many(actions)}
        assert sorted(results) == ["huge", "small"], results
        assert results["small"].ok
        huge = results["huge"]
        assert huge.state == "Refused" and isinstance(huge.error, InvalidRequest), huge
        assert huge.error.status == 413 and "exceeds the limit" in str(huge.error), huge


def test_an_abandoned_run_many_cancels_what_it_left_running(hosts: list[Agent]) -> None:
    """Broken out of after its first result, ``run_many`` left its other actions running on the
    gateway to their end (each holding a core), keyed by keys nobody else knew. Now they are
    cancelled; an action the caller keyed itself runs on (a retry with its key gets its result)."""
    with serve_gateway(hosts) as gw, TangramClient(gw.url, namespace=NS, pool=POOL) as client:
        keyed = code_action("import time; time.sleep(1); print('kept')", key="abandon-keyed")
        before = _timeouts(hosts[0])
        for result in client.run_many([code_action("print('first')"), *_sleepers(3), keyed]):
            assert result.stdout == "first\n", result
            break
        _ended_by_cancel(gw, hosts[0], before)
        again = client.run(keyed)
        assert again.ok and again.stdout == "kept\n", "the caller's own key ran on, and is answered"
        assert client.cancel(["abandon-keyed", "never-sent"]) == [], "neither queued nor running"


async def test_a_cancelled_async_run_many_cancels_its_actions(hosts: list[Agent]) -> None:
    with serve_gateway(hosts) as gw:
        async with AsyncTangramClient(gw.url, namespace=NS, pool=POOL) as client:

            async def consume() -> None:
                async for _ in client.run_many(_sleepers(3)):
                    pass

            before = _timeouts(hosts[0])
            task = asyncio.create_task(consume())
            # In a thread: the stream is sent on this loop meanwhile.
            await asyncio.to_thread(wait_until, lambda: _outstanding(gw) == 3, 60, "the sleepers to arrive")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        _ended_by_cancel(gw, hosts[0], before)


def test_ctrl_c_in_a_blocking_run_many_cancels_its_actions(hosts: list[Agent]) -> None:
    """Ctrl-C (KeyboardInterrupt in the main thread) while the blocking client waited: the wait
    ended, but the stream ran on on the client's loop, and its actions on the gateway."""
    # SIGINT as a plain program has it (KeyboardInterrupt), whatever handler an earlier test of this
    # process left behind: in one full run the interrupt did not raise, and the sleepers ran to
    # their timeout.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with serve_gateway(hosts) as gw, TangramClient(gw.url, namespace=NS, pool=POOL) as client:
            results = client.run_many(_sleepers(3))
            before = _timeouts(hosts[0])
            main = threading.get_ident()
            unseen: list[BaseException] = []

            def interrupt() -> None:
                try:
                    wait_until(lambda: _outstanding(gw) == 3, 120, "the sleepers to arrive")
                except BaseException as exc:  # said below; Ctrl-C all the same, so the test ends
                    unseen.append(exc)
                signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, to the thread that waits

            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                list(results)
            assert not unseen, unseen
            _ended_by_cancel(gw, hosts[0], before)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_stream_in_flight_is_refused_as_removed() -> None:
    """It was accepted and never used: a caller believed it bounded its streams."""
    with pytest.raises(TypeError, match="stream_in_flight was removed"):
        AsyncTangramClient("http://127.0.0.1:1", namespace=NS, stream_in_flight=8)  # type: ignore[arg-type]
