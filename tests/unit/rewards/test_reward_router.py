"""The reward router's retries (no cluster, no server): a replica whose call failed gets no request
until the controller's view drops it or, when it still listened, for a short while; the retries of a
request go to the replacement instead of spending every attempt on the dead replica."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.dispatch.agent import ConnectFailed, Unreachable
from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.dispatch.rewards import RewardRouter
from arl_tangram.domain.actions import ActionOutcome, ActionRequest, Outage, Outcome, Reason
from arl_tangram.domain.services import service_config
from arl_tangram.errors import InfrastructureError, InvalidSpec, NotFound, QueueFull, TargetUnavailable


class FakeReplicas:
    """Score calls by address: each address answers from its script of errors, then scores."""

    def __init__(self, scripts: dict[str, list[Exception]]) -> None:
        self.scripts = scripts
        self.calls: list[str] = []
        self.called = asyncio.Event()

    async def score(self, address: str, service: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
        self.calls.append(address)
        script = self.scripts.get(address, [])
        error = (script.pop(0) if len(script) > 1 else script[0]) if script else None
        self.called.set()
        await asyncio.sleep(0)
        if error is not None:
            raise error
        return {"scores": [0.5], "restore_s": 0.0, "queue_s": 0.0, "exec_s": 0.001}


def _router(client: FakeReplicas, suspect_s: float = 5.0) -> RewardRouter:
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns"},
            "spec": {
                "model": {"name": "m", "uri": "file:///w/rm.npz"},
                "scaling": {"coldStartBudgetSeconds": 5},
            },
        }
    )
    router = RewardRouter(client, suspect_s=suspect_s)  # type: ignore[arg-type]
    router.upsert(service_config(rms, uid="u"))
    return router


def _request(max_retries: int = 3) -> ActionRequest:
    return ActionRequest(
        "b/r0", "ns", "rm", "reward", {"prompt": "p", "response": "r"}, max_retries=max_retries, backoff_s=0.0
    )


async def test_retries_after_a_replica_dies_go_to_its_replacement() -> None:
    # The runtime at A is killed mid-request (the connection is cut), and nothing listens there after.
    dead: list[Exception] = [
        Unreachable("POST http://a/v1/score: ServerDisconnectedError"),
        ConnectFailed("refused", True),
    ]
    client = FakeReplicas({"a:8000": dead})
    router = _router(client)
    router.sync("ns/rm", [("a", "a:8000")])
    task = asyncio.create_task(router.run(_request()))
    await asyncio.wait_for(client.called.wait(), 5)
    # The controller has not seen the pod fail yet: A is still listed for a while.
    await asyncio.sleep(0.2)
    assert not task.done(), await task  # (without the fix: every attempt spent on A at once)
    router.sync("ns/rm", [("b", "b:8000")])  # A's pod failed; its replacement B is ready
    outcome = await asyncio.wait_for(task, 5)
    assert outcome.state is Outcome.SUCCEEDED and outcome.host == "b" and outcome.attempts == 2, outcome
    assert client.calls == ["a:8000", "b:8000"]
    stats = router.stats("ns/rm")
    assert stats is not None and stats.queued == 0 and stats.running == 0


async def test_a_replica_where_nothing_listens_waits_for_the_controllers_view() -> None:
    client = FakeReplicas({"a:8000": [ConnectFailed("refused", True)]})
    router = _router(client, suspect_s=0.05)
    router.sync("ns/rm", [("a", "a:8000"), ("b", "b:8000")])
    first = await router.run(_request())
    assert first.host == "b" and first.attempts == 2, first
    await asyncio.sleep(0.1)  # past suspect_s: a refused replica stays out all the same
    second = await router.run(_request())
    assert second.host == "b" and second.attempts == 1, second
    router.sync("ns/rm", [("a", "a:8001")])  # the controller lists a new address for it
    client.scripts.clear()
    third = await router.run(_request())
    assert third.host == "a" and third.attempts == 1, third


async def test_the_only_replica_is_tried_again_once_its_suspicion_lapses() -> None:
    # A 503 (a backend failed once) on the only replica: after suspect_s it is used again.
    client = FakeReplicas({"a:8000": [InfrastructureError("agent answered 503")]})
    router = _router(client, suspect_s=0.1)
    router.sync("ns/rm", [("a", "a:8000")])

    async def heal() -> None:
        await client.called.wait()
        client.scripts.clear()

    healer = asyncio.create_task(heal())
    outcome = await asyncio.wait_for(router.run(_request()), 5)
    await healer
    assert outcome.state is Outcome.SUCCEEDED and outcome.attempts == 2, outcome
    assert client.calls == ["a:8000", "a:8000"]


class SlowReplica(FakeReplicas):
    """A replica that holds each call until the test lets it answer (or the call is cancelled)."""

    def __init__(self) -> None:
        super().__init__({})
        self.release = asyncio.Event()
        self.aborted = 0

    async def score(self, address: str, service: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
        self.calls.append(address)
        self.called.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.aborted += 1  # the connection closed under the call: what a server sees as an abort
            raise
        return {"scores": [0.5], "restore_s": 0.0, "queue_s": 0.0, "exec_s": 0.001}


async def _call(
    replica: SlowReplica,
    router: RewardRouter,
    run: Callable[[ActionRequest], Coroutine[Any, Any, ActionOutcome]],
) -> asyncio.Task[ActionOutcome]:
    """``run`` a request with ``router``'s one replica, and return once the replica holds its call."""
    router.sync("ns/rm", [("rm-0", "10.0.0.1:8000")])
    running = asyncio.create_task(run(_request()))
    await asyncio.wait_for(replica.called.wait(), 5)
    return running


