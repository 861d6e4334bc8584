"""The trainer's client against ``tangram up`` used the ways trainers use it beyond one thread and
one loop: in processes forked after it was made, from one ``asyncio.run`` to the next, and closed
while another thread still waits on it. Each such call used to hang for ever or fail with a bare
``RuntimeError``."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Iterator
from multiprocessing.queues import Queue
from pathlib import Path

import pytest
import yaml
from up_harness import Up, pool_doc, tangram_up, wait_until

from arl_tangram.client import AsyncTangramClient, TangramClient, TangramClientError

POOL = "default/py"
# Generous: a bound on a test that failed by hanging, never a measure of speed.
CHILD_DEADLINE_S = 120


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    specs = tmp_path_factory.mktemp("specs")
    (specs / "pool.yaml").write_text(yaml.safe_dump(pool_doc(maxHosts=2)))
    with tangram_up(specs / "pool.yaml") as running:
        wait_until(lambda: running.pools()[POOL]["status"]["hostsReady"] >= 1, 60, "the pool's host")
        yield running


def client(up: Up) -> TangramClient:
    return TangramClient(up.url, namespace="default", pool="py", token="", timeout_s=60)


def _child_runs(shared: TangramClient, answers: Queue[str]) -> None:
    try:
        answers.put(shared.run_code("print('from the child')").stdout)
        shared.close()
    except BaseException as exc:  # the parent reads it: a child's traceback is lost otherwise
        answers.put(repr(exc))


def test_a_client_made_before_a_fork_serves_the_child_and_still_the_parent(up: Up) -> None:
    shared = client(up)
    try:
        assert shared.run_code("print('before')").stdout == "before\n"  # a pooled connection now
        fork = multiprocessing.get_context("fork")
        answers: Queue[str] = fork.Queue()
        child = fork.Process(target=_child_runs, args=(shared, answers))
        child.start()
        child.join(CHILD_DEADLINE_S)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
        assert not hung, "the forked child's call never returned"
        assert answers.get(timeout=10) == "from the child\n"
        assert child.exitcode == 0
        # The child closed its copy: the parent's connections and loop are untouched.
        assert shared.run_code("print('after')").stdout == "after\n"
    finally:
        shared.close()


def test_the_async_client_serves_one_asyncio_run_after_another(up: Up) -> None:
    shared = AsyncTangramClient(up.url, namespace="default", pool="py", token="", timeout_s=60)

    async def step(i: int) -> str:
        return (await shared.run_code(f"print({i})")).stdout

    # A trainer calling asyncio.run once per step with one client made at start.
    assert [asyncio.run(step(i)) for i in range(3)] == ["0\n", "1\n", "2\n"]
    asyncio.run(shared.close())


def test_a_closed_client_says_so(up: Up) -> None:
    closed = client(up)
    closed.close()
    closed.close()  # twice is fine
    with pytest.raises(TangramClientError, match="is closed"):
        closed.run_code("print(1)")


def test_closing_a_client_ends_the_calls_other_threads_wait_on(up: Up) -> None:
    shared = client(up)
    ended: list[BaseException | str] = []

    def long_call() -> None:
        try:
            ended.append(shared.run_code("import time; time.sleep(50)").state)
        except BaseException as exc:
            ended.append(exc)

    waiter = threading.Thread(target=long_call, daemon=True)
    waiter.start()
    wait_until(lambda: up.pools()[POOL]["status"]["coresBusy"] >= 1, 30, "the action to run")
    shared.close()
    waiter.join(CHILD_DEADLINE_S)
    assert not waiter.is_alive(), "the other thread's call never returned after close()"
    assert len(ended) == 1 and isinstance(ended[0], TangramClientError), ended
    assert "closed" in str(ended[0])
    # Its action was the client's own (no key): cancelled on the gateway, not left holding a core.
    wait_until(lambda: up.pools()[POOL]["status"]["coresBusy"] == 0, 30, "the action to be cancelled")


def test_bad_arguments_start_no_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    with pytest.raises(TypeError, match="stream_in_flight"):
        TangramClient("http://127.0.0.1:1", stream_in_flight=4)  # type: ignore[arg-type]
    assert threading.active_count() == before
