"""A trainer's cancel of a reward action in the embedded mode: ``tangram up``'s ActionService stops
it as the operator's does (its dispatcher asks its reward router for a key it runs no job under), so
``POST /v1/actions:cancel`` works for reward requests in both. Against the real reward runtime
process, whose batching holds a lone request (``maxWaitMillis``) long enough to be cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.dispatch.dispatcher import Dispatcher
from arl_tangram.domain.actions import ActionRequest, Outcome, Reason
from arl_tangram.embedded.rewards import LocalRewards
from arl_tangram.embedded.up import EmbeddedService
from arl_tangram.rewards.builtin import write_model


def _reward(key: str) -> ActionRequest:
    return ActionRequest(
        key=key, namespace="default", target="rm", kind="reward", payload={"prompt": "2+2=", "response": "4"}
    )


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[EmbeddedService]:
    model = write_model(tmp_path / "rm.npz", buckets=1024, dim=16, seed=3)
    svc = RewardModelService.model_validate(
        {
            "metadata": {"name": "rm", "namespace": "default"},
            "spec": {
                "model": {"name": "rm", "uri": f"file://{model}"},
                "server": {"runtime": "builtin"},
                # A lone request waits for its batch to fill for as long as the runtime allows:
                # long enough to be cancelled while it is being scored.
                "batching": {"maxBatchSize": 4096, "maxWaitMillis": 10000},
            },
        }
    )
    rewards, _ = LocalRewards.plan([svc], tmp_path)
    agent = AgentClient()
    await rewards.start()
    try:
        yield EmbeddedService(Dispatcher(agent), rewards)
    finally:
        await rewards.stop()
        await agent.close()


async def test_a_reward_action_being_scored_is_cancelled_by_its_key(service: EmbeddedService) -> None:
    scoring = asyncio.create_task(service.run(_reward("r-1")))
    await asyncio.sleep(0)  # it begins: sent to the reward runtime, which holds it for its batch
    assert await service.cancel("r-1")
    outcome = await asyncio.wait_for(scoring, 30)
    assert (outcome.key, outcome.state, outcome.reason) == ("r-1", Outcome.CANCELLED, Reason.CANCELLED)
    # Nothing runs under the key any more; another key is not stopped by it.
    assert not await service.cancel("r-1")
    assert not await service.cancel("unknown")


async def test_a_cancelled_reward_leaves_others_scored(service: EmbeddedService) -> None:
    kept = asyncio.create_task(service.run(_reward("keep")))
    dropped = asyncio.create_task(service.run(_reward("drop")))
    await asyncio.sleep(0)
    assert await service.cancel("drop")
    assert (await asyncio.wait_for(dropped, 30)).state is Outcome.CANCELLED
    outcome = await asyncio.wait_for(kept, 30)  # its batch is scored once the runtime's wait ends
    assert outcome.state is Outcome.SUCCEEDED and outcome.reward is not None
