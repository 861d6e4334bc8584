"""Exclusive cores per action on one sandbox host.

The operator's scheduler normally sends the grant with the request (``cores: [2, 3]``); the agent then
only checks that the cores are its own. A request without a grant (``/run_code`` from a trainer)
asks for a number of cores and gets the first free ones. The fork server owns the pool and starts
queued actions in arrival order as cores come free: it is the one that knows the moment an action's
last process is gone (see ``forkserver._drain``).

Pure and tiny on purpose: the fork server imports it, and every module it imports is paid again by
each fork.
"""

from __future__ import annotations

from arl_tangram.errors import CapacityExceeded, InvalidSpec


class CorePool:
    """Disjoint core sets out of a host's cores."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = sorted(cores)
        self.free: set[int] = set(cores)

    @property
    def busy(self) -> int:
        """Cores held by running actions."""
        return len(self.cores) - len(self.free)

    def check(self, want: int | frozenset[int]) -> None:
        """``InvalidSpec``/``CapacityExceeded`` for a request this host can never serve."""
        if isinstance(want, int):
            if want < 1:
                raise InvalidSpec("ncores", "must be at least 1")
            if want > len(self.cores):
                raise CapacityExceeded(f"ncores={want} but this host has {len(self.cores)} cores")
        else:
            foreign = want - set(self.cores)
            if not want:
                raise InvalidSpec("cores", "must name at least one core")
            if foreign:
                raise InvalidSpec("cores", f"cores {sorted(foreign)} do not belong to this host {self.cores}")

    def take(self, want: int | list[int] | frozenset[int]) -> list[int] | None:
        """``want`` cores (a count, or exactly these) if free now, else ``None``."""
        if isinstance(want, int):
            if len(self.free) < want:
                return None
            got = sorted(self.free)[:want]
        else:
            if not self.free.issuperset(want):
                return None
            got = sorted(want)
        self.free.difference_update(got)
        return got

    def release(self, cores: list[int]) -> None:
        """Give cores back."""
        self.free.update(cores)
