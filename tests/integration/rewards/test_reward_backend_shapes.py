"""The vLLM and SGLang adapters against answers of other model shapes and other server versions,
over real HTTP to small aiohttp stand-ins (no vLLM or SGLang can run here: no GPU). The stand-ins
answer with the shapes the servers document: vLLM's ``/pooling`` rows (``data[i].data``: one
number, a classifier's per-label list, or a process reward model's per-step ``[p0, p1]`` pairs),
its 400 ``BadRequestError`` for an input past the model's maximum length, and SGLang's ``/classify``
(``[i].embedding``: every label's value)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from arl_tangram.rewards.backends import BackendError, SglangBackend, VllmBackend
from arl_tangram.rewards.runtime import BadInput, RewardRuntime, ServiceSpec

GIB = 2**30
MAX_CHARS = 20  # the stand-in model's maximum length, counted in characters


def labels_of(text: str) -> list[float]:
    """A two-label classifier's outputs for ``text``: label 0 (negative) and label 1 (positive)."""
    return [-len(text) / 10, len(text) / 10]


def steps_of(text: str) -> list[list[float]]:
    """A process reward model's per-step ``[p(wrong), p(right)]`` (one step per line)."""
    lines = text.split("\n")
    return [[1 - (i + 1) / 100, (i + 1) / 100 + len(text) / 1000] for i in range(len(lines))]


Rows = Callable[[list[str]], list[object]]


def standin(pooling_rows: Rows, classify_rows: Rows) -> web.Application:
    """vLLM's ``/pooling`` and SGLang's ``/classify`` answering with the given rows; an input
    longer than ``MAX_CHARS`` is refused with 400 as vLLM refuses one past ``max_model_len``."""

    def too_long(texts: list[str]) -> web.Response | None:
        for t in texts:
            if len(t) > MAX_CHARS:
                msg = (
                    f"This model's maximum context length is {MAX_CHARS} tokens. However, you "
                    f"requested {len(t)} tokens in the input for embedding generation."
                )
                return web.json_response(
                    {"object": "error", "message": msg, "type": "BadRequestError", "code": 400}, status=400
                )
        return None

    async def pooling(request: web.Request) -> web.Response:
        texts = (await request.json())["input"]
        return too_long(texts) or web.json_response({"object": "list", "data": pooling_rows(texts)})

    async def classify(request: web.Request) -> web.Response:
        texts = (await request.json())["text"]
        return too_long(texts) or web.json_response(classify_rows(texts))

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    app = web.Application()
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/pooling", pooling)
    app.router.add_post("/classify", classify)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def _backend(kind: str, url: str, session: aiohttp.ClientSession) -> VllmBackend | SglangBackend:
    cls = VllmBackend if kind == "vllm" else SglangBackend
    return cls("rm", url, "m", GIB, session)


async def test_a_classifier_with_two_labels_scores_its_last_label_on_both_servers(
    session: aiohttp.ClientSession,
) -> None:
    """A sequence classifier with ``num_labels`` 2 answers every label's value; the score is the
    last label's (label 1, a binary reward classifier's positive class) through vLLM and SGLang
    alike. SGLang's adapter used to take ``embedding[0]``, the negative class: the same model
    scored through the two servers gave opposite rewards."""
    app = standin(
        lambda texts: [{"index": i, "object": "pooling", "data": labels_of(t)} for i, t in enumerate(texts)],
        lambda texts: [{"embedding": labels_of(t), "meta_info": {}} for t in texts],
    )
    runner, url = await _serve(app)
    try:
        texts = ["good", "a better answer", "x"]
        for kind in ("vllm", "sglang"):
            assert await _backend(kind, url, session).score(texts) == [labels_of(t)[1] for t in texts], kind
    finally:
        await runner.cleanup()


async def test_a_process_reward_model_scores_its_last_step(session: aiohttp.ClientSession) -> None:
    """A process reward model answers ``[p(wrong), p(right)]`` per step: the score is the last
    step's ``p(right)``, rows matched by their index (answered here in reverse, with duplicates)."""
    app = standin(
        lambda texts: [
            {"index": i, "object": "pooling", "data": steps_of(texts[i])} for i in reversed(range(len(texts)))
        ],
        lambda texts: [],
    )
    runner, url = await _serve(app)
    try:
        texts = ["step 1\nstep 2", "one", "step 1\nstep 2", "a\nb\nc"]
        got = await _backend("vllm", url, session).score(texts)
        assert got == [steps_of(t)[-1][1] for t in texts]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("kind", "rows", "says"),
    [
        # vLLM's /classify and /score shapes where /pooling's was expected (another version, or a
        # url pointing at another route's server).
        ("vllm", lambda n: [{"index": i, "probs": [0.2, 0.8], "num_classes": 2} for i in range(n)], "'data'"),
        ("vllm", lambda n: [{"index": i, "object": "score", "score": 0.5} for i in range(n)], "'data'"),
        ("vllm", lambda n: [{"object": "pooling", "data": [0.5]} for _ in range(n)], "'index'"),
        ("vllm", lambda n: [[0.5] for _ in range(n)], "not an object"),
        ("sglang", lambda n: [{"score": 0.5} for _ in range(n)], "'embedding'"),
        ("sglang", lambda n: [{"embedding": []} for _ in range(n)], "empty"),
    ],
)
async def test_an_answer_of_another_shape_names_the_field_it_lacks(
    session: aiohttp.ClientSession, kind: str, rows: Callable[[int], list[object]], says: str
) -> None:
    """An answer of another version's shape fails with a BackendError naming the service, the route
    and the field missing from which row (it used to say only ``unexpected shape: 'data'``)."""
    app = standin(
        lambda texts: rows(len(texts)),
        lambda texts: rows(len(texts)),
    )
    runner, url = await _serve(app)
    try:
        with pytest.raises(BackendError) as err:
            await _backend(kind, url, session).score(["a", "b"])
        msg = str(err.value)
        assert msg.startswith("rm: POST /") and "row 0" in msg and says in msg, msg
    finally:
        await runner.cleanup()


