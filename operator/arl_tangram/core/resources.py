"""Resource vectors: one amount per resource type (cores, memory, GPU memory, an API's quota...)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from arl_tangram.errors import InvalidSpec


@dataclass(frozen=True)
class ResourceVector(Mapping[str, float]):
    """An immutable mapping from resource type to a non-negative amount; absent types are zero."""

    amounts: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.amounts.items():
            if value < 0:
                raise InvalidSpec(f"resources.{name}", f"must be >= 0, got {value}")
        # Freeze a private copy so that a caller mutating its dict cannot change us.
        object.__setattr__(self, "amounts", {k: float(v) for k, v in self.amounts.items() if v})

    def __getitem__(self, key: str) -> float:
        return self.amounts.get(key, 0.0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.amounts)

    def __len__(self) -> int:
        return len(self.amounts)

    def __add__(self, other: ResourceVector) -> ResourceVector:
        keys = set(self.amounts) | set(other.amounts)
        return ResourceVector({k: self[k] + other[k] for k in keys})

    def __sub__(self, other: ResourceVector) -> ResourceVector:
        """Difference; raises when it would go negative (that is an over-allocation, a bug)."""
        keys = set(self.amounts) | set(other.amounts)
        out = {k: self[k] - other[k] for k in keys}
        negative = {k: v for k, v in out.items() if v < -1e-9}
        if negative:
            raise ValueError(f"resource vector would go negative: {negative}")
        return ResourceVector({k: max(0.0, v) for k, v in out.items()})

    def fits_in(self, capacity: ResourceVector) -> bool:
        """True when every amount here is at most the same type's amount in ``capacity``."""
        return all(v <= capacity[k] + 1e-9 for k, v in self.amounts.items())


EMPTY = ResourceVector()
