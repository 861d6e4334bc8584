"""MIG profiles per GPU model, and which combinations of them a GPU can hold.

A MIG-capable GPU has memory slices (8 on A100/H100/H200, 4 on A30) and compute slices (7, or 4 on
A30). Each GPU-instance profile takes a run of memory slices that may only start at given positions
(NVML's "possible placements") and a number of compute slices. A set of instances is valid when their
memory runs do not overlap and their compute slices fit. The tables follow NVIDIA's MIG user guide
("Supported MIG Profiles"); profile IDs are the ones ``nvidia-smi mig -lgip`` prints and NVML's
``nvmlDeviceGetGpuInstances`` takes. Standard library only (the GPU check imports it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache


class MigError(ValueError):
    """A MIG profile or layout a GPU model cannot hold."""


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a model: ``compute`` and ``memory`` slices, allowed ``starts``
    (first memory slice), the NVML profile ID, and how many a GPU may hold at most (``limit``; media
    extensions, ``+me``, exist once per GPU)."""

    name: str
    profile_id: int
    compute: int
    memory: int
    starts: tuple[int, ...]
    limit: int = 8

    @property
    def memory_gb(self) -> float:
        """Nominal memory from the name (``3g.40gb`` -> 40)."""
        return float(self.name.split(".")[1].removesuffix("+me").removesuffix("gb"))


@dataclass(frozen=True)
class MigModel:
    """MIG geometry of one GPU model."""

    key: str
    compute_slices: int
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.profiles)
        raise MigError(f"{self.key} has no MIG profile {name!r} (it has {known})")

    def by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.profile_id == profile_id), None)


