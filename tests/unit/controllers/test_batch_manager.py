"""The BatchManager's writes: a batch's last result goes out at once, a finished batch is not
written again, and its TTL still deletes it.

The dispatcher and the API server are replaced by functions that record what they are asked (the
dispatcher's own tests run it against real agents; the e2e tier runs the manager on a real API
server); what is checked here is when and what the manager writes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from arl_tangram.api import actionbatch as api_actionbatch
from arl_tangram.controllers import actionbatch
from arl_tangram.controllers.actionbatch import BatchManager, completion_event
from arl_tangram.controllers.conditions import Event
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outcome, Reason
from arl_tangram.errors import NotFound, TargetUnavailable


class Recorder:
    def __init__(self) -> None:
        self.writes: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.ran: list[str] = []  # the keys of the actions run

    async def run(self, request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        self.ran.append(request.key)
        await asyncio.sleep(0)
        return ActionOutcome(request.key, Outcome.SUCCEEDED, stdout="ok\n", exit_code=0, attempts=1)

    async def cancel(self, key: str) -> bool:
        return False

    async def patch(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        self.writes.append(status)

    async def delete(self, namespace: str, name: str, uid: str) -> None:
        self.deleted.append((namespace, name))


async def _python_pool(namespace: str, pool: str) -> tuple[str, ...] | None:
    return ("python",) if pool == "py" else None


def _manager(rec: Recorder) -> BatchManager:
    return BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete)


def _body(n: int, **spec: Any) -> dict[str, Any]:
    actions = [{"id": f"a{i}", "type": "code", "target": "py", "payload": {"code": "1"}} for i in range(n)]
    return {
        "metadata": {"namespace": "ns", "name": "b", "uid": "u-1", "generation": 1},
        "spec": {"actions": actions, **spec},
    }


async def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _complete(status: dict[str, Any]) -> bool:
    return any(c["type"] == "Complete" and c["status"] == "True" for c in status["conditions"])


async def test_the_write_that_completes_a_batch_does_not_wait_for_the_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(actionbatch, "STATUS_PERIOD_S", 3600.0)  # only the completion can wake it
    rec = Recorder()
    mgr = _manager(rec)
    writer = asyncio.create_task(mgr.run_writer())
    try:
        mgr.ensure(_body(5))
        await _until(lambda: any(_complete(w) for w in rec.writes))
    finally:
        writer.cancel()
    assert len(rec.writes) == 1
    assert rec.writes[0]["counts"]["succeeded"] == 5 and len(rec.writes[0]["results"]) == 5


async def test_a_finished_batch_is_written_once_and_its_ttl_still_deletes_it() -> None:
    rec = Recorder()
    mgr = _manager(rec)
    mgr.ensure(_body(3, ttlSecondsAfterFinished=1))
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    assert len(rec.writes) == 1 and _complete(rec.writes[0]) and rec.deleted == []
    deadline = time.monotonic() + 10
    while not rec.deleted:  # clean from now on: never written again, deleted once its TTL has passed
        assert time.monotonic() < deadline, "the TTL never deleted the batch"
        await mgr.flush()
        await asyncio.sleep(0.05)
    assert len(rec.writes) == 1
    assert rec.deleted == [("ns", "b")]


async def test_a_ttl_of_zero_deletes_the_batch_only_after_its_complete_status_is_written() -> None:
    """``ttlSecondsAfterFinished: 0`` is "at once", as for a Job, but after the status that
    completes it: a watcher waiting for Complete must see it, not the batch vanish."""
    rec = Recorder()
    events: list[str] = []

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        events.append("complete" if _complete(status) else "write")

    async def delete(namespace: str, name: str, uid: str) -> None:
        events.append("delete")

    mgr = BatchManager(rec.run, rec.cancel, _python_pool, patch, delete)
    mgr.ensure(_body(2, ttlSecondsAfterFinished=0))
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    assert events == ["complete", "delete"]
    await mgr.flush()
    assert events == ["complete", "delete"]  # once


async def test_a_finished_batch_without_a_ttl_is_left_alone() -> None:
    rec = Recorder()
    mgr = _manager(rec)
    mgr.ensure(_body(2))
    await _until(lambda: mgr.pending_count() == 0)
    for _ in range(3):
        await mgr.flush()
    assert len(rec.writes) == 1 and rec.deleted == []


async def test_an_action_naming_no_pool_fails_by_name_and_the_others_run() -> None:
    rec = Recorder()
    mgr = _manager(rec)
    mgr.target_wait_s = 0  # no wait for the pool to be created (below)
    body = _body(2)
    body["spec"]["actions"][1]["target"] = "nowhere"
    mgr.ensure(body)
    await _until(lambda: len(mgr._batches[("ns", "b")].results) == 2)
    results = mgr._batches[("ns", "b")].results
    assert results["a0"].state == "Succeeded"
    assert results["a1"].state == "Failed" and results["a1"].reason == "PoolNotFound"
    assert "'nowhere'" in (results["a1"].output or "")


async def test_an_action_whose_pool_is_created_a_moment_after_its_batch_runs() -> None:
    """``kubectl apply -f dir/`` applies ``actionbatch-*.yaml`` before ``actionpool-*.yaml``: every
    action failed PoolNotFound at once, though its pool came a moment later. They wait for it now
    (``TARGET_WAIT_S``), the status saying so."""
    rec = Recorder()
    lookups = 0

    async def pool_made_later(namespace: str, pool: str) -> tuple[str, ...] | None:
        nonlocal lookups
        lookups += 1
        return ("python",) if lookups > 3 else None

    mgr = BatchManager(rec.run, rec.cancel, pool_made_later, rec.patch, rec.delete)
    mgr.ensure(_body(2))
    await _until(lambda: bool(mgr._batches[("ns", "b")].held_by))
    await mgr.flush()
    running = next(c for c in rec.writes[-1]["conditions"] if c["type"] == "Running")
    assert "ActionPool 'py' not found in namespace 'ns'; waiting up to 30 s" in running["message"], running
    await _until(lambda: mgr.pending_count() == 0)
    results = mgr._batches[("ns", "b")].results
    assert [r.state for r in results.values()] == ["Succeeded", "Succeeded"], results
    await mgr.flush()
    running = next(c for c in rec.writes[-1]["conditions"] if c["type"] == "Running")
    assert "not found" not in running["message"], running


async def test_an_action_whose_target_never_comes_fails_once_the_wait_is_over() -> None:
    """A name nobody creates (a typo) still fails, naming it, after ``target_wait_s``, counted from
    the batch's first action that missed it: a service's actions (whose lookup is the run) too."""
    rec = Recorder()
    tries = 0

    async def no_service(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        nonlocal tries
        tries += 1
        raise NotFound("RewardModelService", request.target)

    mgr = BatchManager(no_service, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.target_wait_s = 1.5
    body = _body(2)
    for a in body["spec"]["actions"]:
        a.update(type="reward", target="rm", payload={"prompt": "p", "response": "r"})
    started = time.monotonic()
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    results = mgr._batches[("ns", "b")].results
    assert {r.reason for r in results.values()} == {"ServiceNotFound"}, results
    assert time.monotonic() - started >= 1.5 and tries >= 4, "failed without waiting for it"


async def test_a_target_no_longer_waited_for_is_no_longer_said_to_be() -> None:
    """Once its wait was over, the batch's Running condition still said "waiting up to 30 s for it
    to be created" for as long as its other actions ran."""
    rec = Recorder()
    release = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        await release.wait()
        return await rec.run(request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.target_wait_s = 1.0
    body = _body(2)
    body["spec"]["actions"][1]["target"] = "nowhere"
    mgr.ensure(body)
    batch = mgr._batches[("ns", "b")]
    await _until(lambda: "a1" in batch.results)
    assert batch.results["a1"].reason == "PoolNotFound", batch.results
    await mgr.flush()
    running = next(c for c in rec.writes[-1]["conditions"] if c["type"] == "Running")
    assert "nowhere" not in running["message"], running
    release.set()
    await _until(lambda: mgr.pending_count() == 0)


async def test_a_batch_deleted_while_its_pool_is_looked_up_runs_none_of_its_actions() -> None:
    """The lookup may read the API server; ``forget`` cancels the actions it knows the keys of, and
    one still looking up its pool must not start once it has found it."""
    rec = Recorder()
    ran: list[str] = []
    found = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        ran.append(request.key)
        return await rec.run(request, attempts_so_far)

    async def slow_pool(namespace: str, pool: str) -> tuple[str, ...] | None:
        await found.wait()
        return ("python",)

    mgr = BatchManager(run, rec.cancel, slow_pool, rec.patch, rec.delete)
    mgr.ensure(_body(2))
    await asyncio.sleep(0.05)  # both actions wait on the lookup
    batch = mgr._batches[("ns", "b")]
    forgetting = asyncio.create_task(mgr.forget("ns", "b"))
    await asyncio.sleep(0.05)
    found.set()
    await asyncio.wait_for(forgetting, 15)
    assert ran == []
    assert {r.state for r in batch.results.values()} == {"Cancelled"}


async def test_an_operator_fault_in_one_action_fails_it_and_the_batch_still_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception the dispatcher was never meant to raise ends that action Failed with a platform
    reason naming it (a trainer may send it again), instead of leaving it Pending for good."""
    rec = Recorder()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a1"):
            raise RuntimeError("boom")
        return await rec.run(request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(3))
    await _until(lambda: len(mgr._batches[("ns", "b")].results) == 3)
    results = mgr._batches[("ns", "b")].results
    assert [results[a].state for a in ("a0", "a2")] == ["Succeeded", "Succeeded"]
    assert results["a1"].state == "Failed" and results["a1"].reason == "SandboxError"
    assert "RuntimeError: boom" in (results["a1"].output or "")
    assert "boom" in caplog.text


async def test_a_long_failure_message_in_the_output_keeps_its_tail_and_says_it_was_cut() -> None:
    """A failure with no output says why in its output: cut as outputs are (the tail: where a
    traceback or an error chain ends with its cause, within outputBytesPerAction bytes, never half a
    character), with ``truncated`` true when it was cut."""
    rec = Recorder()
    cause = "ValueError: the cause a person needs"
    long = "Traceback (most recent call last):\n" + "  frame é\n" * 200 + cause
    short = "SandboxError: no host"

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        message = long if request.key.endswith("a0") else short
        return ActionOutcome(request.key, Outcome.FAILED, Reason.SANDBOX_ERROR, message)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(2, results={"outputBytesPerAction": 101}))
    await _until(lambda: len(mgr._batches[("ns", "b")].results) == 2)
    results = mgr._batches[("ns", "b")].results
    cut = results["a0"]
    assert cut.output is not None and cut.output.endswith(cause) and cut.truncated is True
    assert len(cut.output.encode()) <= 101 and long.endswith(cut.output)
    whole = results["a1"]
    assert (whole.output, whole.truncated) == (short, False)


class Holding(Recorder):
    """Actions run until cancelled by key; ``release`` (when set) lets a cancel take effect."""

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def run(self, request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        stop = self.running.setdefault(request.key, asyncio.Event())
        await stop.wait()
        return ActionOutcome(request.key, Outcome.CANCELLED, Reason.CANCELLED, "cancelled")

    async def cancel(self, key: str) -> bool:
        self.cancelled.append(key)
        await self.release.wait()
        self.running.setdefault(key, asyncio.Event()).set()
        return True


def _made_again(uid: str) -> dict[str, Any]:
    body = _body(1)
    body["metadata"]["uid"] = uid
    return body


async def test_a_batch_made_again_under_its_name_is_not_ended_by_the_old_ones_deletion() -> None:
    """kopf hears each uid on its own: the new batch's events may come while the old one's deletion
    is still being handled (it waits for its actions to stop). That deletion ended the new batch's
    state, and its status was never written again."""
    rec = Holding()
    mgr = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_made_again("u-1"))
    await _until(lambda: "u-1/a0" in rec.running)
    rec.release.clear()  # the old one's actions take a moment to stop
    forgetting = asyncio.create_task(mgr.forget("ns", "b", "u-1"))
    await _until(lambda: rec.cancelled == ["u-1/a0"])
    mgr.ensure(_made_again("u-2"))
    await _until(lambda: "u-2/a0" in rec.running)
    rec.release.set()
    await asyncio.wait_for(forgetting, 5)
    assert mgr.has("ns", "b") and mgr._batches[("ns", "b")].uid == "u-2"
    # A deletion of the old one heard again (or late) leaves the new one alone too.
    await mgr.forget("ns", "b", "u-1")
    assert mgr.has("ns", "b") and "u-2/a0" not in rec.cancelled
    await mgr.forget("ns", "b", "u-2")
    assert not mgr.has("ns", "b") and rec.cancelled == ["u-1/a0", "u-2/a0"]


async def test_a_batch_replaced_under_its_name_with_no_deletion_heard_has_its_actions_stopped() -> None:
    """A watch that restarted lists what is, not what went: the old batch's deletion may never be
    heard. The new object under its name says it is gone; its actions must not run on."""
    rec = Holding()
    mgr = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_made_again("u-1"))
    await _until(lambda: "u-1/a0" in rec.running)
    mgr.ensure(_made_again("u-2"))
    await _until(lambda: rec.cancelled == ["u-1/a0"] and "u-2/a0" in rec.running)
    await _until(lambda: not mgr._ending)
    assert mgr._batches[("ns", "b")].uid == "u-2" and not [k for k in mgr._by_key if k.startswith("u-1/")]
    await mgr.forget("ns", "b", "u-2")


async def test_a_batch_waits_for_a_pool_with_no_host_and_says_why() -> None:
    """A gateway caller hears ``TargetUnavailable`` at once; a batch is asynchronous, so it waits for a
    host (a node added, the image fixed), its status saying why, and its actions run when one comes."""
    rec = Recorder()
    why = "pool ns/py has no host: host py-1 cannot start: container agent: ImagePullBackOff"
    refusals = {"left": 3}
    mgr: BatchManager

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if refusals["left"] > 0:
            refusals["left"] -= 1
            raise TargetUnavailable(why, delay=0.05)
        mgr.started(request.key, 1)  # as the dispatcher reports a start
        return await rec.run(request, attempts_so_far)

    release = asyncio.Event()

    async def held_run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if refusals["left"] == 0:
            await release.wait()
        return await run(request, attempts_so_far)

    mgr = BatchManager(held_run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(1))
    await _until(lambda: refusals["left"] == 0)
    await mgr.flush()
    running = {c["type"]: c for c in rec.writes[-1]["conditions"]}["Running"]
    assert running["status"] == "False" and why in running["message"], running
    assert rec.writes[-1]["counts"]["pending"] == 1
    release.set()
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    assert _complete(rec.writes[-1]) and rec.writes[-1]["results"][0]["state"] == "Succeeded"


async def test_a_batch_deleted_while_it_waits_out_an_outage_goes_at_once_and_runs_nothing() -> None:
    rec = Recorder()
    ran: list[str] = []
    refused = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if not refused.is_set():
            refused.set()
            raise TargetUnavailable("pool ns/py has no host: host py-1 cannot start", delay=3.0)
        ran.append(request.key)  # the outage over: only a batch still there may start it
        return await rec.run(request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(1))
    await asyncio.wait_for(refused.wait(), 5)
    batch = mgr._batches[("ns", "b")]
    started = time.monotonic()
    await asyncio.wait_for(mgr.forget("ns", "b"), 5)
    assert time.monotonic() - started < 1.0, "forget waited for the outage's retry"
    assert ran == [] and batch.results["a0"].state == "Cancelled"


async def test_each_target_says_why_it_holds_and_a_start_clears_only_its_own() -> None:
    rec = Recorder()
    why = "pool ns/down has no host: 3 host(s) failed in a row"
    mgr: BatchManager
    done = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.target == "down":
            raise TargetUnavailable(why, delay=0.01)
        mgr.started(request.key, 1)
        await done.wait()  # keeps running: the batch stays in progress
        return await rec.run(request, attempts_so_far)

    async def pools(namespace: str, pool: str) -> tuple[str, ...] | None:
        return ("python",)

    mgr = BatchManager(run, rec.cancel, pools, rec.patch, rec.delete)
    body = _body(2)
    body["spec"]["actions"][1]["target"] = "down"
    mgr.ensure(body)
    batch = mgr._batches[("ns", "b")]
    await _until(lambda: "down" in batch.held_by and batch.results.get("a0") is not None)
    await mgr.flush()
    running = {c["type"]: c for c in rec.writes[-1]["conditions"]}["Running"]
    assert running["message"].count(why) == 1, running
    writes = len(rec.writes)
    await asyncio.sleep(1.5)  # refused again and again meanwhile: nothing new to write
    await mgr.flush()
    assert len(rec.writes) == writes
    done.set()
    await mgr.forget("ns", "b")


async def test_a_target_that_serves_again_is_no_longer_named_even_without_a_start_report() -> None:
    """Reward actions have no start report (``started``): the reason goes once one is served."""
    rec = Recorder()
    why = "RewardModelService ns/rm has no replica: replica rm-1 cannot start"
    refusals = {"left": 1}
    hold = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a1"):
            await hold.wait()  # keeps the batch in progress
        elif refusals["left"]:
            refusals["left"] -= 1
            raise TargetUnavailable(why, delay=0.01)
        return await rec.run(request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(2))
    batch = mgr._batches[("ns", "b")]
    await _until(lambda: batch.results.get("a0") is not None and batch.results["a0"].state == "Succeeded")
    await mgr.flush()
    running = {c["type"]: c for c in rec.writes[-1]["conditions"]}["Running"]
    assert why not in running["message"] and batch.held_by == {}, running
    hold.set()
    await _until(lambda: mgr.pending_count() == 0)


def _restarted(body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a new operator reads it: with the status the last one wrote, as the API server
    keeps it (JSON, a merge patch's nulls gone)."""
    kept = json.loads(json.dumps({k: v for k, v in status.items() if v is not None}))
    return {**body, "status": kept}


async def test_a_restart_keeps_a_finished_batchs_status_and_act_without_writing_it_again() -> None:
    """A restarted operator wrote every finished batch's status again, and with its ACT summary
    gone (the seconds behind it were the old operator's)."""
    rec = Recorder()
    mgr = _manager(rec)
    body = _body(3)
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    (written,) = rec.writes
    assert written["act"]["count"] == 3
    again = Recorder()
    restarted = _manager(again)
    restarted.ensure(_restarted(body, written))
    for _ in range(2):
        await restarted.flush()
    assert again.writes == []
    status, _ = restarted.status_of(restarted._batches[("ns", "b")], datetime.now(UTC))
    assert status["act"] == written["act"]


async def test_results_after_a_restart_serve_what_the_status_kept_and_say_it_is_not_whole() -> None:
    rec = Recorder()
    mgr = _manager(rec)
    body = _body(2)
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    restarted = _manager(Recorder())
    restarted.ensure(_restarted(body, rec.writes[-1]))
    rows = restarted.results("ns", "b")
    got = [row async for row in (await rows)] if rows is not None else []
    assert [r["id"] for r in got] == ["a0", "a1"]
    live = mgr.results("ns", "b")
    whole = [row async for row in (await live)] if live is not None else []
    for row, before in zip(got, whole, strict=True):
        assert row["state"] == "Succeeded" and row["exitCode"] == 0
        assert row["output"] == "ok\n" and row["outputWhole"] is False and row["stdout"] is None
        # One shape, so that a reader of whole rows does not break only after a failover.
        assert set(row) - {"output"} == set(before) and before["outputWhole"] is True


async def _rows(mgr: BatchManager, name: str) -> list[dict[str, Any]]:
    rows = mgr.results("ns", name)
    return [row async for row in (await rows)] if rows is not None else []


async def test_whole_outputs_past_the_memory_budget_go_oldest_first_and_are_served_from_the_status() -> None:
    """Batches without a TTL stay until deleted, and each kept every action's whole output in the
    operator's memory for ever: a trainer's thousands of batches grew it to its container's limit.
    Past the budget the oldest finished outputs go (served as after a restart); deleting a batch
    gives its share back."""
    out = "x" * 1000

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        await asyncio.sleep(0)
        # (a1's stdout is as the agent capped it: its row says so even while whole)
        capped = request.key.endswith("a1")
        return ActionOutcome(
            request.key, Outcome.SUCCEEDED, stdout=out, exit_code=0, attempts=1, truncated=capped
        )

    rec = Recorder()
    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete, whole_outputs_bytes=2500)
    for name, uid in (("old", "u-old"), ("new", "u-new")):
        body = _body(2, results={"outputBytesPerAction": 64})
        body["metadata"].update(name=name, uid=uid)
        mgr.ensure(body)
        await _until(lambda: mgr.pending_count() == 0)
        await mgr.flush()
    assert mgr.whole_bytes <= 2500
    old, new = await _rows(mgr, "old"), await _rows(mgr, "new")
    assert [r["outputWhole"] for r in old] == [False, False]
    assert all(r["state"] == "Succeeded" and r["output"] == "x" * 64 and r["stdout"] is None for r in old)
    assert [r["outputWhole"] for r in new] == [True, True] and new[1]["stdout"] == out
    # cut to the status's 64 bytes, and capped by the agent, both said
    assert [r["truncated"] for r in old] == [True, True] and [r["truncated"] for r in new] == [False, True]
    await mgr.forget("ns", "new", "u-new")
    assert mgr.whole_bytes == 0