async def _calling() -> tuple[SlowReplica, RewardRouter, asyncio.Task[ActionOutcome]]:
    """A router whose one replica holds a request's call (``SlowReplica``)."""
    replica = SlowReplica()
    router = _router(replica)
    return replica, router, await _call(replica, router, router.run)


async def test_a_cancelled_request_stops_waiting_for_a_replica_and_frees_its_place() -> None:
    router = _router(FakeReplicas({}))  # no replica yet: the request waits for one (a cold start)
    running = asyncio.create_task(router.run(_request()))
    for _ in range(20):
        await asyncio.sleep(0)
    assert router.stats("ns/rm").queued == 1  # type: ignore[union-attr]
    assert router.cancel("b/r0") is True
    outcome = await asyncio.wait_for(running, 5)
    assert outcome.state is Outcome.CANCELLED and outcome.attempts == 0
    stats = router.stats("ns/rm")
    assert stats is not None and (stats.queued, stats.running) == (0, 0)
    assert router.cancel("b/r0") is False  # nothing under the key any more


async def test_a_cancelled_request_closes_its_call_to_the_replica() -> None:
    replica, router, running = await _calling()
    assert router.stats("ns/rm").running == 1  # type: ignore[union-attr]
    assert router.cancel("b/r0") is True
    outcome = await asyncio.wait_for(running, 5)
    assert outcome.state is Outcome.CANCELLED and replica.aborted == 1
    stats = router.stats("ns/rm")
    assert stats is not None and (stats.queued, stats.running, stats.inflight) == (0, 0, {"rm-0": 0})