def _model(key: str, sizes: tuple[int, int, int, int, int, int], a30: bool = False) -> MigModel:
    """The profile set of a 7/8-slice GPU: ``sizes`` are the nominal GB of 1g, 1g (2 memory slices),
    2g, 3g, 4g and 7g instances."""
    s1, s1x2, s2, s3, s4, s7 = sizes
    profiles = (
        MigProfile(f"1g.{s1}gb", 19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
        MigProfile(f"1g.{s1}gb+me", 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
        MigProfile(f"1g.{s1x2}gb", 15, 1, 2, (0, 2, 4, 6), 4),
        MigProfile(f"2g.{s2}gb", 14, 2, 2, (0, 2, 4), 3),
        MigProfile(f"3g.{s3}gb", 9, 3, 4, (0, 4), 2),
        MigProfile(f"4g.{s4}gb", 5, 4, 4, (0,), 1),
        MigProfile(f"7g.{s7}gb", 0, 7, 8, (0,), 1),
    )
    return MigModel(key, 7, 8, profiles)


A30 = MigModel(
    "A30-24GB",
    4,
    4,
    (
        MigProfile("1g.6gb", 14, 1, 1, (0, 1, 2, 3), 4),
        MigProfile("1g.6gb+me", 21, 1, 1, (0, 1, 2, 3), 1),
        MigProfile("2g.12gb", 5, 2, 2, (0, 2), 2),
        MigProfile("2g.12gb+me", 6, 2, 2, (0, 2), 1),
        MigProfile("4g.24gb", 0, 4, 4, (0,), 1),
    ),
)

MODELS: dict[str, MigModel] = {
    m.key: m
    for m in (
        A30,
        _model("A100-40GB", (5, 10, 10, 20, 20, 40)),
        _model("A100-80GB", (10, 20, 20, 40, 40, 80)),
        _model("H100-80GB", (10, 20, 20, 40, 40, 80)),
        _model("H100-94GB", (12, 24, 24, 47, 47, 94)),
        _model("H100-96GB", (12, 24, 24, 48, 48, 96)),
        _model("H200-141GB", (18, 35, 35, 71, 71, 141)),
    )
}


def model_key(name: str, memory_mib: int) -> str | None:
    """The MIG table of a GPU from NVML's name and memory, or None when the model has no MIG.

    Names differ by form factor (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA H100
    NVL``, ``NVIDIA H200``); the memory size tells the variants apart."""
    upper = name.upper()
    gib = memory_mib / 1024
    families = ("A100", "A30", "H100", "H200", "GH200")
    family = next((f for f in families if re.search(rf"\b{f}\b", upper)), None)
    if family is None:
        return None
    if family == "A30":
        return "A30-24GB"
    if family == "A100":
        return "A100-80GB" if gib > 50 else "A100-40GB"
    if family in ("H200", "GH200") and gib > 120:
        return "H200-141GB"
    if gib > 95:
        return "H100-96GB"
    if gib > 85:
        return "H100-94GB"
    return "H100-80GB"


def model_of(key: str) -> MigModel:
    try:
        return MODELS[key]
    except KeyError:
        raise MigError(f"no MIG table for GPU model {key!r} (known: {', '.join(MODELS)})") from None


Placed = tuple[str, int]  # (profile name, first memory slice)


def place(model: MigModel, profiles: Iterable[str], taken: Sequence[Placed] = ()) -> list[Placed] | None:
    """Placements for ``profiles`` next to the instances already ``taken``, or None when they do not
    fit. Tries the largest profiles first and searches every start (a GPU holds at most 7 instances,
    so the search is small)."""
    want = sorted((model.profile(p) for p in profiles), key=lambda p: (-p.memory, -p.compute, p.name))
    used = 0
    compute = 0
    counts: Counter[str] = Counter()
    for name, start in taken:
        p = model.profile(name)
        used |= ((1 << p.memory) - 1) << start
        compute += p.compute
        counts[name] += 1
    if compute + sum(p.compute for p in want) > model.compute_slices:
        return None
    for p in want:
        counts[p.name] += 1
        if counts[p.name] > p.limit:
            return None
    if sum(1 for p in want if p.name.endswith("+me")) + sum(1 for n, _ in taken if n.endswith("+me")) > 1:
        return None  # one media-extension instance per GPU

    out: list[Placed] = []

    def go(i: int, mask: int) -> bool:
        if i == len(want):
            return True
        p = want[i]
        run = (1 << p.memory) - 1
        # Equal profiles take ascending starts (their order does not matter).
        lo = out[-1][1] + 1 if out and out[-1][0] == p.name else 0
        for s in p.starts:
            if s < lo or mask & (run << s):
                continue
            out.append((p.name, s))
            if go(i + 1, mask | (run << s)):
                return True
            out.pop()
        return False

    return list(out) if go(0, used) else None


def valid_layout(model: MigModel, profiles: Iterable[str]) -> bool:
    """True when one GPU of ``model`` can hold instances of all of ``profiles`` at once."""
    return place(model, profiles) is not None


@cache
def layouts(key: str) -> tuple[tuple[str, ...], ...]:
    """Every valid non-empty combination of profiles (as a sorted tuple) of a model, largest first."""
    model = model_of(key)
    found: set[tuple[str, ...]] = set()
    names = [p.name for p in model.profiles]

    def grow(current: tuple[str, ...], first: int) -> None:
        for i in range(first, len(names)):
            cand = (*current, names[i])
            if valid_layout(model, cand):
                found.add(tuple(sorted(cand)))
                grow(cand, i)

    grow((), 0)
    return tuple(sorted(found, key=lambda lay: (-len(lay), lay)))


def remaining_capacity(model: MigModel, taken: Sequence[Placed]) -> dict[str, int]:
    """How many more instances of each profile fit next to ``taken`` (NVML's remaining capacity:
    each profile on its own, not combined)."""
    out: dict[str, int] = {}
    for p in model.profiles:
        n = 0
        while place(model, [p.name] * (n + 1), taken) is not None:
            n += 1
        out[p.name] = n
    return out


def parse_layout(model: MigModel, counts: Mapping[str, int]) -> list[str]:
    """Profiles of a ``{profile: count}`` layout (the MIG manager's ``mig-devices``), checked valid."""
    profiles: list[str] = []
    for name, count in counts.items():
        model.profile(name)
        if count < 0:
            raise MigError(f"{name}: a count cannot be negative ({count})")
        profiles += [name] * count
    if profiles and not valid_layout(model, profiles):
        raise MigError(f"{model.key} cannot hold {dict(counts)} on one GPU")
    return profiles
