"""The examples' trainer-side call paths (examples/*/check.py: the requests verl, OpenRLHF and
slime make, reimplemented from their documented shapes) against an authenticating gateway, with
the ServiceAccount token carried in the URL as the examples' README says."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gateway_harness import NS, POOL, SERVICE, Gateway, serve_gateway, serve_reviews, start_reward_runtime
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.gateway import GatewayConfig, KubernetesAuthenticator
from arl_tangram.gateway.review_server import ReviewServer, StandInToken, api_client_for, stand_in_jwt

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
USER = "system:serviceaccount:team-a:trainer"
TOKEN = stand_in_jwt(USER)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    hosts: list[Agent] = [start_agent(tmp_path_factory.mktemp("exhost") / "work")]
    reviews = ReviewServer(tokens={TOKEN: StandInToken(USER, ("tangram-gateway",))})
    reviews.grant(USER, [NS])
    config = GatewayConfig(default_namespace="default", default_services={NS: SERVICE})
    try:
        with serve_reviews(reviews) as url, start_reward_runtime(tmp_path_factory.mktemp("rm")) as rewards:
            auth = KubernetesAuthenticator(api_client_for(url), "tangram-gateway")
            with serve_gateway(hosts, auth=auth, config=config, rewards=rewards) as gw:
                yield gw
    finally:
        stop_agent(hosts[0])


def _check(trainer: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / trainer / "check.py"), url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _with_token(gw: Gateway, path: str, token: str = TOKEN) -> str:
    return gw.url.replace("http://", f"http://tangram:{token}@") + path


@pytest.mark.parametrize(
    ("trainer", "path"),
    [
        ("verl", f"/run_code?namespace={NS}&pool={POOL}"),
        ("openrlhf", f"/get_reward?namespace={NS}&pool={POOL}"),
        ("slime", f"/slime/reward?namespace={NS}&pool={POOL}"),
    ],
)
def test_the_trainer_call_path_works_through_the_gateway(gateway: Gateway, trainer: str, path: str) -> None:
    done = _check(trainer, _with_token(gateway, path))
    assert done.returncode == 0, done.stdout + done.stderr
    refused = _check(trainer, _with_token(gateway, path, "not-a-token"))
    assert refused.returncode != 0 and "401" in refused.stderr


def test_openrlhf_against_a_reward_model_service(gateway: Gateway) -> None:
    """The model-based door of the same path: a real reward runtime scores prompt + response."""
    url = _with_token(gateway, f"/get_reward?namespace={NS}")
    body = {
        "query": ["q: colour? a: blue", "q: colour? a: red"],
        "prompts": ["q: colour? a:"] * 2,
        "labels": ["blue"] * 2,
    }
    resp = requests.post(url, json=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert gateway.rewards is not None
    want = gateway.rewards.expected(body["query"])
    assert resp.status_code == 200 and resp.json()["rewards"] == want