async def test_a_replica_taken_off_the_list_finishes_its_calls_and_reports_them_until_done() -> None:
    """A replica drained for a rollout is no longer listed: it gets no new call, its call in flight
    runs to its end (the request succeeds on it), and its count stays in ``stats`` until then, so
    the controller deletes it only once it holds nothing (before, the count went with the listing
    and a drained replica always looked idle)."""
    replica, router, running = await _calling()
    router.sync("ns/rm", [("rm-1", "10.0.0.2:8000")])  # rm-0 drained, its replacement ready
    stats = router.stats("ns/rm")
    assert stats is not None and stats.inflight == {"rm-0": 1, "rm-1": 0}
    second = asyncio.create_task(router.run(_request()))
    for _ in range(20):
        await asyncio.sleep(0)
    assert replica.calls == ["10.0.0.1:8000", "10.0.0.2:8000"]  # the new call went to rm-1
    replica.release.set()
    first = await asyncio.wait_for(running, 5)
    assert first.state is Outcome.SUCCEEDED and first.host == "rm-0" and replica.aborted == 0
    assert (await asyncio.wait_for(second, 5)).host == "rm-1"
    stats = router.stats("ns/rm")
    assert stats is not None and stats.inflight == {"rm-1": 0}


async def test_a_caller_cancelled_cancels_its_request_and_is_cancelled_itself() -> None:
    replica, router, running = await _calling()
    running.cancel()
    try:
        await running
        raise AssertionError("the caller's cancellation was swallowed")
    except asyncio.CancelledError:
        pass
    assert replica.aborted == 1 and router.stats("ns/rm").running == 0  # type: ignore[union-attr]


async def test_a_deleted_services_requests_end_at_once_as_not_found() -> None:
    """As a deleted pool's actions do (PoolNotFound): the one waiting for a replica (it would have
    waited out the cold-start budget, then blamed the replicas) and the one a replica holds (the
    pod goes with the service) end now, ServiceNotFound."""
    replica, router, calling = await _calling()
    waiting = asyncio.create_task(
        router.run(ActionRequest("b/r1", "ns", "rm", "reward", {"prompt": "p", "response": "r"}))
    )
    router.sync("ns/rm", [])  # its replica went first: the second request waits for one
    for _ in range(20):
        await asyncio.sleep(0)
    router.remove("ns/rm")
    for task in (calling, waiting):
        outcome = await asyncio.wait_for(task, 5)
        assert (outcome.state, outcome.reason) == (Outcome.FAILED, Reason.SERVICE_NOT_FOUND), outcome
        assert "ns/rm was deleted" in (outcome.message or "")
    assert replica.aborted == 1  # its call was closed
    assert router.cancel("b/r0") is False and router.cancel("b/r1") is False


async def test_the_dispatcher_cancels_a_reward_action_by_its_key() -> None:
    """What the gateway does for a keyless caller that left (``abandoned``) or a batch deleted."""
    replica = SlowReplica()
    dispatcher = Dispatcher(replica)  # type: ignore[arg-type]
    dispatcher.rewards = _router(replica)
    running = await _call(replica, dispatcher.rewards, dispatcher.run)
    assert await dispatcher.cancel("b/r0") is True
    outcome = await asyncio.wait_for(running, 5)
    assert outcome.state is Outcome.CANCELLED and replica.aborted == 1
    assert await dispatcher.cancel("b/r0") is False


async def test_an_outage_refuses_what_waits_for_a_replica_and_what_comes_after() -> None:
    """A service with no replica coming (``service_outage``): a request waiting through its cold
    start is refused with the reason, as is a new one; through the dispatcher, as
    ``TargetUnavailable`` with when to send again."""
    why = "RewardModelService ns/rm has no replica: replica rm-1 cannot start: ImagePullBackOff"
    dispatcher = Dispatcher(FakeReplicas({}))  # type: ignore[arg-type]
    dispatcher.rewards = _router(FakeReplicas({}))
    waiting = asyncio.create_task(dispatcher.run(_request()))
    for _ in range(20):
        await asyncio.sleep(0)
    assert dispatcher.rewards.stats("ns/rm").queued == 1  # type: ignore[union-attr]
    dispatcher.rewards.set_outage("ns/rm", Outage(why, 30.0))
    with pytest.raises(TargetUnavailable) as refused:
        await asyncio.wait_for(waiting, 5)
    assert str(refused.value) == why and refused.value.delay == 30.0
    with pytest.raises(TargetUnavailable):
        await asyncio.wait_for(dispatcher.run(_request()), 5)
    assert dispatcher.rewards.stats("ns/rm").queued == 0  # type: ignore[union-attr]
    # A replica comes: the outage is over and the same request is scored.
    dispatcher.rewards.set_outage("ns/rm", None)
    dispatcher.rewards.sync("ns/rm", [("rm-2", "10.0.0.2:8000")])
    outcome = await asyncio.wait_for(dispatcher.run(_request()), 5)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward == 0.5


