"""Actions: one atomic call to external resources, and the models of how long it takes.

An action has exactly one *key elastic resource* (the pool it is queued on: CPU cores, GPUs, or an
API's quota) with a feasible set of unit counts, fixed needs in other resources, and a duration
model. The scheduler only ever sees the *estimated* model; the simulator keeps the true one apart.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from arl_tangram.core.resources import EMPTY, ResourceVector
from arl_tangram.errors import InvalidSpec


@runtime_checkable
class DurationModel(Protocol):
    """How long an action takes with ``m`` units of its key resource."""

    @property
    def elastic(self) -> bool:
        """True when more units make it faster (known, non-zero elasticity)."""
        ...

    @property
    def convex(self) -> bool:
        """True when ``duration`` is convex and non-increasing in m (greedy allocation is optimal)."""
        ...

    def duration(self, m: int) -> float:
        """Seconds with ``m`` units."""
        ...


@dataclass(frozen=True)
class Amdahl:
    """``dur(m) = T1 * ((1 - p) + p / m)``: a parallel fraction ``p`` (a test suite under pytest -n)."""

    t1: float
    p: float

    def __post_init__(self) -> None:
        if self.t1 <= 0:
            raise InvalidSpec("duration.t1", f"must be > 0, got {self.t1}")
        if not 0.0 <= self.p <= 1.0:
            raise InvalidSpec("duration.p", f"must be in [0, 1], got {self.p}")

    @property
    def elastic(self) -> bool:
        return self.p > 0

    @property
    def convex(self) -> bool:
        return True  # a + b/m with b >= 0 is convex and non-increasing

    def duration(self, m: int) -> float:
        return self.t1 * ((1.0 - self.p) + self.p / m)


@dataclass(frozen=True)
class EfficiencyCurve:
    """The paper's form ``dur(m) = T1 / (E(m) * m)`` with E given at each feasible m."""

    t1: float
    efficiency: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if self.t1 <= 0:
            raise InvalidSpec("duration.t1", f"must be > 0, got {self.t1}")
        for m, e in self.efficiency:
            if m < 1 or not 0.0 < e <= 1.0:
                raise InvalidSpec("duration.efficiency", f"need m >= 1 and 0 < E(m) <= 1, got E({m})={e}")

    def _e(self, m: int) -> float:
        for k, e in self.efficiency:
            if k == m:
                return e
        raise InvalidSpec("duration.efficiency", f"no efficiency given for m={m}")

    @property
    def elastic(self) -> bool:
        return any(e * m > 1.0 for m, e in self.efficiency)

    @property
    def convex(self) -> bool:
        pts = sorted((m, self.duration(m)) for m, _ in self.efficiency)
        slopes = [(d2 - d1) / (m2 - m1) for (m1, d1), (m2, d2) in itertools.pairwise(pts)]
        return all(s <= 1e-12 for s in slopes) and all(b >= a - 1e-12 for a, b in itertools.pairwise(slopes))

    def duration(self, m: int) -> float:
        return self.t1 / (self._e(m) * m)


@dataclass(frozen=True)
class Fixed:
    """Duration not profiled: a historical average that more units do not change ("unknown")."""

    mean: float

    def __post_init__(self) -> None:
        if self.mean < 0 or math.isnan(self.mean):
            raise InvalidSpec("duration.mean", f"must be >= 0, got {self.mean}")

    @property
    def elastic(self) -> bool:
        return False

    @property
    def convex(self) -> bool:
        return True

    def duration(self, m: int) -> float:
        return self.mean


@dataclass(eq=False)
class Action:
    """One atomic call to external resources.

    ``pool`` names the key elastic resource's pool ("cpu", "gpu", "api:<name>"); ``feasible`` lists
    the unit counts of it the action can run with, ascending. ``memory_gib`` is the trajectory's
    memory for its whole life (used to pin it to a sandbox host). ``priority`` 0 is the most urgent
    class. ``service`` names the GPU model service; ``mig_profile`` asks for one MIG slice instead of
    whole GPUs. Identity is the object: two actions are never equal unless they are the same one.
    """

    id: str
    trajectory: str
    pool: str
    feasible: tuple[int, ...]
    model: DurationModel
    fixed: ResourceVector = EMPTY
    memory_gib: float = 0.0
    service: str | None = None
    service_gb: float = 0.0
    mig_profile: str | None = None
    priority: int = 0
    tenant: str = "default"
    arrival: float = 0.0
    seq: int = field(default=-1)

    def __post_init__(self) -> None:
        if not self.feasible:
            raise InvalidSpec(f"action[{self.id}].feasible", "must list at least one unit count")
        if any(k < 1 for k in self.feasible):
            raise InvalidSpec(f"action[{self.id}].feasible", f"unit counts must be >= 1: {self.feasible}")
        self.feasible = tuple(sorted(set(self.feasible)))
        if self.priority < 0:
            raise InvalidSpec(f"action[{self.id}].priority", "must be >= 0 (0 is the most urgent)")

    @property
    def min_units(self) -> int:
        """The fewest units the action can run with."""
        return self.feasible[0]

    @property
    def elastic(self) -> bool:
        """True when the action can use more than its minimum and its model says that helps."""
        return len(self.feasible) > 1 and self.model.elastic

    def __repr__(self) -> str:
        return f"Action({self.id!r}, pool={self.pool!r}, feasible={self.feasible[0]}..{self.feasible[-1]})"


def feasible_range(lo: int, hi: int) -> tuple[int, ...]:
    """Every unit count from ``lo`` to ``hi`` inclusive (a CPU DoP range)."""
    if lo < 1 or hi < lo:
        raise InvalidSpec("feasible", f"need 1 <= min <= max, got [{lo}, {hi}]")
    return tuple(range(lo, hi + 1))
