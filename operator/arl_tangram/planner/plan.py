"""What the planner decides: a :class:`ScalingPlan` (frozen outputs, plain data).

Every decision carries a :class:`Reason`: a CamelCase ``code`` fit for a Kubernetes event's reason
and a ``message`` a person can act on, so that the operator can explain each step in status and events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasonCode = Literal[
    "ScaleUp",  # demand needs more capacity than the active instances give
    "WarmMinimum",  # min_instances / warm_instances keep capacity the demand alone would not
    "ScaleDown",  # capacity has been surplus for idle_timeout_s
    "ScaleToZero",  # idle for idle_timeout_s with scale_to_zero
    "ColdStartBudget",  # scale-to-zero refused: a cold start would exceed its budget
    "Undrain",  # demand came back: a cordoned instance serves again instead of a cold start
    "Drained",  # a cordoned instance is empty and is removed
    "CancelStart",  # a surplus instance that had not started yet is removed
    "InstanceFailed",  # a failed instance is removed
    "MaxStarting",  # adds held back by max_starting
    "MaxInstances",  # adds held back by max_instances
    "Unplaceable",  # no node has room for (some of) the wanted capacity
    "DrainBlocked",  # surplus, but the hysteresis window or the ACT target holds it
    "Steady",  # nothing to change
]


@dataclass(frozen=True)
class Reason:
    """Why one decision was taken: ``code`` for machines and events, ``message`` for people."""

    code: ReasonCode
    message: str


@dataclass(frozen=True)
class InstanceAdd:
    """Create one instance of ``pool`` on ``node``. ``units`` is its capacity (cores or GPUs)."""

    pool: str
    node: str
    units: int
    cpu_millicores: int
    memory_bytes: int
    gpus: int
    reason: Reason


@dataclass(frozen=True)
class InstanceDrain:
    """Cordon an instance: the scheduler sends it no new action or session from now on.

    The runtime reports it as ``draining``; once it is drained (no running action, no pinned session)
    a later plan lists it in ``removals``.
    """

    name: str
    pool: str
    node: str
    reason: Reason


@dataclass(frozen=True)
class InstanceUndrain:
    """Return a ``draining`` instance to service (``ready``): cheaper than starting a new one."""

    name: str
    pool: str
    node: str
    reason: Reason


@dataclass(frozen=True)
class InstanceRemoval:
    """Delete an instance. Only ever one that is drained, still ``starting`` (no work can be on it)
    or ``failed``; never one with running actions or pinned sessions."""

    name: str
    pool: str
    node: str
    reason: Reason


@dataclass(frozen=True)
class PoolDecision:
    """The planner's view of one pool this round, in the pool's units (cores or GPUs).

    ``need_units`` is what the demand asks for; ``target_units`` adds warm capacity and floors;
    ``active_units`` counts ``starting`` and ``ready`` instances before the plan, ``planned_units`` after
    it (adds and undrains in, drains and cancelled starts out). ``unmet_units`` is wanted capacity no
    add could cover (limits or no room). ``idle_for_s`` is how long the pool has had nothing queued or
    running (0 when active).
    """

    pool: str
    kind: Literal["sandbox", "reward"]
    need_units: int
    target_units: int
    active_units: int
    planned_units: int
    unmet_units: int
    idle_for_s: float
    reasons: tuple[Reason, ...]


PlacementMethod = Literal["milp", "milp-incumbent", "reused", "greedy", "none"]
SolStatus = Literal["optimal", "feasible", "no-solution", "infeasible", "unbounded", "error", "not-run"]


@dataclass(frozen=True)
class PlacementReport:
    """How the adds were placed on nodes.

    ``method``: ``milp`` (the solver proved its placement optimal), ``milp-incumbent`` (the solver ran
    out of time with a feasible placement that beat the alternatives), ``reused`` (the last optimal
    placement, still feasible and no worse), ``greedy`` (the fallback), ``none`` (nothing to place).
    ``solver`` is ``"HiGHS"``, ``"CBC"`` or None when no solver ran. ``status`` is pulp's
    ``LpStatus`` text; ``sol_status`` is pulp's ``sol_status`` mapped to a short name (only
    ``optimal`` means proven optimal; a time-limited CBC run may say ``status == "Optimal"`` without
    it). ``objective`` and ``greedy_objective`` are the costs of the chosen and of the greedy placement
    under the same cost function (lower is better). ``message`` says why the method was chosen.
    """

    method: PlacementMethod
    solver: str | None
    status: str
    sol_status: SolStatus
    objective: float
    greedy_objective: float
    solve_seconds: float
    time_limit_s: float
    message: str


@dataclass(frozen=True)
class ScalingPlan:
    """One planning round's decisions. Apply removals, drains and undrains, then adds."""

    at: float
    adds: tuple[InstanceAdd, ...]
    drains: tuple[InstanceDrain, ...]
    undrains: tuple[InstanceUndrain, ...]
    removals: tuple[InstanceRemoval, ...]
    pools: tuple[PoolDecision, ...]
    placement: PlacementReport
    planning_seconds: float

    def pool(self, name: str) -> PoolDecision:
        """The decision for one pool; KeyError when the snapshot had no such pool."""
        for decision in self.pools:
            if decision.pool == name:
                return decision
        raise KeyError(name)

    @property
    def is_empty(self) -> bool:
        """True when the plan changes nothing."""
        return not (self.adds or self.drains or self.undrains or self.removals)
