"""Periodic capacity planning: how many sandbox hosts and reward replicas, and where (pure).

Called once per period by the operator, the embedded mode or the simulator; it imports nothing from
them. Everything in and out is a frozen dataclass of strings, ints and floats.

Usage::

    planner = CapacityPlanner(PlannerConfig(time_limit_s=1.0))
    plan = planner.plan(ClusterSnapshot(now=t, nodes=..., sandbox_pools=..., reward_services=...,
                                        instances=..., demand=...))
    # apply: plan.removals, plan.drains, plan.undrains, then plan.adds (each with its node)

Inputs (:mod:`.snapshot`; CPU in millicores, memory in bytes, GPUs whole; times in seconds on the
caller's clock):

- :class:`NodeSnapshot` (name, cpu_millicores, memory_bytes, gpus, gpu_memory_bytes per GPU,
  labels, schedulable, reserved_* held by pods the planner does not own).
- :class:`SandboxPoolSpec` (name, host_cores, host_memory_bytes, scaling, node_selector): a CPU pool
  of equal-size sandbox hosts; its units are cores.
- :class:`RewardServiceSpec` (name, gpus_per_replica feasible set, gpu_memory_bytes model need,
  scaling, replica_cpu_millicores, replica_memory_bytes, node_selector): its units are GPUs; a replica
  of g GPUs fits a node when g x the node's per-GPU memory covers the need.
- :class:`ScalingPolicy` (max_instances, min_instances, warm_instances, max_starting,
  idle_timeout_s, scale_to_zero, cold_start_s, cold_start_budget_s, act_target_s, target_utilisation).
- :class:`InstanceSnapshot` (name, pool, node, phase, cpu_millicores, memory_bytes, gpus,
  running_actions, pinned_sessions, started_at): a sandbox host or a reward replica
  that exists; ``phase`` is one of :data:`InstancePhase` (starting, ready, draining, failed).
- :class:`PoolDemand` (pool, queued_actions, queued_units, running_actions, running_units,
  arrival_rate_per_s, mean_action_s, mean_units_per_action, act_recent_s, last_active_at).
- :class:`ClusterSnapshot` (now, nodes, sandbox_pools, reward_services, instances, demand); pool
  names are one namespace across sandbox pools and services.

Output (:mod:`.plan`): :class:`ScalingPlan` (at, adds, drains, undrains, removals, pools, placement,
planning_seconds) made of :class:`InstanceAdd` (pool, node, units, cpu_millicores, memory_bytes, gpus,
reason), :class:`InstanceDrain` / :class:`InstanceUndrain` / :class:`InstanceRemoval` (name, pool,
node, reason), one :class:`PoolDecision` per pool (need, target, active and planned units, unmet units,
idle time, reasons) and a :class:`PlacementReport` (method, solver, pulp status, sol_status,
objective, greedy objective, solve time, time limit, message). Every decision has a :class:`Reason`
(``code`` for an event's reason, ``message`` for people).

Drain protocol: the runtime owns each instance's phase and reports it. The planner emits
``ready -> draining`` (drain: the scheduler must stop placing actions and sessions on it) and
``draining -> ready`` (undrain), and removes only drained instances (draining, no running action, no
pinned session), ``starting`` ones (the scheduler places work only on ``ready`` instances) and
``failed`` ones. The scale-down victim is the one with the fewest pinned sessions, then the fewest
running actions, then the newest.

Placement: a MILP in pulp (HiGHS through highspy when present, else the bundled CBC), always with a
time limit, checked through ``sol_status`` (a time-limited CBC run still says "Optimal" in
``status``). When the solver fails or does not prove optimality in time, the plan takes the cheapest
of: the last optimal placement if it is still feasible, the solver's incumbent, and the greedy
best-fit packing (:func:`place_greedy`), all scored by :func:`placement_cost`.
"""

from arl_tangram.planner.capacity_planner import CapacityPlanner, PlannerConfig, PlannerSolver
from arl_tangram.planner.milp import MilpOutcome, make_solver, solve_placement
from arl_tangram.planner.placement import (
    InstanceShape,
    NodeCapacity,
    Placement,
    PlacementProblem,
    PlacementScore,
    PoolRequest,
    check_placement,
    place_greedy,
    placement_cost,
)
from arl_tangram.planner.plan import (
    InstanceAdd,
    InstanceDrain,
    InstanceRemoval,
    InstanceUndrain,
    PlacementMethod,
    PlacementReport,
    PoolDecision,
    Reason,
    ReasonCode,
    ScalingPlan,
    SolStatus,
)
from arl_tangram.planner.snapshot import (
    ClusterSnapshot,
    InstancePhase,
    InstanceSnapshot,
    NodeSnapshot,
    PoolDemand,
    PoolSpec,
    RewardServiceSpec,
    SandboxPoolSpec,
    ScalingPolicy,
)

__all__ = [
    "CapacityPlanner",
    "ClusterSnapshot",
    "InstanceAdd",
    "InstanceDrain",
    "InstancePhase",
    "InstanceRemoval",
    "InstanceShape",
    "InstanceSnapshot",
    "InstanceUndrain",
    "MilpOutcome",
    "NodeCapacity",
    "NodeSnapshot",
    "Placement",
    "PlacementMethod",
    "PlacementProblem",
    "PlacementReport",
    "PlacementScore",
    "PlannerConfig",
    "PlannerSolver",
    "PoolDecision",
    "PoolDemand",
    "PoolRequest",
    "PoolSpec",
    "Reason",
    "ReasonCode",
    "RewardServiceSpec",
    "SandboxPoolSpec",
    "ScalingPlan",
    "ScalingPolicy",
    "SolStatus",
    "check_placement",
    "make_solver",
    "place_greedy",
    "placement_cost",
    "solve_placement",
]
