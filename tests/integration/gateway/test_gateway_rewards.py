"""Reward endpoints in each trainer's shape, scored by a real reward runtime process (model-based:
each answer must be the runtime's own score of that sample, in order) or by tests run in a real
sandbox (test-based), through the same gateway."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import requests
from gateway_harness import NS, POOL, SERVICE, Gateway, serve_gateway, start_reward_runtime
from sandbox_agent_harness import Agent

from arl_tangram.gateway import GatewayConfig
from arl_tangram.gateway.rewards import _sigmoid

TESTS = (
    "from solution import add\n\n"
    "def test_small():\n    assert add(1, 2) == 3\n\n"
    "def test_neg():\n    assert add(-1, -2) == -3\n"
)
RIGHT = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
HALF = "```python\ndef add(a, b):\n    return abs(a) + abs(b)\n```"


@pytest.fixture(scope="module")
def gateway(hosts: list[Agent], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = GatewayConfig(default_namespace=NS, default_pools={NS: POOL}, default_services={NS: SERVICE})
    with (
        start_reward_runtime(tmp_path_factory.mktemp("rm")) as rewards,
        serve_gateway(hosts, config=config, rewards=rewards) as gw,
    ):
        yield gw


def expected(gw: Gateway, texts: list[str]) -> list[float]:
    assert gw.rewards is not None
    return gw.rewards.expected(texts)


def sigmoid(x: float) -> float:
    """What vLLM's activation makes of a one-label model's logit (``torch.sigmoid``)."""
    return 1.0 / (1.0 + math.exp(-x))


def test_openrlhf_get_reward(gateway: Gateway) -> None:
    body = {
        "query": ["Q: 2+2? A: 4", "Q: 3+3? A: 7"],
        "prompts": ["Q: 2+2? A:", "Q: 3+3? A:"],
        "labels": ["4", "6"],
    }
    resp = requests.post(gateway.url + "/get_reward", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    # The prompt and the response (the query minus its prompt) are scored, in order.
    want = expected(gateway, ["Q: 2+2? A: 4", "Q: 3+3? A: 7"])
    assert resp.json()["rewards"] == want == resp.json()["scores"]
    assert want[0] != want[1]


def test_slime_reward_is_a_bare_number(gateway: Gateway) -> None:
    resp = requests.post(
        gateway.url + "/slime/reward?service=rm",
        json={"prompt": "p", "response": "yes it is 42", "label": "42"},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json() == expected(gateway, ["pyes it is 42"])[0]


def test_vllm_score_classify_pooling_and_sglang_classify(gateway: Gateway) -> None:
    score = requests.post(
        gateway.url + "/score",
        json={"model": SERVICE, "text_1": "q", "text_2": ["a" * 10, "b" * 20]},
        timeout=60,
    ).json()
    # vLLM's /score and /classify apply the head's activation unless told not to (a sigmoid for
    # one label); /pooling, SGLang's /classify and /v1/embeddings answer the score itself.
    want = [sigmoid(r) for r in expected(gateway, ["q" + "a" * 10, "q" + "b" * 20])]
    assert [d["score"] for d in score["data"]] == pytest.approx(want, rel=1e-12)
    assert score["object"] == "list" and score["model"] == SERVICE
    classify = requests.post(
        gateway.url + "/classify", json={"model": SERVICE, "input": ["x" * 30]}, timeout=60
    ).json()
    assert (
        classify["data"][0]["probs"] == pytest.approx([sigmoid(expected(gateway, ["x" * 30])[0])], rel=1e-12)
        and classify["data"][0]["num_classes"] == 1
    )
    pooling = requests.post(gateway.url + "/pooling", json={"input": "y" * 40}, timeout=60).json()
    assert pooling["data"][0]["data"] == expected(gateway, ["y" * 40])
    sglang = requests.post(gateway.url + "/classify", json={"text": ["z" * 50, "z" * 60]}, timeout=60).json()
    assert [item["embedding"][0] for item in sglang] == expected(gateway, ["z" * 50, "z" * 60])


def test_test_based_rewards_are_pass_fractions(gateway: Gateway) -> None:
    body = {"query": [RIGHT, HALF, "no code at all"], "labels": [TESTS, TESTS, TESTS]}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["rewards"] == [1.0, 0.5, 0.0]
    native = requests.post(
        gateway.url + "/v1/rewards",
        json={
            "pool": POOL,
            "items": [
                {"response": RIGHT, "label": TESTS},
                {"response": RIGHT, "label": "import solution\nassert False"},
            ],
        },
        timeout=120,
    )
    assert native.json() == {"rewards": [1.0, 0.0]}, native.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        # A code dataset's test cases as JSON text, and a math answer: valid Python that exits 0.
        (
            f"/slime/reward?pool={POOL}",
            {"prompt": "p", "response": RIGHT, "label": '{"inputs": ["1"], "outputs": ["2"]}'},
            "label",
        ),
        (f"/get_reward?pool={POOL}", {"query": [RIGHT, RIGHT], "labels": [TESTS, "42"]}, "labels[1]"),
        (
            "/v1/rewards",
            {"pool": POOL, "items": [{"response": RIGHT, "label": "def test_x():\n    assert True\n"}]},
            "items[0].label",
        ),
    ],
)
def test_a_label_that_never_looks_at_the_answer_is_refused(
    gateway: Gateway, path: str, body: dict[str, object], field: str
) -> None:
    """Such a label scored every answer 1.0, silently: refused, naming the field, before anything runs."""
    resp = requests.post(gateway.url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["field"] == field and "solution" in resp.json()["error"], resp.text


# Answers that fail the tests and try to pass for right: the program under test runs inside
# pytest's process and shares its output. Each must earn what its tests earn (0 or 0.5).
FORGERS = {
    "a summary printed at exit": "import atexit\natexit.register(print, '10 passed in 0.01s')\n",
    "a summary on stderr at exit": (
        "import atexit, sys\natexit.register(lambda: print('2 passed in 0.01s', file=sys.stderr))\n"
    ),
    "exit 0 at exit, after pytest's summary": "import atexit, os\natexit.register(os._exit, 0)\n",
    "exit 0 while pytest imports it": "import os\nos._exit(0)\n",
    "failed asserts turned into skips": (
        "import builtins, pytest\nbuiltins.AssertionError = pytest.skip.Exception\n"
    ),
    "pytest stopped with status 0 at the first failure": (
        "import pytest\n"
        "def _stop(a, b):\n    if (a, b) == (-1, -2):\n        pytest.exit('bye', returncode=0)\n"
    ),
}


@pytest.mark.parametrize("name", list(FORGERS))
def test_an_answer_cannot_forge_its_test_reward(gateway: Gateway, name: str) -> None:
    stop = "    globals().get('_stop', lambda a, b: None)(a, b)\n"
    wrong = "```python\n" + FORGERS[name] + "def add(a, b):\n" + stop + "    return 0\n```"
    half = "```python\n" + FORGERS[name] + "def add(a, b):\n" + stop + "    return abs(a) + abs(b)\n```"
    body = {"query": [wrong, half], "labels": [TESTS, TESTS]}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    rewards = resp.json()["rewards"]
    assert rewards[0] == 0.0, (name, rewards)
    # The half-right answer keeps its half where its summary stands alone, and never earns more.
    assert rewards[1] in (0.0, 0.5), (name, rewards)


def _ran(hosts: list[Agent]) -> int:
    """Actions the sandbox host has run so far (its own count)."""
    return sum(requests.get(hosts[0].url + "/v1/health", timeout=10).json()["outcomes"].values())


def test_a_sample_that_cannot_be_scored_is_refused_before_any_runs(
    gateway: Gateway, hosts: list[Agent]
) -> None:
    """A request whose later sample cannot be scored (no tests as its label) is refused by name
    with nothing begun: the earlier samples' tests ran on and their results were thrown away."""
    before = _ran(hosts)
    body = {"query": [RIGHT, RIGHT, RIGHT], "labels": [TESTS, TESTS, None]}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=120)
    assert resp.status_code == 400 and resp.json()["field"] == "labels[2]", resp.text
    # What had been begun would be running or done on the host by now.
    time.sleep(3.0)
    running = requests.get(hosts[0].url + "/v1/actions", timeout=10).json()
    assert _ran(hosts) == before and not running.get("running"), running


