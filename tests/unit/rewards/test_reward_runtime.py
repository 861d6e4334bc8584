"""The reward runtime's cache logic on CPU with the built-in backend: LRU eviction, restore reported as
overhead, resident preference, batching, and never more weights on the device than it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from arl_tangram.rewards.backends import BackendError, BuiltinBackend
from arl_tangram.rewards.builtin import BuiltinScorer, write_model
from arl_tangram.rewards.cache import DoesNotFit
from arl_tangram.rewards.runtime import BadInput, QueueFull, RewardRuntime, ServiceSpec, UnknownService


class WatchedBackend(BuiltinBackend):
    """The built-in backend, recording the order of restores and evictions and checking on every
    restore that the weights really on the device (scorers holding a device copy) fit it."""

    def __init__(
        self, name: str, scorer: BuiltinScorer, peers: list[WatchedBackend], capacity: int, log: list[str]
    ) -> None:
        super().__init__(name, scorer)
        self.peers, self.capacity, self.log = peers, capacity, log

    async def restore(self) -> None:
        await super().restore()
        self.log.append(f"restore {self.name}")
        on_device = sum(p.scorer.nbytes for p in self.peers if p.scorer.resident)
        assert on_device <= self.capacity, f"{on_device} bytes on a device of {self.capacity}"

    async def evict(self) -> None:
        await super().evict()
        self.log.append(f"evict {self.name}")


def _setup(
    tmp_path: Path, names: Sequence[str], fit: int, prewarm: bool = False, **spec: object
) -> tuple[RewardRuntime, list[str], list[WatchedBackend]]:
    """A runtime whose device holds ``fit`` of the (equal-sized) services; without ``prewarm`` it
    restores only on request, the order most of these tests check."""
    log: list[str] = []
    backends: list[WatchedBackend] = []
    scorers = [
        BuiltinScorer.from_file(write_model(tmp_path / f"{n}.npz", buckets=2048, dim=32, seed=i))
        for i, n in enumerate(names)
    ]
    capacity = scorers[0].nbytes * fit + scorers[0].nbytes // 2
    for n, s in zip(names, scorers, strict=True):
        backends.append(WatchedBackend(n, s, backends, capacity, log))
    specs = [ServiceSpec(n, **spec) for n in names]  # type: ignore[arg-type]
    return RewardRuntime(list(zip(specs, backends, strict=True)), capacity, prewarm=prewarm), log, backends


async def test_first_request_restores_then_hits_and_lru_is_evicted(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a", "b", "c"], fit=2, max_wait_s=0.0)
    await rt.start()
    try:
        r1 = await rt.score("a", ["x"])
        assert r1.restore_s > 0 and r1.evicted == ()
        r2 = await rt.score("a", ["y"])
        assert r2.restore_s == 0.0
        await rt.score("b", ["x"])
        await rt.score("a", ["z"])  # a is now more recent than b
        r3 = await rt.score("c", ["x"])
        assert r3.evicted == ("b",) and r3.restore_s > 0
        assert log == ["restore a", "restore b", "evict b", "restore c"]
        assert rt.cache.resident == ["a", "c"]
    finally:
        await rt.stop()


async def test_scores_match_the_model_whatever_the_eviction(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path, ["a", "b"], fit=1, max_wait_s=0.0)
    await rt.start()
    try:
        texts = ["one", "two", "three"]
        first = [(await rt.score(n, texts)).scores for n in ("a", "b", "a", "b")]
        assert first[0] == first[2] and first[1] == first[3] and first[0] != first[1]
    finally:
        await rt.stop()


async def test_concurrent_requests_share_one_batch(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a"], fit=1, max_batch_size=6, max_wait_s=30.0)
    await rt.start()
    try:
        # The window is long: the batch starts only because it is full.
        results = await asyncio.wait_for(
            asyncio.gather(*(rt.score("a", [f"t{i}", f"u{i}"]) for i in range(3))), timeout=20
        )
        assert [r.batch_size for r in results] == [6, 6, 6]
        assert all(len(r.scores) == 2 for r in results)
        assert log == ["restore a"] and rt.describe()[0]["batches"] == 1
    finally:
        await rt.stop()


async def test_a_request_bigger_than_a_batch_is_scored_in_parts(tmp_path: Path) -> None:
    rt, _, backends = _setup(tmp_path, ["a"], fit=1, max_batch_size=4, max_wait_s=0.0)
    await rt.start()
    try:
        texts = [f"t{i}" for i in range(10)]
        r = await rt.score("a", texts)
        backends[0].scorer.restore()
        assert r.scores == backends[0].scorer.score(texts)
    finally:
        await rt.stop()


async def test_resident_services_go_first_within_the_grace(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a", "b"], fit=1, max_wait_s=0.0)
    rt.grace_s = 60.0  # an evicted service's request waits while resident ones have work
    await rt.start()
    try:
        await rt.score("b", ["warm"])  # b resident
        # a's request arrives first, then b's; both ready at once: b (resident) goes first.
        ra, rb = await asyncio.gather(rt.score("a", ["x"]), rt.score("b", ["y"]))
        assert log == ["restore b", "evict b", "restore a"]
        assert rb.restore_s == 0.0 and ra.evicted == ("b",)
    finally:
        await rt.stop()


async def test_kept_services_stay_and_others_rotate(tmp_path: Path) -> None:
    log: list[str] = []
    backends: list[WatchedBackend] = []
    scorers = [
        BuiltinScorer.from_file(write_model(tmp_path / f"{n}.npz", buckets=1024, dim=16, seed=i))
        for i, n in enumerate("kab")
    ]
    cap = scorers[0].nbytes * 2
    for n, s in zip("kab", scorers, strict=True):
        backends.append(WatchedBackend(n, s, backends, cap, log))
    rt = RewardRuntime(
        [
            (ServiceSpec("k", keep_resident=True, max_wait_s=0), backends[0]),
            (ServiceSpec("a", max_wait_s=0), backends[1]),
            (ServiceSpec("b", max_wait_s=0), backends[2]),
        ],
        cap,
        prewarm=False,
    )
    await rt.start()
    try:
        assert rt.cache.resident == ["k"]  # restored at start
        for n in "abab":
            await rt.score(n, ["x"])
        assert "evict k" not in log and rt.cache.is_resident("k")
        assert log.count("restore a") == 2 and log.count("restore b") == 2
    finally:
        await rt.stop()


async def test_evict_and_restore_on_request(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path, ["a"], fit=1, max_wait_s=0.0)
    await rt.start()
    try:
        assert await rt.restore("a") > 0
        assert await rt.evict("a") is True
        assert await rt.evict("a") is False
        with pytest.raises(UnknownService):
            await rt.evict("nope")
        assert (await rt.score("a", ["x"])).restore_s > 0
    finally:
        await rt.stop()


async def test_queue_limit_refuses_at_once(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path, ["a"], fit=1, max_wait_s=30.0, max_batch_size=100, max_queue=2)
    await rt.start()
    try:
        waiting = [asyncio.create_task(rt.score("a", ["x"])) for _ in range(2)]
        await asyncio.sleep(0)  # one turn of the loop: both tasks run up to their wait in the queue
        assert len(rt.services["a"].queue) == 2  # the long window keeps them there
        with pytest.raises(QueueFull):
            await rt.score("a", ["x"])
    finally:
        await rt.stop()
    for t in waiting:
        with pytest.raises(BackendError):
            await t


async def test_a_restore_in_progress_and_the_unanswered_requests_are_shown(tmp_path: Path) -> None:
    """What a health check sees while a service's weights are being copied to the device."""
    rt, _, backends = _setup(tmp_path, ["a"], fit=1, max_wait_s=0.0)
    entered, release = asyncio.Event(), asyncio.Event()
    copy = backends[0].restore

    async def slow_restore() -> None:
        entered.set()
        await release.wait()
        await copy()

    backends[0].restore = slow_restore  # type: ignore[method-assign]
    await rt.start()
    try:
        assert rt.restoring is None and rt.pending == 0
        calls = [asyncio.create_task(rt.score("a", [f"x{i}"])) for i in range(3)]
        await asyncio.wait_for(entered.wait(), 10)
        assert rt.restoring == "a" and rt.pending == 3
        assert rt.describe()[0]["restoring"] is True
        release.set()
        await asyncio.gather(*calls)
        assert rt.restoring is None and rt.pending == 0
        assert rt.describe()[0]["restoring"] is False
    finally:
        await rt.stop()