# Other servers' and other endpoints' answers for two inputs, as they document them, which a
# services file pointing a backend at the wrong server (or route) brings back.
VLLM_CLASSIFY = {
    "id": "classify-1",
    "object": "list",
    "created": 1,
    "model": "m",
    "data": [{"index": i, "label": "LABEL_1", "probs": [0.1, 0.9], "num_classes": 2} for i in range(2)],
    "usage": {"prompt_tokens": 2, "total_tokens": 2},
}
VLLM_SCORE = {
    "id": "score-1",
    "object": "list",
    "data": [{"index": i, "object": "score", "score": 0.9} for i in range(2)],
}
VLLM_RERANK = {  # /v1/rerank: results by relevance, not in input order
    "id": "rerank-1",
    "model": "m",
    "usage": {"total_tokens": 2},
    "results": [
        {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
        {"index": 0, "relevance_score": 0.1},
    ],
}
VLLM_IO_PROCESSOR = {"request_id": "pool-1", "created_at": 1, "data": {"mask": "..."}}  # a plugin's answer
VLLM_BASE64 = {
    "object": "list",
    "data": [{"index": i, "object": "pooling", "data": "AACAPw=="} for i in range(2)],
}
OPENAI_EMBEDDINGS = {
    "object": "list",
    "data": [{"object": "embedding", "embedding": [0.3], "index": i} for i in range(2)],
    "model": "m",
    "usage": {},
}
TEI_RERANK = [{"index": 1, "score": 0.9}, {"index": 0, "score": 0.1}]  # by score, not input order
TEI_PREDICT = [[{"score": 0.9, "label": "LABEL_1"}, {"score": 0.1, "label": "LABEL_0"}]] * 2  # by score


@pytest.mark.parametrize(
    ("kind", "answer", "says"),
    [
        (
            "sglang",
            VLLM_CLASSIFY,
            "POST /classify answered an unexpected shape: the answer is an object with keys ['created', "
            "'data', 'id', 'model', 'object', 'usage'], not a list of {\"embedding\": [...]} per input",
        ),
        (
            "sglang",
            OPENAI_EMBEDDINGS,
            "POST /classify answered an unexpected shape: the answer is an object with keys ['data', "
            "'model', 'object', 'usage'], not a list of {\"embedding\": [...]} per input",
        ),
        (
            "sglang",
            None,
            'POST /classify answered an unexpected shape: the answer is null, not a list of {"embedding": '
            "[...]} per input",
        ),
        ("sglang", TEI_PREDICT, "row 0 is a list, not an object with 'embedding'"),
        ("sglang", TEI_RERANK, "row 0 has no 'embedding' (it has ['index', 'score'])"),
        (
            "vllm",
            TEI_RERANK,
            "POST /pooling answered an unexpected shape: the answer is a list, not an object with 'data'",
        ),
        ("vllm", VLLM_CLASSIFY, "row 0 has no 'data' (it has ['index', 'label', 'num_classes', 'probs'])"),
        ("vllm", VLLM_SCORE, "row 0 has no 'data' (it has ['index', 'object', 'score'])"),
        ("vllm", VLLM_RERANK, "the answer has no 'data' (it has ['id', 'model', 'results', 'usage'])"),
        ("vllm", OPENAI_EMBEDDINGS, "row 0 has no 'data' (it has ['embedding', 'index', 'object'])"),
        ("vllm", VLLM_IO_PROCESSOR, "data is an object with keys ['mask'], not a list of rows"),
        ("vllm", VLLM_BASE64, "score of input 0 is 'AACAPw==', not a number"),
    ],
)
async def test_another_servers_answer_fails_naming_what_was_expected(
    session: aiohttp.ClientSession, kind: str, answer: object, says: str
) -> None:
    """Answers of other servers and endpoints (vLLM's ``/classify``, ``/score``, ``/v1/rerank``
    and plugins' ``/pooling``, SGLang's ``/v1/classify``, TEI's ``/rerank`` and ``/predict``,
    OpenAI's embeddings) are never read as scores: each fails as a BackendError naming the
    service, the route, what it found and what was expected. An object where SGLang's list was
    expected was said as ``dict results for 2 inputs``, and a JSON null as ``NoneType``."""

    async def answers(_: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/pooling", answers)
    app.router.add_post("/classify", answers)
    runner, url = await _serve(app)
    try:
        with pytest.raises(BackendError) as err:
            await _backend(kind, url, session).score(["a", "b"])
        msg = str(err.value)
        assert (
            msg.startswith(f"rm: POST /{'pooling' if kind == 'vllm' else 'classify'} answered")
            and says in msg
        ), msg
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_an_input_past_the_models_length_fails_alone_as_a_bad_input(
    session: aiohttp.ClientSession, kind: str
) -> None:
    """vLLM refuses a batch holding one input past the model's maximum length with a 400. That
    request gets a BadInput carrying the server's message (400 over HTTP: not retried elsewhere,
    where it would be refused again); the requests batched with it get their scores. It used to
    fail the whole batch as a backend fault (503), and every retry of every request with it."""
    app = standin(
        lambda texts: [{"index": i, "object": "pooling", "data": [len(t) / 10]} for i, t in enumerate(texts)],
        lambda texts: [{"embedding": [len(t) / 10]} for t in texts],
    )
    runner, url = await _serve(app)
    rt = RewardRuntime(
        [(ServiceSpec("rm", max_batch_size=8, max_wait_s=1), _backend(kind, url, session))], GIB
    )
    try:
        await rt.start()
        good, bad, also_good = await asyncio.gather(
            rt.score("rm", ["short", "é😀"]),
            rt.score("rm", ["fine", "x" * (MAX_CHARS + 1)]),
            rt.score("rm", ["short"]),
            return_exceptions=True,
        )
        assert isinstance(bad, BadInput) and "maximum context length" in str(bad), bad
        assert str(bad).startswith("rm: ")
        assert not isinstance(good, BaseException) and good.scores == [0.5, 0.2]
        assert not isinstance(also_good, BaseException) and also_good.scores == [0.5]
    finally:
        await rt.stop()
        await runner.cleanup()


async def test_a_500_with_an_html_body_is_a_backend_error_naming_the_status(
    session: aiohttp.ClientSession,
) -> None:
    """A proxy in front of the server answers 500 with an HTML page: a BackendError (503 over
    HTTP, retried elsewhere) naming the service, route and status, never a score."""

    async def html(_: web.Request) -> web.Response:
        return web.Response(
            status=500, text="<html><body>Internal Server Error</body></html>", content_type="text/html"
        )

    app = web.Application()
    app.router.add_post("/pooling", html)
    runner, url = await _serve(app)
    try:
        with pytest.raises(BackendError) as err:
            await _backend("vllm", url, session).score(["a"])
        assert str(err.value).startswith("rm: POST /pooling answered 500"), err.value
        assert json.dumps(str(err.value))  # one line of text for the caller
    finally:
        await runner.cleanup()


NO_STEP = "no step mark"  # an input the stand-in process reward model finds no step in


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_an_input_with_an_empty_output_fails_alone_naming_it(
    session: aiohttp.ClientSession, kind: str
) -> None:
    """A process reward model answers an empty step list (``data: []``) for an input without its
    step mark. That request gets a BadInput naming its input (400 over HTTP: not retried elsewhere,
    where the model would find no step either); the requests batched with it get their scores from
    the same answer. The whole batch used to fail as a backend fault (503)."""
    app = standin(
        lambda texts: [
            {"index": i, "object": "pooling", "data": [] if t == NO_STEP else steps_of(t)}
            for i, t in enumerate(texts)
        ],
        lambda texts: [{"embedding": [] if t == NO_STEP else labels_of(t)} for t in texts],
    )
    calls: list[int] = []

    @web.middleware
    async def count(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        calls.append(1)
        return await handler(request)

    app.middlewares.append(count)
    runner, url = await _serve(app)
    rt = RewardRuntime(
        [(ServiceSpec("rm", max_batch_size=8, max_wait_s=1), _backend(kind, url, session))], GIB
    )
    try:
        await rt.start()
        calls.clear()
        good, bad, also_good = await asyncio.gather(
            rt.score("rm", ["a\nb", "c"]),
            rt.score("rm", ["fine", NO_STEP]),
            rt.score("rm", ["d"]),
            return_exceptions=True,
        )
        assert isinstance(bad, BadInput), bad
        assert str(bad).startswith("rm: inputs[1]: POST /") and "empty output" in str(bad), bad
        expect = (lambda t: steps_of(t)[-1][1]) if kind == "vllm" else (lambda t: labels_of(t)[1])
        assert not isinstance(good, BaseException) and good.scores == [expect("a\nb"), expect("c")]
        assert not isinstance(also_good, BaseException) and also_good.scores == [expect("d")]
        assert len(calls) == 1  # one answer scored all three: none asked again
    finally:
        await rt.stop()
        await runner.cleanup()
