"""Trainers against ``tangram up``: the examples' call paths (examples/*/check.py: the requests verl,
OpenRLHF and slime make) and the client library (sync and async: code, streams, sessions, rewards)
work against the embedded gateway exactly as against a cluster's, without a token."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from up_harness import Up, pool_doc, tangram_up, wait_until

from arl_tangram.client import AsyncTangramClient, TangramClient, code_action
from arl_tangram.rewards.builtin import BuiltinScorer, write_model

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SERVED = "Org/Reward-Model-0.6B"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("rm") / "rm.npz", buckets=512, dim=8, seed=5)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Up]:
    specs = tmp_path_factory.mktemp("specs")
    service = {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "RewardModelService",
        "metadata": {"name": "rm"},
        # Served under a Hugging Face id, as vLLM and SGLang clients name it in ``model``.
        "spec": {"model": {"name": SERVED, "uri": f"file://{model}"}, "gpu": {"memory": "64Mi"}},
    }
    (specs / "all.yaml").write_text(yaml.safe_dump_all([pool_doc(), service]))
    with tangram_up(specs / "all.yaml") as running:
        wait_until(lambda: running.pools()["default/py"]["status"]["hostsReady"] == 1, 60, "the host")
        yield running


@pytest.mark.parametrize(
    ("trainer", "path"),
    [("verl", "/run_code?pool=py"), ("openrlhf", "/get_reward?pool=py"), ("slime", "/slime/reward?pool=py")],
)
def test_the_examples_call_paths_work_against_tangram_up(up: Up, trainer: str, path: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / trainer / "check.py"), up.url + path],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_sync_client(up: Up, model: Path) -> None:
    with TangramClient(up.url, namespace="default", pool="py", token="") as client:
        results = list(client.run_many(code_action(f"print({i} * {i})") for i in range(6)))
        assert sorted(r.stdout for r in results) == sorted(f"{i * i}\n" for i in range(6))
        assert all(r.ok for r in results)
        items = [{"prompt": "2+2=", "response": "4"}, {"prompt": "2+2=", "response": "5"}]
        scorer = BuiltinScorer.from_file(model)
        scorer.restore()
        assert client.score(items, service="rm") == [float(x) for x in scorer.score(["2+2=4", "2+2=5"])]


def test_the_async_client_with_sessions(up: Up) -> None:
    async def trajectory(client: AsyncTangramClient, i: int) -> str:
        async with client.session() as session:
            await session.run_code(f"open('n', 'w').write('{i}')")
            result = await session.run_code("print(open('n').read())")
            return result.stdout

    async def main() -> list[str]:
        async with AsyncTangramClient(up.url, namespace="default", pool="py", token="") as client:
            return list(await asyncio.gather(*(trajectory(client, i) for i in range(4))))

    assert asyncio.run(main()) == [f"{i}\n" for i in range(4)]


def test_vllm_and_sglang_clients_name_the_service_by_its_model(up: Up, model: Path) -> None:
    """verl's reward loop as it posts to a vLLM or SGLang reward server: ``model`` is the served
    model's name (a Hugging Face id or path, refused with 422 before), the score read from the
    last element of ``probs`` (vLLM ``/classify``) or ``embedding`` (SGLang ``/v1/embeddings``)."""
    scorer = BuiltinScorer.from_file(model)
    scorer.restore()
    text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"
    want = float(scorer.score([text])[0])
    vllm = requests.post(
        up.url + "/classify", json={"model": SERVED, "input": text, "activation": False}, timeout=60
    )
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["data"][-1]["probs"][-1] == want and vllm.json()["model"] == SERVED
    sglang = requests.post(up.url + "/v1/embeddings", json={"model": SERVED, "input": text}, timeout=60)
    assert sglang.status_code == 200, sglang.text
    assert sglang.json()["data"][-1]["embedding"][-1] == want and sglang.json()["object"] == "list"
    by_name = requests.post(up.url + "/v1/embeddings", json={"model": "rm", "input": [text, "x"]}, timeout=60)
    assert [d["embedding"][-1] for d in by_name.json()["data"]] == [want, float(scorer.score(["x"])[0])]
    # A model nobody serves is named, with what is served (as vLLM's 404 for an unknown model).
    unknown = requests.post(up.url + "/classify", json={"model": "/models/other", "input": text}, timeout=60)
    assert unknown.status_code == 404 and SERVED in unknown.json()["error"], unknown.text