def test_services_that_cannot_fit_are_refused_at_start(tmp_path: Path) -> None:
    s = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=1024, dim=16))
    with pytest.raises(DoesNotFit):
        RewardRuntime([(ServiceSpec("a"), BuiltinBackend("a", s))], s.nbytes - 1)


def test_services_file_entries_come_from_the_api() -> None:
    import yaml

    from arl_tangram.api.rewardmodelservice import RewardModelService
    from arl_tangram.rewards.runtime import service_entry
    from arl_tangram.rewards.server import parse_services

    sample = Path(__file__).resolve().parents[3] / "manifests" / "samples" / "rewardmodelservice-small.yaml"
    rms = RewardModelService.model_validate(yaml.safe_load(sample.read_text()))
    entry = service_entry(rms, path="/models/rm.npz")
    assert entry == {
        "name": "skywork-reward-small",
        "backend": "builtin",
        "path": "/models/rm.npz",
        "maxBatchSize": 64,
        "maxWaitMillis": 5,
        "maxQueueLength": 4096,
        "keepResident": False,
    }
    vllm = RewardModelService.model_validate(
        {
            "metadata": {"name": "judge"},
            "spec": {
                "model": {"name": "Qwen/Qwen3-8B", "uri": "hf://Qwen/Qwen3-8B"},
                "server": {"runtime": "vllm", "image": "vllm/vllm-openai:v0.8.0"},
                "gpu": {"memory": "20Gi"},
                "scaling": {"minReplicas": 1},
            },
        }
    )
    e = service_entry(vllm, url="http://127.0.0.1:8001")
    assert e["deviceMemory"] == "20Gi" and e["keepResident"] is True and e["model"] == "Qwen/Qwen3-8B"
    assert [x["name"] for x in parse_services({"services": [entry, e]})] == ["skywork-reward-small", "judge"]
    with pytest.raises(ValueError, match="url"):
        service_entry(vllm)


