"""The built-in scorer: its file format, its scores, and restore/evict on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from arl_tangram.rewards.builtin import BuiltinScorer, ModelError, load_model, score_numpy, write_model


def test_file_round_trip_and_deterministic_scores(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.npz", buckets=512, dim=16, hidden=8, seed=3)
    a = BuiltinScorer.from_file(path)
    b = BuiltinScorer.from_file(path)
    a.restore()
    b.restore()
    texts = ["def f(x): return x", "the answer is 42", ""]
    assert a.score(texts) == b.score(texts)
    assert len(set(a.score(texts))) == 3  # different texts, different scores
    assert a.score(["the answer is 42"]) == a.score(texts)[1:2]  # a text's score ignores its batch


def test_a_texts_score_is_the_same_in_every_batch(tmp_path: Path) -> None:
    """A reward service batches concurrent requests together, so a text's reward must not depend on
    what else was queued with it. float32 BLAS products change in their last bits with the batch's
    shape (hundreds of these 2,100 scores did): the sums run in float64."""
    s = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=4096, dim=64, hidden=64))
    s.restore()
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(list("abcdefgh xyz"), size=int(rng.integers(1, 80)))) for _ in range(300)]
    whole = s.score(texts)
    for size in (1, 2, 3, 5, 7, 16, 33):
        parts = [x for i in range(0, len(texts), size) for x in s.score(texts[i : i + size])]
        assert parts == whole, f"batches of {size}"


def test_another_seed_is_another_model(tmp_path: Path) -> None:
    a = BuiltinScorer.from_file(write_model(tmp_path / "a.npz", seed=1))
    b = BuiltinScorer.from_file(write_model(tmp_path / "b.npz", seed=2))
    a.restore()
    b.restore()
    assert a.score(["x y z"]) != b.score(["x y z"])


def test_restore_copies_and_evict_drops_the_device_copy(tmp_path: Path) -> None:
    s = BuiltinScorer.from_file(write_model(tmp_path / "m.npz", buckets=256, dim=8, hidden=4))
    assert not s.resident
    with pytest.raises(RuntimeError, match="before restore"):
        s.score(["x"])
    assert s.restore() >= 0.0 and s.resident
    assert s.restore() == 0.0  # already there
    s.evict()
    assert not s.resident and s.host["embed"].nbytes == 256 * 8 * 4  # the host copy stays


def test_size_follows_the_shape_and_dtype(tmp_path: Path) -> None:
    s = BuiltinScorer.from_file(
        write_model(tmp_path / "m.npz", buckets=1000, dim=10, hidden=5, dtype="float16")
    )
    assert s.nbytes == 2 * (1000 * 10 + 10 * 5 + 5 + 5 + 1)
    meta, arrays = load_model(tmp_path / "m.npz")
    assert all(a.dtype == np.float16 for a in arrays.values())
    s.restore()
    assert score_numpy(arrays, meta, ["a", "bc"]) == s.score(["a", "bc"])


def test_non_finite_weights_still_reach_the_scores(tmp_path: Path) -> None:
    """The CPU path silences numpy's FE_INVALID warning (spurious from some BLAS kernels); a weight
    that really is NaN must still show in the scores rather than be hidden."""
    meta, arrays = load_model(write_model(tmp_path / "m.npz", buckets=64, dim=4, hidden=3))
    assert all(np.isfinite(x) for x in score_numpy(arrays, meta, ["a", "bc"]))
    arrays["w2"][0, 0] = np.nan
    assert all(np.isnan(x) for x in score_numpy(arrays, meta, ["a", "bc"]))


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no model file"):
        load_model(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a built-in scorer"):
        load_model(tmp_path / "junk.npz")
    np.savez(
        tmp_path / "other.npz",
        meta=np.frombuffer(b'{"format": "x"}', dtype=np.uint8),
        embed=np.zeros(1),
        w1=np.zeros(1),
        b1=np.zeros(1),
        w2=np.zeros(1),
        b2=np.zeros(1),
    )
    with pytest.raises(ModelError, match="format"):
        load_model(tmp_path / "other.npz")


def _damage(path: Path, how: str) -> None:
    """Damage a model file written by ``write_model`` in one way."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bit flipped":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF  # inside the embedding table's bytes: its CRC no longer holds
        path.write_bytes(bytes(flipped))
    else:
        with np.load(path) as z:
            arrays = dict(z)
        meta = json.loads(bytes(arrays["meta"]))
        if how == "meta not an object":
            arrays["meta"] = np.frombuffer(b"[1, 2]", dtype=np.uint8)
        elif how == "meta without buckets":
            del meta["buckets"]
        elif how == "ngram 0":
            meta["ngram"] = 0
        elif how == "b2 of 5":
            arrays["b2"] = np.zeros(5, dtype=np.float32)
        elif how == "integer weights":
            arrays["embed"] = arrays["embed"].astype(np.int32)
        elif how == "NaN weight":
            arrays["w1"][0, 0] = np.nan
        elif how == "inf weight":
            arrays["embed"][-1, -1] = np.inf
        if how != "meta not an object":
            arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        with path.open("wb") as f:
            np.savez(f, **arrays)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("truncated", "damaged"),
        ("empty", "damaged"),
        ("bit flipped", "damaged"),
        ("meta not an object", "format"),
        ("meta without buckets", "buckets is None"),
        ("ngram 0", "ngram is 0"),
        ("b2 of 5", r"b2 has shape \(5,\)"),
        ("integer weights", "embed has dtype int32"),
        ("NaN weight", "w1 holds NaN"),
        ("inf weight", "embed holds NaN or infinite"),
    ],
)
def test_a_damaged_file_is_refused_naming_it_and_the_fault(tmp_path: Path, how: str, says: str) -> None:
    """Each of these escaped as a bare zipfile/KeyError/AttributeError traceback, or loaded and gave
    wrong (NaN, or a b2 broadcast over 5) scores to every request."""
    path = write_model(tmp_path / "m.npz", buckets=256, dim=8, hidden=4)
    _damage(path, how)
    with pytest.raises(ModelError, match=says) as err:
        load_model(path)
    assert str(path) in str(err.value)


def test_cuda_without_torch_or_gpu_is_a_clear_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.npz", buckets=16, dim=4, hidden=2)
    with pytest.raises(ModelError, match="cuda"):
        BuiltinScorer.from_file(path, "cuda:0")
    with pytest.raises(ModelError, match="cpu or cuda"):
        BuiltinScorer.from_file(path, "tpu")