async def test_the_memory_budget_of_whole_outputs_counts_the_memory_they_take() -> None:
    """Whole outputs were counted in characters, which CPython stores in 1, 2 or 4 bytes each: a
    progress bar's blocks (2) or emoji (4) held up to 4 times the results memory an operator was
    given (``TANGRAM_RESULTS_MEMORY_MIB``) before any went. What the kept outputs take in memory
    stays within it."""
    out = "\U0001f600" * 1000  # 1,000 characters, 4,000 bytes of memory

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        await asyncio.sleep(0)
        return ActionOutcome(request.key, Outcome.SUCCEEDED, stdout=out, exit_code=0, attempts=1)

    rec = Recorder()
    budget = 9000
    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete, whole_outputs_bytes=budget)
    mgr.ensure(_body(4))
    await _until(lambda: mgr.pending_count() == 0)
    rows = await _rows(mgr, "b")
    whole = [r for r in rows if r["outputWhole"]]
    assert whole and sum(sys.getsizeof(r["stdout"]) for r in whole) <= mgr.whole_bytes <= budget
    assert [r["outputWhole"] for r in rows] == [False, False, True, True]  # the oldest went


async def test_a_spec_the_models_refuse_is_said_in_the_batchs_status_and_nothing_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the schema cannot check (the spec's size) was raised into kopf, which logged it: the
    batch never had a status, and its author never learned why."""
    # Room for one of the 5 actions beside the spec's defaulted fields (~130 bytes), not for all:
    # under 200 not one fits a batch, which the refusal says instead of "split the actions".
    monkeypatch.setattr(api_actionbatch, "MAX_SPEC_BYTES", 400)
    rec = Recorder()
    mgr = _manager(rec)
    mgr.ensure(_body(5))
    await mgr.flush()
    assert mgr.pending_count() == 0
    (status,) = rec.writes
    (accepted,) = [c for c in status["conditions"] if c["type"] == "Accepted"]
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert "spec.actions" in accepted["message"] and "split the actions" in accepted["message"]
    assert status["observedGeneration"] == 1
    mgr.ensure(_body(5))  # the same object again (a watch event): said once
    await mgr.flush()
    assert len(rec.writes) == 1


async def test_only_the_ttl_of_an_accepted_batch_may_change() -> None:
    rec = Recorder()
    mgr = _manager(rec)
    body = _body(1)
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    changed = _body(2, ttlSecondsAfterFinished=0)
    changed["metadata"]["generation"] = 2
    mgr.ensure(changed)  # an older CRD let the new action in: the accepted one stays the batch
    await mgr.flush()
    batch = mgr._batches[("ns", "b")]
    assert [a.id for a in batch.spec.actions] == ["a0"] and batch.spec.ttl_seconds_after_finished is None
    for generation, ttl_s in ((3, 3600), (4, 0)):
        ttl = _body(1, ttlSecondsAfterFinished=ttl_s)
        ttl["metadata"]["generation"] = generation
        mgr.ensure(ttl)
        await mgr.flush()
        if ttl_s:
            assert rec.writes[-1]["observedGeneration"] == 3 and rec.deleted == []
    assert rec.deleted == [("ns", "b")]


async def test_an_http_action_is_refused_as_unsupported_and_runs_nothing() -> None:
    ran: list[ActionRequest] = []
    rec = Recorder()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        ran.append(request)
        return await Recorder.run(rec, request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete)
    body = _body(1)
    body["spec"]["actions"][0].update(type="http", payload={"runtime": "nodejs", "code": "1"})
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    result = mgr._batches[("ns", "b")].results["a0"]
    assert result.state == "Failed" and result.reason == "UnsupportedType"
    assert ran == []


async def test_a_batch_deleted_by_its_ttl_and_made_again_before_that_is_heard_leaves_nothing() -> None:
    """kopf may hear the new object's event before the old one's deletion, which then no longer
    matches what holds the name: the old batch, deleted by its TTL, had to be ended when it was
    replaced, or its keys and whole outputs (and with them the whole batch) stayed in memory for
    good (outputs of no size, a reward's, never even go past the budget)."""
    rec = Recorder()
    mgr = _manager(rec)
    mgr.ensure(_made_again("u-1") | {"spec": _body(2, ttlSecondsAfterFinished=0)["spec"]})
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    assert rec.deleted == [("ns", "b")]  # written, then deleted by its TTL
    mgr.ensure(_made_again("u-2"))
    await _until(lambda: mgr.pending_count() == 0 and not mgr._ending)
    await mgr.forget("ns", "b", "u-1")  # the old one's deletion, heard late
    assert not [k for k in mgr._by_key if k.startswith("u-1/")]
    assert {b.uid for b, _ in mgr._whole} == {"u-2"}
    await mgr.forget("ns", "b", "u-2")
    assert not mgr._by_key and not mgr._whole and mgr.whole_bytes == 0


async def test_an_action_that_ends_after_its_deleted_batch_was_dropped_keeps_no_output_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deleted batch waits a while for its actions to stop, then drops them; one that ended later
    kept its whole output in the budget's accounts, and the batch with it, for as long as nothing
    pushed it out."""
    monkeypatch.setattr(actionbatch, "STOP_WAIT_S", 0.05)
    stopped = asyncio.Event()

    async def slow(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await stopped.wait()  # stops, but only after the batch's wait is over
            raise
        raise AssertionError("unreachable")

    rec = Recorder()
    mgr = BatchManager(slow, rec.cancel, _python_pool, rec.patch, rec.delete)
    mgr.ensure(_body(1))
    await _until(lambda: bool(mgr._by_key))
    await mgr.forget("ns", "b", "u-1")
    assert not mgr.has("ns", "b")
    stopped.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not mgr._whole and mgr.whole_bytes == 0


@pytest.mark.parametrize(
    ("answer", "state"),
    [
        ({"reward": float("nan")}, "Failed"),
        ({"reward": float("inf")}, "Failed"),
        ({"reward": 0.5, "duration_s": float("nan")}, "Succeeded"),
        ({"reward": 0.5, "duration_s": float("inf"), "queued_s": -3.0}, "Succeeded"),
        ({"reward": 0.5, "duration_s": 1e300, "queued_s": 1e17}, "Succeeded"),
    ],
)
async def test_a_score_or_time_that_is_no_number_still_completes_the_batch_in_valid_json(
    answer: dict[str, Any], state: str
) -> None:
    """A reward server (a custom ``server.image``) answering a NaN or infinite score, or such a
    time: the time made recording the result raise (its action stayed Running, the batch never
    completed), and the score made every status write JSON that the API server refuses (here:
    ``json.dumps(allow_nan=False)``, strict JSON as the API server reads it), for good. The
    score is the result, so its action fails naming it; a time is a measurement, taken as 0.
    A finite time too long for the CRD's int64 milliseconds (1e300 s) was refused the same way
    (422 on the test bed's API server): the written status is checked to hold int64s only."""
    rec = Recorder()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a1"):
            return ActionOutcome(request.key, Outcome.SUCCEEDED, attempts=1, **answer)
        return await rec.run(request, attempts_so_far)

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        rec.writes.append(json.loads(json.dumps(status, allow_nan=False)))
        for result in status["results"]:
            for value in result.values():
                assert not isinstance(value, int) or -(2**63) <= value < 2**63, result

    mgr = BatchManager(run, rec.cancel, _python_pool, patch, rec.delete)
    mgr.ensure(_body(3))
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    assert len(rec.writes) == 1 and _complete(rec.writes[0])
    (a1,) = [r for r in rec.writes[0]["results"] if r["id"] == "a1"]
    assert a1["state"] == state
    if state == "Failed":
        assert a1["reason"] == "SandboxError" and "not a finite number" in a1["output"]
    else:
        assert a1["reward"] == 0.5 and a1["durationMillis"] == 0 and a1["queuedMillis"] == 0
    rows = mgr.results("ns", "b")
    rows_iter = await rows
    assert rows_iter is not None
    json.dumps([row async for row in rows_iter], allow_nan=False)  # the gateway's results, too


async def test_a_batchs_end_and_its_refusal_are_posted_as_events_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch's end showed only in its conditions: nothing that watches Events (``kubectl get
    events``, an alert on Warnings) heard that a batch failed. Its completion is now an Event
    (Warning when an action failed, naming why), as is a spec refused; each once, a restarted
    operator posting none again for a batch whose completed status it reads back."""
    posted: list[tuple[str, str, str, str]] = []

    def emit(namespace: str, name: str, uid: str, event: Event) -> None:
        posted.append((f"{namespace}/{name}", uid, event.type, event.reason))

    rec = Recorder()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a1"):
            return ActionOutcome(request.key, Outcome.FAILED, Reason.NON_ZERO_EXIT, exit_code=3, attempts=1)
        return await rec.run(request, attempts_so_far)

    mgr = BatchManager(run, rec.cancel, _python_pool, rec.patch, rec.delete, emit=emit)
    body = _body(3)
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    await mgr.flush()
    assert posted == [("ns/b", "u-1", "Warning", "SomeFailed")]
    assert completion_event(rec.writes[-1]).message == "2 succeeded, 1 failed, 0 cancelled: 1 NonZeroExit"
    restarted = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete, emit=emit)
    restarted.ensure(_restarted(body, rec.writes[-1]))
    await restarted.flush()
    assert len(posted) == 1

    posted.clear()
    ok = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete, emit=emit)
    ok.ensure(_body(2))
    await _until(lambda: ok.pending_count() == 0)
    await ok.flush()
    assert posted == [("ns/b", "u-1", "Normal", "AllFinished")]

    posted.clear()
    monkeypatch.setattr(api_actionbatch, "MAX_SPEC_BYTES", 200)
    refused = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete, emit=emit)
    refused.ensure(_body(5))
    await refused.flush()
    refused.ensure(_body(5))
    await refused.flush()
    assert posted == [("ns/b", "u-1", "Warning", "InvalidSpec")]


async def test_a_status_write_refused_again_and_again_is_tried_less_often_and_still_lands() -> None:
    """A status write the API server refuses for good (an admission policy, say) was sent again
    every period, each up to a megabyte, for as long as the operator ran. It is now tried again
    after a wait that doubles (up to ``WRITE_BACKOFF_MAX_S``), and once accepted lands whole:
    nothing was lost meanwhile. (The manager's clock is stepped by hand: what is asserted is how
    many writes are tried, not when.)"""
    rec = Recorder()
    tried: list[dict[str, Any]] = []
    refusing = True

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        tried.append(status)
        if refusing:
            raise RuntimeError("admission webhook denied the request")
        rec.writes.append(status)

    mgr = BatchManager(rec.run, rec.cancel, _python_pool, patch, rec.delete)
    now = [1000.0]
    mgr.clock = lambda: now[0]
    mgr.ensure(_body(3))
    await _until(lambda: mgr.pending_count() == 0)
    for _ in range(50):  # 50 periods within the first back-off: one try
        await mgr.flush()
    assert len(tried) == 1
    waits = []
    for _ in range(8):
        before = len(tried)
        step = 0.0
        while len(tried) == before:
            now[0] += 0.5
            step += 0.5
            await mgr.flush()
        waits.append(step)
    assert waits == sorted(waits) and waits[-1] == actionbatch.WRITE_BACKOFF_MAX_S
    refusing = False
    now[0] += actionbatch.WRITE_BACKOFF_MAX_S
    await mgr.flush()
    assert len(rec.writes) == 1 and _complete(rec.writes[0]) and rec.writes[0]["counts"]["succeeded"] == 3
    await mgr.flush()
    assert len(rec.writes) == 1


async def test_a_status_refused_for_what_it_holds_still_says_the_batch_completed_and_why() -> None:
    """A status the API server refuses for what it holds (422: an admission policy, a value its
    schema refuses; etcd's size limit) was only sent again, with back-off, for good: the batch
    kept its last status, never Complete, and nothing said why. Now a status is written meanwhile
    with the counts and conditions (Complete), the results as last accepted (a restarted operator
    still finds them), and ``ResultsRecorded=False`` quoting the answer and naming where the
    results are served; a Warning Event once; not written again while refusals repeat; once the
    full status is accepted, it replaces it."""
    rec = Recorder()
    posted: list[tuple[str, str]] = []
    refusing = False
    release = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a2"):
            await release.wait()
        return await rec.run(request, attempts_so_far)

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        if refusing and any(r["state"] == "Succeeded" for r in status.get("results", ())[2:]):
            raise actionbatch.StatusRefused("422: status.results[2]: Invalid value: denied by policy")
        rec.writes.append(status)

    def emit(namespace: str, name: str, uid: str, event: Event) -> None:
        posted.append((event.type, event.reason))

    mgr = BatchManager(run, rec.cancel, _python_pool, patch, rec.delete, emit=emit)
    now = [1000.0]
    mgr.clock = lambda: now[0]
    mgr.ensure(_body(3))
    await _until(lambda: mgr.pending_count() == 1)
    mgr.started(next(k for k in mgr._by_key if k.endswith("a2")), 1)
    await mgr.flush()
    accepted = rec.writes[-1]["results"]
    assert [r["state"] for r in accepted] == ["Succeeded", "Succeeded", "Running"]
    refusing = True
    release.set()
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    said = rec.writes[-1]
    assert len(rec.writes) == 2 and _complete(said) and said["counts"]["succeeded"] == 3
    assert said["results"] == accepted
    (recorded,) = [c for c in said["conditions"] if c["type"] == "ResultsRecorded"]
    assert recorded["status"] == "False" and recorded["reason"] == "StatusRefused"
    assert "denied by policy" in recorded["message"] and "/v1/batches/ns/b/results" in recorded["message"]
    assert posted == [("Warning", "StatusRefused"), ("Normal", "AllFinished")]
    for _ in range(4):  # refused again after each back-off: nothing new to say
        now[0] += actionbatch.WRITE_BACKOFF_MAX_S
        await mgr.flush()
    assert len(rec.writes) == 2 and len(posted) == 2
    rows = await mgr.results("ns", "b")
    assert rows is not None and [r["state"] async for r in rows] == ["Succeeded"] * 3
    refusing = False
    now[0] += actionbatch.WRITE_BACKOFF_MAX_S
    await mgr.flush()
    full = rec.writes[-1]
    assert [r["state"] for r in full["results"]] == ["Succeeded"] * 3 and _complete(full)
    assert not [c for c in full["conditions"] if c["type"] == "ResultsRecorded"]
    assert len(posted) == 2


async def test_an_edit_of_what_cannot_change_is_refused_in_the_status_naming_the_fields() -> None:
    """The CRD refuses an edit of a batch's actions, retryPolicy or results; a CRD older than that
    rule (Helm never upgrades a chart's CRDs) lets it in, and the operator only logged it: the
    batch said nothing and its observedGeneration lagged for good. It is now refused in the status:
    ``Accepted`` names the fields and the generation (observed), a Warning Event once; the actions
    accepted first are those that run, and an edit back clears it."""
    rec = Recorder()
    posted: list[tuple[str, str, str]] = []

    def emit(namespace: str, name: str, uid: str, event: Event) -> None:
        posted.append((event.type, event.reason, event.message))

    mgr = BatchManager(rec.run, rec.cancel, _python_pool, rec.patch, rec.delete, emit=emit)
    mgr.ensure(_body(1))
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    edited = _body(2, retryPolicy={"maxRetries": 5})
    edited["metadata"]["generation"] = 2
    mgr.ensure(edited)
    mgr.ensure(edited)  # heard again (a resync): said once
    await mgr.flush()
    status = rec.writes[-1]
    (accepted,) = [c for c in status["conditions"] if c["type"] == "Accepted"]
    assert status["observedGeneration"] == 2 and accepted["reason"] == "EditRefused"
    assert (
        "generation 2" in accepted["message"]
        and "spec.actions, spec.retryPolicy changed" in accepted["message"]
    )
    assert [r["id"] for r in status["results"]] == ["a0"] and _complete(status)
    assert [(t, r) for t, r, _ in posted] == [("Normal", "AllFinished"), ("Warning", "EditRefused")]
    assert posted[1][2] == accepted["message"]
    back = _body(1, ttlSecondsAfterFinished=3600)
    back["metadata"]["generation"] = 3
    mgr.ensure(back)
    await mgr.flush()
    status = rec.writes[-1]
    (accepted,) = [c for c in status["conditions"] if c["type"] == "Accepted"]
    assert status["observedGeneration"] == 3 and accepted["reason"] == "Queued"
    assert mgr._batches[("ns", "b")].spec.ttl_seconds_after_finished == 3600


async def test_a_restart_runs_no_action_of_a_complete_batch_whose_result_was_left_out() -> None:
    """Results left out of a complete batch's status (``resultsOmitted``, for its budget) would
    read to a restarted operator as actions never run: it ran them again and the batch reported
    Complete went back to running."""
    rec = Recorder()
    mgr = _manager(rec)
    body = _body(40, results={"budgetBytes": 1024, "outputBytesPerAction": 0})
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    written = rec.writes[-1]
    assert _complete(written) and written["resultsOmitted"] == 40 - len(written["results"]) > 0
    again = Recorder()
    restarted = _manager(again)
    restarted.ensure(_restarted(body, written))
    assert restarted.pending_count() == 0
    await restarted.flush()
    assert again.ran == [] and again.writes == []
    status, _ = restarted.status_of(restarted._batches[("ns", "b")], datetime.now(UTC))
    assert _complete(status) and status["counts"] == written["counts"]
    assert status["resultsOmitted"] == written["resultsOmitted"]
    rows = await _rows(restarted, "b")
    assert [r["state"] for r in rows[len(written["results"]) :]] == ["Unknown"] * written["resultsOmitted"]


async def test_a_restart_runs_no_action_of_a_complete_batch_whose_status_write_was_refused() -> None:
    """A complete batch whose full status the API server refused (``StatusRefused``) holds its
    counts and ``completionTime`` with the results as last accepted: one of them still Running.
    A restarted operator took that action for one not finished and ran it again, and the batch
    its status had called Complete (its completion Event posted) went back to running."""
    rec = Recorder()
    release = asyncio.Event()

    async def run(request: ActionRequest, attempts_so_far: int = 0) -> ActionOutcome:
        if request.key.endswith("a2"):
            await release.wait()
        return await rec.run(request, attempts_so_far)

    async def patch(namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        if any(r["state"] == "Succeeded" for r in status.get("results", ())[2:]):
            raise actionbatch.StatusRefused("422: status.results[2]: Invalid value: denied by policy")
        rec.writes.append(status)

    mgr = BatchManager(run, rec.cancel, _python_pool, patch, rec.delete)
    body = _body(3)
    mgr.ensure(body)
    await _until(lambda: mgr.pending_count() == 1)
    mgr.started(next(k for k in mgr._by_key if k.endswith("a2")), 1)
    await mgr.flush()
    release.set()
    await _until(lambda: mgr.pending_count() == 0)
    await mgr.flush()
    said = rec.writes[-1]
    assert _complete(said) and [r["state"] for r in said["results"]] == ["Succeeded", "Succeeded", "Running"]
    again = Recorder()
    restarted = _manager(again)
    restarted.ensure(_restarted(body, said))
    assert restarted.pending_count() == 0
    await restarted.flush()
    assert again.ran == []
    status, _ = restarted.status_of(restarted._batches[("ns", "b")], datetime.now(UTC))
    assert _complete(status) and status["counts"] == said["counts"]
    rows = await _rows(restarted, "b")
    assert [r["state"] for r in rows] == ["Succeeded", "Succeeded", "Unknown"], rows