async def _settled(rt: RewardRuntime) -> None:
    """Let the serve loop run until it has nothing left to pre-warm (a few turns)."""
    for _ in range(200):
        await asyncio.sleep(0.01)
        if rt._to_prewarm() is None and rt.restoring is None and not rt._device.locked():
            return
    raise AssertionError("the runtime kept pre-warming")


async def test_prewarm_fills_free_memory_largest_first_and_never_evicts(tmp_path: Path) -> None:
    log: list[str] = []
    backends: list[WatchedBackend] = []
    sizes = {"small": 512, "big": 2048, "mid": 1024}
    scorers = {
        n: BuiltinScorer.from_file(write_model(tmp_path / f"{n}.npz", buckets=b, dim=16, seed=i))
        for i, (n, b) in enumerate(sizes.items())
    }
    # Room for big and small, not mid beside them: mid must wait for a request.
    cap = scorers["big"].nbytes + scorers["small"].nbytes + scorers["small"].nbytes // 2
    for n, s in scorers.items():
        backends.append(WatchedBackend(n, s, backends, cap, log))
    rt = RewardRuntime([(ServiceSpec(b.name, max_wait_s=0), b) for b in backends], cap)
    await rt.start()
    try:
        await _settled(rt)
        assert log == ["restore big", "restore small"]  # largest first; mid fits only by evicting
        r = await rt.score("big", ["x"])
        assert r.restore_s == 0.0 and r.evicted == ()
        r = await rt.score("mid", ["x"])
        assert r.restore_s > 0 and r.evicted  # a request may evict; a pre-warm never did
        await _settled(rt)
        assert sum(e.startswith("evict") for e in log) == len(r.evicted)
    finally:
        await rt.stop()