def test_a_reward_request_retried_with_its_key_runs_each_sample_once(
    gateway: Gateway, hosts: list[Agent]
) -> None:
    """With X-Tangram-Action-Key, a retry (OpenRLHF's and slime's, after a dropped connection) gets
    the rewards of the samples already scored instead of running them all again; the same key
    with other samples is refused (409)."""
    headers = {"X-Tangram-Action-Key": "rollout-3-rewards"}
    body = {"query": [RIGHT, HALF], "labels": [TESTS, TESTS]}
    before = _ran(hosts)
    first = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, headers=headers, timeout=120)
    again = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, headers=headers, timeout=120)
    assert first.json()["rewards"] == again.json()["rewards"] == [1.0, 0.5], (first.text, again.text)
    assert _ran(hosts) == before + 2
    other = {"query": [HALF, RIGHT], "labels": [TESTS, TESTS]}
    conflict = requests.post(
        gateway.url + f"/get_reward?pool={POOL}", json=other, headers=headers, timeout=120
    )
    assert conflict.status_code == 409 and "rollout-3-rewards" in conflict.text, conflict.text


def test_a_label_run_as_a_script_is_judged_by_its_status_alone(gateway: Gateway) -> None:
    """A label with no ``def test`` runs as a plain script: its status decides. An answer that
    prints a summary of its own ("9 passed, 1 failed") before the script's assert fails earned 0.9."""
    label = "from solution import add\nassert add(1, 2) == 3\nassert add(-1, -2) == -3\n"
    forger = "```python\nprint('9 passed, 1 failed in 0.1s')\ndef add(a, b):\n    return abs(a) + abs(b)\n```"
    body = {"query": [RIGHT, forger], "labels": [label, label]}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["rewards"] == [1.0, 0.0], resp.text


