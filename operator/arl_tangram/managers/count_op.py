"""The DP operator of a plain count of free units (CPU cores on one host, an API's free slots)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CountOperator:
    """State: free units. ``Prev(j, k) = j - k``; a state is valid while it is not negative."""

    free: int

    def start(self) -> int:
        return self.free

    def prev(self, state: int, k: int) -> int | None:
        after = state - k
        return after if after >= 0 else None

    def is_valid(self, state: int) -> bool:
        return state >= 0

    def end(self, state: int) -> bool:
        return True