async def test_no_prewarm_while_a_request_waits(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a", "b"], fit=2, prewarm=True, max_wait_s=30.0, max_batch_size=100)
    waiting = asyncio.create_task(rt.score("a", ["x"]))  # its 30 s window keeps it queued
    await asyncio.sleep(0)
    await rt.start()
    try:
        await asyncio.sleep(0.3)
        assert log == []  # b's restore would delay a's batch when its window ends
    finally:
        await rt.stop()
    with pytest.raises(BackendError):
        await waiting


async def test_prewarm_leaves_services_scaled_to_zero_cold(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a", "b"], fit=2, prewarm=True, max_wait_s=0.0)
    assert await rt.evict("b") is False  # scaled to zero before it was ever restored
    await rt.start()
    try:
        await _settled(rt)
        assert log == ["restore a"]
        assert (await rt.score("b", ["x"])).restore_s > 0  # a request brings it back
        assert await rt.evict("a") is True
        await _settled(rt)
        assert not rt.cache.is_resident("a") and rt.cache.is_resident("b")
        assert log == ["restore a", "restore b", "evict a"]
    finally:
        await rt.stop()


async def test_memory_freed_by_a_scale_to_zero_is_prewarmed_at_once(tmp_path: Path) -> None:
    rt, log, _ = _setup(tmp_path, ["a", "b", "c"], fit=2, prewarm=False, max_wait_s=0.0)
    await rt.start()
    try:
        await rt.score("a", ["x"])
        rt.prewarm = True
        rt._wake.set()
        await _settled(rt)
        assert log == ["restore a", "restore b"]
        # b, pre-warmed after a's request but asked for by nobody, is the least recently used.
        assert (await rt.score("c", ["x"])).evicted == ("b",)
        # Once c is scaled to zero, b comes back into the memory it left, unasked.
        assert await rt.evict("c") is True
        await _settled(rt)
        assert rt.cache.is_resident("b") and not rt.cache.is_resident("c")
    finally:
        await rt.stop()


async def test_a_prewarm_waiting_for_the_device_yields_to_a_request_that_came_meanwhile(
    tmp_path: Path,
) -> None:
    """A ``restore`` call holds the device; the serve loop picks b to pre-warm and waits for the
    device; a request for a arrives. When the device frees, the request's batch goes first."""
    log: list[str] = []
    backends: list[WatchedBackend] = []
    scorers = {
        n: BuiltinScorer.from_file(write_model(tmp_path / f"{n}.npz", buckets=b, dim=16, seed=i))
        for i, (n, b) in enumerate({"a": 512, "b": 2048}.items())
    }
    cap = sum(x.nbytes for x in scorers.values()) * 2
    for n, sc in scorers.items():
        backends.append(WatchedBackend(n, sc, backends, cap, log))
    rt = RewardRuntime([(ServiceSpec(b.name, max_wait_s=0), b) for b in backends], cap, prewarm=False)
    release = asyncio.Event()
    copy_a, copy_b = backends[0].restore, backends[1].restore
    queued_at_b: list[int] = []

    async def slow_a() -> None:
        await release.wait()
        await copy_a()

    async def watched_b() -> None:
        queued_at_b.append(sum(len(s.queue) for s in rt.services.values()))
        await copy_b()

    backends[0].restore = slow_a  # type: ignore[method-assign]
    backends[1].restore = watched_b  # type: ignore[method-assign]
    await rt.start()
    try:
        held = asyncio.create_task(rt.restore("a"))  # holds the device until released
        await asyncio.sleep(0.05)
        rt.prewarm = True
        rt._wake.set()
        await asyncio.sleep(0.05)  # the loop has chosen b and waits for the device
        asked = asyncio.create_task(rt.score("a", ["x"]))
        await asyncio.sleep(0.05)
        release.set()
        await held
        assert (await asked).restore_s == 0.0
        await _settled(rt)
        assert queued_at_b == [0] and log == ["restore a", "restore b"]
    finally:
        await rt.stop()


class HeldBackend(BuiltinBackend):
    """The built-in backend, whose scoring waits until ``go`` is set (a long batch)."""

    def __init__(self, name: str, scorer: BuiltinScorer) -> None:
        super().__init__(name, scorer)
        self.go, self.started = asyncio.Event(), asyncio.Event()

    async def score(self, inputs: Sequence[str]) -> list[float]:
        self.started.set()
        await self.go.wait()
        return await super().score(inputs)


class MiscountingBackend(HeldBackend):
    """The built-in backend, losing the last score of every batch (a stand-in for a server that
    answers one score short without saying so: the HTTP backends now refuse such answers themselves,
    so only an in-process backend can hand one to the runtime) once ``go`` is set."""

    async def score(self, inputs: Sequence[str]) -> list[float]:
        return (await super().score(inputs))[:-1]


async def test_a_short_answer_fails_the_batch_even_when_a_caller_left(tmp_path: Path) -> None:
    """One of two batched callers gives up (its future is cancelled) while the backend answers one
    score short: the other caller used to wait for ever (setting an error on the cancelled future
    raised InvalidStateError before it reached the next one)."""
    scorer = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=64, dim=4, hidden=4))
    backend = MiscountingBackend("s", scorer)
    rt = RewardRuntime([(ServiceSpec("s", max_batch_size=2, max_wait_s=0), backend)], scorer.nbytes)
    await rt.start()
    try:
        leaver = asyncio.create_task(rt.score("s", ["a"]))
        stayer = asyncio.create_task(rt.score("s", ["b"]))
        await backend.started.wait()  # both are in the running batch (max_batch_size 2, no wait)
        assert rt.services["s"].batches == 0 and not rt.services["s"].queue
        leaver.cancel()
        backend.go.set()
        with pytest.raises(BackendError, match="1 scores for 2 inputs"):
            await asyncio.wait_for(stayer, 30)
    finally:
        await rt.stop()