async def test_requests_of_one_turn_of_the_loop_are_bounded_by_the_queue_length() -> None:
    """``maxQueueLength`` holds for requests that all arrive at once (each took its place in the
    queue only once its own task ran, and every one of them passed the check)."""
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "ns"},
            "spec": {"model": {"name": "m", "uri": "file:///w/rm.npz"}, "scaling": {"maxQueueLength": 2}},
        }
    )
    router = RewardRouter(FakeReplicas({}))  # type: ignore[arg-type]
    router.upsert(service_config(rms, uid="u"))
    calls = [asyncio.create_task(router.run(_request())) for _ in range(10)]
    for _ in range(20):
        await asyncio.sleep(0)
    refused = [c for c in calls if c.done() and isinstance(c.exception(), QueueFull)]
    assert len(refused) == 8 and router.stats("ns/rm").queued == 2  # type: ignore[union-attr]
    for c in calls:
        c.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert router.stats("ns/rm").queued == 0  # type: ignore[union-attr]


async def test_a_request_cancelled_before_its_task_ran_gives_its_place_back() -> None:
    router = _router(FakeReplicas({}))
    call = asyncio.create_task(router.run(_request()))
    await asyncio.sleep(0)  # run() has taken its place and made its task, which has not run yet
    assert router.cancel("b/r0") is True
    outcome = await asyncio.wait_for(call, 5)
    assert outcome.state is Outcome.CANCELLED and router.stats("ns/rm").queued == 0  # type: ignore[union-attr]


def _service(name: str, model: str, namespace: str = "ns") -> Any:
    rms = RewardModelService.model_validate(
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"name": model, "uri": "file:///w/rm.npz"}},
        }
    )
    return service_config(rms, uid=f"u-{name}")


def test_a_service_is_named_by_its_own_name_or_by_the_model_it_serves() -> None:
    """vLLM and SGLang clients name the served model in ``model`` (verl sends the model's path or
    Hugging Face id): the gateway refused such names (422) before any service was looked up."""
    router = RewardRouter(FakeReplicas({}))  # type: ignore[arg-type]
    router.upsert(_service("rm", "Org/Reward-Model-0.6B"))
    router.upsert(_service("judge-a", "Org/Judge"))
    router.upsert(_service("judge-b", "Org/Judge"))
    router.upsert(_service("elsewhere", "Org/Other", namespace="other"))

    def target(name: str) -> str:
        return router.resolve(ActionRequest("k", "ns", name, "reward", {})).target

    assert target("rm") == "rm"
    assert target("Org/Reward-Model-0.6B") == "rm"
    # A valid name nobody is known by yet is kept: the dispatcher may learn a service just created.
    assert target("new-service") == "new-service"
    with pytest.raises(InvalidSpec, match="judge-a, judge-b") as ambiguous:
        target("Org/Judge")
    assert ambiguous.value.field == "model"
    # A model served only in another namespace, or by nobody, is named with what is served here.
    for unknown in ("Org/Other", "/models/local-path"):
        with pytest.raises(NotFound, match=r"served there: Org/Judge, Org/Reward-Model-0.6B\)"):
            target(unknown)


async def test_the_dispatcher_serves_a_request_naming_the_model() -> None:
    client = FakeReplicas({})
    dispatcher = Dispatcher(client)  # type: ignore[arg-type]
    dispatcher.rewards = RewardRouter(client)  # type: ignore[arg-type]
    dispatcher.rewards.upsert(_service("rm", "Org/Reward-Model-0.6B"))
    dispatcher.rewards.sync("ns/rm", [("a", "a:8000")])
    request = ActionRequest("k", "ns", "Org/Reward-Model-0.6B", "reward", {"prompt": "p", "response": "r"})
    outcome = await asyncio.wait_for(dispatcher.run(request), 5)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward == 0.5 and client.calls == ["a:8000"]


