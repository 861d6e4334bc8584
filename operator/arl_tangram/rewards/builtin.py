"""The built-in reward scorer: a small model that runs on CPU with numpy, or on a GPU with PyTorch.

A text is hashed into character n-grams (crc32, so the same text gets the same features in every
process), their embeddings are averaged, and a two-layer MLP maps that to one score. It is a real
model with real weights of a chosen size, so restore and eviction move real bytes, and numpy and
PyTorch compute the same scores from the same file.

Weights come from a local ``.npz`` file (``write_model`` makes one); nothing is downloaded. The host
copy stays in memory (page-locked when PyTorch can pin it) for the life of the process; ``restore``
copies it to the device and ``evict`` drops the device copy: weights never change, so there is nothing
to write back. This module imports only numpy and the standard library; PyTorch only when a CUDA
device is asked for (the GPU check runs it where only torch, nvidia-ml-py and numpy are installed).
"""

from __future__ import annotations

import json
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "tangram-builtin-scorer/1"
ARRAYS = ("embed", "w1", "b1", "w2", "b2")


class ModelError(ValueError):
    """A model file that is missing, malformed or of another format."""


@dataclass(frozen=True)
class ModelMeta:
    buckets: int
    dim: int
    hidden: int
    ngram: int
    dtype: str


def random_model(
    buckets: int = 4096,
    dim: int = 64,
    hidden: int = 64,
    ngram: int = 3,
    seed: int = 0,
    dtype: str = "float32",
) -> tuple[ModelMeta, dict[str, np.ndarray]]:
    """A model with seeded random weights; its size is about ``buckets * dim`` values."""
    if min(buckets, dim, hidden, ngram) < 1:
        raise ModelError("buckets, dim, hidden and ngram must be >= 1")
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    arrays = {
        "embed": rng.standard_normal((buckets, dim), dtype=np.float32).astype(dt, copy=False),
        "w1": (rng.standard_normal((dim, hidden), dtype=np.float32) / np.sqrt(dim)).astype(dt),
        "b1": np.zeros(hidden, dtype=dt),
        "w2": (rng.standard_normal((hidden, 1), dtype=np.float32) / np.sqrt(hidden)).astype(dt),
        "b2": np.zeros(1, dtype=dt),
    }
    return ModelMeta(buckets, dim, hidden, ngram, dtype), arrays


def write_model(path: str | Path, **kwargs: Any) -> Path:
    """Write ``random_model(**kwargs)`` to ``path`` (the file ``load_model`` reads)."""
    meta, arrays = random_model(**kwargs)
    doc = {"format": FORMAT, **meta.__dict__}
    out = Path(path)
    with out.open("wb") as f:
        blobs: dict[str, Any] = {"meta": np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8), **arrays}
        np.savez(f, **blobs)
    return out


def load_model(path: str | Path) -> tuple[ModelMeta, dict[str, np.ndarray]]:
    """Read a model file into host memory (``ModelError`` names the file and what is wrong): at
    start, so that a bad file stops the runtime there and never reaches a request."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"no model file at {p}")
    try:
        with np.load(p, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k: np.ascontiguousarray(z[k]) for k in ARRAYS}
    # A truncated or damaged archive fails in zipfile (BadZipFile, a bad CRC), zlib or EOF, not as
    # an OSError: every one of them is this file's fault.
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ModelError(f"{p} is not a built-in scorer model (damaged or another format): {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise ModelError(f"{p}: format {got!r}, expected {FORMAT!r}")
    sizes = {}
    for key in ("buckets", "dim", "hidden", "ngram"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{p}: meta {key} is {v!r}, expected an integer >= 1")
        sizes[key] = v
    m = ModelMeta(sizes["buckets"], sizes["dim"], sizes["hidden"], sizes["ngram"], str(meta.get("dtype")))
    shapes = {
        "embed": (m.buckets, m.dim),
        "w1": (m.dim, m.hidden),
        "b1": (m.hidden,),
        "w2": (m.hidden, 1),
        "b2": (1,),
    }
    for k, shape in shapes.items():
        if arrays[k].shape != shape:
            raise ModelError(f"{p}: {k} has shape {arrays[k].shape}, expected {shape}")
        if not np.issubdtype(arrays[k].dtype, np.floating):
            raise ModelError(f"{p}: {k} has dtype {arrays[k].dtype}, expected floating point")
        # A NaN or inf weight gives NaN scores for every text that touches it.
        if not _finite(arrays[k]):
            raise ModelError(f"{p}: {k} holds NaN or infinite values")
    return m, arrays


def _finite(a: np.ndarray, block_bytes: int = 64 * 2**20) -> bool:
    """Whether every value of ``a`` is finite, checked in blocks of rows: the whole mask of a
    table of many GiB would take a quarter of its size again in host memory."""
    rows = max(1, block_bytes // max(1, a[:1].nbytes))
    return all(np.isfinite(a[i : i + rows]).all() for i in range(0, max(1, len(a)), rows))


def features(texts: Sequence[str], meta: ModelMeta) -> tuple[np.ndarray, np.ndarray]:
    """Hashed n-gram ids of every text, flattened, and each text's offset into them (embedding bag)."""
    ids: list[int] = []
    offsets: list[int] = []
    n = meta.ngram
    for text in texts:
        offsets.append(len(ids))
        data = f"\x02{text}\x03".encode()
        grams = [data[i : i + n] for i in range(max(1, len(data) - n + 1))]
        ids.extend(zlib.crc32(g) % meta.buckets for g in grams)
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def score_numpy(arrays: dict[str, np.ndarray], meta: ModelMeta, texts: Sequence[str]) -> list[float]:
    """Scores on CPU: a text's score does not depend on the batch it is in, nor on the process.

    BLAS picks its kernel and summation order by the matrices' shapes (and threads and alignment), so
    a float32 product changes in its last bits with the batch: a reward service that batches requests
    together would give a text a reward that depends on what else was queued. So the sums run in
    float64, whose differences (at most about 1e-12 relative, measured) vanish when the result is
    rounded to float32, except where one lies that close to a rounding boundary: about once in 1e8
    scores, never seen in a review's sweep of five models, 3,000 texts and 19 batch sizes."""
    if not texts:
        return []
    ids, offsets = features(texts, meta)
    emb = arrays["embed"][ids].astype(np.float64)
    sums = np.add.reduceat(emb, offsets, axis=0)
    counts = np.diff(np.append(offsets, len(ids))).astype(np.float64)[:, None]
    # Some OpenBLAS kernels leave the FE_INVALID flag set for finite inputs, which numpy reports as
    # "invalid value encountered in matmul" (numpy issues 24067 and 13173). A real NaN or inf in the
    # weights still reaches the scores, so only the spurious warning is silenced.
    with np.errstate(invalid="ignore"):
        h = np.tanh(sums / counts @ arrays["w1"].astype(np.float64) + arrays["b1"].astype(np.float64))
        out = h @ arrays["w2"].astype(np.float64) + arrays["b2"].astype(np.float64)
    return [float(x) for x in out[:, 0].astype(np.float32)]