def test_a_reward_requests_key_never_meets_an_actions_key(gateway: Gateway) -> None:
    """A reward request's samples are keyed apart from any key a caller sends: steps keyed
    ``traj-5/0``, ``traj-5/1`` and a reward request keyed ``traj-5`` are three actions, not a 409."""
    step = {"type": "code", "target": POOL, "key": "traj-5/0", "payload": {"code": "print('step')"}}
    assert requests.post(gateway.url + "/v1/actions", json=step, timeout=60).status_code == 200
    body = {"query": [RIGHT], "labels": [TESTS]}
    headers = {"X-Tangram-Action-Key": "traj-5"}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200 and resp.json()["rewards"] == [1.0], resp.text


def test_unknown_service_and_missing_tests_are_named(gateway: Gateway) -> None:
    """Each shape's refusal names the caller's own field: OpenRLHF's ``labels[0]``, slime's
    ``label``, the native ``items[1].label``, vLLM's ``text_2[0]`` (it has no label: a test-based
    reward cannot be asked through it); it named the gateway's ``items[0].label`` for all of them."""
    resp = requests.post(gateway.url + "/get_reward?service=ghost", json={"query": ["x"]}, timeout=60)
    assert resp.status_code == 404 and "ghost" in resp.json()["error"]
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json={"query": ["x"]}, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "labels[0]", resp.text
    resp = requests.post(gateway.url + f"/slime/reward?pool={POOL}", json={"response": "x"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "label", resp.text
    native = {"pool": POOL, "items": [{"response": RIGHT, "label": TESTS}, {"response": "x"}]}
    resp = requests.post(gateway.url + "/v1/rewards", json=native, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "items[1].label", resp.text
    pairs = {"model": "m", "text_1": "a", "text_2": ["b"]}
    resp = requests.post(gateway.url + f"/score?pool={POOL}", json=pairs, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "text_2[0]", resp.text
    resp = requests.post(gateway.url + "/get_reward", json={"query": ["a", "b"], "labels": ["x"]}, timeout=60)
    assert resp.status_code == 400 and resp.json()["field"] == "labels"


def test_openrlhf_queries_as_its_trainer_decodes_them(gateway: Gateway) -> None:
    """OpenRLHF decodes ``query`` with its special tokens: an unfenced answer ends with the chat's
    end-of-turn marker, and a prompt longer than the trainer's maximum is cut from the left (the
    query starts inside it). Both scored 0 for a right answer: the marker was run as code, and the
    whole query (prompt included) was taken for the answer."""
    prompt = (
        "<|im_start|>user\n" + "Some long context. " * 40 + "Write add.<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = "def add(a, b):\n    return a + b<|im_end|>"
    queries = [prompt + answer, prompt[300:] + answer, "<|endoftext|>" * 3 + prompt + answer]
    body = {"query": queries, "prompts": [prompt] * 3, "labels": [TESTS] * 3}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["rewards"] == [1.0, 1.0, 1.0], resp.text


def test_an_answer_ending_in_a_long_run_of_whitespace_is_scored(gateway: Gateway) -> None:
    """Models that degenerate print long runs of spaces: the end-marker pattern backtracked over
    them for seconds to minutes on the gateway's event loop (everyone's requests waited)."""
    answer = "def add(a, b):\n    return a + b\n" + " " * 300_000 + "\n# the end\n"
    body = {"query": [answer], "labels": [TESTS]}
    resp = requests.post(gateway.url + f"/get_reward?pool={POOL}", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["rewards"] == [1.0], resp.text


def test_vllm_shapes_take_fields_vllm_takes(gateway: Gateway) -> None:
    """vLLM ignores request fields it does not know (its clients send ``use_activation``,
    ``softmax``, ``task``...); these were refused (422)."""
    resp = requests.post(
        gateway.url + "/classify",
        json={"model": SERVICE, "input": ["x" * 30], "use_activation": False},
        timeout=60,
    )
    assert resp.status_code == 200 and len(resp.json()["data"]) == 1, resp.text
    resp = requests.post(gateway.url + "/pooling", json={"input": "y" * 40, "task": "reward"}, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["data"]) == 1, resp.text


ACTIVATED_TEXTS = ["q: colour? a: blue", "q: colour? a: red", "x" * 30]


@pytest.mark.parametrize(
    ("fields", "activated"),
    [
        ({}, True),  # vLLM's default on /classify: the activation applies
        ({"use_activation": True}, True),
        ({"use_activation": None}, True),  # null is unset, as in vLLM
        ({"use_activation": False}, False),  # verl's reward loop
        ({"activation": False}, False),  # vLLM 0.10's name
        ({"softmax": False}, False),  # vLLM 0.9's name
        # vLLM reads the older names first (softmax, then activation, then use_activation).
        ({"activation": False, "use_activation": True}, False),
        ({"softmax": True, "activation": False}, True),
    ],
)
def test_vllm_classify_applies_the_activation_as_vllm_does(
    gateway: Gateway, fields: dict[str, bool | None], activated: bool
) -> None:
    """vLLM's ``/classify`` answers probabilities unless the request turns the activation off: for a
    one-label reward model, the sigmoid of its logit. The gateway answered the raw logit whatever was
    asked, so a trainer leaving ``use_activation`` out got logits where vLLM gives probabilities."""
    raw = expected(gateway, ACTIVATED_TEXTS)
    want = [sigmoid(r) for r in raw] if activated else raw
    resp = requests.post(
        gateway.url + "/classify", json={"model": SERVICE, "input": ACTIVATED_TEXTS, **fields}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    rows = resp.json()["data"]
    assert [r["probs"] for r in rows] == [[pytest.approx(w, rel=1e-12)] for w in want]
    assert all(r["num_classes"] == 1 for r in rows)


@pytest.mark.parametrize(("fields", "activated"), [({}, True), ({"use_activation": False}, False)])
def test_vllm_score_applies_the_activation_as_vllm_does(
    gateway: Gateway, fields: dict[str, bool], activated: bool
) -> None:
    """vLLM's ``/score`` (and ``/v1/score``) with a cross-encoder applies the activation by default
    (a sigmoid for one label), as ``/classify`` does."""
    raw = expected(gateway, ["q: colour?" + t for t in ("a: blue", "a: red")])
    want = [sigmoid(r) for r in raw] if activated else raw
    for route in ("/score", "/v1/score"):
        body = {"model": SERVICE, "text_1": "q: colour?", "text_2": ["a: blue", "a: red"], **fields}
        resp = requests.post(gateway.url + route, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert [d["score"] for d in resp.json()["data"]] == pytest.approx(want, rel=1e-12), route


def test_vllm_pooling_answers_the_raw_score_unless_asked_for_the_activation(gateway: Gateway) -> None:
    """``/pooling`` answers the score as the reward runtime reads it from its server's ``/pooling``
    (raw), and the sigmoid when the request asks for the activation; SGLang's shapes answer the raw
    score whatever is sent (SGLang has no such field)."""
    raw = expected(gateway, ACTIVATED_TEXTS)
    for fields, want in (({}, raw), ({"use_activation": False}, raw)):
        resp = requests.post(gateway.url + "/pooling", json={"input": ACTIVATED_TEXTS, **fields}, timeout=60)
        assert resp.status_code == 200 and [r["data"] for r in resp.json()["data"]] == [[w] for w in want]
    resp = requests.post(
        gateway.url + "/pooling", json={"input": ACTIVATED_TEXTS, "use_activation": True}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert [r["data"] for r in resp.json()["data"]] == [[pytest.approx(sigmoid(r), rel=1e-12)] for r in raw]
    sglang = requests.post(gateway.url + "/classify", json={"text": ACTIVATED_TEXTS}, timeout=60)
    assert [item["embedding"] for item in sglang.json()] == [[r] for r in raw]
    emb = requests.post(gateway.url + "/v1/embeddings", json={"input": ACTIVATED_TEXTS}, timeout=60)
    assert [d["embedding"] for d in emb.json()["data"]] == [[r] for r in raw]


@pytest.mark.parametrize("field", ["use_activation", "activation", "softmax"])
def test_a_non_boolean_activation_is_refused_by_name(gateway: Gateway, field: str) -> None:
    """A value that is no boolean is refused naming the field (vLLM refuses it too), not ignored."""
    resp = requests.post(
        gateway.url + "/classify", json={"model": SERVICE, "input": ["x"], field: "sometimes"}, timeout=60
    )
    assert resp.status_code in (400, 422), resp.text
    assert field in resp.text


def test_the_activation_of_an_extreme_score_is_a_probability() -> None:
    """A reward head may answer any finite number: the naive ``1 / (1 + exp(-x))`` raises
    OverflowError for a large negative one, failing the whole request. (Called directly: the test
    model's scores stay small, so no request through the gateway reaches such a score.)"""
    assert _sigmoid(-1000.0) == 0.0 and _sigmoid(1000.0) == 1.0
    assert _sigmoid(0.0) == 0.5 and _sigmoid(-2.0) == pytest.approx(sigmoid(-2.0), rel=1e-15)