class NanBackend(BuiltinBackend):
    """A backend whose scores are NaN (a stand-in for a model gone bad in process)."""

    async def score(self, inputs: Sequence[str]) -> list[float]:
        return [float("nan")] * len(inputs)


async def test_non_finite_scores_are_an_error_not_a_reward(tmp_path: Path) -> None:
    scorer = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=64, dim=4, hidden=4))
    rt = RewardRuntime([(ServiceSpec("s", max_wait_s=0), NanBackend("s", scorer))], scorer.nbytes)
    await rt.start()
    try:
        with pytest.raises(BackendError, match="not a finite number"):
            await rt.score("s", ["a"])
    finally:
        await rt.stop()


async def test_stopping_during_a_batch_answers_its_requests(tmp_path: Path) -> None:
    """``stop`` while a batch runs (the pod is terminating): its requests get the stopping error
    (503, retried elsewhere); they used to be left waiting for ever."""
    scorer = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=64, dim=4, hidden=4))
    backend = HeldBackend("s", scorer)
    rt = RewardRuntime([(ServiceSpec("s", max_wait_s=0), backend)], scorer.nbytes)
    await rt.start()
    waiting = asyncio.create_task(rt.score("s", ["a"]))
    await backend.started.wait()
    await rt.stop()
    with pytest.raises(BackendError, match="stopping"):
        await asyncio.wait_for(waiting, 30)


async def test_an_input_that_is_no_text_is_refused_alone(tmp_path: Path) -> None:
    """A lone surrogate ("\\ud800" is valid JSON) cannot be encoded for any model: it is refused
    before it joins a batch; it used to fail every request batched with it."""
    rt, _, backends = _setup(tmp_path, ["a"], fit=1, max_batch_size=10, max_wait_s=0.05)
    await rt.start()
    try:
        good, bad = await asyncio.gather(
            rt.score("a", ["fine", "😀\x00"]), rt.score("a", ["ok", "x\ud800"]), return_exceptions=True
        )
        assert isinstance(bad, BadInput) and "inputs[1]" in str(bad), bad
        assert not isinstance(good, BaseException)
        assert good.scores == backends[0].scorer.score(["fine", "😀\x00"])
    finally:
        await rt.stop()


async def test_empty_texts_unicode_and_batches_of_thousands_match_alone(tmp_path: Path) -> None:
    """Odd but valid inputs in big concurrent batches: each request gets its own texts' scores, the
    same as scored alone (no cross-talk between requests of one batch)."""
    rt, _, backends = _setup(tmp_path, ["a"], fit=1, max_batch_size=512, max_wait_s=0.01)
    await rt.start()
    try:
        odd = ["", " ", "\x00", "😀" * 50, "é" * 300, "\u200b\ufeff", "\r\n\t"]
        requests = [[f"{odd[i % len(odd)]}{i}" for i in range(j, j + 1 + j % 37)] for j in range(200)]
        requests += [[str(i) for i in range(4096)], [""], ["a" * 200_000, ""]]
        answers = await asyncio.gather(*(rt.score("a", r) for r in requests))
        alone = backends[0].scorer
        for req, ans in zip(requests, answers, strict=True):
            assert ans.scores == alone.score(req)
    finally:
        await rt.stop()