class BuiltinScorer:
    """The model with a host copy always present and a device copy while restored.

    ``device`` is ``"cpu"`` (the device copy is a second numpy copy, so restore and evict move real
    bytes and the cache logic is exercised without a GPU) or ``"cuda"``/``"cuda:N"`` (PyTorch: pinned
    host tensors, copied with ``non_blocking`` and synchronised)."""

    def __init__(self, meta: ModelMeta, arrays: dict[str, np.ndarray], device: str = "cpu") -> None:
        self.meta, self.host = meta, arrays
        self.device = device
        self.nbytes = sum(a.nbytes for a in self.host.values())
        self.pinned = False
        self._torch: Any = None
        self._host_t: dict[str, Any] = {}
        self._dev: dict[str, Any] | None = None
        if device != "cpu":
            if not device.startswith("cuda"):
                raise ModelError(f"device must be cpu or cuda[:N], got {device!r}")
            try:
                import torch
            except ImportError:
                raise ModelError("device cuda needs PyTorch, which is not installed") from None
            if not torch.cuda.is_available():
                raise ModelError("device cuda: PyTorch sees no CUDA device")
            self._torch = torch
            self._host_t = {k: torch.from_numpy(v) for k, v in self.host.items()}
            try:
                self._host_t = {k: t.pin_memory() for k, t in self._host_t.items()}
                self.pinned = True
            except RuntimeError:
                pass  # page-locked memory refused (limits): pageable copies still work, slower

    @classmethod
    def from_file(cls, path: str | Path, device: str = "cpu") -> BuiltinScorer:
        meta, arrays = load_model(path)
        return cls(meta, arrays, device)

    @property
    def resident(self) -> bool:
        return self._dev is not None

    def restore(self) -> float:
        """Copy the weights to the device; returns the seconds it took (0 when already there)."""
        if self._dev is not None:
            return 0.0
        t0 = time.perf_counter()
        if self._torch is None:
            self._dev = {k: v.copy() for k, v in self.host.items()}
        else:
            dev = {k: t.to(self.device, non_blocking=self.pinned) for k, t in self._host_t.items()}
            self._torch.cuda.synchronize(self.device)
            self._dev = dev
        return time.perf_counter() - t0

    def evict(self) -> None:
        """Drop the device copy (no write-back: the weights never change)."""
        self._dev = None

    def score(self, texts: Sequence[str]) -> list[float]:
        """Scores of ``texts``; the weights must be restored first."""
        if self._dev is None:
            raise RuntimeError("score before restore: the weights are not on the device")
        if self._torch is None:
            return score_numpy(self._dev, self.meta, texts)
        if not texts:
            return []
        torch = self._torch
        ids, offsets = features(texts, self.meta)
        d = self._dev
        with torch.inference_mode():
            # Only the rows the batch uses in float64: the whole table's copy would take twice its
            # size of the device's memory on every call (four times for float16 weights).
            used, at = torch.unique(torch.from_numpy(ids).to(self.device), return_inverse=True)
            emb = torch.nn.functional.embedding_bag(
                at, d["embed"][used].double(), torch.from_numpy(offsets).to(self.device), mode="mean"
            )
            # float64 sums, as in score_numpy: a score independent of its batch, and numpy's
            h = torch.tanh(emb @ d["w1"].double() + d["b1"].double())
            out = h @ d["w2"].double() + d["b2"].double()
            return [float(x) for x in out[:, 0].float().cpu().tolist()]