class AnswersOf(FakeReplicas):
    """Each call answers the next body of ``bodies`` (the last one from then on)."""

    def __init__(self, bodies: list[dict[str, Any]]) -> None:
        super().__init__({})
        self.bodies = bodies

    async def score(self, address: str, service: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
        self.calls.append(address)
        return self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]


@pytest.mark.parametrize("score", [float("nan"), float("inf"), float("-inf"), True, "0.5", None])
async def test_a_score_that_is_no_number_is_no_reward(score: object) -> None:
    """A custom server's (``server.image``) NaN became the action's reward, and invalid JSON in
    every answer and batch status that carried it: it is a replica that answered without a score
    (tried again; the next answer is the reward)."""
    client = AnswersOf([{"scores": [score]}, {"scores": [0.25]}])
    router = _router(client, suspect_s=0.01)  # the only replica: tried again once its suspicion lapses
    router.sync("ns/rm", [("a", "a:8000")])
    outcome = await asyncio.wait_for(router.run(_request()), 10)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward == 0.25 and outcome.attempts == 2, outcome


@pytest.mark.parametrize("seconds", ["abc", float("nan"), -1.0, [1]])
async def test_times_a_replica_reports_that_are_no_seconds_are_not_taken(seconds: object) -> None:
    """A string raised out of the action; NaN went into its status."""
    client = AnswersOf([{"scores": [0.5], "exec_s": seconds, "queue_s": seconds, "restore_s": seconds}])
    router = _router(client)
    router.sync("ns/rm", [("a", "a:8000")])
    outcome = await asyncio.wait_for(router.run(_request()), 10)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward == 0.5, outcome
    assert outcome.duration_s >= 0 and outcome.queued_s >= 0 and outcome.message is None, outcome


@pytest.mark.parametrize("scores", [[0.1, 0.9], [0.1, 0.1], []])
async def test_more_or_fewer_scores_than_the_one_input_are_no_reward(scores: list[float]) -> None:
    """One input goes to the replica; an answer with two scores used to give the first as the
    reward, though it may be another input's (a custom server's batch mixed up)."""
    client = AnswersOf([{"scores": scores}, {"scores": [0.25]}])
    router = _router(client, suspect_s=0.01)  # the only replica: tried again once its suspicion lapses
    router.sync("ns/rm", [("a", "a:8000")])
    outcome = await asyncio.wait_for(router.run(_request()), 10)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward == 0.25 and outcome.attempts == 2, outcome


class BadAt(FakeReplicas):
    """Replica ``bad`` answers 200 with NaN for a score, every time; the others score."""

    def __init__(self, bad: str) -> None:
        super().__init__({})
        self.bad = bad

    async def score(self, address: str, service: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
        self.calls.append(address)
        return {"scores": [float("nan") if address == self.bad else 0.5]}


async def test_a_replica_that_answers_without_a_score_is_suspect_as_one_that_fails() -> None:
    """A replica answering 200 without a valid score is treated as one answering 503: its request
    is retried on another replica, and the next requests go elsewhere while it is suspect. It was
    retried at once, with no backoff, on the same (least busy) replica, until the attempts ran out."""
    client = BadAt("a:8000")
    router = _router(client)
    router.sync("ns/rm", [("a", "a:8000"), ("b", "b:8000")])
    first = await asyncio.wait_for(router.run(_request()), 10)
    assert first.state is Outcome.SUCCEEDED and first.host == "b" and first.attempts == 2, first
    second = await asyncio.wait_for(router.run(_request()), 10)
    assert second.host == "b" and second.attempts == 1, second
    assert client.calls == ["a:8000", "b:8000", "b:8000"]
