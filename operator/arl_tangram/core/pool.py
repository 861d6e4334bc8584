"""What the scheduler needs from a resource manager: grants, scratch fitting and the DP operator.

The scheduler is written against these protocols only, so that the same policies drive CPU cores,
GPU chunks and API quotas, in the operator and in the simulator alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from arl_tangram.core.action import Action

S = TypeVar("S", bound=Hashable)


@dataclass(eq=False)
class Grant:
    """Units of a pool given to one action: where (``host``), which units (``units_ids``: core ids or
    GPU indices or a MIG instance), and ``restore_s``, the time to make a GPU service resident first."""

    action: Action
    units: int
    start: float
    host: str
    unit_ids: tuple[int, ...] = ()
    restore_s: float = 0.0
    est_end: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)


class DPOperator(Protocol[S]):
    """The paper's per-manager DP primitives over a hashable state of free capacity.

    ``start`` is the free state now; ``prev(state, k)`` the state left after an action takes k units
    (the paper writes it backwards, ``Prev(j, k) = j - k``), or None when it cannot; ``is_valid``
    whether a state is a real one; ``end`` whether a final state is acceptable.
    """

    def start(self) -> S: ...

    def prev(self, state: S, k: int) -> S | None: ...

    def is_valid(self, state: S) -> bool: ...

    def end(self, state: S) -> bool: ...


@dataclass
class Partition:
    """Candidates that compete for the same capacity (one sandbox host, one GPU pool) and its operator."""

    operator: DPOperator[Any]
    actions: list[Action]
    free_units: int
    countable: bool = False  # the state is a plain count of units: any split of free_units is valid


class Scratch(Protocol):
    """A throw-away copy of free capacity to test what fits (the candidate prefix), cheap to make."""

    def try_take(self, action: Action, units: int) -> bool:
        """Take ``units`` for ``action`` if it fits and is placeable; report whether it did."""
        ...

    def partitions(self, actions: Sequence[Action]) -> list[Partition]:
        """Split actions (already taken here at their minimum) into independent DP problems whose
        start states are the capacity before those actions were taken."""
        ...


@dataclass(frozen=True)
class PlacementOption:
    """One way to run an action in a pool whose units cache state (GPU services): ``units`` on the
    block ``ref``, usable at ``ready_at`` (now for a free block, a running action's expected end
    for a busy block that already holds the service), after ``restore_s`` of loading the service,
    evicting cached services whose expected cost to their own future requests is ``penalty_s``.
    ``displaces``: the restore evicts a copy of another service (however cold); True unless the
    pool says otherwise, since a restore that displaces no one is bought at once (``tangram``)."""

    units: int
    ready_at: float
    restore_s: float
    penalty_s: float
    ref: tuple[str, int]
    displaces: bool = True


class ResidencyPlan(Scratch, Protocol):
    """A decision's view of a residency-aware pool: its options per action, and what was taken."""

    def options(self, action: Action) -> list[PlacementOption]:
        """Every usable (block size, block) for ``action``: the best free block per feasible size
        and the earliest busy block per size that holds the service resident."""
        ...

    def has_free(self) -> bool:
        """Whether any unit is still free in this view (else nothing more can start now)."""
        ...

    def take(self, action: Action, option: PlacementOption, end: float) -> None:
        """Book ``option`` for ``action`` until ``end`` (a free block now, or a busy one later)."""
        ...


@runtime_checkable
class ResidencyPlanner(Protocol):
    """A pool that plans placements with service residency in view (the GPU manager)."""

    def residency_plan(
        self, now: float, heat: Mapping[str, float], busy_until: Mapping[tuple[str, int], float]
    ) -> ResidencyPlan:
        """A throw-away view for one decision. ``heat`` weighs a cached service's eviction (0: no
        demand expected, 1: in use, more: requests wait for it); ``busy_until`` is each busy unit's
        (host, id) expected release."""
        ...


@runtime_checkable
class Pinning(Protocol):
    """A pool whose actions are tied to one host once their session started there (sandboxes)."""

    def pinned_host(self, action: Action, scratch: Scratch | None = None) -> str | None:
        """The host the action's session is pinned to, or None while it is not pinned; with
        ``scratch``, a session pinned in that scratch (earlier in the same decision) counts too."""
        ...

    def hosts_open(self) -> int:
        """Hosts taking work (not draining)."""
        ...

    def hosts_total(self) -> int:
        """Every host, draining ones included (they still run their pinned sessions' actions)."""
        ...

    def session_hosts(self, action: Action) -> list[str]:
        """Open hosts with memory left for the session of an unpinned action."""
        ...

    def hold(self, scratch: Scratch, host: str) -> None:
        """In ``scratch``, pin no new session to ``host`` (an earlier action waits for its cores)."""
        ...

    def host_free(self, scratch: Scratch, host: str) -> int:
        """Units of ``host`` still free in ``scratch``."""
        ...

    def pin_session(self, action: Action) -> str | None:
        """Pin the session of an unpinned action now, before it has any units, to the open host
        the pool spreads sessions onto; its memory is held there. None where no host has room."""
        ...


@runtime_checkable
class Clocked(Protocol):
    """A pool whose free capacity depends on the time (token buckets): told the time first."""

    def advance(self, now: float) -> None: ...


class PoolManager(Protocol):
    """Capacity state and placement for one pool."""

    @property
    def pool(self) -> str: ...

    def total_units(self) -> int: ...

    def free_units(self) -> int: ...

    def scratch(self) -> Scratch: ...

    def place(self, action: Action, units: int, now: float, plan: Scratch | None = None) -> Grant | None:
        """Commit ``units`` to ``action`` (exclusive), or None if it cannot be placed now. ``plan`` is
        the scratch the decision was made on, so that placement follows it (e.g. the chosen host)."""
        ...

    def release(self, grant: Grant, now: float) -> None:
        """Return a grant's units."""
        ...

    def can_ever_fit(self, action: Action) -> bool:
        """False when the action asks for more than the pool could ever hold."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """When capacity appears without a completion (a token bucket refilling), else None."""
        ...
